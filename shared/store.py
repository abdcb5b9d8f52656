"""Run-namespaced Redis storage: checkpoint bytes, reports, feedback bundles, idempotency markers.

Keys (all under `tl:{run}:`; `run_key(run, ...)` builds them):
  ckpt:{epoch}            checkpoint bytes (safetensors), the last K epochs kept
  ckpt:sha256             hash epoch → sha256 hex of those bytes (checked on every load)
  ckpt:index              sorted set of stored checkpoint epochs (score = epoch)
  report:{epoch}          evaluator report JSON          (index: report:index)
  bundle:{epoch}          feedback bundle JSON           (index: bundle:index)
  done:{kind}:{epoch}     idempotency marker (SET NX)
  trainer:history         hash epoch → the trainer's epoch record JSON

JSON documents are written first-wins (SET NX): a handler retried after a crash computes the same
thing again and `put_*` returns False instead of overwriting. With `files` (a `shared.runfiles.RunFiles` of the
run directory) every report, bundle and epoch record is also written there as a file, atomically, when it is
stored; `mirror(kind, epoch)` writes the stored one where a crash came between the two. Everything is async (redis.asyncio);
the client should be created with `decode_responses=False` (checkpoints are binary).
"""
from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from shared.checkpoints import CheckpointError, checkpoint_sha256
from shared.events import validate_run_id
from shared.runfiles import RunFiles

MAX_CHECKPOINT_BYTES = 512 * 1024 * 1024  # Redis' largest string
JSON_KINDS = ("report", "bundle")


class StoreError(KeyError):
    """A stored object that is missing (or was trimmed); the message says which and what exists."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


def run_key(run_id: str, *parts: object) -> str:
    """`tl:{run}:part1:part2…`"""
    return ":".join(["tl", validate_run_id(run_id), *map(str, parts)])


def trainer_history_key(run_id: str) -> str:
    """`tl:{run}:trainer:history` — hash epoch → JSON epoch record (stats, checkpoint, knobs, bundle applied)."""
    return run_key(run_id, "trainer", "history")


def _to_json(obj: Any) -> str:
    if hasattr(obj, "model_dump_json"):  # a pydantic model
        return obj.model_dump_json()
    if isinstance(obj, (bytes, bytearray)):
        obj = obj.decode()
    if isinstance(obj, str):
        json.loads(obj)  # must already be JSON
        return obj
    return json.dumps(obj, allow_nan=False)


PUT_JSON = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX') then return 0 end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
local n = tonumber(ARGV[3])
for i = 3, 2 + n do redis.call('HINCRBY', KEYS[i], ARGV[2], 1) end
for i = 3 + n, #KEYS do redis.call('HSET', KEYS[i], ARGV[2], ARGV[i + 1 - n]) end
return 1
"""
"""`put_json` as one script: the document first-wins (SET NX), then, only if it was new, its index and the caller's
per-epoch tallies (HINCRBY) and marks (HSET). KEYS: document, index, the tallies' hashes, the marks' hashes; ARGV:
text, epoch, number of tallies, the marks' values."""


class RunStore:
    """Redis storage of one run. `client`: a redis.asyncio.Redis with decode_responses=False."""

    def __init__(self, client: aioredis.Redis, run_id: str, *, keep_checkpoints: int = 5,
                 files: RunFiles | None = None):
        if keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {keep_checkpoints}")
        self.redis = client
        self.run_id = validate_run_id(run_id)
        self.keep_checkpoints = keep_checkpoints
        self.files = files
        """The run directory's files: every document stored here is also written there (None: Redis only)."""

    def key(self, *parts: object) -> str:
        """`tl:{run}:…` of this run."""
        return run_key(self.run_id, *parts)

    # -- checkpoints ------------------------------------------------------------------------------
    async def put_checkpoint(self, epoch: int, data: bytes, sha256: str | None = None) -> tuple[str, str]:
        """Store checkpoint bytes of `epoch`, keep the last K epochs; return (key, sha256).

        `sha256`, when given, must match the bytes (raises CheckpointError otherwise).
        """
        if len(data) > MAX_CHECKPOINT_BYTES:
            raise ValueError(f"checkpoint of epoch {epoch} is {len(data)} bytes > {MAX_CHECKPOINT_BYTES}; "
                             "publish a path on a shared volume instead")
        digest = checkpoint_sha256(data)
        if sha256 is not None and sha256.lower() != digest:
            raise CheckpointError(f"epoch {epoch}", f"sha256 mismatch before storing: expected {sha256}, got {digest}")
        key = self.key("ckpt", int(epoch))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(key, data)
            pipe.hset(self.key("ckpt", "sha256"), str(int(epoch)), digest)
            pipe.zadd(self.key("ckpt", "index"), {str(int(epoch)): int(epoch)})
            await pipe.execute()
        await self._trim_checkpoints()
        return key, digest

    async def _trim_checkpoints(self) -> None:
        index = self.key("ckpt", "index")
        old = await self.redis.zrange(index, 0, -(self.keep_checkpoints + 1))
        if not old:
            return
        epochs = [e.decode() if isinstance(e, bytes) else str(e) for e in old]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(*[self.key("ckpt", e) for e in epochs])
            pipe.hdel(self.key("ckpt", "sha256"), *epochs)
            pipe.zrem(index, *epochs)
            await pipe.execute()

    async def checkpoint_epochs(self) -> list[int]:
        """Epochs whose checkpoint bytes are in Redis, ascending."""
        return [int(e) for e in await self.redis.zrange(self.key("ckpt", "index"), 0, -1)]

    async def get_checkpoint(self, epoch: int, expected_sha256: str | None = None) -> bytes:
        """Checkpoint bytes of `epoch`, checked against `expected_sha256` (else the stored digest).

        Raises StoreError when absent (trimmed or never stored), CheckpointError on a sha256 mismatch.
        """
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.key("ckpt", int(epoch)))
            pipe.hget(self.key("ckpt", "sha256"), str(int(epoch)))
            data, stored = await pipe.execute()
        if data is None:
            have = await self.checkpoint_epochs()
            raise StoreError(f"checkpoint of epoch {epoch} is not in Redis (run {self.run_id}; kept epochs: {have})")
        expected = expected_sha256 or (stored.decode() if stored else None)
        if expected is None:
            raise CheckpointError(self.key("ckpt", epoch), "no sha256 stored to check against")
        actual = checkpoint_sha256(data)
        if actual != expected.lower():
            raise CheckpointError(self.key("ckpt", epoch), f"sha256 mismatch: expected {expected}, got {actual}")
        return data

    # -- reports and bundles ----------------------------------------------------------------------
    async def put_json(self, kind: str, epoch: int, obj: Any, *, tally: tuple[str, ...] = (),
                       mark: dict[str, str] | None = None) -> bool:
        """Store a JSON document (dict, JSON text or pydantic model) first-wins; True if newly stored.

        Only when it is new, and in the same atomic step (one Lua script, `PUT_JSON`): its index entry, +1 at field
        `epoch` of each hash in `tally`, and field `epoch` := value of each hash → value in `mark`. As separate
        writes, a Redis killed between them left the document without its tallies, and the retried handler, finding
        the document stored, never added them; in one script they land together (and AOF logs a script's writes as
        one transaction)."""
        if kind not in JSON_KINDS:
            raise ValueError(f"kind must be one of {JSON_KINDS}, got {kind!r}")
        text = await asyncio.to_thread(_to_json, obj)         # a report is tens of MB: off the event loop
        mark = mark or {}
        e = int(epoch)
        created = await self.redis.eval(PUT_JSON, 2 + len(tally) + len(mark), self.key(kind, e),
                                        self.key(kind, "index"), *tally, *mark, text, e, len(tally), *mark.values())
        if created and self.files is not None:
            await asyncio.to_thread(self.files.write, kind, e, text)
        elif self.files is not None:
            await self.mirror(kind, e)
        return bool(created)

    async def mirror(self, kind: str, epoch: int) -> bool:
        """Write the stored document of `kind` for `epoch` to the run directory when its file is missing (a crash
        between the Redis write and the file's); True when a file was written. No-op without `files`."""
        if self.files is None or await asyncio.to_thread(self.files.has, kind, epoch):
            return False
        raw = await self.get_raw(kind, epoch) if kind in JSON_KINDS else \
            await self.redis.hget(trainer_history_key(self.run_id), str(int(epoch)))
        if raw is None:
            return False
        await asyncio.to_thread(self.files.write, kind, int(epoch), raw)
        return True

    async def put_epoch_record(self, epoch: int, record: dict) -> None:
        """The trainer's record of `epoch` (stats, checkpoint id and sha256, knobs, bundle applied): field `epoch`
        of the history hash `tl:{run}:trainer:history` (overwritten: a re-published epoch rewrites it) and, with
        `files`, `epochs/epoch-NNNN.json`."""
        text = json.dumps(record, allow_nan=False)
        await self.redis.hset(trainer_history_key(self.run_id), str(int(epoch)), text)
        if self.files is not None:
            await asyncio.to_thread(self.files.write, "epoch", int(epoch), text)

    async def get_raw(self, kind: str, epoch: int) -> bytes | None:
        """The stored JSON text of `kind` for `epoch` (bytes, unparsed), or None."""
        return await self.redis.get(self.key(kind, int(epoch)))

    async def get_json(self, kind: str, epoch: int) -> dict | None:
        """The stored document of `kind` for `epoch`, or None (parsed off the event loop)."""
        raw = await self.get_raw(kind, epoch)
        return None if raw is None else await asyncio.to_thread(json.loads, raw)

    async def has_json(self, kind: str, epoch: int) -> bool:
        """Whether a document of `kind` exists for `epoch` (the idempotency check of a handler)."""
        return bool(await self.redis.exists(self.key(kind, int(epoch))))

    async def json_epochs(self, kind: str) -> list[int]:
        """Epochs with a stored document of `kind`, ascending."""
        return [int(e) for e in await self.redis.zrange(self.key(kind, "index"), 0, -1)]

    async def put_report(self, epoch: int, report: Any, *, tally: tuple[str, ...] = (),
                         mark: dict[str, str] | None = None) -> bool:
        """Store the evaluator report of `epoch` (first wins; `tally` and `mark` as in `put_json`); True if newly
        stored."""
        return await self.put_json("report", epoch, report, tally=tally, mark=mark)

    async def get_report(self, epoch: int) -> dict | None:
        """The report of `epoch`, or None."""
        return await self.get_json("report", epoch)

    async def has_report(self, epoch: int) -> bool:
        """Whether the report of `epoch` is stored."""
        return await self.has_json("report", epoch)

    async def put_bundle(self, epoch: int, bundle: Any) -> bool:
        """Store the feedback bundle computed from epoch `epoch`'s report (first wins)."""
        return await self.put_json("bundle", epoch, bundle)

    async def get_bundle(self, epoch: int) -> dict | None:
        """The feedback bundle computed from epoch `epoch`'s report, or None."""
        return await self.get_json("bundle", epoch)

    async def has_bundle(self, epoch: int) -> bool:
        """Whether the bundle of `epoch` is stored."""
        return await self.has_json("bundle", epoch)

    # -- idempotency ------------------------------------------------------------------------------
    async def claim_once(self, kind: str, epoch: int, ttl_s: int | None = None) -> bool:
        """SET NX `tl:{run}:done:{kind}:{epoch}`: True for the first caller only.

        Use it for side effects that must happen once *after* the result is stored (publishing the
        follow-up event); a marker set before the work would lose the work if the worker died.
        """
        return bool(await self.redis.set(self.key("done", kind, int(epoch)), b"1", nx=True, ex=ttl_s))

    async def delete_run(self) -> int:
        """Delete every key of this run (tests, `tradeloop` clean-up); returns how many."""
        n = 0
        batch = []
        async for k in self.redis.scan_iter(match=self.key("*"), count=500):
            batch.append(k)
            if len(batch) >= 500:
                n += await self.redis.delete(*batch)
                batch = []
        if batch:
            n += await self.redis.delete(*batch)
        return n
