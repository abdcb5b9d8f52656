"""K runs of one market and one config trained epoch by epoch in lockstep: each run keeps its own `TrainState` (its
loop, checkpoints, evaluation and feedback are those of a run alone), and the iterations of an epoch run as one
computation over all of them (`lockstep_step.BatchedIteration`: R runs' collection and updates under vmap).

    group = Lockstep(K)                          # one per group; member i trains through group.member(i)
    train_run(..., train_fn=group.member(i))     # in K threads, one per run; each calls group.leave() when done
    train_in_lockstep(runs, run)                 # the same: run(run, train_fn) in a thread each, the group's rounds

A member's `train(state, knobs)` waits until every member still in the group has asked for its next epoch; the last
to ask runs the round for all:
  - in step (same epoch, update count, env steps, learning gate and optimizer step: `in_step`): each run's set-up
    (`start_epoch`, the embedding refresh) on its own state, then its state copied into its slot of the batched
    state (`LockstepEngine.load`), the epoch's iterations batched, the slots copied back (`store`), and each run's
    `end_epoch` — the same rules as `train_epoch`, which this file calls rather than restates;
  - runs at different epochs (a resume of a group killed while its runs saved an epoch): those behind train theirs
    alone (`train_epoch`) while the others wait, until the group is at one epoch again;
  - at one epoch but not in step (a rollback that restored another update count or optimizer step), or one member
    left: each trains its epoch alone, one after another.
The iterations draw every run's uniforms from that run's own generator, in the order its `StepRunner` would: an
eager lockstep epoch trains each run as `train_epoch` does, up to the order of float sums (tests/test_lockstep.py).
The batched state is built for the group's first round and kept (the compiled and captured step reads its
addresses); a member that has left keeps its slot, trained on its last state and never copied back. Compiled (the
runs' accel), the step is traced on its first call at the level of aten ops and that graph compiled
(`traced.TracedStep`: torch.compile's dynamo cannot trace the vmap and ran most of it eagerly) — as one graph, or
its collection and its updates as two (`TrainConfig.lockstep_graphs`); a CUDA graph captures it after that.

Not in lockstep: `TrainConfig.policy_ema` (the average's update is not batched: `LockstepEngine` refuses it).
Imports: torch, `services.trainer.{lockstep_step, loop, optim, run_batch, runtime, state, traced}`, `shared.graphs`.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

import torch

from services.trainer.lockstep_step import BatchedIteration, collect_objects
from services.trainer.loop import EpochStats, end_epoch, iteration_plan, ready_to_train, start_epoch, train_epoch
from services.trainer.optim import age_groups
from services.trainer.run_batch import autocast_linear
from services.trainer.runtime import compile_step, in_precision
from services.trainer.state import TrainState, adapt_support
from services.trainer.traced import Sequenced, TracedStep, traced_iteration
from shared.graphs import capture


def optimizer_step(state: TrainState) -> float:
    """The optimizer's step counter (every parameter shares it)."""
    st = next(iter(state.opt.state.values()))
    return float(st["step"])


def in_step(states: list[TrainState]) -> bool:
    """Whether the runs can train their next epoch as one: the same epoch, update count, env steps, learning gate
    and optimizer step (the batched optimizer's step counter is one for all)."""
    keys = {(s.epoch, s.update_step, s.env_steps, s.learn_from, optimizer_step(s)) for s in states}
    return len(keys) == 1


def batched_precision(fn, cfg, device):
    """A batched step in the precision the trainer's steps run in (`in_precision`), its vmapped linear layers kept in
    autocast's dtype (`run_batch.autocast_linear`)."""
    return autocast_linear(in_precision(fn, cfg, device))


class LockstepEngine:
    """The batched state of K runs (one slot each) and its compiled step: `load`/`store` copy a run's state into
    and out of its slot, `epoch` trains the runs of some slots one epoch."""

    def __init__(self, states: list[TrainState]):
        st = states[0]
        why = self.refusal(states)
        if why:
            raise ValueError(f"lockstep: {why}")
        self.states = list(states)
        self.it = BatchedIteration(states)
        self.cfg = st.cfg
        cuda = st.device.type == "cuda"
        self.sync = (lambda: torch.cuda.synchronize(st.device)) if cuda else (lambda: None)
        precise = lambda fn: batched_precision(fn, st.cfg, st.device)  # noqa: E731
        step = precise(self.it)
        self.collect = precise(self.it.col)                                         # warm-up iterations: eager
        if "compile" in st.accel:           # the runs' own accel (`resolve_accel`'s), as their `StepRunner`s
            step = traced_iteration(self.it, precise, lambda graph: compile_step(graph, st.cfg, st.device),
                                    st.cfg.lockstep_graphs)
        self.step, self.graphed = step, "graph" in st.accel and cuda
        self.graph = None
        self.calls = 0                      # calls of the step before it runs warm: the trace, then the compile
        self.warm_calls = 2 if isinstance(step, (TracedStep, Sequenced)) else 1
        self.compile_s = 0.0

    @staticmethod
    def refusal(states: list[TrainState]) -> str | None:
        """Why these runs cannot share a batched state (None: they can)."""
        st = states[0]
        if len({s.cfg.hash() for s in states}) > 1:
            return "the runs' configs differ (the batched step bakes one in)"
        if st.cfg.policy_ema > 0:
            return "policy_ema > 0 (the moving average's update is not batched)"
        m = st.env.market
        for s in states[1:]:
            o = s.env.market
            if (o.start, len(o), s.device) != (m.start, len(m), st.device) or not torch.equal(o.prices.close,
                                                                                               m.prices.close):
                return "the runs train on different markets (the batched step reads the first run's)"
        return None

    def _pairs(self, r: int, st: TrainState) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot r's tensor, the run's own) for everything an iteration reads or writes."""
        it, u = self.it, self.it.upd
        own_p, own_b = dict(st.agent.named_parameters()), dict(st.agent.named_buffers())
        tgt_p, tgt_b = dict(st.target.named_parameters()), dict(st.target.named_buffers())
        out = [(u.p[n].detach()[r], own_p[n]) for n in u.p] + [(u.b[n][r], own_b[n]) for n in u.b]
        out += [(u.tp[n].detach()[r], tgt_p[n]) for n in u.tp] + [(u.tb[n][r], tgt_b[n]) for n in u.tb]
        for n, p in u.p.items():
            mine, theirs = u.opt.state[p], st.opt.state[own_p[n]]
            out += [(mine[k][r], theirs[k]) for k in ("exp_avg", "exp_avg_sq")]
        out += [(u.bufs[k][r], getattr(st.buffers, k)) for k in u.bufs]
        out += [(u.views[k][r], getattr(st.buffers.view_online, k)) for k in u.views]
        out += [(u.replays[k][r], getattr(st.replay, k)) for k in u.replays]
        objs = collect_objects(st)
        out += [(t[r], getattr(objs[o], n)) for o, names in it.col.state.items() for n, t in names.items()]
        return out

    @torch.no_grad()
    def load(self, slots: list[int], states: list[TrainState]) -> None:
        for r, st in zip(slots, states):
            for mine, theirs in self._pairs(r, st):
                mine.copy_(theirs)
            self.states[r] = st
        self.it.upd.opt.step_count.fill_(optimizer_step(states[0]))

    @torch.no_grad()
    def store(self, slots: list[int], states: list[TrainState]) -> None:
        steps = self.it.upd.opt.step_count
        for r, st in zip(slots, states):
            for mine, theirs in self._pairs(r, st):
                theirs.copy_(mine)
            for s in st.opt.state.values():
                s["step"].copy_(steps.view(()).to(s["step"].dtype))

    def _draw(self, slots: list[int], states: list[TrainState], updates: int) -> None:
        """Each run's uniforms for the next iteration from its own generator, in its `StepRunner`'s order: the
        collection's, then each update's."""
        col, upd = self.it.col, self.it.upd
        for r, st in zip(slots, states):
            torch.rand(col.noise[r].shape, generator=st.generator, out=col.noise[r])
            for k in range(updates):
                upd.draw_run(r, st.generator, k)

    def _iteration(self) -> None:
        if self.graph is not None:
            self.graph()
            return
        if self.calls >= self.warm_calls:
            self.step()
            return
        t0 = time.perf_counter()                # the first calls: tracing, compiling, capturing
        if self.graphed and self.calls == self.warm_calls - 1:
            self.graph = capture(self.step, warmup=1)           # the warm-up call compiles and runs the step
        else:
            self.step()
        self.calls += 1
        self.sync()
        self.compile_s += time.perf_counter() - t0

    def epoch(self, slots: list[int], states: list[TrainState], knobs: list, progress: list) -> list[EpochStats]:
        """One epoch of the runs `states` (in slots `slots`, in step) under their `knobs`: `train_epoch`'s set-up and
        end on each run's own state, the iterations batched."""
        cfg, lead = self.cfg, states[0]
        U = cfg.updates_per_iter
        t_setup = time.perf_counter()
        for st, k in zip(states, knobs):
            start_epoch(st, k)
            ready_to_train(st)
        self.it.upd.st.agent.train()            # the module the vmapped calls run (dropout on)
        env0 = lead.env_steps
        self.load(slots, states)
        self.sync()
        t0 = time.perf_counter()
        compile0, n_upd, support_set = self.compile_s, 0, False
        for i in range(cfg.iterations):
            after, learn, first = iteration_plan(lead, support_set)
            if not learn or first:
                self._draw(slots, states, 0)
                self.collect()
                if first:        # the first learning iteration collects only, then each run sets its support
                    self.store(slots, states)
                    for st in states:
                        adapt_support(st, weight=1.0, min_rows=max(cfg.horizons) + 1)
                    self.load(slots, states)
                    support_set = True
            else:
                self._draw(slots, states, U)
                self._iteration()
                n_upd += U
                for st in states:
                    st.update_step += U
            for st, report in zip(states, progress):
                st.env_steps = after
                if report is not None:
                    report(i + 1, cfg.iterations)
        self.store(slots, states)
        self.sync()
        seconds = time.perf_counter() - t0
        setup_s = t0 - t_setup
        out = []
        for st, k in zip(states, knobs):
            age_groups(st.opt, n_upd)           # `set_lrs`'s host bookkeeping of the epoch's updates
            out.append(end_epoch(st, k, n_upd=n_upd, env_steps=st.env_steps - env0, t_env=seconds, t_upd=seconds,
                                 seconds=seconds, compile_s=self.compile_s - compile0, setup_s=setup_s))
        return out


class Lockstep:
    """A lockstep group of `n` members, each a thread running its own run's loop with `member(i)` as its
    `train_fn` (module docstring). `rounds`: how many rounds trained in lockstep and how many alone."""

    def __init__(self, n: int):
        self.cv = threading.Condition()
        self.active = n
        self.arrived: dict[int, tuple] = {}
        self.results: dict[int, object] = {}
        self.engine: LockstepEngine | None = None
        self.slots: dict[int, int] = {}
        self.rounds = {"lockstep": 0, "alone": 0}

    def member(self, i: int) -> Callable[..., EpochStats]:
        return lambda state, knobs, progress=None: self.train(i, state, knobs, progress)

    def leave(self) -> None:
        """A member is done (or failed): the others no longer wait for it."""
        with self.cv:
            self.active -= 1
            self._run_if_all_here()

    def train(self, i: int, state: TrainState, knobs, progress=None) -> EpochStats:
        with self.cv:
            self.arrived[i] = (state, knobs, progress)
            self._run_if_all_here()
            while i not in self.results:
                self.cv.wait()
            out = self.results.pop(i)
        if isinstance(out, BaseException):
            raise out
        return out

    def _run_if_all_here(self) -> None:
        if not self.arrived or len(self.arrived) < self.active:
            return
        members = sorted(self.arrived)
        states = [self.arrived[i][0] for i in members]
        behind = min(s.epoch for s in states)
        if any(s.epoch != behind for s in states):     # runs behind the others train alone until they catch up
            members = [i for i, s in zip(members, states) if s.epoch == behind]
            states = [self.arrived[i][0] for i in members]
        try:
            if self._together(members, states):
                slots = [self.slots[i] for i in members]
                stats = self.engine.epoch(slots, states, [self.arrived[i][1] for i in members],
                                          [self.arrived[i][2] for i in members])
                self.rounds["lockstep"] += 1
            else:
                stats = [train_epoch(s, self.arrived[i][1], self.arrived[i][2]) for i, s in zip(members, states)]
                self.rounds["alone"] += 1
            results: dict[int, object] = dict(zip(members, stats))
        except BaseException as exc:  # noqa: BLE001 — every member of the round raises it
            results = {i: exc for i in members}
        self.results.update(results)
        for i in members:                                # the others' epochs wait for the next round
            del self.arrived[i]
        self.cv.notify_all()

    def _together(self, members: list[int], states: list[TrainState]) -> bool:
        if len(members) < 2 or not in_step(states):
            return False
        if self.engine is None:
            if LockstepEngine.refusal(states) is not None:
                return False
            self.engine = LockstepEngine(states)
            self.slots = {i: r for r, i in enumerate(members)}
        return all(i in self.slots for i in members)


def train_in_lockstep(members: list, run: Callable[[object, Callable[..., EpochStats]], None]) -> dict[str, int]:
    """`run(member, train_fn)` of each member in a thread of its own, `train_fn` its place in one `Lockstep` group
    (left when `run` returns or raises); the group's `rounds` once every thread has ended."""
    group = Lockstep(len(members))

    def one(i: int, m) -> None:
        try:
            run(m, group.member(i))
        finally:
            group.leave()

    threads = [threading.Thread(target=one, args=(i, m), name=f"lockstep-{i}") for i, m in enumerate(members)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(group.rounds)
