"""`tradeloop data ...` — inspect market data.

`tradeloop data check FILE|NAME` loads bars exactly as training would (`shared.market.load_dataset`) and
prints a one-line summary (exit 0), or every problem found, one per line with file, row and rule (exit 2).
"""
from __future__ import annotations


import pandas as pd
import typer

data_app = typer.Typer(help="Inspect and validate market data.", no_args_is_help=True)


def _human_interval(td: pd.Timedelta) -> str:
    """1 day, 4 hours, 15 minutes, 30 seconds; mixed spans fall back to pandas' own form."""
    secs = td.total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1)):
        if secs >= size and secs % size == 0:
            n = int(secs // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    if 0 < secs < 1:
        return f"{secs * 1000:g} ms"
    return str(td)


def _human_time(ts: pd.Timestamp, daily: bool) -> str:
    return ts.strftime("%Y-%m-%d") if daily else ts.strftime("%Y-%m-%d %H:%M") + (" UTC" if ts.tzinfo else "")


def summary_line(bars) -> str:
    """`name: N bars, start → end, interval X (median), K columns ok`."""
    n = len(bars)
    ts = bars.timestamps
    daily = bool((ts.normalize() == ts).all())
    interval = f"{_human_interval(bars.infer_interval())} (median)" if n >= 2 else "n/a (one bar)"
    n_cols = 5 if bars.has_volume else 4
    vol_note = "" if bars.has_volume else " (no volume)"
    return (f"{bars.name}: {n} bar{'s' if n != 1 else ''}, {_human_time(ts[0], daily)} → {_human_time(ts[-1], daily)}, "
            f"interval {interval}, {n_cols} columns ok{vol_note}")


@data_app.command("check")
def check(
    source: str = typer.Argument(..., help="A CSV or Parquet file, or a dataset name: synthetic, sp500, eurusd."),
    seed: int = typer.Option(0, min=0, help="Seed of the synthetic dataset."),
) -> None:
    """Validate a data file (or dataset) and print a one-line summary; exit 2 listing every problem."""
    from shared.market import DataError, load_dataset

    try:
        bars = load_dataset(source, seed=seed)
    except DataError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    except OSError as exc:
        typer.echo(f"error: {source}: cannot read: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(summary_line(bars))


def register(app: typer.Typer) -> None:
    """Add the `data` sub-command group to the main CLI."""
    app.add_typer(data_app, name="data")
