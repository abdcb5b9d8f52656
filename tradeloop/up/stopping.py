"""The interrupt and resume path in words: what a stop waits for (from the trainer's /status, read just before it
gets SIGTERM) and what an interrupted trainer saved (the header of `checkpoints/interrupted.safetensors`), so the
launcher can say both; `runs.resume_hint` is the command that continues the run.
"""
from __future__ import annotations

import json
from pathlib import Path

import httpx

from tradeloop.up.progress import get_json
from tradeloop.up.supervisor import GRACE_S, TRAINER_GRACE_S


def stopping_note(urls: dict[str, str]) -> str:
    """What stopping waits for, from the trainer's /status (read just before it is sent SIGTERM)."""
    with httpx.Client(timeout=1.0) as c:
        st = get_json(c, f"{urls['trainer']}/status") or {}
    phase = st.get("phase")
    if phase == "training":
        it = f" (iteration {st.get('iteration', 0)}/{st.get('iterations', '?')})" if st.get("iterations") else ""
        what = (f"the trainer stops epoch {st.get('training_epoch')} at its next iteration boundary{it} and saves "
                f"its state there")
    elif phase == "publishing":
        what = f"the trainer finishes publishing epoch {st.get('training_epoch')}"
    elif phase is None:
        what = "the trainer (not answering) stops"
    else:
        what = f"the trainer ({phase}) stops; nothing of it to save"
    return (f"{what} (up to {TRAINER_GRACE_S:.0f} s); the evaluator and feedback services finish the message in hand "
            f"(up to {GRACE_S:.0f} s). Ctrl-C again kills them now (the trainer's epoch in hand then restarts from "
            "its last saved state)")


def interrupted_note(run_path: Path, since: float) -> str | None:
    """What the trainer saved when it was stopped mid-epoch (the metadata of checkpoints/interrupted.safetensors
    written after `since`), in words."""
    from safetensors import SafetensorError, safe_open

    from services.trainer.checkpoint import INTERRUPTED
    from services.trainer.rundir import CHECKPOINTS
    from shared.runfiles import TRAINER_DIR
    path = run_path / TRAINER_DIR / CHECKPOINTS / INTERRUPTED
    try:
        if path.stat().st_mtime < since:
            return None
        with safe_open(str(path), framework="numpy") as f:
            meta = json.loads((f.metadata() or {})["tradeloop"])
        p = meta["progress"]
        return (f"the trainer saved epoch {p['epoch']} at iteration {p['iteration']}/{p['iterations']} "
                f"({path}); a resume finishes the epoch from there")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):
        return None
