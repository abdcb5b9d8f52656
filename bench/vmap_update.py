"""R runs' training steps as one computation: the product's update (and with `--step iteration` the whole iteration:
collection, then the updates) under `torch.func.vmap` over the runs' stacked state, against the same with one run
and against one run as the product trains it — how much of R runs' work batching them into the same kernels gets for
the price of one, the step a run-batched study needs (bench/README.md, run_streams.py).

    python3 -m bench.vmap_update --device cuda [--runs 1 2 4 8] [--steps 200] [--preset full]
                                 [--set iterations=1000] [--accel compile+graph] [--bars 300000]
                                 [--kernels fused|reference] [--step update|iteration] [--product]
                                 [--profile TOP]

Every run is a `build_state` of the preset on the same synthetic training split (seeds 0…R−1), trained for a short
warm-up epoch so its replay holds transitions. The batched update, per call (the uniforms of every run drawn into
static tensors first, outside the step, as `StepRunner` draws them):
  schedule  each run's learning rates from its own update counter and knobs (`device_lrs`, vmapped)
  sample    each run's batch from its own replay (`Replay.sample`, vmapped over the runs' stacked replay tensors)
  targets   `make_targets`'s no-grad targets of every run's batch, vmapped over the runs' online and target
            networks
  loss      `make_objective`'s loss of every run, vmapped; one backward pass through their sum gives each run's
            own gradients (tests/test_vmap_runs.py)
  clip      each run's gradients clipped to `grad_clip` by its own norm
  AdamW     the product's `FlatAdamW` over its parameter groups, with a run dimension (`runs=R`: each run's row of
            the flat buffer steps as its own optimizer would, its moments its own)
  target    θ' ← θ' + τ(θ − θ'): one lerp over the stacked target networks' flat buffer, as the product's
  entropy   each run's entropy coefficient adapted to its own batch's atom utilisation (`adapt_entropy_coef`)
  priority  each run's replay priorities and sampling weights from its own TD errors (`Replay.update_priorities`,
            vmapped over the runs' replays: one launch of the priority op for all of them)
The batched collection (`--step iteration`, before the iteration's `updates_per_iter` updates): `TrainEnv.collect`
vmapped over every run's accounts, exploration knobs, acting view table and replay (`BatchedCollect`), so the
updates sample what it wrote.
Each run reads its own update buffers (embedding tables, knobs, hindsight labels, the acting view's table: stacked
and vmapped like the parameters). Each update also advances every run's rolling embedding refresh
(`BatchedRefresh`: encoded before the forward pass, stored after the backward pass, as `train_step` does).
`--kernels fused` (the default) keeps the preset's Triton kernels (fused attention, C51 chain and targets), whose
vmap rules fold the runs' samples into one launch (`services.trainer.run_batch`); `--kernels reference` trains with
`attention=sdpa`, `fused_c51=False`, `fused_targets=False` and the attention written out (`causal_attention_math`,
`last_query_attention_math`: on CUDA, SDPA's memory-efficient backward rejects the strides vmap gives its saved
log-sum-exp, "LSE is not correctly aligned"). R = 1 runs the same code, so the ratio compares like with like;
`--product` adds one run as `tradeloop train` runs it (`StepRunner.iteration` at the device's default accel, timed
over as many steady calls as the vmapped steps; `epoch_per_s` in its JSON: the rate of one `train_epoch` of
`--steps` iterations), the rate a study's runs have today — timed first, in a process that has compiled nothing
else (timed after the vmapped steps' compiles, the same call ran 1 427 kernels an iteration, 355 iterations/s, where
a fresh process runs 403, 920/s: bench/README.md 2026-12-06 · vmap_update.py). Compiled, the vmapped step is traced
at the level of aten ops and that graph compiled (`services.trainer.traced.TracedStep`, as the lockstep engine
does: dynamo cannot trace the vmap, and ran most of it eagerly). The timed step runs in the product's precision
(`in_precision`: bf16 autocast on CUDA with the preset's `bf16`; without it the fused attention ran its IEEE-fp32
path, bench/README.md 2026-12-04), its vmapped linear layers kept in autocast's dtype (`run_batch.AutocastLinear`: vmap
adds their biases after the product, outside autocast, and the fp32 sum reached the attention, bench/README.md
2026-12-05 · 10abaa5). Before timing, each R's batched step is checked against every run's own (`check`: the
largest |Δ| relative to the scale — the loss for the update; every tensor the collection writes for the iteration).
Compiled, the traced step's first compiled call is checked against the step run eagerly, one call each from the
same state (`compiled − eager`: floats relative to their scale; the share of integer elements that differ).
A compiled iteration is traced as the lockstep engine traces it: as one graph or, by default, its collection and its
updates as two (`--set lockstep_graphs=1|2`, `TrainConfig.lockstep_graphs`).
`--profile TOP` (CUDA) prints each timed step's kernel profile (`bench.train_profile.report`) and the product's.
  steps/s     steps (updates or iterations) of all runs together per second; ×1: over R = 1's
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from unittest import mock

import torch

from bench import run_streams
from shared.knobs import Knobs
from shared import layers
from services.trainer.lockstep_step import BATCH_FIELDS, BatchedIteration, BatchedUpdate  # noqa: F401 — the tests'
from services.trainer.lockstep import batched_precision
from services.trainer.loop import train_epoch
from services.trainer.runtime import compile_step
from services.trainer.traced import Sequenced, TracedStep, traced_iteration
from services.trainer.train import TrainConfig
from shared.graphs import capture, resolve_accel


def reference_paths(cfg: TrainConfig) -> None:
    """The preset's Triton kernels off: their reference paths (on any device, the same products)."""
    cfg.attention, cfg.fused_c51, cfg.fused_targets = "sdpa", False, False


def make_states(args, R: int) -> list:
    """R eager states (seeds 0…R−1), with the reference paths of the Triton kernels under `--kernels reference`
    (`run_streams`'s)."""
    configure = reference_paths if args.kernels == "reference" else (lambda cfg: None)
    return run_streams.make_states(args, list(range(R)), accel="eager", configure=configure)


def timed(draw, step, n: int, cuda: bool) -> float:
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        draw()
        step()
    sync()
    return time.perf_counter() - t0


def measure(args, states: list, accel: str, cuda: bool) -> list[dict]:
    """One row per R in `args.runs`: the first R states' batched update, compiled and captured per `accel`."""
    rows = []
    for R in args.runs:
        if args.step == "iteration":
            upd = BatchedIteration(states[:R])
            check = max(upd.col.check(states[:R]), upd.upd.check(states[:R]), upd.upd.refresh.check(states[:R]))
        else:
            upd = BatchedUpdate(states[:R])
            check = max(upd.check(states[:R]), upd.refresh.check(states[:R]))
        # bf16 autocast on CUDA, as the product's steps, with vmap's linear layers kept in it (`AutocastLinear`)
        precise = lambda fn, cfg=upd.cfg: batched_precision(fn, cfg, args.device)  # noqa: E731
        step = precise(upd)
        traced = None
        t0 = time.perf_counter()
        if "compile" in accel:              # as the lockstep engine compiles it: traced, then through inductor
            compiled = lambda graph, cfg=upd.cfg: compile_step(graph, cfg, args.device)  # noqa: E731
            step = traced_iteration(upd, precise, compiled, upd.cfg.lockstep_graphs) if args.step == "iteration" \
                else TracedStep(step, compiled)
            upd.draw()
            step()                                                  # the trace (one step, run for real)
            traced = compiled_difference(upd, step)                 # the compile, checked against the eager step
        upd.draw()
        if "graph" in accel:
            step = capture(step, warmup=3)
        else:
            step()
        first = time.perf_counter() - t0
        wall = timed(upd.draw, step, args.steps, cuda)
        rows.append({"runs": R, "per_s": R * args.steps / wall, "wall_s": wall, "first_s": first,
                     "accel": accel, "kernels": args.kernels, "step": args.step,
                     "graphs": upd.cfg.lockstep_graphs if args.step == "iteration" and "compile" in accel else None,
                     "check": check, "traced": traced})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        if args.profile:
            profile(f"{R} runs' {args.step}, vmapped ({accel})", lambda: (upd.draw(), step()), args.profile)
    return rows


def compiled_difference(upd, step: TracedStep | Sequenced) -> dict:
    """The traced step's compiled call against the step run eagerly, each one call from the same batched state on
    the same uniforms: {"float": the largest |Δ| of a floating tensor relative to its scale, "int": the largest share
    of an integer or boolean tensor's elements that differ (a near-tie decided the other way in a lower precision:
    an action, a sampled row), "float_at"/"int_at": which tensor (`BatchedIteration.tensors`'s name)}. The state is
    left where the compiled call took it."""
    tensors = upd.tensors()
    start = {k: v.detach().clone() for k, v in tensors.items()}

    def restore() -> None:
        with torch.no_grad():
            for k, v in tensors.items():
                v.copy_(start[k])

    step.fn()
    want = {k: v.detach().clone() for k, v in tensors.items()}
    restore()
    step()
    worst = {"float": 0.0, "float_at": None, "int": 0.0, "int_at": None}
    for k, v in tensors.items():
        got, ref = v.detach(), want[k]
        if ref.is_floating_point():
            d = float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1.0))
            kind = "float"
        elif ref.numel():
            d, kind = float((got != ref).float().mean()), "int"
        else:
            continue
        if d > worst[kind]:
            worst[kind], worst[f"{kind}_at"] = d, k
    return worst


def profile(name: str, fn, top: int) -> None:
    """Where a step's GPU time goes (`bench.train_profile.report`: kernels a call, their kinds and streams, the top
    `top` kernels) — to set a vmapped step's kernels beside one product run's."""
    from bench import train_profile

    train_profile.report(name, fn, calls=5, top=top)


def product_rate(args) -> dict:
    """One run as `tradeloop train` trains it (`train_epoch`, the device's default accel, the preset's kernels): its
    iterations per second over `--steps` calls of its own iteration (`StepRunner.iteration`), timed as the vmapped
    steps are, after a warm-up epoch that compiles and captures and one epoch of `--steps` iterations
    (`epoch_per_s`: that epoch's rate, whose fixed costs a short epoch does not amortise)."""
    st = run_streams.make_states(args, [0], accel="auto")[0]
    st.cfg.iterations = args.steps
    stats = train_epoch(st, Knobs())
    wall = timed(lambda: None, st.runner.iteration, args.steps, args.device.startswith("cuda"))
    if args.profile:
        profile(f"one run's iteration, the product's ({st.accel})", st.runner.iteration, args.profile)
    return {"runs": "product", "per_s": args.steps / wall, "wall_s": wall, "first_s": 0.0,
            "epoch_per_s": args.steps / stats.seconds, "accel": st.accel, "kernels": "fused", "step": "iteration",
            "check": 0.0}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=200, help="steps (updates or iterations) of each run timed")
    ap.add_argument("--step", choices=("update", "iteration"), default="update",
                    help="what is batched: the update, or the whole iteration (collection and updates)")
    ap.add_argument("--product", action="store_true",
                    help="also time one run as `tradeloop train` trains it (--step iteration): the ratio that counts")
    ap.add_argument("--warmup", type=int, default=40, help="iterations of each state's warm-up epoch")
    ap.add_argument("--preset", default="full")
    ap.add_argument("--set", action="append", default=None)
    ap.add_argument("--bars", type=int, default=300_000, help="training-split bars")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--accel", default="auto", help="eager, compile, graph or compile+graph (auto: the device's)")
    ap.add_argument("--kernels", choices=("fused", "reference"), default="fused",
                    help="the preset's Triton kernels (vmapped by folding the runs) or their reference paths")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="on CUDA, also print each timed step's GPU profile with its TOP kernels (and the product's)")
    args = ap.parse_args(argv)
    if args.profile and not args.device.startswith("cuda"):
        ap.error("--profile reads CUDA kernels: it needs --device cuda")
    accel = resolve_accel(args.accel, args.device)
    cuda = args.device.startswith("cuda")
    states = make_states(args, max(args.runs))
    short = [i for i, st in enumerate(states) if int(st.replay.valid_row_count()) == 0]
    if short:           # nothing to sample: the update would read unwritten rows (NaN targets, garbage bin indices)
        ap.error(f"--warmup {args.warmup} left the replay of run(s) {short} without a transition whose "
                 f"{max(states[0].cfg.horizons)}-step window is written; give a longer --warmup")
    product = product_rate(args) if args.product else None     # first: before any other step is compiled here
    written_out = mock.patch.object(layers, "written_out_attention", lambda q: True)   # vmap-able SDPA (above)
    with written_out if args.kernels == "reference" else contextlib.nullcontext():
        rows = measure(args, states, accel, cuda)
    if product:
        rows.insert(0, product)
    one = next((r["per_s"] for r in rows if r["runs"] == 1), None)
    prod = next((r["per_s"] for r in rows if r["runs"] == "product"), None)
    print(f"| runs in one vmapped {args.step} | {args.step}s/s (all runs) | ×1 | × the product's run | wall s | "
          "first call s | check | compiled − eager (float / int) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        x = f"{r['per_s'] / one:.2f}" if one else "n/a"
        xp = f"{r['per_s'] / prod:.2f}" if prod else "n/a"
        t = r.get("traced")
        tr = f"{t['float']:.1e} ({t['float_at']}) / {t['int']:.1e} ({t['int_at']})" if t else "n/a"
        print(f"| {r['runs']} | {r['per_s']:.1f} | {x} | {xp} | {r['wall_s']:.2f} | {r['first_s']:.1f} | "
              f"{r['check']:.1e} | {tr} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
