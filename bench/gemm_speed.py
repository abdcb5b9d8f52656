"""The update's largest matrix products alone: how fast the GPU runs each of their shapes outside the update.

    python3 bench/gemm_speed.py --device cuda                       # full preset, batch 4 096, bf16 and fp32 (TF32)

The shapes follow from the preset and the batch N (H' bootstrap horizons a sample, M IQN quantiles, N_q samples of
the IQN head, hidden width W, K ensemble members, NB actions, A atoms): the target's IQN over N_q·H'·M rows (τ
embedding E → W, then W → W), the online IQN over N_q·M rows, and the heads' one product, K·NB·A columns (padded to
8), over the N·H' bootstrap states and over the batch. Each is `F.linear` with a bias, timed with CUDA events over `--repeat` calls after a warm-up
(wall clock on a CPU). Compare the times with the update's GEMM row in `train_profile.py`: what the same products
cost inside the update, where the table sums every launch of a kernel.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from services.trainer.train import TrainConfig, iqn_rows, sample_horizons  # noqa: E402


def shapes(cfg: TrainConfig, n: int) -> list[tuple[str, int, int, int]]:
    """(what, rows, inputs, outputs) of the update's largest products at batch n."""
    a, H, M, n_q = cfg.agent, sample_horizons(cfg), cfg.iqn_quantiles, iqn_rows(cfg, n)
    heads = -(-a.ensemble * a.n_actions * a.n_atoms // 8) * 8                   # `Agent.logit_weights`, padded
    return [("target IQN, τ embedding", n_q * H * M, a.iqn_embed, a.hidden),
            ("target IQN, hidden layer", n_q * H * M, a.hidden, a.hidden),
            ("online IQN, hidden layer", n_q * M, a.hidden, a.hidden),
            ("heads at the bootstrap states", n * H, a.hidden, heads),
            ("heads at the batch", n, a.hidden, heads)]


def timed(fn, device: torch.device, repeat: int) -> float:
    """Mean µs of fn() over `repeat` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeat * 1e3
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat * 1e6


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--config", default="full", choices=("small", "full"))
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True           # as the trainer sets it (`TrainConfig.tf32`)
    cfg = TrainConfig.preset(a.config, 16)
    rows = []
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"# gemm_speed: config={a.config} batch={a.batch} device={name} torch={torch.__version__}\n")
    print("| product | rows × in → out | dtype | µs | TFLOP/s |\n|---|---|---|---:|---:|")
    for what, m, k, n in shapes(cfg, a.batch):
        for name in a.dtypes:
            dt = getattr(torch, name)
            x, w, b = (torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt),
                       torch.randn(n, device=dev, dtype=dt))
            us = timed(lambda: F.linear(x, w, b), dev, a.repeat)
            rows.append(dict(what=what, rows=m, k=k, n=n, dtype=name, us=us, tflops=2 * m * k * n / us / 1e6))
            print(f"| {what} | {m:,} × {k} → {n} | {name} | {us:.1f} | {rows[-1]['tflops']:.0f} |")
    return rows


if __name__ == "__main__":
    main()
