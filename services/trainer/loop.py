"""The epoch loop: `train_epoch(state, knobs) -> EpochStats` (apply knobs → fresh episodes → iterations of
collect ⇄ update → stats) and `train_run` (open or resume a run directory, then for each epoch: roll back if asked
→ train → checkpoint → history).

Owns: `EpochStats` (one line of history.jsonl), the phase clock, interruption at an iteration boundary and the
resumed epoch, the run's lifecycle for `tradeloop train` (`open_run`, the resume check `rundir.latest_epoch`).
Imports: every other trainer module; torch, numpy, `shared.{knobs, market}`.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from shared.knobs import Knobs
from shared.market import Bars, Split, chronological_split, compute_features
from services.trainer.buffers import METRICS, refresh_embeddings
from services.trainer.checkpoint import EpochProgress, prune_checkpoints, restore_state, roll_back, start_save_epoch
from services.trainer.config import TrainConfig
from services.trainer.optim import set_lrs
from services.trainer.rundir import append_history, latest_epoch, read_run_json, write_run_json
from services.trainer.state import (TrainState, adapt_support, apply_knobs, average_epoch_end, build_state,
                                    perturb_due, restart_due, restart_fresh, shrink_perturb)


@dataclass
class EpochStats:
    """One line of history.jsonl."""

    epoch: int
    loss: float
    c51: float
    iqn: float
    expectile: float
    q_mean: float
    entropy: float
    utilisation: float
    epsilon: float
    gamma: float
    v_max: float
    maturity: float
    env_steps: int
    updates: int
    env_steps_per_s: float
    """Account-steps per second of collection time; an iteration captured whole (collection and updates in one
    graph) counts entirely here and in `updates_per_s`."""
    updates_per_s: float
    seconds: float
    compile_s: float
    """Of `seconds`, the first calls of the compiled or captured steps (compiling, capturing): the first epoch of a
    process in those modes; 0 eagerly and once compiled."""
    train_per_trade_sharpe: float
    """Un-annualized, per trade, of the trades closed while collecting this epoch (with exploration)."""
    train_trades: int
    knobs: dict
    rolled_back_to: int | None = None
    """The epoch whose learner a feedback rollback restored before this epoch trained (`roll_back`), else None."""
    save_s: float | None = None
    """Seconds after `seconds` writing the epoch's weights and trainer state and pruning older ones, less the time
    the state's write ran beside `train_run`'s `on_epoch` (an evaluation)."""
    setup_s: float | None = None
    """Seconds before `seconds`: the knobs, a restart, fresh episodes and the embedding cache's full refresh
    (`refresh_embeddings`: every training bar through the online and target encoders)."""
    rollback_s: float | None = None
    """Seconds before `setup_s` restoring the learner a feedback rollback named (`roll_back`: reading the best
    epoch's checkpoints back, their sha256 checked); None in an epoch that did not begin from a rollback."""



class PhaseClock:
    """Seconds spent in the phases of an epoch without stalling the GPU: the host clock on a CPU; on CUDA, events
    recorded on the stream between phases (no sync in the loop) and read once, in `totals`, at the epoch's end."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple[str, object, object]] = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def add(self, phase: str, start, end) -> None:
        self.spans.append((phase, start, end))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for phase, a, b in self.spans:
            out[phase] = out.get(phase, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out



class EpochInterrupted(Exception):
    """`train_epoch` stopped at an iteration boundary because `interrupt()` returned True; the state is consistent
    there (no step half done) and `progress` says how far the epoch got."""

    def __init__(self, progress: EpochProgress):
        super().__init__(f"epoch {progress.epoch} interrupted after iteration {progress.iteration}/"
                         f"{progress.iterations}")
        self.progress = progress


def train_epoch(state: TrainState, knobs: Knobs, progress: Callable[[int, int], None] | None = None,
                between: Callable[[int], Knobs | None] | None = None, *,
                interrupt: Callable[[], bool] | None = None, resume: EpochProgress | None = None) -> EpochStats:
    """One epoch: apply knobs → fresh episodes → iterations of (collect E × env_steps_per_iter, update) → stats.

    `between(it)` is asked before each iteration: new knobs it returns are applied there and rule the rest of the
    epoch (the trainer's overlap mode: a bundle that arrives mid-epoch). `interrupt()` is asked there too: True
    raises `EpochInterrupted` at that boundary. `resume` (with the state of `restore_interrupted`) finishes an
    interrupted epoch: its remaining iterations under `knobs` (those in effect when it stopped), with fresh
    episodes, the support as it was, and the epoch's sums carried, so its stats cover the whole epoch."""
    cfg = state.cfg
    t_setup = time.perf_counter()
    if resume is None:
        start_epoch(state, knobs)
        start, n_upd, n_env0, t_before, spent_before = 0, 0, state.env_steps, 0.0, {}
    else:
        apply_knobs(state, knobs)
        if (resume.epoch, resume.iterations) != (state.epoch + 1, cfg.iterations):
            raise ValueError(f"cannot resume epoch {resume.epoch} ({resume.iterations} iterations) on a state after "
                             f"epoch {state.epoch} ({cfg.iterations} iterations an epoch)")
        fresh_episodes(state)
        start, n_upd = resume.iteration, resume.updates
        n_env0, t_before, spent_before = state.env_steps - resume.env_steps, resume.seconds, resume.phases
    ready_to_train(state)
    runner = state.runner
    compile0 = runner.compile_s
    cuda = state.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(state.device)     # the refresh's kernels counted in setup_s, not in the iterations
    t0 = time.perf_counter()
    setup_s = t0 - t_setup
    clock = PhaseClock(cuda)

    def before_update() -> None:                # host bookkeeping of one update (LRs on a CPU, group ages)
        nonlocal n_upd
        set_lrs(state.opt, state.update_step, knobs.lr_scale, cfg, write_lr=not cuda, lr_decay=knobs.lr_decay)
        n_upd += 1
        state.update_step += 1

    support_set = False
    for it in range(start, cfg.iterations):
        if interrupt is not None and interrupt():
            spent = clock.totals()
            raise EpochInterrupted(EpochProgress(
                epoch=state.epoch + 1, iteration=it, iterations=cfg.iterations, updates=n_upd,
                env_steps=state.env_steps - n_env0, seconds=t_before + time.perf_counter() - t0,
                phases={k: spent_before.get(k, 0.0) + spent.get(k, 0.0) for k in {*spent_before, *spent}},
                knobs=knobs.to_dict()))
        if between is not None and (new := between(it)) is not None:
            apply_knobs(state, new)
            knobs = new
        after, learn, first = iteration_plan(state, support_set)
        ta = clock.now()
        if not learn or first:
            runner.collect()
            clock.add("env", ta, clock.now())
            if first:         # the run's first learning iteration collects only, then sets the support for its updates
                adapt_support(state, weight=1.0, min_rows=max(cfg.horizons) + 1)
                support_set = True
        elif (tb := runner.iteration(before_update, mark=clock.now)) is None:
            # one graph for the collection and the updates: the iteration's time counts for both rates
            clock.add("iteration", ta, clock.now())
        else:
            clock.add("env", ta, tb)
            clock.add("update", tb, clock.now())
        state.env_steps = after
        if progress is not None:
            progress(it + 1, cfg.iterations)
    spent = clock.totals()
    spent = {k: spent_before.get(k, 0.0) + spent.get(k, 0.0) for k in {*spent_before, *spent}}
    t_it = spent.get("iteration", 0.0)
    t_env, t_upd = spent.get("env", 0.0) + t_it, spent.get("update", 0.0) + t_it
    return end_epoch(state, knobs, n_upd=n_upd, env_steps=state.env_steps - n_env0, t_env=t_env, t_upd=t_upd,
                     seconds=t_before + time.perf_counter() - t0, compile_s=runner.compile_s - compile0,
                     setup_s=setup_s)


def fresh_episodes(state: TrainState) -> None:
    """Every account starts a fresh episode (an epoch's start, or a resumed epoch's). With `cut_episodes` the
    replay's last rows, whose n-step windows would run on into the new episodes (nothing in the ring marks the cut:
    it is no terminal), are never drawn (`Replay.cut_windows`)."""
    if state.cfg.cut_episodes:
        state.replay.cut_windows()
    state.env.reset_all()


def start_epoch(state: TrainState, knobs: Knobs) -> None:
    """An epoch's set-up before its embedding refresh: the knobs applied, a restart or shrink-and-perturb where due,
    the support adapted, fresh episodes, the epoch's sums zeroed (`train_epoch`, and each run of a lockstep epoch)."""
    apply_knobs(state, knobs)
    if restart_due(state):
        restart_fresh(state)
    elif perturb_due(state):
        shrink_perturb(state)
    adapt_support(state)
    fresh_episodes(state)
    state.env.pop_trade_stats()
    state.buffers.metric_sums.zero_()


def ready_to_train(state: TrainState) -> None:
    """The last of an epoch's set-up, once its knobs are applied: the embedding cache's full refresh from the current
    encoders, the device's update counter from the host's, the network in training mode."""
    refresh_embeddings(state)
    state.buffers.step.fill_(float(state.update_step))
    state.agent.train()


def iteration_plan(state: TrainState, support_set: bool) -> tuple[int, bool, bool]:
    """(env steps after the next iteration's collection, whether it updates, whether it is the run's first learning
    iteration, which collects only and then sets the support: `TrainConfig.support_at_start`)."""
    cfg = state.cfg
    after = state.env_steps + cfg.n_envs * cfg.env_steps_per_iter
    since = after - state.learn_from                            # transitions in the replay after this collection
    learn = since >= cfg.learning_starts and since // cfg.n_envs > max(cfg.horizons)
    first = learn and cfg.support_at_start and state.update_step == 0 and not support_set
    return after, learn, first


def end_epoch(state: TrainState, knobs: Knobs, *, n_upd: int, env_steps: int, t_env: float, t_upd: float,
              seconds: float, compile_s: float, setup_s: float) -> EpochStats:
    """An epoch's end: the maturity, the means of the epoch's sums, the training trades, the epoch counted, the SWA
    step; its `EpochStats` (`t_env`, `t_upd`: seconds collecting and updating, for the rates)."""
    cfg = state.cfg
    mat = 1.0 - math.exp(-state.update_step / cfg.maturity_updates)
    state.agent.maturity.fill_(mat)
    state.target.maturity.fill_(mat)
    means = ({k: float(v) / n_upd for k, v in zip(METRICS, state.buffers.metric_sums.tolist())} if n_upd else {})
    sharpe, n_trades = state.env.pop_trade_stats()
    state.epoch += 1
    average_epoch_end(state)
    nan = float("nan")
    return EpochStats(epoch=state.epoch, loss=means.get("loss", nan), c51=means.get("c51", nan),
                      iqn=means.get("iqn", nan), expectile=means.get("expectile", nan),
                      q_mean=means.get("q_mean", nan), entropy=means.get("entropy", nan),
                      utilisation=means.get("utilisation", nan), epsilon=knobs.epsilon, gamma=knobs.gamma,
                      v_max=float(state.agent.v_max), maturity=mat, env_steps=env_steps, updates=n_upd,
                      env_steps_per_s=env_steps / max(t_env, 1e-9), updates_per_s=n_upd / max(t_upd, 1e-9),
                      seconds=seconds, compile_s=compile_s, train_per_trade_sharpe=sharpe,
                      train_trades=int(n_trades), knobs=knobs.to_dict(), setup_s=setup_s)




def open_run(run_dir: Path, bars: Bars, dataset: str, *, seed: int, new_config: Callable[[], TrainConfig],
             split: Split | None = None, where: str = "--out directory", extra: dict | None = None
             ) -> tuple[dict, TrainConfig, Split, int]:
    """The run in `run_dir`: (run.json's metadata, config, split, seed). An existing run keeps its own config, split
    and seed, and is refused on other data or (`split` given) another split, naming `where` to go instead; a new one
    takes `new_config()`, `split` (default `chronological_split`), `seed` and `extra` metadata, and its run.json is
    written (the one writer of run.json: `tradeloop train` and the trainer service)."""
    meta = read_run_json(run_dir)
    if meta is not None:
        try:
            cfg, run_split = TrainConfig.from_dict(meta["config"]), Split.from_dict(meta["split"])
            seed = int(meta["seed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{run_dir / 'run.json'}: the run's settings cannot be read ({type(exc).__name__}: "
                             f"{exc}); use another {where}") from None
        if meta.get("bars_fingerprint") != bars.fingerprint():
            raise ValueError(f"{run_dir} holds a run on other data: its bars (dataset {meta.get('dataset')!r}, "
                             f"{meta.get('n_bars')} bars) differ from those given (dataset "
                             f"{dataset!r}, {len(bars)} bars); use another {where}")
        if split is not None and split != run_split:
            raise ValueError(f"{run_dir} holds a run on another split ({meta['split']}); use another {where}")
        return meta, cfg, run_split, seed
    cfg = new_config()
    split = chronological_split(len(bars)) if split is None else split
    meta = {"dataset": dataset, **(extra or {}), "seed": seed, "config": cfg.to_dict(), "split": split.to_dict(),
            "split_hashes": {w: split.window_hash(bars, w) for w in ("train", "val", "test")},
            "bars_fingerprint": bars.fingerprint(), "n_bars": len(bars), "config_hash": cfg.hash()}
    write_run_json(run_dir, meta)
    return meta, cfg, split, seed


def train_run(bars: Bars, dataset: str, run_dir: Path, epochs: int, *, config: str | TrainConfig = "small",
              seed: int = 0, device="cpu", accel: str = "auto", knobs_fn: Callable[[int], Knobs] | None = None,
              on_epoch: Callable[[EpochStats], None] | None = None,
              on_saved: Callable[[EpochStats], None] | None = None,
              progress: Callable[[int, int], None] | None = None,
              on_compile: Callable[[str | None], None] | None = None,
              rollback_fn: Callable[[int], tuple[int, str, float, Path | None, bool] | None] | None = None,
              pinned_fn: Callable[[], Iterable[int]] | None = None, split: Split | None = None,
              features: np.ndarray | None = None,
              train_fn: Callable[..., EpochStats] | None = None) -> TrainState:
    """Train until `epochs` epochs exist in `run_dir`, resuming from its latest checkpoint when it holds a run.

    Knobs of epoch e (1-based) come from `knobs_fn(e)`, by default the config's fixed schedule
    (`cfg.schedule.knobs(e)`). `on_compile`: see `StepRunner.on_compile`. `rollback_fn(e)`, when given and not
    None, is (epoch, checkpoint sha256 or "", keep, run directory, restart) of a feedback rollback: `roll_back` to
    that epoch of that run directory (None: this one; another: a population's exploit), or a fresh learner where
    restart is True, before epoch e trains (its record says `rolled_back_to`). `pinned_fn()`: epochs whose trainer
    state the pruning keeps (a later rollback's candidates). `split`: the bar ranges of a new run (default
    `chronological_split`; a walk-forward fold, `shared.market.walk_forward_folds`); a resumed run keeps its own and
    refuses a different one.
    `features`: `compute_features(bars)` when already computed. `train_fn(state, knobs, progress)` trains an epoch
    (default `train_epoch`; a lockstep study's member, `services.trainer.lockstep.Lockstep.train`).
    After each epoch: its weights' file is written, then `on_epoch(stats)` is called while the trainer state's file is
    written on a thread (`start_save_epoch`: an evaluation of the weights overlaps the write; without `on_epoch` the
    state is written at once), then — both files complete, older ones pruned, the history line appended —
    `on_saved(stats)`; `stats.save_s` counts the seconds the loop spent writing and waiting for the write."""
    run_dir = Path(run_dir)
    feats = compute_features(bars) if features is None else features
    meta, cfg, split, seed = open_run(run_dir, bars, dataset, seed=seed, split=split, where="--out directory",
                                      new_config=lambda: config if isinstance(config, TrainConfig)
                                      else TrainConfig.preset(config, feats.shape[1]),
                                      extra=None if isinstance(config, TrainConfig) else {"config_preset": config})
    state = build_state(cfg, bars, split, seed, device, features=feats, accel=accel)
    state.runner.on_compile = on_compile
    done = latest_epoch(run_dir)
    if done:
        restore_state(state, run_dir, done)
    knobs_fn = knobs_fn or cfg.schedule.knobs
    while state.epoch < epochs:
        rb = rollback_fn(state.epoch + 1) if rollback_fn is not None else None
        t_rollback = time.perf_counter()
        if rb is not None:
            roll_back(state, rb[3] or run_dir, rb[0], rb[1] or None, keep=rb[2], restart=rb[4],
                      refresh=False)       # train_epoch's set-up refreshes the embedding tables from these encoders
        rollback_s = time.perf_counter() - t_rollback
        stats = (train_fn or train_epoch)(state, knobs_fn(state.epoch + 1), progress)
        stats.rolled_back_to, stats.rollback_s = (None, None) if rb is None else (rb[0], rollback_s)
        t_save = time.perf_counter()
        _, _, write = start_save_epoch(state, run_dir, meta, background=on_epoch is not None)
        stats.save_s = time.perf_counter() - t_save
        try:
            if on_epoch is not None:
                on_epoch(stats)        # the weights' file is complete; the trainer state is being written
        finally:
            stats.save_s += write.wait()
        # every epoch's weights stay; only the last state and the pinned ones
        t_prune = time.perf_counter()
        prune_checkpoints(run_dir, state.epoch, keep=None, pinned=pinned_fn() if pinned_fn is not None else ())
        stats.save_s += time.perf_counter() - t_prune
        append_history(run_dir, asdict(stats))
        if on_saved is not None:
            on_saved(stats)
    return state
