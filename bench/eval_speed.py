"""Evaluator speed: validation bars per second of `services.evaluator.runner.run_windows`.

    .venv/bin/python -m bench.eval_speed [--bars 100000 1000000] [--accounts 1 64] [--device cpu|cuda]
                                         [--config small|full] [--max-steps N] [--threads N]

A random agent of the trainer's `small` (default) or `full` preset shape runs greedy over a validation window of
`--bars` synthetic bars; `--accounts` B runs B windows of that length at once (checkpoints × folds share the
sequential pass as accounts of one simulator). Measured, per row:
  encode_s   the market encoder over every bar of the covering span (batched)
  step_s     run_windows: the sequential pass (heads + simulator, bar by bar), the prediction extraction, and
             the encoder over the span its windows cover
  bars/s     B × bars / (encode_s + step_s)   — account-bars evaluated per second
With `--max-steps N` the windows are cut to N + 1 bars for the sequential part while the encoder still runs over
all `--bars` bars; the table then says so and bars/s is B × (N + 1) / (encode_s·(N + 1)/bars + step_s), i.e. the
rate of a full run extrapolated from the measured per-step cost (used where a full 10^6-bar sequential pass
does not fit the time budget).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from services.evaluator.runner import run_windows
from shared.agent import Agent
from shared.market import compute_features
from shared.rollout import MarketTensors
from shared.synthetic import generate


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bars", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--accounts", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default="small", choices=["small", "full"])
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    from services.trainer.train import TrainConfig  # only to take the preset's shape (bench, not the library)

    print(f"device={dev} config={a.config} threads={torch.get_num_threads()} max_steps={a.max_steps}")
    print(f"{'bars':>9} {'accounts':>8} {'seq bars':>9} {'encode_s':>9} {'step_s':>9} {'bars/s':>12}")
    for n in a.bars:
        for B in a.accounts:
            bars = generate(n_bars=n + 200, seed=0).bars
            feats = compute_features(bars)
            cfg = TrainConfig.preset(a.config, feats.shape[1]).agent
            torch.manual_seed(0)
            agent = Agent(cfg).to(dev).eval()
            L = n if a.max_steps is None else min(n, a.max_steps + 1)
            # B windows of L bars; the encoder covers the full n-bar span as it would in a real run
            starts = np.linspace(200, 200 + n - L, B).astype(int) if B > 1 else np.array([200])
            wins = [(int(s), int(s) + L) for s in starts]
            span = (200, 200 + n)
            _sync(dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                m = MarketTensors.from_bars(bars, *span, cfg.window, dev, features=feats)
                torch.cat([agent.encode(m.windows[i:i + 4096]) for i in range(0, n, 4096)])
            _sync(dev)
            enc = time.perf_counter() - t0
            t0 = time.perf_counter()
            run_windows(agent, bars, wins, features=feats, device=dev, encode_chunk=4096)
            _sync(dev)
            total = time.perf_counter() - t0
            # step_s includes run_windows' own encoding of the span its windows cover (conservative: that share
            # of the encoder is counted twice in bars/s; subtracting a separately timed encode proved unreliable
            # on a loaded machine)
            step = total
            rate = B * L / (enc * L / n + step)
            print(f"{n:>9} {B:>8} {L:>9} {enc:>9.2f} {step:>9.2f} {rate:>12.0f}", flush=True)


if __name__ == "__main__":
    main()
