"""An epoch interrupted at an iteration boundary is saved there and finished later without losing an update; a run
directory keeps the last trainer state and the last K checkpoints. In-process, CPU, the tiny config of
test_train.py."""
from __future__ import annotations

import pytest
import torch

from services.trainer.train import (INTERRUPTED, EpochInterrupted, build_state, latest_epoch, prune_checkpoints,
                                    read_interrupted, restore_interrupted, restore_state, save_epoch, save_interrupted,
                                    train_epoch)
from shared.checkpoints import sidecar_path
from shared.knobs import Knobs
from shared.market import chronological_split
from shared.synthetic import generate
from test_train import tiny_config

META = {"dataset": "synthetic", "seed": 5}


def _state(bars, cfg):
    return build_state(cfg, bars, chronological_split(len(bars)), 5, "cpu")


def _stop_after(n: int):
    calls = {"n": 0}

    def interrupt() -> bool:
        calls["n"] += 1
        return calls["n"] > n
    return interrupt


def test_an_interrupted_epoch_resumes_at_its_iteration_with_every_update_kept(tmp_path):
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    cfg.iterations = 6
    knobs = Knobs.fixed_schedule(1)
    ref = _state(bars, cfg)                                   # the same epochs, never interrupted
    train_epoch(ref, knobs)
    full = train_epoch(ref, Knobs.fixed_schedule(2))

    run = tmp_path / "trainer"
    a = _state(bars, cfg)
    train_epoch(a, knobs)
    save_epoch(a, run, META)
    with pytest.raises(EpochInterrupted) as info:
        train_epoch(a, Knobs.fixed_schedule(2), interrupt=_stop_after(3))
    p = info.value.progress
    assert (p.epoch, p.iteration, p.iterations) == (2, 3, cfg.iterations) and 0 < p.updates < full.updates
    assert a.epoch == 1                                       # the epoch is not complete
    save_interrupted(a, run, p, {"knobs_source": "test"})

    b = _state(bars, cfg)                                     # a new process
    done = latest_epoch(run)
    tensors, meta = read_interrupted(run, done, cfg.hash())
    assert done == 1 and meta["record"] == {"knobs_source": "test"}
    q = restore_interrupted(b, tensors, meta)
    assert q == p and (b.epoch, b.update_step, b.env_steps, b.replay.count) == (
        a.epoch, a.update_step, a.env_steps, a.replay.count)
    for (n, pa), pb in zip(a.agent.state_dict().items(), b.agent.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert torch.equal(a.buffers.metric_sums, b.buffers.metric_sums)
    assert b.generator.get_state().equal(a.generator.get_state())
    done_stats = train_epoch(b, Knobs.from_dict(q.knobs), resume=q)
    assert b.epoch == 2 and b.update_step == ref.update_step and b.env_steps == ref.env_steps
    assert (done_stats.updates, done_stats.env_steps) == (full.updates, full.env_steps)
    assert done_stats.seconds >= p.seconds and torch.isfinite(torch.tensor(done_stats.loss))
    # a state after another epoch cannot resume it
    with pytest.raises(ValueError, match="cannot resume epoch 2"):
        train_epoch(b, Knobs.from_dict(q.knobs), resume=q)


def test_an_interrupted_file_of_an_earlier_epoch_or_with_a_bad_sha256_is_never_loaded(tmp_path):
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    cfg.iterations = 6
    run = tmp_path / "trainer"
    a = _state(bars, cfg)
    with pytest.raises(EpochInterrupted) as info:
        train_epoch(a, Knobs.fixed_schedule(1), interrupt=_stop_after(3))
    path = save_interrupted(a, run, info.value.progress)
    assert read_interrupted(run, 0, "another config") is None and not path.exists()   # removed
    save_interrupted(a, run, info.value.progress)
    path.write_bytes(path.read_bytes()[:-10])                  # cut: its sha256 no longer checks
    assert read_interrupted(run, 0, cfg.hash()) is None and not path.exists() and not sidecar_path(path).exists()
    assert len(list(path.parent.glob(INTERRUPTED + ".bad-*"))) == 2       # set aside with its sidecar, not deleted
    save_interrupted(a, run, info.value.progress)
    a2 = _state(bars, cfg)
    train_epoch(a2, Knobs.fixed_schedule(1))
    save_epoch(a2, run, META)                                  # epoch 1 completed by another path: the file is stale
    assert read_interrupted(run, latest_epoch(run), cfg.hash()) is None and not path.exists()


def test_a_run_keeps_the_last_trainer_state_and_the_last_k_checkpoints(tmp_path):
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    cfg.iterations = 3
    run = tmp_path / "trainer"
    a = _state(bars, cfg)
    ck = run / "checkpoints"
    for e in range(1, 6):
        train_epoch(a, Knobs.fixed_schedule(e))
        save_epoch(a, run, META)
        if e == 4:
            with pytest.raises(EpochInterrupted) as info:
                b = _state(bars, cfg)
                restore_state(b, run, 4)
                train_epoch(b, Knobs.fixed_schedule(5), interrupt=_stop_after(1))
            save_interrupted(b, run, info.value.progress)
        gone = prune_checkpoints(run, e, keep=2)
        assert all(not p.exists() and not sidecar_path(p).exists() for p in gone)
    names = sorted(p.name for p in ck.iterdir() if not p.name.endswith(".sha256"))
    assert names == ["epoch-0004.safetensors", "epoch-0005.safetensors", "epoch-0005.state.safetensors"]
    assert sorted(p.name for p in ck.glob("*.sha256")) == [f"{n}.sha256" for n in names]
    assert not (ck / INTERRUPTED).exists() and latest_epoch(run) == 5
    c = _state(bars, cfg)
    restore_state(c, run, 5)                                  # what is kept resumes
    assert c.update_step == a.update_step
