"""Checkpoints: safetensors files with a checked sha256 — never pickle, never `torch.load`.

Format. A checkpoint is a plain safetensors file (8-byte little-endian header length, a JSON header,
raw tensor bytes). Our metadata dict is stored as one JSON string in the header's `__metadata__` map
under the key "tradeloop" (safetensors metadata values must be strings).

Integrity. `save_checkpoint` returns the sha256 of the file's bytes and writes it to a sidecar
`<path>.sha256` (the `sha256sum` format: "<hex>  <name>"). `load_checkpoint` checks the bytes against
the expected sha256 (the argument, else the sidecar) *before* parsing anything, then validates the
header by hand (sane size, JSON object, offsets inside the file) before handing the bytes to the
safetensors library. A pickle or a zip (what `torch.save` writes) is refused with a clear error: it is
never unpickled.

Writes are atomic: a temporary file in the same directory, fsync, `os.replace`, then the sidecar the
same way, then an fsync of the directory.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    import torch

# torch and safetensors are imported inside the functions that need them, so the plumbing that only
# hashes bytes (shared.store, shared.bus) stays importable — and fast to import — without torch.

METADATA_KEY = "tradeloop"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own bound on the JSON header
_HEADER_LEN_BYTES = 8

PathOrBytes = Union[str, os.PathLike, bytes, bytearray, memoryview]


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or parsed; the message names the source and the reason."""

    def __init__(self, source: str, reason: str):
        self.source = source
        self.reason = reason
        super().__init__(f"checkpoint {source}: {reason}")


def checkpoint_sha256(data: bytes) -> str:
    """sha256 hex digest of a checkpoint's bytes (the same digest `save_checkpoint` returns)."""
    return hashlib.sha256(data).hexdigest()


def sidecar_path(path: str | os.PathLike) -> Path:
    """The `<path>.sha256` file written next to a checkpoint."""
    p = Path(path)
    return p.with_name(p.name + ".sha256")


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: temp file in the same directory + fsync + os.replace. A failed write (a
    full disk) removes the temp file, leaves `path` as it was and raises OSError with the same errno and the
    strerror "writing <path>: <reason>"."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise OSError(exc.errno, f"writing {path}: {exc.strerror or exc}") from None
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not supported on this platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict) -> bytes:
    """Serialise tensors + metadata to safetensors bytes (what `save_checkpoint` writes to disk)."""
    import torch
    from safetensors.torch import save as _st_save

    if not isinstance(tensors, dict) or not all(isinstance(k, str) for k in tensors):
        raise TypeError("tensors must be a dict[str, torch.Tensor]")
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"tensors must be torch.Tensor values; not a tensor: {bad}")
    try:
        meta_json = json.dumps(metadata, allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint metadata must be JSON-serialisable (finite floats): {exc}") from exc
    # safetensors refuses tensors that share storage and non-contiguous ones: give it private CPU copies.
    # [any shape] → same shape, contiguous, on the CPU
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    return _st_save(plain, metadata={METADATA_KEY: meta_json})


def save_checkpoint(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict) -> str:
    """Write a safetensors checkpoint atomically, plus its `<path>.sha256` sidecar.

    tensors: name → tensor (any device/dtype safetensors supports; copied to CPU).
    metadata: a JSON-serialisable dict, stored in the header under `__metadata__["tradeloop"]`.
    Returns the sha256 hex digest of the file's bytes.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = checkpoint_to_bytes(tensors, metadata)
    digest = checkpoint_sha256(data)
    _atomic_write(path, data)
    _atomic_write(sidecar_path(path), f"{digest}  {path.name}\n".encode())
    _fsync_dir(path.parent)
    return digest


def load_error_reason(exc: BaseException, limit: int | None = 200) -> str:
    """The first informative line of a failed load's message (cut to `limit` characters; None: whole): torch's
    `load_state_dict` opens with a header ending in a colon ("Error(s) in loading state_dict for Agent:") and
    names what is wrong on the lines after it ("Missing key(s) in state_dict: …", "size mismatch for …")."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = next((ln for ln in lines if not ln.endswith(":")), lines[0] if lines else type(exc).__name__)
    return line if limit is None or len(line) <= limit else line[:limit - 1] + "…"


def _read_sidecar(path: Path) -> str | None:
    side = sidecar_path(path)
    if not side.exists():
        return None
    text = side.read_text(encoding="utf-8", errors="replace").strip()
    digest = text.split()[0].lower() if text else ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise CheckpointError(str(path), f"sidecar {side.name} does not hold a sha256 hex digest")
    return digest


def _sniff_foreign(data: bytes) -> str | None:
    """Name a known non-safetensors format from its first bytes (never parsing it). Bytes shaped as a safetensors
    file (a header length within the file and the bound, then '{') are not foreign, whatever their first byte: a
    header of 1 152 bytes starts 0x80 0x04, as a protocol-4 pickle does."""
    n = int.from_bytes(data[:_HEADER_LEN_BYTES], "little") if len(data) >= _HEADER_LEN_BYTES else -1
    if 0 < n <= MAX_HEADER_BYTES and _HEADER_LEN_BYTES + n <= len(data) and data[_HEADER_LEN_BYTES:][:1] == b"{":
        return None
    if data[:4] == b"PK\x03\x04":
        return "a zip archive (what torch.save writes)"
    if data[:1] == b"\x80" and len(data) > 1 and data[1] <= 5:
        return "a Python pickle"
    return None


def _validate_header(data: bytes, source: str) -> dict:
    """Parse and check the safetensors header by hand; return it as a dict."""
    not_st = "is not a safetensors file and will not be unpickled"
    foreign = _sniff_foreign(data)
    if foreign:
        raise CheckpointError(source, f"{foreign} {not_st}")
    if len(data) < _HEADER_LEN_BYTES + 2:
        raise CheckpointError(source, f"truncated: {len(data)} bytes is too short for a safetensors file")
    n = int.from_bytes(data[:_HEADER_LEN_BYTES], "little")
    if n > MAX_HEADER_BYTES:
        raise CheckpointError(source, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte bound; it {not_st}")
    if _HEADER_LEN_BYTES + n > len(data):
        raise CheckpointError(source, f"truncated: header says {n} bytes but the file has {len(data) - 8} after it")
    raw = data[_HEADER_LEN_BYTES:_HEADER_LEN_BYTES + n]
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(source, f"header is not valid JSON ({exc}); it {not_st}") from None
    if not isinstance(header, dict):
        raise CheckpointError(source, "header is not a JSON object")
    body = len(data) - _HEADER_LEN_BYTES - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= info.keys()):
            raise CheckpointError(source, f"header entry {name!r} lacks dtype/shape/data_offsets")
        off = info["data_offsets"]
        if not (isinstance(off, list) and len(off) == 2 and all(isinstance(o, int) for o in off)
                and 0 <= off[0] <= off[1] <= body):
            raise CheckpointError(source, f"tensor {name!r} has data offsets {off} outside the {body}-byte body"
                                          " (truncated file?)")
    return header


def load_checkpoint(path_or_bytes: PathOrBytes,
                    expected_sha256: str | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a checkpoint after checking its sha256; returns (tensors on CPU, metadata dict).

    The sha256 is checked against `expected_sha256` when given, else (for a path) against the
    `<path>.sha256` sidecar; a path with neither is refused. Bytes with no expected digest are parsed
    unchecked (the caller had nothing to check against). Raises CheckpointError naming the source.
    """
    if isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
        data = bytes(path_or_bytes)
        source = f"<{len(data)} bytes>"
        expected = expected_sha256
    else:
        path = Path(path_or_bytes)
        source = str(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(source, "file not found") from None
        except OSError as exc:
            raise CheckpointError(source, f"cannot read: {exc.strerror or exc}") from None
        expected = expected_sha256 if expected_sha256 is not None else _read_sidecar(path)
        if expected is None:
            raise CheckpointError(source, "no sha256 to check against (no expected digest, no "
                                          f"{sidecar_path(path).name})")
    if expected is not None:
        actual = checkpoint_sha256(data)
        if actual != expected.strip().lower():
            raise CheckpointError(source, f"sha256 mismatch: expected {expected.strip().lower()}, got {actual}")

    header = _validate_header(data, source)
    meta_map = header.get("__metadata__") or {}
    if not isinstance(meta_map, dict) or METADATA_KEY not in meta_map:
        raise CheckpointError(source, f"header has no __metadata__[{METADATA_KEY!r}] (not a tradeloop checkpoint)")
    try:
        metadata = json.loads(meta_map[METADATA_KEY])
    except (TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(source, f"metadata is not valid JSON: {exc}") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(source, "metadata is not a JSON object")
    from safetensors.torch import load as _st_load

    try:
        tensors = _st_load(data)
    except Exception as exc:  # the library's own checks (dtype, shape × size, overlaps)
        raise CheckpointError(source, f"safetensors refused it: {exc}") from None
    return tensors, metadata
