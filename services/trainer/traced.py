"""A stateful step compiled as one graph by tracing it at the level of aten ops (`make_fx`), for steps that
torch.compile cannot trace from their Python: the lockstep step (`lockstep_step.BatchedIteration`) runs R runs'
iterations under `torch.func.vmap` over objects whose tensors it swaps in and out with context managers, and dynamo
gives up on such a vmap (it must inline the vmapped function: "Unsupported functorch tracing attempt"), so under
torch.compile most of that step ran eagerly — ~1 500 kernels an iteration captured in its CUDA graph, against the
~400 of one run's compiled iteration (bench/README.md, 2026-12-06 · vmap_update.py).

    step = TracedStep(fn, compile_fn)    # fn(): no arguments; reads and writes tensors its objects hold
    step()                               # the first call runs fn once, for real, recording every aten op it issues
    step()                               # later calls run the recorded graph, compiled by compile_fn

What the trace records is what fn did on its first call: its Python (control flow, shapes, config values, which
context managers were entered) is baked in, as a CUDA graph bakes it in. fn must therefore read no tensor value on
the host (`.item()`, a branch on a tensor) — the same condition a step must meet to be captured in a CUDA graph,
which is how the trainer runs such steps. The tensors fn reads and writes are the objects' own, held by the graph
as constants: the compiled graph reads and updates them in place, views of one storage included (the parameters
of a flat optimizer buffer, the runs' slices of a stacked tensor). The recorded graph holds the backward pass as
plain ops and runs without autograd (`torch.no_grad`: AOTAutograd then takes mutated inputs that alias one
another, which it refuses in a graph it must differentiate); the casts autocast made while tracing are ops of the
graph.

Imports: torch.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx


class TracedStep:
    """fn traced on its first call, then run as `compile_fn(graph)` (module docstring). `traced`: whether the first
    call has happened (the next one compiles: a CUDA graph may capture the call after that)."""

    def __init__(self, fn: Callable[[], object], compile_fn: Callable[[torch.fx.GraphModule], Callable[[], object]]):
        self.fn, self.compile_fn = fn, compile_fn
        self.graph: torch.fx.GraphModule | None = None
        self.run: Callable[[], object] | None = None

    @property
    def traced(self) -> bool:
        return self.run is not None

    def __call__(self) -> object:
        if self.run is not None:
            with torch.no_grad():
                return self.run()
        out = []
        self.graph = make_fx(lambda: out.append(self.fn()) or out[0])()
        for n in self.graph.graph.nodes:        # gradients the trace left on the constants: the graph makes its own
            if n.op == "get_attr" and isinstance(t := getattr(self.graph, n.target, None), torch.Tensor):
                t.grad = None
        self.run = self.compile_fn(self.graph)
        return out[0]


class Sequenced:
    """Traced steps called one after another as one step: an iteration's collection, then its updates, each traced
    and compiled as a graph of its own (`traced_iteration`, graphs=2). `fn`: their eager functions in the same
    order, as a `TracedStep` has; `traced`: whether every one has been traced."""

    def __init__(self, *steps: TracedStep):
        self.steps = steps

    @property
    def traced(self) -> bool:
        return all(s.traced for s in self.steps)

    def fn(self) -> object:
        return [s.fn() for s in self.steps][-1]

    def __call__(self) -> object:
        return [s() for s in self.steps][-1]


def traced_iteration(it, wrap: Callable, compile_fn: Callable, graphs: int = 1) -> TracedStep | Sequenced:
    """A batched iteration `it` (`lockstep_step.BatchedIteration`) traced and compiled: graphs=1, the whole
    iteration as one graph; 2, its collection (`it.col`) and its updates (`it.updates`) as two. `wrap` puts a
    function in the step's precision (autocast) before it is traced."""
    if graphs == 1:
        return TracedStep(wrap(it), compile_fn)
    if graphs == 2:
        return Sequenced(TracedStep(wrap(it.col), compile_fn), TracedStep(wrap(it.updates), compile_fn))
    raise ValueError(f"graphs must be 1 or 2, not {graphs!r}")
