"""The best epoch the feedback compares with — for a rollback, E2's new best and stagnation, the plateau decay — is
the one the run's selection would pick (`fallbacks.best_point`), and a policy that all but stops trading is rolled
back though no standard error of its few trades shows the fall."""
from __future__ import annotations

from test_signals import CFG, at

from services.feedback.signals import FeedbackConfig, compute_bundle


def test_a_policy_that_all_but_stops_trading_is_rolled_back():
    """0, 1 or 2 validation trades after epochs of enough: a Sharpe of a few trades has an infinite or huge
    standard error, so no drop is beyond it; the epoch cannot be selected either, and the rollback takes the best."""
    from shared.metrics import MIN_SELECTION_TRADES

    hist = [at(1, 0.8, n=40), at(2, 0.9, n=40)]
    for n in (0, 2, MIN_SELECTION_TRADES - 2):
        b = compute_bundle(at(3, -0.5, n=n), hist, CFG, now="t")
        assert b.rollback and b.rollback_to_epoch == 2, (n, b.reason)
        assert f"rollback: {n} val trades, below the {MIN_SELECTION_TRADES}" in b.reason and "stopped" in b.reason
    assert not compute_bundle(at(3, 0.7, n=40), hist, CFG, now="t").rollback     # enough trades, within noise


def test_a_new_best_and_stagnation_are_judged_against_the_epoch_selection_would_pick():
    """The best earlier epoch E2 and the plateau decay compare with is the one the rollback and the selection pick
    (`best_point`): an epoch of 4 trades at Sharpe 3 does not count while others have enough."""
    from services.feedback.fallbacks import new_best
    from services.feedback.guard import build_view
    from services.feedback.fallbacks import is_stagnant

    hist = [at(1, 3.0, n=4), at(2, 0.5, n=60)]
    v = build_view(at(3, 0.55, n=60), hist)
    assert new_best(v, CFG)[1].epoch == 2
    v = build_view(at(4, 0.45, n=60), [*hist, at(3, 0.5, n=60)])
    assert not is_stagnant(v, 0.45, v.val.sharpe_se, FeedbackConfig(patience=2))   # within noise of epoch 2's 0.5


def test_the_rollback_chooses_among_the_epochs_a_studys_selection_could_choose():
    """`min_selection_trades`: a study's threshold (20 validation trades by default) rules the feedback's choices
    too — an epoch of 15 trades is no rollback target and counts as too few to be selected, where the product's
    default (10) takes it; a study passes its own `min_val_trades`, and its stored config hashes stay as they were."""
    from dataclasses import replace

    from shared.metrics import MIN_SELECTION_TRADES
    from tradeloop.study.spec import StudySpec, Variant

    hist = [at(1, 0.9, n=15), at(2, 0.4, n=40)]
    own = compute_bundle(at(3, -0.5, n=15), hist, CFG, now="t")
    assert own.rollback and own.rollback_to_epoch == 1 and not own.reason.startswith("rollback: 15 val trades")
    study = compute_bundle(at(3, -0.5, n=15), hist, replace(CFG, min_selection_trades=20), now="t")
    assert study.rollback and study.rollback_to_epoch == 2
    assert study.reason.startswith("rollback: 15 val trades, below the 20 a checkpoint needs to be selected")
    spec = StudySpec(dataset="synthetic", variants=(Variant("on", ()), Variant("off", (("feedback.enabled", False),))),
                     seeds=[0], folds=1, epochs=2)
    assert spec.configs(spec.variant("on"), 14)[1].min_selection_trades == spec.min_val_trades == 20
    assert "min_selection_trades" not in spec.resolved_doc(spec.variant("on"))[1]
    assert CFG.min_selection_trades == MIN_SELECTION_TRADES and "min_selection_trades" not in CFG.to_dict()
