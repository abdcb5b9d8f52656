"""A study's runs through Redis, so that workers on any host that reaches it take runs (the streams and consumer
groups the services' bus uses, with redis-py's blocking client: a worker's run is minutes of blocking work).

Keys, under `tl:study:{sid}:` (sid: the study's identity hash, the same for the study process and every worker):
    spec        study.json's document and the code fingerprint of the study process (`guard.code_fingerprint`)
    runs        stream, one entry {"run": id} per run to do; consumer group "workers"
    queued      set of run ids ever put on `runs` (a run is queued once: `enqueue` is one Lua script)
    summaries   hash run id → summary JSON (first wins), the done marker the study process reads
    failed      hash run id → error text (never counted for a run with a summary)
    events      stream of progress events (start, epoch, done, error, handed-over) for the study process (capped)
A worker reads one run at a time (XREADGROUP, COUNT 1) and, while it runs it, re-claims its entry every
`HEARTBEAT_S` while the entry is still its own (one Lua script: XPENDING for its consumer, then XCLAIM … JUSTID,
which resets the entry's idle time); a worker that died stops doing so, and after `CLAIM_IDLE_S` another worker
takes the entry over (XAUTOCLAIM) and runs it — resuming it where the dead one's checkpoints are on the same disk,
from the start elsewhere. A worker that only stalled past the bound finds the entry gone from its own pending
entries and stops that run at its next epoch (`RunHandedOver`); a run found locked by a live process on the same
disk is left pending for a later claim, never marked failed. An entry is acked after its summary (or failure) is
stored; a failure is stored only by the entry's owner, and only where the run has no summary.

The Redis URL comes from `--redis` or the environment (`TL_REDIS_URL`), its password from the URL
or from `TL_REDIS_PASSWORD` (the services' rule: `shared.config.CommonSettings`); the worker processes a study or
host starts read both from their environment (`url_in_env`), never from their command line.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import threading
from contextlib import contextmanager
from urllib.parse import quote, urlsplit, urlunsplit

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

_BEAT = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'JUSTID')
return 1
"""

_FAIL = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1, ARGV[3]) == 0 then return 0 end
if redis.call('HEXISTS', KEYS[2], ARGV[4]) == 0 then redis.call('HSET', KEYS[3], ARGV[4], ARGV[5]) end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def study_id(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]


def key(sid: str, name: str) -> str:
    return f"tl:study:{sid}:{name}"


URL_VAR = "TL_REDIS_URL"
"""Where `--redis` comes from when not given (the services' variable; not the generic REDIS_URL, which a shell may
hold for anything, and which would send a plain study through a Redis unasked)."""
PASSWORD_VAR = "TL_REDIS_PASSWORD"


class RunHandedOver(Exception):
    """The worker's run was taken over by another worker (its entry is no longer among this consumer's pending)."""


def connect_url(url: str) -> str:
    """The URL to connect with: `url` checked by the services' settings (`shared.config.CommonSettings`: the scheme,
    a password given twice, a placeholder password) with the password of `TL_REDIS_PASSWORD`, where set, put into
    it (percent-encoded). RedisServerError, one line, when the settings refuse them."""
    from pydantic import ValidationError

    from shared.redis_server import RedisServerError, redact_url

    try:
        s = _redis_settings()(TL_REDIS_URL=url, redis_password=os.environ.get(PASSWORD_VAR) or None)
    except ValidationError as exc:
        why = "; ".join(e["msg"].removeprefix("Value error, ") for e in exc.errors())
        raise RedisServerError(f"the study's Redis {redact_url(url)}: {why}") from None
    if s.redis_url is None or s.redis_password is None:
        return url
    parts = urlsplit(s.redis_url)
    user, _, host = parts.netloc.rpartition("@")
    netloc = f"{user}:{quote(s.redis_password.get_secret_value(), safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


@functools.lru_cache(maxsize=1)
def _redis_settings():
    """`shared.config.CommonSettings` reading only the values it is given (the rest of the environment, the services'
    settings, is not a study's)."""
    from shared.config import CommonSettings

    class RedisOnly(CommonSettings):
        @classmethod
        def settings_customise_sources(cls, settings_cls, init_settings, **_):
            return (init_settings,)

    return RedisOnly


def has_password(url: str) -> bool:
    """Whether `url` holds a password (what a command line should not)."""
    try:
        return bool(urlsplit(url).password)
    except ValueError:
        return "@" in url


@contextmanager
def url_in_env(url: str):
    """`TL_REDIS_URL` set to `url` in this process's environment meanwhile, for the worker processes started in it
    (spawned: they inherit it; `TL_REDIS_PASSWORD` is inherited as it is)."""
    before = os.environ.get(URL_VAR)
    os.environ[URL_VAR] = url
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(URL_VAR, None)
        else:
            os.environ[URL_VAR] = before


def env_url() -> str:
    """The Redis URL a worker process was given through its environment (`url_in_env`)."""
    return os.environ[URL_VAR]


def client(url: str):
    """A client of the study's Redis at `url` (its password from `TL_REDIS_PASSWORD` where the URL has none), the
    server pinged and its version checked (RedisServerError)."""
    import redis

    from shared.redis_server import check_redis_url

    full = connect_url(url)
    check_redis_url(full)
    return redis.Redis.from_url(full, socket_timeout=30, socket_connect_timeout=10, decode_responses=True)


def ensure_group(r, sid: str) -> None:
    import redis

    try:
        r.xgroup_create(key(sid, "runs"), GROUP, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def publish(r, sid: str, doc: dict, run_ids: list[str]) -> int:
    """Store the study's document with this process's code fingerprint and queue every run not queued before (failed
    ones again); returns how many were queued now."""
    from tradeloop.study.guard import code_fingerprint

    r.set(key(sid, "spec"), json.dumps({**doc, "code": code_fingerprint()}))
    ensure_group(r, sid)
    for rid in r.hkeys(key(sid, "failed")):            # a failed run is tried again by a new study process
        r.hdel(key(sid, "failed"), rid)
        r.srem(key(sid, "queued"), rid)
    enqueue = r.register_script(_ENQUEUE)
    done = set(r.hkeys(key(sid, "summaries")))
    return sum(int(enqueue(keys=[key(sid, "queued"), key(sid, "runs")], args=[rid]))
               for rid in run_ids if rid not in done)


def accounted(r, sid: str) -> tuple[set[str], dict[str, str]]:
    """(runs with a summary, failed runs → error): a run with a summary is never counted failed."""
    done = set(r.hkeys(key(sid, "summaries")))
    return done, {rid: err for rid, err in r.hgetall(key(sid, "failed")).items() if rid not in done}


class RedisSource:
    """A worker's view of the study's run stream: `get()` the next run id (None once every run is accounted for),
    then `done(...)`, `failed(...)` or `hand_over()`; `check()` at each epoch (RunHandedOver once another worker has
    taken the run over); `emit(event)` for progress."""

    def __init__(self, url: str, sid: str, n_runs: int, consumer: str | None = None):
        self.r, self.sid, self.n_runs = client(url), sid, n_runs
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.stream = key(sid, "runs")
        ensure_group(self.r, sid)
        self._entry: str | None = None
        self._lost: str | None = None            # the entry another worker took over from this one
        self._beat, self._fail = self.r.register_script(_BEAT), self.r.register_script(_FAIL)
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 — Redis away for a moment: the next beat tries again
                pass

    def beat(self) -> bool:
        """Re-claim the run's entry (its idle time reset) if it is still this consumer's; else mark the run lost to
        another worker (`check` raises then). Whether it is still this worker's (True with no run in hand)."""
        e = self._entry
        if e is None:
            return True
        if int(self._beat(keys=[self.stream], args=[GROUP, e, self.consumer])):
            return True
        if self._entry == e:
            self._lost = e
        return False

    def check(self) -> None:
        """RunHandedOver when the run in hand's entry was taken over by another worker (`beat` found it gone)."""
        if self._entry is not None and self._lost == self._entry:
            raise RunHandedOver(f"another worker took the run over (this one did not re-claim it for "
                                f"{CLAIM_IDLE_S:.0f} s)")

    def hand_over(self) -> bool:
        """Leave the run in hand to whoever holds it (another worker took it over, or a live process on this disk
        runs it): no failure stored, no ack; its entry stays pending, without this worker's heartbeat, for a later
        claim."""
        self._entry = None
        return True

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
                self._entry, self._lost = entry_id, None
                return rid

    def _finish(self) -> None:
        if self._entry is not None:
            self.r.xack(self.stream, GROUP, self._entry)
        self._entry = None

    def done(self, run_id: str, summary: dict) -> None:
        self.r.hsetnx(key(self.sid, "summaries"), run_id, json.dumps(summary))
        self._finish()

    def failed(self, run_id: str, error: str) -> None:
        """Store the run's failure and ack its entry, if the entry is still this worker's and the run has no summary
        (a run another worker has taken over or done is not this one's to fail)."""
        if self._entry is not None:
            self._fail(keys=[self.stream, key(self.sid, "summaries"), key(self.sid, "failed")],
                       args=[GROUP, self._entry, self.consumer, run_id, error])
        self._entry = None

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

