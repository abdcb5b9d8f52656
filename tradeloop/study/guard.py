"""What keeps a study's runs from being mixed: one study process per out directory (`lock_study`, an exclusive
`flock` on `OUT/study.lock` held for the study's life) and one code on every host (`code_fingerprint`, published
with the study in Redis and recorded in every run's summary.json).
"""
from __future__ import annotations

import functools
import hashlib
from pathlib import Path

from tradeloop.locks import FileLock, Locked, describe_holder
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


def lock_study(out: Path) -> FileLock:
    """The study process's lock on `OUT/study.lock` (`tradeloop.locks.FileLock`; OUT made where missing), held for
    its life, taken before anything in OUT is written; StudyError naming the holder when another study process has
    it (OSError where OUT cannot be made)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        return FileLock.acquire(Path(out) / LOCK_FILE, mode=0o644)
    except Locked as exc:
        raise StudyError(f"--out {out} is in use by another study process ({describe_holder(exc.holder)}); one "
                         "study process at a time runs a study directory (wait for it, or stop it)") from None
