"""Checkpoint files that cannot be trusted or do not fit: swapped weights and trainer-state files, tensors of
another shape, a garbled sidecar, an interrupted epoch's file with a bad sha256, and a write that fails (a full
disk) are each one clear error naming the file, and nothing on disk is lost or overwritten. The tiny config of
test_train.py, on the CPU; the command-line tests resume a one-epoch run trained once for the module."""
from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_train import tiny_config
from test_train_out import _tree, use_tiny_presets
from typer.testing import CliRunner

from services.trainer.train import (INTERRUPTED, EpochInterrupted, build_state, latest_epoch,
                                    read_interrupted, restore_interrupted, restore_state, roll_back, save_epoch,
                                    save_interrupted, train_epoch)
from shared.checkpoints import (CheckpointError, checkpoint_sha256, load_checkpoint, save_checkpoint,
                                sidecar_path)
from shared.knobs import Knobs
from shared.market import chronological_split
from shared.synthetic import generate
from tradeloop.cli import app

META = {"dataset": "synthetic", "seed": 5}


def _state(cfg):
    bars = generate(700, seed=3).bars
    return build_state(cfg, bars, chronological_split(len(bars)), 5, "cpu")


def _small_cfg():
    cfg = tiny_config()
    cfg.iterations = 3
    return cfg


@pytest.fixture
def epoch_run(tmp_path):
    """A run directory holding epoch 1 of the tiny config (weights, trainer state, sidecars), and its config."""
    cfg = _small_cfg()
    a = _state(cfg)
    train_epoch(a, Knobs.fixed_schedule(1))
    save_epoch(a, tmp_path / "run", META)
    return tmp_path / "run", cfg


def _rewrite(path: Path, change) -> None:
    """Write `path` again with its tensors changed by `change(tensors)`, metadata kept, its sidecar matching."""
    tensors, meta = load_checkpoint(path)
    change(tensors)
    save_checkpoint(path, tensors, meta)


def _swap(src: Path, dst: Path) -> None:
    """Copy `src` over `dst`, with `dst`'s sidecar edited to match (what no kill or crash does)."""
    dst.write_bytes(src.read_bytes())
    sidecar_path(dst).write_text(f"{checkpoint_sha256(dst.read_bytes())}  {dst.name}\n")


def test_swapped_weights_and_state_files_are_refused_by_kind_naming_the_file(epoch_run):
    run, cfg = epoch_run
    w, st = run / "checkpoints" / "epoch-0001.safetensors", run / "checkpoints" / "epoch-0001.state.safetensors"
    keep_w, keep_side, keep_st = w.read_bytes(), sidecar_path(w).read_text(), st.read_bytes()
    _swap(st, w)
    swapped = "is a trainer-state file, not an epoch's weights \\(files swapped\\?\\)"
    with pytest.raises(CheckpointError, match=swapped) as info:
        restore_state(_state(cfg), run, 1)
    assert info.value.source == str(w)
    with pytest.raises(CheckpointError, match="files swapped"):
        roll_back(_state(cfg), run, 1)
    w.write_bytes(keep_w)
    sidecar_path(w).write_text(keep_side)
    _swap(w, st)
    with pytest.raises(CheckpointError, match="is an epoch's weights, not a trainer-state file") as info:
        restore_state(_state(cfg), run, 1)
    assert info.value.source == str(st)
    assert w.read_bytes() == keep_w and st.read_bytes() != keep_st         # nothing was written over


def test_tensors_that_do_not_fit_are_a_checkpoint_error_with_torchs_line_and_a_rollback_changes_nothing(epoch_run):
    run, cfg = epoch_run
    w = run / "checkpoints" / "epoch-0001.safetensors"
    _rewrite(w, lambda t: t.pop("value_b"))
    with pytest.raises(CheckpointError) as info:
        restore_state(_state(cfg), run, 1)
    assert info.value.source == str(w) and "Missing key(s) in state_dict" in info.value.reason
    assert len(info.value.reason) <= 250 and "\n" not in info.value.reason
    _rewrite(w, lambda t: t.update(value_b=torch.zeros(3, 3)))
    with pytest.raises(CheckpointError) as info:
        restore_state(_state(cfg), run, 1)
    assert info.value.source == str(w) and "size mismatch for value_b" in info.value.reason
    b = _state(cfg)
    before = {k: v.clone() for k, v in b.agent.state_dict().items()}
    for keep in (0.0, 0.5):
        with pytest.raises(CheckpointError, match="size mismatch for value_b") as info:
            roll_back(b, run, 1, keep=keep)
        assert info.value.source == str(w)
    assert all(torch.equal(before[k], v) for k, v in b.agent.state_dict().items())   # left as it was


def _interrupted(cfg, run):
    """A state of `cfg` whose first epoch was interrupted at once, its interrupted file saved in `run`, and the
    epoch's progress."""
    a = _state(cfg)
    with pytest.raises(EpochInterrupted) as info:
        train_epoch(a, Knobs.fixed_schedule(1), interrupt=lambda: True)
    return a, save_interrupted(a, run, info.value.progress), info.value.progress


def test_an_interrupted_file_whose_tensors_do_not_fit_is_a_checkpoint_error_naming_it(tmp_path):
    cfg = _small_cfg()
    _, path, _ = _interrupted(cfg, tmp_path / "run")
    _rewrite(path, lambda t: t.update({"agent.value_b": torch.zeros(3, 3)}))
    tensors, meta = read_interrupted(tmp_path / "run", 0, cfg.hash())
    with pytest.raises(CheckpointError, match="size mismatch for value_b") as info:
        restore_interrupted(_state(cfg), tensors, meta)
    assert info.value.source == str(path)


def test_an_interrupted_file_with_a_bad_sha256_is_set_aside_with_a_warning_and_a_stale_one_removed(tmp_path, caplog):
    cfg = _small_cfg()
    run = tmp_path / "run"
    a, path, progress = _interrupted(cfg, run)
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    side = sidecar_path(path).read_text()
    with caplog.at_level(logging.INFO, logger="tradeloop.trainer"):
        assert read_interrupted(run, 0, cfg.hash()) is None
    aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith(INTERRUPTED + ".bad-")]
    assert not path.exists() and not sidecar_path(path).exists() and len(aside) == 2, aside
    kept = next(p for p in aside if not p.name.endswith(".sha256"))
    assert kept.read_bytes() == bytes(raw) and sidecar_path(kept).read_text() == side
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(path) in warned[0].getMessage() and "sha256 mismatch" in warned[0].getMessage()
    save_interrupted(a, run, progress)                # a second bad file takes the first one's place
    raw[-2] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert read_interrupted(run, 0, cfg.hash()) is None
    aside = [p for p in (run / "checkpoints").iterdir() if ".bad-" in p.name]
    assert len(aside) == 2 and next(p for p in aside if not p.name.endswith(".sha256")).read_bytes() == bytes(raw)
    caplog.clear()
    save_interrupted(a, run, progress)                # another config's file: stale, removed at INFO
    with caplog.at_level(logging.INFO, logger="tradeloop.trainer"):
        assert read_interrupted(run, 0, "another config") is None
    assert not path.exists() and not sidecar_path(path).exists()
    assert [r.levelno for r in caplog.records] == [logging.INFO] and str(path) in caplog.records[0].getMessage()


def test_a_garbled_sidecar_is_refused_and_only_a_missing_one_is_incomplete(epoch_run):
    run, _ = epoch_run
    st = run / "checkpoints" / "epoch-0001.state.safetensors"
    side = sidecar_path(st)
    good = side.read_text()
    side.write_text("not a digest\n")
    with pytest.raises(CheckpointError, match="does not hold a sha256 digest.*nothing was touched") as info:
        latest_epoch(run)
    assert info.value.source == str(st) and side.read_text() == "not a digest\n"
    side.write_text(good)
    assert latest_epoch(run) == 1
    side.unlink()
    assert latest_epoch(run) == 0 and st.exists()                 # a kill before the sidecar: trained again


@pytest.fixture
def tiny_presets(monkeypatch):
    use_tiny_presets(monkeypatch)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of `tradeloop train` under the tiny presets, copied by each test that resumes it."""
    out = tmp_path_factory.mktemp("template") / "run"
    with pytest.MonkeyPatch.context() as mp:
        use_tiny_presets(mp)
        r = CliRunner().invoke(app, ["train", "--epochs", "1", "--dataset", "synthetic", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    return out


def _resume(out: Path):
    r = CliRunner().invoke(app, ["train", "--epochs", "2", "--out", str(out)])
    return r, " ".join(r.stderr.split())


def test_train_refuses_swapped_files_in_one_line_touching_nothing(trained, tmp_path, tiny_presets):
    out = _copy(trained, tmp_path)
    ck = out / "checkpoints"
    _swap(ck / "epoch-0001.state.safetensors", ck / "epoch-0001.safetensors")
    before = _tree(tmp_path)
    r, msg = _resume(out)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    assert msg == (f"error: checkpoint {ck / 'epoch-0001.safetensors'}: is a trainer-state file, not an epoch's "
                   "weights (files swapped?)"), r.output
    assert _tree(tmp_path) == before


def test_train_refuses_a_garbled_sidecar_touching_nothing(trained, tmp_path, tiny_presets):
    out = _copy(trained, tmp_path)
    w = out / "checkpoints" / "epoch-0001.safetensors"
    sidecar_path(w).write_text("garbled\n")
    before = _tree(tmp_path)
    r, msg = _resume(out)
    assert r.exit_code == 2 and msg.startswith(f"error: checkpoint {w}: sidecar {sidecar_path(w).name} does not "
                                               "hold a sha256 digest"), r.output
    assert "nothing was touched" in msg and "Traceback" not in r.output
    assert _tree(tmp_path) == before


@pytest.fixture
def file_size_limit():
    """`limit(n)`: files this process writes may grow to n bytes at most (RLIMIT_FSIZE; a write past it fails with
    EFBIG, as one on a full disk fails with ENOSPC); `limit(None)`, and the end of the test, restore the limit and
    SIGXFSZ's handler."""
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    def limit(n: int | None) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit if n is None else (n, old_limit[1]))
    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    signal.signal(signal.SIGXFSZ, old_handler)


def test_a_failed_checkpoint_write_names_the_file_keeps_its_errno_and_loses_nothing(tmp_path, file_size_limit):
    path = tmp_path / "ck" / "epoch-0001.safetensors"
    save_checkpoint(path, {"x": torch.zeros(4)}, {"kind": "agent"})
    old, old_side = path.read_bytes(), sidecar_path(path).read_text()
    file_size_limit(64 * 1024)
    with pytest.raises(OSError) as info:
        save_checkpoint(path, {"x": torch.zeros(64 * 1024)}, {"kind": "agent"})
    file_size_limit(None)
    assert info.value.errno == errno.EFBIG and info.value.strerror == f"writing {path}: {os.strerror(errno.EFBIG)}"
    assert path.read_bytes() == old and sidecar_path(path).read_text() == old_side
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, sidecar_path(path).name]   # no temp file


def test_train_on_a_full_disk_names_the_file_it_was_writing(trained, tmp_path, tiny_presets,
                                                            file_size_limit):
    out = _copy(trained, tmp_path)
    w = out / "checkpoints" / "epoch-0001.safetensors"
    file_size_limit(w.stat().st_size // 2)
    r, msg = _resume(out)
    file_size_limit(None)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), r.output
    new = out / "checkpoints" / "epoch-0002.safetensors"
    assert msg == f"error: writing {new}: {os.strerror(errno.EFBIG)}", r.output
    assert [p.name for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")] == []
    assert w.read_bytes() == (trained / "checkpoints" / "epoch-0001.safetensors").read_bytes()


def test_evaluate_names_the_checkpoint_file_and_torchs_line_when_its_tensors_do_not_fit(trained, tmp_path):
    out = _copy(trained, tmp_path)
    w = out / "checkpoints" / "epoch-0001.safetensors"
    _rewrite(w, lambda t: t.update(value_b=torch.zeros(3, 3)))
    lone = tmp_path / "lone.safetensors"                    # outside a run: `evaluate --policy FILE`
    lone.write_bytes(w.read_bytes())
    sidecar_path(lone).write_text(f"{checkpoint_sha256(lone.read_bytes())}  {lone.name}\n")
    for args, path in ((["--policy", str(lone)], lone), (["--policy", str(out), "--checkpoint", "all"], w)):
        r = CliRunner().invoke(app, ["evaluate", *args])
        msg = " ".join(r.stderr.split())
        assert r.exit_code == 2 and f"error: checkpoint {path}: tensors do not fit the agent config: size mismatch " \
                                   "for value_b" in msg, r.output
        assert "bytes>" not in msg and "Traceback" not in r.output
