"""`tradeloop train` — train the agent standalone (no services), resuming when --out already holds the run.

    tradeloop train --dataset synthetic --epochs 5 --out runs/demo [--device cpu|cuda] [--config small|full] [--seed 0]
                    [--accel auto|eager|compile|graph|compile+graph]

Progress on the terminal: a rich progress bar per epoch, then one line per epoch with loss, ε, γ, steps/s and the
train per-trade Sharpe (un-annualized, trades closed while collecting, exploration included).
"""
from __future__ import annotations

import math
from pathlib import Path

import typer


def train(
    dataset: str = typer.Option(..., "--dataset", help="Dataset name (synthetic, sp500, eurusd) or a CSV/Parquet file."),
    epochs: int = typer.Option(..., "--epochs", help="Train until this many epochs exist in --out."),
    out: Path = typer.Option(..., "--out", help="Run directory (created; resumed when it holds a run)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    config: str = typer.Option("small", "--config", help="Preset: small (CPU) or full (GPU)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the run (and of the synthetic data)."),
    accel: str = typer.Option("auto", "--accel",
                              help="auto (CUDA graphs on a GPU, eager on CPU), eager, compile, graph or compile+graph."),
) -> None:
    """Train the distributional agent on the training split; checkpoints and history go to --out."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from services.trainer.train import EpochStats, train_run
    from shared.checkpoints import CheckpointError
    from shared.market import DataError, load_dataset

    err = Console(stderr=True)
    if epochs < 1:
        err.print(f"error: --epochs must be ≥ 1, got {epochs}")
        raise typer.Exit(2)
    if config not in ("small", "full"):
        err.print(f"error: --config must be small or full, got {config!r}")
        raise typer.Exit(2)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        err.print(f"error: --device must be cpu or cuda, got {device!r}")
        raise typer.Exit(2)
    if device.startswith("cuda") and not torch.cuda.is_available():
        err.print("error: --device cuda but no CUDA device is available here")
        raise typer.Exit(2)
    from shared.graphs import resolve_accel
    try:
        resolve_accel(accel, torch.device(device))
    except ValueError as exc:
        err.print(f"error: --accel: {exc}", markup=False)
        raise typer.Exit(2) from None
    if out.exists() and not out.is_dir():
        err.print(f"error: --out {out} exists and is not a directory")
        raise typer.Exit(2)
    try:
        bars = load_dataset(dataset, seed=seed)
    except DataError as exc:
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None
    except OSError as exc:
        err.print(f"error: {dataset}: cannot read: {exc}", markup=False)
        raise typer.Exit(2) from None

    console = Console()
    with Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as prog:
        task = prog.add_task("train", total=1, epoch="…")
        state_box: dict = {"epoch": None}

        def progress(i: int, n: int) -> None:
            if state_box["epoch"] is None:
                state_box["epoch"] = 0
            prog.update(task, completed=i, total=n, epoch=state_box.get("next", "?"))

        def on_epoch(s: EpochStats) -> None:
            state_box["next"] = s.epoch + 1
            sr = "n/a" if math.isnan(s.train_per_trade_sharpe) else f"{s.train_per_trade_sharpe:.3f}"
            console.print(f"epoch {s.epoch:>3}  loss {s.loss:.4f}  ε {s.epsilon:.3f}  γ {s.gamma:.3f}  "
                          f"env-steps/s {s.env_steps_per_s:,.0f}  updates/s {s.updates_per_s:,.1f}  "
                          f"train per-trade Sharpe {sr} ({s.train_trades} trades)  {s.seconds:.0f}s")

        try:
            state = train_run(bars, dataset, out, epochs, config=config, seed=seed, device=device,
                              accel=accel, on_epoch=on_epoch, progress=progress)
        except (CheckpointError, ValueError) as exc:
            err.print(f"error: {exc}", markup=False)
            raise typer.Exit(2) from None
    console.print(f"done: {state.epoch} epochs in {out} (checkpoints in {out / 'checkpoints'})")


def register(app: typer.Typer) -> None:
    """Add `tradeloop train`."""
    app.command("train")(train)
