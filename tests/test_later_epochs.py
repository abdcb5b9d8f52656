"""bench/later_epochs.py: a run's later epochs against its first, per variant of finished studies, on a hand-computed
case; runs with a missing Sharpe left out; a missing results.json named."""
import json

import pytest

from bench import later_epochs


def test_later_minus_first_per_variant_by_hand(tmp_path, capsys):
    study = tmp_path / "study-x"
    study.mkdir()
    curves = {"off": {"0/0": [0.5, 0.1, 0.4], "1/0": [0.2, 0.3, 0.2], "2/0": [0.3, float("nan"), 0.1]},
              "one": {"0/0": [0.4]}}
    wide = {"mean": 0.09, "lo": 0.05, "hi": 0.13, "n": 3, "widened": 3}   # the study's own, printed as it is
    (study / "results.json").write_text(json.dumps({"curves": curves, "variants": {"off": {"gap_widening": wide}}}))
    # off: mean(0.1, 0.4) − 0.5 = −0.25, mean(0.3, 0.2) − 0.2 = +0.05, and the NaN epoch left out: 0.1 − 0.3 = −0.2;
    # "one" has no later epoch → epoch 1 (0.5 + 0.2 + 0.3) / 3, later (0.25 + 0.25 + 0.1) / 3, Δ −0.4 / 3
    assert later_epochs.later_minus_first(curves["off"]) == pytest.approx([-0.25, 0.05, -0.2])
    later_epochs.main([str(study / "results.json")])
    out = capsys.readouterr().out
    assert "| study-x | off | 3 | 3 | +0.333 | +0.200 | -0.133 [" in out and "| one |" not in out
    assert "| +0.090 [+0.050, +0.130] |" in out
    later_epochs.main([str(study / "results.json"), "--variants", "none"])
    assert "| study-x |" not in capsys.readouterr().out


def test_a_missing_results_file_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        later_epochs.main([str(tmp_path / "nope.json")])
    assert f"no such results.json: {tmp_path / 'nope.json'}" in capsys.readouterr().err


def test_each_epochs_change_by_hand(tmp_path, capsys):
    study = tmp_path / "study-y"
    study.mkdir()
    curves = {"off": {"0/0": [0.5, 0.1, 0.4], "1/0": [0.3, 0.2, float("nan")]}}
    (study / "results.json").write_text(json.dumps({"curves": curves}))
    means, deltas = later_epochs.steps(curves["off"])
    # epoch means (0.5 + 0.3) / 2, (0.1 + 0.2) / 2, 0.4 (the NaN left out); changes −0.4 and −0.1, then +0.3 alone
    assert means == pytest.approx([0.4, 0.15, 0.4])
    assert [d["mean"] for d in deltas] == pytest.approx([-0.25, 0.3]) and [d["n"] for d in deltas] == [2, 1]
    later_epochs.main([str(study / "results.json"), "--steps"])
    out = capsys.readouterr().out
    assert "| study-y | off | 2 | 1 | +0.400 | — |" in out
    assert "| study-y | off | 2 | 3 | +0.400 | +0.300 [one unit: no interval] |" in out
    assert "| study-y | off | 2 | 2 | +0.150 | -0.250 [" in out

