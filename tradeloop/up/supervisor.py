"""The service processes of a run: each a child `tradeloop serve <service>` configured by TL_* variables, its log
in `<run>/logs/<service>.log`, serving on the socket the launcher bound. `Supervisor` starts the consumers before the
trainer, restarts a process that exits on its own with exponential backoff (1 s, 2 s, … 30 s), and stops them all:
SIGTERM, each its grace (`GRACE_S`, the trainer `TRAINER_GRACE_S`), then SIGKILL, or at once on a second Ctrl-C.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from shared.config import TRAINER_STOP_WAIT_S
from shared.redis_server import die_with_parent

REFUSED_EXIT = 2
"""`tradeloop serve`'s exit code for settings or input it refuses (a TL_* variable out of range, say): the same
settings fail again, so the service is not restarted and the run stops, saying why."""
GRACE_S = 20.0
"""How long the evaluator, feedback and dashboard get to stop (the message in hand) before SIGKILL."""
TRAINER_GRACE_S = TRAINER_STOP_WAIT_S + 30.0
"""How long the trainer gets to stop: its own wait for the iteration in hand and the save
(`shared.config.TRAINER_STOP_WAIT_S`) and 30 s for the rest of its shutdown."""


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
    refused: str | None = None             # why it exited REFUSED_EXIT (its log's last words): not restarted

    def start(self) -> None:
        """Start (or restart) the process, appending to its log; it serves on the launcher's bound socket."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env, fds = self.env, self.keep_fds
        if self.listener is not None:
            env, fds = {**self.env, "TL_LISTEN_FD": str(self.listener.fileno())}, (*fds, self.listener.fileno())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "serve", self.service],
                                     env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     pass_fds=fds, start_new_session=True, preexec_fn=die_with_parent)
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
        if any(p.proc is not None and p.proc.poll() == REFUSED_EXIT for p in first):
            return                                  # a consumer refused its settings: the run stops (`poll`)
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
            if p.refused is not None:
                continue
            if code == REFUSED_EXIT:
                p.exits.append(code)
                p.refused = last_words(p.log_path)
                msgs.append(f"{p.name} refused its settings (exit {code}): {p.refused} (log: {p.log_path})")
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

    @property
    def refused(self) -> str | None:
        """Why the first service that refused its settings did (None: none did)."""
        return next((f"{p.name}: {p.refused}" for p in self.procs if p.refused is not None), None)

    def stop_all(self, grace_s: float = GRACE_S, trainer_grace_s: float = TRAINER_GRACE_S,
                 hurry: Callable[[], bool] = lambda: False) -> dict[str, str]:
        """SIGTERM every child (trainer first) and wait for each up to its grace — the trainer's covers the
        iteration in hand and the save of its state — then SIGKILL what is left; everything at once when `hurry()`
        turns True (a second Ctrl-C). Returns name → how it ended ("exited 0", "stopped by SIGTERM", "killed after
        150 s", ...)."""
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
                if code is not None:       # -SIGTERM: ended by the signal sent above, as asked
                    ended[p.name] = "stopped by SIGTERM" if code == -signal.SIGTERM else f"exited {code}"
                elif rushed or now - t0 > grace:
                    p.proc.kill()
                    p.proc.wait()
                    ended[p.name] = "killed at a second interrupt" if rushed else f"killed after {grace:.0f} s"
                else:
                    continue
                waiting.remove(p)
            time.sleep(0.05)
        return ended


def service_procs(env: dict[str, str], url: dict[str, str], listeners: dict[str, socket.socket], logs: Path,
                  evaluators: int, device: str, keep_fds: tuple[int, ...]) -> list[ServiceProc]:
    """The run's processes, in start order: feedback, the evaluator replicas (named `evaluator` when alone, each its
    own port and consumer name), the trainer, and the dashboard when it has a listener. `url`: name → base URL."""
    procs = [ServiceProc("feedback", "feedback", env, logs / "feedback.log", url["feedback"],
                         listener=listeners["feedback"], keep_fds=keep_fds)]
    for i in range(evaluators):
        name = f"evaluator-{i + 1}"
        e = {**env, "TL_EVALUATOR_PORT": str(listeners[name].getsockname()[1]), "TL_CONSUMER_NAME": name}
        if device == "cpu" and evaluators > 1:
            e.setdefault("OMP_NUM_THREADS", "1")
        procs.append(ServiceProc(name if evaluators > 1 else "evaluator", "evaluator", e, logs / f"{name}.log",
                                 url[name], listener=listeners[name], keep_fds=keep_fds))
    procs.append(ServiceProc("trainer", "trainer", env, logs / "trainer.log", url["trainer"],
                             listener=listeners["trainer"], keep_fds=keep_fds))
    if "dashboard" in listeners:
        procs.append(ServiceProc("dashboard", "dashboard", env, logs / "dashboard.log", url["dashboard"],
                                 listener=listeners["dashboard"], keep_fds=keep_fds))
    return procs


def last_words(log_path: Path, max_chars: int = 600) -> str:
    """What a service that refused to start said last: its log's last lines from the last `tradeloop serve` line on
    (where `tradeloop serve` prints the variables at fault), joined on one line; the last line where none says."""
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "its log cannot be read"
    start = max((i for i, ln in enumerate(lines) if ln.startswith("tradeloop serve")), default=len(lines) - 1)
    text = " ".join(lines[max(start, 0):])
    return (text[:max_chars] + " …") if len(text) > max_chars else text or "nothing in its log"
