"""SIGTERM in the study process: `kill`, `timeout`, `docker stop` or a batch system's preemption stops a study as
Ctrl-C does — workers stopped, the MPS daemon quit, status "interrupted", a line saying how to resume — instead of
ending the process where it stands.

`timeout` sends SIGTERM twice, to the process and then to its whole process group, and a user may send it again
while the study stops: only the first is taken (raised as `Terminated` where the study stands), the later ones are
ignored until the study has stopped, so that none ends it half way through marking itself interrupted. A teardown
that must finish (the workers joined, the MPS daemon quit) holds a SIGTERM that comes meanwhile (`TermSignal.held`)
and raises it afterwards (`TermSignal.raise_held`). The study's child processes get the group's signal too; the
baselines' pool keeps out of the group (`tradeloop.study.report`).
"""
from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the study process where it is when the signal comes, as Ctrl-C raises KeyboardInterrupt."""


class TermSignal:
    """The SIGTERM handler of one `sigterm_interrupts` block: the first signal raises `Terminated`, unless a teardown
    holds it (`held`), which `raise_held` raises after; every later one is ignored."""

    def __init__(self) -> None:
        self.taken = self.pending = False
        self._holding = 0

    def __call__(self, signum, frame) -> None:
        if self.taken or self.pending:
            return
        if self._holding:
            self.pending = True
            return
        self.taken = True
        raise Terminated()

    @contextlib.contextmanager
    def held(self):
        """Within: a SIGTERM is kept for `raise_held` instead of raised."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def stopping(self) -> None:
        """The study is stopping (on Ctrl-C, or on this signal): every SIGTERM from here on is ignored."""
        self.taken = True

    def raise_held(self) -> None:
        """Raise `Terminated` for a SIGTERM that came while `held` (once)."""
        if self.pending and not self.taken:
            self.taken = True
            raise Terminated()


@contextlib.contextmanager
def sigterm_interrupts():
    """Within: SIGTERM goes to a `TermSignal` (yielded). Python runs signal handlers in the main thread only;
    elsewhere the handler is not installed and the yielded one never fires."""
    term = TermSignal()
    if threading.current_thread() is not threading.main_thread():
        yield term
        return
    old = signal.signal(signal.SIGTERM, term)
    try:
        yield term
    finally:
        signal.signal(signal.SIGTERM, old)


def stopped_how(exc: KeyboardInterrupt) -> str:
    """How the study was stopped, for its last line: "stopped by SIGTERM" or "interrupted" (Ctrl-C)."""
    return "stopped by SIGTERM" if isinstance(exc, Terminated) else "interrupted"
