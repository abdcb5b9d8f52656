"""The C51 loss of a shifted distribution as one Triton kernel: softmax → portfolio shift → cross-entropy, with its
gradient computed in the same pass.

The update's C51 loss of each sample, branch and ensemble member is

    p = softmax(logits)                               (A atoms)
    q_i = Σ_j w_ij(δ) p_j,  w_ij = clip(1 − |clip(z_j + δ, v_min, v_max) − z_i| / Δz, 0, 1)
    ce = −Σ_i m_i log max(q_i, ε)                     (m: the branch's C51 target)

(`losses.shift_distribution`, `losses.c51_cross_entropy_probs`). Written with torch ops, the dense hat weights are an
N·NBR × A × A tensor in memory, the product a batched A × A GEMM per row (56 × 56, padded), and backward another two
of each: on the H200 at batch 4 096 those kernels were ~0.45 ms of a 2.4-ms update (bench/train_profile.py, session
12). Here one program per (sample, branch) holds w and ∂w/∂δ in registers, runs its K members' softmax, shift and
cross-entropy, and writes the loss and its gradient with respect to the logits and δ; backward only scales them by
the incoming gradient. The arithmetic is the torch form's, op for op, including its subgradients at the weights'
kinks (δ = 0 puts every atom on one, and `shift_distribution` explains why they matter): clip passes the gradient
on its closed interval, |x|' = sign(x) with sign(0) = 0, and log max(q, ε) passes it where q ≥ ε.

`shifted_c51_cross_entropy` runs the kernel on CUDA when Triton is importable, the torch form elsewhere.
ML core: imports torch, and Triton (torch's own GPU compiler) where it is installed.
"""
from __future__ import annotations

import torch

from services.trainer.losses import c51_cross_entropy_probs, shift_distribution

try:
    import triton
    import triton.language as tl
except ImportError:                                   # a CPU-only torch without Triton: the torch form only
    triton = None

EPS = 1e-6
"""ε of `c51_cross_entropy_probs`: the floor of a predicted probability under the log."""


def shifted_c51_reference(logits: torch.Tensor, delta: torch.Tensor, support: torch.Tensor,
                          target: torch.Tensor) -> torch.Tensor:
    """The torch form: logits N × NBR × K × A, delta N × NBR, target N × NBR × A → ce N × NBR × K (float32)."""
    N, NBR, K, A = logits.shape
    probs = shift_distribution(torch.softmax(logits.float(), -1).reshape(N * NBR, K, A), delta.reshape(-1), support)
    return c51_cross_entropy_probs(probs.view(N, NBR, K, A), target.unsqueeze(2), EPS)


if triton is not None:
    @triton.jit
    def _shifted_c51_kernel(logits_ptr, delta_ptr, support_ptr, dz_ptr, target_ptr, ce_ptr, glogits_ptr, gdelta_ptr,
                            s_ln, s_lb, s_lk, NBR: tl.constexpr, K: tl.constexpr, A: tl.constexpr,
                            BLOCK: tl.constexpr, EPS: tl.constexpr):
        r = tl.program_id(0)                          # row r = n · NBR + b
        n, b = r // NBR, r % NBR
        i = tl.arange(0, BLOCK)                       # an atom of the support (rows of w) or of the source (columns)
        ok = i < A
        z = tl.load(support_ptr + i, mask=ok, other=0.0)
        v_min, v_max = tl.load(support_ptr), tl.load(support_ptr + A - 1)
        dz = tl.load(dz_ptr)
        d = tl.load(delta_ptr + r)
        src = z + d                                   # z_j + δ, over j
        tz = tl.minimum(tl.maximum(src, v_min), v_max)
        inside = (src >= v_min) & (src <= v_max)      # where clip(z_j + δ) passes its gradient
        diff = tz[None, :] - z[:, None]               # [i, j]
        x = 1.0 - tl.math.div_rn(tl.abs(diff), dz)
        both = ok[:, None] & ok[None, :]
        w = tl.where(both, tl.minimum(tl.maximum(x, 0.0), 1.0), 0.0)
        sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        dw = tl.where(both & (x >= 0.0) & (x <= 1.0) & inside[None, :], tl.math.div_rn(-sign, dz), 0.0)  # ∂w/∂δ
        m = tl.load(target_ptr + r * A + i, mask=ok, other=0.0)
        base = n * s_ln + b * s_lb
        for k in tl.static_range(K):
            lg = tl.load(logits_ptr + base + k * s_lk + i, mask=ok, other=float("-inf")).to(tl.float32)
            e = tl.where(ok, tl.exp(lg - tl.max(lg, 0)), 0.0)
            p = e / tl.sum(e, 0)                                                  # softmax, over j
            q = tl.sum(w * p[None, :], 1)                                         # shifted, over i
            qc = tl.maximum(q, EPS)
            tl.store(ce_ptr + r * K + k, -tl.sum(m * tl.log(qc), 0))
            gq = tl.where(q >= EPS, -m / qc, 0.0)                                 # ∂ce/∂q_i
            gp = tl.sum(w * gq[:, None], 0)                                       # ∂ce/∂p_j
            tl.store(glogits_ptr + (r * K + k) * A + i, p * (gp - tl.sum(p * gp, 0)), mask=ok)
            tl.store(gdelta_ptr + r * K + k, tl.sum(tl.sum(gq[:, None] * dw * p[None, :], 1), 0))


NUM_WARPS = 4
"""Warps per program of the kernel (bench/fused_speed.py times the choices)."""


def shifted_c51_launch(logits: torch.Tensor, delta: torch.Tensor, support: torch.Tensor, target: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the kernel: (ce N × NBR × K, ∂ce/∂logits N × NBR × K × A, ∂ce/∂δ N × NBR × K), all float32. The logits'
    atoms must be contiguous (any layout of the other three dimensions). Also runs on CPU tensors under Triton's
    interpreter (TRITON_INTERPRET=1), which is how the tests check it without a GPU."""
    N, NBR, K, A = logits.shape
    if logits.stride(3) != 1:
        logits = logits.contiguous()
    v = support.float()
    dz = ((v[-1] - v[0]) / (A - 1)).reshape(1)         # Δz as `losses.projection_weights` computes it
    ce = torch.empty(N, NBR, K, device=logits.device, dtype=torch.float32)
    glogits = torch.empty(N, NBR, K, A, device=logits.device, dtype=torch.float32)
    gdelta = torch.empty(N, NBR, K, device=logits.device, dtype=torch.float32)
    _shifted_c51_kernel[(N * NBR,)](logits, delta.float().contiguous(), v.contiguous(), dz,
                                    target.float().contiguous(), ce, glogits, gdelta,
                                    logits.stride(0), logits.stride(1), logits.stride(2), NBR=NBR, K=K, A=A,
                                    BLOCK=triton.next_power_of_2(A), EPS=EPS, num_warps=NUM_WARPS)
    return ce, glogits, gdelta


@torch.library.custom_op("tradeloop::shifted_c51", mutates_args=())
def _shifted_c51_op(logits: torch.Tensor, delta: torch.Tensor, support: torch.Tensor, target: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel as an operator that torch.compile treats as opaque (it needs only the shapes, `_shifted_c51_fake`)
    and a CUDA graph captures like any other launch."""
    return shifted_c51_launch(logits, delta, support, target)


@_shifted_c51_op.register_fake
def _shifted_c51_fake(logits, delta, support, target):
    N, NBR, K, A = logits.shape
    f32 = dict(dtype=torch.float32)
    return logits.new_empty(N, NBR, K, **f32), logits.new_empty(N, NBR, K, A, **f32), logits.new_empty(N, NBR, K, **f32)


class _ShiftedC51(torch.autograd.Function):
    """float32 logits and δ in, float32 gradients out (the caller's casts carry them to other dtypes)."""

    @staticmethod
    def forward(ctx, logits, delta, support, target):
        ce, glogits, gdelta = _shifted_c51_op(logits, delta, support, target)
        ctx.save_for_backward(glogits, gdelta)
        return ce

    @staticmethod
    def backward(ctx, g_ce):
        glogits, gdelta = ctx.saved_tensors
        return g_ce.unsqueeze(-1) * glogits, (g_ce * gdelta).sum(-1), None, None


def fused_available(t: torch.Tensor) -> bool:
    """True where the kernel runs: a CUDA tensor and Triton installed."""
    return triton is not None and t.is_cuda


def shifted_c51_cross_entropy(logits: torch.Tensor, delta: torch.Tensor, support: torch.Tensor,
                              target: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """C51 cross-entropy of the shifted distributions: logits N × NBR × K × A (each member's, of the taken action of
    each branch), delta N × NBR (that action's portfolio shift), target N × NBR × A (no gradient) → N × NBR × K,
    differentiable in logits and delta. The fused kernel where `fused` and `fused_available`, else the torch form."""
    if fused and fused_available(logits):
        return _ShiftedC51.apply(logits.float(), delta.float(), support, target.detach())
    return shifted_c51_reference(logits, delta, support, target)
