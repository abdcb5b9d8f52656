"""`tradeloop study` — variants × seeds × walk-forward folds of the closed loop, many runs at once, with confidence
intervals.

    tradeloop study --dataset synthetic --variants on,off --seeds 5 --folds 3 --epochs 8 --out runs/study
                    [--preset small|full] [--set KEY=VALUE ...] [--bars N|auto] [--device cpu|cuda] [--parallel P|auto]
                    [--accel auto|eager|compile|graph|compile+graph] [--deterministic] [--config study.toml]

Options given on the command line win over the same keys of `--config FILE.toml` (keys: the long option names with
'_' for '-'; `variants` a table of `[variants.NAME]` tables; `set` a list of "KEY=VALUE" or a table, merged with
`--set` setting by setting). The run
logic is `tradeloop.study`; this module parses, checks and prints.
"""
from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from tradeloop.study.remote import URL_VAR

CLI_ONLY = ("config", "redis", "report_only")
"""Options of `tradeloop study` that a study file does not hold; every other option is a key of it (`study`'s
parameter names, `set_` as `set`: `TOML_KEYS`, defined after `study`)."""


def parse_seeds(value: Any, where: str = "--seeds") -> list[int]:
    """N (seeds 0 … N−1) or a list "3,7,9" (or a TOML array)."""
    from tradeloop.study.spec import StudyError

    try:
        if isinstance(value, list):
            return [int(x) for x in value]
        text = str(value).strip()
        if "," in text:
            return [int(x) for x in text.split(",") if x.strip()]
        n = value if isinstance(value, int) and not isinstance(value, bool) else int(text)
    except (TypeError, ValueError):
        raise StudyError(f"{where}: expected a count N (seeds 0 … N−1) or a list like 0,3,7; got {value!r}") from None
    if n < 1:
        raise StudyError(f"{where}: a count N (seeds 0 … N−1) must be ≥ 1, got {n}"
                         + (" (seed 0 alone is the list '0,')" if n == 0 else ""))
    return list(range(n))


def build_spec(cli: dict[str, Any], remote: bool = False):
    """The StudySpec and out directory from the command line's values (None: not given) merged over --config.
    `remote`: the runs go through Redis (`--redis`), where `--lockstep auto` is 1."""
    from tradeloop.study.capacity import parse_lockstep, parse_parallel
    from tradeloop.study.spec import (StudyError, StudySpec, parse_setting, parse_variants, read_toml, split_assignment,
                                      synthetic_bars_for, variants_from_toml)

    conf: dict[str, Any] = {}
    where = "--config"
    if cli.get("config") is not None:
        where = f"--config {cli['config']}"
        conf = read_toml(Path(cli["config"]))
        conf = {k.replace("-", "_"): v for k, v in conf.items()}
        unknown = sorted(set(conf) - set(TOML_KEYS))
        if unknown:
            raise StudyError(f"{where}: unknown keys {', '.join(unknown)} (known: {', '.join(TOML_KEYS)})")
    pick = lambda k, default=None: cli[k] if cli.get(k) is not None else conf.get(k, default)  # noqa: E731

    def named(k: str) -> str:
        """How an error names key `k`: by its option where the command line gave it, else as the study file's key."""
        flag = "--" + k.replace("_", "-")
        return flag if cli.get(k) is not None or k not in conf else f"{where}: {k}"

    def integer(k: str, default: Any = None) -> Any:
        """Key `k` as an int (None where neither gives it): an integer, or a string of one; never a bool or a
        float, which int() would turn into another number."""
        v = pick(k, default)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        if isinstance(v, str) and v.strip().lstrip("+-").isdigit():
            return int(v)
        raise StudyError(f"{named(k)} must be an integer, got {v!r}")

    def boolean(k: str, default: bool) -> bool:
        v = pick(k, default)
        if not isinstance(v, bool):
            raise StudyError(f"{named(k)} must be true or false, got {v!r}")
        return v
    dataset = pick("dataset")
    if not dataset:
        raise StudyError("--dataset is required (synthetic, sp500, eurusd or a CSV/Parquet file)")
    if cli.get("variants") is not None:
        variants = parse_variants(cli["variants"])
    else:
        variants = variants_from_toml(conf.get("variants", "on,off"), where)
    def read_set(raw: Any, from_file: bool) -> list:
        """(key, value) settings of a `set`: a "KEY=VALUE" string, a list of them, or (in the file) a table."""
        where_set = f"{where}: set" if from_file else "--set"
        if isinstance(raw, str):                  # one KEY=VALUE
            raw = [raw]
        elif not isinstance(raw, (list, dict)):
            raise StudyError(f"{where_set} must be a list of \"KEY=VALUE\" strings or a table, got {raw!r}")
        if isinstance(raw, dict):
            from tradeloop.study.spec import _flatten

            return [parse_setting(k, v, f"{where} set") for k, v in _flatten(raw)]
        return [parse_setting(*split_assignment(str(item), where_set), where_set) for item in raw]

    # the file's settings, then the command line's: one wins over the other key by key, not list by list
    merged = dict(read_set(conf.get("set", []), True))
    merged.update(read_set(cli["set"], False) if cli.get("set") else [])
    settings = list(merged.items())
    folds = integer("folds", 3)
    bars = pick("bars")
    window_trades = pick("window_trades")
    if bars is not None and str(bars).strip().lower() == "auto":
        if str(dataset).strip().lower() != "synthetic":
            raise StudyError(f"--bars auto sizes the synthetic market only; with {dataset} give a number of bars, "
                             "or leave --bars out for all of them")
        try:
            window_trades = integer("window_trades", 200)
        except StudyError:
            raise StudyError(f"{named('window_trades')} must be an integer ≥ 1, got {window_trades!r}") from None
        if window_trades < 1:
            raise StudyError(f"{named('window_trades')} must be an integer ≥ 1, got {window_trades}")
        bars = synthetic_bars_for(window_trades, folds)
    elif window_trades is not None:
        raise StudyError("--window-trades sizes the data with --bars auto only; give --bars auto, or drop it")
    elif bars is not None:
        try:
            bars = integer("bars")
        except StudyError:
            raise StudyError(f"{named('bars')} must be a number of bars or auto, got {bars!r}") from None
    epochs = integer("epochs")
    if epochs is None:
        raise StudyError("--epochs is required")
    out = pick("out")
    if out is None:
        raise StudyError("--out is required (the study's directory; a study there is resumed)")
    device = str(pick("device", "cpu"))
    lockstep = parse_lockstep(pick("lockstep", "auto"), device, remote=remote, where=named("lockstep"))
    parallel = parse_parallel(pick("parallel", "auto"), device)
    runs_at_once = str(pick("parallel", "auto")).strip().lower() == "auto" and device.startswith("cuda")
    try:
        spec = StudySpec(
            dataset=str(dataset), variants=variants, seeds=parse_seeds(pick("seeds", 3), named("seeds")), folds=folds,
            epochs=epochs, preset=str(pick("preset", "small")), settings=settings, bars=bars,
            data_seed=integer("data_seed"),
            seeds_per_market=integer("seeds_per_market", 1),
            device=device, accel=str(pick("accel", "auto")),
            deterministic=boolean("deterministic", False), min_val_trades=integer("min_val_trades", 20),
            reference=pick("reference"), n_boot=integer("n_boot", 10_000), ci_seed=integer("ci_seed", 0),
            parallel=parallel, lockstep=lockstep,
            threads=integer("threads"),
            stagger=str(pick("stagger", "auto")), mps=str(pick("mps", "auto")).strip().lower(),
            mps_share=integer("mps_share", 100), iteration_sms=integer("iteration_sms", 0))
    except StudyError:
        raise
    except (TypeError, ValueError) as exc:
        raise StudyError(str(exc) if cli.get("config") is None else f"{where}: {exc}") from None
    spec = spec.validate()
    if runs_at_once and spec.lockstep > 1:
        # auto counts runs at once: a worker holds a lockstep group, as many runs as the study's groups hold on
        # average (runs that pair with none — another trainer config on each market — take a worker each)
        from tradeloop.study.runner import lockstep_groups

        ids = [r.run_id for r in spec.runs()]
        per_worker = len(ids) / max(1, len(lockstep_groups(spec, ids)))
        spec.parallel = max(1, math.ceil(parallel / per_worker))
    return spec, Path(out)


def check_runnable(spec, local: bool = True) -> None:
    """What can be checked before any worker starts: the device (when runs run here), the accel mode, the data and
    its folds."""
    import torch

    from shared.config import check_cuda
    from shared.graphs import resolve_accel
    from shared.market import DataError
    from tradeloop.study.spec import StudyError, load_study_bars, study_folds

    if local:
        try:
            check_cuda(spec.device)
        except ValueError as exc:
            raise StudyError(str(exc)) from None
    try:
        resolve_accel(spec.accel, torch.device(spec.device))
    except ValueError as exc:
        raise StudyError(f"--accel: {exc}") from None
    if spec.dataset.strip().lower() == "synthetic":
        from tradeloop.study.spec import SYNTHETIC_DEFAULT_BARS

        study_folds(spec, spec.bars or SYNTHETIC_DEFAULT_BARS)
        return
    try:
        bars = load_study_bars(spec, 0)
    except DataError as exc:
        raise StudyError(str(exc)) from None
    except OSError as exc:
        raise StudyError(f"--dataset {spec.dataset}: cannot read: {exc}") from None
    study_folds(spec, len(bars))


def _key(param: str) -> str:
    """The option key of a parameter of `study` (`set_` → `set`)."""
    return param.rstrip("_")


def _options(values: dict[str, Any]) -> dict[str, Any]:
    """{option key: value} of `study`'s parameters in `values` (its `locals()`), for `build_spec`: the study file's
    keys and `config`."""
    return {_key(k): values[k] for k in inspect.signature(study).parameters if _key(k) not in ("redis", "report_only")}


def study(
    dataset: Optional[str] = typer.Option(None, "--dataset", help="synthetic, sp500, eurusd, or a CSV/Parquet file "
                                          "(required, here or in --config)."),
    variants: Optional[str] = typer.Option(None, "--variants",
                                           help="on,off[,NAME:KEY=VALUE;KEY=VALUE,...] (default on,off)."),
    seeds: Optional[str] = typer.Option(None, "--seeds", help="N (seeds 0…N−1) or a list 0,3,7 (default 3)."),
    folds: Optional[int] = typer.Option(None, "--folds", help="Rolling walk-forward folds (default 3)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", help="Epochs of every run (required, here or in "
                                         "--config)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu (default) or cuda (every visible GPU is "
                                         "used)."),
    parallel: Optional[str] = typer.Option(None, "--parallel", help="Worker processes (each trains a run, or a "
                                           "--lockstep group): N or auto (default: on CUDA a run per core, at most "
                                           "16 a GPU, as many as fit its memory; on a CPU a worker per core)."),
    out: Optional[Path] = typer.Option(None, "--out", help="The study's directory (a study there is resumed; "
                                       "required, here or in --config)."),
    config: Optional[Path] = typer.Option(None, "--config", help="A study file (TOML) with the same keys."),
    preset: Optional[str] = typer.Option(None, "--preset", help="Trainer preset: small (CPU; default) or full "
                                         "(GPU)."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="KEY=VALUE for every variant (repeatable), "
                                             "e.g. iterations=1000 or agent.d_model=64."),
    bars: Optional[str] = typer.Option(None, "--bars", help="Bars of the data: N, or auto (synthetic: val and test "
                                       "windows of ≥ --window-trades trades of a trade-holding policy)."),
    window_trades: Optional[int] = typer.Option(None, "--window-trades", help="Trades per window for --bars auto "
                                                "(default 200)."),
    data_seed: Optional[int] = typer.Option(None, "--data-seed", help="Synthetic market seed (default: each run's "
                                            "seed)."),
    seeds_per_market: Optional[int] = typer.Option(None, "--seeds-per-market", help="Seeds that share a synthetic "
                                                   "market (default 1): seed s trains on market s // K; a population "
                                                   "variant is then judged over its markets."),
    accel: Optional[str] = typer.Option(None, "--accel", help="auto, eager, compile, graph or compile+graph."),
    deterministic: Optional[bool] = typer.Option(None, "--deterministic/--no-deterministic",
                                                 help="torch's deterministic algorithms in every run (GPU: "
                                                 "reproducible pairing, at a cost)."),
    min_val_trades: Optional[int] = typer.Option(None, "--min-val-trades", help="Fewest validation trades of a "
                                                 "selectable checkpoint (default 20)."),
    reference: Optional[str] = typer.Option(None, "--reference", help="Variant the paired differences are taken "
                                            "against (default off, else the first)."),
    n_boot: Optional[int] = typer.Option(None, "--n-boot", help="Bootstrap resamples (default 10000)."),
    ci_seed: Optional[int] = typer.Option(None, "--ci-seed", help="Seed of the bootstrap's resampling (default 0)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per worker (default cores / P)."),
    stagger: Optional[str] = typer.Option(None, "--stagger", help="auto (compiled: the other workers start once "
                                          "the first has compiled) or seconds between worker starts."),
    mps: Optional[str] = typer.Option(None, "--mps", help="auto, on or off: workers sharing a GPU run under a CUDA "
                                      "MPS daemon of the study's own, so their kernels run at once (auto: when "
                                      "installed and a GPU has > 1 worker)."),
    mps_share: Optional[int] = typer.Option(None, "--mps-share", help="Under MPS, the share of a GPU's SMs (%) "
                                            "each worker's kernels may occupy (default 100: no limit)."),
    iteration_sms: Optional[int] = typer.Option(None, "--iteration-sms", help="SMs each run's training "
                                                "iterations may use where runs share a GPU (a CUDA green context "
                                                "a run, disjoint where they fit; default 0: no limit)."),
    lockstep: Optional[str] = typer.Option(None, "--lockstep", help="Runs a worker trains as one batched "
                                           "computation: up to K runs of one market and trainer config, or auto "
                                           "(default: 2 on CUDA, 1 on a CPU or with --redis)."),
    redis: Optional[str] = typer.Option(None, "--redis", envvar=URL_VAR, show_envvar=True,
                                        help="Redis URL: runs go through its stream, where `tradeloop "
                                        "study-worker` on other hosts take them too (--parallel 0: none here); "
                                        "its password in the URL or in TL_REDIS_PASSWORD. Default: the "
                                        "environment; '' runs here without Redis."),
    report_only: bool = typer.Option(False, "--report-only", help="Aggregate the finished study in --out again "
                                     "(results.json, report.md, report.png) without running anything."),
) -> None:
    """Run variants × seeds × walk-forward folds of the closed loop; statistics with 95 % CIs (Sharpes un-annualized,
    per trade)."""
    cli = _options(locals())
    from rich.console import Console

    from shared.redis_server import RedisServerError
    from tradeloop.study.report import counted, markdown
    from tradeloop.study.guard import lock_study
    from tradeloop.study.runner import prepare, run_study
    from tradeloop.study.spec import StudyError

    err = Console(stderr=True, soft_wrap=True)
    if report_only:
        _report_only(out, err)
        return
    redis = redis or None                          # --redis '': no Redis, whatever the environment says
    warn_password_on_command_line(redis, err)
    if redis is not None and not any(a == "--redis" or a.startswith("--redis=") for a in sys.argv):
        from shared.redis_server import redact_url

        err.print(f"the study goes through the Redis of {URL_VAR} ({redact_url(redis)}); --redis '' runs it here "
                  "without one", markup=False, highlight=False)
    try:
        spec, out_dir = build_spec(cli, remote=redis is not None)
        check_runnable(spec, local=spec.parallel > 0)
        if redis is None and spec.parallel < 1:
            raise StudyError("--parallel 0 (no local worker) needs --redis: workers elsewhere take the runs")
        if redis is not None:
            from tradeloop.study.remote import client

            client(redis)
        lock = lock_study(out_dir)                 # before study.json is read or written: one study process a dir
        prepare(spec, out_dir)
    except (StudyError, RedisServerError) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except OSError as exc:
        err.print(f"error: {unwritable(cli.get('out'), exc)}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    console = Console(soft_wrap=True)
    n_runs = len(spec.runs())
    pairs = f", {spec.lockstep} a worker in lockstep" if spec.lockstep > 1 else ""
    here = (f"{min(spec.parallel * spec.lockstep, n_runs)} at once" + (f" at most (those that fit each GPU{pairs})"
                                                                       if spec.device != "cpu" else pairs)
            if spec.parallel > 0 else "none here")
    console.print(f"study: {counted(len(spec.variants), 'variant')} × {counted(len(spec.seeds), 'seed')} × "
                  f"{counted(spec.folds, 'fold')} = {counted(n_runs, 'run')} of {counted(spec.epochs, 'epoch')}, "
                  f"{here}, in {out_dir}", markup=False, highlight=False)
    for name in spec.acting_on_nothing():
        console.print(f"note: variant {name!r} switches every signal and the rollback off (the product's default), "
                      "so its feedback changes nothing: it trains as the fixed schedule would under its settings; a "
                      "variant switches one on by leaving it out of `off` (e.g. "
                      "'rollback:off=E1+E2+E3+E4+E5+E6+E7+E8+E9')", markup=False, highlight=False)
    try:
        res = run_study(spec, out_dir, console, redis_url=redis, lock=lock)
    except (StudyError, RedisServerError) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    except OSError as exc:
        err.print(f"error: {unwritable(out_dir, exc)}; run the same command again to resume once it can be written",
                  markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print(markdown(res).split("\n| run |")[0], markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {out_dir / 'report.md'}, {out_dir / 'results.json'}, {out_dir / 'report.png'}",
                  markup=False, highlight=False)


TOML_KEYS = tuple(k for k in map(_key, inspect.signature(study).parameters) if k not in CLI_ONLY)
"""The keys of a study file: the options of `tradeloop study` but `CLI_ONLY`."""


def warn_password_on_command_line(url: str | None, err) -> None:
    """One warning line when the Redis URL, with a password in it, is on this process's command line (`--redis`,
    which every local user reads in /proc/PID/cmdline) rather than in the environment."""
    import sys

    from tradeloop.study.remote import has_password

    if url and has_password(url) and any(url in arg for arg in sys.argv[1:]):
        err.print("warning: --redis holds a password, which every user of this host can read in the process list; "
                  "give the URL in TL_REDIS_URL (or the password in TL_REDIS_PASSWORD) instead",
                  markup=False, highlight=False)


def unwritable(out, exc: OSError) -> str:
    """What an OSError met while writing a study's files says: the folder, the file and the system's reason."""
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return f"--out {out}: cannot write the study's files{where}: {exc.strerror or exc}"


def _report_only(out, err) -> None:
    """`tradeloop study --out DIR --report-only`: the results of a finished study again, nothing run."""
    from rich.console import Console

    from tradeloop.study.report import markdown
    from tradeloop.study.runner import report_only
    from tradeloop.study.spec import StudyError

    if out is None:
        err.print("error: --report-only needs --out (the finished study's directory)")
        raise typer.Exit(2)
    try:
        res = report_only(Path(out))
    except StudyError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except OSError as exc:
        err.print(f"error: {unwritable(out, exc)}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    console = Console(soft_wrap=True)
    console.print(markdown(res).split("\n| run |")[0], markup=False, highlight=False, soft_wrap=True)
    console.print(f"results: {Path(out) / 'report.md'}, {Path(out) / 'results.json'}, {Path(out) / 'report.png'}",
                  markup=False, highlight=False)


def study_worker(
    redis: Optional[str] = typer.Option(None, "--redis", envvar=URL_VAR, show_envvar=True,
                                        help="The study's Redis URL (its password in it or in TL_REDIS_PASSWORD). "
                                        "Default: the environment."),
    study_id: str = typer.Option(..., "--study", help="The study's id (printed by `tradeloop study --redis`)."),
    out: Path = typer.Option(..., "--out", help="This host's directory for the runs it does."),
    parallel: str = typer.Option("auto", "--parallel", help="Runs at once on this host (GPUs round-robin): N or "
                                 "auto (as `tradeloop study`: on CUDA as many as fit each GPU's memory)."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per worker (default cores / P)."),
) -> None:
    """Take runs of a study from its Redis stream until every run is done (the study process gathers the results)."""
    from rich.console import Console

    from shared.redis_server import RedisServerError
    from tradeloop.study.capacity import parse_parallel
    from tradeloop.study.host import WorkersDied, work_for
    from tradeloop.study.spec import StudyError, StudyInterrupted

    err = Console(stderr=True, soft_wrap=True)
    warn_password_on_command_line(redis, err)
    try:
        if not redis:
            raise StudyError(f"the study's Redis URL is required: set {URL_VAR} (or give --redis URL)")
        if parse_parallel(parallel, "cpu") < 1:
            raise StudyError(f"--parallel must be ≥ 1 on a worker host, got {parallel}")
        work_for(redis, study_id, out, parallel, threads, Console(soft_wrap=True))
    except (StudyError, RedisServerError) as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(1 if isinstance(exc, (StudyInterrupted, WorkersDied)) else 2) from None


def study_compare(
    sides: list[str] = typer.Argument(..., help="DIR:VARIANT pairs, A B [A2 B2 …]: a variant of a finished study, "
                                      "then the study and variant it is paired against; more pairs pool their units."),
    n_boot: int = typer.Option(10_000, "--n-boot", help="Bootstrap resamples."),
    ci_seed: int = typer.Option(0, "--ci-seed", help="Seed of the bootstrap's resampling."),
    as_json: bool = typer.Option(False, "--json", help="The comparison as JSON."),
    any_epochs: bool = typer.Option(False, "--any-epochs", help="Pair studies that differ in epochs alone (each run's "
                                    "checkpoint chosen among its own epochs); the table says how many each side had."),
    any_settings: bool = typer.Option(False, "--any-settings", help="Pair studies that differ in their base settings "
                                      "(--set) too: the same units trained otherwise; the table says each side's."),
    detect: Optional[float] = typer.Option(None, "--detect", help="A difference to plan for: the units it would take "
                                           "to resolve it at 80 % power (a paired t-test at 5 %), given the spread "
                                           "of these units' differences."),
) -> None:
    """A variant of one finished study against a variant of another on the same seeds, folds and data, paired by
    (seed, fold): OOS and val per-trade Sharpe of the val-selected checkpoints and last-epoch val. Several pairs
    (a replication in another study) are pooled into one bootstrap."""
    from rich.console import Console

    from tradeloop.study.compare import compare_pooled, load_side, markdown
    from tradeloop.study.spec import StudyError

    err = Console(stderr=True, soft_wrap=True)
    try:
        if n_boot < 100:
            raise StudyError(f"--n-boot must be ≥ 100, got {n_boot}")
        if len(sides) % 2:
            raise StudyError(f"give DIR:VARIANT in pairs (A B [A2 B2 …]); got {len(sides)}: {' '.join(sides)}")
        loaded = [load_side(x) for x in sides]
        pairs = [(ra, va, rb, vb) for (ra, va, _), (rb, vb, _) in zip(loaded[::2], loaded[1::2])]
        if detect is not None and not (math.isfinite(detect) and detect != 0.0):
            raise StudyError(f"--detect must be a finite difference other than 0, got {detect}")
        c = compare_pooled(pairs, n_boot=n_boot, seed=ci_seed, any_epochs=any_epochs,
                           any_settings=any_settings, detect=detect)
    except StudyError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps({"a": sides[0], "b": sides[1], "sides": sides, **c}, default=str))
    else:
        la, lb = (" + ".join(dict.fromkeys(x[2] for x in loaded[k::2])) for k in (0, 1))
        typer.echo(markdown(c, la, lb), nl=False)


def register(app: typer.Typer) -> None:
    """Add `tradeloop study`, `tradeloop study-worker` and `tradeloop study-compare`."""
    app.command("study")(study)
    app.command("study-worker")(study_worker)
    app.command("study-compare")(study_compare)
