"""What the dashboard reads of a run, computed from the stored documents — one definition for the evaluator's REST
API (the live run, from Redis) and the dashboard's run browser (runs on disk, `services/dashboard/runs.py`), so a
run looks the same in both.

- `report_summary` / `report_rows`: the `/reports` rows, one per report, the checkpoint validation selects flagged
  (`selected_epoch`: `shared.metrics.select_best`'s rule, the one `tradeloop up`'s summary, `tradeloop evaluate
  --checkpoint best`, the feedback's rollback and a study select by).
- `equity_view`: a backtest's equity with its drawdown, dates and the buy-and-hold benchmark, min-max decimated
  (`decimate`) and, on request, packed (base64 of float64: a 10^6-bar window ships in a few tens of kB).
- `trades_page`: a page of the trade ledger, one object per trade, with entry and exit dates.
- `tearsheet`: headline metrics, val/OOS gap, buy-and-hold, monthly returns, the knobs the checkpoint trained under.

`market` is a window's `shared.runfiles.RunFiles.read_market` columns (bar, timestamp in ns, close, buy_and_hold),
or None where unknown (then no dates and no benchmark). Sharpe ratios are un-annualized, per trade. Returns are
simple fractions; a drawdown is ≤ 0 (equity / running peak − 1).
"""
from __future__ import annotations

import asyncio
import base64
from typing import Any, Mapping

import numpy as np

from shared.report import TradeTable, pack, unpack_floats

SUMMARY_SPLITS = ("val", "oos")


_DECODED: list[tuple[str, np.ndarray]] = []      # the last few packed curves decoded: (packed text, array)
_KEEP_DECODED = 8


def equity_of(part: Mapping[str, Any]) -> np.ndarray:
    """A backtest's equity curve as float64, decoded straight from its packed form (`shared.report.PackedFloats`);
    the last few decoded are kept (keyed by the packed text object itself), so the views of one report — equity,
    tearsheet — decode a 10^6-bar curve once."""
    v = part.get("equity") or []
    if not isinstance(v, str):
        return np.asarray(unpack_floats(v), dtype=np.float64)
    for text, arr in list(_DECODED):
        if text is v:
            return arr
    raw = base64.b64decode(v)
    if len(raw) % 8:
        raise ValueError(f"packed float64 array: {len(raw)} bytes is not a multiple of 8")
    a = np.frombuffer(raw, dtype="<f8")
    if not np.isfinite(a).all():
        raise ValueError(f"equity value at index {int(np.flatnonzero(~np.isfinite(a))[0])} is not finite")
    _DECODED[:] = [*_DECODED[-(_KEEP_DECODED - 1):], (v, a)]
    return a


_DERIVED: dict[tuple[int, Any], tuple[np.ndarray, Any]] = {}


def derived(arr: np.ndarray, what: Any, fn) -> Any:
    """`fn(arr)`, kept for this very array object (a decoded curve, a cached market column): the drawdowns, month
    ends and decimations of a 10^6-bar window are computed once, not on every request (at most 48 kept)."""
    key = (id(arr), what)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is arr:
        return hit[1]
    value = fn(arr)
    if len(_DERIVED) >= 48:
        _DERIVED.clear()
    _DERIVED[key] = (arr, value)
    return value


def prepare(part: Mapping[str, Any] | None = None, market: Mapping[str, np.ndarray] | None = None) -> None:
    """Decode a backtest's curve and compute the drawdowns and month ends its views need, ahead of the requests
    (the dashboard calls it when it loads a report or a market file)."""
    if part is not None:
        derived(equity_of(part), "drawdown", drawdown)
    if market is not None and len(market.get("bar", ())):
        derived(market["buy_and_hold"], "drawdown", drawdown)
        derived(market["timestamp"], "month_ends", month_ends)


def report_summary(epoch: int, doc: Mapping[str, Any]) -> dict:
    """The /reports row of one stored report (Sharpes un-annualized, per trade), with every metric of its val and
    OOS backtests under "metrics" (what the dashboard shows, without reading the report itself)."""
    def m(split: str, key: str):
        return ((doc.get(split) or {}).get("metrics") or {}).get(key)

    def count(split: str):                      # stored among the float metrics; a count is served whole
        n = m(split, "n_trades")
        return None if n is None else int(n)

    return {"epoch": epoch, "checkpoint_sha256": doc.get("checkpoint_sha256"), "n_trials": doc.get("n_trials"),
            "val_per_trade_sharpe": m("val", "per_trade_sharpe"), "oos_per_trade_sharpe": m("oos", "per_trade_sharpe"),
            "val_dsr": m("val", "dsr"), "val_psr": m("val", "psr"), "val_n_trades": count("val"),
            "oos_n_trades": count("oos"), "val_total_return": m("val", "total_return"),
            "oos_total_return": m("oos", "total_return"), "val_oos_gap": doc.get("val_oos_gap"),
            "created_at": doc.get("created_at"),
            "metrics": {w: dict((doc.get(w) or {}).get("metrics") or {}) for w in SUMMARY_SPLITS}}


def bundle_summary(run_id: str, epoch: int, doc: Mapping[str, Any]) -> dict:
    """The /signals row of one stored feedback bundle: E1–E9 (E6/E7 as counts), the knobs, the rollback flag."""
    from shared.api import bundle_id

    return {"epoch": epoch, "for_epoch": doc.get("for_epoch"),
            "bundle_id": bundle_id(run_id, epoch, doc.get("report_checkpoint_sha256", "")),
            "enabled": doc.get("enabled"), "off": doc.get("off", []), "rollback": doc.get("rollback"),
            "rollback_to_epoch": doc.get("rollback_to_epoch"), "reason": doc.get("reason"),
            "signals": {k: {"knob": s.get("knob"), "value": s.get("value"), "reason": s.get("reason"),
                            "clamped": s.get("clamped")}
                        for k, s in (doc.get("signals") or {}).items() if k not in ("E6", "E7")}
            | {k: {"knob": s.get("knob"), "count": len(s.get("value") or []), "reason": s.get("reason")}
               for k, s in (doc.get("signals") or {}).items() if k in ("E6", "E7")},
            "knobs": {k: v for k, v in (doc.get("knobs") or {}).items() if k not in ("priority_boost", "hindsight")},
            "created_at": doc.get("created_at")}


def selected_epoch(rows: list[Mapping[str, Any]]) -> int | None:
    """The checkpoint validation selects, by the rule every selection in tradeloop uses (`shared.metrics.select_best`:
    the highest validation per-trade Sharpe among the epochs with at least `MIN_SELECTION_TRADES` validation trades,
    the earliest on a tie; epochs without a Sharpe are skipped). Never the OOS result: that stays a test of the
    selection."""
    from shared.metrics import select_best

    rows = sorted((r for r in rows if r.get("val_per_trade_sharpe") is not None), key=lambda r: r["epoch"])
    if not rows:
        return None
    i, _ = select_best([float(r["val_per_trade_sharpe"]) for r in rows],
                       [int(r.get("val_n_trades") or 0) for r in rows])
    return int(rows[i]["epoch"])


def report_rows(summaries: list[dict], selected: int | None = None) -> list[dict]:
    """The /reports list: the summary rows by epoch, `selected_by_validation` true on the `selected_epoch` row, or
    on epoch `selected` where the run made its own selection (a study's, by its `--min-val-trades`)."""
    rows = sorted(summaries, key=lambda r: r["epoch"])
    sel = selected_epoch(rows) if selected is None else selected
    return [{**r, "selected_by_validation": r["epoch"] == sel} for r in rows]


def decimate(curve: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most `max_points` points of `curve` that keep its shape, ascending: the first and the last
    point, and the minimum and the maximum of each of (max_points − 2) / 2 equal buckets in between (all of them
    when the curve is that short)."""
    curve = np.asarray(curve)
    n = len(curve)
    if n <= max_points:
        return np.arange(n)
    k = max(1, (max_points - 2) // 2)
    edges = np.linspace(1, n - 1, k + 1).astype(np.int64)
    idx = [np.array([0, n - 1], dtype=np.int64)]
    lo, hi = edges[:-1], edges[1:]
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    width = int((hi - lo).max())
    # every bucket as one row of a [k, width] view (padded with the bucket's own first value): argmin/argmax per row
    cols = lo[:, None] + np.minimum(np.arange(width)[None, :], (hi - lo - 1)[:, None])
    seg = curve[cols]
    idx += [lo + seg.argmin(axis=1), lo + seg.argmax(axis=1)]
    return np.unique(np.concatenate(idx))


def drawdown(equity: np.ndarray) -> np.ndarray:
    """equity / running peak − 1 (≤ 0) at each bar."""
    eq = np.asarray(equity, dtype=np.float64)
    return eq / np.maximum.accumulate(eq) - 1.0 if len(eq) else eq


def market_for(market: Mapping[str, np.ndarray] | None, window: Any, n: int) -> Mapping[str, np.ndarray] | None:
    """`market` when it covers exactly the `n` bars of `window`, else None (another window, or absent)."""
    if market is None or window is None or len(market["bar"]) != n or n == 0:
        return None
    return market if int(market["bar"][0]) == int(window[0]) else None


def _split(doc: Mapping[str, Any], split: str) -> Mapping[str, Any]:
    part = doc.get(split)
    if part is None:
        raise LookupError(f"report of epoch {doc.get('epoch')} has no {split} backtest")
    return part


def _kept_bars(eq: np.ndarray, bench: np.ndarray | None, max_points: int) -> np.ndarray:
    """At most `max_points` bars that keep the equity's shape (`decimate`) and, beside it, the benchmark's: each
    curve's min-max points within its share of the budget (the two ends shared), or the equity's alone where the
    budget is too small to share."""
    def kept(curve: np.ndarray, m: int) -> np.ndarray:
        return derived(curve, ("decimate", m), lambda a: decimate(a, m))

    if bench is None:
        return kept(eq, max_points)
    mine = max(4, max_points // 2 + 1)
    x = np.union1d(kept(eq, mine), kept(bench, max(4, max_points - mine + 2)))
    return x if len(x) <= max_points else kept(eq, max_points)


def equity_view(doc: Mapping[str, Any], split: str, market: Mapping[str, np.ndarray] | None = None, *,
                max_points: int | None = None, packed: bool = False) -> dict:
    """One backtest's curves at the same decimated bars: "x" (bar offsets into the window), "equity", "drawdown",
    and with `market` "t" (unix seconds), "benchmark" (buy-and-hold equity) and "benchmark_drawdown" (else None).
    Drawdowns are computed on every bar before decimating; the kept bars are at most `max_points` (`_kept_bars`).
    `packed`: each array as base64 of float64 (`shared.report.pack`)."""
    part = _split(doc, split)
    eq = equity_of(part)
    window = part.get("window")
    mk = market_for(market, window, len(eq))
    bench = None if mk is None else mk["buy_and_hold"]
    if max_points is None:
        x = np.arange(len(eq))
    else:
        x = _kept_bars(eq, bench, max_points)
    cols: dict[str, np.ndarray | None] = {
        "x": x.astype(np.float64), "equity": eq[x], "drawdown": derived(eq, "drawdown", drawdown)[x],
        "t": None if mk is None else mk["timestamp"][x].astype(np.float64) / 1e9,
        "benchmark": None if bench is None else bench[x],
        "benchmark_drawdown": None if bench is None else derived(bench, "drawdown", drawdown)[x]}
    enc = (lambda a: pack(np.asarray(a, dtype="<f8"))) if packed else (lambda a: a.tolist())
    out = {k: (None if v is None else enc(v)) for k, v in cols.items()}
    if not packed:
        out["x"] = x.tolist()                                   # bar offsets as integers
    return {"epoch": doc.get("epoch"), "split": split, "window": window, "n_bars": len(eq), "n_points": len(x),
            "packed": packed, **out}


def _iso(ns: np.ndarray) -> list[str]:
    return [str(t) for t in np.asarray(ns, dtype="datetime64[ns]").astype("datetime64[s]")]


def trades_page(doc: Mapping[str, Any], split: str, market: Mapping[str, np.ndarray] | None = None, *,
                offset: int = 0, limit: int | None = None) -> dict:
    """Trades [offset, offset + limit) of one backtest as objects (`TradeRecord` fields), with "entry_time" and
    "exit_time" (ISO 8601, UTC) when `market` covers the window. A backtest that keeps no trade list (a study run's
    record: `shared.runfiles.report_of_record`) gives no rows, "listed" false and its metrics' count as "n_trades"."""
    part = _split(doc, split)
    if "trades" not in part:
        n = (part.get("metrics") or {}).get("n_trades")
        return {"epoch": doc.get("epoch"), "split": split, "window": part.get("window"),
                "n_trades": int(n) if isinstance(n, (int, float)) else 0, "offset": offset, "trades": [],
                "listed": False}
    table = TradeTable.of(part.get("trades") or [])
    stop = None if limit is None else offset + limit
    rows = table.records(offset, stop)
    window = part.get("window")
    n_bars = (int(window[1]) - int(window[0])) if window else 0
    mk = market_for(market, window, n_bars)
    if mk is not None and rows:
        w0 = int(window[0])
        ent = np.clip(np.array([r["entry_t"] for r in rows]) - w0, 0, n_bars - 1)
        ext = np.clip(np.array([r["exit_t"] for r in rows]) - w0, 0, n_bars - 1)
        for r, a, b in zip(rows, _iso(mk["timestamp"][ent]), _iso(mk["timestamp"][ext])):
            r["entry_time"], r["exit_time"] = a, b
    return {"epoch": doc.get("epoch"), "split": split, "window": window, "n_trades": len(table), "offset": offset,
            "trades": rows, "listed": True}


def month_ends(timestamps_ns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(months as datetime64[M], index of the last bar of each) of ascending UTC timestamps in ns."""
    ts = np.asarray(timestamps_ns, dtype=np.int64)
    first, last = (np.datetime64(int(t), "ns").astype("datetime64[M]") for t in (ts[0], ts[-1]))
    months = np.arange(first, last + 1)
    starts = months[1:].astype("datetime64[ns]").astype(np.int64)
    ends = np.r_[np.searchsorted(ts, starts, side="left") - 1, len(ts) - 1]
    keep = np.r_[True, np.diff(ends) > 0]                 # a month without a bar is skipped
    return months[keep], ends[keep]


def monthly_returns(equity: np.ndarray, timestamps_ns: np.ndarray) -> list[dict]:
    """[{"month": "YYYY-MM", "return": r}] of an equity curve: the last equity of each calendar month (UTC) over
    that of the month before (the first month over the window's starting equity)."""
    eq = np.asarray(equity, dtype=np.float64)
    if not len(eq):
        return []
    months, last = derived(timestamps_ns, "month_ends", month_ends) if isinstance(timestamps_ns, np.ndarray) \
        else month_ends(timestamps_ns)
    ends = eq[last]
    prev = np.r_[eq[0], ends[:-1]]
    return [{"month": str(m), "return": float(r)} for m, r in zip(months, ends / prev - 1.0)]


def tearsheet(doc: Mapping[str, Any], split: str, market: Mapping[str, np.ndarray] | None = None) -> dict:
    """The headline of one backtest of a checkpoint: its metrics (as stored: `shared.metrics.compute_metrics` keys,
    un-annualized), the report's val/OOS gap and DSR trials, the window's dates, buy-and-hold's total return and max
    drawdown over the same bars, monthly returns of both, and the knobs the checkpoint trained under."""
    part = _split(doc, split)
    eq = equity_of(part)
    window = part.get("window")
    mk = market_for(market, window, len(eq))
    # a study's record keeps no curve: its window's bars
    n_bars = len(eq) or ((int(window[1]) - int(window[0])) if window else 0)
    out = {"epoch": doc.get("epoch"), "split": split, "window": window, "n_bars": n_bars,
           "metrics": dict(part.get("metrics") or {}), "val_oos_gap": doc.get("val_oos_gap"),
           "n_trials": doc.get("n_trials"), "checkpoint_sha256": doc.get("checkpoint_sha256"),
           "dataset": doc.get("dataset"), "knobs": doc.get("knobs"), "created_at": doc.get("created_at"),
           "start": None, "end": None, "benchmark": None, "monthly": []}
    if mk is not None:
        bench = mk["buy_and_hold"]
        ts = mk["timestamp"]
        out["start"], out["end"] = _iso(ts[[0, -1]])
        out["benchmark"] = {"name": "buy-and-hold", "total_return": float(bench[-1] / bench[0] - 1.0),
                            "max_drawdown": float(-derived(bench, "drawdown", drawdown).min())}
        strat, bh = monthly_returns(eq, ts), monthly_returns(bench, ts)
        out["monthly"] = [{"month": s["month"], "return": s["return"], "benchmark": b["return"]}
                          for s, b in zip(strat, bh)]
    return out


class DocCache:
    """Parsed documents kept by key and a version (e.g. a file's mtime and size): a report is tens of MB of JSON,
    parsed once and served many times. At most `size` entries and, with `max_weight`, at most that total weight
    (e.g. bytes of the files they came from); the least recently used go first."""

    MISS = object()

    def __init__(self, size: int = 8, max_weight: float | None = None):
        self.size, self.max_weight = size, max_weight
        self._d: dict[Any, tuple[Any, Any, float]] = {}
        self._pending: dict[tuple, asyncio.Future] = {}

    def lookup(self, key: Any, version: Any) -> Any:
        """The value stored for (key, version), else `DocCache.MISS`."""
        hit = self._d.pop(key, None)
        if hit is None or hit[0] != version:
            return self.MISS
        self._d[key] = hit
        return hit[1]

    def put(self, key: Any, version: Any, value: Any, weight: float = 1.0) -> Any:
        self._d.pop(key, None)
        self._d[key] = (version, value, weight)
        while len(self._d) > 1 and (len(self._d) > self.size or (
                self.max_weight is not None and sum(w for _, _, w in self._d.values()) > self.max_weight)):
            self._d.pop(next(iter(self._d)))
        return value

    async def aget(self, key: Any, version: Any, load, weight: float = 1.0) -> Any:
        """The cached value, else `load()` run in a worker thread (parsing stays off the event loop) and kept;
        concurrent requests for the same (key, version) share one load."""
        v = self.lookup(key, version)
        if v is not self.MISS:
            return v
        pending = self._pending.get((key, version))
        if pending is None:
            pending = self._pending[(key, version)] = asyncio.ensure_future(asyncio.to_thread(load))
            pending.add_done_callback(lambda _: self._pending.pop((key, version), None))
        value = await asyncio.shield(pending)
        return self.put(key, version, value, weight)
