"""AdamW over one flat buffer: every parameter a view of it, one pass per step whatever the number of groups.

`torch.optim.AdamW` steps each parameter group on its own: under torch.compile its foreach form became ~20 Triton
kernels for the `full` agent's groups, plus the gradient clip's multi-tensor norm and scale and the target network's
multi-tensor lerp (~45 kernels, ~120 µs of a batch-4 096 update's 1.27 ms on the H200; bench/README.md).
Here the parameters are views of one flat float32 buffer (`flatten_parameters`), the gradients are concatenated
once, and the clip's norm, the moments, the decay and the step are a handful of element-wise passes over that
buffer, each parameter reading its group's learning rate and decay through a per-element group index. The target
network's parameters can be flattened the same way, so its update is one `lerp_` over a buffer.

The numbers are those of `torch.optim.AdamW` (decoupled weight decay, bias correction) after
`torch.nn.utils.clip_grad_norm_`, up to the order of float sums (tests/test_flat_adamw.py). With `runs=R`, every
parameter holds R runs' values along its first dimension (`torch.func.stack_module_state`'s stacks, for runs trained
as one vmapped computation): the buffer is R rows of one run's layout, and each row steps as that run's own
FlatAdamW would, its gradients clipped by their own norm, its learning rates and momentum factors its own (a
row of `lr_vector` and `momentum_keep` a run). The groups keep
torch's interface where the trainer reads it: `param_groups` (with "lr" a 0-d tensor, as a capturable torch
optimizer has it, to be written in place), `state[p]` with "exp_avg", "exp_avg_sq" (views of the flat moments) and
"step" (one counter all parameters share: every parameter steps at every update), `zero_grad`. Imports torch only.
"""
from __future__ import annotations

import torch


ALIGN = 32
"""Each parameter's view starts at a multiple of this many elements (128 bytes), as a parameter allocated on its
own does: kernels compiled for aligned inputs read every view with vector loads. Packed end to end instead, the
H200 stopped at "misaligned address" in the compiled update."""


def flat_layout(params: list[torch.Tensor]) -> tuple[list[int], int]:
    """Offsets of `params` in a flat buffer, each a multiple of `ALIGN`, and the buffer's length (the gaps hold 0)."""
    offsets, o = [], 0
    for p in params:
        offsets.append(o)
        o += -(-p.numel() // ALIGN) * ALIGN
    return offsets, o


def flatten_parameters(params: list[torch.nn.Parameter], runs: int | None = None) -> torch.Tensor:
    """Move `params` into one new flat float32 buffer, in order (`flat_layout`), each parameter's data becoming a
    view of it; returns the buffer. Autograd, state dicts and `copy_` see the same parameters as before. `runs=R`:
    each parameter is R runs' stacked along its first dimension, and the buffer R rows, row r holding run r's
    values in one run's layout."""
    dev = params[0].device
    if runs is not None and any(p.dim() < 1 or p.shape[0] != runs for p in params):
        raise ValueError(f"flatten_parameters: runs={runs} needs every parameter stacked {runs} runs deep; got "
                         f"{sorted({tuple(p.shape) for p in params if p.dim() < 1 or p.shape[0] != runs})}")
    lead = () if runs is None else (runs,)
    offsets, n = flat_layout([p if runs is None else p[0] for p in params])
    flat = torch.zeros(*lead, n, dtype=torch.float32, device=dev)
    with torch.no_grad():
        for p, o in zip(params, offsets):
            if p.dtype != torch.float32 or p.device != dev:
                raise ValueError(f"flatten_parameters: a {p.dtype} parameter on {p.device}; float32 on {dev} only")
            k = p.numel() // (runs or 1)
            flat[..., o:o + k].copy_(p.reshape(*lead, -1))
            p.data = flat[..., o:o + k].view(p.shape)
    return flat


class FlatAdamW:
    """AdamW with the gradient-norm clip built in, over parameters flattened into one buffer (module docstring).

    `groups`: torch-style parameter groups (dicts with "params", "weight_decay", an optional "lr" and any other
    keys, kept). `step(max_norm)` clips the gradients together by their global 2-norm (as `clip_grad_norm_`, inf =
    no clip; with `runs`, each run's by its own), takes the AdamW step and returns the norm (a device scalar; with
    `runs`, R of them). The groups' learning rates are views of one device vector (`lr_vector`), written in place by
    a schedule (`fill_`, or one copy on the device), and the step counter is a device tensor: nothing is read back
    on the host, a CUDA graph can capture the step, and torch.compile sees no changing Python floats (which would
    recompile it)."""

    def __init__(self, groups: list[dict], lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 runs: int | None = None):
        self.defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        self.param_groups = [{**self.defaults, **g, "params": list(g["params"])} for g in groups]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        params = [p for g in self.param_groups for p in g["params"]]
        self.params, self.runs = params, runs
        self.lead = () if runs is None else (runs,)
        """The run dimension the flat buffers, moments and LR vectors lead with: none, or (R,)."""
        self._sizes = [p.numel() // (runs or 1) for p in params]
        """Each parameter's elements in one run's layout."""
        self.flat = flatten_parameters(params, runs)
        dev, n = self.flat.device, self.flat.shape[-1]
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        # float64: 1 − β2^t in float32 loses ~5 digits at t = 1 (β2 = 0.999). One element, not 0-d: torch.compile
        # (2.13, CPU) lost the in-place increment of a 0-d float64 CPU tensor read back in the same graph (the step
        # always read 0; `t.add_(1.0); x.mul_(1 + t.float())` reproduces it, float32 and one element do not)
        self.step_count = torch.zeros(1, dtype=torch.float64, device=dev)
        self.offsets, _ = flat_layout([p if runs is None else p[0] for p in params])
        ends = self.offsets[1:] + [n]
        group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        gid = torch.cat([torch.full((e - o,), i, dtype=torch.int32) for i, o, e in zip(group_of, self.offsets, ends)])
        self.group_index = gid.to(dev)
        """Per element of the flat buffer: its parameter group."""
        self.decay = torch.tensor([g["weight_decay"] for g in self.param_groups], dtype=torch.float32, device=dev)
        G, lead = len(self.param_groups), self.lead
        self.momentum_keep = torch.ones(*lead, G, device=dev)
        """Per group: a factor on its first moment before the next step (0 = a reset; the trainer's cosine restarts
        write it on the device, `device_lrs`)."""
        lrs = torch.tensor([float(g["lr"]) for g in self.param_groups], dtype=torch.float32, device=dev)
        self.lr_vector = lrs.repeat(*lead, 1)
        """Per group (with `runs`: per run and group) its learning rate."""
        for i, g in enumerate(self.param_groups):
            g["lr"] = self.lr_vector[..., i]
        for p, o, k in zip(params, self.offsets, self._sizes):
            self.state[p] = {"step": self.step_count.view(()), "exp_avg": self.exp_avg[..., o:o + k].view(p.shape),
                             "exp_avg_sq": self.exp_avg_sq[..., o:o + k].view(p.shape)}
        self._gaps = [e - o - k for k, o, e in zip(self._sizes, self.offsets, ends)]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, max_norm: float = float("inf")) -> torch.Tensor:
        # the zeros are made from the flat buffer, not from a parameter: a parameter used in the compiled step
        # becomes a graph input aliasing the buffer the step mutates, and AOTAutograd then writes the buffer back
        # with a copy after the compiled kernels (a device-to-device memcpy of every parameter, ~9 µs at the end of
        # the batch-4 096 update on the H200)
        lead = self.lead
        parts = []
        for p, k, gap in zip(self.params, self._sizes, self._gaps):
            parts.append(p.grad.reshape(*lead, -1).float() if p.grad is not None else self.flat.new_zeros(*lead, k))
            if gap:
                parts.append(self.flat.new_zeros(*lead, gap))
        g = torch.cat(parts, dim=-1)
        norm = g.square().sum().sqrt() if self.runs is None else g.square().sum(-1).sqrt()      # each run's own
        if max_norm != float("inf"):
            scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            g = g * (scale if self.runs is None else scale.unsqueeze(-1))
        beta1, beta2 = self.defaults["betas"]
        eps = self.defaults["eps"]
        self.step_count.add_(1.0)
        t = self.step_count
        step_size = (1.0 / (1.0 - beta1 ** t)).float()                         # 1 / bias correction 1
        bc2_sqrt = (1.0 - beta2 ** t).sqrt().float()
        lr = self.lr_vector[..., self.group_index]
        wd = self.decay[self.group_index]
        self.exp_avg.mul_(self.momentum_keep[..., self.group_index]).lerp_(g, 1.0 - beta1)
        self.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        self.flat.mul_(1.0 - lr * wd)
        self.flat.sub_(lr * step_size * self.exp_avg / (self.exp_avg_sq.sqrt() / bc2_sqrt + eps))
        return norm
