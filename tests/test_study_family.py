"""Several variants against one reference: each Δ OOS beside its Bonferroni interval (`stats.paired`'s `family`),
by hand from the documented recipe — the resamples `resample_indices` draws, the quantiles `expanded_tail` gives at
the level 1 − 0.05 / m."""
import json
from pathlib import Path

import numpy as np
import pytest

from tests.test_study_stats import _markdown_of_on_off, _summary
from tradeloop.study.intervals import (
    expanded_tail,
    family_level,
    paired,
    resample_indices,
    t_interval,
)
from tradeloop.study.stats import aggregate

DIFFS = [0.12, 0.05, 0.20, -0.08, 0.09, 0.15, -0.01, 0.10, -0.05, 0.08]
"""Ten units' differences whose 95 % interval clears 0 and whose interval at 99 % (one of five) does not."""


def _by_hand(d: list[float], level: float, n_boot: int = 2000, seed: int = 0) -> tuple[float, float]:
    x = np.asarray(d)
    means = x[resample_indices(x.size, n_boot, seed)].mean(axis=1)
    a = expanded_tail(x.size, level)
    lo, hi = np.quantile(means, [a, 1 - a])
    half = t_interval(x, level)[1] - x.mean()          # each side widened to the t interval where that is wider
    return min(float(lo), x.mean() - half), max(float(hi), x.mean() + half)


def test_the_level_of_each_of_m_intervals():
    assert family_level(1) == pytest.approx(0.95) and family_level(2) == pytest.approx(0.975)
    assert family_level(5) == pytest.approx(0.99) and family_level(0) == pytest.approx(0.95)


def test_a_difference_clear_of_zero_alone_but_not_as_one_of_five_by_hand():
    a = {(s, 0): d for s, d in enumerate(DIFFS)}
    b = {(s, 0): 0.0 for s in range(len(DIFFS))}
    alone = paired(a, b, n_boot=2000, seed=0)
    assert "family" not in alone
    assert (alone["lo"], alone["hi"]) == pytest.approx(_by_hand(DIFFS, 0.95))
    assert alone["lo"] > 0
    five = paired(a, b, n_boot=2000, seed=0, family=5)
    fw = five["family"]
    assert (fw["m"], fw["level"]) == (5, pytest.approx(0.99))
    assert (fw["lo"], fw["hi"]) == pytest.approx(_by_hand(DIFFS, 0.99))
    assert fw["lo"] < 0 < five["lo"] and fw["hi"] > five["hi"]         # wider, from the same resamples
    assert (five["mean"], five["lo"], five["hi"]) == (alone["mean"], alone["lo"], alone["hi"])
    one_unit = paired({(0, 0): 0.1}, {(0, 0): 0.0}, family=5)
    assert "family" not in one_unit                                    # no interval at one unit


def _three_variants() -> list[dict]:
    """on, alt and off on seeds 0–2 of fold 0: OOS on − off = +0.2, +0.3, +0.1; alt − off = −0.1, 0, +0.1."""
    runs = []
    for s, (on, alt, off) in enumerate([(0.3, 0.0, 0.1), (0.5, 0.2, 0.2), (0.4, 0.4, 0.3)]):
        runs += [_summary("on", s, 0, [0.1, 0.4], 2, on), _summary("alt", s, 0, [0.2, 0.3], 2, alt),
                 _summary("off", s, 0, [0.1, 0.2], 2, off)]
    return runs


def test_a_study_of_two_variants_against_the_reference_gives_each_its_family_interval():
    res = aggregate(_three_variants(), [], ["on", "alt", "off"], "off", n_boot=2000, seed=0)
    for name, d in (("on", [0.2, 0.3, 0.1]), ("alt", [-0.1, 0.0, 0.1])):
        p = res["paired"][name]["oos_sharpe"]
        assert p["mean"] == pytest.approx(np.mean(d))
        assert (p["family"]["m"], p["family"]["level"]) == (2, pytest.approx(0.975))
        assert (p["family"]["lo"], p["family"]["hi"]) == pytest.approx(_by_hand(d, 0.975))
        assert "family" not in res["paired"][name]["val_sharpe"]     # the primary endpoint only
    md = _markdown_of_on_off(res)
    row = next(x for x in md.splitlines() if x.startswith("| on | "))
    fw = res["paired"]["on"]["oos_sharpe"]["family"]
    assert f"; of 2: [{fw['lo']:+.3f}, {fw['hi']:+.3f}]" in row
    assert "2 variants are compared with off" in md and "at 97.5 %" in md


def test_one_variant_against_the_reference_has_no_family():
    runs = [m for m in _three_variants() if m["variant"] != "alt"]
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)
    assert "family" not in res["paired"]["on"]["oos_sharpe"]
    md = _markdown_of_on_off(res)
    assert "variants are compared with" not in md and "; of " not in md


def test_the_figure_draws_each_family_interval(tmp_path, monkeypatch):
    """report.png's paired panel: beside each Δ OOS CI its family interval (a second, wider bar), named in the
    panel's title."""
    import matplotlib.axes

    from tradeloop.study.report import plot

    res = aggregate(_three_variants(), [], ["on", "alt", "off"], "off", n_boot=2000, seed=0)
    _markdown_of_on_off(res)                                         # the study keys the figure reads
    bars, titles = [], []
    errorbar, set_ = matplotlib.axes.Axes.errorbar, matplotlib.axes.Axes.set
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, yerr=None, **kw: bars.append((x[0], y[0], yerr)) or
                        errorbar(self, x, y, yerr=yerr, **kw))
    monkeypatch.setattr(matplotlib.axes.Axes, "set",
                        lambda self, **kw: titles.append(kw.get("title", "")) or set_(self, **kw))
    plot(res, tmp_path / "report.png")
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fw = res["paired"]["on"]["oos_sharpe"]["family"]
    mean = res["paired"]["on"]["oos_sharpe"]["mean"]
    assert any(x == 0.2 and y == mean and yerr == [[mean - fw["lo"]], [fw["hi"] - mean]] for x, y, yerr in bars)
    assert any("grey: as one of 2, Bonferroni" in t for t in titles)


def test_units_that_share_a_test_period_are_read_over_the_periods():
    """A real series: every seed of a fold trades the same test bars, so 2 seeds × 3 folds are 6 units but 3 periods.
    OOS on (seed 0, 1): fold 0 0.2, 0.4 → 0.3; fold 1 0.1, 0.1 → 0.1; fold 2 0.6, 0.2 → 0.4; off 0.1 on every unit: the
    periods' means 0.3, 0.1, 0.4 and on − off 0.2, 0.0, 0.3 — the headline CIs are over those 3 (with the t interval
    at 2 df), not over the 6 units; a deterministic baseline's 6 copies of 3 numbers are 3 periods too."""
    oos = {(0, 0): 0.2, (1, 0): 0.4, (0, 1): 0.1, (1, 1): 0.1, (0, 2): 0.6, (1, 2): 0.2}
    runs = [_summary("on", s, f, [0.1, 0.2], 2, x) for (s, f), x in oos.items()] + \
           [_summary("off", s, f, [0.1, 0.2], 2, 0.1) for (s, f) in oos]
    flat = [{"policy": "buy_and_hold", "seed": s, "fold": f, "oos_sharpe": 0.1 * (f + 1), "val_sharpe": 0.2,
             "val_trades": 1, "oos_trades": 1, "oos_bar_sharpe": 0.01} for (s, f) in oos]
    res = aggregate(runs, flat, ["on", "off"], "off", n_boot=2000, seed=0, cluster_of=lambda s, f: (None, f))
    assert res["periods"] == {"periods": 3, "units": 6}
    on = res["variants"]["on"]["oos_sharpe"]
    assert on["mean"] == pytest.approx(0.8 / 3) and on["n"] == 3
    lo, hi = t_interval([0.3, 0.1, 0.4])
    assert on["lo"] <= lo and on["hi"] >= hi
    d = res["paired"]["on"]["oos_sharpe"]
    assert (d["n"], d["wins"]) == (3, 2) and d["mean"] == pytest.approx(0.5 / 3)
    assert (d["lo"], d["hi"]) == pytest.approx(t_interval([0.2, 0.0, 0.3]))   # wider than the percentile one here
    b = res["baselines"]["buy_and_hold"]["oos_sharpe"]
    assert b["n"] == 3 and (b["lo"], b["hi"]) == pytest.approx(t_interval([0.1, 0.2, 0.3]))
    assert res["choice"] is None                                               # a unit-by-unit reading: none here
    md = _markdown_of_on_off(res)
    assert "the 6 (seed, fold) units share 3 test periods" in md and "bootstrap over the 3 test periods" in md
    assert "over units" not in md and "mean [95 % CI] over test periods" in md
    own = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)            # a market each: units
    assert "periods" not in own and "test periods" not in _markdown_of_on_off(own)
    assert own["variants"]["on"]["oos_sharpe"]["n"] == 6 and own["paired"]["on"]["oos_sharpe"]["n"] == 6


def test_bench_periods_reads_a_stored_study_over_its_test_periods(capsys):
    """bench/periods.py on the stored S&P 500 study (5 seeds × 3 folds of one series) and on a synthetic one."""
    from bench import periods

    root = Path(__file__).resolve().parents[1] / "docs"
    periods.main([str(root / "study-h100-real-sp500"), str(root / "study-h100-onoff-default")])
    sp, syn = capsys.readouterr().out.splitlines()
    assert "3 test periods of 15 units; off +0.060 [" in sp and "paired rollback − off -0.013 [" in sp
    assert syn.endswith("every (seed, fold) unit has a test period of its own")


def test_an_interval_stays_within_what_its_quantity_can_be():
    """The t widening knows no bounds: over two units a DSR's interval ran to [−3.3, 3.9] and a trade count's below 0."""
    from tradeloop.study.intervals import bootstrap_ci

    free = bootstrap_ci([0.05, 0.9], n_boot=500)
    held = bootstrap_ci([0.05, 0.9], n_boot=500, bounds=(0.0, 1.0))
    assert free["lo"] < 0 and free["hi"] > 1 and (held["lo"], held["hi"]) == (0.0, 1.0)
    runs = [_summary("on", s, 0, [0.1, 0.2], 2, 0.3, trades=n) for s, n in ((0, 30), (1, 300))] + \
           [_summary("off", s, 0, [0.1, 0.2], 2, 0.1, trades=n) for s, n in ((0, 40), (1, 35))]
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=500, seed=0)
    on = res["variants"]["on"]
    assert 0.0 <= on["dsr"]["lo"] <= on["dsr"]["hi"] <= 1.0 and on["val_trades"]["lo"] == 0.0
    assert -1.0 <= res["paired"]["on"]["dsr"]["lo"] and res["paired"]["on"]["dsr"]["hi"] <= 1.0


def test_an_epoch_of_fewer_than_two_validation_trades_has_no_sharpe_to_average():
    """Its per-trade Sharpe is booked 0.0 (undefined): the last-epoch figure and how far the policy moves leave it out
    instead of averaging a zero that was never measured."""
    runs = [_summary("on", s, 0, [0.4, 0.2, 0.6], 1, 0.3) for s in (0, 1)] + \
           [_summary("off", s, 0, [0.1, 0.3, 0.0], 2, 0.1) for s in (0, 1)]
    runs[3]["epochs"][-1]["val_trades"] = 1                   # off-s1-f0's last epoch: one trade, no Sharpe
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=500, seed=0)
    rows = {r["run_id"]: r for r in res["runs"]}
    assert rows["off-s1-f0"]["last_val_sharpe"] is None and rows["off-s0-f0"]["last_val_sharpe"] == 0.0
    assert rows["off-s1-f0"]["val_step"] == pytest.approx(0.2)          # |0.3 − 0.1| alone, not also |0 − 0.3|
    assert res["variants"]["off"]["last_val_sharpe"]["n"] == 1 and res["paired"]["on"]["last_val_sharpe"]["n"] == 1
    # the validation curves (report.png, results.json) hold no Sharpe there either: None, not a drawn 0.0
    assert res["curves"]["off"] == {"0/0": [0.1, 0.3, 0.0], "1/0": [0.1, 0.3, None]}


def test_bench_verdicts_reads_the_stored_verdicts_again_under_todays_rule(capsys):
    """bench/verdicts.py: the SWA study's `gamma97` (mean DSR 0.986, a run far below the bar) was a validated edge by
    its mean and is none by the mean's interval; its `off` stays as stored."""
    from bench import verdicts

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "docs" / "study-h200-swa" / "results.json").read_text())
    got = verdicts.verdicts(res)
    old, new, ci = got["gamma97"]
    assert (old, new) == ("validated edge", "no validated edge") and ci["mean"] >= 0.95 > ci["lo"]
    assert got["off"][0] == got["off"][1]
    verdicts.main([str(root / "docs" / "study-h200-swa")])
    assert "study-h200-swa:gamma97: validated edge -> no validated edge" in capsys.readouterr().out
