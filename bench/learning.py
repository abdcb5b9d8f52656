"""Does the agent learn? Train on `synthetic` (small config, CPU) per seed and compare with the baselines.

    .venv/bin/python bench/learning.py --seeds 0 1 2 --epochs 6

Prints, per seed, the val and OOS (test) per-trade Sharpe (un-annualized) and trade count of the agent, the
oracle, random, flat and buy-and-hold, and checks the target: agent OOS per-trade Sharpe ≥ ½ oracle's and above
random and flat (a policy with < 2 trades has Sharpe 0 by `shared.metrics`' convention).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.train import TrainConfig, train_run  # noqa: E402
from shared.market import chronological_split, compute_features, load_dataset  # noqa: E402
from tradeloop.cmd_evaluate import policy_metrics  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--epochs", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=None, help="override iterations per epoch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="keep run directories here (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    root = Path(args.out or tempfile.mkdtemp(prefix="tl-learning-"))
    ok_all = True
    for seed in args.seeds:
        bars = load_dataset("synthetic", seed=seed)
        split = chronological_split(len(bars))
        cfg = TrainConfig.preset("small", compute_features(bars).shape[1])
        if args.iterations:
            cfg.iterations = args.iterations
        t0 = time.perf_counter()
        run = root / f"seed{seed}"
        train_run(bars, "synthetic", run, args.epochs, config=cfg, seed=seed, device=args.device,
                  on_epoch=lambda s: print(f"  seed {seed} epoch {s.epoch}: loss {s.loss:.3f} train-sharpe "
                                           f"{s.train_per_trade_sharpe:.3f} ({s.train_trades} trades) "
                                           f"{s.seconds:.0f}s", flush=True))
        train_s = time.perf_counter() - t0
        rows = {}
        for pol in ("agent", "oracle", "random", "flat", "buy-and-hold"):
            p = str(run) if pol == "agent" else pol
            rows[pol] = {w: policy_metrics(p, "synthetic", bars, split, w, seed=seed, device=args.device)
                         for w in ("val", "test")}
        print(f"\nseed {seed}  (train {train_s:.0f}s, {args.epochs} epochs; per-trade Sharpe un-annualized)")
        print(f"  {'policy':<13} {'val SR':>8} {'val n':>6} {'OOS SR':>8} {'OOS n':>6}")
        for pol, r in rows.items():
            print(f"  {pol:<13} {r['val']['per_trade_sharpe']:>8.3f} {int(r['val']['n_trades']):>6} "
                  f"{r['test']['per_trade_sharpe']:>8.3f} {int(r['test']['n_trades']):>6}")
        a, o = rows["agent"]["test"]["per_trade_sharpe"], rows["oracle"]["test"]["per_trade_sharpe"]
        ok = a >= 0.5 * o and a > rows["random"]["test"]["per_trade_sharpe"] and a > rows["flat"]["test"]["per_trade_sharpe"]
        ok_all &= ok
        print(f"  target (OOS ≥ ½ oracle, > random, > flat): {'MET' if ok else 'NOT MET'}", flush=True)
    print(f"\nall seeds: {'MET' if ok_all else 'NOT MET'}  (runs in {root})")


if __name__ == "__main__":
    main()
