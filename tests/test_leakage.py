"""Leakage guard: the OOS split never reaches feedback, validation never reaches sample-level signals, and reports
whose windows overlap the wrong split are refused. Reports are built through the real pipeline: bars → simulator
→ autopsy → report builder → guard → signals."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from services.evaluator import autopsy as ap
from services.evaluator.report_builder import build_eval_report, build_split_report, split_definition
from services.feedback.guard import FeedbackView, LeakageError, ValAggregates, build_view
from services.feedback.signals import compute_bundle
from shared.execution import CostModel, Prices, run_positions
from shared.market import Bars, chronological_split, load_dataset, regime_labels
from shared.report import bars_window_hash

COST = CostModel(cost_bps=1.0)
N = 1500
SAMPLE_LEVEL = ("E6", "E7")
VAL_LEVEL = ("E1", "E2", "E3", "E4", "E5", "E8", "E9")


@pytest.fixture(scope="module")
def bars() -> Bars:
    return load_dataset("synthetic", seed=11).slice(0, N)


@pytest.fixture(scope="module")
def split():
    return chronological_split(N, train=0.6, val=0.2, embargo=20)


def _policy(w: Bars) -> tuple[np.ndarray, ap.Predictions]:
    """A deterministic stand-in for the agent: 3-bar momentum, held 4 bars; predictions from the same signal."""
    c = w.close
    mom = np.zeros(len(c))
    mom[3:] = c[3:] / c[:-3] - 1.0
    raw = np.sign(mom)
    targets = np.repeat(raw[::4], 4)[: len(c)]
    q = 0.5 * mom                                              # [T] predicted return of the chosen action
    preds = ap.Predictions(direction=(targets + 1).astype(int), size=np.zeros(len(c), dtype=int),
                           exit=np.zeros(len(c), dtype=int), q_mean=q,
                           q_quantiles=q[:, None] + 0.01 * np.array([-2, -1, 0, 1, 2.0])[None, :],
                           ensemble_std=np.abs(mom) + 1e-3, q_dir=np.stack([-q, 0 * q, q], axis=1), n_sizes=1)
    return targets, preds


def _window_report(name, bars: Bars, window, regimes):
    s, e = window
    w = bars.slice(s, e)
    targets, preds = _policy(w)
    res = run_positions(Prices.from_bars(w), targets, COST)
    return build_split_report(name, window=window, window_hash=bars_window_hash(bars, s, e), ledger=res.ledger,
                              bar_returns=res.bar_returns, positions=res.positions, equity=res.equity,
                              preds=preds, regimes=regimes[s:e], close=w.close, cost_rate=COST.rate, n_trials=2)


def _report(bars: Bars, split, epoch: int = 1, run_id: str = "run"):
    reg = regime_labels(bars)
    return build_eval_report(run_id=run_id, epoch=epoch, split=split_definition(split, bars),
                             val=_window_report("val", bars, split.val, reg),
                             oos=_window_report("oos", bars, split.test, reg),
                             insample=_window_report("insample", bars, split.train, reg), n_trials=2,
                             created_at="t")


def _perturb(bars: Bars, window, seed: int) -> Bars:
    """The same bars with [start, end) replaced by another path (each bar's OHLC scaled by one factor)."""
    s, e = window
    f = np.ones(len(bars))
    f[s:e] = np.cumprod(1 + np.random.default_rng(seed).normal(0, 0.01, e - s))
    return Bars(timestamps=bars.timestamps, open=bars.open * f, high=bars.high * f, low=bars.low * f,
                close=bars.close * f, volume=bars.volume, name=bars.name, source=bars.source)


def _signals(bundle):
    return {i: s.model_dump() for i, s in bundle.signals.items()}


@pytest.fixture(scope="module")
def base(bars, split):
    return _report(bars, split)


def test_changing_oos_bars_changes_no_signal(bars, split, base):
    other = _perturb(bars, split.test, seed=1)
    rep2 = _report(other, split)
    # the OOS backtest really differs …
    assert rep2.oos.window_hash != base.oos.window_hash
    assert [t.net_return for t in rep2.oos.trades] != [t.net_return for t in base.oos.trades]
    # … and no signal moves
    a = compute_bundle(base, [], None, bars=bars, now="t")
    b = compute_bundle(rep2, [], None, bars=other, now="t")
    assert _signals(a) == _signals(b) and a.knobs == b.knobs
    # dropping the OOS backtest altogether changes nothing either
    c = compute_bundle(base.model_copy(update={"oos": None}), [], None, now="t")
    assert _signals(c) == _signals(a)


def test_changing_validation_bars_changes_no_sample_level_signal(bars, split, base):
    other = _perturb(bars, split.val, seed=2)
    rep2 = _report(other, split)
    a = compute_bundle(base, [], None, bars=bars, now="t")
    b = compute_bundle(rep2, [], None, bars=other, now="t")
    assert a.signals["E6"].value and a.signals["E7"].value             # the sample-level signals are not empty
    for i in SAMPLE_LEVEL:
        assert a.signals[i].model_dump() == b.signals[i].model_dump()
    # the validation-level signals do see the change (so this test could fail)
    assert any(a.signals[i].value != b.signals[i].value for i in VAL_LEVEL)


def test_sample_level_signals_index_only_training_bars(bars, split, base):
    b = compute_bundle(base, [], None, now="t")
    lo, hi = split.train
    bars_e6 = [bar for bar, _ in b.signals["E6"].value]
    bars_e7 = [bar for bar, _ in b.signals["E7"].value]
    assert bars_e6 and bars_e7
    assert all(lo <= x < hi for x in bars_e6 + bars_e7)


def test_the_view_has_no_oos_and_no_validation_samples(base):
    view = build_view(base)
    assert {f.name for f in dataclasses.fields(FeedbackView)} == {"run_id", "epoch", "knobs", "val", "insample",
                                                                 "history"}
    assert "trades" not in {f.name for f in dataclasses.fields(ValAggregates)}
    text = repr(view)
    assert base.oos.window_hash not in text and base.split.test_hash not in text
    for t in base.val.trades[:20]:                               # no validation bar index survives
        assert f"decision_t={t.decision_t}," not in text and f"entry_t={t.entry_t}," not in text


def test_guard_refuses_windows_of_the_wrong_split(bars, split, base):
    s0, s1 = split.val
    t0, t1 = split.train
    overlap = base.model_copy(update={"val": base.val.model_copy(update={"window": (t1 - 10, s1)})})
    with pytest.raises(LeakageError, match="val window .* overlaps train"):
        compute_bundle(overlap, [], None)
    into_test = base.model_copy(update={"val": base.val.model_copy(update={"window": (s0, split.test[0] + 1)})})
    with pytest.raises(LeakageError, match="overlaps"):
        compute_bundle(into_test, [], None)
    outside = base.model_copy(update={"insample": base.insample.model_copy(update={"window": (t0, s0 + 5)})})
    with pytest.raises(LeakageError, match="insample window .* not inside train"):
        compute_bundle(outside, [], None)


def test_guard_refuses_mismatched_window_hashes(bars, split, base):
    wrong = base.model_copy(update={"val": base.val.model_copy(update={"window_hash": "0" * 64})})
    with pytest.raises(LeakageError, match="val window hash"):
        compute_bundle(wrong, [], None)
    other = _perturb(bars, split.val, seed=3)                     # a report of other bars, checked against ours
    with pytest.raises(LeakageError, match="does not match the bars"):
        compute_bundle(_report(other, split), [], None, bars=bars)


def test_guard_refuses_foreign_history(bars, split, base):
    other_run = base.model_copy(update={"run_id": "other", "epoch": 0})
    with pytest.raises(LeakageError, match="another run"):
        compute_bundle(base, [other_run], None)
    later = base.model_copy(update={"epoch": 5})
    with pytest.raises(LeakageError, match="earlier epochs"):
        compute_bundle(base, [later], None)
    moved = base.model_copy(update={"epoch": 0, "split": base.split.model_copy(update={"embargo": 0})})
    with pytest.raises(LeakageError, match="split definition differs"):
        compute_bundle(base, [moved], None)


def test_history_entries_give_the_view_and_the_refusals_of_full_reports(bars, split, base):
    """The feedback service keeps earlier reports as `HistoryEntry`s: the same view (and bundle) as the full
    reports, and the same refusals of another run, a later epoch, another split."""
    from services.feedback.guard import HistoryEntry, history_entry

    earlier = [base.model_copy(update={"epoch": 0}), base.model_copy(update={"epoch": -1})]
    entries = [history_entry(h) for h in earlier]
    assert all(isinstance(e, HistoryEntry) for e in entries)
    assert build_view(base, earlier) == build_view(base, entries)
    assert build_view(base, earlier).history and compute_bundle(base, entries, None, now="t") == compute_bundle(
        base, earlier, None, now="t")
    for bad, match in ((base.model_copy(update={"run_id": "other", "epoch": 0}), "another run"),
                       (base.model_copy(update={"epoch": 5}), "earlier epochs"),
                       (base.model_copy(update={"epoch": 0, "split": base.split.model_copy(update={"embargo": 0})}),
                        "split definition differs")):
        with pytest.raises(LeakageError, match=match):
            build_view(base, [history_entry(bad)])
