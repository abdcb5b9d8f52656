"""Assemble the evaluator's `SplitReport`s and `EvalReport` from simulator outputs, metrics and the autopsy.

Inputs per window: the simulator's `BacktestResult` (shared.execution: ledger in the window's local bar indices,
[B, T] equity / bar returns / positions — account `account` is reported), the policy's `Predictions` at every
bar of the window, the window's regime labels and close prices. Metrics come from `shared.metrics.compute_metrics`
(un-annualized), with PSR, and DSR deflated by `n_trials` = checkpoints evaluated in the run so far (this one
included) and, when the per-trade Sharpes of earlier checkpoints are given, their variance as V.

Only the "insample" window carries sample-level autopsy (top winners, hindsight actions of losing trades).
"""
from __future__ import annotations

import datetime as _dt
from typing import Any, Sequence

import numpy as np
import pandas as pd

from services.evaluator import autopsy as ap
from shared.metrics import compute_metrics, per_trade_sharpe, trials_variance, val_oos_gap
from shared.report import (EvalReport, SplitDefinition, SplitName, SplitReport, bars_window_hash)


def _row(a: Any, account: int) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    return a[account] if a.ndim == 2 else a


def trial_sharpe_variance(prior_sharpes: Sequence[float], current: float, prior_trades: Sequence[int] | None = None,
                          current_trades: int = 0) -> float | None:
    """V of the val DSR's trials: `shared.metrics.trials_variance` of the per-trade Sharpes of the run's
    checkpoints, this one included — over those of enough validation trades to be selected where `prior_trades`
    (the earlier checkpoints' validation trades) says, of all of them where it does not; None with < 2."""
    trades = None if prior_trades is None else [*prior_trades, current_trades]
    return trials_variance([*prior_sharpes, current], trades)


def build_split_report(split: SplitName, *, window: tuple[int, int], window_hash: str, ledger: pd.DataFrame,
                       bar_returns: Any, positions: Any, equity: Any, preds: ap.Predictions, regimes: Any,
                       close: Any, cost_rate: float, n_trials: int = 1, prior_sharpes: Sequence[float] = (),
                       prior_trades: Sequence[int] | None = None, account: int = 0, top_frac: float = 0.1,
                       material: float | None = None, engine: str = "") -> SplitReport:
    """One window's report: metrics (PSR, DSR over `n_trials`), trades with entry predictions, equity, autopsy.

    ledger / bar_returns / positions / equity: the simulator's outputs over the window (local indices, [T] or
    [B, T]); preds, regimes, close: the window's per-bar arrays ([T]); `window` = (start, end) absolute bar
    indices of the window in the dataset (end − start = T); `engine`: the path that ran the backtest
    (`SplitReport.engine`).
    """
    start, end = window
    T = len(np.asarray(close))
    if end - start != T:
        raise ValueError(f"{split}: window {window} covers {end - start} bars but the arrays cover {T}")
    br, pos, eq = _row(bar_returns, account), _row(positions, account), _row(equity, account)
    trades = ap.build_trades(ledger, preds, regimes, close, cost_rate=cost_rate, offset=start, account=account,
                             hindsight=split == "insample", material=material)
    tr, tb = trades.net_return, trades.bars.astype(np.float64)
    var = trial_sharpe_variance(prior_sharpes, per_trade_sharpe(tr), prior_trades, tr.size) if prior_sharpes else None
    metrics = compute_metrics(tr, br, pos, tb, n_trials=max(1, n_trials), sharpe_var_trials=var)
    dis_w, dis_l = ap.disagreement(trades)
    sample = split == "insample"
    return SplitReport(
        split=split, window=(int(start), int(end)), window_hash=window_hash, engine=engine, metrics=metrics,
        trades=trades,
        equity=eq, regimes=ap.regime_stats(trades), branches=ap.branch_stats(trades),
        calibration=ap.calibration(trades), gate_curve=ap.gate_curve(trades),
        disagreement_winners=dis_w, disagreement_losers=dis_l,
        top_winners=ap.top_winners(trades, top_frac) if sample else [],
        losers=ap.losing_with_hindsight(trades) if sample else [],
    )


def split_report_from_backtest(split: SplitName, result: Any, *, window: tuple[int, int], bars: Any,
                               preds: ap.Predictions, regimes: Any, cost_rate: float, n_trials: int = 1,
                               prior_sharpes: Sequence[float] = (), window_hash: str | None = None,
                               account: int = 0) -> SplitReport:
    """`build_split_report` from a `shared.execution.BacktestResult` over `bars` (the window's Bars);
    the window hash is computed from `bars` unless given (`shared.report.window_hash` definition)."""
    h = window_hash if window_hash is not None else bars_window_hash(bars, 0, len(bars.close))
    return build_split_report(split, window=window, window_hash=h, ledger=result.ledger,
                              bar_returns=result.bar_returns, positions=result.positions, equity=result.equity,
                              preds=preds, regimes=regimes, close=bars.close, cost_rate=cost_rate,
                              n_trials=n_trials, prior_sharpes=prior_sharpes, account=account,
                              engine=getattr(result, "engine", ""))


def split_definition(split: Any, bars: Any) -> SplitDefinition:
    """A `SplitDefinition` from a `shared.market.Split` (train/val/test ranges, embargo) and the full Bars.

    Uses `split.window_hash(bars, which)` when the Split provides it, else `shared.report.bars_window_hash`.
    """
    def h(which: str) -> str:
        if hasattr(split, "window_hash"):
            return split.window_hash(bars, which)
        s, e = getattr(split, which)
        return bars_window_hash(bars, s, e)

    return SplitDefinition(n_bars=len(bars.close), train=tuple(split.train), val=tuple(split.val),
                           test=tuple(split.test), embargo=int(getattr(split, "embargo", 0)),
                           train_hash=h("train"), val_hash=h("val"), test_hash=h("test"))


def build_eval_report(*, run_id: str, epoch: int, split: SplitDefinition, val: SplitReport,
                      oos: SplitReport | None = None, insample: SplitReport | None = None, n_trials: int = 1,
                      knobs: dict | None = None, checkpoint_sha256: str = "", config_hash: str = "",
                      dataset: str = "", created_at: str | None = None, policy_shaping: bool = True) -> EvalReport:
    """The EvalReport of one checkpoint; the val/OOS gap = 1 − OOS / val per-trade Sharpe (un-annualized); its
    `engine` names the paths its windows' backtests ran on (`engine_of`)."""
    gap = None
    if oos is not None:
        gap = val_oos_gap(val.metric("per_trade_sharpe"), oos.metric("per_trade_sharpe"))
    return EvalReport(
        run_id=run_id, epoch=epoch, checkpoint_sha256=checkpoint_sha256, config_hash=config_hash, dataset=dataset,
        split=split, n_trials=max(1, n_trials), val=val, oos=oos, insample=insample, val_oos_gap=gap, knobs=knobs,
        policy_shaping=policy_shaping, engine=engine_of(val, oos, insample),
        created_at=created_at if created_at is not None else _dt.datetime.now(_dt.timezone.utc).isoformat(),
    )


def engine_of(*splits: SplitReport | None) -> str:
    """The engines of the windows' backtests, each once in window order, joined by ", " ("" when none is named)."""
    names = [s.engine for s in splits if s is not None and s.engine]
    return ", ".join(dict.fromkeys(names))
