"""Bus tests on a real Redis: delivery, retries, dead letters, claims, poison, NOGROUP, a killed server."""
from __future__ import annotations

import asyncio
import json

import pytest

from shared.bus import Bus, Consumer
from shared.events import (CheckpointPublished, EvalCompleted, FeedbackReady, decode_event, encode_event)
from shared.redis_server import EmbeddedRedis
from tests.polling import apoll_until

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


def ckpt(run_id: str, epoch: int) -> CheckpointPublished:
    return CheckpointPublished(run_id=run_id, epoch=epoch, checkpoint_id=f"c{epoch}", sha256="ab" * 32,
                               key=f"tl:{run_id}:ckpt:{epoch}", size_bytes=100, config_hash="cfg")


async def until(cond, timeout_s: float = 10.0, what: str = "condition"):
    """Poll `cond()` (sync or async) until true; fail after the deadline."""
    await apoll_until(cond, what, timeout_s=timeout_s, interval_s=0.01)


async def pending_count(bus: Bus, stream: str, group: str) -> int:
    return int((await bus.redis.xpending(stream, group))["pending"])


async def test_round_trip_every_event_type(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        assert (await bus.connect()) >= "6.2"
        events = [ckpt(run_id, 0),
                  EvalCompleted(run_id=run_id, epoch=0, report_id="r0", checkpoint_id="c0",
                                report_key=f"tl:{run_id}:report:0", val_per_trade_sharpe=0.25, n_trades=7),
                  FeedbackReady(run_id=run_id, epoch=0, bundle_id="b0", report_id="r0",
                                bundle_key=f"tl:{run_id}:bundle:0", for_epoch=1)]
        for e in events:
            await bus.publish(e)
        got: dict[str, list] = {}
        for kind in ("checkpoints", "reports", "feedback"):
            got[kind] = []
            c = Consumer(bus, bus.stream(kind), "g", "c1", lambda ev, k=kind: _append(got[k], ev))
            assert await c.run_burst() == 1
            assert await pending_count(bus, bus.stream(kind), "g") == 0
            assert await c.lag() == 0
        assert [got["checkpoints"][0], got["reports"][0], got["feedback"][0]] == events


async def _append(lst, ev):
    lst.append(ev)


async def test_publish_refuses_other_run_and_oversized(redis_url, run_id):
    async with Bus(redis_url, run_id, max_event_bytes=400) as bus:
        with pytest.raises(ValueError, match="run"):
            await bus.publish(ckpt("otherrun", 0))
        big = CheckpointPublished(run_id=run_id, epoch=0, checkpoint_id="x" * 200, sha256="ab" * 32,
                                  key="k", size_bytes=1, config_hash="h")
        with pytest.raises(ValueError, match="bytes >"):
            await bus.publish(big)


async def test_failing_handler_is_retried_then_dead_lettered_with_reason(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        calls: dict[int, int] = {}

        async def handler(ev):
            calls[ev.epoch] = calls.get(ev.epoch, 0) + 1
            if ev.epoch == 1:
                raise RuntimeError(f"cannot evaluate epoch {ev.epoch}")

        stream = bus.stream("checkpoints")
        c = Consumer(bus, stream, "eval", "c1", handler, max_deliveries=3, retry_delay_ms=10, block_ms=50)
        for ep in range(3):
            await bus.publish(ckpt(run_id, ep))
        task = asyncio.create_task(c.run())
        try:
            await until(lambda: c.stats.dead == 1 and c.stats.processed == 2, what="2 processed + 1 dead")
        finally:
            c.stop()
            await asyncio.wait_for(task, 5)
        assert calls == {0: 1, 1: 3, 2: 1}  # epoch 1: delivered max_deliveries=3 times, never more
        [dl] = await bus.dead_letters()
        assert dl.original_stream == stream and dl.deliveries == 3 and dl.epoch == 1
        assert "RuntimeError: cannot evaluate epoch 1" in dl.reason
        assert decode_event({"data": dl.fields["data"]}).epoch == 1
        assert await pending_count(bus, stream, "eval") == 0


async def test_handler_that_fails_once_then_succeeds_is_not_dead_lettered(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        calls = []

        async def flaky(ev):
            calls.append(ev.epoch)
            if len(calls) == 1:
                raise ConnectionResetError("transient")

        c = Consumer(bus, bus.stream("checkpoints"), "g", "c1", flaky, max_deliveries=3)
        await bus.publish(ckpt(run_id, 4))
        await c.run_burst()
        assert calls == [4, 4] and c.stats.processed == 1 and c.stats.dead == 0
        assert await bus.dead_letters() == []


async def test_consumer_killed_before_ack_entry_is_claimed_and_processed_once(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        stream = bus.stream("checkpoints")
        started, completed = [], []

        async def dies(ev):  # consumer A takes the entry and never finishes (killed mid-handler)
            started.append(("A", ev.epoch))
            await asyncio.Event().wait()

        async def works(ev):
            started.append(("B", ev.epoch))
            completed.append(ev.event_id)

        a = Consumer(bus, stream, "eval", "A", dies, claim_idle_ms=300, block_ms=50)
        b = Consumer(bus, stream, "eval", "B", works, claim_idle_ms=300, block_ms=50)
        await bus.publish(ckpt(run_id, 7))
        task = asyncio.create_task(a.run())
        await until(lambda: started == [("A", 7)], what="A to take the entry")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await pending_count(bus, stream, "eval") == 1  # A died holding it
        assert await b.run_burst() == 0  # not idle long enough yet: B must not steal a live entry
        await until(b.run_burst, what="B to claim the idle entry")
        assert started == [("A", 7), ("B", 7)] and len(completed) == 1
        assert b.stats.claimed == 1 and b.stats.processed == 1
        assert await pending_count(bus, stream, "eval") == 0
        assert await b.run_burst() == 0 and len(completed) == 1  # nothing left to redo


async def test_poison_entries_are_dead_lettered_and_good_ones_still_processed(redis_url, run_id):
    async with Bus(redis_url, run_id, max_event_bytes=2048) as bus:
        stream = bus.stream("checkpoints")
        good = ckpt(run_id, 3)
        good_json = encode_event(good)["data"]
        v2 = json.loads(good_json) | {"schema_version": 2}
        bad_schema = json.loads(good_json) | {"size_bytes": -5}
        poison = {
            "not JSON": {"data": "hello there"},
            "unknown schema_version 2": {"data": json.dumps(v2)},
            "truncated JSON": {"data": good_json[: len(good_json) // 2]},
            "oversized": {"data": "{" + " " * 4096 + "}"},
            "missing field 'data'": {"payload": good_json},
            "size_bytes": {"data": json.dumps(bad_schema)},
            "does not match": {"data": encode_event(ckpt("someoneelse", 3))["data"]},
        }
        for fields in poison.values():
            await bus.redis.xadd(stream, fields)
        await bus.publish(good)
        seen = []

        async def handler(ev):
            seen.append(ev)

        c = Consumer(bus, stream, "g", "c1", handler)
        await c.run_burst()
        assert seen == [good]
        dead = await bus.dead_letters()
        assert len(dead) == len(poison) and c.stats.dead == len(poison)
        for (needle, _), dl in zip(poison.items(), dead):
            assert dl.reason.startswith("malformed:") and needle in dl.reason, (needle, dl.reason)
            assert dl.deliveries == 1  # no retries for a schema error
        assert max(len(v) for dl in dead for v in dl.fields.values()) < 2100  # raw fields truncated
        assert await pending_count(bus, stream, "g") == 0


async def test_nogroup_after_flush_is_recreated_and_consumption_continues(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        seen = []

        async def handler(ev):
            seen.append(ev.epoch)

        c = Consumer(bus, bus.stream("checkpoints"), "g", "c1", handler, block_ms=50)
        task = asyncio.create_task(c.run())
        try:
            await bus.publish(ckpt(run_id, 0))
            await until(lambda: seen == [0], what="first event")
            await bus.redis.flushdb()  # stream and group gone: the next read gets NOGROUP
            await until(lambda: c.stats.group_recreated >= 1, what="NOGROUP handled")
            await bus.publish(ckpt(run_id, 1))
            await until(lambda: seen == [0, 1], what="event after the flush")
        finally:
            c.stop()
            await asyncio.wait_for(task, 5)


async def test_claim_once_and_lag(redis_url, run_id):
    async with Bus(redis_url, run_id) as bus:
        assert await bus.claim_once("eval", 3) is True
        assert await bus.claim_once("eval", 3) is False
        assert await bus.claim_once("eval", 4) is True
        stream = bus.stream("reports")

        async def fail(ev):
            raise ValueError("no")

        c = Consumer(bus, stream, "g", "c1", fail, max_deliveries=5)
        await bus.ensure_group(stream, "g")
        for ep in range(4):
            await bus.publish(EvalCompleted(run_id=run_id, epoch=ep, report_id="r", checkpoint_id="c",
                                            report_key="k"))
        assert await c.lag() == 4  # 4 undelivered
        await c._read_new(block_ms=None)  # delivered, failed: 4 pending
        assert await c.lag() == 4 and await pending_count(bus, stream, "g") == 4


@pytest.mark.timeout(90)
async def test_server_killed_and_restarted_on_aof_consumer_reconnects(tmp_path, run_id):
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        async with Bus(server.url, run_id, socket_timeout_s=1.0) as bus:
            counts: dict[int, int] = {}

            async def handler(ev):
                counts[ev.epoch] = counts.get(ev.epoch, 0) + 1

            stream = bus.stream("checkpoints")
            c = Consumer(bus, stream, "g", "c1", handler, block_ms=100)
            task = asyncio.create_task(c.run())
            try:
                for ep in range(3):
                    await bus.publish(ckpt(run_id, ep))
                await until(lambda: sum(counts.values()) == 3, what="3 events before the crash")
                server.kill()  # SIGKILL: only the AOF (fsync always) survives
                await until(lambda: c.stats.reconnects >= 1, what="the consumer to notice")
                server.start()
                await bus.publish(ckpt(run_id, 3), retry_for_s=10)
                await until(lambda: counts.get(3) == 1, what="the event after the restart")
            finally:
                c.stop()
                await asyncio.wait_for(task, 5)
            assert counts == {0: 1, 1: 1, 2: 1, 3: 1}  # acked before the crash: never redelivered
            assert await bus.redis.xlen(stream) == 4  # nothing published was lost
            assert await pending_count(bus, stream, "g") == 0
    finally:
        server.stop()


async def test_redis_password_with_url_reserved_characters(tmp_path, run_id, monkeypatch):
    """A password that a redis:// URL cannot hold as it is (docker compose passes any secret): inside TL_REDIS_URL
    it is refused, naming the variable and not the password; given in TL_REDIS_PASSWORD it reaches the server."""
    from shared.api import service_plumbing
    from shared.config import ConfigError, FeedbackSettings, load_settings

    password = "p/@ss+w=rd?x:y%z"
    (tmp_path / "redis").mkdir()
    (tmp_path / "redis" / "password").write_text(password + "\n")   # EmbeddedRedis's requirepass
    server = EmbeddedRedis(tmp_path / "redis", tcp=True).start()
    try:
        for k in ("REDIS_URL", "TL_REDIS_URL", "TL_REDIS_PASSWORD"):
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setenv("TL_RUN_ID", run_id)
        monkeypatch.setenv("TL_REDIS_URL", server.url)                # the password inside the URL, unencoded
        with pytest.raises(ConfigError, match="TL_REDIS_URL.*TL_REDIS_PASSWORD") as ei:
            load_settings(FeedbackSettings)
        assert "w=rd" not in str(ei.value), "the message must not show the password"

        monkeypatch.setenv("TL_REDIS_URL", f"redis://{server.host}:{server.port}/0")
        monkeypatch.setenv("TL_REDIS_PASSWORD", password)
        _, bus = service_plumbing("feedback", load_settings(FeedbackSettings))
        try:
            assert await bus.redis.ping()
        finally:
            await bus.close()
        monkeypatch.setenv("TL_REDIS_URL", f"redis://:other@{server.host}:{server.port}/0")
        with pytest.raises(ConfigError, match="given twice"):
            load_settings(FeedbackSettings)
    finally:
        server.stop()


async def test_a_loop_polling_redis_ends_on_cancel_though_a_command_swallows_it(redis_url, run_id):
    """redis-py's asyncio client can finish a command that a cancel interrupted and return normally, the
    CancelledError gone: a service loop written `while True` then outlives its cancel, and the service's shutdown,
    which waits for it, never completes (a trainer that failed kept its process for good). The services' loops turn
    on `cancel_requested()`; cancelled at random moments while their commands are in flight, every one ends."""
    import random

    import redis.asyncio as aredis

    from shared.bus import cancel_requested

    r = aredis.Redis.from_url(redis_url, socket_timeout=0.05)
    await r.xadd(f"{run_id}:s", {"a": 1})

    async def poll() -> None:
        while not cancel_requested():
            await r.xinfo_stream(f"{run_id}:s")

    rng = random.Random(0)
    try:
        for _ in range(30):
            task = asyncio.create_task(poll())
            await asyncio.wait({task}, timeout=rng.random() * 0.003)   # it never ends by itself: 0–3 ms in
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2.0)
            assert done, "the loop went on after its cancel"
    finally:
        await r.aclose()
