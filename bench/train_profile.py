"""Where the GPU time of a training iteration goes: top kernels of one update, one collection step and one
rolling embedding refresh.

    python3 bench/train_profile.py --batch 4096 --envs 65536                        # on the H200
    python3 bench/train_profile.py --batch 1024 --envs 256 --train-bars 1000000 --accel compile   # the epoch's

For each part (update at `--batch`, collection at `--envs` accounts, the rolling refresh of the embedding tables
that every update also runs), run after a warm-up under torch.profiler (eagerly, or through torch.compile with
`--accel compile`: its fused kernels are what the captured modes replay) and print: kernels launched per call, GPU
time per call, the kernels of each CUDA stream (the update's targets and the refresh run on side streams), and the
top kernels by total GPU time (share of the call), each compiled kernel with the FX nodes it computes (read from the
modules inductor wrote, `kernel_origins`: in a forward graph the step's own variable names) and the elements its
launch covers (`kernel_sizes`; a combo kernel's each part, which share one launch's registers). This is what decides
what to fuse, shrink or capture next. `--variants` profiles config variants one after another in the same run and ends with a
side-by-side table of them:

    python3 bench/train_profile.py --batch 1024 --train-bars 1000000 --accel compile --parts update --replay \
        --variants '' adamw=fused emb_refresh=4000

`--trace PREFIX` also writes every kernel of one call in launch order (start, stream, µs, kernel, source nodes) to
PREFIX<n>.tsv, one file per profiled part: where the launches come from, not just the time (57 one-microsecond
kernels of the gradient clip were found that way: bench/README.md, entry f5389a5). With `--replay` as well,
PREFIX<n>_replay.tsv holds one graph replay's kernels as the device ran them (start, end, stream), and a table gives
each stream's busy time and the
step's own stream's longest idle gaps: what it waited for inside the graph.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bench import yardstick  # noqa: E402
from shared.graphs import Graphed  # noqa: E402
from services.trainer.train import (TrainConfig, build_state, compile_step, in_precision,  # noqa: E402
                                    refresh_rolling)
from bench.train_speed import fill_for_updates, synthetic_dataset  # noqa: E402


CATEGORIES = (("GEMM", ("gemm", "xmma", "cutlass", "nvjet", "cublas")),
              ("attention", ("fmha", "flash", "attention", "cudnn")),
              ("optimizer / foreach", ("multi_tensor", "foreach", "adam")),
              ("triton (fused by compile)", ("triton",)),
              ("reduction", ("reduce",)),
              ("elementwise / copy", ("elementwise", "copy", "fill", "cat", "index", "gather", "scatter")))


def category(kernel: str) -> str:
    k = kernel.lower()
    return next((c for c, keys in CATEGORIES if any(x in k for x in keys)), "other")


KINDS = (("fused C51 (services/trainer/fused_c51.py)", re.compile(r"^c51_(fwd|bwd)$")),
         ("split-K reduction", re.compile(r"splitkreduce", re.I)),
         ("GEMM", re.compile(r"gemm|xmma|cutlass|nvjet|cublas", re.I)),
         ("attention", re.compile(r"fmha|flash|attention|cudnn", re.I)),
         ("optimizer / foreach", re.compile(r"^triton_for_|multi_tensor|lpnorm", re.I)),
         ("bias-gradient sum", re.compile(r"^triton_(red|per)_fused_sum_\d+$")),
         ("weight cast / pad", re.compile(r"^triton_\w+_fused_(_to_copy|constant_pad_nd|_to_copy_constant_pad_nd|"
                                          r"_to_copy_slice|constant_pad_nd_view)_\d+$")),
         ("combo (independent pointwise kernels in one launch)", re.compile(r"^triton_poi_fused_\d+$")),
         ("inductor element-wise / reduction", re.compile(r"^triton_")),
         ("aten (RNG, fill, copy, scatter, sort) / memset", re.compile(r"^void at::|memset|memcpy", re.I)))


def kind(kernel: str) -> str:
    """A finer kind than `category`, for the step's own stream: what a fix would target (the weights' casts, the
    bias-gradient sums, split-K reductions, combo kernels, ...), by the names inductor, cuBLAS and aten give."""
    return next((name for name, pattern in KINDS if pattern.search(kernel)), "other")


def phases(kernels: list[tuple[float, float, str]], gap_us: float = 100.0) -> list[tuple[int, float, str]]:
    """The step's own stream in phases: its kernels (start µs, duration µs, name), in launch order, split wherever
    the GPU waited more than `gap_us` for the next launch. Profiled without a graph, a compiled step pauses on the
    host at each of its graph breaks (the backward, the targets' and refresh's streams joined, the optimizer), so
    these are the step's phases (sampling, forward, C51 and losses, backward, optimizer). Returns (kernels, µs,
    first kernel's name) per phase."""
    out: list[list] = []
    end = None
    for start, dur, name in sorted(kernels):
        if end is None or start - end > gap_us:
            out.append([0, 0.0, name])
        out[-1][0] += 1
        out[-1][1] += dur
        end = start + dur if end is None else max(end, start + dur)
    return [tuple(x) for x in out]


def replay_ms(fn, reps: int = 20, trace: str | None = None) -> float:
    """GPU wall time per replay of fn captured in one CUDA graph (kernels plus the gaps between them). `trace`: also
    profile 3 replays and write the last one's kernels as the device ran them (`replay_timeline`)."""
    g = Graphed(fn, warmup=1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g()
    start.record()
    for _ in range(reps):
        g()
    end.record()
    torch.cuda.synchronize()
    if trace:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                g()
                torch.cuda.synchronize()
        replay_timeline([e for e in prof.events() if e.device_type.name == "CUDA"], trace)
    return start.elapsed_time(end) / reps


def replay_timeline(kernels: list, trace: str, gaps: int = 12) -> None:
    """The kernels of the last of 3 profiled graph replays, as the device ran them: each stream's busy time (the
    union of its kernels' intervals, so overlapping launches count once) and the step's own stream's idle gaps
    (where it waited for a side stream, or for a launch), the longest with the kernels around them and the kernel of
    another stream that ended last inside the gap (what it waited for; "–" if none did: a launch); every kernel to
    `trace` (start and end µs from the replay's first kernel, stream, kernel). A replay maps the graph's branches
    onto streams of its own, so which branch a stream ran is read from its kernels, not from its number (in the
    H200 traces of bench/README.md's entry 1a3b2bc the "own" stream, the one with the most kernels, ran the
    sampling, the targets, the loss and the backward, and its longest wait was for the online forward
    pass on the second)."""
    if not kernels:
        print("replay timeline: the profiler recorded no kernels inside the graph replays")
        return
    ks = sorted(kernels, key=lambda e: e.time_range.start)
    last = ks[-len(ks) // 3:]
    t0 = last[0].time_range.start
    rows = [(e.time_range.start - t0, e.time_range.end - t0, e.device_resource_id, e.name) for e in last]
    span = max(r[1] for r in rows)
    print(f"\nreplay timeline (one replay as run, {len(rows)} kernels): {span:.0f} µs from its first kernel's start "
          f"to its last one's end")
    print("\n| stream | kernels | busy µs (union) | first start µs | last end µs |")
    print("|---|---:|---:|---:|---:|")
    by: dict[int, list] = {}
    for r in rows:
        by.setdefault(r[2], []).append(r)
    for sid, rs in sorted(by.items(), key=lambda kv: -len(kv[1])):
        busy, end = 0.0, -1.0
        for a, b, _, _ in rs:
            if b > end:
                busy += b - max(a, end)
                end = b
        print(f"| {sid} | {len(rs)} | {busy:.0f} | {rs[0][0]:.0f} | {max(r[1] for r in rs):.0f} |")
    own_sid = max(by, key=lambda sid: len(by[sid]))
    own = sorted(by[own_sid])
    idle, end, prev = [], own[0][1], own[0][3]
    for a, b, _, name in own[1:]:
        if a > end:
            idle.append((a - end, end, prev, name))
        if b > end:
            end, prev = b, name

    def waited_for(at: float, until: float) -> str:
        ended = [r for r in rows if r[2] != own_sid and at <= r[1] <= until]
        if not ended:
            return "–"
        _, _, sid, name = max(ended, key=lambda r: r[1])
        return f"{sid}: {name[:40]}"
    print(f"\nthe step's own stream ({own_sid}) idle {sum(i[0] for i in idle):.0f} µs in {len(idle)} gaps; the longest:")
    print("\n| idle µs | at µs | after | before | waited for (stream: its kernel that ended last in the gap) |")
    print("|---:|---:|---|---|---|")
    for d, at, before, after in sorted(idle, reverse=True)[:gaps]:
        print(f"| {d:.1f} | {at:.0f} | {before[:50]} | {after[:50]} | {waited_for(at, at + d)} |")
    with open(trace, "w") as f:
        f.write("start_us\tend_us\tstream\tkernel\n")
        for a, b, sid, name in rows:
            f.write(f"{a:.1f}\t{b:.1f}\t{sid}\t{name}\n")


SOURCE = re.compile(r"#\s*Topologically Sorted Source Nodes: \[(.*?)\], Original ATen: \[(.*?)\]")
CALL = re.compile(r"^\s*(triton_\w+)\.run\(|^\s*(cpp_fused_\w+)\(|^\s*extern_kernels\.(\w+)\("
                  r"|^(triton_\w+|cpp_fused_\w+) = async_compile\.")


def inductor_modules(root: str | None = None):
    """The text of every module inductor wrote under root (default: its cache directory)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    for path in Path(root or cache_dir()).rglob("*.py"):
        try:
            yield path.read_text(errors="replace")
        except OSError:
            continue


def kernel_origins(root: str | None = None) -> dict[str, set[str]]:
    """Kernel name → the FX nodes it computes, from the modules inductor wrote (its cache directory): each kernel's
    definition, and each launch in a module's call(), follows a comment naming its "source nodes", which in a
    forward graph carry the Python
    variable names of the step (`logits_a`, `probs`, ...) and in a backward graph the ATen ops'. Inductor numbers
    kernels per graph, so one name can stand for kernels of several graphs: all their origins are kept."""
    out: dict[str, set[str]] = {}
    for text in inductor_modules(root):
        last = None
        for line in text.splitlines():
            m = SOURCE.search(line)
            if m:
                last = m.group(1) or m.group(2)
                continue
            c = CALL.match(line)
            if c and last is not None:
                out.setdefault(next(g for g in c.groups() if g), set()).add(last)
                last = None
    return out


HEURISTIC = "@triton_heuristics."
SIZE_HINTS = re.compile(r"size_hints=\{(.*?)\}")
COMBO_SIZES = re.compile(r"'xnumel_\d+': (\d+)")
KERNEL_NAME = re.compile(r"'kernel_name': '(\w+)'")


def kernel_sizes(root: str | None = None) -> dict[str, str]:
    """Kernel name → the elements each of its launches covers, from the modules inductor wrote: a combo kernel's
    (independent kernels in one launch) each part's, joined by " + " (the parts share one launch's block size and
    register allocation, so a register-heavy small part can slow a large streaming one); else its size hints
    (x, and r0 for a reduction's rows). As `kernel_origins`, a name several graphs use keeps all their sizes."""
    out: dict[str, set[str]] = {}
    for text in inductor_modules(root):
        for block in text.split(HEURISTIC)[1:]:
            name = KERNEL_NAME.search(block)
            if name is None:
                continue
            combo = block.split("'combo_grid_meta'", 1)
            if len(combo) == 2:
                parts = COMBO_SIZES.findall(combo[1].split("}", 1)[0])
                sizes = " + ".join(f"{int(n):,}".replace(",", " ") for n in parts)
            else:
                hints = SIZE_HINTS.search(block)
                sizes = "" if hints is None else " × ".join(
                    f"{k.strip().strip(chr(39)).rstrip('_')} {int(v):,}".replace(",", " ") for k, v in
                    (kv.split(":") for kv in hints.group(1).split(",") if ":" in kv))
            if sizes:
                out.setdefault(name.group(1), set()).add(sizes)
    return {k: " / ".join(sorted(v)) for k, v in out.items()}


def report(name: str, fn, calls: int, top: int, body=None, trace: str | None = None,
           replay_trace: str | None = None) -> tuple[float, float, float]:
    """Print the profile of fn; returns (kernels per call, kernel ms per call, ms per graph replay or nan).
    `trace`: also write every kernel of the last call, in launch order, to that file (tab-separated: start µs from
    the call's first kernel, stream, µs, kernel, its source nodes), to see which phase of the step launches what.
    `replay_trace`: the same for one graph replay as the device ran it (`replay_timeline`)."""
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
    wall = float("nan")
    if body is not None:
        wall = replay_ms(body, trace=replay_trace)
        print(f"captured in one CUDA graph: {wall:.2f} ms per replay — kernels busy {total / 1e3 / wall:.0%} of it")
    cats: dict[str, list[float]] = {}
    for e in kernels:
        c = cats.setdefault(category(e.name), [0, 0.0])
        c[0] += 1 / calls
        c[1] += e.device_time / calls
    print("\n| kind | kernels per call | µs per call | share |")
    print("|---|---:|---:|---:|")
    for c, (n, t) in sorted(cats.items(), key=lambda kv: -kv[1][1]):
        print(f"| {c} | {n:.0f} | {t:.0f} | {t / total:.0%} |")
    streams: dict[int, list[float]] = {}
    for e in kernels:
        st = streams.setdefault(e.device_resource_id, [0, 0.0])
        st[0] += 1 / calls
        st[1] += e.device_time / calls
    if len(streams) > 1:
        # the CUDA side streams: the refresh's encodings and, in the update, its targets (`StepRunner`)
        print("\n| stream (CUPTI id; the step's own has the most kernels) | kernels per call | µs per call | share |")
        print("|---|---:|---:|---:|")
        for sid, (n, t) in sorted(streams.items(), key=lambda kv: -kv[1][0]):
            print(f"| {sid} | {n:.0f} | {t:.0f} | {t / total:.0%} |")
    own = max(streams, key=lambda sid: streams[sid][0])
    kinds: dict[str, list[float]] = {}
    for e in kernels:
        if e.device_resource_id == own:
            c = kinds.setdefault(kind(e.name), [0, 0.0, 0])
            c[0] += 1 / calls
            c[1] += e.device_time / calls
            c[2] += (e.device_time < 2.0) / calls
    print("\n| kind, the step's own stream | kernels per call | µs per call | kernels under 2 µs |")
    print("|---|---:|---:|---:|")
    for c, (n, t, small) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        print(f"| {c} | {n:.0f} | {t:.0f} | {small:.0f} |")
    last = sorted(kernels, key=lambda e: e.time_range.start)[-round(len(kernels) / calls):]
    parts = phases([(e.time_range.start, e.device_time, e.name) for e in last if e.device_resource_id == own])
    print("\n| phase of the step's own stream (split at launch pauses > 100 µs: graph breaks) | kernels | µs | "
          "first kernel |")
    print("|---|---:|---:|---|")
    for i, (n, t, first) in enumerate(parts):
        print(f"| {i + 1} | {n} | {t:.0f} | {first[:70]} |")
    print()
    by: dict[str, float] = {}
    for e in kernels:
        by[e.name] = by.get(e.name, 0.0) + e.device_time / calls
    origins = kernel_origins()                                  # what each compiled kernel computes (its FX nodes)
    source = lambda kernel: " / ".join(sorted(origins.get(kernel, ())))  # noqa: E731
    sizes = kernel_sizes()                                      # the elements each launch covers
    print("| kernel | µs per call | share | elements (a combo kernel: each part's) "
          "| source nodes (compiled kernels) |")
    print("|---|---|---|---|---|")
    for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
        print(f"| {k[:90]} | {v:.0f} | {v / total:.0%} | {sizes.get(k, '')[:80]} | {source(k)[:160]} |")
    if trace:
        t0 = last[0].time_range.start
        with open(trace, "w") as f:
            f.write("start_us\tstream\tus\tkernel\tsource nodes\n")
            for e in last:
                f.write(f"{e.time_range.start - t0:.1f}\t{e.device_resource_id}\t{e.device_time:.1f}\t{e.name}\t"
                        f"{source(e.name)}\n")
    return len(kernels) / calls, total / 1e3, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="full", choices=["small", "full"])
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--envs", type=int, default=65536)
    ap.add_argument("--train-bars", type=int, default=20_000, help="bars of the training split (the refresh's size)")
    ap.add_argument("--accel", default="eager", choices=["eager", "compile"])
    ap.add_argument("--parts", nargs="+", default=["update", "collect", "refresh"],
                    choices=["update", "collect", "refresh"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="override preset fields (agent.FIELD for the network's), e.g. agent.n_heads=2")
    ap.add_argument("--variants", nargs="+", default=[""], metavar="'FIELD=VALUE ...'",
                    help="profile each part once per variant (space-separated --set items on top of --set; '' = "
                         "as set) and end with a side-by-side table")
    ap.add_argument("--trace", default=None, metavar="PREFIX",
                    help="write each profiled part's kernels of one call in launch order to PREFIX<n>.tsv")
    ap.add_argument("--replay", action="store_true",
                    help="also time the update and the refresh captured in one CUDA graph (in-graph gaps)")
    a = ap.parse_args()
    bars, split, feats = synthetic_dataset(a.train_bars)
    print(f"# train_profile: config={a.config} accel={a.accel} train bars={split.train[1] - split.train[0]:,} "
          f"device={torch.cuda.get_device_name()} torch={torch.__version__}")
    print(yardstick.line("cuda"), flush=True)     # figures of other machines compare through these
    rows = []
    for variant in a.variants:
        for part, over in (("update", dict(batch_size=a.batch, n_envs=256)), ("collect", dict(n_envs=a.envs)),
                           ("refresh", dict())):
            if part not in a.parts:
                continue
            cfg = TrainConfig.preset(a.config, feats.shape[1]).override(a.set + variant.split())
            for k, v in over.items():
                setattr(cfg, k, v)
            st = build_state(cfg, bars, split, 0, "cuda", features=feats, accel=a.accel)
            st.env.reset_all()
            fill_for_updates(st)
            if part == "refresh":
                fn = in_precision(lambda st=st: refresh_rolling(st), cfg, st.device)
                if a.accel == "compile":
                    fn = compile_step(fn, cfg, st.device)
                label = f"rolling refresh ({st.refresh_idx.shape[0]:,} bars × 2 networks per update)"
            else:
                fn = st.runner.update if part == "update" else st.runner.collect
                label = (f"update (batch {a.batch})" if part == "update"
                         else f"collect ({a.envs} accounts × {cfg.env_steps_per_iter} steps)")
            body = st.runner._bodies["update"] if part == "update" else (fn if part == "refresh" else None)
            name = f"{label}, {a.config}, {a.accel}" + (f", {variant}" if variant else "")
            rows.append((variant or "as set", label, *report(
                name, fn, a.calls, a.top, body if a.replay else None, f"{a.trace}{len(rows)}.tsv" if a.trace else None,
                f"{a.trace}{len(rows)}_replay.tsv" if a.trace and a.replay else None)))
            del st
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    if len(a.variants) > 1:
        print("\n| variant | part | kernels per call | kernel ms per call | ms per graph replay |")
        print("|---|---|---:|---:|---:|")
        for v, label, n, ms, wall in rows:
            print(f"| {v} | {label} | {n:.0f} | {ms:.2f} | {wall:.2f} |")

if __name__ == "__main__":
    main()
