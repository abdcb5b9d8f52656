"""How many runs a study trains at once here: the cores and memory a CPU worker takes, the runs per GPU, and the
runs a worker trains in lockstep (`--parallel`, `--lockstep`; `tradeloop.study.spec.StudySpec` holds what they
resolve to)."""
from __future__ import annotations

import os
from typing import Any

from tradeloop.study.spec import StudyError

AUTO_RUNS_PER_GPU = 16
"""`--parallel auto` on CUDA: at most this many runs at once per visible GPU (and one per core; a worker each, or a
worker per `--lockstep` group); each GPU then keeps as many workers as its memory holds
(`tradeloop.study.worker.runs_that_fit`)."""


CPU_RUN_BYTES = 1 << 30
"""`--parallel auto` on a CPU: the host memory given to each worker (a `small`-preset worker held 0.55 GB RSS on the
project's 2-core VM; bench/README.md 2026-12-06 · d4d0c3a)."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else every core): the one count
    behind the study's worker and thread counts, so a study under `taskset` or a container's cpuset sizes itself
    to the cores it has, not to the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cpu_workers() -> int:
    """`--parallel auto` on a CPU: a worker per core this process may use (each with one torch thread: on the 2-core
    VM two workers trained 1.3–2.3× the epochs a second of one worker on both cores), at most as many as the
    available memory holds at `CPU_RUN_BYTES` each."""
    cores = usable_cores()
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        avail = None
    return max(1, min(cores, cores if avail is None else avail // CPU_RUN_BYTES))


AUTO_LOCKSTEP_CUDA = 2
"""`--lockstep auto` on CUDA: runs of one market and trainer config a local worker trains as one batched computation
(an on/off study's `on` and `off` of each seed and fold). On one H100, fourteen `full` runs at once read 1.88× one
run's epochs/s as seven such pairs and 1.64× as fourteen processes, the same warm machine (bench/README.md 2026-12-07
· 7a4839e)."""


def parse_lockstep(value: Any, device: str, remote: bool = False, where: str = "--lockstep") -> int:
    """Runs a local worker trains in lockstep: an integer 1–64 as given, or auto — `AUTO_LOCKSTEP_CUDA` on CUDA, 1 on
    a CPU (a worker per core trains more there) and where the runs go through Redis (`remote`: a Redis worker takes
    one run at a time)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return AUTO_LOCKSTEP_CUDA if str(device).startswith("cuda") and not remote else 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise StudyError(f"{where} must be a count of runs from 1 to 64 or auto, got {value!r}")
    return value


def parse_parallel(value: Any, device: str, where: str = "--parallel") -> int:
    """Runs at once here: an integer ≥ 0 as given, or auto — on a CPU `cpu_workers()`; on CUDA one worker per core,
    at most `AUTO_RUNS_PER_GPU` per visible GPU."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        if not str(device).startswith("cuda"):
            return cpu_workers()
        from tradeloop.study.worker import visible_gpus

        return max(1, min(usable_cores(), AUTO_RUNS_PER_GPU * max(len(visible_gpus()), 1)))
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else -1
    except (TypeError, ValueError):
        n = -1
    if n < 0:
        raise StudyError(f"{where} must be an integer ≥ 1 or auto (0: no local worker, with --redis), got {value!r}")
    return n
