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

import base64
import hashlib
import math
from typing import Annotated, Any, Iterable, Iterator, Literal, Mapping, Sequence

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, PlainSerializer,
                      PlainValidator, ValidationError, WithJsonSchema, field_validator, model_validator)
from pydantic_core import core_schema

from shared.knobs import BRANCHES, N_REGIMES, Knobs

SCHEMA_VERSION = 2
TAUS: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)
"""Quantile levels of the predicted return distribution carried in the report."""
DIRECTIONS = ("short", "flat", "long")
SIGNAL_IDS = ("E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9")
OFF_NAMES = (*SIGNAL_IDS, "rollback")
"""What a feedback config may switch off: a signal, or the rollback."""


def parse_off(value: str | Sequence[str]) -> tuple[str, ...]:
    """The names of switched-off signals from a comma-separated string or a sequence ("e2" → "E2"), each once;
    ValueError naming what is not in `OFF_NAMES`."""
    items = [p.strip() for p in value.split(",")] if isinstance(value, str) else [str(x).strip() for x in value]
    norm = {x: x.upper() if x.upper() in SIGNAL_IDS else x.lower() for x in items if x}
    bad = [x for x, n in norm.items() if n not in OFF_NAMES]
    if bad:
        raise ValueError(f"off names {bad}, not among {', '.join(OFF_NAMES)}")
    return tuple(dict.fromkeys(norm.values()))
SplitName = Literal["insample", "val", "oos"]


class _Model(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=False)


def _finite_or_none(x: Any) -> float | None:
    """float(x) if finite, else None (for metrics that are undefined)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


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


class TradeRecord(_Model):
    """One closed trade of a backtest, with what the policy predicted when it decided to enter."""

    entry_t: int
    """Bar of the entry fill (at its open); the decision was taken at the close of `entry_t − 1`."""
    exit_t: int
    """Bar of the exit fill (at its open for signal/flip exits, inside the bar for stop/target, its close for end)."""
    decision_t: int
    """Bar at whose close the entry was decided (= entry_t − 1): where the predictions below were read."""
    side: int = Field(ge=-1, le=1)
    size: float = Field(ge=0.0)
    entry_price: float
    exit_price: float
    net_return: float
    """Net return of the trade, costs included (the simulator's ledger)."""
    bars: int
    exit_reason: Literal["signal", "flip", "stop", "target", "end"]
    regime: int = Field(ge=0, lt=N_REGIMES)
    """Regime label at the decision bar."""
    direction_idx: int
    size_idx: int
    exit_idx: int
    q_pred: float
    """Predicted Q (mean of the chosen action's return distribution) at the decision bar."""
    q_quantiles: list[float]
    """Predicted quantiles of the chosen action's return at `TAUS`."""
    ensemble_std: float = Field(ge=0.0)
    """Std of Q across the ensemble heads (epistemic disagreement) at the decision bar."""
    q_dir: list[float]
    """Q of each direction (short, flat, long) at the decision bar."""
    direction_error: bool
    size_error: bool
    exit_error: bool
    best_exit_return: float
    """Best net return the same position could have made exiting at a close in the hindsight exit span."""
    hindsight_returns: list[float] | None = None
    """Net return of short / flat / long over the trade's span (in-sample only)."""
    hindsight_dir: int | None = None
    """Hindsight-optimal direction (0 short, 1 flat, 2 long) for a losing trade (in-sample only)."""


# --- packed columns -----------------------------------------------------------------------------------------

EXIT_REASONS: tuple[str, ...] = ("signal", "flip", "stop", "target", "end")
"""`TradeRecord.exit_reason` values; a `TradeTable` stores the index into this tuple."""

TRADE_COLUMNS: dict[str, tuple[str, int]] = {
    # name: (little-endian dtype, width: 0 = one value per trade, k = k values per trade)
    "entry_t": ("<i8", 0), "exit_t": ("<i8", 0), "decision_t": ("<i8", 0), "side": ("<i1", 0),
    "size": ("<f8", 0), "entry_price": ("<f8", 0), "exit_price": ("<f8", 0), "net_return": ("<f8", 0),
    "bars": ("<i8", 0), "exit_reason": ("<u1", 0), "regime": ("<i1", 0), "direction_idx": ("<i1", 0),
    "size_idx": ("<i1", 0), "exit_idx": ("<i1", 0), "q_pred": ("<f4", 0), "q_quantiles": ("<f4", len(TAUS)),
    "ensemble_std": ("<f4", 0), "q_dir": ("<f4", 3), "direction_error": ("|b1", 0), "size_error": ("|b1", 0),
    "exit_error": ("|b1", 0), "best_exit_return": ("<f8", 0), "hindsight_returns": ("<f8", 3),
    "hindsight_dir": ("<i1", 0),
}
"""The columns of a `TradeTable`. The policy's predictions are float32 (what the network computes); prices and
returns float64. `hindsight_dir` is −1 and `hindsight_returns` NaN where a trade has none (`TradeRecord`: None)."""


def pack(a: np.ndarray) -> str:
    """base64 of an array's little-endian C-order bytes (its dtype and shape are the reader's to know)."""
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{what}: not base64 ({exc})") from None


def unpack(text: str, dtype: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    """The array `pack` wrote; ValueError naming `what` when the text is not base64 of exactly that many values."""
    raw = _b64(text, what)
    want = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise ValueError(f"{what}: {len(raw)} bytes where shape {shape} of {dtype} needs {want}")
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _first_bad(ok: np.ndarray) -> int:
    return int(np.flatnonzero(~ok.reshape(len(ok), -1).all(axis=1))[0])


class TradeTable:
    """The closed trades of one backtest as columns: `table.net_return` is a float64 array over the trades, and
    so on for every `TradeRecord` field (`TRADE_COLUMNS`); `table[i]` is row i as a `TradeRecord`.

    Built from columns (`TradeTable(entry_t=..., ...)`) or rows (`TradeTable.from_records`, also what a pydantic
    field of this type does with a list); checked on construction with the `TradeRecord` rules, vectorised (a
    ValueError names the column and row). JSON: `{"n": n, "columns": {name: base64}}` (`pack`).
    """

    __slots__ = ("_cols", "n")

    def __init__(self, **columns: Any) -> None:
        unknown = sorted(set(columns) - set(TRADE_COLUMNS))
        missing = [c for c in TRADE_COLUMNS if c not in columns and c not in ("hindsight_returns", "hindsight_dir")]
        if unknown or missing:
            raise ValueError(f"trade table: unknown columns {unknown}, missing columns {missing}")
        n = len(columns["entry_t"])
        cols: dict[str, np.ndarray] = {}
        for name, (dtype, width) in TRADE_COLUMNS.items():
            shape = (n, width) if width else (n,)
            if name not in columns:
                a = np.full(shape, np.nan if name == "hindsight_returns" else -1, dtype=dtype)
            else:
                v = columns[name]
                if name == "exit_reason" and len(v) and not np.issubdtype(np.asarray(v).dtype, np.integer):
                    codes = {r: i for i, r in enumerate(EXIT_REASONS)}
                    bad = [x for x in v if x not in codes]
                    if bad:
                        raise ValueError(f"trade table: exit_reason {bad[0]!r} is not one of {EXIT_REASONS}")
                    v = [codes[x] for x in v]
                src = np.asarray(v)
                if src.size == 0:
                    src = src.reshape(shape)
                if src.shape != shape:
                    raise ValueError(f"trade table: column {name} has shape {src.shape}, expected {shape}")
                a = src.astype(dtype)
                if np.issubdtype(a.dtype, np.integer) and not np.array_equal(a, src):
                    raise ValueError(f"trade table: column {name} row {_first_bad(a == src)}: value "
                                     f"{src.reshape(n, -1)[_first_bad(a == src)].tolist()} does not fit {dtype}")
            cols[name] = a
        self._cols, self.n = cols, n
        self._check()

    def _check(self) -> None:
        c = self._cols
        rules = {
            "side": (c["side"] == -1) | (c["side"] == 1), "size": c["size"] >= 0.0,
            "exit_reason": c["exit_reason"] < len(EXIT_REASONS),
            "regime": (c["regime"] >= 0) & (c["regime"] < N_REGIMES),
            "ensemble_std": c["ensemble_std"] >= 0.0,
            "hindsight_dir": (c["hindsight_dir"] >= -1) & (c["hindsight_dir"] <= 2),
            "hindsight_returns": np.isnan(c["hindsight_returns"]).all(axis=1) == (c["hindsight_dir"] == -1),
        }
        for name, (dtype, _) in TRADE_COLUMNS.items():
            if dtype[1] == "f" and name != "hindsight_returns":
                rules[name] = np.isfinite(c[name]) & rules.get(name, np.True_)
        for name, ok in rules.items():
            if ok.size and not ok.all():
                i = _first_bad(ok)
                raise ValueError(f"trade table: column {name} row {i}: invalid value {c[name][i].tolist()}")
        if self.n and not ((c["entry_t"] <= c["exit_t"]).all()):
            raise ValueError(f"trade table: row {_first_bad(c['entry_t'] <= c['exit_t'])}: exit_t before entry_t")

    @classmethod
    def from_records(cls, rows: Iterable["TradeRecord | Mapping[str, Any]"]) -> "TradeTable":
        """A table of `TradeRecord`s (or dicts of their fields, validated as one)."""
        recs = []
        for i, r in enumerate(rows):
            try:
                recs.append(r if isinstance(r, TradeRecord) else TradeRecord.model_validate(r))
            except ValidationError as exc:
                err = exc.errors()[0]
                raise ValueError(f"trade table: row {i}, field {'.'.join(map(str, err['loc']))}: {err['msg']}") \
                    from None
        cols: dict[str, Any] = {name: [getattr(r, name) for r in recs] for name in TRADE_COLUMNS}
        cols["hindsight_dir"] = [-1 if d is None else d for d in cols["hindsight_dir"]]
        cols["hindsight_returns"] = np.array([[math.nan] * 3 if h is None else h for h in cols["hindsight_returns"]],
                                             dtype=np.float64).reshape(len(recs), 3)
        for name, (_, width) in TRADE_COLUMNS.items():
            if width and name != "hindsight_returns":
                cols[name] = np.array(cols[name], dtype=np.float64).reshape(len(recs), width)
        return cls(**cols)

    @classmethod
    def empty(cls) -> "TradeTable":
        return cls.from_records([])

    def __len__(self) -> int:
        return self.n

    def __getattr__(self, name: str) -> np.ndarray:
        if name.startswith("_") or name not in TRADE_COLUMNS:   # (copy/pickle probe dunders before _cols exists)
            raise AttributeError(f"TradeTable has no attribute {name!r}")
        return self._cols[name]

    def __getstate__(self) -> dict[str, np.ndarray]:
        return self._cols

    def __setstate__(self, cols: dict[str, np.ndarray]) -> None:
        self._cols, self.n = cols, len(cols["entry_t"])

    def records(self, start: int = 0, stop: int | None = None) -> list[dict[str, Any]]:
        """Rows [start, stop) as dicts of `TradeRecord` fields (JSON-ready: None where a trade has no hindsight)."""
        sl = slice(start, stop)
        cols = {k: v[sl].tolist() for k, v in self._cols.items()}
        cols["exit_reason"] = [EXIT_REASONS[i] for i in cols["exit_reason"]]
        out = [dict(zip(cols, vals)) for vals in zip(*cols.values())]
        for r in out:
            if r["hindsight_dir"] == -1:
                r["hindsight_dir"] = r["hindsight_returns"] = None
        return out

    def __getitem__(self, i: "int | slice | np.ndarray") -> "TradeRecord | TradeTable":
        """Row i as a `TradeRecord`; a slice or an index array gives a `TradeTable` of those rows."""
        if isinstance(i, (slice, np.ndarray, list)):
            return TradeTable(**{k: v[i] for k, v in self._cols.items()})
        i = int(i)
        if not -self.n <= i < self.n:
            raise IndexError(f"trade {i} of {self.n}")
        i %= self.n
        return TradeRecord.model_validate(self.records(i, i + 1)[0])

    def __iter__(self) -> Iterator["TradeRecord"]:
        return (self[i] for i in range(self.n))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TradeTable) and self.n == other.n and all(
            np.array_equal(a, other._cols[k], equal_nan=a.dtype.kind == "f") for k, a in self._cols.items())

    def __repr__(self) -> str:
        return f"TradeTable(n={self.n})"

    def to_json_dict(self) -> dict[str, Any]:
        return {"n": self.n, "columns": {k: pack(v) for k, v in self._cols.items()}}

    @classmethod
    def from_json_dict(cls, d: Mapping[str, Any]) -> "TradeTable":
        n, packed = d.get("n"), d.get("columns")
        if not isinstance(n, int) or n < 0 or not isinstance(packed, Mapping):
            raise ValueError('a packed trade table is {"n": int >= 0, "columns": {name: base64}}')
        missing = [c for c in TRADE_COLUMNS if c not in packed]
        if missing:
            raise ValueError(f"trade table: missing columns {missing}")
        return cls(**{name: unpack(packed[name], dtype, (n, width) if width else (n,), f"trades.columns.{name}")
                      for name, (dtype, width) in TRADE_COLUMNS.items()})

    @classmethod
    def of(cls, v: "TradeTable | Mapping[str, Any] | Iterable[TradeRecord | Mapping[str, Any]]") -> "TradeTable":
        """A table as is, from its packed JSON form, or from rows."""
        return cls._validate(v)

    @classmethod
    def _validate(cls, v: Any) -> "TradeTable":
        if isinstance(v, TradeTable):
            return v
        if isinstance(v, Mapping):
            return cls.from_json_dict(v)
        if isinstance(v, (list, tuple)):
            return cls.from_records(v)
        raise ValueError(f"trades must be a packed table or a list of trades, got {type(v).__name__}")

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate, serialization=core_schema.plain_serializer_function_ser_schema(lambda t: t.to_json_dict()))

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return {"type": "object", "description": "trades as columns: base64 of little-endian arrays (TRADE_COLUMNS)",
                "properties": {"n": {"type": "integer"}, "columns": {"type": "object",
                                                                     "additionalProperties": {"type": "string"}}}}


def unpack_floats(v: Any) -> list[float]:
    """Floats from base64 of float64 bytes (`pack`), a list or an array; ValueError unless all are finite."""
    if isinstance(v, str):
        raw = _b64(v, "packed float64 array")
        if len(raw) % 8:
            raise ValueError(f"packed float64 array: {len(raw)} bytes is not a multiple of 8")
        a = np.frombuffer(raw, dtype="<f8")
    else:
        try:
            a = np.asarray(v, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not an array of numbers ({exc})") from None
    if not np.isfinite(a).all():
        raise ValueError(f"value at index {int(np.flatnonzero(~np.isfinite(a))[0])} is not finite")
    return a.tolist()


PackedFloats = Annotated[list[float], PlainValidator(unpack_floats),
                         PlainSerializer(lambda v: pack(np.asarray(v, dtype="<f8"))),
                         WithJsonSchema({"type": "string", "description": "base64 of little-endian float64 values"})]
"""Finite floats (a list in Python), sent as base64 of their float64 bytes; validates from that, a list or an
array."""


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


class EvalReport(_Model):
    """The evaluator's report of one checkpoint (epoch) of one run."""

    schema_version: int = SCHEMA_VERSION
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

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"EvalReport schema_version {v} is not supported (this code reads {SCHEMA_VERSION})")
        return v

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


class FeedbackBundle(_Model):
    """The signals for epoch `epoch + 1`, computed from the report of epoch `epoch`."""

    schema_version: int = SCHEMA_VERSION
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
    best_epoch: int | None = None
    """The epoch with the best validation per-trade Sharpe so far, this one included: what a later rollback would
    restore, so the trainer keeps its checkpoint files. None with the rollback off."""
    reason: str = ""
    signals: dict[str, Signal]
    knobs: dict[str, Any]
    """`Knobs.to_dict()` of the result (gate_threshold None = no gate)."""
    report_checkpoint_sha256: str = ""
    created_at: str = ""

    @field_validator("schema_version")
    @classmethod
    def _version(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"FeedbackBundle schema_version {v} is not supported (this code reads {SCHEMA_VERSION})")
        return v

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
