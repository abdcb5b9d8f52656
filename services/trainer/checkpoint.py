"""Checkpoints (safetensors only): an epoch's agent weights (what the evaluator loads) and trainer state (target
network, optimizer, replay, tracker and RNG state flattened into tensors + JSON metadata), an epoch interrupted at
an iteration boundary, resume, a feedback rollback's restore, and pruning.

Owns: the checkpoint contents and metadata, `EpochProgress`. Imports: torch, `shared.checkpoints`,
`services.trainer.{state, buffers, rundir}`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from shared.checkpoints import CheckpointError, load_checkpoint, load_error_reason, save_checkpoint, sidecar_path
from services.trainer.buffers import refresh_embeddings
from services.trainer.rundir import CHECKPOINTS, checkpoint_path, epoch_of
from services.trainer.state import TrainState, restart_fresh

log = logging.getLogger("tradeloop.trainer")

AGENT_KIND, STATE_KIND, INTERRUPTED_KIND = "agent", "trainer_state", "interrupted_epoch"
"""The metadata "kind" of an epoch's weights, of its trainer state and of an interrupted epoch's file."""


@dataclass
class EpochProgress:
    """How far an epoch got before it was interrupted at an iteration boundary: with the trainer state saved there
    (`save_interrupted`), what `train_epoch(resume=…)` needs to finish it."""

    epoch: int
    """The epoch in progress (1-based; `state.epoch` is the last complete one, epoch − 1)."""
    iteration: int
    """Iterations done; the resumed epoch runs iterations `iteration` … iterations − 1."""
    iterations: int
    updates: int
    env_steps: int
    """Account-steps collected in this epoch so far."""
    seconds: float
    phases: dict[str, float]
    """`PhaseClock.totals()` so far."""
    knobs: dict
    """The knobs in effect at the boundary (`Knobs.to_dict()`)."""



def _rng_tensor(state_bytes: torch.Tensor) -> torch.Tensor:
    return state_bytes.detach().cpu().to(torch.uint8).clone()


def agent_metadata(state: TrainState, run_meta: dict) -> dict:
    """Metadata of an agent checkpoint: what the evaluator needs to rebuild and trust it."""
    return {"kind": AGENT_KIND, "epoch": state.epoch, "agent_config": state.cfg.agent.to_dict(),
            "config_hash": state.cfg.hash(), "dataset": run_meta.get("dataset"),
            "split": run_meta.get("split"), "split_hashes": run_meta.get("split_hashes"),
            "seed": run_meta.get("seed"), "update_step": state.update_step,
            "knobs": state.knobs.to_dict() if state.knobs is not None else None,
            "costs_bps": state.cfg.costs_bps}


def policy_weights(state: TrainState) -> dict[str, torch.Tensor]:
    """The weights an epoch's checkpoint holds: the agent's, its parameters replaced by their moving average
    (`TrainState.ema`, `TrainConfig.policy_ema`) when there is one."""
    w = {k: v.detach().contiguous() for k, v in state.agent.state_dict().items()}
    if state.ema is not None:
        w.update({k: v.detach().contiguous() for k, v in state.ema.named_parameters()})
    return w


def save_epoch(state: TrainState, run_dir: Path, run_meta: dict) -> tuple[Path, str]:
    """Write DIR/checkpoints/epoch-NNNN.safetensors (+ .state.safetensors); returns (path, sha256)."""
    path, sha, write = start_save_epoch(state, run_dir, run_meta, background=False)
    write.wait()
    return path, sha


class StateWrite:
    """The write of an epoch's trainer-state file (`start_save_epoch`), on a thread of its own or already done:
    `wait()` returns once the file and its sidecar are complete (re-raising the write's error) and gives the seconds
    it waited."""

    def __init__(self, write: Callable[[], object], background: bool):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(write,), name="state-write", daemon=True)
        if background:
            self.thread.start()
        else:
            self._run(write)

    def _run(self, write: Callable[[], object]) -> None:
        try:
            write()
        except BaseException as exc:     # noqa: BLE001 - re-raised by wait() in the thread that waits
            self.error = exc

    def wait(self) -> float:
        t0 = time.perf_counter()
        if self.thread.ident is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        return time.perf_counter() - t0


def start_save_epoch(state: TrainState, run_dir: Path, run_meta: dict, background: bool = True
                     ) -> tuple[Path, str, StateWrite]:
    """`save_epoch` with its trainer state written on a thread: returns (path, sha256, the state's write) once the
    weights' file is complete — what the evaluator loads — so an evaluation can run while the state is written.
    Its tensors and metadata are gathered before it returns (the host RNG's state among them); the device tensors
    are read by the thread, so nothing may change the run's state until `wait()` has returned. A kill before the
    state is complete leaves the epoch incomplete (`rundir.latest_epoch`): a resume trains it again."""
    path = checkpoint_path(run_dir, state.epoch)
    path.parent.mkdir(parents=True, exist_ok=True)
    sha = save_checkpoint(path, policy_weights(state), agent_metadata(state, run_meta))
    target = checkpoint_path(run_dir, state.epoch, state=True)
    tensors, meta = _state_tensors(state), {"kind": STATE_KIND, **_state_meta(state)}
    return path, sha, StateWrite(lambda: save_checkpoint(target, tensors, meta), background)


def _state_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """The trainer state beside the agent's weights: target net, optimizer (flattened), replay, tracker, RNG."""
    t: dict[str, torch.Tensor] = {f"target.{k}": v.detach().contiguous() for k, v in state.target.state_dict().items()}
    if state.ema is not None:    # the checkpoint holds the average: the online weights training goes on from are here
        t.update({f"online.{k}": v.detach().contiguous() for k, v in state.agent.state_dict().items()})
        t.update({f"ema.{k}": v.detach().contiguous() for k, v in state.ema.named_parameters()})
        if state.cfg.policy_swa > 0:
            t["swa.count"] = torch.tensor(state.swa_count, dtype=torch.int64)
    names = {p: n for n, p in state.agent.named_parameters()}
    for p, st in state.opt.state.items():
        for k, v in st.items():
            t[f"opt.{names[p]}.{k}"] = torch.as_tensor(v).detach().contiguous()
    t.update({f"replay.{k}": narrow_ints(v.contiguous()) for k, v in state.replay.state_tensors().items()})
    t.update({f"tracker.{k}": v.contiguous() for k, v in state.env.tracker.state_tensors().items()})
    t["rng.generator"] = _rng_tensor(state.generator.get_state())
    t["rng.torch"] = _rng_tensor(torch.get_rng_state())
    t["buf.entropy_coef"] = state.buffers.entropy_coef.detach().clone()
    return t


NARROW = (torch.int8, torch.int16, torch.int32)
"""The integer dtypes a saved int64 tensor may take (the narrowest that holds its values)."""


def narrow_ints(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor in the narrowest dtype of `NARROW` that holds every one of its values, else itself (and any
    other tensor as it is): the replay's bar indices, actions and regimes take an eighth to a half of their bytes in
    the trainer state's file. Loading copies them back into the ring's int64 buffers (`Replay.load_state`), so the
    values, and a resumed run, are the same."""
    if t.dtype != torch.int64 or t.numel() == 0:
        return t
    lo, hi = (int(x) for x in torch.aminmax(t))
    for dt in NARROW:
        if torch.iinfo(dt).min <= lo and hi <= torch.iinfo(dt).max:
            return t.to(dt)
    return t


def _state_meta(state: TrainState) -> dict:
    return {"epoch": state.epoch, "update_step": state.update_step, "env_steps": state.env_steps,
            "learn_from": state.learn_from,
            "replay": state.replay.state_meta(), "group_ages": [g["age"] for g in state.opt.param_groups],
            "config_hash": state.cfg.hash()}


INTERRUPTED = "interrupted.safetensors"
"""checkpoints/ file of an epoch interrupted at an iteration boundary: weights, trainer state and `EpochProgress`."""


def save_interrupted(state: TrainState, run_dir: Path, progress: EpochProgress, record: dict | None = None) -> Path:
    """Write DIR/checkpoints/interrupted.safetensors (atomically, with its sha256 sidecar): the agent, the trainer
    state and the epoch's running sums at the boundary where `progress` stopped, and `record` (the caller's
    notes on the epoch: where its knobs came from). Never published: it is not an epoch's checkpoint."""
    env, buf = state.env, state.buffers
    t = {f"agent.{k}": v.detach().contiguous() for k, v in state.agent.state_dict().items()}
    t.update(_state_tensors(state))
    t["epoch.metric_sums"] = buf.metric_sums.detach().clone()
    t["epoch.trades"] = torch.stack([env.trade_sum, env.trade_sq, env.trade_n]).detach().clone()
    path = Path(run_dir) / CHECKPOINTS / INTERRUPTED
    save_checkpoint(path, t, {"kind": INTERRUPTED_KIND, **_state_meta(state), "progress": asdict(progress),
                              "record": record or {}})
    return path


def read_interrupted(run_dir: Path, epoch_done: int, config_hash: str) -> tuple[dict, dict] | None:
    """(tensors, metadata) of DIR/checkpoints/interrupted.safetensors when it continues the last complete epoch
    `epoch_done` under the same config and its sha256 checks (the metadata with "path": the file's, for
    `restore_interrupted`'s errors); else None. A file of another epoch or config is stale
    (the run went on past it): removed, logged at INFO. A file that cannot be trusted or read (a sha256 mismatch —
    a change after the file and its sidecar were written, or a kill between those two writes —, a bad header,
    another kind of file) is logged as a WARNING with the reason and renamed aside with its sidecar (`set_aside`;
    the one set aside before it is deleted then: at most one stays, the latest). Either way the run continues from
    its last complete epoch."""
    path = Path(run_dir) / CHECKPOINTS / INTERRUPTED
    if not path.exists():
        return None
    try:
        tensors, meta = load_checkpoint(path)
        if meta.get("kind") != INTERRUPTED_KIND:
            raise CheckpointError(str(path), f"its metadata kind is {meta.get('kind')!r}, not an interrupted "
                                             "epoch's (files swapped?)")
        try:
            epoch = int(meta["epoch"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(str(path), f"its metadata epoch is {meta.get('epoch')!r}, not a number") from None
    except CheckpointError as exc:
        for old in path.parent.glob(f"{INTERRUPTED}.bad-*"):      # one set aside at most: each holds a replay
            old.unlink(missing_ok=True)
        aside = set_aside(path)
        log.warning("%s: %s; renamed to %s (with its sidecar): the run continues from epoch %d", path, exc.reason,
                    aside.name, epoch_done)
        return None
    if epoch == epoch_done and meta.get("config_hash") == config_hash:
        return tensors, {**meta, "path": str(path)}
    log.info("%s continues epoch %d under config %s, not epoch %d under this run's config: removed (stale)",
             path, epoch, str(meta.get("config_hash"))[:12], epoch_done)
    remove_checkpoint(path)
    return None


def set_aside(path: Path) -> Path:
    """Rename a checkpoint that cannot be trusted, and its sidecar, to `<name>.bad-<UTC time>` (a name nothing
    loads, prunes or overwrites), keeping it for a look; returns the new path."""
    path = Path(path)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside, n = path.with_name(f"{path.name}.bad-{stamp}"), 1
    while aside.exists() or sidecar_path(aside).exists():
        n += 1
        aside = path.with_name(f"{path.name}.bad-{stamp}-{n}")
    side = sidecar_path(path)
    if side.exists():
        os.replace(side, sidecar_path(aside))
    os.replace(path, aside)
    return aside


@contextmanager
def _loading(path: Path) -> Iterator[None]:
    """Tensors of `path` that do not fit the state they are loaded into (torch's `load_state_dict` and `copy_`
    errors, a missing tensor): CheckpointError naming the file and the first informative line of the error."""
    try:
        yield
    except (CheckpointError, torch.OutOfMemoryError):
        raise
    except (RuntimeError, KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(str(path), f"does not fit this run's agent or trainer state: "
                                         f"{load_error_reason(exc)}") from None


def restore_interrupted(state: TrainState, tensors: dict, meta: dict) -> EpochProgress:
    """Load `read_interrupted`'s agent, trainer state and epoch sums into a freshly built `state` (same config);
    returns the progress to pass to `train_epoch(resume=…)`. CheckpointError naming the file when its tensors do
    not fit."""
    dev = state.device
    with _loading(Path(meta.get("path") or Path(CHECKPOINTS) / INTERRUPTED)):
        state.agent.load_state_dict({k[len("agent."):]: v.to(dev) for k, v in tensors.items()
                                     if k.startswith("agent.")})
        _load_state(state, tensors, meta)
        state.buffers.metric_sums.copy_(tensors["epoch.metric_sums"].to(dev))
        trades = tensors["epoch.trades"].to(dev)
        for i, acc in enumerate((state.env.trade_sum, state.env.trade_sq, state.env.trade_n)):
            acc.copy_(trades[i])
        return EpochProgress(**meta["progress"])


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint file and then its sidecar (a kill between the two leaves a sidecar alone, never a file
    that looks complete)."""
    Path(path).unlink(missing_ok=True)
    sidecar_path(path).unlink(missing_ok=True)


def prune_checkpoints(run_dir: Path, epoch: int, keep: int | None, pinned: Iterable[int] = ()) -> list[Path]:
    """After epoch `epoch` is saved complete: delete the trainer state of every earlier epoch (a run resumes from
    its last complete epoch only), an interrupted epoch's file, and, with `keep`, the weights of all but the last
    `keep` epochs — except both files of the `pinned` epochs (a feedback rollback's candidates: `roll_back` needs
    an epoch's weights and trainer state). Returns the files deleted."""
    ck = Path(run_dir) / CHECKPOINTS
    pinned = set(pinned)
    gone = []
    for p in ck.glob("epoch-[0-9]*.safetensors"):
        e, state_file = epoch_of(p), p.name.endswith(".state.safetensors")
        if e in pinned:
            continue
        if (state_file and e < epoch) or (not state_file and keep is not None and e <= epoch - keep):
            remove_checkpoint(p)
            gone.append(p)
    if (ck / INTERRUPTED).exists():
        remove_checkpoint(ck / INTERRUPTED)
        gone.append(ck / INTERRUPTED)
    return gone



_KIND_NAMES = {AGENT_KIND: "an epoch's weights", STATE_KIND: "a trainer-state file",
               INTERRUPTED_KIND: "an interrupted epoch's file"}


def _check_kind(path: Path, meta: dict, kind: str) -> None:
    """CheckpointError naming `path` unless its metadata kind is `kind`."""
    got = meta.get("kind")
    if got != kind:
        what = _KIND_NAMES.get(got, f"a file of kind {got!r}")
        raise CheckpointError(str(path), f"is {what}, not {_KIND_NAMES[kind]} (files swapped?)")


def _load_epoch(state: TrainState, run_dir: Path, epoch: int, expected_sha256: str | None = None
                ) -> tuple[dict[str, torch.Tensor], Path, dict[str, torch.Tensor], dict]:
    """Epoch `epoch`'s online weights and the file they come from, its trainer-state tensors and the state's
    metadata, each file checked against its sha256 (the weights against `expected_sha256` when given, else their
    sidecar) and its metadata kind (CheckpointError naming a file of another kind). The online weights are the
    checkpoint's, or the trainer state's where the checkpoint holds their moving average (`policy_ema`)."""
    wpath, tpath = checkpoint_path(run_dir, epoch), checkpoint_path(run_dir, epoch, state=True)
    w, wmeta = load_checkpoint(wpath, expected_sha256)
    _check_kind(wpath, wmeta, AGENT_KIND)
    t, meta = load_checkpoint(tpath)
    _check_kind(tpath, meta, STATE_KIND)
    if meta.get("config_hash") != state.cfg.hash():
        raise ValueError(f"{run_dir}: the run's config changed since epoch {epoch} (config hash mismatch)")
    online = {k[len("online."):]: v for k, v in t.items() if k.startswith("online.")}
    return (online, tpath, t, meta) if online else (w, wpath, t, meta)


def _check_fits(path: Path, tensors: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming `path` unless `tensors` has the names and shapes of `current` (a module's state dict):
    checked before anything is loaded, so a refused rollback leaves the learner as it was."""
    missing, unexpected = sorted(current.keys() - tensors.keys()), sorted(tensors.keys() - current.keys())
    sizes = [f"size mismatch for {k}: {tuple(tensors[k].shape)} in the file, {tuple(current[k].shape)} here"
             for k in sorted(current.keys() & tensors.keys()) if tensors[k].shape != current[k].shape]
    why = ([f"Missing key(s): {', '.join(missing)}"] if missing else []) + \
          ([f"Unexpected key(s): {', '.join(unexpected)}"] if unexpected else []) + sizes
    if why:
        raise CheckpointError(str(path), f"does not fit this run's agent or trainer state: "
                                         f"{load_error_reason(RuntimeError(why[0]))}")


def restore_state(state: TrainState, run_dir: Path, epoch: int) -> None:
    """Load epoch `epoch`'s agent and trainer state into a freshly built `state` (same config): resume.
    CheckpointError naming the file whose tensors do not fit."""
    w, wpath, t, meta = _load_epoch(state, run_dir, epoch)
    with _loading(wpath):
        state.agent.load_state_dict({k: v.to(state.device) for k, v in w.items()})
    with _loading(checkpoint_path(run_dir, epoch, state=True)):
        _load_state(state, t, meta)


def roll_back(state: TrainState, run_dir: Path, epoch: int, expected_sha256: str | None = None,
              keep: float = 0.0, restart: bool = False, refresh: bool = True) -> None:
    """A feedback rollback (population-based training's exploit step): the learner of the best epoch `epoch` —
    its weights, target network, optimizer state (moments, step counts) and entropy coefficient, bit for bit from
    its checkpoint files (`expected_sha256`: the checkpoint its report evaluated) — replaces the current one, in
    place. With `keep` > 0 (`FeedbackBundle.rollback_keep`) every floating-point tensor of the network and of its
    target becomes `keep·current + (1 − keep)·best` instead; the optimizer state is the best epoch's either way.
    What was collected stays (the replay buffer, the trade tracker), and time moves on (the RNGs, the epoch,
    update and environment-step counters, the LR schedule's group ages). The embedding tables the updates and
    collection read are recomputed from the restored encoders (`refresh`; False for a caller whose next step is
    `train_epoch`, which recomputes them in its set-up).
    With `restart` (`FeedbackBundle.rollback_restart`) the answer to the drop is a fresh learner instead
    (`state.restart_fresh`: new weights, zeroed optimizer state, and the replay emptied under
    `TrainConfig.restart_replay`); `epoch`'s files are not read. CheckpointError naming a file of `epoch` that
    cannot be trusted or whose tensors do not fit."""
    if not 0.0 <= keep < 1.0:
        raise ValueError(f"rollback keep must be in [0, 1), got {keep}")
    if restart:
        restart_fresh(state)
        if refresh:
            refresh_embeddings(state)
        return
    w, wpath, t, _ = _load_epoch(state, run_dir, epoch, expected_sha256)
    tpath = checkpoint_path(run_dir, epoch, state=True)
    _check_fits(wpath, w, state.agent.state_dict())
    _check_fits(tpath, {k[len("target."):]: v for k, v in t.items() if k.startswith("target.")},
                state.target.state_dict())
    if keep:
        now = {k: v.detach().cpu() for k, v in state.agent.state_dict().items()}
        with _loading(wpath):
            w = _blend(now, w, keep)
        now_t = {f"target.{k}": v.detach().cpu() for k, v in state.target.state_dict().items()}
        with _loading(tpath):
            t = {**t, **_blend(now_t, {k: v for k, v in t.items() if k.startswith("target.")}, keep)}
    with torch.no_grad(), _loading(wpath):
        state.agent.load_state_dict({k: v.to(state.device) for k, v in w.items()})
    with _loading(tpath):
        _load_learner(state, t)
    if refresh:
        refresh_embeddings(state)


def _blend(now: dict[str, torch.Tensor], best: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
    """`keep·now + (1 − keep)·best` for each floating-point tensor of `best` (computed in float64, stored in its
    dtype); other tensors (counters, integer buffers) are `best`'s."""
    out = {}
    for k, b in best.items():
        if b.is_floating_point():
            mix = keep * now[k].double() + (1.0 - keep) * b.double()
            out[k] = mix.to(b.dtype)
        else:
            out[k] = b
    return out


@torch.no_grad()
def _load_learner(state: TrainState, t: dict) -> None:
    """The learner's part of `_state_tensors` back into `state`, in place: target network, optimizer state,
    entropy coefficient."""
    dev = state.device
    state.target.load_state_dict({k[len("target."):]: v.to(dev) for k, v in t.items() if k.startswith("target.")})
    if state.ema is not None:
        ema = dict(state.ema.named_parameters())
        for k, v in t.items():
            if k.startswith("ema."):
                ema[k[len("ema."):]].copy_(v)         # in place: a captured step's lerp reads these addresses
    if "swa.count" in t:
        state.swa_count = int(t["swa.count"])
    params = dict(state.agent.named_parameters())
    for key, v in t.items():
        if key.startswith("opt."):
            # in place: the state exists from the optimizer's construction (`materialise_state`, or `FlatAdamW`'s
            # views of its flat buffers), on its device, at the addresses a captured step reads
            name, slot = key[len("opt."):].rsplit(".", 1)
            state.opt.state[params[name]][slot].copy_(v)
    state.buffers.entropy_coef.copy_(t["buf.entropy_coef"].to(dev))


def _load_state(state: TrainState, t: dict, meta: dict) -> None:
    """`_state_tensors` / `_state_meta` back into `state`."""
    dev = state.device
    _load_learner(state, t)
    for g, age in zip(state.opt.param_groups, meta["group_ages"]):
        g["age"] = int(age)
    state.replay.load_state({k[len("replay."):]: v.to(dev) for k, v in t.items() if k.startswith("replay.")},
                            meta["replay"])
    state.env.tracker.load_state({k[len("tracker."):]: v for k, v in t.items() if k.startswith("tracker.")})
    state.generator.set_state(t["rng.generator"])
    torch.set_rng_state(t["rng.torch"])
    state.epoch, state.update_step = int(meta["epoch"]), int(meta["update_step"])
    state.env_steps = int(meta["env_steps"])
    state.learn_from = int(meta.get("learn_from", 0))         # a state saved before the replay could be emptied: 0
