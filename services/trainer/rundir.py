"""The trainer's run directory, one definition of its files:

    DIR/run.json                              dataset, seed, config, split and their hashes (`write_run_json`)
    DIR/history.jsonl                         one JSON record per epoch, appended (`append_history`; read by
                                              `shared.runfiles.read_history`)
    DIR/checkpoints/epoch-NNNN.safetensors    agent weights + metadata (what the evaluator loads; sha256 sidecar)
    DIR/checkpoints/epoch-NNNN.state.safetensors   trainer state for resume (sha256 sidecar)

and the one resume check (`latest_epoch`): the highest epoch whose two files match their sha256 sidecars.

Imports only the standard library and `shared.checkpoints` (no torch).
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("tradeloop.trainer")

RUN_JSON = "run.json"
HISTORY = "history.jsonl"
CHECKPOINTS = "checkpoints"


def checkpoint_path(run_dir: Path, epoch: int, state: bool = False) -> Path:
    """DIR/checkpoints/epoch-NNNN.safetensors, or with `state` its trainer state's file."""
    return Path(run_dir) / CHECKPOINTS / f"epoch-{epoch:04d}{'.state' if state else ''}.safetensors"


def epoch_of(path: Path) -> int:
    """The epoch of a checkpoint file name (epoch-NNNN.safetensors or epoch-NNNN.state.safetensors)."""
    return int(Path(path).name.split("-")[1].split(".")[0])


def read_run_json(run_dir: Path) -> dict | None:
    """DIR/run.json, None when there is none; ValueError naming the file when it is not a JSON object."""
    p = Path(run_dir) / RUN_JSON
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: not valid JSON ({exc}); the run's settings cannot be read") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{p}: expected a JSON object of the run's settings, got {type(meta).__name__}")
    return meta


def write_run_json(run_dir: Path, meta: dict) -> None:
    """Create DIR and write its run.json."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_JSON).write_text(json.dumps(meta, indent=2))


def finite(d: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf floats → None (JSON on the wire and in history.jsonl is NaN-free)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def append_history(run_dir: Path, record: dict) -> None:
    """Append one epoch's record to DIR/history.jsonl (non-finite floats as null)."""
    with open(Path(run_dir) / HISTORY, "a") as f:
        f.write(json.dumps(finite(record), allow_nan=False) + "\n")


def latest_epoch(run_dir: Path) -> int:
    """Highest epoch whose checkpoint AND trainer state both exist and match their sha256 sidecars (0: none): the
    epoch a run resumes from, for `tradeloop train` and the trainer service alike.

    `save_checkpoint` writes a file atomically and then its sidecar; a trainer killed inside `save_epoch` can leave
    the weights of epoch e without its state, or a file without its sidecar: such an epoch is incomplete and is
    trained again, never loaded. A file whose sidecar it does not match, or a sidecar that does not hold a sha256
    digest, was changed after it was written, which no kill does (both are written atomically): CheckpointError
    naming it, nothing touched (training again would overwrite the run's checkpoints). Temp files of a killed
    write are removed (only the trainer writes here)."""
    from shared.checkpoints import CheckpointError, _read_sidecar, checkpoint_sha256, sidecar_path

    ck = Path(run_dir) / CHECKPOINTS
    for tmp in ck.glob(".epoch-*.tmp"):
        tmp.unlink(missing_ok=True)
    for e in sorted({epoch_of(p) for p in ck.glob("epoch-[0-9]*.state.safetensors")}, reverse=True):
        for p in (checkpoint_path(run_dir, e), checkpoint_path(run_dir, e, state=True)):
            try:
                want = _read_sidecar(p) if p.exists() else None
            except CheckpointError:
                raise CheckpointError(str(p), f"sidecar {sidecar_path(p).name} does not hold a sha256 digest: it was "
                                      "changed after it was written; restore it (or its run) from a copy, or train "
                                      "into a new directory — nothing was touched") from None
            if want is None:
                log.warning("%s is incomplete (no sha256 sidecar: a kill during the checkpoint write?): epoch %d "
                            "is trained again from the latest complete epoch before it", p, e)
                break
            got = checkpoint_sha256(p.read_bytes())
            if got != want:
                raise CheckpointError(str(p), f"sha256 {got[:16]}… differs from its sidecar's {want[:16]}…: the "
                                      "file was changed after it was written; restore it (or its run) from a copy, "
                                      "or train into a new directory — nothing was touched")
        else:
            return e
    return 0
