"""The feedback service (FastAPI): the consumer of `worker.py` plus read-only access to the bundles.

    GET /health /ready /status /metrics /docs   (shared/api.py)
    GET /signals            per epoch: the E1–E9 values, the resulting knobs, signals off, the rollback and its epoch
    GET /signals/{epoch}    the full FeedbackBundle computed from that epoch's report, as stored in Redis
"""
from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, HTTPException, Path

from services.feedback.worker import FeedbackWorker
from shared.api import service_plumbing, consumer_lifespan, create_service_app
from shared.config import FeedbackSettings, load_settings
from shared.runview import bundle_summary

__all__ = ["bundle_summary", "create_app"]

EpochPath = Annotated[int, Path(ge=0, le=1_000_000, description="epoch whose report the bundle came from")]


def create_app(settings: FeedbackSettings | None = None) -> FastAPI:
    """The feedback app (settings default: TL_* environment)."""
    settings = settings or load_settings(FeedbackSettings)
    state, bus = service_plumbing("feedback", settings)
    worker = FeedbackWorker(settings, bus, state)

    lifespan = consumer_lifespan(worker, "feedback")

    app = create_service_app("feedback", settings, state, lifespan=lifespan,
                             description="Turns each report into the E1–E9 signals of the next epoch.")

    @app.get("/signals", tags=["signals"], summary="E1–E9 and knobs per epoch")
    async def signals() -> list[dict]:
        out = []
        for e in await bus.store.json_epochs("bundle"):
            doc = await bus.store.get_bundle(e)
            if doc is not None:
                out.append(bundle_summary(settings.run_id, e, doc))
        return out

    @app.get("/signals/{epoch}", tags=["signals"], summary="The full bundle computed from an epoch's report")
    async def signals_of(epoch: EpochPath) -> dict:
        doc = await bus.store.get_bundle(epoch)
        if doc is None:
            raise HTTPException(404, f"no feedback bundle for epoch {epoch} of run {settings.run_id}")
        return doc

    app.state.worker, app.state.bus = worker, bus
    return app
