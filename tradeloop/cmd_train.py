"""`tradeloop train` — train the agent standalone (no services), resuming when --out already holds the run.

    tradeloop train --dataset synthetic --epochs 5 --out runs/demo [--device cpu|cuda] [--config small|full] [--seed 0]
                    [--accel auto|eager|compile|graph|compile+graph]

Progress on the terminal: a rich progress bar per epoch (it names the compile while the first epoch's steps compile),
then one line per epoch with loss, ε, γ, steps/s and the train per-trade Sharpe (un-annualized, trades closed while
collecting, exploration included). `run_training` is what the command runs once its flags are checked
(bench/train_speed.py times it as a user sees it).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import typer

if TYPE_CHECKING:
    from services.trainer.train import EpochStats, TrainConfig, TrainState


def run_training(dataset: str, epochs: int, out: Path, *, device: str = "cpu", config: "str | TrainConfig" = "small",
                 seed: int = 0, accel: str = "auto", on_epoch: "Callable[[EpochStats], None] | None" = None,
                 progress: Callable[[int, int], None] | None = None,
                 on_compile: Callable[[str | None], None] | None = None) -> "TrainState":
    """`tradeloop train`'s work: the dataset (seeded by `seed`), then `train_run` until `epochs` epochs exist in
    `out`. Raises DataError, CheckpointError or ValueError (a dataset file that cannot be read among them)."""
    from services.trainer.train import train_run
    from shared.market import load_dataset

    try:
        bars = load_dataset(dataset, seed=seed)
    except OSError as exc:
        raise ValueError(f"{dataset}: cannot read: {exc}") from None
    return train_run(bars, dataset, out, epochs, config=config, seed=seed, device=device, accel=accel,
                     on_epoch=on_epoch, progress=progress, on_compile=on_compile)


def train(
    dataset: str = typer.Option(..., "--dataset", help="Dataset name (synthetic, sp500, eurusd) or a CSV/Parquet file."),
    epochs: int = typer.Option(..., "--epochs", help="Train until this many epochs exist in --out."),
    out: Path = typer.Option(..., "--out", help="Run directory (created; resumed when it holds a run)."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    config: str = typer.Option("small", "--config", help="Preset: small (CPU) or full (GPU)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the run (and of the synthetic data)."),
    accel: str = typer.Option("auto", "--accel",
                              help="auto (compile+graph on a GPU, eager on CPU), eager, compile, graph or "
                                   "compile+graph. Compiled kernels are cached (TORCHINDUCTOR_CACHE_DIR, default "
                                   "~/.cache/tradeloop/inductor): a second run of a config starts in seconds."),
) -> None:
    """Train the distributional agent on the training split; checkpoints and history go to --out."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from shared.checkpoints import CheckpointError
    from shared.config import check_cuda
    from shared.graphs import compile_cache_dir, resolve_accel

    err = Console(stderr=True, soft_wrap=True)
    if epochs < 1:
        err.print(f"error: --epochs must be ≥ 1, got {epochs}")
        raise typer.Exit(2)
    if config not in ("small", "full"):
        err.print(f"error: --config must be small or full, got {config!r}")
        raise typer.Exit(2)
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        err.print(f"error: --device must be cpu or cuda, got {device!r}")
        raise typer.Exit(2)
    try:
        check_cuda(device)
    except ValueError as exc:
        err.print(f"error: {exc}")
        raise typer.Exit(2)
    try:
        mode = resolve_accel(accel, torch.device(device))
    except ValueError as exc:
        err.print(f"error: --accel: {exc}", markup=False)
        raise typer.Exit(2) from None
    if out.exists() and not out.is_dir():
        err.print(f"error: --out {out} exists and is not a directory")
        raise typer.Exit(2)

    console = Console()
    how = f"{mode} ({accel} on {device})" if accel == "auto" else mode
    cache = f"; compiled kernels cached in {compile_cache_dir()}" if "compile" in mode else ""
    console.print(f"accel: {how}{cache}", markup=False)
    with Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), TextColumn("{task.fields[phase]}"), console=console, transient=True) as prog:
        task = prog.add_task("train", total=1, epoch="…", phase="loading")
        state_box: dict = {}

        def progress(i: int, n: int) -> None:
            prog.update(task, completed=i, total=n, epoch=state_box.get("next", "?"), phase="")

        def on_compile(what: str | None) -> None:
            prog.update(task, phase="" if what is None else f"{what} (first epoch only)…")

        def on_epoch(s: EpochStats) -> None:
            state_box["next"] = s.epoch + 1
            sr = "n/a" if math.isnan(s.train_per_trade_sharpe) else f"{s.train_per_trade_sharpe:.3f}"
            comp = f" (compile {s.compile_s:.0f}s)" if s.compile_s >= 0.5 else ""
            console.print(f"epoch {s.epoch:>3}  loss {s.loss:.4f}  ε {s.epsilon:.3f}  γ {s.gamma:.3f}  "
                          f"env-steps/s {s.env_steps_per_s:,.0f}  updates/s {s.updates_per_s:,.1f}  "
                          f"train per-trade Sharpe {sr} ({s.train_trades} trades)  {s.seconds:.0f}s{comp}")

        try:
            state = run_training(dataset, epochs, out, device=device, config=config, seed=seed, accel=accel,
                                 on_epoch=on_epoch, progress=progress, on_compile=on_compile)
        except (CheckpointError, ValueError) as exc:             # DataError among them
            err.print(f"error: {exc}", markup=False)
            raise typer.Exit(2) from None
    console.print(f"done: {state.epoch} epochs in {out} (checkpoints in {out / 'checkpoints'})")


def register(app: typer.Typer) -> None:
    """Add `tradeloop train`."""
    app.command("train")(train)
