"""Where the GPU time of a training iteration goes: top kernels of one update and one collection step.

    python3 bench/train_profile.py --batch 4096 --envs 65536          # on the H200

For each half (update at `--batch`, collection at `--envs` accounts), run eagerly after a warm-up under
torch.profiler and print: kernels launched per call, GPU time per call, and the top kernels by total GPU time
(share of the call). This is what decides what to fuse, shrink or capture next.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from services.trainer.train import TrainConfig, build_state  # noqa: E402
from shared.market import chronological_split, compute_features  # noqa: E402
from shared.synthetic import generate  # noqa: E402


def report(name: str, fn, calls: int, top: int) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in kernels) / calls                                   # µs per call
    print(f"\n## {name}: {len(kernels) / calls:.0f} kernels per call, {total / 1e3:.2f} ms GPU time per call")
    by: dict[str, float] = {}
    for e in kernels:
        by[e.name] = by.get(e.name, 0.0) + e.device_time / calls
    print("| kernel | µs per call | share |")
    print("|---|---|---|")
    for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {k[:90]} | {v:.0f} | {v / total:.0%} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="full", choices=["small", "full"])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--envs", type=int, default=65536)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    bars = generate(n_bars=34_000, seed=0).bars
    split, feats = chronological_split(len(bars)), compute_features(bars)
    for half, over in (("update", dict(batch_size=a.batch, n_envs=256)), ("collect", dict(n_envs=a.envs))):
        cfg = TrainConfig.preset(a.config, feats.shape[1])
        for k, v in over.items():
            setattr(cfg, k, v)
        st = build_state(cfg, bars, split, 0, "cuda", features=feats, accel="eager")
        st.env.reset_all()
        while st.replay.count <= max(cfg.horizons) + 2:
            st.runner.collect()
        fn = st.runner.update if half == "update" else st.runner.collect
        label = f"{half} ({a.config}, {'batch ' + str(a.batch) if half == 'update' else str(a.envs) + ' accounts × ' + str(cfg.env_steps_per_iter) + ' steps'})"
        report(label, fn, a.calls, a.top)
        del st
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
