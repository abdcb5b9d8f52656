"""`tradeloop up`'s options and what it reports: a `--summary FILE` that cannot be written is refused before anything
starts, and the run's own summary is written before the copy, so a copy that fails at the end loses nothing; a
resume's --epochs may not go below the epochs trained; a service ended by the launcher's SIGTERM is said to be
stopped, not to have failed."""
import json

from typer.testing import CliRunner

from tradeloop.cli import app
from tradeloop.up.launch import write_summary


def test_a_summary_path_that_cannot_be_a_file_is_refused_before_the_run_starts(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    a_file = tmp_path / "bars.csv"
    a_file.write_text("x\n")
    for given, message in [(tmp_path, "is a directory; give the path of a file"),
                           (a_file / "s.json", f"{a_file} is a file, not a folder"),
                           (a_file / "deeper" / "s.json", f"{a_file} is a file, not a folder")]:
        r = CliRunner().invoke(app, ["up", "--epochs", "1", "--run-dir", str(runs), "--summary", str(given),
                                     "--no-dashboard"])
        assert r.exit_code == 2 and f"--summary {given}: {message}" in r.stderr, r.output
        assert "Traceback" not in r.output
    assert not any(runs.iterdir())                      # nothing started, no run directory left


def test_the_runs_summary_is_written_when_the_copy_cannot_be(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    head = {"run_id": "r", "status": "completed"}
    best, unwritten = write_summary(head, "unix:///nonexistent/redis.sock", run, blocker / "s.json")
    assert best is None and unwritten                   # the reason, not a traceback
    doc = json.loads((run / "summary.json").read_text())
    assert doc["run_id"] == "r" and doc["epochs_completed"] == 0 and "error" in doc
    best, unwritten = write_summary(head, "unix:///nonexistent/redis.sock", run, tmp_path / "new" / "s.json")
    assert unwritten is None and json.loads((tmp_path / "new" / "s.json").read_text())["run_id"] == "r"


def test_a_service_ended_by_the_launchers_sigterm_is_said_to_be_stopped_not_to_have_failed():
    import subprocess
    import sys

    from tradeloop.up.supervisor import Supervisor

    class Child:                                        # a real process in the supervisor's view of a service
        def __init__(self, name: str, code: str):
            self.name = self.service = name
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)

        @property
        def alive(self) -> bool:
            return self.proc.poll() is None

    plain = Child("feedback", "import signal; print('up', flush=True); signal.pause()")
    handled = Child("evaluator", "import signal, sys\n"
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); print('up', flush=True); signal.pause()")
    failing = Child("dashboard", "import signal, sys\n"
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); print('up', flush=True); signal.pause()")
    for c in (plain, handled, failing):                 # each has installed its handler
        assert c.proc.stdout.readline().strip() == b"up"
    ended = Supervisor([plain, handled, failing]).stop_all(grace_s=30)
    assert ended == {"feedback": "stopped by SIGTERM", "evaluator": "exited 0", "dashboard": "exited 3"}


def test_a_resume_may_not_lower_epochs_below_those_trained(tmp_path):
    from services.trainer.rundir import append_history
    from shared.runfiles import TRAINER_DIR
    from tradeloop.up.runs import DEFAULTS, claim_run, write_run_file

    runs = tmp_path / "runs"
    run_id, path, lock = claim_run("r1", runs / "r1", generated=False)
    try:
        write_run_file(path, run_id, {**DEFAULTS, "epochs": 3}, resuming=False)
        (path / TRAINER_DIR).mkdir()
        for e in (1, 2, 3):
            append_history(path / TRAINER_DIR, {"epoch": e})
    finally:
        lock.release()
    before = sorted((p, p.stat().st_mtime_ns) for p in path.rglob("*"))
    r = CliRunner().invoke(app, ["up", "--resume", "r1", "--run-dir", str(runs), "--epochs", "2", "--no-dashboard"])
    assert r.exit_code == 2, r.output
    assert "--epochs 2: the run has trained 3 epochs; a resume's --epochs may raise its target" in r.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in path.rglob("*")) == before      # nothing touched


def test_a_dataset_file_too_short_for_a_run_is_refused_before_anything_starts(tmp_path):
    """100 bars trained a run on 12-bar validation and test windows of one trade each; `--data-bars` below the same
    minimum was already refused."""
    import pandas as pd

    from tradeloop.cmd_up import MIN_DATA_BARS

    runs = tmp_path / "runs"
    runs.mkdir()
    short = tmp_path / "short.csv"
    t = pd.date_range("2024-01-01", periods=100, freq="h")
    pd.DataFrame({"timestamp": t, "open": 100.0, "high": 101.0, "low": 99.0, "close": 100.5,
                  "volume": 1.0}).to_csv(short, index=False)
    r = CliRunner().invoke(app, ["up", "--epochs", "1", "--run-dir", str(runs), "--dataset", str(short),
                                 "--no-dashboard"])
    assert r.exit_code == 2 and f"--dataset {short}: 100 bars, fewer than the {MIN_DATA_BARS} a run needs" in r.stderr, \
        r.output
    assert "Traceback" not in r.output and not any(runs.iterdir())


def test_a_run_directory_that_is_a_file_or_cannot_be_made_is_named_as_such(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("")
    for given, words in [(a_file, f"the run directory {a_file} (--run-dir, TL_RUN_DIR) is a file, not a folder"),
                         (a_file / "below", f"the run directory {a_file / 'below'} (--run-dir, TL_RUN_DIR) cannot be "
                                            "made: ")]:
        r = CliRunner().invoke(app, ["up", "--epochs", "1", "--run-dir", str(given), "--no-dashboard",
                                     "--free-ports"])
        assert r.exit_code == 2 and words in r.stderr, r.output
        assert "Errno" not in r.stderr and "Traceback" not in r.output
