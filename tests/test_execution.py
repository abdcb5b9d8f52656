"""The simulator pinned to hand-computed ledgers (shared/execution.py).

Every expected number below is written out from the fill rules in the module docstring, not taken from a run.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.execution import CostModel, Prices, Simulator, run_positions

C = 10e-4  # 10 bps


def prices(o, h=None, l=None, c=None):
    o = np.asarray(o, dtype=float)
    c = o + 0.5 if c is None else np.asarray(c, dtype=float)
    h = np.maximum(o, c) + 5 if h is None else np.asarray(h, dtype=float)
    l = np.minimum(o, c) - 5 if l is None else np.asarray(l, dtype=float)
    return Prices.from_arrays(o, h, l, c)


def one_trade(res, i=0):
    return res.ledger.iloc[i]


def test_long_round_trip_costs_and_bars():
    p = prices([100, 101, 102, 103, 104])               # close = open + 0.5
    res = run_positions(p, [1, 1, 0, 0, 0], CostModel(cost_bps=10))
    assert len(res.ledger) == 1
    tr = one_trade(res)
    # decided at close 0, in at open[1]=101 (cost 0.001); held through bars 1 and 2; the 0 decided at close 2
    # fills at open[3]=103 (cost 0.001)
    expect = (1 - C) * (101.5 / 101) * (102 / 101.5) * (102.5 / 102) * (103 / 102.5) * (1 - C) - 1
    assert tr.net_return == pytest.approx(expect, abs=1e-12)
    assert (tr.entry_t, tr.exit_t, tr.side, tr.bars, tr.exit_reason) == (1, 3, 1, 2, "signal")
    assert (tr.entry_price, tr.exit_price, tr["size"]) == (101, 103, 1.0)
    # flat afterwards: equity is the trade's growth
    assert res.equity[0, -1] == pytest.approx(1 + expect, abs=1e-12)


def test_flip_closes_one_trade_and_opens_the_next():
    p = prices([100, 101, 102, 103, 104])
    res = run_positions(p, [1, -1, 0, 0, 0], CostModel(cost_bps=10))
    assert list(res.ledger.exit_reason) == ["flip", "signal"]
    long_, short = res.ledger.iloc[0], res.ledger.iloc[1]
    # long: 101 → 102; the flip's |Δ|=2 cost is split: 1 unit to each trade
    assert long_.net_return == pytest.approx((1 - C) * (102 / 101) * (1 - C) - 1, abs=1e-12)
    # short: in at 102, held to close[2]=102.5, gap to open[3]=103, out there
    g_short = (1 - C) * (1 - (102.5 / 102 - 1)) * (1 - (103 / 102.5 - 1)) * (1 - C)
    assert short.net_return == pytest.approx(g_short - 1, abs=1e-12)
    assert (short.side, short.entry_t, short.exit_t) == (-1, 2, 3)
    assert res.equity[0, -1] == pytest.approx((1 + long_.net_return) * (1 + short.net_return), abs=1e-12)


def test_partial_size_and_resize_stay_one_trade():
    p = prices([100, 101, 102, 103, 104])
    res = run_positions(p, [0.5, 1.0, 0, 0, 0], CostModel(cost_bps=10))
    assert len(res.ledger) == 1
    tr = one_trade(res)
    g = (1 - 0.5 * C) * (1 + 0.5 * (101.5 / 101 - 1)) * (1 + 0.5 * (102 / 101.5 - 1))  # in at half size
    g *= (1 - 0.5 * C)                                                                # resize 0.5 → 1.0
    g *= (1 + (102.5 / 102 - 1)) * (1 + (103 / 102.5 - 1)) * (1 - C)                   # hold, exit at open[3]
    assert tr.net_return == pytest.approx(g - 1, abs=1e-12)
    assert (tr["size"], tr.entry_t, tr.exit_t, tr.bars) == (0.5, 1, 3, 2)


def test_stop_and_target_in_the_same_bar_stop_first():
    # bar 1 opens at 100 and ranges 97..104: both a 2% target (102) and a 2% stop (98) are inside it
    p = prices([100, 100, 100, 100], h=[101, 104, 101, 101], l=[99, 97, 99, 99], c=[100, 100, 100, 100])
    res = run_positions(p, [1, 0, 0, 0], CostModel(cost_bps=10), take_profit=0.02, stop_loss=0.02)
    tr = one_trade(res)
    assert tr.exit_reason == "stop" and tr.exit_price == pytest.approx(98.0)
    assert tr.net_return == pytest.approx((1 - C) * (98 / 100) * (1 - C) - 1, abs=1e-12)
    assert (tr.entry_t, tr.exit_t, tr.bars) == (1, 1, 1)
    assert res.positions[0, 1] == 0.0


def test_target_only_and_short_stop():
    p = prices([100, 100, 100, 100], h=[101, 103, 101, 101], l=[99, 99.5, 99, 99], c=[100, 100, 100, 100])
    res = run_positions(p, [1, 0, 0, 0], CostModel(cost_bps=0), take_profit=0.02, stop_loss=0.02)
    tr = one_trade(res)
    assert tr.exit_reason == "target" and tr.net_return == pytest.approx(0.02, abs=1e-12)
    # a short's stop is above: 100·1.02 = 102 is touched by the high of 103
    res = run_positions(p, [-1, 0, 0, 0], CostModel(cost_bps=0), stop_loss=0.02)
    tr = one_trade(res)
    assert tr.exit_reason == "stop" and tr.exit_price == pytest.approx(102.0)
    assert tr.net_return == pytest.approx(-0.02, abs=1e-12)


def test_gap_through_stop_fills_at_the_open():
    p = prices([100, 100, 95, 95], h=[101, 101, 96, 96], l=[99, 99.5, 94, 94], c=[100, 100, 95, 95])
    res = run_positions(p, [1, 1, 1, 0], CostModel(cost_bps=0), stop_loss=0.02)
    tr = one_trade(res)
    assert tr.exit_reason == "stop" and tr.exit_price == 95.0 and tr.exit_t == 2
    assert tr.net_return == pytest.approx(95 / 100 - 1, abs=1e-12)
    # the target is still +1 after the stop: a new trade opens at the next open and ends at the last close
    assert len(res.ledger) == 2 and res.ledger.iloc[1].exit_reason == "end"


def test_position_open_at_the_end_is_closed_at_the_last_close():
    p = prices([100, 101, 102, 103])
    res = run_positions(p, [0, 1, 1, 1], CostModel(cost_bps=10))
    tr = one_trade(res)
    assert tr.exit_reason == "end" and tr.exit_t == 3 and tr.exit_price == 103.5
    g = (1 - C) * (102.5 / 102) * (103 / 102.5) * (103.5 / 103) * (1 - C)
    assert tr.net_return == pytest.approx(g - 1, abs=1e-12)
    assert tr.bars == 2 and res.positions[0, -1] == 0.0


def test_no_lookahead_decision_at_t_fills_at_next_open():
    p = prices([100, 110, 120, 130])
    res = run_positions(p, [0, 1, 0, 0], CostModel(cost_bps=0))
    tr = one_trade(res)
    assert tr.entry_t == 2 and tr.entry_price == 120  # decided at close 1, filled at open 2
    assert res.positions[0, 1] == 0 and res.positions[0, 2] == 1


def test_batched_accounts_are_independent_and_equity_is_product_of_trades():
    rng = np.random.default_rng(0)
    T = 400
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, T)))
    open_ = np.r_[100, close[:-1]] * np.exp(rng.normal(0, 0.002, T))
    high = np.maximum(open_, close) * (1 + rng.uniform(0, 0.01, T))
    low = np.minimum(open_, close) * (1 - rng.uniform(0, 0.01, T))
    p = Prices.from_arrays(open_, high, low, close)
    tg = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=(4, T))
    tg[:, -2:] = 0  # end flat so that equity is exactly the product of trade growths
    res = run_positions(p, tg, CostModel(cost_bps=5, slippage_bps=1), take_profit=0.015, stop_loss=0.01)
    for b in range(4):
        one = run_positions(p, tg[b], CostModel(cost_bps=5, slippage_bps=1), take_profit=0.015, stop_loss=0.01)
        led = res.ledger[res.ledger.account == b].reset_index(drop=True)
        np.testing.assert_allclose(led.net_return, one.ledger.net_return, rtol=0, atol=1e-13)
        np.testing.assert_allclose(res.equity[b], one.equity[0], rtol=0, atol=1e-13)
        assert res.equity[b, -1] == pytest.approx(np.prod(1 + led.net_return), rel=1e-10)
        assert (led.bars >= 1).all() and (led.exit_t >= led.entry_t).all()


def test_step_reward_is_the_closed_trade_return_and_done_accounts_freeze():
    p = prices([100, 101, 102, 103])
    sim = Simulator(p, 2, CostModel(cost_bps=10))
    sim.reset(torch.tensor([0, 2]))
    r1 = sim.step(torch.tensor([1.0, 1.0]))
    assert r1.opened.tolist() == [True, True] and r1.n_closed.tolist() == [0, 1]  # account 1 hit the last bar
    assert sim.done.tolist() == [False, True]
    expect_end = (1 - C) * (103.5 / 103) * (1 - C) - 1
    assert r1.trade_return[1].item() == pytest.approx(expect_end, abs=1e-12)
    eq_before = sim.equity[1].item()
    r2 = sim.step(torch.tensor([0.0, 1.0]))
    assert r2.trade_return[0].item() == pytest.approx((1 - C) * (101.5 / 101) * (102 / 101.5) * (1 - C) - 1, abs=1e-12)
    assert sim.equity[1].item() == eq_before and r2.n_closed[1].item() == 0


def test_costs_reduce_returns_monotonically():
    p = prices([100, 101, 102, 103, 104])
    r = [run_positions(p, [1, -1, 1, 0, 0], CostModel(cost_bps=b)).equity[0, -1] for b in (0, 5, 50)]
    assert r[0] > r[1] > r[2]


@pytest.mark.parametrize("bad", [[1, 1], [math.nan, 0, 0, 0, 0]])
def test_bad_targets_are_refused(bad):
    with pytest.raises(ValueError):
        run_positions(prices([100, 101, 102, 103, 104]), bad)


def test_vectorised_replay_matches_the_step_simulator():
    """Fast path vs reference: the vectorised no-stop replay gives the step loop's ledger and equity."""
    rng = np.random.default_rng(7)
    T = 600
    close = 50 * np.exp(np.cumsum(rng.normal(0, 0.01, T)))
    open_ = np.r_[50, close[:-1]] * np.exp(rng.normal(0, 0.003, T))
    p = Prices.from_arrays(open_, np.maximum(open_, close) * 1.004, np.minimum(open_, close) * 0.996, close)
    tg = rng.choice([-1.0, -0.5, 0.0, 0.25, 1.0], size=(5, T))
    tg[1, :] = 1.0                      # always long: one trade closed at the end
    tg[2, -3:] = [1.0, -1.0, 1.0]       # a flip into the last bar, then the end close
    costs = CostModel(cost_bps=3, slippage_bps=2)
    fast = run_positions(p, tg, costs, fast=True)
    slow = run_positions(p, tg, costs, fast=False)
    assert len(fast.ledger) == len(slow.ledger) > 100
    for col in ("account", "entry_t", "exit_t", "side", "bars", "exit_reason"):
        assert (fast.ledger[col].to_numpy() == slow.ledger[col].to_numpy()).all(), col
    for col in ("size", "entry_price", "exit_price", "net_return"):
        np.testing.assert_allclose(fast.ledger[col], slow.ledger[col], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fast.equity, slow.equity, rtol=1e-9)
    np.testing.assert_allclose(fast.bar_returns, slow.bar_returns, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(fast.positions, slow.positions)
