"""The trainer process's loop: wait for feedback → apply knobs → train an epoch → checkpoint → publish.

    for epoch e = 1..N:
        knobs   = bundle e−1's knobs (waited for, bounded by TL_FEEDBACK_TIMEOUT_S; on timeout the last
                  bundle received, and the status says so; epoch 1: the fixed schedule)
                  — TL_FEEDBACK_MODE=overlap: epoch e starts at once under the last bundle's knobs and bundle
                  e−1 is applied at the first iteration boundary after it is stored (`BundleWaiter`); the
                  trainer waits only when evaluation + feedback outlast a whole epoch (then bundle e−1 starts
                  epoch e+1). The record lists each bundle applied and the iteration (`bundles_applied`).
        rollback= a bundle that says "rollback" (applied fresh, never again as a stale bundle): `train.roll_back`
                  restores that epoch's weights, target network and optimizer state before the epoch trains
                  (overlap mode: at the iteration where the bundle is applied); the record says `rolled_back_to`
        stats   = train_epoch(state, knobs)                     (a worker thread: HTTP stays responsive)
        ckpt    = save_epoch(...)  → DIR/checkpoints/epoch-NNNN.safetensors (+ trainer state, for resume);
                  older trainer states are deleted, and the weights of all but the last TL_KEEP_CHECKPOINTS epochs,
                  except the files of the best epoch so far (named by the latest bundle: what a rollback restores)
                  and of an epoch no bundle has judged yet
        Redis   ← checkpoint bytes (RunStore.put_checkpoint), the epoch record (history hash), then
        publish   checkpoint.published

The run directory is `TL_RUN_DIR/TL_RUN_ID/trainer` (run.json, checkpoints, history.jsonl). run.json records the
settings a run keeps for good (`RUN_SETTINGS`); a restart given other values of them is refused at start (exit 2,
naming each). A restarted trainer resumes from its latest complete checkpoint on disk; an epoch saved but not yet
published (a crash between the two) is published again — consumers are idempotent on (run, epoch).

Shutdown (SIGTERM / Ctrl-C, `interrupt()`): an epoch in training stops at the next iteration boundary and saves
its state there (`checkpoints/interrupted.safetensors`: weights, trainer state, the epoch's sums, the knobs and
record); a restart finishes that epoch from that iteration, under the same knobs (the record lists where it
resumed: `resumed_at`). A feedback wait ends at once; a publish in hand is finished.

The epoch record (`tl:{run}:trainer:history`, hash epoch → JSON) holds the stats, the checkpoint id and
sha256, which bundle the epoch trained under (`bundle_epoch`, `bundle_id`, `feedback_timed_out`) and the epoch
whose learner a rollback restored (`rolled_back_to`; `rollback_error` when the restore was refused).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

from pydantic import Field

from shared.api import ServiceState, bundle_id, checkpoint_id, knob_gauges, trainer_history_key
from shared.bus import REDIS_DOWN, Backoff, Bus
from shared.config import TrainerSettings, check_cuda
from shared.events import CheckpointPublished, EventError, FeedbackReady, decode_event
from shared.knobs import FixedSchedule, Knobs
from shared import runfiles
from shared.redis_server import RedisOutageLog
from shared.store import run_key
from services.trainer.bundles import BundleWaiter, rollback_request
from services.trainer.rundir import HISTORY, append_history, checkpoint_path, finite, read_run_json

log = logging.getLogger("tradeloop.trainer")


class TrainerServiceSettings(TrainerSettings):
    """Trainer settings plus the size of a run (small values make a test run take seconds)."""

    data_bars: int | None = Field(default=None, ge=500,
                                  description="use only the first N bars of the dataset (None: all)")
    train_iterations: int | None = Field(default=None, ge=1, description="iterations per epoch (None: preset)")
    train_learning_starts: int | None = Field(default=None, ge=1,
                                              description="transitions before the first update (None: preset)")
    train_batch_size: int | None = Field(default=None, ge=2, description="transitions per update (None: preset)")
    train_n_envs: int | None = Field(default=None, ge=1, description="parallel accounts (None: preset)")
    data_seed: int = Field(default=0, ge=0, description="seed of the synthetic dataset (shared by all services)")


RUN_SETTINGS = ("config", "seed", "data_bars", "train_iterations", "train_learning_starts", "train_batch_size",
                "train_n_envs")
"""The trainer settings a run keeps for good (run.json records them as `service_settings`): a restart of the run
given another value of one is refused (`refuse_changed_settings`), as `tradeloop up --resume` refuses its own."""


def refuse_changed_settings(settings: TrainerServiceSettings, meta: dict | None) -> None:
    """ValueError naming each TL_ variable whose value differs from the one run.json (`meta`) records, with both
    values and the way out; a run without a record (new, or written by `tradeloop train`) passes."""
    recorded = (meta or {}).get("service_settings") or {}
    clash = [k for k in RUN_SETTINGS if k in recorded and recorded[k] != getattr(settings, k)]
    if clash:
        name = {k: f"TL_{k.upper()}" for k in clash}
        raise ValueError(f"run {settings.run_id} keeps " + ", ".join(f"{name[k]}={recorded[k]}" for k in clash)
                         + " (it was started so; given " + ", ".join(f"{name[k]}={getattr(settings, k)}" for k in clash)
                         + "); set them back, or set another TL_RUN_ID for a new run")


history_key = trainer_history_key
PHASES = ("starting", "loading", "waiting_feedback", "rolling_back", "training", "saving", "publishing", "paused",
          "interrupted", "done", "stopped", "failed")
"""The trainer's phases (/status "phase"; /metrics `phase{phase=…}` is 1 for the current one)."""


async def read_history(bus: Bus) -> list[dict]:
    """Every epoch record of the run, ordered by epoch."""
    raw = await bus.redis.hgetall(history_key(bus.run_id))
    return sorted((json.loads(v) for v in raw.values()), key=lambda r: r["epoch"])


class TrainerWorker:
    """Runs the training loop inside the service's event loop; torch work happens in a worker thread."""

    def __init__(self, settings: TrainerServiceSettings, bus: Bus, state: ServiceState):
        import services.trainer.train  # noqa: F401 — torch loads here, not in a thread beside live requests

        settings.check_data()
        check_cuda(settings.device, "TL_DEVICE")    # no CUDA here (a CPU image): refused at once, not mid-loop
        self.settings, self.bus, self.state = settings, bus, state
        self.run_dir = settings.check_run_dir(runfiles.TRAINER_DIR)
        try:
            meta = read_run_json(self.run_dir)
        except ValueError:                          # an unreadable run.json: the loop reports it (`open_run`)
            meta = None
        refuse_changed_settings(settings, meta)
        self._resume = asyncio.Event()
        self._resume.set()
        self._stop = asyncio.Event()
        self._interrupt = threading.Event()      # read by the training thread at each iteration boundary
        self.phase = "starting"
        self.set_phase("starting")
        self.last_bundle: dict | None = None   # the latest bundle received (what a timed-out epoch trains on)
        self._late: dict | None = None          # overlap: a bundle stored after its epoch ended, for the next start
        self._carry: dict = {}                  # overlap: the wait between two epochs, for the next record
        self.schedule = FixedSchedule()          # the run's config's, once built: knobs without a bundle
        self._tstate = None                      # the training state, once built (a mid-epoch rollback's target)
        self.outage = RedisOutageLog(log)        # a Redis outage logged once when it starts, once when it ends
        state.extra.update(epochs=settings.epochs, feedback=None, paused=False, training_epoch=None, iteration=None,
                           iterations=None, updates_per_s=None, env_steps_per_s=None)

    # -- control ----------------------------------------------------------------------------------------
    def pause(self) -> None:
        """Pause before the next epoch starts (the current one finishes)."""
        self._resume.clear()
        self.state.extra["paused"] = True

    def resume(self) -> None:
        """Resume after a pause."""
        self._resume.set()
        self.state.extra["paused"] = False

    def stop(self) -> None:
        """Stop after the current epoch (it is checkpointed and published); a pause in force ends with it."""
        self._stop.set()
        self._resume.set()
        self.state.extra["paused"] = False
        self.state.extra["stopping"] = True

    def interrupt(self) -> None:
        """Stop at the next iteration boundary (shutdown): an epoch in training saves its state there
        (`save_interrupted`) and a restart finishes it; a feedback wait ends at once."""
        self._interrupt.set()
        self.stop()

    def stopping_note(self) -> str:
        """What a shutdown waits for, in words (the service logs it)."""
        x = self.state.extra
        if self.phase == "training":
            return (f"epoch {x.get('training_epoch')} stops at its next iteration boundary (iteration "
                    f"{x.get('iteration', 0)}/{x.get('iterations', '?')}) and saves its state there")
        if self.phase == "saving":
            return f"saving epoch {x.get('training_epoch')}'s state"
        if self.phase == "publishing":
            return f"publishing epoch {x.get('training_epoch')}'s checkpoint"
        return f"nothing to save (phase {self.phase})"

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.state.extra["phase"] = phase
        self.state.set_labeled("phase", "phase", {p: float(p == phase) for p in PHASES})

    def _knobs(self, knobs: Knobs) -> None:
        """The knobs training runs under now, on /metrics (`knob{knob=…}`)."""
        self.state.set_labeled("knob", "knob", knob_gauges(knobs.to_dict()))

    def _progress(self, tstate, epoch: int):
        """`train_epoch`'s progress callback (training thread): iteration i of n of the epoch, and the epoch's update
        and account-step rates so far, on /status and /metrics. Host counters only: no device synchronisation."""
        t0, u0, s0 = time.perf_counter(), tstate.update_step, tstate.env_steps
        self.state.extra.update(training_epoch=epoch, iteration=0, iterations=tstate.cfg.iterations)

        def progress(it: int, n: int) -> None:
            dt = time.perf_counter() - t0
            self.state.extra["iteration"], self.state.extra["iterations"] = it, n
            self.state.gauges["epoch_progress"] = it / max(1, n)
            if dt > 0:
                ups, sps = (tstate.update_step - u0) / dt, (tstate.env_steps - s0) / dt
                self.state.gauges["updates_per_s"] = self.state.extra["updates_per_s"] = ups
                self.state.gauges["env_steps_per_s"] = self.state.extra["env_steps_per_s"] = sps

        return progress

    def _compiling(self, what: str | None) -> None:
        """`StepRunner.on_compile` (training thread): /status shows phase "compiling" and what, while the epoch's
        first calls compile or capture its steps; `self.phase` stays "training" (an epoch is in hand)."""
        self.state.extra["compiling"] = what
        self.state.extra["phase"] = "compiling" if what is not None else self.phase

    # -- setup ------------------------------------------------------------------------------------------
    def _build(self):
        """Load data, build or resume the training state (blocking; run in a thread). Returns (state, run meta,
        the interrupted epoch's (progress, record) or None)."""
        import torch

        from services.trainer.train import (TrainConfig, build_state, latest_epoch, open_run, read_interrupted,
                                            restore_interrupted, restore_state)
        from shared.market import compute_features, load_dataset

        s = self.settings
        if s.compile_cache_dir is not None:             # before anything compiles (`shared.graphs.use_compile_cache`)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(s.compile_cache_dir).resolve())
        if s.device == "cpu":
            torch.set_num_threads(max(1, min(torch.get_num_threads(), 4)))
        bars = load_dataset(s.data, seed=s.data_seed)
        if s.data_bars is not None and s.data_bars < len(bars):
            bars = bars.slice(0, s.data_bars)
        feats = compute_features(bars)

        def new_config() -> TrainConfig:
            cfg = TrainConfig.preset(s.config, feats.shape[1])
            over = {k: v for k, v in (("iterations", s.train_iterations), ("learning_starts", s.train_learning_starts),
                                      ("batch_size", s.train_batch_size), ("n_envs", s.train_n_envs)) if v is not None}
            return dataclasses.replace(cfg, **over)
        meta, cfg, split, seed = open_run(self.run_dir, bars, s.data, seed=s.seed, new_config=new_config,
                                          where="TL_RUN_ID", extra={"data_seed": s.data_seed, "service_settings": {
                                              k: getattr(s, k) for k in RUN_SETTINGS}})
        device = s.device if s.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        tstate = build_state(cfg, bars, split, seed, device, features=feats, accel=s.accel)
        tstate.runner.on_compile = self._compiling
        done = latest_epoch(self.run_dir)
        partial = read_interrupted(self.run_dir, done, cfg.hash())
        if partial is not None:
            tensors, pmeta = partial
            progress = restore_interrupted(tstate, tensors, pmeta)
            log.info("resuming epoch %d at iteration %d/%d (its state was saved when it was interrupted)",
                     progress.epoch, progress.iteration, progress.iterations)
            return tstate, meta, (progress, pmeta.get("record") or {})
        if done:
            restore_state(tstate, self.run_dir, done)
        return tstate, meta, None

    # -- feedback -----------------------------------------------------------------------------------------
    async def _wait_bundle(self, epoch: int) -> tuple[dict | None, bool, float]:
        """Bundle `epoch` (computed from that epoch's report): (bundle, timed_out, waited_s).

        Reads the store first (the source of truth), then blocks on the feedback stream for news."""
        t0 = time.monotonic()
        deadline = t0 + self.settings.feedback_timeout_s
        stream, last_id = self.bus.stream("feedback"), "0-0"
        block_ms = int(min(1000, self.bus.socket_timeout_s * 500))
        backoff = Backoff(cap_s=1.0)
        while not self._stop.is_set():
            left = deadline - time.monotonic()
            try:
                bundle = await self.bus.store.get_bundle(epoch)
                if bundle is not None:
                    return bundle, False, time.monotonic() - t0
                if left <= 0:
                    return None, True, time.monotonic() - t0
                resp = await self.bus.redis.xread({stream: last_id}, count=100,
                                                  block=max(1, min(block_ms, int(left * 1000))))
                backoff.reset()
                self.outage.answered()
            except REDIS_DOWN as exc:  # Redis down: keep waiting (the timeout still bounds the wait)
                self._redis_down(exc)
                if left <= 0:
                    return None, True, time.monotonic() - t0
                await asyncio.sleep(min(backoff.next(), max(0.01, left)))
                continue
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        ev = decode_event(fields)
                    except EventError:
                        continue  # the consumers dead-letter bad entries; the trainer only listens
                    if isinstance(ev, FeedbackReady) and ev.epoch == epoch:
                        break
        return None, False, time.monotonic() - t0

    async def _knobs_for(self, epoch: int) -> tuple[Knobs, dict]:
        """The knobs epoch `epoch` trains under, and the record of where they came from."""
        if epoch == 1:
            return self.schedule.knobs(1), {"bundle_epoch": None, "bundle_id": None, "feedback_timed_out": False,
                                             "feedback_wait_s": 0.0, "knobs_source": "fixed schedule (first epoch)"}
        self.set_phase("waiting_feedback")
        self.state.extra["feedback"] = {"waiting_for_bundle": epoch - 1, "timed_out": False}
        bundle, timed_out, waited = await self._wait_bundle(epoch - 1)
        if bundle is not None:
            self.last_bundle = bundle
            src = f"bundle of epoch {epoch - 1}"
        elif self.last_bundle is not None:
            src = (f"timeout after {waited:.1f}s waiting for bundle {epoch - 1}; "
                   f"training on the last bundle (epoch {self.last_bundle['epoch']})")
        else:
            src = f"timeout after {waited:.1f}s waiting for bundle {epoch - 1}; no bundle yet: fixed schedule"
        used = bundle if bundle is not None else self.last_bundle
        if timed_out:
            self.state.count("feedback_timeouts")
            log.warning("epoch %d: %s", epoch, src)
        knobs = Knobs.from_dict(used["knobs"]) if used is not None else self.schedule.knobs(epoch)
        if bundle is None and used is not None:
            # a stale bundle: its hyper-parameters carry on, but its sample-level signals (E6 replay boosts,
            # E7 hindsight labels of that checkpoint's trades) were applied already — never apply them twice
            knobs = dataclasses.replace(knobs, priority_boost=[], hindsight=[])
        rec = {"bundle_epoch": None if used is None else int(used["epoch"]),
               "bundle_id": None if used is None else bundle_id(self.bus.run_id, int(used["epoch"]),
                                                                 used.get("report_checkpoint_sha256", "")),
               "feedback_timed_out": timed_out, "feedback_wait_s": round(waited, 3), "knobs_source": src,
               "stale_bundle": bundle is None and used is not None, **rollback_request(bundle)}
        self.state.extra["feedback"] = {"epoch": epoch, **rec}
        return knobs, rec

    async def _overlap_knobs(self, epoch: int) -> tuple[Knobs, dict, "BundleWaiter | None"]:
        """Overlap mode, epoch ≥ 2: the knobs the epoch starts under, its record, and the waiter for bundle
        epoch − 1 when that is not stored yet (it is then applied mid-epoch by `BundleWaiter.poll`)."""
        try:
            bundle = await self.bus.store.get_bundle(epoch - 1)
        except REDIS_DOWN as exc:
            self._redis_down(exc)
            bundle = None
        now = time.time()
        applied: list[dict] = []
        waiter = None
        if self._late is not None:               # stored after the last epoch ended: it starts this one
            applied.append({"epoch": int(self._late["epoch"]), "iteration": 0, "at": now})
        if bundle is not None:
            self.last_bundle = bundle
            applied.append({"epoch": epoch - 1, "iteration": 0, "at": now})
            knobs, src = Knobs.from_dict(bundle["knobs"]), f"bundle of epoch {epoch - 1} (stored before the epoch)"
            fresh = bundle
        else:
            used = self._late or self.last_bundle
            fresh = self._late                   # a bundle not applied yet (its rollback too); None: all applied
            if used is None:
                knobs, src = self.schedule.knobs(epoch), "fixed schedule"
            else:
                knobs, src = Knobs.from_dict(used["knobs"]), f"bundle of epoch {used['epoch']}"
                if self._late is None:           # already applied: its sample-level signals are not re-applied
                    knobs = dataclasses.replace(knobs, priority_boost=[], hindsight=[])
            src += f" until bundle {epoch - 1} is stored"
            waiter = BundleWaiter(self, epoch - 1)
        self._late = None
        rec = {"feedback_mode": "overlap", "feedback_timed_out": False, "feedback_wait_s": 0.0,
               **self._carry, "knobs_source": src, "bundles_applied": applied, "stale_bundle": False,
               **rollback_request(fresh)}
        self._carry = {}
        self._set_bundle(rec)
        if applied:
            rec["knobs_applied_at"] = applied[-1]["at"]
        self.state.extra["feedback"] = {"epoch": epoch, **rec}
        return knobs, rec, waiter

    async def _saved_record(self, epoch: int) -> dict | None:
        """Epoch `epoch`'s record: from Redis, else from history.jsonl."""
        prev = await self.bus.redis.hget(history_key(self.bus.run_id), str(epoch))
        return json.loads(prev) if prev else runfiles.read_history(self.run_dir / HISTORY).get(epoch)

    async def _restore_last_bundle(self, epoch: int) -> None:
        """A restarted trainer picks up the bundle its last saved epoch trained under (from that epoch's record):
        what a feedback timeout trains on next, and the best epoch pruning keeps."""
        try:
            rec = await self._saved_record(epoch) or {}
            if rec.get("bundle_epoch") is not None:
                self.last_bundle = await self.bus.store.get_bundle(int(rec["bundle_epoch"]))
        except REDIS_DOWN as exc:
            self._redis_down(exc)

    def _set_bundle(self, rec: dict) -> None:
        """bundle_epoch / bundle_id of a record: the last bundle applied in the epoch, else the one carried."""
        b = rec["bundles_applied"][-1]["epoch"] if rec["bundles_applied"] else (
            None if self.last_bundle is None else int(self.last_bundle["epoch"]))
        src = self.last_bundle if self.last_bundle is not None and int(self.last_bundle["epoch"]) == b else None
        rec["bundle_epoch"] = b
        rec["bundle_id"] = None if b is None else bundle_id(self.bus.run_id, b,
                                                            (src or {}).get("report_checkpoint_sha256", ""))

    async def _resumed_knobs(self, epoch: int, progress, record: dict) -> tuple[Knobs, dict, "BundleWaiter | None"]:
        """An interrupted epoch resumes under the knobs it had when it stopped and its record (plus where it
        resumed); in overlap mode, a bundle it had not applied yet is still waited for."""
        rec = {**record, "resumed_at": [*record.get("resumed_at", []),
                                        {"iteration": progress.iteration, "at": time.time()}]}
        waiter = None
        if (self.settings.feedback_mode == "overlap" and epoch > 1
                and all(b["epoch"] != epoch - 1 for b in rec.get("bundles_applied", []))):
            rec.setdefault("bundles_applied", [])
            waiter = BundleWaiter(self, epoch - 1)
        if rec.get("bundle_epoch") is not None:
            try:
                self.last_bundle = await self.bus.store.get_bundle(int(rec["bundle_epoch"]))
            except REDIS_DOWN as exc:
                self._redis_down(exc)
        self.state.extra["feedback"] = {"epoch": epoch, **rec}
        return Knobs.from_dict(progress.knobs), rec, waiter

    def _absorb(self, waiter: "BundleWaiter | None", rec: dict) -> None:
        """Overlap mode: a bundle applied mid-epoch goes into the epoch's record."""
        if waiter is not None and waiter.applied is not None and waiter.applied not in rec["bundles_applied"]:
            self.last_bundle = waiter.bundle
            rec["bundles_applied"].append(waiter.applied)
            rec["knobs_applied_at"] = waiter.applied["at"]
            self._set_bundle(rec)
            rec["knobs_source"] += f"; bundle {waiter.epoch} applied at iteration {waiter.applied['iteration']}"
            rec.update(waiter.rollback)

    async def _overlap_finish(self, waiter: "BundleWaiter", epoch: int) -> None:
        """After epoch `epoch` is published: a bundle not yet applied is waited for now (bounded by the
        timeout; the only wait of overlap mode) and then starts the next epoch."""
        self.set_phase("waiting_feedback")
        t0 = time.monotonic()
        bundle, timed_out = await waiter.result_async()
        waited = time.monotonic() - t0
        if bundle is not None:
            self.last_bundle = bundle
            if waiter.applied is None:
                self._late = bundle
        if timed_out:
            self.state.count("feedback_timeouts")
            log.warning("epoch %d: timeout waiting for bundle %d", epoch + 1, epoch - 1)
        self._carry = {"feedback_wait_s": round(waited, 3), "feedback_timed_out": timed_out}

    def _roll_back(self, rec: dict) -> dict:
        """The rollback a bundle asked for (`rec`'s rollback_to_epoch and checkpoint sha256), done now (blocking:
        a worker thread, or the training thread between iterations): {"rolled_back_to": epoch}, or the error that
        refused it (a missing or altered checkpoint: the epoch trains on from where it is, and the status says so)."""
        from services.trainer.train import roll_back
        from shared.checkpoints import CheckpointError

        target = rec["rollback_to_epoch"]
        try:
            roll_back(self._tstate, self.run_dir, target, rec.get("rollback_checkpoint_sha256") or None,
                      keep=float(rec.get("rollback_keep") or 0.0), restart=bool(rec.get("rollback_restart")))
        except (CheckpointError, ValueError, OSError) as exc:
            log.error("rollback to epoch %d refused: %s", target, exc)
            self.state.error(f"rollback to epoch {target} refused: {exc}")
            return {"rolled_back_to": None, "rollback_error": str(exc)}
        self.state.count("rollbacks")
        if rec.get("rollback_restart"):
            log.info("answered the drop below epoch %d with a fresh learner", target)
        else:
            log.info("rolled back to epoch %d's weights and optimizer state", target)
        return {"rolled_back_to": target}

    def _pinned(self, epoch: int) -> set[int]:
        """After epoch `epoch` is saved: the epochs whose checkpoint files pruning keeps — the best epoch so far
        (`best_epoch` of the latest bundle: what a rollback restores) and the last two epochs that bundle has not
        judged yet (one of them may be the next best; overlap mode trains one epoch ahead of its bundle)."""
        b = self.last_bundle
        judged = -1 if b is None else int(b["epoch"])
        best = None if b is None else b.get("best_epoch")
        return set(range(max(judged + 1, epoch - 1), epoch + 1)) | ({int(best)} if best is not None else set())

    # -- publishing -----------------------------------------------------------------------------------------
    def _redis_down(self, exc: BaseException) -> None:
        self.outage.failed(f"{type(exc).__name__}: {exc}", self.state)   # /status; a WARNING at the first

    async def _publish(self, epoch: int, path: Path, meta: dict, record: dict) -> None:
        """`_publish_once`, retried with backoff while Redis is unreachable (every step is idempotent)."""
        backoff = Backoff()
        while True:
            try:
                return await self._publish_once(epoch, path, meta, record)
            except REDIS_DOWN as exc:
                self._redis_down(exc)
                await asyncio.sleep(backoff.next())

    async def _publish_once(self, epoch: int, path: Path, meta: dict, record: dict) -> None:
        """Checkpoint bytes → Redis, the epoch record, then checkpoint.published (once per epoch)."""
        data = await asyncio.to_thread(path.read_bytes)
        key, sha = await self.bus.store.put_checkpoint(epoch, data)
        cid = checkpoint_id(self.bus.run_id, epoch, sha)
        record = {**record, "epoch": epoch, "checkpoint_id": cid, "sha256": sha, "checkpoint_key": key}
        await self.bus.store.put_epoch_record(epoch, record)     # Redis, and the run directory's epochs/
        # marker done:published:{epoch} + event in one Lua script: never lost, never published twice
        await self.bus.publish_once("published", CheckpointPublished(
            run_id=self.bus.run_id, epoch=epoch, checkpoint_id=cid, sha256=sha, key=key, size_bytes=len(data),
            config_hash=meta["config_hash"], split_hashes=meta["split_hashes"], path=str(path.resolve())))
        self.state.count("checkpoints_published")
        self.outage.answered()

    # -- the loop -------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Train until TL_EPOCHS epochs exist, then idle (status phase "done") until the process stops."""
        from services.trainer.train import EpochInterrupted, prune_checkpoints, save_epoch, train_epoch

        self.set_phase("loading")
        tstate, meta, partial = await asyncio.to_thread(self._build)
        self._tstate, self.schedule = tstate, tstate.cfg.schedule
        self.state.epoch = tstate.epoch
        self.state.extra.update(device=str(tstate.device), accel=tstate.accel)
        if tstate.epoch and not await self.bus.redis.exists(run_key(self.bus.run_id, "done", "published", tstate.epoch)):
            # resumed after a crash between saving and publishing: publish the saved epoch (once)
            path = checkpoint_path(self.run_dir, tstate.epoch)
            await self._publish(tstate.epoch, path, meta, await self._saved_record(tstate.epoch) or {"resumed": True})
        if tstate.epoch:
            await self._restore_last_bundle(tstate.epoch)
        self.state.ready = True
        while tstate.epoch < self.settings.epochs and not self._stop.is_set():
            if not self._resume.is_set():
                self.set_phase("paused")
                await self._resume.wait()
                if self._stop.is_set():
                    break
            epoch = tstate.epoch + 1
            waiter = None
            if partial is not None:
                knobs, rec, waiter = await self._resumed_knobs(epoch, *partial)
            elif self.settings.feedback_mode == "overlap" and epoch > 1:
                knobs, rec, waiter = await self._overlap_knobs(epoch)
            else:
                knobs, rec = await self._knobs_for(epoch)
                rec["knobs_applied_at"] = time.time()  # unix time: bundle e−1 → epoch e (bench/loop_latency.py)
            if self._stop.is_set():
                if waiter is not None:
                    waiter.cancel()
                break
            if rec.get("rollback_to_epoch") is not None and "rolled_back_to" not in rec:   # not done (nor resumed)
                self.set_phase("rolling_back")
                rec.update(await asyncio.to_thread(self._roll_back, rec))
            self.set_phase("training")
            self.state.extra.update(training_epoch=epoch, iteration=partial[0].iteration if partial else 0)
            try:
                self._knobs(knobs)
                stats = await asyncio.to_thread(train_epoch, tstate, knobs, self._progress(tstate, epoch),
                                                None if waiter is None else waiter.poll,
                                                interrupt=self._interrupt.is_set,
                                                resume=partial[0] if partial else None)
            except EpochInterrupted as exc:
                self._absorb(waiter, rec)
                if waiter is not None:
                    waiter.cancel()
                await self._save_interrupted(tstate, exc.progress, rec, partial[0] if partial else None)
                break
            partial = None
            self._absorb(waiter, rec)
            path, _ = await asyncio.to_thread(save_epoch, tstate, self.run_dir, meta)
            await asyncio.to_thread(prune_checkpoints, self.run_dir, epoch, self.settings.keep_checkpoints,
                                    self._pinned(epoch))
            record = {**finite(asdict(stats)), **rec}
            append_history(self.run_dir, record)
            self.set_phase("publishing")
            await self._publish(epoch, path, meta, record)
            self.state.epoch = epoch
            self.state.gauges.update(loss=record["loss"] or 0.0, epoch_seconds=stats.seconds,
                                     env_steps_per_s=stats.env_steps_per_s, updates_per_s=stats.updates_per_s,
                                     feedback_wait_seconds=float(record.get("feedback_wait_s") or 0.0))
            self.state.count("epochs_trained")
            log.info("epoch %d trained (loss %s, %s)", epoch, record["loss"], rec["knobs_source"])
            if waiter is not None:
                if epoch < self.settings.epochs:
                    await self._overlap_finish(waiter, epoch)
                else:
                    waiter.cancel()             # no epoch left to apply it to: nothing to wait for
        if self.phase != "interrupted":
            self.set_phase("stopped" if self._stop.is_set() and tstate.epoch < self.settings.epochs else "done")
            if self.phase == "done":
                log.info("run %s done: %d of TL_EPOCHS=%d epochs trained (raise TL_EPOCHS to train on, or set another "
                         "TL_RUN_ID for a new run)", self.bus.run_id, tstate.epoch, self.settings.epochs)

    async def _save_interrupted(self, tstate, progress, rec: dict, resumed) -> None:
        """Save an epoch interrupted at an iteration boundary (unless it did no iteration since it (re)started:
        then what is on disk already holds it)."""
        from services.trainer.train import save_interrupted

        self.set_phase("saving")
        info = {"epoch": progress.epoch, "iteration": progress.iteration, "iterations": progress.iterations}
        if progress.iteration > (resumed.iteration if resumed is not None else 0):
            t0 = time.monotonic()
            path = await asyncio.to_thread(save_interrupted, tstate, self.run_dir, progress, rec)
            info.update(saved=str(path), save_seconds=round(time.monotonic() - t0, 2))
            log.warning("epoch %d interrupted after iteration %d/%d: its state is saved in %s (%.1fs); a restart "
                        "finishes the epoch from there", progress.epoch, progress.iteration, progress.iterations,
                        path, info["save_seconds"])
        else:
            log.warning("epoch %d interrupted at iteration %d/%d, before any new iteration: nothing to save (a "
                        "restart starts there again)", progress.epoch, progress.iteration, progress.iterations)
        self.state.extra["interrupted"] = info
        self.set_phase("interrupted")

    async def lag(self) -> int | None:
        """Checkpoints published but not yet acked by the evaluator group (None before the group exists)."""
        stream = self.bus.stream("checkpoints")
        try:
            groups = await self.bus.redis.xinfo_groups(stream)
        except Exception:  # noqa: BLE001 — no stream yet
            return None
        g = next((g for g in groups if (g["name"].decode() if isinstance(g["name"], bytes) else g["name"]) == "evaluator"),
                 None)
        if g is None:
            return await self.bus.redis.xlen(stream)
        last = g["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else last
        after = await self.bus.redis.xrange(stream, min=f"({last}", max="+", count=10_000)
        return int(g["pending"]) + len(after)
