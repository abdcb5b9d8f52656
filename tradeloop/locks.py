"""The one file lock of the command line: an exclusive, non-blocking `flock` whose file names its holder. `tradeloop
up` holds `<run>/up.lock` for a run's life, a study process `OUT/study.lock`, a study worker `runs/<id>/.lock` for
the run in hand. A lock lives as long as any descriptor of it (a killed holder releases it; a process started with
the descriptor keeps it). Imports only the standard library.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path


class Locked(Exception):
    """Another process holds the lock: `holder` is what it wrote into the file (pid, host, started_at, command; {}
    where it wrote nothing readable)."""

    def __init__(self, path: Path, holder: dict):
        super().__init__(f"{path} is locked by {describe_holder(holder)}")
        self.path, self.holder = path, holder


class FileLock:
    """An exclusive `flock` on `path`, taken with `acquire`; the file then holds the holder's pid, host, start time
    (local, with its UTC offset) and command line, as JSON."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    @classmethod
    def acquire(cls, path: Path, wait_s: float = 0.0, mode: int = 0o600) -> "FileLock":
        """The lock on `path` (created if missing), waiting up to `wait_s` for a holder to let go; `Locked` naming
        the holder when it does not."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise Locked(path, read_holder(path)) from None
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "command": " ".join(sys.argv)}).encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        """Close this process's descriptor (another process that inherited it keeps the lock until it exits)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def read_holder(path: Path) -> dict:
    """What a lock's holder wrote into it ({} when nothing readable)."""
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def describe_holder(holder: dict) -> str:
    """A holder in words: "pid N on HOST"."""
    return f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
