"""`tradeloop train` — train the agent standalone (no services), resuming when --out already holds the run.

    tradeloop train --dataset synthetic --epochs 5 --out runs/demo [--device cpu|cuda] [--config small|full] [--seed 0]
                    [--accel auto|eager|compile|graph|compile+graph]

--out is a new or empty directory, or one a `tradeloop train` run made (`plan_out`); any other is refused, a
`tradeloop up` run among them (its trainer's files are under trainer/, and its checkpoints the loop's: continue it
with `tradeloop up --resume`). A resumed run keeps its dataset, seed and config (`KEPT`): one given with another
value is refused by name (`tradeloop.up.runs.refuse_changed`, the rule of `tradeloop up --resume`).

Progress on the terminal: a rich progress bar per epoch (it names the compile while the first epoch's steps compile),
then one line per epoch with loss, ε, γ, steps/s and the train per-trade Sharpe (un-annualized, trades closed while
collecting, exploration included). `run_training` is what the command runs once its flags are checked
(bench/train_speed.py times it as a user sees it).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import typer

if TYPE_CHECKING:
    from services.trainer.train import EpochStats, TrainConfig, TrainState

KEPT = ("dataset", "seed", "config")
"""What a `tradeloop train` run keeps for good (its run.json fixes them): a resume may not change them."""


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def plan_out(out: Path) -> dict | None:
    """--out's run.json when it holds a `tradeloop train` run, None when it is new or empty (dot-files aside). Any
    other directory is a RunError saying what to do instead: a `tradeloop up` run (or its trainer's directory), a
    directory holding something else, or a train run's files beside other directories (a study's run)."""
    from services.trainer.rundir import CHECKPOINTS, RUN_JSON, read_run_json
    from shared.runfiles import TRAINER_DIR
    from tradeloop.up.runs import LOCK_FILE, RunError, is_run, resume_hint

    out = Path(out)
    if not out.exists():
        return None
    if not out.is_dir():
        raise RunError(f"--out {out} exists and is not a directory")
    if is_run(out) or (out / LOCK_FILE).exists():
        raise RunError(f"--out {out} holds a `tradeloop up` run (its trainer's files are in {out / TRAINER_DIR}), "
                       f"which `tradeloop train` does not write into; continue it with "
                       f"{resume_hint(out.name, out.parent)}, or give --out a new directory")
    if out.name == TRAINER_DIR and is_run(out.parent):
        raise RunError(f"--out {out} is the trainer's directory of the `tradeloop up` run {out.parent}, which "
                       f"`tradeloop train` does not write into; continue it with "
                       f"{resume_hint(out.parent.name, out.parent.parent)}, or give --out a new directory")
    try:
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if not p.name.startswith("."))
    except OSError as exc:
        raise RunError(f"--out {out}: cannot list it ({exc})") from None
    if not entries:
        return None
    if not (out / RUN_JSON).is_file():
        raise RunError(f"--out {out} holds {_shown(entries)} but no `tradeloop train` run ({RUN_JSON}); give --out "
                       f"a new or empty directory")
    other = [e for e in entries if e.endswith("/") and e != CHECKPOINTS + "/"]
    if other:
        raise RunError(f"--out {out} holds {_shown(other)} beside a run's {RUN_JSON}: not a `tradeloop train` run "
                       f"(it holds {RUN_JSON}, history.jsonl and {CHECKPOINTS}/); give --out a new or empty directory")
    return read_run_json(out)


def _run_config(meta: dict) -> str:
    """The --config a run was started with: its preset's name, else (a run of another config) custom:HASH."""
    from services.trainer.config import PRESETS
    from services.trainer.train import TrainConfig

    name, digest = meta.get("config_preset"), str(meta.get("config_hash"))
    if name in PRESETS:
        return name
    agent = meta.get("config", {}).get("agent", {}) if isinstance(meta.get("config"), dict) else {}
    n_features = agent.get("n_features") if isinstance(agent, dict) else None
    if isinstance(n_features, int):
        for name in PRESETS:
            if TrainConfig.preset(name, n_features).hash() == digest:
                return name
    return f"custom:{digest[:12]}"


def _same_dataset(given: str, recorded: str) -> bool:
    """Whether --dataset names the dataset a run recorded: the same string, a dataset's name in any case, or the
    same file."""
    from shared.market_data import BUNDLED

    g, r = given.strip(), recorded.strip()
    if g == r or (g.lower() == r.lower() and g.lower() in ("synthetic", *BUNDLED)):
        return True
    try:
        return os.path.samefile(g, r)
    except OSError:
        return False


def check_kept(out: Path, meta: dict, dataset: str | None, seed: int | None,
               config: "str | TrainConfig | None") -> None:
    """RunError naming each setting a resumed run keeps (`KEPT`) that is given with another value than its run.json
    records (`refuse_changed`, the rule of `tradeloop up --resume`); one left out (None) or equal passes."""
    from tradeloop.up.runs import refuse_changed

    run = {"dataset": meta.get("dataset"), "seed": meta.get("seed"), "config": _run_config(meta)}
    recorded = {k: v for k, v in run.items() if v is not None}
    given_config = config
    if config is not None and not isinstance(config, str):           # a TrainConfig: the run's own or another
        digest = config.hash()
        given_config = recorded["config"] if digest == meta.get("config_hash") else f"custom:{digest[:12]}"
    same = dataset is not None and "dataset" in recorded and _same_dataset(dataset, str(recorded["dataset"]))
    given = {"dataset": None if same else dataset, "seed": seed, "config": given_config}
    refuse_changed(recorded, given, KEPT, run=f"the run in {out}", instead="give --out a new directory")


def existing_run(out: Path, dataset: str | None) -> dict | None:
    """The run.json of --out's run to resume, None for a new run (`plan_out`); RunError when there is no dataset to
    train on: none given, and no run's own."""
    from tradeloop.up.runs import RunError

    meta = plan_out(out)
    if dataset is None and meta is None:
        raise RunError(f"--dataset is needed: --out {out} holds no run to resume")
    if dataset is None and not isinstance(meta.get("dataset"), str):
        raise RunError(f"--dataset is needed: {Path(out) / 'run.json'} records no dataset")
    return meta


def run_training(dataset: str | None, epochs: int, out: Path, *, device: str = "cpu",
                 config: "str | TrainConfig | None" = None, seed: int | None = None, accel: str = "auto",
                 on_epoch: "Callable[[EpochStats], None] | None" = None,
                 progress: Callable[[int, int], None] | None = None,
                 on_compile: Callable[[str | None], None] | None = None) -> "TrainState":
    """`tradeloop train`'s work: --out's run (`existing_run`), the dataset (seeded by the seed), a resumed run's
    settings checked (`check_kept`), then `train_run` until `epochs` epochs exist in `out`. Settings left out (None)
    are a resumed run's own, a new run's defaults (seed 0, config small). Raises DataError, CheckpointError or
    ValueError (a dataset file that cannot be read, a refused --out or setting among them)."""
    from services.trainer.train import train_run
    from shared.market import load_dataset

    meta = existing_run(out, dataset)
    run_seed = meta.get("seed") if meta is not None else None
    data = dataset if dataset is not None else meta["dataset"]
    data_seed = seed if seed is not None else run_seed if isinstance(run_seed, int) else 0
    try:
        bars = load_dataset(data, seed=data_seed)
    except OSError as exc:
        raise ValueError(f"{data}: cannot read: {exc}") from None
    if meta is not None:
        check_kept(out, meta, dataset, seed, config)
    # `open_run` keeps a resumed run's own config and seed: these are a new run's
    return train_run(bars, data, out, epochs, config="small" if config is None else config, seed=data_seed,
                     device=device, accel=accel, on_epoch=on_epoch, progress=progress, on_compile=on_compile)


def train(
    dataset: str = typer.Option(None, "--dataset", help="Dataset name (synthetic, sp500, eurusd) or a CSV/Parquet "
                                                        "file (a resumed run: its own)."),
    epochs: int = typer.Option(..., "--epochs", help="Train until this many epochs exist in --out."),
    out: Path = typer.Option(..., "--out", help="Run directory: new or empty, or a `tradeloop train` run, resumed."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    config: str = typer.Option(None, "--config", help="Preset: small (CPU; the default) or full (GPU) (a resumed "
                                                      "run: its own)."),
    seed: int = typer.Option(None, "--seed", min=0, help="Seed of the run and of the synthetic data (default 0; a "
                                                         "resumed run: its own)."),
    accel: str = typer.Option("auto", "--accel",
                              help="auto (compile+graph on a GPU, eager on CPU), eager, compile, graph or "
                                   "compile+graph. Compiled kernels are cached (TORCHINDUCTOR_CACHE_DIR, default "
                                   "~/.cache/tradeloop/inductor): a second run of a config starts in seconds."),
) -> None:
    """Train the distributional agent on the training split; checkpoints and history go to --out."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from services.trainer.config import PRESETS
    from shared.checkpoints import CheckpointError
    from shared.config import check_cuda
    from shared.graphs import compile_cache_dir, resolve_accel

    err = Console(stderr=True, soft_wrap=True)
    if epochs < 1:
        err.print(f"error: --epochs must be ≥ 1, got {epochs}")
        raise typer.Exit(2)
    if config is not None and config not in PRESETS:
        err.print(f"error: --config must be {' or '.join(PRESETS)}, got {config!r}", markup=False)
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
    try:
        existing_run(out, dataset)                               # before anything prints; run_training checks again
    except ValueError as exc:                                    # RunError among them
        err.print(f"error: {exc}", markup=False)
        raise typer.Exit(2) from None

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
        except OSError as exc:          # --out not writable, a full disk (a checkpoint's write names its file)
            why = str(exc.strerror or exc)
            where = "" if exc.filename is None and why.startswith("writing ") else \
                f"cannot write {exc.filename or out}: "
            err.print(f"error: {where}{why}", markup=False)
            raise typer.Exit(2) from None
    console.print(f"done: {state.epoch} epochs in {out} (checkpoints in {out / 'checkpoints'})")


def register(app: typer.Typer) -> None:
    """Add `tradeloop train`."""
    app.command("train")(train)
