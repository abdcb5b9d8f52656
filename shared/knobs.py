"""The knobs of an epoch: every quantity the feedback service steers, with its fixed-schedule default.

The trainer turns a `Knobs` into device tensors before the epoch (`copy_` into static buffers), so a
captured training step reads them without a host sync. The evaluator reads the few that the policy
itself uses (`gate_threshold`, `regime_confidence`). Feedback E1–E9 produce a `Knobs` for epoch e+1
(services/feedback); with feedback off (or a signal switched off), the `FixedSchedule` defined here is used
instead: the trainer's config and the feedback config each hold one (their `schedule` field).

ML core: imports only the standard library (and numpy for validation).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Mapping

N_REGIMES = 9  # 3 volatility buckets × 3 trend buckets (shared/market.py)
BRANCHES = ("direction", "size", "exit")


@dataclass
class Knobs:
    epsilon: float = field(default_factory=lambda: FixedSchedule().epsilon(1))
    """E2 — exploration rate of the ε-greedy policy during collection (per branch, independently); by default the
    fixed schedule's first epoch's (`FixedSchedule`, the one source of both)."""
    gamma: float = field(default_factory=lambda: FixedSchedule().gamma)
    """E3 — discount factor per bar for bootstrap targets; by default the fixed schedule's."""
    q_bias: float = 0.0
    """E1 — subtracted from bootstrap targets (return units): positive when Q over-predicts realised trades."""
    lr_scale: dict[str, float] = field(default_factory=lambda: {b: 1.0 for b in BRANCHES})
    """E4 — multiplier of the base LR for each branch's parameter group."""
    gate_threshold: float = math.inf
    """E5 — epistemic entry gate: no new entry where ensemble disagreement (std of Q, return units) exceeds it."""
    priority_boost: list[tuple[int, float]] = field(default_factory=list)
    """E6 — (absolute bar index of the dataset, inside the train range; multiplier ≥ 1) for replay transitions of top winning trades."""
    hindsight: list[tuple[int, int]] = field(default_factory=list)
    """E7 — (absolute bar index of the dataset, inside the train range; hindsight-optimal direction 0=short 1=flat 2=long) for losing trades."""
    regime_weights: list[float] = field(default_factory=lambda: [1.0] * N_REGIMES)
    """E8 — relative sampling weight of episode starts by regime label."""
    regime_confidence: list[float] = field(default_factory=lambda: [1.0] * N_REGIMES)
    """E9 — position-size multiplier in [0, 1] by regime (0 closes the regime to new entries)."""
    lr_decay: float = 1.0
    """Multiplier in (0, 1] of every parameter group's learning rate, the E4 scales included: the fixed schedule's
    `lr_epoch_factor` once an epoch after the first, × `FeedbackConfig.rollback_lr_factor` once a rollback so far
    (1: neither)."""

    def validate(self) -> "Knobs":
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {self.epsilon}")
        if not 0.0 < self.gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {self.gamma}")
        if set(self.lr_scale) != set(BRANCHES) or any(v <= 0 for v in self.lr_scale.values()):
            raise ValueError(f"lr_scale needs a positive value for each of {BRANCHES}, got {self.lr_scale}")
        if not 0.0 < self.lr_decay <= 1.0:
            raise ValueError(f"lr_decay must be in (0, 1], got {self.lr_decay}")
        for name in ("regime_weights", "regime_confidence"):
            v = getattr(self, name)
            if len(v) != N_REGIMES or any((not math.isfinite(x)) or x < 0 for x in v):
                raise ValueError(f"{name} needs {N_REGIMES} finite non-negative values, got {v}")
        return self

    def group_lr_scale(self, branch: str) -> float:
        """`group_lr_scale` of a parameter group of `branch` under these knobs."""
        return group_lr_scale(self.lr_scale, self.lr_decay, branch)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gate_threshold"] = None if math.isinf(self.gate_threshold) else self.gate_threshold
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Knobs":
        d = dict(d)
        if d.get("gate_threshold") is None:
            d["gate_threshold"] = math.inf
        d["priority_boost"] = [tuple(x) for x in d.get("priority_boost", [])]
        d["hindsight"] = [tuple(x) for x in d.get("hindsight", [])]
        return cls(**d).validate()

    @classmethod
    def fixed_schedule(cls, epoch: int, **schedule) -> "Knobs":
        """`FixedSchedule(**schedule).knobs(epoch)`: the knobs of feedback off for 1-based `epoch`."""
        return FixedSchedule(**schedule).knobs(epoch)


def unlisted_at_neutral(d: dict[str, Any], neutral: Mapping[str, Any]) -> dict[str, Any]:
    """`d` without the keys of `neutral` that hold their neutral value: a config's JSON form (and its hash) stays as
    it was before a field was added, so runs, checkpoints and studies stored then still match."""
    return {k: v for k, v in d.items() if k not in neutral or v != neutral[k]}


def group_lr_scale(lr_scale: Mapping[str, float], lr_decay: float, branch: str) -> float:
    """The multiplier of a parameter group's scheduled learning rate: E4's scale of its branch (1 for the trunk and
    the risk head) × `Knobs.lr_decay` (the schedule's decay across epochs and the rollbacks')."""
    return (lr_scale[branch] if branch in BRANCHES else 1.0) * lr_decay


@dataclass(frozen=True)
class FixedSchedule:
    """The ε/γ schedule of feedback off, declared once: `TrainConfig.schedule` (the trainer alone, `tradeloop
    train`, the first epoch) and `FeedbackConfig.schedule` (the feedback service switched off, or a signal
    switched off) hold one, so the trainer alone and the feedback service switched off agree.

    ε falls linearly from `eps_start` at epoch 1 to `eps_end` at epoch 1 + `eps_decay_epochs`; γ is fixed; every
    learning rate is `lr_epoch_factor` times the previous epoch's (`Knobs.lr_decay`); every other knob keeps its
    neutral default (no Q-bias, LR scales 1, no gate, no boosts or labels, uniform regime weights, full confidence).

    Settings name a field bare (`eps_start=0.5`) or under `schedule.` (`schedule.eps_start=0.5`); `gamma_fixed`
    (see `ALIASES`) is another name of `gamma`."""

    eps_start: float = 0.3
    """ε of the first epoch …"""
    eps_end: float = 0.02
    """… falling linearly to this …"""
    eps_decay_epochs: int = 8
    """… over this many epochs."""
    gamma: float = 0.98
    """γ of every epoch: a horizon 1/(1 − γ) of 50 bars, about five times the 9 bars the selected policies hold a
    trade at `full`. Against 0.99, on the H200 (synthetic, `full`, 5 seeds × 3 folds × 8 epochs, side by side in one
    study, docs/study-h200-gamma/): OOS of the checkpoint chosen on validation +0.098 [−0.002, +0.209] (higher in
    12 of 15), validation +0.077 [+0.002, +0.144]; on a CPU at `small` +0.043 [+0.003, +0.084] (docs/study-cpu-gamma/).
    E3's γ from the holding time settled near it (0.980–0.985) and scored below it (−0.036 [−0.105, +0.029]).
    Set against 0.99 again on seeds no γ study had used (one H100, docs/study-h100-gamma-confirm/): OOS +0.037
    [−0.072, +0.133] (11 of 15), validation +0.072 [+0.008, +0.137]; both studies pooled, 30 units: OOS +0.068
    [−0.001, +0.137] (23 of 30), validation +0.074 [+0.029, +0.119] (`tradeloop study-compare`)."""
    lr_epoch_factor: float = 1.0
    """Every learning rate of epoch e + 1 is this times epoch e's: epoch e trains at `lr_epoch_factor`^(e − 1) of
    the preset's rates (the warm-up and the branches' cosine cycle inside an epoch unchanged); 1: the same rates in
    every epoch."""

    ALIASES = {"gamma_fixed": "gamma"}
    """Other names of fields that settings accept: the feedback config's name for γ."""
    NEUTRAL_UNLISTED = {"lr_epoch_factor": 1.0}
    """Fields that `to_dict` leaves out at their neutral value (`unlisted_at_neutral`)."""

    def __post_init__(self) -> None:
        for name in ("eps_start", "eps_end"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"fixed schedule: {name} must be a number in [0, 1], got {v!r}")
        d = self.eps_decay_epochs
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"fixed schedule: eps_decay_epochs must be an integer ≥ 0, got {d!r}")
        if isinstance(self.gamma, bool) or not isinstance(self.gamma, (int, float)) or not 0.0 < self.gamma < 1.0:
            raise ValueError(f"fixed schedule: gamma must be a number in (0, 1), got {self.gamma!r}")
        f = self.lr_epoch_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ValueError(f"fixed schedule: lr_epoch_factor must be a number in (0, 1], got {f!r}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def field_of(cls, key: str) -> str | None:
        """The field a setting key names (`eps_start`, `schedule.eps_start`, `gamma_fixed`), else None."""
        name = key[len("schedule."):] if key.startswith("schedule.") else key
        name = cls.ALIASES.get(name, name)
        return name if name in cls.names() else None

    def with_values(self, values: Mapping[str, Any], where: str = "schedule") -> "FixedSchedule":
        """A copy with `values` (keys as `field_of` reads them; text parsed as the field's type) set; ValueError
        naming `where` and the key on an unknown key or a bad value."""
        changes: dict[str, Any] = {}
        for key, value in values.items():
            name = self.field_of(str(key))
            if name is None:
                raise ValueError(f"{where}: {key!r} is not a field of the fixed schedule (fields: "
                                 f"{', '.join(self.names())}, each also as schedule.FIELD)")
            if isinstance(value, str):
                kind = int if name == "eps_decay_epochs" else float
                try:
                    value = kind(value.strip())
                except ValueError:
                    raise ValueError(f"{where}: {key} expects {'an integer' if kind is int else 'a number'}, got "
                                     f"{value!r}") from None
            elif name == "eps_decay_epochs" and isinstance(value, float) and value.is_integer():
                value = int(value)
            changes[name] = value
        try:
            return replace(self, **changes)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    @classmethod
    def coerce(cls, value: Any, where: str = "schedule") -> "FixedSchedule":
        """A FixedSchedule from itself, a mapping of (some of) its fields, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            return cls().with_values(value, where)
        raise ValueError(f"{where}: expected a table of {', '.join(cls.names())}, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return unlisted_at_neutral(asdict(self), self.NEUTRAL_UNLISTED)

    def epsilon(self, epoch: int) -> float:
        """ε of 1-based `epoch`."""
        frac = min(1.0, max(0, epoch - 1) / max(1, self.eps_decay_epochs))
        return self.eps_start + (self.eps_end - self.eps_start) * frac

    def lr_decay(self, epoch: int) -> float:
        """`Knobs.lr_decay` of 1-based `epoch`: `lr_epoch_factor`^(epoch − 1)."""
        return self.lr_epoch_factor ** max(0, epoch - 1)

    def knobs(self, epoch: int) -> Knobs:
        """The knobs of 1-based `epoch`."""
        return Knobs(epsilon=self.epsilon(epoch), gamma=self.gamma, lr_decay=self.lr_decay(epoch))
