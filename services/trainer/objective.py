"""The objective: a batch and its targets → the loss, the detached metrics, the replay priorities. No optimizer
(as TorchRL's loss modules): `services.trainer.step` runs the backward pass and the optimizer on what this returns.

loss = mean_w(C51 + expectile_coef · expectile) + iqn_coef · IQN + q_centre_coef · centring + q_gap_coef · gap
       + hindsight_coef · hindsight − β · entropy

Owns: the online forward pass (the encoder with gradient on the first `encoder_batch` samples; the trunk state's
dropout), the C51 losses of every branch on each member's bootstrap mask, the IQN quantile Huber loss, the
expectile value head, the stability and hindsight terms, and the batch's scalars as two-level sums. Imports: torch,
`shared.agent`, `services.trainer.{config, buffers, targets, losses, fused_c51, replay}`.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from shared.agent import Agent
from services.trainer.buffers import UpdateBuffers
from services.trainer.config import TrainConfig
from services.trainer.fused_c51 import available as fused_c51_available
from services.trainer.losses import (C51_EPS, batch_sum, c51_branch_losses, c51_branch_losses_q, expectile_loss,
                                     quantile_huber_loss, top_two)
from services.trainer.replay import Batch
from services.trainer.targets import Targets, dropout_columns, iqn_rows, sample_horizons


class Objective(NamedTuple):
    """What `objective(batch, noise, targets, wait)` returns."""

    loss: torch.Tensor
    """The scalar to minimise (with gradient)."""
    metrics: dict[str, torch.Tensor]
    """Detached scalars: loss, c51, iqn, expectile, q_mean, entropy, utilisation."""
    priority: torch.Tensor
    """N: each sample's new replay priority (its direction branch's C51 loss, detached)."""
    utilisation: torch.Tensor
    """The batch's atom utilisation (what the entropy coefficient adapts to)."""


def dropout_keep(noise: torch.Tensor, cfg: TrainConfig) -> torch.Tensor | None:
    """The trunk state's dropout multipliers of a batch (`TrainConfig.dropout` p): 1 / (1 − p) where the noise's
    dropout column is ≥ p, else 0 (N × H); None without dropout."""
    if cfg.dropout <= 0:
        return None
    return (noise[:, dropout_columns(cfg)] >= cfg.dropout).float() / (1.0 - cfg.dropout)


def make_objective(agent: Agent, windows: torch.Tensor, buf: UpdateBuffers, cfg: TrainConfig
                   ) -> Callable[[Batch, torch.Tensor, Targets, Callable[[], None]], Objective]:
    """Build `objective(b, noise, targets, wait) -> Objective`. noise: N × `noise_width(cfg)` uniforms (ensemble
    mask, online τ, target τ); `wait()` is called after the online forward pass, before the first read of
    `targets` (they may be computed on a side stream: `runtime.StepRunner`)."""
    M, Hs = cfg.iqn_quantiles, sample_horizons(cfg)
    n_ens = agent.cfg.ensemble
    fused = cfg.fused_c51 and fused_c51_available(windows)

    def objective(b: Batch, noise: torch.Tensor, tg: Targets, wait: Callable[[], None]) -> Objective:
        N = b.bar.shape[0]
        z, v_max = agent.support, agent.v_max                                              # A
        # --- online network at s (the encoder learns from the first `encoder_batch` samples, a random subset) ---
        n_enc = min(cfg.encoder_batch or N, N)
        emb = agent.encode(windows[b.bar[:n_enc]])
        if n_enc < N:
            emb = torch.cat([emb, buf.emb_online[b.bar[n_enc:]].to(emb.dtype)])
        out = agent.head(emb, b.portfolio, dropout_keep(noise, cfg))
        # the portfolio shift of the taken action of every branch
        col = b.action + agent.branch_first                                                # N × NBR
        d_a = out.delta.gather(1, col)                                                     # N × NBR
        # IQN: the online quantiles of the taken direction at τ (shifted by δ_direction), on the first n_q samples
        n_q = iqn_rows(cfg, N)
        taus = noise[:n_q, n_ens:n_ens + M]                                                # n_q × M
        th = agent.quantiles(out.hidden[:n_q], taus).float() + out.delta[:n_q, :3].unsqueeze(1)  # n_q × M × 3
        th = th.gather(2, b.action[:n_q, 0].view(n_q, 1, 1).expand(n_q, M, 1)).squeeze(2)  # n_q × M
        # only what the losses read crosses `wait()`, a graph break when compiled: a live `out` would make every
        # field of it an output of the forward graph, and the trunk state and the shift, which reach the loss only
        # through the terms above, would get no gradient there and autograd would fill zeros for them.
        # The direction Q with the C51 terms where it pays, the fused kernels; compiled without them it is the
        # written-out chain: torch 2.11's CPU inductor got the gradients of the fused-in form wrong (the size and
        # exit branches' and V's; torch 2.13 exact; `test_compiled_update_equals_eager_on_one_batch`)
        q_in_c51 = cfg.direction_q_in_c51 and (fused or not torch.compiler.is_compiling())
        if q_in_c51:
            wide, d_dir, value_e = out.wide, out.delta[:, :3], out.value_e
        else:
            q_dir = agent.q_values(out.logits[:, :, :3], out.delta).mean(1)                # N × 3
            logits, value_e = out.logits, out.value_e
        del out
        wait()
        # --- C51 loss of every branch against its target; each ensemble member trains on its bootstrap mask ---
        # the distribution of (s, p, a): the market one with its atoms moved by the portfolio shift δ_a
        if q_in_c51:                    # with every member's direction Q, from the heads' padded output
            ce, ent_k, util_k, q_k = c51_branch_losses_q(wide, n_ens, col, d_a, tg.dist, z,
                                                         agent.cfg.branch_sizes, fused=fused)  # …, N × K × 3
            q_dir = (q_k + d_dir.unsqueeze(1)).mean(1)                                     # N × 3
        else:
            ce, ent_k, util_k = c51_branch_losses(logits, col, d_a, tg.dist, z, agent.cfg.branch_sizes,
                                                  fused=fused)                             # N × NBR × K, N × K
        member = (noise[:, :n_ens] < cfg.ensemble_mask_p).float()                          # N × K
        c51 = ((ce * member.unsqueeze(1)).sum(2) / member.sum(1, keepdim=True).clamp(min=1.0)).sum(1)  # N
        priority = ce[:, 0].mean(1).detach()
        if cfg.kl_priority:             # the KL: the cross-entropy less the target's own entropy (Rainbow)
            m = tg.dist[:, 0].float()                                                      # N × A
            priority = (priority + (m * torch.log(m.clamp(min=C51_EPS))).sum(-1)).clamp(min=0.0)
        # --- IQN quantile Huber on the direction branch (units of v_max, κ = `iqn_kappa`), blended over horizons ---
        qh = quantile_huber_loss((th / v_max).repeat_interleave(Hs, 0), (tg.quantiles / v_max).reshape(n_q * Hs, M),
                                 taus.repeat_interleave(Hs, 0), kappa=cfg.iqn_kappa)       # n_q·H'
        iqn = (qh.view(n_q, Hs) * tg.blend[:n_q]).sum(1)                                   # n_q
        # --- expectile value head on the blended scalar target of the direction branch ---
        y = tg.value
        expl = expectile_loss((y - value_e.float()) / v_max, cfg.expectile)               # N
        per_sample = c51 + cfg.expectile_coef * expl
        # --- the batch's scalars as sums over its rows, each in two levels (`batch_sum`): no reduction of a batch
        # scalar depends on another, so none of them waits for one thread block to loop over the whole batch ---
        first, second = top_two(q_dir)
        gap_n = (first - second) / v_max                                                   # N
        y0 = y[0].detach()                                        # a shift: the variance's sums without cancellation
        lab = buf.hindsight[b.bar]                                                         # N
        has = (lab >= 0).float()
        hce = torch.nn.functional.cross_entropy(q_dir / (0.1 * v_max), lab.clamp(min=0), reduction="none")
        s_loss, s_c51, s_expl, s_q, s_y, s_y2, s_gap, s_gap2, s_hce, s_has, s_ent, s_util, s_iqn_w, s_iqn = (
            batch_sum(r) for r in (b.weight * per_sample, c51, expl, q_dir.mean(1), y - y0, (y - y0).square(), gap_n,
                                   gap_n.square(), hce * has, has, ent_k.mean(1), util_k.mean(1),
                                   b.weight[:n_q] * iqn, iqn))
        ent, util = s_ent / N, s_util / N
        # --- stability terms on the online direction Q ---
        centre = ((s_q / N - (s_y / N + y0)) / v_max) ** 2
        y_std = ((s_y2 - s_y * s_y / N) / max(N - 1, 1)).clamp(min=0.0).sqrt()          # y.std(), unbiased
        gap_star = cfg.q_gap_frac * y_std / v_max
        gap = s_gap2 / N - 2.0 * gap_star * s_gap / N + gap_star * gap_star            # mean((gap_n − gap*)²)
        hind = s_hce / s_has.clamp(min=1.0)
        # the IQN term's mean over its n_q samples (all N unless `iqn_batch`): an unbiased estimate of its batch mean
        loss = (s_loss / N + cfg.iqn_coef * s_iqn_w / n_q + cfg.q_centre_coef * centre + cfg.q_gap_coef * gap
                + cfg.hindsight_coef * hind - buf.entropy_coef * ent)
        # the metrics, taken before the backward from detached tensors: a tensor that requires grad and is read
        # after the backward would be an output of the compiled forward that gets no gradient, and autograd fills
        # a zero gradient for each such output
        metrics = {"loss": loss.detach(), "c51": s_c51.detach() / N, "iqn": s_iqn.detach() / n_q,
                   "expectile": s_expl.detach() / N, "q_mean": s_q.detach() / N, "entropy": ent.detach(),
                   "utilisation": util.detach()}
        return Objective(loss, metrics, priority, util)

    return objective
