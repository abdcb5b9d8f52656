"""`tradeloop study-compare`: a variant of one finished study against a variant of another, paired by (seed, fold)
(`tradeloop.study.compare`), against hand-computed differences; studies whose units do not pair are refused."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from tradeloop.cli import app
from tradeloop.study.compare import compare, compare_pooled, load_side, markdown
from tradeloop.study.spec import StudyError

SPEC = {"dataset": "synthetic", "seeds": [0, 1], "folds": 2, "epochs": 4, "preset": "small",
        "settings": [["train.iterations", 120]], "bars": 1000, "data_seed": None}


def study(tmp: Path, name: str, variant: str, oos: dict, last: dict, **spec) -> Path:
    d = tmp / name
    d.mkdir()
    runs = [{"variant": variant, "seed": s, "fold": f, "oos_sharpe": v, "val_sharpe": v / 2,
             "last_val_sharpe": last[(s, f)]} for (s, f), v in oos.items()]
    runs.append({"variant": "other", "seed": 0, "fold": 0, "oos_sharpe": 9.0, "val_sharpe": 9.0,
                 "last_val_sharpe": 9.0})
    doc = {"study": {**SPEC, **spec, "variants": [{"name": variant, "settings": []}, {"name": "other", "settings": []}]},
           "runs": runs}
    (d / "results.json").write_text(json.dumps(doc))
    return d


UNITS = [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_differences_are_paired_by_seed_and_fold_on_the_shared_units(tmp_path):
    a_oos = dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20]))
    b_oos = dict(zip(UNITS, [0.45, 0.45, 0.10, 0.20]))
    a = study(tmp_path, "a", "rb", a_oos, dict(zip(UNITS, [0.3, 0.3, 0.1, 0.1])))
    b_last = dict(zip(UNITS, [0.2, 0.2, 0.2, 0.2]))
    b = study(tmp_path, "b", "off", {**b_oos, (2, 0): 5.0}, {**b_last, (2, 0): 5.0})   # a unit a does not hold
    ra, va, la = load_side(f"{a}:rb")
    rb, vb, lb = load_side(f"{b}:off")
    c = compare(ra, va, rb, vb, n_boot=2000, seed=0)
    d = c["metrics"]["oos_sharpe"]["a_minus_b"]
    want = np.array([0.05, -0.05, 0.20, 0.0])
    assert d["mean"] == pytest.approx(want.mean()) and d["n"] == 4 and d["wins"] == 2
    assert d["lo"] <= d["mean"] <= d["hi"]
    assert c["metrics"]["oos_sharpe"]["b"]["mean"] == pytest.approx(np.mean(list(b_oos.values())))
    assert c["metrics"]["val_sharpe"]["a_minus_b"]["mean"] == pytest.approx(want.mean() / 2)
    assert c["last_val_seeds"] == {"a_at_least_b": 1, "seeds": 2}    # seed 0: 0.3 ≥ 0.2; seed 1: 0.1 < 0.2
    assert c["units"] == 4 and la == "a:rb" and lb == "b:off"


def test_studies_whose_units_differ_or_that_lack_the_variant_are_refused(tmp_path):
    oos = dict(zip(UNITS, [0.1] * 4))
    a = study(tmp_path, "a", "rb", oos, oos)
    b = study(tmp_path, "b", "off", oos, oos, epochs=8, bars=2000)
    with pytest.raises(StudyError, match=r"differ in epochs, bars \(epochs: 4 vs 8; bars: 1000 vs 2000\)"):
        compare(*load_side(f"{a}:rb")[:2], *load_side(f"{b}:off")[:2])
    with pytest.raises(StudyError, match=r"differ in bars \(bars: 1000 vs 2000\)"):     # epochs allowed, not bars
        compare(*load_side(f"{a}:rb")[:2], *load_side(f"{b}:off")[:2], any_epochs=True)
    with pytest.raises(StudyError, match=r"no variant 'on' \(it has rb, other\)"):
        load_side(f"{a}:on")
    with pytest.raises(StudyError, match="is not a finished study"):
        load_side(f"{tmp_path / 'nowhere'}:on")
    with pytest.raises(StudyError, match="give a study directory and one of its variants as DIR:VARIANT"):
        load_side(str(a))


def test_the_command_prints_the_table_and_refuses_bad_input_with_exit_2(tmp_path):
    a_oos = dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20]))
    a = study(tmp_path, "a", "rb", a_oos, a_oos)
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.40] * 4)), dict(zip(UNITS, [0.40] * 4)))
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", "--n-boot", "500"])
    assert r.exit_code == 0, r.output
    assert "| OOS per-trade Sharpe (val-selected) | +0.350" in r.output and "| 1 of 4 |" in r.output
    assert "a:rb ≥ b:off in 1 of 2 seeds" in r.output
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", "--json", "--n-boot", "500"])
    doc = json.loads(r.output)
    assert doc["metrics"]["oos_sharpe"]["a_minus_b"]["mean"] == pytest.approx(-0.05)
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:nope"])
    assert r.exit_code == 2 and "no variant 'nope'" in r.output and "Traceback" not in r.output
    # differences [0.1, 0, −0.1, −0.2]: sd √(0.05 / 3) = 0.129099; (t₀.₉₇₅,₃ 3.1824 + t₀.₈,₃ 0.9785) · sd / √4 = 0.269
    # resolvable; +0.1 takes 16 units: at 15, (2.1448 + 0.8681) · sd / √15 = 0.1004 > 0.1, at 16 (2.1314 + 0.8662)
    # · sd / 4 = 0.0967
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", "--n-boot", "500", "--detect", "0.1"])
    assert r.exit_code == 0, r.output
    assert "| **-0.050 [" in r.output and "| 1 of 4 | 0.269 |" in r.output
    assert "Units to resolve a difference of +0.1 at 80 % power, at these units' spread: OOS per-trade Sharpe " \
           "(val-selected) 16;" in r.output
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", "--detect", "0", "--json"])
    assert r.exit_code == 2 and "--detect must be a finite difference other than 0, got 0.0" in r.output
    doc = json.loads(CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", "--json", "--n-boot", "500",
                                              "--detect", "-0.1"]).output)
    assert doc["detect"] == -0.1 and doc["metrics"]["oos_sharpe"]["a_minus_b"]["units_for_detect"] == 16


def test_a_replication_pools_its_units_with_the_first_pairs(tmp_path):
    """Two pairs of studies (the second with other epochs and bars: a replication need not match the first) pool
    into one bootstrap over (pair, seed, fold); the same seed in both pairs is two units, two seeds counted."""
    a = study(tmp_path, "a", "rb", dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20])), dict(zip(UNITS, [0.3] * 4)))
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.45, 0.45, 0.10, 0.20])), dict(zip(UNITS, [0.2] * 4)))
    units2 = [(0, 0), (1, 0)]
    a2 = study(tmp_path, "a2", "on", dict(zip(units2, [0.60, 0.10])), dict(zip(units2, [0.1, 0.1])),
               epochs=8, bars=3000, folds=1)
    b2 = study(tmp_path, "b2", "off", dict(zip(units2, [0.70, 0.40])), dict(zip(units2, [0.2, 0.2])),
               epochs=8, bars=3000, folds=1)
    pairs = [(load_side(f"{a}:rb")[0], "rb", load_side(f"{b}:off")[0], "off"),
             (load_side(f"{a2}:on")[0], "on", load_side(f"{b2}:off")[0], "off")]
    c = compare_pooled(pairs, n_boot=2000, seed=0)
    d = c["metrics"]["oos_sharpe"]["a_minus_b"]
    want = np.array([0.05, -0.05, 0.20, 0.0, -0.10, -0.30])
    assert d["n"] == 6 and d["mean"] == pytest.approx(want.mean()) and d["wins"] == 2
    assert c["last_val_seeds"] == {"a_at_least_b": 2, "seeds": 4} and c["pairs"] == 2
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", f"{a2}:on", f"{b2}:off", "--n-boot", "500"])
    assert r.exit_code == 0, r.output
    assert "over 6 units of 2 pairs of studies, pooled" in r.output and "a:rb + a2:on" in r.output
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rb", f"{b}:off", f"{a2}:on"])
    assert r.exit_code == 2 and "give DIR:VARIANT in pairs" in r.output and "Traceback" not in r.output
    with pytest.raises(StudyError, match="differ in folds, epochs, bars"):     # within a pair the units must still match
        compare_pooled([pairs[0][:2] + pairs[1][2:]], n_boot=200)


def test_pairs_of_studies_on_the_same_data_count_each_test_period_once(tmp_path):
    """A replication on the same seeds, folds and bars trades the very OOS bars of the first pair: each (seed, fold)
    test period is one unit of the bootstrap, the mean of the two pairs' differences there — not two units; the
    per-seed count of last-epoch validation stays per (pair, seed)."""
    a = study(tmp_path, "a", "rb", dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20])), dict(zip(UNITS, [0.3] * 4)))
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.45, 0.45, 0.10, 0.20])), dict(zip(UNITS, [0.2] * 4)))
    a2 = study(tmp_path, "a2", "rb", dict(zip(UNITS, [0.30, 0.40, 0.10, 0.60])), dict(zip(UNITS, [0.1] * 4)))
    b2 = study(tmp_path, "b2", "off", dict(zip(UNITS, [0.25, 0.35, 0.20, 0.20])), dict(zip(UNITS, [0.2] * 4)))
    pairs = [(load_side(f"{a}:rb")[0], "rb", load_side(f"{b}:off")[0], "off"),
             (load_side(f"{a2}:rb")[0], "rb", load_side(f"{b2}:off")[0], "off")]
    c = compare_pooled(pairs, n_boot=2000, seed=0)
    d = c["metrics"]["oos_sharpe"]["a_minus_b"]
    per_period = (np.array([0.05, -0.05, 0.20, 0.0]) + np.array([0.05, 0.05, -0.10, 0.40])) / 2
    assert (d["n"], c["units"], c["runs"]) == (4, 4, 8)
    assert d["mean"] == pytest.approx(per_period.mean()) and d["wins"] == int((per_period > 0).sum())
    assert c["last_val_seeds"] == {"a_at_least_b": 2, "seeds": 4}
    assert "the 8 paired (seed, fold) runs trade 4 test periods" in markdown(c, "a:rb + a2:rb", "b:off + b2:off")


def test_a_population_variant_is_compared_over_its_populations(tmp_path):
    """A side whose variant is a population (`feedback.population`, seeds on market seed // 2): the differences are
    over the populations' means — (market, fold) — not over the (seed, fold) units."""
    units = [(s, 0) for s in range(4)]
    spec = dict(seeds=[0, 1, 2, 3], folds=1, seeds_per_market=2)
    a = study(tmp_path, "a", "pop", dict(zip(units, [0.5, 0.3, 0.9, 0.7])), dict(zip(units, [0.1] * 4)), **spec)
    b = study(tmp_path, "b", "off", dict(zip(units, [0.2, 0.2, 0.4, 0.6])), dict(zip(units, [0.1] * 4)), **spec)
    doc = json.loads((a / "results.json").read_text())
    doc["study"]["variants"][0]["settings"] = [["feedback.population", True]]
    (a / "results.json").write_text(json.dumps(doc))
    c = compare(*load_side(f"{a}:pop")[:2], *load_side(f"{b}:off")[:2], n_boot=500)
    d = c["metrics"]["oos_sharpe"]["a_minus_b"]
    assert (d["n"], d["wins"]) == (2, 2) and d["mean"] == pytest.approx(0.25)   # 0.4 − 0.2 and 0.8 − 0.5
    plain = compare(*load_side(f"{b}:off")[:2], *load_side(f"{b}:off")[:2], n_boot=500)
    assert plain["metrics"]["oos_sharpe"]["a_minus_b"]["n"] == 2                # two seeds a market: one period


def test_any_epochs_pairs_studies_that_differ_in_epochs_alone_and_says_so(tmp_path):
    a = study(tmp_path, "a", "rs", dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20])), dict(zip(UNITS, [0.1] * 4)), epochs=6)
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.40] * 4)), dict(zip(UNITS, [0.1] * 4)), epochs=8)
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rs", f"{b}:off", "--n-boot", "500"])
    assert r.exit_code == 2 and "differ in epochs (epochs: 6 vs 8)" in r.output
    r = CliRunner().invoke(app, ["study-compare", f"{a}:rs", f"{b}:off", "--n-boot", "500", "--any-epochs"])
    assert r.exit_code == 0, r.output
    assert "| OOS per-trade Sharpe (val-selected) | +0.350" in r.output and "**-0.050" in r.output
    assert "The sides differ in epochs (6 against 8)" in r.output
    same = study(tmp_path, "c", "off", dict(zip(UNITS, [0.40] * 4)), dict(zip(UNITS, [0.1] * 4)), epochs=6)
    c = compare(*load_side(f"{a}:rs")[:2], *load_side(f"{same}:off")[:2], any_epochs=True)
    assert "epochs" not in c                                  # nothing to say when they agree


def test_any_settings_pairs_studies_trained_otherwise_on_the_same_units_and_says_how(tmp_path):
    a = study(tmp_path, "a", "off", dict(zip(UNITS, [0.50, 0.40, 0.30, 0.20])), dict(zip(UNITS, [0.1] * 4)),
              epochs=8, settings=[["train.iterations", 60], ["schedule.eps_decay_epochs", 8]])
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.40] * 4)), dict(zip(UNITS, [0.1] * 4)))
    r = CliRunner().invoke(app, ["study-compare", f"{a}:off", f"{b}:off", "--n-boot", "500", "--any-epochs"])
    assert r.exit_code == 2 and "differ in settings" in r.output                  # epochs alone are not enough
    r = CliRunner().invoke(app, ["study-compare", f"{a}:off", f"{b}:off", "--n-boot", "500", "--any-settings"])
    assert r.exit_code == 2 and "differ in epochs" in r.output and "settings" not in r.output.split("differ in")[1]
    r = CliRunner().invoke(app, ["study-compare", f"{a}:off", f"{b}:off", "--n-boot", "500", "--any-epochs",
                                 "--any-settings"])
    assert r.exit_code == 0, r.output
    assert "**-0.050" in r.output and "The sides differ in epochs (8 against 4)" in r.output
    assert ("base settings (train.iterations=60, schedule.eps_decay_epochs=8 against train.iterations=120)"
            in r.output)
    c = compare(*load_side(f"{b}:off")[:2], *load_side(f"{b}:off")[:2], n_boot=200, any_settings=True)
    assert "settings" not in c                                # nothing to say when they agree
    dataset = study(tmp_path, "d", "off", dict(zip(UNITS, [0.40] * 4)), dict(zip(UNITS, [0.1] * 4)), dataset="sp500")
    with pytest.raises(StudyError, match="differ in dataset"):   # the units themselves must still be the same
        compare(*load_side(f"{a}:off")[:2], *load_side(f"{dataset}:off")[:2], any_epochs=True, any_settings=True)


def test_the_first_epochs_validation_is_paired_from_the_curves_as_the_studies_shift(tmp_path):
    a = study(tmp_path, "a", "rb", dict(zip(UNITS, [0.5] * 4)), dict(zip(UNITS, [0.3] * 4)))
    b = study(tmp_path, "b", "off", dict(zip(UNITS, [0.4] * 4)), dict(zip(UNITS, [0.2] * 4)))
    ra, va, _ = load_side(f"{a}:rb")
    rb, vb, _ = load_side(f"{b}:off")
    assert "first_val" not in compare(ra, va, rb, vb, n_boot=200)           # no curves: nothing claimed
    first_a = [0.6, 0.7, 0.1, None]                                        # (1, 1): no epoch-1 value on a's side
    first_b = [0.5, 0.4, 0.3, 0.2]
    ra["curves"] = {"rb": {f"{s}/{f}": [x, 0.0] for (s, f), x in zip(UNITS, first_a)}}
    rb["curves"] = {"off": {f"{s}/{f}": [x, 9.0] for (s, f), x in zip(UNITS, first_b)},
                    "other": {"0/0": [9.0]}}
    c = compare(ra, va, rb, vb, n_boot=200)
    assert c["first_val"]["n"] == 3 and c["first_val"]["wins"] == 2
    assert c["first_val"]["mean"] == pytest.approx((0.1 + 0.3 - 0.2) / 3)
    assert c["metrics"]["oos_sharpe"]["a_minus_b"]["mean"] == pytest.approx(0.1)   # the table is unchanged
    assert "Epoch-1 validation, x − y: +0.067" in markdown(c, "x", "y")


def test_two_variants_of_one_study_are_not_said_to_be_two_studies(tmp_path):
    a = study(tmp_path, "a", "rb", dict(zip(UNITS, [0.5] * 4)), dict(zip(UNITS, [0.3] * 4)))
    doc = json.loads((a / "results.json").read_text())
    doc["curves"] = {"rb": {f"{s}/{f}": [0.5, 0.1] for s, f in UNITS},
                     "other": {f"{s}/{f}": [0.4, 0.1] for s, f in UNITS}}
    doc["runs"] += [{"variant": "other", "seed": s, "fold": f, "oos_sharpe": 0.2, "val_sharpe": 0.1,
                     "last_val_sharpe": 0.1} for s, f in UNITS[1:]]
    (a / "results.json").write_text(json.dumps(doc))
    b = study(tmp_path, "b", "rb", dict(zip(UNITS, [0.5] * 4)), dict(zip(UNITS, [0.3] * 4)))
    (b / "results.json").write_text(json.dumps(doc))               # the same study's results, in another place
    (ra, va, _), (ro, vo, _) = load_side(f"{a}:rb"), load_side(f"{a}:other")
    one = markdown(compare(ra, va, ro, vo, n_boot=200), "rb", "other")
    assert "the noise between runs of one study that train alike" in one and "two studies" not in one
    rc, vc, _ = load_side(f"{b}:other")
    two = compare(ra, va, rc, vc, n_boot=200)
    assert two["one_study"] and "noise between runs of one study" in markdown(two, "rb", "other")
    (b / "results.json").write_text(json.dumps({**doc, "runs": doc["runs"][:-1]}))   # another study: a run differs
    rc, vc, _ = load_side(f"{b}:other")
    other = markdown(compare(ra, va, rc, vc, n_boot=200), "rb", "other")
    assert "a shift between the two studies" in other
