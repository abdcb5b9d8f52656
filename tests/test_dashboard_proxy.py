"""The dashboard's proxy (/api/<service>/...) over real HTTP: a uvicorn server stands for a service.

- a GET is forwarded with its path and query; status, content type and body come back as the service sent them;
- a body larger than any buffer (8 MB, sent in chunks) streams through byte for byte;
- a POST (a mutating call) is refused, never forwarded: the page only reads;
- a service that does not answer gives 502 naming it and the URL tried; an unknown service 404;
- without TL_<SERVICE>_URL the proxy reaches the service on TL_HOST and its port (the embedded `tradeloop up`).
"""
from __future__ import annotations

import socket
import threading
import warnings

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from polling import poll_until
from shared.config import DashboardSettings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from fastapi.testclient import TestClient

CHUNK = bytes(range(256)) * 4096          # 1 MiB
CHUNKS = 8


def _service_app() -> FastAPI:
    app = FastAPI()

    @app.get("/status")
    def status(request: Request) -> dict:
        return {"service": "stand-in", "query": dict(request.query_params)}

    @app.get("/big")
    def big() -> StreamingResponse:
        return StreamingResponse((CHUNK for _ in range(CHUNKS)), media_type="application/octet-stream")

    @app.get("/ready")
    def ready() -> JSONResponse:
        return JSONResponse({"ready": False}, status_code=503)

    @app.post("/control/stop")
    def stop() -> dict:
        return {"stopped": True}

    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def service():
    """A uvicorn server on a free loopback port, in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_service_app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    poll_until(lambda: server.started, "the stand-in service started", timeout_s=20)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def test_proxy_forwards_reads_streams_and_refuses_writes(service):
    from services.dashboard.app import create_app

    dead = f"http://127.0.0.1:{_free_port()}"        # nothing listens there
    settings = DashboardSettings(feedback_url=service + "/", trainer_url=dead)
    with TestClient(create_app(settings)) as client:
        r = client.get("/api/feedback/status?epoch=3&x=a%2Fb")
        assert r.status_code == 200 and r.json() == {"service": "stand-in", "query": {"epoch": "3", "x": "a/b"}}
        assert r.headers["content-type"] == "application/json"

        with client.stream("GET", "/api/feedback/big") as big:
            assert big.status_code == 200 and big.headers["content-type"] == "application/octet-stream"
            body = b"".join(big.iter_bytes())
        assert body == CHUNK * CHUNKS

        assert client.get("/api/feedback/ready").status_code == 503          # the service's answer, as it was
        assert client.post("/api/feedback/control/stop").status_code == 405  # never forwarded

        down = client.get("/api/trainer/status")
        assert down.status_code == 502 and "trainer" in down.json()["detail"] and dead in down.json()["detail"]
        unknown = client.get("/api/redis/info")
        assert unknown.status_code == 404 and "trainer, evaluator, feedback" in unknown.json()["detail"]


def test_proxy_defaults_to_the_services_ports_on_loopback(service):
    """Embedded mode: no URLs set, the ports the launcher gave the services (TL_<SERVICE>_PORT)."""
    from services.dashboard.app import create_app

    port = int(service.rsplit(":", 1)[1])
    settings = DashboardSettings(evaluator_port=port)
    assert settings.upstream("evaluator") == service
    with TestClient(create_app(settings)) as client:
        assert client.get("/api/evaluator/status").json()["service"] == "stand-in"


@pytest.mark.parametrize("bad", ["trainer:8001", "http://trainer:8001/api", "ftp://trainer", "http:// x"])
def test_upstream_url_is_checked(bad, monkeypatch):
    from shared.config import ConfigError, load_settings

    monkeypatch.setenv("TL_TRAINER_URL", bad)
    with pytest.raises(ConfigError, match="TL_TRAINER_URL"):
        load_settings(DashboardSettings)
