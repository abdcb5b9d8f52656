"""Common FastAPI pieces of the three services: app factory, token check, body limit, CORS, metrics.

`create_service_app(name, settings, state, lifespan=...)` returns a FastAPI app with:
  GET /health   200 {"status": "ok"} while the process serves HTTP (liveness)
  GET /ready    200 when `state.ready` (Redis reached, worker started) and Redis answers the worker's probes,
                else 503 (readiness)
  GET /status   JSON: service, pid, uptime_s, run_id, epoch, stream_lag, last_error, + `state.extra`
  GET /metrics  Prometheus text format 0.0.4 (prometheus-client), read from `state` on each scrape
  GET /docs     OpenAPI (FastAPI's own), with every route's response models (`shared.api_models`)
and these guards:
  - `require_token(app)`: `Authorization: Bearer <token>` for mutating endpoints; missing → 401 (with
    `WWW-Authenticate: Bearer`), wrong → 403; compared with `hmac.compare_digest` (constant time). OpenAPI
    declares it as an HTTP bearer security scheme on those routes.
  - `BodyLimitMiddleware`: a body over `settings.max_body_bytes` → 413, whether announced by
    Content-Length or streamed (chunked) — the body is never read past the limit.
  - CORS: only `settings.dashboard_origin`, GET/POST, the Authorization and Content-Type headers.
Invalid path/query parameters get FastAPI's 422 with the field named.

`ServiceState` is the mutable record a worker updates (epoch, lag, last error, counters); the app reads
it, so endpoints stay three lines. Web stack only: the ML core never imports this module.
"""
from __future__ import annotations

import asyncio
import hmac
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.api_models import METRICS_RESPONSES, Health, PrometheusResponse, Ready, ServiceStatus, errors
from shared.config import CommonSettings

if TYPE_CHECKING:
    from shared.bus import Bus, Consumer


@dataclass
class ServiceState:
    """What a service's worker reports: read by /ready, /status and /metrics."""

    service: str
    run_id: str
    started_at: float = field(default_factory=time.time)
    ready: bool = False
    """The worker has started (Redis reached, its groups made)."""
    redis_answers: bool = True
    """The last of the worker's probes of Redis (its stream lag, each second) was answered: /ready says 503 while
    it is not."""
    epoch: int = 0
    """Last epoch this service finished (trainer: trained; evaluator: evaluated; feedback: bundled)."""
    stream_lag: int | None = None
    """Entries of this service's input stream not yet handled (None: not measured yet)."""
    last_error: str = ""
    last_error_at: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    """Monotonic counts, exported as Prometheus counters `tradeloop_<service>_<name>_total`."""
    gauges: dict[str, float] = field(default_factory=dict)
    """Current values, exported as Prometheus gauges `tradeloop_<service>_<name>`."""
    labeled: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)
    """Gauges with one label: name → (label, {label value: value}), exported as
    `tradeloop_<service>_<name>{run_id=…, <label>=…}` (e.g. `knob{knob="epsilon"}`, `phase{phase="training"}`)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Service-specific JSON fields of /status."""

    def error(self, message: str) -> None:
        """Record the latest error (shown in /status)."""
        self.last_error, self.last_error_at = message[:2000], time.time()

    def count(self, name: str, n: float = 1) -> None:
        """Add `n` to counter `name`."""
        self.counters[name] = self.counters.get(name, 0) + n

    def set_labeled(self, name: str, label: str, values: dict[str, float]) -> None:
        """Replace labelled gauge `name` (one assignment: a scrape on another thread sees the old or the new set)."""
        self.labeled[name] = (label, {str(k): float(v) for k, v in values.items()})

    def status(self) -> dict[str, Any]:
        """The /status document."""
        return {"service": self.service, "pid": os.getpid(), "uptime_s": round(time.time() - self.started_at, 3),
                "run_id": self.run_id, "ready": self.ready and self.redis_answers, "epoch": self.epoch,
                "stream_lag": self.stream_lag,
                "last_error": self.last_error or None, "last_error_at": self.last_error_at,
                "counters": dict(self.counters), **self.extra}


class _StateCollector:
    """Prometheus collector reading a ServiceState at scrape time (no global registry)."""

    def __init__(self, state: ServiceState):
        self.state = state

    def collect(self):
        s, p = self.state, f"tradeloop_{self.state.service}"
        base = [("up", 1.0, "1 while the process serves HTTP"),
                ("ready", float(s.ready), "1 when the worker is ready"),
                ("uptime_seconds", time.time() - s.started_at, "seconds since the process started"),
                ("epoch", float(s.epoch), "last epoch this service finished"),
                ("stream_lag", float(s.stream_lag if s.stream_lag is not None else -1),
                 "input stream entries not yet handled (-1: unknown)")]
        for name, value, doc in base:
            g = GaugeMetricFamily(f"{p}_{name}", doc, labels=["run_id"])
            g.add_metric([s.run_id], value)
            yield g
        for name, value in sorted(s.gauges.items()):
            g = GaugeMetricFamily(f"{p}_{name}", name, labels=["run_id"])
            g.add_metric([s.run_id], float(value))
            yield g
        for name, (label, values) in sorted(s.labeled.items()):
            g = GaugeMetricFamily(f"{p}_{name}", name, labels=["run_id", label])
            for k, v in sorted(values.items()):
                g.add_metric([s.run_id, k], v)
            yield g
        for name, value in sorted(s.counters.items()):
            c = CounterMetricFamily(f"{p}_{name}", name, labels=["run_id"])
            c.add_metric([s.run_id], float(value))
            yield c


class BodyLimitMiddleware:
    """Pure ASGI middleware: refuse request bodies over `max_bytes` with 413 (declared or streamed)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = JSONResponse({"detail": f"request body larger than {self.max_bytes} bytes"}, status_code=413)
        try:
            if declared is not None and int(declared) > self.max_bytes:
                return await too_big(scope, receive, send)
        except ValueError:
            return await JSONResponse({"detail": "invalid Content-Length"}, status_code=400)(scope, receive, send)
        if declared is not None or scope.get("method") not in ("POST", "PUT", "PATCH"):
            # declared within the limit (uvicorn stops at Content-Length), or a method without a body
            return await self.app(scope, receive, send)
        # streamed (chunked) body of unknown length: read it up to the limit before the app sees it
        buffered, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                buffered.append(message)
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await too_big(scope, receive, send)
            buffered.append(message)
            if not message.get("more_body", False):
                break

        async def replay():
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)


_BEARER = HTTPBearer(auto_error=False, description="TL_API_TOKEN")
"""Declares the bearer scheme in OpenAPI; `token_checker` reads the header itself."""


def token_checker(settings: CommonSettings) -> Callable[..., None]:
    """A dependency that accepts only `Authorization: Bearer <settings.api_token>` (401 missing, 403 wrong)."""
    expected = settings.api_token.get_secret_value().encode()

    def check(request: Request, _scheme: HTTPAuthorizationCredentials | None = Depends(_BEARER)) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header or scheme.lower() != "bearer" or not token.strip():
            raise HTTPException(401, "missing bearer token (Authorization: Bearer <TL_API_TOKEN>)",
                                headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), expected):
            raise HTTPException(403, "invalid token")

    return check


REDIS_503 = errors(503)
"""What a route that reads Redis may answer while Redis is unreachable (`create_service_app`'s handler)."""


def create_service_app(name: str, settings: CommonSettings, state: ServiceState, *,
                       lifespan: Callable[[FastAPI], Any] | None = None, description: str = "",
                       status_model: type[ServiceStatus] = ServiceStatus) -> FastAPI:
    """A FastAPI app with /health, /ready, /status (declared as `status_model`), /metrics, the body limit and
    dashboard-only CORS.

    `lifespan(app)` is an async context manager factory that starts/stops the service's worker.
    The token dependency is at `app.state.require_token` (use `Depends(app.state.require_token)`).
    """

    @asynccontextmanager
    async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
        if lifespan is None:
            state.ready = True
            yield
        else:
            async with lifespan(app):
                yield

    app = FastAPI(title=f"tradeloop {name}", description=description or f"The tradeloop {name} service.",
                  version="1", lifespan=_lifespan)
    app.state.settings, app.state.service = settings, state
    app.state.require_token = token_checker(settings)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StateCollector(state))
    app.add_middleware(CORSMiddleware, allow_origins=[settings.dashboard_origin], allow_credentials=False,
                       allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    from redis.exceptions import ConnectionError as RedisConnectionError, TimeoutError as RedisTimeoutError

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        """Redis restarting or unreachable: a clear 503 (declared as `REDIS_503` on the routes that read it), not a
        500 with a traceback."""
        return JSONResponse({"detail": f"Redis unreachable: {exc}"}, status_code=503)

    @app.get("/health", tags=["ops"], summary="Liveness: the process serves HTTP")
    def health() -> Health:
        return Health(status="ok", service=name)

    @app.get("/ready", tags=["ops"], summary="Readiness: Redis reached and the worker running", response_model=Ready,
             responses={503: {"model": Ready, "description": "not ready (yet): Redis not reached or the worker "
                                                            "stopped (/status says why)"}})
    def ready() -> JSONResponse:
        ok = state.ready and state.redis_answers
        return JSONResponse(Ready(ready=ok, service=name).model_dump(), status_code=200 if ok else 503)

    @app.get("/status", tags=["ops"], summary="pid, uptime, run id, epoch, stream lag, last error",
             response_model=status_model)
    def status() -> dict:
        return state.status()

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics", response_class=PrometheusResponse,
             responses=METRICS_RESPONSES)
    def metrics() -> PrometheusResponse:
        return PrometheusResponse(generate_latest(registry))

    return app


def require_token(app: FastAPI):
    """`Depends(...)` object for the app's bearer-token check (for mutating endpoints)."""
    return Depends(app.state.require_token)


TOKEN_ERRORS = errors(401, 403, 413)
"""`responses=` of a route behind `require_token` (a POST: its body is also limited)."""


def knob_gauges(knobs: dict[str, Any] | None) -> dict[str, float]:
    """The knobs of a `Knobs.to_dict()` as one gauge value each (label `knob`): the scalars by name, `gate_threshold`
    +Inf for "no gate", `lr_scale_<branch>`, `regime_weight_<r>` and `regime_confidence_<r>` per regime, and the sizes
    of the sample-level lists (`priority_boost_count`, `hindsight_count`)."""
    import math

    out: dict[str, float] = {}
    for k, v in (knobs or {}).items():
        if k == "gate_threshold":
            out[k] = math.inf if v is None else float(v)
        elif k in ("priority_boost", "hindsight"):
            out[f"{k}_count"] = float(len(v or []))
        elif isinstance(v, dict):
            out.update({f"{k}_{b}": float(x) for b, x in v.items()})
        elif isinstance(v, (list, tuple)):
            stem = {"regime_weights": "regime_weight", "regime_confidence": "regime_confidence"}.get(k, k)
            out.update({f"{stem}_{i}": float(x) for i, x in enumerate(v)})
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


# --- ids shared by the services (stable per (run, epoch, checkpoint), so a retried handler reuses them) ---
def checkpoint_id(run_id: str, epoch: int, sha256: str) -> str:
    """`{run}-e{epoch:04d}-{sha[:12]}`: the checkpoint of one epoch."""
    return f"{run_id}-e{int(epoch):04d}-{sha256[:12]}"


def report_id(run_id: str, epoch: int, checkpoint_sha256: str) -> str:
    """`{run}-report-e{epoch:04d}-{sha[:12]}`: the evaluator report of a checkpoint."""
    return f"{run_id}-report-e{int(epoch):04d}-{checkpoint_sha256[:12]}"


def bundle_id(run_id: str, epoch: int, checkpoint_sha256: str) -> str:
    """`{run}-bundle-e{epoch:04d}-{sha[:12]}`: the feedback bundle computed from that report."""
    return f"{run_id}-bundle-e{int(epoch):04d}-{checkpoint_sha256[:12]}"


def trainer_history_key(run_id: str) -> str:
    """`tl:{run}:trainer:history` — hash epoch → JSON epoch record (`shared.store.trainer_history_key`)."""
    from shared.store import trainer_history_key as key

    return key(run_id)


class ConsumerWorker:
    """Base of a service that consumes one stream (evaluator, feedback): subclasses set `bus`, `state`,
    `consumer` (a `shared.bus.Consumer`) and `group`, and implement the consumer's handler."""

    bus: "Bus"
    state: ServiceState
    consumer: "Consumer"
    group: str

    async def run(self) -> None:
        """Consume until cancelled; refresh the stream lag and the consumer's last error on /status."""
        await self.bus.connect()
        await self.bus.ensure_group(self.consumer.stream, self.group)
        self.state.ready = True
        lag_task = asyncio.create_task(self._lag_loop())
        try:
            await self.consumer.run()
        finally:
            lag_task.cancel()

    async def _lag_loop(self) -> None:
        from shared.bus import REDIS_DOWN, cancel_requested

        while not cancel_requested():
            try:
                self.state.stream_lag = await self.consumer.lag()
                self.state.redis_answers = True
                st = self.consumer.stats
                self.state.counters["dead_lettered"] = st.dead      # entries this consumer sent to the dead stream
                self.state.gauges["dead_letters"] = await self.bus.redis.xlen(self.bus.stream("dead"))
                if st.last_error and st.last_error_at != self.state.last_error_at:
                    self.state.last_error, self.state.last_error_at = st.last_error, st.last_error_at
                self.state.extra["consumer_stats"] = self.consumer.status()
            except Exception as exc:  # noqa: BLE001
                self.state.redis_answers = self.state.redis_answers and not isinstance(exc, REDIS_DOWN)
                self.state.error(f"lag: {type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)


def consumer_lifespan(worker: ConsumerWorker, name: str):
    """FastAPI lifespan that runs `worker` in the background (retrying with backoff while Redis is not up)
    and, on shutdown, stops taking work, lets the entry in hand finish (or stay pending for another
    replica), then closes the bus."""
    state, bus = worker.state, worker.bus

    async def run_worker() -> None:
        from shared.bus import cancel_requested

        while not cancel_requested():
            try:
                await worker.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — e.g. Redis not up yet: report, back off, retry
                state.ready = False
                state.error(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(1.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(run_worker(), name=f"{name}-consumer")
        try:
            yield
        finally:
            worker.consumer.stop()
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout=5)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await bus.close()

    return lifespan


def consumer_service_app(name: str, settings: CommonSettings, worker_cls: type[ConsumerWorker], *, description: str,
                         status_model: type[ServiceStatus]) -> tuple[FastAPI, "Bus"]:
    """The app of a service that consumes one stream: its status, bus and `worker_cls(settings, bus, state)` run by
    `consumer_lifespan`; the worker and the bus at `app.state.worker`, `app.state.bus`."""
    state, bus = service_plumbing(name, settings)
    worker = worker_cls(settings, bus, state)
    app = create_service_app(name, settings, state, lifespan=consumer_lifespan(worker, name), description=description,
                             status_model=status_model)
    app.state.worker, app.state.bus = worker, bus
    return app, bus


def service_plumbing(name: str, settings: CommonSettings) -> tuple[ServiceState, "Bus"]:
    """The status holder and the Redis bus of service `name`; refuses settings with no Redis URL."""
    from shared.bus import Bus

    if not settings.redis_url:
        raise ValueError(f"TL_REDIS_URL (or REDIS_URL) is required by the {name} service")
    state = ServiceState(name, settings.run_id)
    password = settings.redis_password.get_secret_value() if settings.redis_password is not None else None
    bus = Bus(settings.redis_url, settings.run_id, password=password,
              socket_timeout_s=settings.redis_socket_timeout_s, keep_checkpoints=settings.keep_checkpoints,
              run_dir=settings.run_path)
    return state, bus
