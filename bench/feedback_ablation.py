"""Feedback on vs off: does the closed loop (E1–E9) buy a better OOS per-trade Sharpe or a smaller val/OOS gap?

    .venv/bin/python bench/feedback_ablation.py                                   # defaults (~15 min, 2 cores)
    .venv/bin/python bench/feedback_ablation.py --datasets synthetic --seeds 0 1 2 --epochs 6 --iterations 400

The closed loop runs in-process, with no Redis and no services, through the very functions the services call:
`tradeloop.study.loop.run_closed_loop` (what `tradeloop study` runs): for epoch e = 1..E, knobs_e (epoch 1: the
trainer config's fixed schedule in both modes; then bundle e−1's) → `train_run` → `evaluate_checkpoint` (val and
in-sample, n_trials = e) → `compute_bundle(report_e, earlier reports, FeedbackConfig(enabled=on|off))` — off is the
product's fixed schedule, what the feedback service publishes with TL_ENABLED=false.

Selection (`tradeloop.study.stats.select_epoch`): the epoch with the best validation per-trade Sharpe among those
with ≥ `--min-val-trades` val trades (default 10; all epochs when none has that many) — a multiple test over the E
checkpoints, so the DSR printed is that checkpoint's validation DSR re-deflated over all E trials
(`shared.metrics.dsr`, n_trials = E, variance of the E val Sharpes). OOS is backtested for that checkpoint only
(`tradeloop.study.loop.evaluate_selected`). Printed for it: val and OOS per-trade Sharpe (un-annualized,
`shared.metrics`: a window with < 2 trades has Sharpe 0), the DSR, the val/OOS gap 1 − OOS/val (only meaningful when
val > 0: "n/a" otherwise) and the trade counts. One markdown table per dataset, a row per seed × mode and a mean row
per mode; then the goal check: feedback on has a higher mean OOS Sharpe or a smaller mean gap than off, and a
mean gap < 15 %. For seeds × walk-forward folds × any variants with confidence intervals, use `tradeloop study`.

Seeds: the training seed, and for `synthetic` also the generator seed (one market per seed). The split is the
trainer's default chronological split (train | embargo | val | embargo | test).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from services.feedback.signals import FeedbackConfig  # noqa: E402
from services.trainer.train import TrainConfig  # noqa: E402
from shared.market import chronological_split, compute_features, load_dataset  # noqa: E402
from shared.metrics import MIN_SELECTION_TRADES, dsr, per_trade_sharpe, val_oos_gap  # noqa: E402
from tradeloop.study.loop import evaluate_selected, run_closed_loop  # noqa: E402
from tradeloop.study.stats import select_epoch  # noqa: E402

GAP_GOAL = 0.15


def run_one(dataset: str, seed: int, feedback: bool, args, root: Path) -> dict:
    """One closed-loop run; returns the selected checkpoint's figures and the per-epoch trace."""
    bars = load_dataset(dataset, seed=seed)
    feats = compute_features(bars)
    cfg = TrainConfig.preset(args.config, feats.shape[1])
    cfg.iterations = args.iterations
    if args.learning_starts is not None:
        cfg.learning_starts = args.learning_starts
    run_dir = root / f"{dataset}-s{seed}-{'on' if feedback else 'off'}"
    split = chronological_split(len(bars))

    def on_epoch(rec: dict) -> None:
        if args.verbose:
            k, vm = rec["next_knobs"], rec["val"]
            gate = "∞" if k["gate_threshold"] is None else f"{k['gate_threshold']:.4f}"
            print(f"    {run_dir.name} e{rec['epoch']}: train {rec['seconds']['train']:.0f}s eval "
                  f"{rec['seconds']['eval']:.0f}s | val SR {vm['per_trade_sharpe']:+.3f} ({int(vm['n_trades'])}) | "
                  f"next: ε {k['epsilon']:.3f} γ {k['gamma']:.3f} qb {k['q_bias']:+.4f} gate {gate} "
                  f"E6 {len(k['priority_boost'])} E7 {len(k['hindsight'])} "
                  f"conf0 {sum(c == 0 for c in k['regime_confidence'])} — {rec['bundle']['reason'][:60]}", flush=True)

    t0 = time.perf_counter()
    records = run_closed_loop(bars, dataset, run_dir, args.epochs, config=cfg,
                              feedback=FeedbackConfig(enabled=feedback, off=args.off), split=split, seed=seed, features=feats,
                              on_epoch=on_epoch)
    vals = [r["history"]["val_sharpe"] for r in records]
    n_val = [r["history"]["val_n_trades"] for r in records]
    best, _ = select_epoch(vals, n_val, args.min_val_trades)
    chosen = evaluate_selected(run_dir, best, records, bars=bars, split=split, dataset=dataset, features=feats)
    wall = time.perf_counter() - t0
    val_sr, oos_sr = vals[best - 1], chosen["oos"]["per_trade_sharpe"] or 0.0
    val_tr = records[best - 1]["val_trade_returns"]
    var = float(np.var(vals, ddof=1)) if len(vals) >= 2 else None
    d = dsr(val_tr, n_trials=len(vals), sharpe_var_trials=var)
    assert abs(per_trade_sharpe(val_tr) - val_sr) < 1e-9, "report trades disagree with the report's metrics"
    return dict(dataset=dataset, seed=seed, mode="on" if feedback else "off", epoch=best, val=val_sr,
                oos=oos_sr, dsr=d, gap=val_oos_gap(val_sr, oos_sr) if val_sr > 0 else float("nan"),
                n_val=n_val[best - 1], n_oos=int(chosen["oos"]["n_trades"]), wall=wall,
                trace=[dict(epoch=r["epoch"], val=vals[i], n_val=n_val[i]) for i, r in enumerate(records)])


def fmt(x: float, spec: str = "+.3f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, spec)


def table(rows: list[dict]) -> str:
    out = ["| seed | feedback | best epoch | val SR | OOS SR | DSR (val) | val/OOS gap | val trades | OOS trades |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['seed']} | {r['mode']} | {r['epoch']} | {fmt(r['val'])} | {fmt(r['oos'])} | "
                   f"{fmt(r['dsr'], '.3f')} | {fmt(r['gap'], '+.1%')} | {r['n_val']} | {r['n_oos']} |")
    for mode in ("on", "off"):
        m = summary(rows, mode)
        out.append(f"| mean | {mode} | | {fmt(m['val'])} | {fmt(m['oos'])} | {fmt(m['dsr'], '.3f')} | "
                   f"{fmt(m['gap'], '+.1%')} (of the means) | {m['n_val']:.0f} | {m['n_oos']:.0f} |")
    return "\n".join(out)


def summary(rows: list[dict], mode: str) -> dict:
    rs = [r for r in rows if r["mode"] == mode]
    gaps = [r["gap"] for r in rs if math.isfinite(r["gap"])]
    mean = lambda k: float(np.mean([r[k] for r in rs])) if rs else float("nan")  # noqa: E731
    v, o = mean("val"), mean("oos")
    # the mean row's gap is the gap of the means: a per-seed gap explodes where val Sharpe is near 0
    return dict(val=v, oos=o, dsr=mean("dsr"), n_val=mean("n_val"), n_oos=mean("n_oos"),
                gap=val_oos_gap(v, o) if v > 0 else float("nan"), n_gap=len(gaps), n=len(rs))


def report(ds: str, rows: list[dict], args) -> None:
    """Print one dataset's table and the goal check."""
    on, off = summary(rows, "on"), summary(rows, "off")
    better = on["oos"] > off["oos"] or (math.isfinite(on["gap"]) and math.isfinite(off["gap"])
                                        and on["gap"] < off["gap"])
    gap_ok = math.isfinite(on["gap"]) and on["gap"] < GAP_GOAL
    seeds = len({r["seed"] for r in rows})
    print(f"\n### {ds} — {seeds} seeds, {args.epochs} epochs × {args.iterations} iterations, checkpoint selected "
          f"by best val per-trade Sharpe\n")
    print(table(rows))
    print(f"\ngoal (on: higher mean OOS SR or smaller gap of the means than off): {'MET' if better else 'NOT MET'}; "
          f"gap of the means with feedback on < {GAP_GOAL:.0%}: {'MET' if gap_ok else 'NOT MET'} "
          f"({fmt(on['gap'], '+.1%')}; off {fmt(off['gap'], '+.1%')})\n", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="synthetic,sp500", help="comma-separated dataset names or files")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=120, help="iterations (collect → update) per epoch")
    ap.add_argument("--learning-starts", type=int, default=1000, help="transitions before the first update")
    ap.add_argument("--min-val-trades", type=int, default=MIN_SELECTION_TRADES,
                    help="only checkpoints with at least this many val trades are selectable (all when none has)")
    ap.add_argument("--config", default="small", help="trainer config preset")
    ap.add_argument("--off", default="", help="feedback on: signals switched off, comma-separated (E1…E9, rollback)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: fastest on a loaded VM)")
    ap.add_argument("--out", default=None, help="keep run directories here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    ap.add_argument("-q", "--quiet", dest="verbose", action="store_false", help="no per-epoch lines")
    ap.add_argument("--from-json", default=None, help="only print the tables of rows saved by --json")
    args = ap.parse_args()
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())
        for ds in dict.fromkeys(r["dataset"] for r in rows):
            report(ds, [r for r in rows if r["dataset"] == ds], args)
        return
    torch.set_num_threads(args.threads)
    root = Path(args.out or tempfile.mkdtemp(prefix="tl-ablation-"))
    t_all = time.perf_counter()
    all_rows: list[dict] = []
    for ds in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        rows = []
        for seed in args.seeds:
            for fb in (True, False):
                r = run_one(ds, seed, fb, args, root)
                rows.append(r)
                print(f"  {ds} seed {seed} feedback {r['mode']}: best epoch {r['epoch']} val {fmt(r['val'])} "
                      f"OOS {fmt(r['oos'])} ({r['wall']:.0f}s)", flush=True)
        report(ds, rows, args)
        all_rows += rows
    print(f"total {time.perf_counter() - t_all:.0f}s; runs in {root}")
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=1, default=float))


if __name__ == "__main__":
    main()
