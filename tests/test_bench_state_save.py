"""bench/state_save.py: the trainer state written with the replay's integers narrowed against int64, and an epoch's close
with the backtest after the write and beside it, side by side."""
from __future__ import annotations

from bench import state_save


def test_the_narrowed_state_file_is_smaller_and_the_table_names_what_was_narrowed(capsys):
    state_save.main(["--preset", "small", "--bars", "3000", "--repeat", "1"])
    out = capsys.readouterr().out
    assert "replay integers written as: bar int16, action int8, regime int8" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| int64") or line.startswith("| narrowed")]
    assert len(rows) == 2
    wide_mb, narrow_mb = float(rows[0][4]), float(rows[1][4])
    assert narrow_mb < wide_mb
    closes = [line.split("|") for line in out.splitlines()
              if line.startswith("| written, then") or line.startswith("| the backtest while")]
    assert len(closes) == 2 and float(closes[0][3]) == 1.0
    assert all(float(c[2]) > 0 and float(c[4]) > 0 for c in closes)        # a close, and the backtest inside it
    assert all(float(c[2]) >= float(c[4]) for c in closes)
