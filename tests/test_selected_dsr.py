"""The DSR of a study run's selected checkpoint (`tradeloop.study.loop.evaluate_selected`) is deflated by every epoch
it was chosen among, not by the epochs up to it (the DSR an epoch's own record holds, as of that epoch)."""
from __future__ import annotations

import pytest

from services.feedback.signals import FeedbackConfig
from shared.market import walk_forward_folds
from shared.metrics import dsr, trials_variance
from shared.synthetic import generate
from tests.test_train import tiny_config
from tradeloop.study.loop import evaluate_selected, run_closed_loop


def test_the_selected_checkpoints_dsr_is_deflated_by_every_epoch_of_the_run(tmp_path):
    bars = generate(3000, seed=0).bars
    split = walk_forward_folds(len(bars), n_folds=1)[0]
    recs = run_closed_loop(bars, "synthetic", tmp_path / "r", 3, config=tiny_config(),
                           feedback=FeedbackConfig(enabled=False), split=split, seed=0)
    sharpes = [r["history"]["val_sharpe"] for r in recs]
    trades = [r["history"]["val_n_trades"] for r in recs]
    chosen = evaluate_selected(tmp_path / "r", 2, recs, bars=bars, split=split, dataset="synthetic")
    assert chosen["val"]["per_trade_sharpe"] == pytest.approx(sharpes[1])          # the same backtest again
    want = dsr(recs[1]["val_trade_returns"], n_trials=3, sharpe_var_trials=trials_variance(sharpes, trades))
    assert chosen["val"]["dsr"] == pytest.approx(want, abs=1e-12)
    # the record's own: as of epoch 2, deflated by epochs 1 and 2
    own = dsr(recs[1]["val_trade_returns"], n_trials=2, sharpe_var_trials=trials_variance(sharpes[:2], trades[:2]))
    assert recs[1]["val"]["dsr"] == pytest.approx(own, abs=1e-12)
    assert trades[1] >= 20 and want < own - 1e-5                                     # deflated further
