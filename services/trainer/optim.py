"""The optimizer: parameter groups, the weight-decay mask, AdamW (torch's or `FlatAdamW`), the gradient clip, and
the LR schedule — one formula (`scheduled_lr`) that the host (`group_lr` / `set_lrs`, eager on a CPU) and the
device (`device_lrs`, inside a captured step on CUDA) both evaluate.

Owns: which group a parameter belongs to and its decay; the schedule lr = base × warm-up × (E4 scale × cosine
warm restart, branch groups); the momentum reset at a restart. Imports: torch, `shared.agent` (types),
`shared.knobs` (BRANCHES), `services.trainer.config`, `services.trainer.flat_adamw`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from shared.agent import Agent
from shared.knobs import BRANCHES, group_lr_scale
from services.trainer.config import TrainConfig
from services.trainer.flat_adamw import FlatAdamW

if TYPE_CHECKING:
    from services.trainer.buffers import UpdateBuffers


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
    parameter), which inductor lowers to one kernel per parameter (57 launches of ~1 µs on the H200 in the update's
    graph; bench/train_profile.py --trace). Here the squares of those norms are added in one expression, which it
    fuses into one kernel."""
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


# ---------------------------------------------------------------------------------------------------------
# The LR schedule
# ---------------------------------------------------------------------------------------------------------
def scheduled_lr(age, step, scale, branch, cfg: TrainConfig):
    """lr = base × warm-up(age) × scale × (cosine warm restart(step) for the branch groups, 1 for the others), the
    scale `Knobs.group_lr_scale` (E4's scale of the branch × the rollback's `lr_decay`): warm-up min(1, (age + 1) /
    lr_warmup); cosine floor + (1 − floor) · ½(1 + cos(π · (step mod period) / period)).

    Python numbers (the host: `group_lr`) or tensors (the device's captured step: `device_lrs`, with `branch` a
    bool tensor per group and `scale` the groups' scales): the same formula in the same order of operations."""
    on_device = torch.is_tensor(step)
    warm = (age + 1.0) / cfg.lr_warmup
    warm = warm.clamp(max=1.0) if on_device else min(warm, 1.0)
    phase = (step % cfg.cosine_period) / cfg.cosine_period
    cos_f = cfg.cosine_floor + (1 - cfg.cosine_floor) * 0.5 * (1.0 + (torch.cos if on_device else math.cos)(math.pi * phase))
    if on_device:
        branch_f = torch.where(branch, scale * cos_f, scale)
    else:
        branch_f = scale * cos_f if branch else scale
    return cfg.lr * warm * branch_f


def cosine_restart(step, cfg: TrainConfig):
    """True at update k·cosine_period, k ≥ 1: the branch groups' momentum is reset there (number or tensor)."""
    return (step > 0) & (step % cfg.cosine_period == 0)


def group_lr(group: dict, step: int, knobs_lr_scale: dict[str, float], cfg: TrainConfig, lr_decay: float = 1.0) -> float:
    """`scheduled_lr` of one optimizer group (its "age" and "branch") before update `step`, on the host, under E4's
    scales and the rollback's `lr_decay` (`Knobs.group_lr_scale`)."""
    branch = group["branch"] in BRANCHES
    return scheduled_lr(group["age"], step, group_lr_scale(knobs_lr_scale, lr_decay, group["branch"]), branch, cfg)


def set_lrs(opt: torch.optim.Optimizer, step: int, lr_scale: dict[str, float], cfg: TrainConfig,
            write_lr: bool = True, lr_decay: float = 1.0) -> None:
    """Host-side schedule before update `step`: the LRs written into the groups (tensor LRs with `fill_`), the
    momentum reset of branch groups at each cosine restart, group ages. With `write_lr=False` (CUDA) only the ages:
    `device_lrs`, inside the captured step, does the LRs and the restart from the device's update counter."""
    if write_lr:
        restart = cosine_restart(step, cfg)
        for g in opt.param_groups:
            lr = group_lr(g, step, lr_scale, cfg, lr_decay)
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
            if restart and g["branch"] in BRANCHES:
                for p in g["params"]:
                    opt.state[p]["exp_avg"].zero_()                # created with the optimizer
    age_groups(opt, 1)


def age_groups(opt: torch.optim.Optimizer, updates: int) -> None:
    """Every group's age advanced by `updates` (the warm-up's clock: `set_lrs` advances it once an update)."""
    for g in opt.param_groups:
        g["age"] += updates


def device_lrs(opt: torch.optim.Optimizer, buf: "UpdateBuffers", cfg: TrainConfig) -> None:
    """`scheduled_lr` of every group computed on the device from the update counter `buf.step` and written into the
    groups' LR tensors (read by the capturable AdamW), the branch groups' momentum zeroed at a cosine restart
    (multiplied by 0 or 1), then the counter advanced: no host value per update, so it is captured with the step.
    Every group is created with the optimizer, so its age equals the update count."""
    step = buf.step
    lr = scheduled_lr(step, step, buf.lr_scale, buf.lr_branch, cfg)
    keep = (~cosine_restart(step, cfg)).float()                                          # 0 at a restart
    if isinstance(opt, FlatAdamW):          # one vector each; the step applies the momentum factor in its pass
        opt.lr_vector.copy_(lr)
        opt.momentum_keep.copy_(torch.where(buf.lr_branch, keep, torch.ones_like(keep)))
    else:
        torch._foreach_copy_([g["lr"] for g in opt.param_groups], list(lr.to(torch.float32).unbind()))
        momenta = [opt.state[p]["exp_avg"] for g in opt.param_groups if g["branch"] in BRANCHES
                   for p in g["params"]]                                   # created with the optimizer
        torch._foreach_mul_(momenta, keep)
    step.add_(1.0)
