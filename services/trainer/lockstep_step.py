"""R runs of one market and config trained as one computation: their update and their collection under
`torch.func.vmap` over the runs' stacked state (the lockstep study worker's step, `services.trainer.lockstep`; timed
against one run by bench/vmap_update.py).

Every run keeps its own everything: its networks, its optimizer's moments and learning rates (`FlatAdamW(runs=R)`),
its update buffers (knobs, entropy coefficient, embedding tables, metric sums), its replay and its accounts. What the
runs share is the code, the config baked into it and the market the collection and the objective read (the first
state's). The batched update, per call:
  schedule  each run's learning rates from its own update counter and knobs (`device_lrs`, vmapped)
  sample    each run's batch from its own replay (`Replay.sample`, vmapped over the runs' stacked replay tensors)
  targets   `make_targets`'s no-grad targets of every run's batch, vmapped over the runs' online and target networks
  loss      `make_objective`'s loss of every run, vmapped; one backward pass through their sum gives each run's own
            gradients (tests/test_vmap_runs.py)
  clip      each run's gradients clipped to `grad_clip` by its own norm
  AdamW     the product's `FlatAdamW` with a run dimension: each run's row steps as its own optimizer would
  target    θ' ← θ' + τ(θ − θ'): one lerp over the stacked target networks' flat buffer, as the product's
  entropy   each run's entropy coefficient adapted to its own batch's atom utilisation (`adapt_entropy_coef`)
  priority  each run's replay priorities from its own TD errors (`Replay.update_priorities`, vmapped)
  metrics   each run's `METRICS` added to its own epoch sums, as `train_step` adds them
The batched collection: `TrainEnv.collect` vmapped over every run's accounts, exploration knobs, acting view table and
replay (`BatchedCollect`). Each update also advances every run's rolling embedding refresh (`BatchedRefresh`). The
uniforms each call reads are static tensors: `draw_from(states)` draws them from every run's own generator in the
order its `StepRunner` would (collection, then each update), so a run trained in lockstep consumes its random stream
as it would alone (tests/test_lockstep.py); `draw()` draws them from one generator of the batch's own (the bench).

Imports: torch, `services.trainer.{buffers, flat_adamw, losses, objective, optim, replay, targets}`.
"""
from __future__ import annotations

import contextlib

import torch
from torch.func import stack_module_state, vmap

from services.trainer.buffers import METRICS, refresh_encode, refresh_rolling, refresh_store
from services.trainer.flat_adamw import FlatAdamW, flatten_parameters
from services.trainer.losses import adapt_entropy_coef
from services.trainer.objective import make_objective
from services.trainer.optim import device_lrs
from services.trainer.replay import Batch
from services.trainer.targets import Targets, make_targets, noise_width

BATCH_FIELDS = ("slot", "bar", "portfolio", "action", "regime", "rewards", "dones", "next_bar", "next_portfolio",
                "weight")


def tensor_attributes(obj: object) -> list[str]:
    return [k for k, v in vars(obj).items() if torch.is_tensor(v)]


@contextlib.contextmanager
def swapped(obj: object, values: dict[str, torch.Tensor]):
    """obj's tensor attributes set to `values` (inside vmap: one run's slices of the stacked tensors) for the block,
    then restored."""
    saved = {k: getattr(obj, k) for k in values}
    try:
        for k, v in values.items():
            setattr(obj, k, v)
        yield obj
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


def batched_sample(states: list, n: int):
    """(the runs' replay tensors stacked, sample(stacked, u R × n) → the R batches' `BATCH_FIELDS` stacked):
    `Replay.sample` of every run's own replay at once (the first run's replay object runs it on each run's slices)."""
    replay = states[0].replay
    names = tensor_attributes(replay)
    stacked = {k: torch.stack([getattr(s.replay, k) for s in states]) for k in names}

    def one(tensors: dict, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with swapped(replay, tensors):
            b = replay.sample(n, u=u)
        return tuple(getattr(b, f) for f in BATCH_FIELDS)

    return stacked, lambda tensors, u: vmap(one)(tensors, u)


class BatchedUpdate:
    """The update of R states' networks as one vmapped computation (see the module docstring)."""

    def __init__(self, states: list):
        st = self.st = states[0]
        self.cfg, self.R = st.cfg, len(states)
        dev, B = st.device, st.cfg.batch_size
        self.p, self.b = stack_module_state([s.agent for s in states])
        self.tp, self.tb = stack_module_state([s.target for s in states])
        bufs = [s.buffers for s in states]
        self.bufs = {k: torch.stack([getattr(x, k) for x in bufs]) for k in tensor_attributes(st.buffers)}
        views = [x.view_online for x in bufs]
        self.views = ({} if views[0] is None else
                      {k: torch.stack([getattr(v, k) for v in views]) for k in tensor_attributes(views[0])})
        for t in self.tp.values():
            t.requires_grad_(False)
        self.gen = torch.Generator(device=dev).manual_seed(0)
        self.replays, self.sample = batched_sample(states, B)
        U = max(st.cfg.updates_per_iter, 1)
        self.us = torch.zeros(U, self.R, B, device=dev)             # an iteration's updates: each its own uniforms
        self.noises = torch.zeros(U, self.R, B, noise_width(st.cfg), device=dev)
        self.u, self.noise = self.us[0], self.noises[0]
        self.objective = make_objective(st.agent, st.env.market.windows, st.buffers, st.cfg)
        self.targets = make_targets(st.agent, st.target, st.buffers, st.cfg)
        # the product's flat AdamW over its parameter groups, with a run dimension: each run clipped by its own norm
        name_of = {p: n for n, p in st.agent.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [self.p[name_of[p]] for p in g["params"]]}
                  for g in st.opt.param_groups]
        self.opt = FlatAdamW(groups, lr=st.cfg.lr, betas=(0.9, 0.999), eps=1e-6, runs=self.R)
        stacked_name = {p: n for n, p in self.p.items()}
        self.target_flat = flatten_parameters([self.tp[stacked_name[p]] for p in self.opt.params], runs=self.R)
        self.refresh = BatchedRefresh(self)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the batched state an update reads or writes, by name: the runs' networks, optimizer, update
        buffers and replays, and the uniforms it reads (several are views of one storage)."""
        named = (("online", self.p), ("online_buffer", self.b), ("target", self.tp), ("target_buffer", self.tb),
                 ("buffers", self.bufs), ("view", self.views), ("replay", self.replays))
        out = {f"{what}.{k}": v for what, d in named for k, v in d.items()}
        out |= {f"adamw.{k}": v for k, v in vars(self.opt).items() if torch.is_tensor(v)}
        out |= {f"adamw.{i}.{k}": v for i, s in enumerate(self.opt.state.values()) for k, v in s.items()
                if torch.is_tensor(v)}
        return out | {"target_flat": self.target_flat, "uniforms": self.us, "noises": self.noises}

    def _online(self, p: dict, b: dict):
        return torch.nn.utils.stateless._reparametrize_module(self.st.agent, {**p, **b})

    def _buffers(self, bufs: dict, views: dict):
        """The first state's update buffers holding one run's slices of the stacked ones (inside vmap)."""
        stack = contextlib.ExitStack()
        stack.enter_context(swapped(self.st.buffers, bufs))
        if views:
            stack.enter_context(swapped(self.st.buffers.view_online, views))
        return stack

    def _targets(self, p, b, tp, tb, bufs, views, batch, noise) -> tuple[torch.Tensor, ...]:
        with self._online(p, b), torch.nn.utils.stateless._reparametrize_module(self.st.target, {**tp, **tb}), \
                self._buffers(bufs, views):
            return tuple(self.targets(Batch(*batch), noise).tensors())

    def _loss(self, p, b, bufs, views, batch, noise, tg) -> tuple[torch.Tensor, torch.Tensor]:
        with self._online(p, b), self._buffers(bufs, views):
            o = self.objective(Batch(*batch), noise, Targets(*tg), lambda: None)
            return o.loss, o.priority.detach(), o.utilisation, torch.stack([o.metrics[k].float() for k in METRICS[:-1]])

    def _schedule(self, lrs: torch.Tensor, keep: torch.Tensor, bufs: dict, views: dict) -> tuple:
        with swapped(self.opt, {"lr_vector": lrs, "momentum_keep": keep}), self._buffers(bufs, views):
            device_lrs(self.opt, self.st.buffers, self.cfg)
        return ()                                          # in place: each run's row of the LRs, its counter

    def schedule(self) -> None:
        """Every run's learning rates for its next update from its own update counter and knobs, and the counter
        advanced (`device_lrs`, vmapped over the runs' rows of the optimizer's LR and momentum vectors)."""
        with torch.no_grad():
            vmap(self._schedule)(self.opt.lr_vector, self.opt.momentum_keep, self.bufs, self.views)

    def _prioritise(self, replay: dict, slot: torch.Tensor, td: torch.Tensor) -> tuple:
        with swapped(self.st.replay, replay):
            self.st.replay.update_priorities(slot, td)
        return ()                                          # in place: the stacked replays take the writes

    def _adapt(self, bufs: dict, utilisation: torch.Tensor) -> tuple:
        adapt_entropy_coef(bufs["entropy_coef"], utilisation, self.cfg.entropy_target, self.cfg.entropy_rate)
        return ()                                          # in place: each run's coefficient

    def losses(self, k: int = 0) -> tuple[tuple, tuple, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the runs' batches, their targets, their losses, their TD errors for the priorities, their atom
        utilisations for the entropy coefficient, their `METRICS` but the gradient norm: R × 7) of one step (the
        iteration's k-th update's uniforms), vmapped over the runs."""
        u, noise = self.us[k], self.noises[k]
        with torch.no_grad():
            batch = self.sample(self.replays, u)
            tg = vmap(self._targets, randomness="different")(self.p, self.b, self.tp, self.tb, self.bufs, self.views,
                                                             batch, noise)
        losses, td, util, metrics = vmap(self._loss, randomness="different")(self.p, self.b, self.bufs, self.views,
                                                                             batch, noise, tg)
        return batch, tg, losses, td, util, metrics

    def check(self, states: list) -> float:
        """The largest |Δ| between the batched loss of each run and the loss its own networks and buffers give (its
        own targets and objective) on the same batch and noise, relative to the loss."""
        self.draw()
        with torch.no_grad():
            batch, _, losses, *_ = self.losses()
            worst = 0.0
            for r, s in enumerate(states):
                b = Batch(*(x[r] for x in batch))
                tg = make_targets(s.agent, s.target, s.buffers, s.cfg)(b, self.noise[r])
                own = make_objective(s.agent, s.env.market.windows, s.buffers, s.cfg)(
                    b, self.noise[r], tg, lambda: None).loss
                worst = max(worst, float((losses[r] - own).abs() / own.abs().clamp(min=1e-12)))
        return worst

    def draw(self) -> None:
        """Every run's uniforms for the next step (each update of an iteration), into the static tensors it reads."""
        torch.rand(self.us.shape, generator=self.gen, out=self.us)
        torch.rand(self.noises.shape, generator=self.gen, out=self.noises)

    def draw_run(self, r: int, gen: torch.Generator, k: int) -> None:
        """Run r's uniforms of the iteration's k-th update from its own generator, as its `StepRunner` draws them:
        one batch × (1 + noise width) tensor, its first column the sampling uniforms."""
        u = torch.rand(self.cfg.batch_size, 1 + self.noises.shape[-1], generator=gen, device=self.us.device)
        self.us[k, r].copy_(u[:, 0])
        self.noises[k, r].copy_(u[:, 1:])

    def __call__(self, k: int = 0) -> torch.Tensor:
        self.schedule()
        staged = self.refresh.encode()
        batch, _, losses, td, util, metrics = self.losses(k)
        self.opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        self.refresh.store(staged)
        norms = self.opt.step(self.cfg.grad_clip)                                # each run's clip, then AdamW
        with torch.no_grad():
            self.bufs["metric_sums"].add_(torch.cat([metrics.detach(), norms.unsqueeze(-1).float()], -1))
            self.target_flat.lerp_(self.opt.flat, self.cfg.tau)  # θ' ← θ' + τ(θ − θ'), every run
            vmap(self._adapt)(self.bufs, util.detach())
            vmap(self._prioritise)(self.replays, batch[BATCH_FIELDS.index("slot")], td)
        return losses.detach()


class BatchedRefresh:
    """The rolling embedding refresh of R runs, vmapped over their networks and tables, in `train_step`'s order: the
    next chunk of bars encoded with the parameters an update starts from (`refresh_encode`, before its forward pass),
    stored into each run's tables after its backward pass (`refresh_store`: rows by `index_put_`, the offset in
    place), before the optimizer step."""

    def __init__(self, upd: BatchedUpdate):
        self.upd = upd

    def _encode(self, p, b, tp, tb, bufs, views) -> tuple[torch.Tensor, ...]:
        u = self.upd
        with u._online(p, b), torch.nn.utils.stateless._reparametrize_module(u.st.target, {**tp, **tb}), \
                u._buffers(bufs, views):
            return tuple(refresh_encode(u.st))

    def _store(self, bufs, views, staged) -> tuple:
        with self.upd._buffers(bufs, views):
            refresh_store(self.upd.st, list(staged))
        return ()                                          # in place: the stacked tables take the rows

    def encode(self) -> tuple[torch.Tensor, ...]:
        u = self.upd
        with torch.no_grad():
            return vmap(self._encode, randomness="error")(u.p, u.b, u.tp, u.tb, u.bufs, u.views)

    def store(self, staged: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            vmap(self._store, randomness="error")(self.upd.bufs, self.upd.views, staged)

    def check(self, states: list) -> float:
        """The largest |Δ| between the batched refresh and each run's own `refresh_rolling` from the same networks
        and tables, over the tables and the offset, relative to each table's scale. Each state then holds its own
        refresh's result."""
        self.store(self.encode())
        worst = 0.0
        u = self.upd
        for r, s in enumerate(states):
            refresh_rolling(s)
            own = {**{k: getattr(s.buffers, k) for k in u.bufs},
                   **{k: getattr(s.buffers.view_online, k) for k in u.views}}
            for k, got in {**u.bufs, **u.views}.items():
                d = (got[r].double() - own[k].double()).abs().max() / own[k].double().abs().max().clamp(min=1.0)
                worst = max(worst, float(d))
        return worst


def collect_objects(st) -> dict[str, object]:
    """The objects whose tensors `TrainEnv.collect` reads and writes, besides the replay, the networks and the update
    buffers."""
    return {"sim": st.env.sim, "tracker": st.env.tracker, "env": st.env, "controls": st.controls}


class BatchedCollect:
    """`TrainEnv.collect` of R states as one vmapped computation: each run's accounts (simulator, tracker, episode
    counters), exploration knobs, acting view table and replay, stacked; the runs' networks and replays are the
    `BatchedUpdate`'s, so the updates sample what the collection wrote. Inside vmap the first state's objects hold
    one run's slices; what `collect` rebinds (the simulator's state, written out of place) is handed back and
    copied into the stacks, what it writes in place (the replay's rows: `index_put_`) lands in them directly."""

    def __init__(self, states: list, upd: BatchedUpdate):
        st = self.st = states[0]
        self.upd, cfg = upd, st.cfg
        self.names = {k: tensor_attributes(o) for k, o in collect_objects(st).items()}
        self.state = {k: {n: torch.stack([getattr(collect_objects(s)[k], n) for s in states]) for n in names}
                      for k, names in self.names.items()}
        self.noise = torch.zeros(len(states), cfg.env_steps_per_iter, cfg.n_envs, 7, device=st.device)

    def _one(self, p, b, state, replay, bufs, views, noise):
        st, objs = self.st, collect_objects(self.st)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.nn.utils.stateless._reparametrize_module(st.agent, {**p, **b}))
            stack.enter_context(self.upd._buffers(bufs, views))
            stack.enter_context(swapped(st.replay, replay))
            for k, obj in objs.items():
                stack.enter_context(swapped(obj, state[k]))
            st.env.collect(st.agent, st.controls, st.cfg.env_steps_per_iter, st.buffers.emb_online, noise,
                           view_table=st.buffers.view_online)
            rebound = {k: {n: getattr(obj, n) for n in self.names[k] if getattr(obj, n) is not state[k][n]}
                       for k, obj in objs.items()}
            rebound["replay"] = {n: getattr(st.replay, n) for n in replay if getattr(st.replay, n) is not replay[n]}
        return rebound

    def draw(self) -> None:
        torch.rand(self.noise.shape, generator=self.upd.gen, out=self.noise)

    def __call__(self) -> None:
        u = self.upd
        with torch.no_grad():
            out = vmap(self._one, randomness="error")(u.p, u.b, self.state, u.replays, u.bufs, u.views, self.noise)
            for k, rebound in out.items():
                into = u.replays if k == "replay" else self.state[k]
                for n, v in rebound.items():
                    into[n].copy_(v)

    def check(self, states: list) -> float:
        """The largest |Δ| between the batched collection and each run's own `collect` (on the same noise, from the
        same state) over every tensor either writes (the accounts, the episode counters, the replay), relative to
        the tensor's scale. Each state then holds its own collection's result."""
        self.draw()
        self()
        worst = 0.0
        with torch.no_grad():
            for r, s in enumerate(states):
                s.env.collect(s.agent, s.controls, s.cfg.env_steps_per_iter, s.buffers.emb_online, self.noise[r],
                              view_table=s.buffers.view_online)
                for k, obj in {**collect_objects(s), "replay": s.replay}.items():
                    stacked = self.upd.replays if k == "replay" else self.state[k]
                    for n, got in stacked.items():
                        own = getattr(obj, n).double()
                        d = (got[r].double() - own).abs().max() / own.abs().max().clamp(min=1.0)
                        worst = max(worst, float(d))
        return worst


class BatchedIteration:
    """A training iteration of R runs: the batched collection, then `updates_per_iter` batched updates."""

    def __init__(self, states: list):
        self.upd = BatchedUpdate(states)
        self.col = BatchedCollect(states, self.upd)
        self.cfg, self.R = self.upd.cfg, self.upd.R

    def draw(self) -> None:
        self.col.draw()
        self.upd.draw()

    def __call__(self) -> torch.Tensor:
        self.col()
        return self.updates()

    def updates(self) -> torch.Tensor:
        """The iteration's batched updates, after its collection: one result per update's uniforms."""
        return torch.stack([self.upd(k) for k in range(len(self.upd.us))])

    def tensors(self) -> dict[str, torch.Tensor]:
        """`BatchedUpdate.tensors`, and the runs' accounts and the collection's uniforms."""
        out = self.upd.tensors()
        out |= {f"{obj}.{k}": v for obj, d in self.col.state.items() for k, v in d.items()}
        return out | {"collection_noise": self.col.noise}
