"""The dashboard's run browser: runs on disk (`shared/runfiles.py`), served with the services' own REST shapes, so the
page reads a finished run exactly as it reads the live one — no Redis needed.

    GET /runs                                          {"live": live run id or null, "root": the served directory's
                                                       name, "runs": [row, ...]}
    GET /runs/{run}/trainer/status                     a run's status on disk (phase "finished", or "unfinished" for
                                                       an up run with no summary yet: live, or its launcher killed)
    GET /runs/{run}/trainer/api/history                the epoch records
    GET /runs/{run}/evaluator/reports                  as the evaluator's /reports (the selected checkpoint flagged)
    GET /runs/{run}/evaluator/reports/{epoch}[/trades|/equity|/tearsheet]    as the evaluator's
    GET /runs/{run}/feedback/signals[/{epoch}]         as the feedback service's

`{run}` is the run directory's path relative to the served directory ("seed-0", "study/seed-1"); only directories
the catalog found are served (nothing else on disk is reachable), and no response or error names a path outside the
served directory (the dashboard is the one service published beyond loopback, its reads unauthenticated): a run's
"path" is relative to it, "root" is its name alone. Parsed reports are cached by file (mtime, size).
The views come from `shared.runview`, as the evaluator's do. A study's run (`tradeloop study`) is read from its epoch
records (`RunFiles.read`): its reports hold metrics and knobs but no trades and no equity curve, and the checkpoint
flagged is the one the study selected (its summary.json), whose report alone has an OOS backtest.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse

from shared.api_models import (BundleRow, EpochRecord, EquityView, ReportRow, RunList, RunOnDiskStatus, Tearsheet,
                               TradesPage, errors)
from shared.report import EvalReport, FeedbackBundle
from shared.runfiles import SUMMARY, UP_FILE, RunFiles, find_runs, read_json
from shared.runview import (DocCache, bundle_summary, equity_view, prepare, report_rows, report_summary, tearsheet,
                            trades_page)

EpochPath = Annotated[int, PathParam(ge=0, le=1_000_000, description="training epoch")]
SplitQuery = Annotated[Literal["val", "oos", "insample"], Query(description="which backtest")]
RESCAN_S = 2.0
DOC_CACHE_BYTES = 256 << 20
"""Parsed reports kept, by the size of their files (a parsed report takes ~2× its file in memory)."""


class RunCatalog:
    """The run directories under `root` (re-scanned at most every `RESCAN_S`), by id; `live` names the run the
    services are running now (its documents are read from them, not from here)."""

    def __init__(self, root: Path, live: str | None = None):
        self.root = Path(root).resolve()
        self.live = live
        self._runs: dict[str, Path] = {}
        self._scanned = 0.0

    def runs(self) -> dict[str, Path]:
        if time.monotonic() - self._scanned > RESCAN_S:
            found = find_runs(self.root)
            self._runs = {(p.name if p == self.root else p.relative_to(self.root).as_posix()): p for p in found}
            self._scanned = time.monotonic()
        return self._runs

    def files(self, run: str) -> RunFiles:
        path = self.runs().get(run)
        if path is None:
            self._scanned = 0.0                       # a run that appeared since the last scan
            path = self.runs().get(run)
        if path is None:
            raise HTTPException(404, f"no run {run!r} in {self.name}")
        return RunFiles(path)

    @property
    def name(self) -> str:
        """The served directory's name: what the responses say of it (never its absolute path)."""
        return self.root.name or "."

    def relative(self, path: Path) -> str:
        """`path` (a run's directory, or a file in one) relative to the served directory: "." for the directory
        itself."""
        return path.relative_to(self.root).as_posix()

    def scrub(self, text: str) -> str:
        """`text` (an error naming a file) with the served directory's absolute path replaced by its name."""
        return text.replace(str(self.root), self.name)


def _version(p: Path):
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _versions(paths: tuple[Path, ...]):
    """The version of a document read from `paths` (`RunFiles.sources`): theirs, None when its own file (the first)
    is missing."""
    vs = tuple(map(_version, paths))
    return None if vs[0] is None else vs


def _selected(rows: list[dict]) -> int | None:
    return next((r["epoch"] for r in rows if r["selected_by_validation"]), None)


def warm_parquet() -> None:
    """Read a small Parquet table once: the first read in a process costs ~0.3 s of CPU whatever the file's size
    (pyarrow's lazy set-up), which would otherwise land on the first tearsheet's request."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"x": np.arange(1000)}), buf, compression="none", use_dictionary=False)
    pq.read_table(pa.BufferReader(buf.getvalue()), use_threads=False)


def _load_report(files: RunFiles, epoch: int) -> dict:
    """A report file parsed, its equity curves decoded and their drawdowns computed here (`shared.runview.prepare`)
    rather than on the first chart's request."""
    doc = files.read("report", epoch)
    for split in ("val", "oos"):
        if isinstance(doc, dict) and isinstance(doc.get(split), dict):
            prepare(doc[split])
    return doc


def _load_market(files: RunFiles, split: str) -> dict | None:
    m = files.read_market(split)
    prepare(market=m)
    return m


def create_router(catalog: RunCatalog) -> APIRouter:
    """The /runs routes over `catalog`."""
    warm_parquet()
    router = APIRouter(prefix="/runs", tags=["runs"], responses=errors(404, 422))
    docs = DocCache(size=64, max_weight=DOC_CACHE_BYTES)   # parsed reports, weighed by their files' bytes
    rows = DocCache(size=4096)       # their summary rows
    markets = DocCache(size=8)

    async def doc(files: RunFiles, kind: str, epoch: int) -> dict:
        src = files.sources(kind, epoch)
        v = _versions(src)
        if v is None:
            raise HTTPException(404, f"no {kind} of epoch {epoch} in run {catalog.relative(files.root)}")
        try:
            return await docs.aget((str(src[0]), kind), v,
                                   lambda: _load_report(files, epoch) if kind == "report" else files.read(kind, epoch),
                                   weight=v[0][1])
        except ValueError as exc:
            raise HTTPException(422, catalog.scrub(str(exc))) from None

    async def summaries(files: RunFiles, unreadable: list[str] | None = None) -> list[dict]:
        """The /reports rows of a run, each computed once per report file. A report that cannot be read is a 422
        naming it, or, given `unreadable`, left out and its problem added there (the run list: one bad file
        hides nothing else)."""
        out = []
        for e in await asyncio.to_thread(files.epochs, "report"):
            src = files.sources("report", e)
            v = _versions(src)
            if v is None:
                continue
            row = rows.lookup(str(src[0]), v)
            if row is DocCache.MISS:
                try:
                    row = rows.put(str(src[0]), v, report_summary(e, await doc(files, "report", e)))
                except HTTPException as exc:
                    if unreadable is None:
                        raise
                    unreadable.append(str(exc.detail))
                    continue
            out.append(row)
        return report_rows(out, await asyncio.to_thread(files.selected_epoch))

    background: set[asyncio.Task] = set()

    def prefetch(*aws) -> None:
        """Start loading what the page asks for next (kept in the caches; errors surface on the real request)."""
        async def quiet(aw):
            try:
                await aw
            except Exception:  # noqa: BLE001
                pass

        for aw in aws:
            task = asyncio.create_task(quiet(aw))
            background.add(task)
            task.add_done_callback(background.discard)

    async def market(files: RunFiles, split: str):
        if split not in ("val", "oos"):
            return None
        p = files.market_path(split)
        v = _version(p)
        return None if v is None else await markets.aget(str(p), v, lambda: _load_market(files, split))

    def split_of(d: dict, split: str, epoch: int) -> None:
        if d.get(split) is None:
            raise HTTPException(404, f"report of epoch {epoch} has no {split} backtest")

    @router.get("", summary="The runs on disk", response_model=RunList)
    async def list_runs() -> dict:
        out = []
        for run_id, path in catalog.runs().items():
            files = RunFiles(path)
            meta = files.run_json() or {}
            unreadable: list[str] = []
            reps = await summaries(files, unreadable)
            sel = _selected(reps)
            srow = next((r for r in reps if r["epoch"] == sel), None)
            hist = await asyncio.to_thread(files.history)
            bundles = await asyncio.to_thread(files.epochs, "bundle")
            out.append({"id": run_id, "path": catalog.relative(path), "live": run_id == catalog.live,
                        "dataset": meta.get("dataset"), "seed": meta.get("seed"),
                        "n_epochs": len(hist), "n_reports": len(reps), "n_bundles": len(bundles),
                        "epochs_requested": _epochs_requested(files),
                        "selected_epoch": sel,
                        "selected": None if srow is None else {
                            k: srow.get(k) for k in ("val_per_trade_sharpe", "val_dsr", "oos_per_trade_sharpe",
                                                     "val_n_trades", "oos_n_trades", "val_total_return",
                                                     "val_oos_gap")},
                        "modified": files.modified(), "unreadable": unreadable})
        if catalog.live is not None and catalog.live not in catalog.runs():
            out.append({"id": catalog.live, "path": None, "live": True, "n_epochs": 0, "n_reports": 0,
                        "n_bundles": 0, "selected_epoch": None, "selected": None, "modified": time.time()})
        out.sort(key=lambda r: (not r["live"], r["id"]))
        return {"live": catalog.live, "root": catalog.name, "runs": out}

    @router.get("/{run:path}/trainer/status", summary="A run's status on disk (finished or unfinished)")
    async def status(run: str) -> RunOnDiskStatus:
        files = catalog.files(run)
        hist = await asyncio.to_thread(files.history)
        done = hist[-1]["epoch"] if hist else 0
        ended = (files.root / SUMMARY).exists() or not (files.root / UP_FILE).exists()
        return RunOnDiskStatus(service="trainer", run_id=run, phase="finished" if ended else "unfinished", epoch=done,
                               epochs=_epochs_requested(files) or done, on_disk=True)

    @router.get("/{run:path}/trainer/api/history", summary="A run's epoch records",
                response_model_exclude_unset=True)      # each record as stored
    async def history(run: str) -> list[EpochRecord]:
        return await asyncio.to_thread(catalog.files(run).history)

    @router.get("/{run:path}/evaluator/reports", summary="One summary row per report")
    async def reports(run: str) -> list[ReportRow]:
        files = catalog.files(run)
        out = await summaries(files)
        sel = _selected(out)
        # the page opens the selected checkpoint next: its report and the windows' dates, read now
        prefetch(market(files, "val"), market(files, "oos"), *([doc(files, "report", sel)] if sel is not None else []))
        return out

    @router.get("/{run:path}/evaluator/reports/{epoch}", summary="The full report of an epoch",
                response_model=EvalReport)
    async def report(run: str, epoch: EpochPath) -> JSONResponse:
        return JSONResponse(await doc(catalog.files(run), "report", epoch))    # as written (validated then)

    @router.get("/{run:path}/evaluator/reports/{epoch}/trades", summary="Trades of one backtest of an epoch",
                response_model_exclude_unset=True)
    async def trades(run: str, epoch: EpochPath, split: SplitQuery = "val",
                     offset: Annotated[int, Query(ge=0)] = 0,
                     limit: Annotated[int | None, Query(ge=0)] = None) -> TradesPage:
        files = catalog.files(run)
        d = await doc(files, "report", epoch)
        split_of(d, split, epoch)
        return await asyncio.to_thread(trades_page, d, split, await market(files, split), offset=offset, limit=limit)

    @router.get("/{run:path}/evaluator/reports/{epoch}/equity", summary="Equity curve of one backtest of an epoch")
    async def equity(run: str, epoch: EpochPath, split: SplitQuery = "val",
                     max_points: Annotated[int | None, Query(ge=4)] = None, packed: bool = False) -> EquityView:
        files = catalog.files(run)
        d = await doc(files, "report", epoch)
        split_of(d, split, epoch)
        return await asyncio.to_thread(equity_view, d, split, await market(files, split), max_points=max_points,
                                       packed=packed)

    @router.get("/{run:path}/evaluator/reports/{epoch}/tearsheet", summary="Headline numbers of one backtest")
    async def tearsheet_of(run: str, epoch: EpochPath, split: SplitQuery = "val") -> Tearsheet:
        files = catalog.files(run)
        d = await doc(files, "report", epoch)
        split_of(d, split, epoch)
        return await asyncio.to_thread(tearsheet, d, split, await market(files, split))

    @router.get("/{run:path}/feedback/signals", summary="E1–E9 and knobs per epoch")
    async def signals(run: str) -> list[BundleRow]:
        files = catalog.files(run)
        out = []
        for e in await asyncio.to_thread(files.epochs, "bundle"):
            d = await asyncio.to_thread(files.read, "bundle", e)
            if d is not None:
                out.append(bundle_summary(d.get("run_id") or run, e, d))
        return out

    @router.get("/{run:path}/feedback/signals/{epoch}", summary="The full bundle computed from an epoch's report",
                response_model=FeedbackBundle)
    async def signals_of(run: str, epoch: EpochPath) -> JSONResponse:
        files = catalog.files(run)
        d = await asyncio.to_thread(files.read, "bundle", epoch)
        if d is None:
            raise HTTPException(404, f"no feedback bundle of epoch {epoch} in run {run}")
        return JSONResponse(d)

    return router


def _epochs_requested(files: RunFiles) -> int | None:
    """The epochs the run was started for, when it says: `tradeloop up`'s summary.json once the run has ended, its
    up.json while it runs (or after a launcher killed before its summary)."""
    for name, key in ((SUMMARY, "epochs_requested"), (UP_FILE, "epochs")):
        value = (read_json(files.root / name) or {}).get(key)
        if isinstance(value, int):
            return value
    return None
