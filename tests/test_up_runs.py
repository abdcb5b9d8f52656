"""Run identity of `tradeloop up`: launchers started together never share a run or lose a port race (each embedded
Redis on its own Unix socket), an existing run is continued only with --resume (and never while another process
holds it), and Ctrl-C in the middle of an epoch leaves a run that resumes at the iteration where it stopped. Real
processes, real Redis, the e2e tests' tiny CPU config."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from polling import poll_until
from test_e2e import TINY

from tradeloop.up.runs import RUN_FILE, RunError, claim_run, new_run_id, plan_run, resumed_settings

pytestmark = [pytest.mark.e2e, pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[1]


def _env(runs: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    env.update(TINY, TL_RUN_DIR=str(runs), **extra)
    return env


def _up(env: dict[str, str], *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--free-ports", "--no-dashboard", "--no-live",
           "--data-bars", "1000", "--feedback-timeout", "120", "--timeout", "240", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout_s: float = 200) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"tradeloop up did not finish in {timeout_s}s:\n{out}")
    return out


def test_run_ids_are_unique_and_a_resume_keeps_what_the_run_fixed(tmp_path, monkeypatch):
    ids = [new_run_id() for _ in range(200)]
    assert all(re.fullmatch(r"run-\d{8}-\d{6}-[0-9a-f]{6}", i) for i in ids), ids[:3]
    # 24 random bits: two of 200 ids drawn in one second collide with p ≈ 0.1 %, three or more with p < 1e-6;
    # claim_run draws again on a collision (the test below), so a collision never shares a directory
    assert len(set(ids)) >= 198
    monkeypatch.setenv("TL_RUN_ID", "from-env")
    assert plan_run(None, tmp_path, None) == ("from-env", tmp_path / "from-env", False)
    assert plan_run("flag", tmp_path, None)[0] == "flag"                       # --run-id wins over TL_RUN_ID
    (tmp_path / "from-env").mkdir()
    with pytest.raises(RunError, match="holds no run; remove it"):
        plan_run(None, tmp_path, None)
    with pytest.raises(RunError, match="no run in"):                           # a directory that holds no run
        plan_run(None, tmp_path, "from-env")
    (tmp_path / "from-env" / RUN_FILE).write_text("{}")
    with pytest.raises(RunError, match="holds a run; resume it with tradeloop up --resume from-env"):
        plan_run(None, tmp_path, None)
    assert plan_run(None, tmp_path, "from-env") == ("from-env", tmp_path / "from-env", True)
    assert plan_run(None, Path("elsewhere"), str(tmp_path / "from-env"))[1] == tmp_path / "from-env"
    with pytest.raises(RunError, match="name different runs"):
        plan_run("other", tmp_path, "from-env")
    rec = {"dataset": "synthetic", "iterations": 6, "epochs": 2, "device": "cpu"}
    got = resumed_settings(rec, {"epochs": 4, "dataset": None, "iterations": 6})
    assert (got["epochs"], got["dataset"], got["iterations"], got["config"]) == (4, "synthetic", 6, "small")
    with pytest.raises(RunError, match=r"keeps --dataset synthetic \(it was started so; given --dataset sp500\); "
                                       "drop --dataset or start a new run"):
        resumed_settings(rec, {"dataset": "sp500"})


def test_a_generated_id_that_collides_is_drawn_again_and_a_chosen_one_is_refused(tmp_path):
    taken = tmp_path / "run-20261206-120000-abcdef"
    taken.mkdir()
    run_id, path, lock = claim_run(taken.name, taken, generated=True)
    try:
        assert run_id != taken.name and path == tmp_path / run_id and path.is_dir()
        assert not any(taken.iterdir())                                  # the other run's directory untouched
    finally:
        lock.release()
    with pytest.raises(RunError, match="created by another process just now"):
        claim_run(taken.name, taken, generated=False)


def test_a_trainer_that_fails_ends_the_run_at_once_saying_why(tmp_path):
    runs = tmp_path / "runs"
    env = _env(runs)
    first = _up(env, "--run-id", "broken", "--epochs", "1", "--iterations", "4")
    assert first.wait(timeout=200) == 0, _finish(first)
    (runs / "broken" / "trainer" / "run.json").write_text("{")          # the run's settings, now unreadable
    # the loop cannot go on: the launcher stops at once (long before its --timeout), naming the trainer's error
    proc = _up(env, "--timeout", "900", "--resume", "broken", "--epochs", "2")      # the last --timeout counts
    out = _finish(proc, timeout_s=150)
    assert proc.returncode == 1, out
    assert f"the trainer failed: ValueError: {runs / 'broken' / 'trainer' / 'run.json'}: not valid JSON" in out, out
    assert "stopping (failed)" in out and "tradeloop up --resume broken" in out, out
    summary = json.loads((runs / "broken" / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert summary["loop_error"].startswith("the trainer failed: ValueError: "), summary


def test_a_service_that_refuses_its_settings_is_not_restarted_and_the_run_stops_naming_the_variable(tmp_path):
    """A TL_* value out of range makes `tradeloop serve` exit 2 each time it starts: the launcher does not restart it
    until --timeout but stops the run at once, printing the variable and the rule."""
    runs = tmp_path / "runs"
    proc = _up(_env(runs, TL_KEEP_CHECKPOINTS="0"), "--timeout", "900", "--run-id", "bad", "--epochs", "1",
               "--iterations", "4")
    out = _finish(proc, timeout_s=150)
    assert proc.returncode == 1, out
    assert "refused its settings (exit 2)" in out and "TL_KEEP_CHECKPOINTS: Input should be greater than" in out, out
    assert "restarting in" not in out and "stopping (failed)" in out, out
    summary = json.loads((runs / "bad" / "summary.json").read_text())
    assert summary["status"] == "failed" and "TL_KEEP_CHECKPOINTS" in summary["loop_error"], summary
    assert set(summary["restarts"].values()) == {0}, summary


def test_a_last_epoch_message_given_up_ends_the_run_at_once_saying_why(tmp_path):
    import redis

    from shared.events import DeadLetter, encode_event, stream_name

    runs = tmp_path / "runs"
    proc = _up(_env(runs), "--run-id", "lost", "--epochs", "2", "--iterations", "4", "--timeout", "900")
    run = runs / "lost"
    svc = poll_until(lambda: (run / "services.json").exists() and json.loads((run / "services.json").read_text()),
                     "the run to start", timeout_s=60, alive=lambda: proc.poll() is None)
    password = (run / "redis" / "password").read_text().strip()
    r = redis.Redis(unix_socket_path=svc["redis_socket"], password=password)
    try:           # what a consumer writes when it gives up on a message: here the last epoch's checkpoint
        r.xadd(stream_name("lost", "dead"), encode_event(DeadLetter(
            run_id="lost", epoch=2, original_stream=stream_name("lost", "checkpoints"), entry_id="1-0",
            group="evaluators", consumer="evaluator-1", reason="CheckpointError: sha256 mismatch", deliveries=5)))
    finally:
        r.close()
    out = _finish(proc, timeout_s=150)
    assert proc.returncode == 1, out
    assert ("dead letter: the checkpoints message of epoch 2 given up by evaluators/evaluator-1 after 5 deliveries: "
            "CheckpointError: sha256 mismatch") in out, out
    assert "the loop cannot finish: the last epoch's message was given up" in out and "stopping (failed)" in out, out
    assert json.loads((run / "summary.json").read_text())["status"] == "failed"


def test_four_launchers_started_together_all_complete_in_their_own_runs(tmp_path):
    runs = tmp_path / "runs"
    env = _env(runs)                       # TL_RUN_DIR: the launcher honours it; no run id: each draws its own
    procs = [_up(env, "--epochs", "1", "--iterations", "4") for _ in range(4)]
    outs = [_finish(p) for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out
    dirs = sorted(d for d in runs.iterdir() if d.is_dir())
    assert len(dirs) == 4, [d.name for d in dirs]
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    assert sorted(s["run_id"] for s in summaries) == [d.name for d in dirs]
    for s in summaries:
        assert s["status"] == "completed" and s["epochs_completed"] == 1 and s["redis"] == "embedded", s
        assert len(s["epochs"][0]["checkpoint_sha256"]) == 64 and s["epochs"][0]["bundle_id"]
    # each run's Redis listened on its own Unix socket (in its directory, or in a short private one when that
    # path is too long for a socket address), never on a TCP port
    socks = []
    for d in dirs:
        conf = (d / "redis" / "redis.conf").read_text().splitlines()
        assert "port 0" in conf
        socks.append(Path(next(x for x in conf if x.startswith("unixsocket ")).split(" ", 1)[1].strip('"')))
    assert len(set(socks)) == 4
    for d, sock in zip(dirs, socks):
        assert sock == d.resolve() / "redis" / "redis.sock" or sock.parent.name.startswith("tl-redis-"), sock
    assert len({(d / "trainer" / "run.json").read_text() for d in dirs}) == 1     # same settings, four runs


def test_two_launchers_naming_one_run_at_once_one_runs_the_other_is_refused(tmp_path):
    runs = tmp_path / "runs"
    env = _env(runs, TL_RUN_ID="same")
    procs = [_up(env, "--epochs", "1", "--iterations", "4") for _ in range(2)]
    lost = poll_until(lambda: next((p for p in procs if p.poll() is not None), None), "one launcher to be refused",
                      timeout_s=60)
    won = procs[1 - procs.index(lost)]
    out = _finish(lost)
    assert lost.returncode == 2 and "--resume same" in out and "Traceback" not in out, out
    out = _finish(won)
    assert won.returncode == 0, out
    assert json.loads((runs / "same" / "summary.json").read_text())["status"] == "completed"


def _status(client: httpx.Client, services: Path) -> dict | None:
    try:
        url = json.loads(services.read_text())["urls"]["trainer"]
        r = client.get(f"{url}/status", timeout=1.0)
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        return None
    return r.json() if r.status_code == 200 else None


def test_ctrl_c_mid_epoch_saves_it_and_a_resume_finishes_it_there(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "cc"
    iterations = 300   # the epoch still runs once the refused resume has returned, on a loaded machine too
    env = _env(runs)
    first = _up(env, "--run-id", "cc", "--epochs", "1", "--iterations", str(iterations))
    poll_until(lambda: (run / "services.json").exists(), "the run to start", timeout_s=60,
               alive=lambda: first.poll() is None)
    # while it runs, a resume cannot touch it
    busy = subprocess.run([sys.executable, "-m", "tradeloop.cli", "up", "--resume", "cc", "--free-ports",
                           "--no-dashboard"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2 and f"tradeloop up pid {first.pid}" in busy.stderr, busy.stderr
    with httpx.Client() as c:
        st = poll_until(lambda: (s := _status(c, run / "services.json")) and s.get("phase") == "training"
                        and s.get("iteration", 0) >= 2 and s, "the trainer in epoch 1, iteration 2",
                        timeout_s=120, interval_s=0.05, alive=lambda: first.poll() is None)
    assert st["training_epoch"] == 1
    os.kill(first.pid, signal.SIGINT)                                       # Ctrl-C
    out = _finish(first)
    assert first.returncode == 130, out
    assert "the trainer stops epoch 1 at its next iteration boundary" in out, out
    saved = next(line for line in out.splitlines() if "the trainer saved epoch 1 at iteration" in line)
    stopped_at = int(saved.split("at iteration ")[1].split("/")[0])
    assert 2 <= stopped_at < iterations and f"/{iterations}" in saved
    assert "tradeloop up --resume cc" in out and "Traceback" not in out
    assert (run / "trainer" / "checkpoints" / "interrupted.safetensors").exists()
    assert not (run / "services.json").exists()

    again = subprocess.run([sys.executable, "-m", "tradeloop.cli", "up", "--free-ports", "--no-dashboard"],
                           env={**env, "TL_RUN_ID": "cc"}, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already exists" in again.stderr and "--resume cc" in again.stderr, again.stderr

    resumed = _up(env, "--resume", "cc")                                    # the run's own settings (up.json)
    out = _finish(resumed)
    assert resumed.returncode == 0, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed"] and summary["epochs_completed"] == 1
    log = (run / "logs" / "trainer.log").read_text()
    assert f"resuming epoch 1 at iteration {stopped_at}/{iterations}" in log
    (rec,) = [json.loads(x) for x in (run / "trainer" / "history.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rec["resumed_at"]] == [stopped_at]
    cfg = json.loads((run / "trainer" / "run.json").read_text())["config"]
    # every iteration ran exactly once over the two processes, and the epoch's stats cover both parts
    assert rec["env_steps"] == iterations * cfg["n_envs"] * cfg["env_steps_per_iter"]
    meta_len = int.from_bytes((run / "trainer" / "checkpoints" / "epoch-0001.safetensors").open("rb").read(8), "little")
    with (run / "trainer" / "checkpoints" / "epoch-0001.safetensors").open("rb") as f:
        f.seek(8)
        meta = json.loads(json.loads(f.read(meta_len))["__metadata__"]["tradeloop"])
    assert rec["updates"] == meta["update_step"] > 0
    assert not (run / "trainer" / "checkpoints" / "interrupted.safetensors").exists()
    # a resume of the complete run has nothing to do: it says so and starts nothing, its summary untouched
    done = subprocess.run([sys.executable, "-m", "tradeloop.cli", "up", "--resume", "cc", "--free-ports",
                           "--no-dashboard"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "run cc is complete: 1 of 1 epochs trained" in done.stdout, done.stdout + done.stderr
    assert json.loads((run / "summary.json").read_text()) == summary


def test_a_stop_through_the_api_ends_the_run_once_its_last_epoch_is_evaluated(tmp_path):
    """POST /control/stop during epoch 1 of 3: the trainer finishes and publishes epoch 1, the loop evaluates it and
    gives its feedback, and `up` ends there with status "stopped" (exit 0) instead of waiting for --timeout."""
    runs = tmp_path / "runs"
    run = runs / "st"
    proc = _up(_env(runs), "--run-id", "st", "--epochs", "3", "--iterations", "60")
    poll_until(lambda: (run / "services.json").exists(), "the run to start", timeout_s=60,
               alive=lambda: proc.poll() is None or pytest.fail(_finish(proc)))
    token = (run / "api_token").read_text().strip()
    with httpx.Client() as c:
        poll_until(lambda: (s := _status(c, run / "services.json")) and s.get("phase") == "training" and s,
                   "the trainer in epoch 1", timeout_s=120, interval_s=0.05,
                   alive=lambda: proc.poll() is None or pytest.fail(_finish(proc)))
        url = json.loads((run / "services.json").read_text())["urls"]["trainer"]
        r = c.post(f"{url}/control/stop", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert r.status_code == 200, r.text
        st = c.get(f"{url}/status", timeout=10).json()        # the stop asked, shown until the run ends
        assert st["stopping"] is True and st["paused"] is False, st
    out = _finish(proc)
    assert proc.returncode == 0, out
    assert "the trainer was stopped (POST /control/stop) after epoch 1 of 3" in out and "stopping (stopped)" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["epochs_completed"] == 1, summary
    assert summary["epochs"][0]["report_id"] and summary["epochs"][0]["bundle_id"], summary["epochs"][0]
    assert "tradeloop up --resume st" in out and "Traceback" not in out
    # with --no-dashboard the services' URLs and where the token is are said
    assert "services trainer http://127.0.0.1:" in out and f"; API token in {run / 'api_token'}" in out, out


def test_a_closed_terminal_stops_the_run_and_writes_its_summary(tmp_path):
    """SIGHUP (the terminal closed, an ssh session dropped) with the output's reader gone: `up` stops its services
    and writes summary.json. It used to die of the signal, or of a BrokenPipeError at the first line it wrote while
    stopping, leaving no summary (or the last start's) and services.json behind."""
    runs = tmp_path / "runs"
    run = runs / "hup"
    proc = _up(_env(runs), "--run-id", "hup", "--epochs", "1", "--iterations", "300")
    poll_until(lambda: (run / "services.json").exists(), "the run to start", timeout_s=60,
               alive=lambda: proc.poll() is None)
    proc.stdout.close()                           # nobody reads the output any more: its next line breaks the pipe
    os.kill(proc.pid, signal.SIGHUP)
    try:
        proc.wait(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("tradeloop up did not stop within 150 s of SIGHUP")
    assert proc.returncode == 130
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["run_id"] == "hup"
    assert not (run / "services.json").exists()
