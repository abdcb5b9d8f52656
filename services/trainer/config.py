"""`TrainConfig`: everything a training run needs besides the data, the seed and the knobs, and its presets.

Owns: the config dataclass (a docstring under every field), its JSON form and hash, the `small` / `full` presets
and `--set FIELD=VALUE` overrides. Imports: `shared.agent` (AgentConfig), `shared.knobs` (the fixed ε/γ
schedule), `services.trainer.env` (RewardConfig). Measured figures below come from the bench scripts named
with them (bench/README.md keeps the dated log).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field

from shared.agent import AgentConfig
from shared.portfolio import BARS_CAP, BARS_SCALE
from shared.knobs import FixedSchedule, unlisted_at_neutral
from services.trainer.env import RewardConfig

RANGES: dict[str, tuple[type, float, bool, float, bool]] = {
    **{k: (int, 1, True, math.inf, False) for k in (
        "n_envs", "env_steps_per_iter", "updates_per_iter", "iterations", "batch_size", "replay_capacity",
        "iqn_quantiles", "emb_refresh", "cosine_period", "maturity_updates")},
    **{k: (int, 0, True, math.inf, False) for k in (
        "learning_starts", "lr_warmup", "encoder_batch", "iqn_batch", "policy_swa", "restart_every")},
    **{k: (float, 0.0, False, math.inf, False) for k in ("grad_clip", "support_margin", "iqn_kappa")},
    **{k: (float, 0.0, True, math.inf, False) for k in (
        "lr", "weight_decay", "iqn_coef", "expectile_coef", "q_centre_coef", "q_gap_coef", "hindsight_coef",
        "costs_bps", "entropy_init", "entropy_rate")},
    **{k: (float, 0.0, False, 1.0, True) for k in ("ensemble_mask_p", "support_quantile")},
    **{k: (float, 0.0, True, 1.0, True) for k in (
        "tau", "cosine_floor", "q_gap_frac", "entropy_target", "shrink_perturb")},
    **{k: (float, 0.0, True, 1.0, False) for k in ("policy_ema", "dropout")},
    "expectile": (float, 0.0, False, 1.0, False),
}
"""The numeric `TrainConfig` fields' ranges: (type, low, low included, high, high included); `TrainConfig` refuses a
value outside, naming the field, so a bad `--set` or study variant is refused before a run starts. A learning rate
or a target-network rate of 0 is allowed: a frozen learner, or a target that never moves."""
NOUNS = {"shrink_perturb": "a share"}
"""What a field's value is called in `check_range`'s message where "a number" would say less."""


def check_range(name: str, value: object) -> None:
    """ValueError naming `name` when `value` is not of its `RANGES` type or lies outside its range."""
    kind, lo, lo_in, hi, hi_in = RANGES[name]
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (kind is int and not isinstance(value, int)) or not math.isfinite(value) \
            or not (lo <= value if lo_in else lo < value) or not (value <= hi if hi_in else value < hi):
        what = NOUNS.get(name) or ("a whole number" if kind is int else "a number")
        span = (f"≥ {lo:g}" if lo_in else f"> {lo:g}") if hi == math.inf else \
            f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"
        raise ValueError(f"train config: {name} must be {what} {span}, got {value!r}")


MIN_HOLD_SMALL = 96  # small preset: bars a trade is held before a signal exit (regimes last ~200 bars)
CHURN_SMALL = 1e-3  # small preset: reward cost per opened trade (return units, ~10× the 1 bp fill cost)


NEUTRAL_UNLISTED = {"policy_ema": 0.0, "policy_swa": 0, "restart_every": 0, "restart_replay": False,
                    "shrink_perturb": 0.0, "feasible_targets": False, "kl_priority": False,
                    "cut_episodes": False, "iqn_kappa": 1.0,
                    "support_at_start": False, "dropout": 0.0, "lockstep_graphs": 2}
"""Fields that `TrainConfig.to_dict` leaves out at their neutral value, so that the configs (and hashes) of runs
stored before the field existed still match."""


PRESETS = ("small", "full")
"""The names `TrainConfig.preset` takes: `small` (CPU) and `full` (GPU)."""


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
    # -- optimizer (services.trainer.optim) --
    lr: float = 3e-4
    """Base learning rate of every parameter group."""
    weight_decay: float = 1e-4
    """AdamW decay of the trunk and value-head weight matrices (the decay mask); 0 elsewhere."""
    dropout: float = 0.0
    """> 0: dropout of the trunk state h (every head's input) in the update's online forward pass, with this
    probability: h ← h · m / (1 − p), m drawn from the update's noise (`targets.dropout_columns`), so a captured
    or vmapped update stays a function of its inputs (DroQ, Hiraoka et al. 2022: dropout in the Q-network against
    overfitting the replay). The targets, the double-Q selection, acting and evaluation run the network whole."""
    feasible_targets: bool = False
    """The targets' double-Q selection chooses, at a bootstrap state that holds a trade inside its commitment
    (`shared.policy.in_commitment`: fewer than `min_hold` × maturity bars old), only the held direction: acting holds
    such a trade whatever is chosen, and the replay records the held side, so the other directions' Q there is never
    trained. Off: the maximum over all three, which values a young trade as if it could be cut at once."""
    kl_priority: bool = False
    """The replay priority of a sample is the KL divergence of its direction prediction from the target (the
    cross-entropy less the target's entropy, as Rainbow prioritises); off: the cross-entropy, whose entropy part no
    learning removes, so that sampling stays near uniform (weights within a few % on a short `small` run)."""
    cut_episodes: bool = False
    """At an epoch's fresh episodes, the replay rows whose n-step windows cross the cut are never drawn
    (`Replay.cut_windows`): nothing in the ring ends the old episodes there, so their windows would sum the next
    episodes' first rewards and bootstrap from a random new start (the last max horizon rows of every epoch)."""
    lr_warmup: int = 200
    """Updates of linear LR warm-up of a parameter group from its creation."""
    cosine_period: int = 1000
    """Updates per cosine warm restart of the branch groups (their Adam momentum resets at each restart)."""
    cosine_floor: float = 0.3
    """Minimum of the branch cosine factor floor + (1 − floor) · ½(1 + cos(π · phase)), phase the position in the
    period (`optim.scheduled_lr`)."""
    grad_clip: float = 10.0
    """Global gradient-norm clip."""
    tau: float = 0.01
    """Target network update θ' ← θ' + τ (θ − θ') each update (`lerp_`)."""
    policy_ema: float = 0.0
    """> 0: an epoch's checkpoint — the policy the evaluator runs and a study selects — holds an exponential moving
    average of the online weights, θ̄ ← θ̄ + w(θ − θ̄) after the t-th update with w = max(1/t, 1 − policy_ema) (the
    mean of the updates so far until there are 1/(1 − policy_ema) of them, then an EMA of that horizon;
    `step.ema_weight`), not the online weights themselves; training goes on from the online weights (kept in the trainer
    state). 0 (the default): the online weights. Why: on the H200 one more epoch of training moves a policy's
    validation per-trade Sharpe by 0.17 on average and a well-validated epoch's by −0.10 to −0.30 (bench/README.md,
    2026-12-02 · 55207aa); an average over the epoch's last updates is a policy less tied to where its last one
    landed."""
    policy_swa: int = 0
    """> 0: from epoch `policy_swa` on, an epoch's checkpoint holds the mean of the online weights at the ends of
    epochs `policy_swa` … e, each end weighted alike (stochastic weight averaging, Izmailov et al. 2018: the ends of
    the branches' cosine cycles, which restart every epoch at `full`); earlier epochs' checkpoints hold the online
    weights, and training goes on from the online weights either way (`state.average_epoch_end`). A restart of the
    learner starts the mean again. 0 (the default): no average. Not with `policy_ema`. Why: later epochs validate
    below the first while their policies move 0.17 an epoch (bench/README.md, 2026-12-04 · 24290cc); a mean of the
    cycles' ends is a policy between them rather than at the last. Measured (2026-12-05 · 80f4476): on the H200 it
    steadies the policy and lifts the last epoch, but the checkpoint validation picks scores no higher out of sample
    (−0.033 [−0.163, +0.059] from epoch 1), and on the CPU at `small` it scores lower (−0.354): it stays off."""
    restart_every: int = 0
    """> 0: before every epoch that follows a multiple of this many, the learner restarts (`state.restart_learner`):
    fresh weights for the network, its target and its average, fresh optimizer moments and step counts, while what
    was collected stays (the replay, the trade tracker, the reward support) and the schedule goes on — a reset against
    the primacy bias (Nikishin et al. 2022) with the replay kept, each restarted epoch a new draw for the validation
    choice (a feedback rollback to an earlier epoch's learner before such an epoch is undone by the restart). 0 (the
    default): no restart. Why: on the H200 an epoch's mean validation is flat after the first (0.41–0.58 from epoch 2
    on for the fixed schedule), and the first epoch of a policy average read 0.62 (bench/README.md, 2026-12-03 ·
    799ab21). Measured there with the average at 0.999 and k = 1: +0.037 [+0.007, +0.068] against the fixed schedule
    (6 epochs against its 8), about the rollback's gain, the restarted epochs below the first (2026-12-03 · 5cc88f4)."""
    restart_replay: bool = False
    """With `restart_every`, or a feedback rollback that asks for a fresh learner (`FeedbackConfig.rollback_restart`):
    a restart also empties the replay (`state.empty_replay`: no transition kept, priorities reset) and starts the
    learner's warm-ups again (the LR warm-up's group ages, and `learning_starts` transitions collected before the
    first update), so a restarted epoch trains as the run's first did but for the schedule's knobs and the reward
    support. Off (the default): the replay is kept. Why: on the H200 every epoch after the first validates lower than
    the first, after a restart too (bench/README.md, 2026-12-03 · 5cc88f4, 206c041); this tells what the epoch learns
    from apart from the weights it starts from."""
    shrink_perturb: float = 0.0
    """s > 0: before every epoch after the first, every parameter of the online network moves a share s of the way
    to a fresh initialisation, θ ← (1 − s)·θ + s·θ_fresh (shrink and perturb, Ash & Adams 2020; the encoder's
    interpolation in BBF, Schwarzer et al. 2023), θ_fresh from a seed the run's generator draws; the target network,
    the optimizer moments, the replay and the schedule are kept. 0 (the default): none. Why: a full restart before
    every epoch made each epoch a new draw for the validation choice but trained below the first epoch (+0.037 on the
    H200, 2026-12-03 · 5cc88f4); a partial one keeps most of what was learned while still moving each epoch's
    policy off its predecessor's. Measured on the VM at `small` (2026-12-05 · ea6c6db): s = 0.3 scored −0.258
    [−0.509, −0.032] against the fixed schedule over 6 units, where the learner still improves every epoch; at
    `full` on an H100 (`studies/shrink-perturb.toml`, 2026-12-05 · 6a9c365) s = 0.3 and 0.5 +0.015 and +0.031 over
    15 units, CIs across 0, the mean from one unit where the fixed schedule's OOS window held 326 trades."""
    # -- objective (services.trainer.objective) --
    iqn_quantiles: int = 16
    """τ samples of the IQN loss (online and target)."""
    iqn_coef: float = 0.5
    """Weight of the IQN loss."""
    iqn_kappa: float = 1.0
    """κ of the IQN quantile Huber loss, in units of v_max (the loss compares quantiles divided by v_max). At 1 nearly
    every TD error lies inside the Huber's quadratic zone, where the loss is an expectile loss: the head learns
    expectiles, and the CVaR it gives reads a thinner tail than the quantiles'; about one atom, 2 / (n_atoms − 1),
    gives quantiles (Dabney et al. 2018 take κ = 1 in reward units). The loss's scale changes with it."""
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
    """Adaptation rate of β per update: β grows while the atom utilisation is below `entropy_target`, shrinks above
    (`losses.adapt_entropy_coef`)."""
    q_centre_coef: float = 0.1
    """Q-mean centring: weight of ((mean Q − mean target) / v_max)²."""
    q_gap_frac: float = 0.5
    """Target Q gap between the best and second direction, as a fraction of the targets' std …"""
    q_gap_coef: float = 0.01
    """… and the Q-gap attractor's weight of ((gap − gap*) / v_max)², gap* = q_gap_frac · std(targets)."""
    hindsight_coef: float = 0.1
    """E7: weight of the hindsight-label cross-entropy on the direction Q."""
    support_quantile: float = 0.99
    """Adaptive support: v_max tracks this quantile of |20-step reward sums| in replay …"""
    support_margin: float = 1.5
    """… times this margin."""
    support_at_start: bool = False
    """True: the support is set to its target (margin · quantile, `state.adapt_support` with weight 1) before the
    run's first update, from the transitions collected until then, so that learning starts on the reward scale it
    will keep; the epochs' adaptation then follows from there. False (the default): the first epoch learns on
    `agent.v_max_init`, and the support first moves halfway to its target before epoch 2 (which re-scales every value
    the network has learnt). Why off: on the H200 (`full`) the first epoch validated 0.411 in the mean with it against
    0.710 without (paired −0.299 [−0.468, −0.143]; bench/README.md, 2026-12-03 · a32c971)."""
    maturity_updates: int = 5000
    """Risk-head maturity m = 1 − exp(−updates / maturity_updates) scales the protection stack."""
    costs_bps: float = 1.0
    """Trading costs (bps of notional) in the training simulator."""
    schedule: FixedSchedule = field(default_factory=FixedSchedule)
    """The fixed ε/γ schedule of feedback off (`shared.knobs.FixedSchedule`): the first epoch's knobs, and every
    epoch's without a feedback bundle. Set as `schedule.FIELD` or the bare field name (`--set eps_start=0.5`)."""
    # -- speed: each of these keeps the update's numbers (up to the order of float sums) --
    bf16: bool = False
    """On CUDA, the forward passes of collection and update under bf16 autocast (losses and softmaxes in fp32)."""
    encoder_batch: int = 0
    """Samples of each update whose market encoding is computed with gradient (the encoder learns from them);
    the rest read the cached online embeddings. 0 = the whole batch. The encoder with gradient is the largest part
    of the `full` preset's update: at batch 4 096 on the H200 its graph replay took 1.56 ms with 512 such samples,
    1.35 with 256 and 1.23 with 128 (bench/train_profile.py). The preset's 256 learned as 512 did on the GPU
    learning bench (OOS per-trade Sharpe mean 0.433 vs 0.441 over 3 seeds, all meeting the target); 128 came out
    below 256 there in each of 3 seeds (0.370 against 0.500; bench/README.md, learning.py)."""
    adamw: str = "auto"
    """AdamW kernels on CUDA: "fused" (one `_fused_adamw_` launch per parameter group), "foreach" (the capturable
    multi-tensor form, which torch.compile lowers to its own fused Triton kernels); a CPU runs torch's default form
    with either. "flat", on any device: `FlatAdamW` (`services.trainer.flat_adamw`), every parameter (and the
    target network's) a view of one flat buffer, the clip, the step and the target's lerp a few passes over it
    whatever the number of groups; the same numbers up to the order of float sums. "auto" (the default): flat when
    the update is compiled on CUDA (batch-4 096 graph replay on the H200: 1.33 ms against 1.38 with foreach), fused
    when it runs eagerly on CUDA, torch's default form on a CPU."""
    inductor: str = "combo_kernels,combo_kernels_pointwise_only,triton.enable_pdl"
    """Comma-separated boolean options of `torch._inductor.config` turned on ("name") or off ("!name") for the compiled
    modes' step functions; "" = inductor's defaults. The default fuses independent pointwise kernels side by side
    into one launch (`combo_kernels`) and leaves reductions alone (`combo_kernels_pointwise_only`; combined
    reductions doubled the update's time): on the H200 the batch-4 096 update went from 543 to 380 kernels and its
    graph replay from 1.79 to 1.58 ms. And it lets each Triton kernel launch before the previous one has finished,
    waiting on the device for its inputs (programmatic dependent launch, `triton.enable_pdl`; Hopper and later):
    1.33 → 1.23 ms with flat AdamW (bench/train_profile.py). On a CPU inductor's C++ backend makes neither.
    Measured against this default and left off: `coordinate_descent_tuning` and `aggressive_fusion` (no faster),
    `!split_reductions` (3× slower), `max_autotune_gemm` (not compiled within 5 min)."""
    lockstep_graphs: int = 2
    """Runs trained in lockstep (`tradeloop study --lockstep`), compiled: their batched iteration traced and compiled
    as one graph (1), or its collection and its updates as two (2, the default, as `StepRunner` compiles one run's);
    one CUDA graph captures either. In one graph inductor put the 8 runs' fp64 account update in one combo launch
    with the encoder's GELU (419 µs) and fused it into an 8-program reduction (237 µs): on the H100 the 8-run
    iteration took 6.06 ms of GPU time as one graph, 5.62 as two (1 317 against 1 412 iterations/s), and 8 runs in
    lockstep trained an epoch in 5.35 s against 5.95 (bench/README.md 2026-12-06 · 5fe46c0)."""
    tf32: bool = True
    """On CUDA, float32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32 accumulate)."""
    emb_refresh: int = 50
    """Updates over which the cached market embeddings of all training bars are refreshed once: each update
    re-encodes the next ceil(T_train / emb_refresh) bars of a rolling window (plus a full refresh per epoch).
    The refresh's cost per update grows with the training split: at 10^6 bars and 500 it re-encoded 2 001 bars with
    each network, 1.51 ms of a 4.30-ms update at batch 1 024 on the H200 (`bench/train_profile.py`, compiled), so
    the `full` preset refreshes every bar once per 2 000 updates (half a 10^6-bar epoch's 4 000); with
    `encoder_batch` it learned as before on the GPU learning bench (bench/README.md, learning.py)."""
    iqn_batch: int = 0
    """Samples of each update the IQN risk head trains on: the first `iqn_batch` of the batch, a random subset (replay
    draws its samples independently), so their mean loss is an unbiased estimate of the whole batch's; the target's
    quantiles are computed for them alone. 0 = the whole batch. The IQN head is the update's widest part (N × M rows
    through two 256-wide layers, online forward and backward plus the target's forward). The `full` preset's 512
    took the batch-4 096 update's graph replay from 2.65 to 2.42 ms on the H200 with `horizon_sample`
    (bench/train_profile.py) and learned as well (see `horizon_sample`)."""
    horizon_sample: bool = False
    """Off: every sample bootstraps at all H horizons, its losses weighted by its regime's `horizon_blend` row w_h.
    On: at one horizon drawn from w_h, weight 1 — the same C51 and IQN losses in expectation (both are linear in
    w_h: the C51 target blends before a linear projection, the IQN loss is Σ_h w_h ρ_h) with H times fewer bootstrap
    states; the expectile and stability terms then read the drawn horizon's scalar target instead of the blend.
    On in the `full` preset: at batch 4 096 an update is 107.6 GFLOP instead of 152 (bench/update_flops.py) and its
    graph replay 2.65 ms instead of 3.29 on the H200 (bench/train_profile.py); with `iqn_batch` 512 it met the GPU
    learning bench's target in 3 seeds of 3; on the CPU learning bench (`small`, 12 seeds) the difference was noise
    (bench/README.md, learning.py)."""
    target_stream: bool = True
    """On CUDA, the update's no-grad targets (`targets.make_targets`: double-Q at the N·H bootstrap states, the
    target network's heads and IQN, the projections) on a side stream beside its online forward pass (batch-4 096
    graph replay on the H200: 3.63 → 3.47 ms; bench/train_speed.py)."""
    priorities_aside: bool = True
    """On CUDA, the replay's priority write (`Replay.update_priorities`: a one-program scatter kernel, ~16 µs) on the
    rolling refresh's side stream as soon as the loss is known, beside the backward pass, instead of after the
    optimizer step on the update's own stream. Nothing in the update reads the priorities after its sampling
    (batch-4 096 graph replay on the H200: 1.08 → 1.06 ms; bench/train_profile.py --variants ''
    priorities_aside=False)."""
    refresh_at_backward: bool = False
    """On CUDA with `priorities_aside`, the rolling refresh's encodings launched on their side stream when the loss is
    known, beside the backward pass, instead of at the update's start, beside its forward pass (the encodings read
    only the parameters, which the backward does not change). Off: measured 1.01 → 1.00 ms a graph replay at batch
    4 096 on the H200, within run-to-run spread (bench/train_profile.py --variants '' refresh_at_backward=True)."""
    fold_ln: bool = True
    """The encoder blocks' LayerNorm affines folded into the linear layers after them (`shared.agent.ln_fold`):
    the same function and parameters, with γ's and β's gradients taken on the weights instead of summed over
    every token of the batch's windows; as fast as unfolded (bench/train_profile.py --variants '' fold_ln=False),
    kept as the smaller arithmetic."""
    attention: str = "triton"
    """The encoder's attention in the update's online pass (with gradient): "triton" (`services.trainer.
    fused_attention`: one kernel a pass and (window, head), CUDA only; elsewhere SDPA) or "sdpa" (PyTorch's fused
    kernels: cuDNN's on the H200, four kernels backward). Batch-4 096 graph replay on the H200: 1.13 → 1.09 ms
    (bench/train_profile.py --variants '' attention=sdpa); values and gradients match SDPA's
    (tests/test_fused_attention.py)."""
    fused_targets: bool = True
    """On CUDA, the targets' double-Q selection (the online ensemble-mean Q of every action at the bootstrap states,
    the greedy action of each branch, the target members' mean distribution and portfolio shift there) as one Triton
    kernel (`services.trainer.fused_greedy`) instead of the five kernels torch.compile made of it; the same numbers
    up to the order of float sums (an exact tie of two actions' Q aside)."""
    direction_q_in_c51: bool = True
    """The online direction Q of the update's stability and hindsight terms (every member's Σ_i z_i p_i of the three
    direction actions) computed with the C51 terms from the heads' padded output (`losses.c51_branch_losses_q`): on
    CUDA with `fused_c51`, two more Triton kernels, the backward's adding its gradient into the C51 kernel's, where
    compiled the Q's softmax, its backward and a pass summing both gradients ran on the update's stream. The same
    numbers up to the order of float sums. Compiled without the fused kernels the update keeps the written-out chain
    (`objective.make_objective`). Batch-4 096 graph replay on the H200: 1.01 → 0.97 ms (bench/train_profile.py
    --variants '' direction_q_in_c51=True)."""
    fused_c51: bool = True
    """On CUDA, the update's C51 chain of the taken actions (softmax, portfolio shift, cross-entropy, the direction
    branch's entropy and utilisation, forward and backward) as two Triton kernels (`services.trainer.fused_c51`)
    instead of the ~20 kernels torch.compile made of it; the same numbers up to the order of float sums."""
    act_view_cache: bool = False
    """On: collection reads each bar's market view (`Agent.view`: ensemble-mean Q of every action, the directions'
    spread, the IQN tail, the code) from a table refreshed with the cached embeddings, so acting costs only the
    portfolio shift and the policy per account-step; the policy's market part is then as stale as the embeddings
    (≤ `emb_refresh` updates), its portfolio shift is current. The update's double-Q selection at the bootstrap
    states reads the same table. Off (the default): the heads run on the cached embeddings at every step and for the
    selection — on the CPU learning bench (3 seeds, `small`) acting on the cached view reached OOS per-trade Sharpes
    0.493 / 0.647 / 0.411 against 0.941 / 0.606 / 0.595 (bench/README.md, learning.py)."""

    def __post_init__(self) -> None:
        self.schedule = FixedSchedule.coerce(self.schedule, "TrainConfig.schedule")
        self.check_ranges()
        if self.policy_swa and self.policy_ema:
            raise ValueError("train config: policy_swa and policy_ema both set: a checkpoint holds one average")
        if not isinstance(self.restart_replay, bool):
            raise ValueError(f"train config: restart_replay must be true or false, got {self.restart_replay!r}")
        for flag in ("feasible_targets", "kl_priority", "cut_episodes"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"train config: {flag} must be true or false, got {getattr(self, flag)!r}")
        if self.feasible_targets and self.agent.min_hold > BARS_SCALE * BARS_CAP:
            raise ValueError(f"train config: feasible_targets reads a trade's age from the portfolio vector, which "
                             f"stops at {BARS_SCALE * BARS_CAP:g} bars; agent.min_hold {self.agent.min_hold} is longer")
        if not isinstance(self.support_at_start, bool):
            raise ValueError(f"train config: support_at_start must be true or false, got {self.support_at_start!r}")
        if self.lockstep_graphs not in (1, 2):
            raise ValueError(f"train config: lockstep_graphs must be 1 or 2, got {self.lockstep_graphs!r}")

    def to_dict(self) -> dict:
        """The JSON form: the schedule's fields sit at the top level under their `FixedSchedule` names, the form
        (and so the hash) that stored runs and checkpoints carry."""
        d = asdict(self)
        d["agent"] = self.agent.to_dict()
        del d["schedule"]
        return unlisted_at_neutral({**d, **self.schedule.to_dict()}, NEUTRAL_UNLISTED)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """The inverse of `to_dict`; a nested `schedule` table is read too."""
        d = dict(d)
        d["agent"] = AgentConfig.from_dict(d["agent"])
        d["reward"] = RewardConfig(**d["reward"])
        d["horizons"] = tuple(d["horizons"])
        d["horizon_blend"] = tuple(tuple(r) for r in d["horizon_blend"])
        flat = {k: d.pop(k) for k in FixedSchedule.names() if k in d}
        d["schedule"] = FixedSchedule.coerce(d.get("schedule"), "config schedule").with_values(flat, "config")
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
            # were mostly padding (bench/attention_speed.py: fwd+bwd 300 vs 575 µs at 1 024 windows on the H200).
            # One update an iteration (each transition sampled about twice), not two: OOS per-trade Sharpe of the
            # val-selected checkpoint +0.042 [+0.009, +0.075], the last epoch's validation +0.087 [+0.038, +0.144],
            # paired over 35 seed × fold units of three H200 studies (docs/study-h200-generalization,
            # -fewer-updates, -onoff-one-update against -onoff8; bench/README.md 2026-12-04 · 955e644).
            return cls(agent=AgentConfig(n_features=n_features, window=64, d_model=128, n_heads=2, n_layers=2,
                                         hidden=256, ensemble=5),
                       n_envs=256, env_steps_per_iter=2, updates_per_iter=1, iterations=2000, batch_size=1024,
                       replay_capacity=2_000_000, learning_starts=20_000, encoder_batch=256, bf16=True,
                       emb_refresh=2000, horizon_sample=True, iqn_batch=512)
        raise ValueError(f"unknown config preset {name!r}: use {' or '.join(map(repr, PRESETS))}")

    def override(self, items: list[str]) -> "TrainConfig":
        """Set fields from FIELD=VALUE strings (`agent.FIELD` for the network's, `schedule.FIELD` or the bare name for
        the fixed schedule's), each parsed as the field's current type (bools from 1/true/yes); ValueError naming
        an unknown field. Returns self (benches' --set)."""
        for item in items:
            key, sep, text = item.partition("=")
            if sep and FixedSchedule.field_of(key) is not None:
                self.schedule = self.schedule.with_values({key: text}, f"--set {item!r}")
                continue
            obj, name = (self.agent, key[6:]) if key.startswith("agent.") else (self, key)
            if not sep or not hasattr(obj, name) or name == "schedule":
                raise ValueError(f"--set {item!r}: expected FIELD=VALUE with a field of TrainConfig or agent.FIELD")
            cur = getattr(obj, name)
            setattr(obj, name, text.lower() in ("1", "true", "yes") if isinstance(cur, bool) else type(cur)(text))
        self.check_ranges()
        return self

    def check_ranges(self) -> None:
        """ValueError naming the first numeric field outside its `RANGES` range, or an encoder whose width its
        heads do not divide (the attention splits d_model into n_heads equal parts)."""
        for name in RANGES:
            check_range(name, getattr(self, name))
        a = self.agent
        if a.n_heads < 1 or a.d_model < 1 or a.d_model % a.n_heads:
            raise ValueError(f"train config: agent.d_model ({a.d_model}) must be a positive multiple of agent.n_heads "
                             f"({a.n_heads})")
