"""The update's C51 chain alone, forward + backward, at the full preset's shapes: the fused Triton kernels under each
launch setting (`services.trainer.fused_c51.LAUNCH`) side by side with the compiled reference chain they replace
(`losses.c51_branch_losses_reference` under torch.compile), each captured in a CUDA graph and replayed.

    python3 bench/c51_kernel_speed.py --batch 4096 --rows 1 2 4 --warps 1 2 4 --replays 200
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.trainer import fused_c51  # noqa: E402
from services.trainer.losses import c51_branch_losses  # noqa: E402


def inputs(N: int, K: int, A: int, branches: tuple[int, ...], dev: str):
    g = torch.Generator().manual_seed(0)
    NB = sum(branches)
    wide = (torch.randn(N, K * NB * A + 8, generator=g) * 2.0).to(dev, torch.bfloat16).requires_grad_()
    first = torch.tensor([0, branches[0], branches[0] + branches[1]])
    col = (torch.stack([torch.randint(0, n, (N,), generator=g) for n in branches], 1) + first).to(dev)
    delta = (torch.randn(N, 3, generator=g) * 0.03).to(dev).requires_grad_()
    target = torch.softmax(torch.randn(N, 3, A, generator=g), -1).to(dev)
    z = torch.linspace(-0.05, 0.05, A, device=dev)
    return wide, col, delta, target, z, (N, K, NB, A)


def time_replay(step, replays: int) -> float:
    """µs per replay of `step` captured in one CUDA graph (after warm-up runs on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--ensemble", type=int, default=5)
    ap.add_argument("--atoms", type=int, default=51)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4], help="(sample, branch) rows a program")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json", help="also write the fused variants' launch settings and µs to this file")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("c51_kernel_speed needs a CUDA GPU")
    branches = (3, 2, 3)
    wide, col, delta, target, z, (N, K, NB, A) = inputs(a.batch, a.ensemble, a.atoms, branches, "cuda")
    w_ce = torch.rand(N, 3, K, device="cuda")
    w_ent = torch.rand(N, K, device="cuda")

    def make(fused: bool):
        def loss(wide, delta):
            logits = wide[:, :K * NB * A].view(N, K, NB, A)
            ce, ent, _ = c51_branch_losses(logits, col, delta, target, z, branches, fused=fused)
            return (ce * w_ce).sum() + (ent * w_ent).sum()
        fn = torch.compile(loss) if not fused else loss

        def step():
            wide.grad = delta.grad = None
            fn(wide, delta).backward()
        return step

    table, launches = [], []
    ref = time_replay(make(False), a.replays)
    table.append(("reference chain, torch.compile", ref))
    for rows in a.rows:
        for w in a.warps:
            fused_c51.LAUNCH.update(rows=rows, num_warps=w)
            us = time_replay(make(True), a.replays)
            table.append((f"fused, {rows} row{'s' if rows > 1 else ''} × {w} warp{'s' if w > 1 else ''} a program", us))
            launches.append(dict(fused_c51.LAUNCH, us=us))
    print(f"# c51_kernel_speed: batch {N}, K={K}, A={A}, branches {branches}, bf16 logits, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print("| variant | µs per forward + backward (graph replay) | vs reference |")
    print("|---|---:|---:|")
    for name, us in table:
        print(f"| {name} | {us:.1f} | {ref / us:.2f}× |")
    if a.json:
        Path(a.json).write_text(json.dumps({"reference_us": ref, "fused": launches}, indent=1))


if __name__ == "__main__":
    main()
