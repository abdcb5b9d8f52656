"""The evaluator service (FastAPI): the consumer of `worker.py` plus read-only access to the run's reports.

    GET /health /ready /status /metrics /docs          (shared/api.py)
    GET /reports                                       one summary row per stored report
    GET /reports/{epoch}                               the full EvalReport as stored in Redis (trades and equity
                                                       packed: `shared.report.TradeTable`, `PackedFloats`)
    GET /reports/{epoch}/trades?split=&offset=&limit=  the trades of one backtest, one JSON object per trade
    GET /reports/{epoch}/equity?split=&max_points=&packed=   the equity curve of one backtest: bar offsets "x",
                                                       "equity", "drawdown", and the dates "t" and buy-and-hold
                                                       "benchmark" (min-max decimated to max_points)
    GET /reports/{epoch}/tearsheet?split=              headline metrics, val/OOS gap, buy-and-hold, monthly returns,
                                                       the knobs the checkpoint trained under

Reports are read from Redis (the source of truth), so every replica answers the same; the dates and the benchmark
come from the run directory's market files (`shared.runfiles`, written by the evaluator that evaluated the run).
The views are `shared.runview`'s, which the dashboard's run browser serves for runs on disk.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal

from fastapi import FastAPI, HTTPException, Path, Query
from fastapi.responses import JSONResponse

from services.evaluator.worker import EvaluatorServiceSettings, EvaluatorWorker
from shared.api import REDIS_503, consumer_service_app
from shared.api_models import EquityView, EvaluatorStatus, ReportRow, Tearsheet, TradesPage, errors
from shared.config import load_settings
from shared.report import EvalReport
from shared.runview import DocCache, decimate, equity_view, report_rows, report_summary, tearsheet, trades_page

__all__ = ["create_app", "decimate", "report_summary"]

log = logging.getLogger("tradeloop.evaluator")
EpochPath = Annotated[int, Path(ge=0, le=1_000_000, description="training epoch")]
SplitQuery = Annotated[Literal["val", "oos", "insample"], Query(description="which backtest")]


def create_app(settings: EvaluatorServiceSettings | None = None) -> FastAPI:
    """The evaluator app (settings default: TL_* environment)."""
    settings = settings or load_settings(EvaluatorServiceSettings)
    app, bus = consumer_service_app("evaluator", settings, EvaluatorWorker, status_model=EvaluatorStatus,
                                    description="Backtests each checkpoint on validation and OOS data.")
    missing = {**errors(404, 422), **REDIS_503}

    docs = DocCache(size=4)     # a report is stored once (first wins): parsed once, served from here after

    async def get(epoch: int) -> dict:
        doc = docs.lookup(epoch, 0)
        if doc is DocCache.MISS:
            doc = await bus.store.get_report(epoch)
            if doc is None:
                raise HTTPException(404, f"no report for epoch {epoch} of run {settings.run_id}")
            docs.put(epoch, 0, doc)
        return doc

    def split_of(doc: dict, split: str, epoch: int) -> dict:
        part = doc.get(split)
        if part is None:
            raise HTTPException(404, f"report of epoch {epoch} has no {split} backtest")
        return part

    markets = DocCache(size=4)

    async def market(split: str):
        """The window's dates and buy-and-hold (the run directory's market file), or None."""
        files = bus.store.files
        if files is None or split not in ("val", "oos"):
            return None
        p = files.market_path(split)
        try:
            st = p.stat()
        except OSError:
            return None
        return await markets.aget(split, (st.st_mtime_ns, st.st_size), lambda: files.read_market(split))

    # a report is stored once per epoch (first wins: `Store.put_report`), so its summary row is computed once —
    # the dashboard polls this list, and a report is tens to hundreds of MB
    summaries: dict[int, dict] = {}

    @app.get("/reports", tags=["reports"], summary="One summary row per stored report", responses=REDIS_503)
    async def reports() -> list[ReportRow]:
        out = []
        for e in await bus.store.json_epochs("report"):
            if e not in summaries:
                doc = await bus.store.get_report(e)
                if doc is None:
                    continue
                summaries[e] = report_summary(e, doc)
            out.append(summaries[e])
        return report_rows(out)

    @app.get("/reports/{epoch}", tags=["reports"], summary="The full report of an epoch", response_model=EvalReport,
             responses=missing)
    async def report(epoch: EpochPath) -> JSONResponse:
        return JSONResponse(await get(epoch))     # as stored (validated when it was written): tens of MB

    @app.get("/reports/{epoch}/trades", tags=["reports"], summary="Trades of one backtest of an epoch",
             responses=missing, response_model_exclude_unset=True)
    async def trades(epoch: EpochPath, split: SplitQuery = "val",
                     offset: Annotated[int, Query(ge=0, description="first trade")] = 0,
                     limit: Annotated[int | None, Query(ge=0, description="at most this many trades")] = None
                     ) -> TradesPage:
        doc = await get(epoch)
        split_of(doc, split, epoch)
        return await asyncio.to_thread(trades_page, doc, split, await market(split), offset=offset, limit=limit)

    @app.get("/reports/{epoch}/equity", tags=["reports"], summary="Equity curve of one backtest of an epoch",
             responses=missing)
    async def equity(epoch: EpochPath, split: SplitQuery = "val",
                     max_points: Annotated[int | None, Query(ge=4, description="decimate to at most this many "
                                                             "points (min and max per bucket)")] = None,
                     packed: Annotated[bool, Query(description="arrays as base64 of float64")] = False) -> EquityView:
        doc = await get(epoch)
        split_of(doc, split, epoch)
        return await asyncio.to_thread(equity_view, doc, split, await market(split), max_points=max_points,
                                       packed=packed)

    @app.get("/reports/{epoch}/tearsheet", tags=["reports"], summary="Headline numbers of one backtest of an epoch",
             responses=missing)
    async def tearsheet_of(epoch: EpochPath, split: SplitQuery = "val") -> Tearsheet:
        doc = await get(epoch)
        split_of(doc, split, epoch)
        return await asyncio.to_thread(tearsheet, doc, split, await market(split))

    return app
