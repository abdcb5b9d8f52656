"""What `tradeloop up` prints while a run is up: validation per epoch, and OOS only for the checkpoint validation
selects (the dashboard's test-set discipline), by the selection rule of `shared.metrics.select_best`."""
from __future__ import annotations

from rich.console import Console

from shared.runview import report_rows
from tradeloop.up.progress import Progress


def _snapshot() -> dict:
    reports = report_rows([
        {"epoch": 1, "val_per_trade_sharpe": 0.20, "val_n_trades": 40, "val_dsr": 0.6, "oos_per_trade_sharpe": 0.7771},
        {"epoch": 2, "val_per_trade_sharpe": 0.90, "val_n_trades": 4, "val_dsr": 0.7, "oos_per_trade_sharpe": 0.7772},
        {"epoch": 3, "val_per_trade_sharpe": 0.35, "val_n_trades": 12345, "val_dsr": 0.9,
         "oos_per_trade_sharpe": 0.7773},
    ])
    history = [{"epoch": e, "loss": 1.0 / e, "epsilon": 0.3, "gamma": 0.98, "bundle_epoch": e - 1 or None}
               for e in (1, 2, 3)]
    return {"history": history, "reports": reports, "signals": []}


def test_a_line_per_epoch_says_validation_and_never_the_test_result(capsys):
    p = Progress({}, epochs=3, live=False)
    try:
        p.snapshot = _snapshot()
        p._print_events()
    finally:
        p.client.close()
    out = capsys.readouterr().out
    assert "epoch 3 evaluated: val per-trade Sharpe 0.35 over 12345 trades, DSR 0.9" in out
    assert "OOS" not in out and "0.7771" not in out and "0.7773" not in out


def test_the_live_table_shows_oos_for_the_selected_checkpoint_alone():
    p = Progress({}, epochs=3, live=False)
    try:
        p.snapshot = _snapshot()
        console = Console(record=True, width=200)
        console.print(p.render())
    finally:
        p.client.close()
    text = console.export_text()
    # epoch 2 validates highest but on 4 trades: epoch 3 is selected (≥ 10 trades), and its OOS alone is shown
    assert "0.7773" in text and "0.7771" not in text and "0.7772" not in text, text
    assert "12345" in text and "OOS S/trade (selected)" in text
