"""Feedback on vs off: does the closed loop (E1–E9) buy a better OOS per-trade Sharpe or a smaller val/OOS gap?

    .venv/bin/python bench/feedback_ablation.py                                   # defaults (~15 min, 2 cores)
    .venv/bin/python bench/feedback_ablation.py --datasets synthetic --seeds 0 1 2 --epochs 6 --iterations 400

The closed loop runs in-process, with no Redis and no services, through the very functions the services call:

    for epoch e = 1..E:
        knobs_e  = epoch 1: the trainer config's fixed schedule (both modes)
                   on : services.feedback.signals.compute_bundle(report_{e−1}, reports_{<e−1}, FeedbackConfig with
                        the config's schedule and `--off`); a bundle that rolls back makes `train_run` restore that
                        epoch's learner before epoch e (`rollback_fn` → `roll_back`)
                   off: the trainer's fixed schedule (`train_run`'s default knobs_fn: cfg.schedule.knobs(e)) —
                        what `tradeloop train` does without feedback
        train    : services.trainer.train.train_run (train_epoch → save_epoch → history.jsonl)
        report_e : services.evaluator.runner.evaluate_checkpoint(checkpoint e, knobs_e, n_trials = e,
                   prior_sharpes = earlier val Sharpes)      (val, OOS, in-sample for E6/E7)

Selection (`shared.metrics.select_best`, as `tradeloop evaluate --checkpoint best`): the epoch with the best
validation per-trade Sharpe among those with ≥ `--min-val-trades` val trades (default 10; all epochs when none has
that many) — a multiple test over the E checkpoints, so the DSR printed is that checkpoint's validation DSR
re-deflated over all E trials (`shared.metrics.selection_dsr`: n_trials = E, variance of the E val Sharpes). Printed for it: val and OOS per-trade Sharpe (un-annualized, `shared.metrics`:
a window with < 2 trades has Sharpe 0), the DSR, the val/OOS gap 1 − OOS/val (only meaningful when val > 0:
"n/a" otherwise) and the trade counts. One markdown table per dataset, a row per seed × mode and a mean row
per mode; then the goal check: feedback on has a higher mean OOS Sharpe or a smaller mean gap than off, and a
mean gap < 15 %.

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

from services.evaluator.runner import evaluate_checkpoint  # noqa: E402
from services.feedback.signals import FeedbackConfig, compute_bundle  # noqa: E402
from services.trainer.train import TrainConfig, train_run  # noqa: E402
from shared.knobs import Knobs  # noqa: E402
from shared.market import Split, compute_features, load_dataset  # noqa: E402
from shared.metrics import MIN_SELECTION_TRADES, per_trade_sharpe, select_best, selection_dsr, val_oos_gap  # noqa: E402

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
    run_id = run_dir.name
    fixed = cfg.schedule.knobs
    fb_cfg = FeedbackConfig(eps_start=cfg.eps_start, eps_end=cfg.eps_end, eps_decay_epochs=cfg.eps_decay_epochs,
                            gamma_fixed=cfg.gamma, off=args.off)
    knobs_of: dict[int, Knobs] = {1: fixed(1)}
    rollback_of: dict[int, tuple[int, str]] = {}
    best: set[int] = set()                   # the epoch a later rollback would restore: its files are kept
    reports: list = []
    trace: list[dict] = []

    def knobs_fn(e: int) -> Knobs:
        return knobs_of.get(e) or fixed(e)

    def on_epoch(stats) -> None:
        e = stats.epoch
        ck = run_dir / "checkpoints" / f"epoch-{e:04d}.safetensors"
        split = Split.from_dict(json.loads((run_dir / "run.json").read_text())["split"])
        prior = [r.val.metrics["per_trade_sharpe"] or 0.0 for r in reports]
        t0 = time.perf_counter()
        rep = evaluate_checkpoint(ck, expected_sha256=None, bars=bars, split=split, run_id=run_id, epoch=e,
                                  n_trials=e, prior_sharpes=prior, features=feats, knobs=knobs_of[e],
                                  dataset=dataset)
        t_eval = time.perf_counter() - t0
        if feedback:
            bundle = compute_bundle(rep, reports, fb_cfg, bars=bars)
            knobs_of[e + 1] = Knobs.from_dict(bundle.knobs)
            if bundle.rollback:
                rollback_of[e + 1] = (bundle.rollback_to_epoch, bundle.rollback_checkpoint_sha256)
            best.clear()
            best.update([] if bundle.best_epoch is None else [bundle.best_epoch])
            why = bundle.reason
        else:
            knobs_of[e + 1] = fixed(e + 1)
            why = "fixed schedule"
        reports.append(rep)
        vm, om = rep.val.metrics, rep.oos.metrics
        k = knobs_of[e + 1]
        trace.append(dict(epoch=e, val=vm["per_trade_sharpe"], oos=om["per_trade_sharpe"],
                          n_val=int(vm["n_trades"]), n_oos=int(om["n_trades"])))
        if args.verbose:
            gate = "∞" if math.isinf(k.gate_threshold) else f"{k.gate_threshold:.4f}"
            print(f"    {run_id} e{e}: train {stats.seconds:.0f}s eval {t_eval:.0f}s | val SR "
                  f"{vm['per_trade_sharpe']:+.3f} ({int(vm['n_trades'])}) OOS SR {om['per_trade_sharpe']:+.3f} "
                  f"({int(om['n_trades'])}) | next: ε {k.epsilon:.3f} γ {k.gamma:.3f} qb {k.q_bias:+.4f} "
                  f"gate {gate} E6 {len(k.priority_boost)} E7 {len(k.hindsight)} "
                  f"conf0 {sum(c == 0 for c in k.regime_confidence)} — {why[:60]}", flush=True)

    t0 = time.perf_counter()
    train_run(bars, dataset, run_dir, args.epochs, config=cfg, seed=seed, knobs_fn=knobs_fn, on_epoch=on_epoch,
              rollback_fn=rollback_of.get, pinned_fn=lambda: best)
    wall = time.perf_counter() - t0
    vals = [r.val.metrics["per_trade_sharpe"] or 0.0 for r in reports]
    best, _ = select_best(vals, [int(r.val.metrics["n_trades"]) for r in reports], args.min_val_trades)
    rep = reports[best]
    val_sr, oos_sr = vals[best], rep.oos.metrics["per_trade_sharpe"] or 0.0
    val_tr = rep.val.trades.net_return.tolist()
    d = selection_dsr(val_tr, vals)
    assert abs(per_trade_sharpe(val_tr) - val_sr) < 1e-9, "report trades disagree with the report's metrics"
    return dict(dataset=dataset, seed=seed, mode="on" if feedback else "off", epoch=rep.epoch, val=val_sr,
                oos=oos_sr, dsr=d, gap=val_oos_gap(val_sr, oos_sr) if val_sr > 0 else float("nan"),
                n_val=int(rep.val.metrics["n_trades"]), n_oos=int(rep.oos.metrics["n_trades"]), wall=wall,
                trace=trace)


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
