"""End to end: `tradeloop up` as a subprocess — embedded Redis, the three services, a tiny CPU config.

1. 3 epochs on `synthetic`: every epoch has exactly one checkpoint, one report and one bundle; bundle e was
   applied in epoch e + 1; the REST answers captured while the loop ran equal what Redis holds afterwards
   (the embedded server is started again on the run's AOF to read it).
2. Scale-out: `--evaluators 2` — both replicas join the consumer group and every checkpoint is evaluated
   exactly once.
The run is kept small with the trainer's size settings (TL_TRAIN_*, --data-bars, --iterations).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from shared.api import trainer_history_key
from shared.redis_server import EmbeddedRedis
from shared.store import run_key

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
EPOCHS = 3
TINY = {"TL_TRAIN_LEARNING_STARTS": "32", "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4",
        "OMP_NUM_THREADS": "1"}


def _up(tmp_path: Path, run_id: str, *extra: str) -> subprocess.Popen:
    """`tradeloop up` on free ports: it binds them itself (no window for another process to take one) and
    writes where the services listen to <run dir>/services.json."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TL_REDIS_URL")}
    env.update(TINY)
    cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--free-ports", "--epochs", str(EPOCHS), "--dataset", "synthetic",
           "--device", "cpu", "--data-bars", "1000", "--iterations", "6", "--no-dashboard", "--no-live",
           "--run-dir", str(tmp_path / "runs"), "--run-id", run_id, "--summary", str(tmp_path / "summary.json"),
           "--feedback-timeout", "200", "--timeout", "280", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _get(client: httpx.Client, url: str):
    try:
        r = client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _service_urls(services_file: Path, proc: subprocess.Popen, deadline: float) -> dict[str, str] | None:
    """The run's service URLs from services.json, once `up` has written it (None if `up` exited first)."""
    while proc.poll() is None:
        if services_file.exists():
            try:
                return json.loads(services_file.read_text())["urls"]
            except (json.JSONDecodeError, KeyError):
                pass  # being written
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"tradeloop up wrote no {services_file}:\n{proc.stdout.read()}")
        time.sleep(0.1)
    return None


def _wait_and_capture(proc: subprocess.Popen, services_file: Path, deadline_s: float) -> dict:
    """Poll the REST endpoints until `up` exits; keep the last answer of each."""
    seen: dict = {"history": None, "reports": {}, "signals": {}, "status": {}, "urls": None}
    deadline = time.monotonic() + deadline_s
    urls = _service_urls(services_file, proc, deadline)
    if urls is None:
        return seen
    seen["urls"] = urls
    t, e, f = urls["trainer"], urls["evaluator-1"], urls["feedback"]
    with httpx.Client() as c:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"tradeloop up did not finish in {deadline_s}s:\n{proc.stdout.read()}")
            h = _get(c, f"{t}/api/history")
            if h:
                seen["history"] = h
            for rec in h or []:
                ep = rec["epoch"]
                for kind, url in (("reports", f"{e}/reports/{ep}"), ("signals", f"{f}/signals/{ep}")):
                    if ep not in seen[kind]:
                        doc = _get(c, url)
                        if doc is not None:
                            seen[kind][ep] = doc
            for name, base in (("trainer", t), ("evaluator", e), ("feedback", f)):
                st = _get(c, f"{base}/status")
                if st is not None:
                    seen["status"][name] = st
            time.sleep(0.5)
    return seen


def _redis_of_run(run_dir: Path) -> EmbeddedRedis:
    """The run's embedded Redis started again on its AOF (same password file, a new free port)."""
    return EmbeddedRedis(run_dir / "redis").start()


def test_up_three_epochs_closes_the_loop(tmp_path):
    proc = _up(tmp_path, "e2e")
    seen = _wait_and_capture(proc, tmp_path / "runs" / "e2e" / "services.json", 290)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["redis"] == "embedded"
    rows = summary["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["checkpoint_id"] and len(r["checkpoint_sha256"]) == 64 and r["report_id"] and r["bundle_id"]
        assert r["evaluations"] == 1
        assert r["bundle_applied_in_epoch"] == (r["epoch"] + 1 if r["epoch"] < EPOCHS else None)
        assert r["feedback_timed_out"] is False
    assert rows[0]["trained_under_bundle_epoch"] is None
    assert [r["trained_under_bundle_id"] for r in rows[1:]] == [r["bundle_id"] for r in rows[:-1]]
    # the services reported their status while running
    assert seen["status"]["trainer"]["run_id"] == "e2e" and seen["status"]["trainer"]["pid"] > 0
    assert "stream_lag" in seen["status"]["evaluator"]
    assert seen["status"]["evaluator"]["warm_up_s"] > 0      # data, features and a pass were ready before epoch 1
    # the launcher bound the ports it wrote to services.json (the services answered there), and removed the file
    assert set(seen["urls"]) == {"trainer", "evaluator-1", "feedback"}
    assert not (tmp_path / "runs" / "e2e" / "services.json").exists()

    server = _redis_of_run(tmp_path / "runs" / "e2e")
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        # exactly one checkpoint, report, bundle per epoch — in the store and as events on the streams
        assert sorted(int(x) for x in r.zrange(run_key("e2e", "ckpt", "index"), 0, -1)) == [1, 2, 3]
        shas = r.hgetall(run_key("e2e", "ckpt", "sha256"))
        assert {int(k): v for k, v in shas.items()} == {x["epoch"]: x["checkpoint_sha256"] for x in rows}
        for kind in ("report", "bundle"):
            assert sorted(int(x) for x in r.zrange(run_key("e2e", kind, "index"), 0, -1)) == [1, 2, 3]
        for stream in ("checkpoints", "reports", "feedback"):
            events = [json.loads(f["data"]) for _, f in r.xrange(f"tl:e2e:stream:{stream}")]
            assert sorted(ev["epoch"] for ev in events) == [1, 2, 3], stream
        assert r.xlen("tl:e2e:stream:dead") == 0
        # REST answers == what Redis holds
        for ep in (1, 2, 3):
            if ep in seen["reports"]:
                assert seen["reports"][ep] == json.loads(r.get(run_key("e2e", "report", ep)))
            if ep in seen["signals"]:
                assert seen["signals"][ep] == json.loads(r.get(run_key("e2e", "bundle", ep)))
        assert seen["reports"] and seen["signals"], "no report/bundle was captured over REST while the loop ran"
        stored_hist = sorted((json.loads(v) for v in r.hgetall(trainer_history_key("e2e")).values()),
                             key=lambda x: x["epoch"])
        assert seen["history"] == stored_hist[:len(seen["history"])]
        # the knobs epoch e+1 trained under are bundle e's knobs
        for ep in (1, 2):
            bundle = json.loads(r.get(run_key("e2e", "bundle", ep)))
            assert stored_hist[ep]["knobs"] == bundle["knobs"]
    finally:
        r.close()
        server.stop()


def test_up_scale_out_two_evaluators_evaluate_each_checkpoint_once(tmp_path):
    proc = _up(tmp_path, "e2e2", "--evaluators", "2")
    _wait_and_capture(proc, tmp_path / "runs" / "e2e2" / "services.json", 290)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["evaluations"] == {"1": 1, "2": 1, "3": 1}
    server = _redis_of_run(tmp_path / "runs" / "e2e2")
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        # both replicas were up and in the group before the first checkpoint (the launcher starts the trainer
        # only once every consumer answers /ready); which one takes which checkpoint is Redis's scheduling, so
        # only membership is asserted, and exactly-once above
        logs = tmp_path / "runs" / "e2e2" / "logs"
        for name in ("evaluator-1", "evaluator-2"):
            assert "Application startup complete" in (logs / f"{name}.log").read_text(), name
        assert summary["restarts"].get("evaluator-1") == 0 and summary["restarts"].get("evaluator-2") == 0
        consumers = {c["name"] for c in r.xinfo_consumers("tl:e2e2:stream:checkpoints", "evaluator")}
        assert consumers and consumers <= {"evaluator-1", "evaluator-2"}
        group = next(g for g in r.xinfo_groups("tl:e2e2:stream:checkpoints") if g["name"] == "evaluator")
        assert group["pending"] == 0
        by = r.hgetall(run_key("e2e2", "evaluated_by"))
        assert set(by) == {"1", "2", "3"} and set(by.values()) <= consumers
    finally:
        r.close()
        server.stop()


def test_up_overlap_mode_applies_every_bundle_once_without_waiting_for_it(tmp_path):
    """--feedback-mode overlap: epoch e+1 starts without waiting for bundle e, which is applied at the first
    iteration boundary after it is stored (or, when it comes after that epoch ended, at the start of the next).
    Every bundle applied is applied exactly once, in a later epoch; only the last bundle before the end may find
    no epoch left (stored after the last epoch trained); an epoch's final knobs are those of the last bundle it
    applied."""
    proc = _up(tmp_path, "e2e3", "--feedback-mode", "overlap", "--iterations", "60")
    _wait_and_capture(proc, tmp_path / "runs" / "e2e3" / "services.json", 290)
    out = proc.stdout.read()
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = summary["epochs"]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for r in rows[:-1]:
        assert r["bundle_id"]
        if r["epoch"] < EPOCHS - 1:
            assert r["bundle_applied_in_epoch"] is not None, rows
        if r["bundle_applied_in_epoch"] is not None:
            assert r["epoch"] < r["bundle_applied_in_epoch"] <= r["epoch"] + 2
    server = _redis_of_run(tmp_path / "runs" / "e2e3")
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        hist = sorted((json.loads(v) for v in r.hgetall(trainer_history_key("e2e3")).values()),
                      key=lambda x: x["epoch"])
        applied = [b["epoch"] for h in hist[1:] for b in h["bundles_applied"]]
        assert sorted(applied) == sorted(set(applied)) and set(applied) <= {1, 2}, applied
        assert all(h["feedback_mode"] == "overlap" for h in hist[1:])
        iterations = 60
        for h in hist[1:]:
            for b in h["bundles_applied"]:
                assert 0 <= b["iteration"] < iterations and b["at"] > 0
            if h["bundles_applied"]:
                last = json.loads(r.get(run_key("e2e3", "bundle", h["bundles_applied"][-1]["epoch"])))
                assert h["knobs"] == last["knobs"] and h["bundle_epoch"] == last["epoch"]
                assert h["bundle_id"] == summary["epochs"][last["epoch"] - 1]["bundle_id"]
    finally:
        r.close()
        server.stop()
