"""The command-line evaluation of checkpoints (`tradeloop evaluate`): a checkpoint file's inputs (its run's data,
split, costs, the knobs it trained under, the loop's val DSR trials) resolved as the loop's evaluator resolves them,
then one checkpoint's full report (`report_for_cli`) or one window of several checkpoints in one batched pass
(`windows_for_cli`), through `services.evaluator.runner`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from services.evaluator.runs import CHECKPOINT_NAME
from services.evaluator.runner import (eval_controls, evaluate_checkpoint, restore_agent, run_windows_many,
                                       split_reports)
from shared.checkpoints import CheckpointError, checkpoint_sha256, load_checkpoint, sidecar_path
from shared.execution import CostModel
from shared.knobs import Knobs
from shared.market import Bars, Split, chronological_split, compute_features, load_dataset
from shared.runfiles import read_history

if TYPE_CHECKING:
    from shared.report import EvalReport


class EvaluateInputError(ValueError):
    """Bad input to `tradeloop evaluate` (message names the file and what is wrong); the CLI exits 2."""


def _run_dir_of(checkpoint: Path) -> Path | None:
    d = checkpoint.resolve().parent.parent
    return d if (d / "run.json").exists() else None


def refuse_foreign(path: Path, meta: dict, run_meta: dict, run_json: Path) -> None:
    """EvaluateInputError unless checkpoint `path` (its metadata `meta`) is of the run it sits in: the epoch its name
    gives, and the run's config and split (run.json's `config_hash` and `split_hashes`, where both say) — a file
    copied in from another run would be evaluated, and chosen as `best`, under this run's name."""
    named = CHECKPOINT_NAME.match(path.name)
    if named and meta.get("epoch") is not None and int(meta["epoch"]) != int(named.group(1)):
        raise EvaluateInputError(f"checkpoint {path}: its metadata says epoch {meta['epoch']}, its name epoch "
                                 f"{int(named.group(1))}: not this run's file of that epoch")
    for key in ("config_hash", "split_hashes"):
        mine, run = meta.get(key), run_meta.get(key)
        if mine and run and mine != run:
            raise EvaluateInputError(f"checkpoint {path}: its {key} differs from {run_json}'s: a checkpoint of "
                                     "another run (another config, data or split); evaluate it as a file outside "
                                     "this run's checkpoints/, or from its own run")


def _knobs_from_history(run_dir: Path, epoch: int) -> dict | None:
    knobs = read_history(run_dir / "history.jsonl").get(epoch, {}).get("knobs")
    return knobs if isinstance(knobs, dict) else None


@dataclass
class CheckpointProvenance:
    """What a command-line evaluation of a checkpoint was computed with (named on the command line)."""

    path: Path
    """The checkpoint file."""
    sha256: str
    """Its sha256, verified before it was loaded."""
    epoch: int
    knobs: Knobs | None
    """The knobs the policy ran under (its gate threshold and regime confidence): those it trained under."""
    knobs_source: str
    """Where they came from: the checkpoint's metadata, the run's history.jsonl, or nowhere (no gate)."""
    n_trials: int
    trials_source: str
    """What the val DSR is deflated over: the run's stored reports (the loop's trials) or the epoch count."""
    costs: CostModel
    dataset: str

    @classmethod
    def of(cls, c: "_CliInputs", **rest: Any):
        """This kind of evaluation of the checkpoint `c` names, with its own fields `rest`."""
        return cls(path=c.path, sha256=c.sha256, epoch=c.epoch, knobs=c.knobs, knobs_source=c.knobs_source,
                   n_trials=c.n_trials, trials_source=c.trials_source, costs=c.costs, dataset=c.dataset, **rest)


@dataclass
class CliEvaluation(CheckpointProvenance):
    """`report_for_cli`'s answer: the report, and what it was computed with."""

    report: EvalReport


def report_for_cli(checkpoint: str | os.PathLike, *, data: str | None = None, expected_sha256: str | None = None,
                   run_id: str | None = None, device: str = "cpu", cost_bps: float | None = None,
                   slippage_bps: float = 0.0, insample: bool = True, oos: bool = True, data_seed: int | None = None,
                   trials: tuple[int, Sequence[float], str] | None = None, shaping: bool = True) -> CliEvaluation:
    """The full report of a checkpoint file, as the loop's evaluator computes it (`tradeloop evaluate`, plain and
    `--report` alike).

    data: a bundled dataset name or a CSV/Parquet path; default: the dataset the checkpoint trained on, seeded as the
    run's data (run.json "data_seed", else the run's seed; `data_seed` overrides). On the training data the run's
    split is used (metadata "split"); on other data a fresh chronological split.
    The knobs are those the checkpoint trained under — the metadata's, else the run directory's history.jsonl (the
    checkpoint's `<run>/checkpoints/` parent) — as the loop's evaluator applies them; costs: `cost_bps`, else the
    metadata's (the loop's), else the run's config. The windows are the loop's (validation, OOS and, with
    `insample`, the in-sample window), evaluated together as the loop's evaluator does; `oos=False`,
    `insample=False`: validation alone (what choosing a run's best checkpoint needs).
    trials: (n_trials, the earlier checkpoints' val per-trade Sharpes, where they came from) for the val DSR — the
    loop's reports (`services.evaluator.runs.loop_trials`); default: n_trials = the checkpoint's epoch, the trials'
    variance the null one (`shared.metrics.dsr`).
    shaping: see `evaluate_checkpoint` (False: without the knobs that shape the greedy policy, E5 and E9).
    Raises EvaluateInputError (message names the file / dataset and the problem) on bad input.
    """
    c = _cli_inputs(checkpoint, data=data, expected_sha256=expected_sha256, cost_bps=cost_bps,
                    slippage_bps=slippage_bps, data_seed=data_seed, trials=trials)
    try:
        rep = evaluate_checkpoint(c.blob, expected_sha256=c.expected, bars=c.bars, split=c.split,
                                  run_id=run_id or (c.run_dir.name if c.run_dir else c.path.stem), epoch=c.epoch,
                                  n_trials=c.n_trials, prior_sharpes=c.prior, insample_bars=-1 if insample else 0,
                                  device=device, costs=c.costs, dataset=c.dataset, knobs=c.knobs, oos=oos,
                                  shaping=shaping)
    except (CheckpointError, ValueError) as exc:
        raise EvaluateInputError(_named(exc, c.path)) from None
    return CliEvaluation.of(c, report=rep)


def _named(exc: ValueError, path: Path) -> str:
    """The message of an error about a checkpoint's bytes, naming its file: a CheckpointError's source (the
    evaluator loads the verified bytes, "<N bytes>") replaced by `path`."""
    return f"checkpoint {path}: {exc.reason}" if isinstance(exc, CheckpointError) else str(exc)


@dataclass
class _CliInputs:
    """What `tradeloop evaluate` evaluates one checkpoint with (`_cli_inputs`)."""

    path: Path
    blob: bytes
    expected: str
    sha256: str
    run_dir: Path | None
    bars: Bars
    data_key: tuple
    """(dataset, data seed): checkpoints with the same key read the same bars."""
    split: Split
    dataset: str
    epoch: int
    knobs: Knobs | None
    knobs_source: str
    costs: CostModel
    n_trials: int
    prior: Sequence[float]
    trials_source: str


def _cli_inputs(checkpoint: str | os.PathLike, *, data: str | None, expected_sha256: str | None,
                cost_bps: float | None, slippage_bps: float, data_seed: int | None,
                trials: tuple[int, Sequence[float], str] | None, loaded: dict | None = None) -> _CliInputs:
    """The checkpoint's bytes (sha256 verified), data, split, knobs, costs and val DSR trials, as `report_for_cli`
    documents them. `loaded`: (dataset, seed) → bars already loaded (filled in here). EvaluateInputError on bad
    input."""
    from shared.market import DataError

    path = Path(checkpoint)
    if not path.is_file():
        raise EvaluateInputError(f"checkpoint {path}: file not found")
    blob = path.read_bytes()
    expected = expected_sha256
    if expected is None:
        side = sidecar_path(path)
        if not side.is_file():
            raise EvaluateInputError(f"checkpoint {path}: no sha256 to verify against ({side.name}, which the "
                                     "trainer writes beside every checkpoint, is missing): a checkpoint is loaded "
                                     "only once its sha256 is checked")
        expected = (side.read_text(errors="replace").split() or [""])[0]
    try:
        meta = load_checkpoint(blob, expected)[1]
    except CheckpointError as exc:
        raise EvaluateInputError(_named(exc, path)) from None
    sha = checkpoint_sha256(blob)
    run_dir = _run_dir_of(path)
    run_meta = json.loads((run_dir / "run.json").read_text()) if run_dir else {}
    if run_dir is not None:
        refuse_foreign(path, meta, run_meta, run_dir / "run.json")
    trained_on = meta.get("dataset") or run_meta.get("dataset")
    name = data or trained_on
    if not name:
        raise EvaluateInputError(f"checkpoint {path}: its metadata names no dataset; pass --dataset NAME|FILE")
    if data_seed is None:
        data_seed = int(run_meta.get("data_seed", run_meta.get("seed", meta.get("seed"))) or 0)
    try:
        key = (str(name), int(data_seed))
        bars = loaded[key] if loaded is not None and key in loaded else load_dataset(name, seed=data_seed)
        if loaded is not None:
            loaded[key] = bars
    except DataError as exc:
        raise EvaluateInputError(str(exc)) from None
    except (FileNotFoundError, OSError) as exc:
        raise EvaluateInputError(f"dataset {name}: {exc}") from None
    split_d = meta.get("split") or run_meta.get("split")
    same_data = split_d is not None and name == trained_on
    try:
        split = Split.from_dict(split_d) if same_data else chronological_split(len(bars))
    except ValueError as exc:
        raise EvaluateInputError(f"dataset {name}: {exc}") from None
    if same_data:
        hashes = meta.get("split_hashes") or run_meta.get("split_hashes") or {}

        def differs(b: Bars) -> bool:                   # not the bars the checkpoint trained on
            return split.test[1] > len(b) or bool(hashes.get("train")) and hashes["train"] != split.window_hash(
                b, "train")

        n_run = run_meta.get("n_bars")
        if str(name).strip().lower() == "synthetic" and n_run and n_run != len(bars) and differs(bars):
            # a study generates a synthetic market of its own length (`--bars`); `up --data-bars` cuts the default
            # one: the train window's hash tells which, so nothing is evaluated on bars it did not train on
            try:
                own = load_dataset(name, seed=data_seed, n_bars=int(n_run))
            except (DataError, ValueError):
                own = None
            if own is not None and not differs(own):
                bars, key = own, (str(name), int(data_seed), int(n_run))
        if differs(bars):
            raise EvaluateInputError(f"dataset {name} (seed {data_seed}): these bars differ from those checkpoint "
                                     f"{path} trained on (train window sha256 mismatch)")
    epoch = int(meta.get("epoch") or 0)
    knobs_d, knobs_source = meta.get("knobs"), "the checkpoint's metadata"
    if knobs_d is None and run_dir is not None:
        knobs_d, knobs_source = _knobs_from_history(run_dir, epoch), f"{run_dir / 'history.jsonl'} (epoch {epoch})"
    if knobs_d is None:
        knobs_source = "none recorded: no entry gate, regime confidence 1"
    cfg_costs = meta.get("costs_bps", (run_meta.get("config") or {}).get("costs_bps"))   # the loop's: metadata
    costs = CostModel(cost_bps if cost_bps is not None else float(cfg_costs if cfg_costs is not None else 1.0),
                      slippage_bps)
    if trials is not None and not same_data:
        trials = None                                       # the loop's trials were on the run's own data
    if trials is None:
        trials = (max(1, epoch), (), f"{max(1, epoch)} checkpoints (the epoch; no stored reports of the earlier "
                                     "ones on these data: the trials' variance is the null 1/(n − 1))")
    n_trials, prior, trials_source = trials
    knobs = None if knobs_d is None else Knobs.from_dict(knobs_d)
    return _CliInputs(path=path, blob=blob, expected=expected, sha256=sha, run_dir=run_dir, bars=bars, data_key=key,
                      split=split, dataset=str(name), epoch=epoch, knobs=knobs, knobs_source=knobs_source,
                      costs=costs, n_trials=n_trials, prior=prior, trials_source=trials_source)


@dataclass
class CliWindowEvaluation(CheckpointProvenance):
    """One checkpoint's row of `windows_for_cli`: its report of the window and what it was computed with."""

    window: Any
    """The window's `shared.report.SplitReport` (metrics, trades, equity, autopsy)."""
    agents_in_pass: int
    """Checkpoints whose accounts shared the sequential pass (K on the native loop; 1 on a torch mode)."""


def windows_for_cli(checkpoints: Sequence[str | os.PathLike], *, window: str = "val", data: str | None = None,
                    device: str = "cpu", cost_bps: float | None = None, slippage_bps: float = 0.0,
                    data_seed: int | None = None,
                    trials: Sequence[tuple[int, Sequence[float], str] | None] | None = None,
                    shaping: bool = True, accel: str = "auto") -> list[CliWindowEvaluation]:
    """The report of one window ("val" or "oos") of each of several checkpoints of one run, as `report_for_cli`
    computes it for each alone (its knobs, the run's data, split and costs, its val DSR trials: `trials[k]`), with
    every checkpoint evaluated in one batched pass (`run_windows_many`: one encoder/view table per checkpoint, one
    sequential pass of all of them). The checkpoints must share one architecture, dataset, split and costs
    (EvaluateInputError naming the first that does not)."""
    if not checkpoints:
        raise EvaluateInputError("no checkpoint to evaluate")
    if window not in ("val", "oos"):
        raise EvaluateInputError(f"window must be val or oos, got {window!r}")
    trials = list(trials) if trials is not None else [None] * len(checkpoints)
    loaded: dict = {}
    ins = [_cli_inputs(ck, data=data, expected_sha256=None, cost_bps=cost_bps, slippage_bps=slippage_bps,
                       data_seed=data_seed, trials=t, loaded=loaded) for ck, t in zip(checkpoints, trials)]
    first = ins[0]
    for c in ins[1:]:
        for what, a, b in (("dataset", c.data_key, first.data_key), ("split", c.split, first.split),
                           ("costs", c.costs, first.costs)):
            if a != b:
                raise EvaluateInputError(f"checkpoint {c.path}: another {what} than {first.path} ({a} vs {b}): "
                                         "checkpoints evaluated together must share the run's data, split and costs")
    agents = []
    for c in ins:
        try:
            agents.append(restore_agent(c.blob, expected_sha256=c.expected, device=device)[0])
        except CheckpointError as exc:
            raise EvaluateInputError(_named(exc, c.path)) from None
    try:
        w = tuple(getattr(first.split, "test" if window == "oos" else "val"))
        runs = run_windows_many(agents, first.bars, [w], controls=[eval_controls(c.knobs, device, shaping)
                                                                   for c in ins],
                                costs=first.costs, features=compute_features(first.bars), device=device, accel=accel)
    except (CheckpointError, ValueError) as exc:
        raise EvaluateInputError(str(exc)) from None
    out = []
    for c, (run,) in zip(ins, runs):
        rep = split_reports([(window, w)], [run], first.bars, c.costs, c.n_trials, c.prior)[window]
        out.append(CliWindowEvaluation.of(c, window=rep, agents_in_pass=run.agents_in_pass))
    return out
