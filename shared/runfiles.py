"""A run's directory on disk: every document the services store in Redis is also written here, as a file, when
it is stored — so a finished run, or a directory of runs, can be read (`tradeloop show`, `tradeloop serve
dashboard --runs DIR`) with no Redis running.

Layout of a run directory (`TL_RUN_DIR/TL_RUN_ID`, `CommonSettings.run_path`):

    trainer/run.json              the run's dataset, seed, config, split and its hashes (the trainer)
    trainer/checkpoints/          epoch-NNNN.safetensors (+ sha256 sidecars, trainer state)
    trainer/history.jsonl         the trainer's own log of epoch records
    epochs/epoch-NNNN.json        the epoch record as stored in Redis (stats, checkpoint id and sha256, knobs,
                                  bundle applied)
    reports/epoch-NNNN.json       the evaluator's `EvalReport` as stored in Redis (trades and equity as packed
                                  columns: `shared.report.TradeTable`, `PackedFloats`)
    bundles/epoch-NNNN.json       the feedback service's `FeedbackBundle` computed from that epoch's report
    market/val.parquet            per bar of the validation window: bar (absolute index), timestamp, close,
    market/oos.parquet            buy_and_hold (the equity of holding one unit long through the simulator,
                                  1.0 at the window's first bar) — written once per window by the evaluator

A study's run (`tradeloop study`: `<out>/runs/<run-id>/`, `tradeloop/study/loop.py`) keeps each epoch's report and
bundle in one record instead, `loop/epoch-NNNN.json` (`read_records`; beside run.json, history.jsonl, checkpoints/,
loop/split_definition.json, and summary.json once the run is done: the study's selected epoch and its OOS
metrics). `RunFiles.read` gives a study run's "report" and "bundle" of an epoch from its record (`report_of_record`,
`bundle_of_record`): the validation and in-sample metrics, the selected checkpoint's OOS metrics, the knobs, the
bundle's signals, knobs and rollback — no trade ledger and no equity curve, which a record does not keep.

Every file is written atomically (a temporary file in the same directory, fsynced, then `os.replace`): a reader
sees the previous version or the new one, never half a file. A directory of runs is any directory tree holding
run directories (`find_runs`), e.g. the `runs/` of `tradeloop up` or the seeds of a study.

Web/plumbing side: the standard library, numpy, and pandas + pyarrow for the market files only.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, Iterable

KINDS = {"report": "reports", "bundle": "bundles", "epoch": "epochs"}
"""Document kind → sub-directory of the run directory."""
TRAINER_DIR = "trainer"
"""Sub-directory of a service run's directory with the trainer's files (run.json, checkpoints/, history.jsonl);
`tradeloop train --out DIR` writes them in DIR itself."""
UP_FILE = "up.json"
"""What `tradeloop up` started a run with (`tradeloop.up.runs`: its epochs, dataset, config, ...)."""
LOOP_DIR = "loop"
"""Sub-directory of a study's run directory with its epoch records (`record_path`)."""
RECORD_KINDS = ("report", "bundle")
"""Document kinds a study run's records hold."""
SUMMARY = "summary.json"
MARKET_SPLITS = ("val", "oos")
MARKET_COLUMNS = ("bar", "timestamp", "close", "buy_and_hold")
_EPOCH_FILE = re.compile(r"^epoch-(\d{4,})\.json$")


def atomic_write(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` atomically: a temporary file beside it, flushed and fsynced, then renamed over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)                      # mkstemp's 0600 would hide the run's files from other readers
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_history(path: str | os.PathLike) -> dict[int, dict]:
    """epoch → record of a trainer's history.jsonl: the last complete line of each epoch (a line cut by a kill, or
    one that is not an epoch's record, is skipped); {} without the file. The one reader of that file (the trainer's
    resume, the evaluator's knobs of an epoch, `RunFiles.history`)."""
    path = Path(path)
    if not path.is_file():
        return {}
    recs: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(d, dict) and isinstance(d.get("epoch"), int):
            recs[d["epoch"]] = d
    return recs


def read_json(path: str | os.PathLike) -> dict | None:
    """A JSON object file's content, or None where it is missing, unreadable or not an object."""
    try:
        d = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _epochs_in(d: Path) -> list[int]:
    """Epochs with an `epoch-NNNN.json` file in directory `d`, ascending (none where `d` is missing)."""
    if not d.is_dir():
        return []
    return sorted(int(m.group(1)) for p in d.iterdir() if (m := _EPOCH_FILE.match(p.name)))


def record_path(run_dir: str | os.PathLike, epoch: int) -> Path:
    """A study run's record of `epoch`: `<run>/loop/epoch-NNNN.json`."""
    return Path(run_dir) / LOOP_DIR / f"epoch-{int(epoch):04d}.json"


def record_epochs(run_dir: str | os.PathLike) -> list[int]:
    """Epochs with a record in a study's run directory, ascending."""
    return _epochs_in(Path(run_dir) / LOOP_DIR)


def read_record(run_dir: str | os.PathLike, epoch: int) -> dict | None:
    """The record of `epoch` of a study's run directory, or None; ValueError naming the file when it is not JSON."""
    p = record_path(run_dir, epoch)
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: not JSON ({exc})") from None


def read_records(run_dir: str | os.PathLike) -> dict[int, dict]:
    """The epoch records of a study's run directory (epoch → record): the one reader of them (the study's loop, its
    resume and population, the dashboard's run browser)."""
    out = {}
    for e in record_epochs(run_dir):
        rec = read_record(run_dir, e)
        if rec is not None:
            out[int(rec["epoch"])] = rec
    return out


def _iso(t: Any) -> str:
    import datetime as dt

    return "" if t is None else dt.datetime.fromtimestamp(float(t), dt.timezone.utc).isoformat()


def report_of_record(rec: dict, run_id: str, split: dict | None = None, summary: dict | None = None,
                     dataset: str = "") -> dict:
    """A study record as a stored report's JSON shape (what `shared.runview` reads): the validation and in-sample
    metrics of the epoch's checkpoint, the knobs it trained under, its DSR trials (the loop's: the epoch), the
    windows of `split` (loop/split_definition.json), and the OOS metrics where `summary` (the run's summary.json)
    selected this checkpoint. No trades and no equity: a record does not keep them."""
    from shared.metrics import val_oos_gap

    e, split = int(rec["epoch"]), split or {}
    doc = {"run_id": run_id, "epoch": e, "checkpoint_sha256": rec.get("checkpoint_sha256", ""), "dataset": dataset,
           "n_trials": e, "knobs": rec.get("knobs"), "created_at": _iso(rec.get("finished_at")),
           "val": {"split": "val", "window": split.get("val"), "metrics": dict(rec.get("val") or {})},
           "insample": None if not rec.get("insample") else {"split": "insample", "window": None,
                                                             "metrics": dict(rec["insample"])},
           "oos": None, "val_oos_gap": None}
    chosen = (summary or {}).get("epochs") or []
    if ((summary or {}).get("selected_epoch") == e and summary.get("oos_metrics") and len(chosen) >= e
            and chosen[e - 1].get("checkpoint_sha256") == doc["checkpoint_sha256"]):
        doc["oos"] = {"split": "oos", "window": split.get("test"), "metrics": dict(summary["oos_metrics"])}
        sharpe = lambda part: float(part["metrics"].get("per_trade_sharpe") or 0.0)  # noqa: E731
        doc["val_oos_gap"] = val_oos_gap(sharpe(doc["val"]), sharpe(doc["oos"]))
    return doc


_BUNDLE_KEYS = ("enabled", "rollback", "rollback_to_epoch", "rollback_checkpoint_sha256", "rollback_keep",
                "rollback_restart", "best_epoch", "reason")


def bundle_of_record(rec: dict, run_id: str) -> dict:
    """A study record's bundle as a stored `FeedbackBundle`'s JSON shape: the rollback and reason it recorded (a
    population's exploit is in the reason), its signals (id, knob, value, reason; none in the records of a study
    run before they were kept) and the knobs of the next epoch."""
    e, b = int(rec["epoch"]), rec.get("bundle") or {}
    return {**{k: b[k] for k in _BUNDLE_KEYS if k in b}, "run_id": run_id, "epoch": e, "for_epoch": e + 1,
            "off": b.get("off") or [], "signals": b.get("signals") or {}, "knobs": rec.get("next_knobs") or {},
            "report_checkpoint_sha256": rec.get("checkpoint_sha256", ""), "created_at": _iso(rec.get("finished_at"))}


class RunFiles:
    """The files of one run directory (`root`); see the module docstring for the layout."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFiles({str(self.root)!r})"

    # -- documents ------------------------------------------------------------------------------------------
    def path(self, kind: str, epoch: int) -> Path:
        """`<run>/<reports|bundles|epochs>/epoch-NNNN.json`."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {tuple(KINDS)}, got {kind!r}")
        return self.root / KINDS[kind] / f"epoch-{int(epoch):04d}.json"

    def write(self, kind: str, epoch: int, text: str | bytes) -> Path:
        """Write the JSON text of document `kind` of `epoch` (atomically); returns its path."""
        p = self.path(kind, epoch)
        atomic_write(p, text)
        return p

    def has(self, kind: str, epoch: int) -> bool:
        return self.path(kind, epoch).is_file()

    def read_bytes(self, kind: str, epoch: int) -> bytes | None:
        """The stored JSON text (bytes) of `kind` for `epoch`, or None."""
        try:
            return self.path(kind, epoch).read_bytes()
        except FileNotFoundError:
            return None

    def read(self, kind: str, epoch: int) -> dict | None:
        """The parsed document, or None; ValueError naming the file when it is not JSON. A study run's report or
        bundle: from the epoch's record (`report_of_record`, `bundle_of_record`)."""
        if kind in RECORD_KINDS and self.has_records():
            rec = read_record(self.root, epoch)
            if rec is None:
                return None
            if kind == "bundle":
                return bundle_of_record(rec, self.root.name)
            return report_of_record(rec, self.root.name, read_json(self.root / LOOP_DIR / "split_definition.json"),
                                    read_json(self.root / SUMMARY), (self.run_json() or {}).get("dataset") or "")
        raw = self.read_bytes(kind, epoch)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{self.path(kind, epoch)}: not JSON ({exc})") from None

    def epochs(self, kind: str) -> list[int]:
        """Epochs with a document of `kind` on disk (a study run's report or bundle: with a record), ascending."""
        if kind in RECORD_KINDS and self.has_records():
            return record_epochs(self.root)
        return _epochs_in(self.root / KINDS[kind])

    def has_records(self) -> bool:
        """A study's run: its reports and bundles are in its epoch records (`LOOP_DIR`), not files of their own."""
        return (self.root / LOOP_DIR).is_dir() and not (self.root / KINDS["report"]).is_dir()

    def sources(self, kind: str, epoch: int) -> tuple[Path, ...]:
        """The files `read(kind, epoch)` reads, the document's own first: its file (`path`), or a study run's record
        of the epoch and the run's summary.json (the OOS metrics of the checkpoint the study selected)."""
        if kind in RECORD_KINDS and self.has_records():
            return record_path(self.root, epoch), self.root / SUMMARY
        return (self.path(kind, epoch),)

    def selected_epoch(self) -> int | None:
        """The epoch the run itself selected on validation, where it says: a study run's summary.json (by the
        study's `--min-val-trades`); None otherwise."""
        e = (read_json(self.root / SUMMARY) or {}).get("selected_epoch") if self.has_records() else None
        return e if isinstance(e, int) else None

    # -- the trainer's files ----------------------------------------------------------------------------------
    def run_json(self) -> dict | None:
        """The run's metadata: `trainer/run.json` (a service run) or `run.json` (`tradeloop train --out`)."""
        for p in (self.root / TRAINER_DIR / "run.json", self.root / "run.json"):
            if p.is_file():
                return read_json(p)
        return None

    def history(self) -> list[dict]:
        """Epoch records, ordered by epoch: `epochs/*.json`, else the trainer's `history.jsonl` (the last complete
        line of each epoch; a line cut by a kill is skipped)."""
        recs = {e: self.read("epoch", e) for e in self.epochs("epoch")}
        if not recs:
            for p in (self.root / TRAINER_DIR / "history.jsonl", self.root / "history.jsonl"):
                if p.is_file():
                    recs = read_history(p)
                    break
        return [recs[e] for e in sorted(recs) if recs[e] is not None]

    # -- market -------------------------------------------------------------------------------------------------
    def market_path(self, split: str) -> Path:
        if split not in MARKET_SPLITS:
            raise ValueError(f"market split must be one of {MARKET_SPLITS}, got {split!r}")
        return self.root / "market" / f"{split}.parquet"

    def has_market(self, split: str, window: Iterable[int]) -> bool:
        """Whether the market file of `split` exists and covers exactly `window` (half-open bar range)."""
        m = self.read_market(split)
        s, e = (int(x) for x in window)
        return m is not None and len(m["bar"]) == e - s and int(m["bar"][0]) == s

    def write_market(self, split: str, bar: Any, timestamp_ns: Any, close: Any, buy_and_hold: Any) -> Path:
        """Write the market file of `split` (columns `MARKET_COLUMNS`; timestamps as int64 ns since the epoch, UTC)."""
        import io

        import numpy as np
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({"bar": pa.array(np.asarray(bar, dtype=np.int64)),
                          "timestamp": pa.array(np.asarray(timestamp_ns, dtype=np.int64), type=pa.timestamp("ns")),
                          "close": pa.array(np.asarray(close, dtype=np.float64)),
                          "buy_and_hold": pa.array(np.asarray(buy_and_hold, dtype=np.float64))})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="none", use_dictionary=False)   # read back in ~30 ms per 10^6 bars
        p = self.market_path(split)
        atomic_write(p, buf.getvalue())
        return p

    def read_market(self, split: str, columns: Iterable[str] = ("bar", "timestamp", "buy_and_hold")) -> dict | None:
        """{column: numpy array} of `columns` of the market file of `split` (timestamp as int64 ns), or None when
        absent or unreadable."""
        p = self.market_path(split)
        if not p.is_file():
            return None
        import numpy as np
        import pyarrow.parquet as pq

        try:
            t = pq.read_table(p, columns=list(columns), use_threads=False, memory_map=True)
        except Exception:  # noqa: BLE001 — a damaged file reads as absent: the page shows bars, not dates
            return None
        out = {c: t.column(c).to_numpy() for c in columns}
        if "timestamp" in out:              # ns since the epoch as int64 (a view: no copy when the file holds ns)
            out["timestamp"] = np.ascontiguousarray(out["timestamp"].astype("datetime64[ns]", copy=False)).view(np.int64)
        return out

    @classmethod
    def of_checkpoint(cls, checkpoint: str | os.PathLike) -> "RunFiles | None":
        """The run directory of a checkpoint file (`<run>/trainer/checkpoints/epoch-NNNN.safetensors`, or
        `<run>/checkpoints/…` of `tradeloop train --out`) when it holds documents, else None."""
        d = Path(checkpoint).resolve().parent.parent
        for root in ((d.parent, d) if d.name == TRAINER_DIR else (d,)):
            if any((root / k).is_dir() for k in KINDS.values()):
                return cls(root)
        return None

    # -- what is here ---------------------------------------------------------------------------------------------
    def is_run(self) -> bool:
        """A run directory: it holds documents, or a trainer's run.json."""
        return any((self.root / d).is_dir() for d in KINDS.values()) or self.run_json() is not None

    def modified(self) -> float:
        """Latest modification time of the run's documents (0 when none)."""
        t = 0.0
        for d in [*(self.root / k for k in KINDS.values()), self.root / TRAINER_DIR, self.root / LOOP_DIR,
                  self.root]:
            try:
                t = max(t, d.stat().st_mtime)
            except OSError:
                pass
        return t


_SKIP_DIRS = {*KINDS.values(), "market", "checkpoints", TRAINER_DIR, "redis", "logs", "__pycache__"}


def find_runs(root: str | os.PathLike, max_depth: int = 3) -> list[Path]:
    """The run directories at or under `root` (at most `max_depth` levels down), sorted by path. A run directory's
    own sub-directories are not searched."""
    root = Path(root)
    found: list[Path] = []

    def walk(d: Path, depth: int) -> None:
        if RunFiles(d).is_run():
            found.append(d)
            return
        if depth >= max_depth:
            return
        try:
            subs = sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")
                          and p.name not in _SKIP_DIRS)
        except OSError:
            return
        for p in subs:
            walk(p, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return found
