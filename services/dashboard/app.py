"""The dashboard service: a FastAPI app that serves the static page (`dashboard/` at the repository root) and
`/config.json`, which tells the page where the trainer, evaluator and feedback services answer.

Conventions:
- The page is static (no CDN: the chart code is `dashboard/chart.js`); it calls the three services from the
  browser, which is why those services allow the dashboard's origin (`TL_DASHBOARD_ORIGIN`) through CORS.
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
PAGE_FILES = ("index.html", "app.js", "chart.js", "style.css")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
DEFAULT_POLL_MS = 3000


def page_config(settings: DashboardSettings, poll_ms: int = DEFAULT_POLL_MS) -> dict:
    """The `/config.json` document: base URL of each service, poll interval, run id."""
    return {"trainer": settings.service_url("trainer"), "evaluator": settings.service_url("evaluator"),
            "feedback": settings.service_url("feedback"), "poll_ms": int(poll_ms), "run_id": settings.run_id}


def create_app(settings: DashboardSettings, *, static_dir: Path | None = None,
               poll_ms: int = DEFAULT_POLL_MS) -> FastAPI:
    """The dashboard app: `/` (the page), its files, `/config.json`, `/health`, `/ready`."""
    root = Path(static_dir) if static_dir is not None else STATIC_DIR
    app = FastAPI(title="tradeloop dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    config = page_config(settings, poll_ms)
    allowed = {name: (root / name) for name in PAGE_FILES}

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

    @app.get("/{name}")
    def static_file(name: str) -> FileResponse:
        """One of the page's files (a fixed list: nothing else on disk is reachable)."""
        return _file(name)

    return app
