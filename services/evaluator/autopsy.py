"""Trade autopsy: what the policy predicted when it entered each trade, and what went wrong.

Pure functions over the simulator's ledger (`shared.execution`, columns `LEDGER_COLUMNS`), per-bar arrays of the
policy's predictions, regime labels and the window's close prices. Everything is in the window's LOCAL bar
indices (0 = first bar of the backtested window); `offset` is added to the bar indices written into the
`TradeTable` so reports carry absolute dataset indices.

Definitions (tested in tests/test_autopsy.py):

- decision bar: the ledger's `entry_t` is the entry FILL bar (at its open); the decision was taken at the close
  of `entry_t − 1`, so the predictions of a trade are read at `decision_t = entry_t − 1`.
- cost rate: c = (cost_bps + slippage_bps)·1e-4 of the traded notional per fill.
- hindsight return of a position held at one size (side s, size p: units bought at the entry price E, held) to an
  exit price X, the simulator's own trade return (`shared.execution.held_return`):
      r(s, p, X) = s·p·(X/E − 1) − c·p·(1 + X/E)
- direction error: the trade lost money net (net_return < 0).
- size error (only with more than one size level): a loser (net_return < −material) taken at the LARGEST size, or
  a winner (net_return > material) taken at the SMALLEST size — a different size would have been materially
  better.
- exit error: the trade exited on its stop or target, and the best exit in the hindsight exit span was
  materially better: best_exit_return − net_return > material, where
      best_exit_return = max over closes C_k, k ∈ [entry_t, min(exit_t + bars, T − 1)], of r(s, p, C_k)
  (the trade's own span extended by as many bars again: a stop the price recovered from, or a target the price
  ran far past, or a trade that gave back an earlier gain, counts as an error). Signal/flip/end exits are the
  direction head's decision and never count as exit errors.
- hindsight-optimal direction (for losing trades, in-sample only): argmax of
      [r(−1, p, X), 0, r(+1, p, X)]   (short, flat, long over the trade's own span, E and X the ledger's fills)
  flat wins ties and wherever neither side beats the round-trip costs.
- `material` defaults to 2·c (a full-size round trip's costs).
- calibration: coverage_j = fraction of trades whose net_return ≤ predicted quantile q_{τ_j}; bias = mean(q_pred −
  r); median_bias = median(q_0.5 − r); mae = mean |q_pred − r|.
- top winners: the ceil(frac · n_winners) winning trades (net_return > 0) with the largest net returns.

Imports numpy and pandas, the payload models of shared.report (the records it returns) and the simulator's trade
return (shared.execution).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from shared.execution import held_return
from shared.knobs import BRANCHES, N_REGIMES
from shared.report import TAUS, BranchStats, Calibration, GatePoint, RegimeStats, TradeTable

LEDGER_NEEDED = ("account", "entry_t", "exit_t", "side", "size", "entry_price", "exit_price", "net_return", "bars",
                 "exit_reason")
GATE_LEVELS = (0.5, 0.6, 0.7, 0.8, 0.9)
"""Quantiles of the trades' ensemble std tried as gate thresholds (plus "no gate")."""


POST_HOC = ("q_quantiles", "q_dir")
"""The `Predictions` fields extracted after the pass (the rest is recorded by the pass itself)."""


@dataclass
class Predictions:
    """The policy's outputs at every decision bar of a window (local index t = decision at the close of bar t).

    Shapes: [T] for the per-bar scalars, [T, len(TAUS)] for quantiles, [T, 3] for the Q of each direction.
    """

    direction: np.ndarray
    """int [T] chosen direction branch index (0 short, 1 flat, 2 long)."""
    size: np.ndarray
    """int [T] chosen size branch index (0 = smallest)."""
    exit: np.ndarray
    """int [T] chosen exit-plan branch index."""
    q_mean: np.ndarray
    """float [T] predicted Q (mean return) of the chosen action."""
    q_quantiles: np.ndarray
    """float [T, len(TAUS)] predicted quantiles of the chosen action's return distribution at TAUS. NaN where not
    computed: the evaluator extracts them (and `q_dir`) after the pass only at the decisions that opened a trade,
    the rows the autopsy reads (`services.evaluator.runner`)."""
    ensemble_std: np.ndarray
    """float [T] std of Q across ensemble heads."""
    q_dir: np.ndarray
    """float [T, 3] Q of each direction (short, flat, long); NaN where not computed (see `q_quantiles`)."""
    n_sizes: int = 1
    """Number of size levels of the size branch."""

    def validate(self, n_bars: int) -> "Predictions":
        """Check shapes against the window's bar count and finiteness; ValueError naming the field."""
        shapes = {"direction": (n_bars,), "size": (n_bars,), "exit": (n_bars,), "q_mean": (n_bars,),
                  "q_quantiles": (n_bars, len(TAUS)), "ensemble_std": (n_bars,), "q_dir": (n_bars, 3)}
        for name, shape in shapes.items():
            a = np.asarray(getattr(self, name))
            if a.shape != shape:
                raise ValueError(f"predictions.{name} must have shape {shape}, got {a.shape}")
            ok = np.isfinite(a) | (np.isnan(a) if name in POST_HOC else False)   # NaN = not computed there
            if not ok.all():
                bad = np.argwhere(~ok)[0].tolist()
                raise ValueError(f"predictions.{name} is not finite at index {bad}")
        if self.n_sizes < 1:
            raise ValueError(f"predictions.n_sizes must be >= 1, got {self.n_sizes}")
        return self


def check_ledger(ledger: pd.DataFrame, n_bars: int) -> None:
    """ValueError naming the column and row when the ledger lacks a column or indexes outside [0, n_bars)."""
    missing = [c for c in LEDGER_NEEDED if c not in ledger.columns]
    if missing:
        raise ValueError(f"ledger lacks columns {missing}")
    for col in ("entry_t", "exit_t"):
        bad = np.flatnonzero((ledger[col].to_numpy() < 0) | (ledger[col].to_numpy() >= n_bars))
        if bad.size:
            raise ValueError(f"ledger row {int(bad[0])}: {col}={ledger[col].iloc[bad[0]]} outside the window's "
                             f"{n_bars} bars")


def fixed_position_return(side: float, size: float, entry: float, exit_: np.ndarray | float, cost_rate: float):
    """r(s, p, X) = s·p·(X/E − 1) − c·p·(1 + X/E): net return of a position held at one size from E to X (see
    module), as the simulator books it."""
    return held_return(side, size, entry, np.asarray(exit_, dtype=np.float64), cost_rate)


def hindsight_returns(size: np.ndarray | float, entry: np.ndarray | float, exit_: np.ndarray | float,
                      cost_rate: float) -> np.ndarray:
    """Net returns of [short, flat, long] at each trade's size over its span E → X (flat = 0): [..., 3]. The
    counterfactual does not depend on the side taken."""
    sh = fixed_position_return(-1.0, size, entry, exit_, cost_rate)
    lo = fixed_position_return(+1.0, size, entry, exit_, cost_rate)
    return np.stack([sh, np.zeros_like(sh), lo], axis=-1)


def hindsight_direction(returns: np.ndarray | list[float]) -> np.ndarray | int:
    """argmax of [short, flat, long] returns ([..., 3]); flat wins ties and when neither side is > 0."""
    r = np.asarray(returns, dtype=np.float64)
    short, long = r[..., 0], r[..., 2]
    d = np.where(np.maximum(short, long) <= 0.0, 1, np.where(short > long, 0, 2))
    return int(d) if d.ndim == 0 else d


def best_exit_return(side: int, size: float, entry: float, close: np.ndarray, entry_t: int, exit_t: int,
                     bars: int, cost_rate: float) -> float:
    """max of r(s, p, C_k) over k ∈ [entry_t, min(exit_t + bars, T − 1)] (the hindsight exit span)."""
    end = min(exit_t + max(bars, 1), len(close) - 1)
    return float(np.max(fixed_position_return(side, size, entry, close[entry_t:end + 1], cost_rate)))


def _range_max_min(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """max and min of x[lo_i : hi_i + 1] for every i (lo_i ≤ hi_i), vectorised with a sparse table: level j holds
    the extremes of the 2^j-long runs, and a range is two overlapping runs of its level (O(n log span))."""
    span = hi - lo + 1
    lev = np.floor(np.log2(np.maximum(span, 1))).astype(np.int64)
    mx, mn = np.empty(len(lo)), np.empty(len(lo))
    tmax, tmin = x, x
    for j in range(int(lev.max()) + 1 if len(lo) else 0):
        if j:
            w = 1 << (j - 1)
            tmax, tmin = np.maximum(tmax[:-w], tmax[w:]), np.minimum(tmin[:-w], tmin[w:])
        q = lev == j
        if q.any():
            a, b = lo[q], hi[q] - (1 << j) + 1
            mx[q], mn[q] = np.maximum(tmax[a], tmax[b]), np.minimum(tmin[a], tmin[b])
    return mx, mn


def build_trades(ledger: pd.DataFrame, preds: Predictions, regimes: np.ndarray, close: np.ndarray, *,
                 cost_rate: float, offset: int = 0, account: int = 0, hindsight: bool = False,
                 material: float | None = None) -> TradeTable:
    """One row per closed trade of `account`, with the predictions at its decision bar and its errors.

    ledger: the simulator's ledger over the window (local bar indices); preds, regimes [T], close [T]: the
    window's arrays; cost_rate: (cost_bps + slippage_bps)·1e-4; offset: added to every bar index written;
    hindsight: fill `hindsight_returns` / `hindsight_dir` of losing trades (in-sample windows only).
    Vectorised over the trades (a 10^5-bar pass of an untrained agent closes ~10^5 of them).
    """
    close = np.asarray(close, dtype=np.float64)
    T = close.shape[0]
    preds.validate(T)
    regimes = np.asarray(regimes)
    if regimes.shape != (T,):
        raise ValueError(f"regimes must have shape ({T},), got {regimes.shape}")
    if regimes.size and (regimes.min() < 0 or regimes.max() >= N_REGIMES):
        raise ValueError(f"regimes must be in [0, {N_REGIMES}), got range [{regimes.min()}, {regimes.max()}]")
    check_ledger(ledger, T)
    mat = 2.0 * cost_rate if material is None else float(material)
    led = ledger[ledger["account"] == account].sort_values(["entry_t", "exit_t"], kind="stable")
    e, x = led["entry_t"].to_numpy(np.int64), led["exit_t"].to_numpy(np.int64)
    bars = led["bars"].to_numpy(np.int64)
    d = np.maximum(e - 1, 0)                                          # decision at the close of entry_t − 1
    side, size = led["side"].to_numpy(np.int64), led["size"].to_numpy(np.float64)
    r = led["net_return"].to_numpy(np.float64)
    entry, exit_px = led["entry_price"].to_numpy(np.float64), led["exit_price"].to_numpy(np.float64)
    reason = led["exit_reason"].astype(str).to_numpy()
    for name in POST_HOC:
        v = np.asarray(getattr(preds, name), dtype=np.float64)[d]
        bad = ~np.isfinite(v).reshape(len(d), -1).all(axis=1) if len(d) else np.zeros(0, dtype=bool)
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise ValueError(f"predictions.{name} is not computed at decision bar {int(d[k])}, the entry decision of "
                             f"the trade entered at bar {int(e[k])}")
    # best exit: r(s, p, C) is monotone in C (up for a long, down for a short), so its max over the hindsight
    # span [entry_t, min(exit_t + max(bars, 1), T − 1)] is r at the span's highest (long) or lowest (short) close
    end = np.minimum(x + np.maximum(bars, 1), T - 1)
    hi_c, lo_c = _range_max_min(close, e, end)
    best = fixed_position_return(side, size, entry, np.where(side > 0, hi_c, lo_c), cost_rate)
    size_idx = np.asarray(preds.size)[d].astype(np.int64)
    size_err = (preds.n_sizes > 1) & (((r < -mat) & (size_idx == preds.n_sizes - 1)) | ((r > mat) & (size_idx == 0)))
    exit_err = np.isin(reason, ("stop", "target")) & (best - r > mat)
    # hindsight of losing trades (in-sample): [short, flat, long] returns at the trade's size over its span
    lose = hindsight & (r < 0.0)
    h_ret = np.full((len(e), 3), np.nan)
    h_dir = np.full(len(e), -1, dtype=np.int64)
    if lose.any():
        h_ret[lose] = hindsight_returns(size[lose], entry[lose], exit_px[lose], cost_rate)
        h_dir[lose] = hindsight_direction(h_ret[lose])
    return TradeTable(entry_t=e + offset, exit_t=x + offset, decision_t=d + offset, side=side, size=size,
                      entry_price=entry, exit_price=exit_px, net_return=r, bars=bars, exit_reason=reason.tolist(),
                      regime=regimes[d], direction_idx=np.asarray(preds.direction)[d], size_idx=size_idx,
                      exit_idx=np.asarray(preds.exit)[d], q_pred=np.asarray(preds.q_mean)[d],
                      q_quantiles=np.asarray(preds.q_quantiles)[d].reshape(len(d), len(TAUS)),
                      ensemble_std=np.asarray(preds.ensemble_std)[d],
                      q_dir=np.asarray(preds.q_dir)[d].reshape(len(d), 3), direction_error=r < 0.0,
                      size_error=size_err, exit_error=exit_err, best_exit_return=best, hindsight_returns=h_ret,
                      hindsight_dir=h_dir)


def _sharpe(r: np.ndarray) -> float:
    """Un-annualized mean/std (ddof=1); 0 with fewer than 2 values or no dispersion."""
    if r.size < 2:
        return 0.0
    sd = float(r.std(ddof=1))
    return float(r.mean()) / sd if sd > 0 else 0.0


def regime_stats(trades: TradeTable | list, n_regimes: int = N_REGIMES) -> list[RegimeStats]:
    """Per regime label (at the decision bar): trade count, mean/sum net return, win rate, per-trade Sharpe."""
    trades = TradeTable.of(trades)
    reg, ret = trades.regime, trades.net_return
    out = []
    for k in range(n_regimes):
        r = ret[reg == k]
        out.append(RegimeStats(regime=k, n_trades=int(r.size), mean_return=float(r.mean()) if r.size else 0.0,
                               sum_return=float(r.sum()), win_rate=float((r > 0).mean()) if r.size else 0.0,
                               sharpe=_sharpe(r)))
    return out


def branch_stats(trades: TradeTable | list) -> dict[str, BranchStats]:
    """Error count and rate per action branch (direction, size, exit) over the closed trades."""
    trades = TradeTable.of(trades)
    ret = trades.net_return
    out = {}
    for b in BRANCHES:
        err = getattr(trades, f"{b}_error")
        n = int(err.size)
        out[b] = BranchStats(n_trades=n, n_errors=int(err.sum()), error_rate=float(err.mean()) if n else 0.0,
                             mean_return_when_error=float(ret[err].mean()) if err.any() else 0.0)
    return out


def calibration(trades: TradeTable | list, taus: tuple[float, ...] = TAUS) -> Calibration:
    """Quantile coverage, bias, median bias and MAE of the predicted return at entry vs the realised return."""
    trades = TradeTable.of(trades)
    n = len(trades)
    if n == 0:
        return Calibration(n_trades=0, taus=list(taus), coverage=[0.0] * len(taus), bias=0.0, median_bias=0.0,
                           mae=0.0)
    r = trades.net_return                                              # [K]
    q = trades.q_pred.astype(np.float64)                               # [K]
    qs = trades.q_quantiles.astype(np.float64)                         # [K, len(taus)]
    coverage = (r[:, None] <= qs).mean(axis=0)                         # [len(taus)]
    mid = qs[:, list(taus).index(0.5)] if 0.5 in taus else q
    return Calibration(n_trades=n, taus=list(taus), coverage=[float(c) for c in coverage],
                       bias=float(np.mean(q - r)), median_bias=float(np.median(mid - r)),
                       mae=float(np.mean(np.abs(q - r))))


def gate_curve(trades: TradeTable | list, levels: tuple[float, ...] = GATE_LEVELS) -> list[GatePoint]:
    """Trades an epistemic gate would keep (ensemble_std ≤ θ) for θ at quantiles `levels` of the trades' std,
    and for no gate (θ = None). Approximation: a gated entry is assumed not to be replaced by another trade."""
    trades = TradeTable.of(trades)
    std, ret = trades.ensemble_std.astype(np.float64), trades.net_return
    points = []
    thresholds = sorted(set(float(v) for v in np.quantile(std, levels))) if std.size else []
    for th in [*thresholds, None]:
        keep = std <= th if th is not None else np.ones_like(std, dtype=bool)
        k = ret[keep]
        points.append(GatePoint(threshold=th, n_kept=int(k.size), sum_return=float(k.sum()),
                                mean_return=float(k.mean()) if k.size else 0.0))
    return points


def top_winners(trades: TradeTable | list, frac: float = 0.1) -> list[int]:
    """Indices of the ceil(frac · n_winners) winning trades with the largest net returns, best first (ties: the
    earlier trade first)."""
    trades = TradeTable.of(trades)
    r = trades.net_return
    win = np.flatnonzero(r > 0.0)
    k = math.ceil(frac * len(win))
    return win[np.argsort(-r[win], kind="stable")][:k].tolist()


def losing_with_hindsight(trades: TradeTable | list) -> list[int]:
    """Indices of losing trades that carry a hindsight-optimal direction, worst first (ties: earlier first)."""
    trades = TradeTable.of(trades)
    r = trades.net_return
    idx = np.flatnonzero((r < 0.0) & (trades.hindsight_dir >= 0))
    return idx[np.argsort(r[idx], kind="stable")].tolist()


def disagreement(trades: TradeTable | list) -> tuple[float, float]:
    """(mean ensemble std at entry of winners, of losers); 0 for an empty group."""
    trades = TradeTable.of(trades)
    s, r = trades.ensemble_std.astype(np.float64), trades.net_return
    w, lo = s[r > 0], s[r <= 0]
    return (float(w.mean()) if w.size else 0.0, float(lo.mean()) if lo.size else 0.0)
