"""`tradeloop data check`: one summary line on good data; exit 2 naming file, row and rule on bad data."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from tradeloop.cli import app

HEADER = "timestamp,open,high,low,close,volume\n"
GOOD = ["2021-01-04,100,101,99,100.5,10", "2021-01-05,100.5,102,100,101,12", "2021-01-06,101,103,100.5,102,9"]


def _rows(*replace: tuple[int, str]) -> str:
    rows = list(GOOD)
    for i, row in replace:
        rows[i] = row
    return HEADER + "\n".join(rows) + "\n"


# (name, file text, line named in the error, rule)   — line numbers: header = line 1
BAD_CSV = [
    ("unsorted", _rows((2, "2021-01-03,101,103,100.5,102,9")), 4, "unsorted_timestamp"),
    ("duplicate_ts", _rows((2, "2021-01-05,101,103,100.5,102,9")), 4, "duplicate_timestamp"),
    ("zero_price", _rows((1, "2021-01-05,100.5,102,0,101,12")), 3, "non_positive_price"),
    ("negative_price", _rows((0, "2021-01-04,-100,101,-101,100.5,10")), 2, "non_positive_price"),
    ("high_below_open", _rows((1, "2021-01-05,100.5,100.4,100,100.3,12")), 3, "high_below_open_close"),
    ("high_below_close", _rows((2, "2021-01-06,101,101.5,100.5,102,9")), 4, "high_below_open_close"),
    ("low_above_open", _rows((1, "2021-01-05,100.5,102,100.7,101,12")), 3, "low_above_open_close"),
    ("low_above_close", _rows((0, "2021-01-04,100,101,100.6,100.5,10")), 2, "low_above_open_close"),
    ("nan_cell", _rows((1, "2021-01-05,100.5,102,NaN,101,12")), 3, "nan"),
    ("empty_cell", _rows((2, "2021-01-06,101,103,100.5,,9")), 4, "nan"),
    ("inf_cell", _rows((1, "2021-01-05,100.5,inf,100,101,12")), 3, "infinite"),
    ("non_numeric", _rows((2, "2021-01-06,101,103,abc,102,9")), 4, "non_numeric"),
    ("bad_timestamp", _rows((1, "2021-13-45,100.5,102,100,101,12")), 3, "unparseable_timestamp"),
    ("negative_volume", _rows((2, "2021-01-06,101,103,100.5,102,-9")), 4, "negative_volume"),
    ("far_future", _rows((2, "9999-12-31,101,103,100.5,102,9")), 4, "timestamp_out_of_range"),
    ("before_1677", _rows((0, "1600-01-04,100,101,99,100.5,10")), 2, "timestamp_out_of_range"),
]
FILE_LEVEL = [
    ("missing_column", "timestamp,open,high,close\n2021-01-04,1,2,1.5\n", "missing_column", "missing column 'low'"),
    ("no_time_column", "open,high,low,close\n1,2,0.5,1.5\n", "missing_column", "missing column 'timestamp'"),
    ("empty_file", "", "empty_file", "empty"),
    ("header_only", HEADER, "no_rows", "no data rows"),
    ("duplicate_column", "Date,Open,High,Low,Close,open\n2021-01-04,1,2,0.5,1.5,1\n", "duplicate_column",
     "column 'Open' appears more than once"),
    ("ragged_row", HEADER + GOOD[0] + ",7\n", "wrong_field_count", "ragged_row.csv:2: 7 fields, but the header has 6"),
    ("short_row", _rows((1, "2021-01-05,100.5,102")), "wrong_field_count", "short_row.csv:3: 3 fields"),
]

runner = CliRunner()


def _check(path: Path):
    return runner.invoke(app, ["data", "check", str(path)])


@pytest.mark.parametrize("name,text,line,rule", BAD_CSV, ids=[c[0] for c in BAD_CSV])
def test_bad_rows_exit_2_naming_line_and_rule(tmp_path, name, text, line, rule):
    p = tmp_path / f"{name}.csv"
    p.write_text(text)
    res = _check(p)
    assert res.exit_code == 2, res.output
    assert f"{p}:{line}:" in res.stderr and f"[{rule}]" in res.stderr
    # exactly one problem is planted per file (the negative-price row plants two: open and low)
    assert res.stderr.count(f"{p}:") == (2 if name == "negative_price" else 1), res.stderr
    assert "Traceback" not in res.output and res.stdout == ""


def test_a_row_missing_its_close_or_open_has_its_other_price_rules_checked_too(tmp_path):
    p = tmp_path / "gaps.csv"
    p.write_text(_rows((0, "2021-01-04,100,101,99,,10"), (1, "2021-01-05,100.5,99,100,abc,12"),
                       (2, "2021-01-06,,99,100,,9")))
    res = _check(p)
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert any(f"{p}:2:" in x and "[nan]" in x for x in lines)                        # row 2: only its close
    assert not any(f"{p}:2:" in x and "[nan]" not in x for x in lines)
    assert any(f"{p}:3:" in x and "high below max(open, close) (high=99, open=100.5" in x for x in lines)
    assert any(f"{p}:4:" in x and "high below low (high=99, low=100) [high_below_low]" in x for x in lines)
    assert "Traceback" not in res.output


@pytest.mark.parametrize("name,text,rule,phrase", FILE_LEVEL, ids=[c[0] for c in FILE_LEVEL])
def test_file_level_problems_exit_2(tmp_path, name, text, rule, phrase):
    p = tmp_path / f"{name}.csv"
    p.write_text(text)
    res = _check(p)
    assert res.exit_code == 2 and f"[{rule}]" in res.stderr and phrase in res.stderr and str(p) in res.stderr
    assert "Traceback" not in res.output


def test_blank_lines_keep_editor_line_numbers(tmp_path):
    p = tmp_path / "blank.csv"
    p.write_text(HEADER + GOOD[0] + "\n\n\n" + "2021-01-05,100.5,102,100,101,oops\n")
    res = _check(p)
    assert res.exit_code == 2 and f"{p}:5: column 'volume': non-numeric value 'oops' [non_numeric]" in res.stderr


def test_non_utf8_cell_is_reported_not_crashed(tmp_path):
    p = tmp_path / "latin.csv"
    p.write_bytes((HEADER + GOOD[0] + "\n2021-01-05,100.5,102,100,101\xe9,12\n").encode("latin-1"))
    res = _check(p)
    assert res.exit_code == 2 and f"{p}:3: column 'close': non-numeric value '101\xe9' [non_numeric]" in res.stderr


def test_missing_file_and_unknown_name(tmp_path):
    res = runner.invoke(app, ["data", "check", str(tmp_path / "nope.csv")])
    assert res.exit_code == 2 and "file_not_found" in res.stderr and "synthetic, sp500, eurusd" in res.stderr


def test_parquet_rows_are_0_based(tmp_path):
    df = pd.DataFrame({"Date": pd.date_range("2021-01-04", periods=3, freq="D"),
                       "Open": [1.0, 2.0, 3.0], "High": [2.0, 1.5, 4.0], "Low": [0.5, 1.0, 2.0], "Close": [1.5, 1.8, 3.5]})
    p = tmp_path / "bad.parquet"
    df.to_parquet(p)
    res = _check(p)
    assert res.exit_code == 2
    assert f"{p}: row 1: column 'high': high below max(open, close) (high=1.5, open=2, close=1.8)" in res.stderr
    df["Close"] = ["1.5", "1.8", "n/a?"]  # a text column in Parquet: the bad cell is named too
    df["High"] = [2.0, 2.0, 4.0]
    df.to_parquet(p)
    res = _check(p)
    assert res.exit_code == 2 and res.stderr.count(f"{p}:") == 1
    assert f"{p}: row 2: column 'close': non-numeric value 'n/a?' [non_numeric]" in res.stderr


def test_good_inputs_print_one_summary_line(tmp_path):
    res = runner.invoke(app, ["data", "check", "sp500"])
    assert res.exit_code == 0
    assert res.stdout == "sp500: 5031 bars, 1999-01-04 → 2018-12-31, interval 1 day (median), 5 columns ok\n"
    p = tmp_path / "mine.csv"
    p.write_text("Date,Open,High,Low,Close\n" + "\n".join(
        f"2021-02-01 {h:02d}:00,1,2,0.5,1.5" for h in range(0, 24, 4)) + "\n")
    res = _check(p)
    assert res.exit_code == 0
    assert res.stdout.strip() == ("mine: 6 bars, 2021-02-01 00:00 → 2021-02-01 20:00, interval 4 hours (median), "
                                  "4 columns ok (no volume)")
    res = runner.invoke(app, ["data", "check", "synthetic", "--seed", "3"])
    assert res.exit_code == 0 and res.stdout.startswith("synthetic: 6000 bars, ") and "interval 1 hour" in res.stdout
    ms = tmp_path / "ticks.csv"
    ms.write_text("timestamp,open,high,low,close\n" + "\n".join(
        f"2021-02-01 00:00:0{i // 2}.{5 * (i % 2)},1,2,0.5,1.5" for i in range(6)) + "\n")
    res = _check(ms)
    assert res.exit_code == 0 and "interval 500 ms (median)" in res.stdout, res.stdout
    assert runner.invoke(app, ["data", "check", "synthetic", "--seed", "-1"]).exit_code == 2


def test_real_subprocess_exit_code_and_no_traceback(tmp_path):
    p = tmp_path / "sub.csv"
    p.write_text(_rows((1, "2021-01-05,100.5,99,100,101,12")))
    exe = Path(sys.executable).parent / "tradeloop"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tradeloop.cli"]
    proc = subprocess.run([*cmd, "data", "check", str(p)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{p}:3:" in proc.stderr and "[high_below_open_close]" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_yyyymmdd_dates_are_dates_and_tiny_integers_are_refused(tmp_path):
    p = tmp_path / "ymd.csv"
    p.write_text("date,open,high,low,close\n20200101,1,2,0.5,1\n20200102,1,2,0.5,1\n20200103,1,2,0.5,1\n")
    res = _check(p)
    assert res.exit_code == 0 and res.stdout.startswith("ymd: 3 bars, 2020-01-01 → 2020-01-03, interval 1 day"), \
        res.output
    p = tmp_path / "tiny.csv"
    p.write_text("timestamp,open,high,low,close\n1,1,2,0.5,1\n2,1,2,0.5,1\n")
    res = _check(p)
    assert res.exit_code == 2 and f"{p}:2: column 'timestamp': cannot parse timestamp '1' [unparseable_timestamp]" \
        in res.stderr and "Traceback" not in res.output


def test_out_of_range_parquet_timestamp_exit_2(tmp_path):
    df = pd.DataFrame({"Date": pd.Series(["2021-01-04", "9999-01-01"], dtype="datetime64[s]"),
                       "Open": [1.0, 2.0], "High": [2.0, 3.0], "Low": [0.5, 1.0], "Close": [1.5, 2.5]})
    p = tmp_path / "far.parquet"
    df.to_parquet(p)
    res = _check(p)
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"{p}: row 1: column 'Date': timestamp '9999-01-01 00:00:00' is outside" in res.stderr
    assert "[timestamp_out_of_range]" in res.stderr


def test_utf16_csv_is_read_and_utf16_without_bom_is_named(tmp_path):
    p = tmp_path / "u16.csv"
    p.write_bytes(_rows((2, "2021-01-06,101,103,100.5,102,oops")).replace("\n", "\r\n").encode("utf-16"))
    res = _check(p)
    assert res.exit_code == 2 and f"{p}:4: column 'volume': non-numeric value 'oops' [non_numeric]" in res.stderr
    p.write_bytes(_rows().encode("utf-16"))
    res = _check(p)
    assert res.exit_code == 0 and res.stdout.startswith("u16: 3 bars, 2021-01-04 → 2021-01-06"), res.output
    p.write_bytes(_rows().encode("utf-16-le"))
    res = _check(p)
    assert res.exit_code == 2 and f"{p}:1: contains NUL bytes" in res.stderr and "[unsupported_encoding]" in res.stderr
    assert "Traceback" not in res.output
