"""The training loop: config, the update step, `train_epoch(state, knobs) -> EpochStats`, run directory, resume.

Read top to bottom (CleanRL style): `TrainConfig` → parameter groups (weight-decay mask, per-branch groups) →
`make_update` (the hot step: a closure `update(batch) -> detached metrics`, no `.item()`, no Python branch on
tensor values, knobs as device tensors, target update with `lerp_`) → `TrainState` → `train_epoch` (apply knobs →
collect ⇄ update → stats) → checkpoints (safetensors only; optimizer, replay and RNG state flattened into
tensors + JSON metadata) → `train_run` (run directory, resume).

Run directory: DIR/run.json (config, dataset, split, seed), DIR/checkpoints/epoch-NNNN.safetensors (agent
weights + metadata, what the evaluator loads; sha256 sidecar), DIR/checkpoints/epoch-NNNN.state.safetensors
(trainer state for resume), DIR/history.jsonl (one line of `EpochStats` per epoch).

ML core: imports only torch, numpy, pandas and the standard library (plus `shared.checkpoints`, whose
safetensors dependency is the checkpoint format itself).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from shared.agent import Agent, AgentConfig, MarketView, PolicyControls, agent_from_checkpoint
from shared.checkpoints import load_checkpoint, save_checkpoint, sidecar_path
from shared.execution import CostModel
from shared.graphs import StaticState, capture, resolve_accel, use_compile_cache
from shared.knobs import BRANCHES, FixedSchedule, Knobs
from shared.market import Bars, Split, chronological_split, compute_features
from shared.rollout import MarketTensors
from services.trainer.env import RewardConfig, TrainEnv
from services.trainer import fused_attention
from services.trainer.flat_adamw import FlatAdamW, flatten_parameters
from services.trainer.fused_c51 import available as fused_c51_available
from services.trainer.losses import (adapt_entropy_coef, batch_sum, c51_branch_losses, c51_branch_losses_q,
                                     evaluate_columns, expectile_loss, greedy_columns, greedy_next, nstep_returns,
                                     project_distribution, quantile_huber_loss, top_two)
from services.trainer.replay import Batch, Replay

FEATURE_WARMUP = 64  # shared.market zeroes feature rows before this bar
MIN_HOLD_SMALL = 96  # small preset: bars a trade is held before a signal exit (regimes last ~200 bars)
CHURN_SMALL = 1e-3  # small preset: reward cost per opened trade (return units, ~10× the 1 bp fill cost)


# ---------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything a training run needs besides the data, the seed and the knobs."""

    agent: AgentConfig = field(default_factory=AgentConfig)
    """Network and action space."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward terms and episode lengths."""
    n_envs: int = 16
    """E: accounts stepping through the training split in parallel."""
    env_steps_per_iter: int = 4
    """Rollout steps of all E accounts between update bursts."""
    updates_per_iter: int = 1
    """Gradient updates per iteration."""
    iterations: int = 1500
    """Iterations per epoch (collect → update)."""
    batch_size: int = 256
    """Transitions per update."""
    replay_capacity: int = 200_000
    """Transitions kept in replay."""
    learning_starts: int = 2_000
    """Transitions collected before the first update."""
    horizons: tuple[int, ...] = (1, 5, 20)
    """n-step horizons of the targets, blended per regime by `horizon_blend`."""
    horizon_blend: tuple[tuple[float, float, float], ...] = ((0.2, 0.3, 0.5), (0.5, 0.3, 0.2), (0.2, 0.3, 0.5)) * 3
    """Weight of each horizon per regime label (trend buckets down/range/up × 3 vol buckets): trends favour long
    horizons, ranges short ones. Rows sum to 1."""
    lr: float = 3e-4
    """Base learning rate of every parameter group."""
    weight_decay: float = 1e-4
    """AdamW decay of the trunk and value-head weight matrices (the decay mask); 0 elsewhere."""
    lr_warmup: int = 200
    """Updates of linear LR warm-up of a parameter group from its creation."""
    cosine_period: int = 1000
    """Updates per cosine warm restart of the branch groups (their Adam momentum resets at each restart)."""
    cosine_floor: float = 0.3
    """Minimum of the branch cosine factor."""
    grad_clip: float = 10.0
    """Global gradient-norm clip."""
    tau: float = 0.01
    """Target network update θ' ← θ' + τ (θ − θ') each update (`lerp_`)."""
    iqn_quantiles: int = 16
    """τ samples of the IQN loss (online and target)."""
    iqn_coef: float = 0.5
    """Weight of the IQN loss."""
    expectile: float = 0.7
    """Expectile of the IQL value head."""
    expectile_coef: float = 0.25
    """Weight of the expectile loss."""
    ensemble_mask_p: float = 0.8
    """Bootstrap mask: probability that an ensemble member trains on a sample."""
    entropy_target: float = 0.3
    """Target atom utilisation (fraction of atoms holding > ½/A of the mass)."""
    entropy_init: float = 1e-3
    """Initial entropy-bonus coefficient β."""
    entropy_rate: float = 0.01
    """Adaptation rate of β per update."""
    q_centre_coef: float = 0.1
    """Q-mean centring: weight of ((mean Q − mean target) / v_max)²."""
    q_gap_coef: float = 0.01
    """Q-gap attractor: weight of ((gap − gap*) / v_max)², gap* = q_gap_frac · std(targets)."""
    q_gap_frac: float = 0.5
    """Target Q gap between the best and second direction, as a fraction of the targets' std."""
    hindsight_coef: float = 0.1
    """E7: weight of the hindsight-label cross-entropy on the direction Q."""
    support_quantile: float = 0.99
    """Adaptive support: v_max tracks this quantile of |20-step reward sums| in replay …"""
    support_margin: float = 1.5
    """… times this margin."""
    maturity_updates: int = 5000
    """Risk-head maturity m = 1 − exp(−updates / maturity_updates) scales the protection stack."""
    costs_bps: float = 1.0
    """Trading costs (bps of notional) in the training simulator."""
    gamma: float = FixedSchedule.gamma
    """Fixed-schedule γ (feedback off; default `shared.knobs.FixedSchedule`)."""
    eps_start: float = FixedSchedule.eps_start
    """Fixed-schedule ε of the first epoch …"""
    eps_end: float = FixedSchedule.eps_end
    """… decaying linearly to this …"""
    eps_decay_epochs: int = FixedSchedule.eps_decay_epochs
    """… over this many epochs."""
    bf16: bool = False
    """On CUDA, the forward passes of collection and update under bf16 autocast (losses and softmaxes in fp32)."""
    encoder_batch: int = 0
    """Samples of each update whose market encoding is computed with gradient (the encoder learns from them);
    the rest read the cached online embeddings. 0 = the whole batch. The encoder with gradient was the largest part
    of the `full` preset's update: at batch 4 096 on the H200 its graph replay took 1.56 ms with 512 such samples,
    1.35 with 256 and 1.23 with 128 (bench/train_profile.py, one run, session 17; session 19: 1.19 against 1.09,
    side by side, on the session's defaults); the preset's 256 learned as 512
    did on the GPU learning bench (3 of 3 seeds met the target either way, OOS per-trade Sharpe mean 0.433 vs 0.441,
    paired difference −0.01 ± 0.04; bench/README.md, learning.py). 128 is not taken: on the CPU learning bench an
    eighth of the batch learned as a quarter did (24 seeds, paired OOS per-trade Sharpe −0.02 ± 0.09, sessions
    18–19), but on the GPU learning bench 128 came out below 256 in each of 3 seeds (OOS per-trade Sharpe mean 0.370
    against 0.500, paired −0.13 ± 0.07; validation lower in each too; target met 3 of 3 either way; session 20)."""
    adamw: str = "auto"
    """AdamW kernels on CUDA: "fused" (one `_fused_adamw_` launch per parameter group), "foreach" (the capturable
    multi-tensor form, which torch.compile lowers to its own fused Triton kernels); a CPU runs torch's default form
    with either. "flat", on any device: `FlatAdamW` (`services.trainer.flat_adamw`), every parameter (and the
    target network's) a view of one flat buffer, the clip, the step and the target's lerp a few passes over it
    whatever the number of groups; the same numbers up to the order of float sums. "auto" (the default): flat when
    the update is compiled on CUDA (on the H200 the batch-4 096 update's graph replay took 1.33 ms against 1.38 with
    foreach, 361 kernels against 377, side by side, session 18), fused when it runs eagerly on CUDA, torch's
    default form on a CPU."""
    inductor: str = "combo_kernels,combo_kernels_pointwise_only,triton.enable_pdl"
    """Comma-separated boolean options of `torch._inductor.config` turned on ("name") or off ("!name") for the compiled
    modes' step functions; "" = inductor's defaults. The default fuses independent pointwise kernels side by side
    into one launch (`combo_kernels`) and leaves reductions alone (`combo_kernels_pointwise_only`): on the H200 the
    batch-4 096 update went from 543 to 380 kernels and its graph replay from 1.79 to 1.58 ms (session 16). Combined
    reductions had doubled the update's time (one took 3.39 ms by itself, session 9; bench/README.md). And it lets
    each Triton kernel launch before the previous one has finished, waiting on the device for its inputs
    (programmatic dependent launch, `triton.enable_pdl`; inductor emits it on Hopper and later only): the batch-4 096
    update's graph replay went 1.33 → 1.23 ms side by side with flat AdamW, 1.32 → 1.27 without (session 18).
    Compiling takes longer. On a CPU inductor's C++ backend makes neither combo kernels nor launches. Measured
    against this default and left off (session 19, 1.18–1.19 ms): `coordinate_descent_tuning` 1.19 ms (and ~4 min
    to compile), `aggressive_fusion` 1.18, `!split_reductions` 3.43 (long reductions in a few programs),
    `max_autotune_gemm` not compiled within 5 min."""
    tf32: bool = True
    """On CUDA, float32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulate)."""
    emb_refresh: int = 50
    """Updates over which the cached market embeddings of all training bars are refreshed once: each update
    re-encodes the next ceil(T_train / emb_refresh) bars of a rolling window (plus a full refresh per epoch).
    The refresh's cost per update grows with the training split: at 10^6 bars and 500 it re-encoded 2 001 bars with
    each network, 1.51 ms of a 4.30-ms update at batch 1 024 on the H200 (`bench/train_profile.py`, compiled), so
    the `full` preset refreshes every bar once per 2 000 updates (half a 10^6-bar epoch's 4 000). With
    `encoder_batch` 512 as well, the update's graph replay went from 2.91 to 2.23 ms (session 9) and the epoch
    from 12.4 to 9.8 s (session 10); on the GPU learning bench both settings met the target in 3 of 3 seeds
    (bench/README.md, learning.py)."""
    iqn_batch: int = 0
    """Samples of each update the IQN risk head trains on: the first `iqn_batch` of the batch, a random subset (replay
    draws its samples independently), so their mean loss is an unbiased estimate of the whole batch's; the target's
    quantiles are computed for them alone. 0 = the whole batch. The IQN head is the update's widest part (N × M rows
    through two 256-wide layers, online forward and backward plus the target's forward). The `full` preset's 512
    (session 12) took the batch-4 096 update's graph replay from 2.65 to 2.42 ms on the H200 with `horizon_sample`
    (bench/train_profile.py; 1 024: 2.44 ms) and learned as well (see `horizon_sample`)."""
    horizon_sample: bool = False
    """Off: every sample bootstraps at all H horizons, its losses weighted by its regime's `horizon_blend` row w_h.
    On: at one horizon drawn from w_h, weight 1 — the same C51 and IQN losses in expectation (both are linear in
    w_h: the C51 target blends before a linear projection, the IQN loss is Σ_h w_h ρ_h) with H times fewer bootstrap
    states; the expectile and stability terms then read the drawn horizon's scalar target instead of the blend.
    On in the `full` preset since session 12: at batch 4 096 an update is 107.6 GFLOP instead of 152
    (bench/update_flops.py) and its graph replay 2.65 ms instead of 3.29 on the H200 (bench/train_profile.py); on
    the GPU learning bench it and `iqn_batch` 512 met the target in 3 seeds of 3 against 2 of 3 as set before. On the
    CPU learning bench (`small`, 12 seeds) it met the target in 7 seeds against 6, median OOS per-trade Sharpe 0.764
    against 0.834, paired difference −0.19 ± 0.53: noise (bench/README.md, learning.py, sessions 11–12)."""
    target_stream: bool = True
    """On CUDA, the update's no-grad targets (`make_targets`: double-Q at the N·H bootstrap states, the target
    network's heads and IQN, the projections) on a side stream beside its online forward pass. On the H200 the
    batch-4 096 update's graph replay went 3.63 → 3.47 ms: the targets' kernels are large enough to fill the GPU, so
    the streams overlap little (bench/README.md, train_speed.py, session 11)."""
    priorities_aside: bool = True
    """On CUDA, the replay's priority write (`Replay.update_priorities`: a one-program scatter kernel, ~16 µs) on the
    rolling refresh's side stream as soon as the loss is known, beside the backward pass, instead of after the
    optimizer step on the update's own stream. Nothing in the update reads the priorities after its sampling. Side
    by side at batch 4 096 on the H200 the update's graph replay went 1.08 → 1.06 ms (bench/train_profile.py
    --variants '' priorities_aside=False, session 22)."""
    refresh_at_backward: bool = False
    """On CUDA with `priorities_aside`, the rolling refresh's encodings launched on their side stream when the loss is
    known, beside the backward pass, instead of at the update's start, beside its forward pass. In session 23's replay
    timelines the forward pass shared the GPU with the targets and the refresh (the GPU busy 117 % of the replay)
    while the backward's small kernels ran alone; the encodings read only the parameters, which the backward does not
    change. Session 21 measured launching them after the targets or at their join as equal. Off: side by side at
    batch 4 096 on the H200 the update's graph replay went 1.01 → 1.00 ms (bench/train_profile.py --variants ''
    refresh_at_backward=True, session 24), within what one tree's rows differ by between runs."""
    fold_ln: bool = True
    """The encoder blocks' LayerNorm affines folded into the linear layers after them (`shared.agent.ln_fold`):
    the same function and parameters, with γ's and β's gradients taken on the weights instead of summed over
    every token of the batch's windows. Side by side at batch 4 096 on the H200: 1.07 → 1.06 ms a replay (11 more,
    smaller kernels: the folds work on the parameters; bench/train_profile.py --variants '' fold_ln=False,
    session 22) — within what variants of one run differ by, kept as the smaller arithmetic."""
    attention: str = "triton"
    """The encoder's attention in the update's online pass (with gradient): "triton" (`services.trainer.
    fused_attention`: one kernel a pass and (window, head), CUDA only; elsewhere SDPA) or "sdpa" (PyTorch's fused
    kernels: cuDNN's on the H200, four kernels backward). Side by side at batch 4 096 on the H200 the update's graph
    replay went 1.13 → 1.09 ms, 333 → 324 kernels (bench/train_profile.py --variants '' attention=sdpa, session
    21); values and gradients match SDPA's (tests/test_fused_attention.py)."""
    fused_targets: bool = True
    """On CUDA, the targets' double-Q selection (the online ensemble-mean Q of every action at the bootstrap states,
    the greedy action of each branch, the target members' mean distribution and portfolio shift there) as one Triton
    kernel (`services.trainer.fused_greedy`) instead of the five kernels torch.compile made of it; the same numbers
    up to the order of float sums (an exact tie of two actions' Q aside)."""
    direction_q_in_c51: bool = True
    """The online direction Q of the update's stability and hindsight terms (every member's Σ_i z_i p_i of the three
    direction actions) computed with the C51 terms from the heads' padded output (`losses.c51_branch_losses_q`): on
    CUDA with `fused_c51`, two more Triton kernels, the backward's adding its gradient into the C51 kernel's and
    handing the heads' GEMM the gradient of the whole padded row, where compiled the Q's softmax (~18 µs forward),
    its backward (~13 µs) and a pass that summed both gradients into a padded copy (~26 µs) ran on the update's
    stream (bench/train_profile.py --trace, session 23). The same numbers up to the order of float sums. Compiled
    without the fused kernels the update keeps the written-out chain (see `make_update`). Side by side at batch
    4 096 on the H200 the update's graph replay went 1.01 → 0.97 ms, 331 → 333 kernels, GPU time a call 1.17 →
    1.13 ms (bench/train_profile.py --variants '' direction_q_in_c51=True, session 24)."""
    fused_c51: bool = True
    """On CUDA, the update's C51 chain of the taken actions (softmax, portfolio shift, cross-entropy, the direction
    branch's entropy and utilisation, forward and backward) as two Triton kernels (`services.trainer.fused_c51`)
    instead of the ~20 kernels torch.compile made of it; the same numbers up to the order of float sums."""
    act_view_cache: bool = False
    """Off by default: on the CPU learning bench (3 seeds, `small`) acting on the cached view reached OOS per-trade
    Sharpes 0.493 / 0.647 / 0.411 against 0.941 / 0.606 / 0.595 with the heads run fresh (bench/README.md,
    learning.py, session 5) — staleness of the heads seems to cost more than that of the embeddings. On: collection
    reads each bar's market view (`Agent.view`: ensemble-mean Q of every action, the directions' spread, the IQN
    tail, the code) from a table refreshed with the cached embeddings, so acting costs only the portfolio shift and the policy per
    account-step (the heads run once per bar and refresh, not once per account and step); the policy's market part
    is then as stale as the embeddings (≤ `emb_refresh` updates), its portfolio shift is current. The update's
    double-Q selection at the bootstrap states reads the same table. False: the heads run on the cached embeddings
    at every step and for the selection."""

    @property
    def schedule(self) -> FixedSchedule:
        """The ε/γ schedule of feedback off with this config's values."""
        return FixedSchedule(eps_start=self.eps_start, eps_end=self.eps_end, eps_decay_epochs=self.eps_decay_epochs,
                             gamma=self.gamma)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["agent"] = self.agent.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        d["agent"] = AgentConfig.from_dict(d["agent"])
        d["reward"] = RewardConfig(**d["reward"])
        d["horizons"] = tuple(d["horizons"])
        d["horizon_blend"] = tuple(tuple(r) for r in d["horizon_blend"])
        return cls(**d)

    def hash(self) -> str:
        """sha256 of the canonical JSON of the config."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    @classmethod
    def preset(cls, name: str, n_features: int) -> "TrainConfig":
        """`small` (CPU, an epoch of ~3600 training bars in tens of seconds) or `full` (GPU)."""
        if name == "small":
            # Commitment for ~200-bar regimes: trades held ≥ MIN_HOLD_SMALL·m bars before a signal exit, exit
            # plans wider than a trend's noise (a 4σ stop is hit within ~16 bars of a trend), a churn cost per
            # opened trade, and the protection stack (m = maturity) mature within the short CPU run.
            return cls(agent=AgentConfig(n_features=n_features, window=32, d_model=32, n_heads=4, hidden=96,
                                         ensemble=3, min_hold=MIN_HOLD_SMALL,
                                         exit_plans=((math.inf, math.inf), (16.0, 10.0), (32.0, 12.0))),
                       reward=RewardConfig(churn=CHURN_SMALL), batch_size=128, iterations=600,
                       maturity_updates=1000)
        if name == "full":
            # 2 attention heads of 64 dims, not 8 of 16: the fused attention kernels tile 64 dims, so 16-dim heads
            # were mostly padding (bench/attention_speed.py: fwd+bwd 300 vs 575 µs at 1 024 windows on the H200)
            return cls(agent=AgentConfig(n_features=n_features, window=64, d_model=128, n_heads=2, n_layers=2,
                                         hidden=256, ensemble=5),
                       n_envs=256, env_steps_per_iter=2, updates_per_iter=2, iterations=2000, batch_size=1024,
                       replay_capacity=2_000_000, learning_starts=20_000, encoder_batch=256, bf16=True,
                       emb_refresh=2000, horizon_sample=True, iqn_batch=512)
        raise ValueError(f"unknown config preset {name!r}: use 'small' or 'full'")

    def override(self, items: list[str]) -> "TrainConfig":
        """Set fields from FIELD=VALUE strings (`agent.FIELD` for the network's), each parsed as the field's
        current type (bools from 1/true/yes); ValueError naming an unknown field. Returns self (benches' --set)."""
        for item in items:
            key, sep, text = item.partition("=")
            obj, name = (self.agent, key[6:]) if key.startswith("agent.") else (self, key)
            if not sep or not hasattr(obj, name):
                raise ValueError(f"--set {item!r}: expected FIELD=VALUE with a field of TrainConfig or agent.FIELD")
            cur = getattr(obj, name)
            setattr(obj, name, text.lower() in ("1", "true", "yes") if isinstance(cur, bool) else type(cur)(text))
        return self


# ---------------------------------------------------------------------------------------------------------
# Parameter groups: weight-decay mask and per-branch groups
# ---------------------------------------------------------------------------------------------------------
def param_branch(name: str) -> str:
    """The parameter group a parameter belongs to: trunk, value, direction, size, exit or risk."""
    if name.startswith(("enc_", "trunk.", "code.", "shift.")):
        return "trunk"
    if name.startswith("value_"):
        return "value"
    if name.startswith(("adv_w.", "adv_b.")):
        return BRANCHES[int(name.split(".")[1])]
    if name.startswith(("iqn_", "expectile")):
        return "risk"
    raise ValueError(f"parameter {name} has no group")


def weight_decay_mask(model: torch.nn.Module) -> dict[str, bool]:
    """True for the parameters that get weight decay: weight matrices (≥ 2-D) of the trunk and value head,
    except the positional embedding. Biases, LayerNorms, branch heads and risk heads: no decay."""
    return {n: param_branch(n) in ("trunk", "value") and p.dim() >= 2 and n != "enc_pos"
            and not n.endswith(("bias", "_b")) for n, p in model.named_parameters()}


def build_optimizer(agent: Agent, cfg: TrainConfig, device, compiled: bool = False
                    ) -> torch.optim.AdamW | FlatAdamW:
    """AdamW with one group per (branch, decay): the decay mask decides weight_decay; names in group['name'].
    On CUDA the LRs and step counters live on the device (capturable in a graph) and `cfg.adamw` picks the kernels
    (`compiled`: the update runs under torch.compile, where "auto" means flat)."""
    mask = weight_decay_mask(agent)
    groups: dict[tuple[str, bool], list] = {}
    for n, p in agent.named_parameters():
        groups.setdefault((param_branch(n), mask[n]), []).append(p)
    cuda = torch.device(device).type == "cuda"
    pg = [{"params": ps, "name": f"{b}{'' if d else '/nodecay'}", "branch": b,
           "weight_decay": cfg.weight_decay if d else 0.0, "age": 0,
           "lr": torch.tensor(cfg.lr, device=device) if cuda else cfg.lr}
          for (b, d), ps in sorted(groups.items())]
    if cfg.adamw not in ("auto", "fused", "foreach", "flat"):
        raise ValueError(f"adamw={cfg.adamw!r}: use auto, fused, foreach or flat")
    if cfg.adamw == "flat" or (cfg.adamw == "auto" and cuda and compiled):
        return FlatAdamW(pg, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-6)
    # the fused kernel is one multi-tensor launch per group, ~13 µs each on the H200 whatever the group's size (a
    # block walks a 64 Ki-element chunk serially); compiled, the foreach form becomes Triton kernels spread over
    # the whole GPU (bench/train_profile.py)
    fused = cuda and (cfg.adamw == "fused" or (cfg.adamw == "auto" and not compiled))
    opt = torch.optim.AdamW(pg, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-6, capturable=cuda, fused=fused or None,
                            foreach=True if cuda and not fused else None)
    materialise_state(opt)
    return opt


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (2-norm, foreach): the gradients scaled in place by min(1, max_norm /
    (‖g‖ + 1e-6)), where ‖g‖ is the norm of all of them together; returns ‖g‖. The same numbers, written so that
    torch.compile does not split it: torch's form stacks the per-parameter norms (`torch.stack` of one 0-d norm per
    parameter), which inductor lowered to one kernel per parameter — 57 launches of ~1 µs on the H200 in the
    update's graph (bench/train_profile.py --trace, session 14). Here the squares of those norms are added in one
    expression, which it fuses into one kernel."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = torch._foreach_norm(grads)                                    # one multi-tensor launch
    total = torch.sqrt(sum(n.float() * n.float() for n in norms))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return total


@torch.no_grad()
def materialise_state(opt: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state (zero moments, step 0) now instead of at the first update: the
    first update then has the structure of every later one, so torch.compile traces it once and a graph captured
    after a single warm-up step replays the same step (the momentum reset of `device_lrs` reads that state).
    One AdamW step at learning rate 0 on zero gradients: it moves no weight (the decay is lr × wd = 0), leaves the
    moments at 0, and its step counter is set back to 0."""
    params = [p for g in opt.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.zeros_like(g["lr"]) if torch.is_tensor(g["lr"]) else 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for st in opt.state.values():
        st["step"].zero_()


def group_lr(group: dict, step: int, knobs_lr_scale: dict[str, float], cfg: TrainConfig) -> float:
    """lr = base × E4 scale (branch groups) × warm-up(age) × cosine warm restart (branch groups)."""
    warm = min(1.0, (group["age"] + 1) / cfg.lr_warmup)
    lr = cfg.lr * warm
    if group["branch"] in BRANCHES:
        phase = (step % cfg.cosine_period) / cfg.cosine_period
        lr *= knobs_lr_scale[group["branch"]] * (cfg.cosine_floor + (1 - cfg.cosine_floor) * 0.5 * (1 + math.cos(math.pi * phase)))
    return lr


def set_lrs(opt: torch.optim.Optimizer, step: int, lr_scale: dict[str, float], cfg: TrainConfig,
            write_lr: bool = True) -> None:
    """Host-side schedule before update `step`: the LRs written into the groups (tensor LRs with `fill_`), the
    momentum reset of branch groups at each cosine restart, group ages. With `write_lr=False` (CUDA) only the ages:
    `device_lrs`, inside the captured step, does the LRs and the restart from the device's update counter."""
    if write_lr:
        restart = step > 0 and step % cfg.cosine_period == 0
        for g in opt.param_groups:
            lr = group_lr(g, step, lr_scale, cfg)
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
            if restart and g["branch"] in BRANCHES:
                for p in g["params"]:
                    opt.state[p]["exp_avg"].zero_()                # created with the optimizer
    for g in opt.param_groups:
        g["age"] += 1


def device_lrs(opt: torch.optim.Optimizer, buf: "UpdateBuffers", cfg: TrainConfig) -> None:
    """`group_lr` computed on the device from the update counter `buf.step` and written into the groups' LR
    tensors (read by the capturable AdamW), the branch groups' momentum zeroed at a cosine restart (multiplied by
    0 or 1), then the counter advanced: no host value per update, so it is captured with the step. Every group is
    created with the optimizer, so its age equals the update count."""
    step = buf.step
    warm = ((step + 1.0) / cfg.lr_warmup).clamp(max=1.0)
    phase = torch.remainder(step, cfg.cosine_period) / cfg.cosine_period
    cos_f = cfg.cosine_floor + (1 - cfg.cosine_floor) * 0.5 * (1.0 + torch.cos(math.pi * phase))
    lr = cfg.lr * warm * torch.where(buf.lr_branch, buf.lr_scale * cos_f, torch.ones_like(buf.lr_scale))
    keep = ((step == 0) | (phase != 0)).float()                                            # 0 at a restart
    if isinstance(opt, FlatAdamW):          # one vector each; the step applies the momentum factor in its pass
        opt.lr_vector.copy_(lr)
        opt.momentum_keep.copy_(torch.where(buf.lr_branch, keep, torch.ones_like(keep)))
    else:
        torch._foreach_copy_([g["lr"] for g in opt.param_groups], list(lr.to(torch.float32).unbind()))
        momenta = [opt.state[p]["exp_avg"] for g in opt.param_groups if g["branch"] in BRANCHES
                   for p in g["params"]]                                   # created with the optimizer
        torch._foreach_mul_(momenta, keep)
    step.add_(1.0)


# ---------------------------------------------------------------------------------------------------------
# The update step
# ---------------------------------------------------------------------------------------------------------
@dataclass
class UpdateBuffers:
    """Device tensors the update reads: knobs (γ, Q-bias), the entropy coefficient, lookup tables."""

    gamma: torch.Tensor
    q_bias: torch.Tensor
    entropy_coef: torch.Tensor
    horizon_blend: torch.Tensor
    """N_REGIMES × H."""
    hindsight: torch.Tensor
    """T_train: E7 hindsight-optimal direction per bar, −1 where none."""
    emb_online: torch.Tensor
    """T_train × D: online-network market embedding of every training bar, refreshed every `emb_refresh`
    updates (acting and double-Q selection at bootstrap states read it; the current state is encoded with
    gradient inside the update)."""
    emb_target: torch.Tensor
    """T_train × D: the same for the target network (bootstrap evaluation)."""
    emb_offset: torch.Tensor
    """First bar of the next rolling embedding refresh (device scalar)."""
    view_online: MarketView | None
    """T_train rows: the online network's `MarketView` of every training bar, refreshed with `emb_online` (what
    collection acts on when `act_view_cache`), else None."""
    step: torch.Tensor
    """Updates done so far (device scalar, float64): the LR schedule of a captured step reads it."""
    lr_scale: torch.Tensor
    """Per optimizer group: the E4 scale of its branch (1 for non-branch groups), float64."""
    lr_branch: torch.Tensor
    """Per optimizer group: True for the branch groups (E4 scale and cosine restarts apply)."""
    metric_sums: torch.Tensor
    """Sum over the epoch's updates of each of `METRICS` (read once per epoch)."""


METRICS = ("loss", "c51", "iqn", "expectile", "q_mean", "entropy", "utilisation", "grad_norm")


@dataclass
class Targets:
    """The no-grad targets of a batch of N samples (`make_targets`): what the update's losses compare its online
    predictions with. Computed apart from the online forward pass so that, on CUDA, they can run beside it on a
    side stream (`StepRunner`)."""

    dist: torch.Tensor
    """N × NBR × A: the C51 target of each branch (the projected next distribution of its greedy action, blended over
    the horizons)."""
    quantiles: torch.Tensor
    """N_q × H' × M': the IQN targets R + disc · θ'(s_h, a*, τ') of the direction branch at each sample's H'
    horizons (all H, or the one drawn: `TrainConfig.horizon_sample`), for the first N_q samples (`iqn_rows`: all N
    unless `TrainConfig.iqn_batch`)."""
    value: torch.Tensor
    """N: the blended scalar target Σ_h w_h (R + disc · Q'(s_h, a*)) of the direction branch (expectile and
    stability terms)."""
    blend: torch.Tensor
    """N × H': the weights of those horizons (the sample's regime's `horizon_blend` row, or 1 for the one drawn)."""

    FIELDS = ("dist", "quantiles", "value", "blend")

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f) for f in self.FIELDS]


def sample_horizons(cfg: TrainConfig) -> int:
    """H': the bootstrap horizons of each sample — all H, or the one drawn (`horizon_sample`)."""
    return 1 if cfg.horizon_sample else len(cfg.horizons)


def iqn_rows(cfg: TrainConfig, n: int) -> int:
    """Samples of a batch of n on which the IQN loss is computed (`iqn_batch`)."""
    return min(cfg.iqn_batch or n, n)


def noise_width(cfg: TrainConfig) -> int:
    """Uniforms per sample that an update reads (`make_update`): K ensemble-mask draws, M online τ, then M' target τ
    at each of the sample's H' bootstrap horizons (and, with `horizon_sample`, the draw of that horizon)."""
    return cfg.agent.ensemble + cfg.iqn_quantiles * (1 + sample_horizons(cfg)) + int(cfg.horizon_sample)


def make_targets(agent: Agent, target: Agent, buf: UpdateBuffers, cfg: TrainConfig
                 ) -> Callable[[Batch, torch.Tensor], Targets]:
    """Build `targets(batch, noise) -> Targets`: double-Q at the bootstrap states (the online network selects the
    greedy action of each branch on the cached embeddings or view, the target network evaluates it), the n-step
    returns, and from them the C51, IQN and scalar targets. N·H bootstrap states, or N with `horizon_sample`. Reads
    parameters, tables and the batch; writes nothing."""
    horizons = cfg.horizons
    H, M, K = len(horizons), cfg.iqn_quantiles, agent.cfg.ensemble
    Hs = sample_horizons(cfg)                                                              # H' horizons per sample
    NBR = len(agent.cfg.branch_sizes)
    fused = cfg.fused_targets and fused_c51_available(agent.v_max)

    @torch.no_grad()
    def targets(b: Batch, noise: torch.Tensor) -> Targets:
        N = b.bar.shape[0]
        z = agent.support                                                                  # A
        R, disc = nstep_returns(b.rewards.double(), b.dones, buf.gamma.double(), horizons)  # N × H
        R, disc = (R - buf.q_bias).float(), disc.float()
        w_h = buf.horizon_blend[b.regime]                                                  # N × H
        next_bar, next_pf = b.next_bar, b.next_portfolio                                   # N × H, N × H × P
        if cfg.horizon_sample:
            # one horizon per sample, drawn from its regime's blend (inverse CDF; rows sum to 1)
            u = noise[:, K + 2 * M:K + 2 * M + 1]                                          # N × 1
            h = (u >= w_h.cumsum(1)).sum(1, keepdim=True).clamp(max=H - 1)                  # N × 1
            R, disc, next_bar = R.gather(1, h), disc.gather(1, h), next_bar.gather(1, h)
            next_pf = next_pf.gather(1, h.unsqueeze(-1).expand(-1, -1, next_pf.shape[2]))
            w_h = torch.ones_like(R)                                                       # N × 1
        nb, npf = next_bar.reshape(-1), next_pf.reshape(N * Hs, -1)                        # n-major: N·H' rows
        tg_n = target.head(buf.emb_target[nb], npf)                                         # cached embeddings
        # the greedy next action of each branch (as a column among the NB actions), chosen by the online network;
        # the ensemble shares one target: the target members' mean next distribution at the greedy action (the
        # softmax is over atoms, per action: taken of the greedy actions' logits alone), all branches at once, and
        # the target's portfolio shift there (its atoms sit at z + δ')
        if buf.view_online is not None:
            # the online selection reads the cached market view of the next bars (as stale as the cached
            # embeddings it would otherwise run the heads on) plus the current portfolio shift
            vn = buf.view_online.rows(nb)
            q_on = vn.q + agent.delta(vn.code, npf)[:, :agent.cfg.n_actions]              # N·H' × NB
            col = greedy_columns(q_on, agent.cfg.branch_sizes)                             # N·H' × NBR
            p_next, d_star = evaluate_columns(tg_n.logits, tg_n.delta, col)
        else:
            on_n = agent.head(buf.emb_online[nb], npf)
            col, p_next, d_star = greedy_next(on_n.logits, on_n.delta, tg_n.logits, tg_n.delta, z,
                                              agent.cfg.branch_sizes, fused=fused)
        p_next = p_next.view(N, Hs, NBR, -1).transpose(1, 2)                               # N × NBR × H' × A
        d_star = d_star.view(N, Hs, NBR).transpose(1, 2)                                   # N × NBR × H'
        # blended over horizons before the projection (Φ is linear in the probabilities)
        p_w = (p_next * w_h.view(N, 1, Hs, 1)).reshape(N, NBR, -1)                         # N × NBR × H'·A
        tz = R.view(N, 1, Hs, 1) + disc.view(N, 1, Hs, 1) * (z + d_star.unsqueeze(-1))     # N × NBR × H' × A
        dist = project_distribution(tz.reshape(N, NBR, -1), p_w, z)                        # N × NBR × A
        # the target's Q of the greedy direction, Σ_i z_i p_i + δ' → the scalar target
        q_tn = (p_next[:, 0] * z).sum(-1) + d_star[:, 0]                                   # N × H'
        value = ((R + disc * q_tn) * w_h).sum(1)                                           # N
        # IQN: the target's quantiles of the greedy direction at τ' (shifted by δ'_direction)
        # (for the first n_q samples only: `iqn_batch`; rows are n-major, so theirs are the first n_q·H')
        n_q = iqn_rows(cfg, N)
        rq = slice(0, n_q * Hs)
        taus_t = noise[:n_q, K + M:K + M + Hs * M].reshape(n_q * Hs, M)                    # n-major, like nb
        th_n = target.quantiles(tg_n.hidden[rq], taus_t).float() + tg_n.delta[rq, :3].unsqueeze(1)  # n_q·H' × M × 3
        th_n = th_n.gather(2, col[rq, 0].view(n_q * Hs, 1, 1).expand(-1, M, 1)).view(n_q, Hs, M)
        quantiles = R[:n_q].unsqueeze(-1) + disc[:n_q].unsqueeze(-1) * th_n                # n_q × H' × M
        return Targets(dist=dist, quantiles=quantiles, value=value, blend=w_h)

    return targets


def make_update(agent: Agent, target: Agent, opt: torch.optim.Optimizer, replay: Replay, windows: torch.Tensor,
                buf: UpdateBuffers, cfg: TrainConfig, generator: torch.Generator,
                targets: Callable[[Batch, torch.Tensor], Targets]) -> Callable[[Batch], dict]:
    """Build the hot step `update(batch) -> dict of detached metric tensors` (`targets`: `make_targets`'s)."""
    M, Hs = cfg.iqn_quantiles, sample_horizons(cfg)
    params = [p for p in agent.parameters()]
    tparams = [p for p in target.parameters()]
    flat = isinstance(opt, FlatAdamW)
    if flat:   # the target's parameters in the optimizer's flat layout: its update is one lerp over the buffer
        name_of = {p: n for n, p in agent.named_parameters()}
        tnamed = dict(target.named_parameters())
        target_flat = flatten_parameters([tnamed[name_of[p]] for p in opt.params])
    n_ens = agent.cfg.ensemble
    fused = cfg.fused_c51 and fused_c51_available(windows)

    def update(b: Batch, noise: torch.Tensor | None = None, after_backward: Callable[[], None] | None = None,
               targets_via: Callable[[Batch, torch.Tensor], tuple[Targets, Callable[[], None]]] | None = None,
               priorities_via: Callable[[torch.Tensor, torch.Tensor], None] | None = None
               ) -> dict[str, torch.Tensor]:
        """One gradient update on batch b. noise: N × `noise_width(cfg)` uniforms (ensemble mask, online τ, target τ),
        drawn from the generator unless given (a captured step is handed noise drawn outside the graph).
        `after_backward()` runs between the backward pass and the optimizer step (the last point at which the
        parameters are still those the forward pass read: `train_step` stores the rolling refresh there).
        `targets_via(b, noise) -> (targets, wait)`: how the batch's `Targets` are made (`StepRunner`: on a side
        stream; `wait()` makes the update wait for them, after its online forward pass); None: `make_targets`'s
        here, first. `priorities_via(slot, td)`: how the replay's priorities are written (`StepRunner`: on a side
        stream before the backward pass, joined by `after_backward`); None: here, after the optimizer step."""
        N, dev = b.bar.shape[0], b.bar.device
        if noise is None:
            noise = torch.rand(N, noise_width(cfg), device=dev, generator=generator)
        tg, wait = (targets(b, noise), lambda: None) if targets_via is None else targets_via(b, noise)
        z, v_max = agent.support, agent.v_max                                              # A
        # --- online network at s (the encoder learns from the first `encoder_batch` samples, a random subset) ---
        n_enc = min(cfg.encoder_batch or N, N)
        emb = agent.encode(windows[b.bar[:n_enc]])
        if n_enc < N:
            emb = torch.cat([emb, buf.emb_online[b.bar[n_enc:]].to(emb.dtype)])
        out = agent.head(emb, b.portfolio)
        # the portfolio shift of the taken action of every branch
        col = b.action + agent.branch_first                                                # N × NBR
        d_a = out.delta.gather(1, col)                                                     # N × NBR
        # IQN: the online quantiles of the taken direction at τ (shifted by δ_direction), on the first n_q samples
        n_q = iqn_rows(cfg, N)
        taus = noise[:n_q, n_ens:n_ens + M]                                                # n_q × M
        th = agent.quantiles(out.hidden[:n_q], taus).float() + out.delta[:n_q, :3].unsqueeze(1)  # n_q × M × 3
        th = th.gather(2, b.action[:n_q, 0].view(n_q, 1, 1).expand(n_q, M, 1)).squeeze(2)  # n_q × M
        # only what the losses read crosses `wait()`, a graph break when compiled: a live `out` would make every
        # field of it an output of the forward graph, and the trunk state and the shift, which reach the loss only
        # through the terms above, would get no gradient there and autograd would fill zeros for them
        # the direction Q with the C51 terms where it pays, the fused kernels; compiled without them it is the same
        # chain of compiled kernels, and torch 2.11's CPU inductor got its gradients wrong (session 24: the size and
        # exit branches' and V's 100 % off eager, torch 2.13 exact; `test_compiled_update_equals_eager_on_one_batch`)
        q_in_c51 = cfg.direction_q_in_c51 and (fused or not torch.compiler.is_compiling())
        if q_in_c51:
            wide, d_dir, value_e = out.wide, out.delta[:, :3], out.value_e
        else:
            q_dir = agent.q_values(out.logits[:, :, :3], out.delta).mean(1)                # N × 3
            logits, value_e = out.logits, out.value_e
        del out
        wait()
        # --- C51 loss of every branch against its target; each ensemble member trains on its bootstrap mask ---
        # the distribution of (s, p, a): the market one with its atoms moved by the portfolio shift δ_a
        if q_in_c51:                    # with every member's direction Q, from the heads' padded output
            ce, ent_k, util_k, q_k = c51_branch_losses_q(wide, n_ens, col, d_a, tg.dist, z,
                                                         agent.cfg.branch_sizes, fused=fused)  # …, N × K × 3
            q_dir = (q_k + d_dir.unsqueeze(1)).mean(1)                                     # N × 3
        else:
            ce, ent_k, util_k = c51_branch_losses(logits, col, d_a, tg.dist, z, agent.cfg.branch_sizes,
                                                  fused=fused)                             # N × NBR × K, N × K
        member = (noise[:, :n_ens] < cfg.ensemble_mask_p).float()                          # N × K
        c51 = ((ce * member.unsqueeze(1)).sum(2) / member.sum(1, keepdim=True).clamp(min=1.0)).sum(1)  # N
        priority = ce[:, 0].mean(1).detach()
        # --- IQN quantile Huber on the direction branch (in units of v_max, κ = 1), blended over horizons ---
        qh = quantile_huber_loss((th / v_max).repeat_interleave(Hs, 0), (tg.quantiles / v_max).reshape(n_q * Hs, M),
                                 taus.repeat_interleave(Hs, 0))                            # n_q·H'
        iqn = (qh.view(n_q, Hs) * tg.blend[:n_q]).sum(1)                                   # n_q
        # --- expectile value head on the blended scalar target of the direction branch ---
        y = tg.value
        expl = expectile_loss((y - value_e.float()) / v_max, cfg.expectile)               # N
        per_sample = c51 + cfg.expectile_coef * expl
        # --- the batch's scalars as sums over its rows, each in two levels (`batch_sum`): no reduction of a batch
        # scalar depends on another, so none of them waits for one thread block to loop over the whole batch ---
        first, second = top_two(q_dir)
        gap_n = (first - second) / v_max                                                   # N
        y0 = y[0].detach()                                        # a shift: the variance's sums without cancellation
        lab = buf.hindsight[b.bar]                                                         # N
        has = (lab >= 0).float()
        hce = torch.nn.functional.cross_entropy(q_dir / (0.1 * v_max), lab.clamp(min=0), reduction="none")
        s_loss, s_c51, s_expl, s_q, s_y, s_y2, s_gap, s_gap2, s_hce, s_has, s_ent, s_util, s_iqn_w, s_iqn = (
            batch_sum(r) for r in (b.weight * per_sample, c51, expl, q_dir.mean(1), y - y0, (y - y0).square(), gap_n,
                                   gap_n.square(), hce * has, has, ent_k.mean(1), util_k.mean(1),
                                   b.weight[:n_q] * iqn, iqn))
        ent, util = s_ent / N, s_util / N
        # --- stability terms on the online direction Q ---
        centre = ((s_q / N - (s_y / N + y0)) / v_max) ** 2
        y_std = ((s_y2 - s_y * s_y / N) / max(N - 1, 1)).clamp(min=0.0).sqrt()          # y.std(), unbiased
        gap_star = cfg.q_gap_frac * y_std / v_max
        gap = s_gap2 / N - 2.0 * gap_star * s_gap / N + gap_star * gap_star            # mean((gap_n − gap*)²)
        hind = s_hce / s_has.clamp(min=1.0)
        # the IQN term's mean over its n_q samples (all N unless `iqn_batch`): an unbiased estimate of its batch mean
        loss = (s_loss / N + cfg.iqn_coef * s_iqn_w / n_q + cfg.q_centre_coef * centre + cfg.q_gap_coef * gap
                + cfg.hindsight_coef * hind - buf.entropy_coef * ent)
        # the metrics, taken before the backward from detached tensors: a tensor that requires grad and is read
        # after the backward would be an output of the compiled forward that gets no gradient, and autograd fills
        # a zero gradient for each such output (four aten fill kernels on the H200, session 20)
        metrics = {"loss": loss.detach(), "c51": s_c51.detach() / N, "iqn": s_iqn.detach() / n_q,
                   "expectile": s_expl.detach() / N, "q_mean": s_q.detach() / N, "entropy": ent.detach(),
                   "utilisation": util.detach()}
        if priorities_via is not None:    # the priorities need only the loss: beside the backward pass
            priorities_via(b.slot, priority)
        # grads set to None, not zeroed: backward then hands each parameter its gradient tensor (no zeroing and no
        # accumulation kernels); captured, those tensors come from the graph's pool at fixed addresses
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if after_backward is not None:
            after_backward()
        if flat:
            gnorm = opt.step(cfg.grad_clip)                                                # clip + AdamW
        else:
            gnorm = clip_grad_norm(params, cfg.grad_clip)
            opt.step()
        with torch.no_grad():
            if flat:
                target_flat.lerp_(opt.flat, cfg.tau)                                      # θ' ← θ' + τ(θ − θ')
            else:
                torch._foreach_lerp_(tparams, params, cfg.tau)
            adapt_entropy_coef(buf.entropy_coef, util, cfg.entropy_target, cfg.entropy_rate)
            if priorities_via is None:
                replay.update_priorities(b.slot, priority)
        return {**metrics, "grad_norm": gnorm.detach()}

    return update


# ---------------------------------------------------------------------------------------------------------
# The iteration, eager or captured: collection and update as step functions over static buffers
# ---------------------------------------------------------------------------------------------------------
def _targets_into(targets: Callable[[Batch, torch.Tensor], Targets], b: Batch, noise: torch.Tensor,
                  out: list[torch.Tensor]) -> None:
    """Write targets(b, noise) into the static tensors `out` (`Targets.tensors()` order). Compiled with it, each
    copy is the store of the kernel that computes the tensor; after the compiled call instead, it was one more
    multi-tensor copy kernel on the targets' stream (~20 µs at batch 4 096 on the H200, session 21)."""
    for o, t in zip(out, targets(b, noise).tensors()):
        o.copy_(t)


class StepRunner:
    """An iteration's step functions with static noise buffers, run eagerly, compiled, captured in CUDA graphs,
    or both (`accel`). The same Python code runs in every mode.

    collect():   n_envs × env_steps_per_iter environment steps (policy with ε and gates, simulator, rewards, replay
                 write, episode resets) — `TrainEnv.collect`.
    update():    sampling from replay, the full update (C51 + IQN + expectile + stability + hindsight losses,
                 backward, clip, AdamW, target lerp, priorities), LR schedule and cosine restarts on the device
                 (CUDA), metric sums and the rolling embedding refresh — `train_step` (on CUDA the refresh's
                 encodings run on a side stream beside the forward and backward passes, and the update's targets,
                 `make_targets`, on another beside its online forward pass: `target_stream`).
    iteration(): collect() then updates_per_iter × update() — in the graph modes one CUDA graph for all of it, so
                 a training iteration is one launch with no host work between its halves.
    Each call first draws its uniforms from the run's generator into static noise tensors (outside any graph), in
    the order the eager calls would (collection, then each update), so every mode consumes the same random stream.
    A graph is captured on the first call, whose warm-up run is that call's real step; later calls replay it.
    """

    def __init__(self, state: "TrainState", accel: str):
        self.state, self.accel = state, accel
        cfg, dev, env = state.cfg, state.device, state.env
        self.collect_noise = torch.zeros(cfg.env_steps_per_iter, cfg.n_envs, 7, device=dev)
        self.update_noise = [torch.zeros(cfg.batch_size, 1 + noise_width(cfg), device=dev)
                             for _ in range(max(cfg.updates_per_iter, 1))]
        collect_fn = lambda: env.collect(state.agent, state.controls, cfg.env_steps_per_iter,  # noqa: E731
                                         state.buffers.emb_online, self.collect_noise,
                                         view_table=state.buffers.view_online)
        update_fn = lambda noise, staged, join, via, prio: train_step(state, noise, staged, join, via, prio)  # noqa: E731
        encode_fn = lambda: refresh_encode(state)  # noqa: E731
        targets_fn = lambda b, noise, out: _targets_into(state.targets, b, noise, out)  # noqa: E731
        if cfg.bf16 and dev.type == "cuda":
            collect_fn, update_fn, encode_fn, targets_fn = (_bf16(collect_fn), _bf16(update_fn), _bf16(encode_fn),
                                                            _bf16(targets_fn))
        if "compile" in accel:
            collect_fn, update_fn, encode_fn, targets_fn = (compile_step(f, cfg, dev) for f in
                                                            (collect_fn, update_fn, encode_fn, targets_fn))
        if dev.type == "cuda":
            # the rolling refresh's encodings on a side stream, beside the update's forward and backward passes
            # (both only read the parameters); the update waits for them just before its optimizer step. Static
            # staging tensors carry them across, so nothing allocated on one stream is freed on the other.
            side = torch.cuda.Stream(device=dev)
            C, D = state.refresh_idx.shape[0], cfg.agent.d_model
            staging = [torch.zeros(C, D, device=dev), torch.zeros(C, D, device=dev)]
            if state.buffers.view_online is not None:
                staging += [torch.zeros(C, *getattr(state.buffers.view_online, f).shape[1:], device=dev)
                            for f in MarketView.FIELDS]
            join = torch._dynamo.disable(lambda: torch.cuda.current_stream().wait_stream(side))
            via = self._side_targets(targets_fn) if cfg.target_stream else None
            prio = self._side_priorities(side) if cfg.priorities_aside else None

            def encode_aside() -> None:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch._foreach_copy_(staging, list(encode_fn()))

            if cfg.refresh_at_backward and prio is not None:
                write_priorities = prio

                @torch._dynamo.disable
                def prio(slot: torch.Tensor, td: torch.Tensor) -> None:   # the loss is known: the backward is next
                    encode_aside()
                    write_priorities(slot, td)

                def update_call(noise: torch.Tensor) -> None:
                    update_fn(noise, staging, join, via, prio)
            else:
                def update_call(noise: torch.Tensor) -> None:
                    encode_aside()
                    update_fn(noise, staging, join, via, prio)
        else:
            def update_call(noise: torch.Tensor) -> None:
                update_fn(noise, None, lambda: None, None, None)
        self.pinned = StaticState(env.sim, env.tracker, env)
        if "graph" in accel:
            def collect_body():
                collect_fn()
                self.pinned.commit()
        else:
            collect_body = collect_fn

        def iteration_body():
            collect_body()
            for noise in self.update_noise[:cfg.updates_per_iter]:
                update_call(noise)
        self._bodies = {"collect": collect_body, "update": lambda: update_call(self.update_noise[0]),
                        "iteration": iteration_body}
        self._graphs: dict[str, object] = {}
        self._ran: set[str] = set()
        self.compile_s = 0.0
        """Seconds spent in first calls of the compiled or captured modes (compiling, capturing, running once)."""
        self.on_compile: Callable[[str | None], None] | None = None
        """Told what is being compiled when a first call starts ("compiling the iteration", …) and None when it
        ends: the trainer's /status phase and `tradeloop train`'s progress show it."""

    def _side_targets(self, targets_fn: Callable[[Batch, torch.Tensor, list[torch.Tensor]], None]
                      ) -> Callable[[Batch, torch.Tensor], tuple[Targets, Callable[[], None]]]:
        """The update's `targets_via` on CUDA: the batch's `Targets` on their own stream, beside the online forward
        pass (they read the batch, the parameters and the tables; the online pass reads the same), written into
        static tensors so nothing allocated on one stream is freed on the other (`_targets_into`); `wait()` joins
        them."""
        cfg, dev = self.state.cfg, self.state.device
        N, H, M = cfg.batch_size, sample_horizons(cfg), cfg.iqn_quantiles
        NBR, A = len(cfg.agent.branch_sizes), cfg.agent.n_atoms
        out = Targets(dist=torch.zeros(N, NBR, A, device=dev),
                      quantiles=torch.zeros(iqn_rows(cfg, N), H, M, device=dev),
                      value=torch.zeros(N, device=dev), blend=torch.zeros(N, H, device=dev))
        stream = torch.cuda.Stream(device=dev)
        wait = torch._dynamo.disable(lambda: torch.cuda.current_stream().wait_stream(stream))

        @torch._dynamo.disable
        def via(b: Batch, noise: torch.Tensor) -> tuple[Targets, Callable[[], None]]:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                targets_fn(b, noise, out.tensors())
            return out, wait
        return via

    def _side_priorities(self, side: torch.cuda.Stream) -> Callable[[torch.Tensor, torch.Tensor], None]:
        """The update's `priorities_via` on CUDA: the replay's priority write on `side` (the rolling refresh's stream,
        which the update joins after its backward pass), run eagerly there. The batch's slots and TD errors come from
        the update's stream: `record_stream` keeps their memory from being reused before `side` has read them."""
        replay = self.state.replay

        @torch._dynamo.disable
        def via(slot: torch.Tensor, td: torch.Tensor) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                replay.update_priorities(slot, td)
            slot.record_stream(side)
            td.record_stream(side)
        return via

    @property
    def graphed(self) -> bool:
        return "graph" in self.accel

    def _run(self, name: str) -> None:
        if self.accel != "eager" and name not in self._ran:
            return self._first(name)
        if not self.graphed:
            self._bodies[name]()
        elif name in self._graphs:
            self._graphs[name]()
        else:
            self._graphs[name] = capture(self._bodies[name], warmup=1)

    def _first(self, name: str) -> None:
        """The first call of a step in a compiled or captured mode: compiles (torch.compile's caches in
        `shared.graphs.compile_cache_dir()`) and/or captures it, timed into `compile_s`, announced to `on_compile`."""
        what = " and capturing" if "compile" in self.accel and self.graphed else ""
        label = f"{'compiling' if 'compile' in self.accel else 'capturing'}{what} the {name} step"
        if self.on_compile is not None:
            self.on_compile(label)
        t0 = time.perf_counter()
        try:
            self._ran.add(name)
            self._run(name)
            if self.state.device.type == "cuda":
                torch.cuda.synchronize(self.state.device)
        finally:
            self.compile_s += time.perf_counter() - t0
            if self.on_compile is not None:
                self.on_compile(None)

    def _draw(self, t: torch.Tensor) -> None:
        torch.rand(t.shape, generator=self.state.generator, out=t)

    def collect(self) -> None:
        self._draw(self.collect_noise)
        self.pinned.commit()      # eager code between steps (episode resets, resume) may have rebound state
        self._run("collect")

    def update(self) -> None:
        self._draw(self.update_noise[0])
        self._run("update")

    def iteration(self, before_update: Callable[[], None] = lambda: None,
                  mark: Callable[[], object] = lambda: None) -> object:
        """collect(), then updates_per_iter × (before_update(), update()). In the graph modes the host's
        `before_update` calls all run first (host bookkeeping only: on CUDA the LR schedule is on the device), one
        graph replays the whole iteration, and None is returned; eagerly, the same calls in the same order, and
        `mark()` taken between the collection and the updates is returned (a clock reading)."""
        n = self.state.cfg.updates_per_iter
        if not self.graphed:
            self.collect()
            between = mark()
            for _ in range(n):
                before_update()
                self.update()
            return between
        self._draw(self.collect_noise)
        for noise in self.update_noise[:n]:
            self._draw(noise)
        for _ in range(n):
            before_update()
        self.pinned.commit()
        self._run("iteration")
        return None


def inductor_options(spec: str) -> dict[str, bool]:
    """`TrainConfig.inductor` ("a,!b,triton.c") as torch.compile's options ({"a": True, "b": False, "triton.c": True}:
    a leading "!" turns an option off, a dotted name is an option of a sub-config); ValueError naming an option that
    is not a boolean of `torch._inductor.config`."""
    from torch._inductor import config as inductor_config

    out = {}
    for item in (n.strip() for n in spec.split(",")):
        if not item:
            continue
        name = item.lstrip("!")
        value: object = inductor_config
        for part in name.split("."):                        # "triton.enable_pdl": an option of a sub-config
            value = getattr(value, part, None)
        if not isinstance(value, bool):
            raise ValueError(f"TrainConfig.inductor: {name!r} is not a boolean option of torch._inductor.config")
        out[name] = not item.startswith("!")
    return out


def compile_step(fn: Callable[..., object], cfg: TrainConfig, device: torch.device | str) -> Callable[..., object]:
    """`fn` through torch.compile with the config's inductor options, for a step on `device`.

    On a CPU with torch older than 2.13, without inductor's pattern-matcher passes: torch 2.11's lost the C51 heads'
    gradients of the compiled update on the CPU (`adv_w` 0, `value_w` 1e-3 of eager; the same graph through
    `aot_eager` and the same inductor with `pattern_matcher` off matched eager within 1.4e-6; CUDA and torch 2.13
    unaffected — tests/test_train_graph.py's one-batch test, session 18)."""
    use_compile_cache()
    options = inductor_options(cfg.inductor)
    if torch.device(device).type == "cpu" and torch.__version__ < "2.13":      # a TorchVersion: compared as one
        options.setdefault("pattern_matcher", False)
    return torch.compile(fn, options=options or None)


def _bf16(fn: Callable[..., object]) -> Callable[..., object]:
    """fn under bf16 autocast; the autocast weight cache is off, as CUDA-graph capture requires."""
    def run(*args):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            return fn(*args)
    return run


def train_step(state: "TrainState", noise: torch.Tensor, staged: list[torch.Tensor] | None = None,
               join: Callable[[], None] = lambda: None,
               targets_via: Callable[[Batch, torch.Tensor], tuple[Targets, Callable[[], None]]] | None = None,
               priorities_via: Callable[[torch.Tensor, torch.Tensor], None] | None = None
               ) -> dict[str, torch.Tensor]:
    """Sample a batch (inverse CDF with noise[:, 0]), update on it (noise[:, 1:]), add its metrics to the epoch's
    sums, and advance the rolling embedding refresh. On CUDA the LR schedule runs on the device first.

    The refresh encodes the next chunk of bars with the parameters this update starts from (`refresh_encode`) and
    stores the encodings into the tables after the backward pass, before the optimizer step (`refresh_store`), so
    the encoding reads nothing the update writes and the update's own table reads come first. `staged`: those
    encodings, already computed by the caller (`StepRunner` runs them on a side stream, overlapping the forward
    and backward passes, and hands over `join`, which makes the update wait for them); None: computed here.
    `targets_via`, `priorities_via`: how the update makes its targets and writes the replay's priorities
    (`make_update`; the `StepRunner`'s side streams), None: inline."""
    cfg, buf = state.cfg, state.buffers
    if state.device.type == "cuda":
        device_lrs(state.opt, buf, cfg)
    if staged is None:
        staged = refresh_encode(state)

    def store() -> None:
        join()
        refresh_store(state, staged)
    b = state.replay.sample(cfg.batch_size, u=noise[:, 0])
    m = state.update(b, noise[:, 1:], after_backward=store, targets_via=targets_via, priorities_via=priorities_via)
    buf.metric_sums.add_(torch.stack([m[k].float() for k in METRICS]))
    return m


# ---------------------------------------------------------------------------------------------------------
# State, epoch
# ---------------------------------------------------------------------------------------------------------
@dataclass
class EpochStats:
    """One line of history.jsonl."""

    epoch: int
    loss: float
    c51: float
    iqn: float
    expectile: float
    q_mean: float
    entropy: float
    utilisation: float
    epsilon: float
    gamma: float
    v_max: float
    maturity: float
    env_steps: int
    updates: int
    env_steps_per_s: float
    """Account-steps per second of collection time; an iteration captured whole (collection and updates in one
    graph) counts entirely here and in `updates_per_s`."""
    updates_per_s: float
    seconds: float
    compile_s: float
    """Of `seconds`, the first calls of the compiled or captured steps (compiling, capturing): the first epoch of a
    process in those modes; 0 eagerly and once compiled."""
    train_per_trade_sharpe: float
    """Un-annualized, per trade, of the trades closed while collecting this epoch (with exploration)."""
    train_trades: int
    knobs: dict
    rolled_back_to: int | None = None
    """The epoch whose learner a feedback rollback restored before this epoch trained (`roll_back`), else None."""


@dataclass
class TrainState:
    """Everything that `train_epoch` mutates and a checkpoint restores."""

    cfg: TrainConfig
    device: torch.device
    agent: Agent
    target: Agent
    opt: torch.optim.AdamW
    replay: Replay
    env: TrainEnv
    controls: PolicyControls
    buffers: UpdateBuffers
    generator: torch.Generator
    update: Callable[[Batch], dict]
    targets: Callable[[Batch, torch.Tensor], Targets]
    """`make_targets`'s: the update's no-grad targets of a batch (the `StepRunner` runs them on a side stream)."""
    epoch: int = 0
    knobs: Knobs | None = None
    """The knobs of the last `apply_knobs` (saved in the checkpoint: the evaluator gates as trained)."""
    update_step: int = 0
    env_steps: int = 0
    accel: str = "eager"
    """How the iteration runs: eager, compile, graph or compile+graph (`StepRunner`)."""
    refresh_idx: torch.Tensor | None = None
    """0 … C−1: the rolling embedding refresh re-encodes C bars per update."""
    runner: "StepRunner | None" = None


def build_state(cfg: TrainConfig, bars: Bars, split: Split, seed: int, device="cpu",
                features: np.ndarray | None = None, accel: str = "auto") -> TrainState:
    """Fresh training state on the training split of `bars`, seeded; `accel`: see `resolve_accel`."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.manual_seed(seed)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    feats = compute_features(bars) if features is None else features
    market = MarketTensors.from_bars(bars, *split.train, cfg.agent.window, device, features=feats)
    agent = Agent(cfg.agent).to(device)
    if cfg.attention not in ("sdpa", "triton"):
        raise ValueError(f"attention={cfg.attention!r}: use 'sdpa' or 'triton'")
    a = cfg.agent
    agent.fold_layer_norms(cfg.fold_ln)
    if cfg.attention == "triton" and fused_attention.supported(agent.v_max, a.window, a.d_model // a.n_heads):
        agent.use_attention_kernels((fused_attention.causal_attention, fused_attention.last_query_attention))
    target = copy.deepcopy(agent)
    for p in target.parameters():
        p.requires_grad_(False)
    accel = resolve_accel(accel, device)
    opt = build_optimizer(agent, cfg, device, compiled="compile" in accel)
    replay = Replay(cfg.replay_capacity, cfg.n_envs, cfg.agent.n_portfolio, len(market), cfg.horizons, device)
    warmup = max(cfg.agent.window, FEATURE_WARMUP - split.train[0], 0)
    env = TrainEnv(market, cfg.n_envs, warmup, cfg.reward, replay, CostModel(cfg.costs_bps), gen)
    controls = PolicyControls.make(device)
    buf = UpdateBuffers(gamma=torch.tensor(0.97, device=device), q_bias=torch.tensor(0.0, device=device),
                        entropy_coef=torch.tensor(cfg.entropy_init, device=device),
                        horizon_blend=torch.tensor(cfg.horizon_blend, dtype=torch.float32, device=device),
                        hindsight=torch.full((len(market),), -1, dtype=torch.long, device=device),
                        emb_online=torch.zeros(len(market), cfg.agent.d_model, device=device),
                        emb_target=torch.zeros(len(market), cfg.agent.d_model, device=device),
                        emb_offset=torch.zeros((), dtype=torch.long, device=device),
                        view_online=_view_table(cfg.agent, len(market), device) if cfg.act_view_cache else None,
                        step=torch.zeros((), dtype=torch.float64, device=device),
                        lr_scale=torch.ones(len(opt.param_groups), dtype=torch.float64, device=device),
                        lr_branch=torch.tensor([g["branch"] in BRANCHES for g in opt.param_groups], device=device),
                        metric_sums=torch.zeros(len(METRICS), device=device))
    targets = make_targets(agent, target, buf, cfg)
    update = make_update(agent, target, opt, replay, market.windows, buf, cfg, gen, targets)
    chunk = -(-len(market) // max(cfg.emb_refresh, 1))
    state = TrainState(cfg, device, agent, target, opt, replay, env, controls, buf, gen, update, targets,
                       accel=accel, refresh_idx=torch.arange(chunk, device=device))
    state.runner = StepRunner(state, state.accel)
    return state


def _view_table(cfg: AgentConfig, T: int, device) -> MarketView:
    """A zeroed T-row `MarketView` table (filled by `refresh_embeddings`)."""
    z = lambda *shape: torch.zeros(T, *shape, device=device)  # noqa: E731
    return MarketView(q=z(cfg.n_actions), q_std=z(3), tail=z(cfg.n_tail, 3), code=z(cfg.code_dim))


def _store_view(table: MarketView, idx: torch.Tensor, v: MarketView) -> None:
    """table[idx] = v for each field, in place (`index_copy_`: capturable)."""
    for name in MarketView.FIELDS:
        dst = getattr(table, name)
        dst.index_copy_(0, idx, getattr(v, name).to(dst.dtype))


def apply_knobs(state: TrainState, knobs: Knobs) -> None:
    """Write an epoch's knobs into the device tensors and tables the policy and the update read."""
    knobs.validate()
    state.knobs = knobs
    state.controls.set(epsilon=knobs.epsilon, gate_threshold=knobs.gate_threshold,
                       regime_confidence=knobs.regime_confidence)
    state.buffers.gamma.fill_(knobs.gamma)
    state.buffers.lr_scale.copy_(torch.tensor([knobs.lr_scale.get(g["branch"], 1.0)
                                               for g in state.opt.param_groups], dtype=torch.float64))
    state.buffers.q_bias.fill_(knobs.q_bias)
    # E6/E7 name absolute bars of the dataset (inside the train range); the replay and the label table are
    # indexed from the start of the training window
    T, t0 = len(state.env.market), state.env.market.start
    boost = [(b - t0, m) for b, m in knobs.priority_boost if 0 <= b - t0 < T]
    state.replay.set_bar_boost([b for b, _ in boost], [m for _, m in boost])
    state.buffers.hindsight.fill_(-1)
    hs = [(b - t0, d) for b, d in knobs.hindsight if 0 <= b - t0 < T and d in (0, 1, 2)]
    if hs:
        state.buffers.hindsight[torch.tensor([b for b, _ in hs], device=state.device)] = torch.tensor(
            [d for _, d in hs], device=state.device)
    state.env.set_regime_weights(knobs.regime_weights)


@torch.no_grad()
def refresh_embeddings(state: TrainState, chunk: int = 4096) -> None:
    """Recompute the cached market embeddings of every training bar (online and target networks), in place;
    the rolling refresh restarts at bar 0."""
    w, buf = state.env.market.windows, state.buffers
    for net, out in ((state.agent, buf.emb_online), (state.target, buf.emb_target)):
        for i in range(0, w.shape[0], chunk):
            out[i:i + chunk] = net.encode(w[i:i + chunk])
            if buf.view_online is not None and net is state.agent:
                rows = torch.arange(i, min(i + chunk, w.shape[0]), device=w.device)
                _store_view(buf.view_online, rows, net.view(out[i:i + chunk]))
    buf.emb_offset.zero_()


@torch.no_grad()
def refresh_encode(state: TrainState) -> list[torch.Tensor]:
    """The next C bars (cyclically) of the rolling refresh encoded with the current parameters: [online embeddings,
    target embeddings] (+ the fields of the online `MarketView` when it is cached). Reads only parameters and
    windows (`refresh_store` writes them into the tables)."""
    buf, T = state.buffers, state.buffers.emb_online.shape[0]
    w = state.env.market.windows[(buf.emb_offset + state.refresh_idx) % T]
    emb = state.agent.encode(w)
    out = [emb, state.target.encode(w)]
    if buf.view_online is not None:
        v = state.agent.view(emb)
        out += [getattr(v, name) for name in MarketView.FIELDS]
    return out


@torch.no_grad()
def refresh_store(state: TrainState, staged: list[torch.Tensor]) -> None:
    """Write `refresh_encode`'s encodings into the tables, in place, and advance the offset: every bar's cached
    embedding is at most `emb_refresh` updates old, at a constant cost per update (capturable: the offset is a
    device scalar)."""
    buf, T = state.buffers, state.buffers.emb_online.shape[0]
    idx = (buf.emb_offset + state.refresh_idx) % T                                         # C
    buf.emb_online.index_copy_(0, idx, staged[0].to(buf.emb_online.dtype))
    buf.emb_target.index_copy_(0, idx, staged[1].to(buf.emb_target.dtype))
    if buf.view_online is not None:
        _store_view(buf.view_online, idx, MarketView(*staged[2:]))
    buf.emb_offset.add_(state.refresh_idx.shape[0]).remainder_(T)


def refresh_rolling(state: TrainState) -> None:
    """Re-encode the next C bars of both embedding tables (and the online view table), in place."""
    refresh_store(state, refresh_encode(state))


@torch.no_grad()
def adapt_support(state: TrainState) -> None:
    """v_max ← ½ v_max + ½ · margin · quantile(|20-step reward sums in replay|): the support follows the reward
    scale (the update's projection re-maps old distributions onto the new support)."""
    rp, cfg = state.replay, state.cfg
    if rp.count < 64:
        return
    r = rp.reward[: rp.count]                                                              # L × E
    h = min(max(cfg.horizons), rp.count)
    sums = r.unfold(0, h, 1).sum(-1).abs().flatten()
    q = torch.quantile(sums[torch.randperm(sums.numel(), generator=state.generator, device=sums.device)[:100_000]],
                       cfg.support_quantile)
    new = (0.5 * state.agent.v_max + 0.5 * (cfg.support_margin * q).clamp(0.005, 1.0))
    state.agent.v_max.copy_(new)
    state.target.v_max.copy_(new)


class PhaseClock:
    """Seconds spent in the phases of an epoch without stalling the GPU: the host clock on a CPU; on CUDA, events
    recorded on the stream between phases (no sync in the loop) and read once, in `totals`, at the epoch's end."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.spans: list[tuple[str, object, object]] = []

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return mark

    def add(self, phase: str, start, end) -> None:
        self.spans.append((phase, start, end))

    def totals(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, float] = {}
        for phase, a, b in self.spans:
            out[phase] = out.get(phase, 0.0) + (a.elapsed_time(b) / 1e3 if self.cuda else b - a)
        return out


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


class EpochInterrupted(Exception):
    """`train_epoch` stopped at an iteration boundary because `interrupt()` returned True; the state is consistent
    there (no step half done) and `progress` says how far the epoch got."""

    def __init__(self, progress: EpochProgress):
        super().__init__(f"epoch {progress.epoch} interrupted after iteration {progress.iteration}/"
                         f"{progress.iterations}")
        self.progress = progress


def train_epoch(state: TrainState, knobs: Knobs, progress: Callable[[int, int], None] | None = None,
                between: Callable[[int], Knobs | None] | None = None, *,
                interrupt: Callable[[], bool] | None = None, resume: EpochProgress | None = None) -> EpochStats:
    """One epoch: apply knobs → fresh episodes → iterations of (collect E × env_steps_per_iter, update) → stats.

    `between(it)` is asked before each iteration: new knobs it returns are applied there and rule the rest of the
    epoch (the trainer's overlap mode: a bundle that arrives mid-epoch). `interrupt()` is asked there too: True
    raises `EpochInterrupted` at that boundary. `resume` (with the state of `restore_interrupted`) finishes an
    interrupted epoch: its remaining iterations under `knobs` (those in effect when it stopped), with fresh
    episodes, the support as it was, and the epoch's sums carried, so its stats cover the whole epoch."""
    cfg, env = state.cfg, state.env
    apply_knobs(state, knobs)
    if resume is None:
        adapt_support(state)
        env.reset_all()
        env.pop_trade_stats()
        state.buffers.metric_sums.zero_()
        start, n_upd, n_env0, t_before, spent_before = 0, 0, state.env_steps, 0.0, {}
    else:
        if (resume.epoch, resume.iterations) != (state.epoch + 1, cfg.iterations):
            raise ValueError(f"cannot resume epoch {resume.epoch} ({resume.iterations} iterations) on a state after "
                             f"epoch {state.epoch} ({cfg.iterations} iterations an epoch)")
        env.reset_all()
        start, n_upd = resume.iteration, resume.updates
        n_env0, t_before, spent_before = state.env_steps - resume.env_steps, resume.seconds, resume.phases
    refresh_embeddings(state)
    state.buffers.step.fill_(float(state.update_step))
    runner = state.runner
    compile0 = runner.compile_s
    t0 = time.perf_counter()
    state.agent.train()
    cuda = state.device.type == "cuda"
    clock = PhaseClock(cuda)

    def before_update() -> None:                # host bookkeeping of one update (LRs on a CPU, group ages)
        nonlocal n_upd
        set_lrs(state.opt, state.update_step, knobs.lr_scale, cfg, write_lr=not cuda)
        n_upd += 1
        state.update_step += 1

    for it in range(start, cfg.iterations):
        if interrupt is not None and interrupt():
            spent = clock.totals()
            raise EpochInterrupted(EpochProgress(
                epoch=state.epoch + 1, iteration=it, iterations=cfg.iterations, updates=n_upd,
                env_steps=state.env_steps - n_env0, seconds=t_before + time.perf_counter() - t0,
                phases={k: spent_before.get(k, 0.0) + spent.get(k, 0.0) for k in {*spent_before, *spent}},
                knobs=knobs.to_dict()))
        if between is not None and (new := between(it)) is not None:
            apply_knobs(state, new)
            knobs = new
        after = state.env_steps + cfg.n_envs * cfg.env_steps_per_iter
        learn = after >= cfg.learning_starts and after // cfg.n_envs > max(cfg.horizons)
        ta = clock.now()
        if not learn:
            runner.collect()
            clock.add("env", ta, clock.now())
        elif (tb := runner.iteration(before_update, mark=clock.now)) is None:
            # one graph for the collection and the updates: the iteration's time counts for both rates
            clock.add("iteration", ta, clock.now())
        else:
            clock.add("env", ta, tb)
            clock.add("update", tb, clock.now())
        state.env_steps = after
        if progress is not None:
            progress(it + 1, cfg.iterations)
    spent = clock.totals()
    spent = {k: spent_before.get(k, 0.0) + spent.get(k, 0.0) for k in {*spent_before, *spent}}
    t_it = spent.get("iteration", 0.0)
    t_env, t_upd = spent.get("env", 0.0) + t_it, spent.get("update", 0.0) + t_it
    mat = 1.0 - math.exp(-state.update_step / cfg.maturity_updates)
    state.agent.maturity.fill_(mat)
    state.target.maturity.fill_(mat)
    means = ({k: float(v) / n_upd for k, v in zip(METRICS, state.buffers.metric_sums.tolist())} if n_upd else {})
    sharpe, n_trades = env.pop_trade_stats()
    state.epoch += 1
    dt = t_before + time.perf_counter() - t0
    env_steps = state.env_steps - n_env0
    nan = float("nan")
    return EpochStats(epoch=state.epoch, loss=means.get("loss", nan), c51=means.get("c51", nan),
                      iqn=means.get("iqn", nan), expectile=means.get("expectile", nan),
                      q_mean=means.get("q_mean", nan), entropy=means.get("entropy", nan),
                      utilisation=means.get("utilisation", nan), epsilon=knobs.epsilon, gamma=knobs.gamma,
                      v_max=float(state.agent.v_max), maturity=mat, env_steps=env_steps, updates=n_upd,
                      env_steps_per_s=env_steps / max(t_env, 1e-9), updates_per_s=n_upd / max(t_upd, 1e-9),
                      seconds=dt, compile_s=runner.compile_s - compile0, train_per_trade_sharpe=sharpe, train_trades=int(n_trades), knobs=knobs.to_dict())


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (safetensors only) and resume
# ---------------------------------------------------------------------------------------------------------
def _rng_tensor(state_bytes: torch.Tensor) -> torch.Tensor:
    return state_bytes.detach().cpu().to(torch.uint8).clone()


def agent_metadata(state: TrainState, run_meta: dict) -> dict:
    """Metadata of an agent checkpoint: what the evaluator needs to rebuild and trust it."""
    return {"kind": "agent", "epoch": state.epoch, "agent_config": state.cfg.agent.to_dict(),
            "config_hash": state.cfg.hash(), "dataset": run_meta.get("dataset"),
            "split": run_meta.get("split"), "split_hashes": run_meta.get("split_hashes"),
            "seed": run_meta.get("seed"), "update_step": state.update_step,
            "knobs": state.knobs.to_dict() if state.knobs is not None else None,
            "costs_bps": state.cfg.costs_bps}


def save_epoch(state: TrainState, run_dir: Path, run_meta: dict) -> tuple[Path, str]:
    """Write DIR/checkpoints/epoch-NNNN.safetensors (+ .state.safetensors); returns (path, sha256)."""
    ck = Path(run_dir) / "checkpoints"
    ck.mkdir(parents=True, exist_ok=True)
    path = ck / f"epoch-{state.epoch:04d}.safetensors"
    weights = {k: v.detach().contiguous() for k, v in state.agent.state_dict().items()}
    sha = save_checkpoint(path, weights, agent_metadata(state, run_meta))
    save_checkpoint(ck / f"epoch-{state.epoch:04d}.state.safetensors", _state_tensors(state),
                    {"kind": "trainer_state", **_state_meta(state)})
    return path, sha


def _state_tensors(state: TrainState) -> dict[str, torch.Tensor]:
    """The trainer state beside the agent's weights: target net, optimizer (flattened), replay, tracker, RNG."""
    t: dict[str, torch.Tensor] = {f"target.{k}": v.detach().contiguous() for k, v in state.target.state_dict().items()}
    names = {p: n for n, p in state.agent.named_parameters()}
    for p, st in state.opt.state.items():
        for k, v in st.items():
            t[f"opt.{names[p]}.{k}"] = torch.as_tensor(v).detach().contiguous()
    t.update({f"replay.{k}": v.contiguous() for k, v in state.replay.state_tensors().items()})
    t.update({f"tracker.{k}": v.contiguous() for k, v in state.env.tracker.state_tensors().items()})
    t["rng.generator"] = _rng_tensor(state.generator.get_state())
    t["rng.torch"] = _rng_tensor(torch.get_rng_state())
    t["buf.entropy_coef"] = state.buffers.entropy_coef.detach().clone()
    return t


def _state_meta(state: TrainState) -> dict:
    return {"epoch": state.epoch, "update_step": state.update_step, "env_steps": state.env_steps,
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
    path = Path(run_dir) / "checkpoints" / INTERRUPTED
    save_checkpoint(path, t, {"kind": "interrupted_epoch", **_state_meta(state), "progress": asdict(progress),
                              "record": record or {}})
    return path


def read_interrupted(run_dir: Path, epoch_done: int, config_hash: str) -> tuple[dict, dict] | None:
    """(tensors, metadata) of DIR/checkpoints/interrupted.safetensors when it continues the last complete epoch
    `epoch_done` under the same config and its sha256 checks; else None, and a file that cannot be used is
    removed (it is older than the last complete epoch, or cut by a kill)."""
    path = Path(run_dir) / "checkpoints" / INTERRUPTED
    if not path.exists():
        return None
    try:
        tensors, meta = load_checkpoint(path)
        ok = (meta.get("kind") == "interrupted_epoch" and int(meta["epoch"]) == epoch_done
              and meta.get("config_hash") == config_hash)
    except (ValueError, KeyError, TypeError):   # CheckpointError is a ValueError
        ok = False
    if ok:
        return tensors, meta
    remove_checkpoint(path)
    return None


def restore_interrupted(state: TrainState, tensors: dict, meta: dict) -> EpochProgress:
    """Load `read_interrupted`'s agent, trainer state and epoch sums into a freshly built `state` (same config);
    returns the progress to pass to `train_epoch(resume=…)`."""
    dev = state.device
    state.agent.load_state_dict({k[len("agent."):]: v.to(dev) for k, v in tensors.items() if k.startswith("agent.")})
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
    ck = Path(run_dir) / "checkpoints"
    pinned = set(pinned)
    gone = []
    for p in ck.glob("epoch-[0-9]*.safetensors"):
        e, state_file = int(p.name.split("-")[1].split(".")[0]), p.name.endswith(".state.safetensors")
        if e in pinned:
            continue
        if (state_file and e < epoch) or (not state_file and keep is not None and e <= epoch - keep):
            remove_checkpoint(p)
            gone.append(p)
    if (ck / INTERRUPTED).exists():
        remove_checkpoint(ck / INTERRUPTED)
        gone.append(ck / INTERRUPTED)
    return gone


def load_agent(path, expected_sha256: str | None = None, device="cpu") -> tuple[Agent, dict]:
    """Rebuild the agent of a checkpoint (file path or bytes); returns (agent in eval mode, metadata)."""
    tensors, meta = load_checkpoint(path, expected_sha256)
    return agent_from_checkpoint(tensors, meta, device), meta


def _load_epoch(state: TrainState, run_dir: Path, epoch: int, expected_sha256: str | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Epoch `epoch`'s weights and trainer-state tensors, and the state's metadata, each file checked against its
    sha256 (the weights against `expected_sha256` when given, else their sidecar)."""
    ck = Path(run_dir) / "checkpoints"
    w, _ = load_checkpoint(ck / f"epoch-{epoch:04d}.safetensors", expected_sha256)
    t, meta = load_checkpoint(ck / f"epoch-{epoch:04d}.state.safetensors")
    if meta["config_hash"] != state.cfg.hash():
        raise ValueError(f"{run_dir}: the run's config changed since epoch {epoch} (config hash mismatch)")
    return w, t, meta


def restore_state(state: TrainState, run_dir: Path, epoch: int) -> None:
    """Load epoch `epoch`'s agent and trainer state into a freshly built `state` (same config): resume."""
    w, t, meta = _load_epoch(state, run_dir, epoch)
    state.agent.load_state_dict({k: v.to(state.device) for k, v in w.items()})
    _load_state(state, t, meta)


def roll_back(state: TrainState, run_dir: Path, epoch: int, expected_sha256: str | None = None) -> None:
    """A feedback rollback (population-based training's exploit step): the learner of the best epoch `epoch` —
    its weights, target network, optimizer state (moments, step counts) and entropy coefficient, bit for bit from
    its checkpoint files (`expected_sha256`: the checkpoint its report evaluated) — replaces the current one, in
    place. What was collected stays (the replay buffer, the trade tracker), and time moves on (the RNGs, the epoch,
    update and environment-step counters, the LR schedule's group ages). The embedding tables the updates and
    collection read are recomputed from the restored encoders."""
    w, t, _ = _load_epoch(state, run_dir, epoch, expected_sha256)
    with torch.no_grad():
        state.agent.load_state_dict({k: v.to(state.device) for k, v in w.items()})
    _load_learner(state, t)
    refresh_embeddings(state)


@torch.no_grad()
def _load_learner(state: TrainState, t: dict) -> None:
    """The learner's part of `_state_tensors` back into `state`, in place: target network, optimizer state,
    entropy coefficient."""
    dev = state.device
    state.target.load_state_dict({k[len("target."):]: v.to(dev) for k, v in t.items() if k.startswith("target.")})
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
    state.epoch, state.update_step, state.env_steps = int(meta["epoch"]), int(meta["update_step"]), int(meta["env_steps"])


def latest_epoch(run_dir: Path) -> int:
    """Highest complete epoch in DIR/checkpoints (0 when none): both files and both sha256 sidecars present.

    `save_checkpoint` writes a file atomically and then its sidecar; a kill between the two leaves an epoch
    without a sidecar, which is not complete and is never resumed from (its sha256 could not be checked).
    """
    ck = Path(run_dir) / "checkpoints"
    best = 0
    for p in ck.glob("epoch-*.state.safetensors"):
        e = int(p.name.split("-")[1].split(".")[0])
        files = [ck / f"epoch-{e:04d}.safetensors", p]
        if all(f.exists() and sidecar_path(f).exists() for f in files):
            best = max(best, e)
    return best


def train_run(bars: Bars, dataset: str, run_dir: Path, epochs: int, *, config: str | TrainConfig = "small",
              seed: int = 0, device="cpu", accel: str = "auto", knobs_fn: Callable[[int], Knobs] | None = None,
              on_epoch: Callable[[EpochStats], None] | None = None,
              progress: Callable[[int, int], None] | None = None,
              on_compile: Callable[[str | None], None] | None = None,
              rollback_fn: Callable[[int], tuple[int, str] | None] | None = None,
              pinned_fn: Callable[[], Iterable[int]] | None = None, split: Split | None = None,
              features: np.ndarray | None = None) -> TrainState:
    """Train until `epochs` epochs exist in `run_dir`, resuming from its latest checkpoint when it holds a run.

    Knobs of epoch e (1-based) come from `knobs_fn(e)`, by default the config's fixed schedule
    (`cfg.schedule.knobs(e)`). `on_compile`: see `StepRunner.on_compile`. `rollback_fn(e)`, when given and not
    None, is (epoch, checkpoint sha256 or "") of a feedback rollback: `roll_back` to that epoch before epoch e trains
    (its record says `rolled_back_to`). `pinned_fn()`: epochs whose trainer state the pruning keeps (a later
    rollback's candidates). `split`: the bar ranges of a new run (default `chronological_split`; a walk-forward
    fold, `shared.market.walk_forward_folds`); a resumed run keeps its own and refuses a different one.
    `features`: `compute_features(bars)` when already computed."""
    run_dir = Path(run_dir)
    feats = compute_features(bars) if features is None else features
    run_json = run_dir / "run.json"
    if run_json.exists():
        meta = json.loads(run_json.read_text())
        cfg = TrainConfig.from_dict(meta["config"])
        asked, (split, seed) = split, (Split.from_dict(meta["split"]), int(meta["seed"]))
        if meta.get("bars_fingerprint") and meta["bars_fingerprint"] != bars.fingerprint():
            raise ValueError(f"{run_dir} holds a run on other data (dataset {meta.get('dataset')!r}); "
                             "use another --out directory")
        if asked is not None and asked != split:
            raise ValueError(f"{run_dir} holds a run on another split ({meta['split']}); use another --out directory")
    else:
        cfg = config if isinstance(config, TrainConfig) else TrainConfig.preset(config, feats.shape[1])
        split = chronological_split(len(bars)) if split is None else split
        meta = {"dataset": dataset, "seed": seed, "config": cfg.to_dict(), "split": split.to_dict(),
                "split_hashes": {w: split.window_hash(bars, w) for w in ("train", "val", "test")},
                "bars_fingerprint": bars.fingerprint(), "n_bars": len(bars), "config_hash": cfg.hash()}
        run_dir.mkdir(parents=True, exist_ok=True)
        run_json.write_text(json.dumps(meta, indent=2))
    state = build_state(cfg, bars, split, seed, device, features=feats, accel=accel)
    state.runner.on_compile = on_compile
    done = latest_epoch(run_dir)
    if done:
        restore_state(state, run_dir, done)
    knobs_fn = knobs_fn or cfg.schedule.knobs
    while state.epoch < epochs:
        rb = rollback_fn(state.epoch + 1) if rollback_fn is not None else None
        if rb is not None:
            roll_back(state, run_dir, rb[0], rb[1] or None)
        stats = train_epoch(state, knobs_fn(state.epoch + 1), progress)
        stats.rolled_back_to = None if rb is None else rb[0]
        save_epoch(state, run_dir, meta)
        # every epoch's weights stay; only the last state and the pinned ones
        prune_checkpoints(run_dir, state.epoch, keep=None, pinned=pinned_fn() if pinned_fn is not None else ())
        with open(run_dir / "history.jsonl", "a") as f:
            f.write(json.dumps(asdict(stats)) + "\n")
        if on_epoch is not None:
            on_epoch(stats)
    return state
