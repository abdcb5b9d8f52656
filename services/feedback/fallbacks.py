"""Where a feedback bundle's knobs do not come from the signals: the fixed schedule (a signal switched off, or
feedback off: `fixed_signals`, `disabled_bundle`) and the rollback to the best earlier epoch (`rollback_target`:
its evidence; `rollback_reason`: what the bundle says of it; `services.feedback.signals.compute_bundle` restores
that epoch's knobs), and the exploit of another run's better epoch (`exploit_target`: population-based training
across runs), and the learning rates' decay (`next_lr_decay`: the schedule's, the plateau's after an epoch without
a `new_best`, the rollback's). `KNOB_OF` names the knob each signal sets; `knobs_from_signals` turns E1–E9 into the
`Knobs` of a bundle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

from services.feedback.guard import FeedbackView, HistoryPoint
from shared.knobs import Knobs
from shared.metrics import MIN_SELECTION_TRADES, select_best
from shared.report import OFF_NAMES, SIGNAL_IDS, EvalReport, FeedbackBundle, Provenance, Signal

if TYPE_CHECKING:
    from services.feedback.signals import FeedbackConfig

KNOB_OF = {"E1": "q_bias", "E2": "epsilon", "E3": "gamma", "E4": "lr_scale", "E5": "gate_threshold",
           "E6": "priority_boost", "E7": "hindsight", "E8": "regime_weights", "E9": "regime_confidence"}
"""The `Knobs` field each signal sets."""


def diff_se(se_a: float, se_b: float) -> float:
    """Standard error of the difference of two independent estimates (inf when either is unknown)."""
    return math.hypot(se_a, se_b)


# --- rollback ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rollback:
    """A rollback's evidence: the best earlier epoch, how far validation fell below it, and the noise."""

    best: HistoryPoint
    drop: float
    """best.val_sharpe − this epoch's validation per-trade Sharpe (un-annualized)."""
    se: float
    """Standard error of that difference."""
    stopped: bool = False
    """The epoch had too few validation trades to be selected while the best had enough: the policy all but stopped
    trading, a fall no standard error of a few trades can show."""


def best_point(points: Sequence[HistoryPoint], min_trades: int = MIN_SELECTION_TRADES) -> tuple[HistoryPoint, bool]:
    """The best of these epochs by the rule that selects a run's checkpoint (`shared.metrics.select_best`): the
    highest validation per-trade Sharpe among the epochs with ≥ `min_trades` validation trades (the best of all when
    none has), the earliest of equal Sharpes; and whether it has enough trades."""
    i, enough = select_best([p.val_sharpe for p in points], [p.val_n_trades for p in points], min_trades)
    return points[i], enough


def new_best(view: FeedbackView, cfg: "FeedbackConfig") -> tuple[bool, HistoryPoint | None, float]:
    """(whether the reported epoch's validation per-trade Sharpe beat the best earlier epoch's by more than noise_z
    standard errors of the difference, that epoch or None on the first, that standard error or inf)."""
    s, se = view.val.metric("per_trade_sharpe"), view.val.sharpe_se
    best = best_point(view.history, cfg.min_selection_trades)[0] if view.history else None
    gain_se = diff_se(se, best.val_sharpe_se) if best is not None else math.inf
    return best is not None and s - best.val_sharpe > cfg.noise_z * gain_se, best, gain_se


def is_stagnant(view: FeedbackView, s: float, se: float, cfg: "FeedbackConfig") -> bool:
    """E2's stagnation: the last `patience` epochs (this one included) each fell below the best epoch before them by
    more than noise_z standard errors of the difference."""
    hist, k = view.history, cfg.patience
    if len(hist) < k:
        return False
    before = hist[:len(hist) - (k - 1)]
    recent = [(h.val_sharpe, h.val_sharpe_se) for h in hist[len(hist) - (k - 1):]] + [(s, se)]
    best = best_point(before, cfg.min_selection_trades)[0]
    return all(best.val_sharpe - r > cfg.noise_z * diff_se(r_se, best.val_sharpe_se) for r, r_se in recent)


def next_lr_decay(view: FeedbackView, cfg: "FeedbackConfig", rolled_back: bool) -> tuple[float, str]:
    """(`Knobs.lr_decay` of the next epoch, a note for the bundle's reason or ""): the reported epoch's decay, carried
    on, × the fixed schedule's `lr_epoch_factor`, × `plateau_lr_factor` after an epoch that set no new best beyond
    noise (never after the first), × `rollback_lr_factor` at a rollback (which accumulates over the run's rollbacks:
    the restored epoch's knobs do not reset it, so each retry from the best epoch takes smaller steps)."""
    plateau = cfg.plateau_lr_factor < 1.0 and bool(view.history) and not new_best(view, cfg)[0]
    decay = view.knobs.lr_decay * cfg.schedule.lr_epoch_factor * (cfg.plateau_lr_factor if plateau else 1.0) * (
        cfg.rollback_lr_factor if rolled_back else 1.0)
    why = (f"; no new best beyond noise: learning rates × {cfg.plateau_lr_factor:g} (lr_decay "
           f"{view.knobs.lr_decay:g} → {decay:g})") if plateau else ""
    return decay, why


def rollback_target(view: FeedbackView, cfg: "FeedbackConfig") -> Rollback | None:
    """A `Rollback` when this epoch's validation per-trade Sharpe fell below the best earlier epoch's (`best_point`)
    by more than rollback_z standard errors of the difference, or when this epoch had too few validation trades to
    be selected (`FeedbackConfig.min_selection_trades`: the policy all but stopped trading, where the standard error
    of a few trades hides any fall); None otherwise (or with no history, or no earlier epoch of enough trades)."""
    if not view.history:
        return None
    best, enough = best_point(view.history, cfg.min_selection_trades)
    if not enough:
        return None
    drop = best.val_sharpe - view.val.metric("per_trade_sharpe")
    se = diff_se(view.val.sharpe_se, best.val_sharpe_se)
    if view.val.metric("n_trades") < cfg.min_selection_trades:
        return Rollback(best, drop, se, stopped=True)
    return Rollback(best, drop, se) if drop > cfg.rollback_z * se else None


@dataclass(frozen=True)
class PeerPoint:
    """An epoch of another run of the population: the run's id and the epoch's `HistoryPoint` (validation per-trade
    Sharpe, trades, its standard error, the checkpoint's sha256)."""

    run: str
    point: HistoryPoint


@dataclass(frozen=True)
class Exploit:
    """An exploit's evidence: the peer's epoch, how far its validation is above this run's best, and the noise."""

    peer: PeerPoint
    gain: float
    """peer.point.val_sharpe − this run's best validation per-trade Sharpe (un-annualized)."""
    se: float
    """Standard error of that difference."""


def rollback_reason(view: FeedbackView, rb: Rollback, cfg: "FeedbackConfig") -> str:
    """The bundle's reason for rollback `rb`: the drop against its noise, and what the trainer does about it."""
    g, s = rb.best, view.val.metric("per_trade_sharpe")
    answer = (f"restarts a fresh learner under epoch {g.epoch}'s knobs" if cfg.rollback_restart else
              f"restores epoch {g.epoch}'s weights and optimizer state, and its knobs")
    why = (f"rollback: {int(view.val.metric('n_trades'))} val trades, below the {cfg.min_selection_trades} a "
           f"checkpoint needs to be selected, where epoch {g.epoch} had {g.val_n_trades} (val per-trade Sharpe "
           f"{g.val_sharpe:.3f}): the policy all but stopped trading; the trainer {answer}") if rb.stopped else (
        f"rollback: val per-trade Sharpe {s:.3f} fell {rb.drop:.3f} below epoch {g.epoch}'s "
        f"{g.val_sharpe:.3f}, beyond {cfg.rollback_z:g}·SE = {cfg.rollback_z * rb.se:.3f}; the trainer {answer}")
    if cfg.rollback_lr_factor != 1.0:
        why += (f"; learning rates × {cfg.rollback_lr_factor:g} (lr_decay {view.knobs.lr_decay:g} → "
                f"{view.knobs.lr_decay * cfg.rollback_lr_factor:g})")
    if cfg.rollback_keep and not cfg.rollback_restart:
        why += f"; weights {cfg.rollback_keep:g}·current + {1 - cfg.rollback_keep:g}·epoch {g.epoch}'s"
    return why


def exploit_target(own: Sequence[HistoryPoint], peers: Sequence[PeerPoint], cfg: "FeedbackConfig") -> Exploit | None:
    """Population-based training's exploit step across runs: of the peers' epochs with enough validation trades to
    be selected whose validation per-trade Sharpe is above this run's best epoch's (`best_point` of `own`, this
    epoch included) by more than `population_z` standard errors of the difference, the highest; None when there is
    none (or no own epoch of enough trades, or the population switched off)."""
    if not (cfg.enabled and cfg.population and own and peers):
        return None
    mine, enough = best_point(own, cfg.min_selection_trades)
    if not enough:
        return None
    beyond = []
    for p in peers:
        gain = p.point.val_sharpe - mine.val_sharpe
        se = diff_se(p.point.val_sharpe_se, mine.val_sharpe_se)
        if p.point.val_n_trades >= cfg.min_selection_trades and gain > cfg.population_z * se:
            beyond.append(Exploit(p, gain, se))
    return max(beyond, key=lambda x: x.peer.point.val_sharpe, default=None)


# --- the fixed schedule -----------------------------------------------------------------------------------


def knobs_from_signals(sig: dict[str, Signal]) -> Knobs:
    """The `Knobs` of signals E1–E9 (E5 None = no gate), validated."""
    g = sig["E5"].value
    return Knobs(epsilon=sig["E2"].value, gamma=sig["E3"].value, q_bias=sig["E1"].value,
                 lr_scale=dict(sig["E4"].value), gate_threshold=math.inf if g is None else g,
                 priority_boost=[(int(b), float(m)) for b, m in sig["E6"].value],
                 hindsight=[(int(b), int(d)) for b, d in sig["E7"].value],
                 regime_weights=list(sig["E8"].value), regime_confidence=list(sig["E9"].value)).validate()


def fixed_signals(ids: Sequence[str], report: EvalReport, cfg: "FeedbackConfig", reason: str,
                  field: str) -> dict[str, Signal]:
    """Signals `ids` at the fixed schedule's knobs for epoch e+1 (a signal switched off, or feedback off)."""
    d = cfg.schedule.knobs(report.epoch + 1).to_dict()
    prev = report.trained_knobs().to_dict()
    prov = [Provenance(run_id=report.run_id, epoch=report.epoch, split="config", fields=[field])]
    return {i: Signal(id=i, knob=KNOB_OF[i], value=d[KNOB_OF[i]], previous=prev[KNOB_OF[i]], provenance=prov,
                      reason=reason) for i in ids}


def disabled_bundle(report: EvalReport, cfg: "FeedbackConfig", now: str) -> FeedbackBundle:
    """The bundle with feedback off: every knob from the fixed schedule for epoch e+1."""
    why = "feedback disabled (ablation)"
    sig = fixed_signals(SIGNAL_IDS, report, cfg, why, "feedback.enabled")
    knobs = replace(knobs_from_signals(sig), lr_decay=cfg.schedule.lr_decay(report.epoch + 1))
    return FeedbackBundle(run_id=report.run_id, epoch=report.epoch, for_epoch=report.epoch + 1, enabled=False,
                          reason=why, signals=sig, knobs=knobs.to_dict(), off=list(OFF_NAMES),
                          report_checkpoint_sha256=report.checkpoint_sha256, created_at=now)
