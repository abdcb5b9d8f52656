"""Run identity: one directory per run, one writer at a time.

A new run gets `--run-id`, else `TL_RUN_ID`, else `new_run_id()`, and a directory `<run dir>/<run id>` that must not
exist yet: `claim_run` creates it exclusively, so two launchers never share one. An existing run is continued only
with `--resume RUN`; its settings come from `<run dir>/up.json` (`RUN_FILE`), and those it keeps for good (`FIXED`)
cannot change. `RunLock` is the exclusive lock on `<run dir>/up.lock` held for the whole run by the launcher and
every process it starts.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from shared.runfiles import UP_FILE as RUN_FILE
from tradeloop.locks import FileLock, Locked, read_holder

LOCK_FILE = "up.lock"
FIXED = ("dataset", "config", "data_bars", "iterations")
"""Settings a run keeps for good (its trainer's run.json fixes them): a resume may not change them."""
DEFAULTS = {"epochs": 5, "dataset": "synthetic", "device": "cpu", "config": "small", "evaluators": 1,
            "feedback_mode": "sync", "data_bars": None, "iterations": None, "accel": "auto"}


class RunError(ValueError):
    """A run that cannot be started or resumed; the message says why and what to do."""


def timestamp() -> str:
    """Local time with its UTC offset, as the run's files record it."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def default_run_dir() -> Path:
    """The parent directory of run directories when `--run-dir` is not given: `TL_RUN_DIR`, else `runs`."""
    return Path(os.environ.get("TL_RUN_DIR") or "runs")


def new_run_id() -> str:
    """run-YYYYmmdd-HHMMSS-xxxxxx: the time and 24 random bits, so runs started in the same second differ."""
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def pid_alive(pid: object) -> bool:
    """True when `pid` names a live process (one of another user's counts)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resume_hint(run_id: str, run_dir: Path) -> str:
    """The command that continues run `run_id` under `run_dir`."""
    default = default_run_dir()
    where = "" if Path(run_dir) == default or Path(run_dir).resolve() == default.resolve() else f" --run-dir {run_dir}"
    from shared.config import cli_command

    return f"{cli_command()} up --resume {run_id}{where} (make up ARGS='--resume {run_id}{where}')"


def is_run(run_path: Path) -> bool:
    """A launcher's run directory: it holds up.json, or a trainer's run.json."""
    from shared.runfiles import TRAINER_DIR

    return (run_path / RUN_FILE).exists() or (run_path / TRAINER_DIR / "run.json").exists()


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
        if not path.is_dir() or not is_run(path):
            known = sorted(p.name for p in path.parent.glob("*") if p.is_dir() and is_run(p))[-5:]
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
    if path.exists() and is_run(path):
        raise RunError(f"{path} already exists and holds a run; resume it with {resume_hint(run_id, run_dir)}, "
                       f"or choose another {source}")
    if path.exists():
        raise RunError(f"{path} already exists and holds no run; remove it, or choose another {source}")
    return run_id, path, False


class RunLock(FileLock):
    """The exclusive lock on `<run dir>/up.lock` (`tradeloop.locks.FileLock`). The launcher takes it for the whole
    run and passes the descriptor to every process it starts (the services, the embedded Redis): a lock lives as
    long as any descriptor of it, so the run stays locked until the last of them has exited, even when the launcher
    itself is killed."""

    @classmethod
    def acquire(cls, run_path: Path, wait_s: float = 0.0, mode: int = 0o600) -> "RunLock":
        path = Path(run_path) / LOCK_FILE
        try:
            return super().acquire(path, wait_s, mode)
        except Locked as exc:
            raise RunError(f"run {Path(run_path).name} is in use: {lock_holder(path, exc.holder)}; two processes "
                           "never write one run") from None


def lock_holder(path: Path, holder: dict | None = None) -> str:
    """Who holds a run's lock, in words, from what the holder wrote into it (`holder`, else read from `path`)."""
    doc = read_holder(path) if holder is None else holder
    pid = doc.get("pid")
    if pid_alive(pid):
        return f"tradeloop up pid {pid} (started {doc.get('started_at', '?')}: {doc.get('command', '?')}) holds it"
    return (f"its launcher (pid {pid}) has exited, but a process it started still holds the lock (a service or its "
            f"Redis shutting down); wait for it to exit (`fuser {path}` names it)")


def claim_run(run_id: str, run_path: Path, generated: bool) -> tuple[str, Path, RunLock]:
    """Create a new run's directory — exclusively: when two launchers name the same run, one gets it and the other
    is refused (a generated id is drawn again) — and lock it."""
    run_dir = run_path.parent
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunError(f"the run directory {run_dir} (--run-dir, TL_RUN_DIR) is a file, not a folder") from None
    except OSError as exc:
        raise RunError(f"the run directory {run_dir} (--run-dir, TL_RUN_DIR) cannot be made: "
                       f"{exc.strerror or exc}") from None
    for _ in range(5):
        path = run_dir / run_id
        try:
            path.mkdir()
        except OSError as exc:
            if not isinstance(exc, FileExistsError):
                raise RunError(f"the run directory {run_dir} (--run-dir, TL_RUN_DIR) cannot hold the run "
                               f"{path.name}: {exc.strerror or exc}") from None
            if not generated:
                raise RunError(f"{path} was created by another process just now; resume it with "
                               f"{resume_hint(run_id, run_dir)} once it is free, or choose another run id") from None
            run_id = new_run_id()
            continue
        # a resume of this id waits for up.json before it counts the directory as a run; hold the lock first
        return run_id, path, RunLock.acquire(path, wait_s=5.0)
    raise RunError(f"could not create a new run directory under {run_dir}")


def lock_resumed(run_path: Path) -> RunLock:
    """Lock an existing run for a resume; RunError when it is in use or not (yet) a run."""
    lock = RunLock.acquire(run_path)
    if not is_run(run_path):  # (a directory being created holds its lock until up.json is written)
        lock.release()
        raise RunError(f"{run_path} is not a run (yet): no {RUN_FILE}")
    return lock


def read_run_file(run_path: Path) -> dict:
    """The settings a run was started with (`up.json`); {} for a run without one."""
    try:
        return json.loads((Path(run_path) / RUN_FILE).read_text()).get("settings") or {}
    except (OSError, ValueError, AttributeError):
        return {}


def write_run_file(run_path: Path, run_id: str, settings: dict, resuming: bool) -> None:
    """Write up.json: the run's id and settings, when it was created and each time it was resumed."""
    record = {"run_id": run_id, "settings": settings}
    if resuming:
        try:
            old = json.loads((run_path / RUN_FILE).read_text())
        except (OSError, ValueError):
            old = {}
        record = {**old, **record, "resumed_at": [*old.get("resumed_at", []), timestamp()]}
    else:
        record["created_at"] = timestamp()
    (run_path / RUN_FILE).write_text(json.dumps(record, indent=2))


def refuse_changed(recorded: dict, given: dict, keys: tuple[str, ...], *, run: str = "a resumed run",
                   instead: str = "start a new run") -> None:
    """RunError, naming each flag with the run's value and the given one, when `given` sets a setting the run keeps
    for good (one of `keys`) to another value than `recorded`, what it was started with; a setting not given (None)
    or not recorded passes. The one rule of a resume: `tradeloop up --resume` and `tradeloop train` on its --out."""
    clash = [k for k in keys if given.get(k) is not None and k in recorded and given[k] != recorded[k]]
    if clash:
        flags = {k: "--" + k.replace("_", "-") for k in clash}
        raise RunError(f"{run} keeps " + ", ".join(f"{flags[k]} {recorded[k]}" for k in clash)
                       + " (it was started so; given " + ", ".join(f"{flags[k]} {given[k]}" for k in clash)
                       + "); drop " + ", ".join(flags.values()) + f" or {instead}")


def resumed_settings(recorded: dict, given: dict) -> dict:
    """A resumed run's settings: those given, else those it was started with, else the defaults. A setting the run
    keeps for good (`FIXED`) given with another value is a RunError (`refuse_changed`)."""
    refuse_changed(recorded, given, FIXED)
    return {k: given[k] if given.get(k) is not None else recorded.get(k, DEFAULTS[k]) for k in DEFAULTS}
