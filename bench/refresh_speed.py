"""An epoch's set-up on the GPU: the embedding cache's full refresh (`refresh_embeddings`: every training bar through
the online and target encoders, chunk by chunk), the part of a run's set-up that is GPU work, in each of the ways it
can run — side by side in one invocation.

    python3 -m bench.refresh_speed [--bars 300000] [--preset full] [--set KEY=VALUE] [--chunk 4096]
                                   [--repeats 5] [--profile TOP] [--device cuda]

The state is a `build_state` of the preset on the synthetic training split (seed 0), trained for a short eager
warm-up epoch. Rows:
  fp32 eager        `encode_bars` as it is, in fp32 (TF32 matmuls where the config's `tf32`)
  steps' precision  `in_precision(encode_bars)` (`full_refresh_pass`, not compiled): bf16 autocast where the
                    config's `bf16` (the rolling refresh inside the steps runs so)
  compiled          `encode_bars` through `compile_step`, run in that precision (`full_refresh_pass`, the product's
                    `StepRunner.encode_bars` on CUDA with a compiling accel): whole chunks only, one graph a network
  s         seconds a full refresh (both networks), the median of `--repeats` after one untimed call
  ×         the fp32 eager row's seconds over the row's
  Δ         the largest |Δ| of the online and target tables from the fp32 eager row's, relative to each table's
            largest |value| (what a lower precision moves)
`--profile TOP` prints each row's CUDA kernels (torch.profiler, the TOP by GPU time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench import run_streams
from services.trainer.buffers import encode_bars, refresh_embeddings
from services.trainer.runtime import full_refresh_pass


def modes(cfg, device) -> dict:
    """{row name: (the pass, whether it is compiled)}."""
    return {"fp32 eager": (encode_bars, False), "steps' precision": (full_refresh_pass(cfg, device, False), False),
            "compiled": (full_refresh_pass(cfg, device, True), True)}


def measure(st, args) -> list[dict]:
    cuda = st.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(st.device)) if cuda else (lambda: None)
    refresh = lambda: refresh_embeddings(st, chunk=args.chunk)  # noqa: E731
    rows, ref = [], None
    for name, (fn, compiled) in modes(st.cfg, st.device).items():
        st.runner.encode_bars, st.runner.encode_bars_compiled = fn, compiled
        t0 = time.perf_counter()
        refresh()                               # a compiled row compiles here
        sync()
        first = time.perf_counter() - t0
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            refresh()
            sync()
            times.append(time.perf_counter() - t0)
        tables = [st.buffers.emb_online.clone(), st.buffers.emb_target.clone()]
        ref = ref or tables
        delta = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(tables, ref))
        rows.append({"mode": name, "s": statistics.median(times), "first_s": first, "delta": delta,
                     "rows": int(st.env.market.windows.shape[0]), "chunk": args.chunk})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.profile and cuda:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                refresh()
                sync()
            print(f"{name}:\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile),
                  file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="full")
    ap.add_argument("--set", action="append", default=None)
    ap.add_argument("--bars", type=int, default=300_000, help="training-split bars")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunk", type=int, default=4096, help="bars a pass (refresh_embeddings' chunk)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=40, help="iterations of the state's warm-up epoch")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP")
    args = ap.parse_args(argv)
    st = run_streams.make_states(args, [0], accel="eager")[0]
    rows = measure(st, args)
    base = rows[0]["s"]
    print(f"| full refresh ({rows[0]['rows']} bars, chunk {args.chunk}) | s | × fp32 eager | first call s | Δ |\n"
          "|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['s']:.3f} | {base / r['s']:.2f} | {r['first_s']:.1f} | {r['delta']:.1e} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
