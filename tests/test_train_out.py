"""`tradeloop train --out`: what it trains into and what a resume keeps. A directory that is not a `tradeloop train`
run (a `tradeloop up` run, its trainer's directory, a directory of runs, other files) is refused with nothing
written; a resumed run refuses another --seed, --config or --dataset by name and resumes with the same flags, given
or left out."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_train import TINY_AGENT, tiny_config
from typer.testing import CliRunner

from services.trainer.train import TrainConfig, open_run
from shared.market import load_dataset
from shared.runfiles import TRAINER_DIR
from tradeloop.cli import app
from tradeloop.up.runs import DEFAULTS, claim_run, write_run_file


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root`: (size, mtime in ns)."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _train(*args: str):
    return CliRunner().invoke(app, ["train", "--epochs", "1", *args])


def use_tiny_presets(mp: pytest.MonkeyPatch) -> None:
    """Both presets as the tests' tiny config (an epoch in seconds), each remembering its name in its batch size."""
    def preset(cls, name: str, n_features: int) -> TrainConfig:
        if name not in ("small", "full"):
            raise ValueError(f"unknown config preset {name!r}")
        return dataclasses.replace(tiny_config(), agent=dataclasses.replace(TINY_AGENT, n_features=n_features),
                                   batch_size=16 if name == "small" else 8)

    mp.setattr(TrainConfig, "preset", classmethod(preset))


@pytest.fixture
def tiny_presets(monkeypatch):
    use_tiny_presets(monkeypatch)


def _up_run(runs: Path, run_id: str) -> Path:
    """The on-disk run of `tradeloop up` before its first epoch, made by the code that makes it: the launcher's
    directory, lock and up.json, and the trainer service's run.json under trainer/."""
    run_id, path, lock = claim_run(run_id, runs / run_id, generated=False)
    try:
        write_run_file(path, run_id, dict(DEFAULTS), resuming=False)
        bars = load_dataset("synthetic", seed=0).slice(0, 1000)
        open_run(path / TRAINER_DIR, bars, "synthetic", seed=0, where="TL_RUN_ID", extra={"data_seed": 0},
                 new_config=lambda: tiny_config())
    finally:
        lock.release()
    return path


def test_train_refuses_an_up_run_its_trainer_directory_and_any_other_directory_writing_nothing(tmp_path):
    runs = tmp_path / "runs"
    run = _up_run(runs, "r1")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    study_run = tmp_path / "study-run"                    # a run.json beside another program's directories
    (study_run / "loop").mkdir(parents=True)
    (study_run / "run.json").write_text(json.dumps({"dataset": "synthetic", "seed": 0}))
    before = _tree(tmp_path)
    r = _train("--dataset", "synthetic", "--out", str(run))
    assert r.exit_code == 2, r.output
    msg = " ".join(r.stderr.split())
    assert f"--out {run} holds a `tradeloop up` run" in msg
    assert f"tradeloop up --resume r1 --run-dir {runs}" in msg
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    r = _train("--dataset", "synthetic", "--out", str(run / TRAINER_DIR))
    assert r.exit_code == 2 and f"is the trainer's directory of the `tradeloop up` run {run}" in r.stderr, r.output
    r = _train("--dataset", "synthetic", "--out", str(runs))
    assert r.exit_code == 2 and "holds r1/ but no `tradeloop train` run" in r.stderr, r.output
    r = _train("--dataset", "synthetic", "--out", str(tmp_path / "notes"))
    assert r.exit_code == 2 and "holds todo.txt but no `tradeloop train` run" in r.stderr, r.output
    r = _train("--dataset", "synthetic", "--out", str(study_run))
    assert r.exit_code == 2 and "holds loop/ beside a run's run.json" in r.stderr, r.output
    assert _tree(tmp_path) == before


def test_a_resumed_train_run_refuses_another_seed_config_or_dataset_by_name_and_resumes_with_the_same(
        tmp_path, tiny_presets):
    out = tmp_path / "run"
    r = _train("--dataset", "synthetic", "--out", str(out), "--seed", "5", "--config", "small")
    assert r.exit_code == 0, r.output
    meta = json.loads((out / "run.json").read_text())
    assert (meta["seed"], meta["config"]["batch_size"]) == (5, 16)
    before = _tree(out)
    r = _train("--dataset", "synthetic", "--out", str(out), "--seed", "6", "--config", "full")
    assert r.exit_code == 2, r.output
    msg = " ".join(r.stderr.split())
    assert (f"the run in {out} keeps --seed 5, --config small (it was started so; given --seed 6, --config full); "
            "drop --seed, --config or give --out a new directory") in msg, msg
    assert "other data" not in msg and len(r.stderr.strip().splitlines()) == 1
    r = _train("--dataset", "synthetic", "--out", str(out), "--config", "full")
    assert r.exit_code == 2 and "keeps --config small" in r.stderr and "--seed" not in r.stderr, r.output
    r = _train("--dataset", "sp500", "--out", str(out))
    assert r.exit_code == 2 and "keeps --dataset synthetic" in r.stderr and "given --dataset sp500" in r.stderr
    assert _tree(out) == before
    r = _train("--dataset", "Synthetic", "--out", str(out), "--seed", "5", "--config", "small", "--epochs", "2")
    assert r.exit_code == 0, r.output                                  # the same flags: resumed
    r = _train("--out", str(out), "--epochs", "3")                     # left out: the run's own
    assert r.exit_code == 0, r.output
    hist = [json.loads(x) for x in (out / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert json.loads((out / "run.json").read_text()) == meta and meta["config_preset"] == "small"


def test_a_new_train_run_needs_a_dataset(tmp_path):
    r = _train("--out", str(tmp_path / "new"))
    assert r.exit_code == 2 and f"--dataset is needed: --out {tmp_path / 'new'} holds no run" in r.stderr, r.output
    assert not (tmp_path / "new").exists()


def test_bad_options_and_an_out_that_cannot_be_written_are_one_line_errors(tmp_path, tiny_presets):
    """A negative --seed is refused as an option; an --out under a file (as an unwritable directory would) names the
    path, exit 2, no traceback."""
    r = _train("--dataset", "synthetic", "--seed", "-1", "--out", str(tmp_path / "s"))
    assert r.exit_code == 2 and "--seed" in r.output and not (tmp_path / "s").exists()
    (tmp_path / "file").write_text("x")
    r = _train("--dataset", "synthetic", "--out", str(tmp_path / "file" / "run"))
    assert r.exit_code == 2 and f"cannot write {tmp_path / 'file'}" in r.stderr, r.output
    assert isinstance(r.exception, SystemExit), r.exception           # typer.Exit(2), not the OSError


def test_a_changed_checkpoint_is_refused_on_resume_touching_nothing(tmp_path, tiny_presets):
    """A state file that does not match its sha256 sidecar was changed after it was written (no kill does that):
    the resume refuses it by name instead of training again from scratch over the run's checkpoints."""
    out = tmp_path / "run"
    r = _train("--dataset", "synthetic", "--out", str(out))
    assert r.exit_code == 0, r.output
    state = out / "checkpoints" / "epoch-0001.state.safetensors"
    raw = bytearray(state.read_bytes())
    raw[-1] ^= 0xFF
    state.write_bytes(bytes(raw))
    before = _tree(tmp_path)
    r = CliRunner().invoke(app, ["train", "--epochs", "2", "--out", str(out)])
    msg = " ".join(r.stderr.split())
    assert r.exit_code == 2 and f"checkpoint {state}: sha256 " in msg and "differs from its sidecar" in msg, r.output
    assert _tree(tmp_path) == before
