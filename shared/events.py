"""Versioned events that cross services on Redis Streams.

Conventions:
- One `Event` base (event id, schema version, type, run id, epoch, UTC creation time) and one subclass
  per event; `type` is the discriminator. Models are frozen and forbid unknown fields, so both ends
  validate the same schema.
- A stream entry holds exactly one field, `data`: the event as JSON (`encode_event`). `decode_event`
  turns an entry back into an event or raises `EventError` with a reason a dead letter can carry:
  missing field, oversized, not JSON, truncated, unknown schema version, unknown type, schema error.
- Streams are per run: `tl:{run}:stream:{checkpoints|reports|feedback|dead}` (`stream_name`). Each
  event type has one home stream (`stream_for`).
- Floats that may be undefined (a Sharpe with < 2 trades) are `None`, never NaN, on the wire.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from datetime import datetime, timezone
from typing import Annotated, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo,
                      field_validator, model_validator)

SCHEMA_VERSION = 1
MAX_EVENT_BYTES = 64 * 1024  # an event is a pointer to a stored blob, never the blob itself
DEAD_FIELD_MAX_CHARS = 2048  # raw fields copied into a dead letter are cut to this length

STREAM_KINDS = ("checkpoints", "reports", "feedback", "dead")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256_RE = r"^[0-9a-f]{64}$"


def validate_run_id(run_id: str) -> str:
    """Return `run_id` if it is safe inside Redis keys (1–64 of [A-Za-z0-9_.-], no leading punctuation)."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '_', '.', '-' "
                         "starting with a letter or digit")
    return run_id


def stream_name(run_id: str, kind: str) -> str:
    """`tl:{run}:stream:{kind}` for kind in checkpoints|reports|feedback|dead."""
    if kind not in STREAM_KINDS:
        raise ValueError(f"unknown stream kind {kind!r}; expected one of {STREAM_KINDS}")
    return f"tl:{validate_run_id(run_id)}:stream:{kind}"


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


class Event(BaseModel):
    """Fields every event carries. `epoch` is the training epoch the event is about."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: str = Field(default_factory=lambda: uuid.uuid4().hex, description="uuid4 hex, unique per event")
    schema_version: Literal[1] = Field(default=1, description="bumped on any incompatible change")
    type: str
    run_id: str = Field(description="run namespace of every Redis key of this run")
    epoch: int = Field(ge=0, description="training epoch this event is about")
    created_at: datetime = Field(default_factory=_utc_now, description="UTC time the event was created")

    @model_validator(mode="before")
    @classmethod
    def _version_on_the_wire(cls, data, info: ValidationInfo):
        # In code the version defaults to the current one; a message off the wire must state it.
        if info.context and info.context.get("wire") and isinstance(data, dict) and "schema_version" not in data:
            raise ValueError("missing schema_version")
        return data

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, v: str) -> str:
        return validate_run_id(v)

    @field_validator("created_at")
    @classmethod
    def _check_utc(cls, v: datetime) -> datetime:
        if v.tzinfo is None:
            raise ValueError("created_at must be timezone-aware (UTC)")
        return v.astimezone(timezone.utc)


class CheckpointPublished(Event):
    """The trainer finished epoch `epoch` and stored its checkpoint bytes in Redis at `key`."""

    type: Literal["checkpoint.published"] = "checkpoint.published"
    checkpoint_id: str = Field(min_length=1, max_length=200)
    sha256: str = Field(pattern=_SHA256_RE, description="sha256 hex of the safetensors bytes")
    key: str = Field(min_length=1, max_length=300, description="Redis key of the bytes: tl:{run}:ckpt:{epoch}")
    size_bytes: int = Field(gt=0)
    config_hash: str = Field(min_length=1, max_length=128, description="hash of the training config")
    split_hashes: dict[str, str] = Field(default_factory=dict,
                                         description="window name (train/val/test) → sha256 of its bars")
    path: str | None = Field(default=None, description="optional path on a shared volume (same sha256 check)")


def _finite_or_none(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else float(v)


class EvalCompleted(Event):
    """The evaluator stored the report of checkpoint `checkpoint_id` at `report_key`."""

    type: Literal["eval.completed"] = "eval.completed"
    report_id: str = Field(min_length=1, max_length=200)
    checkpoint_id: str = Field(min_length=1, max_length=200)
    report_key: str = Field(min_length=1, max_length=300)
    val_per_trade_sharpe: float | None = Field(default=None, description="un-annualized, per trade (validation)")
    oos_per_trade_sharpe: float | None = Field(default=None, description="un-annualized, per trade (OOS test)")
    dsr: float | None = Field(default=None, description="Deflated Sharpe Ratio of the validation backtest")
    n_trades: int = Field(default=0, ge=0, description="closed trades in the validation backtest")

    @field_validator("val_per_trade_sharpe", "oos_per_trade_sharpe", "dsr")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return _finite_or_none(v)


class FeedbackReady(Event):
    """The feedback service stored the bundle computed from epoch `epoch`'s report, for epoch `for_epoch`."""

    type: Literal["feedback.ready"] = "feedback.ready"
    bundle_id: str = Field(min_length=1, max_length=200)
    report_id: str = Field(min_length=1, max_length=200)
    bundle_key: str = Field(min_length=1, max_length=300)
    for_epoch: int = Field(ge=1, description="the epoch that trains under this bundle: epoch + 1")

    @model_validator(mode="after")
    def _next_epoch(self) -> "FeedbackReady":
        if self.for_epoch != self.epoch + 1:
            raise ValueError(f"for_epoch must be epoch + 1 = {self.epoch + 1}, got {self.for_epoch}")
        return self


class DeadLetter(Event):
    """An entry a consumer gave up on, with the reason; `epoch` is -1 when the entry did not say."""

    type: Literal["dead_letter"] = "dead_letter"
    epoch: int = Field(default=-1, ge=-1)
    original_stream: str
    entry_id: str
    group: str = ""
    consumer: str = ""
    fields: dict[str, str] = Field(default_factory=dict, description="raw entry fields, each cut to 2 KiB")
    reason: str
    deliveries: int = Field(ge=0)


AnyEvent = Annotated[Union[CheckpointPublished, EvalCompleted, FeedbackReady, DeadLetter],
                     Field(discriminator="type")]
_ADAPTER: TypeAdapter = TypeAdapter(AnyEvent)
_WIRE = {"wire": True}
EVENT_TYPES = {"checkpoint.published": CheckpointPublished, "eval.completed": EvalCompleted,
               "feedback.ready": FeedbackReady, "dead_letter": DeadLetter}
_HOME_STREAM = {CheckpointPublished: "checkpoints", EvalCompleted: "reports",
                FeedbackReady: "feedback", DeadLetter: "dead"}


def stream_for(event: Event) -> str:
    """The stream an event is published on: `tl:{run}:stream:{kind}`."""
    return stream_name(event.run_id, _HOME_STREAM[type(event)])


class EventError(ValueError):
    """An entry that is not a valid event of this schema version; `.reason` is dead-letter ready."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def encode_event(event: Event) -> dict[str, str]:
    """The stream entry fields of an event: {"data": <JSON>}."""
    return {"data": event.model_dump_json()}


def _text(v: bytes | str) -> str:
    return v.decode("utf-8", errors="replace") if isinstance(v, (bytes, bytearray)) else str(v)


def raw_fields(fields: dict) -> dict[str, str]:
    """Entry fields as text, each value cut to DEAD_FIELD_MAX_CHARS (for a dead letter)."""
    out = {}
    for k, v in (fields or {}).items():
        s = _text(v)
        out[_text(k)[:200]] = s if len(s) <= DEAD_FIELD_MAX_CHARS else s[:DEAD_FIELD_MAX_CHARS] + f"…[{len(s)} chars]"
    return out


def decode_event(fields: dict, *, max_bytes: int = MAX_EVENT_BYTES) -> Event:
    """Parse a stream entry's fields into an event; raise EventError(reason) for anything else."""
    if not fields:
        raise EventError("empty entry (no fields)")
    data = fields.get(b"data", fields.get("data"))
    if data is None:
        names = sorted(_text(k) for k in fields)
        raise EventError(f"missing field 'data' (fields: {names})")
    size = len(data) if isinstance(data, (bytes, bytearray)) else len(str(data).encode())
    if size > max_bytes:
        raise EventError(f"oversized: {size} bytes > {max_bytes}-byte limit")
    try:  # fast path: pydantic-core parses and validates in one go
        return _ADAPTER.validate_json(data, context=_WIRE)
    except ValidationError:
        pass  # diagnose below, for a reason a person can act on
    try:
        obj = json.loads(data)
    except UnicodeDecodeError:
        raise EventError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        text = _text(data).rstrip()
        # A prefix of valid JSON fails at its very end, or inside a string that never closes.
        at_end = exc.pos >= len(text) or exc.msg.startswith("Unterminated string")
        if at_end and text.lstrip().startswith(("{", "[")):
            raise EventError(f"truncated JSON ({size} bytes; ended at char {exc.pos})") from None
        raise EventError(f"not JSON: {exc.msg} at char {exc.pos}") from None
    if not isinstance(obj, dict):
        raise EventError(f"not a JSON object (got {type(obj).__name__})")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise EventError(f"unknown schema_version {version!r} (this build reads {SCHEMA_VERSION})")
    etype = obj.get("type")
    if etype not in EVENT_TYPES:
        raise EventError(f"unknown event type {etype!r} (known: {sorted(EVENT_TYPES)})")
    try:
        return _ADAPTER.validate_python(obj, context=_WIRE)  # fails again here, with field-level errors
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or '(event)'}: {e['msg']}"
                             for e in exc.errors())
        raise EventError(f"schema error in {etype}: {problems}") from None
