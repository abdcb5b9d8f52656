"""E1–E9 on crafted reports: each signal moves the right way, by the documented formula, never past its bounds;
rollback; feedback off."""
from __future__ import annotations

import math

import numpy as np
import pytest

from services.evaluator import autopsy as ap
from services.feedback.guard import build_view
from services.feedback.signals import (KNOB_OF, FeedbackConfig, beyond_noise, compute_bundle, e1_q_bias, e2_epsilon,
                                       e3_gamma, e4_lr_scale, e5_gate, e6_priority, e7_hindsight, e8_regime_weights,
                                       e9_regime_confidence)
from shared.knobs import BRANCHES, N_REGIMES, FixedSchedule, Knobs
from shared.report import OFF_NAMES, EvalReport, FeedbackBundle, SplitDefinition, SplitReport, TradeRecord

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
           insample: list[TradeRecord] | None = None, split: SplitDefinition = SPLIT, sha: str = "",
           **metrics) -> EvalReport:
    ins = None if insample is None else split_report("insample", insample, (0, 600))
    val = split_report("val", val_trades, split.val, **metrics).model_copy(update={"window_hash": split.val_hash})
    return EvalReport(run_id="run", epoch=epoch, split=split, n_trials=epoch + 1, val=val, insample=ins,
                      knobs=None if knobs is None else knobs.to_dict(), checkpoint_sha256=sha)


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
    # mean(q − r) > 0 because of a quarter of losers, but realised returns sit ABOVE the predicted median mostly
    trades = [tr(0.002, t=i, bars=1, q=0.0) for i in range(120)] + [tr(-0.05, t=120 + i, bars=1, q=0.0)
                                                                    for i in range(40)]
    s = e1_q_bias(view(trades), CFG)
    err = np.array([0.0 - t.net_return for t in trades])
    e = 0.5 * (err.mean() + np.median(err))
    assert e > 0 and s.inputs["coverage_gap_q50"] < 0
    e_sig = e - CFG.evidence_z * err.std(ddof=1) / math.sqrt(len(err))   # the part beyond 2·SE, > 0 here
    assert e_sig > 0
    assert s.value == pytest.approx(CFG.q_bias_rate * 160 / 180 * 0.5 * e_sig)


def test_e1_a_bias_within_its_noise_moves_nothing():
    # one outlier makes mean(q − r) > 0, but within 2 standard errors of the Q error over 40 trades
    trades = [tr(0.002, t=2 * i, q=0.0) for i in range(39)] + [tr(-0.5, t=100, q=0.0)]
    s = e1_q_bias(view(trades, knobs=Knobs(q_bias=0.003)), CFG)
    assert s.inputs["bias"] > 0 and s.inputs["bias_beyond_noise"] == 0.0
    assert s.value == pytest.approx(0.003) and "q_bias kept" in s.reason


def test_beyond_noise_is_a_soft_threshold():
    assert beyond_noise(0.5, 0.1, 2.0) == pytest.approx(0.3)
    assert beyond_noise(-0.5, 0.1, 2.0) == pytest.approx(-0.3)
    assert beyond_noise(0.15, 0.1, 2.0) == 0.0
    assert beyond_noise(3.0, math.inf, 2.0) == 0.0


# --- E2 ---------------------------------------------------------------------------------------------------

S = CFG.schedule.epsilon                                                 # the fixed schedule's ε of an epoch
# a validation window of 1 176 bars (the full config's synthetic split)
LONG = SplitDefinition(n_bars=3000, train=(0, 1500), val=(1520, 2696), test=(2716, 3000), embargo=20,
                       train_hash="T" * 64, val_hash="W" * 64, test_hash="X" * 64)


def sharpe_trades(n: int, sharpe: float, *, bars: int = 2, start: int = 620) -> list[TradeRecord]:
    """n (even) trades whose per-trade Sharpe is exactly `sharpe`: 0.01·(sharpe ± a), a = sqrt((n − 1)/n)."""
    a = math.sqrt((n - 1) / n) if n else 0.0
    return [tr(0.01 * (sharpe + (a if i % 2 else -a)), t=bars * i, bars=bars, start=start) for i in range(n)]


def at(epoch: int, sharpe: float, n: int = 30, eps: float | None = None, **kw) -> EvalReport:
    """Epoch `epoch`'s report: n validation trades of per-trade Sharpe `sharpe`, trained under ε = eps (default:
    the schedule's) and the other knobs of `kw`."""
    knobs = Knobs(epsilon=S(epoch) if eps is None else eps, **kw)
    return report(sharpe_trades(n, sharpe), epoch=epoch, knobs=knobs, sha=f"{epoch:064d}")


def test_sharpe_trades_have_the_sharpe_asked_for():
    from shared.metrics import per_trade_sharpe
    assert per_trade_sharpe([t.net_return for t in sharpe_trades(30, 0.4)]) == pytest.approx(0.4)
    assert at(1, 0.4).val.metrics["per_trade_sharpe"] == pytest.approx(0.4)


def test_e2_follows_the_schedule_without_evidence():
    s = e2_epsilon(build_view(at(3, 0.2)), CFG)
    assert s.value == pytest.approx(S(4)) and s.inputs["factor"] == 1.0 and not s.clamped
    # a run that stood at twice the schedule keeps that multiplier
    assert e2_epsilon(build_view(at(3, 0.2, eps=2 * S(3))), CFG).value == pytest.approx(2 * S(4))
    # and a change within the noise is no evidence: 0.3 → 0.4 on 30 trades each (SE of the difference ≈ 0.26)
    s = e2_epsilon(build_view(at(2, 0.4), [at(1, 0.3)]), CFG)
    assert not s.inputs["new_best"] and s.value == pytest.approx(S(3))


def test_e2_exploits_more_on_a_new_best_beyond_noise():
    from shared.metrics import sharpe_se
    hist, cur = at(1, 0.3), at(2, 1.0)
    se = math.hypot(*(sharpe_se(r.val.trades.net_return) for r in (hist, cur)))
    assert 0.7 > CFG.noise_z * se                                        # the gain exceeds its noise
    s = e2_epsilon(build_view(cur, [hist]), CFG)
    assert s.inputs["new_best"] and s.value == pytest.approx(S(3) / CFG.eps_improve)
    # the same gain on 4 trades a side is within the noise
    few = e2_epsilon(build_view(at(2, 1.0, n=4), [at(1, 0.3, n=4)]), CFG)
    assert not few.inputs["new_best"]


def test_e2_too_few_trades_is_relative_to_the_window_and_the_holding_time():
    def e2(n: int, bars: int, **kw):
        trades = sharpe_trades(n, 0.2, bars=bars, start=1520) if n else []
        rep = report(trades, epoch=1, knobs=Knobs(epsilon=S(1)), split=LONG, mean_bars_held=float(bars), **kw)
        return e2_epsilon(build_view(rep), CFG)
    # 10 trades held 100 bars fill most of a 1 176-bar window: need = min(20, ¼·1176/100) = 2.94 — not too few
    busy = e2(10, 100)
    assert busy.inputs["min_trades_for_window"] == pytest.approx(0.25 * 1176 / 100)
    assert busy.value == pytest.approx(S(2))
    # 2 such trades are; so are 12 trades of 2 bars (need = min(20, 147) = 20); and no trade at all
    for n, bars in ((2, 100), (12, 2), (0, 2)):
        assert e2(n, bars).value == pytest.approx(S(2) * CFG.eps_step), (n, bars)


def test_e2_never_raises_epsilon_while_validation_improves():
    # too few trades, but better than the last epoch: ε is not raised
    cur = report(sharpe_trades(2, 0.5), epoch=3, knobs=Knobs(epsilon=S(3)))
    s = e2_epsilon(build_view(cur, [at(1, 0.1), at(2, -0.2)]), CFG)
    assert s.inputs["improving"] and s.value <= S(3)
    # a rising schedule would raise it: capped at the epoch's ε while validation improves
    rising = FeedbackConfig(schedule={"eps_start": 0.05, "eps_end": 0.3})
    s = e2_epsilon(build_view(at(2, 0.5, eps=0.1), [at(1, 0.4, eps=0.1)]), rising)
    assert s.value == pytest.approx(0.1) and "not raised" in s.reason
    # a rollback to an epoch of higher ε while validation improves on the last epoch: ε stays
    b = compute_bundle(at(3, 0.0, n=60, eps=0.1), [at(1, 1.5, n=60), at(2, -0.5, n=60, eps=0.1)], CFG, now="t")
    assert b.rollback and b.rollback_to_epoch == 1 and S(4) > 0.1
    assert b.knobs["epsilon"] == pytest.approx(0.1)
    # property: over random histories, whenever this epoch beats the last one ε does not rise — rollback included
    rng = np.random.default_rng(3)
    for _ in range(40):
        e = int(rng.integers(2, 7))
        hist = [at(k, float(rng.normal(0.3, 0.5)), n=int(rng.choice([4, 30, 80])),
                   eps=float(rng.uniform(0.02, 0.5))) for k in range(1, e)]
        cur = at(e, float(rng.normal(0.3, 0.5)), n=int(rng.choice([4, 30, 80])), eps=float(rng.uniform(0.02, 0.5)))
        b = compute_bundle(cur, hist, CFG, now="t")
        if cur.val.metrics["per_trade_sharpe"] > hist[-1].val.metrics["per_trade_sharpe"]:
            assert b.knobs["epsilon"] <= cur.knobs["epsilon"] + 1e-15


def test_e2_explores_more_below_the_best_beyond_noise_for_patience_epochs():
    n = 60                                                               # SE of a difference ≈ 0.19
    s = e2_epsilon(build_view(at(3, 0.1, n=n), [at(1, 1.0, n=n), at(2, 0.2, n=n)]), CFG)
    assert s.inputs["stagnant"] and s.value == pytest.approx(S(4) * CFG.eps_stagnation)
    # within the noise of the best: not stagnant, ε follows the schedule
    s = e2_epsilon(build_view(at(3, 0.2, n=n), [at(1, 0.3, n=n), at(2, 0.25, n=n)]), CFG)
    assert not s.inputs["stagnant"] and s.value == pytest.approx(S(4))
    # one epoch below is not `patience` = 2 epochs
    s = e2_epsilon(build_view(at(2, 0.1, n=n), [at(1, 1.0, n=n)]), CFG)
    assert not s.inputs["stagnant"]


def test_e2_step_limit_and_bounds():
    # a factor past eps_step is cut to it (the multiplier moves at most ×/÷1.5 a epoch)
    big = FeedbackConfig(eps_improve=3.0)
    s = e2_epsilon(build_view(at(2, 1.0), [at(1, 0.3)]), big)
    assert s.value == pytest.approx(S(3) / 1.5) and s.clamped
    # the ceiling and the floor hold
    assert e2_epsilon(build_view(at(1, 0.0, n=0, eps=0.45)), CFG).value == pytest.approx(CFG.eps_max)
    low = e2_epsilon(build_view(at(9, 1.0, eps=0.012), [at(8, 0.2, eps=0.012)]), CFG)
    assert low.value == pytest.approx(CFG.eps_min)                       # 0.012 / 1.25 → floor 0.01


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
    # each rate's excess over the mean counts beyond 2 binomial standard errors (p at the pair's mean)
    se = {b: math.sqrt(max((p := (rates[b] + mean) / 2) * (1 - p), 1 / n) / n) for b in BRANCHES}
    eff = {b: mean + math.copysign(max(0.0, abs(rates[b] - mean) - 2 * se[b]), rates[b] - mean) for b in BRANCHES}
    assert eff["direction"] == mean and eff["exit"] > mean > eff["size"]  # 0.2 vs 0.233: within the noise
    expect = {b: 1 + w * ((eff[b] + CFG.lr_smooth) / (mean + CFG.lr_smooth) - 1) for b in BRANCHES}
    expect = {b: min(max(v, 1 / 1.5), 1.5) for b, v in expect.items()}   # the ×/÷1.5 step from 1.0
    assert s.value == pytest.approx(expect)
    assert s.value["exit"] > s.value["direction"] > s.value["size"]
    # the same rates over 8 trades are noise: every scale goes back toward 1
    few = e4_lr_scale(view(trades[:8], knobs=Knobs(lr_scale={"direction": 1.2, "size": 0.9, "exit": 1.0})), CFG)
    assert few.value == pytest.approx({b: 1.0 for b in BRANCHES})


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
    z = min(0.0, -0.009 / sigma + CFG.evidence_z / math.sqrt(4))        # the part beyond 2 SE of a 4-trade mean
    assert z < 0
    raw = 1 + CFG.conf_lambda * z * 4 / (4 + CFG.conf_n0)
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
        r = S(2) / S(1)                                                  # the schedule's own step, epoch 1 → 2
        assert min(prev.epsilon * r / 1.5, 0.5) - eps <= k.epsilon <= max(prev.epsilon * r * 1.5, 0.01) + eps
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


def test_rollback_only_beyond_the_noise_of_the_drop():
    # a drop of 0.2 from the best is noise on 30 trades a side (2·SE ≈ 0.53) …
    assert not compute_bundle(at(2, 0.4), [at(1, 0.6)], CFG, now="t").rollback
    # … a drop of 0.9 is not …
    b = compute_bundle(at(2, -0.3), [at(1, 0.6)], CFG, now="t")
    assert b.rollback and b.rollback_to_epoch == 1 and b.reason.startswith("rollback")
    # … and on 80 trades a side (2·SE ≈ 0.32) a drop of 0.4 is not noise either
    assert compute_bundle(at(2, 0.2, n=80), [at(1, 0.6, n=80)], CFG, now="t").rollback
    assert not compute_bundle(at(2, 0.2, n=30), [at(1, 0.6, n=30)], CFG, now="t").rollback
    # no history, or "rollback" switched off: no rollback
    assert not compute_bundle(at(1, -5.0), [], CFG, now="t").rollback
    off = compute_bundle(at(2, -0.3), [at(1, 0.6)], {"off": ("rollback",)}, now="t")
    assert not off.rollback and off.best_epoch is None                   # nothing to keep for a rollback
    pop = compute_bundle(at(2, -0.3), [at(1, 0.6)], {"off": ("rollback",), "population": True}, now="t")
    assert not pop.rollback and pop.best_epoch == 1                      # kept for the population's peers
    # the best epoch so far, this one included (ties: the earliest)
    assert compute_bundle(at(3, 0.9), [at(1, 0.6), at(2, 0.6)], CFG, now="t").best_epoch == 3
    assert compute_bundle(at(3, 0.6), [at(1, 0.6), at(2, 0.6)], CFG, now="t").best_epoch == 1


def test_the_rollback_and_the_kept_epoch_pass_over_an_epoch_selection_would_not_pick():
    """The best epoch a rollback restores, and the one the trainer keeps, is chosen by the run's selection rule
    (`shared.metrics.select_best`): an epoch of few validation trades does not count while another has enough,
    whatever its Sharpe. With no earlier epoch of enough trades there is no rollback; the trainer keeps the best of
    all."""
    from shared.metrics import MIN_SELECTION_TRADES

    few, many = MIN_SELECTION_TRADES - 3, 60
    hist = [at(1, 0.9, n=few), at(2, 0.5, n=many)]
    z0 = {"rollback_z": 0.0}
    b = compute_bundle(at(3, 0.3, n=many), hist, z0, now="t")
    assert b.rollback and b.rollback_to_epoch == 2 and b.best_epoch == 2
    assert compute_bundle(at(3, 0.6, n=many), hist, z0, now="t").best_epoch == 3      # a new best with enough trades
    only_few = [at(1, 0.9, n=few), at(2, 0.5, n=few)]
    b = compute_bundle(at(3, 0.3, n=few), only_few, z0, now="t")
    assert not b.rollback and b.best_epoch == 1


def test_rollback_restores_the_best_epochs_knobs_and_names_its_checkpoint():
    good = dict(eps=0.2, gamma=0.95, q_bias=0.01, lr_scale={"direction": 2.0, "size": 0.5, "exit": 1.0},
                gate_threshold=0.3, regime_weights=[2.0] + [0.875] * 8, regime_confidence=[0.5] + [1.0] * 8)
    bad = dict(eps=0.45, gamma=0.99, q_bias=-0.02, gate_threshold=math.inf)
    ins = [tr(0.01 * (i % 3 - 1) + 0.001, t=5 * i, start=0, hindsight_dir=0 if i % 3 == 0 else None)
           for i in range(30)]
    cur = at(3, -0.4, **bad).model_copy(update={"insample": split_report("insample", ins, (0, 600))})
    b = compute_bundle(cur, [at(1, 0.1), at(2, 0.8, **good)], CFG, now="t")
    assert b.rollback and b.rollback_to_epoch == 2 and b.rollback_checkpoint_sha256 == f"{2:064d}"
    assert b.best_epoch == 2                                             # the epoch whose files the trainer keeps
    k, g = b.to_knobs(), at(2, 0.8, **good).trained_knobs()
    assert (k.gamma, k.q_bias, k.lr_scale, k.gate_threshold, k.regime_weights, k.regime_confidence) == \
           (g.gamma, g.q_bias, g.lr_scale, g.gate_threshold, g.regime_weights, g.regime_confidence)
    assert k.epsilon == pytest.approx(S(4) * 0.2 / S(2))                 # epoch 2's multiplier of the schedule
    for i in ("E1", "E2", "E3", "E4", "E5", "E8", "E9"):
        assert b.signals[i].reason.startswith("rollback") and b.signals[i].inputs["rollback_to_epoch"] == 2
    # the sample labels of the checkpoint that fell below the best are not trained on
    usual = compute_bundle(cur, [], CFG, now="t").signals
    assert usual["E6"].value != [] and usual["E7"].value != []
    for i in ("E6", "E7"):
        assert b.signals[i].value == [] and b.signals[i].reason.startswith("rollback")
        assert b.signals[i].inputs["signal_labels"] == len(usual[i].value)
    assert b.to_knobs().priority_boost == [] and b.to_knobs().hindsight == []


def test_a_rollback_decays_every_learning_rate_and_the_decay_carries_on():
    """With `rollback_lr_factor` f, a rollback multiplies the reported epoch's `lr_decay` by f (not the restored
    epoch's: each retry from the best epoch takes smaller steps than the last), an epoch without one carries it,
    the default f = 1 never decays, and feedback off leaves the schedule's 1."""
    cfg = {"rollback_lr_factor": 0.5}
    first = compute_bundle(at(2, -0.3), [at(1, 0.6)], cfg, now="t")
    assert first.rollback and first.to_knobs().lr_decay == 0.5 and "learning rates × 0.5" in first.reason
    again = compute_bundle(at(3, -0.3, lr_decay=0.5), [at(1, 0.6), at(2, -0.3, lr_decay=1.0)], cfg, now="t")
    assert again.rollback_to_epoch == 1 and again.to_knobs().lr_decay == 0.25
    carried = compute_bundle(at(4, 0.9, lr_decay=0.25), [at(1, 0.6)], cfg, now="t")
    assert not carried.rollback and carried.to_knobs().lr_decay == 0.25
    assert compute_bundle(at(2, -0.3), [at(1, 0.6)], {}, now="t").to_knobs().lr_decay == 1.0
    assert compute_bundle(at(2, -0.3, lr_decay=0.5), [at(1, 0.6)], {"enabled": False, "rollback_lr_factor": 0.5},
                          now="t").to_knobs().lr_decay == 1.0
    for bad in (0.0, 1.5, -0.5):
        with pytest.raises(ValueError, match="rollback_lr_factor must be in"):
            FeedbackConfig(rollback_lr_factor=bad)
    with pytest.raises(ValueError, match="lr_decay must be in"):
        Knobs(lr_decay=0.0).validate()


def test_the_schedules_lr_decay_is_the_same_with_feedback_on_off_and_after_a_rollback():
    """The fixed schedule's `lr_epoch_factor` f: the bundle after epoch e sets `lr_decay` f^e, as
    `FixedSchedule.knobs(e + 1)` does, whether feedback is off, on with every act off, or on with a signal acting;
    a rollback's factor multiplies on top of it."""
    sched = FixedSchedule(lr_epoch_factor=0.5)
    want = sched.knobs(3).lr_decay
    assert want == 0.25 and sched.knobs(1).lr_decay == 1.0
    cur, hist = at(2, 0.6, lr_decay=0.5), [at(1, 0.6)]
    for cfg in ({"enabled": False}, {"off": list(OFF_NAMES)}, {}):
        b = compute_bundle(cur, hist, {"schedule": sched, **cfg}, now="t")
        assert b.to_knobs().lr_decay == want, cfg
    rb = compute_bundle(at(2, -0.3, lr_decay=0.5), hist, {"schedule": sched, "off": ["E7"],
                                                           "rollback_lr_factor": 0.5}, now="t")
    assert rb.rollback and rb.to_knobs().lr_decay == 0.125


def test_the_plateau_decays_the_learning_rates_after_an_epoch_without_a_new_best_beyond_noise():
    """`plateau_lr_factor` f: after an epoch whose validation did not beat the best earlier epoch's by more than
    noise_z standard errors of the difference, every learning rate × f (carried on, times the schedule's factor);
    a new best beyond noise, the first epoch, f = 1 (the default) and feedback off leave the decay as it was."""
    cfg = {"off": list(OFF_NAMES), "plateau_lr_factor": 0.5}
    flat = compute_bundle(at(3, 0.6, lr_decay=0.5), [at(1, 0.6), at(2, 0.5)], cfg, now="t")
    assert flat.to_knobs().lr_decay == 0.25 and "no new best beyond noise: learning rates × 0.5" in flat.reason
    # above the best, but within the noise of 30 trades a side (SE of the difference ≈ 0.27): still a plateau
    assert compute_bundle(at(3, 0.7, lr_decay=0.5), [at(1, 0.6)], cfg, now="t").to_knobs().lr_decay == 0.25
    better = compute_bundle(at(3, 1.5, lr_decay=0.5), [at(1, 0.6), at(2, 0.5)], cfg, now="t")
    assert better.to_knobs().lr_decay == 0.5 and "plateau" not in better.reason.lower() \
        and "no new best" not in better.reason
    assert compute_bundle(at(1, 0.6), [], cfg, now="t").to_knobs().lr_decay == 1.0          # nothing to beat yet
    assert compute_bundle(at(3, 0.6), [at(1, 0.6)], {"off": list(OFF_NAMES)}, now="t").to_knobs().lr_decay == 1.0
    assert compute_bundle(at(3, 0.6, lr_decay=0.5), [at(1, 0.6)], {**cfg, "enabled": False},
                          now="t").to_knobs().lr_decay == 1.0                              # the schedule's: none
    with_schedule = compute_bundle(at(3, 0.6, lr_decay=0.5), [at(1, 0.6)],
                                   {**cfg, "schedule": {"lr_epoch_factor": 0.8}}, now="t")
    assert with_schedule.to_knobs().lr_decay == pytest.approx(0.5 * 0.8 * 0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="plateau_lr_factor must be in"):
            FeedbackConfig(plateau_lr_factor=bad)


def test_a_rollback_names_the_share_of_the_current_weights_it_keeps():
    """`rollback_keep` reaches the bundle of a rollback (and its reason), never a bundle without one; the default
    keeps nothing (the best epoch's weights exactly); a share outside [0, 1) is refused."""
    b = compute_bundle(at(2, -0.3), [at(1, 0.6)], {"rollback_keep": 0.5}, now="t")
    assert b.rollback and b.rollback_keep == 0.5 and "weights 0.5·current + 0.5·epoch 1's" in b.reason
    assert compute_bundle(at(2, -0.3), [at(1, 0.6)], {}, now="t").rollback_keep == 0.0
    assert compute_bundle(at(2, 0.7), [at(1, 0.6)], {"rollback_keep": 0.5}, now="t").rollback_keep == 0.0
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="rollback_keep must be in"):
            FeedbackConfig(rollback_keep=bad)


def test_a_rollback_asks_for_a_fresh_learner_when_configured():
    """`rollback_restart` reaches the bundle of a rollback and its reason (the knobs still the best epoch's), never a
    bundle without one; off by default; only true or false."""
    b = compute_bundle(at(2, -0.3), [at(1, 0.6)], {"rollback_restart": True, "rollback_keep": 0.5}, now="t")
    restored = compute_bundle(at(2, -0.3), [at(1, 0.6)], {}, now="t")
    assert b.rollback and b.rollback_restart and b.rollback_to_epoch == 1
    assert "restarts a fresh learner under epoch 1's knobs" in b.reason and "current" not in b.reason
    assert b.knobs == restored.knobs and not restored.rollback_restart
    assert not compute_bundle(at(2, 0.7), [at(1, 0.6)], {"rollback_restart": True}, now="t").rollback_restart
    with pytest.raises(ValueError, match="rollback_restart must be true or false"):
        FeedbackConfig(rollback_restart=1)


def test_switched_off_signals_keep_the_fixed_schedule():
    prev = Knobs(epsilon=0.4, gamma=0.95, q_bias=0.02, regime_confidence=[0.5] * 9)
    trades = [tr(-0.01 + 0.002 * (i % 2), t=2 * i, regime=3, q=0.01) for i in range(40)]
    cur = report(trades, epoch=3, knobs=prev, mean_bars_held=20.0)
    on = compute_bundle(cur, [], CFG, now="t")
    b = compute_bundle(cur, [], {"off": "E2, e3,E9"}, now="t")
    fixed = Knobs.fixed_schedule(4)
    assert b.off == ["E2", "E3", "E9"] and "switched off: E2, E3, E9" in b.reason
    k = b.to_knobs()
    assert (k.epsilon, k.gamma, k.regime_confidence) == (fixed.epsilon, fixed.gamma, fixed.regime_confidence)
    assert (on.knobs["epsilon"], on.knobs["gamma"]) != (k.epsilon, k.gamma)        # on, they do move
    for i in ("E2", "E3", "E9"):
        assert b.signals[i].reason.startswith("switched off") and b.signals[i].previous == cur.knobs[KNOB_OF[i]]
    for i in ("E1", "E4", "E5", "E6", "E7", "E8"):                       # the others are untouched
        assert b.signals[i] == on.signals[i]
    # a switched-off signal stays at the schedule through a rollback; the others roll back
    rb = compute_bundle(at(2, -0.3, eps=0.45, q_bias=0.03), [at(1, 0.6, q_bias=0.01)], {"off": ("E2",)}, now="t")
    assert rb.rollback and rb.knobs["epsilon"] == pytest.approx(S(3)) and rb.knobs["q_bias"] == 0.01
    with pytest.raises(ValueError, match=r"off names \['E10'\]"):
        FeedbackConfig(off=("E2", "E10"))


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


# --- evidence: an input within the noise of the trades behind it moves nothing ---------------------------


def test_e3_keeps_gamma_below_min_trades():
    s = e3_gamma(view(alternating(CFG.min_trades - 2), knobs=Knobs(gamma=0.97), mean_bars_held=100.0), CFG)
    assert s.value == 0.97 and "γ kept" in s.reason
    assert e3_gamma(view(alternating(CFG.min_trades), knobs=Knobs(gamma=0.97), mean_bars_held=100.0), CFG).value > 0.97


def test_e5_a_gate_whose_gain_is_within_noise_is_not_set():
    calm = [tr(0.01 + 0.01 * (i % 2), t=2 * i, std=0.01 + 0.001 * i) for i in range(30)]
    wild = [tr(-0.002, t=100 + 2 * i, std=1.0 + i) for i in range(10)]    # removing them gains 0.02 ≪ 2·σ·√10
    s = e5_gate(view(calm + wild), CFG)
    assert s.value is None and "within" in s.reason
    assert s.inputs["kept_sum_return"] > s.inputs["ungated_sum_return"]    # the curve's argmax is a gate


def test_e8_e9_a_regime_within_noise_moves_nothing():
    # regime 3's mean −0.001 over 20 trades of std ≈ 0.01: z ≈ −0.1 against 2 SE = 0.45
    trades = ([tr(-0.001 + (0.01 if i % 2 else -0.01), t=2 * i, regime=3) for i in range(20)]
              + [tr(0.001 + (0.01 if i % 2 else -0.01), t=100 + 2 * i, regime=6) for i in range(20)])
    assert e8_regime_weights(view(trades), CFG).value == pytest.approx([1.0] * N_REGIMES)
    assert e9_regime_confidence(view(trades), CFG).value == [1.0] * N_REGIMES
    back = e9_regime_confidence(view(trades, knobs=Knobs(regime_confidence=[0.5] + [1.0] * 8)), CFG)
    assert back.value[0] == pytest.approx(0.75)                             # re-opens by conf_step
