"""The arithmetic of R runs' training iteration in lockstep, against R times one run's and one run widened R times
(`run_streams.widen`): floating-point operations counted by torch's FlopCounterMode, and what they say of the
aggregate rate runs at once can reach on a GPU.

    .venv/bin/python -m bench.lockstep_flops                              # full preset, 8 runs, 20 000 bars
    .venv/bin/python -m bench.lockstep_flops --seconds 1.07 5.59          # with measured seconds an epoch

Each row is one iteration (the collection, then `updates_per_iter` updates) of `lockstep_step.BatchedIteration`,
run eagerly on the CPU after a warm-up epoch (`run_streams.make_states`), on the preset with the reference paths of
its Triton kernels (the same arithmetic: they fuse element-wise work and the C51 chain, which is not counted).
Counted: matrix products (mm, addmm, bmm) and attention (dense), as `bench/update_flops.py` counts them. Rows:
  one run        R = 1
  lockstep R     R runs vmapped over their stacked state: the study's `--lockstep R` worker's iteration
  wide R         one run doing R runs' work (`run_streams.widen`: R× the batch, environments, samples encoded with
                 gradient, IQN samples and refreshed bars), the `run_streams.py --wide R` row's state
With `--seconds ONE R` (one run's training seconds an epoch and R runs' in lockstep, measured on the GPU by
`study_speed.py`, `--iterations` iterations an epoch): the TFLOP/s each achieves, and what R runs at 3× one run's
rate would have to achieve.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import run_streams
from bench.update_flops import CPU_ATTENTION
from bench.vmap_update import reference_paths
from services.trainer.lockstep_step import BatchedIteration


def iteration_flops(states: list) -> float:
    """FLOP of one batched iteration of `states` (the third: two run first, so replay and buffers are past their
    first writes)."""
    it = BatchedIteration(states)
    for _ in range(2):
        it.draw()
        it()
    it.draw()
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
    with counter:
        it()
    return float(counter.get_total_flops())


def count(preset: str, runs: int, bars: int, warmup: int, settings: list[str]) -> list[dict]:
    """Rows: one run, `runs` runs in lockstep, one run widened `runs` times."""
    args = argparse.Namespace(bars=bars, preset=preset, set=settings, device="cpu",
                              warmup=warmup, iterations=warmup)
    rows = []
    for how, seeds, wide in (("one run", 1, 1), (f"lockstep {runs}", runs, 1), (f"wide {runs}", 1, runs)):
        t0 = time.perf_counter()
        states = run_streams.make_states(args, list(range(seeds)), wide=wide, accel="eager", configure=reference_paths)
        flops = iteration_flops(states)
        rows.append({"how": how, "runs": max(seeds, wide), "flops": flops, "s": time.perf_counter() - t0})
        print(f"  {how}: {flops / 1e9:.2f} GFLOP ({rows[-1]['s']:.0f} s)", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], seconds: tuple[float, float] | None, iterations: int) -> str:
    """The rows as markdown, per run-equivalent against one run; with `seconds` the TFLOP/s achieved and needed."""
    one = rows[0]["flops"]
    out = ["| iteration | runs' work | GFLOP | GFLOP a run | × one run's |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['how']} | {r['runs']} | {r['flops'] / 1e9:.2f} | {r['flops'] / r['runs'] / 1e9:.2f} | "
                   f"{r['flops'] / one:.3f} |")
    if seconds:
        s1, sr = seconds
        lock = rows[1]
        need = lock["flops"] * iterations / (lock["runs"] * s1 / 3)
        out += ["", f"- one run: {one * iterations / s1 / 1e12:.1f} TFLOP/s achieved ({iterations} iterations in "
                    f"{s1:g} s); {lock['how']}: {lock['flops'] * iterations / sr / 1e12:.1f} TFLOP/s ({sr:g} s); "
                    f"{lock['runs']} runs at 3× one run's rate would need {need / 1e12:.1f} TFLOP/s "
                    f"({lock['runs'] * s1 / 3:.2f} s for their iterations)"]
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="full", choices=["small", "full"])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--bars", type=int, default=20_000, help="training split (sets the refresh's chunk)")
    ap.add_argument("--warmup", type=int, default=30, help="iterations of each state's warm-up epoch")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="override preset fields")
    ap.add_argument("--seconds", type=float, nargs=2, metavar=("ONE", "LOCKSTEP"),
                    help="one run's and the lockstep runs' training seconds an epoch, measured on the GPU")
    ap.add_argument("--iterations", type=int, default=1000, help="iterations an epoch behind --seconds")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    if a.runs < 2:
        ap.error(f"--runs: at least 2 runs to set beside one, got {a.runs}")
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"# lockstep_flops: preset={a.preset} runs={a.runs} bars={a.bars:,} set={a.set} torch={torch.__version__}")
    print(table(count(a.preset, a.runs, a.bars, a.warmup, a.set), tuple(a.seconds) if a.seconds else None,
                a.iterations))


if __name__ == "__main__":
    main()
