"""The run's Redis dying under `tradeloop up`: the launcher starts an embedded redis-server that was SIGKILLed again on
its AOF (within a restart budget, then the run stops saying why), says when an external Redis stops and starts
answering, and the services log an outage once when it starts and once when it ends. Real redis-server processes
killed with SIGKILL, a real `up` run on the e2e tests' tiny CPU config."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import httpx
import pytest
import redis
from polling import poll_until
from test_up_runs import _env, _finish, _status, _up

from shared.redis_server import EmbeddedRedis, RedisOutageLog
from tradeloop.up.progress import RedisWatch

pytestmark = [pytest.mark.redis]


def _server_pids(sock: str) -> list[int]:
    """Live processes whose command line names `sock` (redis-server sets its title to the address it serves)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"redis-server" in cmdline and os.fsencode(sock) in cmdline:
            pids.append(int(d.name))
    return pids


def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(caplog):
    out = RedisOutageLog(logging.getLogger("tradeloop.test"))
    with caplog.at_level(logging.INFO, logger="tradeloop.test"):
        out.answered()                                   # no outage: nothing to say
        for _ in range(5):
            out.failed("ConnectionError: Connection refused")
        out.answered()
        out.answered()
    assert [(r.levelname, r.getMessage().split(" (")[0].split(" after")[0]) for r in caplog.records] == [
        ("WARNING", "Redis unreachable"), ("INFO", "Redis answers again")], caplog.text
    assert caplog.records[0].getMessage() == ("Redis unreachable (ConnectionError: Connection refused); retrying until "
                                              "it answers")
    assert "(5 failed tries)" in caplog.records[1].getMessage()


def test_the_watch_restarts_a_killed_embedded_redis_on_its_aof_until_its_budget_is_spent(tmp_path):
    srv = EmbeddedRedis(tmp_path / "redis").start()
    client = redis.Redis.from_url(srv.url, socket_timeout=2)
    try:
        client.set("acked", "1")
        watch = RedisWatch(srv, client, restarts=1)
        assert watch.poll() == []
        first = srv.pid
        srv.kill()                                       # SIGKILL
        lines = poll_until(watch.poll, "the watch to notice the exit", timeout_s=10)
        assert lines[0].startswith("the embedded Redis exited (killed by SIGKILL); its log ends: "), lines
        assert "restarting it in 1s on its AOF" in lines[0], lines
        lines = poll_until(watch.poll, "the restart", timeout_s=20)
        assert lines[0].startswith(f"the embedded Redis was restarted on {srv.socket_path} (restart #1"), lines
        assert srv.running and srv.pid != first and watch.restarts == 1
        assert client.get("acked") == b"1"               # the acknowledged write, replayed from the AOF
        srv.kill()                                       # again, the budget (1 in a row) spent: the run must stop
        poll_until(watch.poll, "the second exit", timeout_s=10)
        assert watch.failure == ("the embedded Redis stopped again after 1 restarts in a row "
                                 f"(its log: {srv.data_dir / 'redis.log'})"), watch.failure
        assert not srv.running and watch.poll() == []
    finally:
        client.close()
        srv.stop()


def test_an_external_redis_that_stops_answering_is_said_once_and_so_is_its_return(tmp_path):
    srv = EmbeddedRedis(tmp_path / "ext", tcp=True).start()        # an "external" Redis: the watch has no server
    client = redis.Redis.from_url(srv.url, socket_timeout=2, socket_connect_timeout=2)
    try:
        watch = RedisWatch(None, client, quiet_s=0.5)
        assert watch.poll() == []
        srv.kill()
        lines = poll_until(watch.poll, "the outage to be said", timeout_s=10)
        assert len(lines) == 1 and lines[0].startswith(f"Redis at redis://{srv.host}:{srv.port}/0 has not answered "
                                                       "for "), lines
        assert "the services retry until it does" in lines[0]
        assert all(watch.poll() == [] for _ in range(3))   # said once
        srv.start()
        lines = poll_until(watch.poll, "the return to be said", timeout_s=10)
        assert len(lines) == 1 and lines[0].startswith(f"Redis at redis://{srv.host}:{srv.port}/0 answers again"), lines
        assert watch.poll() == [] and watch.failure is None
    finally:
        client.close()
        srv.stop()


@pytest.mark.e2e
def test_a_run_whose_redis_is_killed_restarts_it_and_finishes_its_epochs(tmp_path):
    """kill -9 of the embedded redis-server while the trainer waits for epoch 1's feedback: the launcher says so and
    starts it again on its AOF, the services log the outage once each, and the run finishes all its epochs. It used to
    print nothing more and hang until --timeout, the trainer retrying its Redis calls without a word."""
    runs = tmp_path / "runs"
    run = runs / "rk"
    proc = _up(_env(runs), "--run-id", "rk", "--epochs", "3", "--iterations", "20", "--timeout", "400")
    alive = lambda: proc.poll() is None or pytest.fail(_finish(proc))  # noqa: E731
    poll_until(lambda: (run / "services.json").exists(), "the run to start", timeout_s=60, alive=alive)
    sock = json.loads((run / "services.json").read_text())["redis_socket"]
    (first,) = _server_pids(sock)
    with httpx.Client() as c:
        poll_until(lambda: (s := _status(c, run / "services.json")) and s.get("phase") == "waiting_feedback",
                   "the trainer waiting for epoch 1's feedback", timeout_s=200, interval_s=0.05, alive=alive)
    os.kill(first, signal.SIGKILL)
    poll_until(lambda: [p for p in _server_pids(sock) if p != first], "the restarted redis-server", timeout_s=60,
               alive=alive)
    out = _finish(proc, timeout_s=400)
    assert proc.returncode == 0, out
    assert "the embedded Redis exited (killed by SIGKILL); its log ends: " in out, out
    assert f"the embedded Redis was restarted on {sock} (restart #1" in out, out
    assert "Traceback" not in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 3, summary
    assert summary["restarts"]["redis"] == 1, summary["restarts"]
    assert all(e["checkpoint_sha256"] and e["report_id"] and e["bundle_id"] for e in summary["epochs"]), summary
    for service in ("trainer", "evaluator-1", "feedback"):
        log = (run / "logs" / f"{service}.log").read_text()
        assert log.count("Redis unreachable (") == 1 and log.count("Redis answers again after") == 1, (service, log)
