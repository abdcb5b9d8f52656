"""`tradeloop study` end to end on the CPU: a tiny study (2 variants × 2 seeds × 2 folds) as a subprocess with two
worker processes; the same study killed with SIGKILL mid-run and resumed (no run done twice, the same results);
stopped by SIGTERM as Ctrl-C stops it, and a host's study worker too; bad input refused with exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.polling import poll_until
from tradeloop.cli import app
from tradeloop.study.stats import select_epoch

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 2
TINY = f"""
dataset = "synthetic"
seeds = 2
folds = 2
epochs = {EPOCHS}
bars = 3000
preset = "small"
min_val_trades = 5
n_boot = 2000
threads = 1

[variants.on]
[variants.off]

[set]
iterations = 14
n_envs = 4
env_steps_per_iter = 2
batch_size = 16
replay_capacity = 400
learning_starts = 40
horizons = [1, 2, 4]
iqn_quantiles = 4
lr_warmup = 5
cosine_period = 7
emb_refresh = 5
agent = {{ window = 8, d_model = 16, n_heads = 2, hidden = 24, n_atoms = 11, ensemble = 2, iqn_embed = 8, iqn_quantiles_act = 8 }}
reward = {{ episode_bars = 60, grace_bars = 10 }}
"""
RUNS = [f"{v}-s{s}-f{k}" for s in (0, 1) for k in (0, 1) for v in ("on", "off")]


def _cmd(cfg: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "tradeloop.cli", "study", "--config", str(cfg), "--out", str(out), "--parallel", "2"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("study")
    (d / "tiny.toml").write_text(TINY)
    return d / "tiny.toml"


@pytest.fixture(scope="module")
def reference(tiny) -> tuple[Path, subprocess.CompletedProcess]:
    out = tiny.parent / "ref"
    p = subprocess.run(_cmd(tiny, out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p


def _summaries(out: Path) -> dict[str, dict]:
    return {r: json.loads((out / "runs" / r / "summary.json").read_text()) for r in RUNS}


def test_tiny_study_end_to_end(reference):
    out, p = reference
    res = json.loads((out / "results.json").read_text())
    sums = _summaries(out)
    # every run selected on validation only, by the rule, and pruned to that checkpoint
    for rid, s in sums.items():
        vals = [e["val_sharpe"] for e in s["epochs"]]
        trades = [e["val_trades"] for e in s["epochs"]]
        assert (s["selected_epoch"], s["selectable"]) == select_epoch(vals, trades, 5), rid
        assert s["val_recheck"] == 0.0                      # the OOS pass's validation equals the loop's
        kept = sorted(x.name for x in (out / "runs" / rid / "checkpoints").glob("*.safetensors"))
        assert kept == [f"epoch-{s['selected_epoch']:04d}.safetensors"], rid
        assert len(s["epochs"]) == EPOCHS and s["split"]["test"][1] <= 3000
    # the folds are walk-forward: fold 1 is fold 0 moved by its test length
    f0, f1 = sums["on-s0-f0"]["split"], sums["on-s0-f1"]["split"]
    step = f0["test"][1] - f0["test"][0]
    assert [a + step for a in f0["train"]] == f1["train"] and [a + step for a in f0["test"]] == f1["test"]
    # paired difference on (seed, fold) units = mean of the per-unit differences
    units = [(s, k) for s in (0, 1) for k in (0, 1)]
    d = [sums[f"on-s{s}-f{k}"]["oos_sharpe"] - sums[f"off-s{s}-f{k}"]["oos_sharpe"] for s, k in units]
    pd_ = res["paired"]["on"]["oos_sharpe"]
    assert res["reference"] == "off" and pd_["n"] == 4 and pd_["mean"] == pytest.approx(sum(d) / 4)
    assert pd_["lo"] <= pd_["mean"] <= pd_["hi"]
    # pairing: on and off share seed, data and first-epoch knobs → identical epoch-1 checkpoints on a CPU
    assert res["pairing"]["groups"] == 4 and res["pairing"]["identical_checkpoints"] == 4
    # the DSR's trials: every distinct checkpoint (on and off trained alike wrote the same files: one trial each)
    distinct = {e["checkpoint_sha256"] for s in sums.values() for e in s["epochs"]}
    assert res["n_trials"] == len(distinct) <= len(RUNS) * EPOCHS - 4
    assert set(res["baselines"]) == {"random", "flat", "buy-and-hold", "oracle"}
    # one trade (buy-and-hold) or none (flat) has no per-trade Sharpe: n/a, not a measured 0 [0, 0]; the equity
    # curve's per-bar Sharpe stands beside it
    bh = res["baselines"]["buy-and-hold"]
    assert bh["oos_sharpe"]["mean"] is None and bh["oos_trades"]["mean"] == 1
    assert bh["oos_bar_sharpe"]["mean"] is not None and res["baselines"]["flat"]["oos_sharpe"]["mean"] is None
    assert res["variants"]["on"]["verdict"] in ("validated edge", "no validated edge")
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "done" and status["runs_done"] == 8 and status["epochs_done"] == 16
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    md = (out / "report.md").read_text()
    assert "Paired differences, variant − off" in md and "| oracle (baseline) |" in md
    assert "| buy-and-hold (baseline) | 4 | n/a | n/a | n/a | — | 1 [1, 1] | 1 [1, 1] | — |" in md
    assert "buy-and-hold (baseline) " in md.split("The account beside its trades")[1].split("\n")[0]
    assert res["choice"]["units"] == 4 and "Choosing among the variants by validation (2 on each of 4" in md
    # the account's OOS per-bar Sharpe beside the per-trade one: each run's, per variant and paired
    bars = {rid: s["oos_metrics"]["per_bar_sharpe"] for rid, s in sums.items()}
    assert res["variants"]["off"]["oos_bar_sharpe"]["mean"] == pytest.approx(
        sum(v for r, v in bars.items() if r.startswith("off")) / 4)
    assert res["paired"]["on"]["oos_bar_sharpe"]["n"] == 4 and "OOS per-bar Sharpe of the selected checkpoints" in md
    # every epoch's in-sample Sharpe (the greedy policy on the training split's last bars) is kept beside validation
    for rid, s in sums.items():
        rec = json.loads((out / "runs" / rid / "loop" / "epoch-0001.json").read_text())
        assert rec["seconds"]["save"] > 0.0 and rec["train"]["save_s"] == rec["seconds"]["save"], rid
        assert rec["seconds"]["setup"] > 0.0 and rec["train"]["setup_s"] == rec["seconds"]["setup"], rid
        assert rec["seconds"]["rollback"] is None and rec["train"]["rollback_s"] is None, rid   # nothing to restore
        assert s["epochs"][0]["insample_sharpe"] == float(rec["insample"]["per_trade_sharpe"] or 0.0), rid
        assert all(isinstance(e["insample_sharpe"], float) for e in s["epochs"]), rid
        assert all(0.0 <= e["compile_s"] <= e["train_s"] for e in s["epochs"]), rid     # compiling is part of training
    assert res["timing"]["compile_max_s"] >= res["timing"]["compile_median_s"] >= 0.0
    parts = res["timing"]["epoch_parts_s"]           # each timed part of the runs' second epochs, in the report
    assert all(parts[k] > 0.0 for k in ("setup", "train", "eval", "save")), parts
    assert "an epoch's parts (median after each run's first epoch): set-up" in md
    assert set(res["curves_insample"]) == {"on", "off"} and "In sample beside validation" in md
    assert "runs at once" in p.stdout and "epochs/s" in p.stdout and "wall" in p.stdout
    finished = [line.split(":")[0] for line in p.stdout.splitlines() if "selected on validation (val" in line]
    assert sorted(finished) == sorted(RUNS)                # one line per finished run


def test_a_run_line_says_when_no_epoch_had_the_trades_to_be_selected(tiny, tmp_path):
    out = tmp_path / "few"
    p = subprocess.run([*_cmd(tiny, out)[:-1], "1", "--variants", "off", "--seeds", "1", "--folds", "1",
                        "--epochs", "1", "--min-val-trades", "1000000"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert not json.loads((out / "runs" / "off-s0-f0" / "summary.json").read_text())["selectable"]
    line = next(x for x in p.stdout.splitlines() if x.startswith("off-s0-f0: epoch 1 selected on validation"))
    assert "; no epoch had 1000000: the best of all) → OOS" in line


def _pids(out: Path) -> list[int]:
    """The pids that hold (or last held) a run's lock, from what each wrote into it (`tradeloop.locks`)."""
    from tradeloop.locks import read_holder

    return [pid for lock in (out / "runs").glob("*/.lock") if isinstance(pid := read_holder(lock).get("pid"), int)]


def test_killed_study_resumes_without_doing_a_run_twice(tiny, reference):
    out = tiny.parent / "killed"
    proc = subprocess.Popen(_cmd(tiny, out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def half_done() -> list[str]:
        """Runs with epoch 1 recorded and epoch 2 not, once some other run is done."""
        runs = out / "runs"
        if not any((runs / r / "summary.json").exists() for r in RUNS):
            return []
        return [r for r in RUNS if (runs / r / "loop" / "epoch-0001.json").exists()
                and not (runs / r / "loop" / "epoch-0002.json").exists()]

    def frozen_half_done() -> list[str]:
        """`half_done()` with the workers stopped (SIGSTOP) as soon as it holds, so that no half-done run finishes
        before the kill; checked again once they are stopped (else they go on and the poll with them)."""
        if not half_done():
            return []
        pids = _pids(out)
        for sig in (signal.SIGSTOP, signal.SIGCONT):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            if sig == signal.SIGSTOP and (half := half_done()):
                return half
        return []

    try:
        poll_until(frozen_half_done, "a run half done after another finished", timeout_s=150, interval_s=0.02,
                   alive=lambda: proc.poll() is None)
        proc.send_signal(signal.SIGKILL)          # the workers, stopped, die with it (PR_SET_PDEATHSIG)
        workers = _pids(out)                      # read from the runs' lock files, which the kill leaves in place
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the workers die with the study (PR_SET_PDEATHSIG): nothing goes on training behind the resume
    poll_until(lambda: not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers),
               "the workers to die with the study", timeout_s=10)
    before = {r: (out / "runs" / r / "summary.json").read_bytes() for r in RUNS
              if (out / "runs" / r / "summary.json").exists()}
    half = half_done()
    assert before and len(before) < len(RUNS) and half

    p = subprocess.run(_cmd(tiny, out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming {out}: {len(before)} of {len(RUNS)} runs done" in " ".join(p.stdout.split())
    sums = _summaries(out)
    for r, raw in before.items():                 # done runs were not touched
        assert (out / "runs" / r / "summary.json").read_bytes() == raw
    for r in half:                                # half-done runs resumed from their epoch, not from scratch
        assert sums[r]["epochs_trained_here"] == EPOCHS - 1, r
    attempts = {r: [json.loads(x) for x in (out / "runs" / r / "attempts.jsonl").read_text().splitlines()]
                for r in RUNS}
    for r in RUNS:                                # a run done before the kill was not started again; a half-done
        starts = [a["from_epoch"] for a in attempts[r]]  # one started again from its epoch
        if r in before:
            assert starts == [0], (r, starts)
        if r in half:
            assert starts == [0, 1], (r, starts)
    for r in RUNS:                                # no epoch trained twice
        epochs = [json.loads(x)["epoch"] for x in (out / "runs" / r / "history.jsonl").read_text().splitlines()]
        assert len(epochs) == len(set(epochs)) and set(epochs) <= set(range(1, EPOCHS + 1)), (r, epochs)
    # the timing counts both starts of the command: the killed one's time and epochs too
    t = json.loads((out / "results.json").read_text())["timing"]
    first = json.loads((out / "status.json").read_text())["earlier_starts"]
    assert t["starts"] == 2 and len(first) == 1 and first[0]["wall_s"] > 0
    assert t["wall_total_s"] == pytest.approx(t["wall_s"] + first[0]["wall_s"])
    assert t["epochs_trained_total"] == t["epochs_trained"] + first[0]["epochs"]
    assert "over 2 starts of the command" in (out / "report.md").read_text()
    # and a resumed run gives what an uninterrupted one gives
    ref = _summaries(reference[0])
    for r in RUNS:
        a, b = sums[r], ref[r]
        assert (a["selected_epoch"], a["val_sharpe"], a["oos_sharpe"]) == \
               (b["selected_epoch"], b["val_sharpe"], b["oos_sharpe"]), r


def test_sigterm_stops_the_study_as_ctrl_c_does(tiny):
    """`kill`, `timeout`, `docker stop` and batch systems stop a process with SIGTERM: the study stops its workers,
    marks itself interrupted and says how to resume, as on Ctrl-C — not a process gone mid-write with its workers
    and queues left to the kernel."""
    out = tiny.parent / "terminated"
    proc = subprocess.Popen(_cmd(tiny, out), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        def running() -> dict:
            return (out / "status.json").exists() and json.loads((out / "status.json").read_text())["running"]

        poll_until(lambda: running() and _pids(out), "the workers' first runs in status.json", timeout_s=150,
                   alive=lambda: proc.poll() is None)
        workers = _pids(out)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, (proc.returncode, stderr[-2000:])
    said = " ".join(stderr.split())
    assert "error: stopped by SIGTERM: run the same command again to resume" in said, said
    assert "Traceback" not in stderr and "leaked semaphore" not in stderr, stderr[-2000:]
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "interrupted" and status["running"] == {}
    assert status["stopped"] and set(status["stopped"]) <= set(RUNS)     # the runs it stopped, with their epochs
    assert all(0 <= e < EPOCHS for e in status["stopped"].values())
    assert workers and not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in workers)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return "zombie"


def test_bad_input_is_refused_with_exit_2(tmp_path, tiny, reference):
    runner = CliRunner()
    base = ["study", "--dataset", "synthetic", "--epochs", "1", "--out", str(tmp_path / "o")]
    r = runner.invoke(app, [*base, "--variants", "on,x:eps_start=1.5"])
    assert r.exit_code == 2 and "eps_start must be a number in [0, 1], got 1.5" in r.output
    r = runner.invoke(app, [*base, "--folds", "40", "--bars", "500"])
    assert r.exit_code == 2 and "--folds 40 on 500 bars leave windows of train 30, val 10" in r.output
    r = runner.invoke(app, [*base, "--folds", "60", "--bars", "100"])
    assert r.exit_code == 2 and "--folds 60 on 100 bars: walk_forward_folds" in r.output
    r = runner.invoke(app, [*base, "--seeds", "two"])
    assert r.exit_code == 2 and "--seeds" in r.output
    r = runner.invoke(app, ["study", "--config", str(tiny), "--out", str(reference[0]), "--epochs", "3"])
    assert r.exit_code == 2 and "holds another study (it differs in epochs)" in r.output
    bad = tmp_path / "bad.toml"
    bad.write_text('dataset = "synthetic"\nepochs = 1\nwindows = 3\n')
    r = runner.invoke(app, ["study", "--config", str(bad), "--out", str(tmp_path / "o2")])
    assert r.exit_code == 2 and "unknown keys windows" in r.output
    assert "Traceback" not in r.output


def test_a_lockstep_study_trains_each_markets_runs_as_one_and_selects_each_on_its_own(tiny, reference, tmp_path):
    """--lockstep 2: on and off of one seed and fold (one market, one trainer config) are a group whose epochs train
    as one computation; every run is still its own — selected on its own validation, its own summary — and on a CPU
    the two still share their first epoch bit for bit, as the reference study's runs alone do (seed 0's four runs)."""
    out = tmp_path / "lockstep"
    p = subprocess.run([*_cmd(tiny, out)[:-1], "1", "--lockstep", "2", "--seeds", "1"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    groups = [e for e in events if e["type"] == "lockstep"]
    assert sorted(sorted(g["runs"]) for g in groups) == [["off-s0-f0", "on-s0-f0"], ["off-s0-f1", "on-s0-f1"]]
    assert all(g["rounds"] == {"lockstep": EPOCHS, "alone": 0} for g in groups), groups
    assert "2 runs in lockstep" in p.stdout and "up to 2 a worker in lockstep" in (out / "report.md").read_text()
    res = json.loads((out / "results.json").read_text())
    assert res["timing"]["lockstep"] == 2
    assert res["pairing"]["identical_checkpoints"] == 2
    runs = [r for r in RUNS if "-s0-" in r]
    ref = _summaries(reference[0])
    for rid in runs:
        s = json.loads((out / "runs" / rid / "summary.json").read_text())
        vals = [e["val_sharpe"] for e in s["epochs"]]
        assert (s["selected_epoch"], s["selectable"]) == select_epoch(vals, [e["val_trades"] for e in s["epochs"]], 5)
        assert s["val_recheck"] == 0.0 and len(s["epochs"]) == EPOCHS, rid
        # each run trained as it is alone: its data, split and first-epoch key, and its first epoch's loss up to
        # float sums, are the reference study's run's
        assert (s["split"], s["first_epoch_key"]) == (ref[rid]["split"], ref[rid]["first_epoch_key"]), rid
        loss = [json.loads((d / "runs" / rid / "loop" / "epoch-0001.json").read_text())["train"]["loss"]
                for d in (out, reference[0])]
        assert loss[0] == pytest.approx(loss[1], rel=1e-3), rid


def test_lockstep_groups_share_a_market_and_a_config_and_split_evenly():
    from tradeloop.study.runner import lockstep_groups
    from tradeloop.study.spec import StudySpec, parse_variants

    spec = StudySpec(dataset="synthetic", variants=parse_variants("on,off,g:gamma=0.9"), seeds=[0, 1, 2],
                     folds=2, epochs=1, lockstep=2, data_seed=7)
    ids = [r.run_id for r in spec.runs()]
    groups = lockstep_groups(spec, ids)
    assert sorted(x for g in groups for x in ([g] if isinstance(g, str) else g)) == sorted(ids)   # each run once
    for g in groups:
        runs = [spec.run(x) for x in ([g] if isinstance(g, str) else g)]
        assert len({r.fold for r in runs}) == 1 and len(runs) <= 2
        assert len({r.variant == "g" for r in runs}) == 1          # another trainer config: another group
    # 6 runs of on/off per fold share one market (data_seed) and config: 3 groups of 2; g's 3 a fold: 2 and 1
    sizes = sorted(len(g) if isinstance(g, list) else 1 for g in groups)
    assert sizes == [1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert lockstep_groups(StudySpec(**{**spec.to_dict(), "lockstep": 1}), ids) == ids
    one_market_a_seed = StudySpec(dataset="synthetic", variants=parse_variants("on,off"), seeds=[0, 1], folds=1,
                                  epochs=1, lockstep=4)
    assert sorted(map(sorted, lockstep_groups(one_market_a_seed, [r.run_id for r in one_market_a_seed.runs()]))) == [
        ["off-s0-f0", "on-s0-f0"], ["off-s1-f0", "on-s1-f0"]]


@pytest.mark.redis
def test_study_through_redis_with_workers_on_two_hosts(tiny, reference, redis_url):
    """The study process queues the runs in Redis and runs none itself (--parallel 0); two `study-worker`s with
    their own directories (two hosts) take them; every run is done once, and the results are the same runs and
    selections as the local study's."""
    out, hosts = tiny.parent / "coord", [tiny.parent / "host-a", tiny.parent / "host-b"]
    coord = subprocess.Popen([*_cmd(tiny, out)[:-1], "0", "--redis", redis_url], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from tradeloop.study.remote import key, study_id

        sid = study_id(json.loads((reference[0] / "study.json").read_text())["identity"])
        import redis as redis_py

        r = redis_py.Redis.from_url(redis_url, decode_responses=True)
        poll_until(lambda: r.exists(key(sid, "spec")), "the study in Redis", timeout_s=120,
                   alive=lambda: coord.poll() is None)
        workers = [subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "study-worker", "--redis", redis_url,
                                     "--study", sid, "--out", str(h)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for h in hosts]
        outs = [w.communicate(timeout=400)[0] for w in workers]
        assert all(w.returncode == 0 for w in workers), outs
        text = coord.communicate(timeout=120)[0]
    finally:
        for p in (coord, *locals().get("workers", [])):
            if p.poll() is None:
                p.kill()
    assert coord.returncode == 0, text[-3000:]
    assert f"study {sid}" in text and "selected on validation" in text
    by_host = [{r for r in RUNS if (h / "runs" / r / "summary.json").exists()} for h in hosts]
    assert by_host[0] | by_host[1] == set(RUNS) and not by_host[0] & by_host[1]   # every run once, on one host
    ref, sums = _summaries(reference[0]), _summaries(out)
    for rid in RUNS:
        assert (sums[rid]["selected_epoch"], sums[rid]["oos_sharpe"]) == \
               (ref[rid]["selected_epoch"], ref[rid]["oos_sharpe"]), rid
    assert json.loads((out / "results.json").read_text())["paired"]["on"]["oos_sharpe"] == \
        json.loads((reference[0] / "results.json").read_text())["paired"]["on"]["oos_sharpe"]


@pytest.mark.redis
def test_sigterm_stops_a_hosts_study_worker_and_says_where_its_runs_go(tiny, redis_url):
    """A `study-worker` host stopped by SIGTERM terminates its worker processes and says that the runs it held go
    back to the study; exit 1, no traceback."""
    out, host = tiny.parent / "coord-term", tiny.parent / "host-term"
    cmd = [*_cmd(tiny, out)[:-1], "0", "--redis", redis_url, "--seeds", "1"]   # a study of its own in Redis
    coord = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = None
    try:
        import redis as redis_py

        from tradeloop.study.remote import study_id

        r = redis_py.Redis.from_url(redis_url, decode_responses=True)
        specs = poll_until(lambda: r.keys("tl:study:*:spec"), "the study in Redis", timeout_s=120,
                           alive=lambda: coord.poll() is None)
        sid = specs[0].split(":")[2]
        assert sid == study_id(json.loads((out / "study.json").read_text())["identity"])
        worker = subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "study-worker", "--redis", redis_url,
                                   "--study", sid, "--out", str(host), "--parallel", "2"], cwd=ROOT, env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pids = poll_until(lambda: _pids(host), "the host's workers' runs", timeout_s=150,
                          alive=lambda: worker.poll() is None)
        worker.send_signal(signal.SIGTERM)
        _, stderr = worker.communicate(timeout=60)
    finally:
        for p in (coord, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert worker.returncode == 1, stderr[-2000:]
    said = " ".join(stderr.split())
    assert "error: stopped by SIGTERM: the runs this host held go back to the study 180 s after" in said, said
    assert "Traceback" not in stderr
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in pids)


def test_report_only_aggregates_a_finished_study_again(tmp_path, reference):
    """`--report-only` rewrites results.json, report.md and report.png of a finished study (its baselines computed
    again when baselines.json is gone) with the same statistics, and runs nothing; a directory that holds no study
    or unfinished runs is refused with exit 2."""
    import shutil

    ref = json.loads((reference[0] / "results.json").read_text())
    out = tmp_path / "again"
    shutil.copytree(reference[0], out, ignore=shutil.ignore_patterns("checkpoints", "results.json", "report.*",
                                                                      "baselines.json"))
    runner = CliRunner()
    r = runner.invoke(app, ["study", "--out", str(out), "--report-only"])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "results.json").read_text())
    for key in ("variants", "paired", "baselines", "runs", "n_trials", "pairing"):
        assert res[key] == ref[key], key
    assert res["timing"]["epochs_trained"] == json.loads((out / "status.json").read_text())["epochs_this_start"]
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| oracle (baseline) |" in (out / "report.md").read_text() and "Paired differences" in r.output
    assert not any((out / "runs").glob("*/checkpoints"))               # nothing was run
    # baselines.json is kept unit by unit: a cached unit is read, not recomputed; a missing one is computed again
    from tradeloop.study.report import baselines
    from tradeloop.study.spec import StudySpec

    spec = StudySpec.from_dict(json.loads((out / "study.json").read_text())["spec"])
    doc = json.loads((out / "baselines.json").read_text())
    before = doc["units"]["1-1"]
    doc["units"]["0-0"][0]["oos_sharpe"] = 123.0
    del doc["units"]["1-1"]
    (out / "baselines.json").write_text(json.dumps(doc))
    rows = baselines(spec, out)
    assert rows[0]["oos_sharpe"] == 123.0 and [r for r in rows if (r["seed"], r["fold"]) == (1, 1)] == before
    # in the background, one process at a time until widened to two: the same rows, the cached units kept as read
    from tradeloop.study.report import BackgroundBaselines

    doc = json.loads((out / "baselines.json").read_text())
    kept = {u: doc["units"].pop(u) for u in ("0-1", "1-0")}
    (out / "baselines.json").write_text(json.dumps(doc))
    job = BackgroundBaselines(spec, out, now=0, most=2)
    assert job.now == 1
    job.widen()
    job.join()
    assert job.now == 2 and baselines(spec, out) == rows
    assert {u: json.loads((out / "baselines.json").read_text())["units"][u] for u in kept} == kept
    (out / "runs" / "on-s1-f1" / "summary.json").unlink()
    r = runner.invoke(app, ["study", "--out", str(out), "--report-only"])
    assert r.exit_code == 2 and "1 of 8 runs are not done (on-s1-f1)" in r.output
    r = runner.invoke(app, ["study", "--out", str(tmp_path), "--report-only"])
    assert r.exit_code == 2 and "holds no study.json" in r.output and "Traceback" not in r.output


def test_background_baselines_stop_at_once_and_leave_no_process(tmp_path, reference):
    """An interrupted study stops its baselines' pool at once: `stop()` ends the thread within seconds, terminating
    the pool's processes mid-unit (the units done stay in baselines.json); no process of it is left running."""
    import multiprocessing as mp

    from tradeloop.study.report import BackgroundBaselines
    from tradeloop.study.spec import StudySpec

    spec = StudySpec.from_dict(json.loads((reference[0] / "study.json").read_text())["spec"])
    before = set(mp.active_children())
    job = BackgroundBaselines(spec, tmp_path, now=2, most=2)
    deadline = time.monotonic() + 30
    while set(mp.active_children()) == before and time.monotonic() < deadline:
        job._thread.join(0.05)                                          # the pool's processes spawned
    t0 = time.monotonic()
    job.stop()
    assert time.monotonic() - t0 < 5 and not job._thread.is_alive()
    assert set(mp.active_children()) <= before
    left = json.loads((tmp_path / "baselines.json").read_text())["units"] if (tmp_path / "baselines.json").exists() \
        else {}
    assert len(left) < spec.folds * len(spec.seeds)


GROUP_KILL = """
import json, multiprocessing as mp, os, signal, sys, time
from pathlib import Path
from tradeloop.study.report import BackgroundBaselines
from tradeloop.study.spec import StudySpec, parse_variants

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: None)         # the study process takes its SIGTERM itself
    doc = json.loads(Path(sys.argv[1]).read_text())["spec"]
    spec = StudySpec.from_dict({**doc, "seeds": list(range(100))})  # 200 units of ~0.1 s: the pool outlives the test
    out = Path(sys.argv[2])
    job = BackgroundBaselines(spec, out, now=1, most=2)    # a unit at a time: one process at work, one waiting
    deadline = time.monotonic() + 30
    pool = []
    while len(pool) < 2 and time.monotonic() < deadline:
        job._thread.join(0.02)
        pool = [p.pid for p in mp.active_children()]
    while any(os.getpgid(pid) == os.getpgid(0) for pid in pool) and time.monotonic() < deadline:
        job._thread.join(0.02)                             # each in its task loop once out of the study's group
    groups = [os.getpgid(pid) for pid in pool]
    os.killpg(0, signal.SIGTERM)                           # as `timeout` signals the study's whole group
    t0 = time.monotonic()
    job.stop()
    print(json.dumps({"pool": pool, "groups": groups, "mine": os.getpgid(0), "stop_s": time.monotonic() - t0,
                      "stopped": not job._thread.is_alive()}), flush=True)
"""


def test_a_signal_to_the_studys_whole_group_leaves_the_baselines_pool_to_the_study(tmp_path, reference):
    """`timeout` and batch systems signal a study's whole process group. The baselines' pool keeps out of it: a pool
    process killed while it waits for a unit holds the pool's task-queue lock, and the study's stop and its exit
    then wait on that lock for ever. Here the group gets SIGTERM while one pool process is at work and the other
    waits for a unit: the study stops the pool at once."""
    p = subprocess.run([sys.executable, "-c", GROUP_KILL, str(reference[0] / "study.json"), str(tmp_path)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=90, start_new_session=True)
    assert p.returncode == 0, p.stderr[-3000:]
    said = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(said["pool"]) == 2 and said["mine"] not in said["groups"]
    assert said["stopped"] and said["stop_s"] < 5, said       # not waiting on a lock a killed process held
    assert not any(Path(f"/proc/{pid}").exists() and "zombie" not in _state(pid) for pid in said["pool"])
    assert "leaked semaphore" not in p.stderr, p.stderr[-2000:]


def test_only_the_first_sigterm_stops_the_study_and_a_teardown_holds_it():
    """`timeout` sends SIGTERM twice (the process, then its group): the first raises where the study stands, every
    later one is ignored while it stops; one that comes during a teardown that must finish is raised after it."""
    from tradeloop.study.interrupt import Terminated, TermSignal

    term = TermSignal()
    with pytest.raises(Terminated):
        term(signal.SIGTERM, None)
    term(signal.SIGTERM, None)                 # the second: ignored
    term.raise_held()                          # nothing held
    held = TermSignal()
    with held.held():
        held(signal.SIGTERM, None)
        held(signal.SIGTERM, None)
    with pytest.raises(Terminated):
        held.raise_held()
    held.raise_held()                          # raised once
    held(signal.SIGTERM, None)
    ctrl_c = TermSignal()
    ctrl_c.stopping()                          # stopping on Ctrl-C: a SIGTERM meanwhile changes nothing
    ctrl_c(signal.SIGTERM, None)
    ctrl_c.raise_held()


def test_a_study_carried_as_its_summaries_runs_only_the_runs_not_done(tmp_path, tiny, reference):
    """A study moved to another host (or a fresh GPU machine) as study.json and its done runs' summary.json alone —
    no checkpoints, no loop records — runs only the runs whose summary is missing and reports the carried ones as
    they were."""
    import shutil

    out = tmp_path / "carried"
    (out / "runs").mkdir(parents=True)
    shutil.copy(reference[0] / "study.json", out / "study.json")
    carried = [r for r in RUNS if r not in ("on-s1-f1", "off-s1-f1")]
    for r in carried:
        (out / "runs" / r).mkdir()
        shutil.copy(reference[0] / "runs" / r / "summary.json", out / "runs" / r / "summary.json")
    p = subprocess.run(_cmd(tiny, out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resuming" in p.stdout and f"{len(carried)} of {len(RUNS)} runs done" in p.stdout
    ran = {r for r in RUNS if (out / "runs" / r / "loop").exists()}
    assert ran == {"on-s1-f1", "off-s1-f1"}
    ref = {r["run_id"]: r for r in json.loads((reference[0] / "results.json").read_text())["runs"]}
    got = {r["run_id"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    for r in carried:
        assert got[r]["oos_sharpe"] == ref[r]["oos_sharpe"] and got[r]["selected_epoch"] == ref[r]["selected_epoch"]
    for r in ran:                                        # run again from the same seed and data on a CPU: the same
        assert got[r]["oos_sharpe"] == pytest.approx(ref[r]["oos_sharpe"], abs=1e-9)
