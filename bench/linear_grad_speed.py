"""A Linear layer's backward at the update's shapes: autograd's (cuBLAS's input-gradient GEMM and split-K
weight-gradient GEMM with its reduction, the bias sum) against `services.trainer.fused_linear.linear` (the same
input-gradient GEMM, the weight and bias gradients in one Triton kernel), side by side in one run.

    python3 bench/linear_grad_speed.py                  # on a CUDA GPU

Each case is the layer's forward and backward under bf16 autocast, captured in one CUDA graph (so launches cost
what they cost inside the update's graph), timed over replays with CUDA events. Shapes (rows × in → out) are the
`full` preset's at batch 4 096: the encoder's on 256 windows of 64 bars (16 384 tokens), the last block's and the
trunk's, the heads', the IQN's on its 512-sample sub-batch × quantiles. Prints µs per replay and the ratio.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.train_profile import replay_ms  # noqa: E402
from services.trainer.fused_linear import linear  # noqa: E402

SHAPES = [("encoder input", 16384, 16, 128), ("encoder qkv", 16384, 128, 384), ("encoder proj", 16384, 128, 128),
          ("encoder mlp in", 16384, 128, 256), ("encoder mlp out", 16384, 256, 128),
          ("last block k, v", 16384, 128, 256), ("last block mlp in", 256, 128, 256),
          ("trunk in", 4096, 128, 256), ("trunk", 4096, 256, 256), ("logits (folded)", 4096, 256, 2048),
          ("code + V_e", 4096, 256, 24), ("shift", 4096, 24, 64), ("IQN hidden", 16384, 256, 256),
          ("IQN out", 16384, 256, 8)]


def case(fn, rows: int, n_in: int, n_out: int):
    x = torch.randn(rows, n_in, device="cuda", requires_grad=True)
    w = torch.randn(n_out, n_in, device="cuda", requires_grad=True)
    b = torch.randn(n_out, device="cuda", requires_grad=True)
    g = torch.randn(rows, n_out, device="cuda")

    def step():
        x.grad = w.grad = b.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, w, b)
        y.backward(g.to(y.dtype))
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    print(f"# linear_grad_speed: {torch.cuda.get_device_name()} torch={torch.__version__} bf16 autocast, "
          f"forward + backward in one CUDA graph")
    print("\n| layer | rows × in → out | autograd µs | fused_linear µs | ratio |")
    print("|---|---|---:|---:|---:|")
    total = [0.0, 0.0]
    for name, rows, n_in, n_out in SHAPES:
        t = [replay_ms(case(fn, rows, n_in, n_out), a.reps) * 1e3 for fn in (F.linear, linear)]
        total = [total[0] + t[0], total[1] + t[1]]
        print(f"| {name} | {rows} × {n_in} → {n_out} | {t[0]:.1f} | {t[1]:.1f} | {t[0] / t[1]:.2f}× |")
    print(f"| all | | {total[0]:.1f} | {total[1]:.1f} | {total[0] / total[1]:.2f}× |")


if __name__ == "__main__":
    main()
