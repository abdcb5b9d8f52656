"""Runs at once on one GPU, inside one process (each run's epoch in its own thread, on its own CUDA stream) against
processes under CUDA MPS (the study's workers today), against one run alone — training only, side by side in one
invocation.

    python3 -m bench.run_streams --device cuda [--runs 1 2 4 8] [--processes 4 8] [--wide 4 8] [--joint 4 8]
                                 [--timeline] [--iterations 300] [--preset full] [--set iterations=1000]
                                 [--bars 300000]

Every run is the product's `train_epoch` on a `build_state` of the preset (`--accel auto`: compiled and captured on
CUDA), on the same synthetic training split, seeds 0…K−1, after a warm-up epoch that compiles and captures it. Rows:
  threads K      K states built in this process; one thread each runs `train_epoch` (`--iterations` iterations)
                 under `torch.cuda.stream(its own)`, all started together: their CUDA graphs' replays can overlap
  processes P    P copies of this script (`--child`), one state each, under a private MPS daemon
                 (`tradeloop.study.mps`), each starting its timed epoch at one wall-clock instant
  iter/s         aggregate training iterations per second (each iteration: the collection and `updates_per_iter`
                 updates at the preset's batch), over the span from the common start to the last run's end
  one graph K    K states' training iterations recorded together in one CUDA graph, each run's iteration a branch
                 on its own stream forked from the capture stream and joined back to it; per iteration the host
                 draws each run's uniforms, then replays that graph once (iterations only: none of `train_epoch`'s
                 host bookkeeping, which the graph modes keep off the device's path)
  --timeline     for each `one graph K` row, torch.profiler's kernel spans over 5 replays: kernels a replay, µs a
                 kernel, the share of the replay with a kernel running, and how many run at once while any does
  wide K         one state whose batch and environments are K × the preset's (and the samples its update encodes
                 with gradient, the IQN head's and the bars it refreshes: `widen`), alone: the work of K runs in one
                 graph with K× wider kernels — the ceiling of K runs' steps batched into one (its iterations/s
                 counted K times, as K runs' worth)
  ×1             that over the rate of one run alone (threads 1)
  kernels        CUDA kernels one iteration launches (torch.profiler over 10 replays of one state; the
                 processes' figure is the threads' state's), and the aggregate kernels per second of the row
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from services.trainer.loop import train_epoch
from services.trainer.state import build_state
from services.trainer.train import TrainConfig
from shared.knobs import Knobs
from bench.train_speed import synthetic_dataset


def widen(cfg: TrainConfig, k: int) -> TrainConfig:
    """cfg doing K runs' work an iteration: K× the batch and environments, and K× every part of an update that reads
    a subset of the batch or of the bars — the samples encoded with gradient (`encoder_batch`) and trained by the IQN
    head (`iqn_batch`; 0, the whole batch, scales with it) and the bars the rolling refresh re-encodes
    (`emb_refresh` / K updates a full pass). What K runs have and one wider run has not: K sets of weights and
    optimizer moments, K replays and K full refreshes an epoch."""
    cfg.batch_size, cfg.n_envs = cfg.batch_size * k, cfg.n_envs * k
    cfg.encoder_batch, cfg.iqn_batch = cfg.encoder_batch * k, cfg.iqn_batch * k
    cfg.emb_refresh = max(1, cfg.emb_refresh // k)
    return cfg


def make_states(args, seeds: list[int], wide: int = 1, accel: str = "auto",
                configure: Callable[[TrainConfig], None] = lambda cfg: None) -> list:
    """A state of the preset (`--set` applied, then `configure(cfg)`) for each seed on the synthetic split, after a
    warm-up epoch of `args.warmup` iterations; the epochs after it run `args.iterations` (if given)."""
    try:                                               # one compiled step per state: a recompile each, not a fallback
        torch._dynamo.config.recompile_limit = max(64, 8 * len(seeds))
        torch._dynamo.config.accumulated_recompile_limit = 4096
    except AttributeError:
        pass
    bars, split, feats = synthetic_dataset(args.bars)
    states = []
    for seed in seeds:
        cfg = TrainConfig.preset(args.preset, feats.shape[1])
        cfg.override(args.set or [])
        widen(cfg, wide)
        configure(cfg)
        st = build_state(cfg, bars, split, seed, args.device, features=feats, accel=accel)
        cfg.iterations, cfg.learning_starts = args.warmup, 0
        t0 = time.perf_counter()
        train_epoch(st, Knobs())                        # compiles and captures the iteration
        print(f"  state seed {seed}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        cfg.iterations = getattr(args, "iterations", args.warmup)
        states.append(st)
    return states


def timed_threads(states: list, at: float | None = None) -> float:
    """Seconds from the common start to the end of the last of the states' epochs, each in its own thread and on
    its own stream."""
    cuda = states[0].device.type == "cuda"
    streams = [torch.cuda.Stream() if cuda else None for _ in states]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    barrier = threading.Barrier(len(states) + 1)
    errors: list[BaseException] = []

    def one(st, stream) -> None:
        try:
            barrier.wait()
            with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                train_epoch(st, Knobs())
            sync()
        except BaseException as exc:                    # noqa: BLE001 — reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(st, s)) for st, s in zip(states, streams)]
    for t in threads:
        t.start()
    sync()
    if at is not None:
        time.sleep(max(0.0, at - time.time()))
    t0 = time.time() if at is None else at
    barrier.wait()
    for t in threads:
        t.join()
    sync()
    if errors:
        raise errors[0]
    return time.time() - t0


def joint_graph(states: list) -> "torch.cuda.CUDAGraph":
    """One CUDA graph holding an iteration of every state, each on its own stream (a branch of the graph), after one
    eager iteration of each on that stream (its cuBLAS workspace and allocator blocks)."""
    streams = [torch.cuda.Stream() for _ in states]
    cap = torch.cuda.Stream()
    for st, s in zip(states, streams):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            st.runner._bodies["iteration"]()
        torch.cuda.current_stream().wait_stream(s)
    cap.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=cap):
        origin = torch.cuda.current_stream()
        for s in streams:                      # every branch forks from the start, before any joins
            s.wait_stream(origin)
        for st, s in zip(states, streams):
            with torch.cuda.stream(s):
                st.runner._bodies["iteration"]()
        for s in streams:
            origin.wait_stream(s)
    torch.cuda.synchronize()
    return graph


def joint_timeline(states: list, replays: int = 5) -> dict:
    """Where the time of `joint_graph(states)`'s replays goes (torch.profiler's kernel spans): kernels a replay, the
    mean kernel's µs, the share of the span with ≥ 1 kernel running (`busy`), and the mean number running while any
    is (`overlap`: 1.0 when the branches' kernels never run side by side)."""
    from torch.profiler import ProfilerActivity, profile

    graph = joint_graph(states)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    return span_stats(spans, replays)


def span_stats(spans: list[tuple[float, float]], replays: int) -> dict:
    """`joint_timeline`'s figures from kernel spans (start, end in µs) over `replays` replays."""
    if not spans:
        return {}
    spans = sorted(spans)
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])     # an end before a start at a tie
    busy, depth, last = 0.0, 0, edges[0][0]
    for t, d in edges:
        if depth > 0:
            busy += t - last
        depth, last = depth + d, t
    kernel_us = sum(b - a for a, b in spans)
    wall = max(b for _, b in spans) - spans[0][0]
    return {"kernels": len(spans) / replays, "kernel_us": kernel_us / len(spans), "busy": busy / wall,
            "overlap": kernel_us / busy, "replay_us": wall / replays}


def timed_joint(states: list, iterations: int) -> float:
    """Seconds for `iterations` replays of `joint_graph(states)`, each after the host has drawn every run's uniforms
    into its static noise tensors (as `StepRunner.iteration` draws them)."""
    graph = joint_graph(states)
    torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(iterations):
        for st in states:
            st.runner.draw_iteration()
        graph.replay()
    torch.cuda.synchronize()
    return time.time() - t0


def kernels_per_iteration(st, n: int = 10) -> float:
    """CUDA kernels a training iteration of `st` launches (torch.profiler over n graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        st.runner.iteration()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            st.runner.iteration()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA") / n


def child(args) -> None:
    st = make_states(args, [args.seed])
    Path(args.ready).joinpath(f"{args.seed}").write_text("ready")
    while not (Path(args.ready) / "go").exists():
        time.sleep(0.05)
    at = float((Path(args.ready) / "go").read_text())
    wall = timed_threads(st, at=at)
    print(json.dumps({"seed": args.seed, "wall_s": wall}), flush=True)


def processes(args, P: int) -> float:
    import tempfile

    from tradeloop.study.mps import MpsDaemon

    daemon = MpsDaemon()
    if not daemon.start():
        raise SystemExit(f"MPS did not start: {daemon.why_not}")
    try:
        with tempfile.TemporaryDirectory(prefix="tl-run-streams-") as ready:
            cmd = [sys.executable, "-m", "bench.run_streams", "--child", "--ready", ready, "--device", args.device,
                   "--iterations", str(args.iterations), "--warmup", str(args.warmup), "--preset", args.preset,
                   "--bars", str(args.bars)]
            for s in args.set or []:
                cmd += ["--set", s]
            env = {**os.environ, **daemon.env()}
            procs = [subprocess.Popen(cmd + ["--seed", str(i)], stdout=subprocess.PIPE, text=True, env=env)
                     for i in range(P)]
            while sum(1 for p in Path(ready).iterdir()) < P:
                if any(p.poll() not in (None, 0) for p in procs):
                    raise SystemExit("a child process failed")
                time.sleep(0.2)
            Path(ready, "go").write_text(str(time.time() + 2.0))
            walls = [json.loads(p.communicate()[0].strip().splitlines()[-1])["wall_s"] for p in procs]
        return max(walls)
    finally:
        daemon.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--processes", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--wide", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--joint", type=int, nargs="*", default=[], help="runs recorded in one CUDA graph")
    ap.add_argument("--timeline", action="store_true", help="profile the --joint rows' kernel spans")
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--set", action="append", default=None)
    ap.add_argument("--bars", type=int, default=300_000, help="training-split bars")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ready", default="", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)
    if args.joint and not args.device.startswith("cuda"):
        ap.error("--joint records CUDA graphs: it needs --device cuda")
    rows, k_one = [], None
    if args.runs or args.joint:
        states = make_states(args, list(range(max(args.runs + args.joint))))
        k_one = kernels_per_iteration(states[0]) if args.device.startswith("cuda") else None
        for K in args.runs:
            wall = timed_threads(states[:K])
            rows.append({"how": "threads", "runs": K, "wall_s": wall, "iter_per_s": K * args.iterations / wall,
                         "kernels": k_one})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        for K in args.joint:
            wall = timed_joint(states[:K], args.iterations)
            rows.append({"how": "one graph, a branch a run", "runs": K, "wall_s": wall,
                         "iter_per_s": K * args.iterations / wall, "kernels": k_one})
            if args.timeline:
                rows[-1]["timeline"] = joint_timeline(states[:K])
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del states
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    for K in args.wide:
        states = make_states(args, [0], wide=K)
        kernels = kernels_per_iteration(states[0]) if args.device.startswith("cuda") else None
        wall = timed_threads(states)
        rows.append({"how": f"one run, batch and envs ×{K}", "runs": K, "wall_s": wall,
                     "iter_per_s": K * args.iterations / wall, "kernels": kernels, "graphs": 1})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del states
    for P in args.processes:
        wall = processes(args, P)
        rows.append({"how": "processes (MPS)", "runs": P, "wall_s": wall, "iter_per_s": P * args.iterations / wall,
                     "kernels": k_one})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    one = next((r["iter_per_s"] for r in rows if r["runs"] == 1), None)
    print("| how | runs at once | iterations/s | ×1 | kernels an iteration | kernels/s | wall s |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        x = f"{r['iter_per_s'] / one:.2f}" if one else "n/a"
        k = r.get("kernels")
        # a wide run's iterations/s counts K runs' worth, but it launches one iteration's kernels per K
        rate = k * r["iter_per_s"] / (r["runs"] if r.get("graphs") else 1) if k else None
        print(f"| {r['how']} | {r['runs']} | {r['iter_per_s']:.1f} | {x} | {f'{k:.0f}' if k else 'n/a'} | "
              f"{f'{rate / 1e3:.0f} k' if rate else 'n/a'} | {r['wall_s']:.1f} |")
    timed = [r for r in rows if r.get("timeline")]
    if timed:
        print("\n| one graph, runs | kernels a replay | µs a kernel | busy | kernels at once while busy "
              "| µs a replay |\n|---|---|---|---|---|---|")
        for r in timed:
            t = r["timeline"]
            print(f"| {r['runs']} | {t['kernels']:.0f} | {t['kernel_us']:.2f} | {100 * t['busy']:.0f} % | "
                  f"{t['overlap']:.2f} | {t['replay_us']:.0f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
