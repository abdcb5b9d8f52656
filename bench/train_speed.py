"""Training speed per config: env-steps/s (rollout of all accounts) and updates/s (the update step).

    .venv/bin/python bench/train_speed.py --configs small --device cpu --iterations 100
    python3 bench/train_speed.py --configs small full --device cuda        # on the H200

Each row: one short epoch of `--iterations` iterations on `synthetic` after a warm-up epoch that fills replay;
the phases are timed separately by `train_epoch` (EpochStats.env_steps_per_s, updates_per_s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.train import TrainConfig, build_state, train_epoch  # noqa: E402
from shared.knobs import Knobs  # noqa: E402
from shared.market import chronological_split, compute_features, load_dataset  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["small"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bars = load_dataset("synthetic", seed=0)
    split = chronological_split(len(bars))
    n_feat = compute_features(bars).shape[1]
    print(f"device {args.device}, torch threads {torch.get_num_threads()}")
    print(f"{'config':<8} {'envs':>5} {'batch':>6} {'env-steps/s':>12} {'updates/s':>10} {'epoch s':>8}")
    for name in args.configs:
        cfg = TrainConfig.preset(name, n_feat)
        cfg.iterations = args.iterations
        cfg.learning_starts = 0
        st = build_state(cfg, bars, split, 0, args.device)
        train_epoch(st, Knobs())                     # warm-up: fills replay, first kernels
        s = train_epoch(st, Knobs())
        print(f"{name:<8} {cfg.n_envs:>5} {cfg.batch_size:>6} {s.env_steps_per_s:>12,.0f} {s.updates_per_s:>10,.1f} "
              f"{s.seconds:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
