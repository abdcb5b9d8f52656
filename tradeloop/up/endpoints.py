"""Where a run's services are reached: their ports, the Redis, the API token, and `services.json` listing them.

Every service's port is bound by the launcher before anything else exists (`bind_listeners`) and held to the end:
a taken port is a clear error up front (naming the run whose services.json lists it), `--free-ports` binds port 0
so no other process can take the port between choosing and serving, and a restarted service serves again on the
same socket (`TL_LISTEN_FD`). Redis is `TL_REDIS_URL` / `REDIS_URL` when set, else the embedded server on a Unix
socket in the run directory: no port to race for.
"""
from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

from shared.config import DEFAULT_PORTS, LOOPBACK
from tradeloop.up.runs import pid_alive

HOST = LOOPBACK  # embedded mode serves on loopback only
SERVICES_FILE = "services.json"
LISTEN_BACKLOG = 2048
"""The launcher's listen backlog for each service's socket (uvicorn's own default backlog)."""
TOKEN_FILE = "api_token"


def wanted_ports(evaluators: int, free_ports: bool, dashboard: bool) -> dict[str, int]:
    """Service name → port to bind (0: any free one). Fixed ports come from TL_<SERVICE>_PORT or the defaults
    8000–8003; evaluator replica i (from 0) takes the evaluator port + 10·i."""
    def fixed(service: str) -> int:
        var = f"TL_{service.upper()}_PORT"
        raw = os.environ.get(var)
        if raw is None:
            return DEFAULT_PORTS[service]
        if not raw.strip().isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"{var}={raw!r} is not a port number (1-65535)")
        return int(raw)

    services = ["trainer", "feedback", "evaluator"] + (["dashboard"] if dashboard else [])
    base = {s: 0 if free_ports else fixed(s) for s in services}
    wanted = {"trainer": base["trainer"], "feedback": base["feedback"]}
    for i in range(evaluators):
        wanted[f"evaluator-{i + 1}"] = 0 if free_ports else base["evaluator"] + 10 * i
    if dashboard:
        wanted["dashboard"] = base["dashboard"]
    seen: dict[int, str] = {}
    for name, port in wanted.items():
        if port and port in seen:
            var = lambda n: f"TL_{n.split('-')[0].upper()}_PORT"  # noqa: E731 — a replica's: the evaluator's
            raise ValueError(f"{seen[port]} and {name} would both listen on port {port} ({var(seen[port])}, "
                             f"{var(name)}; evaluator replica i takes TL_EVALUATOR_PORT + 10·i): give each its own")
        seen[port] = name
    return wanted


class PortTaken(ValueError):
    """A service's port cannot be bound; the message names the service, the address and what to do."""

    def __init__(self, msg: str, name: str, port: int):
        super().__init__(msg)
        self.name, self.port = name, port


def bind_listeners(host: str, wanted: dict[str, int]) -> dict[str, socket.socket]:
    """One listening TCP socket per service (port 0: a free one), for the children to serve on (`TL_LISTEN_FD`;
    a connection made before its service serves waits in the backlog). A port that cannot be bound closes what was
    bound and raises PortTaken naming the service and port. The socket listens at once: two SO_REUSEADDR sockets
    that only bind share a port on Linux, so two launchers started together would both take it and their
    services would fight over it."""
    held: dict[str, socket.socket] = {}
    for name, port in wanted.items():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            s.listen(LISTEN_BACKLOG)
        except (OSError, OverflowError) as exc:
            s.close()
            close_listeners(held)
            var = f"TL_{name.split('-')[0].upper()}_PORT"
            why = getattr(exc, "strerror", None) or str(exc)
            raise PortTaken(f"the {name} cannot listen on {host}:{port} ({why}); set {var} to a free port "
                            f"or pass --free-ports (make up ARGS=--free-ports)", name, port) from None
        held[name] = s
    return held


def close_listeners(listeners: dict[str, socket.socket]) -> None:
    for s in listeners.values():
        s.close()


def port_holder(run_dir: Path, port: int) -> str | None:
    """The run under `run_dir` whose services.json lists `port` and whose launcher is alive, in words."""
    for f in sorted(Path(run_dir).glob(f"*/{SERVICES_FILE}")):
        try:
            doc = json.loads(f.read_text())
            urls = doc.get("urls") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if any(str(u).endswith(f":{port}") for u in urls.values()) and pid_alive(doc.get("pid")):
            return f"run {doc.get('run_id', f.parent.name)} holds it ({f}, tradeloop up pid {doc.get('pid')})"
    return None


def start_redis(run_path: Path, lock_fd: int):
    """(Redis URL, the embedded server or None): `TL_REDIS_URL` / `REDIS_URL` when set (checked), else an
    embedded server on a Unix socket in `<run>/redis`, which holds the run's lock too. RedisServerError when
    neither can be used."""
    from shared.redis_server import EmbeddedRedis, check_redis_url

    url = os.environ.get("TL_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        check_redis_url(url)
        return url, None
    server = EmbeddedRedis(run_path / "redis", pass_fds=(lock_fd,), die_with_parent=True).start()
    return server.url, server


def api_token(run_path: Path) -> tuple[str, Path | None]:
    """(token, the file it was written to): `TL_API_TOKEN` when set, else a new one in `<run>/api_token` (0600)."""
    token = os.environ.get("TL_API_TOKEN")
    if token:
        return token, None
    token = secrets.token_urlsafe(24)
    path = run_path / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def write_services_file(run_path: Path, run_id: str, urls: dict[str, str], server, token_file: Path | None) -> Path:
    """`<run>/services.json`: where everything is while the run is up, for scripts (removed when it stops)."""
    path = run_path / SERVICES_FILE
    path.write_text(json.dumps({"run_id": run_id, "pid": os.getpid(), "urls": urls,
                                "redis": "embedded" if server else "external",
                                "redis_socket": str(server.socket_path) if server else None,
                                "api_token_file": str(token_file) if token_file else None}, indent=2))
    return path
