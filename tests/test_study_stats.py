"""`tradeloop study`'s statistics and its variant grammar: hand-computed cases (pure logic, no runs)."""
from __future__ import annotations

import math
import typing
from dataclasses import dataclass

import numpy as np
import pytest

from services.feedback.signals import FeedbackConfig
from services.trainer.train import TrainConfig
from shared.metrics import dsr
from tradeloop.study.spec import (StudyError, StudySpec, apply_settings, parse_value, parse_variants, resolve_key,
                                  synthetic_bars_for, variants_from_toml)
from tradeloop.study.stats import aggregate, power_cells, select_epoch
from tradeloop.study.intervals import bootstrap_ci, detectable, expanded_tail, gap_ci, paired, percentile_ci, t_quantile, units_to_detect


# --- selection on validation only ---------------------------------------------------------------------------
def test_selection_takes_the_best_validation_sharpe_with_enough_trades_not_what_oos_would_pick():
    # epoch:           1     2     3     4
    val_sharpe = [0.50, 0.90, 0.70, 0.70]
    val_trades = [30, 5, 25, 40]          # epoch 2 has the best val Sharpe but too few trades
    oos_sharpe = [0.80, 1.20, -0.30, 0.10]  # OOS would pick epoch 2 (or epoch 1 among those with enough trades)
    epoch, selectable = select_epoch(val_sharpe, val_trades, min_trades=20)
    assert (epoch, selectable) == (3, True)            # the earliest of the two 0.70s
    assert oos_sharpe[epoch - 1] == -0.30               # and its OOS is what the study reports, bad as it is
    assert int(np.argmax(oos_sharpe)) + 1 != epoch
    # no epoch with enough trades: the best of all, flagged
    assert select_epoch(val_sharpe, val_trades, min_trades=100) == (2, False)
    with pytest.raises(ValueError):
        select_epoch([0.1], [1, 2], 0)


# --- bootstrap CIs: exact distributions of the resampled mean -------------------------------------------------
def test_the_percentile_interval_of_two_values_spans_both_and_the_t_interval_widens_it():
    # resampled mean of [0, 1] ∈ {0, ½, 1} with P = ¼, ½, ¼: its 2.5 % and 97.5 % quantiles are 0 and 1; the t interval,
    # ½ ± t₀.₉₇₅,₁ · s / √2 = ½ ± 12.706205 · ½, reaches further on both sides
    assert percentile_ci([0.0, 1.0], n_boot=20_000, seed=0) == (0.0, 1.0)
    ci = bootstrap_ci([0.0, 1.0], n_boot=20_000, seed=0)
    assert (ci["mean"], ci["n"]) == (0.5, 2)
    assert (ci["lo"], ci["hi"]) == pytest.approx((0.5 - 6.3531025, 0.5 + 6.3531025), abs=1e-6)


def test_the_percentile_interval_of_a_skewed_sample_matches_the_binomial_quantiles():
    # mean of 4 draws from [0, 0, 0, 1] = K/4, K ~ Binomial(4, ¼). At n = 4 the expanded tail is
    # α′/2 = 1 − Φ(√(4/3) · t₀.₉₇₅,₃) = 1 − Φ(1.1547 · 3.1824) = 1.2e-4: P(K = 0) = 0.316 > α′/2 → lo = 0;
    # P(K = 4) = 1/256 = 0.0039 > α′/2 → hi = 1 (the plain 97.5 % quantile would stop at 3/4: P(K ≤ 3) = 0.996)
    assert percentile_ci([0.0, 0.0, 0.0, 1.0], n_boot=20_000, seed=7) == (0.0, 1.0)
    # s = ½, s / √4 = ¼: the t interval ¼ ± 3.182446 · ¼ is the wider on both sides
    ci = bootstrap_ci([0.0, 0.0, 0.0, 1.0], n_boot=20_000, seed=7)
    assert ci["mean"] == 0.25 and (ci["lo"], ci["hi"]) == pytest.approx((0.25 - 0.7956115, 0.25 + 0.7956115), abs=1e-6)


def test_the_interval_covers_a_normal_mean_at_three_units_where_the_percentile_one_does_not():
    # 600 samples of 3 units from N(0, 1): a percentile interval cannot reach past the sample's extremes, which hold
    # the mean 0 with probability 1 − 2 · ½³ = 0.75; widened to the t interval it holds it about 95 % of the time
    rng = np.random.default_rng(5)
    hit = perc = 0
    for k in range(600):
        x = rng.normal(size=3)
        ci = bootstrap_ci(x, n_boot=500, seed=k)
        lo, hi = percentile_ci(x, n_boot=500, seed=k)
        hit += ci["lo"] <= 0.0 <= ci["hi"]
        perc += lo <= 0.0 <= hi
    assert hit / 600 >= 0.93 and perc / 600 <= 0.80


def test_t_quantiles_and_the_expanded_tails_match_the_tables():
    # Student's t 97.5 % points from the standard tables
    for df, t in [(1, 12.706205), (3, 3.182446), (5, 2.570582), (14, 2.144787), (30, 2.042272)]:
        assert t_quantile(0.975, df) == pytest.approx(t, abs=2e-6)
    # n = 6: √(6/5) · 2.570582 = 2.81592, 1 − Φ(2.81592) = 0.002432; n = 15: √(15/14) · 2.144787 = 2.22006 → 0.013207
    assert expanded_tail(6) == pytest.approx(0.002432, abs=2e-6)
    assert expanded_tail(15) == pytest.approx(0.013207, abs=2e-6)
    assert expanded_tail(10_000) == pytest.approx(0.025, abs=2e-4)      # tends to the plain interval
    with pytest.raises(ValueError):
        t_quantile(0.3, 5)


def test_the_expanded_interval_covers_a_normal_mean_at_six_units_where_the_plain_one_does_not():
    # 1 000 samples of 6 units from N(0, 1): the share of CIs that hold the true mean 0
    rng = np.random.default_rng(11)
    hit, plain = 0, 0
    for k in range(1000):
        x = rng.normal(size=6)
        ci = bootstrap_ci(x, n_boot=2000, seed=k)
        hit += ci["lo"] <= 0.0 <= ci["hi"]
        means = x[np.random.default_rng(k).integers(0, 6, size=(2000, 6))].mean(axis=1)
        lo, hi = np.quantile(means, [0.025, 0.975])
        plain += lo <= 0.0 <= hi
    assert 0.925 <= hit / 1000 <= 0.975          # nominal 95 % (SE of the share ≈ 0.007)
    assert plain / 1000 < 0.91                   # the plain percentile interval under-covers at n = 6


def test_bootstrap_ci_is_fixed_by_its_seed_and_equals_the_documented_procedure():
    x = np.array([0.3, -0.1, 0.8, 0.05, 0.4, -0.6, 1.1])
    a, b = bootstrap_ci(x, n_boot=5000, seed=3), bootstrap_ci(x, n_boot=5000, seed=3)
    assert a == b
    assert percentile_ci(x, n_boot=5000, seed=4) != percentile_ci(x, n_boot=5000, seed=3)
    # the procedure written out: one integers(0, n, size=(B, n)) draw, the mean per row, numpy's quantiles at the
    # expanded tail of n = 7: 1 − Φ(√(7/6) · t₀.₉₇₅,₆) = 1 − Φ(1.0801 · 2.446912) = 0.004109
    rng = np.random.default_rng(3)
    idx = rng.integers(0, len(x), size=(5000, len(x)))
    means = [x[row].mean() for row in idx]
    lo, hi = np.quantile(means, [0.004109, 1 - 0.004109])
    assert percentile_ci(x, n_boot=5000, seed=3) == pytest.approx((lo, hi), abs=1e-12)
    # each side widened to the t interval where that reaches further: mean ± t₀.₉₇₅,₆ · s / √7, t₀.₉₇₅,₆ = 2.446912
    half = 2.446912 * x.std(ddof=1) / np.sqrt(7)
    lo, hi = min(lo, x.mean() - half), max(hi, x.mean() + half)
    assert a["lo"] == pytest.approx(lo, abs=1e-6) and a["hi"] == pytest.approx(hi, abs=1e-6)
    assert a["mean"] == pytest.approx(x.mean())
    assert bootstrap_ci([2.5])["lo"] == bootstrap_ci([2.5])["hi"] == 2.5
    assert bootstrap_ci([])["mean"] is None


def test_paired_difference_on_shared_units_by_hand():
    a = {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 3.0}
    b = {(0, 0): 0.0, (0, 1): 2.0, (1, 0): 1.0, (1, 1): 9.0}   # (1, 1) has no partner: left out
    d = paired(a, b, n_boot=20_000, seed=0)
    # differences [1, 0, 2]: mean 1; resampled sums 0 and 6 each have P = 1/27 = 3.7 % > 2.5 % → percentile [0, 2],
    # within the t interval 1 ± t₀.₉₇₅,₂ · 1 / √3 = 1 ± 4.302653 · 0.577350
    assert (d["mean"], d["n"], d["wins"]) == (1.0, 3, 2)
    assert (d["lo"], d["hi"]) == pytest.approx((1 - 2.4841377, 1 + 2.4841377), abs=1e-6)


def test_what_a_paired_comparison_can_resolve_by_hand():
    """Differences [0.1, −0.1, 0.2, 0.0, 0.3]: mean 0.1, sd √(0.1 / 4) = 0.158114. With t₀.₉₇₅,₄ = 2.7764 and
    t₀.₈,₄ = 0.9410 (tables) the smallest difference 5 units resolve at 80 % power is 3.7174 · 0.158114 / √5 =
    0.26286; the observed 0.1 needs 22 units: at 21, (t₀.₉₇₅,₂₀ 2.0860 + t₀.₈,₂₀ 0.8600) · sd / √21 = 0.1016 > 0.1, at
    22, (2.0796 + 0.8591) · sd / √22 = 0.0991."""
    a = {(0, f): x for f, x in enumerate([0.6, 0.4, 0.7, 0.5, 0.8])}
    b = {(0, f): 0.5 for f in range(5)}
    d = paired(a, b, n_boot=2000)
    sd = (0.1 / 4) ** 0.5
    assert d["mean"] == pytest.approx(0.1) and d["sd"] == pytest.approx(sd)
    assert d["detectable"] == pytest.approx((2.7764 + 0.9410) * sd / 5 ** 0.5, abs=2e-4)
    assert d["units_to_detect"] == 22
    at_21 = detectable(sd, 21)
    assert at_21 == pytest.approx((2.0860 + 0.8600) * sd / 21 ** 0.5, abs=2e-4) and at_21 > 0.1
    assert units_to_detect(-0.1, sd) == 22                     # a loss is resolved as a gain is
    assert units_to_detect(0.0, sd) is None and units_to_detect(1e-4, sd) is None     # beyond MOST_UNITS
    assert units_to_detect(0.5, 0.0) == 2
    assert power_cells(d) == "0.263 | 22"
    one = paired({(0, 0): 1.0}, {(0, 0): 0.5})
    assert one["sd"] is None and one["detectable"] is None and power_cells(one) == "n/a | n/a"
    assert power_cells({**d, "units_to_detect": None}) == "0.263 | > 100 000"
    same = paired(b, b)                                         # identical variants: no difference to resolve
    assert (same["mean"], same["sd"], same["units_to_detect"]) == (0.0, 0.0, None)
    assert power_cells(same) == "0.000 | n/a (Δ = 0)"
    with pytest.raises(ValueError, match="n >= 2"):
        detectable(sd, 1)


def test_gap_is_the_gap_of_the_means_and_undefined_when_validation_is_not_positive():
    g = gap_ci([0.4, 0.6], [0.2, 0.3], n_boot=2000)
    assert g["mean"] == pytest.approx(0.5) and g["lo"] == pytest.approx(0.5) and g["hi"] == pytest.approx(0.5)
    assert gap_ci([-0.1, 0.05], [0.2, 0.3])["mean"] is None


def _summary(variant, seed, fold, vals, sel, oos, trades=30):
    rng = np.random.default_rng(seed * 10 + fold + (variant == "on"))
    return {"run_id": f"{variant}-s{seed}-f{fold}", "variant": variant, "seed": seed, "fold": fold,
            "selected_epoch": sel, "selectable": True, "val_sharpe": vals[sel - 1], "oos_sharpe": oos,
            "val_trades": trades, "oos_trades": trades, "run_dsr": 0.5, "first_epoch_key": "k",
            "selected_val_trade_returns": list(rng.normal(0.01, 0.02, trades)),
            "epochs": [{"epoch": i + 1, "val_sharpe": v,
                        "checkpoint_sha256": f"same-{seed}-{fold}" if i == 0 else f"{variant}-{seed}-{fold}-{i}"}
                       for i, v in enumerate(vals)]}


def _two_units():
    """on and off on seeds 0 and 1 of fold 0: the hand-computed case several tests share."""
    return [_summary("on", 0, 0, [0.1, 0.4], 2, 0.30), _summary("off", 0, 0, [0.1, 0.2], 2, 0.10),
            _summary("on", 1, 0, [0.2, 0.5], 2, 0.50), _summary("off", 1, 0, [0.2, 0.1], 1, 0.20)]


def test_aggregate_deflates_by_every_distinct_checkpoint_of_the_study_and_pairs_by_seed_and_fold():
    """8 checkpoints, of which each unit's epoch 1 is one file in both variants (the same sha256): 6 trials."""
    runs = _two_units()
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)
    allv = [0.1, 0.4, 0.2, 0.2, 0.5, 0.1]                 # on-s0 1, 2; off-s0 2; on-s1 1, 2; off-s1 2
    assert res["n_trials"] == 6 and res["trial_sharpe_var"] == pytest.approx(np.var(allv, ddof=1))
    row = next(r for r in res["runs"] if r["run_id"] == "on-s1-f0")
    assert row["dsr"] == pytest.approx(dsr(runs[2]["selected_val_trade_returns"], 6, np.var(allv, ddof=1)))
    p = res["paired"]["on"]["oos_sharpe"]
    assert p["mean"] == pytest.approx(((0.30 - 0.10) + (0.50 - 0.20)) / 2) and p["wins"] == 2 and p["n"] == 2
    assert res["paired"]["on"]["last_val_sharpe"]["mean"] == pytest.approx(((0.4 - 0.2) + (0.5 - 0.1)) / 2)
    assert res["variants"]["on"]["oos_sharpe"]["mean"] == pytest.approx(0.40)
    assert res["variants"]["on"]["gap"]["mean"] == pytest.approx(1 - 0.40 / 0.45)
    assert res["variants"]["on"]["verdict"] == ("validated edge" if res["variants"]["on"]["dsr"]["lo"] >= 0.95
                                                else "no validated edge")
    assert res["pairing"] == {"groups": 2, "identical_checkpoints": 2, "max_epoch1_val_spread": 0.0,
                              "mean_epoch1_val_spread": 0.0, "later_epochs": {}}     # no knobs_key: epoch 1 alone


def test_pairing_follows_the_epochs_a_group_still_trained_alike():
    from tradeloop.study.report import markdown

    runs = [_summary("on", 0, 0, [0.5, 0.2, 0.4, 0.3], 1, 0.3), _summary("off", 0, 0, [0.6, 0.5, 0.1, 0.2], 1, 0.2),
            _summary("on", 1, 0, [0.5, 0.2, 0.4], 1, 0.3), _summary("off", 1, 0, [0.4, 0.6, 0.1], 1, 0.2)]
    for m in runs:
        for e in m["epochs"]:
            e["knobs_key"], e["rollback"] = f"k{e['epoch']}", False
    runs[0]["epochs"][2]["rollback"] = True          # unit 0: on's epoch 4 began from a rollback → alike to epoch 3
    runs[3]["epochs"][1]["knobs_key"] = "other"      # unit 1: off's epoch 2 trained under other knobs → epoch 1 only
    p = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)["pairing"]
    assert p["groups"] == 2 and p["mean_epoch1_val_spread"] == pytest.approx((0.1 + 0.1) / 2)
    assert list(p["later_epochs"]) == ["2", "3"]
    assert p["later_epochs"]["2"] == pytest.approx({"groups": 1, "mean_val_spread": 0.3, "max_val_spread": 0.3})
    assert p["later_epochs"]["3"] == pytest.approx({"groups": 1, "mean_val_spread": 0.3, "max_val_spread": 0.3})
    runs[1]["epochs"][1]["rollback"] = True          # off's epoch 3 of unit 0 began from one too (rollback after 2)
    p = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)["pairing"]
    assert list(p["later_epochs"]) == ["2"]
    res = {**aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0),
           "study": {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in ("on", "off")],
                     "seeds": [0, 1], "folds": 1, "epochs": 4, "preset": "small", "settings": [], "device": "cpu",
                     "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 200,
                     "ci_seed": 0},
           "timing": {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 14, "epochs_per_s": 1.4}}
    assert "val spread within a group: epoch 2: mean 0.3000, max 0.3000 (1 of 2 groups)." in " ".join(markdown(res).split())


def _ci2(a: float, b: float, floor: float | None = None) -> str:
    """The 95 % CI of the mean of two units as the report prints it: the t interval (a + b) / 2 ± t₀.₉₇₅,₁ · s / √2,
    s / √2 = |a − b| / 2, t₀.₉₇₅,₁ = 12.706205 — wider than any percentile interval of two values — held at `floor`
    (a standard deviation's 0)."""
    m, h = (a + b) / 2, 12.706205 * abs(a - b) / 2
    return f"[{m - h if floor is None else max(m - h, floor):+.3f}, {m + h:+.3f}]"


def test_what_a_rollback_led_to_is_the_next_epochs_validation_against_the_epoch_it_restored():
    from tradeloop.study.report import markdown

    runs = [_summary("on", 0, 0, [0.5, 0.2, 0.3, 0.6], 1, 0.3), _summary("on", 1, 0, [0.4, 0.6, 0.1, 0.5], 2, 0.3),
            _summary("on", 2, 0, [0.3, 0.1, 0.2, 0.2], 1, 0.3), _summary("off", 0, 0, [0.2, 0.1, 0.2, 0.2], 1, 0.2)]
    # (after epoch, restored epoch): run 0 after 2 → 1 and after 3 → 1; run 1 after 3 → 2 and after its last epoch
    # (which starts nothing); run 2 after 2 → 1 but an exploit took its place
    for m, rolls in zip(runs, ({2: 1, 3: 1}, {3: 2, 4: 2}, {2: 1}, {})):
        for e in m["epochs"]:
            e["rollback"], e["rollback_to"] = e["epoch"] in rolls, rolls.get(e["epoch"])
    runs[2]["epochs"][1]["exploit"] = {"run": "on-s0-f0", "epoch": 1, "val_sharpe": 0.5}
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)
    steps = {r["run_id"]: r["rollback_steps"] for r in res["runs"]}
    assert steps["on-s0-f0"] == pytest.approx([0.3 - 0.5, 0.6 - 0.5]) and steps["on-s1-f0"] == pytest.approx([0.5 - 0.6])
    assert steps["on-s2-f0"] == [] and steps["off-s0-f0"] == []
    after = res["variants"]["on"]["after_rollback"]                  # over runs, each run's mean: −0.05 and −0.10
    assert after["mean"] == pytest.approx(-0.075) and (after["rollbacks"], after["higher"]) == (3, 1)
    # two runs: the t interval −0.075 ± t₀.₉₇₅,₁ · 0.025 = −0.075 ± 12.706205 · 0.025 (the percentile one: [−0.10, −0.05])
    assert (after["lo"], after["hi"]) == pytest.approx((-0.075 - 0.3176551, -0.075 + 0.3176551), abs=1e-6)
    assert "after_rollback" not in res["variants"]["off"]
    res["study"] = {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in ("on", "off")],
                    "seeds": [0, 1, 2], "folds": 1, "epochs": 4, "preset": "small", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 200,
                    "ci_seed": 0}
    res["timing"] = {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 16, "epochs_per_s": 1.6}
    assert "minus that of the epoch it restored" in markdown(res)
    assert f"on -0.075 {_ci2(-0.05, -0.10)} (1 of 3 higher)." in " ".join(markdown(res).split())
    for m in runs:                                      # a summary written before `rollback_to` was kept: none
        for e in m["epochs"]:
            del e["rollback_to"]
    assert "after_rollback" not in aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)["variants"]["on"]


def test_rollbacks_count_the_epochs_that_began_from_one_not_the_last_epochs_bundle():
    from tradeloop.study.report import markdown

    runs = [_summary("on", 0, 0, [0.5, 0.1, 0.4], 1, 0.3), _summary("on", 1, 0, [0.5, 0.4, 0.6], 3, 0.3),
            _summary("off", 0, 0, [0.2, 0.1, 0.2], 1, 0.2), _summary("off", 1, 0, [0.2, 0.3, 0.2], 2, 0.2)]
    for m, flags in zip(runs, ([False, True, True], [True, False, True], [False] * 3, [False] * 3)):
        for e, f in zip(m["epochs"], flags):
            e["rollback"] = f                    # the bundle of this epoch asked for one before the next
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)
    assert {r["run_id"]: r["rollbacks"] for r in res["runs"]} == {"on-s0-f0": 1, "on-s1-f0": 1, "off-s0-f0": 0,
                                                                  "off-s1-f0": 0}
    assert (res["variants"]["on"]["rollbacks"], res["variants"]["on"]["rollback_chances"]) == (2, 4)
    res["study"] = {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in ("on", "off")],
                    "seeds": [0, 1], "folds": 1, "epochs": 3, "preset": "small", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 200,
                    "ci_seed": 0}
    res["timing"] = {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 12, "epochs_per_s": 1.2}
    assert "Epochs that began from a feedback rollback (of those after a run's first): on 2 of 4." in markdown(res)
    assert "another run's epoch" not in markdown(res)
    # how far the policy moves between epochs: on [0.5, 0.1, 0.4] → 0.35, [0.5, 0.4, 0.6] → 0.15; off 0.1 and 0.1
    assert [r["val_step"] for r in res["runs"]] == pytest.approx([0.35, 0.15, 0.1, 0.1])
    assert res["variants"]["on"]["val_step"]["mean"] == pytest.approx(0.25)
    assert ("epoch to the next (mean |Δ val per-trade Sharpe| between a run's consecutive epochs; mean [95 % CI] over "
            "units): on +0.250 [-1.021, +1.521]; off +0.100 [+0.100, +0.100].")   # 0.25 ± 12.706205 · 0.1 in " ".join(markdown(res).split())
    # the typical epoch: on [0.5, 0.1, 0.4] → mean 1/3, deviations 1/6, −7/30, 1/15 → var 0.26/9 (ddof 0);
    # [0.5, 0.4, 0.6] → 0.5, var 0.02/3; off [0.2, 0.1, 0.2] → 1/6, [0.2, 0.3, 0.2] → 7/30, var 0.02/9 each
    assert [r["val_epochs_mean"] for r in res["runs"]] == pytest.approx([1 / 3, 0.5, 1 / 6, 7 / 30])
    assert [r["val_epochs_sd"] for r in res["runs"]] == pytest.approx(
        [(0.26 / 9) ** 0.5, (0.02 / 3) ** 0.5, (0.02 / 9) ** 0.5, (0.02 / 9) ** 0.5])
    assert res["variants"]["on"]["epochs_val"]["mean"]["mean"] == pytest.approx(5 / 12)
    typical = res["paired"]["on"]["val_epochs_mean"]                 # on − off: 1/3 − 1/6 and 0.5 − 7/30, both won
    assert typical["mean"] == pytest.approx((1 / 6 + 4 / 15) / 2) and typical["wins"] == 2
    sd = [(0.26 / 9) ** 0.5, (0.02 / 3) ** 0.5]
    assert ("The typical epoch beside the selected one (a run's mean val per-trade Sharpe over its epochs, and their "
            "standard deviation within the run; mean [95 % CI] over units — the choice on validation keeps the best "
            f"draw, so the spread counts as much as the mean): on +0.417 {_ci2(1 / 3, 0.5)}, sd +0.126 {_ci2(*sd, 0.0)}; "
            "off +0.200 " + _ci2(1 / 6, 7 / 30) + ", sd +0.047 [+0.047, +0.047]; paired on − off +0.217 "
            f"{_ci2(1 / 6, 4 / 15)} (2/2).") in " ".join(markdown(res).split())
    # the first epoch against the later ones: on 0.5 | mean(0.1, 0.4) = 0.25 and 0.5 | 0.5; off 0.2 | 0.15 and
    # 0.2 | 0.25 → paired epoch 1 +0.3 twice, later +0.1 and +0.25
    assert [x for r in res["runs"] for x in (r["val_epoch1"], r["val_later_mean"])] == pytest.approx(
        [0.5, 0.25, 0.5, 0.5, 0.2, 0.15, 0.2, 0.25])
    later = res["paired"]["on"]["val_later_mean"]
    assert later["mean"] == pytest.approx(0.175) and f"[{later['lo']:+.3f}, {later['hi']:+.3f}]" == _ci2(0.1, 0.25)
    assert ("so its difference there is the pairing's noise): epoch 1 on − off +0.300 [+0.300, +0.300] (2/2); the "
            f"mean of epochs 2–3 on − off +0.175 {_ci2(0.1, 0.25)} (2/2).") in " ".join(markdown(res).split())
    # in sample beside validation: on's runs carry it at every epoch, off's not (summaries written before it was kept)
    for m, ins in zip(runs[:2], ([0.6, 0.8, 1.0], [0.6, 0.7, 0.9])):
        for e, x in zip(m["epochs"], ins):
            e["insample_sharpe"] = x
    res3 = {**res, **aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)}
    assert set(res3["curves_insample"]) == {"on"} and res3["curves_insample"]["on"]["1/0"] == [0.6, 0.7, 0.9]
    # on: in sample 0.6 → mean(0.9, 0.8) = 0.85; validation 0.5 → mean(0.25, 0.5) = 0.375. The gap in sample −
    # validation: run 1 0.1 | 0.7, 0.6 → widens 0.55; run 2 0.1 | 0.3, 0.3 → 0.2; mean 0.375 over the 2 units
    assert [r["gap_widening"] for r in res3["runs"][:2]] == pytest.approx([0.55, 0.2])
    assert all(r["gap_widening"] is None for r in res3["runs"][2:]) and "gap_widening" not in res3["variants"]["off"]
    wide = res3["variants"]["on"]["gap_widening"]
    assert (wide["mean"], wide["widened"]) == pytest.approx((0.375, 2))
    assert f"[{wide['lo']:+.3f}, {wide['hi']:+.3f}]" == _ci2(0.2, 0.55)
    assert ("epoch 1 → the mean of epochs 2–E — in sample rising while validation falls is overfitting the training "
            "split; the widening of the gap, in sample − validation, mean [95 % CI] over units and how many widened): "
            "on in sample +0.600 → +0.850, validation +0.500 → +0.375, the gap between them widening +0.375 "
            f"{_ci2(0.2, 0.55)} (2/2).") in " ".join(markdown(res3).split())
    assert "In sample beside validation" not in markdown(res)
    assert "gap_widening" not in res3["paired"]["on"]                            # off has no in-sample record
    # off's runs with one too: in sample at validation's level at every epoch (0.2 0.1 0.2 and 0.2 0.3 0.2), so their
    # gap does not widen, and on − off is on's own widening, 0.55 and 0.2
    for m, ins in zip(runs[2:], ([0.2, 0.1, 0.2], [0.2, 0.3, 0.2])):
        for e, x in zip(m["epochs"], ins):
            e["insample_sharpe"] = x
    res4 = {**res, **aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)}
    off_wide = res4["variants"]["off"]["gap_widening"]
    assert (off_wide["mean"], off_wide["widened"]) == (0, 0)
    pw = res4["paired"]["on"]["gap_widening"]
    assert (pw["mean"], pw["wins"]) == pytest.approx((0.375, 2))
    assert (f"widening +0.000 [+0.000, +0.000] (0/2); paired widening on − off +0.375 {_ci2(0.2, 0.55)} (2/2)."
            in " ".join(markdown(res4).split()))
    runs[2]["epochs"] = runs[2]["epochs"][:1]                 # a run of one epoch: none for its variant, no pairing
    res2 = {**res, **aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)}
    assert res2["runs"][2]["val_epochs_sd"] is None and "epochs_val" not in res2["variants"]["off"]
    assert "val_epochs_mean" not in res2["paired"]["on"] and "val_later_mean" not in res2["paired"]["on"]
    assert res2["runs"][2]["val_epoch1"] is None and "The first epoch against" not in markdown(res2)
    assert f"so the spread counts as much as the mean): on +0.417 {_ci2(1 / 3, 0.5)}, sd +0.126 {_ci2(*sd, 0.0)}." in (
        " ".join(markdown(res2).split()))
    runs[2]["epochs"] = _summary("off", 0, 0, [0.2, 0.1, 0.2], 1, 0.2)["epochs"]
    # an exploit of a peer's epoch takes the place of the rollback its bundle also asked for
    runs[0]["epochs"][1]["exploit"] = {"run": "on-s1-f0", "epoch": 1, "val_sharpe": 0.5}
    runs[1]["epochs"][2]["exploit"] = {"run": "on-s0-f0", "epoch": 3, "val_sharpe": 0.4}  # the last's: starts nothing
    res = {**res, **aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)}
    assert {r["run_id"]: (r["rollbacks"], r["exploits"]) for r in res["runs"]} == {
        "on-s0-f0": (0, 1), "on-s1-f0": (1, 0), "off-s0-f0": (0, 0), "off-s1-f0": (0, 0)}
    assert res["runs"][0]["exploited"] == [[2, "on-s1-f0", 1, 0.5]] and res["runs"][1]["exploited"] == []
    assert "Epochs that began from another run's epoch (the population's exploit): on 1 of 4." in markdown(res)


def test_a_population_variant_is_judged_over_its_populations_not_its_runs():
    """With `on` a population variant whose runs form populations by (market = seed // 2, fold): its mean and CI, and
    every paired difference it takes part in, are over the means of its populations; a variant that is no population,
    against a reference that is none, is over the test periods its seeds share (the same markets) all the same. Hand
    case: 4 seeds, 1 fold, markets {0, 1} and {2, 3}."""
    from tradeloop.study.report import markdown

    oos = {"on": [0.5, 0.3, 0.9, 0.7], "off": [0.2, 0.2, 0.4, 0.6], "alt": [0.1, 0.4, 0.2, 0.5]}
    runs = [_summary(v, s, 0, [0.3, 0.4, 0.2], 2, o) for v, xs in oos.items() for s, o in enumerate(xs)]
    res = aggregate(runs, [], ["on", "off", "alt"], "off", n_boot=500, seed=0, populations=["on"],
                    cluster_of=lambda s, f: (s // 2, f))
    on, p = res["variants"]["on"], res["paired"]["on"]["oos_sharpe"]
    assert on["populations"] == 2 and on["oos_sharpe"]["n"] == 2 and on["oos_sharpe"]["mean"] == pytest.approx(0.6)
    # population means: on 0.4, 0.8; off 0.2, 0.5 → differences 0.2 and 0.3, both won
    assert (p["n"], p["wins"]) == (2, 2) and p["mean"] == pytest.approx(0.25)
    assert res["paired"]["on"]["over_populations"] is True
    alt = res["paired"]["alt"]["oos_sharpe"]                         # no population: over the shared markets
    assert alt["n"] == 2 and alt["mean"] == pytest.approx(np.mean([-0.1, 0.2, -0.2, -0.1]))
    assert "over_populations" not in res["paired"]["alt"] and "populations" not in res["variants"]["off"]
    assert res["choice"] is None                 # its units are not independent: no unit-by-unit choice
    res["study"] = {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in oos],
                    "seeds": [0, 1, 2, 3], "folds": 1, "epochs": 3, "preset": "small", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 500,
                    "ci_seed": 0}
    res["timing"] = {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 36, "epochs_per_s": 1.2}
    assert "paired differences of on (2 populations) are over populations" in markdown(res)


# --- the variant grammar ---------------------------------------------------------------------------------------
def test_variants_parse_builtins_and_changed_loops():
    vs = parse_variants("on,off,slow:train.lr=1e-4;rollback_z=3.0,noE:feedback=off;horizons=1+5+20")
    assert [v.name for v in vs] == ["on", "off", "slow", "noE"]
    assert vs[0].settings == () and vs[1].settings == (("feedback.enabled", False),)
    assert vs[2].settings == (("train.lr", 1e-4), ("feedback.rollback_z", 3.0)) and vs[2].feedback
    assert vs[3].settings == (("feedback.enabled", False), ("train.horizons", (1, 5, 20))) and not vs[3].feedback
    spec = StudySpec(dataset="synthetic", variants=vs, seeds=[0], folds=1, epochs=1)
    cfg, fb = spec.configs(vs[2], 14)
    assert cfg.lr == 1e-4 and fb.rollback_z == 3.0 and fb.enabled
    cfg, fb = spec.configs(vs[3], 14)
    assert cfg.horizons == (1, 5, 20) and not fb.enabled
    assert [r.run_id for r in spec.runs()] == ["on-s0-f0", "off-s0-f0", "slow-s0-f0", "noE-s0-f0"]


@pytest.mark.parametrize("text, message", [
    ("on,nope", "neither 'on' nor 'off'"),
    ("x:schedule.eps=0.2", "FixedSchedule has no field 'eps'"),
    ("x:eps_decay_epochs=2.5", "expected an integer"),
    ("x:lr=fast", "expected a number"),
    ("x:nonsense=1", "no field of that name"),
    ("x:bf16=maybe", "expected true or false"),
    ("on,on", "repeated: on"),
    ("on:lr=1", "built-in"),
    ("bad/name:lr=1", "variant name"),
    ("x:train.nope=1", "TrainConfig has no field 'nope'"),
    ("x:iteratons=9", r"no field of that name .* \(did you mean iterations\?\)"),
])
def test_bad_variants_are_refused_naming_the_problem(text, message):
    with pytest.raises(StudyError, match=message):
        parse_variants(text)


def test_signals_switched_off_are_named_apart_and_a_joined_name_says_how():
    from shared.report import parse_off

    assert parse_off("e6, E7") == parse_off(["E6", "e7"]) == ("E6", "E7")
    with pytest.raises(ValueError, match=r"off names \['E6,E7'\], not among .* joined by \+, e\.g\. E6\+E7\)"):
        parse_off(["E6,E7"])
    with pytest.raises(ValueError, match=r"off names \['E10'\], not among E1, .*rollback$"):
        parse_off("E10")


def test_tuple_fields_parse_generically_from_their_declared_type():
    @dataclass(frozen=True)
    class Signals:
        off: tuple[str, ...] = ()
        pair: tuple[int, float] = (0, 0.0)
        limit: float | None = None

    hints = typing.get_type_hints(Signals)
    assert parse_value("E2+E3", hints["off"], "off") == ("E2", "E3")
    assert parse_value("E2", hints["off"], "off") == ("E2",)
    assert parse_value("", hints["off"], "off") == ()
    assert parse_value(["E1", "E9"], hints["off"], "off") == ("E1", "E9")     # a TOML array
    assert parse_value("3+0.5", hints["pair"], "pair") == (3, 0.5)
    assert parse_value("none", hints["limit"], "limit") is None and parse_value("2", hints["limit"], "limit") == 2.0
    with pytest.raises(StudyError, match="expected 2 items"):
        parse_value("1+2+3", hints["pair"], "pair")


def test_toml_variants_with_dotted_keys_and_config_checks():
    vs = variants_from_toml({"on": {}, "off": {}, "short": {"train": {"iterations": 7}, "feedback": {"n0": 5}}},
                            "--config s.toml")
    assert vs[2].settings == (("train.iterations", 7), ("feedback.n0", 5.0))
    assert resolve_key("d_model") == ("agent", "d_model") and resolve_key("churn") == ("reward", "churn")
    with pytest.raises(StudyError, match="expected an integer"):
        variants_from_toml({"x": {"iterations": 2.5}}, "--config s.toml")
    base = TrainConfig.preset("small", 14)
    cfg, fb = apply_settings(base, FeedbackConfig(), [("agent.d_model", 64), ("feedback.enabled", False)])
    assert base.agent.d_model == 32 and not fb.enabled            # copies: the base config is untouched
    assert cfg.agent.d_model == 64


def test_auto_bars_give_walk_forward_windows_of_the_asked_trades():
    from shared.market import walk_forward_folds
    from shared.synthetic import MEAN_DURATION

    n = synthetic_bars_for(200, 3)
    folds = walk_forward_folds(n, n_folds=3)
    for f in folds:
        for a, b in (f.val, f.test):
            assert (b - a) / (1.5 * MEAN_DURATION) >= 200 * 1.1


def _markdown_of_on_off(res: dict) -> str:
    """The report of an `aggregate` of on, off and any other variant, over seeds 0, 1 × 1 fold × 2 epochs."""
    from tradeloop.study.report import markdown

    res["study"] = {"dataset": "synthetic",
                    "variants": [{"name": n, "settings": []} for n in dict.fromkeys(["on", "off", *res["variants"]])],
                    "seeds": [0, 1], "folds": 1, "epochs": 2, "preset": "tiny", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": None, "min_val_trades": 20, "n_boot": 2000,
                    "ci_seed": 0}
    res["timing"] = {"runs_at_once": 1}
    return markdown(res)


def test_policy_shaping_is_told_apart_from_learning_by_hand():
    """Each run's OOS as learned (the selected checkpoint without its E5/E9 knobs): per variant its CI and the
    shaped − learned difference; paired against the reference; and the report's table says so."""
    runs = _two_units()
    learned = {"on-s0-f0": 0.20, "on-s1-f0": 0.10, "off-s0-f0": 0.10, "off-s1-f0": 0.20}
    for m in runs:
        m.update(shaped=m["variant"] == "on", oos_sharpe_unshaped=learned[m["run_id"]],
                 val_sharpe_unshaped=m["val_sharpe"])
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)
    u = res["variants"]["on"]["unshaped"]
    assert u["shaped_runs"] == 2 and u["oos_sharpe"]["mean"] == pytest.approx(0.15)
    assert u["shaping_oos"]["mean"] == pytest.approx(((0.30 - 0.20) + (0.50 - 0.10)) / 2)
    assert res["paired"]["on"]["oos_sharpe_unshaped"]["mean"] == pytest.approx(((0.20 - 0.10) + (0.10 - 0.20)) / 2)
    assert res["variants"]["off"]["unshaped"]["shaping_oos"]["mean"] == pytest.approx(0.0)
    md = _markdown_of_on_off(res)
    assert "Policy shaping apart from learning" in md and "| on | 2/2 | +0.150" in md
    # summaries written without the field: no such table, nothing invented
    for m in runs:
        del m["oos_sharpe_unshaped"]
    assert "unshaped" not in aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)["variants"]["on"]


def test_the_accounts_per_bar_sharpe_stands_beside_the_per_trade_one_by_hand():
    """OOS per-bar Sharpe (the summary's `oos_metrics`): per variant its CI, paired against the reference, in the
    report; summaries without it give neither."""
    runs = _two_units()
    per_bar = {"on-s0-f0": 0.05, "on-s1-f0": 0.07, "off-s0-f0": 0.10, "off-s1-f0": 0.08}
    for m in runs:
        m["oos_metrics"] = {"per_trade_sharpe": m["oos_sharpe"], "per_bar_sharpe": per_bar[m["run_id"]]}
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)
    assert res["variants"]["on"]["oos_bar_sharpe"]["mean"] == pytest.approx(0.06)
    assert res["variants"]["off"]["oos_bar_sharpe"]["mean"] == pytest.approx(0.09)
    p = res["paired"]["on"]["oos_bar_sharpe"]
    assert p["mean"] == pytest.approx(((0.05 - 0.10) + (0.07 - 0.08)) / 2) and p["wins"] == 0
    md = _markdown_of_on_off(res)
    assert "OOS per-bar Sharpe of the selected checkpoints" in md and "on − off -0.030" in md
    del runs[0]["oos_metrics"]
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)
    assert "oos_bar_sharpe" not in res["variants"]["on"] and "oos_bar_sharpe" not in res["paired"]["on"]


def test_shapes_policy_names_the_knobs_that_change_the_greedy_policy():
    from services.evaluator.runner import shapes_policy
    from shared.knobs import Knobs

    assert not shapes_policy(None) and not shapes_policy(Knobs(q_bias=0.02, gamma=0.95))
    assert shapes_policy(Knobs(gate_threshold=0.3))
    assert shapes_policy(Knobs(regime_confidence=[1.0] * 8 + [0.75]))


def test_the_best_validated_run_of_each_market_and_fold_is_chosen_on_validation_alone():
    """Seeds 0, 1 share market 0 and seeds 2, 3 market 1 (`cluster_of`), folds 0. off: market 0 (val, OOS) (0.3, 0.1),
    (0.2, 0.5) → chosen 0.1 (the higher val, though OOS would pick the other), mean 0.3; market 1 (0.4, 0.6), (0.1,
    0.2) → 0.6, mean 0.4. on: market 0 (0.5, 0.4), (0.5, 0.9) → a tie on val: the first seed's 0.4, mean 0.65;
    market 1 (0.2, 0.3), (0.6, 0.5) → 0.5, mean 0.4. on − off: 0.4 − 0.1, 0.5 − 0.6 → +0.1 mean, 1 win. With one
    run a market there is nothing to choose from, and no such figure."""
    from tradeloop.study.report import markdown

    vo = {"off": [(0.3, 0.1), (0.2, 0.5), (0.4, 0.6), (0.1, 0.2)], "on": [(0.5, 0.4), (0.5, 0.9), (0.2, 0.3), (0.6, 0.5)]}
    runs = [_summary(v, s, 0, [val], 1, oos) for v, xs in vo.items() for s, (val, oos) in enumerate(xs)]
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=500, seed=0, cluster_of=lambda s, f: (s // 2, f))
    off, on = res["variants"]["off"]["best_validated"], res["variants"]["on"]["best_validated"]
    assert (off["runs"], off["groups"]) == (2, 2)
    assert off["oos"]["mean"] == pytest.approx((0.1 + 0.6) / 2) and on["oos"]["mean"] == pytest.approx((0.4 + 0.5) / 2)
    assert off["lift"]["mean"] == pytest.approx(((0.1 - 0.3) + (0.6 - 0.4)) / 2)
    assert on["lift"]["mean"] == pytest.approx(((0.4 - 0.65) + (0.5 - 0.4)) / 2)
    # a run's own spread: off's groups {0.1, 0.5} and {0.6, 0.2} each hold squares 2 · 0.2² = 0.08 on 1 degree of
    # freedom → pooled √(0.16 / 2) = 0.2828; the groups' means 0.3 and 0.4 → SD 0.0707
    assert off["within_sd"] == pytest.approx(math.sqrt(0.08), abs=1e-12)
    assert off["between_sd"] == pytest.approx(0.1 / math.sqrt(2), abs=1e-12)
    # on: {0.4, 0.9} squares 2 · 0.25² = 0.125, {0.3, 0.5} 2 · 0.1² = 0.02 → √(0.145 / 2) = 0.2693
    assert on["within_sd"] == pytest.approx(math.sqrt(0.0725), abs=1e-12)
    p = res["paired"]["on"]["best_validated_oos"]
    assert p["mean"] == pytest.approx(((0.4 - 0.1) + (0.5 - 0.6)) / 2) and (p["wins"], p["n"]) == (1, 2)
    res["study"] = {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in ("on", "off")],
                    "seeds": [0, 1, 2, 3], "folds": 1, "epochs": 1, "preset": "small", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 500,
                    "ci_seed": 0}
    res["timing"] = {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 8, "epochs_per_s": 0.8}
    text = " ".join(markdown(res).split())
    assert "The run chosen on validation among each market and fold's runs" in text
    assert "on OOS +0.450 [" in text and "(2 groups of ≥ 2 runs)" in text and "paired on − off +0.100 [" in text
    assert "off within a group 0.283 (standard deviation, pooled), between the groups' means 0.071" in text
    alone = aggregate(runs, [], ["on", "off"], "off", n_boot=500, seed=0)        # a market a seed
    assert "best_validated" not in alone["variants"]["off"] and "best_validated_oos" not in alone["paired"]["on"]


def test_the_knobs_each_epoch_trained_under_are_reported_where_the_variants_differ():
    from tradeloop.study.report import markdown
    from tradeloop.study.stats import knob_paths

    runs = [_summary("E3", 0, 0, [0.1, 0.2, 0.3], 3, 0.3), _summary("E3", 1, 0, [0.2, 0.3, 0.1], 2, 0.2),
            _summary("off", 0, 0, [0.1, 0.1, 0.1], 1, 0.1), _summary("off", 1, 0, [0.2, 0.1, 0.1], 1, 0.1)]
    gammas = ([0.99, 0.98, 0.975], [0.99, 0.98, 0.985], [0.99] * 3, [0.99] * 3)
    for m, gs in zip(runs, gammas):
        for e, g in zip(m["epochs"], gs):
            e["gamma"], e["epsilon"] = g, 0.3 / e["epoch"]          # ε: the same schedule in both variants
    paths = knob_paths(runs, ["E3", "off"])
    assert set(paths) == {"gamma"}                                   # ε does not differ: not reported
    assert paths["gamma"]["E3"] == pytest.approx([0.99, 0.98, 0.98]) and paths["gamma"]["off"] == [0.99] * 3
    res = aggregate(runs, [], ["E3", "off"], "off", n_boot=200, seed=0)
    assert res["knob_paths"] == paths
    res["study"] = {"dataset": "synthetic", "variants": [{"name": n, "settings": []} for n in ("E3", "off")],
                    "seeds": [0, 1], "folds": 1, "epochs": 3, "preset": "small", "settings": [], "device": "cpu",
                    "accel": "auto", "deterministic": False, "bars": 3000, "min_val_trades": 20, "n_boot": 200,
                    "ci_seed": 0}
    res["timing"] = {"wall_s": 10.0, "runs_at_once": 1, "epochs_trained": 12, "epochs_per_s": 1.2}
    text = " ".join(markdown(res).split())
    assert ("The γ each epoch trained under, where the variants differ (mean over a variant's runs, epoch 1 → 3): "
            "E3 0.9900, 0.9800, 0.9800; off 0.9900, 0.9900, 0.9900.") in text
    assert "The ε each epoch" not in text
    for m in runs:                                                   # the learning rates' decay (schedule, plateau)
        for e in m["epochs"]:
            e["lr_decay"] = 0.5 ** (e["epoch"] - 1) if m["variant"] == "E3" else 1.0
    res["knob_paths"] = knob_paths(runs, ["E3", "off"])
    assert set(res["knob_paths"]) == {"gamma", "lr_decay"}
    assert ("The learning rates' decay each epoch trained under, where the variants differ (mean over a variant's "
            "runs, epoch 1 → 3): E3 1.000, 0.500, 0.250; off 1.000, 1.000, 1.000.") in " ".join(markdown(res).split())
    for m in runs:
        for e in m["epochs"]:
            del e["lr_decay"]
    del runs[0]["epochs"][1]["gamma"]                                # a summary without it: E3 is left out, and
    assert knob_paths(runs, ["E3", "off"]) == {}                     # one variant alone differs from nothing


def test_a_studys_results_and_report_carry_the_choice_among_its_variants_by_validation():
    from tradeloop.study.report import choice_lines

    runs = [_summary("off", 0, 0, [0.5], 1, 0.4), _summary("on", 0, 0, [0.7], 1, 0.6),
            _summary("off", 1, 0, [0.8], 1, 0.2), _summary("on", 1, 0, [0.1], 1, 0.3)]
    res = aggregate(runs, [], ["off", "on"], "off", n_boot=200)
    # unit (0, 0): validation picks on → 0.6 against off's 0.4, the best OOS 0.6; unit (1, 0): off → 0.2, best 0.3
    assert res["choice"]["val_chosen_minus_reference"]["mean"] == pytest.approx(0.1)
    assert res["choice"]["oos_best_minus_reference"]["mean"] == pytest.approx(0.15)
    assert res["choice"]["chosen_by_val"] == {"off": 1, "on": 1} and res["choice"]["rank_corr"] is None
    head = choice_lines(res["choice"])[0]
    assert "Choosing among the variants by validation (2 on each of 2 (seed, fold) units" in head
    assert aggregate(runs[::2], [], ["off"], "off", n_boot=200)["choice"] is None     # one variant: no choice


def test_the_accounts_worst_fall_and_its_ruin_out_of_sample_by_hand():
    """OOS max drawdown (the summary's `oos_metrics`): per variant its CI over units; a run whose OOS account ran out
    of equity (a drawdown of the whole peak) is named in the report, and a drawdown short of it is not; each run's
    drawdown in the run table; a variant whose summaries lack it gives neither."""
    from tradeloop.study.stats import ruined
    runs = _two_units()
    dd = {"on-s0-f0": 0.2, "on-s1-f0": 0.4, "off-s0-f0": 1.0, "off-s1-f0": 0.999}
    for m in runs:
        m["oos_metrics"] = {"per_trade_sharpe": m["oos_sharpe"], "max_drawdown": dd[m["run_id"]]}
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=2000, seed=0)
    assert res["variants"]["on"]["oos_max_drawdown"]["mean"] == pytest.approx(0.3)
    assert res["variants"]["off"]["oos_max_drawdown"]["mean"] == pytest.approx(0.9995)
    assert res["variants"]["on"]["oos_ruined"] == [] and res["variants"]["off"]["oos_ruined"] == ["off-s0-f0"]
    from shared.metrics import max_drawdown                # an account's bar returns once its equity is gone: 0
    assert ruined(max_drawdown([0.1, -1.0, 0.0])) and ruined(max_drawdown([0.1, -1.3, 0.0]))   # gapped past zero
    assert not ruined(max_drawdown([0.1, -0.99, 0.0])) and not ruined(0.999)
    md = _markdown_of_on_off(res)
    assert "ran out of equity out of sample" in md and "stops there): off-s0-f0." in md
    assert "| off-s1-f0 | 1 | 0 | 1 | +0.200 | 30 | +0.200 | 30 | 0.999 |" in md
    dd["off-s0-f0"] = 0.5
    for m in runs:
        m["oos_metrics"]["max_drawdown"] = dd[m["run_id"]]
    md = _markdown_of_on_off(aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0))
    assert "No account ran out of equity out of sample." in md
    del runs[0]["oos_metrics"]
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=200, seed=0)
    assert "oos_max_drawdown" not in res["variants"]["on"] and "oos_ruined" not in res["variants"]["on"]
    line = next(x for x in _markdown_of_on_off(res).splitlines() if "worst fall out of sample" in x)
    assert "units): off 0.750" in line and "; on " not in line                 # only the variant that has it

