"""E1–E9 on crafted reports: each signal moves the right way, by the documented formula, never past its bounds;
rollback; feedback off."""
from __future__ import annotations

import math

import numpy as np
import pytest

from services.evaluator import autopsy as ap
from services.feedback.guard import build_view
from services.feedback.signals import (FeedbackConfig, compute_bundle, e1_q_bias, e2_epsilon, e3_gamma,
                                       e4_lr_scale, e5_gate, e6_priority, e7_hindsight, e8_regime_weights,
                                       e9_regime_confidence)
from shared.knobs import BRANCHES, N_REGIMES, Knobs
from shared.report import EvalReport, FeedbackBundle, SplitDefinition, SplitReport, TradeRecord

SPLIT = SplitDefinition(n_bars=1000, train=(0, 600), val=(620, 800), test=(820, 1000), embargo=20,
                        train_hash="T" * 64, val_hash="V" * 64, test_hash="X" * 64)
CFG = FeedbackConfig()


def tr(r: float, *, t: int = 0, start: int = 620, bars: int = 2, regime: int = 0, q: float | None = None,
       std: float = 0.01, direction_idx: int = 2, d_err: bool | None = None, s_err: bool = False,
       x_err: bool = False, hindsight_dir: int | None = None) -> TradeRecord:
    """A closed trade of return r whose decision bar is start + t."""
    q = r if q is None else q
    e = start + t + 1
    return TradeRecord(entry_t=e, exit_t=e + bars - 1, decision_t=e - 1, side=1, size=1.0, entry_price=100.0,
                       exit_price=100.0 * (1 + r), net_return=r, bars=bars, exit_reason="signal", regime=regime,
                       direction_idx=direction_idx, size_idx=0, exit_idx=0, q_pred=q,
                       q_quantiles=[q - 0.02, q - 0.01, q, q + 0.01, q + 0.02], ensemble_std=std,
                       q_dir=[-q, 0.0, q], direction_error=r < 0 if d_err is None else d_err, size_error=s_err,
                       exit_error=x_err, best_exit_return=max(r, 0.0),
                       hindsight_returns=None if hindsight_dir is None else [0.0, 0.0, 0.0],
                       hindsight_dir=hindsight_dir)


def split_report(name: str, trades: list[TradeRecord], window: tuple[int, int], **metrics) -> SplitReport:
    """A SplitReport whose aggregates come from the autopsy of `trades`; metrics given explicitly."""
    r = np.array([t.net_return for t in trades])
    m = {"per_trade_sharpe": float(r.mean() / r.std(ddof=1)) if len(r) > 1 and r.std() > 0 else 0.0,
         "n_trades": float(len(trades)),
         "mean_bars_held": float(np.mean([t.bars for t in trades])) if trades else 0.0, **metrics}
    w, lo = ap.disagreement(trades)
    return SplitReport(split=name, window=window, window_hash=(SPLIT.val_hash if name == "val" else SPLIT.train_hash),
                       metrics=m, trades=trades, equity=[1.0], regimes=ap.regime_stats(trades),
                       branches=ap.branch_stats(trades), calibration=ap.calibration(trades),
                       gate_curve=ap.gate_curve(trades), disagreement_winners=w, disagreement_losers=lo,
                       top_winners=ap.top_winners(trades) if name == "insample" else [],
                       losers=ap.losing_with_hindsight(trades) if name == "insample" else [])


def report(val_trades: list[TradeRecord], *, epoch: int = 1, knobs: Knobs | None = None,
           insample: list[TradeRecord] | None = None, **metrics) -> EvalReport:
    ins = None if insample is None else split_report("insample", insample, (0, 600))
    return EvalReport(run_id="run", epoch=epoch, split=SPLIT, n_trials=epoch + 1,
                      val=split_report("val", val_trades, SPLIT.val, **metrics), insample=ins,
                      knobs=None if knobs is None else knobs.to_dict())


def view(val_trades, **kw):
    return build_view(report(val_trades, **kw))


def alternating(n: int, mean: float = 0.0, spread: float = 0.01, **kw) -> list[TradeRecord]:
    return [tr(mean + (spread if i % 2 else -spread), t=2 * i, **kw) for i in range(n)]


# --- E1 ---------------------------------------------------------------------------------------------------


def test_e1_biased_q_is_corrected_with_the_right_sign():
    real = alternating(40)
    over = [tr(t.net_return, t=i * 2, q=t.net_return + 0.004) for i, t in enumerate(real)]
    under = [tr(t.net_return, t=i * 2, q=t.net_return - 0.004) for i, t in enumerate(real)]
    up, down = e1_q_bias(view(over), CFG), e1_q_bias(view(under), CFG)
    w = 40 / (40 + CFG.n0)
    # e = ½(mean(q − r) + median(q50 − r)) = 0.004, calibration agrees (coverage at q50 = 1 > 0.5) → a = 1
    assert up.value == pytest.approx(CFG.q_bias_rate * w * 0.004) and up.value > 0
    assert down.value == pytest.approx(-CFG.q_bias_rate * w * 0.004)
    assert e1_q_bias(view(real), CFG).value == pytest.approx(0.0)


def test_e1_step_is_limited_and_clamped():
    huge = [tr(t.net_return, t=i * 2, q=t.net_return + 1.0) for i, t in enumerate(alternating(40))]
    s = e1_q_bias(view(huge, knobs=Knobs(q_bias=0.045)), CFG)
    assert s.value == pytest.approx(CFG.q_bias_max) and s.clamped       # 0.045 + 0.01 → clamp 0.05
    s = e1_q_bias(view(huge), CFG)
    assert s.value == pytest.approx(CFG.q_bias_step)                     # one epoch moves at most 0.01


def test_e1_disagreeing_calibration_halves_the_step():
    # mean(q − r) > 0 because of one outlier, but realised returns sit ABOVE the predicted median mostly
    trades = [tr(0.002, t=2 * i, q=0.0) for i in range(39)] + [tr(-0.5, t=100, q=0.0)]
    s = e1_q_bias(view(trades), CFG)
    e = 0.5 * (np.mean([0.0 - t.net_return for t in trades]) + np.median([0.0 - t.net_return for t in trades]))
    assert e > 0 and s.inputs["coverage_gap_q50"] < 0
    assert s.value == pytest.approx(CFG.q_bias_rate * 40 / 60 * 0.5 * e)


# --- E2 ---------------------------------------------------------------------------------------------------


def _hist(epoch: int, sharpe: float, eps: float = 0.1) -> EvalReport:
    trades = [tr(0.01 + sharpe * 0.001 * (i % 3), t=2 * i) for i in range(30)]
    rep = report(trades, epoch=epoch, knobs=Knobs(epsilon=eps))
    rep.val.metrics["per_trade_sharpe"] = sharpe
    return rep


def test_e2_explores_more_with_too_few_trades_and_on_stagnation():
    few = e2_epsilon(view(alternating(5), knobs=Knobs(epsilon=0.1)), CFG)
    assert few.value == pytest.approx(0.15)
    # stagnation: the last `patience` = 2 epochs (epoch 2 and this one) do not beat epoch 0's 0.3
    hist = [_hist(0, 0.3), _hist(1, 0.2), _hist(2, 0.25)]
    cur = report(alternating(30), epoch=3, knobs=Knobs(epsilon=0.1), per_trade_sharpe=0.28)
    assert e2_epsilon(build_view(cur, hist), CFG).value == pytest.approx(0.125)
    # a new best: exploit more
    best = report(alternating(30), epoch=3, knobs=Knobs(epsilon=0.1), per_trade_sharpe=0.5)
    assert e2_epsilon(build_view(best, hist), CFG).value == pytest.approx(0.08)
    # the ceiling holds
    assert e2_epsilon(view(alternating(5), knobs=Knobs(epsilon=0.45)), CFG).value == pytest.approx(CFG.eps_max)


# --- E3 ---------------------------------------------------------------------------------------------------


def test_e3_longer_trades_give_a_higher_gamma():
    short = e3_gamma(view(alternating(30), knobs=Knobs(gamma=0.955), mean_bars_held=5.0), CFG)
    long = e3_gamma(view(alternating(30), knobs=Knobs(gamma=0.955), mean_bars_held=10.0), CFG)
    assert short.value == pytest.approx(1 - 1 / (5 * 5))                 # 0.96, within the step
    assert long.value == pytest.approx(0.965) and long.clamped           # raw 0.98, |Δγ| ≤ 0.01
    assert long.value > short.value
    very = e3_gamma(view(alternating(30), knobs=Knobs(gamma=0.99), mean_bars_held=1000.0), CFG)
    assert very.value == pytest.approx(CFG.gamma_max)                    # raw 0.9998 → clamp 0.995


# --- E4 ---------------------------------------------------------------------------------------------------


def test_e4_a_branch_with_more_errors_gets_a_larger_lr_scale():
    n = 40
    trades = [tr(0.01, t=2 * i, d_err=i % 5 == 0, x_err=i % 2 == 0) for i in range(n)]   # dir 20 %, exit 50 %
    s = e4_lr_scale(view(trades), CFG)
    rates = {"direction": 0.2, "size": 0.0, "exit": 0.5}
    mean, w = sum(rates.values()) / 3, n / (n + CFG.n0)
    expect = {b: 1 + w * ((rates[b] + CFG.lr_smooth) / (mean + CFG.lr_smooth) - 1) for b in BRANCHES}
    expect = {b: min(max(v, 1 / 1.5), 1.5) for b, v in expect.items()}   # the ×/÷1.5 step from 1.0
    assert s.value == pytest.approx(expect)
    assert s.value["exit"] > s.value["direction"] > s.value["size"]


# --- E5 ---------------------------------------------------------------------------------------------------


def test_e5_needs_twenty_trades_then_gates_uncertain_losers():
    few = alternating(10, std=0.5)
    assert e5_gate(view(few, knobs=Knobs(gate_threshold=0.3)), CFG).value == pytest.approx(0.3)
    calm = [tr(0.01, t=2 * i, std=0.01 + 0.001 * i) for i in range(30)]
    wild = [tr(-0.02, t=100 + 2 * i, std=1.0 + i) for i in range(10)]
    s = e5_gate(view(calm + wild), CFG)
    assert s.value is not None and 0.029 <= s.value < 1.0                # keeps ≥ 20 calm winners, drops wild
    assert s.inputs["n_kept"] >= CFG.gate_min_trades
    # from an existing gate the threshold moves at most ×1.5
    s2 = e5_gate(view(calm + wild, knobs=Knobs(gate_threshold=0.1)), CFG)
    assert s2.value == pytest.approx(max(s.inputs["target"], 0.1 / 1.5))
    # when gating would not help, no gate
    assert e5_gate(view([tr(0.01, t=2 * i, std=0.01 * i) for i in range(30)]), CFG).value is None


# --- E6 / E7 ----------------------------------------------------------------------------------------------


def test_e6_boosts_the_decision_bars_of_the_top_tenth_winners():
    ins = [tr(0.001 * (i + 1), t=10 * i, start=0, bars=3) for i in range(20)] + \
          [tr(-0.01, t=300 + 10 * i, start=0) for i in range(5)]
    s = e6_priority(view(alternating(30), insample=ins), CFG)
    best, second = ins[19], ins[18]                                      # ceil(0.1·20) = 2 winners
    expect = {b: 3.0 for b in range(best.decision_t, best.exit_t)}
    expect.update({b: 1 + 2 * 0.019 / 0.020 for b in range(second.decision_t, second.exit_t)})
    assert dict((b, m) for b, m in s.value) == pytest.approx(expect)
    assert all(1.0 < m <= CFG.boost_max for _, m in s.value)


def test_e7_labels_losers_with_their_hindsight_direction():
    ins = [tr(-0.02, t=0, start=0, direction_idx=2, hindsight_dir=0),
           tr(-0.001, t=10, start=0, direction_idx=2, hindsight_dir=1),
           tr(0.03, t=20, start=0, direction_idx=2)]
    s = e7_hindsight(view(alternating(30), insample=ins), CFG)
    assert s.value == [[0, 0], [10, 1]]                                  # worst loss first; the winner unlabelled


# --- E8 / E9 ----------------------------------------------------------------------------------------------


def test_e8_a_losing_regime_gets_a_higher_curriculum_weight():
    trades = ([tr(-0.01 + 0.002 * (i % 2), t=2 * i, regime=3) for i in range(20)]
              + [tr(0.01 + 0.002 * (i % 2), t=100 + 2 * i, regime=6) for i in range(20)])
    s = e8_regime_weights(view(trades), CFG)
    w = s.value
    assert w[3] > 1.0 > w[6]
    assert w[3] > w[0] and w[0] > w[6]                                   # untested regimes in between
    assert np.mean(w) == pytest.approx(1.0)
    assert all(1 / 1.5 - 1e-12 <= v <= 1.5 + 1e-12 for v in w)            # one epoch from all-ones


def test_e9_confidence_drops_in_a_losing_regime_and_is_shrunk_by_trade_count():
    many = [tr(-0.01 + 0.002 * (i % 2), t=i, regime=3) for i in range(40)] + \
           [tr(0.01 + 0.002 * (i % 2), t=60 + i, regime=6) for i in range(40)]
    few = many[:4] + many[40:]
    c_many = e9_regime_confidence(view(many), CFG)
    c_few = e9_regime_confidence(view(few), CFG)
    assert c_many.value[3] == pytest.approx(0.75)                        # raw ≈ 0.11, |Δ| ≤ 0.25 from 1
    assert c_many.value[6] == 1.0
    sigma = np.std([t.net_return for t in few])
    raw = 1 + CFG.conf_lambda * (-0.009 / sigma) * 4 / (4 + CFG.conf_n0)
    assert c_few.value[3] == pytest.approx(max(raw, 0.75)) and c_few.value[3] > c_many.value[3] - 1e-12
    two_steps = e9_regime_confidence(view(many, knobs=Knobs(regime_confidence=c_many.value)), CFG)
    assert two_steps.value[3] == pytest.approx(0.5)


# --- bounds, rollback, ablation ---------------------------------------------------------------------------


def test_no_signal_ever_jumps_past_its_bound():
    rng = np.random.default_rng(7)
    for trial in range(25):
        n = int(rng.integers(0, 60))
        trades = [tr(float(rng.normal(0, 0.05)), t=i, regime=int(rng.integers(0, 9)),
                     q=float(rng.normal(0, 1)), std=float(rng.exponential(1)), d_err=bool(rng.random() < 0.5),
                     s_err=bool(rng.random() < 0.3), x_err=bool(rng.random() < 0.3), bars=int(rng.integers(1, 50)))
                  for i in range(n)]
        raw_w = rng.uniform(0.3, 3.0, N_REGIMES)
        prev = Knobs(epsilon=float(rng.uniform(0.01, 0.5)), gamma=float(rng.uniform(0.9, 0.995)),
                     q_bias=float(rng.uniform(-0.05, 0.05)),
                     lr_scale={b: float(rng.uniform(0.25, 4)) for b in BRANCHES},
                     gate_threshold=float(rng.exponential(1)) if rng.random() < 0.5 else math.inf,
                     regime_weights=list(np.clip(raw_w / raw_w.mean(), 0.25, 4)),
                     regime_confidence=list(rng.uniform(0, 1, N_REGIMES)))
        k = compute_bundle(report(trades, knobs=prev, mean_bars_held=float(rng.uniform(0.5, 300))),
                           config=CFG, now="t").to_knobs()
        eps = 1e-12
        assert 0.01 - eps <= k.epsilon <= 0.5 + eps
        assert prev.epsilon / 1.5 - eps <= k.epsilon <= prev.epsilon * 1.5 + eps
        assert 0.9 - eps <= k.gamma <= 0.995 + eps and abs(k.gamma - prev.gamma) <= 0.01 + eps
        assert abs(k.q_bias) <= 0.05 + eps and abs(k.q_bias - prev.q_bias) <= 0.01 + eps
        for b in BRANCHES:
            assert 0.25 - eps <= k.lr_scale[b] <= 4 + eps
            assert prev.lr_scale[b] / 1.5 - eps <= k.lr_scale[b] <= prev.lr_scale[b] * 1.5 + eps
        if math.isfinite(prev.gate_threshold) and math.isfinite(k.gate_threshold):
            assert prev.gate_threshold / 1.5 - eps <= k.gate_threshold <= prev.gate_threshold * 1.5 + eps
        pm = np.mean(prev.regime_weights)
        for new, old in zip(k.regime_weights, prev.regime_weights):
            assert 0.25 - eps <= new <= 4 + eps and (old / pm) / 1.5 - eps <= new <= (old / pm) * 1.5 + eps
        assert np.mean(k.regime_weights) == pytest.approx(1.0, abs=1e-6)
        for new, old in zip(k.regime_confidence, prev.regime_confidence):
            assert 0 <= new <= 1 and abs(new - old) <= 0.25 + eps


def test_rollback_steps_halfway_back_to_the_best_epoch():
    good = Knobs(epsilon=0.1, gamma=0.95, q_bias=0.0)
    bad = Knobs(epsilon=0.3, gamma=0.96, q_bias=0.01)
    h0 = _hist(0, 0.10, eps=0.2)
    h1 = report(alternating(30), epoch=1, knobs=good, per_trade_sharpe=0.40)
    cur = report(alternating(30), epoch=2, knobs=bad, per_trade_sharpe=0.05)
    b = compute_bundle(cur, [h0, h1], CFG, now="t")
    assert b.rollback and b.rollback_to_epoch == 1 and "rollback" in b.reason
    k = b.to_knobs()
    assert k.epsilon == pytest.approx(0.2) and k.gamma == pytest.approx(0.955) and k.q_bias == pytest.approx(0.005)
    assert all("rollback" in b.signals[i].reason for i in ("E1", "E2", "E3", "E4", "E5", "E8", "E9"))
    # a small dip is not a rollback
    ok = report(alternating(30), epoch=2, knobs=bad, per_trade_sharpe=0.36)
    assert not compute_bundle(ok, [h0, h1], CFG, now="t").rollback


def test_feedback_off_gives_the_fixed_schedule():
    cur = report(alternating(30), epoch=4)
    b = compute_bundle(cur, [], {"enabled": False}, now="t")
    assert not b.enabled and b.reason == "feedback disabled (ablation)" and b.for_epoch == 5
    assert b.to_knobs() == Knobs.fixed_schedule(5)
    assert all(s.reason == "feedback disabled (ablation)" for s in b.signals.values())


def test_bundle_is_json_and_converts_to_knobs():
    ins = [tr(0.01 * (i % 3 - 1) + 0.001, t=5 * i, start=0, hindsight_dir=0 if i % 3 == 0 else None)
           for i in range(30)]
    cur = report(alternating(30), epoch=1, insample=ins)
    b = compute_bundle(cur, [], CFG, now="t")
    text = b.model_dump_json()
    assert "NaN" not in text and "Infinity" not in text
    back = FeedbackBundle.model_validate_json(text)
    assert back.to_knobs() == b.to_knobs()
    assert sorted(b.signals) == [f"E{i}" for i in range(1, 10)]
    assert all(s.reason and s.provenance for i, s in b.signals.items())
    assert b.signals["E6"].provenance[0].split == "insample"
    assert all(p.split in ("val", "history") for i in ("E1", "E2", "E3", "E4", "E5", "E8", "E9")
               for p in b.signals[i].provenance)
