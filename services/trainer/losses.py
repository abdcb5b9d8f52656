"""Losses of the distributional agent: C51 projection and cross-entropy, IQN quantile Huber, expectile,
multi-horizon n-step returns, and the adaptive entropy bonus.

Every function is shape-static (no data-dependent control flow, no host syncs), so the update step that calls
them can be captured in a CUDA graph. Shape comments: N batch, K ensemble, A atoms, M / M' quantiles,
L reward steps, H horizons.

ML core: imports only torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F



def project_distribution(tz: torch.Tensor, probs: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """C51 projection Φ of a distribution on atoms `tz` onto `support` (Bellemare et al. 2017, Eq. 7).

    tz: ... × A' (target atoms T z_j = r + γ z_j), probs: ... × A' (their probabilities), support: A (uniform).
        (Φ p)_i = Σ_j clip(1 − |clip(T z_j, v_min, v_max) − z_i| / Δz, 0, 1) p_j
    Each clipped T z_j lies between two neighbouring atoms l = ⌊b_j⌋ and l + 1, b_j = (T z_j − v_min) / Δz, and only
    those two weights are non-zero (1 − (b_j − l) and b_j − l), so the mass is added to them with two scatter-adds:
    O(A') per distribution instead of the dense A × A' weights (`projection_weights`, the same numbers; it was the
    update's largest fused kernel on the H200 at batch 4096). Returns ... × A (no gradient through tz: targets).
    """
    lo, frac = lower_neighbour(tz, support)                                                # ... × A' each
    m = torch.zeros(*tz.shape[:-1], support.shape[0], dtype=probs.dtype, device=probs.device)
    m.scatter_add_(-1, lo, probs * (1.0 - frac))
    return m.scatter_add_(-1, lo + 1, probs * frac)                                         # ... × A


def lower_neighbour(tz: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For atoms at `tz` (clipped to the support): the index l of the support atom at or below each, at most A − 2,
    and its fraction of the way to atom l + 1, in [0, 1] (differentiable in tz inside the support, where the hat
    weights 1 − frac and frac are linear) — the two non-zero weights of the projection onto a uniform support."""
    A = support.shape[0]
    v_min, v_max = support[0], support[-1]
    b = ((tz.clamp(v_min, v_max) - v_min) / ((v_max - v_min) / (A - 1))).clamp(0, A - 1)  # in [0, A − 1]
    lower = b.detach().floor().clamp(max=A - 2)                          # b = A − 1: weight 1 on the top atom
    return lower.long(), b - lower


def projection_weights(tz: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The weights of Φ: w_ij = clip(1 − |clip(tz_j, v_min, v_max) − z_i| / Δz, 0, 1), tz ... × A' → ... × A × A'.
    The dense definition: `project_distribution` and `shift_distribution` compute only its non-zero part, and the
    tests check both against it (no training path calls it since session 13)."""
    v_min, v_max = support[0], support[-1]
    dz = (v_max - v_min) / (support.shape[0] - 1)                                         # Δz
    tz = tz.clamp(v_min, v_max).unsqueeze(-2)                                              # ... × 1 × A'
    return (1.0 - (tz - support.unsqueeze(-1)).abs() / dz).clamp(0.0, 1.0)                 # ... × A × A'


def shift_distribution(probs: torch.Tensor, delta: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The distributions `probs` (N × K × A on `support`) with their atoms moved by δ (N: one shift per sample, the
    same for its K members) and projected back onto the support: Φ(z + δ) — the agent's portfolio shift
    (`shared.agent.Agent.delta`). Differentiable in probs and δ (the projection weights are piecewise linear in δ).
    Mass pushed past an end of the support piles on that end, as in the C51 projection. Returns N × K × A (fp32).

    The hat weights w_ij = clip(1 − |clip(z_j + δ, v_min, v_max) − z_i| / Δz, 0, 1) of `projection_weights`, written
    with the same float operations, but only on the band of four support atoms i = ⌊b_j⌋ − 1 … ⌊b_j⌋ + 2 around each
    source atom (b_j = (clip(z_j + δ) − v_min) / Δz), and added with one scatter-add: O(4A) per distribution, not
    the dense A × A weights and a batched A × A product per row (on the H200 at batch 4 096 those and their backward
    were ~0.4 ms of a 2.3-ms update, bench/train_profile.py, session 13). Off the band |z_j + δ − z_i| ≥ 2Δz − ε, so
    the dense weight is 0 and so is its subgradient (clip passes none below its interval): values and gradients are
    the dense form's, up to the order of float additions (tests/test_losses.py checks both, at kinks too).

    Why the dense form's subgradients and not `project_distribution`'s two weights per atom: the shift starts at
    δ = 0 — every atom on a kink, where the two-weight form's gradient in δ is one-sided (−p_j at l, +p_j at l + 1)
    and the dense form's is central (−p_j at l − 1, +p_j at l + 1, none at l: |x|' = 0 at 0). On the CPU learning
    bench (session 8, seeds 0–5) the two-weight form reached a mean OOS per-trade Sharpe of 0.37 (target met in 1 seed
    of 6) against 0.66 (5 of 6) for the dense one. The band keeps the dense form's subgradients: the clips and the
    absolute value are the same elementwise functions, evaluated on every pair where they can be non-zero."""
    N, K, A = probs.shape
    v_min, v_max = support[0], support[-1]
    dz = (v_max - v_min) / (A - 1)                                                          # Δz
    tz = (support.unsqueeze(0) + delta.float().unsqueeze(1)).clamp(v_min, v_max)            # N × A' (source atoms)
    band = torch.arange(-1, 3, device=support.device)               # (an arange, not a host list: capturable)
    i = ((tz.detach() - v_min) / dz).floor().long().unsqueeze(-1) + band                   # N × A' × 4
    on = (i >= 0) & (i < A)
    i = i.clamp(0, A - 1)
    w = (1.0 - (tz.unsqueeze(-1) - support[i]).abs() / dz).clamp(0.0, 1.0) * on           # N × A' × 4
    contrib = probs.float().unsqueeze(-1) * w.unsqueeze(1)                                  # N × K × A' × 4
    idx = i.view(N, 1, -1).expand(N, K, -1)
    return probs.new_zeros(N, K, A, dtype=torch.float32).scatter_add(-1, idx, contrib.reshape(N, K, -1))


def c51_cross_entropy_probs(probs: torch.Tensor, target_probs: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """−Σ_i m_i log p_i(s, a) of predicted probabilities (a shifted distribution, `shift_distribution`), no gradient
    through the target: ... × A → ...."""
    return -(target_probs.detach() * torch.log(probs.clamp(min=eps))).sum(-1)


def quantile_huber_loss(pred: torch.Tensor, target: torch.Tensor, taus: torch.Tensor,
                        kappa: float = 1.0) -> torch.Tensor:
    """IQN loss (Dabney et al. 2018, Eq. 3 and 10) for N samples.

    pred N × M (θ at taus), target N × M' (no gradient), taus N × M.
        u_ij = target_j − pred_i                                                           # N × M × M'
        L_κ(u) = ½u² if |u| ≤ κ else κ(|u| − ½κ)
        ρ_τ(u) = |τ − 1{u < 0}| L_κ(u) / κ
    Loss per sample = Σ_i mean_j ρ_τi(u_ij). Returns N.
    """
    u = target.detach().unsqueeze(1) - pred.unsqueeze(2)                                  # N × M × M'
    au = u.abs()
    huber = torch.where(au <= kappa, 0.5 * u * u, kappa * (au - 0.5 * kappa))
    weight = (taus.unsqueeze(2) - (u < 0).to(u.dtype)).abs()                              # N × M × M'
    return (weight * huber / kappa).mean(2).sum(1)


def expectile_loss(diff: torch.Tensor, expectile: float) -> torch.Tensor:
    """IQL expectile loss L_τ(u) = |τ − 1{u < 0}| u², u = target − prediction (elementwise)."""
    weight = torch.where(diff < 0, 1.0 - expectile, expectile)
    return weight * diff * diff


def nstep_returns(rewards: torch.Tensor, dones: torch.Tensor, gamma: torch.Tensor,
                  horizons: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted n-step returns and bootstrap discounts for several horizons at once.

    rewards N × L, dones N × L (transition l ends its episode), gamma a scalar tensor, L ≥ max(horizons).
        R^(h)  = Σ_{l<h} γ^l r_l Π_{j<l} (1 − d_j)      (rewards after an episode end are not counted)
        disc^(h) = γ^h Π_{l<h} (1 − d_l)                (0 when the episode ended within h steps)
    Returns (R N × H, disc N × H).
    """
    L = rewards.shape[1]
    alive = torch.cumprod(1.0 - dones.to(rewards.dtype), dim=1)                            # N × L: alive after l
    alive_before = torch.cat([torch.ones_like(alive[:, :1]), alive[:, :-1]], dim=1)        # N × L
    powers = gamma ** torch.arange(L, device=rewards.device, dtype=rewards.dtype)          # L
    disc_r = rewards * alive_before * powers                                               # N × L
    csum = torch.cumsum(disc_r, dim=1)                                                     # N × L
    # horizons are static: basic indexing (views), no index tensor copied from the host inside a graph
    R = torch.stack([csum[:, h - 1] for h in horizons], dim=1)                             # N × H
    disc = torch.stack([gamma ** h * alive[:, h - 1] for h in horizons], dim=1)            # N × H
    return R, disc


def atom_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy −Σ p log p of each C51 distribution: ... × A → ...."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def atom_utilisation(logits: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """Fraction of atoms holding more than `threshold / A` of the mass, averaged: ... × A → scalar."""
    A = logits.shape[-1]
    return (torch.softmax(logits, dim=-1) > threshold / A).float().mean()


@torch.no_grad()
def adapt_entropy_coef(coef: torch.Tensor, utilisation: torch.Tensor, target: float, rate: float,
                       lo: float = 1e-5, hi: float = 1e-1) -> None:
    """In place: β ← clamp(β · exp(rate · (target − utilisation)), lo, hi). Raises β while atoms go unused."""
    coef.mul_(torch.exp(rate * (target - utilisation))).clamp_(lo, hi)
