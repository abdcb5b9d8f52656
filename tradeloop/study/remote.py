"""A study's runs through Redis, so that workers on any host that reaches it take runs (the streams and consumer
groups the services' bus uses, with redis-py's blocking client: a worker's run is minutes of blocking work).

Keys, under `tl:study:{sid}:` (sid: the study's identity hash, the same for the study process and every worker):
    spec        study.json's document (what a worker needs to run any run of the study)
    runs        stream, one entry {"run": id} per run to do; consumer group "workers"
    queued      set of run ids ever put on `runs` (a run is queued once: `enqueue` is one Lua script)
    summaries   hash run id → summary JSON (first wins), the done marker the study process reads
    failed      hash run id → error text
    events      stream of progress events (start, epoch, done, error) for the study process (capped)
A worker reads one run at a time (XREADGROUP, COUNT 1) and, while it runs it, re-claims its entry every
`HEARTBEAT_S` (XCLAIM … JUSTID resets the entry's idle time); a worker that died stops doing so, and after
`CLAIM_IDLE_S` another worker takes the entry over (XAUTOCLAIM) and runs it — resuming it where the dead one's
checkpoints are on the same disk, from the start elsewhere. An entry is acked after its summary (or failure) is
stored. A run whose worker only stalled past the bound can run twice (the first summary stored wins).
"""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading

from redis.exceptions import RedisError

GROUP = "workers"
HEARTBEAT_S = 10.0
CLAIM_IDLE_S = 180.0
EVENTS_MAXLEN = 100_000

_ENQUEUE = """
if redis.call('SADD', KEYS[1], ARGV[1]) == 1 then
  redis.call('XADD', KEYS[2], '*', 'run', ARGV[1])
  return 1
end
return 0
"""


def study_id(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def key(sid: str, name: str) -> str:
    return f"tl:study:{sid}:{name}"


def client(url: str):
    import redis

    from shared.redis_server import check_redis_url

    check_redis_url(url)
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10, decode_responses=True)


def ensure_group(r, sid: str) -> None:
    import redis

    try:
        r.xgroup_create(key(sid, "runs"), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def publish(r, sid: str, doc: dict, run_ids: list[str]) -> int:
    """Store the study's document and queue every run not queued before (failed ones again); returns how many
    were queued now."""
    r.set(key(sid, "spec"), json.dumps(doc))
    ensure_group(r, sid)
    for rid in r.hkeys(key(sid, "failed")):            # a failed run is tried again by a new study process
        r.hdel(key(sid, "failed"), rid)
        r.srem(key(sid, "queued"), rid)
    enqueue = r.register_script(_ENQUEUE)
    done = set(r.hkeys(key(sid, "summaries")))
    return sum(int(enqueue(keys=[key(sid, "queued"), key(sid, "runs")], args=[rid]))
               for rid in run_ids if rid not in done)


def accounted(r, sid: str) -> tuple[set[str], dict[str, str]]:
    """(runs with a summary, failed runs → error)."""
    return set(r.hkeys(key(sid, "summaries"))), r.hgetall(key(sid, "failed"))


class RedisSource:
    """A worker's view of the study's run stream: `get()` the next run id (None once every run is accounted for),
    then `done(...)` or `failed(...)`; `emit(event)` for progress."""

    def __init__(self, url: str, sid: str, n_runs: int, consumer: str | None = None):
        self.r, self.sid, self.n_runs = client(url), sid, n_runs
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.stream = key(sid, "runs")
        ensure_group(self.r, sid)
        self._entry: str | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            e = self._entry
            if e is not None:
                try:
                    self.r.xclaim(self.stream, GROUP, self.consumer, 0, [e], justid=True)
                except Exception:  # noqa: BLE001 — Redis away for a moment: the next beat tries again
                    pass

    def get(self) -> str | None:
        while True:
            done, failed = accounted(self.r, self.sid)
            if len(done | set(failed)) >= self.n_runs:
                return None
            # a dead worker's run first, then a new one
            _, claimed, *_ = self.r.xautoclaim(self.stream, GROUP, self.consumer, int(CLAIM_IDLE_S * 1000),
                                               "0-0", count=1)
            entries = claimed or []
            if not entries:
                resp = self.r.xreadgroup(GROUP, self.consumer, {self.stream: ">"}, count=1, block=2000)
                entries = resp[0][1] if resp else []
            for entry_id, fields in entries:
                rid = (fields or {}).get("run")
                if rid is None or rid in done or rid in failed:
                    self.r.xack(self.stream, GROUP, entry_id)
                    continue
                self._entry = entry_id
                return rid

    def _finish(self) -> None:
        if self._entry is not None:
            self.r.xack(self.stream, GROUP, self._entry)
        self._entry = None

    def done(self, run_id: str, summary: dict) -> None:
        self.r.hsetnx(key(self.sid, "summaries"), run_id, json.dumps(summary))
        self._finish()

    def failed(self, run_id: str, error: str) -> None:
        self.r.hset(key(self.sid, "failed"), run_id, error)
        self._finish()

    def emit(self, event: dict) -> None:
        """Progress for the study process: best effort, as the heartbeat is (a Redis away for a moment loses a line
        of progress, not the run in hand; `done` and `failed` carry the results)."""
        try:
            self.r.xadd(key(self.sid, "events"), {"data": json.dumps({**event, "consumer": self.consumer},
                                                                     default=str)},
                        maxlen=EVENTS_MAXLEN, approximate=True)
        except RedisError:
            pass

    def close(self) -> None:
        self._stop.set()


class RedisEvents:
    """The study process's reader of the events stream (from the moment it started)."""

    def __init__(self, url: str, sid: str):
        self.r, self.sid = client(url), sid
        newest = self.r.xrevrange(key(sid, "events"), count=1)
        self.last = newest[0][0] if newest else "0-0"

    def get(self, timeout: float) -> dict | None:
        resp = self.r.xread({key(self.sid, "events"): self.last}, count=1, block=max(1, int(timeout * 1000)))
        if not resp:
            return None
        entry_id, fields = resp[0][1][0]
        self.last = entry_id
        return json.loads(fields["data"])


def fetch_spec(url: str, sid: str) -> dict:
    r = client(url)
    raw = r.get(key(sid, "spec"))
    if raw is None:
        from tradeloop.study.spec import StudyError

        raise StudyError(f"--study {sid}: no such study in this Redis (the study process prints its id)")
    return json.loads(raw)

