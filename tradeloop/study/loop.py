"""The closed loop in one process, through the very functions the services call (no Redis, no HTTP):

    for epoch e = 1..E:
        knobs_e  = epoch 1: the trainer config's fixed schedule (`Knobs.fixed_schedule(1, …)`), whatever the feedback
                   settings, so variants of one seed and fold share their first epoch
                   e > 1: bundle e−1's knobs
        train    : services.trainer.train.train_run (train_epoch → the weights' file → report_e and bundle_e while
                   the trainer state's file is written → history.jsonl), resumed from the run directory's latest
                   complete checkpoint
        report_e : services.evaluator.runner.evaluate_checkpoint(checkpoint e, knobs_e, n_trials = e, prior_sharpes =
                   earlier val Sharpes, oos=False)  — validation and the in-sample autopsy; the OOS window is not
                   backtested here (`evaluate_selected` reads it for the checkpoint selected on validation only)
        bundle_e : services.feedback.signals.compute_bundle(report_e, earlier reports' history entries, feedback)
                   — with `feedback.enabled` False the product's fixed schedule ("feedback disabled (ablation)")

What the services keep in Redis is kept here in the run directory, one JSON file per epoch written atomically after
the epoch's bundle, once both its checkpoint files are complete (`loop/epoch-NNNN.json`: the knobs it trained under,
the next epoch's knobs, the bundle's rollback and signals, the validation metrics and trade returns, the in-sample
window's metrics, the history entry the feedback service would keep, timings; `shared.runfiles.read_records` reads
them, for the loop and for the dashboard's run browser). A loop killed at any point resumes where it stopped: an
epoch whose checkpoint is complete but whose record does not exist is evaluated again (evaluation and feedback are
pure functions of the checkpoint and the earlier records), then `train_run` resumes from the latest complete
checkpoint (one whose trainer state a kill cut short is trained again). Only the latest epoch's trainer state
(optimizer, replay, RNG: what resuming needs, hundreds of MB at the `full` preset) is kept.

Sharpes are un-annualized, per trade.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from services.evaluator.runner import evaluate_checkpoint, shapes_policy
from services.feedback.fallbacks import PeerPoint, exploit_target
from services.feedback.guard import HistoryEntry, HistoryPoint
from services.feedback.signals import FeedbackConfig, compute_bundle
from services.trainer.train import EpochStats, TrainConfig, latest_epoch, train_run
from shared.checkpoints import sidecar_path
from shared.knobs import Knobs
from shared.market import Bars, Split, compute_features
from shared.metrics import sharpe_se
from shared.report import SplitDefinition
from shared.runfiles import LOOP_DIR, atomic_write, read_records, record_path

PARTS = ("rollback", "setup", "train", "eval", "save")
"""The timed parts of an epoch in its record's `seconds` (beside `feedback`), in the order they run: restoring a
rollback's learner, the set-up (fresh episodes, the embedding cache's full refresh), the iterations, the evaluation,
writing the weights and trainer state."""

PEER_DIR = "peer"
"""Where a run keeps the peer epoch an exploit restores (`link_peer_epoch`) until the epoch that starts from it is saved."""


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write JSON to `path` atomically (`shared.runfiles.atomic_write`): a reader (or a resume) sees all of it or
    none."""
    atomic_write(path, json.dumps(doc, allow_nan=False, separators=(",", ":")))


def checkpoint_path(run_dir: Path, epoch: int, state: bool = False) -> Path:
    """The agent checkpoint (or with `state` the trainer state) of `epoch` in a run directory."""
    return Path(run_dir) / "checkpoints" / f"epoch-{epoch:04d}{'.state' if state else ''}.safetensors"


def first_knobs(cfg: TrainConfig) -> Knobs:
    """The knobs of epoch 1: the trainer config's fixed schedule (the same for feedback on and off)."""
    return cfg.schedule.knobs(1)


def point_of(record: dict) -> HistoryPoint:
    """The `HistoryPoint` of an epoch's record: its validation per-trade Sharpe, trades and their standard error."""
    return HistoryPoint(epoch=int(record["epoch"]), val_sharpe=float(record["history"]["val_sharpe"]),
                        val_n_trades=int(record["history"]["val_n_trades"]), knobs=Knobs.from_dict(record["knobs"]),
                        val_sharpe_se=sharpe_se(np.asarray(record["val_trade_returns"], dtype=np.float64)),
                        checkpoint_sha256=record.get("checkpoint_sha256") or "")


def history_of(record: dict, run_id: str, split_def: SplitDefinition) -> HistoryEntry:
    """The `HistoryEntry` the feedback service keeps of an epoch's report (`guard.history_entry`), from its record."""
    return HistoryEntry(run_id=run_id, epoch=int(record["epoch"]), split=split_def, point=point_of(record))


def peer_points(peers: Sequence[Path], upto: int) -> dict[tuple[str, int], tuple[Path, PeerPoint]]:
    """The epochs ≤ `upto` of the population's other runs (their run directories) that an exploit can restore: those
    whose record, weights and trainer state are on disk; (run, epoch) → (its directory, its `PeerPoint`)."""
    out = {}
    for d in map(Path, peers):
        for e, rec in read_records(d).items():
            if e <= upto and checkpoint_path(d, e, state=True).exists():
                out[(d.name, e)] = (d, PeerPoint(run=d.name, point=point_of(rec)))
    return out


def link_peer_epoch(peer_dir: Path, epoch: int, into: Path) -> bool:
    """Hard-link (copy where links cannot be made) a peer's epoch — weights, trainer state and their sha256 sidecars —
    into `into` laid out as a run directory, so that `roll_back(state, into, epoch)` restores it after the peer has
    pruned its own files. False when the peer removed one of them first."""
    files = [checkpoint_path(peer_dir, epoch), checkpoint_path(peer_dir, epoch, state=True)]
    files += [sidecar_path(f) for f in files]
    shutil.rmtree(into, ignore_errors=True)
    try:
        for f in files:
            dst = into / f.relative_to(peer_dir)
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(f, dst)
            except FileNotFoundError:        # the peer pruned it
                raise
            except OSError:                  # no hard links here (another file system): a copy
                shutil.copy2(f, dst)
    except FileNotFoundError:
        shutil.rmtree(into, ignore_errors=True)
        return False
    return True


def _drop(path: Path) -> None:
    for p in (path, sidecar_path(path)):
        p.unlink(missing_ok=True)


def run_closed_loop(bars: Bars, dataset: str, run_dir: Path, epochs: int, *, config: TrainConfig,
                    feedback: FeedbackConfig, split: Split, seed: int, device: str = "cpu", accel: str = "auto",
                    features: np.ndarray | None = None, run_id: str | None = None,
                    on_epoch: Callable[[dict], None] | None = None,
                    progress: Callable[[int, int], None] | None = None, peers: Sequence[Path] = (),
                    train_fn: Callable[..., EpochStats] | None = None) -> list[dict]:
    """Run (or resume) the closed loop for `epochs` epochs in `run_dir`; returns the E epoch records in order.

    `on_epoch(record)` is called after each epoch's record is stored (not for epochs a resume found done).
    `peers`: the run directories of the other runs of its population (`feedback.population`): after each epoch's
    bundle, `exploit_target` over their epochs so far (up to this one) may name one, and the next epoch starts from
    it (`link_peer_epoch`; the record's bundle says `exploit`) instead of any rollback to this run's own best.
    `train_fn`: how an epoch trains (`train_run`'s; a lockstep group's member)."""
    run_dir = Path(run_dir)
    run_id = run_id or run_dir.name
    feats = compute_features(bars) if features is None else features
    # one schedule: feedback off (or a signal off) falls back to the trainer's
    feedback = dataclasses.replace(feedback, schedule=config.schedule)
    records = {e: r for e, r in read_records(run_dir).items() if e <= epochs}
    split_file = run_dir / LOOP_DIR / "split_definition.json"
    box: dict[str, Any] = {"split_def": (SplitDefinition.model_validate_json(split_file.read_text())
                                         if split_file.exists() else None)}

    def knobs_for(e: int) -> Knobs:
        return first_knobs(config) if e == 1 else Knobs.from_dict(records[e - 1]["next_knobs"])

    def close_epoch(e: int, stats: EpochStats | None) -> dict:
        """Evaluate checkpoint e on validation (+ in-sample), compute bundle e, store the epoch's record."""
        return store_epoch(assess_epoch(e), stats)

    def assess_epoch(e: int) -> dict:
        """Checkpoint e's evaluation on validation (+ in-sample) and bundle e: the epoch's record but its training
        statistics (`store_epoch`)."""
        knobs = knobs_for(e)
        prior = [records[k]["history"]["val_sharpe"] for k in range(1, e)]
        prior_n = [records[k]["history"]["val_n_trades"] for k in range(1, e)]
        t0 = time.perf_counter()
        rep = evaluate_checkpoint(checkpoint_path(run_dir, e), expected_sha256=None, bars=bars, split=split,
                                  run_id=run_id, epoch=e, n_trials=e, prior_sharpes=prior, prior_trades=prior_n,
                                  device=device, dataset=dataset, oos=False, features=feats, knobs=knobs)
        t1 = time.perf_counter()
        if box["split_def"] is None:
            box["split_def"] = rep.split
            write_json_atomic(split_file, rep.split.model_dump(mode="json"))
        history = [history_of(records[k], run_id, box["split_def"]) for k in range(1, e)]
        bundle = compute_bundle(rep, history, feedback, bars=bars)
        vm = rep.val.metrics
        this = {"epoch": e, "knobs": knobs.to_dict(), "checkpoint_sha256": rep.checkpoint_sha256,
                "history": {"val_sharpe": rep.val.metric("per_trade_sharpe"), "val_n_trades": len(rep.val.trades)},
                "val_trade_returns": [float(x) for x in rep.val.trades.net_return]}
        exploit = population_exploit([*(h.point for h in history), point_of(this)], e)
        reason = bundle.reason if exploit is None else f"{bundle.reason}; {exploit['reason']}"
        t2 = time.perf_counter()
        rec = {**this, "next_knobs": bundle.knobs,
               "bundle": {"enabled": bundle.enabled, "rollback": bundle.rollback, "reason": reason,
                          "rollback_to_epoch": bundle.rollback_to_epoch,
                          "rollback_checkpoint_sha256": bundle.rollback_checkpoint_sha256,
                          "rollback_keep": bundle.rollback_keep, "rollback_restart": bundle.rollback_restart,
                          "best_epoch": bundle.best_epoch, "exploit": exploit, "off": list(bundle.off),
                          "signals": {k: s.model_dump(mode="json", include={"id", "knob", "value", "reason", "clamped"})
                                      for k, s in bundle.signals.items()}},
               "val": {k: v for k, v in vm.items()},
               # the same greedy policy on the training split's last bars (as many as validation's): what it learned
               # on the data it trains on, beside what holds out of it
               "insample": None if rep.insample is None else dict(rep.insample.metrics),
               "seconds": {"eval": t1 - t0, "feedback": t2 - t1}}
        return rec

    def store_epoch(rec: dict, stats: EpochStats | None) -> dict:
        """The epoch's record with its training statistics (None: an epoch a resume evaluated), stored."""
        rec = {**rec, "train": None if stats is None else {k: (v if not isinstance(v, float) or np.isfinite(v)
                                                              else None) for k, v in asdict(stats).items()
                                                           if k != "knobs"},
               "seconds": {"rollback": None if stats is None else stats.rollback_s,
                           "setup": None if stats is None else stats.setup_s,
                           "train": None if stats is None else stats.seconds,
                           "save": None if stats is None else stats.save_s, **rec["seconds"]},
               "finished_at": time.time()}
        write_json_atomic(record_path(run_dir, rec["epoch"]), rec)
        records[rec["epoch"]] = rec
        return rec

    def population_exploit(own: list[HistoryPoint], e: int) -> dict | None:
        """After epoch e: the peer epoch the next epoch starts from (`exploit_target`), linked into this run
        directory; None when there is none (or the peer pruned it first)."""
        if not (peers and feedback.population) or e >= epochs:     # after the last epoch nothing trains from it
            return None
        found = peer_points(peers, e)
        while found:
            ex = exploit_target(own, [p for _, p in found.values()], feedback)
            if ex is None:
                return None
            key = (ex.peer.run, ex.peer.point.epoch)
            if link_peer_epoch(found[key][0], key[1], run_dir / PEER_DIR):
                return {"run": key[0], "epoch": key[1], "checkpoint_sha256": ex.peer.point.checkpoint_sha256,
                        "val_sharpe": ex.peer.point.val_sharpe, "gain": ex.gain, "se": ex.se,
                        "reason": (f"exploit: {key[0]}'s epoch {key[1]} validated {ex.gain:.3f} above this run's "
                                   f"best, beyond {feedback.population_z:g}·SE = {feedback.population_z * ex.se:.3f}; "
                                   f"the trainer restores its weights and optimizer state")}
            del found[key]
        return None

    def rollback_for(e: int) -> tuple[int, str, float, Path | None, bool] | None:
        """Bundle e−1's rollback or exploit: (the epoch whose learner `train_run` restores before epoch e, its sha256,
        the share of the current weights kept, the run directory it is in: None for this one, and whether a fresh
        learner answers the drop instead)."""
        b = records.get(e - 1, {}).get("bundle", {})
        if b.get("exploit"):
            x = b["exploit"]
            return int(x["epoch"]), x["checkpoint_sha256"], 0.0, run_dir / PEER_DIR, False
        return ((int(b["rollback_to_epoch"]), b.get("rollback_checkpoint_sha256") or "",
                 float(b.get("rollback_keep") or 0.0), None, bool(b.get("rollback_restart")))
                if b.get("rollback") else None)

    def pinned() -> set[int]:
        """The epoch a later rollback would restore (the latest bundle's best epoch): its trainer state is kept."""
        b = records[max(records)]["bundle"] if records else {}
        return set() if b.get("best_epoch") is None else {int(b["best_epoch"])}

    # a resume: epochs checkpointed before a kill but not yet evaluated
    done = latest_epoch(run_dir) if (run_dir / "run.json").exists() else 0
    for e in range(1, min(done, epochs) + 1):
        if e not in records:
            close_epoch(e, None)

    def after_epoch(stats: EpochStats) -> None:
        """The epoch's evaluation, while its trainer state is written (`train_run`'s `on_epoch`)."""
        shutil.rmtree(run_dir / PEER_DIR, ignore_errors=True)    # the peer epoch it started from, if any, is used
        box["assessed"] = assess_epoch(stats.epoch)

    def after_saved(stats: EpochStats) -> None:
        """The record, once the epoch's files are complete: a record on disk means a resume starts after it."""
        rec = store_epoch(box.pop("assessed"), stats)
        if on_epoch is not None:
            on_epoch(rec)

    if done < epochs:
        train_run(bars, dataset, run_dir, epochs, config=config, seed=seed, device=device, accel=accel,
                  knobs_fn=knobs_for, on_epoch=after_epoch, on_saved=after_saved, progress=progress, split=split,
                  features=feats, rollback_fn=rollback_for, pinned_fn=pinned, train_fn=train_fn)
    return [records[e] for e in range(1, epochs + 1)]


def evaluate_selected(run_dir: Path, epoch: int, records: list[dict], *, bars: Bars, split: Split, dataset: str,
                      device: str = "cpu", features: np.ndarray | None = None, run_id: str | None = None) -> dict:
    """The OOS backtest of the one checkpoint selected on validation (epoch `epoch`), with its validation backtest
    again (the same pass: its per-trade Sharpe must equal the record's). Returns {"val": metrics, "oos": metrics,
    "oos_trade_returns": [...], "unshaped": {"val": metrics, "oos": metrics} | None}.

    "unshaped": where the knobs the checkpoint trained under shape the greedy policy (E5 gate, E9 regime confidence:
    `shapes_policy`), the same backtests without them — the policy as learned — so a study tells what the feedback
    taught the agent from what its knobs did to the evaluated policy; None where they do not (the two are equal).
    The DSRs are deflated by every epoch of `records`, those it was chosen among (an epoch's own record has the
    DSR as of that epoch: deflated by it and the ones before)."""
    run_dir = Path(run_dir)
    rec = records[epoch - 1]
    others = [r["history"] for i, r in enumerate(records) if i != epoch - 1]
    prior, prior_n = [h["val_sharpe"] for h in others], [h["val_n_trades"] for h in others]
    knobs = Knobs.from_dict(rec["knobs"])

    def backtest(shaping: bool):
        return evaluate_checkpoint(checkpoint_path(run_dir, epoch), expected_sha256=None, bars=bars, split=split,
                                   run_id=run_id or run_dir.name, epoch=epoch, n_trials=len(records),
                                   prior_sharpes=prior, prior_trades=prior_n, insample_bars=0, device=device,
                                   dataset=dataset, oos=True, features=features, knobs=knobs, shaping=shaping)

    rep = backtest(True)
    plain = backtest(False) if shapes_policy(knobs) else None
    return {"val": dict(rep.val.metrics), "oos": dict(rep.oos.metrics),
            "oos_trade_returns": [float(x) for x in rep.oos.trades.net_return],
            "unshaped": None if plain is None else {"val": dict(plain.val.metrics), "oos": dict(plain.oos.metrics)}}


def prune_checkpoints(run_dir: Path, keep: set[int], keep_state: bool = False) -> None:
    """Delete every trainer state and every agent checkpoint of a finished run except the epochs in `keep` (and,
    with `keep_state`, their trainer states: what a population's later runs exploit)."""
    ck = Path(run_dir) / "checkpoints"
    for p in ck.glob("epoch-*.safetensors"):
        e = int(p.name.split("-")[1].split(".")[0])
        if e not in keep or (p.name.endswith(".state.safetensors") and not keep_state):
            _drop(p)
    shutil.rmtree(Path(run_dir) / PEER_DIR, ignore_errors=True)
