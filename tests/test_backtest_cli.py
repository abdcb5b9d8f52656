"""`tradeloop backtest` on a crafted 6-bar file whose trades are computed by hand with the documented cost
convention (shared/execution.py), and its refusals of bad POS.csv input (exit 2, file line named)."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tradeloop import cmd_backtest

TIMES = ["2024-03-01T09:00:00", "2024-03-01T10:00:00", "2024-03-01T11:00:00", "2024-03-01T12:00:00",
         "2024-03-01T13:00:00", "2024-03-01T14:00:00"]
#            open   high   low   close
OHLC = [(100.0, 101.0, 99.0, 100.0),
        (100.0, 103.0, 99.0, 102.0),
        (102.0, 106.0, 101.0, 105.0),
        (104.0, 105.0, 100.0, 101.0),
        (101.0, 102.0, 95.0, 96.0),
        (96.0, 99.0, 95.0, 98.0)]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    a = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @a.callback()
    def _root() -> None:  # keeps `backtest` a sub-command, as in tradeloop/cli.py
        pass

    cmd_backtest.register(a)
    return a


@pytest.fixture
def bars_csv(tmp_path):
    p = tmp_path / "bars.csv"
    p.write_text("timestamp,open,high,low,close,volume\n"
                 + "".join(f"{t},{o},{h},{l},{c},1000\n" for t, (o, h, l, c) in zip(TIMES, OHLC)))
    return p


def write(tmp_path, text: str, name: str = "pos.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


def invoke(app, *args):
    return CliRunner().invoke(app, ["backtest", *map(str, args)])


def test_hand_computed_flip_and_signal_exit(app, bars_csv, tmp_path):
    # long 1 decided at close 0 → fills at open 1 (100); flip to short 1 decided at close 2 → open 3 (104);
    # flat decided at close 3 → open 4 (101). 10 bps of each fill's traded notional.
    pos = write(tmp_path, f"timestamp,position\n{TIMES[0]},1\n{TIMES[2]},-1\n{TIMES[3]},0\n")
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--cost-bps", 10, "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    c = 10e-4
    # trade 1: 1/100 units bought at open 1 (100), sold at open 3 (104) by the flip; c of each fill's notional
    long_ret = 104 / 100 - 1 - c - c * 104 / 100
    # trade 2 (short): opened on the equity left, sold at 104, bought back at open 4 (101)
    short_ret = -(101 / 104 - 1) - c - c * 101 / 104
    trades = out["trades"]
    assert [(t["entry_time"], t["exit_time"], t["side"], t["size"], t["entry_price"], t["exit_price"], t["bars"],
             t["exit_reason"]) for t in trades] == [
        (TIMES[1], TIMES[3], 1, 1.0, 100.0, 104.0, 2, "flip"),
        (TIMES[3], TIMES[4], -1, 1.0, 104.0, 101.0, 1, "signal"),
    ]
    assert trades[0]["net_return"] == pytest.approx(long_ret, rel=1e-12)
    assert trades[1]["net_return"] == pytest.approx(short_ret, rel=1e-12)

    m = out["metrics"]
    assert m["n_trades"] == 2
    assert m["total_return"] == pytest.approx((1 + long_ret) * (1 + short_ret) - 1, rel=1e-12)
    assert m["per_trade_sharpe"] == pytest.approx(statistics.mean([long_ret, short_ret])
                                                  / statistics.stdev([long_ret, short_ret]), rel=1e-9)
    assert m["win_rate"] == pytest.approx(sum(r > 0 for r in (long_ret, short_ret)) / 2)
    assert m["mean_bars_held"] == pytest.approx(1.5)
    # positions held at the closes of bars 0..5: 0, 1, 1, −1, 0, 0
    assert m["exposure"] == pytest.approx(3 / 6)
    assert m["turnover"] == pytest.approx((0 + 1 + 0 + 2 + 1 + 0) / 6)
    for k in ("per_bar_sharpe", "max_drawdown", "profit_factor", "exposure", "turnover", "sortino", "psr", "dsr"):
        assert math.isfinite(m[k]), k


def test_held_target_and_end_exit(app, bars_csv, tmp_path):
    # no row before bar 3 → flat; 0.5 long from close 3 held (no further rows) to the last close
    pos = write(tmp_path, f"timestamp,position\n{TIMES[3]},0.5\n")
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--cost-bps", 10, "--slippage-bps", 10, "--json")
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.stdout)["trades"]
    c = 20e-4
    # 0.5/101 units bought at open 4 (101), held to the last close (98): c of each fill's notional
    expected = 0.5 * (98 / 101 - 1) - c * 0.5 - c * 0.5 * 98 / 101
    assert (t["entry_time"], t["exit_time"], t["side"], t["size"], t["exit_price"], t["bars"], t["exit_reason"]) \
        == (TIMES[4], TIMES[5], 1, 0.5, 98.0, 2, "end")
    assert t["net_return"] == pytest.approx(expected, rel=1e-12)


def test_fixed_fee_and_borrow(app, bars_csv, tmp_path):
    # short 1 decided at close 0 → sells 1/100 units at open 1 (100); flat decided at close 2 → buys back at open 3
    # (104). Held short at closes 1 (102) and 2 (105): borrow 876.6 bps a year over 8 766 bars a year = 0.1 bp a bar
    pos = write(tmp_path, f"timestamp,position\n{TIMES[0]},-1\n{TIMES[2]},0\n")
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--cost-bps", 0, "--fee", 1e-3, "--borrow-bps", 876.6,
                 "--bars-per-year", 8766, "--json")
    assert res.exit_code == 0, res.output
    (t,) = json.loads(res.stdout)["trades"]
    assert t["net_return"] == pytest.approx(-(104 / 100 - 1) - 2e-3 - 1e-5 * (102 + 105) / 100, rel=1e-12)
    # by default the bars a year are the data's own: 6 hourly bars span 5 hours → 5 / (5 / 8766) = 8 766 here too
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--cost-bps", 0, "--fee", 1e-3, "--borrow-bps", 876.6,
                 "--json")
    assert json.loads(res.stdout)["trades"][0]["net_return"] == pytest.approx(t["net_return"], rel=1e-9)
    for flag, value in (("--fee", -1), ("--borrow-bps", "nan"), ("--bars-per-year", 0)):
        bad = invoke(app, "--data", bars_csv, "--positions", pos, flag, value)
        assert bad.exit_code == 2 and flag in bad.output


def test_table_output(app, bars_csv, tmp_path):
    pos = write(tmp_path, f"timestamp,position\n{TIMES[0]},-1\n")
    res = invoke(app, "--data", bars_csv, "--positions", pos)
    assert res.exit_code == 0, res.output
    assert "per_trade_sharpe" in res.stdout and "trades (1)" in res.stdout


@pytest.mark.parametrize("text, where", [
    ("time,pos\n2024-03-01T09:00:00,1\n", ["line 1", "timestamp"]),
    (f"timestamp,position\n{TIMES[0]},1\n{TIMES[1]},abc\n", ["line 3", "position", "abc"]),
    (f"timestamp,position\n{TIMES[0]},1.5\n", ["line 2", "position", "[-1, 1]"]),
    (f"timestamp,position\n{TIMES[0]},nan\n", ["line 2", "position", "not a finite number"]),
    ("timestamp,position\nyesterday,1\n", ["line 2", "timestamp", "yesterday"]),
    (f"timestamp,position\n{TIMES[2]},1\n{TIMES[1]},0\n", ["line 3", "earlier than line 2"]),
    (f"timestamp,position\n{TIMES[1]},1\n{TIMES[1]},0\n", ["line 3", "duplicates line 2"]),
    (f"timestamp,position\n{TIMES[0]},1\n\n2024-03-01T09:30:00,0\n", ["line 4", "not a bar of the data"]),
    ("timestamp,position\n", ["no position rows"]),
])
def test_bad_positions_exit_2_naming_the_line(app, bars_csv, tmp_path, text, where):
    pos = write(tmp_path, text)
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--json")
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    for w in where:
        assert w in res.stderr, (w, res.stderr)
    assert str(pos) in res.stderr
    assert "Traceback" not in res.output


def test_bad_data_and_missing_files_exit_2(app, bars_csv, tmp_path):
    pos = write(tmp_path, f"timestamp,position\n{TIMES[0]},1\n")
    res = invoke(app, "--data", bars_csv, "--positions", tmp_path / "nope.csv")
    assert res.exit_code == 2 and "nope.csv" in res.stderr
    bad = write(tmp_path, "timestamp,open,high,low,close\n2024-03-01T09:00:00,100,99,98,100\n"
                          "2024-03-01T10:00:00,100,101,99,100\n", "badbars.csv")
    res = invoke(app, "--data", bad, "--positions", pos)
    assert res.exit_code == 2 and "badbars.csv" in res.stderr and "Traceback" not in res.output
    res = invoke(app, "--data", bars_csv, "--positions", pos, "--cost-bps", -1)
    assert res.exit_code == 2 and "--cost-bps" in res.stderr
    for option in ("--max-trades", "--seed"):
        res = invoke(app, "--data", bars_csv, "--positions", pos, option, -1)
        assert res.exit_code == 2 and option in res.output and "Traceback" not in res.output


def test_real_cli_entry_point(bars_csv, tmp_path):
    """The installed command line, as a process: daily data prints dates as in the input; bad input → exit 2."""
    daily = write(tmp_path, "Date,Open,High,Low,Close\n2020-01-02,10,11,9,10\n2020-01-03,10,12,10,11\n"
                            "2020-01-06,11,12,10,12\n", "daily.csv")
    pos = write(tmp_path, "timestamp,position\n2020-01-02,1\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "tradeloop.cli", "backtest", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    ok = run("--data", daily, "--positions", pos, "--cost-bps", 0, "--json")
    assert ok.returncode == 0, ok.stderr
    assert "Warning" not in ok.stderr                # bars read from a file are read-only arrays: torch is not told
    (t,) = json.loads(ok.stdout)["trades"]
    assert (t["entry_time"], t["exit_time"], t["exit_reason"]) == ("2020-01-03", "2020-01-06", "end")
    assert t["net_return"] == pytest.approx(12 / 10 - 1)
    bad = run("--data", daily, "--positions", write(tmp_path, "timestamp,position\n2020-01-02,2\n", "p2.csv"))
    assert bad.returncode == 2 and "line 2" in bad.stderr and "Traceback" not in bad.stderr
