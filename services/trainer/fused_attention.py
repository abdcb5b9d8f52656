"""The encoder's attention for the update as Triton kernels (CUDA): one program a (window, head), forward and
backward (`_attention_triton`).

Why by hand: the encoder learns from 256 windows of 64 bars, 2 heads of 64 dims — a few GFLOP that PyTorch's
fused SDPA (cuDNN on the H200) runs as four kernels backward (a memset, the dO·O preprocessing, the backward, the
dQ conversion), ~35 µs for the causal block and ~20 µs for the last block's single query, plus the transposes and
the concatenation that take q, k, v apart and put their gradients back together (bench/train_profile.py --replay
--trace). A window's whole attention fits one program's registers: here each pass is one kernel that
reads the packed qkv projection (N × W × 3D) and writes the layouts the block's Linear layers use.

`causal_attention(qkv, n_heads)`: the causal self-attention of `CausalBlock.forward`, qkv → N × W × D.
`last_query_attention(q, kv, n_heads)`: `CausalBlock.last_token`'s, q N × D and kv N × W × 2D → N × D.
The same numbers as `F.scaled_dot_product_attention` up to float rounding (fp32 softmax and accumulation; TF32
products of bf16 inputs, which TF32 holds exactly, IEEE ones of fp32 inputs; the outputs and gradients rounded to
the inputs' dtype): tests/test_fused_attention.py, on a GPU or under Triton's interpreter.
Under `torch.func.vmap` over several runs the forward ops fold the runs' windows into one launch
(`services.trainer.run_batch`). `supported(...)` says where the trainer uses them (CUDA with Triton, windows of up
to 128 bars, heads of 16, 32, 64 or 128 dims); `shared.agent.CausalBlock.fused` holds them when the trainer turns
them on (`TrainConfig.attention`).
"""
from __future__ import annotations

import torch

from services.trainer.fused_c51 import available
from services.trainer.run_batch import vmap_by_folding


def supported(x: torch.Tensor, window: int, head_dim: int) -> bool:
    """Whether the kernels run for x (CUDA with Triton, `fused_c51.available`) at this window and head width."""
    return 1 <= window <= 128 and head_dim in (16, 32, 64, 128) and available(x)


def _kernels():
    from services.trainer import _attention_triton
    return _attention_triton


def _wp(W: int) -> int:
    """The window padded for the kernels' tiles: a power of two, at least 16 (tl.dot's smallest side)."""
    return max(16, 1 << (W - 1).bit_length())


@torch.library.custom_op("tradeloop::causal_attention_fwd", mutates_args=())
def _causal_fwd(qkv: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    N, W, D3 = qkv.shape
    D = D3 // 3
    qkv = qkv.contiguous()
    o = torch.empty(N, W, D, dtype=qkv.dtype, device=qkv.device)
    WP = _wp(W)
    lse = torch.empty(N, n_heads, WP, dtype=torch.float32, device=qkv.device)
    k = _kernels()
    HD = D // n_heads
    k.causal_fwd[(N * n_heads,)](qkv, qkv.stride(0), qkv.stride(1), o, o.stride(0), o.stride(1), lse, W, HD ** -0.5,
                                 H=n_heads, HD=HD, WP=WP, IEEE=qkv.dtype == torch.float32, num_warps=4)
    return o, lse


@_causal_fwd.register_fake
def _(qkv, n_heads):
    N, W, D3 = qkv.shape
    return qkv.new_empty(N, W, D3 // 3), qkv.new_empty(N, n_heads, _wp(W), dtype=torch.float32)


@torch.library.custom_op("tradeloop::causal_attention_bwd", mutates_args=())
def _causal_bwd(qkv: torch.Tensor, lse: torch.Tensor, grad_o: torch.Tensor, n_heads: int) -> torch.Tensor:
    N, W, D3 = qkv.shape
    qkv, grad_o = qkv.contiguous(), grad_o.contiguous()
    dqkv = torch.empty(N, W, D3, dtype=qkv.dtype, device=qkv.device)       # qkv's layout: the kernel writes both
    k = _kernels()
    HD = D3 // 3 // n_heads
    k.causal_bwd[(N * n_heads,)](qkv, qkv.stride(0), qkv.stride(1), grad_o, grad_o.stride(0), grad_o.stride(1), lse, dqkv,
                                 W, HD ** -0.5, H=n_heads, HD=HD, WP=lse.shape[2],
                                 IEEE=qkv.dtype == torch.float32, num_warps=4)
    return dqkv


@_causal_bwd.register_fake
def _(qkv, lse, grad_o, n_heads):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _causal_setup(ctx, inputs, output):
    qkv, n_heads = inputs
    ctx.n_heads = n_heads
    ctx.save_for_backward(qkv, output[1])
    ctx.mark_non_differentiable(output[1])


def _causal_backward(ctx, grad_o, _grad_lse):
    qkv, lse = ctx.saved_tensors
    return _causal_bwd(qkv, lse, grad_o, ctx.n_heads), None


_causal_fwd.register_autograd(_causal_backward, setup_context=_causal_setup)
vmap_by_folding(_causal_fwd, per_sample=(0,))


@torch.library.custom_op("tradeloop::last_query_attention_fwd", mutates_args=())
def _last_fwd(q: torch.Tensor, kv: torch.Tensor, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    N, W, D2 = kv.shape
    q, kv = q.contiguous(), kv.contiguous()
    o = torch.empty_like(q)
    lse = torch.empty(N, n_heads, dtype=torch.float32, device=q.device)
    k = _kernels()
    HD = D2 // 2 // n_heads
    k.last_fwd[(N * n_heads,)](q, q.stride(0), kv, kv.stride(0), kv.stride(1), o, lse, W, HD ** -0.5, H=n_heads,
                               HD=HD, WP=_wp(W), num_warps=2)
    return o, lse


@_last_fwd.register_fake
def _(q, kv, n_heads):
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[0], n_heads,
                                                                                   dtype=torch.float32)


@torch.library.custom_op("tradeloop::last_query_attention_bwd", mutates_args=())
def _last_bwd(q: torch.Tensor, kv: torch.Tensor, lse: torch.Tensor, grad_o: torch.Tensor, n_heads: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    N, W, D2 = kv.shape
    q, kv, grad_o = q.contiguous(), kv.contiguous(), grad_o.contiguous()
    dq = torch.empty_like(q)                                # q's layout, as grad_o's: the kernel shares strides
    dkv = torch.empty(N, W, D2, dtype=kv.dtype, device=kv.device)
    k = _kernels()
    HD = D2 // 2 // n_heads
    k.last_bwd[(N * n_heads,)](q, q.stride(0), kv, kv.stride(0), kv.stride(1), grad_o, lse, dq, dkv, W,
                               HD ** -0.5, H=n_heads, HD=HD, WP=_wp(W), num_warps=2)
    return dq, dkv


@_last_bwd.register_fake
def _(q, kv, lse, grad_o, n_heads):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(kv, memory_format=torch.contiguous_format))


def _last_setup(ctx, inputs, output):
    q, kv, n_heads = inputs
    ctx.n_heads = n_heads
    ctx.save_for_backward(q, kv, output[1])
    ctx.mark_non_differentiable(output[1])


def _last_backward(ctx, grad_o, _grad_lse):
    q, kv, lse = ctx.saved_tensors
    dq, dkv = _last_bwd(q, kv, lse, grad_o, ctx.n_heads)
    return dq, dkv, None


_last_fwd.register_autograd(_last_backward, setup_context=_last_setup)
vmap_by_folding(_last_fwd, per_sample=(0, 1))


def causal_attention(qkv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Causal self-attention of the packed projection qkv (N × W × 3D: q, k, v side by side, each D = n_heads ·
    head_dim wide) → N × W × D, the heads side by side (`CausalBlock.forward`'s, before its output projection)."""
    return _causal_fwd(qkv, n_heads)[0]


def last_query_attention(q: torch.Tensor, kv: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The last token's query q (N × D) against the window's keys and values kv (N × W × 2D) → N × D
    (`CausalBlock.last_token`'s)."""
    return _last_fwd(q, kv, n_heads)[0]
