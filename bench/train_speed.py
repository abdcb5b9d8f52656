"""Training speed, eager vs compiled vs CUDA-graphed, side by side in one run (`StepRunner` modes).

    python3 bench/train_speed.py --device cuda                      # on the H200: the issue's table
    .venv/bin/python bench/train_speed.py --device cpu --config small --modes eager --batches 128 \\
        --envs 16 --epoch-bars 0 --threads 1                         # CPU
    .venv/bin/python bench/train_speed.py --device cpu --config small --modes eager --batches 128 --envs 16 \\
        --epoch-bars 0 --updates 5 --collects 5 --threads 1 --product-set iterations=20 learning_starts=64  # smoke

Rows (one column per mode, then each mode's ratio to eager):
  updates/s @ batch N     the whole update step (sampling, C51 + IQN + expectile + auxiliary losses, backward, clip,
                          AdamW, target lerp, priorities, LR schedule, rolling embedding refresh), steady state
  account-steps/s @ B     collection: B accounts × steps of policy (ε, gates) + simulator + rewards + replay write
                          on a `--bars` training split (when B × steps ≥ its bars the heads run once per bar,
                          `TrainEnv.collect`)
  peak GPU memory         the largest `max_memory_allocated` of that mode's rows
  epoch s @ T bars        one epoch of the config (iterations × n_envs × env_steps ≈ T env-steps) on a training
                          split of T synthetic bars, after a short warm-up epoch (captures, compiles); the same
                          epoch's updates/s and env-steps/s as `train_epoch` counts them (`EpochStats`)
  `tradeloop train` …     the product's own path, first in the run: `tradeloop.cmd_train.run_training` — what
                          `tradeloop train --dataset D --config C --device X --epochs N` runs, default flags
                          (`--accel auto`) — timed as its user sees it: each epoch's seconds, compile seconds,
                          updates/s and env-steps/s (its `EpochStats`); the table shows epoch 2 (after the compile)
                          in the column of the mode "auto" resolved to, and whether torch.compile's cache was cold.
                          `--product-set` overrides preset fields (tiny CPU smoke runs); `--no-product` skips it
  GPU busy %              the union of kernel spans over `--busy-iterations` steady-state iterations
                          (`StepRunner.iteration`: collection + updates_per_iter updates, one CUDA graph in the graph
                          modes; torch.profiler, `--profile`), over the GPU timeline (first kernel's start to last
                          kernel's end: gaps inside and between replays count as idle), over the host's wall time
                          of the loop (also counting the start-up before the first launch and the profiler's cost),
                          and over the GPU time of the same iterations run unprofiled (CUPTI's per-kernel tracing
                          widens the gaps between a replay's kernels)
Every figure is measured after a warm-up (captures and compiles excluded); times end with a device sync.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.trainer.train import TrainConfig, build_state, train_epoch  # noqa: E402
from shared.graphs import compile_cache_dir  # noqa: E402
from shared.knobs import Knobs  # noqa: E402
from shared.market import chronological_split, compute_features  # noqa: E402
from shared.synthetic import generate  # noqa: E402
from bench import yardstick  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def synthetic_dataset(n_train: int):
    """(bars, split, features) of synthetic bars whose training split holds about n_train bars."""
    n = int(n_train / 0.588) + 500                  # chronological_split keeps ~58.8 % for training
    bars = generate(n_bars=n, seed=0).bars
    return bars, chronological_split(len(bars)), compute_features(bars)


def fill_for_updates(st) -> None:
    """Collect until the replay holds enough transitions (the longest horizon's and two more) for an update."""
    while st.replay.count <= max(st.cfg.horizons) + 2:
        st.runner.collect()


class Bench:
    def __init__(self, args):
        self.a, self.dev = args, torch.device(args.device)
        self.data: dict[int, tuple] = {}
        self._busy: dict[str, tuple[float, float, float]] = {}
        self._epochs: dict[tuple[str, int], object] = {}

    def dataset(self, n_train: int):
        """Synthetic bars whose training split holds about n_train bars (cached)."""
        if n_train not in self.data:
            self.data[n_train] = synthetic_dataset(n_train)
        return self.data[n_train]

    def state(self, mode: str, n_train: int, **over):
        if "compile" in mode:
            torch._dynamo.reset()   # each row compiles for its own shapes (no dynamic-shape recompile of the last)
        bars, split, feats = self.dataset(n_train)
        cfg = TrainConfig.preset(self.a.config, feats.shape[1])
        cfg.tf32 = not self.a.no_tf32
        cfg.act_view_cache = self.a.act_view_cache
        cfg.override(self.a.set)
        for k, v in over.items():
            setattr(cfg, k, v)
        st = build_state(cfg, bars, split, 0, self.dev, features=feats, accel=mode)
        st.env.reset_all()
        return st

    def timed(self, fn, n: int) -> float:
        """Seconds per call of fn over n calls, after the caller's warm-up."""
        sync(self.dev)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync(self.dev)
        return (time.perf_counter() - t0) / n

    def updates_per_s(self, mode: str, batch: int) -> float:
        st = self.state(mode, self.a.bars, batch_size=batch, n_envs=256, env_steps_per_iter=2)
        fill_for_updates(st)
        for _ in range(3):
            st.runner.update()                     # the first call captures / compiles
        return 1.0 / self.timed(st.runner.update, self.a.updates)

    def account_steps_per_s(self, mode: str, envs: int) -> float:
        st = self.state(mode, self.a.bars, n_envs=envs, env_steps_per_iter=2)
        for _ in range(3):
            st.runner.collect()
        return envs * st.cfg.env_steps_per_iter / self.timed(st.runner.collect, self.a.collects)

    def epoch_stats(self, mode: str, n_train: int):
        """`EpochStats` of one epoch after a short warm-up epoch (cached per mode and size)."""
        if (mode, n_train) not in self._epochs:
            st = self.state(mode, n_train)
            iters = st.cfg.iterations
            st.cfg.iterations, st.cfg.learning_starts = 20, 0
            train_epoch(st, Knobs())                   # warm-up epoch: captures, compiles, fills replay
            st.cfg.iterations = iters
            self._epochs[(mode, n_train)] = train_epoch(st, Knobs())
        return self._epochs[(mode, n_train)]

    def product(self):
        """`tradeloop train` as its user runs it (`run_training`, `--accel auto`) into a temporary directory:
        (the mode "auto" resolved to, each epoch's `EpochStats`, whether the compile cache was empty before)."""
        import tempfile

        from services.trainer.train import TrainConfig
        from shared.graphs import compile_cache_dir, resolve_accel
        from shared.market import load_dataset
        from tradeloop.cmd_train import run_training

        a = self.a
        config = a.config
        if a.product_set:
            feats = compute_features(load_dataset(a.product_dataset, seed=0))
            config = TrainConfig.preset(a.config, feats.shape[1]).override(a.product_set)
        cache = compile_cache_dir()
        cold = not (cache.is_dir() and any(cache.iterdir()))
        torch._dynamo.reset()
        stats = []
        with tempfile.TemporaryDirectory(prefix="tl-train-speed-") as d:
            run_training(a.product_dataset, a.product_epochs, Path(d) / "run", device=a.device, config=config,
                         seed=0, accel="auto", on_epoch=stats.append)
        return resolve_accel("auto", self.dev), stats, cold

    def busy(self, mode: str) -> tuple[float, float, float]:
        """GPU busy over steady-state iterations: the union of kernel spans over (a) the GPU's timeline from the
        first kernel's start to the last one's end, (b) the host's wall time of the loop, which adds the time
        between the clock starting and the first launch and the profiler's own overhead; (c) the kernel time over the
        GPU time of the same number of iterations run again without the profiler (CUDA events). Cached per mode."""
        if mode in self._busy:
            return self._busy[mode]
        from torch.profiler import ProfilerActivity, profile
        st = self.state(mode, self.a.bars)
        for _ in range(30):
            st.runner.collect()
        for _ in range(3):
            st.runner.iteration()                  # collection + updates: one graph in the graph modes
        sync(self.dev)
        iteration = st.runner.iteration
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(self.a.busy_iterations):
                iteration()
            sync(self.dev)
            wall = time.perf_counter() - t0
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in spans:                          # µs
            if cur_e is None or s > cur_e:
                busy += 0 if cur_e is None else cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += 0 if cur_e is None else cur_e - cur_s
        timeline = max(e for _, e in spans) - spans[0][0]
        # the same iterations without the profiler, timed by CUDA events: CUPTI's per-kernel tracing widens the
        # gaps between the ~1 400 kernels of a replay, so the third figure is the profiled kernel time over the
        # unprofiled GPU time
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.a.busy_iterations):
            iteration()
        end.record()
        sync(self.dev)
        self._busy[mode] = (busy / timeline, busy * 1e-6 / wall, busy * 1e-3 / start.elapsed_time(end))
        return self._busy[mode]


def e2_batch(args) -> int:
    """The batch size of the `tradeloop train` rows' preset (with `--product-set`)."""
    cfg = TrainConfig.preset(args.config, 1)
    return cfg.override(args.product_set).batch_size if args.product_set else cfg.batch_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="full", choices=["small", "full"])
    ap.add_argument("--modes", nargs="+", default=["eager", "compile", "graph", "compile+graph"])
    ap.add_argument("--batches", type=int, nargs="*", default=[256, 4096])
    ap.add_argument("--envs", type=int, nargs="*", default=[4096, 65536])
    ap.add_argument("--epoch-bars", type=int, default=1_000_000, help="training-split bars of the epoch row (0: skip)")
    ap.add_argument("--epoch-modes", nargs="*", default=["graph", "compile+graph"],
                    help="modes measured in the epoch row (an eager full epoch takes minutes)")
    ap.add_argument("--bars", type=int, default=20_000, help="training-split bars of the other rows")
    ap.add_argument("--updates", type=int, default=50)
    ap.add_argument("--collects", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="add the GPU busy %% rows")
    ap.add_argument("--busy-modes", nargs="*", default=["graph", "compile+graph"],
                    help="modes of the GPU busy rows (--profile)")
    ap.add_argument("--busy-iterations", type=int, default=50, help="steady-state iterations of the busy rows")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-tf32", action="store_true", help="plain fp32 matmuls (the config's default is TF32)")
    ap.add_argument("--act-view-cache", action="store_true",
                    help="collection acts on the cached market view of every bar (TrainConfig.act_view_cache)")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="override preset fields (agent.FIELD for the network's), e.g. agent.n_heads=2")
    ap.add_argument("--product", action=argparse.BooleanOptionalAction, default=True,
                    help="the rows of `tradeloop train` as its user runs it (first in the run)")
    ap.add_argument("--product-dataset", default="synthetic", help="--dataset of the `tradeloop train` rows")
    ap.add_argument("--product-epochs", type=int, default=2, help="--epochs of the `tradeloop train` rows (≥ 2)")
    ap.add_argument("--product-set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="override preset fields of the `tradeloop train` rows (tiny smoke runs), e.g. iterations=20")
    args = ap.parse_args()
    if args.product and args.product_epochs < 2:
        ap.error("--product-epochs must be >= 2: the rows show the epoch after the compile")
    if args.threads:
        torch.set_num_threads(args.threads)
    b = Bench(args)
    gpu = torch.cuda.get_device_name() if b.dev.type == "cuda" else "cpu"
    print(f"# train_speed: config={args.config} device={gpu} torch={torch.__version__} tf32={not args.no_tf32} "
          f"act_view_cache={args.act_view_cache} threads={torch.get_num_threads()} set={args.set}", flush=True)
    print(yardstick.line(b.dev), flush=True)     # figures of other machines compare through these
    product_rows: dict[str, dict[str, str]] = {}
    if args.product:
        mode, stats, cold = b.product()
        label = (f"tradeloop train --dataset {args.product_dataset} --config {args.config} --device {args.device} "
                 f"--epochs {args.product_epochs}" + (f" (preset with {' '.join(args.product_set)})"
                                                      if args.product_set else ""))
        print(f"  as `{label}` runs it: --accel auto → {mode}; torch.compile cache "
              f"{'cold' if cold else 'warm'} ({compile_cache_dir()})", flush=True)
        for st in stats:
            print(f"    epoch {st.epoch}: {st.seconds:.1f} s (compile {st.compile_s:.1f} s), "
                  f"{st.updates_per_s:,.1f} updates/s, {st.env_steps_per_s:,.0f} env-steps/s", flush=True)
        e2 = stats[1]
        product_rows = {
            f"`tradeloop train` updates/s, epoch 2 (batch {e2_batch(args)})": {mode: f"{e2.updates_per_s:,.4g}"},
            "`tradeloop train` env-steps/s, epoch 2": {mode: f"{e2.env_steps_per_s:,.3g}"},
            "`tradeloop train` epoch 1 / 2 s (compile s)":
                {mode: f"{stats[0].seconds:.1f} / {e2.seconds:.1f} ({stats[0].compile_s:.1f}, "
                       f"{'cold' if cold else 'warm'} cache)"}}
    rows: list[tuple[str, str, callable]] = []
    rows += [(f"updates/s @ batch {n}", "{:,.3g}", lambda m, n=n: b.updates_per_s(m, n)) for n in args.batches]
    rows += [(f"account-steps/s @ B={n}", "{:,.3g}", lambda m, n=n: b.account_steps_per_s(m, n)) for n in args.envs]
    if args.epoch_bars:
        for name, field, fmt in (("s", "seconds", "{:.1f}"), ("updates/s", "updates_per_s", "{:,.4g}"),
                                 ("env-steps/s", "env_steps_per_s", "{:,.3g}")):
            rows.append((f"epoch {name} @ {args.epoch_bars:,} train bars", fmt,
                         lambda m, f=field: getattr(b.epoch_stats(m, args.epoch_bars), f)
                         if m in args.epoch_modes else None))
    if args.profile and b.dev.type == "cuda":
        rows += [(f"GPU busy % (kernel time / {over})", "{:.0%}",
                  lambda m, i=i: b.busy(m)[i] if m in args.busy_modes else None)
                 for i, over in enumerate(("GPU timeline", "host wall", "unprofiled GPU time"))]
    peak = {m: 0.0 for m in args.modes}
    table: dict[str, dict[str, str]] = {}
    raw: dict[str, dict[str, float]] = {}
    for label, fmt, fn in rows:
        table[label], raw[label] = {}, {}
        for m in args.modes:
            if b.dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                v = fn(m)
                if v is None:
                    table[label][m] = "–"
                    continue
                raw[label][m], table[label][m] = v, fmt.format(v)
            except Exception as exc:                # a mode that cannot run here: say why, keep the rest
                table[label][m] = "failed"
                print(f"  {label} [{m}] failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}",
                      flush=True)
                print("    " + traceback.format_exc()[-2000:].replace("\n", "\n    "), file=sys.stderr, flush=True)
            if b.dev.type == "cuda":
                peak[m] = max(peak[m], torch.cuda.max_memory_allocated() / 2 ** 30)
                torch.cuda.empty_cache()
            print(f"  {label} [{m}] = {table[label][m]}", flush=True)
    if b.dev.type == "cuda":
        table["peak GPU memory"] = {m: f"{peak[m]:.2f} GiB" for m in args.modes}
    table.update(product_rows)
    modes = args.modes + [m for cells in product_rows.values() for m in cells if m not in args.modes][:1]
    ratios = [m for m in args.modes if m != "eager"] if "eager" in args.modes else []
    head = "| row | " + " | ".join(modes) + "".join(f" | {m} / eager" for m in ratios) + " |"
    print()
    print(head)
    print("|" + "---|" * (1 + len(modes) + len(ratios)))
    for label, cells in table.items():
        r = raw.get(label, {})
        rat = []
        for m in ratios:
            if m in r and "eager" in r and r["eager"] > 0:
                x = r[m] / r["eager"]
                rat.append(f"{1 / x:.1f}×" if label.startswith("epoch s") else f"{x:.1f}×")
            else:
                rat.append("")
        print(f"| {label} | " + " | ".join(cells.get(m, "") for m in modes)
              + "".join(f" | {x}" for x in rat) + " |")


if __name__ == "__main__":
    main()
