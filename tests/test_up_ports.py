"""`tradeloop up` binds every service's port itself and holds it: a taken port is refused up front with a
clear message, and a service the supervisor restarts serves again on the same socket (no other process can
take its port while it is down). Real sockets, real processes, real Redis."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from polling import poll_until

from tradeloop.up.endpoints import bind_listeners, wanted_ports
from tradeloop.up.supervisor import ServiceProc, Supervisor

ROOT = Path(__file__).resolve().parents[1]


def test_wanted_ports_fixed_free_and_replicas(monkeypatch):
    for var in ("TL_TRAINER_PORT", "TL_EVALUATOR_PORT", "TL_FEEDBACK_PORT", "TL_DASHBOARD_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert wanted_ports(1, False, True) == {"trainer": 8001, "feedback": 8003, "evaluator-1": 8002,
                                            "dashboard": 8000}
    monkeypatch.setenv("TL_EVALUATOR_PORT", "9100")
    assert wanted_ports(3, False, False) == {"trainer": 8001, "feedback": 8003, "evaluator-1": 9100,
                                             "evaluator-2": 9110, "evaluator-3": 9120}
    assert set(wanted_ports(2, True, True).values()) == {0}
    monkeypatch.setenv("TL_TRAINER_PORT", "80x1")
    with pytest.raises(ValueError, match="TL_TRAINER_PORT='80x1'"):
        wanted_ports(1, False, False)
    # two of the run's own services on one port: named, before anything binds (not blamed on another process)
    monkeypatch.setenv("TL_TRAINER_PORT", "18100")
    monkeypatch.setenv("TL_FEEDBACK_PORT", "18100")
    with pytest.raises(ValueError, match=r"trainer and feedback would both listen on port 18100 \(TL_TRAINER_PORT"):
        wanted_ports(1, False, False)
    monkeypatch.setenv("TL_FEEDBACK_PORT", "9110")                   # evaluator replica 2's (9100 + 10)
    with pytest.raises(ValueError, match="feedback and evaluator-2 would both listen on port 9110"):
        wanted_ports(2, False, False)
    assert wanted_ports(1, False, False)["feedback"] == 9110          # one replica: no clash


def test_bind_listeners_refuses_a_taken_port_and_releases_what_it_bound():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = socket.socket()
        first.bind(("127.0.0.1", 0))
        free = first.getsockname()[1]
        first.close()
        with pytest.raises(ValueError) as info:
            bind_listeners("127.0.0.1", {"trainer": free, "evaluator-2": port})
        msg = str(info.value)
        assert "evaluator-2" in msg and f"127.0.0.1:{port}" in msg and "TL_EVALUATOR_PORT" in msg, msg
        with socket.socket() as again:  # the trainer's socket was closed on the way out
            again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            again.bind(("127.0.0.1", free))


def test_a_second_launchers_listeners_are_refused_a_port_the_first_holds_not_shared():
    """Two launchers started at the same moment: the first's listener holds the port, so the second's bind is
    refused up front (two SO_REUSEADDR sockets that bound without listening both took it, and the two runs'
    services then fought over the port)."""
    first = bind_listeners("127.0.0.1", {"trainer": 0})
    try:
        port = first["trainer"].getsockname()[1]
        with pytest.raises(ValueError, match=f"the trainer cannot listen on 127.0.0.1:{port}"):
            bind_listeners("127.0.0.1", {"trainer": port})
    finally:
        for s in first.values():
            s.close()


def test_up_refuses_a_taken_port_before_starting_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
        env["TL_TRAINER_PORT"] = str(port)
        r = subprocess.run([sys.executable, "-m", "tradeloop.cli", "up", "--no-dashboard", "--no-live",
                            "--run-dir", str(tmp_path), "--run-id", "taken", "--epochs", "1"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "trainer" in r.stderr and "TL_TRAINER_PORT" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "taken").exists()  # refused before the run directory (or Redis) was made


def test_a_second_up_beside_a_running_one_names_the_run_that_holds_the_port(tmp_path):
    """The first run is stood in for by this process: its trainer's port bound here, its services.json naming it
    with this pid (alive), as a running `tradeloop up` writes it."""
    runs = tmp_path / "runs"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        first = runs / "run-first"
        first.mkdir(parents=True)
        (first / "services.json").write_text(json.dumps({"run_id": "run-first", "pid": os.getpid(),
                                                         "urls": {"trainer": f"http://127.0.0.1:{port}"}}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
        env.update(TL_TRAINER_PORT=str(port), TL_RUN_DIR=str(runs))
        r = subprocess.run([sys.executable, "-m", "tradeloop.cli", "up", "--no-dashboard", "--no-live",
                            "--epochs", "1"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "run run-first holds it" in r.stderr and str(first / "services.json") in r.stderr, r.stderr
    assert f"pid {os.getpid()}" in r.stderr and "ARGS=--free-ports" in r.stderr, r.stderr
    assert [p.name for p in runs.iterdir()] == ["run-first"]     # no empty run directory left behind


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_up_passes_its_arguments_through():
    r = subprocess.run(["make", "-n", "up", "ARGS=--free-ports --resume r1", "EPOCHS=3"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    line = next(x for x in r.stdout.splitlines() if "tradeloop up" in x)
    assert line.split()[2:] == ["--epochs", "3", "--free-ports", "--resume", "r1"], line
    r = subprocess.run(["make", "-n", "up"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert next(x for x in r.stdout.splitlines() if "tradeloop up" in x).split()[2:] == []   # up's own defaults


def _pid(client: httpx.Client, url: str) -> int | None:
    try:
        r = client.get(f"{url}/status", timeout=1.0)
    except httpx.HTTPError:
        return None
    return r.json()["pid"] if r.status_code == 200 else None


@pytest.mark.redis
def test_a_restarted_service_serves_on_the_same_socket(redis_url, run_id, tmp_path):
    listeners = bind_listeners("127.0.0.1", {"feedback": 0})
    port = listeners["feedback"].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    env.update(TL_REDIS_URL=redis_url, TL_RUN_ID=run_id, TL_RUN_DIR=str(tmp_path), TL_EMBEDDED="true",
               TL_HOST="127.0.0.1", TL_FEEDBACK_PORT=str(port), TL_API_TOKEN="a-test-token-of-some-length")
    proc = ServiceProc("feedback", "feedback", env, tmp_path / "feedback.log", url, listener=listeners["feedback"])
    sup = Supervisor([proc])
    try:
        proc.start()
        with httpx.Client() as client:
            first = poll_until(lambda: _pid(client, url), "the feedback service to answer", timeout_s=60,
                               interval_s=0.2, alive=lambda: proc.alive)
            assert first == proc.proc.pid
            os.kill(first, signal.SIGKILL)
            proc.proc.wait(timeout=10)
            # down, yet its port is still held: nothing else can bind it
            with socket.socket() as intruder, pytest.raises(OSError) as info:
                intruder.bind(("127.0.0.1", port))
            assert info.value.errno == errno.EADDRINUSE
            msgs: list[str] = []

            def back() -> int | None:
                msgs.extend(sup.poll())
                pid = _pid(client, url)
                return pid if pid not in (None, first) else None

            second = poll_until(back, f"the restarted service on {url}", timeout_s=60, interval_s=0.2)
        assert second == proc.proc.pid and proc.restarts == 1
        assert any("exited with code -9" in m for m in msgs) and any("restart #1" in m for m in msgs), msgs
    finally:
        sup.stop_all()
        listeners["feedback"].close()
