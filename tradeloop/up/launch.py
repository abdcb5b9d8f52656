"""`run_up`: one run of the closed loop on this host, from its run directory to its summary.

In order: plan the run (`runs`), bind every service's port (`endpoints`), claim or lock the run directory and write
up.json, start or reach Redis, write the API token and services.json, start the services (`supervisor`), show
progress until N epochs are in, the timeout, or Ctrl-C / SIGTERM (`progress`; an embedded Redis that exits is started
again on its AOF, `RedisWatch`), stop them saying what the stop waits for and what was saved (`stopping`), write the
summary with the run's best checkpoint, stop the embedded Redis and release the lock. An unfinished run prints the
command that resumes it.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tradeloop.up.endpoints import (HOST, PortTaken, api_token, bind_listeners, close_listeners, port_holder,
                                    start_redis, wanted_ports, write_services_file)
from tradeloop.up.progress import (Progress, RedisWatch, collect_summary, dead_letter_line, fmt, loop_done,
                                   new_dead_letters, redis_client, trainer_failure, write_line)
from tradeloop.up.runs import (RunError, claim_run, default_run_dir, lock_resumed, plan_run, resume_hint,
                               write_run_file)
from tradeloop.up.stopping import interrupted_note, stopping_note
from tradeloop.up.supervisor import GRACE_S, TRAINER_GRACE_S, Supervisor, service_procs

EXIT_CODES = {"completed": 0, "stopped": 0, "timeout": 1, "failed": 1, "interrupted": 130}
"""How `tradeloop up` exits: "stopped" is a stop asked through the trainer's `POST /control/stop` (its last epoch
evaluated and given its feedback; a resume trains on)."""


def err(msg: str) -> None:
    """A launcher error line on stderr."""
    write_line(f"tradeloop up: {msg}", "stderr")


def say(msg: str) -> None:
    write_line(f"tradeloop up: {msg}")


def run_up(*, epochs: int, dataset: str, device: str, summary: Path | None, evaluators: int, run_id: str | None,
           run_dir: Path | None, config: str, free_ports: bool, dashboard: bool, feedback_timeout: float,
           timeout: float, live: bool | None, extra_env: dict[str, str], resume: str | None = None,
           settings: dict | None = None) -> int:
    """Start everything, supervise, show progress, stop, write the summary. Returns the exit code.

    `run_dir`: None → `TL_RUN_DIR`, else `runs`; `run_id`: None → `TL_RUN_ID`, else a new id; `resume`: an
    existing run to continue. `settings`: what up.json records (default: from the arguments)."""
    from shared.redis_server import RedisServerError

    run_dir = Path(run_dir) if run_dir is not None else default_run_dir()
    generated = not (run_id or resume or os.environ.get("TL_RUN_ID"))
    try:
        run_id, run_path, resuming = plan_run(run_id, run_dir, resume)
    except RunError as exc:
        err(str(exc))
        return 2

    # Every service's port is bound here, before the run directory, Redis or any child exists, and held to the end.
    import importlib.util

    if dashboard and importlib.util.find_spec("services.dashboard.app") is None:
        err("services/dashboard/app.py not found: running without the dashboard")
        dashboard = False
    try:
        listeners = bind_listeners(HOST, wanted_ports(evaluators, free_ports, dashboard))
    except PortTaken as exc:
        holder = port_holder(run_dir, exc.port)
        err(f"{exc}" + (f"; {holder}" if holder else ""))
        return 2
    except ValueError as exc:
        err(str(exc))
        return 2
    port = {name: s.getsockname()[1] for name, s in listeners.items()}

    try:
        if resuming:
            lock = lock_resumed(run_path)
        else:
            run_id, run_path, lock = claim_run(run_id, run_path, generated)
    except (RunError, OSError) as exc:
        err(str(exc))
        close_listeners(listeners)
        return 2
    run_path = run_path.resolve()
    summary = summary or run_path / "summary.json"
    write_run_file(run_path, run_id, settings or {"epochs": epochs, "dataset": dataset, "device": device,
                                                  "config": config, "evaluators": evaluators}, resuming)

    try:
        redis_url, server = start_redis(run_path, lock.fd)
    except RedisServerError as exc:
        err(str(exc))
        close_listeners(listeners)
        lock.release()
        if not resuming:  # nothing ran: leave no run directory behind
            import shutil

            shutil.rmtree(run_path, ignore_errors=True)
        return 2

    token, token_file = api_token(run_path)
    env = dict(os.environ)
    env.update({
        "TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_RUN_DIR": str(run_path.parent), "TL_DATA": dataset,
        "TL_EPOCHS": str(epochs), "TL_DEVICE": device, "TL_CONFIG": config, "TL_EMBEDDED": "true",
        "TL_HOST": HOST, "TL_API_TOKEN": token, "TL_FEEDBACK_TIMEOUT_S": str(feedback_timeout),
        "TL_TRAINER_PORT": str(port["trainer"]), "TL_FEEDBACK_PORT": str(port["feedback"]),
        "TL_EVALUATOR_PORT": str(port["evaluator-1"]), "PYTHONUNBUFFERED": "1",
        **extra_env,
    })
    if dashboard:
        env.update({"TL_DASHBOARD_PORT": str(port["dashboard"]),
                    "TL_DASHBOARD_ORIGIN": f"http://{HOST}:{port['dashboard']}"})
    env.pop("REDIS_URL", None)
    env.pop("TL_LISTEN_FD", None)
    url = {name: f"http://{HOST}:{p}" for name, p in port.items()}
    urls = {"trainer": url["trainer"], "evaluator": url["evaluator-1"], "feedback": url["feedback"]}
    if dashboard:
        urls["dashboard"] = url["dashboard"]
    procs = service_procs(env, url, listeners, run_path / "logs", evaluators, device, keep_fds=(lock.fd,))
    services_file = write_services_file(run_path, run_id, url, server, token_file)

    stop = {"why": None, "signals": 0}

    def on_signal(signum, _frame):
        stop["why"] = "interrupted"
        stop["signals"] += 1

    # SIGHUP: the terminal closed (an ssh session dropped) — stop as on Ctrl-C, the summary written
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    sup = Supervisor(procs)
    live = sys.stdout.isatty() if live is None else live
    say(f"run {run_id} in {run_path}{' (resumed)' if resuming else ''} — Redis "
        f"{'embedded on ' + str(server.socket_path) if server else 'external'}, {evaluators} evaluator(s), "
        f"dataset {dataset}, device {device}")
    where_token = f"API token in {token_file}" if token_file else "API token: TL_API_TOKEN"
    if "dashboard" in urls:
        say(f"dashboard {urls['dashboard']}/ ; {where_token}")
    else:
        say("services " + ", ".join(f"{name} {url}" for name, url in urls.items()) + f" ; {where_token}")
    t0 = time.monotonic()
    status, failure, dead_after, redis_watch = "completed", None, "0", None
    try:
        sup.start_all(abort=lambda: bool(stop["why"]))
        with Progress(urls, epochs, live) as prog, redis_client(redis_url) as watch:   # one connection for the poll
            redis_watch = RedisWatch(server, watch)
            last = 0.0
            while True:
                if stop["why"]:
                    status = stop["why"]
                    break
                for msg in sup.poll():
                    prog.note(msg)
                if sup.refused is not None:        # the same settings fail again: stop, saying which
                    failure, status = f"a service refused its settings: {sup.refused}", "failed"
                    break
                now = time.monotonic()
                if now - last >= 1.0:
                    last = now
                    for msg in redis_watch.poll():
                        prog.note(msg)
                    if redis_watch.failure is not None:
                        prog.note(f"the loop cannot go on: {redis_watch.failure}")
                        failure, status = redis_watch.failure, "failed"
                        break
                    prog.refresh()
                    failure = trainer_failure(prog.snapshot.get("trainer"))
                    if failure is not None:
                        prog.note(f"the trainer failed: {failure} (its log: {run_path / 'logs' / 'trainer.log'})")
                        failure, status = f"the trainer failed: {failure}", "failed"
                        break
                    for dead_after, dl in new_dead_letters(watch, run_id, dead_after):
                        prog.note(dead_letter_line(dl))
                        if dl.get("epoch") == epochs:        # the last epoch's step is lost: the loop cannot finish
                            failure = f"the last epoch's message was given up ({dl.get('reason')})"
                    if failure is not None:
                        prog.note(f"the loop cannot finish: {failure} (the services' logs: {run_path / 'logs'})")
                        status = "failed"
                        break
                    if loop_done(watch, run_id, epochs):
                        prog.refresh()
                        break
                    after = stopped_after(prog.snapshot)
                    if after is not None and (after == 0 or loop_done(watch, run_id, after)):
                        prog.note(f"the trainer was stopped (POST /control/stop) after epoch {after} of {epochs}")
                        status = "stopped"
                        break
                    if now - t0 > timeout:
                        prog.note(f"the loop did not finish within --timeout {timeout:.0f}s; stopping")
                        status = "timeout"
                        break
                time.sleep(0.2)
    finally:
        note = stopping_note(urls) if status != "completed" else f"all {epochs} epochs are in; the services stop"
        say(f"stopping ({status}): {note}")
        at_stop, since = stop["signals"], time.time()
        ended = sup.stop_all(GRACE_S, TRAINER_GRACE_S, hurry=lambda: stop["signals"] > at_stop)
        saved = interrupted_note(run_path, since)
        if saved:
            say(saved)
        if ended.get("trainer", "").startswith("killed"):
            say(f"the trainer was {ended['trainer']}: what it trained since its last saved state is lost; a resume "
                "trains it again")
        doc = {"run_id": run_id, "run_dir": str(run_path), "dataset": dataset, "device": device,
               "epochs_requested": epochs, "epochs_completed": 0, "status": status,
               "redis": "embedded" if server else "external", "evaluators": evaluators,
               "wall_seconds": round(time.monotonic() - t0, 1), "resumed": resuming, "stopped": ended,
               "restarts": {p.name: p.restarts for p in procs}}
        if server is not None:
            doc["restarts"]["redis"] = redis_watch.restarts if redis_watch is not None else 0
        if failure is not None:
            doc["loop_error"] = failure
        best, unwritten = write_summary(doc, redis_url, run_path, summary)
        say(f"summary written to {run_path / 'summary.json' if unwritten else summary}")
        if unwritten:
            say(f"--summary {summary}: not written ({unwritten}); the run's summary above holds the same")
        if status != "completed":
            say(f"to continue this run: {resume_hint(run_id, run_path.parent)}")
        if best is not None:
            say(f"best checkpoint: epoch {best['epoch']} (val per-trade Sharpe {fmt(best['val_per_trade_sharpe'])} "
                f"over {best['val_n_trades']} trades, {best['rule']}); its OOS per-trade Sharpe "
                f"{fmt(best['oos_per_trade_sharpe'])} over {fmt(best['oos_n_trades'])} trades; evaluate it: "
                f"{best['command']}")
        services_file.unlink(missing_ok=True)
        close_listeners(listeners)
        if server is not None:
            server.stop()
        lock.release()
        for s, h in old.items():
            signal.signal(s, h)
    return EXIT_CODES[status]


def stopped_after(snapshot: dict) -> int | None:
    """The last epoch the trainer trained when its /status says a `POST /control/stop` ended its loop before the
    run's epochs (phase "stopped"), else None."""
    trainer = snapshot.get("trainer")
    if not isinstance(trainer, dict) or trainer.get("phase") != "stopped":
        return None
    return max((int(h["epoch"]) for h in snapshot.get("history") or []), default=0)


def write_summary(head: dict, redis_url: str, run_path: Path, summary: Path) -> tuple[dict | None, str | None]:
    """Write the run's summary (`head`, then the epochs read from Redis, then the best checkpoint by validation) to
    `<run>/summary.json`, which `tradeloop evaluate` reads, then to `summary`. Returns (the best checkpoint or None,
    why `summary` could not be written or None): the run's own file is written first, so a bad `summary` loses
    nothing."""
    from services.evaluator.runs import best_of_summary

    try:
        rows = collect_summary(redis_url, head["run_id"])
    except Exception as exc:  # noqa: BLE001 — the summary says what it could not read
        rows = {"epochs": [], "evaluations": {}, "error": f"{type(exc).__name__}: {exc}"}
    doc = {**head, **rows}
    doc["epochs_completed"] = len(rows["epochs"])
    doc["best_checkpoint"] = best = best_of_summary(doc["epochs"], run_path)
    text = json.dumps(doc, indent=2)
    (run_path / "summary.json").write_text(text)
    if summary.resolve() == (run_path / "summary.json").resolve():
        return best, None
    try:
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(text)
    except OSError as exc:
        return best, exc.strerror or str(exc)
    return best, None
