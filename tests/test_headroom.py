"""bench/headroom.py and `stats.choice_by_validation` under it: the reference, the validation-chosen candidate and
the OOS ceiling per (seed, fold), on a hand-computed case across two studies; ties in the rank correlation; studies
that do not pair and an unknown reference are named."""
import json

import numpy as np
import pytest

from bench import headroom
from tradeloop.study import report, stats

STUDY = {"dataset": "synthetic", "seeds": [0, 1], "folds": 1, "epochs": 2, "preset": "small",
         "settings": [], "bars": 1000, "data_seed": None}


def write(path, runs, **study):
    path.mkdir()
    rows = [{"variant": v, "seed": s, "fold": f, "val_sharpe": val, "oos_sharpe": oos} for v, s, f, val, oos in runs]
    (path / "results.json").write_text(json.dumps({"study": {**STUDY, **study}, "runs": rows}))
    return path


def test_choice_by_validation_and_the_ceiling_by_hand(tmp_path, capsys):
    a = write(tmp_path / "a", [("ref", 0, 0, 0.5, 0.4), ("x", 0, 0, 0.7, 0.6),
                               ("ref", 1, 0, 0.8, 0.2), ("x", 1, 0, 0.1, 0.3)])
    b = write(tmp_path / "b", [("y", 0, 0, 0.6, 0.9), ("y", 1, 0, 0.3, 0.1), ("y", 2, 0, 0.9, 0.9)])
    h = headroom.headroom(headroom.candidates({"a": json.loads((a / "results.json").read_text()),
                                               "b": json.loads((b / "results.json").read_text())}), "a:ref", n_boot=500)
    # unit (0, 0): val picks x (0.7) → OOS 0.6, ceiling y's 0.9; unit (1, 0): val picks ref (0.8) → 0.2,
    # ceiling 0.3; seed 2 has no reference and is left out. Ranks of val / OOS: (1, 3, 2) / (1, 2, 3) → +0.5;
    # (3, 1, 2) / (2, 3, 1) → −0.5.
    assert h["units"] == 2 and h["variants_per_unit"] == [3, 3] and h["chosen_by_val"] == {"a:ref": 1, "a:x": 1}
    assert h["val_chosen_oos"]["mean"] == pytest.approx(0.4) and h["oos_best_oos"]["mean"] == pytest.approx(0.6)
    assert h["val_chosen_minus_reference"]["mean"] == pytest.approx(0.1)
    assert h["val_chosen_minus_reference"]["wins"] == 1
    assert h["oos_best_minus_reference"]["mean"] == pytest.approx(0.3)
    assert h["rank_corr"]["mean"] == pytest.approx(0.0) and h["rank_corr"]["n"] == 2
    headroom.main([str(a), str(b / "results.json"), "--reference", f"{a / 'results.json'}:ref"])
    out = capsys.readouterr().out
    assert "3 candidates from 2 studies." in out and "(3 on each of 2 (seed, fold) units;" in out
    assert "| the variant validation prefers | +0.400 [" in out and "| the best OOS (hindsight) | +0.600 [" in out
    assert "+0.100 [" in out and "| 1 of 2 |" in out
    assert "its CI reaches 0, so validation does not tell them apart" in out          # ranks +0.5 and −0.5


def test_studies_that_do_not_pair_and_an_unknown_reference_are_named(tmp_path, capsys):
    a = write(tmp_path / "a", [("ref", 0, 0, 0.5, 0.4), ("x", 0, 0, 0.7, 0.6)])
    b = write(tmp_path / "b", [("y", 0, 0, 0.6, 0.9)], seeds=[5, 6])
    c = write(tmp_path / "c", [("y", 0, 0, 0.6, 0.9)], settings=[["train.iterations", 500]])
    with pytest.raises(SystemExit, match=r"a and b do not pair: they differ in seeds \(\[0, 1\] vs \[5, 6\]\)"):
        headroom.main([str(a), str(b), "--reference", "a:ref"])
    with pytest.raises(SystemExit, match="differ in settings .*--any-settings"):
        headroom.main([str(a), str(c), "--reference", "a:ref"])
    headroom.main([str(a), str(c), "--reference", "a:ref", "--any-settings"])
    assert "3 candidates from 2 studies" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--reference a:nope: no such study:variant"):
        headroom.main([str(a), "--reference", "a:nope"])
    with pytest.raises(SystemExit, match="missing"):
        headroom.main([str(tmp_path / "none"), "--reference", "none:ref"])


def test_ranks_share_ties_and_a_unit_without_spread_has_no_correlation():
    assert list(stats._ranks(np.array([0.3, 0.1, 0.3, 0.2]))) == [3.5, 1.0, 3.5, 2.0]
    rows = [{"variant": v, "seed": 0, "fold": 0, "val_sharpe": 0.5, "oos_sharpe": o} for v, o in
            (("ref", 0.1), ("x", 0.2), ("y", 0.3))]
    c = stats.choice_by_validation(rows, "ref", n_boot=200)
    assert c["rank_corr"] is None and c["val_chosen_oos"]["mean"] == 0.1      # a tie in val: the first row
    assert stats.choice_by_validation(rows[1:], "ref") is None                 # no unit holds the reference
    alike = [{"variant": v, "seed": s, "fold": 0, "val_sharpe": x + s, "oos_sharpe": x} for s in (0, 1)
             for v, x in (("ref", 0.1), ("x", 0.2), ("y", 0.3))]
    c = stats.choice_by_validation(alike, "ref", n_boot=200)
    assert c["rank_corr"]["lo"] == pytest.approx(1.0)
    assert "validation tells them apart on this data" in " ".join(report.choice_lines(c))

