"""The simulator's ledger against a third-party engine: vectorbt's `Portfolio.from_orders` (a test-only dependency,
the `test` extra).

The same target positions on the bundled EURUSD hourly bars (2017) — a 10/40 moving-average crossover in
{−1, 0, +1}, at full and half size, and a long-only half-size variant — go to both engines: to tradeloop as targets
decided at each close (`run_positions`), to vectorbt as `size_type="targetpercent"` orders at the next bar's open,
an order only where the target changes (units held in between, as tradeloop holds them). vectorbt's positions
(flat to flat, split at a reversal) are tradeloop's trades.

tradeloop's net return of a trade is its P&L over the equity at its entry; vectorbt's `Return` is over the
position's cost, so the vectorbt side is read as P&L / (cash + units × open) just before the entry order, from
vectorbt's own cash and asset series. Conventions that differ, from vectorbt's documentation:
- a position still open at the end is valued at the last close with no exit fill, where tradeloop closes it there
  ("end") and charges that fill: the two differ by exactly that fill's cost;
- a reversal is one order for vectorbt (one fixed fee, the percentage fee split between the two positions by size)
  and two fills for tradeloop (close, then open on the equity left: sized after the closing fee). With percentage
  fees only, each trade's P&L over its entry equity is the same either way; fixed fees are compared on a path
  without reversals;
- vectorbt buys only what its cash covers, fees included, so a long at 100 % of equity with fees is cut to fit;
  the runs with fees use half-size targets.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import vectorbt as vbt  # the test extra installs it (pip install -e '.[test]'): a missing install fails here

from shared.execution import CostModel, Prices, run_positions
from shared.market import load_dataset


@pytest.fixture(scope="module")
def eurusd():
    bars = load_dataset("eurusd")
    close = pd.Series(np.asarray(bars.close, dtype=np.float64))
    cross = np.sign(close.rolling(10).mean() - close.rolling(40).mean()).fillna(0.0).to_numpy()
    return bars, cross


def vectorbt_run(bars, targets: np.ndarray, costs: CostModel):
    """vectorbt's positions for `targets` (decided at each close): entry/exit bars, sides, prices, net returns over
    the equity just before the entry order, and the portfolio's value at each close."""
    idx = pd.DatetimeIndex(bars.timestamps)
    o, cl = np.asarray(bars.open, dtype=np.float64), np.asarray(bars.close, dtype=np.float64)
    size = np.r_[np.nan, targets[:-1]]                        # decided at close t → ordered at open t+1
    held = np.r_[0.0, targets[:-2]]                           # the target held before that order
    size[1:][size[1:] == held] = np.nan                       # unchanged target: no order, units held
    pf = vbt.Portfolio.from_orders(pd.Series(cl, index=idx), pd.Series(size, index=idx), size_type="targetpercent",
                                   price=pd.Series(o, index=idx), fees=costs.rate, fixed_fees=costs.fee,
                                   direction="both", init_cash=1.0, freq="1h")
    rec = pf.positions.records
    pos = {k: np.asarray(rec[k]) for k in ("entry_idx", "exit_idx", "direction", "entry_price", "exit_price", "pnl",
                                           "status", "size")}
    cash, units = pf.cash().to_numpy(), pf.assets().to_numpy()
    e, x = pos["entry_idx"].astype(np.int64), pos["exit_idx"].astype(np.int64)
    equity_at_entry = cash[e - 1] + units[e - 1] * o[e]
    return dict(entry_t=e, exit_t=x, side=np.where(pos["direction"] == 0, 1, -1), entry_price=pos["entry_price"],
                exit_price=pos["exit_price"], net_return=pos["pnl"] / equity_at_entry, open=pos["status"] == 0,
                size_units=pos["size"], equity_at_entry=equity_at_entry, value=pf.value().to_numpy())


def assert_same_trades(led: pd.DataFrame, ref: dict, bars) -> None:
    assert len(led) == len(ref["entry_t"]) > 40
    ts = pd.DatetimeIndex(bars.timestamps)
    assert (ts[led.entry_t.to_numpy()] == ts[ref["entry_t"]]).all()
    assert (ts[led.exit_t.to_numpy()] == ts[ref["exit_t"]]).all()
    np.testing.assert_array_equal(led.side.to_numpy(), ref["side"])
    np.testing.assert_array_equal(led.entry_price.to_numpy(), ref["entry_price"])
    np.testing.assert_array_equal(led.exit_price.to_numpy(), ref["exit_price"])


@pytest.mark.parametrize("size", [1.0, 0.5])
def test_same_trades_and_returns_as_vectorbt_at_zero_cost(eurusd, size):
    bars, cross = eurusd
    targets = size * cross
    costs = CostModel(cost_bps=0.0)
    ref = vectorbt_run(bars, targets, costs)
    for fast in (True, False):                                 # the vectorised replay and the step simulator
        res = run_positions(Prices.from_bars(bars), targets, costs, fast=fast)
        assert_same_trades(res.ledger, ref, bars)
        np.testing.assert_allclose(res.ledger.net_return.to_numpy(), ref["net_return"], rtol=0, atol=1e-9)
        # and the equity at every close: cash + units × close in both
        np.testing.assert_allclose(res.equity[0], ref["value"], rtol=1e-9, atol=0)
    # at size 1 a trade is exactly exit / entry − 1 for its side
    if size == 1.0:
        led = res.ledger
        np.testing.assert_allclose(led.net_return, led.side * (led.exit_price / led.entry_price - 1), rtol=0,
                                   atol=1e-12)


@pytest.mark.parametrize("long_only", [False, True])
def test_costs_within_vectorbt_conventions(eurusd, long_only):
    """5 bps a fill (flips included); the long-only path adds a fixed fee per fill (no reversals there)."""
    bars, cross = eurusd
    targets = 0.5 * (np.clip(cross, 0.0, 1.0) if long_only else cross)
    costs = CostModel(cost_bps=5.0, fee=1e-4 if long_only else 0.0)
    ref = vectorbt_run(bars, targets, costs)
    res = run_positions(Prices.from_bars(bars), targets, costs)
    led = res.ledger
    assert_same_trades(led, ref, bars)
    closed = ~ref["open"]
    assert ref["open"].sum() == 1 and ref["open"][-1] and led.exit_reason.iloc[-1] == "end"
    np.testing.assert_allclose(led.net_return.to_numpy()[closed], ref["net_return"][closed], rtol=0, atol=1e-9)
    # the position vectorbt leaves open: ours paid the end fill at the last close, vectorbt's did not
    end_fill = (costs.rate * ref["size_units"][-1] * ref["exit_price"][-1] + costs.fee) / ref["equity_at_entry"][-1]
    assert led.net_return.iloc[-1] == pytest.approx(ref["net_return"][-1] - end_fill, abs=1e-9)
    assert end_fill > 1e-5


def test_the_short_in_the_crossover_returns_its_fill_prices(eurusd):
    """The short of the 10/40 crossover entered at the open of 2017-04-21 01:00 (1.07179) and flipped at the open of
    2017-04-23 23:00 (1.08842): −(1.08842 / 1.07179 − 1), as `tradeloop backtest --cost-bps 0 --json` reports it."""
    from tradeloop.cmd_backtest import run_backtest

    bars, cross = eurusd
    out = run_backtest(bars, cross, cost_bps=0.0)
    (short,) = [t for t in out["trades"] if t["entry_time"] == "2017-04-21T01:00:00"]
    assert (short["side"], short["entry_price"], short["exit_time"], short["exit_price"], short["exit_reason"]) == (
        -1, 1.07179, "2017-04-23T23:00:00", 1.08842, "flip")
    assert short["net_return"] == pytest.approx(-(1.08842 / 1.07179 - 1), abs=1e-15)
    r = np.array([t["net_return"] for t in out["trades"]])
    assert out["metrics"]["per_trade_sharpe"] == pytest.approx(r.mean() / r.std(ddof=1), rel=1e-12)
