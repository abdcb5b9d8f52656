"""What a study runs: its variants, seeds, walk-forward folds and data, parsed from the command line or a TOML file.

A variant is the product's loop with settings changed. Settings are `KEY=VALUE`, where KEY names a field of
    `TrainConfig` (`train.FIELD`, or `agent.FIELD` / `reward.FIELD` for its network and reward parts), of the fixed
    ε/γ schedule that the trainer and the feedback service share (`schedule.FIELD`: eps_start, eps_end,
    eps_decay_epochs, gamma; `train.FIELD` and `feedback.FIELD`, with `feedback.gamma_fixed` for gamma, name it too)
    or of `FeedbackConfig` (`feedback.FIELD`); an unqualified FIELD is looked up in all five and must name exactly
    one; `feedback=on|off` is short for `feedback.enabled=true|false`.
VALUE is parsed by the field's declared type: bools from true/false/1/0/yes/no/on/off, a tuple from items joined by
`+` (`off=E2+E3`; empty for an empty tuple), `none` for an optional field; in a TOML file values are TOML's own
(arrays for tuples). The built-in variants: `on` (the loop as shipped) and `off` (feedback off: the fixed schedule).

    --variants on,off,noE2:off=E2,slow:train.lr=1e-4;feedback.rollback_z=3.0

Runs: every variant × seed × fold, `<variant>-s<seed>-f<fold>`, ordered so that the variants of one (seed, fold)
come together. Variants of one seed and fold share the seed, the data and the first epoch's knobs.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from services.feedback.signals import FeedbackConfig
from services.trainer.config import PRESETS
from services.trainer.env import RewardConfig
from services.trainer.train import TrainConfig
from shared.agent import AgentConfig
from shared.knobs import FixedSchedule
from shared.report import DEFAULT_OFF, OFF_NAMES

BUILTIN = {"on": (), "off": (("feedback.enabled", False),)}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_TARGETS = {"train": TrainConfig, "agent": AgentConfig, "reward": RewardConfig, "schedule": FixedSchedule,
            "feedback": FeedbackConfig}
_PARTS = ("agent", "reward", "schedule")
"""Fields of TrainConfig / FeedbackConfig that are parts of their own, set under their own prefix."""
SYNTHETIC_DEFAULT_BARS = 6000
MIN_TRAIN_BARS, MIN_WINDOW_BARS = 300, 100


class StudyError(ValueError):
    """A study that cannot run as asked; the message names the option or file and what is wrong."""


class StudyInterrupted(StudyError):
    """A study (or a host's study worker) stopped by Ctrl-C or SIGTERM; the message says how its runs go on."""


# ---------------------------------------------------------------------------------------------------------
# Settings: KEY=VALUE on a config dataclass, parsed by the field's type
# ---------------------------------------------------------------------------------------------------------
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def parse_value(value: Any, hint: Any, where: str) -> Any:
    """`value` (text from the command line, or a TOML value) as type `hint`; StudyError naming `where`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return parse_value(value, a, where)
            except StudyError as exc:
                errors.append(str(exc))
        raise StudyError(errors[0] if errors else f"{where}: cannot parse {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            items = [s.strip() for s in value.split("+")] if value.strip() else []
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise StudyError(f"{where}: expected a list (items joined by '+'), got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(parse_value(x, args[0], f"{where}[{i}]") for i, x in enumerate(items))
        if len(items) != len(args):
            raise StudyError(f"{where}: expected {len(args)} items, got {len(items)} ({value!r})")
        return tuple(parse_value(x, a, f"{where}[{i}]") for i, (x, a) in enumerate(zip(items, args)))
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise StudyError(f"{where}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, bool):
            raise StudyError(f"{where}: expected a number, got {value!r}")
        try:
            x = hint(value.strip()) if isinstance(value, str) else hint(value)
        except (TypeError, ValueError):
            raise StudyError(f"{where}: expected {'an integer' if hint is int else 'a number'}, got {value!r}") from None
        if hint is int and not isinstance(value, str) and x != value:
            raise StudyError(f"{where}: expected an integer, got {value!r}")
        if hint is float and not math.isfinite(x) and not (isinstance(value, str) and "inf" in value.lower()):
            raise StudyError(f"{where}: expected a finite number, got {value!r}")
        return x
    if hint is str:
        if not isinstance(value, str):
            raise StudyError(f"{where}: expected text, got {value!r}")
        return value
    raise StudyError(f"{where}: fields of type {hint} cannot be set from a study")


def resolve_key(key: str) -> tuple[str, str]:
    """(target, field) of a setting KEY: `train.X`, `agent.X`, `reward.X`, `schedule.X`, `feedback.X`, or an
    unqualified X that names a field of exactly one of them. The fixed schedule's fields are ("schedule", X) however
    they are written (`train.gamma`, `feedback.gamma_fixed`, `eps_start`, ...). StudyError otherwise."""
    key = key.strip()
    if key == "feedback":
        return "feedback", "enabled"
    if "." in key:
        target, name = key.split(".", 1)
        if target not in _TARGETS:
            raise StudyError(f"setting {key!r}: the prefix must be one of {', '.join(_TARGETS)}")
        if target in ("train", "schedule", "feedback") and FixedSchedule.field_of(name):
            return "schedule", FixedSchedule.field_of(name)
        names = {f.name for f in fields(_TARGETS[target])} - set(_PARTS)
        if name not in names:
            near = " or ".join(f"{target}.{n}" for n in difflib.get_close_matches(name, sorted(
                names | (set(FixedSchedule.ALIASES) if target in ("train", "schedule", "feedback") else set())), n=3))
            raise StudyError(f"setting {key!r}: {_TARGETS[target].__name__} has no field {name!r}"
                             f"{f' (did you mean {near}?)' if near else ''}")
        return target, name
    if FixedSchedule.field_of(key):
        return "schedule", FixedSchedule.field_of(key)
    found = [t for t, cls in _TARGETS.items() if key in {f.name for f in fields(cls)} and key not in _PARTS]
    if not found:
        known = {f.name for cls in _TARGETS.values() for f in fields(cls)} - set(_PARTS) | set(FixedSchedule.ALIASES)
        near = " or ".join(difflib.get_close_matches(key, sorted(known), n=3))
        raise StudyError(f"setting {key!r}: no field of that name in TrainConfig, AgentConfig, RewardConfig, "
                         f"FeedbackConfig or the fixed schedule{f' (did you mean {near}?)' if near else ''}")
    if len(found) > 1:
        raise StudyError(f"setting {key!r} is a field of {' and '.join(_TARGETS[t].__name__ for t in found)}: write "
                         f"{' or '.join(f'{t}.{key}' for t in found)}")
    return found[0], key


def parse_setting(key: str, value: Any, where: str) -> tuple[str, Any]:
    """A setting as (canonical key `target.field`, typed value); a key that names no field is refused naming
    `where` (the option, or the study file and variant)."""
    try:
        target, name = resolve_key(key)
    except StudyError as exc:
        raise StudyError(f"{where}: {exc}") from None
    if (target, name) == ("feedback", "enabled") and isinstance(value, str) and value.strip().lower() in ("on", "off"):
        value = value.strip().lower() == "on"
    return f"{target}.{name}", parse_value(value, _hints(_TARGETS[target])[name], f"{where}: {key}")


def split_assignment(text: str, where: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise StudyError(f"{where}: expected KEY=VALUE, got {text!r}")
    return key.strip(), value.strip()


def apply_settings(cfg: TrainConfig, fb: FeedbackConfig, settings: list[tuple[str, Any]]
                   ) -> tuple[TrainConfig, FeedbackConfig]:
    """Copies of (cfg, fb) with the settings applied, both holding cfg's fixed schedule (with the `schedule.X`
    settings); StudyError when the result is not a valid config."""
    cfg = copy.deepcopy(cfg)
    fb_over: dict[str, Any] = {}
    sched_over: dict[str, Any] = {}
    for key, value in settings:
        target, name = key.split(".", 1)
        if target == "feedback":
            fb_over[name] = value
        elif target == "schedule":
            sched_over[name] = value
        else:
            setattr({"train": cfg, "agent": cfg.agent, "reward": cfg.reward}[target], name, value)
    try:
        cfg.schedule = cfg.schedule.with_values(sched_over)
        TrainConfig.from_dict(cfg.to_dict())
        fb = dataclasses.replace(fb, **fb_over, schedule=cfg.schedule)
    except (TypeError, ValueError) as exc:
        given = ", ".join(f"{k}={v}" for k, v in settings) or "none"
        raise StudyError(f"settings ({given}): {exc}") from None
    return cfg, fb


# ---------------------------------------------------------------------------------------------------------
# Variants
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    name: str
    settings: tuple[tuple[str, Any], ...]
    """(canonical key, typed value) in the order given."""

    def to_dict(self) -> dict:
        return {"name": self.name, "settings": [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.settings]}

    @property
    def feedback(self) -> bool:
        return dict(self.settings).get("feedback.enabled", True)


def make_variant(name: str, items: list[tuple[str, Any]], where: str) -> Variant:
    if not _NAME_RE.match(name):
        raise StudyError(f"{where}: variant name {name!r} must be letters, digits, '_', '.', '+' or '-'")
    if name in BUILTIN and items:
        raise StudyError(f"{where}: {name!r} is a built-in variant; give the changed loop another name")
    base = [(k, v) for k, v in BUILTIN.get(name, ())]
    return Variant(name, tuple(base + [parse_setting(k, v, f"{where} {name}") for k, v in items]))


def parse_variants(text: str) -> list[Variant]:
    """`on,off,NAME:KEY=VALUE;KEY=VALUE,...` → variants (StudyError on a bad item)."""
    out: list[Variant] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        name, sep, body = item.partition(":")
        name = name.strip()
        if not sep and name not in BUILTIN:
            raise StudyError(f"--variants: {name!r} is neither 'on' nor 'off'; a changed loop is NAME:KEY=VALUE[;...]")
        items = [split_assignment(a, f"--variants {name}") for a in body.split(";") if a.strip()] if sep else []
        if sep and not items:
            raise StudyError(f"--variants {name}: no KEY=VALUE after ':'")
        out.append(make_variant(name, items, "--variants"))
    return _check_variants(out, "--variants")


def variants_from_toml(table: Any, where: str) -> list[Variant]:
    """A TOML `[variants.NAME]` table (keys → values; `[variants.on]` empty) or the command line's string."""
    if isinstance(table, str):
        return parse_variants(table)
    if not isinstance(table, dict):
        raise StudyError(f"{where}: 'variants' must be a table of [variants.NAME] tables or a string")
    out = []
    for name, body in table.items():
        if not isinstance(body, dict):
            raise StudyError(f"{where}: [variants.{name}] must be a table of KEY = VALUE")
        out.append(make_variant(name, list(_flatten(body)), where))
    return _check_variants(out, where)


def _flatten(body: dict, prefix: str = ""):
    """TOML dotted keys arrive as nested tables: {"train": {"lr": 1e-4}} → ("train.lr", 1e-4)."""
    for k, v in body.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _check_variants(vs: list[Variant], where: str) -> list[Variant]:
    if not vs:
        raise StudyError(f"{where}: no variant given")
    names = [v.name for v in vs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise StudyError(f"{where}: variant names must be unique, repeated: {', '.join(dup)}")
    return vs


# ---------------------------------------------------------------------------------------------------------
# The study
# ---------------------------------------------------------------------------------------------------------
@dataclass
class StudySpec:
    """Everything that decides a study's results (saved as `study.json`; a resume must ask for the same), plus how
    it runs (`parallel`, `threads`, `stagger`, `mps`, `mps_share`, `iteration_sms`, `lockstep`: free to change
    between a kill and a resume)."""

    dataset: str
    variants: list[Variant]
    seeds: list[int]
    folds: int
    epochs: int
    preset: str = "small"
    settings: list[tuple[str, Any]] = field(default_factory=list)
    """Base settings applied to every variant before its own (`--set KEY=VALUE`)."""
    bars: int | None = None
    """Bars of the dataset: synthetic generates this many; a file uses its first `bars` (None: all / 6000)."""
    data_seed: int | None = None
    """Seed of the synthetic market; None: each run's seed (one market per seed; see `seeds_per_market`)."""
    seeds_per_market: int = 1
    """With `data_seed` None: seeds s share the synthetic market of seed s // seeds_per_market (1: a market each), so
    a population variant (`feedback.population`) has several independent populations to be judged over."""
    device: str = "cpu"
    accel: str = "auto"
    deterministic: bool = False
    min_val_trades: int = 20
    reference: str | None = None
    n_boot: int = 10_000
    ci_seed: int = 0
    # how it runs
    parallel: int = 1
    threads: int | None = None
    stagger: str = "auto"
    mps: str = "auto"
    """auto | on | off: the workers that share a GPU run under a CUDA MPS daemon of the study's own
    (`tradeloop.study.mps`; auto: when some GPU has more than one worker and MPS is installed)."""
    mps_share: int = 100
    """Under MPS, the share of a GPU's SMs (%) each worker's kernels may occupy (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`;
    100: no limit)."""
    iteration_sms: int = 0
    """Where runs share a GPU, the SMs each run's training iterations may use (`services.trainer.sm_partition`: a
    green context a worker; the rest of a run uses the whole GPU); 0: no limit."""
    lockstep: int = 1
    """Runs a worker trains as one computation (`services.trainer.lockstep`): up to this many runs of one market and
    one trainer config (the variants and seeds that share them) per worker, their iterations batched; 1: a run a
    worker. Local workers only (a Redis worker takes one run at a time). `tradeloop study` resolves `--lockstep auto`
    (its default) with `tradeloop.study.capacity.parse_lockstep`."""

    IDENTITY = ("dataset", "variants", "seeds", "folds", "epochs", "preset", "settings", "bars", "data_seed",
                "seeds_per_market", "device", "accel", "deterministic")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["variants"] = [v.to_dict() for v in self.variants]
        d["settings"] = [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.settings]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StudySpec":
        d = dict(d)
        d["variants"] = [Variant(v["name"], tuple(parse_setting(k, x, "study.json") for k, x in v["settings"]))
                         for v in d["variants"]]
        d["settings"] = [parse_setting(k, v, "study.json") for k, v in d["settings"]]
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})

    def identity(self) -> dict:
        d = self.to_dict()
        return {k: d[k] for k in self.IDENTITY}

    def resolved(self) -> dict[str, str]:
        """Per variant, a hash of the TrainConfig and FeedbackConfig it resolves to with this tradeloop's defaults
        (the preset, the feedback the product ships): kept in study.json, so a study is not resumed by a tradeloop
        whose defaults make a variant mean something else."""
        return {v.name: hashlib.sha256(json.dumps(self.resolved_doc(v), sort_keys=True, default=str).encode()
                                       ).hexdigest()[:16] for v in self.variants}

    def resolved_doc(self, variant: Variant) -> list[dict]:
        """[TrainConfig, FeedbackConfig] of `variant` as `resolved` hashes them (their JSON forms, which leave a field
        added later out at its neutral value, so a study started before it resumes)."""
        cfg, fb = self.configs(variant, 14)
        fbd = fb.to_dict() if fb.enabled else {"enabled": False, "schedule": fb.schedule.to_dict()}
        if not fbd.get("population"):              # with the population off its two fields decide nothing
            fbd.pop("population", None), fbd.pop("population_z", None)
        if fbd.get("min_selection_trades") == self.min_val_trades:     # the study's own: implied by its identity
            fbd.pop("min_selection_trades")
        return [cfg.to_dict(), fbd]

    @property
    def reference_name(self) -> str:
        names = [v.name for v in self.variants]
        if self.reference is not None:
            return self.reference
        return "off" if "off" in names else names[0]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def configs(self, variant: Variant, n_features: int) -> tuple[TrainConfig, FeedbackConfig]:
        """The TrainConfig and FeedbackConfig of a variant: the preset, the base settings, the variant's."""
        cfg = TrainConfig.preset(self.preset, n_features)
        # every variant starts from the feedback the product ships (`DEFAULT_OFF` switched off)
        try:
            # the rollback and the exploit choose among the epochs the study's selection could choose
            fb = FeedbackConfig(off=DEFAULT_OFF, min_selection_trades=self.min_val_trades)
            return apply_settings(cfg, fb, [*self.settings, *variant.settings])
        except StudyError as exc:
            raise StudyError(f"variant {variant.name!r}: {exc}") from None

    def runs(self) -> list["RunSpec"]:
        """Every run, fold by fold: within a fold seed by seed, the variants of one seed together (a population's runs
        — one variant's seeds of a fold — start close together)."""
        return [RunSpec(v.name, s, k) for k in range(self.folds) for s in self.seeds for v in self.variants]

    def in_population(self, variant: "Variant") -> bool:
        """Whether a variant's runs exploit one another (`feedback.population` with feedback on)."""
        d = dict([*self.settings, *variant.settings])
        return bool(d.get("feedback.population")) and d.get("feedback.enabled", True) is not False

    def peers(self, rs: "RunSpec") -> list["RunSpec"]:
        """The other runs of `rs`'s population: its variant and fold, other seeds, on the same data (a synthetic
        series: the same data seed); none unless the variant sets `feedback.population`."""
        if not self.in_population(self.variant(rs.variant)):
            return []
        same = lambda s: self.dataset != "synthetic" or self.data_seed_of(s) == self.data_seed_of(rs.seed)  # noqa: E731
        return [r for r in self.runs() if r.variant == rs.variant and r.fold == rs.fold and r.seed != rs.seed
                and same(r.seed)]

    def run(self, run_id: str) -> "RunSpec":
        r = next((r for r in self.runs() if r.run_id == run_id), None)
        if r is None:
            raise StudyError(f"run {run_id!r} is not part of this study")
        return r

    def compiled(self) -> bool:
        """Whether its runs go through torch.compile (`--accel` as resolved for its device: auto on CUDA does)."""
        from shared.graphs import resolve_accel

        return "compile" in resolve_accel(self.accel, self.device)

    def data_seed_of(self, seed: int) -> int:
        return seed // self.seeds_per_market if self.data_seed is None else self.data_seed

    def cluster_of(self, seed: int, fold: int) -> tuple:
        """The runs on the same data and fold (a synthetic market, or the one real series): one test period. A
        population variant's statistics count them as one unit, and so does every study where several units share
        one (`tradeloop.study.stats.aggregate`)."""
        return (self.data_seed_of(seed) if self.dataset == "synthetic" else None, fold)

    def acting_on_nothing(self) -> list[str]:
        """The variants whose feedback is on with every signal and the rollback switched off, no plateau decay and
        no population (`on` at the product's defaults): they train as the fixed schedule does, `off` in all but GPU
        noise."""
        out = []
        for v in self.variants:
            fb = self.configs(v, 14)[1]
            acts = fb.population or fb.plateau_lr_factor < 1.0 or any(fb.is_on(n) for n in OFF_NAMES)
            if fb.enabled and not acts:
                out.append(v.name)
        return out

    def populations(self) -> list[str]:
        """The variants whose runs exploit one another (`in_population`)."""
        return [v.name for v in self.variants if self.in_population(v)]

    def validate(self) -> "StudySpec":
        """StudyError naming the option on any value a study cannot run with."""
        if self.preset not in PRESETS:
            raise StudyError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name in ("folds", "epochs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise StudyError(f"--{name} must be an integer ≥ 1, got {getattr(self, name)!r}")
        if not isinstance(self.parallel, int) or self.parallel < 0:
            raise StudyError(f"--parallel must be an integer ≥ 1 (0: no local worker, with --redis), got "
                             f"{self.parallel!r}")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds) or min(self.seeds) < 0:
            raise StudyError(f"--seeds must name distinct seeds ≥ 0, got {self.seeds}")
        if self.bars is not None and self.bars < 100:
            raise StudyError(f"--bars must be ≥ 100, got {self.bars}")
        if self.min_val_trades < 0:
            raise StudyError(f"--min-val-trades must be ≥ 0, got {self.min_val_trades}")
        if self.n_boot < 100:
            raise StudyError(f"--n-boot must be ≥ 100, got {self.n_boot}")
        if self.device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", self.device):
            raise StudyError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.reference is not None and self.reference not in [v.name for v in self.variants]:
            raise StudyError(f"--reference {self.reference!r} is not one of the variants "
                             f"({', '.join(v.name for v in self.variants)})")
        if self.mps not in ("auto", "on", "off"):
            raise StudyError(f"--mps must be auto, on or off, got {self.mps!r}")
        if not isinstance(self.mps_share, int) or not 1 <= self.mps_share <= 100:
            raise StudyError(f"--mps-share must be a percentage of the SMs from 1 to 100, got {self.mps_share!r}")
        if not isinstance(self.iteration_sms, int) or not 0 <= self.iteration_sms <= 4096:
            raise StudyError(f"--iteration-sms must be a count of SMs from 0 (no limit) to 4096, got "
                             f"{self.iteration_sms!r}")
        if not isinstance(self.lockstep, int) or not 1 <= self.lockstep <= 64:
            raise StudyError(f"--lockstep must be a count of runs from 1 to 64, got {self.lockstep!r}")
        if not isinstance(self.seeds_per_market, int) or self.seeds_per_market < 1:
            raise StudyError(f"--seeds-per-market must be an integer ≥ 1, got {self.seeds_per_market!r}")
        if self.seeds_per_market > 1 and (self.data_seed is not None or self.dataset != "synthetic"):
            raise StudyError("--seeds-per-market groups seeds into synthetic markets; with --data-seed, or a real "
                             "series, every seed is on the same data already")
        for v in self.variants:
            if self.in_population(v) and not self.peers(RunSpec(v.name, self.seeds[0], 0)):
                raise StudyError(f"variant {v.name!r}: feedback.population needs runs on the same data to exploit — "
                                 "at least 2 seeds and, on synthetic data, one --data-seed for all of them or "
                                 "--seeds-per-market ≥ 2")
        if self.stagger != "auto":
            try:
                if float(self.stagger) < 0:
                    raise ValueError
            except ValueError:
                raise StudyError(f"--stagger must be auto or seconds ≥ 0, got {self.stagger!r}") from None
        for v in self.variants:  # every variant's config builds
            self.configs(v, 14)
        return self


@dataclass(frozen=True)
class RunSpec:
    variant: str
    seed: int
    fold: int

    @property
    def run_id(self) -> str:
        return f"{self.variant}-s{self.seed}-f{self.fold}"

    @property
    def unit(self) -> tuple[int, int]:
        """(seed, fold): the unit that variants are paired on and that the bootstrap resamples."""
        return (self.seed, self.fold)


# ---------------------------------------------------------------------------------------------------------
# Data and folds
# ---------------------------------------------------------------------------------------------------------
def synthetic_bars_for(window_trades: int, folds: int) -> int:
    """Bars of a synthetic series whose walk-forward val and test windows each hold ≥ `window_trades` trades of a
    policy that holds a trade through a trend (the oracle: one trade per trending regime, one in 1.5 regimes, i.e.
    one per 1.5 × MEAN_DURATION bars), with 15 % to spare; `walk_forward_folds`' default sizes (train:val:test =
    3:1:1, step = test) and its 1 % embargo."""
    from shared.synthetic import MEAN_DURATION

    window = math.ceil(1.15 * 1.5 * MEAN_DURATION * window_trades)
    return math.ceil(((4 + folds) * window) / 0.98) + 2


def load_study_bars(spec: StudySpec, data_seed: int):
    """The bars of a study for one data seed (synthetic: generated; a file or bundled set: loaded, first `bars`)."""
    from shared.market import load_dataset

    if spec.dataset.strip().lower() == "synthetic":
        return load_dataset("synthetic", seed=data_seed, n_bars=spec.bars or SYNTHETIC_DEFAULT_BARS)
    bars = load_dataset(spec.dataset)
    if spec.bars is not None:
        if spec.bars > len(bars):
            raise StudyError(f"--bars {spec.bars}: {spec.dataset} has only {len(bars)} bars")
        bars = bars.slice(0, spec.bars)
    return bars


def study_folds(spec: StudySpec, n_bars: int):
    """The walk-forward folds (train | embargo | val | embargo | test) of a series of `n_bars` bars."""
    from shared.market import walk_forward_folds

    try:
        folds = walk_forward_folds(n_bars, n_folds=spec.folds)
    except ValueError as exc:
        raise StudyError(f"--folds {spec.folds} on {n_bars} bars: {exc} (use more --bars or fewer --folds)") from None
    f = folds[0]
    if f.train[1] - f.train[0] < MIN_TRAIN_BARS or min(f.val[1] - f.val[0], f.test[1] - f.test[0]) < MIN_WINDOW_BARS:
        raise StudyError(f"--folds {spec.folds} on {n_bars} bars leave windows of train {f.train[1] - f.train[0]}, val "
                         f"{f.val[1] - f.val[0]}, test {f.test[1] - f.test[0]} bars; a study needs ≥ {MIN_TRAIN_BARS} "
                         f"training and ≥ {MIN_WINDOW_BARS} validation and test bars (use more --bars or fewer --folds)")
    return folds


def read_toml(path: Path) -> dict:
    """A study file (TOML); StudyError naming the file on a read or syntax error."""
    import tomllib

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise StudyError(f"--config {path}: cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise StudyError(f"--config {path}: not valid TOML: {exc}") from None
