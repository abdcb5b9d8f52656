"""`TrainState`: everything `train_epoch` mutates and a checkpoint restores, its construction (`build_state`) and
what changes it between updates: an epoch's knobs written into the device tensors (`apply_knobs`) and the adaptive
C51 support (`adapt_support`).

Imports: torch, numpy, `shared.{agent, execution, graphs, knobs, market, rollout}`, `services.trainer.{config,
optim, buffers, targets, step, runtime, env, replay, fused_attention}`.
"""
from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from shared.agent import Agent, PolicyControls
from shared.execution import CostModel
from shared.graphs import resolve_accel
from shared.knobs import Knobs
from shared.market import FEATURE_WARMUP, Bars, Split, compute_features
from shared.rollout import MarketTensors
from services.trainer import fused_attention
from services.trainer.buffers import UpdateBuffers, make_buffers
from services.trainer.config import TrainConfig
from services.trainer.env import TrainEnv
from services.trainer.optim import build_optimizer
from services.trainer.replay import Batch, Replay
from services.trainer.runtime import StepRunner
from services.trainer.step import make_update
from services.trainer.targets import Targets, make_targets


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
    learn_from: int = 0
    """`env_steps` when the replay was last emptied (`empty_replay`): updates start `learning_starts` transitions
    after it."""
    accel: str = "eager"
    """How the iteration runs: eager, compile, graph or compile+graph (`StepRunner`)."""
    refresh_idx: torch.Tensor | None = None
    """0 … C−1: the rolling embedding refresh re-encodes C bars per update."""
    runner: "StepRunner | None" = None
    ema: Agent | None = None
    """The average of the online weights an epoch's checkpoint holds (`TrainConfig.policy_ema` or `policy_swa` > 0),
    its parameters only (buffers are the agent's); None: the checkpoint holds the online weights."""
    swa_count: int = 0
    """Under `TrainConfig.policy_swa`: the epoch ends in `ema`'s mean (0: it holds the online weights)."""


_SEEDING = threading.Lock()
"""Held while a state is built: its networks are initialised from the process's global RNG, seeded first, so two
threads building states at once (a lockstep group's runs) would interleave their draws."""


def build_state(cfg: TrainConfig, bars: Bars, split: Split, seed: int, device="cpu",
                features: np.ndarray | None = None, accel: str = "auto") -> TrainState:
    """Fresh training state on the training split of `bars`, seeded; `accel`: see `resolve_accel`. Thread-safe: the
    global RNG is seeded and drawn from under `_SEEDING`."""
    with _SEEDING:
        return _build_state(cfg, bars, split, seed, device, features, accel)


def _build_state(cfg: TrainConfig, bars: Bars, split: Split, seed: int, device, features: np.ndarray | None,
                 accel: str) -> TrainState:
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
    ema = copy.deepcopy(target) if cfg.policy_ema > 0 or cfg.policy_swa > 0 else None
    accel = resolve_accel(accel, device)
    opt = build_optimizer(agent, cfg, device, compiled="compile" in accel)
    replay = Replay(cfg.replay_capacity, cfg.n_envs, cfg.agent.n_portfolio, len(market), cfg.horizons, device)
    warmup = max(cfg.agent.window, FEATURE_WARMUP - split.train[0], 0)
    env = TrainEnv(market, cfg.n_envs, warmup, cfg.reward, replay, CostModel(cfg.costs_bps), gen)
    controls = PolicyControls.make(device)
    buf = make_buffers(cfg, opt, len(market), device)
    targets = make_targets(agent, target, buf, cfg)
    update = make_update(agent, target, opt, replay, market.windows, buf, cfg, gen, targets,
                         ema=ema if cfg.policy_ema > 0 else None)
    chunk = -(-len(market) // max(cfg.emb_refresh, 1))
    state = TrainState(cfg, device, agent, target, opt, replay, env, controls, buf, gen, update, targets,
                       accel=accel, refresh_idx=torch.arange(chunk, device=device), ema=ema)
    state.runner = StepRunner(state, state.accel)
    return state


def apply_knobs(state: TrainState, knobs: Knobs) -> None:
    """Write an epoch's knobs into the device tensors and tables the policy and the update read."""
    knobs.validate()
    state.knobs = knobs
    state.controls.set(epsilon=knobs.epsilon, gate_threshold=knobs.gate_threshold,
                       regime_confidence=knobs.regime_confidence)
    state.buffers.gamma.fill_(knobs.gamma)
    state.buffers.lr_scale.copy_(torch.tensor([knobs.group_lr_scale(g["branch"]) for g in state.opt.param_groups],
                                              dtype=torch.float64))
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


def restart_due(state: TrainState) -> bool:
    """Whether the learner restarts before the next epoch (`TrainConfig.restart_every`): after every epoch that is a
    multiple of it (none before the first)."""
    k = state.cfg.restart_every
    return k > 0 and state.epoch > 0 and state.epoch % k == 0


@torch.no_grad()
def restart_learner(state: TrainState) -> None:
    """Fresh learner, in place (the captured step reads these addresses): the parameters of the network, its target
    and its average from a new `Agent` of the same config, initialised from a seed drawn from the run's generator
    (the global RNG untouched), and every optimizer moment and step count zeroed. The buffers (the reward support
    `v_max`, `maturity`) stay, as do the replay, the tracker, the entropy coefficient and the counters that the
    schedule reads; `train_epoch` then re-encodes the embedding tables from the fresh encoder."""
    fresh = fresh_parameters(state)
    for net in (state.agent, state.target, state.ema):
        if net is not None:
            for name, p in net.named_parameters():
                p.copy_(fresh[name])
    for st in state.opt.state.values():
        for key, v in st.items():
            if torch.is_tensor(v):
                v.zero_()
            else:
                st[key] = type(v)(0)
    state.swa_count = 0


@torch.no_grad()
def average_epoch_end(state: TrainState) -> None:
    """`TrainConfig.policy_swa`'s step at the end of an epoch (`state.epoch` already counts it): before epoch
    `policy_swa` the average holds the online weights; from it on, the n-th end joins the mean, θ̄ ← θ̄ + (θ − θ̄)/n.
    Nothing without `policy_swa`."""
    if state.cfg.policy_swa <= 0:
        return
    online = dict(state.agent.named_parameters())
    n = state.swa_count + 1 if state.epoch >= state.cfg.policy_swa else 0
    for name, p in state.ema.named_parameters():
        p.lerp_(online[name], 1.0 / max(n, 1))           # weight 1 (n ≤ 1): the online weights exactly
    state.swa_count = n


def fresh_parameters(state: TrainState) -> dict[str, torch.Tensor]:
    """The parameters of a new `Agent` of the run's config (on the CPU), initialised from a seed drawn from the run's
    generator; the global RNG untouched."""
    seed = int(torch.randint(0, 2**62, (1,), generator=state.generator, device=state.generator.device))
    with _SEEDING, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {n: p.detach() for n, p in Agent(state.cfg.agent).named_parameters()}


def perturb_due(state: TrainState) -> bool:
    """Whether the online network shrinks toward a fresh one before the next epoch (`TrainConfig.shrink_perturb`):
    before every epoch after the first."""
    return state.cfg.shrink_perturb > 0 and state.epoch > 0


@torch.no_grad()
def shrink_perturb(state: TrainState) -> None:
    """θ ← (1 − s)·θ + s·θ_fresh for every parameter of the online network, in place (the captured step reads
    these addresses), s = `TrainConfig.shrink_perturb`; the target, the average, the optimizer and the replay as
    they are."""
    fresh = fresh_parameters(state)
    for name, p in state.agent.named_parameters():
        p.lerp_(fresh[name].to(p.device, p.dtype), state.cfg.shrink_perturb)


def restart_fresh(state: TrainState) -> None:
    """A restart of the learner (`restart_learner`) and, under `TrainConfig.restart_replay`, of what it learns from
    (`empty_replay`): the one form of a restart, before an epoch of `restart_every` or at a feedback rollback that
    asks for one (`FeedbackConfig.rollback_restart`)."""
    restart_learner(state)
    if state.cfg.restart_replay:
        empty_replay(state)


def empty_replay(state: TrainState) -> None:
    """`TrainConfig.restart_replay`'s part of a restart: the replay emptied, the learning gate moved to the present
    (`learn_from`: `learning_starts` transitions are collected before the next update) and every optimizer group's
    age back to 0 (the LR warm-up starts again)."""
    state.replay.clear()
    state.learn_from = state.env_steps
    for g in state.opt.param_groups:
        g["age"] = 0


@torch.no_grad()
def adapt_support(state: TrainState, weight: float = 0.5, min_rows: int = 64) -> None:
    """v_max ← (1 − w) v_max + w · margin · quantile(|20-step reward sums in replay|), w = `weight`: the support
    follows the reward scale (the update's projection re-maps old distributions onto the new support). Nothing with
    fewer than `min_rows` rows in replay."""
    rp, cfg = state.replay, state.cfg
    if rp.count < min_rows:
        return
    r = rp.reward[: rp.count]                                                              # L × E
    h = min(max(cfg.horizons), rp.count)
    sums = r.unfold(0, h, 1).sum(-1).abs().flatten()
    q = torch.quantile(sums[torch.randperm(sums.numel(), generator=state.generator, device=sums.device)[:100_000]],
                       cfg.support_quantile)
    new = (1.0 - weight) * state.agent.v_max + weight * (cfg.support_margin * q).clamp(0.005, 1.0)
    state.agent.v_max.copy_(new)
    state.target.v_max.copy_(new)
