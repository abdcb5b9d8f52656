"""`tradeloop evaluate` — run a policy over a split through the one simulator and print its metrics.

Policies: a trained agent (`CKPT` file or `RUN_DIR`, latest checkpoint; run greedily by `shared.rollout`), or a
baseline of `shared.baselines` (oracle, random, flat, buy-and-hold) run through `shared.execution.run_positions`.
Metrics (`shared.metrics.compute_metrics`; Sharpes un-annualized, per trade / per bar) of one account.
`policy_metrics` is the library entry point (used by bench/learning.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from shared.baselines import BASELINES, baseline_targets

__all__ = ["BASELINES", "baseline_targets", "policy_metrics", "register", "resolve_checkpoint"]


def resolve_checkpoint(policy: str) -> Path:
    """A checkpoint file, or the latest `epoch-NNNN.safetensors` of RUN_DIR/checkpoints."""
    p = Path(policy)
    if p.is_dir():
        cks = sorted((p / "checkpoints").glob("epoch-[0-9][0-9][0-9][0-9].safetensors"))
        if not cks:
            raise FileNotFoundError(f"{p}: no checkpoints/epoch-NNNN.safetensors in this run directory")
        return cks[-1]
    if not p.is_file():
        raise FileNotFoundError(f"{policy}: not a checkpoint file, a run directory, or one of {', '.join(BASELINES)}")
    return p


def policy_metrics(policy: str, dataset: str, bars, split, which: str, *, seed: int = 0, device: str = "cpu",
                   cost_bps: float = 1.0) -> dict:
    """Metrics of `policy` (baseline name, checkpoint or run dir) on split window `which` of `bars`."""
    import numpy as np

    from shared.execution import CostModel, Prices, run_positions
    from shared.metrics import compute_metrics, metrics_from_backtest

    start, stop = split.window(which)
    costs = CostModel(cost_bps)
    if policy in BASELINES:
        tg = baseline_targets(policy, dataset, bars, start, stop, seed)
        res = run_positions(Prices.from_bars(bars.slice(start, stop)), tg, costs)
        return metrics_from_backtest(res)
    from shared.agent import agent_from_checkpoint
    from shared.checkpoints import load_checkpoint
    from shared.rollout import MarketTensors, evaluate_policy

    agent = agent_from_checkpoint(*load_checkpoint(resolve_checkpoint(policy)), device=device)
    market = MarketTensors.from_bars(bars, start, stop, agent.cfg.window, device)
    run = evaluate_policy(agent, market, costs=costs)
    lg = run.ledger
    return compute_metrics(lg["net_return"].to_numpy(np.float64), run.bar_returns, run.positions,
                           lg["bars"].to_numpy(np.float64))


def _fmt(v: float) -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.4g}"


def register(app) -> None:
    """Add `tradeloop evaluate` (typer is imported here, so `policy_metrics` needs no CLI stack)."""
    import typer

    def evaluate(
        policy: str = typer.Option(..., "--policy", help="CKPT file, RUN_DIR, or oracle|random|flat|buy-and-hold."),
        dataset: str = typer.Option(None, "--dataset", help="Dataset name (synthetic, sp500, eurusd) or file; default: "
                                    "the one the checkpoint trained on (a baseline: synthetic)."),
        split: str = typer.Option("val", "--split", help="val or test (OOS)."),
        seed: int = typer.Option(0, "--seed", help="Seed of the synthetic data and of the random policy."),
        device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
        as_json: bool = typer.Option(False, "--json", help="Print the metrics as one JSON object."),
        report: bool = typer.Option(False, "--report", help="Agent only: the evaluator's full report (val, OOS, "
                                    "in-sample autopsy, calibration, ledgers, equity) as JSON, as the service "
                                    "stores it (trades and equity packed: shared.report.TradeTable.of(doc['val']"
                                    "['trades']).records() gives rows)."),
    ) -> None:
        """Run a policy over the validation or test split and print its metrics (Sharpes un-annualized)."""
        from shared.checkpoints import CheckpointError
        from shared.market import DataError, chronological_split, load_dataset

        if report:
            if policy in BASELINES:
                typer.echo("error: --report needs a checkpoint or run directory (the autopsy reads the agent's "
                           "predictions)", err=True)
                raise typer.Exit(2)
            from services.evaluator.runner import EvaluateInputError, report_for_cli

            try:
                rep = report_for_cli(resolve_checkpoint(policy), data=dataset, device=device)
            except (EvaluateInputError, FileNotFoundError) as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            typer.echo(rep.model_dump_json())
            return

        if split not in ("val", "test", "train"):
            typer.echo(f"error: --split must be val or test, got {split!r}", err=True)
            raise typer.Exit(2)
        if device not in ("cpu", "cuda"):
            typer.echo(f"error: --device must be cpu or cuda, got {device!r}", err=True)
            raise typer.Exit(2)
        try:
            run_json = None
            if policy not in BASELINES:
                run_json = resolve_checkpoint(policy).parent.parent / "run.json"
                run_meta = json.loads(run_json.read_text()) if run_json.exists() else {}
                if dataset not in (None, run_meta.get("dataset")):
                    run_json = None                  # other data than the run's: a fresh split of it
                dataset = dataset or run_meta.get("dataset")
            dataset = dataset or "synthetic"
            bars = load_dataset(dataset, seed=seed)
            sp = chronological_split(len(bars))
            if run_json is not None and run_json.exists():  # evaluate on the run's own split
                from shared.market import Split

                sp = Split.from_dict(json.loads(run_json.read_text())["split"])
            m = policy_metrics(policy, dataset, bars, sp, split, seed=seed, device=device)
        except (DataError, CheckpointError, FileNotFoundError, ValueError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
        if as_json:
            typer.echo(json.dumps({"policy": policy, "dataset": dataset, "split": split, "metrics": m}))
            return
        typer.echo(f"{policy} on {dataset} [{split}]  (Sharpes un-annualized)")
        for k, v in m.items():
            typer.echo(f"  {k:<18} {_fmt(v)}")

    app.command("evaluate")(evaluate)
