"""The C51 loss of the shifted distributions alone, forward and backward: the torch form (eager and compiled)
against the fused Triton kernel (`services/trainer/fused.py`) at the update's shapes, on the GPU.

    python3 bench/fused_speed.py                                   # batch 4 096 and 1 024 of the `full` preset
    python3 bench/fused_speed.py --batches 4096 --warps 2 4 8      # the kernel's warps per program

Shapes: N samples × 3 branches × K = 5 members × 51 atoms (the taken action of each branch, `make_update`), bf16
logits as the heads give them under autocast. Each row is the median over `--reps` timings by CUDA events of forward
plus backward, after a warm-up; the kernel's rows also give the ratio to the compiled torch form. The kernel's
output is checked against the torch form before it is timed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import services.trainer.fused as fused  # noqa: E402


def inputs(n: int, dtype=torch.bfloat16, K: int = 5, A: int = 51, v_max: float = 0.05):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(n, 3, K, A, device="cuda", generator=g) * 2).to(dtype).requires_grad_(True)
    delta = (torch.randn(n, 3, device="cuda", generator=g) * v_max / 10).requires_grad_(True)
    target = torch.softmax(torch.randn(n, 3, A, device="cuda", generator=g) * 3, -1)
    return logits, delta, v_max * torch.linspace(-1.0, 1.0, A, device="cuda"), target


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", nargs="+", type=int, default=[4096, 1024])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fused_speed.py times CUDA kernels: run it on the GPU machine")
    print(f"# fused_speed: device={torch.cuda.get_device_name()} torch={torch.__version__}")
    torch_form = fused.shifted_c51_reference
    compiled = torch.compile(torch_form)
    print("\n| batch | form | ms fwd+bwd | vs compiled torch |\n|---:|---|---:|---:|")
    for n in a.batches:
        logits, delta, support, target = inputs(n)
        up = torch.randn(n, 3, 5, device="cuda")

        def run(f):
            return lambda: torch.autograd.grad((f(logits, delta, support, target) * up).sum(), [logits, delta])

        ref = run(torch_form)()
        rows = [("torch, eager", median_ms(run(torch_form), a.reps)),
                ("torch, compiled", median_ms(run(compiled), a.reps))]
        for w in a.warps:
            fused.NUM_WARPS = w
            f = lambda lg, d, s, t: fused.shifted_c51_cross_entropy(lg, d, s, t)  # noqa: E731
            got = run(f)()
            for x, y in zip(got, ref):
                torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=2e-2 * y.abs().max().item())
            rows.append((f"fused kernel, {w} warps", median_ms(run(f), a.reps)))
        base = rows[1][1]
        for name, ms in rows:
            print(f"| {n} | {name} | {ms:.3f} | {base / ms:.1f}× |")


if __name__ == "__main__":
    main()
