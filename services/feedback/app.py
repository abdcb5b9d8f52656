"""The feedback service (FastAPI): the consumer of `worker.py` plus read-only access to the bundles.

    GET /health /ready /status /metrics /docs   (shared/api.py)
    GET /signals            per epoch: the E1–E9 values, the resulting knobs, signals off, the rollback and its epoch
    GET /signals/{epoch}    the full FeedbackBundle computed from that epoch's report, as stored in Redis
"""
from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, HTTPException, Path
from fastapi.responses import JSONResponse

from services.feedback.worker import FeedbackWorker
from shared.api import REDIS_503, consumer_service_app
from shared.api_models import BundleRow, FeedbackStatus, errors
from shared.config import FeedbackSettings, load_settings
from shared.report import FeedbackBundle
from shared.runview import bundle_summary

__all__ = ["bundle_summary", "create_app"]

EpochPath = Annotated[int, Path(ge=0, le=1_000_000, description="epoch whose report the bundle came from")]


def create_app(settings: FeedbackSettings | None = None) -> FastAPI:
    """The feedback app (settings default: TL_* environment)."""
    settings = settings or load_settings(FeedbackSettings)
    app, bus = consumer_service_app("feedback", settings, FeedbackWorker, status_model=FeedbackStatus,
                                    description="Turns each report into the E1–E9 signals of the next epoch.")

    @app.get("/signals", tags=["signals"], summary="E1–E9 and knobs per epoch", responses=REDIS_503)
    async def signals() -> list[BundleRow]:
        out = []
        for e in await bus.store.json_epochs("bundle"):
            doc = await bus.store.get_bundle(e)
            if doc is not None:
                out.append(bundle_summary(settings.run_id, e, doc))
        return out

    @app.get("/signals/{epoch}", tags=["signals"], summary="The full bundle computed from an epoch's report",
             response_model=FeedbackBundle, responses={**errors(404, 422), **REDIS_503})
    async def signals_of(epoch: EpochPath) -> JSONResponse:
        doc = await bus.store.get_bundle(epoch)
        if doc is None:
            raise HTTPException(404, f"no feedback bundle for epoch {epoch} of run {settings.run_id}")
        return JSONResponse(doc)      # as stored (validated when it was written)

    return app
