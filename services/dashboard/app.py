"""The dashboard service: a FastAPI app that serves the static page (`dashboard/` at the repository root),
`/config.json`, the live run's services through its own origin (`/api/{service}/…`, `proxy.py`) and the runs on disk
(`/runs…`, `runs.py`).

Two modes: live (`tradeloop up`, `tradeloop serve dashboard`): the run `TL_RUN_ID` through the services, and the
finished runs under `TL_RUN_DIR` from disk; runs only (`create_app(settings, runs_dir=DIR)`: `tradeloop serve
dashboard --runs DIR`, `tradeloop show RUN`): the runs under DIR, no service.

Conventions:
- The page is static (no CDN: the charts are uPlot, vendored in `dashboard/vendor/` with its licence).
- The URLs in `/config.json` come from the settings (`CommonSettings.service_url`): the ports of
  `TL_TRAINER_PORT`, ... on the host the services bind (loopback when they bind all interfaces), i.e. the
  addresses a browser on the same machine reaches — also true under docker compose, which publishes the ports
  on the host's loopback.
- `/health` is liveness, `/ready` says the page's files are there. Only GET/HEAD; no state, no token.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, JSONResponse

from shared.config import DashboardSettings

STATIC_DIR = Path(__file__).resolve().parents[2] / "dashboard"
PAGE_FILES = ("index.html", "app.js", "charts.js", "style.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
DEFAULT_POLL_MS = 3000


def page_config(settings: DashboardSettings, poll_ms: int = DEFAULT_POLL_MS) -> dict:
    """The `/config.json` document: base URL of each service, poll interval, run id."""
    return {"trainer": settings.service_url("trainer"), "evaluator": settings.service_url("evaluator"),
            "feedback": settings.service_url("feedback"), "poll_ms": int(poll_ms), "run_id": settings.run_id}


def create_app(settings: DashboardSettings, *, static_dir: Path | None = None,
               poll_ms: int = DEFAULT_POLL_MS, runs_dir: Path | None = None) -> FastAPI:
    """The dashboard app: `/` (the page), its files, `/config.json`, `/health`, `/ready`, `/runs…` (the runs under
    `runs_dir`, else under `settings.run_dir`) and, without `runs_dir`, the live run's services at `/api/…`."""
    from services.dashboard import proxy, runs

    root = Path(static_dir) if static_dir is not None else STATIC_DIR
    app = FastAPI(title="tradeloop dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    config = page_config(settings, poll_ms)
    allowed = {name: (root / name) for name in PAGE_FILES}
    live = runs_dir is None
    app.include_router(runs.create_router(runs.RunCatalog(runs_dir if not live else settings.run_dir,
                                                          live=settings.run_id if live else None)))
    if live:
        app.include_router(proxy.create_router(settings))

    @app.get("/health")
    def health() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok", "service": "dashboard"}

    @app.get("/ready")
    def ready() -> JSONResponse:
        """Ready when every page file exists (503 naming the missing ones otherwise)."""
        missing = [str(p) for p in allowed.values() if not p.is_file()]
        if missing:
            return JSONResponse({"status": "not ready", "missing": missing}, status_code=503)
        return JSONResponse({"status": "ready", "service": "dashboard"})

    @app.get("/config.json")
    def config_json() -> JSONResponse:
        """Where the page finds the three services."""
        return JSONResponse(config, headers={"Cache-Control": "no-store"})

    def _file(name: str) -> FileResponse:
        path = allowed.get(name)
        if path is None or not path.is_file():
            raise HTTPException(404, f"no such dashboard file: {name}")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})

    @app.get("/")
    def index() -> FileResponse:
        """The page."""
        return _file("index.html")

    @app.get("/{name:path}")
    def static_file(name: str) -> FileResponse:
        """One of the page's files (a fixed list: nothing else on disk is reachable)."""
        return _file(name)

    return app
