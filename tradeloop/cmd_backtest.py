"""`tradeloop backtest`: replay a target-position series through the one simulator and report trades and metrics.

    tradeloop backtest --data FILE|NAME --positions POS.csv [--cost-bps X] [--slippage-bps Y] [--fee F]
                       [--borrow-bps B] [--bars-per-year N] [--json]

POS.csv has the columns `timestamp,position` (extra columns are ignored). Each row sets the target position
(a signed fraction of equity in [-1, 1]) decided at the close of the bar with that timestamp; it fills at the
next bar's open (shared/execution.py): the fill buys or sells units worth that fraction of equity, and the units
are held until the target changes. Bars without a row hold the previous target; bars before the first row
are flat. Every timestamp must be one of the data's bars, rows must be in increasing time order.

Costs: `--cost-bps` + `--slippage-bps` of each fill's traded notional, `--fee` per fill (in units of the starting
equity, 1), `--borrow-bps` a year of a short's notional, charged at each close it is held (per bar: divided by
`--bars-per-year`, by default the data's own: its bars over the years it spans).

Output: a rich table (default), or with `--json` one JSON object `{"trades": [...], "metrics": {...}}` on stdout.
A trade has entry_time (the bar whose open filled the entry), exit_time (the bar of the exit fill: its open for
"signal"/"flip", inside it for "stop"/"target", its close for "end"), side (+1/-1), size, entry_price,
exit_price, net_return (costs included), bars, exit_reason. Times are ISO 8601 text in the style of the data
file (date only for daily bars). Metrics are those of shared/metrics.py (un-annualized Sharpes; see there).

Bad input (missing file, bad POS.csv line, bad data) prints a message naming the file, line and column to
stderr and exits with code 2.
"""
from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

MAX_PROBLEMS = 20
"""At most this many problems of POS.csv are listed in one error message."""


class PositionsError(ValueError):
    """POS.csv is unusable; `.problems` lists 'file line N, column C: message' strings."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = "" if len(problems) <= MAX_PROBLEMS else f"\n  … and {len(problems) - MAX_PROBLEMS} more"
        super().__init__("\n  ".join(["bad positions file:"] + problems[:MAX_PROBLEMS]) + more)


@dataclass(frozen=True)
class PositionRow:
    line: int
    """Line number in the file (the header is line 1)."""
    text: str
    """The timestamp exactly as written."""
    timestamp: object
    """pandas.Timestamp."""
    position: float


def read_positions(path: Path) -> list[PositionRow]:
    """Parse and validate POS.csv (columns timestamp, position); raise PositionsError naming each bad line."""
    import pandas as pd

    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            rows, lines = [], []
            for row in reader:
                rows.append(row)
                lines.append(reader.line_num)  # the file line where this record ends
    except OSError as exc:
        raise PositionsError([f"{path}: cannot read ({exc.strerror or exc})"]) from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise PositionsError([f"{path}: not a UTF-8 CSV file ({exc})"]) from None
    if not rows:
        raise PositionsError([f"{path}: empty file; expected a header 'timestamp,position'"])
    header = [h.strip().lower() for h in rows[0]]
    missing = [c for c in ("timestamp", "position") if c not in header]
    if missing:
        raise PositionsError([f"{path} line 1: missing column(s) {', '.join(missing)}; "
                              f"expected a header 'timestamp,position', got {','.join(rows[0])!r}"])
    i_ts, i_pos = header.index("timestamp"), header.index("position")
    problems: list[str] = []
    out: list[PositionRow] = []
    for line, row in zip(lines[1:], rows[1:]):
        if not row or all(not c.strip() for c in row):
            continue  # blank line
        where = f"{path} line {line}"
        if len(row) <= max(i_ts, i_pos):
            problems.append(f"{where}: expected {len(header)} fields, got {len(row)}")
            continue
        text, ptext = row[i_ts].strip(), row[i_pos].strip()
        try:
            ts = pd.Timestamp(text)
            if pd.isna(ts):
                raise ValueError
        except (ValueError, TypeError):
            problems.append(f"{where}, column timestamp: {text!r} is not an ISO 8601 timestamp")
            continue
        try:
            pos = float(ptext)
        except ValueError:
            problems.append(f"{where}, column position: {ptext!r} is not a number")
            continue
        if not math.isfinite(pos):
            problems.append(f"{where}, column position: {ptext!r} is not a finite number")
            continue
        if not -1.0 <= pos <= 1.0:
            problems.append(f"{where}, column position: {ptext} is outside [-1, 1]")
            continue
        if out and ts <= out[-1].timestamp:
            what = "duplicates" if ts == out[-1].timestamp else "is earlier than"
            problems.append(f"{where}, column timestamp: {text} {what} line {out[-1].line} ({out[-1].text}); "
                            "rows must be in increasing time order")
            continue
        out.append(PositionRow(line, text, ts, pos))
    if not out and not problems:
        problems.append(f"{path}: no position rows after the header")
    if problems:
        raise PositionsError(problems)
    return out


def _same_tz(ts, index):
    """`ts` (a Timestamp) expressed like `index` (tz-aware or naive) so the two compare."""
    if index.tz is not None and ts.tzinfo is None:
        return ts.tz_localize(index.tz)
    if index.tz is None and ts.tzinfo is not None:
        return ts.tz_convert("UTC").tz_localize(None)
    return ts


def align_positions(rows: list[PositionRow], timestamps, path: Path | str = "positions"):
    """Target per bar, float64 [T]: each row's position from its bar on, held until the next row; 0 before.

    Raises PositionsError naming every row whose timestamp is not one of the bars.
    """
    import numpy as np

    index = timestamps
    targets = np.zeros(len(index), dtype=np.float64)
    problems, starts = [], []
    for r in rows:
        loc = index.get_indexer([_same_tz(r.timestamp, index)])[0]
        if loc < 0:
            problems.append(f"{path} line {r.line}, column timestamp: {r.text} is not a bar of the data "
                            f"({index[0]} … {index[-1]}, {len(index)} bars)")
        else:
            starts.append((int(loc), r.position))
    if problems:
        raise PositionsError(problems)
    for k, (loc, pos) in enumerate(starts):
        stop = starts[k + 1][0] if k + 1 < len(starts) else len(index)
        targets[loc:stop] = pos
    return targets


def iso_format(timestamps) -> list[str]:
    """ISO 8601 text of each timestamp, in one style for the whole index: 'YYYY-MM-DD' when every bar is at
    midnight (daily data, tz-naive), else 'YYYY-MM-DDTHH:MM:SS' (with fractions / UTC offset only when present)."""
    idx = timestamps
    if idx.tz is None and len(idx) and (idx.normalize() == idx).all():
        return [t.strftime("%Y-%m-%d") for t in idx]
    timespec = "microseconds" if (idx.microsecond != 0).any() else "seconds"
    return [t.isoformat(timespec=timespec) for t in idx]


def bars_per_year(timestamps) -> float:
    """Bars a year of a series: its bars after the first over the years between its first and last timestamp
    (252 where they span no time)."""
    import pandas as pd

    ts = pd.DatetimeIndex(timestamps)
    years = (ts[-1] - ts[0]).total_seconds() / (365.25 * 86400) if len(ts) > 1 else 0.0
    return (len(ts) - 1) / years if years > 0 else 252.0


def run_backtest(bars, targets, *, cost_bps: float = 1.0, slippage_bps: float = 0.0, fee: float = 0.0,
                 borrow_bps: float = 0.0, n_bars_per_year: float | None = None, n_trials: int = 1) -> dict:
    """Run one account through `shared.execution.run_positions`; return {"trades": [...], "metrics": {...}}."""
    from shared.execution import CostModel, Prices, run_positions
    from shared.metrics import metrics_from_backtest

    costs = CostModel(cost_bps=cost_bps, slippage_bps=slippage_bps, fee=fee, borrow_bps=borrow_bps,
                      bars_per_year=n_bars_per_year or bars_per_year(bars.timestamps))
    res = run_positions(Prices.from_bars(bars), targets, costs)
    times = iso_format(bars.timestamps)
    trades = [
        {
            "entry_time": times[int(r.entry_t)], "exit_time": times[int(r.exit_t)], "side": int(r.side),
            "size": float(r.size), "entry_price": float(r.entry_price), "exit_price": float(r.exit_price),
            "net_return": float(r.net_return), "bars": int(r.bars), "exit_reason": str(r.exit_reason),
        }
        for r in res.ledger.itertuples(index=False)
    ]
    metrics: dict = metrics_from_backtest(res, 0, n_trials=n_trials)
    metrics["n_trades"] = int(metrics["n_trades"])
    return {"trades": trades, "metrics": metrics}


def _fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


def _print_table(result: dict, data_name: str, max_trades: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = Table(title=f"backtest of {data_name} (Sharpes un-annualized)")
    m.add_column("metric")
    m.add_column("value", justify="right")
    for k, v in result["metrics"].items():
        m.add_row(k, f"{v:d}" if isinstance(v, int) else f"{v:.6g}")
    console.print(m)
    trades = result["trades"]
    t = Table(title=f"trades ({len(trades)})")
    for col in ("entry_time", "exit_time", "side", "size", "entry_price", "exit_price", "net_return", "bars",
                "exit_reason"):
        t.add_column(col, justify="left" if col.endswith(("time", "reason")) else "right")
    for tr in trades[:max_trades]:
        t.add_row(tr["entry_time"], tr["exit_time"], f"{tr['side']:+d}", f"{tr['size']:.4g}",
                  f"{tr['entry_price']:.6g}", f"{tr['exit_price']:.6g}", f"{tr['net_return']:+.4%}",
                  str(tr["bars"]), tr["exit_reason"])
    console.print(t)
    if len(trades) > max_trades:
        console.print(f"… {len(trades) - max_trades} more trades (use --json for all)")


def backtest(
    data: Annotated[str, typer.Option("--data", help="Dataset name (synthetic, sp500, eurusd) or a CSV/Parquet file.")],
    positions: Annotated[Path, typer.Option("--positions", help="CSV with columns timestamp,position: each row "
                                            "the target (a fraction of equity in [-1, 1]) from its bar on, held "
                                            "until the next row; after the last row to the end of the data (a "
                                            "row of 0 ends it flat); flat before the first.")],
    cost_bps: Annotated[float, typer.Option("--cost-bps", help="Cost per fill, bps of the traded notional.")] = 1.0,
    slippage_bps: Annotated[float, typer.Option("--slippage-bps", help="Extra slippage per fill, bps of the traded "
                                                                       "notional.")] = 0.0,
    fee: Annotated[float, typer.Option("--fee", help="Fixed fee per fill, in units of the starting equity (1): "
                                                     "1e-5 is $1 on $100 000.")] = 0.0,
    borrow_bps: Annotated[float, typer.Option("--borrow-bps", help="Borrow cost of shorts, bps a year of their "
                                                                   "notional, charged at each close held.")] = 0.0,
    n_bars_per_year: Annotated[float | None, typer.Option("--bars-per-year", help="Bars a year for --borrow-bps "
                                                          "(default: the data's bar count over the years it spans)."
                                                          )] = None,
    seed: Annotated[int, typer.Option("--seed", min=0, help="Seed of the synthetic dataset.")] = 0,
    n_trials: Annotated[int, typer.Option("--n-trials", help="Trials the DSR deflates by.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"trades": [...], "metrics": {...}} as JSON.')] = False,
    max_trades: Annotated[int, typer.Option("--max-trades", min=0, help="Trades shown in the table.")] = 20,
) -> None:
    """Replay a target-position series (POS.csv: timestamp,position) through the simulator."""
    if not (math.isfinite(cost_bps) and cost_bps >= 0):
        _fail(f"--cost-bps must be a non-negative number, got {cost_bps}")
    if not (math.isfinite(slippage_bps) and slippage_bps >= 0):
        _fail(f"--slippage-bps must be a non-negative number, got {slippage_bps}")
    if not (math.isfinite(fee) and fee >= 0):
        _fail(f"--fee must be a non-negative number, got {fee}")
    if not (math.isfinite(borrow_bps) and borrow_bps >= 0):
        _fail(f"--borrow-bps must be a non-negative number, got {borrow_bps}")
    if n_bars_per_year is not None and not (math.isfinite(n_bars_per_year) and n_bars_per_year > 0):
        _fail(f"--bars-per-year must be a positive number, got {n_bars_per_year}")
    if n_trials < 1:
        _fail(f"--n-trials must be >= 1, got {n_trials}")
    try:
        rows = read_positions(positions)
    except PositionsError as exc:
        _fail(str(exc))

    from shared.market import DataError, load_dataset

    try:
        bars = load_dataset(data, seed=seed)
    except DataError as exc:
        _fail(str(exc))
    except (OSError, ValueError) as exc:
        _fail(f"cannot load data {data!r}: {exc}")
    if len(bars) < 2:
        _fail(f"data {data!r} has {len(bars)} bar(s); a backtest needs at least 2")
    try:
        targets = align_positions(rows, bars.timestamps, positions)
    except PositionsError as exc:
        _fail(str(exc))

    result = run_backtest(bars, targets, cost_bps=cost_bps, slippage_bps=slippage_bps, fee=fee, borrow_bps=borrow_bps,
                          n_bars_per_year=n_bars_per_year, n_trials=n_trials)
    if as_json:
        sys.stdout.write(json.dumps(result, allow_nan=False) + "\n")
    else:
        _print_table(result, getattr(bars, "name", data), max_trades)


def register(app: typer.Typer) -> None:
    """Add the `backtest` command to the tradeloop CLI."""
    app.command("backtest")(backtest)
