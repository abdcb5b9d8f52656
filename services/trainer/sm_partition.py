"""A run's training iterations on a slice of the GPU's SMs (a CUDA green context), for runs that share a GPU.

Several runs side by side on one GPU (`tradeloop study --parallel P`, under CUDA MPS) each launch ~730 small kernels an
iteration; each kernel spreads over the SMs it is given, so without a limit the runs' kernels contend for the same
SMs instead of running beside each other (bench/README.md, entry `799ab21`). MPS's per-process limit
(`--mps-share`) frees the SMs for the iterations but holds every other phase of the run — the embedding refresh, the
evaluation, the writes — to it too (entry `55afb1c`). A green context limits only the work launched on its streams:
the iterations (their CUDA graph is captured and replayed on the partition's stream) run on `sms` SMs, everything
else on the whole GPU.

`partition_streams(device, n)` reads `TL_ITERATION_SMS` (SMs a run's iterations may use; unset or 0: no partition) and
`TL_ITERATION_SLOT` (the run's place among the runs of its GPU: runs in different slots get disjoint SMs, the
device's SMs cut into ⌊SMs / sms⌋ partitions taken in turn). Driver API through ctypes (`libcuda`, CUDA ≥ 12.4:
cuDevSmResourceSplitByCount, cuDevResourceGenerateDesc, cuGreenCtxCreate, cuGreenCtxStreamCreate); no other
dependency. Where the driver lacks green contexts the stream is None and the run uses the whole GPU.

A graph keeps the SMs of the stream it was captured on, not of the one it is launched into (bench/sm_partition_probe.py
on an H100: captured on a 16-SM partition 6.8 ms wherever replayed, against 1.0 ms on the whole GPU), so the trainer
captures on the partition. Measured (bench/README.md 2026-12-05 · 15b1279): on an H100 with four `full` runs at once,
24 SMs read 1.75× one run's epochs/s against 1.76× without; ten runs on an H200 are not measured yet.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:                # torch is imported where a stream is made: the study process reads only the names
    import torch

ENV_SMS, ENV_SLOT = "TL_ITERATION_SMS", "TL_ITERATION_SLOT"
RESOURCE_STRIDE = 144
"""sizeof(CUdevResource): `type`, 92 bytes of padding, a 48-byte payload (CUDA 12; in CUDA 13 a 40-byte payload and
the `nextResource` pointer): the stride of the array the split writes its groups into."""
NEXT_OFFSET = 136
"""Byte offset of CUDA 13's `nextResource` pointer in a CUdevResource."""
RESOURCE_BYTES = 1024
"""Room for one CUdevResource the driver writes alone (more than it needs is harmless)."""
SM_COUNT_OFFSET = 96
"""Byte offset of `sm.smCount` in a CUdevResource: `type` (4 bytes) and 92 bytes of internal padding before it."""
RESOURCE_SM, GREEN_DEFAULT_STREAM, STREAM_NON_BLOCKING = 1, 1, 1

_held: dict[tuple[int, int, int], tuple[ctypes.c_void_p, list[torch.cuda.ExternalStream]] | None] = {}
"""The partitions this process made ((device, sms, slot) → (green context, its streams); None: refused), kept for
the process's lifetime."""


class PartitionError(RuntimeError):
    """The driver refused a step of making the partition (named in the message)."""


def requested() -> tuple[int, int] | None:
    """(sms, slot) from the environment, None when no partition is asked for."""
    raw = os.environ.get(ENV_SMS, "").strip()
    if not raw or raw == "0":
        return None
    try:
        sms, slot = int(raw), int(os.environ.get(ENV_SLOT, "0") or 0)
    except ValueError:
        raise PartitionError(f"{ENV_SMS}={raw!r} / {ENV_SLOT}={os.environ.get(ENV_SLOT)!r}: SMs and slot must be "
                             f"integers") from None
    if sms < 0 or slot < 0:
        raise PartitionError(f"{ENV_SMS}={sms}, {ENV_SLOT}={slot}: must be ≥ 0")
    return sms, slot


def _call(lib, name: str, *args) -> None:
    rc = getattr(lib, name)(*args)
    if rc != 0:
        raise PartitionError(f"{name} returned CUresult {rc}")


def sm_count(resource: ctypes.Array) -> int:
    return int.from_bytes(bytes(resource[SM_COUNT_OFFSET:SM_COUNT_OFFSET + 4]), "little")


def make_partition(index: int, sms: int, slot: int) -> tuple[ctypes.c_void_p, int, int]:
    """(green context, SMs it holds, the partitions the device was cut into) for `slot` on device `index`: the
    device's SMs cut into as many groups of `sms` as fit (rounded up by the driver to its granularity, 8 on
    Hopper) in one split, group slot mod count."""
    lib = _lib()
    version = ctypes.c_int()
    _call(lib, "cuDriverGetVersion", ctypes.byref(version))
    if version.value < 12040:
        raise PartitionError(f"driver API {version.value} has no green contexts (needs 12040)")
    dev = ctypes.c_int()
    _call(lib, "cuDeviceGet", ctypes.byref(dev), index)
    whole = ctypes.create_string_buffer(RESOURCE_BYTES)
    _call(lib, "cuDeviceGetDevResource", dev, whole, RESOURCE_SM)
    n = ctypes.c_uint(max(1, sm_count(whole) // max(sms, 1)))
    groups, left = ctypes.create_string_buffer(RESOURCE_STRIDE * n.value), ctypes.create_string_buffer(RESOURCE_BYTES)
    _call(lib, "cuDevSmResourceSplitByCount", groups, ctypes.byref(n), whole, left, 0, sms)
    if n.value < 1:
        raise PartitionError(f"cuDevSmResourceSplitByCount: no group of {sms} SMs on device {index}")
    k = slot % n.value
    group = ctypes.create_string_buffer(bytes(groups[k * RESOURCE_STRIDE:(k + 1) * RESOURCE_STRIDE]), RESOURCE_BYTES)
    if version.value >= 13000:     # CUDA 13's `nextResource` may link the split's groups: this one stands alone
        ctypes.memset(ctypes.byref(group, NEXT_OFFSET), 0, 8)
    desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
    _call(lib, "cuDevResourceGenerateDesc", ctypes.byref(desc), group, 1)
    _call(lib, "cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, GREEN_DEFAULT_STREAM)
    return ctx, sm_count(group), n.value


def _lib():
    return ctypes.CDLL("libcuda.so.1")


def green_stream(ctx: ctypes.c_void_p, device: torch.device) -> torch.cuda.ExternalStream:
    """A new stream of the green context `ctx`: kernels launched on it run on the context's SMs alone."""
    import torch

    handle = ctypes.c_void_p()
    _call(_lib(), "cuGreenCtxStreamCreate", ctypes.byref(handle), ctx, STREAM_NON_BLOCKING, 0)
    return torch.cuda.ExternalStream(int(handle.value), device=device)


def partition_streams(device: torch.device, n: int) -> list[torch.cuda.ExternalStream] | None:
    """`n` streams of the run's partition (`TL_ITERATION_SMS` SMs, slot `TL_ITERATION_SLOT`), the same ones on
    every call, or None (not asked for, not CUDA, or no green contexts in this driver: the iterations use the whole
    GPU, and a line on stderr says why)."""
    try:
        ask = requested()
    except PartitionError as exc:
        print(f"{exc}; the iterations use the whole GPU", file=sys.stderr)
        return None
    if ask is None or device.type != "cuda":
        return None
    import torch

    sms, slot = ask
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, sms, slot)
    if key not in _held:
        torch.zeros(1, device=device)                # the primary context exists before the green one is cut
        try:
            ctx, got, groups = make_partition(index, sms, slot)
        except (OSError, AttributeError, PartitionError) as exc:
            print(f"{ENV_SMS}={sms}: no SM partition ({exc}); the iterations use the whole GPU", file=sys.stderr)
            _held[key] = None
            return None
        print(f"{ENV_SMS}={sms}: slot {slot}'s iterations on {got} SMs (one of {groups} partitions)",
              file=sys.stderr)
        _held[key] = (ctx, [])
    if _held[key] is None:
        return None
    ctx, streams = _held[key]
    while len(streams) < n:
        streams.append(green_stream(ctx, device))
    return streams[:n]
