"""The services' REST faces over real HTTP: real uvicorn servers on free ports, a real Redis.

The evaluator and feedback apps run their consumers against the session's Redis (nothing is published to
them except what a test writes); reports and bundles are put into the store directly, so the REST answers
can be compared to what Redis holds. The trainer app is checked for its token guard, body limit and CORS
without training (its loop waits for data it is never given: TL_DATA points to a missing file → the loop
fails and says so on /status, which is itself checked).
"""
from __future__ import annotations

import asyncio
import threading
import uuid

import httpx
import numpy as np
import pytest
import uvicorn

from polling import poll_until
from shared.bus import Bus
from shared.redis_server import free_port
from shared.report import TradeTable, pack

pytestmark = pytest.mark.redis
TOKEN = "s3cret-token-for-tests"
ORIGIN = "http://127.0.0.1:8999"


class Server:
    """A uvicorn server in a thread; `stop()` asks it to exit and waits."""

    def __init__(self, app, port: int):
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> "Server":
        self.thread.start()
        poll_until(lambda: self.server.started, "uvicorn to start", alive=self.thread.is_alive)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def _env(monkeypatch, redis_url: str, run_id: str, tmp_path) -> None:
    for k, v in {"TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_API_TOKEN": TOKEN, "TL_EMBEDDED": "true",
                 "TL_DASHBOARD_ORIGIN": ORIGIN, "TL_MAX_BODY_BYTES": "2048", "TL_RUN_DIR": str(tmp_path),
                 "TL_DATA": str(tmp_path / "missing.csv"), "TL_CONSUMER_NAME": "ev-test"}.items():
        monkeypatch.setenv(k, v)


def _store_docs(redis_url: str, run_id: str, docs: dict[tuple[str, int], dict]) -> None:
    async def go():
        async with Bus(redis_url, run_id) as bus:
            for (kind, epoch), doc in docs.items():
                await bus.store.put_json(kind, epoch, doc)
    asyncio.run(go())


@pytest.fixture(scope="module")
def run_id():
    """One run id for the module's servers (they are shared by its tests)."""
    return f"api{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def redis_url(redis_server):
    """The session's Redis; this module's keys live under its own run id."""
    return redis_server


@pytest.fixture(scope="module")
def services(redis_url, run_id, tmp_path_factory):
    from services.evaluator.app import create_app as ev_app
    from services.feedback.app import create_app as fb_app
    from services.trainer.app import create_app as tr_app

    with pytest.MonkeyPatch.context() as mp:
        _env(mp, redis_url, run_id, tmp_path_factory.mktemp("api"))
        servers = {name: Server(f(), free_port()).start()
                   for name, f in (("trainer", tr_app), ("evaluator", ev_app), ("feedback", fb_app))}
    try:
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def test_common_endpoints(services, run_id):
    with httpx.Client() as c:
        for name, s in services.items():
            assert c.get(f"{s.url}/health").json() == {"status": "ok", "service": name}
            st = c.get(f"{s.url}/status").json()
            assert st["service"] == name and st["run_id"] == run_id and st["pid"] > 0 and st["uptime_s"] >= 0
            assert {"epoch", "stream_lag", "last_error"} <= set(st)
            m = c.get(f"{s.url}/metrics")
            assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
            assert f'tradeloop_{name}_up{{run_id="{run_id}"}} 1.0' in m.text
            assert c.get(f"{s.url}/openapi.json").json()["info"]["title"] == f"tradeloop {name}"
            assert c.get(f"{s.url}/docs").status_code == 200
        for name in ("evaluator", "feedback"):  # consumers reach Redis → ready, with a measured lag
            url = services[name].url
            poll_until(lambda: c.get(f"{url}/ready").status_code == 200, f"{name} ready")
            poll_until(lambda: c.get(f"{url}/status").json()["stream_lag"] == 0, f"{name} lag")
        # the trainer cannot load its (missing) dataset: not ready, and /status says why
        tr = services["trainer"].url
        st = poll_until(lambda: (s := c.get(f"{tr}/status").json())["last_error"] and s, "trainer error")
        assert "missing.csv" in st["last_error"] and st["phase"] == "failed"
        assert c.get(f"{tr}/ready").status_code == 503


TRADE = dict(entry_t=11, exit_t=12, decision_t=10, side=1, size=1.0, entry_price=100.0, exit_price=101.0,
             net_return=0.01, bars=2, exit_reason="target", regime=3, direction_idx=2, size_idx=0, exit_idx=1,
             q_pred=0.5, q_quantiles=[-0.5, -0.25, 0.0, 0.25, 0.5], ensemble_std=0.25, q_dir=[-0.5, 0.0, 0.5],
             direction_error=False, size_error=False, exit_error=False, best_exit_return=0.02,
             hindsight_returns=None, hindsight_dir=None)


def test_reports_and_signals_match_redis(services, redis_url, run_id):
    rows_in = [TRADE, {**TRADE, "entry_t": 14, "exit_t": 16, "decision_t": 13, "side": -1, "exit_reason": "stop",
                       "net_return": -0.02, "direction_idx": 0, "direction_error": True}]
    report = {"epoch": 2, "checkpoint_sha256": "ab" * 32, "n_trials": 2, "val_oos_gap": 0.5,
              "val": {"metrics": {"per_trade_sharpe": 0.2, "dsr": 0.7, "n_trades": 12}, "window": [10, 20],
                      "trades": TradeTable.from_records(rows_in).to_json_dict(), "equity": pack(np.array([1.0, 1.01]))},
              "oos": {"metrics": {"per_trade_sharpe": 0.1}, "window": [30, 40],
                      "trades": TradeTable.empty().to_json_dict(), "equity": pack(np.array([1.0]))}}
    bundle = {"epoch": 2, "for_epoch": 3, "report_checkpoint_sha256": "ab" * 32, "enabled": True, "rollback": False,
              "signals": {"E2": {"knob": "epsilon", "value": 0.2, "reason": "r"},
                          "E6": {"knob": "priority_boost", "value": [[5, 2.0]], "reason": "r"}},
              "knobs": {"epsilon": 0.2, "gamma": 0.96, "priority_boost": [[5, 2.0]]}}
    _store_docs(redis_url, run_id, {("report", 2): report, ("bundle", 2): bundle})
    ev, fb = services["evaluator"].url, services["feedback"].url
    with httpx.Client() as c:
        assert c.get(f"{ev}/reports/2").json() == report
        rows = c.get(f"{ev}/reports").json()
        assert [(r["epoch"], r["val_per_trade_sharpe"], r["oos_per_trade_sharpe"], r["val_dsr"]) for r in rows] == \
            [(2, 0.2, 0.1, 0.7)]
        assert rows[0]["metrics"] == {"val": report["val"]["metrics"], "oos": report["oos"]["metrics"]}
        assert c.get(f"{ev}/reports").json() == rows          # the second poll: the cached row
        got = c.get(f"{ev}/reports/2/trades").json()
        # packed in Redis, an object a trade here
        assert got["trades"] == rows_in and (got["n_trades"], got["listed"]) == (2, True)
        assert c.get(f"{ev}/reports/2/trades", params={"offset": 1, "limit": 5}).json()["trades"] == rows_in[1:]
        eq = c.get(f"{ev}/reports/2/equity").json()
        assert eq["equity"] == [1.0, 1.01] and eq["x"] == [0, 1] and eq["n_bars"] == 2
        assert c.get(f"{ev}/reports/2/equity", params={"split": "oos"}).json()["equity"] == [1.0]
        assert c.get(f"{ev}/reports/3").status_code == 404
        assert c.get(f"{ev}/reports/2/trades", params={"split": "insample"}).status_code == 404
        assert c.get(f"{fb}/signals/2").json() == bundle
        (row,) = c.get(f"{fb}/signals").json()
        assert row["for_epoch"] == 3 and row["bundle_id"] == f"{run_id}-bundle-e0002-{'ab' * 6}"
        assert row["signals"]["E6"]["count"] == 1 and "priority_boost" not in row["knobs"]
        assert (row["rollback"], row["rollback_to_epoch"], row["off"]) == (False, None, [])
        assert c.get(f"{fb}/signals/9").status_code == 404


@pytest.mark.parametrize("url_suffix,service", [
    ("/reports/-1", "evaluator"), ("/reports/abc", "evaluator"), ("/reports/1/trades?split=train", "evaluator"),
    ("/reports/1/equity?split=", "evaluator"), ("/signals/x", "feedback"), ("/signals/-3", "feedback")])
def test_invalid_parameters_are_422(services, url_suffix, service):
    r = httpx.get(f"{services[service].url}{url_suffix}")
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"][0] in ("path", "query")


def test_control_needs_the_bearer_token(services):
    tr = services["trainer"].url
    with httpx.Client() as c:
        for action in ("pause", "resume", "stop"):
            r = c.post(f"{tr}/control/{action}")
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert c.post(f"{tr}/control/{action}", headers={"Authorization": "Basic " + TOKEN}).status_code == 401
            assert c.post(f"{tr}/control/{action}", headers={"Authorization": "Bearer wrong"}).status_code == 403
            assert c.post(f"{tr}/control/{action}",
                          headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 403
        ok = c.post(f"{tr}/control/pause", headers={"Authorization": f"Bearer {TOKEN}"})
        assert ok.status_code == 200 and ok.json()["paused"] is True
        assert c.get(f"{tr}/status").json()["paused"] is True
        c.post(f"{tr}/control/resume", headers={"Authorization": f"Bearer {TOKEN}"})
        assert c.get(f"{tr}/status").json()["paused"] is False
        assert c.get(f"{tr}/control/pause").status_code == 405  # mutating endpoints are POST only


def test_oversized_bodies_are_refused(services):
    tr = services["trainer"].url
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client() as c:
        r = c.post(f"{tr}/control/pause", headers=auth, content=b"x" * 4096)
        assert r.status_code == 413
        chunks = (b"y" * 1024 for _ in range(4))  # no Content-Length: streamed (chunked) past the limit
        assert c.post(f"{tr}/control/pause", headers=auth, content=chunks).status_code == 413
        assert c.post(f"{tr}/control/pause", headers=auth, content=b"{}").status_code == 200


def test_cors_allows_only_the_dashboard_origin(services):
    ev, tr = services["evaluator"].url, services["trainer"].url
    with httpx.Client() as c:
        ok = c.get(f"{ev}/reports", headers={"Origin": ORIGIN})
        assert ok.headers.get("access-control-allow-origin") == ORIGIN
        other = c.get(f"{ev}/reports", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        pre = c.options(f"{tr}/control/pause", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        bad = c.options(f"{tr}/control/pause", headers={"Origin": "http://evil.example",
                                                        "Access-Control-Request-Method": "POST"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers


def test_equity_decimation_keeps_the_ends_and_every_bucket_extreme():
    from services.evaluator.app import decimate

    rng = np.random.default_rng(0)
    curve = np.cumprod(1 + rng.normal(0, 0.01, 100_000))
    idx = decimate(curve, 400)
    assert len(idx) <= 400 and idx[0] == 0 and idx[-1] == len(curve) - 1 and (np.diff(idx) > 0).all()
    assert int(np.argmin(curve)) in idx and int(np.argmax(curve)) in idx      # the drawdown's trough survives
    assert decimate(curve[:300], 400).tolist() == list(range(300))           # short curves are kept whole


def test_a_redis_that_goes_away_is_a_503_and_not_ready_not_a_500(monkeypatch, tmp_path):
    """The evaluator's and feedback's routes that read Redis answer a JSON 503 naming it, and /ready turns 503 within
    the workers' next probes, when their Redis stops answering (its own server here, stopped mid-test)."""
    from services.evaluator.app import create_app as ev_app
    from services.feedback.app import create_app as fb_app
    from shared.redis_server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    _env(monkeypatch, server.url, "gone", tmp_path)
    monkeypatch.setenv("TL_REDIS_SOCKET_TIMEOUT_S", "2")
    apps = {"evaluator": (Server(ev_app(), free_port()), "/reports", "/reports/1"),
            "feedback": (Server(fb_app(), free_port()), "/signals", "/signals/1")}
    try:
        with httpx.Client(timeout=30) as c:
            for name, (s, rows, one) in apps.items():
                s.start()
                poll_until(lambda: c.get(f"{s.url}/ready").status_code == 200, f"{name} ready")
                assert c.get(f"{s.url}{rows}").json() == [] and c.get(f"{s.url}{one}").status_code == 404
            server.stop()
            for name, (s, rows, one) in apps.items():
                for path in (rows, one):
                    r = c.get(f"{s.url}{path}")
                    assert r.status_code == 503 and r.json()["detail"].startswith("Redis unreachable"), (path, r.text)
                    assert 503 in [int(k) for k in c.get(f"{s.url}/openapi.json").json()["paths"][
                        path.replace("/1", "/{epoch}")]["get"]["responses"]]
                poll_until(lambda: c.get(f"{s.url}/ready").status_code == 503, f"{name} not ready without Redis",
                           timeout_s=30)
                assert c.get(f"{s.url}/status").json()["ready"] is False
    finally:
        for s, _, _ in apps.values():
            if s.thread.is_alive():
                s.stop()
        server.stop()
