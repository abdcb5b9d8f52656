"""CUDA-graph capture of a step function over stateful objects (the trainer's update and collection).

Small distributional-RL networks leave a GPU idle when each of their hundreds of kernels is launched from
Python; a CUDA graph replays the whole recorded sequence with one launch. A graph, though, replays fixed memory
addresses: every tensor the step reads must live at the address it had at capture, and every state the step
changes must be written back into that same memory. Our step code is written in the functional style that
reads best (`self.equity = torch.where(...)` rebinds an attribute to a new tensor), so `StaticState` pins it:

    state = StaticState(sim, tracker, env)        # remembers each tensor attribute of these objects
    def step():
        ...                                       # any code that rebinds attributes of those objects
        state.commit()                            # copy each rebound attribute back into its pinned tensor
    graphed = capture(step)                       # warm-up on a side stream, then record one graph
    graphed()                                     # replay (eagerly: just call step)

`commit` costs one device copy per rebound tensor, inside the graph, and leaves the objects pointing at their
pinned tensors again, so eager code run between replays (episode bookkeeping, checkpoints) sees the same state.

Randomness: the graphed steps take their uniforms from a noise tensor drawn *outside* the graph from the run's
generator (`torch.rand(..., out=noise, generator=g)`), so eager and captured runs consume the same random stream
and give the same results (the equivalence test), and no generator needs registering with the graph.

ML core: imports only torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch


ACCEL_MODES = ("eager", "compile", "graph", "compile+graph")
"""How a step function runs: eagerly, through torch.compile, captured in a CUDA graph, or compiled then captured."""

AUTO_ACCEL = {"cuda": "compile+graph", "cpu": "eager"}
"""What "auto" resolves to, by device type: the fastest mode measured there. On the H200 with the `full` preset,
compile + graph trains at 1 122 updates/s in an epoch after its first (`tradeloop train`, epoch 2) against 250 for
graph alone (bench/README.md, 2026-12-01). A CPU runs eagerly: no compiled mode has been measured faster there, and
torch 2.11's CPU inductor got the update's gradients wrong (`services.trainer.train.compile_step`). Other device
types run eagerly too."""


def resolve_accel(accel: str, device: torch.device | str) -> str:
    """'auto' → `AUTO_ACCEL` of the device's type (eager where it names none); ValueError for an unknown mode or a
    graph mode off CUDA."""
    device = torch.device(device)
    if accel == "auto":
        return AUTO_ACCEL.get(device.type, "eager")
    if accel not in ACCEL_MODES:
        raise ValueError(f"unknown accel mode {accel!r}: use auto or one of {', '.join(ACCEL_MODES)}")
    if "graph" in accel and device.type != "cuda":
        raise ValueError(f"accel={accel!r} needs a CUDA device (got {device}); use eager or compile")
    return accel


def _torch_default_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def compile_cache_dir() -> Path:
    """Where torch.compile's caches live (inductor's FX graph and AOTAutograd caches, the Triton kernels):
    `TORCHINDUCTOR_CACHE_DIR` when the user set it, else `$XDG_CACHE_HOME/tradeloop/inductor` (default
    `~/.cache/tradeloop/inductor`). torch's own default is a directory under /tmp, which a reboot or a fresh
    machine empties: then every run compiles from scratch (~50 s for the `full` preset on the H200). torch writes
    its default into `TORCHINDUCTOR_CACHE_DIR` when `torch._inductor` is first imported, so that value counts as
    unset."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given and os.path.abspath(given) != _torch_default_cache_dir():
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tradeloop" / "inductor"


def use_compile_cache() -> Path:
    """Point torch.compile at `compile_cache_dir()`, with its local FX graph and AOTAutograd caches on, before this
    process compiles anything (torch's in-memory caches of the directory are cleared when it moves); returns the
    directory. A second run of the same configuration then loads its kernels instead of generating them."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    d = str(compile_cache_dir().resolve())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") != d:
        from torch._inductor.utils import clear_caches

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        clear_caches()
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    return Path(d)


class StaticState:
    """Pins the tensor attributes of some objects so that a captured step updates them in place."""

    def __init__(self, *objects: object, skip: tuple[str, ...] = ()):
        self._pinned: list[tuple[object, str, torch.Tensor]] = [
            (obj, name, value) for obj in objects for name, value in vars(obj).items()
            if torch.is_tensor(value) and name not in skip]

    def commit(self) -> None:
        """Copy every rebound attribute into its pinned tensor and point the attribute back at it."""
        for obj, name, pinned in self._pinned:
            cur = getattr(obj, name)
            if cur is not pinned:
                pinned.copy_(cur)
                setattr(obj, name, pinned)


class Graphed:
    """A step function recorded in one CUDA graph; calling it replays the graph (no Python in the hot path)."""

    def __init__(self, fn: Callable[[], object], *, warmup: int = 3, pool=None, stream=None):
        self.fn = fn
        stream = stream if stream is not None else torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                 # warm-up: allocator, cuBLAS handles, lazy init
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):   # captured where it warmed up
            self.output = fn()

    def __call__(self) -> object:
        self.graph.replay()
        return self.output


def capture(fn: Callable[[], object], *, warmup: int = 3, pool=None, stream=None) -> Graphed:
    """Record `fn` in a CUDA graph after `warmup` eager calls on a side stream (which run for real: a step that
    changes state advances it `warmup` times; `stream`: that stream, else a new one). Returns the replayable
    `Graphed`; its `output` is what `fn` returned while captured (static tensors, overwritten by each replay)."""
    return Graphed(fn, warmup=warmup, pool=pool, stream=stream)
