"""What `tradeloop up` prints while a run is up: validation per epoch, and OOS only for the checkpoint validation
selects (the dashboard's test-set discipline), by the selection rule of `shared.metrics.select_best`."""
from __future__ import annotations

import re

import pytest
from rich.console import Console

from shared.report import OFF_NAMES
from shared.runview import report_rows, report_summary
from tradeloop.up.progress import Progress, dead_letter_line, new_dead_letters


def _report(val_sharpe: float, val_trades: float, dsr: float, oos_sharpe: float) -> dict:
    """A stored report's headline: its metrics as the evaluator stores them (floats, the trade count too)."""
    return {"val": {"metrics": {"per_trade_sharpe": val_sharpe, "n_trades": val_trades, "dsr": dsr}},
            "oos": {"metrics": {"per_trade_sharpe": oos_sharpe, "n_trades": 77.0}}}


def _snapshot() -> dict:
    docs = {1: _report(0.20, 40.0, 0.6, 0.7771), 2: _report(0.90, 4.0, 0.7, 0.7772),
            3: _report(0.35, 12345.0, 0.9, 0.7773)}
    reports = report_rows([report_summary(e, d) for e, d in docs.items()])       # the evaluator's /reports rows
    history = [{"epoch": e, "loss": 1.0 / e, "epsilon": 0.3, "gamma": 0.98, "bundle_epoch": e - 1 or None}
               for e in (1, 2, 3)]
    signals = [{"epoch": 1, "enabled": True, "off": list(OFF_NAMES),           # the default: every act off
                "knobs": {"epsilon": 0.265, "gamma": 0.98, "q_bias": 0.0}},
               {"epoch": 2, "enabled": True, "off": ["E1"], "rollback": True,
                "knobs": {"epsilon": 0.45, "gamma": 0.98, "q_bias": 0.0}},
               {"epoch": 3, "enabled": False, "off": [], "knobs": {"epsilon": 0.2, "gamma": 0.98, "q_bias": 0.0}}]
    return {"history": history, "reports": reports, "signals": signals}


def test_a_line_per_epoch_says_validation_and_never_the_test_result(capsys):
    p = Progress({}, epochs=3, live=False)
    try:
        p.snapshot = _snapshot()
        p._print_events()
    finally:
        p.client.close()
    out = capsys.readouterr().out
    assert "epoch 3 evaluated: val per-trade Sharpe 0.35 over 12345 trades, DSR 0.9" in out
    fixed = "feedback (all off: the fixed schedule)"
    assert f"epoch 1 {fixed}: ε 0.265, γ 0.98" in out and f"epoch 3 {fixed}: ε 0.2" in out
    assert "epoch 2 feedback: ε 0.45, γ 0.98, q_bias 0 ROLLBACK" in out
    assert "OOS" not in out and "0.7771" not in out and "0.7773" not in out
    # the epochs that come at once (a resumed run's earlier ones) in epoch order: trained, evaluated, feedback
    order = [re.match(r"epoch (\d+)(?:/3)? (\w+)", line).groups() for line in out.splitlines()]
    assert order == [(str(e), part) for e in (1, 2, 3) for part in ("trained", "evaluated", "feedback")]


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


@pytest.mark.redis
def test_dead_letters_are_read_in_order_after_the_last_seen_and_said_in_words(redis_url, run_id):
    import redis

    from shared.events import DeadLetter, encode_event, stream_name

    r = redis.Redis.from_url(redis_url)
    try:
        ids = [r.xadd(stream_name(run_id, "dead"), encode_event(DeadLetter(
                   run_id=run_id, epoch=e, original_stream=stream_name(run_id, "checkpoints"), entry_id=f"{e}-0",
                   group="evaluators", consumer="evaluator-1", reason=f"CheckpointError: epoch {e} sha256 mismatch",
                   deliveries=5))).decode() for e in (2, 3)]
        r.xadd(stream_name(run_id, "dead"), {"data": "{not json"})
    finally:
        r.close()
    got = new_dead_letters(redis_url, run_id)
    assert [i for i, _ in got][:2] == ids and len(got) == 3
    assert dead_letter_line(got[0][1]) == ("dead letter: the checkpoints message of epoch 2 given up by "
                                          "evaluators/evaluator-1 after 5 deliveries: CheckpointError: epoch 2 "
                                          "sha256 mismatch")
    assert "an unknown epoch" in dead_letter_line(got[2][1]) and "undecodable" in got[2][1]["reason"]
    after = new_dead_letters(redis_url, run_id, ids[0])                   # only those stored after the last seen
    assert [i for i, _ in after] == [i for i, _ in got[1:]]
    assert new_dead_letters(redis_url, run_id, got[-1][0]) == []
    assert new_dead_letters(redis_url, "another-run") == []


@pytest.mark.redis
def test_the_launchers_poll_reads_both_checks_through_one_connection(redis_url, run_id):
    import json

    import redis

    from shared.api import trainer_history_key
    from shared.store import run_key
    from tradeloop.up.progress import loop_done, redis_client

    admin = redis.Redis.from_url(redis_url)
    accepted = lambda: admin.info("stats")["total_connections_received"]   # noqa: E731
    try:
        n0 = accepted()
        with redis_client(redis_url) as watch:
            polls = [(loop_done(watch, run_id, 2), new_dead_letters(watch, run_id)) for _ in range(5)]
            assert polls == [(False, [])] * 5
            assert accepted() - n0 == 1                             # five seconds of the poll: one connection
            admin.hset(trainer_history_key(run_id), "2", json.dumps({"epoch": 2}))
            admin.set(run_key(run_id, "report", 2), "{}")
            assert not loop_done(watch, run_id, 2)                  # the bundle is still missing
            admin.set(run_key(run_id, "bundle", 2), "{}")
            assert loop_done(watch, run_id, 2)
            assert watch.ping()                                     # the caller's client is left open
        n1 = accepted()
        assert loop_done(redis_url, run_id, 2) and new_dead_letters(redis_url, run_id) == []
        assert accepted() - n1 == 2                                 # by URL: a connection a check
    finally:
        admin.close()
