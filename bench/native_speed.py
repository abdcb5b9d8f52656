"""The sequential part of an evaluation alone: `greedy_pass(accel="native")` for one account over N bars, given the
market view of every bar precomputed (what is left of a pass once the heads are batched).

    .venv/bin/python bench/native_speed.py --presets small full --bars 1000000 [--repeat 3]

Per preset: a random agent of that shape with a randomised portfolio shift (a fresh agent's δ is 0), its view
from random embeddings (`Agent.view_table`; the time is printed, not counted), then the pass `--repeat` times
(after a 1 000-bar warm-up that builds the C loop) and `native.run_native` once alone. Seconds, bars/s, µs a bar.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.train import TrainConfig  # noqa: E402
from shared import native  # noqa: E402
from shared.agent import Agent, PolicyControls  # noqa: E402
from shared.execution import CostModel  # noqa: E402
from shared.market import compute_features  # noqa: E402
from shared.rollout import MarketTensors, greedy_pass  # noqa: E402
from shared.synthetic import generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["small", "full"], choices=["small", "full"])
    ap.add_argument("--bars", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n = a.bars
    bars = generate(n_bars=n + 200, seed=0).bars
    feats = compute_features(bars)
    native.library()
    print(f"# native_speed: {n} bars, torch threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}")
    print("| preset | view_table s (not counted) | greedy_pass s (each run) | bars/s (best) | µs a bar | run_native s |")
    print("|---|---:|---|---:|---:|---:|")
    for name in a.presets:
        cfg = TrainConfig.preset(name, feats.shape[1]).agent
        torch.manual_seed(0)
        agent = Agent(cfg).eval()
        with torch.no_grad():
            agent.shift[2].weight.normal_(0.0, 0.2)
        market = MarketTensors.from_bars(bars, 200, 200 + n, cfg.window, "cpu", features=feats)
        t0 = time.perf_counter()
        view = agent.view_table(torch.randn(n, cfg.d_model))
        t_view = time.perf_counter() - t0
        ctl, costs, st = PolicyControls.make("cpu"), CostModel(), torch.zeros(1, dtype=torch.long)
        greedy_pass(agent, market, view, st, 1000, ctl, costs, accel="native")          # warm-up
        times = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            greedy_pass(agent, market, view, st, n, ctl, costs, accel="native")
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        native.run_native(agent, market, view, st, n, ctl, costs)
        t_loop = time.perf_counter() - t0
        best = min(times)
        print(f"| {name} | {t_view:.1f} | {', '.join(f'{t:.3f}' for t in times)} | {n / best:,.0f} | "
              f"{best / n * 1e6:.2f} | {t_loop:.3f} |", flush=True)


if __name__ == "__main__":
    main()
