"""`tradeloop study`'s paths beside its runs: the baselines it reports, the runs it groups in lockstep, and a study
whose Redis goes away."""
from __future__ import annotations

import json
import subprocess

from tests.polling import poll_until
from tests.test_study import ROOT, TINY, _cmd, _env


def test_the_baselines_trade_at_the_reference_variants_costs():
    """The agents are backtested at the costs they trained under (`train.costs_bps`); the baselines beside them at
    the reference variant's, not at the default 1 bp."""
    from tradeloop.study.report import _baseline_unit
    from tradeloop.study.spec import StudySpec, parse_variants

    def unit(cost: float) -> dict:
        spec = StudySpec(dataset="synthetic", variants=parse_variants("on,off"), seeds=[0], folds=1, epochs=1,
                         bars=3000, settings=[("train.costs_bps", cost)])
        return {r["policy"]: r for r in _baseline_unit(spec.to_dict(), 0, 0)}

    cheap, dear = unit(1.0), unit(25.0)
    assert cheap["random"]["costs_bps"] == 1.0 and dear["random"]["costs_bps"] == 25.0
    assert dear["random"]["oos_bar_sharpe"] < cheap["random"]["oos_bar_sharpe"]
    assert dear["buy-and-hold"]["oos_sharpe"] is None


def test_a_study_whose_redis_goes_away_stops_saying_so(tmp_path):
    """The study's own Redis stopped under it: one line naming it and how to go on, status.json interrupted (a
    redis-py traceback before, status.json left "running")."""
    from shared.redis_server import EmbeddedRedis

    tiny = tmp_path / "tiny.toml"
    tiny.write_text(TINY)
    out = tmp_path / "coord"
    server = EmbeddedRedis(tmp_path / "redis", tcp=True).start()
    coord = subprocess.Popen([*_cmd(tiny, out)[:-1], "0", "--redis", server.url], cwd=ROOT, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        poll_until(lambda: (out / "status.json").exists(), "the study to start", timeout_s=120,
                   alive=lambda: coord.poll() is None)
        server.stop()
        text = coord.communicate(timeout=120)[0]
    finally:
        if coord.poll() is None:
            coord.kill()
        server.stop()
    assert coord.returncode == 1 and "error: lost the study's Redis" in text, text[-3000:]
    assert "run the same command again once it answers" in text and "Traceback" not in text
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"


def test_runs_of_the_policys_moving_average_are_never_grouped_in_lockstep():
    """The moving average's update is not batched (`LockstepEngine.refusal`): grouped, its runs would train each
    alone in one worker's threads; the other runs of a market still pair."""
    from tradeloop.study.runner import lockstep_groups
    from tradeloop.study.spec import StudySpec, parse_variants

    ema = StudySpec(dataset="synthetic", variants=parse_variants("ema:train.policy_ema=0.999,off"), seeds=[0, 1],
                    folds=1, epochs=1, lockstep=2, data_seed=7)
    groups = lockstep_groups(ema, [r.run_id for r in ema.runs()])
    assert sorted((g,) if isinstance(g, str) else tuple(sorted(g)) for g in groups) == [
        ("ema-s0-f0",), ("ema-s1-f0",), ("off-s0-f0", "off-s1-f0")]


def test_a_study_runs_checkpoint_evaluates_on_the_market_the_study_generated(tmp_path):
    """A study with `--bars N` generates a synthetic market of N bars; `tradeloop evaluate` on one of its runs
    regenerated the default 6 000 and refused ("train window sha256 mismatch"). It finds the run's own market now
    (the train window's hash says which) and reproduces the study's OOS for the selected checkpoint."""
    tiny = tmp_path / "tiny.toml"
    tiny.write_text(TINY.replace("seeds = 2", "seeds = 1").replace("folds = 2", "folds = 1")
                    .replace("epochs = 2", "epochs = 1").replace("[variants.on]\n", ""))
    out = tmp_path / "one"
    p = subprocess.run(_cmd(tiny, out), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    run = out / "runs" / "off-s0-f0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["n_bars"] == 3000
    r = subprocess.run([*_cmd(tiny, out)[:3], "evaluate", "--policy", str(run), "--checkpoint",
                        str(summary["selected_epoch"]), "--split", "test", "--json"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = json.loads(r.stdout)["metrics"]
    assert got["n_trades"] == summary["oos_metrics"]["n_trades"]
    assert got["per_trade_sharpe"] == summary["oos_metrics"]["per_trade_sharpe"]


def test_show_on_a_study_whose_runs_went_through_redis_says_where_they_are(tmp_path):
    """A `--redis` study's own directory keeps only its runs' summaries; the runs are in the workers' --out."""
    (tmp_path / "study.json").write_text("{}")
    (tmp_path / "runs" / "off-s0-f0").mkdir(parents=True)
    (tmp_path / "runs" / "off-s0-f0" / "summary.json").write_text("{}")
    r = subprocess.run([*_cmd(tmp_path, tmp_path)[:3], "show", str(tmp_path)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no run directory here" in r.stderr, r.stderr
    assert "keeps them in its workers' --out directories" in r.stderr and "Traceback" not in r.stderr
