"""`tradeloop evaluate` — run a policy over a split through the one simulator and print its metrics.

Policies: a trained agent — a checkpoint file, or a run directory that `tradeloop train --out DIR` or `tradeloop up`
wrote with `--checkpoint best|latest|N` (`services.evaluator.runs`: best = the highest validation per-trade Sharpe
among the checkpoints with enough validation trades, as the loop's reports say) — or a baseline run through
`shared.execution.run_positions`:
  oracle        synthetic only: the generator's hidden-regime positions (`shared.synthetic.oracle_positions`);
  random        seeded: a random side in {−1, 0, +1}, redrawn with probability 1/20 per bar (trades of ~20 bars);
  flat          never trades;
  buy-and-hold  long from the first bar to the last.
An agent is evaluated as the loop's evaluator evaluates it, plain and `--report` alike
(`services.evaluator.cli_eval.report_for_cli`): the knobs it trained under (its entry gate and regime confidence),
the run's costs, split and data, the loop's windows, and the val DSR deflated over the loop's trials — so the
numbers are those the loop and the dashboard show for it. What it ran with (checkpoint, knobs) is printed.
Metrics: `shared.metrics.compute_metrics` (Sharpes un-annualized, per trade / per bar) of one account.
`policy_metrics` is the library entry point (used by bench/learning.py).
`--checkpoint all` (or a list such as `2,4,best`) evaluates those checkpoints of a run on the split, each as it
would be alone, in one batched pass (`services.evaluator.cli_eval.windows_for_cli`), and prints one row per checkpoint.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from shared.baselines import BASELINES, baseline_targets  # noqa: F401 (re-exported)

SPLITS = {"val": "val", "test": "oos"}
"""--split → the report's window."""


def resolve_checkpoint(policy: str, which: str = "latest") -> Path:
    """A checkpoint file, or checkpoint `which` ("latest" or an epoch) of a run directory of either layout.
    FileNotFoundError naming what is missing."""
    from services.evaluator.runs import RunDirError, choose, find_run

    p = Path(policy)
    if p.is_dir():
        try:
            return choose(find_run(p), which).path
        except RunDirError as exc:
            raise FileNotFoundError(str(exc)) from None
    if not p.is_file():
        raise FileNotFoundError(f"{policy}: not a checkpoint file, a run directory, or one of {', '.join(BASELINES)}")
    return p


def policy_metrics(policy: str, dataset: str, bars, split, which: str, *, seed: int = 0, device: str = "cpu",
                   cost_bps: float | None = None) -> dict:
    """Metrics of `policy` (baseline name, checkpoint or run dir: its latest checkpoint) on split window `which`
    ("val" or "test") of `bars`. An agent runs as the loop's evaluator runs it
    (`services.evaluator.runner.evaluate_checkpoint`: the knobs and costs it trained under unless `cost_bps`)."""
    from shared.execution import CostModel, Prices, run_positions
    from shared.metrics import metrics_from_backtest

    if policy in BASELINES:
        start, stop = split.window(which)
        tg = baseline_targets(policy, dataset, bars, start, stop, seed)
        res = run_positions(Prices.from_bars(bars.slice(start, stop)), tg, CostModel(1.0 if cost_bps is None
                                                                                    else cost_bps))
        return metrics_from_backtest(res)
    from services.evaluator.runner import evaluate_checkpoint

    if which not in SPLITS:
        raise ValueError(f"split window must be one of {', '.join(SPLITS)}, got {which!r}")
    rep = evaluate_checkpoint(resolve_checkpoint(policy), expected_sha256=None, bars=bars, split=split, run_id="",
                              epoch=0, insample_bars=0, oos=which == "test", device=device, dataset=dataset,
                              costs=None if cost_bps is None else CostModel(cost_bps))
    return dict(getattr(rep, SPLITS[which]).metrics)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _knobs_used(knobs) -> dict:
    """The knobs the policy reads when evaluated (the rest steer training only)."""
    from shared.knobs import Knobs

    k = knobs or Knobs()
    return {"gate_threshold": None if math.isinf(k.gate_threshold) else k.gate_threshold,
            "regime_confidence": list(k.regime_confidence)}


def evaluate_agent(policy: str, *, which: str | None, split: str, dataset: str | None, seed: int | None,
                   device: str, min_trades: int, report: bool, echo, shaping: bool = True) -> dict:
    """Evaluate a checkpoint or a run's chosen checkpoint as the loop does; `echo(line)` gets what it ran with.
    Returns the JSON document of the plain output (with the report under "report"). Raises RunDirError,
    EvaluateInputError."""
    from services.evaluator.cli_eval import report_for_cli
    from services.evaluator.runs import (CHECKPOINT_NAME, Choice, RunDirError, choose, find_run, loop_trials,
                                         run_of_checkpoint, sidecar_sha256)
    from shared.metrics import selection_dsr

    p = Path(policy)
    if p.is_dir():
        run = find_run(p)

        def val_of(path: Path) -> tuple[float, int]:
            ev = report_for_cli(path, data=dataset, device=device, data_seed=seed, insample=False, oos=False,
                                shaping=shaping)
            m = ev.report.val.metrics
            echo(f"  evaluated epoch {ev.epoch} on validation: per-trade Sharpe {m['per_trade_sharpe']:.4g} over "
                 f"{int(m['n_trades'])} trades")
            return float(m["per_trade_sharpe"]), int(m["n_trades"])

        choice = choose(run, which or "latest", min_trades=min_trades, val_of=val_of)
    elif p.is_file():
        if which is not None:
            raise RunDirError(f"--checkpoint {which}: --policy {policy} is a checkpoint file; --checkpoint picks "
                              "among a run directory's checkpoints")
        run = run_of_checkpoint(p)
        named = CHECKPOINT_NAME.match(p.name)
        sha = sidecar_sha256(p) if p.with_name(p.name + ".sha256").is_file() else ""
        choice = Choice(int(named.group(1)) if named else 0, p, sha, "file")
    else:
        raise RunDirError(f"{policy}: not a checkpoint file, a run directory, or one of {', '.join(BASELINES)}")

    # the val DSR over the loop's trials when the run holds its reports (a file of a run: by the epoch in its name)
    trials = loop_trials(run, choice.epoch) if run is not None and choice.epoch else None
    ev = report_for_cli(choice.path, data=dataset, device=device, data_seed=seed, trials=trials, shaping=shaping)
    rep = ev.report
    sel = None
    if choice.how == "best":
        sharpes = [c.val_sharpe for c in choice.candidates]
        sel = {"rule": "highest val per-trade Sharpe (un-annualized) among checkpoints with >= "
                       f"{choice.min_trades} val trades", "enough_val_trades": choice.enough_trades,
               "considered": [{"epoch": c.epoch, "val_per_trade_sharpe": c.val_sharpe, "val_n_trades": c.val_trades,
                               "source": c.source, "on_disk": c.path is not None} for c in choice.candidates],
               "dsr_deflated_over_considered": selection_dsr(rep.val.trades.net_return, sharpes,
                                                             [c.val_trades for c in choice.candidates],
                                                             choice.min_trades)}
    doc = {"checkpoint": {"epoch": ev.epoch, "path": str(ev.path), "sha256": ev.sha256, "how": choice.how},
           "dataset": ev.dataset, "knobs": _knobs_used(ev.knobs), "knobs_source": ev.knobs_source,
           "costs_bps": ev.costs.cost_bps + ev.costs.slippage_bps,
           "val_dsr_trials": {"n_trials": ev.n_trials, "basis": ev.trials_source}, "selection": sel,
           "engine": rep.engine}
    shown = Choice(ev.epoch, ev.path, ev.sha256, choice.how, choice.candidates, choice.enough_trades,
                   choice.min_trades)
    echo(f"checkpoint: {shown.describe()}")
    k = doc["knobs"]
    gate = "none" if k["gate_threshold"] is None else f"{k['gate_threshold']:.4g}"
    if not shaping:
        echo("policy shaping off (--no-shaping): the greedy policy runs without its entry gate (E5) and regime "
             "confidence (E9)")
    echo(f"knobs: as trained, from {ev.knobs_source}: entry gate {gate}, regime confidence "
         f"[{', '.join(f'{c:.3g}' for c in k['regime_confidence'])}]")
    echo(f"val DSR deflated over {ev.trials_source}")
    echo(f"engine: {rep.engine or 'not recorded'}")
    if sel is not None:
        echo(f"selection DSR (val, deflated over the {len(choice.candidates)} checkpoints considered): "
             f"{sel['dsr_deflated_over_considered']:.4g}")
    window = getattr(rep, SPLITS[split])
    doc["metrics"] = dict(window.metrics)
    if report:
        doc["report"] = rep
    return doc


TABLE_COLUMNS = ("per_trade_sharpe", "n_trades", "total_return", "max_drawdown", "win_rate", "dsr")
"""The metrics `--checkpoint all|LIST` prints per checkpoint (`--json`: all of them)."""


def is_checkpoint_list(which: str | None) -> bool:
    """`--checkpoint` names several checkpoints: "all" or a comma list (e.g. "2,4,best")."""
    return which is not None and (which.strip().lower() == "all" or "," in which)


def evaluate_checkpoints(policy: str, *, which: str, split: str, dataset: str | None, seed: int | None,
                         device: str, min_trades: int, echo, shaping: bool = True) -> dict:
    """Several checkpoints of a run directory (`which`: "all", or a comma list of epochs, latest and best) on one
    split window, every one as `evaluate_agent` evaluates it alone — its knobs, the run's data, split and costs, the
    val DSR over the loop's trials — in ONE batched pass (`services.evaluator.cli_eval.windows_for_cli`). Returns the
    JSON document: one row per checkpoint, by epoch. Raises RunDirError, EvaluateInputError."""
    from services.evaluator.cli_eval import report_for_cli, windows_for_cli
    from services.evaluator.runs import RunDirError, checkpoints, choose, find_run, loop_trials

    p = Path(policy)
    if not p.is_dir():
        raise RunDirError(f"--checkpoint {which}: --policy {policy} is not a run directory; a list of checkpoints "
                          "picks among a run directory's")
    run = find_run(p)
    on_disk = checkpoints(run)
    if not on_disk:
        raise RunDirError(f"{run.checkpoints_dir}: no complete checkpoint (epoch-NNNN.safetensors with its .sha256)")
    items = [w.strip() for w in which.split(",") if w.strip()]
    if not items:
        raise RunDirError(f"--checkpoint {which!r}: no checkpoint named")
    chosen: dict[int, tuple[Path, str]] = {}

    def add(epoch: int, path: Path, how: str) -> None:
        """A checkpoint once, with every name the list gave it ("epoch 2, latest")."""
        path0, hows = chosen.get(epoch, (path, ""))
        chosen[epoch] = (path0, how if not hows else hows if how in hows.split(", ") else f"{hows}, {how}")

    for item in items:
        if item.lower() == "all":
            for e, path in on_disk.items():
                add(e, path, "all")
            continue

        def val_of(path: Path) -> tuple[float, int]:
            ev = report_for_cli(path, data=dataset, device=device, data_seed=seed, insample=False, oos=False,
                                shaping=shaping)
            m = ev.report.val.metrics
            return float(m["per_trade_sharpe"]), int(m["n_trades"])

        c = choose(run, item, min_trades=min_trades, val_of=val_of)
        add(c.epoch, c.path, c.how)
    epochs = sorted(chosen)
    paths = [chosen[e][0] for e in epochs]
    evs = windows_for_cli(paths, window=SPLITS[split], data=dataset, device=device, data_seed=seed,
                          trials=[loop_trials(run, e) if e else None for e in epochs], shaping=shaping)
    rows = [{"checkpoint": {"epoch": ev.epoch, "path": str(ev.path), "sha256": ev.sha256, "how": chosen[e][1]},
             "knobs": _knobs_used(ev.knobs), "knobs_source": ev.knobs_source,
             "val_dsr_trials": {"n_trials": ev.n_trials, "basis": ev.trials_source},
             "engine": ev.window.engine, "checkpoints_in_pass": ev.agents_in_pass, "metrics": dict(ev.window.metrics)}
            for e, ev in zip(epochs, evs)]
    first = evs[0]
    echo(f"{len(rows)} checkpoint(s) of {run.trainer}: engine {first.window.engine}, "
         + ("one batched pass" if first.agents_in_pass == len(rows) else "one pass per checkpoint (torch engine)"))
    echo(f"knobs: each as trained; costs {first.costs.cost_bps + first.costs.slippage_bps:.4g} bps")
    return {"policy": policy, "split": split, "dataset": first.dataset,
            "costs_bps": first.costs.cost_bps + first.costs.slippage_bps, "checkpoints": rows}


def checkpoint_table(doc: dict) -> list[str]:
    """The lines `--checkpoint all|LIST` prints: one row per checkpoint (Sharpes un-annualized, per trade)."""
    head = f"{'epoch':>6}" + "".join(f" {c:>17}" for c in TABLE_COLUMNS) + "  how"
    lines = [f"{doc['policy']} on {doc['dataset']} [{doc['split']}]  (Sharpes un-annualized, per trade)", head]
    for r in doc["checkpoints"]:
        ck = r["checkpoint"]
        lines.append(f"{ck['epoch']:>6}" + "".join(f" {_fmt(r['metrics'][c]):>17}" for c in TABLE_COLUMNS)
                     + f"  {ck['how']}")
    return lines


def register(app) -> None:
    """Add `tradeloop evaluate` (typer is imported here, so `policy_metrics` needs no CLI stack)."""
    import typer

    from shared.metrics import MIN_SELECTION_TRADES

    def evaluate(
        policy: str = typer.Option(..., "--policy", help="CKPT file, RUN_DIR (tradeloop train --out DIR, or a "
                                   "tradeloop up run), or oracle|random|flat|buy-and-hold."),
        checkpoint: str = typer.Option(None, "--checkpoint", help="RUN_DIR only: best (highest val per-trade Sharpe "
                                       "with enough val trades, as the loop reported), latest (default) or an "
                                       "epoch number; all, or a comma list (2,4,best): those checkpoints in one "
                                       "batched pass, one table row each."),
        min_val_trades: int = typer.Option(MIN_SELECTION_TRADES, "--min-val-trades",
                                           help="--checkpoint best: val trades a checkpoint needs to be chosen."),
        dataset: str = typer.Option(None, "--dataset", help="Dataset name (synthetic, sp500, eurusd) or file; "
                                    "default: the agent's training data (synthetic for a baseline)."),
        split: str = typer.Option("val", "--split", help="val or test (OOS)."),
        seed: int = typer.Option(None, "--seed", min=0, help="Seed of the synthetic data (default: the run's) and "
                                 "of the random policy (default 0)."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
        as_json: bool = typer.Option(False, "--json", help="Print the metrics as one JSON object."),
        report: bool = typer.Option(False, "--report", help="Agent only: the evaluator's full report (val, OOS, "
                                    "in-sample autopsy, calibration, ledgers, equity) as JSON, as the service "
                                    "stores it (trades and equity packed: shared.report.TradeTable.of(doc['val']"
                                    "['trades']).records() gives rows); what it ran with goes to stderr."),
        shaping: bool = typer.Option(True, "--shaping/--no-shaping",
                                     help="Agent only: run the greedy policy with the knobs that shape it as "
                                          "trained (E5 gate, E9 regime confidence), or without them (learning "
                                          "alone)."),
    ) -> None:
        """Run a policy over the validation or test split and print its metrics (Sharpes un-annualized)."""
        from shared.checkpoints import CheckpointError
        from shared.config import check_cuda
        from shared.market import DataError, chronological_split, load_dataset

        def fail(msg: str) -> None:
            typer.echo(f"error: {msg}", err=True)
            raise typer.Exit(2)

        if split not in SPLITS:
            fail(f"--split must be val or test, got {split!r}")
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            fail(f"--device must be cpu or cuda, got {device!r}")
        try:
            check_cuda(device)
        except ValueError as exc:
            fail(str(exc))
        if min_val_trades < 0:
            fail(f"--min-val-trades must be >= 0, got {min_val_trades}")
        if policy in BASELINES:
            if report:
                fail("--report needs a checkpoint or run directory (the autopsy reads the agent's predictions)")
            if checkpoint is not None:
                fail(f"--checkpoint picks among a run directory's checkpoints; {policy} is a baseline")
            dataset = dataset or "synthetic"
            try:
                bars = load_dataset(dataset, seed=seed or 0)
                m = policy_metrics(policy, dataset, bars, chronological_split(len(bars)), split, seed=seed or 0)
            except (DataError, ValueError, OSError) as exc:
                fail(str(exc))
            if as_json:
                typer.echo(json.dumps({"policy": policy, "dataset": dataset, "split": split, "metrics": m}))
                return
            typer.echo(f"{policy} on {dataset} [{split}]  (Sharpes un-annualized)")
            for k, v in m.items():
                typer.echo(f"  {k:<18} {_fmt(v)}")
            return

        from services.evaluator.cli_eval import EvaluateInputError
        from services.evaluator.runs import RunDirError

        quiet = as_json or report
        if is_checkpoint_list(checkpoint):
            if report:
                fail("--report takes one checkpoint; --checkpoint all or a list prints a table (--json: its rows)")
            try:
                doc = evaluate_checkpoints(policy, which=checkpoint, split=split, dataset=dataset, seed=seed,
                                           device=device, min_trades=min_val_trades, shaping=shaping,
                                           echo=lambda line: typer.echo(line, err=quiet))
            except (EvaluateInputError, RunDirError, CheckpointError, DataError, OSError) as exc:
                fail(str(exc))
            if as_json:
                typer.echo(json.dumps(doc))
            else:
                for line in checkpoint_table(doc):
                    typer.echo(line)
            return
        try:
            doc = evaluate_agent(policy, which=checkpoint, split=split, dataset=dataset, seed=seed, device=device,
                                 min_trades=min_val_trades, report=report, shaping=shaping,
                                 echo=lambda line: typer.echo(line, err=quiet))
        except (EvaluateInputError, RunDirError, CheckpointError, DataError, OSError) as exc:
            fail(str(exc))
        if report:
            typer.echo(doc["report"].model_dump_json())
            return
        if as_json:
            typer.echo(json.dumps({"policy": policy, "split": split, **doc}))
            return
        typer.echo(f"{policy} on {doc['dataset']} [{split}]  (Sharpes un-annualized, per trade unless per_bar)")
        for k, v in doc["metrics"].items():
            typer.echo(f"  {k:<18} {_fmt(v)}")

    app.command("evaluate")(evaluate)
