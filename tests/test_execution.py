"""The simulator pinned to hand-computed ledgers (shared/execution.py).

Every expected number below is written out from the fill rules in the module docstring (units bought at the
fill, held until the next fill; equity = cash + units × price), not taken from a run.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shared.execution import CostModel, Prices, Simulator, held_return, run_positions

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
    # decided at close 0, in at open[1]=101: 1/101 units bought with equity 1, cost C·1 → cash −C.
    # Held through bars 1 and 2; the 0 decided at close 2 sells them at open[3]=103, cost C·103/101.
    assert tr.net_return == pytest.approx(103 / 101 - 1 - C - C * 103 / 101, abs=1e-15)
    assert (tr.entry_t, tr.exit_t, tr.side, tr.bars, tr.exit_reason) == (1, 3, 1, 2, "signal")
    assert (tr.entry_price, tr.exit_price, tr["size"]) == (101, 103, 1.0)
    # equity = cash + units × close at every close
    np.testing.assert_allclose(res.equity[0], [1, -C + 101.5 / 101, -C + 102.5 / 101, 1 + tr.net_return,
                                               1 + tr.net_return], rtol=0, atol=1e-15)
    # flat afterwards: equity is the trade's growth
    assert res.equity[0, -1] == pytest.approx(1 + tr.net_return, abs=1e-15)


def test_a_short_through_a_trend_holds_its_units():
    # a full short held while the price rises 50 % loses 50 %; held while it halves, it gains 50 %
    up = run_positions(prices([100, 100, 150, 150]), [-1, -1, 0, 0], CostModel(cost_bps=0))
    assert one_trade(up).net_return == pytest.approx(-0.5, abs=1e-15)
    down = run_positions(prices([100, 100, 50, 50]), [-1, -1, 0, 0], CostModel(cost_bps=0))
    assert one_trade(down).net_return == pytest.approx(0.5, abs=1e-15)
    # in between, equity = cash 2 − 1/100 units × close (no rebalancing at any close)
    assert up.equity[0, 1] == pytest.approx(2 - 100.5 / 100, abs=1e-15)
    assert up.equity[0, 2] == pytest.approx(2 - 150.5 / 100, abs=1e-15)
    # half size: −0.5 · (150 / 100 − 1), and the bar returns compound to it
    half = run_positions(prices([100, 100, 150, 150]), [-0.5, -0.5, 0, 0], CostModel(cost_bps=0))
    assert one_trade(half).net_return == pytest.approx(-0.25, abs=1e-15)
    assert np.prod(1 + half.bar_returns[0]) == pytest.approx(0.75, abs=1e-15)


def test_flip_closes_one_trade_and_opens_the_next():
    p = prices([100, 101, 102, 103, 104])
    res = run_positions(p, [1, -1, 0, 0, 0], CostModel(cost_bps=10))
    assert list(res.ledger.exit_reason) == ["flip", "signal"]
    long_, short = res.ledger.iloc[0], res.ledger.iloc[1]
    # long: 1/101 units from 101 to 102, its closing fill (C of 102/101) is its own
    e1 = 102 / 101 - C - C * 102 / 101
    assert long_.net_return == pytest.approx(e1 - 1, abs=1e-15)
    # short: opened on the equity left, e1: −e1/102 units from 102, out at open[3]=103
    assert short.net_return == pytest.approx(-(103 / 102 - 1) - C - C * 103 / 102, abs=1e-15)
    assert (short.side, short.entry_t, short.exit_t, short.entry_price, short.exit_price) == (-1, 2, 3, 102, 103)
    assert res.equity[0, 2] == pytest.approx(e1 * (1 - C) - e1 / 102 * (102.5 - 102), abs=1e-15)
    assert res.equity[0, -1] == pytest.approx((1 + long_.net_return) * (1 + short.net_return), abs=1e-15)


def test_partial_size_and_resize_stay_one_trade():
    p = prices([100, 101, 102, 103, 104])
    res = run_positions(p, [0.5, 1.0, 0, 0, 0], CostModel(cost_bps=10))
    assert len(res.ledger) == 1
    tr = one_trade(res)
    # in at half size: 0.5/101 units, cash 0.5 − 0.5·C
    u1, cash = 0.5 / 101, 0.5 - 0.5 * C
    assert res.equity[0, 1] == pytest.approx(cash + u1 * 101.5, abs=1e-15)
    # resize at open[2]=102 to the whole equity there: units E/102, the cost on the units bought only
    e = cash + u1 * 102
    u2 = e / 102
    cash -= (u2 - u1) * 102 + C * (u2 - u1) * 102
    assert res.equity[0, 2] == pytest.approx(cash + u2 * 102.5, abs=1e-15)
    # out at open[3]=103
    cash += u2 * 103 - C * u2 * 103
    assert tr.net_return == pytest.approx(cash - 1, abs=1e-15)
    assert (tr["size"], tr.entry_t, tr.exit_t, tr.bars) == (0.5, 1, 3, 2)
    # at zero cost the resize is plain P&L of the units held: 0.5/101 units from 101 to 102, then E/102 to 103
    free = one_trade(run_positions(p, [0.5, 1.0, 0, 0, 0], CostModel(cost_bps=0)))
    e = 1 + 0.5 / 101 * (102 - 101)
    assert free.net_return == pytest.approx(e * 103 / 102 - 1, abs=1e-15)


def test_units_drift_and_a_repeated_target_is_no_fill():
    # a half-size long: the same target again holds the units (no fill, no cost); the fraction of equity they are
    # worth drifts with the price
    p = prices([100, 100, 200, 200, 200])
    res = run_positions(p, [0.5, 0.5, 0.5, 0, 0], CostModel(cost_bps=10))
    tr = one_trade(res)
    assert tr.net_return == pytest.approx(0.5 * (200 / 100 - 1) - C * 0.5 - C * 0.5 * 2, abs=1e-15)
    assert len(res.ledger) == 1 and res.positions[0, 1:4].tolist() == [0.5, 0.5, 0.5]


def test_stop_and_target_in_the_same_bar_stop_first():
    # bar 1 opens at 100 and ranges 97..104: both a 2% target (102) and a 2% stop (98) are inside it
    p = prices([100, 100, 100, 100], h=[101, 104, 101, 101], l=[99, 97, 99, 99], c=[100, 100, 100, 100])
    res = run_positions(p, [1, 0, 0, 0], CostModel(cost_bps=10), take_profit=0.02, stop_loss=0.02)
    tr = one_trade(res)
    assert tr.exit_reason == "stop" and tr.exit_price == pytest.approx(98.0)
    assert tr.net_return == pytest.approx(98 / 100 - 1 - C - C * 0.98, abs=1e-15)
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
    assert tr.net_return == pytest.approx(95 / 100 - 1, abs=1e-15)
    # the target is still +1 after the stop: a new trade opens at the next open and ends at the last close
    assert len(res.ledger) == 2 and res.ledger.iloc[1].exit_reason == "end"
    # a half-size short gapped through its stop (102) at an open of 106, with costs: the open is its fill
    p = prices([100, 100, 106, 106], h=[101, 101, 107, 107], l=[99, 99.5, 105, 105], c=[100, 100, 106, 106])
    tr = one_trade(run_positions(p, [-0.5, -0.5, 0, 0], CostModel(cost_bps=10), stop_loss=0.02))
    assert (tr.exit_reason, tr.exit_price, tr.exit_t) == ("stop", 106.0, 2)
    assert tr.net_return == pytest.approx(-0.5 * (106 / 100 - 1) - 0.5 * C - 0.5 * C * 1.06, abs=1e-15)


def test_a_short_is_liquidated_where_its_exit_would_leave_no_equity_and_the_account_trades_no_more():
    # a full short at 100 holds cash 2 and −0.01 units: equity 2 − 0.01·x is gone at x = 200. The bar-3 high of
    # 205 reaches it; every later target (−1 still) is refused: flat, equity 0, bar returns 0
    p = prices([100, 100, 150, 190, 190, 180], h=[101, 101, 151, 205, 191, 181], l=[99, 99, 149, 189, 189, 179],
               c=[100, 100, 150, 190, 190, 180])
    res = run_positions(p, [-1] * 6, CostModel(cost_bps=0))
    assert len(res.ledger) == 1
    tr = one_trade(res)
    assert (tr.exit_reason, tr.exit_price, tr.exit_t, tr.entry_t) == ("stop", 200.0, 3, 1)
    assert tr.net_return == -1.0
    np.testing.assert_array_equal(res.equity[0, 3:], 0.0)
    np.testing.assert_array_equal(res.positions[0, 3:], 0.0)
    np.testing.assert_array_equal(res.bar_returns[0, 4:], 0.0)
    assert res.bar_returns[0, 3] == pytest.approx(0.0 / (2 - 150 / 100) - 1.0)
    # with costs the exit's own cost counts: cash 2 − C, so x·0.01·(1 + C) = 2 − C
    tr = one_trade(run_positions(p, [-1] * 6, CostModel(cost_bps=10)))
    assert tr.exit_price == pytest.approx((2 - C) / (0.01 * (1 + C)), rel=1e-15) and tr.net_return == -1.0
    # a trade's own stop below the liquidation price comes first: the stop at +40 % (140) fills at the open of 150
    tr = one_trade(run_positions(p, [-1] * 6, CostModel(cost_bps=0), stop_loss=0.4))
    assert (tr.exit_reason, tr.exit_price, tr.net_return) == ("stop", 150.0, pytest.approx(-0.5, abs=1e-15))


def test_an_open_gapped_past_the_liquidation_price_fills_there_and_leaves_a_debt():
    p = prices([100, 100, 250, 250, 250], c=[100, 100, 250, 250, 250])
    res = run_positions(p, [-1, -1, 0, 1, 1], CostModel(cost_bps=0))
    tr = one_trade(res)
    assert (tr.exit_reason, tr.exit_price, tr.exit_t) == ("stop", 250.0, 2)
    assert tr.net_return == pytest.approx(2 - 2.5 - 1.0, abs=1e-15)          # cash 2 − 0.01·250 = −0.5
    assert len(res.ledger) == 1                                               # the long at bar 3 is refused
    np.testing.assert_allclose(res.equity[0, 2:], -0.5, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(res.bar_returns[0, 3:], 0.0)


def test_a_fixed_fee_opens_nothing_it_cannot_pay_for_and_never_leaves_a_debt():
    """An account opens a trade only where its equity pays for the fill and for closing it again at that price: a
    fee above the equity opens nothing, and fees wearing an account down on gapless bars stop it above 0."""
    p = prices([100.0] * 6)
    res = run_positions(p, [1, 1, 0, 0, 0, 0], CostModel(cost_bps=0, fee=5.0))
    assert len(res.ledger) == 0 and (res.equity == 1.0).all()
    rng = np.random.default_rng(0)
    T = 400
    walk = 100 * np.exp(np.cumsum(rng.normal(0, 0.002, T)))
    p = prices(walk, h=walk * 1.001, l=walk * 0.999, c=walk)          # every open at the last close: no gap
    res = run_positions(p, rng.choice([-1.0, 0.0, 1.0], size=(8, T)), CostModel(cost_bps=10, fee=0.01))
    assert (res.equity >= 0).all() and (res.ledger.net_return >= -1.0).all()
    assert (res.equity[:, -1] < 0.05).all() and len(res.ledger) > 100     # worn down to what a round trip costs


def test_a_steps_closed_trades_keep_their_count_sum_and_squares_though_two_close_in_one_bar():
    """A flip closes the old trade at the open and a stop closes the new one in the same bar: `n_closed` is 2, and
    `trade_return` / `trade_return_sq` are the sum and the sum of squares of both ledger returns (the trainer's trade
    statistics read them)."""
    rng = np.random.default_rng(3)
    T, B = 300, 6
    walk = 100 * np.exp(np.cumsum(rng.normal(0, 0.01, T)))
    wick = rng.uniform(0.0, 0.01, T)                          # a 0.5 % stop is hit in about half the bars
    p = prices(walk, h=walk * (1 + wick), l=walk * (1 - wick), c=walk)
    sim = Simulator(p, B, CostModel(cost_bps=5), record_ledger=True)
    sim.reset(torch.zeros(B, dtype=torch.long))
    tg = torch.as_tensor(rng.choice([-1.0, 1.0], size=(T, B)), dtype=torch.float64)   # a flip at nearly every bar
    n = s1 = s2 = 0.0
    two = 0
    for t in range(T - 1):
        r = sim.step(tg[t], stop_loss=torch.full((B,), 0.005, dtype=torch.float64))
        n, s1, s2 = n + float(r.n_closed.sum()), s1 + float(r.trade_return.sum()), s2 + float(r.trade_return_sq.sum())
        two += int((r.n_closed == 2).sum())
    led = sim.ledger()
    assert two > 10                                              # flips stopped out in their own bar
    assert n == len(led)
    assert s1 == pytest.approx(led.net_return.sum(), abs=1e-12)
    assert s2 == pytest.approx((led.net_return ** 2).sum(), abs=1e-12)


def test_position_open_at_the_end_is_closed_at_the_last_close():
    p = prices([100, 101, 102, 103])
    res = run_positions(p, [0, 1, 1, 1], CostModel(cost_bps=10))
    tr = one_trade(res)
    assert tr.exit_reason == "end" and tr.exit_t == 3 and tr.exit_price == 103.5
    assert tr.net_return == pytest.approx(103.5 / 102 - 1 - C - C * 103.5 / 102, abs=1e-15)
    assert tr.bars == 2 and res.positions[0, -1] == 0.0


def test_fixed_fee_per_fill():
    F = 1e-3                                         # in units of the starting equity (1)
    p = prices([100, 101, 102, 103, 104])
    tr = one_trade(run_positions(p, [1, 1, 0, 0, 0], CostModel(cost_bps=0, fee=F)))
    assert tr.net_return == pytest.approx(103 / 101 - 1 - 2 * F, abs=1e-15)
    # a flip is two fills (the close, then the open): a fee each; the new trade is sized on the equity left
    res = run_positions(p, [1, -1, 0, 0, 0], CostModel(cost_bps=10, fee=F))
    long_, short = res.ledger.iloc[0], res.ledger.iloc[1]
    e1 = 1 - F + (102 - 101) / 101 - C * 102 / 101 - C - F
    assert long_.net_return == pytest.approx(e1 - 1, abs=1e-15)
    e2 = e1 - F - C * e1 - e1 / 102 * (103 - 102) - C * e1 / 102 * 103 - F
    assert short.net_return == pytest.approx(e2 / e1 - 1, abs=1e-15)
    assert res.equity[0, -1] == pytest.approx(e2, abs=1e-15)
    # a resize is a fill: 0.5 → 1.0 pays a fee
    r = one_trade(run_positions(p, [0.5, 1.0, 0, 0, 0], CostModel(cost_bps=0, fee=F)))
    e = 1 - F + 0.5 / 101 * (102 - 101)
    assert r.net_return == pytest.approx(e - F + e / 102 * (103 - 102) - F - 1, abs=1e-15)


def test_borrow_is_charged_at_each_close_a_short_is_held():
    costs = CostModel(cost_bps=0, borrow_bps=100, bars_per_year=1)       # 1 % of the notional a bar
    p = prices([100, 101, 102, 103, 104])
    tr = one_trade(run_positions(p, [-1, -1, 0, 0, 0], costs))
    # −1/101 units, held at close 1 (101.5) and close 2 (102.5), bought back at open 3 (103)
    assert tr.net_return == pytest.approx(-(103 / 101 - 1) - 0.01 * (101.5 + 102.5) / 101, abs=1e-15)
    longs = one_trade(run_positions(p, [1, 1, 0, 0, 0], costs))
    assert longs.net_return == pytest.approx(103 / 101 - 1, abs=1e-15)   # a long borrows nothing
    # in at open 3 (103), held into the end: closes 3 (103.5) and 4 (104.5, the last) are charged, then the end fill
    end = one_trade(run_positions(p, [0, 0, -0.5, -0.5, 0], costs))
    assert end.net_return == pytest.approx(-0.5 * (104.5 / 103 - 1) - 0.01 * 0.5 * (103.5 + 104.5) / 103, abs=1e-15)
    assert costs.borrow_rate == pytest.approx(0.01)


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
    assert r1.trade_return[1].item() == pytest.approx(103.5 / 103 - 1 - C - C * 103.5 / 103, abs=1e-15)
    assert sim.trade_return_open[0].item() == pytest.approx(101.5 / 101 - 1 - C, abs=1e-15)
    eq_before = sim.equity[1].item()
    r2 = sim.step(torch.tensor([0.0, 1.0]))
    assert r2.trade_return[0].item() == pytest.approx(102 / 101 - 1 - C - C * 102 / 101, abs=1e-15)
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
    tg[3, 100:140] = np.linspace(0.1, 1.0, 40)  # a resize every bar: a chain of resizes inside one trade
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


def _random_market(rng, T):
    close = 100 * np.exp(np.cumsum(rng.normal(0, 0.02, T)))
    open_ = np.r_[100, close[:-1]] * np.exp(rng.normal(0, 0.01, T))
    high = np.maximum(open_, close) * (1 + rng.uniform(0, 0.02, T))
    low = np.minimum(open_, close) * (1 - rng.uniform(0, 0.02, T))
    return Prices.from_arrays(open_, high, low, close)


def _random_targets(rng, B, T):
    """Runs of random length of random targets: flat, partial and full, long and short, resizes and flips."""
    levels = np.array([-1.0, -0.7, -0.3, 0.0, 0.0, 0.2, 0.5, 1.0])
    out = np.empty((B, T))
    for b in range(B):
        t = 0
        while t < T:
            n = int(rng.integers(1, 12))
            out[b, t:t + n] = rng.choice(levels) if rng.random() < 0.9 else rng.uniform(-1, 1)
            t += n
    return out


@pytest.mark.parametrize("seed", range(3))
def test_property_each_trade_without_a_resize_returns_side_size_times_the_price_move(seed):
    """For any target path, at zero cost, every trade without a resize inside it has
    net_return = side · size · (exit_price / entry_price − 1): the step simulator with random stops and targets,
    and the vectorised replay without them. With costs, a flat account's equity is the product of its trades'
    (1 + net_return), and each trade without a resize matches `held_return`."""
    rng = np.random.default_rng(seed)
    T, B = 300, 6
    p = _random_market(rng, T)
    tg = _random_targets(rng, B, T)
    tg[:, -2:] = 0.0
    tp = np.where(rng.random((B, T)) < 0.5, rng.uniform(0.01, 0.08, (B, T)), np.inf)
    sl = np.where(rng.random((B, T)) < 0.5, rng.uniform(0.01, 0.08, (B, T)), np.inf)
    for costs in (CostModel(cost_bps=0), CostModel(cost_bps=25, slippage_bps=5)):
        for kw in (dict(take_profit=tp, stop_loss=sl), dict(fast=True), dict(fast=False)):
            res = run_positions(p, tg, costs, **kw)
            led = res.ledger
            assert len(led) > 50
            unresized = 0
            for tr in led.itertuples(index=False):
                # the decisions that filled inside the trade: from its entry's to the one before its exit fill
                # (an exit at an open is the fill of the last decision; a stop, target or end exit comes after it)
                last = tr.exit_t - 1 if tr.exit_reason in ("signal", "flip") else tr.exit_t
                if not (tg[tr.account, tr.entry_t - 1:last] == tr.side * tr.size).all():
                    continue                                               # a resize inside: P&L of both sizes
                unresized += 1
                expect = held_return(tr.side, tr.size, tr.entry_price, tr.exit_price, costs.rate)
                assert tr.net_return == pytest.approx(expect, abs=1e-12)
                if costs.rate == 0:
                    assert tr.net_return == pytest.approx(tr.side * tr.size * (tr.exit_price / tr.entry_price - 1),
                                                          abs=1e-12)
            assert unresized > 30
            for b in range(B):
                r = led.net_return[led.account == b].to_numpy()
                assert res.equity[b, -1] == pytest.approx(np.prod(1 + r), rel=1e-12)
