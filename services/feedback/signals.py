"""Feedback signals E1–E9: pure functions of (report, history of earlier reports, config) → next epoch's knobs.

Every signal reads a `FeedbackView` built by the leakage guard (services/feedback/guard.py) — validation
aggregates, in-sample trade samples of the training split, and the run's history; never the OOS backtest — and
returns a `shared.report.Signal`: its value, the previous value (the knobs the reported epoch trained under),
the inputs, the provenance and a one-line reason. Each signal is bounded twice: a clamp to its range and a
limit on how far it moves in one epoch; both are written once, in the signal's function. Formulas and bounds
are in docs/feedback.md; in short, with prev = the knob the reported epoch e trained under, n = validation
trade count, w(n) = n / (n + n0), S(e) = the fixed schedule's ε (`shared.knobs.FixedSchedule`):

  E1 q_bias      ← prev + η·w(n)·a·½(bias + median_bias)          |Δ| ≤ 0.01, |q_bias| ≤ 0.05
  E2 epsilon     ← S(e+1)·m, m = prev/S(e) × {1/1.25 new best beyond noise; 1.5 too few trades for the window;
                   1.25 below the best beyond noise for `patience` epochs; 1 else}, never raised while validation
                   improves                                          [0.01, 0.5], m ×/÷1.5
  E3 gamma       ← 1 − 1/(k·mean_bars_held)                         [0.9, 0.995], |Δ| ≤ 0.01
  E4 lr_scale[b] ← 1 + w(n)·((err_b + s)/(mean_err + s) − 1)        [0.25, 4], ×/÷1.5
  E5 gate        ← argmax_θ Σ kept returns s.t. n_kept ≥ 20         ×/÷1.5 once a gate exists; None = no gate
  E6 boosts      ← (bar, 1 + (B − 1)·r_i / r_max) over the in-sample top-10 % winners' decision bars   [1, B]
  E7 hindsight   ← (decision bar, hindsight-optimal direction) of losing in-sample trades
  E8 weights[k]  ← exp(−κ·z_k), z_k = (mean_k / σ)·w(n_k), normalised to mean 1   [0.25, 4], ×/÷1.5
  E9 conf[k]     ← clip(1 + λ·z_k, 0, 1)                            |Δ| ≤ 0.25

Noise: a change in validation counts only beyond `noise_z` standard errors of the difference of two per-trade
Sharpes (un-annualized), sqrt(SE_a² + SE_b²) with SE = `shared.metrics.sharpe_se` (the PSR's denominator).

Rollback: when the validation per-trade Sharpe fell below the best earlier epoch's by more than `rollback_z`
standard errors of the difference, the bundle says "rollback" with that epoch and its checkpoint's sha256: the
trainer restores that epoch's weights, target network and optimizer state (PBT's exploit step), and the
continuous knobs of the signals that are on (E1–E5, E8, E9) are that epoch's knobs (E2: its multiplier m), and
E6/E7 are empty (their labels come from the checkpoint that fell below the best).

Switched off: a signal named in `config.off` leaves its knob at the fixed schedule's value for epoch e+1
("rollback" in `off` switches the rollback off). Feedback off (`config.enabled = False`): every knob from the
fixed schedule, reason "feedback disabled (ablation)".
"""
from __future__ import annotations

import datetime as _dt
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from services.feedback.fallbacks import (KNOB_OF, best_point, disabled_bundle, fixed_signals, is_stagnant, new_best,
                                        next_lr_decay, knobs_from_signals, rollback_reason, rollback_target)
from services.feedback.bounds import _clamp, _fin, _ratio_limit, _w, beyond_noise, project_weights
from services.feedback.guard import FeedbackView, HistoryEntry, HistoryPoint, build_view, check_train_indices
from shared.knobs import BRANCHES, N_REGIMES, FixedSchedule, unlisted_at_neutral
from shared.metrics import MIN_SELECTION_TRADES
from shared.report import SIGNAL_IDS, EvalReport, FeedbackBundle, Provenance, Signal, parse_off

CONTINUOUS = ("E1", "E2", "E3", "E4", "E5", "E8", "E9")
"""Signals that set a setting (restored by a rollback)."""
SAMPLE_LABELS = ("E6", "E7")
"""Signals whose value is sample labels of the reported checkpoint's in-sample trades (emptied by a rollback)."""


@dataclass(frozen=True)
class FeedbackConfig:
    """Parameters of E1–E9 and of the rollback (defaults documented in docs/feedback.md)."""

    enabled: bool = True
    """False: fixed schedules (the ablation)."""
    off: tuple[str, ...] = ()
    """Signals switched off, e.g. ("E2", "E3") (none by default here; the product ships `shared.report.DEFAULT_OFF`
    off): each leaves its knob at the fixed schedule's value; "rollback"
    switches the rollback off. A comma-separated string is accepted ("E2,E3")."""
    schedule: FixedSchedule = FixedSchedule()
    """The fixed schedule of feedback off and of a signal switched off (`shared.knobs.FixedSchedule`); a mapping
    is read as its fields. Its ε must be > 0 at both ends: E2 scales the schedule's ε."""
    n0: float = 20.0
    """Shrinkage constant of w(n) = n / (n + n0) for E1, E4 (validation trade counts)."""
    noise_z: float = 1.0
    """E2: a change in validation per-trade Sharpe counts when it exceeds noise_z standard errors of the
    difference (new best; below the best for `patience` epochs)."""
    evidence_z: float = 2.0
    """E1, E4, E5, E8, E9 act on the part of their input beyond evidence_z standard errors (`beyond_noise`): an
    input within the noise of the validation trades behind it moves nothing."""
    # E1
    q_bias_rate: float = 0.5
    q_bias_max: float = 0.05
    q_bias_step: float = 0.01
    # E2
    eps_min: float = 0.01
    eps_max: float = 0.5
    eps_step: float = 1.5
    """Largest factor of the multiplier m (ε over the schedule's ε) in one epoch; also the too-few-trades factor."""
    eps_stagnation: float = 1.25
    eps_improve: float = 1.25
    min_trades: int = 20
    min_trade_frac: float = 0.25
    """E2's activity threshold: too few validation trades is n < min(min_trades, min_trade_frac·L/d), L the
    validation window's bars, d the mean bars held (L/d: trades the window holds back to back)."""
    patience: int = 2
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
    rollback_z: float = 2.0
    """Roll back when validation fell below the best earlier epoch's by more than rollback_z standard errors of
    the difference (the best of several noisy epochs is biased up, hence more than one)."""
    rollback_lr_factor: float = 1.0
    """Each rollback multiplies every learning rate by this (`Knobs.lr_decay`, carried from epoch to epoch): the
    restored epoch trains on in smaller steps, as "restore the best and anneal" schedules do; 1: no decay."""
    plateau_lr_factor: float = 1.0
    """Every learning rate × this after an epoch that set no new validation best beyond noise (`new_best`;
    `Knobs.lr_decay`, carried on): reduce-on-plateau driven by validation (`next_lr_decay`); 1: off."""
    rollback_keep: float = 0.0
    """The share of the current learner's weights a rollback keeps: every floating-point weight of the network and
    its target becomes `keep·w_now + (1 − keep)·w_best` (a point on the line between the two, as weight averaging
    and the Lookahead optimizer take); 0: the best epoch's weights bit for bit."""
    min_selection_trades: int = MIN_SELECTION_TRADES
    """Fewest validation trades of an epoch the rollback and the exploit may choose (a study sets its own)."""
    rollback_restart: bool = False
    """Answer the drop with a fresh learner (`state.restart_fresh`: new weights, zeroed optimizer state, and the
    replay emptied under `train.restart_replay`) instead of the best epoch's; the knobs are the best epoch's either
    way. Why: an epoch begun from a restored best validated 0.173 below it on the H200 (2026-12-03 · 206c041),
    while the mean first epoch of a run validated above every later epoch's mean."""
    # population
    population: bool = False
    """Exploit across runs (`fallbacks.exploit_target`): the next epoch starts from a peer's epoch (in `tradeloop
    study`: a run of the same variant, fold and data) validated above this run's best beyond the noise. A run alone
    (`tradeloop up`) has no peers: no effect there."""
    population_z: float = 2.0
    """The exploit's noise threshold, in standard errors of the difference."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "off", parse_off(self.off))
        except ValueError as exc:
            raise ValueError(f"feedback config: {exc}") from None
        for name in ("rollback_lr_factor", "plateau_lr_factor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"feedback config: {name} must be in (0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.rollback_keep < 1.0:
            raise ValueError(f"feedback config: rollback_keep must be in [0, 1), got {self.rollback_keep}")
        if isinstance(self.min_selection_trades, bool) or not isinstance(self.min_selection_trades, int) \
                or self.min_selection_trades < 0:
            raise ValueError(f"feedback config: min_selection_trades must be an integer ≥ 0, got "
                             f"{self.min_selection_trades!r}")
        if not isinstance(self.rollback_restart, bool):
            raise ValueError(f"feedback config: rollback_restart must be true or false, got {self.rollback_restart!r}")
        object.__setattr__(self, "schedule", FixedSchedule.coerce(self.schedule, "feedback config: schedule"))
        if not (self.schedule.eps_start > 0 and self.schedule.eps_end > 0):
            raise ValueError(f"feedback config: schedule eps_start and eps_end must be > 0 (E2 scales the schedule's "
                             f"ε), got {self.schedule.eps_start}, {self.schedule.eps_end}")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form, which `coerce` reads back: `off` a list, the schedule a table of its fields."""
        d = unlisted_at_neutral({f.name: getattr(self, f.name) for f in fields(self)},
                                {"plateau_lr_factor": 1.0, "min_selection_trades": MIN_SELECTION_TRADES})
        return {**d, "off": list(self.off), "schedule": self.schedule.to_dict()}

    def is_on(self, name: str) -> bool:
        """Signal (or "rollback") `name` acts: feedback enabled and `name` not switched off."""
        return self.enabled and name not in self.off

    @classmethod
    def coerce(cls, config: Any) -> "FeedbackConfig":
        """A FeedbackConfig from itself, a mapping, or any object with (some of) these attributes (an attribute at
        None: the default); None → defaults.
        A mapping may name the schedule's fields at its top level too (`eps_start`, `gamma_fixed`, ...)."""
        if config is None:
            return cls()
        if isinstance(config, cls):
            return config
        names = {f.name for f in fields(cls)}
        if isinstance(config, dict):
            config = dict(config)
            flat = {k: config.pop(k) for k in list(config) if k not in names and FixedSchedule.field_of(k)}
            unknown = set(config) - names
            if unknown:
                raise ValueError(f"feedback config: unknown keys {sorted(unknown)}")
            if flat:
                config["schedule"] = FixedSchedule.coerce(config.get("schedule"), "feedback config: schedule"
                                                          ).with_values(flat, "feedback config")
            return cls(**config)
        # a settings object leaves a field it does not set at None: the config's default
        return cls(**{n: v for n in names if (v := getattr(config, n, None)) is not None})


# --- helpers ----------------------------------------------------------------------------------------------


def _val_prov(view: FeedbackView, *fields_: str) -> Provenance:
    return Provenance(run_id=view.run_id, epoch=view.epoch, split="val", window_hash=view.val.window_hash,
                      fields=list(fields_))


def _hist_prov(view: FeedbackView) -> Provenance:
    return Provenance(run_id=view.run_id, epoch=view.epoch, split="history",
                      fields=[f"epoch {h.epoch}: val.metrics.per_trade_sharpe" for h in view.history])


def _n_val(view: FeedbackView) -> int:
    return int(view.val.calibration.n_trades)


# --- E1–E9 ------------------------------------------------------------------------------------------------


def e1_q_bias(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E1 — Q-bias from predicted Q at entry vs realised trade return (validation), and the median's coverage.

    e = ½(mean(q − r) + median(q50 − r)); the calibration at τ = 0.5, g = coverage_0.5 − 0.5 (> 0: realised
    returns fall below the predicted median too often, i.e. over-prediction), halves the step when it disagrees
    with e in sign: a = 1 if g·e ≥ 0 else ½. Only the part of e beyond evidence_z·σ/√n counts (σ = the std of the
    validation trades' Q error q − r): q_bias ← prev + η·w(n)·a·beyond_noise(e), |Δ| ≤ q_bias_step, |q_bias| ≤ q_bias_max.
    Positive q_bias is subtracted from bootstrap targets: Q that over-predicts is pulled down.
    """
    prev, cal = view.knobs.q_bias, view.val.calibration
    n = cal.n_trades
    prov = [_val_prov(view, "val.calibration.bias", "val.calibration.median_bias", "val.calibration.coverage")]
    if n == 0:
        return Signal(id="E1", knob="q_bias", value=prev, previous=prev, inputs={"n_trades": 0}, provenance=prov,
                      reason="no validation trades: q_bias kept")
    e = 0.5 * (cal.bias + cal.median_bias)
    sigma = view.val.q_error_std
    se = sigma / math.sqrt(n) if n >= 2 else math.inf
    e_sig = beyond_noise(e, se, cfg.evidence_z)
    g = cal.coverage[cal.taus.index(0.5)] - 0.5 if 0.5 in cal.taus else 0.0
    a = 1.0 if g * e >= 0 else 0.5
    raw = prev + cfg.q_bias_rate * _w(n, cfg.n0) * a * e_sig
    value = _clamp(_clamp(raw, prev - cfg.q_bias_step, prev + cfg.q_bias_step), -cfg.q_bias_max, cfg.q_bias_max)
    sense = "over" if e > 0 else "under"
    return Signal(id="E1", knob="q_bias", value=value, previous=prev, provenance=prov, clamped=value != raw,
                  inputs={"n_trades": n, "bias": cal.bias, "median_bias": cal.median_bias, "coverage_gap_q50": g,
                          "agreement": a, "bias_se": _fin(se), "bias_beyond_noise": e_sig, "raw": raw},
                  reason=(f"Q {sense}-predicts realised validation trades by {e:+.5f}, within "
                          f"{cfg.evidence_z:g}·SE = {cfg.evidence_z * se:.5f} of 0: q_bias kept" if e_sig == 0.0 else
                          f"Q {sense}-predicts realised validation trades by {e:+.5f} ({e_sig:+.5f} beyond "
                          f"{cfg.evidence_z:g}·SE; coverage gap at q50 {g:+.2f})"))


def _schedule_multiplier(eps: float, epoch: int, cfg: FeedbackConfig) -> float:
    """m = ε / S(epoch): how far an epoch's ε stood from the fixed schedule's."""
    return eps / cfg.schedule.epsilon(epoch)


def _epsilon(m: float, epoch: int, cfg: FeedbackConfig) -> float:
    """ε of `epoch` at multiplier m of the schedule, within E2's bounds [eps_min, eps_max]."""
    return _clamp(cfg.schedule.epsilon(epoch) * m, cfg.eps_min, cfg.eps_max)


def e2_epsilon(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E2 — ε as a multiplier m of the fixed schedule's, moved only by validation changes beyond their noise.

    m_prev = prev / S(e). Factor, first that applies: ÷eps_improve when the validation per-trade Sharpe beat the
    best earlier epoch's by more than noise_z·SE of the difference (exploit more); ×eps_step when the policy trades
    too little for the window, n < min(min_trades, min_trade_frac·L/d), and validation does not improve;
    ×eps_stagnation when the last `patience` epochs each fell below the best before them beyond noise and
    validation does not improve; ×1 otherwise (ε follows the schedule). "Improves": this epoch's Sharpe is above
    the previous epoch's. ε ← clamp(S(e+1)·m, ε_min, ε_max) with m within ×/÷ eps_step of m_prev, and never above
    prev while validation improves.
    """
    prev, e = view.knobs.epsilon, view.epoch
    s, n, se = view.val.metric("per_trade_sharpe"), _n_val(view), view.val.sharpe_se
    d, L = view.val.metric("mean_bars_held"), view.val.window_bars
    capacity = L / max(d, 1.0)                        # trades the window holds back to back at holding time d
    need = min(float(cfg.min_trades), cfg.min_trade_frac * capacity)
    last = view.history[-1] if view.history else None
    improving = last is not None and s > last.val_sharpe
    beat, best, gain_se = new_best(view, cfg)
    stagnant = is_stagnant(view, s, se, cfg)
    if beat:
        factor, why = 1.0 / cfg.eps_improve, (f"validation per-trade Sharpe {s:.3f} beats the best {best.val_sharpe:.3f}"
                                              f" beyond noise ({cfg.noise_z:g}·SE = {cfg.noise_z * gain_se:.3f}): "
                                              "exploit more")
    elif n < need and not improving:
        factor, why = cfg.eps_step, (f"too few validation trades for the window ({n} < {need:.1f} = min("
                                     f"{cfg.min_trades}, {cfg.min_trade_frac:g}·{L}/{d:.0f} bars)): explore more")
    elif stagnant and not improving:
        factor, why = cfg.eps_stagnation, (f"validation below the best beyond noise for {cfg.patience} epochs: "
                                           "explore more")
    else:
        factor, why = 1.0, "no validation change beyond noise: ε follows the schedule"
    m_prev = _schedule_multiplier(prev, e, cfg)
    m_raw = m_prev * factor
    m = _ratio_limit(m_raw, m_prev, cfg.eps_step)
    raw = cfg.schedule.epsilon(e + 1) * m_raw
    value = _epsilon(m, e + 1, cfg)
    if improving and value > prev:
        value, why = prev, why + "; validation improves: ε not raised"
    return Signal(id="E2", knob="epsilon", value=value, previous=prev, clamped=value != raw,
                  provenance=[_val_prov(view, "val.metrics.per_trade_sharpe", "val.metrics.n_trades",
                                        "val.metrics.mean_bars_held", "val.window_bars", "val.sharpe_se"),
                              _hist_prov(view)],
                  inputs={"val_sharpe": s, "sharpe_se": _fin(se), "n_trades": n, "min_trades_for_window": need,
                          "best_previous_sharpe": None if best is None else best.val_sharpe,
                          "improving": improving, "new_best": beat, "stagnant": stagnant, "factor": factor,
                          "schedule_multiplier": m, "schedule_epsilon": cfg.schedule.epsilon(e + 1)},
                  reason=why)


def e3_gamma(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E3 — γ = 1 − 1/(k·d) from the mean validation trade duration d (bars); [γ_min, γ_max], |Δγ| ≤ step. Kept
    with fewer than min_trades validation trades (a mean duration of a handful of trades is not a horizon)."""
    prev = view.knobs.gamma
    d, n = view.val.metric("mean_bars_held"), _n_val(view)
    prov = [_val_prov(view, "val.metrics.mean_bars_held")]
    if n < cfg.min_trades or not d > 0:
        return Signal(id="E3", knob="gamma", value=prev, previous=prev, inputs={"n_trades": n}, provenance=prov,
                      reason=f"{n} validation trades (< {cfg.min_trades}): γ kept")
    raw = 1.0 - 1.0 / (cfg.gamma_k * d)
    value = _clamp(_clamp(raw, prev - cfg.gamma_step, prev + cfg.gamma_step), cfg.gamma_min, cfg.gamma_max)
    return Signal(id="E3", knob="gamma", value=value, previous=prev, provenance=prov, clamped=value != raw,
                  inputs={"mean_bars_held": d, "k": cfg.gamma_k, "raw": raw},
                  reason=f"mean trade lasts {d:.1f} bars: horizon k·d = {cfg.gamma_k * d:.0f} bars → γ {raw:.4f}")


def e4_lr_scale(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E4 — per-branch LR scale from the validation autopsy's error rates.

    target_b = 1 + w(n)·((ẽ_b + s)/(mean_b' err_b' + s) − 1): a branch erring more than the others learns faster;
    ẽ_b = mean + beyond_noise(err_b − mean, binomial SE): a difference within the noise of n trades counts as none.
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
    # a branch's excess error rate counts beyond evidence_z binomial standard errors (p at the pair's mean)
    se = {b: math.sqrt(max(0.5 * (rates[b] + mean) * (1 - 0.5 * (rates[b] + mean)), 1.0 / n) / n) for b in BRANCHES}
    eff = {b: mean + beyond_noise(rates[b] - mean, se[b], cfg.evidence_z) for b in BRANCHES}
    raw = {b: 1.0 + w * ((eff[b] + cfg.lr_smooth) / (mean + cfg.lr_smooth) - 1.0) for b in BRANCHES}
    value = {b: _clamp(_ratio_limit(raw[b], prev[b], cfg.lr_step), cfg.lr_min, cfg.lr_max) for b in BRANCHES}
    worst = max(BRANCHES, key=lambda b: rates[b])
    return Signal(id="E4", knob="lr_scale", value=value, previous=prev, provenance=prov,
                  clamped=any(value[b] != raw[b] for b in BRANCHES),
                  inputs={"n_trades": n, "error_rates": rates, "error_rate_se": se, "error_rates_beyond_noise": eff,
                          "raw": raw},
                  reason=(f"{worst} branch errs most ({rates[worst]:.0%} of {n} trades): its LR scale rises"
                          if any(eff[b] != mean for b in BRANCHES) else
                          f"branch error rates within {cfg.evidence_z:g}·SE of their mean: LR scales move to 1"))


def e5_gate(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E5 — epistemic gate threshold tuned on validation trades (aggregated gate curve).

    θ* = argmax over the curve's points with n_kept ≥ gate_min_trades of the kept trades' summed net return
    (ties → the larger θ; None = no gate), and None unless its gain over no gate exceeds evidence_z·σ·√m (m trades
    removed, σ the validation trades' return std). With fewer than gate_min_trades validation trades: kept. A finite prev
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
    ungated = next(p for p in curve if p.threshold is None)
    # the gate's gain is the removed trades' loss: it counts beyond evidence_z·σ·√(trades removed)
    removed = ungated.n_kept - best.n_kept
    gain_se = view.val.trade_return_std * math.sqrt(removed) if removed > 0 else math.inf
    gain = best.sum_return - ungated.sum_return
    noise = best.threshold is not None and beyond_noise(gain, gain_se, cfg.evidence_z) <= 0.0
    target = None if noise else best.threshold
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
                          "n_kept": best.n_kept, "ungated_sum_return": ungated.sum_return, "gain_se": _fin(gain_se)},
                  reason=(f"no gate: the best gate's gain {gain:+.4f} is within {cfg.evidence_z:g}·SE = "
                          f"{cfg.evidence_z * gain_se:.4f}" if noise else
                          "no gate: gating would not raise the validation trades' total return" if target is None else
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


def _regime_z(view: FeedbackView, n0: float, z: float) -> list[float] | None:
    """z_k = beyond_noise(mean_k / σ, 1/√n_k)·n_k/(n_k + n0): per-regime mean trade return in units of the trades'
    std, the part beyond z standard errors of a mean of n_k trades, shrunk."""
    sigma = view.val.trade_return_std
    if not sigma > 0:
        return None
    return [beyond_noise(r.mean_return / sigma, 1.0 / math.sqrt(r.n_trades) if r.n_trades > 0 else math.inf, z)
            * _w(r.n_trades, n0) for r in view.val.regimes]


def _regime_inputs(view: FeedbackView, sid: str, n0: float, z_noise: float, what: str):
    """(prev, provenance, z, kept) of a per-regime signal (E8, E9): its knob as the reported epoch trained under it,
    `_regime_z` with shrinkage n0 and, where z is undefined, the signal that keeps prev (else None)."""
    prev = list(getattr(view.knobs, KNOB_OF[sid]))
    prov = [_val_prov(view, "val.regimes")]
    z = _regime_z(view, n0, z_noise)
    kept = None if z is not None else Signal(
        id=sid, knob=KNOB_OF[sid], value=prev, previous=prev, provenance=prov,
        reason=f"fewer than 2 distinct validation trade returns: {what} kept")
    return prev, prov, z, kept


def e8_regime_weights(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E8 — episode-start weights by regime: exp(−κ·z_k) (a losing regime is sampled more), normalised to mean 1
    with each weight in [w_min, w_max] and within ×/÷ regime_step of prev (`project_weights`)."""
    prev, prov, z, kept = _regime_inputs(view, "E8", cfg.regime_n0, cfg.evidence_z, "regime weights")
    if kept is not None:
        return kept
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
                  reason=(f"regime {worst} performs worst on validation (z = {z[worst]:+.2f}): sampled most"
                          if any(z) else f"no regime's mean trade return beyond {cfg.evidence_z:g}·SE: weights move "
                          "toward 1"))


def e9_regime_confidence(view: FeedbackView, cfg: FeedbackConfig) -> Signal:
    """E9 — per-regime confidence clip(1 + λ·z_k, 0, 1) (z_k shrunk by trade count), |Δ| ≤ conf_step."""
    prev, prov, z, kept = _regime_inputs(view, "E9", cfg.conf_n0, cfg.evidence_z, "regime confidence")
    if kept is not None:
        return kept
    raw = [_clamp(1.0 + cfg.conf_lambda * zk, 0.0, 1.0) for zk in z]
    value = [_clamp(r, p - cfg.conf_step, p + cfg.conf_step) for r, p in zip(raw, prev)]
    low = [k for k in range(N_REGIMES) if value[k] < 1.0]
    return Signal(id="E9", knob="regime_confidence", value=value, previous=prev, provenance=prov,
                  clamped=value != raw, inputs={"z": z, "raw": raw},
                  reason=f"regimes {low} lose on validation: smaller size there" if low else
                  "no regime loses on validation: full size everywhere")


SIGNALS = {"E1": e1_q_bias, "E2": e2_epsilon, "E3": e3_gamma, "E4": e4_lr_scale, "E5": e5_gate, "E6": e6_priority,
           "E7": e7_hindsight, "E8": e8_regime_weights, "E9": e9_regime_confidence}


# --- rollback ---------------------------------------------------------------------------------------------


def _restored(i: str, view: FeedbackView, good: HistoryPoint, cfg: FeedbackConfig) -> Any:
    """Signal i's value after a rollback to `good`: that epoch's knob (E2: its multiplier of the schedule, at
    epoch e+1), as a signal value (gate None = no gate)."""
    k = good.knobs
    if i == "E2":
        return _epsilon(_schedule_multiplier(k.epsilon, good.epoch, cfg), view.epoch + 1, cfg)
    if i == "E5":
        return None if math.isinf(k.gate_threshold) else k.gate_threshold
    v = getattr(k, KNOB_OF[i])
    return dict(v) if isinstance(v, dict) else list(v) if isinstance(v, list) else v


# --- the bundle -------------------------------------------------------------------------------------------


def compute_bundle(report: EvalReport, history: Sequence[EvalReport | HistoryEntry] = (), config: Any = None, *,
                   bars: Any | None = None, now: str | None = None) -> FeedbackBundle:
    """E1–E9 for epoch `report.epoch + 1` from the report, the run's earlier reports (or their `HistoryEntry`s) and
    the config.

    The report and history pass the leakage guard first (LeakageError on a window of the wrong split; `bars`
    lets it recompute window hashes). With `config.enabled` False: the fixed schedule (ablation); a signal in
    `config.off`: its knob at the fixed schedule's value. A rollback (see `rollback_target`) names the epoch and
    checkpoint the trainer restores, and sets the continuous knobs of the signals that are on to that epoch's.
    """
    cfg = FeedbackConfig.coerce(config)
    now = now if now is not None else _dt.datetime.now(_dt.timezone.utc).isoformat()
    view = build_view(report, history, bars)
    if not cfg.enabled:
        return disabled_bundle(report, cfg, now)
    off = [i for i in SIGNAL_IDS if not cfg.is_on(i)]
    sig = {i: f(view, cfg) for i, f in SIGNALS.items() if i not in off}
    sig.update(fixed_signals(off, report, cfg, "switched off (feedback config `off`): fixed schedule",
                              "feedback.off"))
    rb = rollback_target(view, cfg) if cfg.is_on("rollback") else None
    reason = "feedback from validation aggregates and the in-sample autopsy"
    if off:
        reason += f"; switched off: {', '.join(cfg.off)}"
    if rb is not None:
        g, why = rb.best, rollback_reason(view, rb, cfg)
        for i in CONTINUOUS:
            if i in off:
                continue
            old = sig[i]
            value = _restored(i, view, g, cfg)
            if i == "E2" and old.inputs.get("improving") and value > old.previous:
                value = old.previous                    # never raised while validation improves
            sig[i] = Signal.model_validate({
                **old.model_dump(), "value": value, "reason": why, "clamped": False,
                "inputs": {**old.inputs, "rollback_to_epoch": g.epoch, "signal_value": old.value},
                "provenance": [p.model_dump() for p in old.provenance] + [_hist_prov(view).model_dump()]})
        for i in SAMPLE_LABELS:
            if i in off:
                continue
            old = sig[i]    # labels of the checkpoint that fell below the best: not trained on
            sig[i] = old.model_copy(update={"value": [], "reason": f"{why}; {len(old.value)} labels of epoch "
                                                                  f"{view.epoch}'s checkpoint not used",
                                            "inputs": {**old.inputs, "rollback_to_epoch": g.epoch,
                                                       "signal_labels": len(old.value)}})
        reason = why
    decay, why = next_lr_decay(view, cfg, rb is not None)
    knobs = replace(knobs_from_signals(sig), lr_decay=decay).validate()
    reason += why
    this = HistoryPoint(view.epoch, view.val.metric("per_trade_sharpe"), _n_val(view), view.knobs)
    keep_best = cfg.is_on("rollback") or cfg.population      # a rollback restores it, or a peer exploits it
    best_epoch = best_point([*view.history, this], cfg.min_selection_trades)[0].epoch if keep_best else None
    return FeedbackBundle(run_id=report.run_id, epoch=report.epoch, for_epoch=report.epoch + 1, enabled=True,
                          rollback=rb is not None, rollback_to_epoch=None if rb is None else rb.best.epoch,
                          rollback_checkpoint_sha256="" if rb is None else rb.best.checkpoint_sha256,
                          rollback_keep=0.0 if rb is None else cfg.rollback_keep,
                          rollback_restart=rb is not None and cfg.rollback_restart,
                          best_epoch=best_epoch,
                          reason=reason, signals=sig, knobs=knobs.to_dict(), off=list(cfg.off),
                          report_checkpoint_sha256=report.checkpoint_sha256, created_at=now)
