"""Security under bad input, beyond what the unit tests of each module show.

- A pickle that would run code when unpickled (its payload creates a marker file) handed to the system through
  its entry points — `tradeloop evaluate --policy FILE`, and the evaluator service via Redis (a published
  checkpoint whose bytes are the pickle, sha256 matching) — is refused with a clear error and the marker never
  appears. A safetensors file with a bad header and bytes whose sha256 does not match are refused the same way.
- Bad bar files through every entry point that takes one: `tradeloop up --dataset`, `train --dataset`,
  `evaluate --dataset`, `backtest --data`, and the services' `TL_DATA` (`tradeloop serve trainer|evaluator`):
  exit 2, the file and row named, no traceback, and nothing stored before (run directory files, Redis keys) lost.
- In embedded mode a service process listens on 127.0.0.1 only (read from /proc/net/tcp of the real process).
- A Redis older than 6.2 is refused at connect (`Bus.connect`, `check_redis_url`, `tradeloop up` with REDIS_URL).
- The bearer token is compared in constant time (`hmac.compare_digest` is what decides).
- A placeholder API token or Redis password ("change-me…") is refused in every mode, naming the variable.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from polling import poll_until
from shared.checkpoints import checkpoint_sha256, save_checkpoint
from shared.redis_server import RedisServerError, free_port

ROOT = Path(__file__).resolve().parents[1]
BAD_CSV = ("timestamp,open,high,low,close,volume\n2021-01-04,100,101,99,100.5,10\n"
           "2021-01-05,100.5,99,100,101,12\n2021-01-06,101,103,100.5,102,9\n")  # line 3: high < open/close/low


class _Boom:
    """Unpickling this creates `marker`: proof that something was unpickled."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _cli(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TL_REDIS_URL") and not k.startswith("TL_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "tradeloop.cli", *args], env=e, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def _snapshot(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


# ------------------------------------------------------------------------------------------------------------
# checkpoints through the entry points
# ------------------------------------------------------------------------------------------------------------
def _bad_checkpoints(tmp_path: Path) -> dict[str, Path]:
    """name → a file with a matching sidecar (so the refusal is about the content, not a missing digest)."""
    marker = tmp_path / "UNPICKLED"
    files = {"pickle": pickle.dumps(_Boom(str(marker)), protocol=4)}
    import torch

    good = tmp_path / "good.safetensors"
    save_checkpoint(good, {"w": torch.ones(3)}, {"kind": "test"})
    data = good.read_bytes()
    files["bad header"] = (10**12).to_bytes(8, "little") + data[8:]       # header length beyond any bound
    files["header not json"] = data[:8] + b"\x00" * (len(data) - 8)
    out = {}
    for name, blob in files.items():
        p = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        p.write_bytes(blob)
        p.with_name(p.name + ".sha256").write_text(f"{checkpoint_sha256(blob)}  {p.name}\n")
        out[name] = p
    mism = tmp_path / "mismatch.safetensors"
    mism.write_bytes(data)
    mism.with_name(mism.name + ".sha256").write_text(f"{'0' * 64}  {mism.name}\n")
    out["sha256 mismatch"] = mism
    return out


def test_evaluate_refuses_bad_checkpoints_and_runs_nothing(tmp_path):
    files = _bad_checkpoints(tmp_path)
    expect = {"pickle": "Python pickle is not a safetensors file and will not be unpickled",
              "bad header": "exceeds", "header not json": "not valid JSON", "sha256 mismatch": "sha256 mismatch"}
    for name, path in files.items():
        r = _cli("evaluate", "--policy", str(path), "--dataset", "synthetic", "--split", "val")
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        assert expect[name] in r.stderr and str(path) in r.stderr, (name, r.stderr)
        assert "Traceback" not in r.stderr + r.stdout
    assert not (tmp_path / "UNPICKLED").exists()


@pytest.mark.redis
async def test_evaluator_service_dead_letters_a_pickled_checkpoint_without_unpickling(redis_url, run_id, tmp_path,
                                                                                      monkeypatch):
    from services.evaluator.worker import EvaluatorServiceSettings, EvaluatorWorker
    from shared.api import ServiceState
    from shared.bus import Bus
    from shared.events import CheckpointPublished

    marker = tmp_path / "UNPICKLED"
    blob = pickle.dumps(_Boom(str(marker)), protocol=4)
    settings = EvaluatorServiceSettings(redis_url=redis_url, run_id=run_id, consumer_name="sec")
    async with Bus(redis_url, run_id) as bus:
        worker = EvaluatorWorker(settings, bus, ServiceState("evaluator", run_id))
        await bus.ensure_group(worker.consumer.stream, "evaluator")
        _, sha = await bus.store.put_checkpoint(1, blob)
        await bus.store.put_checkpoint(2, b"\x00" * 64)
        for epoch, digest in ((1, sha), (2, "ab" * 32)):   # epoch 2: the event's sha256 is not the bytes'
            await bus.publish(CheckpointPublished(run_id=run_id, epoch=epoch, checkpoint_id=f"c{epoch}", sha256=digest,
                                                  key=bus.store.key("ckpt", epoch), size_bytes=64, config_hash="h"))
        await worker.consumer.run_burst()
        dead = {d.epoch: d.reason for d in await bus.dead_letters()}
        assert set(dead) == {1, 2}
        assert "pickle" in dead[1] and "will not be unpickled" in dead[1] and dead[1].startswith("handler failed 3")
        assert "sha256 mismatch" in dead[2]
        assert await bus.store.json_epochs("report") == []
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------------------
# bad bar files through every entry point
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def stored(tmp_path, redis_server, run_id):
    """A run directory with files and Redis keys of an earlier run; yields (bad csv, run dir, check())."""
    bad = tmp_path / "BAD.csv"
    bad.write_text(BAD_CSV)
    run_dir = tmp_path / "runs" / run_id
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "epoch-0001.safetensors").write_bytes(b"earlier epoch")
    (run_dir / "history.jsonl").write_text('{"epoch": 1}\n')
    (run_dir / "run.json").write_text('{"dataset": "synthetic"}')
    r = redis.Redis.from_url(redis_server, socket_timeout=5)
    keys = {f"tl:{run_id}:report:1": b'{"epoch": 1}', f"tl:{run_id}:ckpt:1": b"bytes"}
    for k, v in keys.items():
        r.set(k, v)
    files = _snapshot(tmp_path / "runs")

    def check():
        assert _snapshot(tmp_path / "runs") == files, "a file stored before was changed or removed"
        assert {k: r.get(k) for k in keys} == keys, "a Redis key stored before was changed or removed"
    try:
        yield bad, run_dir, check
    finally:
        r.delete(*keys)
        r.close()


@pytest.mark.redis
@pytest.mark.parametrize("entry", ["up", "train", "evaluate", "backtest", "serve trainer", "serve evaluator"])
def test_bad_bar_file_is_refused_everywhere_nothing_stored_lost(entry, stored, redis_server, run_id, tmp_path):
    bad, run_dir, check = stored
    env = {"OMP_NUM_THREADS": "1"}
    if entry == "up":
        env["REDIS_URL"] = redis_server
        args = ["up", "--dataset", str(bad), "--run-dir", str(run_dir.parent), "--run-id", run_id, "--no-dashboard",
                "--free-ports", "--epochs", "1"]
    elif entry == "train":
        args = ["train", "--dataset", str(bad), "--epochs", "1", "--out", str(run_dir)]
    elif entry == "evaluate":
        args = ["evaluate", "--policy", "flat", "--dataset", str(bad)]
    elif entry == "backtest":
        pos = tmp_path / "pos.csv"
        pos.write_text("timestamp,position\n2021-01-04,1\n")
        args = ["backtest", "--data", str(bad), "--positions", str(pos)]
    else:
        env.update(TL_DATA=str(bad), TL_REDIS_URL=redis_server, TL_RUN_ID=run_id, TL_RUN_DIR=str(run_dir.parent),
                   TL_TRAINER_PORT=str(free_port()), TL_EVALUATOR_PORT=str(free_port()))
        args = entry.split()
    r = _cli(*args, env=env)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert "Traceback" not in out
    assert "BAD.csv" in r.stderr and "3" in r.stderr and "high" in r.stderr.lower(), r.stderr
    check()


# ------------------------------------------------------------------------------------------------------------
# network exposure, server version, token comparison
# ------------------------------------------------------------------------------------------------------------
def _listening(port: int) -> set[str]:
    """Local addresses with a LISTEN socket on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            addr, state = parts[1], parts[3]
            host, p = addr.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                found.add(host)
    return found


@pytest.mark.redis
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads /proc/net/tcp (Linux)")
def test_embedded_service_listens_on_loopback_only(redis_server, run_id):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    env.update(TL_REDIS_URL=redis_server, TL_RUN_ID=run_id, TL_FEEDBACK_PORT=str(port), TL_EMBEDDED="true")
    proc = subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "serve", "feedback"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        poll_until(lambda: _listening(port), "the feedback service to listen", timeout_s=60,
                   alive=lambda: proc.poll() is None)
        assert _listening(port) == {"0100007F"}  # 127.0.0.1, little-endian hex; nothing on 0.0.0.0 or ::
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    # and embedded mode refuses to bind anything else
    env["TL_HOST"] = "0.0.0.0"
    r = subprocess.run([sys.executable, "-m", "tradeloop.cli", "serve", "feedback"], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "TL_HOST" in r.stderr and "loopback" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.redis
async def test_too_old_redis_is_refused_at_connect(redis_url, run_id, monkeypatch):
    from shared.bus import Bus

    async with Bus(redis_url, run_id) as bus:
        assert await bus.connect()  # the real server passes

        async def old_info(*a, **k):
            return {"redis_version": "6.0.16"}
        monkeypatch.setattr(bus.redis, "info", old_info)
        with pytest.raises(RedisServerError, match=r"6\.0\.16 is too old; tradeloop needs Redis >= 6\.2"):
            await bus.connect()


@pytest.mark.redis
def test_up_refuses_a_too_old_external_redis(redis_url, monkeypatch, tmp_path):
    from shared import redis_server as rs

    monkeypatch.setattr(redis.Redis, "info", lambda self, *a, **k: {"redis_version": "5.0.7"})
    with pytest.raises(RedisServerError, match="5.0.7 is too old"):
        rs.check_redis_url(redis_url)
    from tradeloop.cmd_up import run_up

    monkeypatch.setenv("REDIS_URL", redis_url)
    code = run_up(epochs=1, dataset="synthetic", device="cpu", summary=None, evaluators=1, run_id="old",
                  run_dir=tmp_path, config="small", free_ports=True, dashboard=False, feedback_timeout=1.0,
                  timeout=1.0, live=False, extra_env={})
    assert code == 2 and not (tmp_path / "old" / "logs").exists()  # nothing was started


def test_token_is_compared_in_constant_time(monkeypatch):
    import hmac

    from fastapi import HTTPException
    from starlette.requests import Request

    from shared import api
    from shared.config import CommonSettings

    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(api.hmac, "compare_digest", spy)
    check = api.token_checker(CommonSettings(api_token="s3cret", embedded=True))

    def req(header: str | None) -> Request:
        headers = [] if header is None else [(b"authorization", header.encode())]
        return Request({"type": "http", "headers": headers, "method": "POST", "path": "/"})
    check(req("Bearer s3cret"))
    for header, code in (("Bearer s3cre", 403), ("Bearer s3cretX", 403), (None, 401), ("Basic s3cret", 401)):
        with pytest.raises(HTTPException) as exc:
            check(req(header))
        assert exc.value.status_code == code
    # every well-formed attempt went through compare_digest (never ==), with the expected token as one side
    assert [c[1] for c in calls] == [b"s3cret"] * 3 and [c[0] for c in calls] == [b"s3cret", b"s3cre", b"s3cretX"]


@pytest.mark.parametrize("var", ["TL_API_TOKEN", "TL_REDIS_PASSWORD"])
@pytest.mark.parametrize("value", ["change-me-api-token", "change-me-redis-password", "CHANGE-ME", "changeme123",
                                   "change_me"])
@pytest.mark.parametrize("embedded", [False, True])
def test_placeholder_secrets_are_refused(monkeypatch, var, value, embedded):
    """A placeholder secret ("change-me…", the form of an example file's values) is refused as API token and as
    Redis password, in every mode, with one line naming the variable and not echoing the value."""
    from shared.config import ConfigError, TrainerSettings, is_placeholder, load_settings

    for k in list(os.environ):
        if k.startswith("TL_") or k == "REDIS_URL":
            monkeypatch.delenv(k)
    env = {"TL_EMBEDDED": str(embedded).lower(), "TL_HOST": "127.0.0.1" if embedded else "0.0.0.0",
           "TL_API_TOKEN": "a-real-secret", "TL_REDIS_URL": "redis://redis:6379/0", "TL_REDIS_PASSWORD": "pw-9$x",
           var: value}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert is_placeholder(value)
    with pytest.raises(ConfigError) as exc:
        load_settings(TrainerSettings)
    reason = str(exc.value).splitlines()[-1].strip()
    assert reason.startswith(f"{var} is a placeholder") and value not in str(exc.value), str(exc.value)


def test_real_secrets_are_not_placeholders(monkeypatch):
    from shared.config import CommonSettings, is_placeholder

    for secret in ("s3cret", "my-change-me", "e2e/pa@ss+w0rd=", "changing-me", ""):
        assert not is_placeholder(secret), secret
    assert CommonSettings(api_token="not-change-me", redis_password="x change-me", embedded=False, host="0.0.0.0")
