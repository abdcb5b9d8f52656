"""The response models of the services' REST APIs (pydantic v2): what each route declares, so its OpenAPI document
carries the schemas and a client (the dashboard) reads typed fields.

- The stored documents are `shared.report`'s own models: `/reports/{epoch}` is an `EvalReport`, `/signals/{epoch}` a
  `FeedbackBundle`, a trade row a `TradeRecord` (with its dates when the run's market file gives them).
- The views (`shared.runview`) are closed: a field a view adds must be declared here (`extra="forbid"`), so the
  contract tests see it. The documents the workers write (`/status` extras, the trainer's epoch records) are open:
  their declared fields are typed, fields a worker adds pass through.
- Errors: `Problem` (`{"detail": "..."}`, what `HTTPException` sends) and `Invalid` (422: FastAPI's list of field
  errors, or a message for a stored file that does not parse). `ERRORS` gives each route's `responses=` entries.
- Sharpe ratios are un-annualized, per trade; returns are simple fractions.

Web layer only: the ML core never imports this module.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from shared.report import TradeRecord

PROMETHEUS_TEXT = "text/plain; version=0.0.4"
"""The Prometheus text exposition format /metrics serves (`prometheus_client.generate_latest`)."""


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)   # a field's docstring in OpenAPI


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)


# --- errors -------------------------------------------------------------------------------------------------------


class Problem(_Closed):
    """An error: what went wrong and where, in words."""

    detail: str


class FieldIssue(_Open):
    """One invalid parameter (FastAPI's validation error): where (`loc`), what (`msg`), its kind (`type`)."""

    loc: list[str | int]
    msg: str
    type: str


class Invalid(_Closed):
    """422: the invalid parameters, or a message naming the stored file that does not parse."""

    detail: list[FieldIssue] | str


def _err(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"model": model, "description": description}


ERRORS: dict[int, dict[str, Any]] = {
    401: _err(Problem, "no bearer token (`Authorization: Bearer <TL_API_TOKEN>`)"),
    403: _err(Problem, "the bearer token is not the service's"),
    404: _err(Problem, "no such document (epoch, split, run or file), named in `detail`"),
    413: _err(Problem, "request body over the service's limit (TL_MAX_BODY_BYTES)"),
    422: _err(Invalid, "invalid path or query parameters (each named), or a stored file that does not parse"),
    502: _err(Problem, "the service behind the dashboard does not answer (named with its URL)"),
    503: _err(Problem, "Redis unreachable"),
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for the given status codes (from `ERRORS`)."""
    return {c: ERRORS[c] for c in codes}


class PrometheusResponse(Response):
    """Prometheus text (`PROMETHEUS_TEXT`; Starlette adds `charset=utf-8`)."""

    media_type = PROMETHEUS_TEXT


METRICS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Prometheus text exposition format 0.0.4",
          "content": {PROMETHEUS_TEXT: {"schema": {"type": "string"}}}}}


# --- every service ------------------------------------------------------------------------------------------------


class Health(_Closed):
    """Liveness: the process serves HTTP."""

    status: Literal["ok"]
    service: str


class Ready(_Closed):
    """Readiness (200 when ready, else 503 with the same body)."""

    ready: bool
    service: str


class ServiceStatus(_Open):
    """/status of a service; each service adds its own fields (below)."""

    service: str
    pid: int
    uptime_s: float
    run_id: str
    ready: bool
    epoch: int
    """Last epoch this service finished (trainer: trained; evaluator: evaluated; feedback: bundled)."""
    stream_lag: int | None
    """Entries of the input stream not yet handled (None: not measured yet)."""
    last_error: str | None
    last_error_at: float | None
    """Unix time of `last_error`."""
    counters: dict[str, float]


class BundleApplied(_Open):
    """Which feedback bundle an epoch trains under (the trainer's epoch record and its /status)."""

    bundle_epoch: int | None = None
    """The epoch whose report the bundle came from (None: the fixed schedule)."""
    bundle_id: str | None = None
    feedback_timed_out: bool | None = None
    """True when the bundle did not come in time and the epoch trains on the last one received."""
    feedback_wait_s: float | None = None
    knobs_source: str | None = None
    """Where the epoch's knobs came from, in words."""


class TrainerFeedback(BundleApplied):
    """The feedback of the epoch in hand: the bundle awaited, or the record of the one it trains under."""

    waiting_for_bundle: int | None = None
    epoch: int | None = None


class TrainerStatus(ServiceStatus):
    """The trainer's /status."""

    phase: str
    """starting, loading, waiting_feedback, training, compiling, saving, publishing, finished, failed, ..."""
    epochs: int | None = None
    """Epochs the run trains."""
    training_epoch: int | None = None
    """The epoch in training (None between epochs)."""
    iteration: int | None = None
    """Iterations of `training_epoch` done, of `iterations`."""
    iterations: int | None = None
    paused: bool = False
    stopping: bool = False
    """A stop was asked (`POST /control/stop`): the run ends once the epoch in hand is trained and published."""
    updates_per_s: float | None = None
    env_steps_per_s: float | None = None
    """Account-steps per second of the epoch in hand."""
    feedback: TrainerFeedback | None = None
    device: str | None = None


class ConsumerStatus(ServiceStatus):
    """/status of a stream consumer (evaluator, feedback)."""

    consumer: str
    consumer_stats: dict[str, Any] | None = None


class EvaluatorStatus(ConsumerStatus):
    """The evaluator's /status."""

    evaluated: list[int] = Field(default_factory=list)
    """The last epochs evaluated (at most 100)."""
    evaluating: int | None = None
    last_eval_s: float | None = None


class FeedbackStatus(ConsumerStatus):
    """The feedback service's /status."""

    enabled: bool
    off: list[str]
    bundled: list[int] = Field(default_factory=list)
    """The last epochs bundled (at most 100)."""
    latest_knobs: dict[str, Any] | None = None


# --- trainer ------------------------------------------------------------------------------------------------------


class EpochRecord(BundleApplied):
    """One epoch record of the trainer (`history.jsonl`, Redis `tl:{run}:trainer:history`): the epoch's training stats
    (None where undefined), the checkpoint, and the bundle it trained under."""

    epoch: int
    loss: float | None = None
    c51: float | None = None
    iqn: float | None = None
    epsilon: float | None = None
    gamma: float | None = None
    env_steps: int | None = None
    updates: int | None = None
    env_steps_per_s: float | None = None
    updates_per_s: float | None = None
    seconds: float | None = None
    train_per_trade_sharpe: float | None = None
    """Of the trades closed while collecting the epoch (with exploration); un-annualized, per trade."""
    knobs: dict[str, Any] | None = None
    checkpoint_id: str | None = None
    sha256: str | None = None
    """The checkpoint's sha256 (hex)."""
    rolled_back_to: int | None = None
    """The epoch whose learner a feedback rollback restored before this epoch trained."""


class Paused(_Closed):
    """The trainer's pause state after /control/pause or /control/resume."""

    ok: bool
    paused: bool


class Stopping(_Closed):
    """/control/stop: the trainer stops after the epoch in hand."""

    ok: bool
    stopping: bool


# --- evaluator ----------------------------------------------------------------------------------------------------

Metrics = dict[str, float | None]
"""`shared.metrics.compute_metrics` keys (un-annualized); None where undefined."""


class SummaryMetrics(_Closed):
    """Every metric of a report's validation and OOS backtests (empty without that backtest)."""

    val: Metrics
    oos: Metrics


class ReportRow(_Closed):
    """One /reports row: a report's headline numbers (Sharpes un-annualized, per trade)."""

    epoch: int
    checkpoint_sha256: str | None
    n_trials: int | None
    val_per_trade_sharpe: float | None
    oos_per_trade_sharpe: float | None
    val_dsr: float | None
    val_psr: float | None
    val_n_trades: int | None
    oos_n_trades: int | None
    val_total_return: float | None
    oos_total_return: float | None
    val_oos_gap: float | None
    created_at: str | None
    metrics: SummaryMetrics
    selected_by_validation: bool
    """The checkpoint validation selects: the highest validation per-trade Sharpe (the earliest on a tie)."""


Window = tuple[int, int]
"""Half-open bar range `[start, end)` of the run's dataset."""


class TradeRow(TradeRecord):
    """A `TradeRecord` with its entry and exit dates (ISO 8601, UTC) when the run's market file gives them."""

    entry_time: str | None = None
    exit_time: str | None = None


class TradesPage(_Closed):
    """Trades `[offset, offset + len(trades))` of one backtest, one object per trade."""

    epoch: int | None
    split: Literal["val", "oos", "insample"]
    window: Window | None
    n_trades: int
    offset: int
    trades: list[TradeRow]
    listed: bool = True
    """False where the backtest keeps no trade list (a study run's epoch record): `n_trades` is then its metrics'
    count and `trades` is empty."""


class EquityView(_Closed):
    """One backtest's curves at the same (decimated) bars; with `packed` each array is base64 of float64."""

    epoch: int | None
    split: Literal["val", "oos", "insample"]
    window: Window | None
    n_bars: int
    n_points: int
    packed: bool
    x: list[int] | str
    """Bar offsets into the window."""
    equity: list[float] | str
    drawdown: list[float] | str
    """Equity / running peak − 1 (≤ 0)."""
    t: list[float] | str | None
    """Unix seconds of the bars (None: the window's dates are unknown)."""
    benchmark: list[float] | str | None
    """Buy-and-hold equity over the same bars (None: unknown)."""
    benchmark_drawdown: list[float] | str | None


class Benchmark(_Closed):
    """Buy-and-hold over the backtest's bars."""

    name: str
    total_return: float
    max_drawdown: float
    """A positive fraction."""


class MonthRow(_Closed):
    """One calendar month (UTC): the strategy's and buy-and-hold's returns."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    month: str
    """YYYY-MM"""
    return_: float = Field(alias="return")
    benchmark: float


class Tearsheet(_Closed):
    """The headline of one backtest of a checkpoint."""

    epoch: int | None
    split: Literal["val", "oos", "insample"]
    window: Window | None
    n_bars: int
    metrics: Metrics
    val_oos_gap: float | None
    """1 − OOS per-trade Sharpe / val per-trade Sharpe."""
    n_trials: int | None
    checkpoint_sha256: str | None
    dataset: str | None
    knobs: dict[str, Any] | None
    """The knobs the checkpoint trained under (None: defaults)."""
    created_at: str | None
    start: str | None
    end: str | None
    benchmark: Benchmark | None
    monthly: list[MonthRow]


# --- feedback -----------------------------------------------------------------------------------------------------


class SignalRow(_Closed):
    """A signal of a /signals row: its value for the next epoch."""

    knob: str | None
    value: Any
    reason: str | None
    clamped: bool | None


class SignalCount(_Closed):
    """E6 / E7 in a /signals row: how many bars or labels the signal lists."""

    knob: str | None
    count: int
    reason: str | None


class BundleRow(_Closed):
    """One /signals row: the bundle computed from epoch `epoch`'s report, for epoch `for_epoch`."""

    epoch: int
    for_epoch: int
    """The epoch that trains under it (epoch + 1)."""
    bundle_id: str
    enabled: bool | None
    off: list[str]
    rollback: bool | None
    rollback_to_epoch: int | None
    reason: str | None
    signals: dict[str, SignalRow | SignalCount]
    knobs: dict[str, Any]
    """The knobs of the result, without the sample-level lists (E6, E7)."""
    created_at: str | None


# --- dashboard ----------------------------------------------------------------------------------------------------


class DashboardReady(_Closed):
    """Ready when every page file exists (503 naming the missing ones otherwise)."""

    status: Literal["ready", "not ready"]
    service: Literal["dashboard"] = "dashboard"
    missing: list[str] = Field(default_factory=list)


class PageConfig(_Closed):
    """Where the page finds the services (paths relative to the page), its poll interval and the live run."""

    trainer: str
    evaluator: str
    feedback: str
    poll_ms: int
    run_id: str


class SelectedRow(_Closed):
    """The headline numbers of a run's selected checkpoint (Sharpes un-annualized, per trade)."""

    val_per_trade_sharpe: float | None
    val_dsr: float | None
    oos_per_trade_sharpe: float | None
    val_n_trades: int | None
    oos_n_trades: int | None
    val_total_return: float | None
    val_oos_gap: float | None


class RunRow(_Closed):
    """A run of the catalog."""

    id: str
    """The run directory relative to the served directory."""
    path: str | None
    live: bool
    dataset: str | None = None
    seed: int | None = None
    n_epochs: int
    n_reports: int
    n_bundles: int
    epochs_requested: int | None = None
    selected_epoch: int | None
    selected: SelectedRow | None
    modified: float
    """Unix time of the run's last change."""
    unreadable: list[str] = []
    """The run's files that could not be read (each named with its problem), left out of the counts above."""


class RunList(_Closed):
    """The runs on disk, and the live one."""

    live: str | None
    root: str
    runs: list[RunRow]


class RunOnDiskStatus(_Closed):
    """A run's trainer status read from disk: "finished", or "unfinished" (a `tradeloop up` run with no summary
    yet: its launcher is live, or was killed)."""

    service: Literal["trainer"]
    run_id: str
    phase: Literal["finished", "unfinished"]
    epoch: int
    epochs: int
    on_disk: bool
