"""The trainer's public names in one place (`from services.trainer.train import …`); each lives in the module
that owns it (docs/ARCHITECTURE.md, "The trainer package"):

    config      TrainConfig and its presets
    optim       parameter groups, decay mask, AdamW, the LR schedule (host and device)
    buffers     the device tensors the step reads, the embedding cache and its refresh
    targets     the no-grad targets of a batch
    objective   losses → loss, metrics, priorities
    step        objective → backward → optimizer → target update; train_step
    runtime     eager / compiled / CUDA-graph iterations, side streams
    state       TrainState, build_state, apply_knobs
    checkpoint  epoch checkpoints, interrupted epochs, resume, rollback, pruning
    rundir      run.json, history.jsonl, the resume check
    loop        train_epoch, train_run
"""
from services.trainer.buffers import (METRICS, UpdateBuffers, make_buffers, refresh_embeddings, refresh_encode,
                                      refresh_rolling, refresh_store)
from services.trainer.checkpoint import (INTERRUPTED, EpochProgress, agent_metadata, prune_checkpoints,
                                         read_interrupted, remove_checkpoint, restore_interrupted, restore_state,
                                         roll_back, save_epoch, save_interrupted)
from services.trainer.config import CHURN_SMALL, MIN_HOLD_SMALL, TrainConfig
from services.trainer.loop import EpochInterrupted, EpochStats, PhaseClock, open_run, train_epoch, train_run
from services.trainer.objective import Objective, make_objective
from services.trainer.optim import (build_optimizer, clip_grad_norm, device_lrs, group_lr, materialise_state,
                                    param_branch, scheduled_lr, set_lrs, weight_decay_mask)
from services.trainer.rundir import append_history, latest_epoch, read_run_json
from services.trainer.runtime import StepRunner, compile_step, in_precision, inductor_options
from services.trainer.state import TrainState, adapt_support, apply_knobs, build_state
from services.trainer.step import make_update, train_step
from services.trainer.targets import Targets, iqn_rows, make_targets, noise_width, sample_horizons

__all__ = [
    "CHURN_SMALL", "INTERRUPTED", "METRICS", "MIN_HOLD_SMALL", "EpochInterrupted", "EpochProgress", "EpochStats",
    "Objective", "PhaseClock", "StepRunner", "Targets", "TrainConfig", "TrainState", "UpdateBuffers",
    "adapt_support", "agent_metadata", "append_history", "apply_knobs", "build_optimizer", "build_state",
    "clip_grad_norm", "compile_step", "device_lrs", "group_lr", "in_precision", "inductor_options", "iqn_rows",
    "latest_epoch",
    "make_buffers", "make_objective", "make_targets", "make_update", "materialise_state", "noise_width", "open_run",
    "param_branch", "prune_checkpoints", "read_interrupted", "read_run_json", "refresh_embeddings",
    "refresh_encode", "refresh_rolling", "refresh_store", "remove_checkpoint", "restore_interrupted",
    "restore_state", "roll_back", "sample_horizons", "save_epoch", "save_interrupted", "scheduled_lr", "set_lrs",
    "train_epoch", "train_run", "train_step", "weight_decay_mask",
]
