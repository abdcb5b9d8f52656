"""The update's no-grad targets: double-Q at the bootstrap states (the online network selects the greedy action of
each branch, the target network evaluates it), the n-step returns, and from them the C51, IQN and scalar targets.

Owns: `Targets`, how many horizons and IQN rows a sample has, the layout of an update's uniforms (`noise_width`)
and `make_targets`. Imports: torch, `shared.{agent, policy, portfolio}`, `services.trainer.{config, buffers, losses,
fused_c51, replay}`. Reads parameters, tables and the batch; writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from shared.agent import Agent
from shared.policy import FLAT, in_commitment
from shared.portfolio import BARS_SCALE
from services.trainer.buffers import UpdateBuffers
from services.trainer.config import TrainConfig
from services.trainer.fused_c51 import available as fused_c51_available
from services.trainer.losses import evaluate_columns, greedy_columns, greedy_next, nstep_returns, project_distribution
from services.trainer.replay import Batch


INFEASIBLE_Q = 1e6
"""Subtracted from the online Q of a direction the policy cannot take at a bootstrap state
(`TrainConfig.feasible_targets`), so that the double-Q selection never picks it (Q is in return units)."""


def infeasible_directions(agent: Agent, portfolio: torch.Tensor) -> torch.Tensor:
    """R × 3 (short, flat, long): INFEASIBLE_Q where the state's trade is inside its commitment
    (`shared.policy.in_commitment`, the rule `act` applies) and the direction is not the held one, else 0;
    portfolio R × P (the replay's vectors: position, …, bars in trade / BARS_SCALE, …)."""
    side = torch.sign(portfolio[:, 0])
    young = in_commitment(side, torch.round(portfolio[:, 2] * BARS_SCALE), agent.cfg.min_hold, agent.maturity)
    held = (side + FLAT).long().unsqueeze(1)                                               # R × 1
    other = torch.arange(3, device=portfolio.device).unsqueeze(0) != held                  # R × 3
    return (young.unsqueeze(1) & other).to(torch.float32) * INFEASIBLE_Q


def mask_directions(x: torch.Tensor, penalty: torch.Tensor | None) -> torch.Tensor:
    """x (R × ≥ 3: the direction branch's columns first) less `penalty` (R × 3) on those columns; x if None."""
    if penalty is None:
        return x
    return torch.cat([x[:, :3] - penalty.to(x.dtype), x[:, 3:]], dim=1)


@dataclass
class Targets:
    """The no-grad targets of a batch of N samples (`make_targets`): what the update's losses compare its online
    predictions with. Computed apart from the online forward pass so that, on CUDA, they can run beside it on a
    side stream (`runtime.StepRunner`)."""

    dist: torch.Tensor
    """N × NBR × A: the C51 target of each branch (the projected next distribution of its greedy action, blended over
    the horizons)."""
    quantiles: torch.Tensor
    """N_q × H' × M': the IQN targets R + disc · θ'(s_h, a*, τ') of the direction branch at each sample's H'
    horizons (all H, or the one drawn: `TrainConfig.horizon_sample`), for the first N_q samples (`iqn_rows`: all N
    unless `TrainConfig.iqn_batch`)."""
    value: torch.Tensor
    """N: the blended scalar target Σ_h w_h (R + disc · Q'(s_h, a*)) of the direction branch (expectile and
    stability terms)."""
    blend: torch.Tensor
    """N × H': the weights of those horizons (the sample's regime's `horizon_blend` row, or 1 for the one drawn)."""

    FIELDS = ("dist", "quantiles", "value", "blend")

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]


def sample_horizons(cfg: TrainConfig) -> int:
    """H': the bootstrap horizons of each sample — all H, or the one drawn (`horizon_sample`)."""
    return 1 if cfg.horizon_sample else len(cfg.horizons)


def iqn_rows(cfg: TrainConfig, n: int) -> int:
    """Samples of a batch of n on which the IQN loss is computed (`iqn_batch`)."""
    return min(cfg.iqn_batch or n, n)


def noise_width(cfg: TrainConfig) -> int:
    """Uniforms per sample that an update reads (`step.make_update`): K ensemble-mask draws, M online τ, then M' target τ
    at each of the sample's H' bootstrap horizons (and, with `horizon_sample`, the draw of that horizon), then with
    `dropout` the H of the trunk state's dropout mask (`dropout_columns`)."""
    cols = dropout_columns(cfg)
    return cols.stop if cfg.dropout > 0 else cols.start


def dropout_columns(cfg: TrainConfig) -> slice:
    """The columns of an update's noise that draw its dropout mask (`TrainConfig.dropout`): the last H."""
    start = cfg.agent.ensemble + cfg.iqn_quantiles * (1 + sample_horizons(cfg)) + int(cfg.horizon_sample)
    return slice(start, start + cfg.agent.hidden)


def make_targets(agent: Agent, target: Agent, buf: UpdateBuffers, cfg: TrainConfig
                 ) -> Callable[[Batch, torch.Tensor], Targets]:
    """Build `targets(batch, noise) -> Targets`: double-Q at the bootstrap states (the online network selects the
    greedy action of each branch on the cached embeddings or view, the target network evaluates it), the n-step
    returns, and from them the C51, IQN and scalar targets. N·H bootstrap states, or N with `horizon_sample`. Reads
    parameters, tables and the batch; writes nothing."""
    horizons = cfg.horizons
    H, M, K = len(horizons), cfg.iqn_quantiles, agent.cfg.ensemble
    Hs = sample_horizons(cfg)                                                              # H' horizons per sample
    NBR = len(agent.cfg.branch_sizes)
    fused = cfg.fused_targets and fused_c51_available(agent.v_max)

    @torch.no_grad()
    def targets(b: Batch, noise: torch.Tensor) -> Targets:
        N = b.bar.shape[0]
        z = agent.support                                                                  # A
        R, disc = nstep_returns(b.rewards.double(), b.dones, buf.gamma.double(), horizons)  # N × H
        # E1: Q's fixed point moves by −q_bias (return units) — Q − b = (R − b·(1 − disc)) + disc·(Q' − b) — so
        # each backup takes b·(1 − disc), not b (which would move it by b / (1 − γ^h): ×100 at h = 1, γ = 0.99)
        R, disc = (R - buf.q_bias * (1.0 - disc)).float(), disc.float()
        w_h = buf.horizon_blend[b.regime]                                                  # N × H
        next_bar, next_pf = b.next_bar, b.next_portfolio                                   # N × H, N × H × P
        if cfg.horizon_sample:
            # one horizon per sample, drawn from its regime's blend (inverse CDF; rows sum to 1)
            u = noise[:, K + 2 * M:K + 2 * M + 1]                                          # N × 1
            h = (u >= w_h.cumsum(1)).sum(1, keepdim=True).clamp(max=H - 1)                  # N × 1
            R, disc, next_bar = R.gather(1, h), disc.gather(1, h), next_bar.gather(1, h)
            next_pf = next_pf.gather(1, h.unsqueeze(-1).expand(-1, -1, next_pf.shape[2]))
            w_h = torch.ones_like(R)                                                       # N × 1
        nb, npf = next_bar.reshape(-1), next_pf.reshape(N * Hs, -1)                        # n-major: N·H' rows
        # only the held direction where acting would hold a young trade whatever it chose (`feasible_targets`)
        pen = infeasible_directions(agent, npf) if cfg.feasible_targets else None          # N·H' × 3
        tg_n = target.head(buf.emb_target[nb], npf)                                         # cached embeddings
        # the greedy next action of each branch (as a column among the NB actions), chosen by the online network;
        # the ensemble shares one target: the target members' mean next distribution at the greedy action (the
        # softmax is over atoms, per action: taken of the greedy actions' logits alone), all branches at once, and
        # the target's portfolio shift there (its atoms sit at z + δ')
        if buf.view_online is not None:
            # the online selection reads the cached market view of the next bars (as stale as the cached
            # embeddings it would otherwise run the heads on) plus the current portfolio shift
            vn = buf.view_online.rows(nb)
            q_on = mask_directions(vn.q + agent.delta(vn.code, npf)[:, :agent.cfg.n_actions], pen)  # N·H' × NB
            col = greedy_columns(q_on, agent.cfg.branch_sizes)                             # N·H' × NBR
            p_next, d_star = evaluate_columns(tg_n.logits, tg_n.delta, col)
        else:
            on_n = agent.head(buf.emb_online[nb], npf)
            col, p_next, d_star = greedy_next(on_n.logits, mask_directions(on_n.delta, pen), tg_n.logits,
                                              tg_n.delta, z, agent.cfg.branch_sizes, fused=fused)
        p_next = p_next.view(N, Hs, NBR, -1).transpose(1, 2)                               # N × NBR × H' × A
        d_star = d_star.view(N, Hs, NBR).transpose(1, 2)                                   # N × NBR × H'
        # blended over horizons before the projection (Φ is linear in the probabilities)
        p_w = (p_next * w_h.view(N, 1, Hs, 1)).reshape(N, NBR, -1)                         # N × NBR × H'·A
        tz = R.view(N, 1, Hs, 1) + disc.view(N, 1, Hs, 1) * (z + d_star.unsqueeze(-1))     # N × NBR × H' × A
        dist = project_distribution(tz.reshape(N, NBR, -1), p_w, z)                        # N × NBR × A
        # the target's Q of the greedy direction, Σ_i z_i p_i + δ' → the scalar target
        q_tn = (p_next[:, 0] * z).sum(-1) + d_star[:, 0]                                   # N × H'
        value = ((R + disc * q_tn) * w_h).sum(1)                                           # N
        # IQN: the target's quantiles of the greedy direction at τ' (shifted by δ'_direction)
        # (for the first n_q samples only: `iqn_batch`; rows are n-major, so theirs are the first n_q·H')
        n_q = iqn_rows(cfg, N)
        rq = slice(0, n_q * Hs)
        taus_t = noise[:n_q, K + M:K + M + Hs * M].reshape(n_q * Hs, M)                    # n-major, like nb
        th_n = target.quantiles(tg_n.hidden[rq], taus_t).float() + tg_n.delta[rq, :3].unsqueeze(1)  # n_q·H' × M × 3
        th_n = th_n.gather(2, col[rq, 0].view(n_q * Hs, 1, 1).expand(-1, M, 1)).view(n_q, Hs, M)
        quantiles = R[:n_q].unsqueeze(-1) + disc[:n_q].unsqueeze(-1) * th_n                # n_q × H' × M
        return Targets(dist=dist, quantiles=quantiles, value=value, blend=w_h)

    return targets
