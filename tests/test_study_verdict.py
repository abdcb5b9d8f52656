"""A study's verdict (`tradeloop.study.stats.verdict`: the 95 % CI of a variant's mean DSR at or above the bar) and
the runs it counts as no edge (fewer than two OOS trades), against hand-made cases."""
import pytest

from tests.test_study_stats import _markdown_of_on_off, _two_units
from tradeloop.study.intervals import bootstrap_ci
from tradeloop.study.stats import aggregate, verdict


def test_the_verdict_needs_the_mean_dsrs_interval_at_the_bar_not_its_mean():
    """14 runs at DSR 1.0 and one at 0.30: the mean 0.953 reaches 0.95, but its interval does not (one run far below
    the bar is no validated edge); 15 runs at 0.99 ± 0.005 are; a single unit has no interval and no verdict of one."""
    mixed = bootstrap_ci([1.0] * 14 + [0.30], n_boot=2000, seed=0, bounds=(0.0, 1.0))
    assert mixed["mean"] >= 0.95 and mixed["lo"] < 0.95 and verdict(mixed) == "no validated edge"
    tight = bootstrap_ci([0.99 + 0.005 * (-1) ** i for i in range(15)], n_boot=2000, seed=0, bounds=(0.0, 1.0))
    assert tight["lo"] >= 0.95 and verdict(tight) == "validated edge"
    assert verdict(bootstrap_ci([1.0], n_boot=200, seed=0)) == "no validated edge"


def test_a_run_that_closed_under_two_oos_trades_counts_as_no_edge_and_is_named():
    """An agent's selected checkpoint with 1 OOS trade has no per-trade Sharpe: it counts as 0.0 (its summary's
    figure) in the variant's OOS, and the report names the run; a variant without such a run names none."""
    runs = _two_units()
    runs[0].update(oos_sharpe=0.0, oos_trades=1)
    res = aggregate(runs, [], ["on", "off"], "off", n_boot=500, seed=0)
    assert res["variants"]["on"]["oos_untraded"] == ["on-s0-f0"] and res["variants"]["off"]["oos_untraded"] == []
    assert res["variants"]["on"]["oos_sharpe"]["mean"] == pytest.approx((0.0 + 0.50) / 2)
    md = " ".join(_markdown_of_on_off(res).split())
    assert "closed fewer than two trades out of sample" in md and "on-s0-f0." in md
    assert "closed fewer than two trades" not in _markdown_of_on_off(aggregate(_two_units(), [], ["on", "off"], "off",
                                                                                 n_boot=500, seed=0))
