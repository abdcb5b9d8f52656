"""The training environment around the simulator: rewards, position-gated episodes, weighted soft resets.

E accounts step through the training split (`shared.rollout.run_rollout`); `TrainEnv.on_step` turns each step
into a replay transition.

Reward of the step at decision bar t (return units, rewards enter replay raw):
    r_t = trade_return                        closed trades' net return, attributed when they close
        + micro · bar_return                  small positioning micro-reward (equity return over the bar)
        − churn · opened                      per new trade: discourages tiny trades
        − inaction · relu(edge) · stayed_flat inaction penalty ∝ the model's own predicted edge
Episodes: an account's episode is due after `episode_bars` steps and ends at the first flat close after that
(position-gated), or at once when a liquidation left the account no equity (`shared.execution`: it could trade no
more); past `episode_bars + grace_bars`, and near the end of the split, its target is forced flat.
An ended episode is a terminal transition; the account is soft-reset (equity 1, Kelly/DSR accumulators pulled
toward their priors) at a new start bar sampled with weights ∝ regime_weights[regime(start)] (E8).

ML core: imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.agent import MarketView
from shared.execution import Simulator
from shared.rollout import MarketTensors, PortfolioTracker, StepRecord, policy_step
from services.trainer.replay import Replay


@dataclass
class RewardConfig:
    """Weights of the reward terms (see the module docstring)."""

    micro: float = 0.2
    """Positioning micro-reward weight on the account's bar return."""
    churn: float = 2e-4
    """Penalty per opened trade (return units)."""
    inaction: float = 0.02
    """Inaction penalty per unit of predicted edge while staying flat."""
    episode_bars: int = 2000
    """Steps after which an episode ends at the next flat close."""
    grace_bars: int = 200
    """Extra steps after which the position is forced flat."""


class TrainEnv:
    """E accounts on the training split, with episode bookkeeping and the replay write."""

    def __init__(self, market: MarketTensors, n_envs: int, warmup: int, rewards: RewardConfig, replay: Replay,
                 costs, generator: torch.Generator):
        self.market, self.E, self.warmup, self.rc, self.replay = market, n_envs, warmup, rewards, replay
        self.gen = generator
        dev = market.windows.device
        self.sim = Simulator(market.prices, n_envs, costs)
        self.tracker = PortfolioTracker(n_envs, dev)
        self.steps_in_episode = torch.zeros(n_envs, dtype=torch.long, device=dev)
        self.start_weights = torch.ones(len(market), device=dev)
        self.start_cdf = torch.zeros(len(market), dtype=torch.float64, device=dev)
        self.set_regime_weights([1.0] * 9)
        # running statistics of the epoch (device tensors, read once per epoch)
        self.trade_sum = torch.zeros((), dtype=torch.float64, device=dev)
        self.trade_sq = torch.zeros_like(self.trade_sum)
        self.trade_n = torch.zeros_like(self.trade_sum)

    def set_regime_weights(self, weights) -> None:
        """E8: episode-start sampling weight of each bar ∝ weights[regime(bar)]; bars without room are 0."""
        w = torch.as_tensor(weights, dtype=torch.float32, device=self.start_weights.device)[self.market.regime]
        T = len(self.market)
        ok = torch.zeros(T, dtype=torch.bool, device=w.device)
        hi = max(self.warmup + 1, T - 64)
        ok[self.warmup:hi] = True
        w = torch.where(ok, w, torch.zeros_like(w))
        w = torch.where(w.sum() > 0, w, ok.float())
        self.start_weights.copy_(w)              # in place: a captured collection step reads this memory
        self.start_cdf.copy_(torch.cumsum(w.double(), 0))

    def sample_starts(self, n: int, u: torch.Tensor | None = None) -> torch.Tensor:
        """n start bars ∝ `start_weights` by inverse CDF of uniforms u (drawn from the generator unless given)."""
        if u is None:
            u = torch.rand(n, device=self.start_cdf.device, generator=self.gen)
        idx = torch.searchsorted(self.start_cdf, u.double() * self.start_cdf[-1], right=True)
        return idx.clamp(max=self.start_cdf.shape[0] - 1)

    def collect(self, agent, controls, n_steps: int, emb_table: torch.Tensor, noise: torch.Tensor,
                view_table: MarketView | None = None, per_bar: bool | None = None) -> None:
        """`n_steps` steps of every account: policy → simulator → reward → replay → episode resets.

        The policy reads each account's bar from `view_table` (every training bar's `MarketView`) when given, else
        runs the heads on `emb_table` (every training bar's embedding). noise: n_steps × E × 7 uniforms (6 for the
        policy's ε draws, 1 for the episode-start draw), drawn by the caller, so this body can be captured in a CUDA
        graph and replayed with fresh noise.

        Without a view table, when the accounts' steps outnumber the bars (E × n_steps ≥ T: many accounts share a
        bar), the heads run once per bar — `Agent.view_table` of the whole embedding table, computed now from the
        current weights — and each step reads its rows: the values the heads give per account-step, at T head
        evaluations instead of E × n_steps. `per_bar` forces either way (None: choose by that count)."""
        if view_table is None and (per_bar if per_bar is not None else self.E * n_steps >= emb_table.shape[0]):
            view_table = agent.view_table(emb_table)
        for i in range(n_steps):
            t = self.sim.t
            view = None if view_table is None else view_table.rows(t)
            rec = policy_step(agent, self.sim, self.tracker, self.market, controls, view=view,
                              emb=emb_table[t] if view is None else None, force_flat=self.force_flat(),
                              noise=noise[i, :, :6])
            self.on_step(rec, u_start=noise[i, :, 6])

    def reset_all(self) -> None:
        """Fresh episodes for every account (start of an epoch)."""
        self.sim.reset(self.sample_starts(self.E))
        self.steps_in_episode.zero_()

    def force_flat(self) -> torch.Tensor:
        """Accounts whose next target must be flat: overdue episodes, and the last bars of the split."""
        T = len(self.market)
        return (self.steps_in_episode >= self.rc.episode_bars + self.rc.grace_bars) | (self.sim.t >= T - 3)

    def on_step(self, rec: StepRecord, u_start: torch.Tensor | None = None) -> None:
        """Reward, episode end, replay write, soft reset of ended episodes (new starts drawn with `u_start`)."""
        res, a, rc = rec.result, rec.action, self.rc
        prev_flat = rec.portfolio[:, 0] == 0
        stayed_flat = prev_flat & (res.position == 0) & (a.branches[:, 0] == 1)
        reward = (res.trade_return + rc.micro * res.bar_return - rc.churn * res.opened.double()
                  - rc.inaction * a.edge.double().clamp(min=0) * stayed_flat.double())
        self.steps_in_episode += 1
        T = len(self.market)
        flat = res.position == 0
        done = flat & ((self.steps_in_episode >= rc.episode_bars) | (self.sim.t >= T - 2) | (self.sim.equity <= 0))
        self.replay.add(rec.t, rec.portfolio, a.branches, rec.regime, reward, done)
        self.trade_sum += res.trade_return.sum()        # 0 where no trade closed; two closes in a step: each
        self.trade_sq += res.trade_return_sq.sum()      # counts, with its own square
        self.trade_n += res.n_closed.double().sum()
        # soft reset of ended episodes
        self.sim.reset(self.sample_starts(self.E, u_start), mask=done)
        self.tracker.soft_reset(done)
        self.steps_in_episode = torch.where(done, torch.zeros_like(self.steps_in_episode), self.steps_in_episode)

    def pop_trade_stats(self) -> tuple[float, float]:
        """(per-trade Sharpe of trades closed since the last call (un-annualized, approx. from sums), count)."""
        n = float(self.trade_n)
        if n < 2:
            self.trade_sum.zero_(), self.trade_sq.zero_(), self.trade_n.zero_()
            return float("nan"), n
        mean = float(self.trade_sum) / n
        var = max(float(self.trade_sq) / n - mean * mean, 0.0) * n / (n - 1)
        self.trade_sum.zero_(), self.trade_sq.zero_(), self.trade_n.zero_()
        return (mean / var ** 0.5 if var > 0 else float("nan")), n
