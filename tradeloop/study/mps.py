"""A private CUDA MPS (Multi-Process Service) daemon for a study's workers on the GPU.

Without MPS the processes that share a GPU are time-sliced: one process's kernels run at a time, so P runs whose
small kernels each leave most SMs idle go no faster together than one after another. Under MPS the workers' kernels
share the GPU at once. The study starts its own control daemon (pipe and log directories of its own, so it neither
needs nor disturbs a system one), checks that a CUDA client can reach it, hands its directories to the workers,
and quits it when the runs are done. `--mps auto` (the default) does this when some GPU runs more than one worker
and `nvidia-cuda-mps-control` is installed; `off` never; `on` fails the study when MPS cannot start.

Under MPS a client's `CUDA_VISIBLE_DEVICES` counts among the devices the daemon sees: the daemon is started with
the study's own devices, and worker i gets the position of its GPU in that list. The daemon's directory is kept in
the study's status.json (`mps_dir`): a study killed before it could quit its daemon has that daemon quit when the
study is started again.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

EXE = "nvidia-cuda-mps-control"
PROBE = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"


class MpsError(RuntimeError):
    pass


def wanted(mode: str, device: str, workers: int, gpus: int) -> bool:
    """Whether the study should run its workers under MPS (`mode` auto|on|off)."""
    if mode == "off" or device == "cpu" or gpus < 1:
        return False
    if mode == "on":
        return True
    return workers > gpus


def held_to(share: int | None) -> str:
    """How the study's words name a worker's SM share: ", each run's kernels held to N % of the SMs" below 100."""
    return f", each run's kernels held to {share} % of the SMs" if share is not None and share < 100 else ""


class MpsDaemon:
    """Start with `start()` (False, and a reason in `why_not`, when it cannot), `env()` for the workers, `stop()`."""

    def __init__(self, exe: str | None = None):
        self.exe = exe or shutil.which(EXE)
        self.root: Path | None = None
        self.why_not = ""

    def env(self) -> dict[str, str]:
        assert self.root is not None
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}

    def client_env(self, share: int = 100) -> dict[str, str]:
        """`env()` for a worker; with `share` < 100 also `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`: each of its kernels
        may occupy at most that share of the GPU's SMs, so the kernels of more runs execute at once."""
        return {**self.env(), **({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(share)} if share < 100 else {})}

    def _control(self, *args: str, stdin: str | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run([self.exe, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **self.env()})

    def start(self) -> bool:
        if not self.exe:
            self.why_not = f"{EXE} is not installed"
            return False
        # a short path: the daemon's sockets live there (a Unix socket path holds ≤ 107 bytes)
        self.root = Path(tempfile.mkdtemp(prefix="tl-mps-"))
        for d in ("pipe", "log"):
            (self.root / d).mkdir()
        try:
            r = self._control("-d")
            if r.returncode != 0:
                self.why_not = f"{EXE} -d exited {r.returncode}: {(r.stderr or r.stdout).strip()[:200]}"
                self._cleanup()
                return False
            probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120,
                                   env={**os.environ, **self.env()})
        except (OSError, subprocess.SubprocessError) as exc:
            self.why_not = f"{EXE}: {exc}"
            self.stop()
            return False
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            self.why_not = f"a CUDA client could not run under the MPS daemon: {last[:200]}"
            self.stop()
            return False
        return True

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            self._control(stdin="quit\n", timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        self._cleanup()

    def _cleanup(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def quit_stale(root: str | None, exe: str | None = None) -> bool:
    """Quit the daemon an earlier start of the study left running in `root` (and remove its directories); False
    when there is none."""
    if not root or not Path(root, "pipe").is_dir() or not Path(root).name.startswith("tl-mps-"):
        return False
    d = MpsDaemon(exe)
    d.root = Path(root)
    if d.exe:
        d.stop()
    else:
        d._cleanup()
    return True


def client_gpus(gpus: list[str]) -> list[str]:
    """Under MPS, worker i's `CUDA_VISIBLE_DEVICES`: its GPU's position among the daemon's devices."""
    return [str(i) for i in range(len(gpus))]
