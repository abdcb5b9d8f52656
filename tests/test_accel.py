"""How the training step runs by default (`--accel`, `TL_ACCEL`): "auto" resolves by device (compile+graph on CUDA,
eager on a CPU), the setting reaches the trainer service's state, a first compiled call is announced as a phase, and
torch.compile's caches persist in the user's cache directory across processes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import get_args

import pytest
import torch

from shared.config import AccelMode, ConfigError, TrainerSettings, check_accel, load_settings
from shared.graphs import ACCEL_MODES, compile_cache_dir, resolve_accel

ROOT = Path(__file__).resolve().parents[1]


def test_auto_is_compile_and_graph_on_cuda_and_eager_on_a_cpu():
    assert resolve_accel("auto", torch.device("cuda")) == "compile+graph"
    assert resolve_accel("auto", "cuda:1") == "compile+graph"
    assert resolve_accel("auto", torch.device("cpu")) == "eager"
    assert resolve_accel("compile", "cpu") == "compile"
    assert resolve_accel("graph", "cuda") == "graph"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_accel("compile+graph", "cpu")


def test_the_steps_precision_is_bf16_autocast_on_cuda_with_the_presets_bf16_and_none_elsewhere():
    from services.trainer.runtime import in_precision
    from services.trainer.train import TrainConfig

    def step():
        return torch.get_autocast_dtype("cuda")

    full, small = TrainConfig.preset("full", 8), TrainConfig.preset("small", 8)
    assert full.bf16 and not small.bf16
    assert in_precision(step, full, "cpu") is step and in_precision(step, small, "cuda") is step
    wrapped = in_precision(step, full, torch.device("cuda:0"))
    assert wrapped is not step
    if torch.cuda.is_available():
        assert wrapped() == torch.bfloat16


def test_the_settings_and_the_options_know_the_same_modes():
    assert set(get_args(AccelMode)) == {"auto", *ACCEL_MODES}
    check_accel("compile+graph", "cuda")
    check_accel("auto", "cpu")
    with pytest.raises(ValueError, match="--accel must be one of"):
        check_accel("fast", "cuda")
    with pytest.raises(ValueError, match="--accel=graph captures CUDA graphs but --device is cpu"):
        check_accel("graph", "cpu")


def test_tl_accel_is_read_and_a_graph_mode_on_a_cpu_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("TL_ACCEL", raising=False)
    monkeypatch.setenv("TL_DEVICE", "cpu")
    assert load_settings(TrainerSettings).accel == "auto"
    monkeypatch.setenv("TL_ACCEL", "compile")
    assert load_settings(TrainerSettings).accel == "compile"
    monkeypatch.setenv("TL_ACCEL", "graph")
    with pytest.raises(ConfigError, match="TL_ACCEL=graph captures CUDA graphs but TL_DEVICE is cpu"):
        load_settings(TrainerSettings)
    monkeypatch.setenv("TL_ACCEL", "turbo")
    with pytest.raises(ConfigError, match="TL_ACCEL"):
        load_settings(TrainerSettings)


@pytest.mark.redis
@pytest.mark.parametrize("accel, want", [(None, "eager"), ("compile", "compile")])
def test_the_trainer_service_builds_its_state_with_tl_accel(monkeypatch, tmp_path, redis_url, run_id, accel, want):
    """The trainer service's settings from the environment → `TrainerWorker._build` → the `StepRunner`'s mode, with
    the worker's phase hook installed, and TL_COMPILE_CACHE_DIR as torch.compile's cache (nothing is compiled here:
    building a state does not call a step)."""
    from services.trainer.worker import TrainerServiceSettings, TrainerWorker
    from shared.api import ServiceState
    from shared.bus import Bus

    env = {"TL_RUN_DIR": str(tmp_path), "TL_RUN_ID": run_id, "TL_REDIS_URL": redis_url, "TL_DEVICE": "cpu",
           "TL_DATA_BARS": "800", "TL_TRAIN_N_ENVS": "4", "TL_TRAIN_BATCH_SIZE": "16"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))     # restored after the test
    if accel is None:
        monkeypatch.delenv("TL_ACCEL", raising=False)
        monkeypatch.delenv("TL_COMPILE_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TL_ACCEL", accel)
        monkeypatch.setenv("TL_COMPILE_CACHE_DIR", str(tmp_path / "cc"))
    settings = load_settings(TrainerServiceSettings)
    state = ServiceState("trainer", run_id)
    worker = TrainerWorker(settings, Bus(redis_url, run_id), state)
    tstate, _, _ = worker._build()
    assert tstate.accel == tstate.runner.accel == want
    assert tstate.runner.on_compile == worker._compiling
    assert compile_cache_dir() == (tmp_path / ("theirs" if accel is None else "cc")).resolve()
    worker.set_phase("training")
    worker._compiling("compiling the collect step")
    assert state.extra["phase"] == "compiling" and state.extra["compiling"] == "compiling the collect step"
    assert worker.phase == "training"          # an epoch is in hand (what a stop waits for)
    worker._compiling(None)
    assert state.extra["phase"] == "training" and state.extra["compiling"] is None


def test_a_first_compiled_call_is_announced_and_timed_once():
    """`StepRunner._run` in a compiled mode: the first call of each step tells `on_compile` what it compiles and when
    it is done, and counts into `compile_s`; later calls do neither (the step bodies are replaced by counters: the
    bookkeeping is what is checked, not the compiler)."""
    import time

    from services.trainer.train import StepRunner

    runner = StepRunner.__new__(StepRunner)
    calls: list[str] = []
    runner._bodies = {"collect": lambda: (calls.append("collect"), time.sleep(0.05)),
                      "update": lambda: calls.append("update")}
    runner.accel, runner._graphs, runner._ran, runner.compile_s = "compile", {}, set(), 0.0
    runner.state = type("S", (), {"device": torch.device("cpu")})()
    seen: list[str | None] = []
    runner.on_compile = seen.append
    runner._run("collect")
    runner._run("collect")
    runner._run("update")
    assert calls == ["collect", "collect", "update"]
    assert seen == ["compiling the collect step", None, "compiling the update step", None]
    assert 0.05 <= runner.compile_s < 5


def test_compiled_kernels_persist_in_the_users_cache_directory(tmp_path):
    """A fresh process: `compile_step` (what every compiled training step goes through) compiles into
    $XDG_CACHE_HOME/tradeloop/inductor, not torch's /tmp default, even though importing the trainer has already set
    torch's default; after the in-process caches are dropped, the same graph comes from the disk cache."""
    code = textwrap.dedent("""
        import json, os, torch
        from services.trainer.train import TrainConfig, compile_step
        from torch._dynamo.utils import counters
        fn = lambda x: torch.tanh(x) * 2 + 1
        out = [float(compile_step(fn, TrainConfig(), "cpu")(torch.ones(8))[0])]
        first = dict(counters["inductor"])
        torch._dynamo.reset()
        from torch._inductor.utils import clear_caches
        clear_caches()
        out.append(float(compile_step(fn, TrainConfig(), "cpu")(torch.ones(8))[0]))
        print(json.dumps({"first": first, "second": dict(counters["inductor"]), "out": out,
                          "dir": os.environ["TORCHINDUCTOR_CACHE_DIR"]}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    cache = tmp_path / "xdg" / "tradeloop" / "inductor"
    assert Path(doc["dir"]) == cache.resolve()
    assert doc["first"].get("fxgraph_cache_miss") == 1 and not doc["first"].get("fxgraph_cache_hit")
    assert doc["second"].get("fxgraph_cache_hit") == 1
    assert doc["out"][0] == doc["out"][1] == pytest.approx(2 * float(torch.tanh(torch.tensor(1.0))) + 1)
    assert (cache / "fxgraph").is_dir()


def test_a_cache_directory_the_user_names_is_kept(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compile_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_dir() == tmp_path / "xdg" / "tradeloop" / "inductor"


def test_up_and_train_refuse_a_graph_mode_on_a_cpu_before_starting(tmp_path):
    from typer.testing import CliRunner

    from tradeloop.cli import app

    r = CliRunner().invoke(app, ["up", "--accel", "graph", "--device", "cpu", "--run-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--accel=graph captures CUDA graphs but --device is cpu" in r.stderr, r.output
    r = CliRunner().invoke(app, ["up", "--accel", "fastest", "--run-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--accel must be one of auto, eager, compile, graph, compile+graph" in r.stderr
    assert not any(tmp_path.iterdir())                  # nothing started, no run directory left
    r = CliRunner().invoke(app, ["train", "--dataset", "synthetic", "--epochs", "1", "--out", str(tmp_path / "t"),
                                 "--accel", "compile+graph"])
    assert r.exit_code == 2 and "needs a CUDA device" in r.stderr and not (tmp_path / "t").exists()
