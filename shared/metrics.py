"""Trading metrics of one account's backtest — used by the trainer, the evaluator and `tradeloop backtest` alike.

Conventions (read these before comparing numbers with another library):

- Every Sharpe-like ratio here is **un-annualized**: per trade (`per_trade_sharpe`) or per bar
  (`per_bar_sharpe`, `sortino`). Multiply by sqrt(periods per year) yourself if you must annualize.
- Sharpe = mean / std with ddof=1 and no risk-free rate. It is **0.0 where undefined**: fewer than two
  observations, or zero dispersion (all returns equal). PSR and DSR are 0.0 where the Sharpe is undefined.
- Returns are simple (not log) fractions of equity: 0.01 is +1 %.
- `max_drawdown` is a positive fraction (0.25 = the equity fell 25 % below its running peak); the equity
  curve starts at 1.0 before the first bar return.
- `profit_factor` = gross profit / gross loss of closed trades, capped at `PROFIT_FACTOR_CAP` (so JSON never
  holds inf): no losing trade and at least one winner gives the cap; no trade (or no winner and no loser)
  gives 0.0.
- `exposure` = fraction of bars that close with a non-zero position (the position at each bar's close, after
  its fills and exits: a trade opened and closed within one bar is not counted); `turnover` = mean |Δposition|
  per bar of those positions, starting flat: (|p_0| + Σ_t |p_t − p_{t−1}|) / T.
- `sortino` = mean bar return / downside deviation, target 0, where the downside deviation is
  sqrt(mean(min(r, 0)²)) over all T bars (not only the losing ones — as in Sortino & Price 1994).
- PSR (Bailey & López de Prado 2012) uses the per-trade Sharpe SR, the number of trades n and the
  sample skewness γ3 and (non-excess) kurtosis γ4 of the trade returns (biased moment estimators, as in
  the paper): PSR(SR*) = Φ((SR − SR*)·sqrt(n − 1) / sqrt(1 − γ3·SR + (γ4 − 1)/4·SR²)). `psr` is PSR(0).
  The same denominator over sqrt(n − 1) is the Sharpe's standard error (`sharpe_se_from_stats`); `sharpe_se`,
  the noise level the feedback signals compare validation changes with, never goes below its normal-moment value.
- DSR (Bailey & López de Prado 2014) is PSR(SR0) with the expected maximum Sharpe of N independent trials
  under the null: SR0 = sqrt(V)·((1 − γ)·Φ⁻¹(1 − 1/N) + γ·Φ⁻¹(1 − 1/(N·e))), γ = Euler–Mascheroni,
  N = n_trials (e.g. checkpoints evaluated in the run), V = variance of the trials' Sharpes. When V is
  not given we use 1/(n − 1), the null variance of a Sharpe estimated from n returns. With N = 1 there is
  no selection: SR0 = 0 and DSR = PSR(0).

The ML core: numpy (and pandas for the ledger helper) in, python floats out. No scipy: Φ and Φ⁻¹ come
from `statistics.NormalDist`.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any, Sequence

import numpy as np

PROFIT_FACTOR_CAP = 1000.0
"""Value of `profit_factor` when there are winning trades and no losing trade (and the upper bound otherwise)."""

EULER_GAMMA = 0.5772156649015329
"""Euler–Mascheroni constant γ of the DSR's expected-maximum formula."""

METRIC_KEYS = (
    "per_trade_sharpe", "per_bar_sharpe", "total_return", "max_drawdown", "profit_factor", "win_rate",
    "n_trades", "mean_bars_held", "exposure", "turnover", "sortino", "psr", "dsr",
)
"""Keys of `compute_metrics`, in report order."""

_STD_NORMAL = NormalDist()


def _as_1d(x: Any, name: str) -> np.ndarray:
    """float64 1-D copy of `x`; ValueError naming the argument on a bad shape or a non-finite value."""
    a = np.asarray(x, dtype=np.float64)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if not np.isfinite(a).all():
        bad = int(np.flatnonzero(~np.isfinite(a))[0])
        raise ValueError(f"{name} must be finite; index {bad} is {a[bad]}")
    return a


def sharpe(returns: Any) -> float:
    """Un-annualized Sharpe ratio mean/std (ddof=1) of `returns`; 0.0 with n < 2 or zero dispersion."""
    r = _as_1d(returns, "returns")
    if r.size < 2:
        return 0.0
    sd = float(r.std(ddof=1))
    if not sd > 0.0:
        return 0.0
    return float(r.mean()) / sd


def per_trade_sharpe(trade_returns: Any) -> float:
    """Un-annualized per-trade Sharpe: mean / std (ddof=1) of closed-trade net returns; 0.0 if undefined."""
    return sharpe(_as_1d(trade_returns, "trade_returns"))


def per_bar_sharpe(bar_returns: Any) -> float:
    """Un-annualized per-bar Sharpe: mean / std (ddof=1) of the account's bar returns; 0.0 if undefined."""
    return sharpe(_as_1d(bar_returns, "bar_returns"))


def equity_curve(bar_returns: Any) -> np.ndarray:
    """Equity after each bar, starting from 1.0: E_t = Π_{s≤t} (1 + r_s). Shape [T]."""
    return np.cumprod(1.0 + _as_1d(bar_returns, "bar_returns"))


def total_return(bar_returns: Any) -> float:
    """Compounded return over all bars: Π (1 + r_t) − 1 (0.0 for no bars)."""
    r = _as_1d(bar_returns, "bar_returns")
    return float(np.prod(1.0 + r) - 1.0) if r.size else 0.0


def max_drawdown(bar_returns: Any) -> float:
    """Largest fall of equity below its running peak, as a positive fraction; the peak starts at 1.0."""
    eq = equity_curve(bar_returns)
    if eq.size == 0:
        return 0.0
    peak = np.maximum.accumulate(np.concatenate(([1.0], eq)))[1:]  # running max incl. the initial 1.0
    return float(np.max(1.0 - eq / peak).clip(min=0.0))


def profit_factor(trade_returns: Any) -> float:
    """Gross profit / gross loss of closed trades, capped at PROFIT_FACTOR_CAP; 0.0 without winners."""
    r = _as_1d(trade_returns, "trade_returns")
    gross_win = float(r[r > 0].sum())
    gross_loss = float(-r[r < 0].sum())
    if gross_win <= 0.0:
        return 0.0
    if gross_loss <= 0.0:
        return PROFIT_FACTOR_CAP
    return min(gross_win / gross_loss, PROFIT_FACTOR_CAP)


def win_rate(trade_returns: Any) -> float:
    """Fraction of closed trades with a net return > 0 (0.0 with no trade)."""
    r = _as_1d(trade_returns, "trade_returns")
    return float((r > 0).mean()) if r.size else 0.0


def mean_bars_held(trade_bars: Any) -> float:
    """Mean duration of closed trades in bars (0.0 with no trade)."""
    b = _as_1d(trade_bars, "trade_bars")
    return float(b.mean()) if b.size else 0.0


def exposure(positions: Any) -> float:
    """Fraction of bars with a non-zero position (0.0 for no bars)."""
    p = _as_1d(positions, "positions")
    return float((p != 0).mean()) if p.size else 0.0


def turnover(positions: Any) -> float:
    """Mean |Δposition| per bar, starting flat: (|p_0| + Σ |p_t − p_{t−1}|) / T (0.0 for no bars)."""
    p = _as_1d(positions, "positions")
    if p.size == 0:
        return 0.0
    return float(np.abs(np.diff(p, prepend=0.0)).mean())


def sortino(bar_returns: Any) -> float:
    """Un-annualized per-bar Sortino: mean(r) / sqrt(mean(min(r, 0)²)), target 0; 0.0 if no downside."""
    r = _as_1d(bar_returns, "bar_returns")
    if r.size == 0:
        return 0.0
    downside = math.sqrt(float(np.mean(np.minimum(r, 0.0) ** 2)))
    if not downside > 0.0:
        return 0.0
    return float(r.mean()) / downside


def moments(returns: Any) -> tuple[float, float]:
    """(skewness γ3, non-excess kurtosis γ4) with biased moment estimators m3/m2^1.5, m4/m2²; (0, 3) if m2 = 0."""
    r = _as_1d(returns, "returns")
    if r.size == 0:
        return 0.0, 3.0
    d = r - r.mean()
    m2 = float(np.mean(d ** 2))
    if not m2 > 0.0:
        return 0.0, 3.0
    return float(np.mean(d ** 3)) / m2 ** 1.5, float(np.mean(d ** 4)) / m2 ** 2


def sharpe_se_from_stats(sr: float, n: int, skew: float = 0.0, kurt: float = 3.0) -> float:
    """Standard error of an un-annualized Sharpe `sr` estimated from n returns of skewness γ3 and non-excess
    kurtosis γ4: sqrt((1 − γ3·SR + (γ4 − 1)/4·SR²) / (n − 1)) — the PSR's denominator (Bailey & López de Prado
    2012); sqrt((1 + SR²/2) / (n − 1)) for normal returns. inf with n < 2 (no information); 0 where the
    variance term is 0 (a two-point distribution)."""
    if n < 2:
        return math.inf
    var = 1.0 - skew * sr + (kurt - 1.0) / 4.0 * sr * sr
    return math.sqrt(var / (n - 1)) if var > 0.0 else 0.0


def sharpe_se(trade_returns: Any) -> float:
    """The noise level of the per-trade Sharpe of `trade_returns`: the larger of `sharpe_se_from_stats` with their
    skewness and kurtosis and with normal moments (γ3 = 0, γ4 = 3). Over tens of trades the sample skewness and
    kurtosis are noisy themselves, and a positive skew under a positive Sharpe shrinks the moment form toward 0
    (on 30 synthetic trades, γ3 ≈ 5: 0.09 against 0.19), which would make any change look significant; heavy
    tails only ever widen it. inf with fewer than 2 returns."""
    r = _as_1d(trade_returns, "trade_returns")
    g3, g4 = moments(r)
    sr = sharpe(r)
    return max(sharpe_se_from_stats(sr, r.size, g3, g4), sharpe_se_from_stats(sr, r.size))


def psr_from_stats(sr: float, n: int, skew: float, kurt: float, sr_star: float = 0.0) -> float:
    """Probabilistic Sharpe Ratio Φ((SR − SR*)·sqrt(n − 1) / sqrt(1 − γ3·SR + (γ4 − 1)/4·SR²)) = Φ((SR − SR*) / SE)
    with SE = `sharpe_se_from_stats`.

    `sr`, `sr_star` are un-annualized Sharpes at the frequency of the n observations; `kurt` is non-excess
    (3 for a normal). Returns 0.0 with n < 2. The denominator is ≥ 0 for any sample (γ4 ≥ 1 + γ3²); where it
    is 0 (a two-point distribution) the PSR is 1.0 if SR > SR* else 0.0.
    """
    if n < 2:
        return 0.0
    se = sharpe_se_from_stats(sr, n, skew, kurt)
    if not se > 0.0:
        return 1.0 if sr > sr_star else 0.0
    return _STD_NORMAL.cdf((sr - sr_star) / se)


def expected_max_sharpe(n_trials: int, var_trials: float) -> float:
    """SR0 = sqrt(V)·((1 − γ)·Φ⁻¹(1 − 1/N) + γ·Φ⁻¹(1 − 1/(N·e))): the expected best of N null Sharpes; 0 if N ≤ 1."""
    if n_trials <= 1:
        return 0.0
    if var_trials < 0:
        raise ValueError(f"var_trials must be >= 0, got {var_trials}")
    z1 = _STD_NORMAL.inv_cdf(1.0 - 1.0 / n_trials)
    z2 = _STD_NORMAL.inv_cdf(1.0 - 1.0 / (n_trials * math.e))
    return math.sqrt(var_trials) * ((1.0 - EULER_GAMMA) * z1 + EULER_GAMMA * z2)


def psr(trade_returns: Any, sr_star: float = 0.0) -> float:
    """PSR(SR*) of the per-trade Sharpe, with the trades' skewness and kurtosis; 0.0 where the Sharpe is undefined."""
    r = _as_1d(trade_returns, "trade_returns")
    if r.size < 2 or not float(r.std(ddof=1)) > 0.0:
        return 0.0
    g3, g4 = moments(r)
    return psr_from_stats(sharpe(r), r.size, g3, g4, sr_star)


def dsr(trade_returns: Any, n_trials: int = 1, sharpe_var_trials: float | None = None) -> float:
    """Deflated Sharpe Ratio: PSR against the expected maximum Sharpe of `n_trials` trials.

    `sharpe_var_trials` is the variance of the (un-annualized, per-trade) Sharpes across the trials; when
    None, 1/(n − 1) is used (the null variance of a Sharpe estimated from n trade returns).
    """
    if n_trials < 1:
        raise ValueError(f"n_trials must be >= 1, got {n_trials}")
    r = _as_1d(trade_returns, "trade_returns")
    if r.size < 2:
        return 0.0
    v = 1.0 / (r.size - 1) if sharpe_var_trials is None else float(sharpe_var_trials)
    return psr(r, sr_star=expected_max_sharpe(n_trials, v))


MIN_SELECTION_TRADES = 10
"""Validation trades a checkpoint needs to be selectable as a run's best (`select_best`)."""


def select_best(val_sharpes: Sequence[float], val_trades: Sequence[int],
                min_trades: int = MIN_SELECTION_TRADES) -> tuple[int, bool]:
    """The run's best checkpoint: (index of the highest validation per-trade Sharpe among the checkpoints with at
    least `min_trades` validation trades, whether any had that many). When none has, the highest among all — a
    Sharpe of few trades says little, so the caller says so. The first of equal Sharpes wins; ValueError when
    there is no checkpoint."""
    if len(val_sharpes) != len(val_trades) or not val_sharpes:
        raise ValueError(f"select_best needs one trade count per Sharpe and at least one checkpoint, got "
                         f"{len(val_sharpes)} Sharpes and {len(val_trades)} trade counts")
    ok = [i for i, n in enumerate(val_trades) if n >= min_trades]
    pool = ok or list(range(len(val_sharpes)))
    return max(pool, key=lambda i: (val_sharpes[i], -i)), bool(ok)


def trials_variance(sharpes: Sequence[float], trades: Sequence[int] | None = None,
                    min_trades: int = MIN_SELECTION_TRADES) -> float | None:
    """V of a DSR's trials: the variance (ddof 1) of the per-trade Sharpes of the trials selection could have chosen,
    those with ≥ `min_trades` trades (`trades` given); of all of them where fewer than two could, or `trades` is None;
    None below two. A Sharpe of a few trades is mostly its own sampling noise (variance about 1 / (n − 1)), and one
    such outlier can set V: one checkpoint at −4.9 among the 240 of docs/study-h100-real-eurusd took it from 0.059 to
    0.154. N stays every trial."""
    x = np.asarray(sharpes, dtype=np.float64)
    if trades is not None:
        ok = np.asarray(trades) >= min_trades
        if ok.sum() >= 2:
            x = x[ok]
    return float(np.var(x, ddof=1)) if x.size >= 2 else None


def selection_dsr(best_trade_returns: Any, val_sharpes: Sequence[float], val_trades: Sequence[int] | None = None,
                  min_trades: int = MIN_SELECTION_TRADES) -> float:
    """DSR of the selected checkpoint's validation trades, deflated over every checkpoint considered: N = the
    number of `val_sharpes` (per trade, un-annualized, one per checkpoint), V = `trials_variance` (the null
    1/(n − 1) with one checkpoint). Picking the best epoch by validation is a multiple test."""
    return dsr(best_trade_returns, n_trials=max(1, len(val_sharpes)),
               sharpe_var_trials=trials_variance(val_sharpes, val_trades, min_trades))


def val_oos_gap(val_sharpe: float, oos_sharpe: float) -> float:
    """Val/OOS gap 1 − OOS / val of per-trade Sharpes (0 = no decay, 1 = all lost); 0.0 when val_sharpe is 0."""
    if val_sharpe == 0.0:
        return 0.0
    return 1.0 - oos_sharpe / val_sharpe


def compute_metrics(trade_returns: Any, bar_returns: Any, positions: Any, trade_bars: Any, *,
                    n_trials: int = 1, sharpe_var_trials: float | None = None) -> dict[str, float]:
    """Every metric of one account (keys `METRIC_KEYS`), all finite python floats.

    trade_returns [K]: net returns of closed trades; trade_bars [K]: their durations in bars;
    bar_returns [T]: the account's equity return per bar; positions [T]: the position at each bar's close (after
    that bar's fills and exits: `BacktestResult.positions`).
    `n_trials`, `sharpe_var_trials`: see `dsr`.
    """
    tr = _as_1d(trade_returns, "trade_returns")
    tb = _as_1d(trade_bars, "trade_bars")
    br = _as_1d(bar_returns, "bar_returns")
    pos = _as_1d(positions, "positions")
    if tr.size != tb.size:
        raise ValueError(f"trade_returns ({tr.size}) and trade_bars ({tb.size}) must have the same length")
    if br.size != pos.size:
        raise ValueError(f"bar_returns ({br.size}) and positions ({pos.size}) must have the same length")
    return {
        "per_trade_sharpe": per_trade_sharpe(tr),
        "per_bar_sharpe": per_bar_sharpe(br),
        "total_return": total_return(br),
        "max_drawdown": max_drawdown(br),
        "profit_factor": profit_factor(tr),
        "win_rate": win_rate(tr),
        "n_trades": float(tr.size),
        "mean_bars_held": mean_bars_held(tb),
        "exposure": exposure(pos),
        "turnover": turnover(pos),
        "sortino": sortino(br),
        "psr": psr(tr),
        "dsr": dsr(tr, n_trials, sharpe_var_trials),
    }


def metrics_from_backtest(result: Any, account: int = 0, *, n_trials: int = 1,
                          sharpe_var_trials: float | None = None) -> dict[str, float]:
    """`compute_metrics` of one account of a `shared.execution.BacktestResult` (ledger + [B, T] arrays)."""
    ledger = result.ledger
    trades = ledger[ledger["account"] == account] if len(ledger) else ledger
    bar_returns = np.asarray(result.bar_returns)
    positions = np.asarray(result.positions)
    if bar_returns.ndim == 2:
        bar_returns, positions = bar_returns[account], positions[account]
    return compute_metrics(
        trades["net_return"].to_numpy(np.float64) if len(trades) else np.zeros(0),
        bar_returns, positions,
        trades["bars"].to_numpy(np.float64) if len(trades) else np.zeros(0),
        n_trials=n_trials, sharpe_var_trials=sharpe_var_trials,
    )
