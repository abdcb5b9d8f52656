"""A study worker that gets SIGTERM (the study stopping it, or `timeout` signalling the study's whole group) ends as
multiprocessing ends a child that returns: its finalizers run, and nothing it held is left to the resource tracker —
torch.compile's compile pool holds semaphores, and a worker ended where it stood left them, with the tracker's
"leaked semaphore" warning under the study's last line (`tradeloop.study.worker.exit_on_sigterm`)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import multiprocessing as mp
import signal
import sys

from tradeloop.study.worker import exit_on_sigterm


class Busy:
    def __init__(self, ready):
        self.ready = ready

    def __del__(self):                         # where the signal lands: a finalizer, which prints and swallows
        self.ready.set()                       # whatever is raised in it
        while True:
            pass


def worker(ready, handler, busy):
    if handler:
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    held = mp.get_context("spawn").Queue()     # semaphores of the worker's own, as a compile pool's queues hold
    if busy:
        Busy(ready)
    ready.set()
    signal.pause()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=worker, args=(ready, sys.argv[1] == "handler", sys.argv[2] == "busy"))
    p.start()
    assert ready.wait(60)
    p.terminate()                              # as `stop_workers` does
    p.join(15)
    if p.is_alive():
        p.kill()
    print(p.exitcode, flush=True)
"""


def _run(tmp_path: Path, how: str, doing: str = "waiting") -> subprocess.CompletedProcess:
    script = tmp_path / "worker_exit.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), how, doing], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_a_worker_stopped_by_sigterm_runs_its_finalizers_and_leaks_no_semaphore(tmp_path):
    p = _run(tmp_path, "handler")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["143"], p.stdout           # 128 + SIGTERM, not killed by the signal
    assert "leaked semaphore" not in p.stderr, p.stderr[-2000:]


def test_a_worker_signalled_inside_a_finalizer_exits_all_the_same(tmp_path):
    """A worker spends its time in `__del__` methods when the signal comes (redis-py's parser has one): the exit is
    not an exception that a finalizer would print and swallow, leaving the worker to train on."""
    p = _run(tmp_path, "handler", "busy")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["143"], (p.stdout, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "leaked semaphore" not in p.stderr, p.stderr[-2000:]


def test_without_it_the_signal_ends_the_worker_where_it_stands_and_its_semaphores_leak(tmp_path):
    """The same process with the default SIGTERM: what the test above rules out does happen here."""
    p = _run(tmp_path, "default")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["-15"] and "leaked semaphore" in p.stderr, (p.stdout, p.stderr[-2000:])
