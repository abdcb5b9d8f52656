"""Trade autopsy on crafted ledgers: known winners, losers, regimes, hindsight actions, branch errors,
calibration; and the report builder over the real simulator."""
from __future__ import annotations

import copy
import json
import math
import pickle
import statistics

import numpy as np
import pandas as pd
import pytest

from services.evaluator import autopsy as ap
from services.evaluator.report_builder import build_eval_report, build_split_report, split_definition
from shared.report import SCHEMA_VERSION, TAUS, EvalReport, TradeTable, bars_window_hash

C = 1e-4  # 1 bp of the traded notional per fill
T = 30


def _preds(T: int = T, n_sizes: int = 3) -> ap.Predictions:
    t = np.arange(T)
    q = 0.001 * t
    return ap.Predictions(
        direction=np.full(T, 2), size=np.zeros(T, dtype=int), exit=np.zeros(T, dtype=int), q_mean=q,
        q_quantiles=q[:, None] + np.array([-0.02, -0.01, 0.0, 0.01, 0.02])[None, :],
        ensemble_std=0.01 + 0.0001 * t, q_dir=np.stack([-q, 0 * q, q], axis=1), n_sizes=n_sizes)


def _ledger(rows: list[dict]) -> pd.DataFrame:
    base = {"account": 0, "side": 1, "size": 1.0, "exit_reason": "signal"}
    df = pd.DataFrame([{**base, **r} for r in rows])
    if "bars" not in df:
        df["bars"] = df["exit_t"] - df["entry_t"]
    return df


def _long_ret(E: float, X: float, p: float = 1.0) -> float:
    """Net return of a long of size p from E to X: p/E units per unit of equity, c of the notional at each fill
    (p at the entry, p·X/E at the exit) (hand formula)."""
    return p * (X / E - 1) - C * p - C * p * X / E


def test_decision_bar_and_entry_predictions():
    close = np.full(T, 100.0)
    preds = _preds()
    led = _ledger([{"entry_t": 5, "exit_t": 8, "entry_price": 100.0, "exit_price": 101.0, "net_return": 0.0098}])
    (tr,) = ap.build_trades(led, preds, np.full(T, 4), close, cost_rate=C, offset=1000)
    assert (tr.decision_t, tr.entry_t, tr.exit_t) == (1004, 1005, 1008)
    assert tr.q_pred == pytest.approx(0.004)                   # read at local bar 4 = entry_t − 1
    assert tr.q_quantiles == pytest.approx([-0.016, -0.006, 0.004, 0.014, 0.024])
    assert tr.ensemble_std == pytest.approx(0.0104)
    assert tr.q_dir == pytest.approx([-0.004, 0.0, 0.004])
    assert tr.regime == 4 and not tr.direction_error


def test_hindsight_direction_of_losers():
    close = np.full(T, 100.0)
    E = 100.0
    led = _ledger([
        # a long that lost 2 %: short would have won
        {"entry_t": 2, "exit_t": 4, "entry_price": E, "exit_price": 98.0, "net_return": _long_ret(E, 98.0)},
        # a long that lost only its costs (price moved 0.5 bp): neither side beats 2 bp of costs → flat
        {"entry_t": 6, "exit_t": 8, "entry_price": E, "exit_price": 99.995, "net_return": _long_ret(E, 99.995)},
        # a short that lost 3 %: long would have won
        {"entry_t": 10, "exit_t": 12, "side": -1, "entry_price": E, "exit_price": 103.0,
         "net_return": -0.03 - C - C * 1.03},
        # a winner: no hindsight label
        {"entry_t": 14, "exit_t": 16, "entry_price": E, "exit_price": 102.0, "net_return": _long_ret(E, 102.0)},
    ])
    trades = ap.build_trades(led, _preds(), np.zeros(T, dtype=int), close, cost_rate=C, hindsight=True)
    assert [t.hindsight_dir for t in trades] == [0, 1, 2, None]
    # short from 100 to 98 at size 1 with 1 bp per fill: +2 % less 1 bp of 100 and 1 bp of 98, by hand
    assert trades[0].hindsight_returns == pytest.approx([0.02 - 0.0001 - 0.000098, 0.0, -0.02 - 0.0001 - 0.000098],
                                                        abs=1e-15)
    assert ap.losing_with_hindsight(trades) == [2, 0, 1]       # worst loss first
    # without hindsight (val / OOS windows) nothing is labelled
    assert all(t.hindsight_dir is None for t in
               ap.build_trades(led, _preds(), np.zeros(T, dtype=int), close, cost_rate=C))


def test_size_error_definition():
    close = np.full(T, 100.0)
    preds = _preds(n_sizes=3)
    preds.size[:] = [2, 1, 0, 2, 0, 2] * 5                      # decision bars 0..29
    rows = [  # (entry_t, net) → decision bar entry_t − 1 → size index
        (1, -0.01),   # decision 0: largest size, loser → error
        (2, -0.01),   # decision 1: middle size, loser → no error
        (3, +0.01),   # decision 2: smallest size, winner → error
        (4, +0.01),   # decision 3: largest size, winner → no error
        (5, -0.01),   # decision 4: smallest size, loser → no error
        (6, -0.00005),  # decision 5: largest size, immaterial loss (< 2·c) → no error
    ]
    led = _ledger([{"entry_t": e, "exit_t": e + 1, "entry_price": 100.0, "exit_price": 100.0, "net_return": r}
                   for e, r in rows])
    trades = ap.build_trades(led, preds, np.zeros(T, dtype=int), close, cost_rate=C)
    assert [t.size_error for t in trades] == [True, False, True, False, False, False]
    assert [t.direction_error for t in trades] == [True, True, False, False, True, True]
    one = _preds(n_sizes=1)                                      # one size level: the size branch cannot err
    assert not any(t.size_error for t in ap.build_trades(led, one, np.zeros(T, dtype=int), close, cost_rate=C))


def test_exit_error_definition():
    E, stop = 100.0, 98.0
    net = _long_ret(E, stop)
    # stopped out inside the entry bar (bars = 1): the hindsight exit span is closes of bars [5, 6]
    recovered = np.full(T, 100.0)
    recovered[5], recovered[6] = 97.5, 103.0                    # the price came back: the stop was wrong
    kept_falling = np.full(T, 100.0)
    kept_falling[5], kept_falling[6] = 97.5, 96.0               # every close in the span is below the stop
    led = _ledger([{"entry_t": 5, "exit_t": 5, "bars": 1, "entry_price": E, "exit_price": stop, "net_return": net,
                    "exit_reason": "stop"}])
    (a,) = ap.build_trades(led, _preds(), np.zeros(T, dtype=int), recovered, cost_rate=C)
    (b,) = ap.build_trades(led, _preds(), np.zeros(T, dtype=int), kept_falling, cost_rate=C)
    assert a.exit_error and a.best_exit_return == pytest.approx(_long_ret(E, 103.0))
    assert not b.exit_error and b.best_exit_return == pytest.approx(_long_ret(E, 97.5))
    # the close at bar 7 lies beyond the span (exit_t + bars = 6): a rally there does not count
    late = kept_falling.copy()
    late[7] = 110.0
    (c,) = ap.build_trades(led, _preds(), np.zeros(T, dtype=int), late, cost_rate=C)
    assert not c.exit_error
    # a signal exit is the direction head's decision: never an exit error
    sig = led.assign(exit_reason="signal", exit_t=6, bars=1)
    (d,) = ap.build_trades(sig, _preds(), np.zeros(T, dtype=int), recovered, cost_rate=C)
    assert not d.exit_error
    # a target hit while the price ran far past it: the target was too tight
    run = np.full(T, 100.0)
    run[9], run[10], run[11] = 101.0, 104.0, 106.0
    tgt = _ledger([{"entry_t": 9, "exit_t": 10, "bars": 2, "entry_price": E, "exit_price": 102.0,
                    "net_return": _long_ret(E, 102.0), "exit_reason": "target"}])
    (e,) = ap.build_trades(tgt, _preds(), np.zeros(T, dtype=int), run, cost_rate=C)
    assert e.exit_error and e.best_exit_return == pytest.approx(_long_ret(E, 106.0))


def _records(returns, regimes, stds=None):
    close = np.full(T, 100.0)
    preds = _preds()
    reg = np.zeros(T, dtype=int)
    rows = []
    for i, (r, k) in enumerate(zip(returns, regimes)):
        e = 1 + i
        reg[e - 1] = k
        if stds is not None:
            preds.ensemble_std[e - 1] = stds[i]
        rows.append({"entry_t": e, "exit_t": e + 1, "entry_price": 100.0, "exit_price": 100.0, "net_return": r})
    return ap.build_trades(_ledger(rows), preds, reg, close, cost_rate=C)


def test_regime_stats_by_decision_bar_regime():
    rets = [0.02, -0.01, 0.03, -0.04, -0.02, 0.01]
    regs = [2, 2, 2, 5, 5, 7]
    stats = ap.regime_stats(_records(rets, regs))
    assert [s.n_trades for s in stats] == [0, 0, 3, 0, 0, 2, 0, 1, 0]
    two = [0.02, -0.01, 0.03]
    assert stats[2].mean_return == pytest.approx(statistics.mean(two))
    assert stats[2].sharpe == pytest.approx(statistics.mean(two) / statistics.stdev(two))
    assert stats[2].win_rate == pytest.approx(2 / 3)
    assert stats[5].mean_return == pytest.approx(-0.03) and stats[5].win_rate == 0.0
    assert stats[7].sharpe == 0.0 and stats[0].mean_return == 0.0   # one trade / no trade: defined as 0


def test_branch_error_rates():
    trades = _records([0.02, -0.01, 0.03, -0.04], [0, 0, 0, 0])
    b = ap.branch_stats(trades)
    assert b["direction"].n_errors == 2 and b["direction"].error_rate == 0.5
    assert b["direction"].mean_return_when_error == pytest.approx(-0.025)
    assert b["exit"].n_errors == 0


def test_calibration_coverage_and_bias():
    # predictions at decision bars 0..3: q_mean = 0, .001, .002, .003; quantiles q ± (.02, .01, 0)
    rets = [-0.015, 0.0, 0.005, 0.04]
    trades = _records(rets, [0] * 4)
    cal = ap.calibration(trades)
    q = np.array([0.0, 0.001, 0.002, 0.003])
    qs = q[:, None] + np.array([-0.02, -0.01, 0.0, 0.01, 0.02])
    # by hand: trade 0 (−.015) ≤ q05? −.02 no; ≤ q25 −.01 yes → covered from τ=.25 on
    #          trade 1 (0)    ≤ q25 −.009 no; ≤ q50 .001 yes
    #          trade 2 (.005) ≤ q50 .002 no; ≤ q75 .012 yes
    #          trade 3 (.04)  never (q95 = .023)
    assert cal.coverage == pytest.approx([0.0, 0.25, 0.5, 0.75, 0.75])
    assert cal.coverage == pytest.approx(list((np.array(rets)[:, None] <= qs).mean(0)))
    assert cal.bias == pytest.approx(np.mean(q - rets))
    assert cal.median_bias == pytest.approx(np.median(q - rets))
    assert cal.mae == pytest.approx(np.mean(np.abs(q - rets)))
    assert cal.taus == list(TAUS)
    empty = ap.calibration([])
    assert empty.n_trades == 0 and empty.bias == 0.0


def test_top_winners_are_the_best_tenth_of_winners():
    rets = [0.001 * (i + 1) for i in range(20)] + [-0.01] * 5
    trades = _records(rets[::-1], [0] * 25)                      # order must not matter
    top = ap.top_winners(trades)
    assert [trades[i].net_return for i in top] == pytest.approx([0.020, 0.019])   # ceil(0.1·20) = 2
    assert len(ap.top_winners(trades[:25], frac=0.25)) == 5


def test_gate_curve_sums_kept_trades():
    rets = [0.01, 0.02, -0.05, -0.03]
    stds = [0.1, 0.2, 0.9, 0.8]
    curve = ap.gate_curve(_records(rets, [0] * 4, stds), levels=(0.5,))
    # the median of the stds is 0.5: keeps the two calm winners; no gate keeps all four
    assert [(p.threshold, p.n_kept) for p in curve] == [(pytest.approx(0.5), 2), (None, 4)]
    assert curve[0].sum_return == pytest.approx(0.03) and curve[1].sum_return == pytest.approx(-0.05)


def test_bad_input_names_the_field():
    close = np.full(T, 100.0)
    led = _ledger([{"entry_t": 5, "exit_t": 8, "entry_price": 100.0, "exit_price": 101.0, "net_return": 0.01}])
    with pytest.raises(ValueError, match="exit_reason"):
        ap.build_trades(led.drop(columns="exit_reason"), _preds(), np.zeros(T, dtype=int), close, cost_rate=C)
    bad = _preds()
    bad.q_quantiles = bad.q_quantiles[:, :3]
    with pytest.raises(ValueError, match="q_quantiles"):
        ap.build_trades(led, bad, np.zeros(T, dtype=int), close, cost_rate=C)
    with pytest.raises(ValueError, match="row 0: exit_t"):
        ap.build_trades(led.assign(exit_t=T), _preds(), np.zeros(T, dtype=int), close, cost_rate=C)
    with pytest.raises(ValueError, match="regimes"):
        ap.build_trades(led, _preds(), np.full(T, 9), close, cost_rate=C)
    # post hoc predictions may be absent (NaN) where no trade was entered, not at an entry decision (bar 4 here)
    sparse = _preds()
    sparse.q_dir[np.arange(T) != 4] = np.nan
    sparse.q_quantiles[np.arange(T) != 4] = np.nan
    assert len(ap.build_trades(led, sparse, np.zeros(T, dtype=int), close, cost_rate=C)) == 1
    sparse.q_dir[4] = np.nan
    with pytest.raises(ValueError, match="q_dir is not computed at decision bar 4"):
        ap.build_trades(led, sparse, np.zeros(T, dtype=int), close, cost_rate=C)
    inf = _preds()
    inf.q_dir[7, 0] = np.inf
    with pytest.raises(ValueError, match="q_dir is not finite"):
        ap.build_trades(led, inf, np.zeros(T, dtype=int), close, cost_rate=C)


def test_report_from_the_simulator_round_trips_as_json():
    from shared.execution import CostModel, Prices, run_positions
    from shared.market import chronological_split, load_dataset

    bars = load_dataset("synthetic", seed=3).slice(0, 600)
    sp = chronological_split(len(bars), train=0.6, val=0.2, embargo=10)
    cost = CostModel(cost_bps=1.0)
    reports = {}
    for name, (s, e) in (("insample", sp.train), ("val", sp.val), ("oos", sp.test)):
        w = bars.slice(s, e)
        n = e - s
        rng = np.random.default_rng(s)
        targets = np.repeat(rng.choice([-1.0, 0.0, 1.0], size=n // 5 + 1), 5)[:n]
        res = run_positions(Prices.from_bars(w), targets, cost)
        preds = _preds(n)
        preds.direction[:] = (np.sign(targets) + 1).astype(int)
        reports[name] = build_split_report(
            name, window=(s, e), window_hash=bars_window_hash(bars, s, e), ledger=res.ledger,
            bar_returns=res.bar_returns, positions=res.positions, equity=res.equity, preds=preds,
            regimes=rng.integers(0, 9, n), close=w.close, cost_rate=cost.rate, n_trials=3,
            prior_sharpes=[0.05, 0.10])
        led = res.ledger
        rep = reports[name]
        assert len(rep.trades) == len(led) == rep.metrics["n_trades"]
        assert [t.entry_t for t in rep.trades] == sorted(led["entry_t"] + s)
        assert rep.equity == pytest.approx(list(res.equity[0]))
        assert sum(r.n_trades for r in rep.regimes) == len(led)
    ins, val = reports["insample"], reports["val"]
    assert ins.top_winners and ins.losers and all(ins.trades[i].hindsight_dir is not None for i in ins.losers)
    assert not val.top_winners and all(t.hindsight_dir is None for t in val.trades)
    report = build_eval_report(run_id="r1", epoch=2, split=split_definition(sp, bars), val=val,
                               oos=reports["oos"], insample=ins, n_trials=3)
    assert report.split.val_hash == val.window_hash == sp.window_hash(bars, "val")
    vs, os_ = val.metrics["per_trade_sharpe"], reports["oos"].metrics["per_trade_sharpe"]
    assert report.val_oos_gap == pytest.approx(1 - os_ / vs)
    text = report.model_dump_json()
    assert "NaN" not in text and "Infinity" not in text
    back = EvalReport.model_validate_json(text)
    assert back == report and json.loads(text)["schema_version"] == SCHEMA_VERSION == 2


def test_dsr_is_deflated_by_the_checkpoints_evaluated():
    rng = np.random.default_rng(0)
    T2 = 400
    close = 100 * np.cumprod(1 + rng.normal(0.0005, 0.01, T2))
    rets = rng.normal(0.004, 0.01, 60)
    led = pd.DataFrame({"account": 0, "entry_t": np.arange(1, 121, 2), "exit_t": np.arange(2, 122, 2), "side": 1,
                        "size": 1.0, "entry_price": 100.0, "exit_price": 100.0, "net_return": rets, "bars": 1,
                        "exit_reason": "signal"})
    kw = dict(window=(0, T2), window_hash="h", ledger=led, bar_returns=np.zeros(T2), positions=np.zeros(T2),
              equity=np.ones(T2), preds=_preds(T2), regimes=np.zeros(T2, dtype=int), close=close, cost_rate=C)
    one = build_split_report("val", n_trials=1, **kw).metrics
    many = build_split_report("val", n_trials=20, **kw).metrics
    assert one["dsr"] == pytest.approx(one["psr"])              # one trial: no selection
    assert many["dsr"] < one["dsr"] and math.isfinite(many["dsr"])


def test_vectorised_best_exit_equals_the_scalar_definition():
    """build_trades' best exit (a range max/min of the closes, the return being monotone in the exit price) equals
    `best_exit_return`'s direct max over the hindsight span, bit for bit, for longs and shorts of every length."""
    rng = np.random.default_rng(3)
    n = 3000
    close = 100.0 * np.exp(np.cumsum(0.01 * rng.standard_normal(n)))
    e = np.sort(rng.integers(1, n - 2, 400))
    x = np.minimum(e + rng.integers(0, 300, 400), n - 1)
    led = _ledger([{"entry_t": int(a), "exit_t": int(b), "side": int(s), "size": float(p), "bars": int(bb),
                    "entry_price": float(close[a]), "exit_price": float(close[b]), "net_return": 0.001,
                    "exit_reason": "stop"}
                   for a, b, s, p, bb in zip(e, x, rng.choice([-1, 1], 400), rng.uniform(0.1, 1.0, 400),
                                             rng.integers(0, 400, 400))])
    trades = ap.build_trades(led, _preds(n), np.zeros(n, dtype=int), close, cost_rate=C)
    assert len(trades) == 400
    for t, row in zip(trades, led.sort_values(["entry_t", "exit_t"], kind="stable").itertuples()):
        want = ap.best_exit_return(row.side, row.size, row.entry_price, close, row.entry_t, row.exit_t, row.bars, C)
        assert t.best_exit_return == want


# --- the packed trade table ---------------------------------------------------------------------------------


def test_trade_table_packs_round_trips_and_matches_its_rows():
    """Columns ↔ rows ↔ packed JSON agree exactly; hindsight stays None where a trade has none."""
    rets = [0.02, -0.01, 0.03, -0.04]
    t = ap.build_trades(_ledger([{"entry_t": 1 + i, "exit_t": 2 + i, "entry_price": 100.0, "exit_price": 100 * (1 + r),
                                  "net_return": r} for i, r in enumerate(rets)]),
                        _preds(), np.zeros(T, dtype=int), np.full(T, 100.0), cost_rate=C, offset=50, hindsight=True)
    rows = t.records()
    assert [r["net_return"] for r in rows] == rets and [r["entry_t"] for r in rows] == [51, 52, 53, 54]
    assert [r["hindsight_dir"] is None for r in rows] == [True, False, True, False]    # losers only
    assert TradeTable.from_records(rows) == t == TradeTable.of(json.loads(json.dumps(t.to_json_dict())))
    assert t[1].model_dump() == rows[1] and len(t[1:3]) == 2 and t[1:3][0] == t[1]
    assert ap.hindsight_direction(rows[3]["hindsight_returns"]) == rows[3]["hindsight_dir"]
    assert copy.deepcopy(t) == t == pickle.loads(pickle.dumps(t))
    with pytest.raises(AttributeError, match="no attribute 'pnl'"):
        t.pnl


def test_trade_table_refuses_bad_columns_naming_column_and_row():
    rows = _records([0.01, -0.02, 0.03], [0, 1, 2]).records()
    with pytest.raises(ValueError, match="row 1, field regime: Input should be less than 9"):
        TradeTable.from_records([rows[0], {**rows[1], "regime": 9}, rows[2]])    # 9 regimes: 0..8
    table = TradeTable.from_records(rows)
    with pytest.raises(ValueError, match="column side row 2"):
        TradeTable(**{**{k: getattr(table, k) for k in table.to_json_dict()["columns"]}, "side": [1, -1, 0]})
    packed = TradeTable.from_records(rows).to_json_dict()
    cols = packed["columns"]
    with pytest.raises(ValueError, match=r"trades.columns.net_return: 18 bytes where shape \(3,\) of <f8 needs 24"):
        TradeTable.of({**packed, "columns": {**cols, "net_return": cols["net_return"][:24]}})
    with pytest.raises(ValueError, match="missing columns .'q_dir'."):
        TradeTable.of({**packed, "columns": {k: v for k, v in cols.items() if k != "q_dir"}})
    nan = np.array([0.01, np.nan, 0.03])
    with pytest.raises(ValueError, match="column net_return row 1"):
        TradeTable(**{**{k: getattr(TradeTable.from_records(rows), k) for k in cols}, "net_return": nan})
