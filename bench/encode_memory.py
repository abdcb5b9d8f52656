"""The evaluation's batched part (`shared.rollout.market_view`: the market encoder and `Agent.view_table` over every
bar of a window) at several chunk sizes — its seconds and the GPU memory it takes — side by side in one invocation.

    python3 -m bench.encode_memory [--device cuda] [--preset full] [--bars 200000] [--chunks 4096 8192 16384 32768]
                                   [--repeats 3]

The agent is a random one of the preset's shape (seed 0), eval mode, over a `MarketTensors` of `--bars` synthetic
bars (the product's windows: a strided view of the feature rows). Each row calls `market_view(agent, windows,
chunk)` once untimed, then `--repeats` times timed:
  s            the median seconds of a call
  bars/s       bars over s
  peak GiB     on CUDA, `max_memory_allocated` during a call, less what was allocated before it (the weights and
               the window's features): the memory the call itself needs at its peak
  reserved GiB on CUDA, the caching allocator's `max_memory_reserved` after the row: what a process that ran the
               call keeps from the device until it exits (or empties its cache), which is what a study measures as
               a run's share of the GPU (`tradeloop.study.worker.record_run_memory`)
  Δ emb        the largest |Δ| of the embeddings from the first row's, relative to their largest |value| (the same
               numbers up to the kernels' rounding: chunking changes no result)
On a CPU, `peak GiB` is the rise of the process's peak resident set over one call (Linux: the peak reset just before
it), each chunk size in a process of its own (`--child`: memory an earlier row freed and the process kept would hold
a later row's tensors unseen), and `reserved GiB` is empty (no caching allocator).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from services.trainer.config import TrainConfig
from shared.agent import Agent
from shared.market import compute_features
from shared.rollout import MarketTensors, market_view
from shared.synthetic import generate

GIB = 2 ** 30


def setup(preset: str, bars: int, device: torch.device) -> tuple[Agent, torch.Tensor]:
    """A random agent of `preset` (seed 0) and the windows of `bars` synthetic bars, on `device`."""
    b = generate(n_bars=bars, seed=0).bars
    feats = compute_features(b)
    torch.manual_seed(0)
    agent = Agent(TrainConfig.preset(preset, feats.shape[1]).agent).to(device).eval()
    market = MarketTensors.from_bars(b, 0, len(b), agent.cfg.window, device=device, features=feats)
    return agent, market.windows


def proc_status_kib(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> int | None:
    """Set this process's resident-set peak (VmHWM) to its resident set now (Linux: "5" to /proc/self/clear_refs),
    so that the next peak is a call's own; returns the resident set in KiB, or None where there is no such file."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return proc_status_kib("VmRSS")
    except (OSError, KeyError):
        return None


def measure(agent: Agent, windows: torch.Tensor, chunks: list[int], repeats: int) -> list[dict]:
    """One row a chunk size, in this process (on a CPU, peak GiB is right for the first row only: see `main`)."""
    cuda = windows.device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(windows.device)) if cuda else (lambda: None)
    rows = []
    for chunk in chunks:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(windows.device)
            base = torch.cuda.memory_allocated(windows.device)
        rss = None if cuda else reset_peak_rss()
        emb, view = market_view(agent, windows, chunk)                    # untimed: cuBLAS and allocator warm-up
        sync()
        if cuda:
            peak = (torch.cuda.max_memory_allocated(windows.device) - base) / GIB
        else:
            peak = None if rss is None else (proc_status_kib("VmHWM") - rss) * 1024 / GIB
        del emb, view
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            emb, view = market_view(agent, windows, chunk)
            sync()
            times.append(time.perf_counter() - t0)
            del view
        s = statistics.median(times)
        rows.append({"chunk": chunk, "s": s, "bars_per_s": windows.shape[0] / s, "peak_gib": peak,
                     "reserved_gib": torch.cuda.max_memory_reserved(windows.device) / GIB if cuda else None,
                     "emb": emb.float().cpu().numpy()})
        del emb
    return rows


def with_deltas(rows: list[dict]) -> list[dict]:
    """The rows with `delta_emb` (against the first row's embeddings) in place of the embeddings."""
    ref = rows[0]["emb"]
    scale = max(float(np.abs(ref).max()), 1e-30)
    return [{**{k: v for k, v in r.items() if k != "emb"}, "delta_emb": float(np.abs(r["emb"] - ref).max()) / scale}
            for r in rows]


def table(rows: list[dict]) -> str:
    gib = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| chunk (windows) | s | bars/s | peak GiB | reserved GiB | Δ emb |", "|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['chunk']} | {r['s']:.3f} | {r['bars_per_s']:,.0f} | {gib(r['peak_gib'])} | "
              f"{gib(r['reserved_gib'])} | {r['delta_emb']:.1e} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--bars", type=int, default=200_000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--child", metavar="NPY", help=argparse.SUPPRESS)   # one CPU row; its embeddings to NPY
    args = ap.parse_args(argv)
    if any(c < 1 for c in args.chunks) or args.repeats < 1 or args.bars < 1:
        ap.error("--chunks, --repeats and --bars must be ≥ 1")
    device = torch.device(args.device)
    if device.type == "cpu" and not args.child:
        rows = [cpu_row(args, c) for c in args.chunks]
    else:
        agent, windows = setup(args.preset, args.bars, device)
        with torch.no_grad():
            rows = measure(agent, windows, args.chunks, args.repeats)
        if args.child:
            np.save(args.child, rows[0].pop("emb"), allow_pickle=False)
            print(json.dumps(rows[0]))
            return rows
    rows = with_deltas(rows)
    print(table(rows))
    print(json.dumps(rows))
    return rows


def cpu_row(args, chunk: int) -> dict:
    """One chunk size's row in a process of its own (this script with `--child`)."""
    with tempfile.TemporaryDirectory() as d:
        npy = str(Path(d) / "emb.npy")
        cmd = [sys.executable, "-m", "bench.encode_memory", "--device", "cpu", "--preset", args.preset, "--bars",
               str(args.bars), "--chunks", str(chunk), "--repeats", str(args.repeats), "--child", npy]
        p = subprocess.run(cmd, capture_output=True, text=True, check=True)
        row = json.loads(p.stdout.strip().splitlines()[-1])
        row["emb"] = np.load(npy, allow_pickle=False)
    return row


if __name__ == "__main__":
    main()
