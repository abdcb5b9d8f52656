"""Feedback signals E1–E9: pure functions of (report, history of earlier reports, config) → next epoch's knobs.

Every signal reads a `FeedbackView` built by the leakage guard (services/feedback/guard.py) — validation
aggregates, in-sample trade samples of the training split, and the run's history; never the OOS backtest — and
returns a `shared.report.Signal`: its value, the previous value (the knobs the reported epoch trained under),
the inputs, the provenance and a one-line reason. Each signal is bounded twice: a clamp to its range and a
limit on how far it moves in one epoch. Formulas and bounds are in docs/feedback.md; in short, with
prev = the knob the reported epoch trained under, n = validation trade count, w(n) = n / (n + n0):

  E1 q_bias      ← prev + η·w(n)·a·½(bias + median_bias)          |Δ| ≤ 0.01, |q_bias| ≤ 0.05
  E2 epsilon     ← prev × {1.5 too few trades, 1.25 stagnation, 1/1.25 new best, 1 else}   [0.01, 0.5], ×/÷1.5
  E3 gamma       ← 1 − 1/(k·mean_bars_held)                         [0.9, 0.995], |Δ| ≤ 0.01
  E4 lr_scale[b] ← 1 + w(n)·((err_b + s)/(mean_err + s) − 1)        [0.25, 4], ×/÷1.5
  E5 gate        ← argmax_θ Σ kept returns s.t. n_kept ≥ 20         ×/÷1.5 once a gate exists; None = no gate
  E6 boosts      ← (bar, 1 + (B − 1)·r_i / r_max) over the in-sample top-10 % winners' decision bars   [1, B]
  E7 hindsight   ← (decision bar, hindsight-optimal direction) of losing in-sample trades
  E8 weights[k]  ← exp(−κ·z_k), z_k = (mean_k / σ)·w(n_k), normalised to mean 1   [0.25, 4], ×/÷1.5
  E9 conf[k]     ← clip(1 + λ·z_k, 0, 1)                            |Δ| ≤ 0.25

Rollback: when the validation per-trade Sharpe (un-annualized) fell more than max(drop, rel·|best|) below the
best earlier epoch's, the continuous knobs (E1–E5, E8, E9) move halfway back toward the knobs that best epoch
trained under (still within the per-epoch step limits), and the bundle says "rollback".

Feedback off (`config.enabled = False`): `Knobs.fixed_schedule(epoch + 1, ...)` with reason
"feedback disabled (ablation)".
"""
from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, fields
from typing import Any, Sequence

import numpy as np

from services.feedback.guard import FeedbackView, HistoryEntry, build_view, check_train_indices
from shared.knobs import BRANCHES, N_REGIMES, Knobs
from shared.report import EvalReport, FeedbackBundle, Provenance, Signal


@dataclass(frozen=True)
class FeedbackConfig:
    """Parameters of E1–E9 and of the rollback (defaults documented in docs/feedback.md)."""

    enabled: bool = True
    """False: fixed schedules (the ablation)."""
    # fixed schedule (feedback off)
    eps_start: float = 0.3
    eps_end: float = 0.02
    eps_decay_epochs: int = 8
    gamma_fixed: float = 0.99
    n0: float = 20.0
    """Shrinkage constant of w(n) = n / (n + n0) for E1, E4 (validation trade counts)."""
    # E1
    q_bias_rate: float = 0.5
    q_bias_max: float = 0.05
    q_bias_step: float = 0.01
    # E2
    eps_min: float = 0.01
    eps_max: float = 0.5
    eps_step: float = 1.5
    eps_stagnation: float = 1.25
    eps_improve: float = 1.25
    min_trades: int = 20
    patience: int = 2
    min_improve: float = 0.01
    # E3
    gamma_k: float = 5.0
    gamma_min: float = 0.9
    gamma_max: float = 0.995
    gamma_step: float = 0.01
    # E4
    lr_min: float = 0.25
    lr_max: float = 4.0
    lr_step: float = 1.5
    lr_smooth: float = 0.05
    # E5
    gate_min_trades: int = 20
    gate_step: float = 1.5
    # E6 / E7
    boost_max: float = 3.0
    max_boost_entries: int = 4096
    max_hindsight: int = 1024
    # E8
    regime_kappa: float = 1.0
    regime_n0: float = 10.0
    regime_w_min: float = 0.25
    regime_w_max: float = 4.0
    regime_step: float = 1.5
    # E9
    conf_lambda: float = 2.0
    conf_n0: float = 20.0
    conf_step: float = 0.25
    # rollback
    rollback_drop: float = 0.05
    rollback_rel: float = 0.25

    @classmethod
    def coerce(cls, config: Any) -> "FeedbackConfig":
        """A FeedbackConfig from itself, a mapping, or any object with (some of) these attributes; None → defaults."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        names = {f.name for f in fields(cls)}
        if isinstance(config, dict):
            unknown = set(config) - names
            if unknown:
                raise ValueError(f"feedback config: unknown keys {sorted(unknown)}")
            return cls(**config)
        return cls(**{n: getattr(config, n) for n in names if hasattr(config, n)})


# --- helpers ----------------------------------------------------------------------------------------------


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _ratio_limit(x: float, prev: float, step: float) -> float:
    """x limited to [prev / step, prev · step] (prev > 0)."""
    return _clamp(x, prev / step, prev * step)


def _w(n: float, n0: float) -> float:
    """Shrinkage weight n / (n + n0)."""
    return n / (n + n0) if n + n0 > 0 else 0.0


def _val_prov(view: FeedbackView, *fields_: str) -> Provenance:
    return Provenance(run_id=view.run_id, epoch=view.epoch, split="val", window_hash=view.val.window_hash,
                      fields=list(fields_))


def _hist_prov(view: FeedbackView) -> Provenance:
    return Provenance(run_id=view.run_id, epoch=view.epoch, split="history",
                      fields=[f"epoch {h.epoch}: val.metrics.per_trade_sharpe" for h in view.history])


def _n_val(view: FeedbackView) -> int:
    return int(view.val.calibration.n_trades)


def project_weights(target: Sequence[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """clip(c·target, lo, hi) with the scale c > 0 chosen (bisection) so the mean is 1: a normalisation that
    never breaks a bound. Needs mean(lo) ≤ 1 ≤ mean(hi) to reach mean 1 exactly."""
    t, lo_, hi_ = (np.asarray(a, dtype=np.float64) for a in (target, lo, hi))
    f = lambda c: float(np.clip(c * t, lo_, hi_).mean())  # noqa: E731 — monotone non-decreasing in c
    a, b = 0.0, 1.0
    while f(b) < 1.0 and b < 1e12:
        b *= 2.0
    for _ in range(200):
        m = 0.5 * (a + b)
        a, b = (m, b) if f(m) < 1.0 else (a, m)
    return [float(v) for v in np.clip(b * t, lo_, hi_)]


# --- E1–E9 ------------------------------------------------------------------------------------------------


def e1_q_bias(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E1 — Q-bias from predicted Q at entry vs realised trade return (validation), and the median's coverage.

    e = ½(mean(q − r) + median(q50 − r)); the calibration at τ = 0.5, g = coverage_0.5 − 0.5 (> 0: realised
    returns fall below the predicted median too often, i.e. over-prediction), halves the step when it disagrees
    with e in sign: a = 1 if g·e ≥ 0 else ½. q_bias ← prev + η·w(n)·a·e, |Δ| ≤ q_bias_step, |q_bias| ≤ q_bias_max.
    Positive q_bias is subtracted from bootstrap targets: Q that over-predicts is pulled down.
    """
    prev, cal = view.knobs.q_bias, view.val.calibration
    n = cal.n_trades
    prov = [_val_prov(view, "val.calibration.bias", "val.calibration.median_bias", "val.calibration.coverage")]
    if n == 0:
        return Signal(id="E1", knob="q_bias", value=prev, previous=prev, inputs={"n_trades": 0}, provenance=prov,
                      reason="no validation trades: q_bias kept")
    e = 0.5 * (cal.bias + cal.median_bias)
    g = cal.coverage[cal.taus.index(0.5)] - 0.5 if 0.5 in cal.taus else 0.0
    a = 1.0 if g * e >= 0 else 0.5
    raw = prev + cfg.q_bias_rate * _w(n, cfg.n0) * a * e
    value = _clamp(_clamp(raw, prev - cfg.q_bias_step, prev + cfg.q_bias_step), -cfg.q_bias_max, cfg.q_bias_max)
    sense = "over" if e > 0 else "under"
    return Signal(id="E1", knob="q_bias", value=value, previous=prev, provenance=prov, clamped=value != raw,
                  inputs={"n_trades": n, "bias": cal.bias, "median_bias": cal.median_bias, "coverage_gap_q50": g,
                          "agreement": a, "raw": raw},
                  reason=f"Q {sense}-predicts realised validation trades by {e:+.5f} (coverage gap at q50 {g:+.2f})")


def e2_epsilon(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E2 — ε from validation performance against the run's history.

    Factor: ×1.5 with fewer than `min_trades` validation trades; ×1.25 on stagnation (none of the last `patience`
    epochs, this one included, beat the best before them by `min_improve`); ÷1.25 on a new best (or no history);
    ×1 otherwise. ε ← clamp(prev·factor, ε_min, ε_max), within ×/÷ eps_step of prev.
    """
    prev = view.knobs.epsilon
    s, n = view.val.metric("per_trade_sharpe"), _n_val(view)
    hist = [h.val_sharpe for h in view.history]
    series = [*hist, s]
    best_prev = max(hist) if hist else None
    stagnant = False
    if len(series) > cfg.patience:
        before, recent = series[:-cfg.patience], series[-cfg.patience:]
        stagnant = max(recent) <= max(before) + cfg.min_improve
    if n < cfg.min_trades:
        factor, why = cfg.eps_step, f"too few validation trades ({n} < {cfg.min_trades}): explore more"
    elif stagnant:
        factor, why = cfg.eps_stagnation, f"validation Sharpe stagnant over {cfg.patience} epochs: explore more"
    elif best_prev is None or s > best_prev + cfg.min_improve:
        factor, why = 1.0 / cfg.eps_improve, f"validation per-trade Sharpe {s:.3f} is a new best: exploit more"
    else:
        factor, why = 1.0, "validation Sharpe neither improving nor stagnant: ε kept"
    raw = prev * factor
    value = _clamp(_ratio_limit(raw, prev, cfg.eps_step), cfg.eps_min, cfg.eps_max)
    return Signal(id="E2", knob="epsilon", value=value, previous=prev, clamped=value != raw,
                  provenance=[_val_prov(view, "val.metrics.per_trade_sharpe", "val.metrics.n_trades"),
                              _hist_prov(view)],
                  inputs={"val_sharpe": s, "n_trades": n, "best_previous_sharpe": best_prev, "stagnant": stagnant,
                          "factor": factor},
                  reason=why)


def e3_gamma(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E3 — γ = 1 − 1/(k·d) from the mean validation trade duration d (bars); [γ_min, γ_max], |Δγ| ≤ step."""
    prev = view.knobs.gamma
    d, n = view.val.metric("mean_bars_held"), _n_val(view)
    prov = [_val_prov(view, "val.metrics.mean_bars_held")]
    if n == 0 or not d > 0:
        return Signal(id="E3", knob="gamma", value=prev, previous=prev, inputs={"n_trades": n}, provenance=prov,
                      reason="no validation trades: γ kept")
    raw = 1.0 - 1.0 / (cfg.gamma_k * d)
    value = _clamp(_clamp(raw, prev - cfg.gamma_step, prev + cfg.gamma_step), cfg.gamma_min, cfg.gamma_max)
    return Signal(id="E3", knob="gamma", value=value, previous=prev, provenance=prov, clamped=value != raw,
                  inputs={"mean_bars_held": d, "k": cfg.gamma_k, "raw": raw},
                  reason=f"mean trade lasts {d:.1f} bars: horizon k·d = {cfg.gamma_k * d:.0f} bars → γ {raw:.4f}")


def e4_lr_scale(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E4 — per-branch LR scale from the validation autopsy's error rates.

    target_b = 1 + w(n)·((err_b + s)/(mean_b' err_b' + s) − 1): a branch erring more than the others learns faster.
    lr_b ← clamp(target_b, lr_min, lr_max), within ×/÷ lr_step of prev.
    """
    prev = dict(view.knobs.lr_scale)
    br, n = view.val.branches, _n_val(view)
    prov = [_val_prov(view, *(f"val.branches.{b}.error_rate" for b in BRANCHES))]
    if n == 0:
        return Signal(id="E4", knob="lr_scale", value=prev, previous=prev, inputs={"n_trades": 0}, provenance=prov,
                      reason="no validation trades: LR scales kept")
    rates = {b: br[b].error_rate for b in BRANCHES}
    mean = sum(rates.values()) / len(rates)
    w = _w(n, cfg.n0)
    raw = {b: 1.0 + w * ((rates[b] + cfg.lr_smooth) / (mean + cfg.lr_smooth) - 1.0) for b in BRANCHES}
    value = {b: _clamp(_ratio_limit(raw[b], prev[b], cfg.lr_step), cfg.lr_min, cfg.lr_max) for b in BRANCHES}
    worst = max(BRANCHES, key=lambda b: rates[b])
    return Signal(id="E4", knob="lr_scale", value=value, previous=prev, provenance=prov,
                  clamped=any(value[b] != raw[b] for b in BRANCHES),
                  inputs={"n_trades": n, "error_rates": rates, "raw": raw},
                  reason=f"{worst} branch errs most ({rates[worst]:.0%} of {n} trades): its LR scale rises")


def e5_gate(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E5 — epistemic gate threshold tuned on validation trades (aggregated gate curve).

    θ* = argmax over the curve's points with n_kept ≥ gate_min_trades of the kept trades' summed net return
    (ties → the larger θ; None = no gate). With fewer than gate_min_trades validation trades: kept. A finite prev
    moves within ×/÷ gate_step; from a finite prev toward "no gate" it rises ×gate_step, becoming None once it
    exceeds every validation trade's ensemble std.
    """
    prev = view.knobs.gate_threshold
    prev_j = None if math.isinf(prev) else prev
    curve = view.val.gate_curve
    n = max((p.n_kept for p in curve), default=0)
    prov = [_val_prov(view, "val.gate_curve")]
    if n < cfg.gate_min_trades:
        return Signal(id="E5", knob="gate_threshold", value=prev_j, previous=prev_j, provenance=prov,
                      inputs={"n_trades": n, "min_trades": cfg.gate_min_trades},
                      reason=f"only {n} validation trades (< {cfg.gate_min_trades}): gate threshold kept")
    ok = [p for p in curve if p.n_kept >= cfg.gate_min_trades]
    key = lambda p: (round(p.sum_return, 12), math.inf if p.threshold is None else p.threshold)  # noqa: E731
    best = max(ok, key=key)
    target = best.threshold
    if prev_j is None:
        value = target
    elif target is None:
        up = prev_j * cfg.gate_step
        value = None if up >= view.val.max_ensemble_std else up
    else:
        value = _ratio_limit(target, prev_j, cfg.gate_step)
    return Signal(id="E5", knob="gate_threshold", value=value, previous=prev_j, provenance=prov,
                  clamped=value != target,
                  inputs={"n_trades": n, "target": target, "kept_sum_return": best.sum_return,
                          "n_kept": best.n_kept,
                          "ungated_sum_return": next(p.sum_return for p in curve if p.threshold is None)},
                  reason=("no gate: gating would not raise the validation trades' total return" if target is None else
                          f"gating entries with ensemble std > {target:.4g} keeps {best.n_kept} of {n} trades "
                          f"and the best total return {best.sum_return:+.4f}"))


def e6_priority(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E6 — replay-priority boost for the in-sample top-10 % winners: every decision bar of the trade's span
    [decision_t, exit_t) gets 1 + (B − 1)·r_i / r_max ∈ (1, B]; at most max_boost_entries bars, best trades first."""
    ins = view.insample
    if ins is None or not ins.top_winners:
        return Signal(id="E6", knob="priority_boost", value=[],
                      reason="no in-sample winners to boost" if ins is not None else "no in-sample backtest")
    r_max = ins.trades[ins.top_winners[0]].net_return
    boosts: dict[int, float] = {}
    for i in ins.top_winners:
        t = ins.trades[i]
        m = 1.0 + (cfg.boost_max - 1.0) * _clamp(t.net_return / r_max, 0.0, 1.0)
        for bar in range(t.decision_t, max(t.exit_t, t.decision_t + 1)):
            if len(boosts) >= cfg.max_boost_entries:
                break
            boosts[bar] = max(boosts.get(bar, 1.0), m)
    value = sorted([b, m] for b, m in boosts.items())
    check_train_indices([b for b, _ in value], ins.train, "E6 priority boost")
    return Signal(id="E6", knob="priority_boost", value=value, previous=None,
                  provenance=[Provenance(run_id=view.run_id, epoch=view.epoch, split="insample",
                                         window_hash=ins.window_hash, fields=["insample.top_winners",
                                                                              "insample.trades"])],
                  inputs={"n_trades": len(ins.trades), "n_top": len(ins.top_winners), "best_return": r_max},
                  reason=f"boost {len(value)} replay bars of the {len(ins.top_winners)} best in-sample trades")


def e7_hindsight(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E7 — (decision bar, hindsight-optimal direction) for losing in-sample trades whose hindsight direction
    differs from the one taken; worst losses first, at most max_hindsight labels."""
    ins = view.insample
    if ins is None:
        return Signal(id="E7", knob="hindsight", value=[], reason="no in-sample backtest")
    labels = []
    for i in ins.losers:
        t = ins.trades[i]
        if t.hindsight_dir is not None and t.hindsight_dir != t.direction_idx and len(labels) < cfg.max_hindsight:
            labels.append([t.decision_t, t.hindsight_dir])
    check_train_indices([b for b, _ in labels], ins.train, "E7 hindsight labels")
    counts = [sum(1 for _, d in labels if d == k) for k in range(3)]
    return Signal(id="E7", knob="hindsight", value=labels,
                  provenance=[Provenance(run_id=view.run_id, epoch=view.epoch, split="insample",
                                         window_hash=ins.window_hash, fields=["insample.losers",
                                                                              "insample.trades.hindsight_dir"])],
                  inputs={"n_losers": len(ins.losers), "short_flat_long": counts},
                  reason=f"{len(labels)} losing in-sample trades labelled (short/flat/long = {counts})")


def _regime_z(view: FeedbackView, n0: float) -> list[float] | None:
    """z_k = (mean_k / σ)·n_k/(n_k + n0): per-regime mean trade return in units of the trades' std, shrunk."""
    sigma = view.val.trade_return_std
    if not sigma > 0:
        return None
    return [(r.mean_return / sigma) * _w(r.n_trades, n0) for r in view.val.regimes]


def e8_regime_weights(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E8 — episode-start weights by regime: exp(−κ·z_k) (a losing regime is sampled more), normalised to mean 1
    with each weight in [w_min, w_max] and within ×/÷ regime_step of prev (`project_weights`)."""
    prev = list(view.knobs.regime_weights)
    prov = [_val_prov(view, "val.regimes")]
    z = _regime_z(view, cfg.regime_n0)
    if z is None:
        return Signal(id="E8", knob="regime_weights", value=prev, previous=prev, provenance=prov,
                      reason="fewer than 2 distinct validation trade returns: regime weights kept")
    raw = [math.exp(-cfg.regime_kappa * zk) for zk in z]
    p_mean = sum(prev) / len(prev)
    base = [p / p_mean for p in prev]
    lo = [max(cfg.regime_w_min, b / cfg.regime_step) for b in base]
    hi = [min(cfg.regime_w_max, b * cfg.regime_step) for b in base]
    value = project_weights(raw, lo, hi)
    worst = min(range(N_REGIMES), key=lambda k: z[k])
    return Signal(id="E8", knob="regime_weights", value=value, previous=prev, provenance=prov,
                  inputs={"z": z, "n_trades": [r.n_trades for r in view.val.regimes], "raw": raw},
                  clamped=any(min(abs(v - a), abs(v - b)) < 1e-12 for v, a, b in zip(value, lo, hi)),
                  reason=f"regime {worst} performs worst on validation (z = {z[worst]:+.2f}): sampled most")


def e9_regime_confidence(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E9 — per-regime confidence clip(1 + λ·z_k, 0, 1) (z_k shrunk by trade count), |Δ| ≤ conf_step."""
    prev = list(view.knobs.regime_confidence)
    prov = [_val_prov(view, "val.regimes")]
    z = _regime_z(view, cfg.conf_n0)
    if z is None:
        return Signal(id="E9", knob="regime_confidence", value=prev, previous=prev, provenance=prov,
                      reason="fewer than 2 distinct validation trade returns: regime confidence kept")
    raw = [_clamp(1.0 + cfg.conf_lambda * zk, 0.0, 1.0) for zk in z]
    value = [_clamp(r, p - cfg.conf_step, p + cfg.conf_step) for r, p in zip(raw, prev)]
    low = [k for k in range(N_REGIMES) if value[k] < 1.0]
    return Signal(id="E9", knob="regime_confidence", value=value, previous=prev, provenance=prov,
                  clamped=value != raw, inputs={"z": z, "raw": raw},
                  reason=f"regimes {low} lose on validation: smaller size there" if low else
                  "no regime loses on validation: full size everywhere")


SIGNALS = (e1_q_bias, e2_epsilon, e3_gamma, e4_lr_scale, e5_gate, e6_priority, e7_hindsight, e8_regime_weights,
           e9_regime_confidence)


# --- rollback ---------------------------------------------------------------------------------------------


def rollback_target(view: FeedbackView, cfg: FeedbackConfig):
    """(best HistoryPoint, threshold) when this epoch's validation per-trade Sharpe fell more than
    max(rollback_drop, rollback_rel·|best|) below the best earlier epoch's; None otherwise."""
    if not view.history:
        return None
    best = max(view.history, key=lambda h: h.val_sharpe)
    thr = max(cfg.rollback_drop, cfg.rollback_rel * abs(best.val_sharpe))
    s = view.val.metric("per_trade_sharpe")
    return (best, thr) if s < best.val_sharpe - thr else None


def _rolled_back(sig: Signal, cur: Knobs, good: Knobs, cfg: FeedbackConfig) -> Any:
    """Halfway from the current knobs toward the good epoch's, within each knob's bounds and step limits."""
    half = lambda a, b: a + 0.5 * (b - a)  # noqa: E731
    if sig.id == "E1":
        v = half(cur.q_bias, good.q_bias)
        return _clamp(_clamp(v, cur.q_bias - cfg.q_bias_step, cur.q_bias + cfg.q_bias_step), -cfg.q_bias_max,
                      cfg.q_bias_max)
    if sig.id == "E2":
        return _clamp(_ratio_limit(half(cur.epsilon, good.epsilon), cur.epsilon, cfg.eps_step), cfg.eps_min,
                      cfg.eps_max)
    if sig.id == "E3":
        v = half(cur.gamma, good.gamma)
        return _clamp(_clamp(v, cur.gamma - cfg.gamma_step, cur.gamma + cfg.gamma_step), cfg.gamma_min,
                      cfg.gamma_max)
    if sig.id == "E4":
        return {b: _clamp(_ratio_limit(half(cur.lr_scale[b], good.lr_scale[b]), cur.lr_scale[b], cfg.lr_step),
                          cfg.lr_min, cfg.lr_max) for b in BRANCHES}
    if sig.id == "E5":
        c, g = cur.gate_threshold, good.gate_threshold
        if math.isinf(g):
            return None if math.isinf(c) else c * cfg.gate_step
        if math.isinf(c):
            return g * cfg.gate_step
        return _ratio_limit(half(c, g), c, cfg.gate_step)
    if sig.id == "E8":
        m = sum(cur.regime_weights) / N_REGIMES
        base = [p / m for p in cur.regime_weights]
        gm = sum(good.regime_weights) / N_REGIMES
        target = [half(a, b / gm) for a, b in zip(base, good.regime_weights)]
        lo = [max(cfg.regime_w_min, b / cfg.regime_step) for b in base]
        hi = [min(cfg.regime_w_max, b * cfg.regime_step) for b in base]
        return project_weights(target, lo, hi)
    if sig.id == "E9":
        return [_clamp(_clamp(half(a, b), a - cfg.conf_step, a + cfg.conf_step), 0.0, 1.0)
                for a, b in zip(cur.regime_confidence, good.regime_confidence)]
    return sig.value


# --- the bundle -------------------------------------------------------------------------------------------


def _knobs_from_signals(sig: dict[str, Signal]) -> Knobs:
    g = sig["E5"].value
    return Knobs(epsilon=sig["E2"].value, gamma=sig["E3"].value, q_bias=sig["E1"].value,
                 lr_scale=dict(sig["E4"].value), gate_threshold=math.inf if g is None else g,
                 priority_boost=[(int(b), float(m)) for b, m in sig["E6"].value],
                 hindsight=[(int(b), int(d)) for b, d in sig["E7"].value],
                 regime_weights=list(sig["E8"].value), regime_confidence=list(sig["E9"].value)).validate()


def _disabled_bundle(report: EvalReport, cfg: FeedbackConfig, now: str) -> FeedbackBundle:
    k = Knobs.fixed_schedule(report.epoch + 1, eps_start=cfg.eps_start, eps_end=cfg.eps_end,
                             eps_decay_epochs=cfg.eps_decay_epochs, gamma=cfg.gamma_fixed)
    d = k.to_dict()
    names = {"E1": "q_bias", "E2": "epsilon", "E3": "gamma", "E4": "lr_scale", "E5": "gate_threshold",
             "E6": "priority_boost", "E7": "hindsight", "E8": "regime_weights", "E9": "regime_confidence"}
    prov = [Provenance(run_id=report.run_id, epoch=report.epoch, split="config", fields=["feedback.enabled"])]
    sig = {i: Signal(id=i, knob=n, value=d[n], provenance=prov, reason="feedback disabled (ablation)")
           for i, n in names.items()}
    return FeedbackBundle(run_id=report.run_id, epoch=report.epoch, for_epoch=report.epoch + 1, enabled=False,
                          reason="feedback disabled (ablation)", signals=sig, knobs=d,
                          report_checkpoint_sha256=report.checkpoint_sha256, created_at=now)


def compute_bundle(report: EvalReport, history: Sequence[EvalReport | HistoryEntry] = (), config: Any = None, *,
                   bars: Any | None = None, now: str | None = None) -> FeedbackBundle:
    """E1–E9 for epoch `report.epoch + 1` from the report, the run's earlier reports (or their `HistoryEntry`s) and
    the config.

    The report and history pass the leakage guard first (LeakageError on a window of the wrong split; `bars`
    lets it recompute window hashes). With `config.enabled` False: the fixed schedule (ablation).
    """
    cfg = FeedbackConfig.coerce(config)
    now = now if now is not None else _dt.datetime.now(_dt.timezone.utc).isoformat()
    view = build_view(report, history, bars)
    if not cfg.enabled:
        return _disabled_bundle(report, cfg, now)
    sig = {s.id: s for s in (f(view, cfg) for f in SIGNALS)}
    rb = rollback_target(view, cfg)
    reason = "feedback from validation aggregates and the in-sample autopsy"
    if rb is not None:
        best, thr = rb
        s = view.val.metric("per_trade_sharpe")
        why = (f"rollback: val per-trade Sharpe {s:.3f} < best {best.val_sharpe:.3f} (epoch {best.epoch}) − "
               f"{thr:.3f}; halfway back toward epoch {best.epoch}'s knobs")
        for i in ("E1", "E2", "E3", "E4", "E5", "E8", "E9"):
            old = sig[i]
            sig[i] = old.model_copy(update={
                "value": _rolled_back(old, view.knobs, best.knobs, cfg), "reason": why, "clamped": True,
                "inputs": {**old.inputs, "rollback_to_epoch": best.epoch, "signal_value": old.value},
                "provenance": [*old.provenance, _hist_prov(view)]})
            Signal.model_validate(sig[i].model_dump())
        reason = why
    knobs = _knobs_from_signals(sig)
    return FeedbackBundle(run_id=report.run_id, epoch=report.epoch, for_epoch=report.epoch + 1, enabled=True,
                          rollback=rb is not None, rollback_to_epoch=None if rb is None else rb[0].epoch,
                          reason=reason, signals=sig, knobs=knobs.to_dict(),
                          report_checkpoint_sha256=report.checkpoint_sha256, created_at=now)
