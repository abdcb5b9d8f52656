"""THE one rollout loop: steps `shared.agent`'s policy through `shared.execution.Simulator`.

The trainer calls `run_rollout` with exploration on and an `on_step` callback (rewards, replay writes, episode
resets: `services/trainer/env.py`); the evaluator calls `evaluate_policy` (one continuous greedy pass over a
split, exploration and callbacks off), which returns the ledger, per-bar curves and, per decision bar, the
predicted Q / IQN quantiles / ensemble disagreement of the chosen action.

Conventions
-----------
- `MarketTensors` holds one bar range [start, stop) of a dataset on a device, in *local* bar indices 0..T−1
  (the simulator's `t`). Features, volatility and regimes are computed on the whole series (they are causal)
  and then sliced, so the first window of a split sees the bars just before it.
- The decision at local bar t reads the feature window ending at t and the portfolio at close t.
- `PortfolioTracker` keeps per-account accumulators that outlive single trades: Kelly (win-rate, mean win,
  mean loss EMAs) and differential Sharpe (Moody & Saffell 1998: A, B EMAs of bar returns).

ML core: imports only torch, numpy and pandas.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

from shared.agent import Action, Agent, PolicyControls, act
from shared.execution import CostModel, Prices, Simulator, StepResult
from shared.market import Bars, compute_features, regime_labels, volatility


@dataclass
class MarketTensors:
    """One bar range of a dataset on a device, in local indices (see module docstring)."""

    prices: Prices
    windows: torch.Tensor
    """T × W × F view: windows[t] is the feature window ending at local bar t (float32)."""
    vol: torch.Tensor
    """T: causal per-bar volatility (float64)."""
    regime: torch.Tensor
    """T: causal regime label (long)."""
    start: int
    """Global index of local bar 0."""

    @classmethod
    def from_bars(cls, bars: Bars, start: int, stop: int, window: int, device="cpu",
                  features: np.ndarray | None = None) -> "MarketTensors":
        """Slice [start, stop) of `bars`, with the W−1 feature rows before `start` (zeros before bar 0)."""
        feats = compute_features(bars) if features is None else features                    # T_all × F
        lo = start - window + 1
        pad = max(0, -lo)
        f = feats[max(lo, 0):stop]
        if pad:
            f = np.concatenate([np.zeros((pad, feats.shape[1]), dtype=np.float32), f])
        ft = torch.as_tensor(f, dtype=torch.float32, device=device)                          # (T + W − 1) × F
        windows = ft.unfold(0, window, 1).transpose(1, 2)                                    # T × W × F
        return cls(prices=Prices.from_bars(bars.slice(start, stop), device=device), windows=windows,
                   vol=torch.as_tensor(volatility(bars)[start:stop], dtype=torch.float64, device=device),
                   regime=torch.as_tensor(regime_labels(bars)[start:stop], dtype=torch.long, device=device),
                   start=start)

    def __len__(self) -> int:
        return len(self.prices)


class PortfolioTracker:
    """Per-account accumulators that outlive single trades (Kelly fraction, differential Sharpe)."""

    def __init__(self, n: int, device, *, decay: float = 0.05, dsr_eta: float = 0.01):
        self.decay, self.eta = decay, dsr_eta
        f = lambda v: torch.full((n,), v, dtype=torch.float64, device=device)  # noqa: E731
        self.win_rate, self.mean_win, self.mean_loss = f(0.5), f(0.01), f(0.01)
        self.dsr_a, self.dsr_b, self.dsr = f(0.0), f(1e-4), f(0.0)

    def kelly(self) -> torch.Tensor:
        """f* = p − (1 − p) / b, b = mean win / mean loss (Kelly 1956), clamped to [−1, 1]."""
        b = self.mean_win / self.mean_loss.clamp(min=1e-8)
        return (self.win_rate - (1.0 - self.win_rate) / b.clamp(min=1e-3)).clamp(-1.0, 1.0)

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
        var = (self.dsr_b - self.dsr_a ** 2).clamp(min=1e-10)
        d = (self.dsr_b * da - 0.5 * self.dsr_a * db) / var.pow(1.5)
        self.dsr = (1 - eta) * self.dsr + eta * d.clamp(-10.0, 10.0)
        self.dsr_a, self.dsr_b = self.dsr_a + eta * da, self.dsr_b + eta * db

    def soft_reset(self, mask: torch.Tensor, keep: float = 0.5) -> None:
        """Pull the selected accounts' accumulators halfway (`keep`) back toward their priors."""
        def pull(x, prior):
            return torch.where(mask, keep * x + (1 - keep) * prior, x)
        self.win_rate, self.mean_win = pull(self.win_rate, 0.5), pull(self.mean_win, 0.01)
        self.mean_loss, self.dsr = pull(self.mean_loss, 0.01), pull(self.dsr, 0.0)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("win_rate", "mean_win", "mean_loss", "dsr_a", "dsr_b", "dsr")}

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        for k, v in tensors.items():
            setattr(self, k, v.to(getattr(self, k).device).clone())


def portfolio_features(sim: Simulator, tracker: PortfolioTracker, market: MarketTensors) -> torch.Tensor:
    """The portfolio vector at the current close of each account, B × P float32 (`PORTFOLIO_FEATURES` order)."""
    t = sim.t
    vol, close = market.vol[t], market.prices.close[t]
    pos = sim.position
    in_trade = pos != 0
    zero = torch.zeros_like(pos)
    upnl = torch.where(in_trade, sim.trade_return_open / vol, zero).clamp(-20, 20) / 5.0
    bars = (sim.bars_in_trade.to(pos.dtype) / 50.0).clamp(max=4.0)
    side = torch.sign(pos)
    tp_d = torch.where(in_trade & torch.isfinite(sim.tp_price), side * (sim.tp_price / close - 1.0) / vol, zero)
    sl_d = torch.where(in_trade & torch.isfinite(sim.sl_price), side * (1.0 - sim.sl_price / close) / vol, zero)
    x = torch.stack([pos, upnl, bars, tp_d.clamp(-20, 20) / 10.0, sl_d.clamp(-20, 20) / 10.0, tracker.kelly(),
                     tracker.win_rate - 0.5, tracker.dsr.clamp(-5, 5)], dim=1)
    return x.float()


@dataclass
class StepRecord:
    """One decision of B accounts and what the simulator did with it (what `on_step` receives)."""

    t: torch.Tensor
    """Local bar of the decision, B."""
    portfolio: torch.Tensor
    """Portfolio vector at the decision, B × P."""
    regime: torch.Tensor
    """Regime label at the decision, B."""
    action: Action
    result: StepResult


def policy_step(agent: Agent, sim: Simulator, tracker: PortfolioTracker, market: MarketTensors,
                controls: PolicyControls, *, emb: torch.Tensor | None = None,
                force_flat: torch.Tensor | None = None, generator: torch.Generator | None = None) -> StepRecord:
    """The loop body: observe (window + portfolio) → `act` → `Simulator.step` → tracker update.

    `emb` (B × D) may be given when the embeddings were precomputed (evaluation); `force_flat` (B bool) sets the
    target to 0 (episode ends, end of data)."""
    t = sim.t.clone()
    if emb is None:
        emb = agent.encode(market.windows[t])
    port = portfolio_features(sim, tracker, market)
    regime = market.regime[t]
    a = act(agent, emb, port, position=sim.position, bars_in_trade=sim.bars_in_trade, vol=market.vol[t],
            regime=regime, controls=controls, generator=generator)
    if force_flat is not None:
        a.target = torch.where(force_flat, torch.zeros_like(a.target), a.target)
        a.branches[:, 0] = torch.where(force_flat & (a.target == 0), torch.ones_like(a.branches[:, 0]),
                                       a.branches[:, 0])
    res = sim.step(a.target, a.take_profit, a.stop_loss)
    tracker.update(res)
    return StepRecord(t=t, portfolio=port, regime=regime, action=a, result=res)


@torch.no_grad()
def run_rollout(agent: Agent, sim: Simulator, tracker: PortfolioTracker, market: MarketTensors,
                controls: PolicyControls, n_steps: int, *, on_step: Callable[[StepRecord], None] | None = None,
                force_flat: Callable[[], torch.Tensor] | None = None, emb_table: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> None:
    """Step all accounts `n_steps` times; after each step `on_step(record)` (trainer: rewards, replay, resets).

    `emb_table` (T × D, optional): precomputed market embeddings of every bar, read instead of encoding."""
    for _ in range(n_steps):
        rec = policy_step(agent, sim, tracker, market, controls,
                          emb=None if emb_table is None else emb_table[sim.t],
                          force_flat=None if force_flat is None else force_flat(), generator=generator)
        if on_step is not None:
            on_step(rec)


@dataclass
class PolicyRun:
    """A greedy pass of the agent over one bar range (one account)."""

    ledger: pd.DataFrame
    """Closed trades (`shared.execution.LEDGER_COLUMNS`), bar indices local to the range."""
    equity: np.ndarray
    """T: equity at each close."""
    bar_returns: np.ndarray
    """T: equity return over each bar (0 at bar 0)."""
    positions: np.ndarray
    """T: position held at each close."""
    decisions: pd.DataFrame
    """Per decision bar t (0..T−2): t, direction, size, exit, target, q, q_std, edge, cvar, blocked, regime."""
    quantiles: np.ndarray
    """(T−1) × M: IQN quantiles of the chosen direction at each decision (τ grid `agent.act_taus`)."""
    start: int
    """Global index of local bar 0."""


@torch.no_grad()
def evaluate_policy(agent: Agent, market: MarketTensors, controls: PolicyControls | None = None, *,
                    costs: CostModel = CostModel(), chunk: int = 2048) -> PolicyRun:
    """One continuous greedy pass over the whole range: encode every bar at once, then step the heads bar by bar.

    Open positions are closed at the last bar's close (exit_reason "end")."""
    agent.eval()
    dev = market.windows.device
    if controls is None:
        controls = PolicyControls.make(dev)
    T = len(market)
    emb = torch.cat([agent.encode(market.windows[i:i + chunk]) for i in range(0, T, chunk)])  # T × D
    sim = Simulator(market.prices, 1, costs, record_ledger=True)
    sim.reset(torch.zeros(1, dtype=torch.long, device=dev))
    tracker = PortfolioTracker(1, dev)
    eq = torch.ones(T, dtype=torch.float64, device=dev)
    br, pos = torch.zeros_like(eq), torch.zeros_like(eq)
    recs: list[StepRecord] = []
    for t in range(T - 1):
        rec = policy_step(agent, sim, tracker, market, controls, emb=emb[t:t + 1])
        eq[t + 1], br[t + 1], pos[t + 1] = sim.equity[0], rec.result.bar_return[0], rec.result.position[0]
        recs.append(rec)
    sim.close_all()
    cat = lambda f: torch.cat([f(r) for r in recs]).cpu().numpy() if recs else np.zeros(0)  # noqa: E731
    decisions = pd.DataFrame({
        "t": np.arange(T - 1), "direction": cat(lambda r: r.action.branches[:, 0]),
        "size": cat(lambda r: r.action.branches[:, 1]), "exit": cat(lambda r: r.action.branches[:, 2]),
        "target": cat(lambda r: r.action.target), "q": cat(lambda r: r.action.q),
        "q_std": cat(lambda r: r.action.q_std), "edge": cat(lambda r: r.action.edge),
        "cvar": cat(lambda r: r.action.cvar), "blocked": cat(lambda r: r.action.blocked),
        "regime": cat(lambda r: r.regime),
    })
    M = agent.cfg.iqn_quantiles_act
    quant = torch.cat([r.action.quantiles for r in recs]).cpu().numpy() if recs else np.zeros((0, M))
    return PolicyRun(ledger=sim.ledger(), equity=eq.cpu().numpy(), bar_returns=br.cpu().numpy(),
                     positions=pos.cpu().numpy(), decisions=decisions, quantiles=quant, start=market.start)
