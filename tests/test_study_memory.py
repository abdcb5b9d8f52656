"""How many runs a study puts on one GPU: `--parallel auto`, the runs that fit a GPU's memory as the first run
measured it, the workers past them standing down (real worker processes), and the accel a study's runs resolve to."""
import json
import multiprocessing as mp
import os
import queue
from pathlib import Path

import pytest

from tradeloop.study.runner import prepare
from tradeloop.study.capacity import AUTO_RUNS_PER_GPU, parse_parallel, usable_cores
from tradeloop.study.spec import StudyError, StudySpec, Variant
from tradeloop.study.worker import (MEMORY_HEADROOM, RUN_MEMORY_FILE, SPREAD_S, WARM_FILE, first_fills_cache,
                                    gpu_slots, runs_that_fit, start_plan, start_workers)

GIB = 2 ** 30


def _spec(**kw) -> StudySpec:
    return StudySpec(dataset="synthetic", variants=[Variant("off", (("feedback.enabled", False),))], seeds=[0],
                     folds=1, epochs=1, **kw)


def test_runs_that_fit_one_h200_at_the_full_preset_and_never_none():
    # a `full` run held 12.9 GiB of the H200's 139.8 in the study that failed 6 of 15 runs at --parallel 15
    assert runs_that_fit(int(139.8 * GIB), int(12.9 * GIB)) == 10
    assert runs_that_fit(int(139.8 * GIB), int(12.9 * GIB)) * 12.9 <= 139.8 * MEMORY_HEADROOM
    assert runs_that_fit(100 * GIB, 10 * GIB) == 9                      # 95 of 100 GiB: nine, not ten
    assert runs_that_fit(8 * GIB, 20 * GIB) == 1                        # one run always tries
    assert runs_that_fit(8 * GIB, 0) >= 1


def test_gpu_slots_read_the_first_runs_measure(tmp_path: Path):
    assert gpu_slots(tmp_path) is None
    (tmp_path / RUN_MEMORY_FILE).parent.mkdir(parents=True)
    (tmp_path / RUN_MEMORY_FILE).write_text(json.dumps({"run_bytes": 30 * GIB, "total_bytes": 80 * GIB, "gpu": "0"}))
    fit, doc = gpu_slots(tmp_path)
    assert fit == 2 and doc["gpu"] == "0"


def test_workers_sharing_a_gpu_start_spread_apart_after_the_warm_compile_and_on_a_resume(tmp_path: Path):
    """Auto: on a cold cache the workers after the first wait for its first epoch; on each GPU its k-th worker then
    starts k × SPREAD_S later, cold or warm, so the runs' epochs (and their writes, GPU idle) are not in step. One
    worker per GPU, or the CPU, is not spread; `--stagger SECONDS` replaces all of it."""
    gpu = _spec(device="cuda")
    cold = start_plan(gpu, tmp_path, 4, ["0", "1"])
    assert [w for w, _, _ in cold] == [0.0, 600.0, 600.0, 600.0]
    assert [s for _, _, s in cold] == [0.0, 0.0, SPREAD_S, SPREAD_S] and SPREAD_S > 0
    assert [d for _, d, _ in cold] == [0.0] * 4
    (tmp_path / WARM_FILE).parent.mkdir(parents=True)
    (tmp_path / WARM_FILE).write_text("measured\n")
    warm = start_plan(gpu, tmp_path, 3, ["0"])
    assert warm == [(0.0, 0.0, 0.0), (0.0, 0.0, SPREAD_S), (0.0, 0.0, 2 * SPREAD_S)]
    assert [s for _, _, s in start_plan(gpu, tmp_path, 2, ["0", "1"])] == [0.0, 0.0]
    assert start_plan(_spec(device="cpu"), tmp_path, 2, []) == [(0.0, 0.0, 0.0)] * 2
    assert start_plan(_spec(device="cuda", stagger="2.5"), tmp_path, 3, ["0"]) == [(0.0, 0.0, 0.0), (0.0, 2.5, 0.0),
                                                                                   (0.0, 5.0, 0.0)]


def test_the_study_says_so_when_its_first_worker_runs_alone(tmp_path: Path):
    """The workers after the first wait exactly when the study says so: on a GPU or with a compiled accel, under
    `--stagger auto`, until a run of the directory has finished an epoch; the line names the GPU memory on a GPU."""
    from tradeloop.study.runner import first_alone_line

    gpu = _spec(device="cuda")
    assert first_fills_cache(gpu, tmp_path, ["0"])
    assert not first_fills_cache(_spec(device="cpu"), tmp_path, [])
    assert not first_fills_cache(_spec(device="cuda", stagger="2.5"), tmp_path, ["0"])
    assert "worker 0 starts alone" in first_alone_line(["0"]) and "GPU memory" in first_alone_line(["0"])
    assert "GPU memory" not in first_alone_line([])
    (tmp_path / WARM_FILE).parent.mkdir(parents=True)
    (tmp_path / WARM_FILE).write_text("measured\n")
    assert not first_fills_cache(gpu, tmp_path, ["0"])
    assert all(w == 0.0 for w, _, _ in start_plan(gpu, tmp_path, 3, ["0"]))


def test_parallel_auto_is_a_worker_per_core_on_a_cpu_and_a_worker_per_core_per_gpu_on_cuda(monkeypatch):
    import builtins
    import io

    real_open = builtins.open

    def meminfo(gib):
        def fake(path, *a, **k):
            if path == "/proc/meminfo":
                return io.StringIO(f"MemTotal: 99999999 kB\nMemAvailable: {gib * 1024 * 1024} kB\n")
            return real_open(path, *a, **k)
        return fake

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(builtins, "open", meminfo(64))
    assert parse_parallel("auto", "cpu") == 8 and parse_parallel(" AUTO ", "cpu") == 8   # a worker per core
    monkeypatch.setattr(builtins, "open", meminfo(3))
    assert parse_parallel("auto", "cpu") == 3                             # as many as memory holds at 1 GiB each
    monkeypatch.setattr(builtins, "open", meminfo(0))
    assert parse_parallel("auto", "cpu") == 1                             # one at least
    monkeypatch.setattr(builtins, "open", real_open)
    assert parse_parallel(6, "cuda") == 6 and parse_parallel("0", "cuda") == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(128)), raising=False)
    assert parse_parallel("auto", "cuda") == 2 * AUTO_RUNS_PER_GPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    assert parse_parallel("auto", "cuda") == 12
    monkeypatch.setattr(os, "cpu_count", lambda: 128)                    # a host of 128 cores, this process on 12
    assert parse_parallel("auto", "cuda") == 12 and usable_cores() == 12
    for bad in ("x", "-1", "1.5", True):
        with pytest.raises(StudyError, match=r"--parallel must be an integer ≥ 1 or auto"):
            parse_parallel(bad, "cuda")


def test_a_study_on_cuda_with_accel_auto_compiles():
    """auto resolves to compile+graph on CUDA: the workers then wait for the first one's compile and reset dynamo
    between runs (reading "compile" in the unresolved "auto" did neither)."""
    assert _spec(device="cuda").compiled() and not _spec(device="cpu").compiled()
    assert not _spec(device="cuda", accel="graph").compiled() and _spec(device="cpu", accel="compile").compiled()


def test_workers_past_the_runs_that_fit_a_gpu_stand_down(tmp_path: Path):
    """Three real worker processes on one GPU whose memory holds two runs: the third stands down before taking a
    run and says why; the other two take the queue's end and exit. (No CUDA is touched: the queue holds no run.)"""
    spec = _spec(device="cpu")
    out = tmp_path / "study"
    prepare(spec, out)
    (out / RUN_MEMORY_FILE).parent.mkdir(parents=True, exist_ok=True)
    (out / RUN_MEMORY_FILE).write_text(json.dumps({"run_bytes": 40 * GIB, "total_bytes": 96 * GIB, "gpu": "0"}))
    (out / WARM_FILE).write_text("measured\n")
    ctx = mp.get_context("spawn")
    tasks, events = ctx.Queue(), ctx.Queue()
    for _ in range(3):
        tasks.put(None)
    workers = start_workers(ctx, spec, out, ("local", tasks, events), 3, ["0"], 1)
    seen = []
    while sum(e["type"] == "exit" for e in seen) < 3:
        try:
            seen.append(events.get(timeout=120))
        except queue.Empty:
            pytest.fail(f"workers did not all exit; events so far: {seen}")
    for p in workers:
        p.join(timeout=30)
    down = [e for e in seen if e["type"] == "stand-down"]
    assert [(e["worker"], e["fit"], e["gpu"]) for e in down] == [(2, 2, "0")]
    assert down[0]["run_bytes"] == 40 * GIB and down[0]["total_bytes"] == 96 * GIB
    assert all(p.exitcode == 0 for p in workers)


class _Events:
    def __init__(self):
        self.seen = []

    def emit(self, ev: dict) -> None:
        self.seen.append(ev)


def test_a_run_out_of_gpu_memory_waits_for_a_runs_memory_and_resumes_then_says_what_to_do(tmp_path, monkeypatch):
    import torch

    import tradeloop.study.worker as w

    spec = _spec(device="cpu")
    (tmp_path / RUN_MEMORY_FILE).parent.mkdir(parents=True)
    (tmp_path / RUN_MEMORY_FILE).write_text(json.dumps({"run_bytes": 10 * GIB, "total_bytes": 80 * GIB, "gpu": "0"}))
    free = iter([2 * GIB, 5 * GIB, 11 * GIB] * 10)
    outcomes = iter(["oom", "oom", "ok"])

    def execute_run(*a, **kw):
        if next(outcomes) == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1024.00 MiB.")
        return {"run_id": "off-s0-f0"}

    polls = []
    monkeypatch.setattr(w, "execute_run", execute_run)
    monkeypatch.setattr(w.time, "sleep", lambda s: polls.append(s))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(free), 80 * GIB))
    ev = _Events()
    rs = spec.runs()[0]
    assert w.run_with_memory_retries(spec, tmp_path, rs, None, None, ev, 3, "0") == {"run_id": "off-s0-f0"}
    waits = [e for e in ev.seen if e["type"] == "memory-wait"]
    assert len(waits) == 2 and all(e["need_bytes"] == 10 * GIB and e["worker"] == 3 for e in waits)
    assert len(polls) >= 2                       # it waited while less than a run's memory was free

    outcomes = iter(["oom"] * (w.OOM_RETRIES + 1))
    with pytest.raises(StudyError, match=r"CUDA out of memory on GPU 0 4 times .*Tried to allocate 1024.00 MiB"
                                         r".*run the same command again to resume the run, with a smaller --parallel"):
        w.run_with_memory_retries(spec, tmp_path, rs, None, None, _Events(), 0, "0")


def test_a_lockstep_run_out_of_gpu_memory_fails_saying_what_to_do(tmp_path, monkeypatch):
    """A member of a lockstep group does not wait and retry (its group would go on without it): its error says to run
    the command again with a smaller --lockstep or --parallel."""
    import torch

    import tradeloop.study.worker as w

    def execute_run(*a, **kw):
        assert kw["train_fn"] is not None
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(w, "execute_run", execute_run)
    ev = _Events()
    ev.failed = ev.done = lambda *a: None
    spec = _spec(device="cpu")
    w.run_task(spec, tmp_path, spec.runs()[0].run_id, None, ev, 1, "0", train_fn=lambda *a: None)
    err = next(e for e in ev.seen if e["type"] == "error")["error"]
    assert "CUDA out of memory on GPU 0 in a lockstep group (CUDA out of memory. Tried to allocate 2.00 GiB.)" in err
    assert "with a smaller --lockstep or --parallel" in err and not [e for e in ev.seen if e["type"] == "memory-wait"]


def test_workers_compile_into_the_users_compile_cache_unless_told_otherwise(tmp_path: Path, monkeypatch):
    """A study's workers use the compile cache of every run of the user's (`compile_cache_dir`), not one of the
    study's own, so a second study of a compiled configuration loads its kernels; a cache the user set is kept."""
    from tradeloop.study.worker import worker_env

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env = worker_env(tmp_path / "study", "0", deterministic=False)
    want = tmp_path / "xdg" / "tradeloop" / "inductor"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(want) and env["TRITON_CACHE_DIR"] == str(want / "triton")
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "CUBLAS_WORKSPACE_CONFIG" not in env
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert worker_env(tmp_path / "study", None, deterministic=True)["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")


def test_a_study_resumes_with_a_default_spelled_out_as_it_was_and_refuses_another_value(tmp_path: Path):
    """A study file that pins a setting at the default its study started under (`schedule.gamma` at the fixed
    schedule's γ) resumes that study: every variant resolves as it did; pinned at another value, or with another
    setting that changes a variant, it is another study, refused naming what differs."""
    from shared.knobs import FixedSchedule

    out = tmp_path / "study"
    prepare(_spec(device="cpu"), out)
    gamma = FixedSchedule().gamma
    prepare(_spec(device="cpu", settings=[("schedule.gamma", gamma)]), out)                # the same study
    for other in ([("schedule.gamma", 0.5 * gamma)], [("train.iterations", 7)]):
        with pytest.raises(StudyError, match=r"holds another study \(it differs in settings\)"):
            prepare(_spec(device="cpu", settings=other), out)
