"""The portfolio vector the policy reads (`portfolio_features`) and the per-account accumulators behind it
(`PortfolioTracker`): their scales, priors and rates are defined here once, as named constants.

The torch code below is the reference. The evaluator's compiled loop (`shared/_native_pass.c`) reads the same
constants from the header `shared.native` generates from this module (`native_constants`), and
`tests/test_native_pass.py` pins the two together.

`PortfolioTracker` keeps per-account accumulators that outlive single trades: Kelly (win-rate, mean win, mean loss
EMAs) and differential Sharpe (Moody & Saffell 1998: A, B EMAs of bar returns).

ML core: imports only torch.
"""
from __future__ import annotations

import torch

from shared.execution import Simulator, StepResult

PORTFOLIO_FEATURES = ("position", "upnl_vol", "bars_in_trade", "tp_dist_vol", "sl_dist_vol", "kelly_f",
                      "win_rate", "diff_sharpe")
"""The portfolio vector's columns, in order."""
KELLY_COLUMN = PORTFOLIO_FEATURES.index("kelly_f")
DSR_COLUMN = PORTFOLIO_FEATURES.index("diff_sharpe")

# --- the portfolio vector's scales: each feature clipped, then divided to order 1 ----------------------------
UPNL_CLIP = 20.0
"""Unrealized P&L of the open trade, in bar volatilities, clipped to ±UPNL_CLIP ..."""
UPNL_SCALE = 5.0
"""... then divided by UPNL_SCALE."""
BARS_SCALE = 50.0
"""Bars in the trade, divided by BARS_SCALE ..."""
BARS_CAP = 4.0
"""... and capped at BARS_CAP."""
PLAN_CLIP = 20.0
"""Distance to the plan's target and stop, in bar volatilities, clipped to ±PLAN_CLIP ..."""
PLAN_SCALE = 10.0
"""... then divided by PLAN_SCALE."""
DSR_CLIP = 5.0
"""The differential Sharpe accumulator, clipped to ±DSR_CLIP."""

# --- the tracker's rates and priors -------------------------------------------------------------------------
TRACKER_DECAY = 0.05
"""EMA rate of the Kelly accumulators (win rate, mean win, mean loss), per closed trade."""
DSR_ETA = 0.01
"""EMA rate of the differential Sharpe's moments, per bar."""
WIN_RATE_PRIOR = 0.5
"""Win rate of a new account (the portfolio vector reports the win rate minus this)."""
MEAN_TRADE_PRIOR = 0.01
"""Mean win and mean loss of a new account (return units)."""
DSR_B_PRIOR = 1e-4
"""Second moment B of a new account's bar returns."""
KELLY_LOSS_EPS = 1e-8
"""Floor of the mean loss in the Kelly payoff ratio b = mean win / mean loss."""
KELLY_RATIO_EPS = 1e-3
"""Floor of b in f* = p − (1 − p) / b."""
DSR_VAR_EPS = 1e-10
"""Floor of the variance B − A² in the differential Sharpe."""
DSR_STEP_CLIP = 10.0
"""Each bar's differential Sharpe term, clipped to ±DSR_STEP_CLIP."""


def native_constants() -> dict[str, float]:
    """The constants above by name (what `shared.native` writes into the compiled loop's header)."""
    return {k: float(v) for k, v in globals().items() if k.isupper() and isinstance(v, float)}


class PortfolioTracker:
    """Per-account accumulators that outlive single trades (Kelly fraction, differential Sharpe)."""

    def __init__(self, n: int, device, *, decay: float = TRACKER_DECAY, dsr_eta: float = DSR_ETA):
        self.decay, self.eta = decay, dsr_eta
        f = lambda v: torch.full((n,), v, dtype=torch.float64, device=device)  # noqa: E731
        self.win_rate, self.mean_win, self.mean_loss = f(WIN_RATE_PRIOR), f(MEAN_TRADE_PRIOR), f(MEAN_TRADE_PRIOR)
        self.dsr_a, self.dsr_b, self.dsr = f(0.0), f(DSR_B_PRIOR), f(0.0)

    def kelly(self) -> torch.Tensor:
        """f* = p − (1 − p) / b, b = mean win / mean loss (Kelly 1956), clamped to [−1, 1]."""
        b = self.mean_win / self.mean_loss.clamp(min=KELLY_LOSS_EPS)
        return (self.win_rate - (1.0 - self.win_rate) / b.clamp(min=KELLY_RATIO_EPS)).clamp(-1.0, 1.0)

    def update(self, res: StepResult) -> None:
        closed = res.n_closed > 0
        r, k = res.trade_return, self.decay
        win = (r > 0).to(r.dtype)
        self.win_rate = torch.where(closed, (1 - k) * self.win_rate + k * win, self.win_rate)
        self.mean_win = torch.where(closed & (r > 0), (1 - k) * self.mean_win + k * r, self.mean_win)
        self.mean_loss = torch.where(closed & (r <= 0), (1 - k) * self.mean_loss + k * (-r), self.mean_loss)
        # differential Sharpe D_t = (B ΔA − ½ A ΔB) / (B − A²)^{3/2}   (Moody & Saffell, Eq. 7)
        x, eta = res.bar_return, self.eta
        da, db = x - self.dsr_a, x * x - self.dsr_b
        var = (self.dsr_b - self.dsr_a ** 2).clamp(min=DSR_VAR_EPS)
        d = (self.dsr_b * da - 0.5 * self.dsr_a * db) / var.pow(1.5)
        self.dsr = (1 - eta) * self.dsr + eta * d.clamp(-DSR_STEP_CLIP, DSR_STEP_CLIP)
        self.dsr_a, self.dsr_b = self.dsr_a + eta * da, self.dsr_b + eta * db

    def soft_reset(self, mask: torch.Tensor, keep: float = 0.5) -> None:
        """Pull the selected accounts' accumulators halfway (`keep`) back toward their priors."""
        def pull(x, prior):
            return torch.where(mask, keep * x + (1 - keep) * prior, x)
        self.win_rate, self.mean_win = pull(self.win_rate, WIN_RATE_PRIOR), pull(self.mean_win, MEAN_TRADE_PRIOR)
        self.mean_loss, self.dsr = pull(self.mean_loss, MEAN_TRADE_PRIOR), pull(self.dsr, 0.0)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("win_rate", "mean_win", "mean_loss", "dsr_a", "dsr_b", "dsr")}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            setattr(self, k, v.to(getattr(self, k).device).clone())


def portfolio_features(sim: Simulator, tracker: PortfolioTracker, market) -> torch.Tensor:
    """The portfolio vector at the current close of each account, B × P float32 (`PORTFOLIO_FEATURES` order).
    market: a `shared.rollout.MarketTensors` (its per-bar volatility and closes)."""
    t = sim.t
    vol, close = market.vol[t], market.prices.close[t]
    pos = sim.position
    in_trade = pos != 0
    zero = torch.zeros_like(pos)
    upnl = torch.where(in_trade, sim.trade_return_open / vol, zero).clamp(-UPNL_CLIP, UPNL_CLIP) / UPNL_SCALE
    bars = (sim.bars_in_trade.to(pos.dtype) / BARS_SCALE).clamp(max=BARS_CAP)
    side = torch.sign(pos)
    tp_d = torch.where(in_trade & torch.isfinite(sim.tp_price), side * (sim.tp_price / close - 1.0) / vol, zero)
    sl_d = torch.where(in_trade & torch.isfinite(sim.sl_price), side * (1.0 - sim.sl_price / close) / vol, zero)
    x = torch.stack([pos, upnl, bars, tp_d.clamp(-PLAN_CLIP, PLAN_CLIP) / PLAN_SCALE,
                     sl_d.clamp(-PLAN_CLIP, PLAN_CLIP) / PLAN_SCALE, tracker.kelly(),
                     tracker.win_rate - WIN_RATE_PRIOR, tracker.dsr.clamp(-DSR_CLIP, DSR_CLIP)], dim=1)
    return x.float()
