"""The network's building blocks: causal attention (fused SDPA or written out), cuBLAS-aligned and stacked linear
layers, the LayerNorm fold and the pre-LN causal block of the encoder. `shared.agent` assembles the agent from them
(and re-exports them under their old names).

ML core: imports only torch (and the standard library).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def written_out_attention(q: torch.Tensor) -> bool:
    """Whether attention runs written out (`causal_attention_math`, `last_query_attention_math`) rather than as
    PyTorch's fused SDPA: only in a compiled pass without gradient (the trainer's compiled collection and rolling
    embedding refresh) with heads of ≤ 32 dims. There inductor fuses the written-out form — two batched matmuls around
    an fp32 softmax, with the mask and the scale — and it beat the fused kernel the H200 picks (cuDNN flash, tiles of
    64 dims, mostly padding for 16-dim heads): 1.5× on the causal forward and 2.5× on the last query at 8 heads × 16,
    1.4× and 1.2× at 4 × 32; at 2 × 64 SDPA was as fast or faster (1.0× and 0.6×). With gradient, or uncompiled, the
    fused kernel was faster at every width. `bench/attention_speed.py --heads H --dim d` measures each."""
    return torch.compiler.is_compiling() and not torch.is_grad_enabled() and q.shape[-1] <= 32


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v for N × heads × W × d (W ≤ 64 bars): fused SDPA, or written out where
    that is faster (`written_out_attention`)."""
    if not written_out_attention(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return causal_attention_math(q, k, v)


def causal_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` written out (N × heads × W × d)."""
    W = q.shape[-2]
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5                             # N × h × W × W
    mask = torch.ones(W, W, dtype=torch.bool, device=q.device).triu(1)                    # j > i: the future
    return torch.softmax(s.masked_fill(mask, -math.inf), dim=-1).to(v.dtype) @ v          # N × h × W × d


def last_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last token's attention over its whole window: q N × heads × d, k, v N × heads × W × d → N × heads × d.
    Fused SDPA, or written out where that is faster (`written_out_attention`: elementwise products and sums with an
    fp32 softmax, one fused kernel)."""
    if not written_out_attention(q):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v).squeeze(2)
    return last_query_attention_math(q, k, v)


def last_query_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`last_query_attention` written out (q N × heads × d, k, v N × heads × W × d)."""
    s = (k.float() * q.float().unsqueeze(-2)).sum(-1) * q.shape[-1] ** -0.5               # N × h × W
    return (torch.softmax(s, dim=-1).unsqueeze(-1) * v.float()).sum(-2).to(v.dtype)        # N × h × d


def align_pad(width: int, x: torch.Tensor) -> int:
    """Zeros to append to a width of `width` elements so that rows of x's device are 16-byte aligned for cuBLAS
    (a multiple of 8 bf16 values) on CUDA; 0 on a CPU, where alignment buys nothing."""
    return -width % 8 if x.is_cuda else 0


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x), on CUDA with both widths padded with zeros to a multiple of 8 (the output sliced back): a row of 3,
    9, 14 or 2 295 bf16 values is not 16-byte aligned, and cuBLAS then falls back to its pre-Hopper `align1` kernels
    (on the H200 those ran the heads' GEMMs and the encoder's input projection; `bench/train_profile.py`). The same
    numbers (zero products add nothing); on a CPU just layer(x)."""
    return _aligned(x, layer.weight, layer.bias)


def _aligned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) with the widths padded as `aligned_linear` pads them."""
    n_out, n_in = weight.shape
    po, pi = align_pad(n_out, x), align_pad(n_in, x)
    if po == pi == 0:
        return F.linear(x, weight, bias)
    out = F.linear(F.pad(x, (0, pi)), F.pad(weight, (0, pi, 0, po)), F.pad(bias, (0, po)))
    return out[..., :n_out]


def stacked_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers] as one product: the layers' weights and biases stacked (each through
    `dense_grad`, so their gradients come out in the parameters' own layout), the widths aligned as `aligned_linear`
    aligns them, the output split back. Heads that read the same input then cost one GEMM forward and one of each
    kind backward (input gradient, weight gradient, bias sum) instead of one per head. The same numbers up to the
    order of float sums."""
    w = torch.cat([dense_grad(layer.weight) for layer in layers])
    b = torch.cat([dense_grad(layer.bias) for layer in layers])
    return list(_aligned(x, w, b).split([layer.out_features for layer in layers], dim=-1))


class _DenseGrad(torch.autograd.Function):
    """The identity, whose gradient is handed back contiguous (`dense_grad`)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def dense_grad(p: torch.Tensor) -> torch.Tensor:
    """p itself, with its gradient made contiguous where it is computed. A parameter used through `torch.cat` gets
    a strided slice of the joint gradient, which autograd then copies into the parameter's layout, one copy a
    parameter after the backward (on the H200 six `direct_copy` kernels of the update, for the advantage streams'
    weights and biases). Made contiguous inside the backward, the copy is part of the compiled graph,
    where inductor fuses or groups it, and autograd takes the gradient as it is. The same values."""
    return _DenseGrad.apply(p)


def ln_fold(ln: nn.LayerNorm, layer: nn.Linear, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of layer(ln(x)) (its output rows `rows`) as a product of `ln_plain(x, ln)`: W (γ ⊙ n + β)
    + b = (W diag γ) n + (W β + b). The fold costs O × D on the parameters instead of N × D on the rows: γ's and
    β's gradients come from the weight's and bias's (Σ_o W ⊙ ∂W', Wᵀ ∂b') instead of two reductions over every row
    of the batch (every token of a window, before the encoder's linear layers). W β is summed in fp32 (a matmul
    under bf16 autocast would round it). The same numbers up to float rounding."""
    w, b = layer.weight[rows], layer.bias[rows]
    return w * ln.weight, b + (w * ln.bias).sum(1)


def ln_plain(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    """ln(x) without its affine (`ln_fold`)."""
    return F.layer_norm(x, ln.normalized_shape, None, None, ln.eps)


class CausalBlock(nn.Module):
    """Pre-LN transformer block with causal self-attention: x + Attn(LN x), then x + MLP(LN x)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.fold_ln = False
        """Each LayerNorm's affine folded into the linear layer after it (`ln_fold`): set by the trainer
        (`TrainConfig.fold_ln`); the same parameters and function."""
        self.fused: tuple[Callable, Callable] | None = None
        """Attention kernels for passes with gradient, (causal(qkv N × W × 3D, heads) → N × W × D, last_query(q
        N × D, kv N × W × 2D, heads) → N × D), or None for SDPA: set by the trainer (`TrainConfig.attention`,
        `services.trainer.fused_attention`); not a parameter, not saved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, W, D = x.shape
        qkv = F.linear(self._norm(x, self.ln1), *self._params(self.ln1, self.qkv))         # N × W × 3D
        if self.fused is not None and torch.is_grad_enabled():
            a = self.fused[0](qkv, self.n_heads)                                           # N × W × D
        else:
            q, k, v = (y.view(N, W, self.n_heads, D // self.n_heads).transpose(1, 2) for y in qkv.split(D, dim=-1))
            a = causal_attention(q, k, v).transpose(1, 2).reshape(N, W, D)                 # heads side by side
        x = x + self.proj(a)
        return x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """MLP(LN₂ x)."""
        return self.mlp[2](self.mlp[1](F.linear(self._norm(x, self.ln2), *self._params(self.ln2, self.mlp[0]))))

    def _norm(self, x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
        """ln(x), without its affine when it is folded into the next layer (`fold_ln`)."""
        return ln_plain(x, ln) if self.fold_ln else ln(x)

    def _params(self, ln: nn.LayerNorm, layer: nn.Linear, rows: slice = slice(None)
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and bias (output rows `rows`) that `layer` applies to `_norm(x, ln)`: ln's affine folded in
        (`ln_fold`) or the layer's own."""
        return ln_fold(ln, layer, rows) if self.fold_ln else (layer.weight[rows], layer.bias[rows])

    def last_token(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x)[:, −1] for what the encoder keeps of its last block: the last token's query against every
        key (a causal mask lets the last row see the whole window), its projection and MLP — N × W × D → N × D.
        The same arithmetic for that token, without the other W − 1 queries and MLP rows (~3× less work)."""
        N, W, D = x.shape
        h = self._norm(x, self.ln1)
        q = F.linear(h[:, -1], *self._params(self.ln1, self.qkv, slice(None, D)))        # N × D
        kv = F.linear(h, *self._params(self.ln1, self.qkv, slice(D, None)))              # N × W × 2D
        if self.fused is not None and torch.is_grad_enabled():
            a = self.fused[1](q, kv, self.n_heads)                                         # N × D
        else:
            hd = D // self.n_heads
            k, v = (y.view(N, W, self.n_heads, hd).transpose(1, 2) for y in kv.split(D, dim=-1))
            a = last_query_attention(q.view(N, self.n_heads, hd), k, v).reshape(N, D)      # heads side by side
        y = x[:, -1] + self.proj(a)
        return y + self._mlp(y)


