"""The update step: objective → backward → clip + AdamW → target update → priorities, and `train_step` (sample a
batch, run the LR schedule on the device, update, add the metrics to the epoch's sums, advance the rolling
embedding refresh).

The hot step is a closure `update(batch) -> detached metrics` (LeanRL style): no `.item()`, no Python branch on
tensor values, knobs as device tensors, the target update in place with `lerp_`; the same code runs eagerly,
compiled and captured (`services.trainer.runtime`). Imports: torch, `shared.agent`, `services.trainer.{config,
buffers, targets, objective, optim, losses, flat_adamw, replay}`; `TrainState` for types only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from shared.agent import Agent
from services.trainer.buffers import METRICS, UpdateBuffers, refresh_encode, refresh_store
from services.trainer.config import TrainConfig
from services.trainer.flat_adamw import FlatAdamW, flatten_parameters
from services.trainer.losses import adapt_entropy_coef
from services.trainer.objective import make_objective
from services.trainer.optim import clip_grad_norm, device_lrs
from services.trainer.replay import Batch, Replay
from services.trainer.targets import Targets, noise_width

if TYPE_CHECKING:
    from services.trainer.state import TrainState


def make_update(agent: Agent, target: Agent, opt: torch.optim.Optimizer, replay: Replay, windows: torch.Tensor,
                buf: UpdateBuffers, cfg: TrainConfig, generator: torch.Generator,
                targets: Callable[[Batch, torch.Tensor], Targets], ema: Agent | None = None
                ) -> Callable[[Batch], dict]:
    """Build the hot step `update(batch) -> dict of detached metric tensors` (`targets`: `make_targets`'s; `ema`: the
    moving average of the online parameters that follows them at `1 − cfg.policy_ema` an update, or None)."""
    objective = make_objective(agent, windows, buf, cfg)
    params = [p for p in agent.parameters()]
    tparams = [p for p in target.parameters()]
    eparams = [] if ema is None else [p for p in ema.parameters()]
    rate = 1.0 - cfg.policy_ema
    flat = isinstance(opt, FlatAdamW)
    if flat:   # the target's (and the average's) parameters in the optimizer's flat layout: one lerp over a buffer
        name_of = {p: n for n, p in agent.named_parameters()}
        tnamed = dict(target.named_parameters())
        target_flat = flatten_parameters([tnamed[name_of[p]] for p in opt.params])
        if ema is not None:
            enamed = dict(ema.named_parameters())
            ema_flat = flatten_parameters([enamed[name_of[p]] for p in opt.params])

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
        o = objective(b, noise, tg, wait)
        if priorities_via is not None:    # the priorities need only the loss: beside the backward pass
            priorities_via(b.slot, o.priority)
        # grads set to None, not zeroed: backward then hands each parameter its gradient tensor (no zeroing and no
        # accumulation kernels); captured, those tensors come from the graph's pool at fixed addresses
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
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
            if ema is not None:
                w = ema_weight(opt.step_count if flat else opt.state[params[0]]["step"], rate)
                if flat:
                    ema_flat.lerp_(opt.flat, w)                                           # θ̄ ← θ̄ + w(θ − θ̄)
                else:
                    for e, p in zip(eparams, params):
                        e.lerp_(p, w)
            adapt_entropy_coef(buf.entropy_coef, o.utilisation, cfg.entropy_target, cfg.entropy_rate)
            if priorities_via is None:
                replay.update_priorities(b.slot, o.priority)
        return {**o.metrics, "grad_norm": gnorm.detach()}

    return update


def ema_weight(step: torch.Tensor, rate: float) -> torch.Tensor:
    """The weight of update `step` (1-based, the optimizer's device counter) in the policy's moving average:
    max(1/step, 1 − β) — the mean of the updates so far until there are 1/(1 − β) of them, an EMA of rate 1 − β
    after, so the first epochs' checkpoints hold no share of the initial weights. A float32 device scalar."""
    return torch.clamp(1.0 / step.to(torch.float64), min=rate).to(torch.float32)


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

