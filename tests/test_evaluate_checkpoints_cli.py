"""`tradeloop evaluate --policy RUN --checkpoint all|LIST`: several checkpoints of a run in one batched pass, one
table row each — every row's metrics those of `evaluate --policy RUN --checkpoint N` for that checkpoint alone
(its knobs, the run's data, split and costs, the val DSR over its trials), on both splits; bad lists refused with
the reason.
    python3 -m pytest -q tests/test_evaluate_checkpoints_cli.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_evaluate_runs import _cli, knobbed_run  # noqa: E402,F401 (the tiny two-epoch run, a fixture)


@pytest.mark.parametrize("split", ["val", "test"])
def test_checkpoint_table_equals_one_evaluation_per_checkpoint(knobbed_run, split):  # noqa: F811
    from shared import native

    run, _ = knobbed_run
    out = _cli("evaluate", "--policy", str(run), "--checkpoint", "all", "--split", split, "--json")
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    rows = doc["checkpoints"]
    assert [r["checkpoint"]["epoch"] for r in rows] == [1, 2] and doc["split"] == split
    for r in rows:
        e = r["checkpoint"]["epoch"]
        one = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", str(e), "--split", split,
                              "--json").stdout)
        assert r["checkpoint"]["sha256"] == one["checkpoint"]["sha256"] and r["engine"] == one["engine"]
        assert r["knobs"] == one["knobs"] and r["val_dsr_trials"] == one["val_dsr_trials"]
        assert r["metrics"] == one["metrics"], (e, split)            # the same trades, to the bit
        if native.available():
            assert r["engine"] == "native-c" and r["checkpoints_in_pass"] == 2
    assert rows[0]["metrics"] != rows[1]["metrics"]                  # two different checkpoints were evaluated


def test_checkpoint_list_prints_a_table_and_refuses_bad_lists(knobbed_run):  # noqa: F811
    run, _ = knobbed_run
    out = _cli("evaluate", "--policy", str(run), "--checkpoint", "2,latest,1", "--min-val-trades", "0")
    assert out.exit_code == 0, out.output
    lines = out.stdout.splitlines()
    assert "2 checkpoint(s) of " in lines[0]                         # what ran (engine, passes), then the table
    lines = lines[2:]
    assert lines[0].endswith("[val]  (Sharpes un-annualized, per trade)")
    assert lines[1].split() == ["epoch", "per_trade_sharpe", "n_trades", "total_return", "max_drawdown",
                                "win_rate", "dsr", "how"]
    assert [ln.split("  ")[-1] for ln in lines[2:]] == ["epoch 1", "epoch 2, latest"]     # by epoch, each once
    one = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "1", "--json").stdout)["metrics"]
    row1 = lines[2].split()
    assert float(row1[1]) == pytest.approx(one["per_trade_sharpe"], rel=1e-3) and int(row1[2]) == one["n_trades"]
    best = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "best,1", "--min-val-trades", "0",
                           "--json").stdout)["checkpoints"]
    alone = json.loads(_cli("evaluate", "--policy", str(run), "--checkpoint", "best", "--min-val-trades", "0",
                            "--json").stdout)["checkpoint"]["epoch"]
    assert [r["checkpoint"]["epoch"] for r in best if "best" in r["checkpoint"]["how"].split(", ")] == [alone]
    for args, words in ((("--checkpoint", "1,7"), "no checkpoint of epoch 7"),
                        (("--checkpoint", "1,worst"), "must be best, latest or an epoch"),
                        (("--checkpoint", "all", "--report"), "--report takes one checkpoint")):
        out = _cli("evaluate", "--policy", str(run), *args)
        assert out.exit_code == 2 and words in out.stderr, (args, out.output)
        assert "Traceback" not in out.output
    ck = run / "checkpoints" / "epoch-0001.safetensors"
    out = _cli("evaluate", "--policy", str(ck), "--checkpoint", "all")
    assert out.exit_code == 2 and "not a run directory" in out.stderr, out.output
