"""The targets' double-Q selection alone at the full preset's shapes: the fused Triton kernel
(`services.trainer.fused_greedy`) under each warp count side by side with the compiled reference it replaces
(`losses.greedy_next_reference` under torch.compile), each captured in a CUDA graph and replayed.

    python3 bench/greedy_kernel_speed.py --batch 4096 --warps 1 2 4 8 --replays 200
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.c51_kernel_speed import time_replay  # noqa: E402
from services.trainer import fused_greedy  # noqa: E402
from services.trainer.losses import greedy_next  # noqa: E402


def inputs(N: int, K: int, A: int, branches: tuple[int, ...], dev: str):
    """Online and target logits and shifts laid out as the agent's heads make them (rows padded to 2 048 columns,
    bf16 logits, fp32 shifts), and the support."""
    g = torch.Generator().manual_seed(0)
    NB = sum(branches)
    width = -(-(K * NB * A) // 64) * 64

    def logits():
        return (torch.randn(N, width, generator=g) * 2.0).to(dev, torch.bfloat16)[:, :K * NB * A].view(N, K, NB, A)

    def delta():
        return (torch.randn(N, NB + 8, generator=g) * 0.02).to(dev)[:, :NB + 1]
    return logits(), delta(), logits(), delta(), torch.linspace(-0.05, 0.05, A, device=dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--ensemble", type=int, default=5)
    ap.add_argument("--atoms", type=int, default=51)
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--replays", type=int, default=200)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("greedy_kernel_speed needs a CUDA GPU")
    branches = (3, 2, 3)
    xs = inputs(a.batch, a.ensemble, a.atoms, branches, "cuda")
    out: dict[str, tuple[torch.Tensor, ...]] = {}

    def make(fused: bool, name: str):
        fn = (lambda *t: greedy_next(*t, branches, fused=True)) if fused else \
            torch.compile(lambda *t: greedy_next(*t, branches, fused=False))

        def step():
            out[name] = fn(*xs)
        return step

    table = [("reference, torch.compile", time_replay(make(False, "ref"), a.replays))]
    saved = fused_greedy.NUM_WARPS
    for w in a.warps:
        fused_greedy.NUM_WARPS = w
        name = f"fused, {w} warp{'s' if w > 1 else ''} a program"
        table.append((name, time_replay(make(True, name), a.replays)))
        col, p, d = out[name]
        same = bool(torch.equal(col, out["ref"][0])) and bool(torch.allclose(p, out["ref"][1], atol=1e-6))
        if not same:
            sys.exit(f"{name}: differs from the reference")
    fused_greedy.NUM_WARPS = saved
    ref = table[0][1]
    print(f"# greedy_kernel_speed: batch {a.batch}, K={a.ensemble}, A={a.atoms}, branches {branches}, bf16 logits, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | µs a call (graph replay) | vs reference |")
    print("|---|---:|---:|")
    for name, us in table:
        print(f"| {name} | {us:.1f} | {ref / us:.2f}× |")


if __name__ == "__main__":
    main()
