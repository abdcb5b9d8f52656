"""Running a study: P worker processes take runs from a queue; the study process shows progress, keeps `status.json`
and, when every run is done, the statistics and the report.

Layout of the out directory:
    study.json                 what the study is (a resume must ask for the same)
    study.lock                 flock'ed by the study process while it lives (`guard.lock_study`: one at a time)
    runs/<variant>-s<S>-f<K>/  one run: train_run's run.json, history.jsonl, checkpoints/; the loop's loop/epoch-N.json;
                               summary.json, written atomically when the run is done (the done marker); .lock;
                               attempts.jsonl (a line per start, with the epoch it started from)
    baselines.json             random, flat, buy-and-hold (and the oracle on synthetic) on every (seed, fold)
    status.json                progress, rewritten atomically (state, runs done/running/failed, epochs/s, ETA)
    events.jsonl               one line per run finished (and per run failed, worker stood down, lockstep group
                               ended) as the study process saw it
    results.json, report.md, report.png

The workers (`multiprocessing`, spawn; `tradeloop.study.worker`) run the runs; a done run (summary.json) is never
run again. With `--redis` the runs go through a Redis stream instead of the local queue (`tradeloop.study.remote`),
and `tradeloop study-worker` processes on other hosts take them too (`tradeloop.study.host`).
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from redis.exceptions import RedisError

from tradeloop.study.interrupt import sigterm_interrupts, stopped_how
from tradeloop.study.loop import write_json_atomic
from tradeloop.study.report import BackgroundBaselines, write_results
from tradeloop.study.capacity import usable_cores
from tradeloop.study.guard import LOCK_FILE, lock_study
from tradeloop.study.spec import StudyError, StudyInterrupted, StudySpec
from tradeloop.study.worker import WARM_FILE, first_fills_cache, start_workers, visible_gpus


class GpuSampler:
    """Samples each GPU's utilisation (`nvidia-smi`, every `period` s) in a thread: the mean busy % per GPU."""

    def __init__(self, gpus: list[str], period: float = 2.0):
        self.gpus, self.period, self.samples = gpus, period, {g: [] for g in gpus}
        self._stop = threading.Event()
        self.exe = shutil.which("nvidia-smi")
        self._t = threading.Thread(target=self._run, daemon=True)
        if self.exe and gpus:
            self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                out = subprocess.run([self.exe, "--query-gpu=index,uuid,utilization.gpu",
                                      "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                     timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                continue
            for line in out.splitlines():
                parts = [p.strip() for p in line.split(",")]
                if len(parts) == 3:
                    for key in (parts[0], parts[1]):
                        if key in self.samples:
                            self.samples[key].append(float(parts[2]))

    def stop(self) -> dict[str, float | None]:
        self._stop.set()
        return {g: (sum(s) / len(s) if s else None) for g, s in self.samples.items()}


# ---------------------------------------------------------------------------------------------------------
# The study process
# ---------------------------------------------------------------------------------------------------------
def prepare(spec: StudySpec, out: Path) -> None:
    """Create the out directory with study.json, or check that the study there is this one (StudyError if not)."""
    sj = out / "study.json"
    if sj.exists():
        try:
            old = json.loads(sj.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise StudyError(f"--out {out}: study.json is unreadable ({exc})") from None
        mine, theirs = spec.identity(), old.get("identity", {})
        try:   # the saved spec read again: settings saved under an older spelling of a key compare as today's
            theirs = StudySpec.from_dict(old["spec"]).identity()
        except Exception:  # noqa: BLE001 — an unreadable spec compares as saved
            pass
        diff = [k for k in mine if json.dumps(mine[k], sort_keys=True) != json.dumps(theirs.get(k), sort_keys=True)]
        then, now = old.get("resolved"), spec.resolved()
        if diff == ["settings"] and then == now:
            diff = []   # settings spelled out (a default pinned as it was): every variant resolves as it did
        if diff:
            raise StudyError(f"--out {out} holds another study (it differs in {', '.join(diff)}); use another --out "
                             "or ask for the same study to resume it")
        changed = [k for k in now if then is not None and then.get(k) != now[k]]
        if changed:
            raise StudyError(f"--out {out}: variant(s) {', '.join(changed)} resolve to other trainer or feedback "
                             "configs with this tradeloop's defaults than when the study started (the preset or "
                             "the feedback it ships changed); finish it with the tradeloop that started it, or "
                             "start it again in another --out (a variant that spells out its settings is immune)")
    elif out.exists() and not out.is_dir():
        raise StudyError(f"--out {out} exists and is not a directory")
    elif out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise StudyError(f"--out {out} is not empty and holds no study.json; use an empty or new directory")
    write_json_atomic(sj, {"identity": spec.identity(), "spec": spec.to_dict(), "resolved": spec.resolved()})


def done_runs(spec: StudySpec, out: Path) -> set[str]:
    return {r.run_id for r in spec.runs() if (out / "runs" / r.run_id / "summary.json").exists()}


def epochs_done(out: Path, run_id: str) -> int:
    return len(list((out / "runs" / run_id / "loop").glob("epoch-*.json")))


def earlier_starts(prev: dict) -> list[dict]:
    """The earlier starts of the study command in this out directory (wall s, epochs trained, runs at once each), from
    the status.json the last one left (`prev`, {} when none): a resumed study's time is the sum of its starts."""
    try:
        here = {"wall_s": float(prev["wall_s"]), "epochs": int(prev["epochs_this_start"]),
                "parallel": int(prev.get("parallel", 1))}
    except (ValueError, KeyError, TypeError):
        return []
    return [*prev.get("earlier_starts", []), here]


def _read_status(path: Path) -> dict:
    """The status.json an earlier start left ({} when there is none or it is unreadable)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


class Status:
    """status.json: rewritten atomically at most once a second (and on every state change)."""

    def __init__(self, out: Path, spec: StudySpec, n_runs: int, runs_done: int, epochs_before: int):
        self.path, self.t0, self.t_last = out / "status.json", time.time(), 0.0
        prev = _read_status(self.path)
        self.doc: dict[str, Any] = {
            "state": "running", "pid": os.getpid(), "started_at": self.t0, "runs_total": n_runs,
            "runs_done": runs_done, "runs_failed": [], "running": {}, "epochs_total": n_runs * spec.epochs,
            "epochs_done": epochs_before, "epochs_this_start": 0, "parallel": spec.parallel,
            "earlier_starts": earlier_starts(prev), "mps_dir": prev.get("mps_dir")}

    def update(self, force: bool = False, **kw) -> None:
        self.doc.update(kw)
        now = time.time()
        d = self.doc
        d["updated_at"], d["wall_s"] = now, now - self.t0
        d["epochs_per_s"] = d["epochs_this_start"] / d["wall_s"] if d["wall_s"] > 0 else 0.0
        d["wall_total_s"] = d["wall_s"] + sum(e["wall_s"] for e in d["earlier_starts"])
        d["epochs_trained_total"] = d["epochs_this_start"] + sum(e["epochs"] for e in d["earlier_starts"])
        left = max(0, d["epochs_total"] - d["epochs_done"])
        d["eta_s"] = left / d["epochs_per_s"] if d["epochs_per_s"] > 0 else None
        if force or now - self.t_last >= 1.0:
            write_json_atomic(self.path, d)
            self.t_last = now


def _copy_remote_summaries(r, sid: str, out: Path) -> None:
    """Summaries of runs done on other hosts into this out directory (what the results read)."""
    from tradeloop.study.remote import key

    for rid, raw in r.hgetall(key(sid, "summaries")).items():
        path = out / "runs" / rid / "summary.json"
        if not path.exists():
            write_json_atomic(path, json.loads(raw))


def share_gpus(spec: StudySpec, P: int, gpus: list[str], console, status: "Status | None" = None):
    """The MPS daemon the workers share their GPUs through (`tradeloop.study.mps`; None: time-sliced), and the
    `CUDA_VISIBLE_DEVICES` entries and environment the workers get; the daemon's directory goes into status.json.
    StudyError when `--mps on` cannot start it."""
    from tradeloop.study import mps

    if not mps.wanted(spec.mps, spec.device, P, len(gpus)):
        return None, gpus, {}
    daemon = mps.MpsDaemon()
    if daemon.start():
        if status is not None:
            status.update(force=True, mps_dir=str(daemon.root))
        console.print(f"{P} workers share {len(gpus)} GPU(s) through CUDA MPS (a daemon of the study's own"
                      f"{mps.held_to(spec.mps_share)})",
                      markup=False, highlight=False)
        return daemon, mps.client_gpus(gpus), daemon.client_env(spec.mps_share)
    if spec.mps == "on":
        raise StudyError(f"--mps on: {daemon.why_not}")
    console.print(f"runs share the GPU time-sliced, without MPS ({daemon.why_not})", markup=False, highlight=False)
    return None, gpus, {}


def run_study(spec: StudySpec, out: Path, console=None, redis_url: str | None = None, lock=None) -> dict:
    """Run every run of the study not done yet (P at once here; with `redis_url` through that Redis, where
    `tradeloop study-worker` processes on other hosts take runs too), then write the results; returns them.
    Holds `OUT/study.lock` meanwhile (`lock`, where the caller took it already; StudyError naming the holder when
    another study process has it), taken before study.json is checked or written. Raises StudyError when runs
    failed (they are retried by running the same study again)."""
    from rich.console import Console

    console = console or Console()
    out = Path(out)
    lock = lock or lock_study(out)
    try:
        prepare(spec, out)
        return _run_study(spec, out, console, redis_url)
    finally:
        lock.release()


def _run_study(spec: StudySpec, out: Path, console, redis_url: str | None) -> dict:
    """`run_study` under the study's lock."""
    import multiprocessing as mp

    runs = spec.runs()
    r = sid = None
    if redis_url is not None:
        from tradeloop.study import remote

        r, sid = remote.client(redis_url), remote.study_id(spec.identity())
        _copy_remote_summaries(r, sid, out)
    elif spec.parallel < 1:
        raise StudyError("--parallel 0 (no local worker) needs --redis: workers elsewhere take the runs")
    done = done_runs(spec, out)
    pending = [x.run_id for x in runs if x.run_id not in done]
    before = sum(epochs_done(out, x.run_id) for x in runs)
    status = Status(out, spec, len(runs), len(done), before)
    from tradeloop.study.mps import quit_stale

    if quit_stale(status.doc.get("mps_dir")):       # a start killed before it could quit its MPS daemon
        console.print(f"quit the MPS daemon an earlier start left running ({status.doc['mps_dir']})",
                      markup=False, highlight=False)
    status.doc["mps_dir"] = None
    if done:
        console.print(f"resuming {out}: {len(done)} of {len(runs)} runs done, {before} epochs on disk")
    P = max(0 if r is not None else 1, min(spec.parallel, len(pending)))
    gpus = visible_gpus() if spec.device != "cpu" and P else []
    if spec.device != "cpu" and P and not gpus:
        raise StudyError("--device cuda but no CUDA device is visible here")
    threads = spec.threads or max(1, usable_cores() // max(P, 1))
    sampler = GpuSampler(gpus) if gpus else None
    # the baselines' processes take the cores the workers leave, and up to 8 once the runs are done
    spare = usable_cores() - (P * threads if pending else 0)
    baseline_job = BackgroundBaselines(spec, out, now=spare, most=min(usable_cores(), 8))
    t_start = time.time()
    failed: dict[str, str] = {}
    epochs_here = 0
    workers: list = []
    daemon = None
    if pending:
        daemon, worker_gpus, extra_env = share_gpus(spec, P, gpus, console, status)
        ctx = mp.get_context("spawn")
        if r is not None:
            from shared.config import redact_url
            from tradeloop.study.remote import RedisEvents, publish

            events = RedisEvents(redis_url, sid)
            publish(r, sid, json.loads((out / "study.json").read_text()), pending)
            source: tuple = ("redis", sid, len(runs))
            console.print(f"study {sid} in {redact_url(redis_url)}: workers elsewhere join with `tradeloop "
                          f"study-worker --study {sid} --out DIR`, the URL in TL_REDIS_URL (its password there or "
                          "in TL_REDIS_PASSWORD)", markup=False, highlight=False)
        else:
            tasks, events = ctx.Queue(), ctx.Queue()
            work = lockstep_groups(spec, pending)
            P = min(P, len(work))
            for x in work:
                tasks.put(x)
            for _ in range(P):
                tasks.put(None)
            source = ("local", tasks, events)
        if P > 1 and first_fills_cache(spec, out, gpus):
            console.print(first_alone_line(gpus), markup=False, highlight=False)
    with sigterm_interrupts() as term:
        if pending:
            try:
                from tradeloop.study.remote import url_in_env

                with url_in_env(redis_url) if r is not None else contextlib.nullcontext():
                    workers = start_workers(ctx, spec, out, source, P, worker_gpus, threads, extra_env)
                epochs_here = _follow(spec, out, runs, workers, events, status, failed, r, sid, P, before,
                                      len(done), t_start, console)
            except RedisError as exc:          # the study's Redis went away (`--redis`): stop, keep what is done
                for p in workers:
                    p.terminate()
                join_workers(workers, 30.0)
                baseline_job.stop()
                stopped = {rid: epochs_done(out, rid) for rid in status.doc["running"]}
                status.update(force=True, state="interrupted", running={}, stopped=stopped)
                raise StudyInterrupted(f"lost the study's Redis ({str(exc).splitlines()[0]}): run the same command "
                                       "again once it answers (done runs are kept)") from None
            except KeyboardInterrupt as exc:
                term.stopping()
                how = stop_workers(workers, stopped_by=exc)
                baseline_job.stop()
                stopped = {rid: epochs_done(out, rid) for rid in status.doc["running"]}
                status.update(force=True, state="interrupted", running={}, stopped=stopped)
                raise StudyInterrupted(f"{how}: run the same command again to resume (done runs are kept, a run "
                                       "half done resumes from its last epoch)") from None
            finally:
                if daemon is not None:
                    with term.held():                 # a SIGTERM meanwhile stops the results instead
                        join_workers(workers, 60.0)   # their CUDA contexts closed before the daemon quits
                        daemon.stop()
                        status.update(force=True, mps_dir=None)
        wall = time.time() - t_start
        busy = sampler.stop() if sampler else {}
        timing = {"wall_s": wall, "runs_at_once": status.doc.get("peak_running") or P, "epochs_trained": epochs_here,
                  "epochs_per_s": epochs_here / wall if wall > 0 and epochs_here else None,
                  "gpu_busy_pct": busy, "gpus": gpus, "threads_per_worker": threads, "mps": daemon is not None,
                  "mps_share": spec.mps_share if daemon is not None else None,
                  "iteration_sms": spec.iteration_sms or None,
                  "lockstep": spec.lockstep if spec.lockstep > 1 else None,
                  **_all_starts(status.doc["earlier_starts"], wall, epochs_here)}
        try:
            term.raise_held()
            return _results(spec, out, status, baseline_job, workers, failed, r, sid, timing)
        except KeyboardInterrupt as exc:
            term.stopping()
            baseline_job.stop()
            status.update(force=True, state="interrupted", running={}, stopped={})
            raise StudyInterrupted(f"{stopped_how(exc)} while writing the results (the runs are done and kept): run "
                                   "the same command again to write them") from None


def first_alone_line(gpus: list[str]) -> str:
    """What the study says while its first worker runs alone (`first_fills_cache`): the idle minute or two of a
    machine that has never compiled the configuration (77–88 s on an H100 or H200, bench/README.md 2026-12-07 ·
    483ccf8) is expected, and a later study skips it."""
    memory = " and measures the GPU memory a run holds" if gpus else ""
    return (f"worker 0 starts alone: its first epoch fills the shared compile cache{memory}, then the others start "
            "(compiling takes a minute or two where this configuration was never compiled; a later study loads it)")


def _results(spec: StudySpec, out: Path, status: Status, baseline_job: BackgroundBaselines, workers: list,
             failed: dict, r, sid, timing: dict) -> dict:
    """The runs done: the baselines waited for, the results written (or StudyError naming the runs that failed)."""
    baseline_job.join()
    if r is not None:
        _copy_remote_summaries(r, sid, out)
    for rid in done_runs(spec, out):            # a run with a summary is done, whatever else reported it failed
        failed.pop(rid, None)
    if failed:
        status.update(force=True, state="failed", runs_failed=sorted(failed))
        join_workers(workers, 30.0)
        raise StudyError(f"{len(failed)} run(s) failed: {', '.join(sorted(failed))} (first: "
                         f"{next(iter(failed.values()))}); run the same command again to retry them")
    results = write_results(spec, out, timing)
    status.update(force=True, state="done")
    join_workers(workers, 30.0)             # they have said "exit": only their interpreters' teardown is left
    return results


def lockstep_groups(spec: StudySpec, run_ids: list[str]) -> list[str | list[str]]:
    """The local workers' tasks: with `spec.lockstep` K > 1, the runs that share a market (`cluster_of`: the synthetic
    market and the fold) and a trainer config, in groups of at most K as even as they split (a list each; a group
    of one is its run id); else the run ids. In the order of each group's first run."""
    if spec.lockstep <= 1:
        return list(run_ids)
    by: dict[tuple, list[str]] = {}
    for rid in run_ids:
        rs = spec.run(rid)
        cfg = spec.configs(spec.variant(rs.variant), 14)[0]     # equal configs hash equal at any feature count
        # a config the batched step cannot train (`LockstepEngine.refusal`: the policy's moving average) runs alone
        key = (rid,) if cfg.policy_ema > 0 else (*spec.cluster_of(rs.seed, rs.fold), cfg.hash())
        by.setdefault(key, []).append(rid)
    out: list[str | list[str]] = []
    for ids in by.values():
        n = -(-len(ids) // spec.lockstep)                         # groups, then as even as they split
        for k in range(n):
            g = ids[k * len(ids) // n:(k + 1) * len(ids) // n]
            out.append(g if len(g) > 1 else g[0])
    order = {rid: i for i, rid in enumerate(run_ids)}
    return sorted(out, key=lambda g: order[g[0] if isinstance(g, list) else g])


def stop_workers(workers: list, stopped_by: KeyboardInterrupt) -> str:
    """Terminate the worker processes (30 s for them all to exit) on Ctrl-C or SIGTERM; returns how the study was
    stopped, for its last line."""
    for p in workers:
        p.terminate()
    join_workers(workers, 30.0)
    return stopped_how(stopped_by)


def join_workers(workers: list, timeout_s: float, clock=time.monotonic) -> list:
    """Wait for the worker processes to exit, `timeout_s` for all of them together (a deadline, not a wait each:
    sixteen workers whose teardown hangs cost `timeout_s`, not sixteen times it); returns those still alive."""
    deadline = clock() + timeout_s
    for p in workers:
        p.join(timeout=max(0.0, deadline - clock()))
    return [p for p in workers if p.is_alive()]


def _all_starts(earlier: list[dict], wall: float, epochs: int) -> dict:
    """The timing of every start of the study command together (the last one's is the rest of `timing`)."""
    return {"starts": len(earlier) + 1, "wall_total_s": wall + sum(e["wall_s"] for e in earlier),
            "epochs_trained_total": epochs + sum(e["epochs"] for e in earlier)}


def report_only(out: Path) -> dict:
    """Aggregate a finished study in `out` again (results.json, report.md, report.png; the baselines are computed
    if baselines.json is missing or stale) without running anything. The timing is that of the study process's last
    start, read from status.json. StudyError when `out` holds no study or runs are not done."""
    out = Path(out)
    sj = out / "study.json"
    try:
        spec = StudySpec.from_dict(json.loads(sj.read_text())["spec"])
    except FileNotFoundError:
        raise StudyError(f"--out {out} holds no study.json: not a study directory") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StudyError(f"--out {out}: study.json is unreadable ({exc})") from None
    missing = [r.run_id for r in spec.runs() if r.run_id not in done_runs(spec, out)]
    if missing:
        raise StudyError(f"--out {out}: {len(missing)} of {len(spec.runs())} runs are not done "
                         f"({', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}); run the study's command "
                         "again to finish them")
    st = _read_status(out / "status.json")
    timing = {"wall_s": st.get("wall_s"), "runs_at_once": st.get("parallel", spec.parallel),
              "epochs_trained": st.get("epochs_this_start"), "epochs_per_s": st.get("epochs_per_s") or None,
              "gpu_busy_pct": {}, "from": "the study's last status.json"}
    if st.get("wall_s") is not None:
        timing.update(_all_starts(st.get("earlier_starts", []), st["wall_s"], st.get("epochs_this_start") or 0))
    return write_results(spec, out, timing)


def _follow(spec: StudySpec, out: Path, runs: list, workers: list, events, status: "Status", failed: dict, r,
            sid: str | None, P: int, before: int, n_done: int, t_start: float, console) -> int:
    """The study process while its workers run: events → progress bar, one line per finished run, status.json;
    failed runs into `failed`. Returns the epochs trained meanwhile."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    epochs_here = 0
    current: dict[tuple, set[str]] = {}             # (consumer through Redis or None, worker) → its runs
    reached: dict[str, int] = {}                    # run → the furthest epoch its events have reported
    cols = (TextColumn("[bold]study"), BarColumn(), MofNCompleteColumn(), TextColumn("epochs"),
            TextColumn("{task.fields[runs]}"), TimeElapsedColumn(), TextColumn("{task.fields[rate]}"))
    with Progress(*cols, console=console, transient=False) as prog:
        task = prog.add_task("study", total=len(runs) * spec.epochs, completed=before,
                             runs=f"runs {n_done}/{len(runs)}", rate="")
        exited: set[int] = set()
        t_check = t_event = 0.0
        while True:
            if time.monotonic() - t_check > 1.0:
                t_check = time.monotonic()
                if r is not None:                  # through Redis: over when every run is accounted for
                    from tradeloop.study.remote import accounted

                    ok, bad = accounted(r, sid)
                    if len(ok | set(bad)) >= len(runs) and time.monotonic() - t_event > 1.0:
                        failed.update(bad)         # (and its last events read: a second without any)
                        for rid in ok:             # done by a worker, whatever another reported of it
                            failed.pop(rid, None)
                        break
                elif len(exited) >= P:
                    break
                for i, p in enumerate(workers):    # a worker that died (killed, out of memory)
                    if i not in exited and not p.is_alive() and p.exitcode not in (None, 0):
                        exited.add(i)
                        (out / WARM_FILE).parent.mkdir(parents=True, exist_ok=True)
                        (out / WARM_FILE).touch()           # the others need not wait for its compile
                        for rid in sorted(current.pop((None, i), ())):
                            status.doc["running"].pop(rid, None)
                            why = f"worker {i} died (exit code {p.exitcode})"
                            if r is None:          # (through Redis another worker takes the run over)
                                failed[rid] = why
                                _event_log(out, {"type": "error", "run": rid, "error": why})
                            prog.console.print(f"[red]{rid}: {why}")
                status.update(runs_failed=sorted(failed))
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                ev = None
            if ev is None:
                continue
            t_event = time.monotonic()
            w, rid = ev["worker"], ev.get("run")
            where = f"worker {w}" + (f" of {ev['consumer']}" if "consumer" in ev else "")
            who = (ev.get("consumer"), w)
            if ev["type"] == "start":
                current.setdefault(who, set()).add(rid)
                status.doc["running"][rid] = {"worker": where, "gpu": ev["gpu"], "epoch": epochs_done(out, rid)}
                reached.setdefault(rid, epochs_done(out, rid))
            elif ev["type"] == "epoch":
                epochs_here += 1
                # a run taken over from a lost worker trains its epochs again: each epoch of the study counts once
                status.doc["epochs_done"] += max(0, ev["epoch"] - reached.get(rid, 0))
                reached[rid] = max(reached.get(rid, 0), ev["epoch"])
                status.doc["epochs_this_start"] = epochs_here
                if rid in status.doc["running"]:
                    status.doc["running"][rid]["epoch"] = ev["epoch"]
                rate = epochs_here / max(time.time() - t_start, 1e-9)
                prog.update(task, advance=1, rate=f"{rate:.2f} epochs/s")
            elif ev["type"] == "done":
                current.get(who, set()).discard(rid)
                status.doc["running"].pop(rid, None)
                status.doc["runs_done"] += 1
                s = ev["summary"]
                prog.console.print(
                    f"{rid}: epoch {s['selected_epoch']} selected on validation (val {s['val_sharpe']:+.3f}, "
                    f"{s['val_trades']} trades"
                    + ("" if s.get("selectable", True) else f"; no epoch had {spec.min_val_trades}: the best of all")
                    + f") → OOS {s['oos_sharpe']:+.3f} ({s['oos_trades']} trades), "
                    f"run DSR {s['run_dsr']:.2f}, {s['wall_s']:.0f} s [{where}]"
                    + (f"; exploited {', '.join(s['exploited'])}" if s.get("exploited") else ""))
                prog.update(task, runs=f"runs {status.doc['runs_done']}/{len(runs)}")
                _event_log(out, {"type": "done", "run": rid, "worker": where, "pid_t": ev["t"], **s})
            elif ev["type"] == "error":
                current.get(who, set()).discard(rid)
                status.doc["running"].pop(rid, None)
                failed[rid] = ev["error"]
                prog.console.print(f"[red]{rid} failed: {ev['error']}")
                _event_log(out, {"type": "error", "run": rid, "error": ev["error"], "traceback": ev["traceback"]})
            elif ev["type"] == "handed-over":     # another worker has the run now (through Redis)
                current.get(who, set()).discard(rid)
                if status.doc["running"].get(rid, {}).get("worker") == where:    # not the new holder's entry
                    status.doc["running"].pop(rid, None)
                prog.console.print(f"{rid}: {where} leaves it to another ({ev['why']})", markup=False,
                                   highlight=False)
            elif ev["type"] == "stand-down":
                gib = 2.0 ** 30
                what = ("workers", f"a worker of up to {spec.lockstep} runs in lockstep") if spec.lockstep > 1 else \
                    ("runs", "a run")
                prog.console.print(
                    f"{where} stands down: {ev['fit']} {what[0]} at once fit GPU {ev['gpu']} ({what[1]} holds "
                    f"{ev['run_bytes'] / gib:.1f} GiB of {ev['total_bytes'] / gib:.1f})", markup=False, highlight=False)
                _event_log(out, {"type": "stand-down", "worker": where, "gpu": ev["gpu"], "fit": ev["fit"],
                                 "run_bytes": ev["run_bytes"], "total_bytes": ev["total_bytes"]})
            elif ev["type"] == "memory-wait":
                prog.console.print(f"{rid}: CUDA out of memory on GPU {ev['gpu']}; it resumes once the GPU has memory "
                                   "free", markup=False, highlight=False)
                _event_log(out, {"type": "memory-wait", "run": rid, "worker": where, "gpu": ev["gpu"]})
            elif ev["type"] == "lockstep":
                rd = ev["rounds"]
                prog.console.print(f"{where}: {len(ev['runs'])} runs in lockstep ({', '.join(ev['runs'])}): "
                                   f"{rd['lockstep']} epochs together, {rd['alone']} rounds alone",
                                   markup=False, highlight=False)
                _event_log(out, {"type": "lockstep", "worker": where, "runs": ev["runs"], "rounds": rd})
            elif ev["type"] == "exit" and "consumer" not in ev:
                exited.add(w)
            status.doc["peak_running"] = max(status.doc.get("peak_running", 0), len(status.doc["running"]))
            status.update(force=ev["type"] != "epoch", runs_failed=sorted(failed))
    return epochs_here


def _event_log(out: Path, doc: dict) -> None:
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps(doc, default=str) + "\n")
