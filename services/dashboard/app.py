"""The dashboard service: a FastAPI app that serves the static page (`dashboard/` at the repository root),
`/config.json`, and a read-only proxy to the trainer, evaluator and feedback services.

Conventions:
- The page is static (no CDN: the charts are uPlot, vendored in `dashboard/vendor/` with its licence) and talks only to its own origin: GET
  `/api/<service>/<path>` is forwarded to that service (`DashboardSettings.upstream`: `TL_TRAINER_URL`, ... or
  the service's port on `TL_HOST`), the response streamed back as it arrives (a report is tens of MB). So the
  page works from any machine that reaches the dashboard, with any published port, and needs no CORS: under
  docker compose the services are reached by their names inside the compose network.
- `/config.json` gives the page the base path of each service (relative to the page, so the dashboard also works
  behind a reverse proxy under a path prefix), the poll interval and the run id.
- A service that does not answer gives 502 (naming it and its URL), so the page marks it down.
- Runs on disk: `/runs…` (`runs.py`) serves the finished runs under `TL_RUN_DIR` (live mode) or under DIR
  (`create_app(settings, runs_dir=DIR)`: `tradeloop serve dashboard --runs DIR`, `tradeloop show RUN`, no service
  and no proxy) in the services' own response shapes.
- `/health` is liveness, `/ready` says the page's files are there. Only GET; no state, no token: the proxy
  forwards no mutating request. `/openapi.json` and `/docs` describe the routes (`shared.api_models`).
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from shared.api_models import DashboardReady, Health, PageConfig, errors
from shared.config import DashboardSettings

STATIC_DIR = Path(__file__).resolve().parents[2] / "dashboard"
PAGE_FILES = ("index.html", "app.js", "charts.js", "style.css", "vendor/uPlot.iife.min.js", "vendor/uPlot.min.css")
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
DEFAULT_POLL_MS = 3000
PROXIED = ("trainer", "evaluator", "feedback")
PROXY_TIMEOUT = httpx.Timeout(30.0, connect=3.0)   # read: a report's first bytes can take a while to build
PASSED_HEADERS = ("content-type", "content-length", "cache-control", "etag", "last-modified")


def page_config(settings: DashboardSettings, poll_ms: int = DEFAULT_POLL_MS) -> dict:
    """The `/config.json` document: base path of each service (the page's own proxy), poll interval, run id."""
    return PageConfig(**{name: f"api/{name}" for name in PROXIED}, poll_ms=int(poll_ms),
                      run_id=settings.run_id).model_dump()


def create_app(settings: DashboardSettings, *, static_dir: Path | None = None,
               poll_ms: int = DEFAULT_POLL_MS, runs_dir: Path | None = None) -> FastAPI:
    """The dashboard app: `/` (the page), its files, `/config.json`, `/health`, `/ready`, `/runs…` (the runs under
    `runs_dir`, else under `settings.run_dir`) and, without `runs_dir`, the live run's services at `/api/…`."""
    from services.dashboard import runs

    root = Path(static_dir) if static_dir is not None else STATIC_DIR
    live = runs_dir is None
    upstreams = {name: settings.upstream(name) for name in PROXIED}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # one pool for all proxied requests; a connection error is retried once on a new connection (a scaled
        # service's replica that went away: the name resolves to the others)
        async with httpx.AsyncClient(timeout=PROXY_TIMEOUT, transport=httpx.AsyncHTTPTransport(retries=1),
                                     headers={"accept-encoding": "identity"}) as client:
            app.state.client = client
            yield

    app = FastAPI(title="tradeloop dashboard", description="The page, its run browser and a read-only proxy to the "
                  "services.", version="1", redoc_url=None, lifespan=lifespan)
    config = page_config(settings, poll_ms)
    allowed = {name: (root / name) for name in PAGE_FILES}
    app.include_router(runs.create_router(runs.RunCatalog(runs_dir if not live else settings.run_dir,
                                                          live=settings.run_id if live else None)))

    @app.get("/health", tags=["ops"])
    def health() -> Health:
        """Liveness: the process answers."""
        return Health(status="ok", service="dashboard")

    @app.get("/ready", tags=["ops"], response_model=DashboardReady,
             responses={503: {"model": DashboardReady, "description": "page files missing (named)"}})
    def ready() -> JSONResponse:
        """Ready when every page file exists (503 naming the missing ones otherwise)."""
        missing = [str(p) for p in allowed.values() if not p.is_file()]
        doc = DashboardReady(status="not ready" if missing else "ready", missing=missing).model_dump()
        return JSONResponse(doc, status_code=503 if missing else 200)

    @app.get("/favicon.ico", include_in_schema=False, status_code=204)
    def favicon() -> Response:
        """No icon: an empty answer, so that a browser's request for one is no 404 in its console."""
        return Response(status_code=204)

    @app.get("/config.json", tags=["page"], response_model=PageConfig)
    def config_json() -> JSONResponse:
        """Where the page finds the three services."""
        return JSONResponse(config, headers={"Cache-Control": "no-store"})

    @app.get("/api/{service}/{path:path}", tags=["proxy"], response_class=StreamingResponse,
             responses={200: {"description": "the service's answer: its status, headers and body as it sends them",
                              "content": {"*/*": {}}},
                        "default": {"description": "the service's answer (any status it gives)",
                                    "content": {"*/*": {}}},
                        **errors(404, 502)})
    async def proxy(service: str, path: str, request: Request) -> StreamingResponse:
        """GET `/api/<service>/<path>?<query>` forwarded to the service, the body streamed through."""
        base = upstreams.get(service) if live else None
        if base is None:
            raise HTTPException(404, f"no service {service!r} behind the dashboard (one of {', '.join(PROXIED)})"
                                if live else "no live service behind this dashboard: it shows runs on disk "
                                "(`/runs`)")
        client: httpx.AsyncClient = request.app.state.client
        url = httpx.URL(f"{base}/{path}", query=request.url.query.encode())
        upstream_request = client.build_request("GET", url,
                                                headers={"accept": request.headers.get("accept", "*/*")})
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"detail": f"{service} does not answer at {base}: {type(exc).__name__}: {exc}"},
                                status_code=502, headers={"Cache-Control": "no-store"})
        headers = {k: upstream.headers[k] for k in PASSED_HEADERS if k in upstream.headers}
        return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers,
                                 background=BackgroundTask(upstream.aclose))

    def _file(name: str) -> FileResponse:
        path = allowed.get(name)
        if path is None or not path.is_file():
            raise HTTPException(404, f"no such dashboard file: {name}")
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix], headers={"Cache-Control": "no-cache"})

    @app.get("/", tags=["page"], response_class=HTMLResponse)
    def index() -> FileResponse:
        """The page."""
        return _file("index.html")

    @app.get("/{name:path}", tags=["page"], response_class=FileResponse,
             responses={200: {"description": "the file", "content": {t.split(";")[0]: {} for t in MEDIA_TYPES.values()}},
                        **errors(404)})
    def static_file(name: str) -> FileResponse:
        """One of the page's files (a fixed list: nothing else on disk is reachable)."""
        return _file(name)

    return app
