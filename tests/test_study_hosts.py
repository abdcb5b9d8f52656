"""A study shared through Redis by worker hosts, against the session's real Redis server and real processes: the
Redis URL and its password from the environment (never on a worker's command line, a warning where given there),
the code fingerprint a worker host must share, a run another worker holds left to it (never failed), a host whose
worker process was killed failing loudly, and one study process per out directory."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.polling import poll_until
from tests.test_study import ROOT, TINY, _env, _pids

ONE_RUN = "off-s0-f0"


def _tiny(tmp_path: Path, epochs: int = 2) -> Path:
    """A study of one run (variant off, seed 0, fold 0) of `epochs` tiny epochs."""
    path = tmp_path / "one.toml"
    path.write_text(TINY.replace("seeds = 2", "seeds = 1").replace("folds = 2", "folds = 1")
                    .replace("epochs = 2", f"epochs = {epochs}").replace("[variants.on]\n", ""))
    return path


def _study(cfg: Path, out: Path, parallel: int = 1) -> list[str]:
    return [sys.executable, "-m", "tradeloop.cli", "study", "--config", str(cfg), "--out", str(out),
            "--parallel", str(parallel)]


def _worker(sid: str, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tradeloop.cli", "study-worker", "--study", sid, "--out", str(out), *extra]


def _split(url: str) -> tuple[str, str]:
    """(the URL without its password, the password)."""
    import redis as redis_py

    password = redis_py.connection.parse_url(url)["password"]
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{rest.split('@', 1)[1]}", password


def _env_with(url: str | None = None, password: str | None = None) -> dict:
    env = {k: v for k, v in _env().items() if k not in ("TL_REDIS_URL", "REDIS_URL", "TL_REDIS_PASSWORD")}
    if url is not None:
        env["TL_REDIS_URL"] = url
    if password is not None:
        env["TL_REDIS_PASSWORD"] = password
    return env


def _published(url: str, cfg: Path, out: Path):
    """A study of `cfg` prepared in `out` and published in the Redis at `url` as the study process does: (spec,
    sid, client)."""
    import redis as redis_py

    from tradeloop.cmd_study import build_spec
    from tradeloop.study.guard import code_fingerprint
    from tradeloop.study.remote import publish, study_id
    from tradeloop.study.runner import prepare

    spec, _ = build_spec({"config": str(cfg), "out": str(out)}, remote=True)
    prepare(spec, out)
    sid = study_id(spec.identity())
    r = redis_py.Redis.from_url(url, decode_responses=True)
    code_fingerprint.cache_clear()         # the code as it is now, as a study process started now hashes it
    publish(r, sid, json.loads((out / "study.json").read_text()), [x.run_id for x in spec.runs()])
    return spec, sid, r


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _environ(pid: int) -> str:
    return Path(f"/proc/{pid}/environ").read_bytes().replace(b"\0", b"\n").decode()


@pytest.mark.redis
def test_the_study_takes_its_redis_and_password_from_the_environment_and_its_workers_get_them_there(tmp_path,
                                                                                                   redis_url):
    """No --redis: TL_REDIS_URL (password-less) and TL_REDIS_PASSWORD send the study through that Redis; its worker
    processes find the URL in their environment, the password on no command line; the run's summary names the host
    and the code that ran it."""
    from tradeloop.study.remote import key, study_id

    bare, password = _split(redis_url)
    out = tmp_path / "coord"
    coord = subprocess.Popen(_study(_tiny(tmp_path), out), cwd=ROOT, env=_env_with(bare, password),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        pids = poll_until(lambda: _pids(out), "the worker's run", timeout_s=150, alive=lambda: coord.poll() is None)
        try:
            worker_cmd, worker_env = _cmdline(pids[0]), _environ(pids[0])
        except FileNotFoundError:
            pytest.fail("the worker process ended before it could be read")
        own_cmd = _cmdline(coord.pid)
        text = coord.communicate(timeout=300)[0]
    finally:
        if coord.poll() is None:
            coord.kill()
    assert coord.returncode == 0, text[-3000:]
    sid = study_id(json.loads((out / "study.json").read_text())["identity"])
    assert f"study {sid} in" in text and "goes through the Redis of TL_REDIS_URL" in text, text[-3000:]
    assert password not in worker_cmd and password not in own_cmd and "warning" not in text
    assert f"TL_REDIS_URL={bare}\n" in worker_env
    import redis as redis_py

    r = redis_py.Redis.from_url(redis_url, decode_responses=True)
    summary = json.loads((out / "runs" / ONE_RUN / "summary.json").read_text())
    assert summary["host"] == socket.gethostname()
    assert summary["code"] == json.loads(r.get(key(sid, "spec")))["code"]
    assert set(summary["code"]) == {"version", "sources"} and len(summary["code"]["sources"]) == 64


@pytest.mark.redis
def test_a_password_in_redis_on_the_command_line_is_warned_of_in_one_line(tmp_path, redis_url):
    """`--redis URL` with a password in it: one warning line saying to use the variable; the same URL from
    TL_REDIS_URL: none."""
    said = subprocess.run(_worker("000000000000", tmp_path / "h", "--redis", redis_url), cwd=ROOT, env=_env_with(),
                          capture_output=True, text=True, timeout=120)
    assert said.returncode == 2 and "no such study" in said.stderr, said.stderr
    warnings = [line for line in said.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "TL_REDIS_URL" in warnings[0] and "Traceback" not in said.stderr
    quiet = subprocess.run(_worker("000000000000", tmp_path / "h"), cwd=ROOT, env=_env_with(redis_url),
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 2 and "no such study" in quiet.stderr and "warning" not in quiet.stderr


def test_the_password_comes_from_tl_redis_password_by_the_services_rule(monkeypatch):
    """`connect_url`: TL_REDIS_PASSWORD put into a password-less URL (percent-encoded); a password given twice and
    a placeholder refused as the services' settings refuse them, in one line."""
    import redis as redis_py

    from shared.redis_server import RedisServerError
    from tradeloop.study.remote import connect_url

    monkeypatch.setenv("TL_REDIS_PASSWORD", "p@ss/w:rd")
    monkeypatch.setenv("TL_HOST", "0.0.0.0")            # the services' other settings are not the study's
    full = connect_url("redis://db.example:6380/2")
    assert redis_py.connection.parse_url(full)["password"] == "p@ss/w:rd"
    assert redis_py.connection.parse_url(connect_url("unix:///tmp/r.sock?db=0"))["password"] == "p@ss/w:rd"
    with pytest.raises(RedisServerError, match="given twice") as twice:
        connect_url("redis://:other@db.example:6380/2")
    assert "\n" not in str(twice.value) and "other" not in str(twice.value)
    monkeypatch.setenv("TL_REDIS_PASSWORD", "change-me-now")
    with pytest.raises(RedisServerError, match="placeholder"):
        connect_url("redis://db.example:6380/2")
    monkeypatch.delenv("TL_REDIS_PASSWORD")
    assert connect_url("redis://:mine@db.example:6380/2") == "redis://:mine@db.example:6380/2"


@pytest.mark.redis
def test_a_worker_host_running_other_code_is_refused_in_one_line(tmp_path, redis_url):
    """The study process publishes its code fingerprint; a `study-worker` whose code differs refuses the study
    (exit 2, one line naming both), and takes no run."""
    from tradeloop.study.remote import key

    _, sid, r = _published(redis_url, _tiny(tmp_path), tmp_path / "coord")
    doc = json.loads(r.get(key(sid, "spec")))
    r.set(key(sid, "spec"), json.dumps({**doc, "code": {"version": "0.0.9", "sources": "f" * 64}}))
    p = subprocess.run(_worker(sid, tmp_path / "host"), cwd=ROOT, env=_env_with(redis_url), capture_output=True,
                       text=True, timeout=150)
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.count("\n") == 1 and "this host runs other code" in p.stderr
    assert "tradeloop 0.0.9, sources ffffffffffff" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "host" / "runs").exists() and not r.hkeys(key(sid, "failed"))
    from tradeloop.study.guard import code_fingerprint

    assert doc["code"] == code_fingerprint()                  # what the study process published


def _held_lock(run_dir: Path) -> subprocess.Popen:
    """A live process holding a run directory's lock (as a worker running it on this disk does) until its stdin
    closes."""
    code = ("import sys; from pathlib import Path; from tradeloop.study.worker import lock_run; "
            f"lock = lock_run(Path({str(run_dir)!r})); print('locked', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def _stalled(r, sid: str, entry: str, owner: str) -> None:
    """The entry left unclaimed past `CLAIM_IDLE_S` by its owner (as a worker that stalled leaves it)."""
    from tradeloop.study.remote import CLAIM_IDLE_S, GROUP, key

    r.xclaim(key(sid, "runs"), GROUP, owner, 0, [entry], idle=int(CLAIM_IDLE_S * 1000) + 1000, justid=True)


def _owner(r, sid: str) -> list[str]:
    from tradeloop.study.remote import GROUP, key

    return [p["consumer"] for p in r.xpending_range(key(sid, "runs"), GROUP, "-", "+", 10)]


@pytest.mark.redis
def test_a_run_taken_over_from_a_stalled_worker_on_the_same_disk_is_never_failed_nor_claimed_back(tmp_path,
                                                                                                  redis_url):
    """Worker a stalls with the run (its directory locked on this disk); worker b takes the entry over (XAUTOCLAIM)
    and finds the run locked: it leaves it to a, stores no failure. a's heartbeat then finds the entry no longer its
    own and does not claim it back, and a stops the run."""
    from tradeloop.study.remote import RedisSource, key
    from tradeloop.study.worker import DataCache, run_task

    out = tmp_path / "coord"
    spec, sid, r = _published(redis_url, _tiny(tmp_path), out)
    a, b = (RedisSource(redis_url, sid, 1, consumer=c) for c in ("a", "b"))
    try:
        assert a.get() == ONE_RUN
        holder = _held_lock(out / "runs" / ONE_RUN)
        try:
            _stalled(r, sid, a._entry, "a")
            assert b.get() == ONE_RUN and _owner(r, sid) == ["b"]
            run_task(spec, out, ONE_RUN, DataCache(spec), b, 0, None)
        finally:
            holder.communicate("")
        assert not r.hkeys(key(sid, "failed")) and _owner(r, sid) == ["b"]       # pending: a later claim runs it
        events = [json.loads(f["data"]) for _, f in r.xrange(key(sid, "events"))]
        assert [e["type"] for e in events] == ["start", "handed-over"] and "another process" in events[1]["why"]
        assert a.beat() is False and _owner(r, sid) == ["b"]                       # not claimed back by a
        from tradeloop.study.remote import RunHandedOver

        with pytest.raises(RunHandedOver):
            a.check()
        a.failed(ONE_RUN, "whatever a met after")                                    # not a's to fail any more
        assert not r.hkeys(key(sid, "failed")) and _owner(r, sid) == ["b"]
    finally:
        a.close()
        b.close()


@pytest.mark.redis
def test_a_worker_that_lost_its_run_stops_it_at_the_epochs_end(tmp_path, redis_url):
    """A worker whose run was taken over by another trains no further than the epoch in hand: the run stops there,
    unfailed, no summary, reported as handed over."""
    from tradeloop.study.remote import RedisSource, key
    from tradeloop.study.worker import DataCache, run_task

    out = tmp_path / "coord"
    spec, sid, r = _published(redis_url, _tiny(tmp_path, epochs=3), out)
    a, b = (RedisSource(redis_url, sid, 1, consumer=c) for c in ("a", "b"))
    try:
        assert a.get() == ONE_RUN
        _stalled(r, sid, a._entry, "a")
        assert b.get() == ONE_RUN
        assert a.beat() is False
        run_task(spec, out, ONE_RUN, DataCache(spec), a, 0, None)
    finally:
        a.close()
        b.close()
    loop = out / "runs" / ONE_RUN / "loop"
    assert sorted(p.name for p in loop.glob("epoch-*.json")) == ["epoch-0001.json"]
    assert not (out / "runs" / ONE_RUN / "summary.json").exists() and not r.hkeys(key(sid, "failed"))
    assert [json.loads(f["data"])["type"] for _, f in r.xrange(key(sid, "events"))][-1] == "handed-over"


@pytest.mark.redis
def test_a_run_with_a_summary_is_never_counted_failed(redis_url):
    """A run one worker stored a failure for and another finished: the study counts it done, not failed."""
    import redis as redis_py

    from tradeloop.study.remote import accounted, key

    r = redis_py.Redis.from_url(redis_url, decode_responses=True)
    r.hset(key("s1", "failed"), mapping={"a": "RunBusy: locked", "b": "boom"})
    r.hset(key("s1", "summaries"), "a", "{}")
    assert accounted(r, "s1") == ({"a"}, {"b": "boom"})


@pytest.mark.redis
def test_a_hosts_worker_process_killed_mid_run_fails_the_study_worker_saying_so(tmp_path, redis_url):
    """`study-worker --parallel 1`, its worker process killed by SIGKILL mid-run: the command names it ("killed by
    SIGKILL (out of memory?)") and exits 1 (it said "done here: 0 run(s)" and exited 0)."""
    _, sid, _ = _published(redis_url, _tiny(tmp_path, epochs=40), tmp_path / "coord")   # mid-run when killed
    host = tmp_path / "host"
    w = subprocess.Popen(_worker(sid, host, "--parallel", "1"), cwd=ROOT, env=_env_with(redis_url),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid = poll_until(lambda: _pids(host), "the host's worker's run", timeout_s=150,
                         alive=lambda: w.poll() is None)[0]
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = w.communicate(timeout=120)
    finally:
        if w.poll() is None:
            w.kill()
    assert w.returncode == 1, stdout[-2000:] + stderr[-2000:]
    assert f"worker 0 (pid {pid}) killed by SIGKILL (out of memory?)" in stdout + stderr
    assert "error: 1 of 1 worker process(es) of this host died" in stderr and "Traceback" not in stderr


def test_a_second_study_on_the_same_out_is_refused_naming_the_first(tmp_path):
    """Two `tradeloop study` on one --out: the second is refused at once (exit 2, one line naming the first's pid),
    study.json untouched although its --parallel differs, while the first runs on."""
    cfg, out = _tiny(tmp_path, epochs=40), tmp_path / "study"   # still running when the second starts
    first = subprocess.Popen(_study(cfg, out), cwd=ROOT, env=_env_with(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        poll_until(lambda: _pids(out), "the first study's run", timeout_s=150, alive=lambda: first.poll() is None)
        before = (out / "study.json").read_bytes()
        second = subprocess.run(_study(cfg, out, parallel=2), cwd=ROOT, env=_env_with(), capture_output=True,
                                text=True, timeout=150)
        assert (out / "study.json").read_bytes() == before      # refused before it read or wrote anything there
        assert first.poll() is None
    finally:
        first.kill()
        first.communicate()
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"pid {first.pid} on {socket.gethostname()}" in errors[0], second.stderr
    assert "Traceback" not in second.stderr
    assert json.loads((out / "status.json").read_text())["pid"] == first.pid


def test_a_generic_redis_url_in_the_shell_leaves_a_plain_study_local(tmp_path):
    """REDIS_URL (which a shell may hold for anything; here a port nothing listens on) does not send `tradeloop
    study` through a Redis: only TL_REDIS_URL or --redis do, and the study says so when the variable did."""
    env = {**_env_with(), "REDIS_URL": "redis://127.0.0.1:1/0"}
    r = subprocess.run(_study(_tiny(tmp_path, epochs=1), tmp_path / "s"), cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "goes through the Redis" not in r.stderr and (tmp_path / "s" / "results.json").exists()
