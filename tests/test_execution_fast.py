"""The blocked vectorised replay (`_run_positions_vectorized`) against the step simulator, at its block edges.

The reference is always `run_positions(..., fast=False)`: `Simulator.step` bar by bar. Tiny blocks are forced
through `block_elements` so that trades span blocks, flips land exactly on block boundaries, and several
accounts share a block (whole rows) or each has its own (one row, several time blocks). Blocks cover bars
[1, 1 + w), [1 + w, 1 + 2w), ... (bar 0 is flat by definition), w = the block width.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.execution import LEDGER_COLUMNS, CostModel, Prices, run_positions
from shared.vector_replay import _block_shape, _run_positions_vectorized

COSTS = CostModel(cost_bps=7, slippage_bps=3)


def walk(T: int, seed: int = 0) -> Prices:
    rng = np.random.default_rng(seed)
    close = 80 * np.exp(np.cumsum(rng.normal(0, 0.01, T)))
    open_ = np.r_[80, close[:-1]] * np.exp(rng.normal(0, 0.003, T))
    return Prices.from_arrays(open_, np.maximum(open_, close) * 1.004, np.minimum(open_, close) * 0.996, close)


def replay(p: Prices, tg, block_elements: int):
    tg = torch.as_tensor(np.atleast_2d(np.asarray(tg, dtype=float))).clamp(-1, 1)
    return _run_positions_vectorized(p, tg, COSTS, block_elements=block_elements)


def assert_same(fast, slow):
    assert list(fast.ledger.columns) == list(LEDGER_COLUMNS)
    assert fast.ledger.dtypes.to_dict() == slow.ledger.dtypes.to_dict()
    assert len(fast.ledger) == len(slow.ledger)
    for col in ("account", "entry_t", "exit_t", "side", "bars", "exit_reason"):
        assert (fast.ledger[col].to_numpy() == slow.ledger[col].to_numpy()).all(), col
    for col in ("size", "entry_price", "exit_price", "net_return"):
        np.testing.assert_allclose(fast.ledger[col], slow.ledger[col], rtol=1e-9, atol=1e-12, err_msg=col)
    np.testing.assert_allclose(fast.equity, slow.equity, rtol=1e-9)
    np.testing.assert_allclose(fast.bar_returns, slow.bar_returns, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(fast.positions, slow.positions)


def test_block_shape_is_whole_rows_or_one_account():
    assert _block_shape(B=10, n_bars=4, block_elements=12) == (3, 4)      # whole rows, 3 accounts a block
    assert _block_shape(B=2, n_bars=4, block_elements=100) == (2, 4)      # never more rows than accounts
    assert _block_shape(B=10, n_bars=30, block_elements=7) == (1, 7)      # one account, time blocks of 7
    assert _block_shape(B=1, n_bars=30, block_elements=1) == (1, 1)


def test_trade_spanning_blocks_and_flips_on_block_boundaries():
    T, w = 41, 5                                                          # blocks: bars 1-5, 6-10, 11-15, ...
    p = walk(T)
    tg = np.zeros((4, T))
    tg[0, :] = 1.0                                # one trade from bar 1 to the end: spans all 8 blocks
    tg[1, 2:30] = -0.5                            # a short held over 5+ blocks, exit at bar 30
    tg[2, :5] = 1.0                               # long from open 1, held through bar 5 (a block's last bar)
    tg[2, 5:10] = -1.0                            # decided at close 5 → flip filled at open 6: a block's first bar
    tg[2, 10:20] = 1.0                            # flip at open 11: again a first bar
    tg[2, 20:] = -0.25                            # flip to a smaller short at open 21 (first bar), held to end
    tg[3, 9] = 1.0                                # a one-bar trade in the last bar of a block (bar 10)
    tg[3, 10] = -1.0                              # flipped at open 11, the next block's first bar
    fast, slow = replay(p, tg, w), run_positions(p, tg, COSTS, fast=False)
    assert_same(fast, slow)
    led = fast.ledger
    assert list(led[led.account == 0][["entry_t", "exit_t", "exit_reason"]].itertuples(index=False)) == [
        (1, T - 1, "end")]
    a2 = led[led.account == 2]
    assert list(a2.entry_t) == [1, 6, 11, 21] and list(a2.exit_reason) == ["flip", "flip", "flip", "end"]
    # the spanning trade by hand: 1/o[1] units from open 1 to the last close, a fill cost at each end
    o, cl, c = p.open.numpy(), p.close.numpy(), COSTS.rate
    assert led.net_return.iloc[0] == pytest.approx(cl[-1] / o[1] - 1 - c - c * cl[-1] / o[1], rel=1e-10)


def test_trade_opened_at_the_last_bar():
    T = 12
    p = walk(T, seed=3)
    tg = np.zeros((3, T))
    tg[0, T - 2] = 1.0                            # flat → long at the last open, closed at the last close
    tg[1, : T - 2] = 1.0
    tg[1, T - 2] = -1.0                           # flip into the last bar, then the end close
    tg[2, T - 2] = 1.0
    tg[2, T - 3] = -1.0                           # flip exactly at the last bar's open from a one-bar short
    c, o, cl = COSTS.rate, p.open.numpy(), p.close.numpy()
    for w in (1, 2, 3, T - 1, 10_000):
        fast, slow = replay(p, tg, w), run_positions(p, tg, COSTS, fast=False)
        assert_same(fast, slow)
        last = fast.ledger[fast.ledger.account == 0].iloc[-1]
        assert (last.entry_t, last.exit_t, last.bars, last.exit_reason) == (T - 1, T - 1, 1, "end")
        assert last.net_return == pytest.approx(cl[-1] / o[-1] - 1 - c - c * cl[-1] / o[-1], rel=1e-12)
        assert list(fast.ledger[fast.ledger.account == 1].exit_reason) == ["flip", "end"]


@pytest.mark.parametrize("B,block_elements", [(1, 4), (1, 10_000), (7, 3 * 49), (7, 10), (5, 1)])
def test_random_paths_match_the_step_simulator(B, block_elements):
    """B=1 and B above the rows of a block; whole-row blocks (7 accounts in blocks of 3, 3, 1 rows) and
    one-account time blocks; fractional sizes, resizes, flips, trades still open at the end."""
    T = 50
    rng = np.random.default_rng(B * 100 + block_elements)
    p = walk(T, seed=B)
    tg = rng.choice([-1.0, -0.5, 0.0, 0.0, 0.3, 1.0, 1.5], size=(B, T))  # 1.5 is clamped to 1
    tg[:, -2] = rng.choice([-1.0, 0.0, 1.0], size=B)
    tg[0, 10:25] = np.linspace(0.2, 0.9, 15)      # a chain of resizes, across block edges
    assert_same(replay(p, tg, block_elements), run_positions(p, tg, COSTS, fast=False))


def test_no_trades_and_two_bars():
    p = walk(2)
    for tg in ([[0.0, 0.0]], [[1.0, 0.0]], [[-1.0, 1.0]]):
        assert_same(replay(p, tg, 1), run_positions(p, tg, COSTS, fast=False))
    empty = replay(walk(9), np.zeros((2, 9)), 4)
    assert len(empty.ledger) == 0 and list(empty.ledger.columns) == list(LEDGER_COLUMNS)
    assert (empty.equity == 1.0).all()


def test_cpu_thread_setting_is_restored():
    torch.set_num_threads(2)                    # not the suite's one thread (conftest): the replay sets 1 inside
    replay(walk(20), np.ones((2, 20)), 8)
    assert torch.get_num_threads() == 2


def test_fixed_fees_and_borrow_take_the_step_simulator():
    """The replay's legs scale with equity; a fixed fee or a borrow charge does not, so `run_positions` steps those
    bar by bar whatever `fast` says, and the replay refuses them."""
    p = walk(30, seed=5)
    tg = np.zeros((2, 30))
    tg[0, 3:12], tg[1, 5:20] = 1.0, -0.5
    for costs in (CostModel(cost_bps=2, fee=1e-4), CostModel(cost_bps=2, borrow_bps=300, bars_per_year=250)):
        assert not costs.proportional
        with pytest.raises(ValueError, match="proportional"):
            _run_positions_vectorized(p, torch.as_tensor(tg), costs)
        a, b = run_positions(p, tg, costs, fast=True), run_positions(p, tg, costs, fast=False)
        assert a.ledger.equals(b.ledger) and (a.equity == b.equity).all()
        plain = run_positions(p, tg, CostModel(cost_bps=2))
        worse = a.ledger.net_return.to_numpy() - plain.ledger.net_return.to_numpy()
        assert (worse <= 0).all() and (worse < 0).any()                     # borrow: the short only


def test_ruined_accounts_match_the_step_simulator():
    """Held units can lose more than the equity: a size-1 long whose price falls 99.99 %, a size-1 short whose price
    triples, a short whose bar high alone (a wick; every close below it) reaches its liquidation price. The step
    simulator liquidates them there and opens nothing after; the replay hands them back to it: the ledger and
    equity equal the step simulator's, finite."""
    T = 60
    close = np.r_[np.full(10, 100.0), 100.0 * np.geomspace(1.0, 1e-4, T - 10)]
    up = np.r_[np.full(10, 100.0), np.linspace(100.0, 300.0, 20), np.full(T - 30, 300.0)]
    p = Prices.from_arrays(close, close * 1.001, close * 0.999, close)
    q_high = up * 1.001
    q_high[8] = 230.0                                    # a wick past account 3's liquidation price (≈ 199.8)
    q = Prices.from_arrays(up, q_high, up * 0.999, up)
    tg = np.zeros((4, T))
    tg[0, :] = 1.0                                       # buy-and-hold through the collapse
    tg[1, 5:20], tg[1, 35:45] = 0.5, -0.5               # the healthy account alongside
    tg[2, 5:32], tg[2, 40:50] = -1.0, 1.0                # short through the tripling, then a long it cannot open
    tg[3, 2:9] = -1.0                                    # short through the wick only
    for prices in (p, q):
        for be in (7, 1 << 17):                          # the ruined account in a multi-row block, and alone
            fast = replay(prices, tg, be)
            slow = run_positions(prices, np.clip(tg, -1, 1), COSTS, fast=False)
            assert np.isfinite(fast.ledger["net_return"]).all() and np.isfinite(fast.equity).all()
            assert_same(fast, slow)
    for prices, acct in ((p, 0), (q, 2), (q, 3)):
        res = replay(prices, tg, 1 << 17)
        trades = res.ledger.query(f"account == {acct}")
        assert len(trades) == 1 and trades["exit_reason"].iloc[0] == "stop"
        # liquidated: nothing left, or a little less where an open gapped past the liquidation price
        assert -1.001 < trades["net_return"].iloc[0] <= -1.0 + 1e-12
        later = np.arange(T) > trades["exit_t"].iloc[0]
        after = res.equity[acct, later]
        assert (after <= 0).all() and (after == after[0]).all() and (res.positions[acct, later] == 0.0).all()


def test_the_step_simulator_stops_once_every_account_is_ruined(monkeypatch):
    """Once every account is flat with no equity (`Simulator.ruined`), `run_positions` stops stepping and fills the
    rest of the path as the steps would have: the same ledger, equity, bar returns and positions as stepping every
    bar, in fewer steps; one account still solvent keeps every step."""
    import shared.execution as ex

    T = 400
    close = np.r_[np.full(10, 100.0), 100.0 * np.geomspace(1.0, 1e-4, 30), np.full(T - 40, 0.01)]
    close[200:] = np.linspace(0.01, 5.0, T - 200)                         # a recovery that no ruined account sees
    p = Prices.from_arrays(close, close * 1.001, close * 0.999, close)
    tg = np.zeros((3, T))
    tg[0, :] = 1.0                                                        # held through the collapse
    tg[1, 3:], tg[1, 1] = 1.0, 0.5                                        # a trade first, then held
    tg[2, 50:] = 1.0                                                      # opens after the collapse: solvent
    steps = []
    step = ex.Simulator.step
    monkeypatch.setattr(ex.Simulator, "step", lambda self, *a: steps.append(1) or step(self, *a))

    def run(targets, every):
        steps.clear()
        monkeypatch.setattr(ex, "RUIN_CHECK_EVERY", every)
        return run_positions(p, targets, COSTS, fast=False), len(steps)

    for targets, stops in ((tg[:2], True), (tg, False)):
        early, n_early = run(targets, 4)
        full, n_full = run(targets, 10 ** 9)
        assert n_full == T - 1 and (n_early < 60 if stops else n_early == T - 1), (n_early, n_full)
        assert_same(early, full)
        for a in ("bar_returns", "positions"):
            np.testing.assert_array_equal(getattr(early, a), getattr(full, a), err_msg=a)
    last = early.ledger.groupby("account").tail(1).set_index("account")["exit_reason"]
    assert list(last) == ["stop", "stop", "end"]                          # the two liquidated; the third held
