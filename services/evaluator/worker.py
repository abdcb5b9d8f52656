"""The evaluator process's consumer: checkpoint.published → EvalReport → eval.completed.

A member of the consumer group "evaluator" on `tl:{run}:stream:checkpoints` (N replicas share the work).
Handling one event, idempotent on (run, epoch):
  1. a report of that epoch is already stored → skip the evaluation (a redelivery after a crash, or a
     duplicate publish) and only make sure eval.completed went out (SET NX marker `done:eval:{epoch}`).
  2. else: the checkpoint bytes from Redis (sha256 checked against the event), the run's bars (the dataset
     the checkpoint names, cut to its split; window hashes checked against the event — series, features and
     hashes kept between events), the earlier reports' val Sharpes (DSR trials and their variance; each stored
     report read once per process), the knobs the epoch trained under (trainer's epoch record), then
     `services.evaluator.runner.evaluate_checkpoint` in a worker thread; store the report (first wins);
     publish eval.completed once (`Bus.publish_once`: the marker
     `done:eval:{epoch}` and the event are written by one Lua script, so a kill between them is impossible).
The consumer acks only after the handler returned (shared/bus.py). Every evaluation is counted in
`tl:{run}:evaluations` (hash epoch → count) and `tl:{run}:evaluated_by` (epoch → consumer), written with the report
in one atomic step (`RunStore.put_json`), so "each checkpoint evaluated exactly once" can be checked from outside,
also across a Redis killed right after the report was stored.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from functools import lru_cache

from pydantic import Field

from shared.api import ConsumerWorker, ServiceState, report_id, trainer_history_key
from shared.bus import Bus, Consumer
from shared.config import EvaluatorSettings
from shared.events import CheckpointPublished, EvalCompleted, Event
from shared.knobs import Knobs
from shared.redis_server import RedisOutageLog, watch_consumer
from shared.report import EvalReport
from shared.store import run_key

log = logging.getLogger("tradeloop.evaluator")
GROUP = "evaluator"


class EvaluatorServiceSettings(EvaluatorSettings):
    """Evaluator settings plus the seed of the synthetic dataset (must match the trainer's)."""

    data_seed: int = Field(default=0, ge=0, description="seed of the synthetic dataset (shared by all services)")


@lru_cache(maxsize=2)
def _load(dataset: str, data_seed: int, signature: tuple[int, int] | None):
    """The whole series (`signature`: the file's `_file_signature`, part of the cache key: an edited file is
    read again)."""
    from shared.market import load_dataset

    return load_dataset(dataset, seed=data_seed)


def _bars(dataset: str, data_seed: int, n_bars: int):
    bars = _load(dataset, data_seed, _file_signature(dataset))
    if n_bars > len(bars):
        raise ValueError(f"checkpoint's split needs {n_bars} bars but dataset {dataset!r} has {len(bars)}")
    return bars.slice(0, n_bars) if n_bars < len(bars) else bars


def _file_signature(dataset: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of a dataset given as a file path; None for a bundled or generated dataset."""
    try:
        st = os.stat(dataset)
    except (OSError, ValueError):
        return None
    return st.st_size, st.st_mtime_ns


def _features(bars):
    """The features of the loaded series, and its volatility and regime labels (memoised on `bars`: the regime
    labels' rolling quantiles alone take seconds on 10^6 bars, which the first evaluation would otherwise pay)."""
    from shared.market import compute_features, regime_labels, volatility

    volatility(bars)
    regime_labels(bars)
    return compute_features(bars)


class EvaluatorWorker(ConsumerWorker):
    """Consumes checkpoints, evaluates them, stores reports, publishes eval.completed."""

    def __init__(self, settings: EvaluatorServiceSettings, bus: Bus, state: ServiceState):
        import services.evaluator.runner  # noqa: F401 — torch loads here, not in a thread beside live requests

        settings.check_data()
        self.settings, self.bus, self.state = settings, bus, state
        self.data_seed = settings.data_seed
        self.group = GROUP
        self.consumer = Consumer(bus, bus.stream("checkpoints"), GROUP, settings.consumer_name, self.handle,
                                 claim_idle_ms=settings.claim_idle_ms,
                                 block_ms=int(min(1000, bus.socket_timeout_s * 500)))
        # the loaded series, its features and its window hashes, kept between events (one dataset at a time)
        self._data: dict[tuple, dict] = {}
        self._val_sharpes: dict[int, tuple[float, int] | None] = {}   # epoch → (val per-trade Sharpe, trades)
        self._warm: asyncio.Task | None = None
        self._outage: asyncio.Task | None = None      # logs a Redis outage the consumer retries through, once
        # evaluating: the epoch whose checkpoint this replica is evaluating (taken from the stream, not acked yet)
        state.extra.update(consumer=settings.consumer_name, evaluated=[], evaluating=None, last_eval_s=None)

    async def run(self) -> None:
        """Consume (`ConsumerWorker.run`), warming up (`warm_up`) and logging a Redis outage (`watch_consumer`)
        beside it."""
        if self._warm is None:                         # once per process (run() is retried while Redis is down)
            self._warm = asyncio.create_task(self.warm_up())
            self._outage = asyncio.create_task(watch_consumer(self.consumer, self.state, RedisOutageLog(log)))
        await super().run()

    async def warm_up(self) -> None:
        """Before the first checkpoint arrives: load the configured dataset and its features into the cache,
        start the device and build the native pass by evaluating a random agent on a few bars, so the first
        evaluation costs what the later ones do (on the H200, 10^5 validation bars: 11.3 s for the first, 0.7 s
        for the next). Failures only log: the evaluation itself reports them."""
        t0 = time.perf_counter()
        try:
            dataset = self.settings.data
            series = await self._series(dataset, None)
            await asyncio.to_thread(_warm_passes, series["bars"], series["feats"], self.settings.device)
            self.state.extra["warm_up_s"] = round(time.perf_counter() - t0, 3)
            log.info("warmed up in %.1fs (dataset %s, %d bars)", time.perf_counter() - t0, dataset,
                     len(series["bars"]))
        except Exception as exc:  # noqa: BLE001
            log.warning("warm-up failed (the evaluation will say why if it matters): %s: %s",
                        type(exc).__name__, exc)

    async def _series(self, dataset: str, n_bars: int | None) -> dict:
        """The cached {"bars", "feats", "hashes"} of the first `n_bars` bars of `dataset` (None: all of them),
        loaded when the key — dataset, seed, length, and a file's size and mtime — changes (one series at a time)."""
        if n_bars is None:
            n_bars = len(await asyncio.to_thread(_load, dataset, self.data_seed, _file_signature(dataset)))
        key = (dataset, self.data_seed, n_bars, _file_signature(dataset))
        if key not in self._data:
            bars = await asyncio.to_thread(_bars, dataset, self.data_seed, n_bars)
            self._data = {key: {"bars": bars, "feats": await asyncio.to_thread(_features, bars), "hashes": {}}}
        return self._data[key]

    async def handle(self, event: Event) -> None:
        """Handle one checkpoint.published (see the module docstring)."""
        if not isinstance(event, CheckpointPublished):
            raise ValueError(f"unexpected event {event.type} on the checkpoints stream")
        store, epoch = self.bus.store, event.epoch
        doc = None
        if not await store.has_report(epoch):
            self.state.extra["evaluating"] = epoch
            try:
                report = await self._evaluate(event)
                # the report and its tallies in one atomic write: a Redis killed right after it keeps both or neither
                if await store.put_report(epoch, report, tally=(run_key(self.bus.run_id, "evaluations"),),
                                          mark={run_key(self.bus.run_id, "evaluated_by"): self.consumer.name}):
                    self.state.extra["evaluated"] = [*self.state.extra["evaluated"], epoch][-100:]
                    self.state.count("reports_stored")
                    m = report.val.metrics
                    s = m.get("per_trade_sharpe")
                    self._val_sharpes[epoch] = None if s is None else (float(s), int(m.get("n_trades") or 0))
                    self._report_gauges(event, report)
                    # what the event carries, from the report in hand (not read back: tens of MB of JSON)
                    doc = {w: {"metrics": dict(getattr(report, w).metrics)} if getattr(report, w) is not None
                           else None for w in ("val", "oos")}
            finally:
                self.state.extra["evaluating"] = None
        if doc is None:                  # stored by another replica, or before a redelivery: read what it says
            raw = await store.get_raw("report", epoch)
            doc = await asyncio.to_thread(json.loads, raw)
            await store.mirror("report", epoch)   # its file, where a crash came between the two writes
        await self._publish(event, doc)  # once per epoch: marker and event are written atomically
        self.state.epoch = max(self.state.epoch, epoch)

    async def _evaluate(self, event: CheckpointPublished) -> EvalReport:
        from services.evaluator.runner import val_sharpe_of
        from shared.market import Split

        if self._warm is not None and not self._warm.done():   # the same data: wait for it rather than load twice
            await asyncio.shield(self._warm)

        data = await self.bus.store.get_checkpoint(event.epoch, event.sha256)
        meta = _metadata(data)
        split = Split.from_dict(meta["split"])
        dataset = meta.get("dataset") or self.settings.data
        # the loaded series is kept between events (a 5·10^5-bar CSV takes seconds to parse and check); a file
        # is reloaded when its size or mtime changes, and the split hashes below still check what was loaded
        cached = await self._series(dataset, split.test[1])
        bars, feats, hashes = cached["bars"], cached["feats"], cached["hashes"]
        for name, h in (event.split_hashes or {}).items():
            if name not in ("train", "val", "test"):
                continue
            win = (name, tuple(split.window(name)))
            if win not in hashes:
                hashes[win] = await asyncio.to_thread(split.window_hash, bars, name)
            if hashes[win] != h:
                raise ValueError(f"epoch {event.epoch}: the {name} window of dataset {dataset!r} does not match the "
                                 "checkpoint's split hash (different data on this host?)")
        # the earlier reports' val Sharpes (the DSR's trials): each stored report is read and parsed once per
        # process — a report is tens of MB of JSON, re-reading all of them made each evaluation grow with the run
        earlier = [e for e in await self.bus.store.json_epochs("report") if e < event.epoch]
        for e in earlier:
            if e not in self._val_sharpes:
                self._val_sharpes[e] = val_sharpe_of(await self.bus.store.get_raw("report", e))
        known = [self._val_sharpes[e] for e in earlier if self._val_sharpes[e] is not None]
        prior, prior_n = [s for s, _ in known], [n for _, n in known]
        rec = await self.bus.redis.hget(trainer_history_key(self.bus.run_id), str(event.epoch))
        knobs = Knobs.from_dict(json.loads(rec)["knobs"]) if rec and "knobs" in json.loads(rec) else None
        t0 = time.perf_counter()
        report = await asyncio.to_thread(_run_eval, data, event, bars, split, len(earlier) + 1, prior, prior_n,
                                         knobs, feats, self.settings.device, dataset)
        dt = time.perf_counter() - t0
        self.state.extra["last_eval_s"] = round(dt, 3)
        self.state.gauges["last_eval_seconds"] = dt
        self.state.count("evaluations")
        self.state.count("evaluation_seconds", dt)
        files = self.bus.store.files
        if files is not None:       # the windows' dates and buy-and-hold benchmark, once per run (shared/runfiles.py)
            costs = float(meta.get("costs_bps", 1.0))
            for name, window in (("val", split.val), ("oos", split.test)):
                if not await asyncio.to_thread(files.has_market, name, window):
                    await asyncio.to_thread(_write_market, files, name, bars, window, costs)
        log.info("epoch %d evaluated in %.1fs", event.epoch, dt)
        return report

    def _report_gauges(self, event: CheckpointPublished, report: EvalReport) -> None:
        """/metrics of the last stored report: its validation per-trade Sharpe (un-annualized) and DSR, and the
        seconds from the checkpoint's publication to its report stored (evaluation latency)."""
        for key in ("per_trade_sharpe", "dsr"):
            v = report.val.metrics.get(key)
            if v is not None:
                self.state.gauges[f"last_val_{key}"] = float(v)
        self.state.gauges["last_report_epoch"] = float(report.epoch)
        latency = time.time() - event.created_at.timestamp()
        self.state.gauges["last_eval_latency_seconds"] = latency
        self.state.count("eval_latency_seconds", latency)

    async def _publish(self, event: CheckpointPublished, doc: dict) -> None:
        val = (doc.get("val") or {}).get("metrics", {})
        oos = (doc.get("oos") or {}).get("metrics", {})
        await self.bus.publish_once("eval", EvalCompleted(
            run_id=self.bus.run_id, epoch=event.epoch, report_id=report_id(self.bus.run_id, event.epoch, event.sha256),
            checkpoint_id=event.checkpoint_id, report_key=self.bus.store.key("report", event.epoch),
            val_per_trade_sharpe=val.get("per_trade_sharpe"), oos_per_trade_sharpe=oos.get("per_trade_sharpe"),
            dsr=val.get("dsr"), n_trades=int(val.get("n_trades") or 0)))


def _metadata(data: bytes) -> dict:
    """The tradeloop metadata of a checkpoint (header only; the runner verifies and parses it fully)."""
    from shared.checkpoints import load_checkpoint

    _, meta = load_checkpoint(data)
    return meta


def _warm_passes(bars, feats, device: str) -> None:
    """One greedy pass of a random agent over the first few hundred bars (device start, kernels, native loop)."""
    from shared.agent import Agent, AgentConfig
    from services.evaluator.runner import window_passes

    n = min(len(bars), 512)
    if n < 2:
        return
    agent = Agent(AgentConfig(n_features=feats.shape[1])).to(device)
    window_passes(agent, bars.slice(0, n), [(0, n)], taus=(0.5,), features=feats[:n], device=device)


def _write_market(files, name: str, bars, window, cost_bps: float) -> None:
    """The market file of one window: each bar's timestamp and close, and the equity of buy-and-hold through the
    simulator with the checkpoint's costs (`shared.baselines`: `tradeloop evaluate --policy buy-and-hold`)."""
    import numpy as np

    from shared.execution import CostModel, Prices, run_positions
    from shared.baselines import baseline_targets

    s, e = (int(x) for x in window)
    sub = bars.slice(s, e)
    res = run_positions(Prices.from_bars(sub), baseline_targets("buy-and-hold", "", bars, s, e, 0),
                        CostModel(cost_bps))
    ts = np.asarray(sub.timestamps, dtype="datetime64[ns]").astype(np.int64)    # whatever unit the index has
    files.write_market(name, np.arange(s, e), ts, np.asarray(sub.close, dtype=np.float64), res.equity[0])


def _run_eval(data, event, bars, split, n_trials, prior, prior_n, knobs, feats, device, dataset) -> EvalReport:
    from services.evaluator.runner import evaluate_checkpoint

    return evaluate_checkpoint(data, expected_sha256=event.sha256, bars=bars, split=split, run_id=event.run_id,
                               epoch=event.epoch, n_trials=n_trials, prior_sharpes=prior, prior_trades=prior_n,
                               device=device, dataset=dataset, features=feats, knobs=knobs)
