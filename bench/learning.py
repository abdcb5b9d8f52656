"""Does the agent learn? Train on a dataset (default `synthetic`; small config, CPU; `--config full` on a GPU) per
seed and compare with the baselines.

    .venv/bin/python bench/learning.py --seeds 0 1 2 --epochs 4 --threads 1 --jobs 3
    .venv/bin/python bench/learning.py --dataset sp500 --seeds 0 --epochs 4 --threads 1
    python3 bench/learning.py --config full --device cuda --bars 100000 --seeds 0 1 2 --epochs 4   # on the GPU

Prints, per seed, the val and OOS (test) per-trade Sharpe (un-annualized) and trade count of the agent, the
oracle (synthetic only), random, flat and buy-and-hold, and on `synthetic` checks the target: agent OOS per-trade
Sharpe ≥ ½ oracle's and above random and flat (a policy with < 2 trades has Sharpe 0 by `shared.metrics`'
convention). `--jobs N` trains N seeds at once in separate processes (each with `--threads` torch threads).
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer.train import TrainConfig, train_run  # noqa: E402
from shared.market import chronological_split, compute_features, load_dataset  # noqa: E402
from tradeloop.cmd_evaluate import policy_metrics  # noqa: E402


def run_seed(seed: int, args: argparse.Namespace, root: Path) -> tuple[str, bool | None, float]:
    """Train one seed and evaluate it with the baselines; (table text, target met — None off synthetic, the agent's
    OOS per-trade Sharpe)."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    synthetic = args.dataset.strip().lower() == "synthetic"
    if synthetic and args.bars:
        from shared.synthetic import generate
        bars = generate(args.bars, seed=seed).bars
    else:
        bars = load_dataset(args.dataset, seed=seed)
    split = chronological_split(len(bars))
    cfg = TrainConfig.preset(args.config, compute_features(bars).shape[1])
    if args.iterations:
        cfg.iterations = args.iterations
    cfg.override(args.set)
    t0 = time.perf_counter()
    run = root / f"{args.dataset}-seed{seed}"
    train_run(bars, args.dataset, run, args.epochs, config=cfg, seed=seed, device=args.device,
              on_epoch=lambda s: print(f"  seed {seed} epoch {s.epoch}: loss {s.loss:.3f} train-sharpe "
                                       f"{s.train_per_trade_sharpe:.3f} ({s.train_trades} trades) "
                                       f"{s.seconds:.0f}s", flush=True))
    train_s = time.perf_counter() - t0
    rows = {}
    pols = ("agent", "oracle", "random", "flat", "buy-and-hold") if synthetic else ("agent", "random", "flat",
                                                                                    "buy-and-hold")
    for pol in pols:
        p = str(run) if pol == "agent" else pol
        rows[pol] = {w: policy_metrics(p, args.dataset, bars, split, w, seed=seed, device=args.device)
                     for w in ("val", "test")}
    lines = [f"\n{args.dataset} seed {seed}  ({args.config}, {len(bars)} bars, train {train_s:.0f}s, {args.epochs} "
             f"epochs × {cfg.iterations} iterations; per-trade Sharpe un-annualized)",
             f"  {'policy':<13} {'val SR':>8} {'val n':>6} {'OOS SR':>8} {'OOS n':>6}"]
    for pol, r in rows.items():
        lines.append(f"  {pol:<13} {r['val']['per_trade_sharpe']:>8.3f} {int(r['val']['n_trades']):>6} "
                     f"{r['test']['per_trade_sharpe']:>8.3f} {int(r['test']['n_trades']):>6}")
    ok = None
    if synthetic:
        a, o = rows["agent"]["test"]["per_trade_sharpe"], rows["oracle"]["test"]["per_trade_sharpe"]
        ok = bool(a >= 0.5 * o and a > rows["random"]["test"]["per_trade_sharpe"]
                  and a > rows["flat"]["test"]["per_trade_sharpe"])
        lines.append(f"  target (OOS ≥ ½ oracle, > random, > flat): {'MET' if ok else 'NOT MET'}")
    return "\n".join(lines), ok, rows["agent"]["test"]["per_trade_sharpe"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic", help="synthetic, sp500, eurusd or a file")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--config", default="small", choices=["small", "full"],
                    help="training preset (full: the GPU's, e.g. with --device cuda --bars 100000)")
    ap.add_argument("--bars", type=int, default=None, help="bars of the synthetic dataset (default: the generator's)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=None, help="override iterations per epoch")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="keep run directories here (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (per process)")
    ap.add_argument("--jobs", type=int, default=1, help="seeds trained at once, in separate processes")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="override preset fields (agent.FIELD for the network's), e.g. act_view_cache=false")
    args = ap.parse_args()
    if args.bars and args.dataset.strip().lower() != "synthetic":
        ap.error(f"--bars sizes the synthetic dataset only (got --dataset {args.dataset})")
    root = Path(args.out or tempfile.mkdtemp(prefix="tl-learning-"))
    results = []
    # spawned, not forked: a CUDA context does not survive a fork
    pool = (ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) if args.jobs > 1
            else contextlib.nullcontext())
    with pool as ex:
        for r in (ex.map if ex else map)(run_seed, args.seeds, [args] * len(args.seeds), [root] * len(args.seeds)):
            results.append(r)
            print(r[0], flush=True)
    oks = [ok for _, ok, _ in results if ok is not None]
    if len(results) > 1:
        # a change that moves nothing systematic still moves single seeds by up to ±0.7 here: compare codes over
        # many seeds (the same --seeds for both), by these figures
        sr = [a for _, _, a in results]
        print(f"\nagent OOS per-trade Sharpe over {len(sr)} seeds: mean {statistics.mean(sr):.3f}, median "
              f"{statistics.median(sr):.3f}" + (f"; target met in {sum(oks)} of {len(oks)}" if oks else ""))
    if oks:
        print(f"\nall seeds: {'MET' if all(oks) else 'NOT MET'}  (runs in {root})")
    else:
        print(f"\n(runs in {root})")


if __name__ == "__main__":
    main()
