"""`tradeloop study-worker`: a host's worker processes take a study's runs from its Redis (`work_for`), once this
host's code and configs are those of the study process (`check_same_code`); a worker process that ended otherwise
than by finishing (killed, out of memory) is named and the command fails (`WorkersDied`).
"""
from __future__ import annotations

import signal
from pathlib import Path

from tradeloop.study.capacity import parse_parallel, usable_cores
from tradeloop.study.guard import code_fingerprint, describe
from tradeloop.study.interrupt import sigterm_interrupts
from tradeloop.study.runner import done_runs, prepare, share_gpus, stop_workers
from tradeloop.study.spec import StudyError, StudyInterrupted, StudySpec
from tradeloop.study.worker import start_workers, visible_gpus


class WorkersDied(StudyError):
    """Worker processes of this host ended with a non-zero exit code."""


def check_same_code(sid: str, doc: dict, spec: StudySpec) -> None:
    """StudyError, one line, where this host would run the study's runs otherwise than the study process: its
    variants resolve to other configs here, or its code differs (`guard.code_fingerprint`: the package version and
    the sources)."""
    if doc.get("resolved") not in (None, spec.resolved()):
        raise StudyError(f"study {sid}: its variants resolve to other trainer or feedback configs with this host's "
                         "tradeloop than with the one that started it; run the same tradeloop on every host")
    mine, theirs = code_fingerprint(), doc.get("code")
    if theirs != mine:
        raise StudyError(f"study {sid}: this host runs other code ({describe(mine)}) than the study process "
                         f"({describe(theirs)}); run the same tradeloop on every host")


def exit_reason(code: int) -> str:
    """A worker process's exit code in words: "killed by SIGKILL (out of memory?)", "killed by SIGSEGV", "exit code
    3"."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exit code {code}"


def check_exits(workers: list, console) -> None:
    """After the worker processes have been joined: one line per worker that ended with a non-zero exit code, then
    WorkersDied."""
    dead = [(i, p) for i, p in enumerate(workers) if p.exitcode not in (0, None)]
    for i, p in dead:
        console.print(f"worker {i} (pid {p.pid}) {exit_reason(p.exitcode)}", markup=False, highlight=False)
    if dead:
        from tradeloop.study.remote import CLAIM_IDLE_S

        raise WorkersDied(f"{len(dead)} of {len(workers)} worker process(es) of this host died; the run each held "
                          f"goes back to the study {CLAIM_IDLE_S:.0f} s after its last heartbeat (this command run "
                          "again resumes it from its last epoch on this disk)")


def work_for(url: str, sid: str, out: Path, parallel: int | str, threads: int | None, console) -> int:
    """`tradeloop study-worker`: P worker processes on this host take the study's runs from Redis until every run
    is accounted for (`parallel`: P or auto, `parse_parallel` for the study's device); returns how many runs this
    host did. The workers get the Redis URL through their environment. WorkersDied when any of them died."""
    import multiprocessing as mp

    from tradeloop.study.remote import CLAIM_IDLE_S, accounted, client, fetch_spec, url_in_env

    doc = fetch_spec(url, sid)
    spec = StudySpec.from_dict(doc["spec"])
    parallel = parse_parallel(parallel, spec.device)
    check_same_code(sid, doc, spec)
    out = Path(out)
    prepare(spec, out)
    n_runs = len(spec.runs())
    gpus = visible_gpus() if spec.device != "cpu" else []
    if spec.device != "cpu" and not gpus:
        raise StudyError("the study runs on cuda but no CUDA device is visible here")
    threads = threads or spec.threads or max(1, usable_cores() // parallel)
    before = done_runs(spec, out)
    console.print(f"study {sid}: {n_runs} runs of {spec.epochs} epochs; {parallel} worker(s) here in {out}",
                  markup=False, highlight=False)
    daemon, worker_gpus, extra_env = share_gpus(spec, parallel, gpus, console)
    workers: list = []
    with sigterm_interrupts() as term:
        try:
            with url_in_env(url):
                workers = start_workers(mp.get_context("spawn"), spec, out, ("redis", sid, n_runs), parallel,
                                        worker_gpus, threads, extra_env)
            for p in workers:
                p.join()
        except KeyboardInterrupt as exc:
            term.stopping()
            how = stop_workers(workers, stopped_by=exc)
            raise StudyInterrupted(f"{how}: the runs this host held go back to the study {CLAIM_IDLE_S:.0f} s "
                                   "after their last heartbeat, for any worker to take (this command run again "
                                   "resumes them from their last epoch on this disk)") from None
        finally:
            if daemon is not None:
                with term.held():
                    daemon.stop()
    ok, bad = accounted(client(url), sid)
    mine = done_runs(spec, out) - before
    console.print(f"done here: {len(mine)} run(s); the study: {len(ok)} of {n_runs} runs done, {len(bad)} failed",
                  markup=False, highlight=False)
    check_exits(workers, console)
    return len(mine)
