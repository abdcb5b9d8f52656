"""A backtest's closed trades as packed columns (`TradeTable` of `TradeRecord` rows) and packed float arrays
(`PackedFloats`): the bulky part of `shared.report.EvalReport`, which re-exports every name here.

Per-trade and per-bar data are columnar and packed: a window's trades are a `TradeTable` (one array per
`TradeRecord` field), its equity curve one float64 array, each sent as base64 of its little-endian bytes. A 10^5-bar
window of an untrained agent closes ~3·10^4 trades: as one JSON object per trade they made a 70-MB report that took
seconds to build and to parse, and 10^6 bars would pass Redis's 512-MB value limit. Rows are still `TradeRecord`s
where one is read (`table[i]`, `table.records()`), and the REST API serves rows.

Imports pydantic, numpy and `shared.knobs` (no torch).
"""
from __future__ import annotations

import base64
import math
from typing import Annotated, Any, Iterable, Iterator, Literal, Mapping

import numpy as np
from pydantic import (BaseModel, ConfigDict, Field, GetCoreSchemaHandler, GetJsonSchemaHandler, PlainSerializer,
                      PlainValidator, ValidationError, WithJsonSchema)
from pydantic_core import core_schema

from shared.costs import EXIT_REASONS
from shared.knobs import N_REGIMES

ExitReason = Literal[EXIT_REASONS]  # type: ignore[valid-type]
"""`TradeRecord.exit_reason`: one of `shared.costs.EXIT_REASONS`; a `TradeTable` stores the index into that tuple."""

TAUS: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)
"""Quantile levels of the predicted return distribution carried in the report."""


class _Model(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=False, use_attribute_docstrings=True)


def _finite_or_none(x: Any) -> float | None:
    """float(x) if finite, else None (for metrics that are undefined)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None



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
    exit_reason: ExitReason
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
