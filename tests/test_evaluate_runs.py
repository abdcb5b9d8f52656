"""`tradeloop evaluate` of a run's checkpoints gives the numbers the loop reported for them.

1. A tiny closed loop in-process — the trainer, evaluator and feedback services' own workers on a real Redis, the
   run directory laid out as `tradeloop up` lays it out (RUN/trainer/…, RUN/summary.json from the launcher's
   `collect_summary` and `best_of_summary`): `evaluate --policy RUN --checkpoint N` prints the val and OOS metrics of
   the evaluator's stored report of epoch N, DSR included; `--checkpoint best|latest` name the checkpoint they used.
2. The plain path applies the knobs the checkpoint trained under (here an entry gate and closed regimes that
   change its trades): its numbers are the evaluator's with those knobs, not those of the policy without them.
3. A `tradeloop train --out DIR` run (no loop reports): `--checkpoint best` evaluates every checkpoint on validation
   and picks by the same rule; bad choices are refused with the reason.
"""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.polling import apoll_until

EPOCHS = 2


def _cli(*args: str):
    from tradeloop.cli import app

    return CliRunner().invoke(app, list(args))


async def _run_loop(settings_env: dict, redis_url: str, run_id: str) -> None:
    """The three services' workers in one event loop until epoch EPOCHS has its bundle."""
    from services.evaluator.worker import EvaluatorServiceSettings, EvaluatorWorker
    from services.feedback.worker import FeedbackWorker
    from services.trainer.worker import TrainerServiceSettings, TrainerWorker
    from shared.api import ServiceState
    from shared.bus import Bus
    from shared.config import FeedbackSettings

    buses = [Bus(redis_url, run_id) for _ in range(3)]
    ev = EvaluatorWorker(EvaluatorServiceSettings(**settings_env), buses[0], ServiceState("evaluator", run_id))
    fb = FeedbackWorker(FeedbackSettings(**settings_env), buses[1], ServiceState("feedback", run_id),
                        consumer_name="fb-test")
    tr = TrainerWorker(TrainerServiceSettings(**settings_env), buses[2], ServiceState("trainer", run_id))
    consumers = [asyncio.create_task(ev.run()), asyncio.create_task(fb.run())]
    try:
        await apoll_until(lambda: ev.state.ready and fb.state.ready,   # the groups exist before anything is published
                          "the evaluator's and feedback's consumer groups", timeout_s=30)
        await buses[2].connect()
        await asyncio.wait_for(tr.run(), timeout=240)

        async def bundled():
            return await buses[2].store.get_bundle(EPOCHS) is not None

        await apoll_until(bundled, "the loop to bundle its last epoch", timeout_s=120)
    finally:
        # stop, then cancel: on Python 3.11 a cancel that lands as a handler's `asyncio.wait_for` completes can be
        # swallowed (gh-86296), and the consumer's loop then runs on; its stop flag ends it at the next turn
        for w, t in zip((ev, fb), consumers):
            w.consumer.stop()
            t.cancel()
        await asyncio.wait_for(asyncio.gather(*consumers, return_exceptions=True), timeout=60)
        for b in buses:
            await b.close()


@pytest.mark.redis
def test_evaluate_of_a_loop_checkpoint_equals_the_loops_report(tmp_path, redis_url, run_id, monkeypatch):
    import redis

    from services.evaluator.runs import best_of_summary
    from shared.store import run_key
    from tradeloop.up.progress import collect_summary

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    env = dict(redis_url=redis_url, run_id=run_id, run_dir=tmp_path, data="synthetic", epochs=EPOCHS, device="cpu",
               data_bars=1500, train_iterations=30, train_learning_starts=64, train_batch_size=32, train_n_envs=8,
               feedback_timeout_s=200, consumer_name="ev-test")
    asyncio.run(_run_loop(env, redis_url, run_id))

    run = tmp_path / run_id                          # what `tradeloop up` leaves: RUN/trainer, RUN/summary.json
    doc = collect_summary(redis_url, run_id)
    doc["best_checkpoint"] = best = best_of_summary(doc["epochs"], run)
    (run / "summary.json").write_text(json.dumps(doc))
    assert best is not None and best["command"] == f"tradeloop evaluate --policy {run} --checkpoint best --split test"

    r = redis.Redis.from_url(redis_url)
    try:
        reports = {e: json.loads(r.get(run_key(run_id, "report", e))) for e in range(1, EPOCHS + 1)}
    finally:
        r.close()
    rows = {row["epoch"]: row for row in doc["epochs"]}
    assert any(reports[e]["val"]["metrics"]["n_trades"] >= 2 for e in reports), "no trades: nothing compared"
    for e in range(1, EPOCHS + 1):
        for split, window in (("val", "val"), ("test", "oos")):
            out = _cli("evaluate", "--policy", str(run), "--checkpoint", str(e), "--split", split, "--json")
            assert out.exit_code == 0, out.output
            got = json.loads(out.stdout)
            assert got["checkpoint"]["epoch"] == e and got["checkpoint"]["sha256"] == rows[e]["checkpoint_sha256"]
            assert Path(got["checkpoint"]["path"]) == run / "trainer" / "checkpoints" / f"epoch-{e:04d}.safetensors"
            assert got["knobs_source"] == "the checkpoint's metadata"
            want = reports[e][window]["metrics"]
            assert got["metrics"].keys() == want.keys()
            for k, v in want.items():      # the loop's report: same trades, same metrics, the DSR over its trials
                assert got["metrics"][k] == pytest.approx(v, rel=1e-9, abs=1e-12), (e, split, k)
    assert json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "2", "--json").stdout)[
        "val_dsr_trials"]["n_trials"] == 2

    # best and latest name what they used; best is the summary's, by the loop's reports
    out = _cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--split", "test")
    assert out.exit_code == 0, out.output
    assert f"checkpoint: epoch {best['epoch']} (best) {best['path']} sha256 {best['sha256']}" in out.stdout
    assert re.search(rf"among the [1-9]\d* with ≥ 10 val trades of {EPOCHS} checkpoints \({EPOCHS} on disk; loop "
                     r"report\)", out.stdout) or "NONE has ≥ 10 val trades" in out.stdout, out.stdout
    got = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--json").stdout)
    assert got["checkpoint"]["epoch"] == best["epoch"]
    sel = got["selection"]
    assert [c["source"] for c in sel["considered"]] == ["loop report"] * EPOCHS
    assert 0.0 <= sel["dsr_deflated_over_considered"] <= 1.0
    out = _cli("evaluate", "--policy", str(run / "trainer"), "--checkpoint", "latest")
    assert out.exit_code == 0, out.output
    assert f"checkpoint: epoch {EPOCHS} (latest) {run / 'trainer' / 'checkpoints'}" in out.stdout

    # epoch 1's file replaced by epoch 2's (its sidecar too): refused by name — its metadata says epoch 2
    from shared.checkpoints import load_checkpoint, save_checkpoint

    ck = run / "trainer" / "checkpoints"
    tensors, meta = load_checkpoint(ck / "epoch-0001.safetensors")
    for suffix in ("", ".sha256"):
        (ck / f"epoch-0001.safetensors{suffix}").write_bytes((ck / f"epoch-0002.safetensors{suffix}").read_bytes())
    out = _cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--json")
    assert out.exit_code == 2 and "its metadata says epoch 2, its name epoch 1" in out.stderr, out.output
    # epoch 1's file rewritten as another valid checkpoint of the run (its own metadata, other weights, a new
    # sidecar): evaluated, and said to be another file than the loop reported
    name = next(k for k, v in tensors.items() if v.is_floating_point())
    save_checkpoint(ck / "epoch-0001.safetensors", {**tensors, name: tensors[name] * 0.5}, meta)
    got = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--json").stdout)
    first = got["selection"]["considered"][0]
    assert first["epoch"] == 1 and first["source"].startswith("evaluated here — epoch 1's file is not the one the loop "
                                                              f"reported (sha256 {rows[1]['checkpoint_sha256'][:12]}")


@pytest.fixture(scope="module")
def knobbed_run(tmp_path_factory):
    """Two epochs of a tiny `train_run` under knobs with an entry gate and closed regimes (returned too)."""
    from services.trainer.train import train_run
    from shared.knobs import N_REGIMES, Knobs
    from shared.market import load_dataset
    from test_train import tiny_config

    bars = load_dataset("synthetic", seed=0).slice(0, 1500)
    knobs = Knobs(gate_threshold=1e-3, regime_confidence=[0.0, 1.0, 0.5] * (N_REGIMES // 3))
    cfg = tiny_config()
    cfg.iterations, cfg.learning_starts = 20, 40
    out = tmp_path_factory.mktemp("knobbed") / "run"
    train_run(bars, "synthetic", out, 2, config=cfg, seed=0, knobs_fn=lambda e: knobs)
    return out, knobs


def test_plain_evaluate_applies_the_knobs_the_checkpoint_trained_under(knobbed_run):
    from services.evaluator.runner import evaluate_checkpoint
    from shared.knobs import Knobs
    from shared.market import Split, load_dataset

    run, knobs = knobbed_run
    ck = run / "checkpoints" / "epoch-0002.safetensors"
    bars = load_dataset("synthetic", seed=0)
    split = Split.from_dict(json.loads((run / "run.json").read_text())["split"])
    as_trained = evaluate_checkpoint(ck, expected_sha256=None, bars=bars, split=split, run_id="r", epoch=2,
                                     n_trials=2, knobs=knobs)
    ungated = evaluate_checkpoint(ck, expected_sha256=None, bars=bars, split=split, run_id="r", epoch=2,
                                  n_trials=2, knobs=Knobs())
    out = _cli("evaluate", "--policy", str(ck))
    assert out.exit_code == 0, out.output
    assert "knobs: as trained, from the checkpoint's metadata: entry gate 0.001, regime confidence " \
           "[0, 1, 0.5, 0, 1, 0.5, 0, 1, 0.5]" in out.stdout
    for split_name, window in (("val", "val"), ("test", "oos")):
        got = json.loads(_cli("evaluate", "--policy", str(ck), "--split", split_name, "--json").stdout)["metrics"]
        want, other = getattr(as_trained, window).metrics, getattr(ungated, window).metrics
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
        # the knobs matter here: without them the policy trades differently
        assert (got["n_trades"], got["exposure"]) != (other["n_trades"], other["exposure"]), split_name
    rep = json.loads(_cli("evaluate", "--policy", str(run), "--report").stdout)
    assert rep["knobs"]["gate_threshold"] == 1e-3
    assert rep["val"]["metrics"] == pytest.approx(as_trained.val.metrics, rel=1e-12, abs=1e-15)


def test_best_of_a_train_run_is_evaluated_on_validation_and_bad_choices_are_refused(knobbed_run, tmp_path):
    from shared.metrics import select_best

    run, _ = knobbed_run
    got = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--min-val-trades", "0",
                          "--json").stdout)
    cons = got["selection"]["considered"]
    assert [c["epoch"] for c in cons] == [1, 2] and {c["source"] for c in cons} == {"evaluated here"}
    i, enough = select_best([c["val_per_trade_sharpe"] for c in cons], [c["val_n_trades"] for c in cons], 0)
    assert enough and got["checkpoint"]["epoch"] == cons[i]["epoch"]
    assert got["checkpoint"]["path"] == str(run / "checkpoints" / f"epoch-{cons[i]['epoch']:04d}.safetensors")
    assert len(got["checkpoint"]["sha256"]) == 64
    # a run of the other layout that has nothing in it, an epoch it lacks, --checkpoint with a file
    (tmp_path / "empty").mkdir()
    for args, words in ((("--policy", str(tmp_path / "empty")), "not a run directory"),
                        (("--policy", str(run), "--checkpoint", "7"), "no checkpoint of epoch 7"),
                        (("--policy", str(run), "--checkpoint", "worst"), "must be best, latest or an epoch"),
                        (("--policy", str(run / "checkpoints" / "epoch-0001.safetensors"), "--checkpoint", "best"),
                         "checkpoint file")):
        out = _cli("evaluate", *args)
        assert out.exit_code == 2 and words in out.stderr, (args, out.output)
        assert "Traceback" not in out.output
    out = _cli("evaluate", "--policy", str(run), "--seed", "-1")
    assert out.exit_code == 2 and "--seed" in out.output, out.output


def test_a_checkpoint_of_another_run_in_a_runs_directory_is_refused_naming_the_field(knobbed_run, tmp_path):
    """A checkpoint copied in from a run of another config or split (its own sidecar beside it) would be evaluated,
    and chosen as `best`, under this run's name: refused, naming run.json and the field that differs."""
    import shutil

    from shared.checkpoints import load_checkpoint, save_checkpoint

    run = tmp_path / "run"
    shutil.copytree(knobbed_run[0], run)
    path = run / "checkpoints" / "epoch-0002.safetensors"
    tensors, meta = load_checkpoint(path)
    for key, value in (("config_hash", "0" * 64), ("split_hashes", {**meta["split_hashes"], "val": "0" * 64})):
        save_checkpoint(path, tensors, {**meta, key: value})
        for which in ("best", "latest", "2"):
            out = _cli("evaluate", "--policy", str(run), "--checkpoint", which, "--min-val-trades", "0")
            assert out.exit_code == 2, (key, which, out.output)
            assert f"checkpoint {path}: its {key} differs from {run / 'run.json'}'s" in " ".join(out.stderr.split())
    save_checkpoint(path, tensors, meta)                                  # its own again: evaluated
    assert _cli("evaluate", "--policy", str(run), "--checkpoint", "2").exit_code == 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_evaluate_on_cuda_without_a_gpu_is_refused_by_name(knobbed_run):
    out = _cli("evaluate", "--policy", str(knobbed_run[0]), "--device", "cuda")
    assert out.exit_code == 2 and "--device cuda but no CUDA device is available here" in out.stderr, out.output


def test_the_best_checkpoint_is_the_highest_val_sharpe_with_enough_trades():
    import numpy as np

    from shared.metrics import dsr, select_best, selection_dsr

    assert select_best([0.5, 0.9, 0.7], [12, 3, 10]) == (2, True)       # 0.9 has too few trades
    assert select_best([0.5, 0.9, 0.7], [1, 3, 2]) == (1, False)        # none has enough: the best of all
    assert select_best([0.7, 0.7, 0.2], [10, 10, 10]) == (0, True)      # the first of equals
    assert select_best([0.1], [0], min_trades=0) == (0, True)
    for bad in (([], []), ([0.1, 0.2], [10])):
        with pytest.raises(ValueError, match="one trade count per Sharpe"):
            select_best(*bad)
    r = np.random.default_rng(0).normal(0.01, 0.02, 40)
    assert selection_dsr(r, [0.4]) == dsr(r, 1)
    sharpes = [0.1, 0.3, 0.5, 0.2]
    assert selection_dsr(r, sharpes) == dsr(r, 4, float(np.var(sharpes, ddof=1)))
    assert selection_dsr(r, sharpes) < selection_dsr(r, [0.4])          # selecting among more costs confidence


def test_the_trials_variance_is_of_the_checkpoints_selection_could_choose_and_n_of_every_one():
    """A checkpoint of 3 validation trades at −4.9 beside four of ≥ 40: its Sharpe is mostly sampling noise, and it
    would have dominated V (and so the expected maximum Sharpe every selected checkpoint is deflated by)."""
    import numpy as np

    from shared.metrics import dsr, selection_dsr, trials_variance
    from tradeloop.study.stats import study_trials

    sharpes, trades = [0.1, 0.3, 0.5, 0.2, -4.9], [40, 60, 50, 45, 3]
    assert trials_variance(sharpes, trades, 20) == pytest.approx(np.var([0.1, 0.3, 0.5, 0.2], ddof=1))
    assert trials_variance(sharpes) == pytest.approx(np.var(sharpes, ddof=1))          # no counts: every one
    assert trials_variance([0.1, -4.9], [40, 3], 20) == pytest.approx(np.var([0.1, -4.9], ddof=1))   # < 2 could
    assert trials_variance([0.1]) is None
    r = np.random.default_rng(0).normal(0.01, 0.02, 40)
    v = float(np.var([0.1, 0.3, 0.5, 0.2], ddof=1))
    assert selection_dsr(r, sharpes, trades, 20) == dsr(r, 5, v) > selection_dsr(r, sharpes)
    runs = [{"epochs": [{"val_sharpe": x, "val_trades": n} for x, n in zip(sharpes[:3], trades[:3])]},
            {"epochs": [{"val_sharpe": x, "val_trades": n} for x, n in zip(sharpes[3:], trades[3:])]}]
    assert study_trials(runs, 20) == (5, pytest.approx(v))
    # the evaluator's report of a checkpoint (its val DSR over the run's checkpoints so far) takes the same V
    from services.evaluator.report_builder import trial_sharpe_variance
    from shared.metrics import MIN_SELECTION_TRADES

    assert trial_sharpe_variance(sharpes[1:], 0.1, trades[1:], 40) == pytest.approx(
        trials_variance([*sharpes[1:], 0.1], [*trades[1:], 40], MIN_SELECTION_TRADES)) == pytest.approx(v)
    assert trial_sharpe_variance(sharpes[1:], 0.1) == pytest.approx(np.var([*sharpes[1:], 0.1], ddof=1))


def test_up_summary_names_the_best_checkpoint_on_disk_and_its_command(tmp_path):
    from services.evaluator.runs import best_of_summary

    ck = tmp_path / "run" / "trainer" / "checkpoints"
    ck.mkdir(parents=True)
    for e in (2, 3):
        (ck / f"epoch-{e:04d}.safetensors").write_bytes(b"x")
    rows = [{"epoch": 1, "checkpoint_sha256": "a" * 64, "val_per_trade_sharpe": 2.0, "val_n_trades": 40},  # pruned
            {"epoch": 2, "checkpoint_sha256": "b" * 64, "val_per_trade_sharpe": 0.4, "val_n_trades": 30},
            {"epoch": 3, "checkpoint_sha256": "c" * 64, "val_per_trade_sharpe": 0.9, "val_n_trades": 4},
            {"epoch": 4, "checkpoint_sha256": "d" * 64, "val_per_trade_sharpe": None, "val_n_trades": None}]
    best = best_of_summary(rows, tmp_path / "run")
    assert best["epoch"] == 2 and best["sha256"] == "b" * 64 and best["path"] == str(ck / "epoch-0002.safetensors")
    assert best["selected_among"] == 2 and "(none had" not in best["rule"]
    assert best["command"] == f"tradeloop evaluate --policy {tmp_path / 'run'} --checkpoint best --split test"
    assert best_of_summary(rows[3:], tmp_path / "run") is None


def test_printed_commands_name_the_script_that_ran_when_it_is_not_on_path(tmp_path, monkeypatch):
    """`make up` runs `.venv/bin/tradeloop` without activating the venv: its hints (evaluate the best checkpoint,
    resume the run) name that path, which a user can paste; `tradeloop` where it is on PATH."""
    import sys

    from shared.config import cli_command
    from tradeloop.up.runs import resume_hint

    script = tmp_path / ".venv" / "bin" / "tradeloop"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), "up"])
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli_command() == ".venv/bin/tradeloop"
    assert resume_hint("r1", tmp_path / "elsewhere").startswith(".venv/bin/tradeloop up --resume r1 --run-dir ")
    monkeypatch.setenv("PATH", f"{script.parent}:/usr/bin:/bin")                 # the venv activated
    assert cli_command() == "tradeloop"
    monkeypatch.setattr(sys, "argv", ["/x/tradeloop/cli.py"])                    # python -m tradeloop.cli
    assert cli_command() == "tradeloop"
