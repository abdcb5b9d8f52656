"""The event bus: Redis Streams with consumer groups (redis-py asyncio), at-least-once delivery.

How a message flows:
  `Bus.publish(event)` XADDs `{"data": <json>}` to the event's stream (`tl:{run}:stream:*`).
  A `Consumer` in a group reads it (XREADGROUP), decodes it (`shared.events.decode_event`), awaits the
  handler, and XACKs only after the handler returned — the handler stores its result first, and must
  be idempotent on (run id, epoch): see `RunStore.has_report` / `Bus.claim_once`.

Failure handling:
  - handler raises → the entry stays pending; it is retried (XCLAIM by the same consumer after a
    backoff, or XAUTOCLAIM by any consumer once idle ≥ claim_idle_ms) until it was delivered
    `max_deliveries` times, then written to the dead-letter stream with the exception text and acked.
  - malformed entry (not JSON, truncated, oversized, wrong schema version, wrong run) → dead-lettered
    at once with the reason; the consumer goes on with the next entry.
  - consumer dies before its ack → the entry idles in its PEL; another consumer XAUTOCLAIMs it after
    `claim_idle_ms` (keep it above the longest handler time). A restarted consumer of the same name
    first re-reads its own PEL, and so does a consumer after every reconnect (an entry whose handler met
    the lost connection is in its PEL with no retry scheduled).
  - follow-up events that must go out once per epoch: `Bus.publish_once` (marker + XADD in one script).
  - connection lost / timeout → exponential backoff with jitter, then reconnect; acks that failed are
    retried first. NOGROUP (FLUSHALL, or a restarted Redis without the group) → the group is created
    again (XGROUP CREATE … 0 MKSTREAM) and the loop goes on.
  - every call has a socket timeout (the blocking read's BLOCK is kept below it), so nothing hangs.

Delivery counts come from XPENDING (the `times_delivered` Redis keeps), so they survive restarts.
The last failure reason of a pending entry is kept in a hash `tl:{run}:errors:{group}` so whichever
consumer dead-letters it can say why.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.events import (MAX_EVENT_BYTES, DeadLetter, Event, EventError, decode_event, encode_event,
                           raw_fields, stream_for, stream_name, validate_run_id)
from shared.redis_server import check_redis_version
from shared.runfiles import RunFiles
from shared.store import RunStore

Handler = Callable[[Event], Awaitable[None]]
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)
REDIS_DOWN = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError)
"""Errors meaning "Redis is unreachable right now" (not a missing file, which is also an OSError)."""


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _is_nogroup(exc: BaseException) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith("NOGROUP")


# SET NX the marker; only if that set it, XADD the event (Redis runs a script atomically; Redis >= 5
# replicates its effects, so the AOF holds the XADD with its real id).
_PUBLISH_ONCE_LUA = """
if redis.call('SET', KEYS[1], '1', 'NX') then
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'data', ARGV[2])
end
return false
"""


def cancel_requested() -> bool:
    """Whether the running task has been asked to stop. redis-py's asyncio client can finish a command that a cancel
    interrupted and return normally, the CancelledError swallowed (`tests/test_bus.py` cancels such a loop mid-command),
    so a loop that awaits Redis checks this each turn instead of trusting the error to arrive: a service whose
    background loop outlives its cancel never completes its shutdown."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Backoff:
    """Exponential backoff with full jitter: delay_k = U(0.5, 1) · min(cap, base · 2^k)."""

    def __init__(self, base_s: float = 0.05, cap_s: float = 2.0):
        self.base_s, self.cap_s, self.k = base_s, cap_s, 0

    def next(self) -> float:
        d = min(self.cap_s, self.base_s * (2 ** self.k))
        self.k = min(self.k + 1, 30)
        return d * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.k = 0


class Bus:
    """A run's connection to Redis: publish events, consume streams, store blobs (`.store`)."""

    def __init__(self, redis_url: str, run_id: str, *, password: str | None = None, socket_timeout_s: float = 5.0,
                 max_event_bytes: int = MAX_EVENT_BYTES, stream_maxlen: int = 100_000,
                 keep_checkpoints: int = 5, run_dir: str | os.PathLike | None = None):
        self.run_id = validate_run_id(run_id)
        self.redis_url = redis_url
        self.socket_timeout_s = socket_timeout_s
        self.max_event_bytes = max_event_bytes
        self.stream_maxlen = stream_maxlen
        # No hidden retries inside redis-py: our loops decide when to back off and reconnect.
        # TCP keepalive only where there is TCP (a unix:// URL is a local socket; redis-py refuses the option there).
        # `password` (TL_REDIS_PASSWORD) is used as it is; a password in the URL is percent-decoded by redis-py
        tcp = {} if redis_url.startswith("unix://") else {"socket_keepalive": True}
        self.redis = aioredis.Redis.from_url(redis_url, password=password, socket_timeout=socket_timeout_s,
                                             socket_connect_timeout=socket_timeout_s,
                                             retry=Retry(NoBackoff(), 0), decode_responses=False, **tcp)
        # run_dir: the run's directory, where every stored document is also written as a file (shared/runfiles.py)
        self.store = RunStore(self.redis, self.run_id, keep_checkpoints=keep_checkpoints,
                              files=None if run_dir is None else RunFiles(run_dir))

    def stream(self, kind: str) -> str:
        """`tl:{run}:stream:{kind}` (checkpoints|reports|feedback|dead)."""
        return stream_name(self.run_id, kind)

    async def connect(self) -> str:
        """PING and check the server version (≥ 6.2); returns the version. Call once at start."""
        await self.redis.ping()
        return check_redis_version(await self.redis.info("server"), where="Redis")

    async def close(self) -> None:
        """Close the connection pool."""
        await self.redis.aclose()

    async def __aenter__(self) -> "Bus":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def publish(self, event: Event, *, retry_for_s: float = 30.0) -> str:
        """XADD the event to its stream; returns the entry id. Retries transient errors for `retry_for_s`.

        A retried XADD may duplicate an event whose first reply was lost: consumers are idempotent.
        """
        if event.run_id != self.run_id:
            raise ValueError(f"event of run {event.run_id!r} published on the bus of run {self.run_id!r}")
        fields = encode_event(event)
        if len(fields["data"].encode()) > self.max_event_bytes:
            raise ValueError(f"{event.type} event is {len(fields['data'])} bytes > {self.max_event_bytes}; "
                             "store the payload (RunStore) and publish its key")
        return await self._xadd(stream_for(event), fields, retry_for_s)

    async def _xadd(self, stream: str, fields: dict, retry_for_s: float = 30.0) -> str:
        deadline = time.monotonic() + retry_for_s
        backoff = Backoff()
        while True:
            try:
                entry_id = await self.redis.xadd(stream, fields, maxlen=self.stream_maxlen, approximate=True)
                return _s(entry_id)
            except _TRANSIENT:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(backoff.next())

    async def publish_once(self, kind: str, event: Event, *, retry_for_s: float = 30.0) -> str | None:
        """Publish `event` only if marker `tl:{run}:done:{kind}:{epoch}` is unset, atomically (one Lua script).

        The marker SET NX and the XADD happen together or not at all, so a process killed in between can
        neither lose the event (marker set, nothing published) nor publish it twice. Returns the entry id,
        or None when it was already published (by an earlier delivery, or by a retry whose reply was lost).
        """
        if event.run_id != self.run_id:
            raise ValueError(f"event of run {event.run_id!r} published on the bus of run {self.run_id!r}")
        data = encode_event(event)["data"]
        if len(data.encode()) > self.max_event_bytes:
            raise ValueError(f"{event.type} event is {len(data)} bytes > {self.max_event_bytes}")
        keys = [self.store.key("done", kind, int(event.epoch)), stream_for(event)]
        deadline = time.monotonic() + retry_for_s
        backoff = Backoff()
        while True:
            try:
                entry_id = await self.redis.eval(_PUBLISH_ONCE_LUA, 2, *keys, self.stream_maxlen, data)
                return None if entry_id is None else _s(entry_id)
            except _TRANSIENT:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(backoff.next())

    async def claim_once(self, kind: str, epoch: int) -> bool:
        """SET NX `tl:{run}:done:{kind}:{epoch}`: True only for the first caller (see RunStore.claim_once)."""
        return await self.store.claim_once(kind, epoch)

    async def ensure_group(self, stream: str, group: str) -> None:
        """XGROUP CREATE stream group 0 MKSTREAM, idempotently (BUSYGROUP is fine)."""
        try:
            await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise

    async def dead_letters(self, count: int = 100) -> list[DeadLetter]:
        """The last `count` dead letters of this run, oldest first."""
        rows = await self.redis.xrevrange(self.stream("dead"), count=count)
        return [decode_event(f) for _, f in reversed(rows)]


@dataclass
class ConsumerStats:
    """Counters for /status and /metrics."""

    processed: int = 0
    failed: int = 0        # handler raised (each attempt)
    dead: int = 0          # entries dead-lettered
    claimed: int = 0       # entries taken over by XAUTOCLAIM
    reconnects: int = 0
    group_recreated: int = 0
    last_error: str = ""
    last_error_at: float = 0.0  # unix time


class Consumer:
    """One consumer of a group on one stream; `await run()` until `stop()`, or `await run_burst()`."""

    def __init__(self, bus: Bus, stream: str, group: str, consumer_name: str, handler: Handler, *,
                 max_deliveries: int = 3, claim_idle_ms: int = 60_000, block_ms: int = 1000,
                 count: int = 32, retry_delay_ms: int = 200, handler_timeout_s: float | None = None):
        if block_ms >= bus.socket_timeout_s * 1000:
            raise ValueError(f"block_ms={block_ms} must stay below the socket timeout "
                             f"({bus.socket_timeout_s * 1000:.0f} ms) or every idle read would time out")
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be >= 1")
        self.bus, self.redis = bus, bus.redis
        self.stream, self.group, self.name = stream, group, consumer_name
        self.handler = handler
        self.max_deliveries = max_deliveries
        self.claim_idle_ms = claim_idle_ms
        self.block_ms = block_ms
        self.count = count
        self.retry_delay_ms = retry_delay_ms
        self.handler_timeout_s = handler_timeout_s
        self.stats = ConsumerStats()
        self._errors_key = f"tl:{bus.run_id}:errors:{group}"
        self._dead_stream = bus.stream("dead")
        self._stop = asyncio.Event()
        self._retry_at: dict[str, float] = {}   # entry id → monotonic time of its next own retry
        self._unacked: set[str] = set()        # handled, but the XACK failed (connection lost)
        self._next_autoclaim = 0.0
        self._backoff = Backoff()

    # -- public -----------------------------------------------------------------------------------
    def status(self) -> dict:
        """Counters plus identity, JSON-ready."""
        return {"stream": self.stream, "group": self.group, "consumer": self.name, **asdict(self.stats)}

    def stop(self) -> None:
        """Ask `run()` to return after the current read (≤ block_ms) and the entry in hand."""
        self._stop.set()

    async def run(self) -> None:
        """Consume until `stop()`: never raises for Redis errors or bad entries (they are counted)."""
        self._stop.clear()
        ready = False
        while not self._stop.is_set() and not cancel_requested():
            try:
                if not ready:
                    await self._recover()
                    # a restarted consumer of the same name, or one whose connection broke while it handled
                    # an entry (that entry is in our PEL with no retry scheduled): finish what it had taken
                    await self._read_own_pel()
                    ready = True
                await self._step(burst=False)
                self._backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — the loop must survive anything Redis throws
                ready = False
                await self._on_loop_error(exc)

    async def run_burst(self, max_rounds: int = 10_000) -> int:
        """Process what is there now (new entries, own pending retries, claimable entries), then return.

        Retries happen immediately (no backoff), so a failing entry is dead-lettered within one burst.
        Returns the number of entries handled (acked or dead-lettered). Redis errors propagate.
        """
        before = self.stats.processed + self.stats.dead
        await self._recover()
        n = await self._autoclaim(force=True) + await self._read_own_pel()
        for _ in range(max_rounds):
            if self._retry_at:  # our failed entries: retry now (delivery counts bound this)
                n += await self._read_own_pel()
            n += await self._read_new(block_ms=None)
            if n == 0:
                break
            n = 0
        return self.stats.processed + self.stats.dead - before

    async def lag(self, cap: int = 10_000) -> int:
        """Entries not yet acked by the group: pending + not yet delivered (the latter capped at `cap`).

        XINFO GROUPS' `lag` is Redis 7; on 6.2: XPENDING count + XRANGE after last-delivered-id.
        """
        try:
            groups = await self.redis.xinfo_groups(self.stream)
        except ResponseError as exc:  # no stream yet
            if "no such key" in str(exc).lower():
                return 0
            raise
        mine = next((g for g in groups if _s(g["name"]) == self.group), None)
        if mine is None:
            return 0
        last = _s(mine["last-delivered-id"])
        after = await self.redis.xrange(self.stream, min=f"({last}", max="+", count=cap)
        return int(mine["pending"]) + len(after)

    # -- loop internals ---------------------------------------------------------------------------
    async def _on_loop_error(self, exc: Exception) -> None:
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        self.stats.last_error_at = time.time()
        if _is_nogroup(exc):
            self.stats.group_recreated += 1
            return  # _recover() recreates the group right away
        if isinstance(exc, _TRANSIENT):
            self.stats.reconnects += 1
        delay = self._backoff.next()
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=delay)
        except asyncio.TimeoutError:
            pass

    async def _recover(self) -> None:
        """(Re)start: create the group if needed, flush failed acks, re-read our own PEL."""
        await self.bus.ensure_group(self.stream, self.group)
        if self._unacked:
            ids = sorted(self._unacked)
            await self.redis.xack(self.stream, self.group, *ids)
            await self.redis.hdel(self._errors_key, *ids)
            self._unacked.clear()

    async def _step(self, *, burst: bool) -> None:
        await self._autoclaim(force=False)
        await self._retry_due()
        now = time.monotonic()
        wait_ms = self.block_ms
        if self._retry_at:
            wait_ms = min(wait_ms, max(1, int((min(self._retry_at.values()) - now) * 1000)))
        wait_ms = min(wait_ms, max(1, int((self._next_autoclaim - now) * 1000)))
        await self._read_new(block_ms=wait_ms)

    async def _read_new(self, block_ms: int | None) -> int:
        """XREADGROUP '>' (BLOCK block_ms, or no BLOCK when None); handle what came."""
        resp = await self.redis.xreadgroup(self.group, self.name, {self.stream: ">"},
                                           count=self.count, block=block_ms)
        entries = resp[0][1] if resp else []
        await self._handle_batch([(_s(i), f, 1) for i, f in entries])
        return len(entries)

    async def _read_own_pel(self) -> int:
        """Re-deliver every entry pending for this consumer (XREADGROUP from id 0, paged)."""
        last, n = "0", 0
        while True:
            resp = await self.redis.xreadgroup(self.group, self.name, {self.stream: last}, count=self.count)
            entries = resp[0][1] if resp else []
            if not entries:
                return n
            counts = await self._delivery_counts(entries)
            for entry_id, _ in entries:
                self._retry_at.pop(_s(entry_id), None)
            await self._handle_batch([(_s(i), f, counts.get(_s(i), 1)) for i, f in entries])
            n += len(entries)
            last = _s(entries[-1][0])

    async def _autoclaim(self, *, force: bool) -> int:
        """XAUTOCLAIM entries idle ≥ claim_idle_ms (from dead or stuck consumers); at most every half bound."""
        now = time.monotonic()
        if not force and now < self._next_autoclaim:
            return 0
        self._next_autoclaim = now + min(self.claim_idle_ms / 2000, 5.0)
        cursor, n = "0-0", 0
        while True:
            resp = await self.redis.xautoclaim(self.stream, self.group, self.name, self.claim_idle_ms,
                                               start_id=cursor, count=self.count)
            cursor, entries = _s(resp[0]), resp[1]
            live = [(i, f) for i, f in entries if f is not None and i is not None]
            for entry_id, fields in entries:
                if fields is None and entry_id is not None:  # trimmed while pending: just ack it
                    await self.redis.xack(self.stream, self.group, entry_id)
            if live:
                self.stats.claimed += len(live)
                counts = await self._delivery_counts(live)
                for entry_id, _ in live:
                    self._retry_at.pop(_s(entry_id), None)
                await self._handle_batch([(_s(i), f, counts.get(_s(i), 1)) for i, f in live])
            n += len(entries)
            if cursor == "0-0":
                return n

    async def _retry_due(self) -> None:
        """XCLAIM our own failed entries whose backoff elapsed, and handle them again."""
        if not self._retry_at:
            return
        now = time.monotonic()
        due = sorted(i for i, t in self._retry_at.items() if t <= now)
        if not due:
            return
        for i in due:
            del self._retry_at[i]
        entries = await self.redis.xclaim(self.stream, self.group, self.name,
                                          min_idle_time=min(self.retry_delay_ms, self.claim_idle_ms),
                                          message_ids=due)
        live = [(i, f) for i, f in entries if f is not None]
        counts = await self._delivery_counts(live)
        await self._handle_batch([(_s(i), f, counts.get(_s(i), 1)) for i, f in live])

    async def _delivery_counts(self, entries: list) -> dict[str, int]:
        """entry id → times delivered (XPENDING over the id range of `entries`, one call)."""
        if not entries:
            return {}
        ids = [_s(e[0]) for e in entries]
        rows = await self.redis.xpending_range(self.stream, self.group, min=ids[0], max=ids[-1],
                                               count=len(ids) + 100, consumername=self.name)
        return {_s(r["message_id"]): int(r["times_delivered"]) for r in rows}

    # -- entries ----------------------------------------------------------------------------------
    async def _handle_batch(self, items: list[tuple[str, dict | None, int]]) -> None:
        """Handle entries in order, then XACK the successful ones in one round trip.

        Each handler has stored its result before returning, so acking after the batch keeps
        "ack only after the result is stored"; a crash mid-batch only re-delivers handled entries
        (handlers are idempotent). On cancellation the finished ones are still acked.
        """
        done: list[str] = []
        try:
            for entry_id, fields, deliveries in items:
                if await self._handle(entry_id, fields, deliveries):
                    done.append(entry_id)
        finally:
            if done:
                await self._ack_many(done)

    async def _handle(self, entry_id: str, fields: dict | None, deliveries: int) -> bool:
        """Handle one entry; True when it should be acked (handled), False when retried or dead-lettered."""
        if fields is None:
            return True
        try:
            event = decode_event(fields, max_bytes=self.bus.max_event_bytes)
            if event.run_id != self.bus.run_id:
                raise EventError(f"run_id {event.run_id!r} does not match this stream's run {self.bus.run_id!r}")
        except EventError as exc:
            await self._dead_letter(entry_id, fields, f"malformed: {exc.reason}", deliveries)
            return False
        if deliveries > self.max_deliveries:
            last = await self.redis.hget(self._errors_key, entry_id)
            why = _s(last) if last else "no handler error recorded (a consumer died while handling it?)"
            await self._dead_letter(entry_id, fields, f"delivered {deliveries} times > max_deliveries="
                                    f"{self.max_deliveries}; last error: {why}", deliveries, event)
            return False
        try:
            if self.handler_timeout_s is None:
                await self.handler(event)
            else:
                await asyncio.wait_for(self.handler(event), timeout=self.handler_timeout_s)
        except asyncio.CancelledError:
            raise  # not acked: stays pending, claimed later
        except Exception as exc:  # noqa: BLE001 — any handler failure is a retry, then a dead letter
            reason = f"{type(exc).__name__}: {exc}"[:2000]
            self.stats.failed += 1
            self.stats.last_error, self.stats.last_error_at = reason, time.time()
            if deliveries >= self.max_deliveries:
                await self._dead_letter(entry_id, fields, f"handler failed {deliveries} times "
                                        f"(max_deliveries={self.max_deliveries}); last error: {reason}",
                                        deliveries, event)
            else:
                await self.redis.hset(self._errors_key, entry_id, reason)
                delay = self.retry_delay_ms * (2 ** (deliveries - 1)) / 1000
                self._retry_at[entry_id] = time.monotonic() + delay
            return False
        self.stats.processed += 1
        return True

    async def _ack_many(self, entry_ids: list[str]) -> None:
        """XACK + forget their last errors, one round trip; on a lost connection, ack on reconnect."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.hdel(self._errors_key, *entry_ids)
                await pipe.execute()
        except _TRANSIENT:
            self._unacked.update(entry_ids)  # until then the entries are merely pending
            raise

    async def _dead_letter(self, entry_id: str, fields: dict, reason: str, deliveries: int,
                           event: Event | None = None) -> None:
        """XADD a DeadLetter and XACK the entry, atomically (MULTI)."""
        epoch = event.epoch if event is not None else _epoch_hint(fields)
        dl = DeadLetter(run_id=self.bus.run_id, epoch=epoch, original_stream=self.stream, entry_id=entry_id,
                        group=self.group, consumer=self.name, fields=raw_fields(fields), reason=reason[:4000],
                        deliveries=deliveries)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self._dead_stream, encode_event(dl), maxlen=self.bus.stream_maxlen, approximate=True)
            pipe.xack(self.stream, self.group, entry_id)
            pipe.hdel(self._errors_key, entry_id)
            await pipe.execute()
        self._retry_at.pop(entry_id, None)
        self.stats.dead += 1
        self.stats.last_error, self.stats.last_error_at = reason[:500], time.time()


def _epoch_hint(fields: dict) -> int:
    """Best-effort epoch of an undecodable entry (for the dead letter), else -1."""
    try:
        data = fields.get(b"data", fields.get("data"))
        e = json.loads(data).get("epoch")
        return e if isinstance(e, int) and e >= 0 else -1
    except Exception:  # noqa: BLE001
        return -1
