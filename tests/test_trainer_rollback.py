"""The trainer service applies a bundle's rollback and keeps the files a rollback needs: a real Redis, the real
`TrainerWorker` on a tiny run, and a stand-in for the feedback service that stores a bundle after each published
epoch (the fixed schedule's knobs plus the rollback fields). A rollback whose checkpoint sha256 does not match is
refused and recorded; one that matches restores that epoch's learner (bit for bit: tests/test_train.py) and the
record says so."""
from __future__ import annotations

import asyncio
import json

import pytest

from services.feedback.signals import KNOB_OF
from services.trainer.worker import TrainerServiceSettings, TrainerWorker, history_key
from shared.api import service_plumbing
from shared.knobs import Knobs
from shared.report import SIGNAL_IDS, FeedbackBundle, Signal
from tests.polling import apoll_until

pytestmark = pytest.mark.redis


def bundle(run_id: str, epoch: int, **rollback) -> FeedbackBundle:
    """A bundle of epoch `epoch` with the fixed schedule's knobs for epoch + 1 and the given rollback fields."""
    d = Knobs.fixed_schedule(epoch + 1).to_dict()
    sig = {i: Signal(id=i, knob=KNOB_OF[i], value=d[KNOB_OF[i]], reason="test") for i in SIGNAL_IDS}
    return FeedbackBundle(run_id=run_id, epoch=epoch, for_epoch=epoch + 1, signals=sig, knobs=d, **rollback)


async def wait_for(coro_fn, what: str, timeout_s: float = 300.0):
    return await apoll_until(coro_fn, what, timeout_s=timeout_s)


@pytest.mark.parametrize("mode", ["sync", "overlap"])
async def test_trainer_restores_the_epoch_a_bundle_rolls_back_to(redis_url, run_id, tmp_path, mode):
    """Bundle 1 asks for a rollback to epoch 1 with the wrong checkpoint sha256, bundle 2 with the right one. In
    sync mode bundle e starts epoch e + 1; in overlap mode it is applied where it arrives (at an epoch's start or
    between two iterations, the rollback with it)."""
    settings = TrainerServiceSettings(redis_url=redis_url, run_id=run_id, run_dir=tmp_path, epochs=4,
                                      data="synthetic", data_bars=1000, train_iterations=4, train_learning_starts=32,
                                      train_batch_size=32, train_n_envs=4, feedback_timeout_s=300, feedback_mode=mode)
    state, bus = service_plumbing("trainer", settings)
    await bus.connect()
    worker = TrainerWorker(settings, bus, state)
    run = asyncio.create_task(worker.run())

    async def record(e: int) -> dict | None:
        raw = await bus.redis.hget(history_key(run_id), str(e))
        return None if raw is None else json.loads(raw)

    try:
        r1 = await wait_for(lambda: record(1), "epoch 1")
        await bus.store.put_bundle(1, bundle(run_id, 1, rollback=True, rollback_to_epoch=1,
                                             rollback_checkpoint_sha256="0" * 64, best_epoch=1))
        await wait_for(lambda: record(2), "epoch 2")
        await bus.store.put_bundle(2, bundle(run_id, 2, rollback=True, rollback_to_epoch=1,
                                             rollback_checkpoint_sha256=r1["sha256"], best_epoch=1))
        await wait_for(lambda: record(3), "epoch 3")
        # bundle 3 only once bundle 2's rollback is done: stored together at an epoch's start, the newer bundle
        # (no rollback) supersedes it
        await wait_for(lambda: state.counters.get("rollbacks"), "bundle 2's rollback")
        await bus.store.put_bundle(3, bundle(run_id, 3, best_epoch=1))
        await asyncio.wait_for(run, 300)
        recs = [await record(e) for e in (2, 3, 4)]
    finally:
        if not run.done():
            worker.stop()
            run.cancel()
        await bus.close()
    refused = [r["epoch"] for r in recs if "sha256 mismatch" in (r.get("rollback_error") or "")]
    restored = [r["epoch"] for r in recs if r.get("rolled_back_to") == 1]
    keys = ("epoch", "bundles_applied", "rollback_to_epoch", "rolled_back_to", "rollback_error", "knobs_source")
    assert len(restored) == 1 and state.counters.get("rollbacks") == 1, [{k: r.get(k) for k in keys} for r in recs]
    if mode == "sync":                       # bundle e starts epoch e + 1
        assert (refused, restored) == ([2], [3]) and "rollback to epoch 1 refused" in state.last_error
    else:   # where bundle 1 lands depends on timing (at an epoch's start, or in the epoch bundle 2 lands in too: then
        # that epoch's record holds both the refusal and the restore); a newer bundle supersedes it
        assert len(refused) <= 1 and all(e <= restored[0] for e in refused)
    # the pruning keeps the best epoch's files (the bundles' best_epoch) beside the last state
    ck = tmp_path / run_id / "trainer" / "checkpoints"
    states = sorted(int(p.name[6:10]) for p in ck.glob("epoch-*.state.safetensors"))
    assert states[0] == 1 and states[-1] == 4 and 2 not in states, states


async def test_a_restarted_trainer_times_out_onto_the_bundle_its_last_epoch_trained_under(redis_url, run_id, tmp_path):
    """A trainer restarted after epoch 2 (trained under bundle 1) whose wait for bundle 2 times out trains epoch 3
    on bundle 1, as the process before it would have — not on the fixed schedule — and says so in the record."""
    def settings(epochs: int, timeout_s: float) -> TrainerServiceSettings:
        return TrainerServiceSettings(redis_url=redis_url, run_id=run_id, run_dir=tmp_path, epochs=epochs,
                                      data="synthetic", data_bars=1000, train_iterations=4, train_learning_starts=32,
                                      train_batch_size=32, train_n_envs=4, feedback_timeout_s=timeout_s)

    async def run_trainer(s: TrainerServiceSettings, before=None):
        state, bus = service_plumbing("trainer", s)
        await bus.connect()
        try:
            if before is not None:
                await before(bus)
            await asyncio.wait_for(TrainerWorker(s, bus, state).run(), 300)
            return {e: json.loads(v) for e, v in
                    ((int(k), v) for k, v in (await bus.redis.hgetall(history_key(run_id))).items())}
        finally:
            await bus.close()

    # epoch 1, then bundle 1 (stored up front: epoch 2 finds it), then epoch 2; the process ends there
    await run_trainer(settings(1, 300))
    await run_trainer(settings(2, 300), before=lambda bus: bus.store.put_bundle(1, bundle(run_id, 1, best_epoch=1)))
    hist = await run_trainer(settings(3, 0.5))           # a new process; bundle 2 never comes
    r3 = hist[3]
    assert hist[2]["bundle_epoch"] == 1 and r3["feedback_timed_out"] is True, r3
    assert (r3["bundle_epoch"], r3["stale_bundle"]) == (1, True), r3["knobs_source"]
    assert "training on the last bundle (epoch 1)" in r3["knobs_source"]
    # and its pruning still keeps the best epoch bundle 1 named (what a later rollback restores)
    ck = tmp_path / run_id / "trainer" / "checkpoints"
    assert sorted(int(p.name[6:10]) for p in ck.glob("epoch-*.state.safetensors")) == [1, 2, 3]


def test_the_rollback_request_carries_the_share_of_the_current_weights_kept():
    """The trainer's request from a bundle: the epoch, its checkpoint's sha256, `rollback_keep` and
    `rollback_restart` (0 and false when the bundle predates the fields); no request without a rollback."""
    from services.trainer.bundles import rollback_request

    b = bundle("r", 3, rollback=True, rollback_to_epoch=1, rollback_checkpoint_sha256="ab" * 32, rollback_keep=0.5,
               best_epoch=1).model_dump(mode="json")
    assert rollback_request(b) == {"rollback_to_epoch": 1, "rollback_checkpoint_sha256": "ab" * 32, "rollback_keep": 0.5,
                                   "rollback_restart": False}
    old = {k: v for k, v in b.items() if k not in ("rollback_keep", "rollback_restart")}
    assert rollback_request(old)["rollback_keep"] == 0.0 and rollback_request(old)["rollback_restart"] is False
    fresh = bundle("r", 3, rollback=True, rollback_to_epoch=1, rollback_restart=True, best_epoch=1)
    assert rollback_request(fresh.model_dump(mode="json"))["rollback_restart"] is True
    assert rollback_request(bundle("r", 3, best_epoch=1).model_dump(mode="json")) == {}
