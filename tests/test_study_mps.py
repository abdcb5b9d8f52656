"""The study's CUDA MPS daemon (`tradeloop.study.mps`): when it is wanted, how it fails without harm, and the
option's checks. Starting a real daemon needs an NVIDIA GPU (bench/study_speed.py measures it on one)."""
import os
from pathlib import Path

import pytest

from tradeloop.cmd_study import build_spec
from tradeloop.study import mps
from tradeloop.study.report import compile_times, fmt_timing, part_medians
from tradeloop.study.spec import StudyError


@pytest.mark.parametrize("mode,device,workers,gpus,want", [
    ("auto", "cuda", 10, 1, True),      # several workers on one GPU: their kernels should overlap
    ("auto", "cuda", 2, 2, False),      # one worker a GPU: nothing to share
    ("auto", "cuda", 3, 2, True),
    ("auto", "cpu", 10, 0, False),
    ("on", "cuda", 1, 1, True),
    ("on", "cpu", 4, 0, False),         # no GPU, no MPS, whatever was asked
    ("off", "cuda", 10, 1, False),
    ("auto", "cuda", 4, 0, False),
])
def test_mps_is_wanted_when_workers_share_a_gpu(mode, device, workers, gpus, want):
    assert mps.wanted(mode, device, workers, gpus) is want


def test_a_daemon_that_is_not_installed_does_not_start_and_says_why():
    d = mps.MpsDaemon()
    d.exe = None
    assert d.start() is False and "nvidia-cuda-mps-control is not installed" in d.why_not and d.root is None


def test_a_daemon_that_fails_to_start_leaves_nothing_behind(tmp_path: Path):
    fake = tmp_path / "mps-control"
    fake.write_text("#!/bin/sh\necho 'cannot start: no device' >&2\nexit 3\n")
    fake.chmod(0o755)
    d = mps.MpsDaemon(exe=str(fake))
    assert d.start() is False
    assert "exited 3" in d.why_not and "cannot start: no device" in d.why_not
    assert d.root is None


def test_a_daemon_whose_clients_cannot_run_is_quit(tmp_path: Path):
    """The daemon starts, but a CUDA client cannot run under it (here: no CUDA at all): start() is False, the
    daemon is told to quit and its directories are removed."""
    log = tmp_path / "calls"
    fake = tmp_path / "mps-control"
    fake.write_text(f"#!/bin/sh\necho \"$@ $(cat)\" >> {log}\necho \"pipe=$CUDA_MPS_PIPE_DIRECTORY\" >> {log}\n")
    fake.chmod(0o755)
    d = mps.MpsDaemon(exe=str(fake))
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA client runs here")
    assert d.start() is False and "could not run under the MPS daemon" in d.why_not
    calls = log.read_text().splitlines()
    assert calls[0].startswith("-d") and calls[2].strip() == "quit"
    pipe = calls[1].split("=", 1)[1]
    assert len(pipe) < 100 and not os.path.exists(pipe)     # a socket path that fits, removed after


def test_client_gpus_count_among_the_daemons_devices():
    assert mps.client_gpus(["2", "3"]) == ["0", "1"] and mps.client_gpus(["GPU-ab"]) == ["0"]


def test_the_mps_option_is_checked_and_not_part_of_the_studys_identity(tmp_path: Path):
    base = {"dataset": "synthetic", "epochs": 1, "out": tmp_path / "o", "folds": 1}
    with pytest.raises(StudyError, match=r"--mps must be auto, on or off, got 'sometimes'"):
        build_spec({**base, "mps": "sometimes"})
    a, _ = build_spec({**base, "mps": "off"})
    b, _ = build_spec(base)
    assert b.mps == "auto" and a.identity() == b.identity()


def test_the_sm_share_reaches_the_workers_alone_and_is_checked(tmp_path: Path):
    """`--mps-share PCT`: the workers' environment holds CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (none at 100), the
    daemon's own does not, a share outside 1–100 is refused naming the option, and it is not part of the identity."""
    d = mps.MpsDaemon(exe="unused")
    d.root = tmp_path
    assert d.client_env(30) == {**d.env(), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"} and d.client_env(100) == d.env()
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in d.env()
    base = {"dataset": "synthetic", "epochs": 1, "out": tmp_path / "o", "folds": 1}
    for bad in (0, 101):
        with pytest.raises(StudyError, match=rf"--mps-share must be a percentage of the SMs from 1 to 100, got {bad}"):
            build_spec({**base, "mps_share": bad})
    a, _ = build_spec({**base, "mps_share": 30})
    b, _ = build_spec(base)
    assert (a.mps_share, b.mps_share) == (30, 100) and a.identity() == b.identity()


def test_the_timing_line_says_when_runs_shared_the_gpu_through_mps():
    t = {"wall_s": 300.0, "runs_at_once": 10, "epochs_trained": 120, "epochs_per_s": 0.4, "gpu_busy_pct": {}}
    assert "10 runs at once (sharing the GPU through CUDA MPS), 120 epochs" in fmt_timing({**t, "mps": True})
    assert "10 runs at once, 120 epochs" in fmt_timing({**t, "mps": False})
    assert "(sharing the GPU through CUDA MPS, each run's kernels held to 30 % of the SMs)" in fmt_timing(
        {**t, "mps": True, "mps_share": 30})


def test_a_daemon_an_earlier_start_left_is_quit_and_its_directory_removed(tmp_path: Path):
    log = tmp_path / "calls"
    fake = tmp_path / "mps-control"
    fake.write_text(f"#!/bin/sh\necho \"$(cat) $CUDA_MPS_PIPE_DIRECTORY\" >> {log}\n")
    fake.chmod(0o755)
    root = tmp_path / "tl-mps-x1"
    (root / "pipe").mkdir(parents=True)
    assert mps.quit_stale(str(root), exe=str(fake)) is True
    assert log.read_text().split() == ["quit", str(root / "pipe")] and not root.exists()
    assert mps.quit_stale(str(root), exe=str(fake)) is False             # gone: nothing to quit
    assert mps.quit_stale(None) is False
    other = tmp_path / "not-ours"
    (other / "pipe").mkdir(parents=True)
    assert mps.quit_stale(str(other), exe=str(fake)) is False and other.exists()   # only a study's own directory


def test_the_timing_line_says_what_compiling_took():
    runs = [{"epochs": [{"compile_s": c}, {"compile_s": 0.0}]} for c in (88.0, 12.0, 14.0, 13.0)]
    t = {"wall_s": 493.0, "runs_at_once": 10, "epochs_trained": 240, "epochs_per_s": 0.49, "gpu_busy_pct": {},
         **compile_times(runs)}
    assert (t["compile_max_s"], t["compile_median_s"]) == (88.0, 13.0)
    assert "compiling and capturing the step: 88 s in the run that took longest" in fmt_timing(t)
    assert ", 13 s in each other (median)" in fmt_timing(t)
    assert compile_times([{"epochs": [{"train_s": 1.0}]}]) == {}          # summaries without the field
    assert "compiling" not in fmt_timing({**t, "compile_max_s": None})


def test_the_timing_line_gives_an_epochs_parts_after_each_runs_first():
    """`part_medians`: the median of each part over the epochs after each run's first (the first compiles), a
    rollback's restore over the epochs that began from one; the timing line names them, and says nothing of parts
    that older summaries lack."""
    def epoch(train, rollback=None):
        return {"rollback_s": rollback, "setup_s": 0.25, "train_s": train, "eval_s": 0.5, "save_s": 0.75}
    runs = [[epoch(90.0), epoch(1.0), epoch(3.0, rollback=0.5)],
            [epoch(20.0), epoch(2.0), epoch(2.0), epoch(4.0, rollback=0.75)]]
    p = part_medians(runs)
    assert p == {"rollback": 0.75, "setup": 0.25, "train": 2.0, "eval": 0.5, "save": 0.75, "rollbacks": 2}
    line = fmt_timing({"wall_s": 10.0, "runs_at_once": 2, "epochs_trained": 7, "epochs_per_s": 0.7,
                       "gpu_busy_pct": {}, "epoch_parts_s": p})
    assert ("an epoch's parts (median after each run's first epoch): set-up 0.25 s, training 2.00 s, evaluation "
            "0.50 s, writing 0.75 s, restoring a rollback's learner 0.75 s (2 epochs began from one)") in line
    one = fmt_timing({"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 3, "epochs_per_s": 0.3,
                      "gpu_busy_pct": {}, "epoch_parts_s": part_medians(runs[:1])})
    assert "restoring a rollback's learner 0.50 s (1 epoch began from one)" in one
    old = part_medians([[{"train_s": 5.0, "eval_s": 1.0}, {"train_s": 1.0, "eval_s": 0.5}]])
    assert old["setup"] is None and old["rollback"] is None and old["rollbacks"] == 0
    assert fmt_timing({"wall_s": 1.0, "runs_at_once": 1, "epochs_trained": 2, "epochs_per_s": 2.0,
                       "epoch_parts_s": old}).endswith("training 1.00 s, evaluation 0.50 s")


def test_the_workers_are_joined_against_one_deadline_not_a_wait_each():
    """`runner.join_workers`: workers whose teardown hangs cost the timeout once, not once each (before the MPS
    daemon quits, a study of sixteen workers could wait 60 s a worker). Pure logic: a clock the joins advance."""
    from tradeloop.study.runner import join_workers
    clock = [0.0]

    class Worker:
        def __init__(self, hangs: bool):
            self.hangs, self.waited = hangs, None

        def join(self, timeout=None):
            self.waited = timeout
            clock[0] += timeout if self.hangs else min(timeout, 0.5)

        def is_alive(self):
            return self.hangs

    workers = [Worker(True), Worker(False), Worker(True), Worker(True)]
    assert join_workers(workers, 60.0, clock=lambda: clock[0]) == [workers[0], workers[2], workers[3]]
    assert clock[0] == 60.0 and workers[0].waited == 60.0 and all(w.waited == 0.0 for w in workers[1:])
    clock[0] = 0.0
    quick = [Worker(False) for _ in range(4)]
    assert join_workers(quick, 60.0, clock=lambda: clock[0]) == [] and clock[0] == 2.0
    assert [w.waited for w in quick] == [60.0, 59.5, 59.0, 58.5]
