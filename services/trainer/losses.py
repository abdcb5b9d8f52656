"""Losses of the distributional agent: C51 projection and cross-entropy, IQN quantile Huber, expectile,
multi-horizon n-step returns, and the adaptive entropy bonus.

Every function is shape-static (no data-dependent control flow, no host syncs), so the update step that calls
them can be captured in a CUDA graph. Shape comments: N batch, K ensemble, A atoms, M / M' quantiles,
L reward steps, H horizons.

ML core: imports only torch.
"""
from __future__ import annotations

import math

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
    # out of place: under torch.func.vmap over runs the zeros are one run's and the mass every run's
    m = m.scatter_add(-1, lo, probs * (1.0 - frac))
    return m.scatter_add(-1, lo + 1, probs * frac)                                          # ... × A


def atom_step(support: torch.Tensor) -> torch.Tensor:
    """Δz = (v_max − v_min) / (A − 1) of an evenly spaced support."""
    return (support[-1] - support[0]) / (support.shape[0] - 1)


def lower_neighbour(tz: torch.Tensor, support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For atoms at `tz` (clipped to the support): the index l of the support atom at or below each, at most A − 2,
    and its fraction of the way to atom l + 1, in [0, 1] (differentiable in tz inside the support, where the hat
    weights 1 − frac and frac are linear) — the two non-zero weights of the projection onto a uniform support."""
    A = support.shape[0]
    v_min, v_max = support[0], support[-1]
    b = ((tz.clamp(v_min, v_max) - v_min) / atom_step(support)).clamp(0, A - 1)          # in [0, A − 1]
    lower = b.detach().floor().clamp(max=A - 2)                          # b = A − 1: weight 1 on the top atom
    return lower.long(), b - lower


def projection_weights(tz: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The weights of Φ: w_ij = clip(1 − |clip(tz_j, v_min, v_max) − z_i| / Δz, 0, 1), tz ... × A' → ... × A × A'.
    The dense definition: `project_distribution` and `shift_distribution` compute only its non-zero part, and the
    tests check both against it (no training path calls it)."""
    tz = tz.clamp(support[0], support[-1]).unsqueeze(-2)                                   # ... × 1 × A'
    return (1.0 - (tz - support.unsqueeze(-1)).abs() / atom_step(support)).clamp(0.0, 1.0)  # ... × A × A'


def shift_distribution(probs: torch.Tensor, delta: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """The distributions `probs` (N × K × A on `support`) with their atoms moved by δ (N: one shift per sample, the
    same for its K members) and projected back onto the support: Φ(z + δ) — the agent's portfolio shift
    (`shared.agent.Agent.delta`). Differentiable in probs and δ (the projection weights are piecewise linear in δ).
    Mass pushed past an end of the support piles on that end, as in the C51 projection. Returns N × K × A (fp32).

    Values and subgradients are those of the dense hat weights w_ij = clip(1 − |clip(z_j + δ, v_min, v_max) − z_i|
    / Δz, 0, 1), written in atom units: clip(1 − |clip(j + δ / Δz, 0, A − 1) − i|, 0, 1) (the same function on an
    evenly spaced support, without the support values' rounding: exact at δ = 0, `_shift_pairs`; tests/test_losses.py
    checks both, at kinks too), computed as gathers, not as the dense A × A products nor as a scatter
    (`_ShiftGather`).

    Why the dense form's subgradients and not `project_distribution`'s two weights per atom: the shift starts at
    δ = 0 — every atom on a kink, where the two-weight form's gradient in δ is one-sided (−p_j at l, +p_j at l + 1)
    and the dense form's is central (−p_j at l − 1, +p_j at l + 1, none at l: |x|' = 0 at 0). On the CPU learning
    bench (seeds 0–5) the two-weight form reached a mean OOS per-trade Sharpe of 0.37 (target met in 1 seed
    of 6) against 0.66 (5 of 6) for the dense one."""
    return _ShiftGather.apply(probs.float(), delta.float(), support)


def _shift_pairs(delta: torch.Tensor, support: torch.Tensor, transpose: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (output atom i, source atom j) pairs of Φ(z + δ) where a source atom inside the support (v_min ≤ z_j + δ ≤
    v_max) can have a non-zero hat weight or subgradient: |z_j + δ − z_i| ≤ Δz, so j − i ∈ [−u − 1, −u + 1] for
    u = δ / Δz — within the four taps j = i − ⌊u⌋ + t, t = −2 … 1 (one tap of margin for rounding).
    transpose=False: for each output i, its four sources (gather the probabilities); True: for each source j, its
    four outputs i = j + ⌊u⌋ − t (gather the gradient). Returns (the other atom's index N × A × 4, clamped into the
    support; w_ij; ∂w_ij/∂(z_j + δ)), both 0 on pairs off the support or with a source outside it.

    Computed in atom units (`shift_position`): the pair's distance (z_j + δ − z_i) / Δz is (j − i) + u, with u =
    δ / Δz, not the difference of two support values, which carry the support's rounding. At δ = 0, where the shift
    starts (its last layer is zero-initialised), every source sits on a kink, and whether a neighbour's subgradient
    counts (h = 1 − |d| / Δz exactly 0) was decided by that rounding — differently eager and compiled (the last
    layer's gradient 57 % apart on the VM, tests/test_train_graph.py). In atom units h is exactly 0
    there, so the subgradient is the central one everywhere."""
    A, dz = support.shape[0], atom_step(support)
    u = delta / dz                                                                        # N
    s = torch.floor(u).clamp(-A - 2, A + 2).long()                                        # N: ⌊u⌋
    atom = torch.arange(A, device=support.device)
    taps = torch.arange(-2, 2, device=support.device)               # (an arange, not a host list: capturable)
    if transpose:                                                   # for each source j, its outputs j + ⌊u⌋ − t
        j = atom.view(1, A, 1)
        i = j + s.view(-1, 1, 1) - taps                                                   # N × A × 4
        other, i_c = i, i.clamp(0, A - 1)
    else:                                                           # for each output i, its sources i − ⌊u⌋ + t
        i = atom.view(1, A, 1)
        j = i - s.view(-1, 1, 1) + taps                                                   # N × A × 4
        other, j_c = j, j.clamp(0, A - 1)
    x = j + u.view(-1, 1, 1)                                        # the source's position z_j + δ, in atoms
    valid = (other >= 0) & (other < A) & (x >= 0) & (x <= A - 1)    # the clip passes a gradient on its ends too
    d = x - i                                                                             # (z_j + δ − z_i) / Δz
    h = 1.0 - d.abs()
    w = h.clamp(0.0, 1.0) * valid
    dw = torch.where(valid & (h >= 0.0), -torch.sign(d) / dz, torch.zeros_like(d))       # clip(h, 0, 1)' · |d|'
    return (i_c if transpose else j_c), w, dw


def shift_position(delta: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Where each support atom lands under the shift δ (N), in atom units: j + δ / Δz, N × A (v_min ≤ z_j + δ ≤
    v_max ⟺ 0 ≤ position ≤ A − 1)."""
    A = support.shape[0]
    return torch.arange(A, device=support.device) + (delta / atom_step(support)).unsqueeze(1)


class _ShiftGather(torch.autograd.Function):
    """Φ(z + δ) of `shift_distribution` with the dense form's values and subgradients, without its A × A weights and
    without atomics. Forward: each output atom gathers its four candidate sources (`_shift_pairs`), plus the mass of
    the source atoms past each end of the support (clipped: weight 1 on that end atom and no gradient in δ).
    Backward: each source atom gathers the gradient of its four candidate outputs (the transposed pairs, the same
    weights), and ∂/∂δ sums p_j · g_i · ∂w_ij/∂(z_j + δ) over the pairs. Autograd of a gather would scatter-add its
    gradient: the update's largest kernel on the H200 was the band form's scatter-add (124 µs at batch 4 096), where
    these gathers take ~35 µs a pass (bench/train_profile.py --trace). Every tensor op here is
    elementwise, a gather or a sum, so compiled it fuses into a few kernels."""

    generate_vmap_rule = True        # under torch.func.vmap (one loss for several runs) forward and backward are vmapped

    @staticmethod
    def forward(probs: torch.Tensor, delta: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
        N, K, A = probs.shape
        src, w, _ = _shift_pairs(delta, support, transpose=False)                          # N × A × 4
        gathered = probs.gather(2, src.view(N, 1, A * 4).expand(N, K, A * 4)).view(N, K, A, 4)
        out = (gathered * w.unsqueeze(1)).sum(-1)                                          # N × K × A
        x = shift_position(delta, support)                                                 # N × A: z_j + δ
        low = (probs * (x < 0).unsqueeze(1)).sum(-1)                                       # N × K: past v_min
        high = (probs * (x > A - 1).unsqueeze(1)).sum(-1)                                  # past v_max
        atom = torch.arange(A, device=probs.device)
        return out + low.unsqueeze(-1) * (atom == 0) + high.unsqueeze(-1) * (atom == A - 1)

    @staticmethod
    def setup_context(ctx, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, delta, support = ctx.saved_tensors
        N, K, A = probs.shape
        dst, w, dw = _shift_pairs(delta, support, transpose=True)                          # N × A × 4
        g = grad.gather(2, dst.view(N, 1, A * 4).expand(N, K, A * 4)).view(N, K, A, 4)   # g_i of each pair
        grad_p = (g * w.unsqueeze(1)).sum(-1)                                              # Σ_i w_ij g_i
        x = shift_position(delta, support)
        grad_p = (grad_p + (x < 0).unsqueeze(1) * grad[:, :, :1] + (x > A - 1).unsqueeze(1) * grad[:, :, A - 1:])
        grad_d = (probs * (g * dw.unsqueeze(1)).sum(-1)).sum((1, 2))                       # N
        return grad_p, grad_d, None


def c51_branch_losses(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor,
                      support: torch.Tensor, branch_sizes: tuple[int, ...], fused: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The update's C51 terms of the taken actions: `c51_branch_losses_reference`, or with `fused` (CUDA) the same
    numbers from two Triton kernels (`services.trainer.fused_c51`)."""
    if fused:
        from services.trainer.fused_c51 import c51_branch_losses_fused
        return c51_branch_losses_fused(logits, col, delta, target, support, branch_sizes)
    return c51_branch_losses_reference(logits, col, delta, target, support)


def c51_branch_losses_reference(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor,
                                support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For N samples and their taken action of each branch (col N × NBR, columns of the N × K × NB × A market logits):
    each ensemble member's distribution p = softmax(logits) moved by the portfolio shift (delta N × NBR,
    `shift_distribution`), and its cross-entropy against the branch's target (N × NBR × A) → N × NBR × K; plus the
    entropy and the atom utilisation (`atom_utilisation`) of the direction branch's p → N × K each (no gradient
    through the utilisation)."""
    N, K, _, A = logits.shape
    NBR = col.shape[1]
    logits_a = logits.gather(2, col.view(N, 1, NBR, 1).expand(-1, K, -1, A)).transpose(1, 2).float()  # N×NBR×K×A
    probs = shift_distribution(torch.softmax(logits_a, -1).reshape(N * NBR, K, A), delta.reshape(-1), support)
    ce = c51_cross_entropy_probs(probs.view(N, NBR, K, A), target.unsqueeze(2))                      # N × NBR × K
    return ce, atom_entropy(logits_a[:, 0]), atom_utilisation(logits_a[:, 0].detach())


def c51_branch_losses_q(wide: torch.Tensor, members: int, col: torch.Tensor, delta: torch.Tensor,
                        target: torch.Tensor, support: torch.Tensor, branch_sizes: tuple[int, ...], fused: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`c51_branch_losses` on the heads' padded output (wide N × W, the N × K × NB × A logits at the front of each
    row), plus every member's Q of the direction actions, q N × K × 3 = Σ_i z_i softmax(logits[:, k, a])_i (fp32):
    `c51_branch_losses_q_reference`, or with `fused` (CUDA) from Triton kernels whose backward hands the heads'
    GEMM the gradient of the whole padded output (`services.trainer.fused_c51`)."""
    if fused:
        from services.trainer.fused_c51 import c51_branch_losses_q_fused
        return c51_branch_losses_q_fused(wide, members, col, delta, target, support, branch_sizes)
    return c51_branch_losses_q_reference(wide, members, col, delta, target, support, branch_sizes)


def c51_branch_losses_q_reference(wide: torch.Tensor, members: int, col: torch.Tensor, delta: torch.Tensor,
                                  target: torch.Tensor, support: torch.Tensor, branch_sizes: tuple[int, ...]
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`c51_branch_losses_q` written out."""
    NB, A = sum(branch_sizes), support.shape[0]
    logits = wide[:, :members * NB * A].view(wide.shape[0], members, NB, A)
    return (*c51_branch_losses_reference(logits, col, delta, target, support), atom_mean(logits[:, :, :3], support))


def atom_mean(logits: torch.Tensor, support: torch.Tensor) -> torch.Tensor:
    """Σ_i z_i softmax(logits)_i of each distribution (fp32): ... × A → ... (`Agent.q_values` without the shift)."""
    return (torch.softmax(logits.float(), dim=-1) * support).sum(-1)


def greedy_next(on_logits: torch.Tensor, on_delta: torch.Tensor, tg_logits: torch.Tensor, tg_delta: torch.Tensor,
                support: torch.Tensor, branch_sizes: tuple[int, ...], fused: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The targets' double-Q at N bootstrap states: `greedy_next_reference`, or with `fused` (CUDA) the same numbers
    from one Triton kernel (`services.trainer.fused_greedy`)."""
    if fused:
        from services.trainer.fused_greedy import greedy_next_fused
        return greedy_next_fused(on_logits, on_delta, tg_logits, tg_delta, support, branch_sizes)
    return greedy_next_reference(on_logits, on_delta, tg_logits, tg_delta, support, branch_sizes)


def greedy_next_reference(on_logits: torch.Tensor, on_delta: torch.Tensor, tg_logits: torch.Tensor,
                          tg_delta: torch.Tensor, support: torch.Tensor, branch_sizes: tuple[int, ...]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double-Q at N bootstrap states: the online network (logits N × K × NB × A, portfolio shift N × (NB + 1))
    selects the greedy action of each branch by its ensemble-mean Q, the target network (the same shapes) evaluates
    it. Returns (col N × NBR: the greedy actions as columns among the NB; p_next N × NBR × A: the target members'
    mean distribution there, fp32; d_star N × NBR: the target's portfolio shift there)."""
    q_on = (atom_mean(on_logits, support) + on_delta[:, :on_logits.shape[2]].unsqueeze(1)).mean(1)  # N × NB
    col = greedy_columns(q_on, branch_sizes)
    return (col, *evaluate_columns(tg_logits, tg_delta, col))


def greedy_columns(q: torch.Tensor, branch_sizes: tuple[int, ...]) -> torch.Tensor:
    """The greedy action of each branch of Q (N × NB, the branches side by side) as a column among the NB: N × NBR."""
    cols, first = [], 0
    for n in branch_sizes:
        cols.append(q[:, first:first + n].argmax(-1) + first)
        first += n
    return torch.stack(cols, dim=1)


def evaluate_columns(logits: torch.Tensor, delta: torch.Tensor, col: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The members' mean distribution (softmax over atoms of the chosen actions' logits alone, fp32) and the portfolio
    shift of the actions at columns col (N × NBR) of logits N × K × NB × A and delta N × (NB + 1): N × NBR × A,
    N × NBR."""
    N, K, _, A = logits.shape
    lg = logits.gather(2, col.view(N, 1, -1, 1).expand(-1, K, -1, A))                      # N × K × NBR × A
    return torch.softmax(lg.float(), -1).mean(1), delta.gather(1, col)


C51_EPS = 1e-6
"""Floor of a predicted probability inside the C51 cross-entropy's log."""
UTIL_THRESHOLD = 0.5
"""An atom counts as used when it holds more than UTIL_THRESHOLD / A of the mass (`atom_utilisation`)."""


def c51_cross_entropy_probs(probs: torch.Tensor, target_probs: torch.Tensor, eps: float = C51_EPS) -> torch.Tensor:
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


def top_two(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest and second-largest value of each row of q (N × n): `q.topk(2, dim=1).values` unbound. For the
    direction branch's n = 3 the two are written with max and min, max(a, b, c) and the median max(min(a, b),
    min(max(a, b), c)), exact in any float type, so torch.compile fuses them into the loss's kernels: topk is a
    sort, two kernels of ~7 µs on the H200 in the batch-4 096 update plus a scatter in its backward
    (bench/train_profile.py). At a tie the gradient splits between the tied entries (topk gives it
    to one): the same subgradient set, another member of it."""
    if q.shape[1] != 3:
        t = q.topk(2, dim=1).values
        return t[:, 0], t[:, 1]
    a, b, c = q.unbind(1)
    hi, lo = torch.maximum(a, b), torch.minimum(a, b)
    return torch.maximum(hi, c), torch.maximum(lo, torch.minimum(hi, c))


SUM_GROUPS = 64
"""Row groups of `batch_sum`'s first level."""


def batch_sum(x: torch.Tensor) -> torch.Tensor:
    """Σ of x over its first dimension (N × ... → ...), in two levels: partial sums over g = gcd(N, 64) groups of
    N / g consecutive rows, then their sum. The same number up to the order of float additions. Why: compiled, the
    update's batch scalars (the loss, its terms, the metrics) were all reductions of N rows to one value, and
    inductor ran them in one kernel of one thread block that looped over the rows (xnumel 1): 12 to 57 µs on the
    H200 depending on the launch configuration its autotuning picked (bench/README.md). Written in two
    levels they are a kernel over g blocks of N / g rows each and a g-element sum."""
    N = x.shape[0]
    g = math.gcd(N, SUM_GROUPS)
    return x.reshape(g, N // g, *x.shape[1:]).sum(1).sum(0)


def atom_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy −Σ p log p of each C51 distribution: ... × A → ...."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def atom_utilisation(logits: torch.Tensor, threshold: float = UTIL_THRESHOLD) -> torch.Tensor:
    """Fraction of atoms holding more than `threshold / A` of the mass, of each distribution: ... × A → ...."""
    A = logits.shape[-1]
    return (torch.softmax(logits, dim=-1) > threshold / A).float().mean(-1)


@torch.no_grad()
def adapt_entropy_coef(coef: torch.Tensor, utilisation: torch.Tensor, target: float, rate: float,
                       lo: float = 1e-5, hi: float = 1e-1) -> None:
    """In place: β ← clamp(β · exp(rate · (target − utilisation)), lo, hi). Raises β while atoms go unused."""
    # out of place, then copied: vmap (runs in lockstep) has a batching rule for clamp, not for clamp_
    coef.copy_((coef * torch.exp(rate * (target - utilisation))).clamp(lo, hi))
