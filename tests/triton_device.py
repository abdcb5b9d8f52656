"""Where the Triton kernels' tests run: a CUDA GPU, or the CPU under Triton's interpreter (`TRITON_INTERPRET=1` with
triton importable, as `make test`'s second pytest run sets up), else nowhere."""
from __future__ import annotations

import os

import torch


def triton_device() -> str | None:
    """"cuda", "cpu" (the interpreter) or None (skip)."""
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
            return "cpu"
        except ImportError:
            return None
    return None
