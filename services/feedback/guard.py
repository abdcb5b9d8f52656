"""Leakage guard: the only way a report reaches the feedback signals.

Rules, enforced here in code:
1. A report's `val` window must not overlap the run's train or test ranges; its `insample` window must lie inside
   the train range. Where a window equals a split range, its sha256 must equal the split definition's hash, and
   when the bars are given every window hash is recomputed from them. History reports must come from the same
   run, with the same split definition, and from earlier epochs.
2. Signals never see a report: they see a `FeedbackView` built here, which holds
   - `val`: AGGREGATES of the validation backtest only (metrics, calibration, branch error rates, per-regime
     stats, gate curve, two scalar spreads, the Sharpe's standard error, the window's length) — no trade, no bar
     index of the validation window;
   - `insample`: trade samples of the in-sample window of the TRAINING split (bar indices inside train);
   - `history`: per earlier epoch, its validation per-trade Sharpe with its standard error, trade count,
     trained knobs and checkpoint sha256 (what a rollback restores);
   and no OOS field at all: the OOS backtest is reported, never fed back.
3. Sample-level outputs (E6 priority boosts, E7 hindsight labels) are checked to index bars inside train
   (`check_train_indices`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from shared.knobs import Knobs
from shared.metrics import sharpe_se
from shared.report import (BranchStats, Calibration, EvalReport, GatePoint, RegimeStats, SplitDefinition,
                           bars_window_hash)


class LeakageError(ValueError):
    """A report (or a signal) would carry data of the wrong split into feedback."""


@dataclass(frozen=True)
class ValAggregates:
    """What the signals may know of the validation backtest: aggregates, no trade-level sample."""

    window_hash: str
    metrics: dict[str, float | None]
    calibration: Calibration
    branches: dict[str, BranchStats]
    regimes: tuple[RegimeStats, ...]
    gate_curve: tuple[GatePoint, ...]
    trade_return_std: float
    """Std (ddof=0) of the validation trades' net returns (0 with < 2 trades): the unit of E8/E9."""
    q_error_std: float
    """Std (ddof=1) of the validation trades' Q error q_pred − net return (0 with < 2 trades): E1's noise."""
    max_ensemble_std: float
    """Largest ensemble std at entry over the validation trades (0 with none)."""
    sharpe_se: float
    """Standard error of the validation per-trade Sharpe (`shared.metrics.sharpe_se`; inf with < 2 trades): the
    noise level a change in validation is compared with."""
    window_bars: int
    """Length of the validation window in bars: with the mean holding time, how many trades it can hold."""

    def metric(self, key: str, default: float = 0.0) -> float:
        v = self.metrics.get(key)
        return default if v is None else float(v)


@dataclass(frozen=True)
class InsampleTrade:
    """One trade of the in-sample backtest (bars are absolute indices inside the training split)."""

    decision_t: int
    entry_t: int
    exit_t: int
    net_return: float
    direction_idx: int
    hindsight_dir: int | None


@dataclass(frozen=True, eq=False)
class InsampleTrades:
    """The in-sample trades as columns (what E6/E7 may read of them); `trades[i]` is an `InsampleTrade`."""

    decision_t: np.ndarray
    entry_t: np.ndarray
    exit_t: np.ndarray
    net_return: np.ndarray
    direction_idx: np.ndarray
    hindsight_dir: np.ndarray
    """−1 where the trade has no hindsight direction."""

    def __len__(self) -> int:
        return len(self.entry_t)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, InsampleTrades) and all(
            np.array_equal(getattr(self, f), getattr(other, f)) for f in self.__dataclass_fields__)

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, i: int) -> InsampleTrade:
        h = int(self.hindsight_dir[i])
        return InsampleTrade(decision_t=int(self.decision_t[i]), entry_t=int(self.entry_t[i]),
                             exit_t=int(self.exit_t[i]), net_return=float(self.net_return[i]),
                             direction_idx=int(self.direction_idx[i]), hindsight_dir=None if h < 0 else h)


@dataclass(frozen=True)
class InsampleSamples:
    window_hash: str
    train: tuple[int, int]
    trades: InsampleTrades
    top_winners: tuple[int, ...]
    losers: tuple[int, ...]


@dataclass(frozen=True)
class HistoryPoint:
    epoch: int
    val_sharpe: float
    """Un-annualized per-trade Sharpe of the validation backtest."""
    val_n_trades: int
    knobs: Knobs
    """The knobs that epoch trained under."""
    val_sharpe_se: float = float("inf")
    """Standard error of `val_sharpe` (inf: unknown, or < 2 trades)."""
    checkpoint_sha256: str = ""
    """The sha256 of the checkpoint that report evaluated: what a rollback to this epoch restores."""


@dataclass(frozen=True)
class FeedbackView:
    """Everything a signal function may read. Built only by `build_view`; it has no OOS field by design."""

    run_id: str
    epoch: int
    knobs: Knobs
    """The knobs the reported epoch trained under (the 'previous' value of every signal)."""
    val: ValAggregates
    insample: InsampleSamples | None
    history: tuple[HistoryPoint, ...]


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _inside(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return b[0] <= a[0] and a[1] <= b[1]


def check_report(report: EvalReport, bars: Any | None = None) -> None:
    """Raise LeakageError when the report's windows overlap the wrong split or their hashes do not match."""
    sp: SplitDefinition = report.split
    where = f"report run={report.run_id} epoch={report.epoch}"
    v = report.val
    if _overlaps(v.window, sp.train) or _overlaps(v.window, sp.test):
        raise LeakageError(f"{where}: val window {v.window} overlaps train {sp.train} or test {sp.test}")
    if v.window == sp.val and sp.val_hash and v.window_hash != sp.val_hash:
        raise LeakageError(f"{where}: val window hash {v.window_hash[:12]}… differs from the split's val hash "
                           f"{sp.val_hash[:12]}… (the report was computed on other bars)")
    ins = report.insample
    if ins is not None:
        if not _inside(ins.window, sp.train):
            raise LeakageError(f"{where}: insample window {ins.window} is not inside train {sp.train}")
        if ins.window == sp.train and sp.train_hash and ins.window_hash != sp.train_hash:
            raise LeakageError(f"{where}: insample window hash {ins.window_hash[:12]}… differs from the split's "
                               f"train hash {sp.train_hash[:12]}…")
    if bars is not None:
        for name in ("val", "insample", "oos"):
            sr = getattr(report, name)
            if sr is None:
                continue
            h = bars_window_hash(bars, *sr.window)
            if h != sr.window_hash:
                raise LeakageError(f"{where}: {name} window {sr.window} hash {sr.window_hash[:12]}… does not match "
                                   f"the bars ({h[:12]}…)")


@dataclass(frozen=True)
class HistoryEntry:
    """An earlier epoch's report as the history needs it: what `check_history` compares (run, split, epoch) and its
    `HistoryPoint`, taken after that report passed `check_report` (`history_entry`). The feedback service keeps
    these instead of re-reading and re-parsing every earlier report — tens of MB each — at every epoch."""

    run_id: str
    epoch: int
    split: SplitDefinition
    point: HistoryPoint


def history_entry(h: EvalReport) -> HistoryEntry:
    """Guard an earlier epoch's report (`check_report`) and keep what the history needs of it."""
    check_report(h)
    return HistoryEntry(run_id=h.run_id, epoch=h.epoch, split=h.split,
                        point=HistoryPoint(epoch=h.epoch, val_sharpe=h.val.metric("per_trade_sharpe"),
                                           val_n_trades=len(h.val.trades), knobs=h.trained_knobs(),
                                           val_sharpe_se=sharpe_se(h.val.trades.net_return),
                                           checkpoint_sha256=h.checkpoint_sha256))


def check_history(report: EvalReport, history: Sequence[EvalReport | HistoryEntry]) -> list[HistoryEntry]:
    """History reports must be of the same run and split definition, from earlier epochs, and pass the guard.
    Returns them as `HistoryEntry`s (a report is guarded here, an entry was guarded when it was made)."""
    out = []
    for h in history:
        e = h if isinstance(h, HistoryEntry) else history_entry(h)
        where = f"history report run={e.run_id} epoch={e.epoch}"
        if e.run_id != report.run_id:
            raise LeakageError(f"{where}: belongs to another run than {report.run_id}")
        if e.split != report.split:
            raise LeakageError(f"{where}: its split definition differs from epoch {report.epoch}'s")
        if e.epoch >= report.epoch:
            raise LeakageError(f"{where}: history must hold earlier epochs than {report.epoch}")
        out.append(e)
    return out


def check_train_indices(indices: Sequence[int] | np.ndarray, train: tuple[int, int], what: str) -> None:
    """Raise LeakageError when a sample-level signal indexes a bar outside the training split."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    bad = idx[(idx < train[0]) | (idx >= train[1])].tolist()
    if bad:
        raise LeakageError(f"{what}: bar indices {bad[:5]} are outside the training split {train}")


def _val_aggregates(report: EvalReport) -> ValAggregates:
    v = report.val
    r, s = v.trades.net_return, v.trades.ensemble_std.astype(np.float64)
    return ValAggregates(
        window_hash=v.window_hash, metrics=dict(v.metrics), calibration=v.calibration.model_copy(deep=True),
        branches={k: b.model_copy() for k, b in v.branches.items()}, regimes=tuple(v.regimes),
        gate_curve=tuple(v.gate_curve), trade_return_std=float(r.std()) if r.size >= 2 else 0.0,
        q_error_std=float((v.trades.q_pred.astype(np.float64) - r).std(ddof=1)) if r.size >= 2 else 0.0,
        max_ensemble_std=float(s.max()) if s.size else 0.0, sharpe_se=sharpe_se(r),
        window_bars=int(v.window[1] - v.window[0]),
    )


def _insample(report: EvalReport) -> InsampleSamples | None:
    ins = report.insample
    if ins is None:
        return None
    t = ins.trades
    trades = InsampleTrades(decision_t=t.decision_t.copy(), entry_t=t.entry_t.copy(), exit_t=t.exit_t.copy(),
                            net_return=t.net_return.copy(), direction_idx=t.direction_idx.astype(np.int64),
                            hindsight_dir=t.hindsight_dir.astype(np.int64))
    check_train_indices(np.concatenate([trades.decision_t, trades.exit_t]), report.split.train, "insample trades")
    return InsampleSamples(window_hash=ins.window_hash, train=report.split.train, trades=trades,
                           top_winners=tuple(ins.top_winners), losers=tuple(ins.losers))


def build_view(report: EvalReport, history: Sequence[EvalReport | HistoryEntry] = (),
               bars: Any | None = None) -> FeedbackView:
    """Check the report and its history (reports, or `HistoryEntry`s made of them), then strip them to what the
    signals may read (see module docstring)."""
    check_report(report, bars)
    hist = tuple(e.point for e in sorted(check_history(report, history), key=lambda e: e.epoch))
    return FeedbackView(run_id=report.run_id, epoch=report.epoch, knobs=report.trained_knobs(),
                        val=_val_aggregates(report), insample=_insample(report), history=hist)
