"""How an iteration runs: eagerly, compiled (torch.compile with the config's inductor options), captured in CUDA
graphs, or both (`StepRunner`), over static noise buffers so every mode consumes the same random stream; on CUDA
the side streams (the rolling refresh's encodings and the replay's priority write beside the update, its targets
beside its online forward pass) and bf16 autocast.

Owns: `StepRunner`, `compile_step`, `full_refresh_pass`, `inductor_options`. Imports: torch, `shared.agent`
(MarketView), `shared.graphs` (capture, StaticState, the compile cache), `services.trainer.{config, targets, step,
buffers, replay}`; `TrainState` for types only.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from shared.agent import MarketView
from shared.graphs import StaticState, capture, use_compile_cache
from services.trainer.buffers import encode_bars, refresh_encode
from services.trainer.config import TrainConfig
from services.trainer.replay import Batch
from services.trainer.sm_partition import partition_streams
from services.trainer.step import train_step
from services.trainer.targets import Targets, iqn_rows, noise_width, sample_horizons

if TYPE_CHECKING:
    from services.trainer.state import TrainState


def _targets_into(targets: Callable[[Batch, torch.Tensor], Targets], b: Batch, noise: torch.Tensor,
                  out: list[torch.Tensor]) -> None:
    """Write targets(b, noise) into the static tensors `out` (`Targets.tensors()` order). Compiled with it, each
    copy is the store of the kernel that computes the tensor; after the compiled call instead, it was one more
    multi-tensor copy kernel on the targets' stream (~20 µs at batch 4 096 on the H200)."""
    for o, t in zip(out, targets(b, noise).tensors()):
        o.copy_(t)


class StepRunner:
    """An iteration's step functions with static noise buffers, run eagerly, compiled, captured in CUDA graphs,
    or both (`accel`). The same Python code runs in every mode.

    collect():   n_envs × env_steps_per_iter environment steps (policy with ε and gates, simulator, rewards, replay
                 write, episode resets) — `TrainEnv.collect`.
    update():    sampling from replay, the full update (C51 + IQN + expectile + stability + hindsight losses,
                 backward, clip, AdamW, target lerp, priorities), LR schedule and cosine restarts on the device
                 (CUDA), metric sums and the rolling embedding refresh — `train_step` (on CUDA the refresh's
                 encodings run on a side stream beside the forward and backward passes, and the update's targets,
                 `make_targets`, on another beside its online forward pass: `target_stream`).
    iteration(): collect() then updates_per_iter × update() — in the graph modes one CUDA graph for all of it, so
                 a training iteration is one launch with no host work between its halves.
    Each call first draws its uniforms from the run's generator into static noise tensors (outside any graph), in
    the order the eager calls would (collection, then each update), so every mode consumes the same random stream.
    A graph is captured on the first call, whose warm-up run is that call's real step; later calls replay it.
    """

    part: torch.cuda.Stream | None = None

    def __init__(self, state: "TrainState", accel: str):
        self.state, self.accel = state, accel
        cfg, dev, env = state.cfg, state.device, state.env
        self.collect_noise = torch.zeros(cfg.env_steps_per_iter, cfg.n_envs, 7, device=dev)
        self.update_noise = [torch.zeros(cfg.batch_size, 1 + noise_width(cfg), device=dev)
                             for _ in range(max(cfg.updates_per_iter, 1))]
        collect_fn = lambda: env.collect(state.agent, state.controls, cfg.env_steps_per_iter,  # noqa: E731
                                         state.buffers.emb_online, self.collect_noise,
                                         view_table=state.buffers.view_online)
        update_fn = lambda noise, staged, join, via, prio: train_step(state, noise, staged, join, via, prio)  # noqa: E731
        encode_fn = lambda: refresh_encode(state)  # noqa: E731
        targets_fn = lambda b, noise, out: _targets_into(state.targets, b, noise, out)  # noqa: E731
        collect_fn, update_fn, encode_fn, targets_fn = (in_precision(f, cfg, dev) for f in
                                                        (collect_fn, update_fn, encode_fn, targets_fn))
        if "compile" in accel:
            collect_fn, update_fn, encode_fn, targets_fn = (compile_step(f, cfg, dev) for f in
                                                            (collect_fn, update_fn, encode_fn, targets_fn))
        self.encode_bars_compiled = "compile" in accel and dev.type == "cuda"
        self.encode_bars = full_refresh_pass(cfg, dev, self.encode_bars_compiled)
        """The epoch's full refresh of the embedding cache (`refresh_embeddings`), chunk by chunk, in the steps'
        precision and, compiled on CUDA, in one graph a network (LayerNorms and pointwise ops fused: eagerly in fp32
        they took 53 % of its GPU time, and the pass 0.503 s against 0.172 s so, `full` preset, 300 k bars, H100:
        bench/refresh_speed.py). Eager on a CPU, where the compiled pass was slower."""
        part = partition_streams(dev, 3) if dev.type == "cuda" else None
        self.part = part[0] if part else None
        """The stream the steps run on when the run's iterations are held to a partition of the SMs
        (`services.trainer.sm_partition`); None: the current stream, the whole GPU."""
        if dev.type == "cuda":
            # the rolling refresh's encodings on a side stream, beside the update's forward and backward passes
            # (both only read the parameters); the update waits for them just before its optimizer step. Static
            # staging tensors carry them across, so nothing allocated on one stream is freed on the other.
            side = part[1] if part else torch.cuda.Stream(device=dev)
            C, D = state.refresh_idx.shape[0], cfg.agent.d_model
            staging = [torch.zeros(C, D, device=dev), torch.zeros(C, D, device=dev)]
            if state.buffers.view_online is not None:
                staging += [torch.zeros(C, *getattr(state.buffers.view_online, f).shape[1:], device=dev)
                            for f in MarketView.FIELDS]
            join = torch._dynamo.disable(lambda: torch.cuda.current_stream().wait_stream(side))
            via = self._side_targets(targets_fn, part[2] if part else None) if cfg.target_stream else None
            prio = self._side_priorities(side) if cfg.priorities_aside else None

            def encode_aside() -> None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch._foreach_copy_(staging, list(encode_fn()))

            if cfg.refresh_at_backward and prio is not None:
                write_priorities = prio

                @torch._dynamo.disable
                def prio(slot: torch.Tensor, td: torch.Tensor) -> None:   # the loss is known: the backward is next
                    encode_aside()
                    write_priorities(slot, td)

                def update_call(noise: torch.Tensor) -> None:
                    update_fn(noise, staging, join, via, prio)
            else:
                def update_call(noise: torch.Tensor) -> None:
                    encode_aside()
                    update_fn(noise, staging, join, via, prio)
        else:
            def update_call(noise: torch.Tensor) -> None:
                update_fn(noise, None, lambda: None, None, None)
        self.pinned = StaticState(env.sim, env.tracker, env)
        if "graph" in accel:
            def collect_body():
                collect_fn()
                self.pinned.commit()
        else:
            collect_body = collect_fn

        def iteration_body():
            collect_body()
            for noise in self.update_noise[:cfg.updates_per_iter]:
                update_call(noise)
        self._bodies = {"collect": collect_body, "update": lambda: update_call(self.update_noise[0]),
                        "iteration": iteration_body}
        self._graphs: dict[str, object] = {}
        self._ran: set[str] = set()
        self.compile_s = 0.0
        """Seconds spent in first calls of the compiled or captured modes (compiling, capturing, running once)."""
        self.on_compile: Callable[[str | None], None] | None = None
        """Told what is being compiled when a first call starts ("compiling the iteration", …) and None when it
        ends: the trainer's /status phase and `tradeloop train`'s progress show it."""

    def _side_targets(self, targets_fn: Callable[[Batch, torch.Tensor, list[torch.Tensor]], None], stream=None
                      ) -> Callable[[Batch, torch.Tensor], tuple[Targets, Callable[[], None]]]:
        """The update's `targets_via` on CUDA: the batch's `Targets` on their own stream, beside the online forward
        pass (they read the batch, the parameters and the tables; the online pass reads the same), written into
        static tensors so nothing allocated on one stream is freed on the other (`_targets_into`); `wait()` joins
        them."""
        cfg, dev = self.state.cfg, self.state.device
        N, H, M = cfg.batch_size, sample_horizons(cfg), cfg.iqn_quantiles
        NBR, A = len(cfg.agent.branch_sizes), cfg.agent.n_atoms
        out = Targets(dist=torch.zeros(N, NBR, A, device=dev),
                      quantiles=torch.zeros(iqn_rows(cfg, N), H, M, device=dev),
                      value=torch.zeros(N, device=dev), blend=torch.zeros(N, H, device=dev))
        stream = stream if stream is not None else torch.cuda.Stream(device=dev)
        wait = torch._dynamo.disable(lambda: torch.cuda.current_stream().wait_stream(stream))

        @torch._dynamo.disable
        def via(b: Batch, noise: torch.Tensor) -> tuple[Targets, Callable[[], None]]:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                targets_fn(b, noise, out.tensors())
            return out, wait
        return via

    def _side_priorities(self, side: torch.cuda.Stream) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The update's `priorities_via` on CUDA: the replay's priority write on `side` (the rolling refresh's stream,
        which the update joins after its backward pass), run eagerly there. The batch's slots and TD errors come from
        the update's stream: `record_stream` keeps their memory from being reused before `side` has read them."""
        replay = self.state.replay

        @torch._dynamo.disable
        def via(slot: torch.Tensor, td: torch.Tensor) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                replay.update_priorities(slot, td)
            slot.record_stream(side)
            td.record_stream(side)
        return via

    @property
    def graphed(self) -> bool:
        return "graph" in self.accel

    def _run(self, name: str) -> None:
        if self.part is None:
            return self._step(name)
        here = torch.cuda.current_stream()
        self.part.wait_stream(here)               # the noise drawn and the state committed on `here` first
        with torch.cuda.stream(self.part):
            self._step(name)
        here.wait_stream(self.part)

    def _step(self, name: str) -> None:
        if self.accel != "eager" and name not in self._ran:
            return self._first(name)
        if not self.graphed:
            self._bodies[name]()
        elif name in self._graphs:
            self._graphs[name]()
        else:
            self._graphs[name] = capture(self._bodies[name], warmup=1, stream=self.part)

    def _first(self, name: str) -> None:
        """The first call of a step in a compiled or captured mode: compiles (torch.compile's caches in
        `shared.graphs.compile_cache_dir()`) and/or captures it, timed into `compile_s`, announced to `on_compile`."""
        what = " and capturing" if "compile" in self.accel and self.graphed else ""
        label = f"{'compiling' if 'compile' in self.accel else 'capturing'}{what} the {name} step"
        if self.on_compile is not None:
            self.on_compile(label)
        t0 = time.perf_counter()
        try:
            self._ran.add(name)
            self._step(name)
            if self.state.device.type == "cuda":
                torch.cuda.synchronize(self.state.device)
                if self.part is not None:       # a green context's stream: the device's sync does not wait for it
                    self.part.synchronize()
        finally:
            self.compile_s += time.perf_counter() - t0
            if self.on_compile is not None:
                self.on_compile(None)

    def _draw(self, t: torch.Tensor) -> None:
        torch.rand(t.shape, generator=self.state.generator, out=t)

    def collect(self) -> None:
        self._draw(self.collect_noise)
        self.pinned.commit()      # eager code between steps (episode resets, resume) may have rebound state
        self._run("collect")

    def update(self) -> None:
        self._draw(self.update_noise[0])
        self._run("update")

    def iteration(self, before_update: Callable[[], None] = lambda: None,
                  mark: Callable[[], object] = lambda: None) -> object:
        """collect(), then updates_per_iter × (before_update(), update()). In the graph modes the host's
        `before_update` calls all run first (host bookkeeping only: on CUDA the LR schedule is on the device), one
        graph replays the whole iteration, and None is returned; eagerly, the same calls in the same order, and
        `mark()` taken between the collection and the updates is returned (a clock reading)."""
        n = self.state.cfg.updates_per_iter
        if not self.graphed:
            self.collect()
            between = mark()
            for _ in range(n):
                before_update()
                self.update()
            return between
        self.draw_iteration()
        for _ in range(n):
            before_update()
        self.pinned.commit()
        self._run("iteration")
        return None

    def draw_iteration(self) -> None:
        """The uniforms of one whole iteration (its collection, then each update) into the static noise tensors, in
        the order the eager calls draw them: what the iteration's graph reads."""
        self._draw(self.collect_noise)
        for noise in self.update_noise[:self.state.cfg.updates_per_iter]:
            self._draw(noise)


def inductor_options(spec: str) -> dict[str, bool]:
    """`TrainConfig.inductor` ("a,!b,triton.c") as torch.compile's options ({"a": True, "b": False, "triton.c": True}:
    a leading "!" turns an option off, a dotted name is an option of a sub-config); ValueError naming an option that
    is not a boolean of `torch._inductor.config`."""
    from torch._inductor import config as inductor_config

    out = {}
    for item in (n.strip() for n in spec.split(",")):
        if not item:
            continue
        name = item.lstrip("!")
        value: object = inductor_config
        for part in name.split("."):                        # "triton.enable_pdl": an option of a sub-config
            value = getattr(value, part, None)
        if not isinstance(value, bool):
            raise ValueError(f"TrainConfig.inductor: {name!r} is not a boolean option of torch._inductor.config")
        out[name] = not item.startswith("!")
    return out


def compile_step(fn: Callable[..., object], cfg: TrainConfig, device: torch.device | str) -> Callable[..., object]:
    """`fn` through torch.compile with the config's inductor options, for a step on `device`.

    On a CPU with torch older than 2.13, without inductor's pattern-matcher passes: torch 2.11's lost the C51 heads'
    gradients of the compiled update on the CPU (`adv_w` 0, `value_w` 1e-3 of eager; the same graph through
    `aot_eager` and the same inductor with `pattern_matcher` off matched eager within 1.4e-6; CUDA and torch 2.13
    unaffected — tests/test_train_graph.py's one-batch test)."""
    use_compile_cache()
    options = inductor_options(cfg.inductor)
    if torch.device(device).type == "cpu" and torch.__version__ < "2.13":      # a TorchVersion: compared as one
        options.setdefault("pattern_matcher", False)
    return torch.compile(fn, options=options or None)


def full_refresh_pass(cfg: TrainConfig, device, compiled: bool) -> Callable[..., object]:
    """`encode_bars` in the steps' precision, through `compile_step` where `compiled` — compiled inside the
    precision's autocast (not the autocast wrapper compiled, as the steps are): a code object of its own, so its
    graphs (one a network) do not fill the steps' share of dynamo's per-code cache."""
    return in_precision(compile_step(encode_bars, cfg, device) if compiled else encode_bars, cfg, device)


def in_precision(fn: Callable[..., object], cfg: TrainConfig, device) -> Callable[..., object]:
    """fn in the precision the trainer runs its steps in on `device`: under bf16 autocast where `cfg.bf16` and the
    device is CUDA (`_bf16`), else fn itself. Every path that times or runs the trainer's steps wraps them here."""
    return _bf16(fn) if cfg.bf16 and torch.device(device).type == "cuda" else fn


def _bf16(fn: Callable[..., object]) -> Callable[..., object]:
    """fn under bf16 autocast; the autocast weight cache is off, as CUDA-graph capture requires."""
    def run(*args):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return fn(*args)
    return run
