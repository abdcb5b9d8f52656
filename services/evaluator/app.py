"""The evaluator service (FastAPI): the consumer of `worker.py` plus read-only access to the run's reports.

    GET /health /ready /status /metrics /docs          (shared/api.py)
    GET /reports                                       one summary row per stored report
    GET /reports/{epoch}                               the full EvalReport as stored in Redis (trades and equity
                                                       packed: `shared.report.TradeTable`, `PackedFloats`)
    GET /reports/{epoch}/trades?split=&offset=&limit=  the trades of one backtest, one JSON object per trade
    GET /reports/{epoch}/equity?split=&max_points=     the equity curve of one backtest: bar offsets "x" and
                                                       values "equity" (min-max decimated to max_points)

Reports are read from Redis (the source of truth), so every replica answers the same.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Literal

import numpy as np
from fastapi import FastAPI, HTTPException, Path, Query

from services.evaluator.worker import EvaluatorServiceSettings, EvaluatorWorker
from shared.api import service_plumbing, consumer_lifespan, create_service_app
from shared.config import load_settings
from shared.report import TradeTable, unpack_floats

log = logging.getLogger("tradeloop.evaluator")
EpochPath = Annotated[int, Path(ge=0, le=1_000_000, description="training epoch")]
SplitQuery = Annotated[Literal["val", "oos", "insample"], Query(description="which backtest")]


def report_summary(epoch: int, doc: dict) -> dict:
    """The /reports row of one stored report (Sharpes un-annualized, per trade), with every metric of its val and
    OOS backtests under "metrics" (what the dashboard shows, without reading the report itself)."""
    def m(split: str, key: str):
        return ((doc.get(split) or {}).get("metrics") or {}).get(key)

    return {"epoch": epoch, "checkpoint_sha256": doc.get("checkpoint_sha256"), "n_trials": doc.get("n_trials"),
            "val_per_trade_sharpe": m("val", "per_trade_sharpe"), "oos_per_trade_sharpe": m("oos", "per_trade_sharpe"),
            "val_dsr": m("val", "dsr"), "val_psr": m("val", "psr"), "val_n_trades": m("val", "n_trades"),
            "oos_n_trades": m("oos", "n_trades"), "val_total_return": m("val", "total_return"),
            "oos_total_return": m("oos", "total_return"), "val_oos_gap": doc.get("val_oos_gap"),
            "created_at": doc.get("created_at"),
            "metrics": {w: dict((doc.get(w) or {}).get("metrics") or {}) for w in ("val", "oos")}}


def decimate(curve: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most `max_points` points of `curve` that keep its shape, ascending: the first and the last
    point, and the minimum and the maximum of each of (max_points − 2) / 2 equal buckets in between (all of them
    when the curve is that short)."""
    n = len(curve)
    if n <= max_points:
        return np.arange(n)
    k = max(1, (max_points - 2) // 2)
    edges = np.linspace(1, n - 1, k + 1).astype(np.int64)
    idx = [0, n - 1]
    for a, b in zip(edges[:-1], edges[1:]):
        if b > a:
            seg = curve[a:b]
            idx += [a + int(np.argmin(seg)), a + int(np.argmax(seg))]
    return np.unique(np.asarray(idx, dtype=np.int64))


def create_app(settings: EvaluatorServiceSettings | None = None) -> FastAPI:
    """The evaluator app (settings default: TL_* environment)."""
    settings = settings or load_settings(EvaluatorServiceSettings)
    state, bus = service_plumbing("evaluator", settings)
    worker = EvaluatorWorker(settings, bus, state)

    lifespan = consumer_lifespan(worker, "evaluator")

    app = create_service_app("evaluator", settings, state, lifespan=lifespan,
                             description="Backtests each checkpoint on validation and OOS data.")

    async def get(epoch: int) -> dict:
        doc = await bus.store.get_report(epoch)
        if doc is None:
            raise HTTPException(404, f"no report for epoch {epoch} of run {settings.run_id}")
        return doc

    def split_of(doc: dict, split: str, epoch: int) -> dict:
        part = doc.get(split)
        if part is None:
            raise HTTPException(404, f"report of epoch {epoch} has no {split} backtest")
        return part

    # a report is stored once per epoch (first wins: `Store.put_report`), so its summary row is computed once —
    # the dashboard polls this list, and a report is tens to hundreds of MB
    summaries: dict[int, dict] = {}

    @app.get("/reports", tags=["reports"], summary="One summary row per stored report")
    async def reports() -> list[dict]:
        out = []
        for e in await bus.store.json_epochs("report"):
            if e not in summaries:
                doc = await bus.store.get_report(e)
                if doc is None:
                    continue
                summaries[e] = report_summary(e, doc)
            out.append(summaries[e])
        return out

    @app.get("/reports/{epoch}", tags=["reports"], summary="The full report of an epoch")
    async def report(epoch: EpochPath) -> dict:
        return await get(epoch)

    @app.get("/reports/{epoch}/trades", tags=["reports"], summary="Trades of one backtest of an epoch")
    async def trades(epoch: EpochPath, split: SplitQuery = "val",
                     offset: Annotated[int, Query(ge=0, description="first trade")] = 0,
                     limit: Annotated[int | None, Query(ge=0, description="at most this many trades")] = None) -> dict:
        part = split_of(await get(epoch), split, epoch)
        table = await asyncio.to_thread(TradeTable.of, part.get("trades") or [])
        stop = None if limit is None else offset + limit
        rows = await asyncio.to_thread(table.records, offset, stop)
        return {"epoch": epoch, "split": split, "window": part.get("window"), "n_trades": len(table),
                "offset": offset, "trades": rows}

    @app.get("/reports/{epoch}/equity", tags=["reports"], summary="Equity curve of one backtest of an epoch")
    async def equity(epoch: EpochPath, split: SplitQuery = "val",
                     max_points: Annotated[int | None, Query(ge=4, description="decimate to at most this many "
                                                             "points (min and max per bucket)")] = None) -> dict:
        part = split_of(await get(epoch), split, epoch)
        eq = np.asarray(unpack_floats(part.get("equity") or []))
        x = decimate(eq, max_points) if max_points is not None else np.arange(len(eq))
        return {"epoch": epoch, "split": split, "window": part.get("window"), "n_bars": len(eq),
                "x": x.tolist(), "equity": eq[x].tolist()}

    app.state.worker, app.state.bus = worker, bus
    return app
