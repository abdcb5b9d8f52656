"""Payloads that cross services: the evaluator's report and the feedback service's bundle (pydantic v2).

- `EvalReport` (evaluator → feedback, dashboard): metrics of the validation and OOS backtests, the in-sample
  autopsy, the trade ledger with the policy's predictions at entry, equity curves, and the run's split
  definition with the sha256 of every window, so the feedback's leakage guard can refuse a report whose windows
  overlap the wrong split (`services/feedback/guard.py`).
- `FeedbackBundle` (feedback → trainer): the nine signals E1–E9, each with its value, the inputs it was computed
  from, its provenance (report, split, window hash, fields) and a one-line reason; `bundle.to_knobs()` gives the
  `shared.knobs.Knobs` the trainer applies to the next epoch.

Conventions:
- Bar indices are absolute indices into the run's dataset (the same frame `Split` ranges index); windows are
  half-open `(start, end)`.
- Returns are simple fractions (0.01 = +1 %); every Sharpe is un-annualized, per trade unless named otherwise.
- JSON is NaN-free: models refuse NaN/inf (`allow_inf_nan=False`); metrics that are undefined are `None`,
  and an infinite gate threshold ("no gate") is `None`.
- Directions are branch indices 0 = short, 1 = flat, 2 = long; a ledger `side` is −1 / +1.
- Per-trade and per-bar data are columnar and packed: a window's trades are a `TradeTable` (one array per
  `TradeRecord` field), its equity curve one float64 array, each sent as base64 of its little-endian bytes. A
  10^5-bar window of an untrained agent closes ~3·10^4 trades: as one JSON object per trade they made a 70-MB
  report that took seconds to build and to parse, and 10^6 bars would pass Redis's 512-MB value limit. Rows are
  still `TradeRecord`s where one is read (`table[i]`, `table.records()`), and the REST API serves rows.
- `SCHEMA_VERSION` bumps on any incompatible change; readers refuse other versions (2: packed trades and equity).
"""
from __future__ import annotations

import hashlib
import math
from typing import Any, Literal, Sequence

import numpy as np
from pydantic import Field, field_validator, model_validator

from shared.knobs import BRANCHES, N_REGIMES, Knobs
from shared.trade_table import (EXIT_REASONS, TAUS, TRADE_COLUMNS, PackedFloats, TradeRecord,  # noqa: F401
                                TradeTable, _finite_or_none, _Model, pack, unpack, unpack_floats)

SCHEMA_VERSION = 2
DIRECTIONS = ("short", "flat", "long")
SIGNAL_IDS = ("E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9")
OFF_NAMES = (*SIGNAL_IDS, "rollback")
"""What a feedback config may switch off: a signal, or the rollback."""
DEFAULT_OFF = OFF_NAMES
"""What the product ships switched off (`TL_FEEDBACK_OFF`'s default; the base of every `tradeloop study` variant):
the nine signals and the rollback, so every knob follows the fixed schedule (`shared.knobs.FixedSchedule`) while the
feedback service still computes each signal, its inputs and its reason. None earned its place: in the leave-one-out
study no signal did (docs/study-h200-loo/), and on the S&P 500 sample the signals' knobs lowered OOS below the fixed
schedule's beyond the CI; the rollback alone − the fixed schedule at `full`'s one update an iteration read −0.045
[−0.171, +0.048] (docs/study-h200-onoff-one-update/) and −0.090 [−0.258, +0.075] (docs/study-h200-gamma/), pooled
−0.068 [−0.172, +0.028] over 30 units, and on a CPU at `small` with γ 0.98 −0.043 [−0.097, +0.001] (higher in 1 of
6; docs/study-cpu-after-gamma/): each act re-draws an epoch from an optimistic best. One is switched on by naming
the others (`TL_FEEDBACK_OFF=E1,E2,E3,E4,E5,E6,E7,E8,E9` for the rollback alone; a study variant's
`off = [...]`); `FeedbackConfig()` itself switches nothing off."""


def parse_off(value: str | Sequence[str]) -> tuple[str, ...]:
    """The names of switched-off signals from a comma-separated string or a sequence ("e2" → "E2"), each once;
    ValueError naming what is not in `OFF_NAMES`."""
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else [str(x).strip() for x in value]
    norm = {x: x.upper() if x.upper() in SIGNAL_IDS else x.lower() for x in items if x}
    bad = [x for x, n in norm.items() if n not in OFF_NAMES]
    if bad:
        joined = any("," in x or "+" in x for x in bad)
        hint = " (several names: a list, or in a study setting joined by +, e.g. E6+E7)" if joined else ""
        raise ValueError(f"off names {bad}, not among {', '.join(OFF_NAMES)}{hint}")
    return tuple(dict.fromkeys(norm.values()))
SplitName = Literal["insample", "val", "oos"]


def window_hash(timestamps_ns: Any, open_: Any, high: Any, low: Any, close: Any, volume: Any, start: int,
                end: int) -> str:
    """sha256 hex of the bars [start, end): their int64 nanosecond timestamps, then the float64 open, high, low,
    close, volume (little-endian, C order) — the definition of `shared.market.Bars.fingerprint` of the slice, so
    it equals `shared.market.Split.window_hash`."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(np.asarray(timestamps_ns, dtype="<i8")[start:end]).tobytes())
    for a in (open_, high, low, close, volume):
        h.update(np.ascontiguousarray(np.asarray(a, dtype="<f8")[start:end]).tobytes())
    return h.hexdigest()


def bars_window_hash(bars: Any, start: int, end: int) -> str:
    """`window_hash` of a `shared.market.Bars`-like object (timestamps, open, high, low, close, volume)."""
    ts = bars.timestamps
    ts = np.asarray(ts.asi8 if hasattr(ts, "asi8") else ts, dtype=np.int64)
    return window_hash(ts, bars.open, bars.high, bars.low, bars.close, bars.volume, start, end)


# --- the report -------------------------------------------------------------------------------------------


class RegimeStats(_Model):
    """Closed trades grouped by the regime label at their decision bar."""

    regime: int
    n_trades: int
    mean_return: float
    """Mean net trade return (0 with no trade)."""
    sum_return: float
    win_rate: float
    sharpe: float
    """Un-annualized per-trade Sharpe within the regime (0 with fewer than 2 trades or no dispersion)."""


class BranchStats(_Model):
    """How often one action branch erred over the closed trades (definitions in services/evaluator/autopsy.py)."""

    n_trades: int
    n_errors: int
    error_rate: float
    mean_return_when_error: float


class Calibration(_Model):
    """Predicted return distribution at entry vs realised trade returns."""

    n_trades: int
    taus: list[float] = Field(default_factory=lambda: list(TAUS))
    coverage: list[float]
    """coverage[j] = fraction of trades whose realised return ≤ predicted quantile at taus[j] (ideal: taus[j])."""
    bias: float
    """mean(q_pred − realised): > 0 when Q over-predicts."""
    median_bias: float
    """median(q50 − realised): the same, robust to outliers."""
    mae: float
    """mean |q_pred − realised|."""


class GatePoint(_Model):
    """Trades kept by an epistemic entry gate at `threshold` (ensemble_std ≤ threshold; None = no gate)."""

    threshold: float | None
    n_kept: int
    sum_return: float
    mean_return: float


class SplitReport(_Model):
    """One backtest window: metrics, trades, equity, and its autopsy."""

    split: SplitName
    window: tuple[int, int]
    window_hash: str
    engine: str = ""
    """The path that ran this window's backtest: "native-c" (the compiled loop, `shared.native`), "torch-eager",
    "torch-compile", "torch-graph", "torch-compile+graph" (`shared.rollout.greedy_pass`), "replay" (the vectorised
    replay of `shared.execution.run_positions`) or "simulator" (its step simulator); "" when not recorded."""
    metrics: dict[str, float | None]
    """`shared.metrics.compute_metrics` keys (un-annualized); None where undefined."""
    trades: TradeTable
    """The closed trades, sorted by entry bar (`table[i]` is a `TradeRecord`)."""
    equity: PackedFloats
    """Equity at each bar's close of the window (1.0 at the first)."""
    regimes: list[RegimeStats]
    branches: dict[str, BranchStats]
    calibration: Calibration
    gate_curve: list[GatePoint]
    disagreement_winners: float
    """Mean ensemble std at entry of winning trades (0 with none)."""
    disagreement_losers: float
    top_winners: list[int] = Field(default_factory=list)
    """Indices into `trades` of the top-10 % winning trades (in-sample only)."""
    losers: list[int] = Field(default_factory=list)
    """Indices into `trades` of the losing trades with a hindsight action (in-sample only)."""

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics_nan_free(cls, v: dict) -> dict:
        return {str(k): _finite_or_none(x) for k, x in dict(v).items()}

    @model_validator(mode="after")
    def _check(self) -> "SplitReport":
        s, e = self.window
        if not 0 <= s < e:
            raise ValueError(f"{self.split}: window must satisfy 0 <= start < end, got {self.window}")
        tt = self.trades
        out = (tt.entry_t < s) | (tt.exit_t >= e)
        if out.any():
            i = int(np.flatnonzero(out)[0])
            raise ValueError(f"{self.split}: trade {i} spans bars [{tt.entry_t[i]}, {tt.exit_t[i]}] "
                             f"outside window {self.window}")
        for name in ("top_winners", "losers"):
            bad = [i for i in getattr(self, name) if not 0 <= i < len(self.trades)]
            if bad:
                raise ValueError(f"{self.split}: {name} has indices {bad[:5]} outside the {len(self.trades)} trades")
        if self.split != "insample" and (self.top_winners or self.losers
                                         or bool((self.trades.hindsight_dir >= 0).any())):
            raise ValueError(f"{self.split}: sample-level autopsy (top winners, hindsight) is for the insample "
                             "window only")
        if set(self.branches) != set(BRANCHES):
            raise ValueError(f"{self.split}: branches must be {BRANCHES}, got {sorted(self.branches)}")
        if len(self.regimes) != N_REGIMES:
            raise ValueError(f"{self.split}: regimes must have {N_REGIMES} entries, got {len(self.regimes)}")
        return self

    def metric(self, key: str, default: float = 0.0) -> float:
        """A metric as a float, `default` when missing or undefined."""
        v = self.metrics.get(key)
        return default if v is None else float(v)


class SplitDefinition(_Model):
    """The run's chronological split (half-open bar ranges) and the sha256 of each range's bars."""

    n_bars: int
    train: tuple[int, int]
    val: tuple[int, int]
    test: tuple[int, int]
    embargo: int = 0
    train_hash: str = ""
    val_hash: str = ""
    test_hash: str = ""

    @model_validator(mode="after")
    def _ordered(self) -> "SplitDefinition":
        (a0, a1), (b0, b1), (c0, c1) = self.train, self.val, self.test
        if not (0 <= a0 < a1 <= b0 < b1 <= c0 < c1 <= self.n_bars):
            raise ValueError(f"split ranges must be ordered train < val < test inside [0, {self.n_bars}), "
                             f"got train={self.train} val={self.val} test={self.test}")
        return self


class _Versioned(_Model):
    """A payload that carries `SCHEMA_VERSION` and refuses any other."""

    schema_version: int = SCHEMA_VERSION

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"{cls.__name__} schema_version {v} is not supported (this code reads {SCHEMA_VERSION})")
        return v


class EvalReport(_Versioned):
    """The evaluator's report of one checkpoint (epoch) of one run."""

    run_id: str
    epoch: int = Field(ge=0)
    checkpoint_sha256: str = ""
    config_hash: str = ""
    dataset: str = ""
    split: SplitDefinition
    n_trials: int = Field(ge=1)
    """Checkpoints evaluated in the run so far, this one included: the DSR's number of trials."""
    val: SplitReport
    oos: SplitReport | None = None
    insample: SplitReport | None = None
    val_oos_gap: float | None = None
    """1 − OOS per-trade Sharpe / val per-trade Sharpe (None without an OOS backtest)."""
    knobs: dict[str, Any] | None = None
    """The `Knobs.to_dict()` the checkpoint was trained under (None: defaults)."""
    policy_shaping: bool = True
    """The greedy policy ran with the knobs that shape it (E5 gate, E9 regime confidence) as trained; False: without
    them (an ablation telling learning from policy shaping; `services.evaluator.runner.eval_controls`)."""
    engine: str = ""
    """The paths that produced the windows' backtests (`SplitReport.engine` of each, once each, joined by ", "),
    e.g. "native-c"; "" when not recorded."""
    created_at: str = ""

    @model_validator(mode="after")
    def _splits_named(self) -> "EvalReport":
        for name in ("val", "oos", "insample"):
            sr = getattr(self, name)
            if sr is not None and sr.split != name:
                raise ValueError(f"EvalReport.{name} holds a SplitReport labelled {sr.split!r}")
        return self

    def trained_knobs(self) -> Knobs:
        """The knobs this checkpoint trained under (`Knobs()` when the report does not say)."""
        return Knobs() if self.knobs is None else Knobs.from_dict(self.knobs)


# --- the bundle -------------------------------------------------------------------------------------------


class Provenance(_Model):
    """Where a signal came from: which report, which split window, which fields."""

    run_id: str
    epoch: int
    split: Literal["val", "insample", "history", "config"]
    window_hash: str = ""
    fields: list[str] = Field(default_factory=list)


class Signal(_Model):
    """One feedback signal: its value for the next epoch, the previous value, the inputs and a reason."""

    id: Literal["E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9"]
    knob: str
    """The `Knobs` field it sets."""
    value: Any
    previous: Any = None
    inputs: dict[str, Any] = Field(default_factory=dict)
    provenance: list[Provenance] = Field(default_factory=list)
    reason: str
    clamped: bool = False
    """True when a bound or the per-epoch step limit cut the raw value."""

    @model_validator(mode="after")
    def _nan_free(self) -> "Signal":
        for name in ("value", "previous", "inputs"):
            _check_json_finite(getattr(self, name), f"{self.id}.{name}")
        return self


def _check_json_finite(x: Any, where: str) -> None:
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError(f"{where} holds a non-finite number {x} (use None for 'none')")
    if isinstance(x, dict):
        for k, v in x.items():
            _check_json_finite(v, f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            _check_json_finite(v, f"{where}[{i}]")


class FeedbackBundle(_Versioned):
    """The signals for epoch `epoch + 1`, computed from the report of epoch `epoch`."""

    run_id: str
    epoch: int
    """The epoch whose report this bundle was computed from."""
    for_epoch: int
    """The epoch that trains under it (epoch + 1)."""
    enabled: bool = True
    off: list[str] = Field(default_factory=list)
    """Signals switched off (their knobs at the fixed schedule's values); "rollback": no rollback."""
    rollback: bool = False
    """The trainer restores epoch `rollback_to_epoch`'s weights, target network and optimizer state before it
    trains `for_epoch` (the knobs are that epoch's already)."""
    rollback_to_epoch: int | None = None
    rollback_checkpoint_sha256: str = ""
    """The sha256 of that epoch's checkpoint (the one its report evaluated); "" when the report did not say."""
    rollback_keep: float = Field(default=0.0, ge=0.0, lt=1.0)
    """The share of the current weights the rollback keeps (`FeedbackConfig.rollback_keep`; 0: that epoch's
    weights exactly)."""
    rollback_restart: bool = False
    """The trainer answers the drop with a fresh learner instead of restoring epoch `rollback_to_epoch`'s
    (`FeedbackConfig.rollback_restart`); the knobs are that epoch's either way."""
    best_epoch: int | None = None
    """The epoch with the best validation per-trade Sharpe so far, this one included: what a later rollback would
    restore, or a peer run of a population exploit, so the trainer keeps its checkpoint files. None with the rollback
    and the population off."""
    reason: str = ""
    signals: dict[str, Signal]
    knobs: dict[str, Any]
    """`Knobs.to_dict()` of the result (gate_threshold None = no gate)."""
    report_checkpoint_sha256: str = ""
    created_at: str = ""

    @model_validator(mode="after")
    def _check(self) -> "FeedbackBundle":
        missing = [s for s in SIGNAL_IDS if s not in self.signals]
        if missing:
            raise ValueError(f"FeedbackBundle lacks signals {missing}")
        _check_json_finite(self.knobs, "knobs")
        Knobs.from_dict(self.knobs)  # raises ValueError naming the bad knob
        return self

    def to_knobs(self) -> Knobs:
        """The `Knobs` the trainer applies to epoch `for_epoch`."""
        return Knobs.from_dict(self.knobs)
