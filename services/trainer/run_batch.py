"""Several runs' samples folded into one launch of the update's Triton ops, so that `torch.func.vmap` over the
runs' stacked networks keeps the fused kernels (bench/vmap_update.py, the step a run-batched study needs).

Every fused op (`fused_c51`, `fused_greedy`, `fused_attention`) works row by row: a sample's (or a window's) outputs
depend on that sample's inputs alone, and on the C51 support, one row of A atoms. So R runs' batches of N samples
are one batch of R·N: `vmap_by_folding` registers, for an op, the vmap rule that moves the run dimension of every
per-sample input to the front, merges it with the samples, calls the op once and splits its outputs back. The
support stays per run: a batched support is an R × A tensor, and the kernels read sample n's atoms from row
n // z_per with z_per = N (`support_rows`); an unbatched one is the same row for every sample.

The rule calls the op below the autograd dispatch key: the autograd formula registered on the op
(`register_autograd`) is recorded once, on the call the vmap rule serves, and its backward op then runs on the
folded tensors (tests/test_run_batch.py, eager and compiled)."""
from __future__ import annotations

from collections.abc import Sequence

import torch


def support_rows(support: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """(the support as rows of A atoms, contiguous fp32; z_per: the samples that share a row). `support` is A atoms
    for all n samples, or S × A with n a multiple of S, row s for samples s·n/S … (s + 1)·n/S − 1."""
    if support.dim() == 1:
        return support.contiguous().float(), max(n, 1)
    s = support.shape[0]
    if support.dim() != 2 or n % s:
        raise ValueError(f"support of shape {tuple(support.shape)} for {n} samples: needs A atoms, or S × A with S "
                         f"dividing the samples")
    return support.contiguous().float(), max(n // s, 1)


def runs_first(t: torch.Tensor, d: int | None, r: int) -> torch.Tensor:
    """An input of a vmap rule with its run dimension first: moved there, or (unbatched) the same for all r runs."""
    return t.movedim(d, 0) if d is not None else t.expand(r, *t.shape)


def vmap_by_folding(op, per_sample: Sequence[int], support: int | None = None) -> None:
    """Register op's vmap rule: the inputs at positions `per_sample` (leading dimension: samples) folded into one
    batch of R·N, the input at `support` (if any) kept as R rows, every output (leading dimension: samples) split
    back into R × N at dimension 0."""
    def rule(info, in_dims, *args):
        r = info.batch_size
        args, n = list(args), None
        for i in per_sample:
            t = runs_first(args[i], in_dims[i], r)
            n = t.shape[1]
            t = t.reshape(r * n, *t.shape[2:])
            args[i] = t if t.dim() == 1 or t.stride(-1) == 1 else t.contiguous()
        if support is not None and in_dims[support] is not None:
            args[support] = args[support].movedim(in_dims[support], 0)
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args)
        single = isinstance(out, torch.Tensor)
        outs = tuple(o.view(r, n, *o.shape[1:]) for o in ((out,) if single else out))
        return (outs[0], 0) if single else (outs, (0,) * len(outs))

    op.register_vmap(rule)


class AutocastLinear(torch.overrides.TorchFunctionMode):
    """`F.linear` with every floating operand cast to autocast's dtype where autocast is on, as autocast itself casts
    them: for steps vmapped over runs. Under `torch.func.vmap` a linear layer whose weights are batched runs as a
    product and then the bias added; autocast casts the product's operands but not the addition's, so a bf16 product
    plus an fp32 bias comes out fp32, and so does every layer after it (the fused attention on its fp32 path: 68 % of
    an 8-run vmapped iteration's GPU time on the H100, bench/README.md). With the operands cast first the vmapped step
    runs in the precision of one run's (tests/test_run_batch.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and args and torch.is_autocast_enabled(args[0].device.type):
            dt = torch.get_autocast_dtype(args[0].device.type)
            cast = lambda t: t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
            args, kwargs = tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def autocast_linear(fn):
    """fn run under `AutocastLinear`."""
    def run(*args):
        with AutocastLinear():
            return fn(*args)
    return run
