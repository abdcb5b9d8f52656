"""What keeps a study's runs from being mixed: one study process per out directory (`StudyLock`, an exclusive
`flock` on `OUT/study.lock` held for the study's life) and one code on every host (`code_fingerprint`, published
with the study in Redis and recorded in every run's summary.json).
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import socket
import time
from pathlib import Path

from tradeloop.study.spec import StudyError

LOCK_FILE = "study.lock"
PACKAGES = ("shared", "services", "tradeloop")
"""The packages whose sources the fingerprint hashes (*.py and *.c, as installed)."""


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> dict[str, str]:
    """{"version": the tradeloop package's version, "sources": sha256 over the path and bytes of every *.py and *.c
    file of `PACKAGES` where this process imports them from}: equal on hosts that run the same code, whether or not
    a git commit is at hand. Computed once per process."""
    import importlib
    import importlib.metadata

    try:
        version = importlib.metadata.version("tradeloop")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    h = hashlib.sha256()
    for name in PACKAGES:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts):
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(hashlib.sha256(path.read_bytes()).digest())
    return {"version": version, "sources": h.hexdigest()}


def describe(fp: dict | None) -> str:
    """A fingerprint in words: "tradeloop 0.1.0, sources 1a2b3c4d5e6f"."""
    if not fp:
        return "no code fingerprint (a tradeloop that publishes none)"
    return f"tradeloop {fp.get('version', '?')}, sources {str(fp.get('sources', '?'))[:12]}"


class StudyLock:
    """An exclusive, non-blocking `flock` on `OUT/study.lock`, held by the study process for its life (released when
    it exits, even killed); the file names the holder (pid, host, start time). StudyError naming the holder's pid when
    another study process holds it."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_FILE
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            self.fd = -1
            raise StudyError(f"--out {out} is in use by another study process ({holder(self.path)}); one study "
                             "process at a time runs a study directory (wait for it, or stop it)") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "started_at": time.time()}).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def holder(path: Path) -> str:
    """Who holds a study's lock, from what it wrote there: "pid N on HOST"."""
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        doc = {}
    return f"pid {doc.get('pid', '?')} on {doc.get('host', '?')}"
