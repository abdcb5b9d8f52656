"""Process-level faults against a real loop: `tradeloop up` (launcher + supervisor) on a tiny CPU config, a real
Redis on 127.0.0.1 that the test owns (so it can be killed and restarted on its AOF).

One run of 12 epochs takes every fault in turn (bench/chaos.py does the injecting and the counting; this file
asserts): poison entries on the live streams; the evaluator SIGKILLed mid-backtest on three different epochs; the
trainer SIGKILLed mid-epoch, and again with the files of a kill inside `save_epoch` left behind; Redis SIGKILLed,
restarted on its AOF and stripped of both consumer groups; the feedback service SIGSTOPped past the trainer's
feedback timeout, then SIGCONTed. Then: every epoch has exactly one checkpoint, report, bundle and one event of
each kind; nothing acknowledged before the Redis kill was lost; no partial checkpoint was loaded or published.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.chaos import run_all  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
# The faults run one after another, each after the last one's recovery, so the epoch the feedback stop lands on
# depends on timing; 12 epochs leave room for the epochs after it (with 10, a CI run once stalled the last epoch,
# and its catch-up could not be seen: "bundle_epoch 8 at epoch 10")
EPOCHS = 12


@pytest.fixture(scope="module")
def chaos(tmp_path_factory):
    """The faulted run: (loop, tally, faults by name). Everything it started is stopped afterwards."""
    loop, tally = run_all(tmp_path_factory.mktemp("chaos"), epochs=EPOCHS, iterations=12, feedback_timeout_s=8.0,
                          log=lambda m: print(m, flush=True))
    by: dict[str, list] = {}
    for f in loop.faults:
        by.setdefault(f.name, []).append(f)
    try:
        yield loop, tally, by
    finally:
        loop.close()


def test_every_epoch_closed_exactly_once(chaos):
    loop, t, by = chaos
    assert t["up_exit_code"] == 0, (loop.workdir / "up.log").read_text()[-3000:]
    assert (t["epochs_completed"], t["lost"], t["duplicated"]) == (EPOCHS, 0, 0), t["duplicated_epochs"]
    want = {e: 1 for e in range(1, EPOCHS + 1)}
    for kind in ("checkpoints", "reports", "feedback"):
        assert t["event_counts"][kind] == want, kind
    assert t["evaluations"] == want            # one stored evaluation per checkpoint, redeliveries included
    assert t["history_jsonl"] == want          # no epoch trained-and-recorded twice
    assert sorted(loop.epochs_of("report")) == sorted(loop.epochs_of("bundle")) == list(range(1, EPOCHS + 1))
    assert len(by) == 6 and sum(len(v) for v in by.values()) == 8
    # the trainer's epoch records name a bundle of an earlier epoch, never a later one, in order
    used = [t["history"][e]["bundle_epoch"] for e in range(1, EPOCHS + 1)]
    why = {e: (t["history"][e].get("bundle_epoch"), t["history"][e].get("knobs_source")) for e in range(1, EPOCHS + 1)}
    assert used[0] is None and all(u is not None and u < e for e, u in zip(range(2, EPOCHS + 1), used[1:])), why
    assert used[1:] == sorted(used[1:]), why


def test_evaluator_killed_three_times_each_checkpoint_evaluated_once(chaos):
    loop, t, by = chaos
    kills = by["evaluator kill -9 mid-backtest"]
    assert len(kills) == 3 and len({f.epoch for f in kills}) == 3
    for f in kills:
        assert f.detail["new_pid"] != f.detail["pid"]          # a new process finished the evaluation
        assert t["evaluations"][f.epoch] == 1 and t["event_counts"]["reports"][f.epoch] == 1
        assert f.recover_s < 30


def test_trainer_killed_mid_epoch_and_mid_write_resumes_without_loss(chaos):
    loop, t, by = chaos
    (mid,) = by["trainer kill -9 mid-epoch"]
    (write,) = by["trainer kill -9 mid-checkpoint-write"]
    for f in (mid, write):
        assert t["event_counts"]["checkpoints"][f.epoch] == 1 and f.recover_s < 60
    # the partial epoch on disk (weights of another epoch, state without its sidecar) was never loaded or published
    assert write.detail["published_sha256"] != write.detail["planted_sha256"]
    log = (loop.run_dir / "logs" / "trainer.log").read_text()
    assert f"epoch-{write.epoch:04d}.state.safetensors is incomplete" in log
    ck = loop.run_dir / "trainer" / "checkpoints"
    assert not list(ck.glob(".*.tmp")), "temp files of the killed write were left behind"
    import hashlib
    # the last complete epoch's trainer state is kept (the planted one was replaced), and besides it at most the
    # best epoch's, which a feedback rollback would restore (pinned by the bundle); every other state was pruned
    states = {p.name for p in ck.glob("epoch-*.state.safetensors")}
    last = ck / f"epoch-{EPOCHS:04d}.state.safetensors"
    assert last.name in states and len(states) <= 2, states
    side = (ck / f"{last.name}.sha256").read_text().split()[0]
    assert hashlib.sha256(last.read_bytes()).hexdigest() == side
    # the published bytes of every epoch are the ones on disk
    for e, rec in t["history"].items():
        assert hashlib.sha256((ck / f"epoch-{e:04d}.safetensors").read_bytes()).hexdigest() == rec["sha256"]


def test_redis_killed_and_restarted_on_aof(chaos):
    loop, t, by = chaos
    (f,) = by["redis kill -9 + AOF restart"]
    assert f.detail["acked_before"] > 0 and f.detail["lost_after_restart"] == {}
    assert f.detail["groups_destroyed"] == 2 and f.detail["groups_after"] == ["evaluator", "feedback"]
    assert f.recover_s < 60
    st = loop.rq(lambda r: r.xinfo_groups(f"tl:{loop.run_id}:stream:checkpoints"))
    assert [g["pending"] for g in st if g["name"] == "evaluator"] == [0]


def test_feedback_stopped_past_timeout_training_goes_on_and_catches_up(chaos):
    loop, t, by = chaos
    (f,) = by["feedback SIGSTOP past the trainer's timeout"]
    assert f.detail["stopped_s"] >= loop.feedback_timeout_s
    hist = t["history"]
    for e in f.detail["timed_out_epochs"]:
        rec = hist[e]
        assert rec["feedback_timed_out"] and rec["stale_bundle"] and rec["bundle_epoch"] < e - 1
        # the stale bundle's hyper-parameters carry on; its sample-level signals are not applied a second time
        assert rec["knobs"]["priority_boost"] == [] and rec["knobs"]["hindsight"] == []
        stale = json.loads(loop.r.get(f"tl:{loop.run_id}:bundle:{rec['bundle_epoch']}"))["knobs"]
        assert rec["knobs"]["epsilon"] == stale["epsilon"] and rec["knobs"]["gamma"] == stale["gamma"]
    # caught up: the last epoch trained under the bundle of the epoch before it, fresh
    assert max(f.detail["timed_out_epochs"]) < EPOCHS, "the stall hit the last epoch: no epoch left to catch up"
    last = hist[EPOCHS]
    assert last["bundle_epoch"] == EPOCHS - 1 and not last["feedback_timed_out"]
    # no bundle was the fresh source of more than one epoch
    fresh = [h["bundle_epoch"] for h in hist.values() if h.get("bundle_epoch") is not None and not h["stale_bundle"]]
    assert len(fresh) == len(set(fresh))


def test_poison_messages_dead_lettered_with_reasons_loop_unharmed(chaos):
    loop, t, by = chaos
    (f,) = by["poison messages"]
    got = f.detail["reasons"]  # what was injected → the dead letter's reason
    assert len(got) == f.detail["injected"] == 6
    assert got["not json"].startswith("malformed: not JSON")
    assert got["truncated"].startswith("malformed: truncated JSON")
    assert got["wrong version"].startswith("malformed: unknown schema_version 99")
    assert got["oversized"].startswith("malformed: oversized") and "65536" in got["oversized"]
    assert got["bad schema"].startswith("malformed: schema error") and "epoch" in got["bad schema"]
    # a well-formed event whose handler keeps failing: bounded retries, then dead-lettered with the last error
    assert got["handler fails"].startswith("handler failed 3 times") and "epoch 9000" in got["handler fails"]
    # every dead letter of the run is one of the injected entries (re-read once more after the groups were
    # recreated from 0 during the Redis fault); no real epoch was ever dead-lettered
    dead = [d for _, d in loop.stream("dead")]
    assert {d["epoch"] for d in dead} <= {-1, 9000} and t["dead_letters"] == len(dead) >= 6
