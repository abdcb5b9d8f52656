"""The trainer service (FastAPI): the training loop of `worker.py` plus its REST face.

    GET  /health /ready /status /metrics /docs     (shared/api.py)
    GET  /api/history                              every epoch record: stats, checkpoint id + sha256, bundle applied
    POST /control/pause | /control/resume | /control/stop    (bearer token)

`create_app(settings)` builds the app; the lifespan connects to Redis, starts the worker as a task and, on
shutdown (SIGTERM via uvicorn), interrupts it: an epoch in training stops at its next iteration boundary and
saves its state there (a restart finishes it), a feedback wait is cancelled, a publish in hand is finished.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from services.trainer.worker import TrainerServiceSettings, TrainerWorker, read_history
from shared.api import REDIS_503, TOKEN_ERRORS, create_service_app, require_token, service_plumbing
from shared.api_models import EpochRecord, Paused, Stopping, TrainerStatus
from shared.bus import REDIS_DOWN, Backoff, cancel_requested
from shared.config import TRAINER_STOP_WAIT_S as STOP_WAIT_S
from shared.config import load_settings

log = logging.getLogger("tradeloop.trainer")


def create_app(settings: TrainerServiceSettings | None = None) -> FastAPI:
    """The trainer app (settings default: TL_* environment)."""
    settings = settings or load_settings(TrainerServiceSettings)
    state, bus = service_plumbing("trainer", settings)
    worker = TrainerWorker(settings, bus, state)

    async def run_worker() -> None:
        backoff = Backoff()
        while not cancel_requested():
            try:
                await bus.connect()
                await worker.run()
                return
            except asyncio.CancelledError:
                raise
            except REDIS_DOWN as exc:  # Redis unreachable (at start, or mid-run): back off, resume from disk
                state.ready = False
                state.error(f"Redis unreachable ({type(exc).__name__}: {exc}); retrying")
                await asyncio.sleep(backoff.next())
            except ValueError as exc:  # bad data or settings (DataError is a ValueError): no traceback
                log.error("trainer loop failed: %s", exc)
                state.error(f"{type(exc).__name__}: {exc}")
                worker.set_phase("failed")
                state.ready = False            # /ready 503: compose's healthcheck marks the container unhealthy
                return
            except Exception as exc:  # noqa: BLE001 — reported on /status
                log.exception("trainer loop failed")
                state.error(f"{type(exc).__name__}: {exc}")
                worker.set_phase("failed")
                state.ready = False
                return

    async def refresh_lag() -> None:
        while not cancel_requested():
            try:
                state.stream_lag = await worker.lag()
                state.redis_answers = True
                state.gauges["dead_letters"] = await bus.redis.xlen(bus.stream("dead"))
            except Exception as exc:  # noqa: BLE001
                state.redis_answers = state.redis_answers and not isinstance(exc, REDIS_DOWN)
                state.error(f"lag: {type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(run_worker(), name="trainer-loop")
        lag = asyncio.create_task(refresh_lag(), name="trainer-lag")
        app.state.worker_task = task
        try:
            yield
        finally:
            worker.interrupt()
            lag.cancel()
            if worker.phase in ("training", "saving", "publishing"):
                log.info("stopping: %s", worker.stopping_note())
                try:  # the iteration in hand, then the epoch's state saved (or the publish in hand finished)
                    await asyncio.wait_for(asyncio.shield(task), timeout=STOP_WAIT_S)
                except asyncio.TimeoutError:
                    log.error("stopping: the trainer did not save within %.0fs (%s); what it did since its last "
                              "saved state is lost", STOP_WAIT_S, worker.stopping_note())
                except Exception:  # noqa: BLE001 — the task's own failure is on /status and in the log
                    pass
            task.cancel()
            await asyncio.gather(task, lag, return_exceptions=True)
            await bus.close()

    app = create_service_app("trainer", settings, state, lifespan=lifespan,
                             description="Trains the agent epoch by epoch under the feedback bundles.",
                             status_model=TrainerStatus)
    token = require_token(app)

    @app.get("/api/history", tags=["trainer"], summary="Epoch records of the run", responses=REDIS_503,
             response_model_exclude_unset=True)     # each record as stored
    async def history() -> list[EpochRecord]:
        return await read_history(bus)

    @app.post("/control/pause", tags=["control"], dependencies=[token], summary="Pause before the next epoch",
              responses=TOKEN_ERRORS)
    def pause() -> Paused:
        worker.pause()
        return Paused(ok=True, paused=True)

    @app.post("/control/resume", tags=["control"], dependencies=[token], summary="Resume a paused trainer",
              responses=TOKEN_ERRORS)
    def resume() -> Paused:
        worker.resume()
        return Paused(ok=True, paused=False)

    @app.post("/control/stop", tags=["control"], dependencies=[token], summary="Stop after the current epoch",
              responses=TOKEN_ERRORS)
    def stop() -> Stopping:
        worker.stop()
        return Stopping(ok=True, stopping=True)

    app.state.worker = worker
    app.state.bus = bus
    return app
