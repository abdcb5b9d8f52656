"""The update's C51 chain as two Triton kernels (CUDA): `c51_branch_losses(..., fused=True)`.

What it computes is `services.trainer.losses.c51_branch_losses_reference`, for each sample n and branch b:
    the logits of the taken action c = col[n, b] of every ensemble member k      (gathered from the N × K × NB × A
                                                                                  market logits)
    p_k = softmax(logits)                                                         (fp32)
    q_k = Φ(z + δ)(p_k)            the portfolio shift δ = delta[n, b], projected (`losses.shift_distribution`)
    ce[n, b, k] = −Σ_i T_i log max(q_ki, ε)   against the target T = target[n, b]
and, of the direction branch (b = 0), the entropy of p_k and its atom utilisation (fraction of atoms above ½/A).

Why by hand: compiled, that chain was ~20 kernels of the update's graph, ~340 µs of its 1.95 ms at batch 4 096 on the
H200 (gather, softmax, the shift's four-tap gathers, cross-entropy, entropy, and the same backward, plus the
scatter that takes the gathered logits' gradient apart; bench/train_profile.py --trace). Each kernel
moved ~12 MB and was bound by its index arithmetic, not by memory. Here one program holds one (sample, branch) and
visits its K members one after another, each member's A logits in registers; the shift's four taps gather from the
registers (`tl.gather`) — the probabilities (forward) or the saved ratio T / q (backward) — so nothing goes through
memory between the steps. Positions are in atom units, as the reference's (`losses._shift_pairs`).
Measured on the H200 (bench/c51_kernel_speed.py, forward + backward at batch 4 096): 136 µs against 322 µs for the
compiled chain (an all-members tile instead of the members' loop: 159 µs); with the tile, the
update's graph replay went 1.92 → 1.70 ms (bench/train_profile.py --variants). The kernels are bound by
latency: more rows or warps a program were slower (`LAUNCH`), and taps read from global memory (L1) instead of
gathered from registers were 186 µs at best.

- Forward kernel: ce, entropy, utilisation, and r = T / max(q, ε) · [q ≥ ε] (N × NBR × K × A, fp32) for the backward.
- Backward kernel: recomputes the softmax, gathers −g_ce · r at each source atom's four candidate outputs
  (`losses._shift_pairs`, transposed: the same weights and subgradients), adds the entropy's gradient on the
  direction branch, and writes the gradient of the whole N × K × NB × A logits tensor (zeros at the actions not
  taken): no zero-fill and no scatter. ∂/∂δ: Σ p_j g_i ∂w_ij/∂(z_j + δ).
Values and subgradients are the reference's (the dense hat weights'), up to the order of float sums:
tests/test_fused_c51.py compares them on the GPU.

With the direction Q (`losses.c51_branch_losses_q`, `TrainConfig.direction_q_in_c51`): the ops take the heads'
padded output (N × W, the logits at the front of each row) and also return every member's Q of the three direction
actions (`qdir_fwd`: one program a sample, its K × 3 rows as one tile). Backward, `qdir_bwd` adds the Q's gradient
p_i (z_i − q) g into the rows the C51 kernel has written and zeroes each row's padding, so the heads' GEMM gets the
gradient of the whole padded row: no softmax backward, sum of two gradients and padded copy after the kernels.

Triton is torch's own compiler backend (what torch.compile generates its kernels with), present wherever torch runs
on CUDA; it is imported only when the fused path runs. The ops are torch custom ops, so torch.compile keeps them as
they are and a CUDA graph captures their launches. Under `torch.func.vmap` over several runs, the forward ops fold
the runs' samples into one launch, each run with its own support (`services.trainer.run_batch`).
"""
from __future__ import annotations

import torch

from services.trainer.losses import C51_EPS, UTIL_THRESHOLD
from services.trainer.run_batch import support_rows, vmap_by_folding

LAUNCH = {"rows": 1, "num_warps": 1}
"""Launch settings of both kernels: (sample, branch) rows per program and warps per program. One row and one warp
was the fastest on the H200, forward + backward at batch 4 096 (bench/c51_kernel_speed.py): 136 µs;
every setting with more rows or warps a program was slower (168–1 029 µs): they need more registers per thread or
more threads per row, and the kernels are bound by how many programs an SM keeps in flight."""


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on x's device (CUDA with Triton importable)."""
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _kernels():
    import triton
    from services.trainer import _c51_triton
    return triton, _c51_triton.c51_fwd, _c51_triton.c51_bwd


def _launch_fwd(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor,
                support: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    N, K, NB, A = logits.shape
    NBR = col.shape[1]
    assert logits.stride(3) == 1, "the logits' atoms must be contiguous"
    f32 = dict(dtype=torch.float32, device=logits.device)
    ce, ent, util = torch.empty(N, NBR, K, **f32), torch.empty(N, K, **f32), torch.empty(N, K, **f32)
    r = torch.empty(N, NBR, K, A, **f32)
    triton, fwd, _ = _kernels()
    rows = LAUNCH["rows"]
    z, z_per = support_rows(support, N)
    fwd[(triton.cdiv(N * NBR, rows),)](
        logits, logits.stride(0), logits.stride(1), logits.stride(2), col.contiguous(), delta.contiguous().float(),
        target.contiguous().float(), z, z_per, N * NBR, ce, ent, util, r,
        NBR=NBR, K=K, A=A, AP=triton.next_power_of_2(A), ROWS=rows, EPS=C51_EPS, UTIL=UTIL_THRESHOLD,
        num_warps=LAUNCH["num_warps"])
    return ce, ent, util, r


@torch.library.custom_op("tradeloop::c51_branch_fwd", mutates_args=())
def _fwd(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor,
         support: torch.Tensor, branch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_fwd(logits, col, delta, target, support)


@_fwd.register_fake
def _(logits, col, delta, target, support, branch_sizes):
    N, K, _, A = logits.shape
    NBR = col.shape[1]
    e = lambda *s: logits.new_empty(*s, dtype=torch.float32)  # noqa: E731
    return e(N, NBR, K), e(N, K), e(N, K), e(N, NBR, K, A)


def _launch_bwd(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, support: torch.Tensor, r: torch.Tensor,
                grad_ce: torch.Tensor, grad_ent: torch.Tensor, branch_sizes: list[int], grad_logits: torch.Tensor,
                g_sn: int) -> torch.Tensor:
    """c51_bwd into grad_logits (rows of g_sn elements, each K × NB × A); returns ∂/∂δ."""
    N, K, NB, A = logits.shape
    NBR = col.shape[1]
    assert NBR == len(branch_sizes) == 3 and sum(branch_sizes) == NB, "three branches covering the NB actions"
    grad_delta = torch.empty(N, NBR, dtype=torch.float32, device=logits.device)
    triton, _, bwd = _kernels()
    rows = LAUNCH["rows"]
    z, z_per = support_rows(support, N)
    bwd[(triton.cdiv(N * NBR, rows),)](
        logits, logits.stride(0), logits.stride(1), logits.stride(2), col.contiguous(), delta.contiguous().float(),
        z, z_per, N * NBR, r, grad_ce.contiguous().float(), grad_ent.contiguous().float(),
        grad_logits, g_sn, grad_delta, NBR=NBR, K=K, A=A, AP=triton.next_power_of_2(A), ROWS=rows, NB=NB,
        S0=branch_sizes[0], S1=branch_sizes[1], S2=branch_sizes[2], MAXB=max(branch_sizes),
        num_warps=LAUNCH["num_warps"])
    return grad_delta


@torch.library.custom_op("tradeloop::c51_branch_bwd", mutates_args=())
def _bwd(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, support: torch.Tensor, r: torch.Tensor,
         grad_ce: torch.Tensor, grad_ent: torch.Tensor, branch_sizes: list[int]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    N, K, NB, A = logits.shape
    grad_logits = torch.empty(N, K, NB, A, dtype=logits.dtype, device=logits.device)
    return grad_logits, _launch_bwd(logits, col, delta, support, r, grad_ce, grad_ent, branch_sizes, grad_logits,
                                    K * NB * A)


@_bwd.register_fake
def _(logits, col, delta, support, r, grad_ce, grad_ent, branch_sizes):
    N, K, NB, A = logits.shape
    return (torch.empty(N, K, NB, A, dtype=logits.dtype, device=logits.device),
            logits.new_empty(N, col.shape[1], dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    logits, col, delta, _, support, branch_sizes = inputs
    ctx.branch_sizes = list(branch_sizes)
    ctx.save_for_backward(logits, col, delta, support, output[3])
    ctx.mark_non_differentiable(output[2], output[3])


def _backward(ctx, grad_ce, grad_ent, _grad_util, _grad_r):
    logits, col, delta, support, r = ctx.saved_tensors
    N, K, NB, _ = logits.shape
    grad_ce = torch.zeros(N, col.shape[1], K, device=logits.device) if grad_ce is None else grad_ce
    grad_ent = torch.zeros(N, K, device=logits.device) if grad_ent is None else grad_ent
    grad_logits, grad_delta = _bwd(logits, col, delta, support, r, grad_ce, grad_ent, ctx.branch_sizes)
    return grad_logits, None, grad_delta, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)
vmap_by_folding(_fwd, per_sample=(0, 1, 2, 3), support=4)


def c51_branch_losses_fused(logits: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor,
                            support: torch.Tensor, branch_sizes: tuple[int, ...]
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`losses.c51_branch_losses_reference` on CUDA as two Triton kernels (the module's docstring)."""
    ce, ent, util, _ = _fwd(logits, col, delta, target.detach(), support, list(branch_sizes))
    return ce, ent, util


# --- the same chain with the direction Q of every member, on the heads' padded logits ------------------------------
def _wide_logits(wide: torch.Tensor, members: int, branch_sizes: list[int], atoms: int) -> torch.Tensor:
    """The N × K × NB × A logits at the front of each row of the heads' output (N × W, W ≥ K·NB·A: padded)."""
    return wide[:, :members * sum(branch_sizes) * atoms].view(wide.shape[0], members, sum(branch_sizes), atoms)


@torch.library.custom_op("tradeloop::c51_branch_q_fwd", mutates_args=())
def _fwd_q(wide: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, target: torch.Tensor, support: torch.Tensor,
           branch_sizes: list[int], members: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = _wide_logits(wide, members, branch_sizes, support.shape[-1])
    ce, ent, util, r = _launch_fwd(logits, col, delta, target, support)
    N, K, _, A = logits.shape
    q = torch.empty(N, K, 3, dtype=torch.float32, device=wide.device)
    triton = _kernels()[0]
    from services.trainer._c51_triton import qdir_fwd
    qdir_fwd[(N,)](logits, logits.stride(0), logits.stride(1), logits.stride(2), *support_rows(support, N), q,
                   K=K, KP=triton.next_power_of_2(K), A=A, AP=triton.next_power_of_2(A), num_warps=1)
    return ce, ent, util, r, q


@_fwd_q.register_fake
def _(wide, col, delta, target, support, branch_sizes, members):
    N, NBR, A = wide.shape[0], col.shape[1], support.shape[-1]
    e = lambda *s: wide.new_empty(*s, dtype=torch.float32)  # noqa: E731
    return e(N, NBR, members), e(N, members), e(N, members), e(N, NBR, members, A), e(N, members, 3)


@torch.library.custom_op("tradeloop::c51_branch_q_bwd", mutates_args=())
def _bwd_q(wide: torch.Tensor, col: torch.Tensor, delta: torch.Tensor, support: torch.Tensor, r: torch.Tensor,
           grad_ce: torch.Tensor, grad_ent: torch.Tensor, grad_q: torch.Tensor, branch_sizes: list[int], members: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _wide_logits(wide, members, branch_sizes, support.shape[-1])
    N, K, NB, A = logits.shape
    W = wide.shape[1]
    # the gradient of the whole padded output, written by the kernels (the C51 rows, then the direction Q added and
    # the padding zeroed): the heads' GEMM takes it as it is, with no slice to pad back
    grad_wide = torch.empty(N, W, dtype=wide.dtype, device=wide.device)
    grad_delta = _launch_bwd(logits, col, delta, support, r, grad_ce, grad_ent, branch_sizes, grad_wide, W)
    triton = _kernels()[0]
    from services.trainer._c51_triton import qdir_bwd
    pad = W - K * NB * A
    qdir_bwd[(N,)](logits, logits.stride(0), logits.stride(1), logits.stride(2), *support_rows(support, N),
                   grad_q.contiguous().float(), grad_wide, W, K=K, KP=triton.next_power_of_2(K), NB=NB, A=A,
                   AP=triton.next_power_of_2(A), PAD=pad, PADP=triton.next_power_of_2(max(pad, 1)), num_warps=1)
    return grad_wide, grad_delta


@_bwd_q.register_fake
def _(wide, col, delta, support, r, grad_ce, grad_ent, grad_q, branch_sizes, members):
    return torch.empty_like(wide), wide.new_empty(wide.shape[0], col.shape[1], dtype=torch.float32)


def _setup_context_q(ctx, inputs, output):
    wide, col, delta, _, support, branch_sizes, members = inputs
    ctx.branch_sizes, ctx.members = list(branch_sizes), members
    ctx.save_for_backward(wide, col, delta, support, output[3])
    ctx.mark_non_differentiable(output[2], output[3])


def _backward_q(ctx, grad_ce, grad_ent, _grad_util, _grad_r, grad_q):
    wide, col, delta, support, r = ctx.saved_tensors
    N, K = wide.shape[0], ctx.members
    zeros = lambda *s: torch.zeros(*s, device=wide.device)  # noqa: E731
    grad_ce = zeros(N, col.shape[1], K) if grad_ce is None else grad_ce
    grad_ent = zeros(N, K) if grad_ent is None else grad_ent
    grad_q = zeros(N, K, 3) if grad_q is None else grad_q
    grad_wide, grad_delta = _bwd_q(wide, col, delta, support, r, grad_ce, grad_ent, grad_q, ctx.branch_sizes,
                                   ctx.members)
    return grad_wide, None, grad_delta, None, None, None, None


_fwd_q.register_autograd(_backward_q, setup_context=_setup_context_q)
vmap_by_folding(_fwd_q, per_sample=(0, 1, 2, 3), support=4)


def c51_branch_losses_q_fused(wide: torch.Tensor, members: int, col: torch.Tensor, delta: torch.Tensor,
                              target: torch.Tensor, support: torch.Tensor, branch_sizes: tuple[int, ...]
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`losses.c51_branch_losses_q_reference` on CUDA: the two C51 kernels and two more for the direction Q
    (`qdir_fwd`, and `qdir_bwd`, which adds its gradient into the C51 kernel's and zeroes the padding)."""
    ce, ent, util, _, q = _fwd_q(wide, col, delta, target.detach(), support, list(branch_sizes), members)
    return ce, ent, util, q
