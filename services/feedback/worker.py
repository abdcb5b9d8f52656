"""The feedback process's consumer: eval.completed → FeedbackBundle (E1–E9) → feedback.ready.

A member of the consumer group "feedback" on `tl:{run}:stream:reports`. Handling one event, idempotent on
(run, epoch): a bundle of that epoch already stored → only make sure feedback.ready went out (SET NX marker
`done:feedback:{epoch}`); else read the report from Redis, and the run's earlier reports as `HistoryEntry`s
(each earlier report is read, parsed and guarded once per process and kept as its entry: a report is tens of MB
of JSON, so re-reading all of them at every epoch made the feedback stage grow with the run's length),
`compute_bundle(report, history, settings)` (the leakage guard runs inside it), store the bundle (first
wins), publish feedback.ready for epoch + 1. With TL_ENABLED=false the bundle carries the fixed schedule
(the ablation); the signals named in TL_FEEDBACK_OFF (default all nine and "rollback": the knobs follow the fixed
schedule) keep their knobs at the fixed schedule's values.
"""
from __future__ import annotations

import asyncio
import logging
import time

from shared.api import ConsumerWorker, ServiceState, bundle_id, knob_gauges, report_id
from shared.bus import Bus, Consumer
from shared.config import FeedbackSettings
from shared.events import EvalCompleted, Event, FeedbackReady
from shared.redis_server import RedisOutageLog, watch_consumer
from shared.report import EvalReport

log = logging.getLogger("tradeloop.feedback")
GROUP = "feedback"


class FeedbackWorker(ConsumerWorker):
    """Consumes reports, computes bundles, stores them, publishes feedback.ready."""

    def __init__(self, settings: FeedbackSettings, bus: Bus, state: ServiceState, *, consumer_name: str | None = None):
        import os
        import socket

        import services.feedback.signals  # noqa: F401 — loaded up front, not beside live requests

        self.settings, self.bus, self.state = settings, bus, state
        name = consumer_name or f"feedback-{socket.gethostname()}-{os.getpid()}"
        self.group = GROUP
        self.consumer = Consumer(bus, bus.stream("reports"), GROUP, name, self.handle,
                                 block_ms=int(min(1000, bus.socket_timeout_s * 500)))
        state.extra.update(consumer=name, enabled=settings.enabled, off=list(settings.off), bundled=[])
        self._history: dict[int, object] = {}     # epoch → guard.HistoryEntry of this run's earlier reports
        self._outage: asyncio.Task | None = None  # logs a Redis outage the consumer retries through, once

    async def run(self) -> None:
        """Consume (`ConsumerWorker.run`), a Redis outage logged beside it (`watch_consumer`)."""
        if self._outage is None:                   # once per process (run() is retried while Redis is down)
            self._outage = asyncio.create_task(watch_consumer(self.consumer, self.state, RedisOutageLog(log)))
        await super().run()

    async def handle(self, event: Event) -> None:
        """Handle one eval.completed (see the module docstring)."""
        if not isinstance(event, EvalCompleted):
            raise ValueError(f"unexpected event {event.type} on the reports stream")
        store, epoch = self.bus.store, event.epoch
        if not await store.has_bundle(epoch):
            raw = await store.get_raw("report", epoch)
            if raw is None:
                raise LookupError(f"eval.completed for epoch {epoch} but no report at {event.report_key}")
            report = await asyncio.to_thread(EvalReport.model_validate_json, raw)   # tens of MB: off the loop
            from services.feedback.guard import history_entry
            from services.feedback.signals import compute_bundle

            history = []
            for e in await store.json_epochs("report"):
                if e < epoch:
                    if e not in self._history:
                        h = await store.get_raw("report", e)
                        if h is None:
                            continue
                        self._history[e] = history_entry(
                            await asyncio.to_thread(EvalReport.model_validate_json, h))
                    history.append(self._history[e])

            t0 = time.perf_counter()
            bundle = await asyncio.to_thread(compute_bundle, report, history, self.settings)
            self._history.setdefault(epoch, history_entry(report))       # guarded above, for the next epochs
            if await store.put_bundle(epoch, bundle):
                self.state.count("bundles_stored")
                self.state.extra["bundled"] = [*self.state.extra["bundled"], epoch][-100:]
                # feedback latency: the report's eval.completed → its bundle stored; and the computation alone
                latency = time.time() - event.created_at.timestamp()
                self.state.gauges["last_feedback_latency_seconds"] = latency
                self.state.gauges["last_bundle_seconds"] = time.perf_counter() - t0
                self.state.count("feedback_latency_seconds", latency)
                self.state.count("rollbacks", int(bundle.rollback))
        else:
            await store.mirror("bundle", epoch)    # its file, where a crash came between the two writes
        doc = await store.get_bundle(epoch)
        sha = doc.get("report_checkpoint_sha256", "")
        await self.bus.publish_once("feedback", FeedbackReady(  # marker + event atomically: exactly once
            run_id=self.bus.run_id, epoch=epoch, for_epoch=epoch + 1,
            bundle_id=bundle_id(self.bus.run_id, epoch, sha), report_id=report_id(self.bus.run_id, epoch, sha),
            bundle_key=store.key("bundle", epoch)))
        self.state.epoch = max(self.state.epoch, epoch)
        self.state.extra["latest_knobs"] = {k: doc["knobs"].get(k) for k in ("epsilon", "gamma", "q_bias",
                                                                              "gate_threshold")}
        self.state.set_labeled("knob", "knob", knob_gauges(doc["knobs"]))     # what the next epoch trains under
