"""A Linear layer's weight and bias gradients in one Triton kernel (CUDA): `linear(x, weight, bias)`.

Why: in the compiled update's backward each Linear layer was five kernels on the H200 — cuBLAS's input-gradient
GEMM, its split-K weight-gradient GEMM and that split's reduction, and inductor's bias sum, itself split in two —
and the update's ~25 layers made ~70 µs of split-K reductions and bias sums, most under 2 µs, each paying a launch
(bench/train_profile.py, sessions 19–21). Here the input gradient stays cuBLAS's GEMM, and one kernel makes both
dW = gᵀx and db = Σ g: each program takes an output tile of dW and a slice of the rows and writes its partial sums
to a scratch slot; the tile's last program to arrive (an atomic counter) adds the slots in a fixed order and writes
the tile, so the split needs no second kernel, nothing is zeroed, and the sums do not depend on which program
finishes first.

The products are exact (bf16 operands held in fp32 and multiplied as TF32, whose mantissa holds theirs; fp32
operands as IEEE fp32) and accumulate in fp32, as cuBLAS's. `linear` is `F.linear` forward; backward, (dx, dW, db)
as torch computes them, up to the order of float sums: tests/test_fused_linear.py, on a GPU or under Triton's
interpreter. Off by default (`TrainConfig.linear_grad`) until timed on the H200.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from services.trainer.fused_c51 import available

BLOCK = {"o": 64, "i": 64, "n": 64}
"""Tile of dW a program holds (o × i) and rows it adds a step (n)."""
TARGET_PROGRAMS = 264
"""Programs to aim for (two per SM of the H200's 132): the rows are split until the tiles reach this many."""


def supported(x: torch.Tensor) -> bool:
    """Whether the kernel runs for x (CUDA with Triton, `fused_c51.available`)."""
    return available(x)


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
"""Per (device, number of dW tiles): the kernel's arrival counters, zeroed once and set back to 0 by each call's
last programs (so a captured CUDA graph replays with no fill). Calls on one stream run one after another, so layers
with as many tiles share them."""


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    key = (str(device), tiles)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(tiles, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def weight_grads_triton(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gᵀx, Σ_rows g) of g N × O and x N × I as fp32 O × I and O, by the Triton kernel (CUDA, or Triton's
    interpreter on CPU tensors)."""
    import triton
    from services.trainer import _linear_triton
    N, O = g.shape
    I = x.shape[1]
    g, x = g.contiguous(), x.contiguous()
    dw = torch.empty(O, I, dtype=torch.float32, device=g.device)
    db = torch.empty(O, dtype=torch.float32, device=g.device)
    BO, BI, BN = BLOCK["o"], BLOCK["i"], BLOCK["n"]
    grid_o, grid_i = triton.cdiv(O, BO), triton.cdiv(I, BI)
    tiles = grid_o * grid_i
    splits = max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(N, BN)))
    rows = triton.cdiv(triton.cdiv(N, splits), BN) * BN
    splits = triton.cdiv(N, rows)
    part = torch.empty(tiles * splits * (BO * BI + BO), dtype=torch.float32, device=g.device)
    _linear_triton.weight_grads[(grid_o, grid_i, splits)](
        g, x, part, _counters(g.device, tiles), dw, db, N, O, I, ROWS=rows, SPLITS=splits, BO=BO, BI=BI, BN=BN,
        IEEE=g.dtype == torch.float32, num_warps=4)
    return dw, db


@torch.library.custom_op("tradeloop::linear_weight_grads", mutates_args=())
def weight_grads(g: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gᵀx, Σ_rows g), fp32: the Triton kernel on CUDA, torch's products elsewhere."""
    if g.is_cuda:
        return weight_grads_triton(g, x)
    return g.float().t() @ x.float(), g.float().sum(0)


@weight_grads.register_fake
def _(g, x):
    return g.new_empty(g.shape[1], x.shape[1], dtype=torch.float32), g.new_empty(g.shape[1], dtype=torch.float32)


class _Linear(torch.autograd.Function):
    """F.linear forward; backward the input's gradient by a GEMM and the weight's and bias's by `weight_grads`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):           # what autocast's F.linear would compute in
            dt = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dt), weight.to(dt)
            bias = None if bias is None else bias.to(dt)
        with torch.autocast(x.device.type, enabled=False):
            y = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = g.to(x.dtype)
        gx = g @ weight                                                                     # … × I
        dw, db = weight_grads(g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]))
        return gx, dw, db if ctx.has_bias else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), whose backward makes the weight's and bias's gradients in one kernel (module
    docstring)."""
    return _Linear.apply(x, weight, bias)
