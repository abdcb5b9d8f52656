"""The run directories tradeloop writes, read back to pick a checkpoint: `tradeloop evaluate --policy RUN
--checkpoint best|latest|N`, and the best checkpoint named in `tradeloop up`'s summary.

Layouts:
  `tradeloop train --out DIR`    DIR/run.json, DIR/history.jsonl, DIR/checkpoints/epoch-NNNN.safetensors (+ .sha256)
  `tradeloop up`, the services   RUN/trainer/ as above (TL_RUN_DIR/TL_RUN_ID/trainer), and RUN/summary.json: the loop's
                                 reports of each epoch (val / OOS per-trade Sharpe and trades, the val DSR, the
                                 checkpoint's sha256), written when `up` stops
A path may name the run in either layout, its trainer directory, or its checkpoints directory. A checkpoint counts
when its sha256 sidecar exists (a write killed before the sidecar leaves an epoch that is never loaded).

"best" (`shared.metrics.select_best`): the highest validation per-trade Sharpe (un-annualized) among the checkpoints
with at least `min_trades` validation trades, as the loop's reports say — the summary row whose sha256 is the
checkpoint's; a checkpoint without one (a `tradeloop train` run, a summary not written) is evaluated on validation
here, by the evaluator's own function. Its DSR is deflated over every checkpoint considered
(`shared.metrics.selection_dsr`): the reported ones, including those whose files were pruned, and those evaluated.

Imports nothing heavy (the launcher reads summaries with it): the evaluation is handed in.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shared.metrics import MIN_SELECTION_TRADES, select_best
from shared.runfiles import TRAINER_DIR

CHECKPOINT_NAME = re.compile(r"^epoch-(\d{4,})\.safetensors$")


class RunDirError(ValueError):
    """A path that is not a run directory tradeloop wrote, or a checkpoint it does not hold (the message says which
    and what was looked for)."""


@dataclass(frozen=True)
class RunDir:
    """Where a run's pieces are."""

    trainer: Path
    """The directory with run.json, history.jsonl and checkpoints/."""
    summary: Path | None
    """`tradeloop up`'s summary.json of the run, when it exists."""

    @property
    def checkpoints_dir(self) -> Path:
        return self.trainer / "checkpoints"


def find_run(path: str | Path) -> RunDir:
    """The run that `path` names: a run directory of either layout, its trainer directory or its checkpoints
    directory. RunDirError when none of them holds checkpoints/."""
    p = Path(path)
    if not p.is_dir():
        raise RunDirError(f"{p}: not a directory")
    for trainer in (p, p / TRAINER_DIR, p.parent if p.name == "checkpoints" else None):
        if trainer is not None and (trainer / "checkpoints").is_dir():
            root = trainer.parent if trainer.name == TRAINER_DIR else trainer
            summary = root / "summary.json"
            return RunDir(trainer=trainer, summary=summary if summary.is_file() else None)
    raise RunDirError(f"{p}: not a run directory (no checkpoints/ in it, nor in {p / TRAINER_DIR}: `tradeloop train "
                      f"--out DIR` writes DIR/checkpoints, `tradeloop up` RUN/trainer/checkpoints)")


def run_of_checkpoint(path: str | Path) -> RunDir | None:
    """The run a checkpoint file belongs to (its `checkpoints/` directory's), None for a file elsewhere."""
    p = Path(path).resolve()
    if p.parent.name != "checkpoints":
        return None
    try:
        return find_run(p.parent)
    except RunDirError:
        return None


def checkpoints(run: RunDir) -> dict[int, Path]:
    """epoch → agent checkpoint file of every complete checkpoint (its sha256 sidecar written), by epoch."""
    out = {}
    for p in run.checkpoints_dir.iterdir():
        m = CHECKPOINT_NAME.match(p.name)
        if m and p.is_file() and p.with_name(p.name + ".sha256").is_file():
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def sidecar_sha256(path: Path) -> str:
    """The sha256 a checkpoint's sidecar records (its bytes are checked against it when loaded)."""
    text = path.with_name(path.name + ".sha256").read_text(errors="replace").split()
    return text[0].lower() if text else ""


@dataclass(frozen=True)
class LoopReport:
    """What the loop's evaluator reported for one checkpoint (a summary row)."""

    epoch: int
    sha256: str
    val_sharpe: float
    """Validation per-trade Sharpe, un-annualized."""
    val_trades: int | None
    n_trials: int | None
    """Checkpoints its val DSR was deflated over (None: a summary that does not say)."""


def loop_reports(run: RunDir) -> dict[int, LoopReport]:
    """epoch → the loop's report of that epoch's checkpoint, from the run's summary.json (empty without one, or
    with a summary that cannot be read: the checkpoints are then evaluated)."""
    if run.summary is None:
        return {}
    try:
        rows = json.loads(run.summary.read_text()).get("epochs") or []
    except (OSError, ValueError, AttributeError):
        return {}
    out = {}
    for r in rows:
        if not isinstance(r, dict) or r.get("val_per_trade_sharpe") is None or not r.get("checkpoint_sha256"):
            continue
        trades, trials = r.get("val_n_trades"), r.get("val_n_trials")
        out[int(r["epoch"])] = LoopReport(epoch=int(r["epoch"]), sha256=str(r["checkpoint_sha256"]).lower(),
                                          val_sharpe=float(r["val_per_trade_sharpe"]),
                                          val_trades=None if trades is None else int(trades),
                                          n_trials=None if trials is None else int(trials))
    return out


def loop_trials(run: RunDir, epoch: int) -> tuple[int, list[float], str] | None:
    """(n_trials, the earlier checkpoints' val per-trade Sharpes, a note) of the loop's val DSR of epoch `epoch`:
    what the loop's evaluator deflated over (the reports stored before it). None without the loop's reports."""
    reports = loop_reports(run)
    if not reports:
        return None
    prior = [r.val_sharpe for e, r in reports.items() if e < epoch]
    own = reports.get(epoch)
    n = own.n_trials if own is not None and own.n_trials else len(prior) + 1
    note = (f"{n} checkpoint{'' if n == 1 else 's'} (those the loop had reported by then), the trials' variance "
            f"from the loop's reports ({run.summary})")
    return n, prior[:max(0, n - 1)], note


@dataclass
class Candidate:
    """One checkpoint considered for "best"."""

    epoch: int
    path: Path | None
    """None: reported by the loop, its file no longer on disk (a trial, not selectable)."""
    sha256: str
    val_sharpe: float
    val_trades: int
    source: str
    """"loop report" or "evaluated here"."""


@dataclass
class Choice:
    """The checkpoint `--checkpoint` picked."""

    epoch: int
    path: Path
    sha256: str
    how: str
    """"latest", "epoch N" or "best"."""
    candidates: list[Candidate] = field(default_factory=list)
    """best: every checkpoint considered, by epoch (the trials of the selection's DSR)."""
    enough_trades: bool = True
    """best: whether any selectable checkpoint had `min_trades` validation trades (else the best of all)."""
    min_trades: int = MIN_SELECTION_TRADES

    def describe(self) -> str:
        """One line naming the checkpoint and why it was taken."""
        line = f"epoch {self.epoch} ({self.how}) {self.path} sha256 {self.sha256}"
        if self.how == "best":
            on_disk = sum(c.path is not None for c in self.candidates)
            sources = sorted({c.source for c in self.candidates})
            enough = sum(c.path is not None and c.val_trades >= self.min_trades for c in self.candidates)
            line += ("; highest val per-trade Sharpe among " +
                     (f"the {enough} with ≥ {self.min_trades} val trades of " if self.enough_trades else "") +
                     f"{len(self.candidates)} checkpoints ({on_disk} on disk; {' and '.join(sources)})" +
                     ("" if self.enough_trades else
                      f" — NONE has ≥ {self.min_trades} val trades: the best of all, on few trades"))
        return line


def choose(run: RunDir, which: str, *, min_trades: int = MIN_SELECTION_TRADES,
           val_of: Callable[[Path], tuple[float, int]] | None = None) -> Choice:
    """The checkpoint of `run` named by `which`: "latest", "best", or an epoch number. `val_of(path)` → (validation
    per-trade Sharpe, validation trades) evaluates a checkpoint the loop's reports do not cover ("best" only).
    RunDirError naming what is missing."""
    cks = checkpoints(run)
    if not cks:
        raise RunDirError(f"{run.checkpoints_dir}: no complete checkpoint (epoch-NNNN.safetensors with its .sha256)")
    w = which.strip().lower()
    if w == "latest":
        e = max(cks)
        return Choice(e, cks[e], sidecar_sha256(cks[e]), "latest")
    if w.isdigit():
        e = int(w)
        if e not in cks:
            raise RunDirError(f"{run.checkpoints_dir}: no checkpoint of epoch {e} (epochs on disk: "
                              f"{', '.join(map(str, cks))})")
        return Choice(e, cks[e], sidecar_sha256(cks[e]), f"epoch {e}")
    if w != "best":
        raise RunDirError(f"--checkpoint must be best, latest or an epoch number, got {which!r}")
    reports = loop_reports(run)
    cands: list[Candidate] = []
    for e in sorted(set(cks) | set(reports)):
        path, rep = cks.get(e), reports.get(e)
        sha = sidecar_sha256(path) if path is not None else (rep.sha256 if rep else "")
        if rep is not None and rep.sha256 == sha and rep.val_trades is not None:
            cands.append(Candidate(e, path, sha, rep.val_sharpe, rep.val_trades, "loop report"))
        elif path is not None:
            if val_of is None:
                raise RunDirError(f"{path}: no loop report of this checkpoint and nothing to evaluate it with")
            sr, n = val_of(path)
            # a file whose own sidecar matches but whose bytes are not those the loop trained and reported (copied
            # over, rewritten): evaluated, and said so
            src = "evaluated here" if rep is None else (f"evaluated here — epoch {e}'s file is not the one the loop "
                                                        f"reported (sha256 {rep.sha256[:12]}…)")
            cands.append(Candidate(e, path, sha, float(sr), int(n), src))
    selectable = [c for c in cands if c.path is not None]
    i, enough = select_best([c.val_sharpe for c in selectable], [c.val_trades for c in selectable], min_trades)
    best = selectable[i]
    return Choice(best.epoch, best.path, best.sha256, "best", cands, enough, min_trades)


def best_of_summary(rows: list[dict], run_path: Path, *, min_trades: int = MIN_SELECTION_TRADES) -> dict | None:
    """`tradeloop up`'s summary entry for the run's best checkpoint (the rule of `choose`, on the loop's reports of
    the rows whose checkpoint is on disk), with the command that evaluates it; None when no row has a report."""
    ck_dir = Path(run_path) / TRAINER_DIR / "checkpoints"
    rows = [r for r in rows if r.get("val_per_trade_sharpe") is not None and r.get("val_n_trades") is not None
            and (ck_dir / f"epoch-{int(r['epoch']):04d}.safetensors").is_file()]
    if not rows:
        return None
    i, enough = select_best([float(r["val_per_trade_sharpe"]) for r in rows], [int(r["val_n_trades"]) for r in rows],
                            min_trades)
    r = rows[i]
    from shared.config import cli_command

    return {"epoch": r["epoch"], "path": str(ck_dir / f"epoch-{int(r['epoch']):04d}.safetensors"),
            "sha256": r.get("checkpoint_sha256"), "val_per_trade_sharpe": r["val_per_trade_sharpe"],
            "val_n_trades": r["val_n_trades"], "oos_per_trade_sharpe": r.get("oos_per_trade_sharpe"),
            "oos_n_trades": r.get("oos_n_trades"), "selected_among": len(rows),
            "rule": f"highest val per-trade Sharpe (un-annualized) among checkpoints with >= {min_trades} val trades"
                    + ("" if enough else f" (none had {min_trades}: the best of all)"),
            "command": f"{cli_command()} evaluate --policy {run_path} --checkpoint best --split test"}
