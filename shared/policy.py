"""The policy step (`act`): the market view of B accounts' bars plus their portfolio → one action each, with
ε-greedy exploration and the protection stack; the action space's constants (`DIRECTION_SIDES`, `FLAT`) and the
knobs it reads (`PolicyControls`).

This is the reference of the policy: the trainer's environment and every torch evaluation pass call it, and the
evaluator's compiled loop (`shared/_native_pass.c`) reads its constants from the header `shared.native` generates
from this module, pinned to it by `tests/test_native_pass.py`.

ML core: imports only torch (and the standard library).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.portfolio import DSR_COLUMN, KELLY_COLUMN

if TYPE_CHECKING:
    from shared.agent import Agent, MarketView

BRANCH_NAMES = ("direction", "size", "exit")
DIRECTION_SIDES = (-1.0, 0.0, 1.0)
"""Direction action index → side (short, flat, long): the index of a side s is s + 1."""
SHORT, FLAT, LONG = (DIRECTION_SIDES.index(s) for s in (-1.0, 0.0, 1.0))
"""The direction action indices."""
MATURITY_FLOOR = 1e-3
"""The agent's maturity m is clamped to [MATURITY_FLOOR, 1] where the protection stack divides by it."""


def native_constants() -> dict[str, float]:
    """What the compiled loop's header takes from here (`shared.native`)."""
    return {"MATURITY_FLOOR": MATURITY_FLOOR}


@dataclass
class PolicyControls:
    """Device tensors the policy reads (the knobs of `act`), changed in place with `copy_`."""

    epsilon: torch.Tensor
    """ε of the ε-greedy exploration (0 for evaluation), per branch independently. Scalar."""
    gate_threshold: torch.Tensor
    """E5: no new entry where the ensemble std of Q of the chosen direction exceeds it (inf = off). Scalar."""
    regime_confidence: torch.Tensor
    """E9: size multiplier per regime, [N_REGIMES]."""

    @classmethod
    def make(cls, device, epsilon: float = 0.0, gate_threshold: float = math.inf,
             regime_confidence=None, n_regimes: int = 9) -> "PolicyControls":
        rc = [1.0] * n_regimes if regime_confidence is None else list(regime_confidence)
        f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
        return cls(epsilon=f(float(epsilon)), gate_threshold=f(float(gate_threshold)), regime_confidence=f(rc))

    def set(self, *, epsilon=None, gate_threshold=None, regime_confidence=None) -> None:
        """Write new values into the device tensors (no reallocation, so a captured graph keeps reading them)."""
        if epsilon is not None:
            self.epsilon.fill_(float(epsilon))
        if gate_threshold is not None:
            self.gate_threshold.fill_(float(gate_threshold))
        if regime_confidence is not None:
            self.regime_confidence.copy_(torch.as_tensor(regime_confidence, dtype=torch.float32))


@dataclass
class Action:
    """One decision for B accounts (all [B] unless noted)."""

    branches: torch.Tensor
    """Chosen action index per branch, B × 3 (direction, size, exit)."""
    target: torch.Tensor
    """Target position for `Simulator.step`, in [-1, 1]."""
    take_profit: torch.Tensor
    """Profit target as a fraction of the entry price (+inf = none); read by the simulator when a trade opens."""
    stop_loss: torch.Tensor
    """Stop as a fraction of the entry price (+inf = none)."""
    q: torch.Tensor
    """Ensemble-mean Q of the chosen direction (return units)."""
    q_std: torch.Tensor
    """Ensemble std of Q of the chosen direction: the epistemic uncertainty."""
    edge: torch.Tensor
    """Predicted edge of trading: max(Q_long, Q_short) − Q_flat (ensemble mean)."""
    cvar: torch.Tensor
    """CVaR_α of the chosen direction from the IQN quantiles."""
    quantiles: torch.Tensor
    """IQN quantiles of the chosen direction at the CVaR tail of the fixed grid (`act_taus` ≤ cvar_alpha), B × M_α:
    all that acting needs. The full grid is computed after the fact, batched (`shared.rollout.chosen_outputs`)."""
    blocked: torch.Tensor
    """A new entry was blocked by the protection stack (CVaR limit, E5 gate, regime confidence 0)."""


def in_commitment(side: torch.Tensor, bars_in_trade: torch.Tensor, min_hold: int, maturity: torch.Tensor
                  ) -> torch.Tensor:
    """Whether an open trade (side ±1; 0: flat) is still inside its commitment — fewer than min_hold · m bars old,
    m the risk head's maturity floored at `MATURITY_FLOOR` — so that no signal exits it: `act` holds it whatever
    direction is chosen, and the update's targets (`TrainConfig.feasible_targets`) choose only that one there."""
    return (side != 0) & (bars_in_trade < min_hold * maturity.clamp(MATURITY_FLOOR, 1.0))


@torch.no_grad()
def act(agent: Agent, view: MarketView, portfolio: torch.Tensor, *, position: torch.Tensor,
        bars_in_trade: torch.Tensor, vol: torch.Tensor, regime: torch.Tensor, controls: PolicyControls,
        generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> Action:
    """The policy: greedy on the ensemble-mean Q per branch, ε-greedy per branch, then the protection stack.

    view: the B market states' `MarketView` (rows of `Agent.view`), portfolio B × P, position B (current simulator
    position), bars_in_trade B (long), vol B (bar volatility, return units), regime B (long). The only network work
    here is the portfolio shift δ (`Agent.delta`, ~2 k multiply-adds a state): Q = view.q + δ, quantiles =
    view.tail + δ_direction. No host syncs, no Python branches on tensor values and no host-to-device copies, so a
    CUDA graph can capture it. `noise` (B × 6 uniforms in [0, 1): three ε draws, three random actions) is drawn from
    `generator` when not given; a captured step is handed noise drawn outside it.
    Protection stack, the constants scaled by m = agent.maturity (loose while the risk head is untrained):
      CVaR limit      — no new entry where CVaR_α(chosen direction) < −cvar_limit / m;
      epistemic gate  — no new entry where std_K Q(chosen direction) > gate_threshold   (E5: a threshold read off
                        this ensemble's own validation std, so in its units, not scaled);
      commitment      — an open trade is not exited by signal before min_hold · m bars;
      diff. Sharpe    — size × (1 − dsr_size_cut · m · clamp(−DSR, 0, 1)).
    """
    cfg = agent.cfg
    B, dev = portfolio.shape[0], portfolio.device
    delta = agent.delta(view.code, portfolio)                                               # B × (NB + 1)
    q_all = view.q + delta[:, :cfg.n_actions]                                               # B × NB
    q_mean = [q_all[:, sl] for sl in cfg.branch_slices()]                                   # [B × n_b]
    greedy = torch.stack([q.argmax(-1) for q in q_mean], dim=1)                             # B × 3
    # ε-greedy per branch: uniform random action with probability ε
    if noise is None:
        noise = torch.rand(B, 6, device=dev, generator=generator)
    n_act = agent.act_n
    rnd = (noise[:, 3:] * n_act).long().clamp(max=n_act.long() - 1)                         # B × 3, uniform
    branches = torch.where(noise[:, :3] < controls.epsilon, rnd, greedy)                    # B × 3
    d, s, e = branches.unbind(1)

    # predicted Q, disagreement and risk of the chosen direction (the shift moves every member alike: the std is
    # the market state's)
    q_std = view.q_std.gather(1, d.view(B, 1)).squeeze(1)
    edge = torch.maximum(q_mean[0][:, SHORT], q_mean[0][:, LONG]) - q_mean[0][:, FLAT]
    # CVaR_α = mean of the quantiles at the grid's tail τ_i ≤ α (the leading M_α of the M grid points: 3 of 32 by
    # default, `view.tail`); the full grid is for reporting (`shared.rollout.chosen_outputs`)
    n_tail = cfg.n_tail                                                                     # M_α (a Python int)
    quant = view.tail + delta[:, :3].unsqueeze(1)                                           # B × M_α × 3
    cvar_dir = quant.sum(1) / max(n_tail, 1)                                                # B × 3 (0 if M_α = 0)
    cvar = cvar_dir.gather(1, d.view(B, 1)).squeeze(1)

    # target position
    m = agent.maturity.clamp(MATURITY_FLOOR, 1.0)
    side = agent.act_sides.to(position.dtype)[d]                                            # B
    sizes = agent.act_sizes.to(position.dtype)[s]
    kelly = (cfg.kelly_floor + portfolio[:, KELLY_COLUMN].to(position.dtype)).clamp(cfg.kelly_floor, 1.0)
    dsr = portfolio[:, DSR_COLUMN].to(position.dtype)
    dsr_scale = 1.0 - cfg.dsr_size_cut * m * (-dsr).clamp(0.0, 1.0)
    conf = controls.regime_confidence[regime].to(position.dtype)
    new_target = side * sizes * kelly * dsr_scale * conf

    cur_side = torch.sign(position)
    entering = (side != 0) & (side != cur_side)
    committed = in_commitment(cur_side, bars_in_trade.float(), cfg.min_hold, m) & (side != cur_side)
    # commitment comes first: a young trade is held whatever the signal, so no entry is blocked there
    blocked = entering & ~committed & ((cvar < -cfg.cvar_limit / m) | (q_std > controls.gate_threshold)
                                       | (conf <= 0))
    target = torch.where((side == cur_side) & (cur_side != 0), position, new_target)        # hold, no resize
    target = torch.where(blocked, torch.zeros_like(target), target)
    target = torch.where(committed, position, target)

    # the direction actually taken (committed → current side, blocked → flat) is what is reported and learned
    d_eff = torch.where(committed, (cur_side + FLAT).long(), torch.where(blocked, torch.full_like(d, FLAT), d))
    branches = torch.stack([d_eff, s, e], dim=1)
    q = q_mean[0].gather(1, d_eff.view(B, 1)).squeeze(1)
    q_std = view.q_std.gather(1, d_eff.view(B, 1)).squeeze(1)
    quant_d = quant.gather(2, d_eff.view(B, 1, 1).expand(B, quant.shape[1], 1)).squeeze(2)      # B × M_α
    cvar = cvar_dir.gather(1, d_eff.view(B, 1)).squeeze(1)

    scale = vol.to(position.dtype)
    plans = agent.act_plans.to(position.dtype)                                              # n_exit × 2
    take_profit = plans[e, 0] * scale
    stop_loss = plans[e, 1] * scale
    return Action(branches=branches, target=target, take_profit=take_profit, stop_loss=stop_loss, q=q,
                  q_std=q_std, edge=edge, cvar=cvar, quantiles=quant_d, blocked=blocked)

