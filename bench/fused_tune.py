"""The fused evaluation kernel's launch shape, side by side: accounts per program × tile (BK, BN, warps).

    python3 -m bench.fused_tune [--bars 20000] [--accounts 1 1024] [--config small|full]
                                [--shapes 1:32x64x4 1:64x128x4 16:32x64x4 ...]

Times `shared.fused.run_kernel` alone (the kernel: heads, act, simulator and tracker over every bar; no ledger
assembly, no post hoc predictions) for a random agent of the preset's shape on synthetic bars, after one untimed
launch (Triton's JIT). Prints µs per bar per program-step and account-bars/s. CUDA only.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from shared.agent import Agent, PolicyControls
from shared.execution import CostModel
from shared.fused import parse_shape, run_kernel
from shared.market import compute_features
from shared.rollout import MarketTensors
from shared.synthetic import generate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bars", type=int, default=20_000)
    ap.add_argument("--accounts", type=int, nargs="+", default=[1, 1024])
    ap.add_argument("--config", default="small", choices=["small", "full"])
    ap.add_argument("--shapes", nargs="+", default=["1:32x64x4", "1:64x128x4", "1:128x128x8", "16:32x64x4"])
    ap.add_argument("--stages", action="store_true",
                    help="instead: the default shape, timed as kernel alone / greedy_pass (+ ledger and records) / "
                         "window_passes (+ encoder and the report's post hoc predictions of every decision)")
    a = ap.parse_args()
    from services.trainer.train import TrainConfig

    dev = torch.device("cuda")
    bars = generate(n_bars=a.bars + 300, seed=0).bars
    feats = compute_features(bars)
    torch.manual_seed(0)
    agent = Agent(TrainConfig.preset(a.config, feats.shape[1]).agent).to(dev).eval()
    market = MarketTensors.from_bars(bars, 200, 200 + a.bars + 50, agent.cfg.window, dev, features=feats)
    with torch.no_grad():
        emb = torch.cat([agent.encode(market.windows[i:i + 4096]) for i in range(0, len(market), 4096)])
    controls = PolicyControls.make(dev)
    print(f"config={a.config} bars={a.bars} {torch.cuda.get_device_name()}")
    if a.stages:
        stages(agent, bars, feats, market, emb, controls, a)
        return
    print(f"{'accounts':>8} {'block':>5} {'BKxBNxwarps':>12} {'s':>8} {'us/bar':>8} {'acct-bars/s':>12}")
    for B in a.accounts:
        starts = torch.as_tensor(np.linspace(0, 40, B).astype(np.int64), device=dev)
        for shape in a.shapes:
            blk, tiles = parse_shape(shape)
            t = "x".join(map(str, tiles))
            kw = dict(block=blk, tiles=tiles)
            try:
                run_kernel(agent, market, emb, starts, 200, controls, CostModel(), **kw)       # JIT
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run_kernel(agent, market, emb, starts, a.bars, controls, CostModel(), **kw)
                torch.cuda.synchronize()
                s = time.perf_counter() - t0
                print(f"{B:>8} {blk:>5} {t:>12} {s:>8.2f} {s / a.bars * 1e6:>8.1f} {B * a.bars / s:>12.0f}",
                      flush=True)
            except Exception as exc:  # noqa: BLE001 — one failing shape must not cost the others
                print(f"{B:>8} {blk:>5} {t:>12} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")


def stages(agent, bars, feats, market, emb, controls, a) -> None:
    from services.evaluator.runner import window_passes
    from shared.rollout import greedy_pass

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    print(f"{'accounts':>8} {'kernel_s':>9} {'pass_s':>8} {'windows_s':>10} {'kernel acct-bars/s':>19}")
    for B in a.accounts:
        st = np.linspace(0, 40, B).astype(np.int64)
        starts = torch.as_tensor(st, device=market.vol.device)
        L = a.bars
        run_kernel(agent, market, emb, starts, 200, controls, CostModel())                  # JIT
        k = timed(lambda: run_kernel(agent, market, emb, starts, L, controls, CostModel()))
        p = timed(lambda: greedy_pass(agent, market, emb, starts, L, controls, CostModel(), accel="fused"))
        wins = [(200 + int(s), 200 + int(s) + L) for s in st]
        w = timed(lambda: window_passes(agent, bars, wins, taus=tuple(np.linspace(0.05, 0.95, 5)), features=feats,
                                        device=market.vol.device, accel="fused"))
        print(f"{B:>8} {k:>9.2f} {p:>8.2f} {w:>10.2f} {B * (L - 1) / k:>19.0f}", flush=True)


if __name__ == "__main__":
    main()
