"""Evaluator speed: validation bars per second of the evaluator's passes (`services.evaluator.runner`), per `accel` mode.

    .venv/bin/python -m bench.eval_speed [--bars 100000 1000000] [--accounts 1 64 1024] [--device cpu|cuda]
                                         [--accel eager graph compile+graph] [--config small|full]
                                         [--max-steps N | MODE=N ...] [--graph-chunk C] [--threads N]

A random agent of the trainer's `small` (default) or `full` preset shape runs greedy over a validation window of
`--bars` synthetic bars; `--accounts` B runs B windows of that length at once (checkpoints × folds share the
sequential pass as accounts of one simulator). Every mode of `--accel` (`shared.rollout.greedy_pass`: eager,
compile, graph, compile+graph; native — the sequential part as one compiled CPU loop, `shared.native`) is measured
on the same data in the same run, one column group per mode:
  encode_s   the batched part alone: the market encoder and `Agent.view_table` (every head that does not read the
             portfolio) over every bar of the `--bars` span (once per row, all modes)
  step_s     `runner.window_passes` end to end (= `run_windows` without wrapping its arrays in the report's
             dataclasses, so no pydantic is needed): its own encoder and view over the span its windows cover, the
             sequential pass (portfolio shift + policy + simulator, bar by bar), the ledger and the post hoc
             predictions — the whole evaluation of those windows, inference included
  bars/s     B × bars / step_s   — account-bars evaluated per second
A compiled mode first runs the same call once untimed (the compilation; native: a 300-bar pass, the C build,
cached); its seconds are listed below the table, as is the error of a mode that fails.
`--checkpoints K` adds a second table: K random agents of the preset (different seeds) over the same windows,
timed as K separate `window_passes` calls (one per checkpoint) and as one `window_passes_many` (the K checkpoints'
view tables, then ONE sequential pass of all K·B accounts on the native loop; the torch modes run one pass per
checkpoint there), side by side per mode of `--accel`, with `--max-steps` applied alike:
  sep_s      the K separate evaluations end to end
  batch_s    the one batched evaluation end to end (`passes`: sequential passes it ran)
  pass_sep / pass_batch   the sequential part alone, on the K view tables computed beforehand: K `greedy_pass`
             calls vs one `greedy_pass_many` (ledger and records included, no encoder, no post hoc predictions)
`--max-steps N` cuts the windows to N + 1 bars for the sequential part (`MODE=N` for one mode only, e.g.
`--max-steps 2000 graph=20000`) while the encoder still runs over all `--bars` bars; the column then shows the
steps measured and bars/s is B × (N + 1) / (encode_s·(N + 1)/bars + step_s): the rate of a full run
extrapolated from the measured cost per step. That cost includes the fixed costs of the pass (a graph mode's
warm-up chunk, capture and eager tail), so the extrapolation understates a graph mode's full-run rate; give
graph modes enough steps for those to be small.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch

from services.evaluator.runner import window_passes, window_passes_many
from shared.agent import Agent, PolicyControls
from shared.market import compute_features
from shared.graphs import ACCEL_MODES
from shared.rollout import MarketTensors, greedy_pass, greedy_pass_many, market_view, market_views
from shared.synthetic import generate

# as many quantile levels as the report's TAUS (importing shared.report needs pydantic, absent on GPU hosts)
TAUS = tuple(np.linspace(0.05, 0.95, 5))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _max_steps(items: list[str], modes: list[str]) -> dict[str, int | None]:
    """`--max-steps` items ("N" for every mode, "MODE=N" for one) → per mode steps (None = the whole window)."""
    out: dict[str, int | None] = {m: None for m in modes}
    for it in items:
        mode, _, n = it.rpartition("=")
        for m in ([mode] if mode else modes):
            if m not in out:
                raise SystemExit(f"--max-steps {it}: {m} is not one of --accel {' '.join(modes)}")
            if mode or out[m] is None:
                out[m] = int(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bars", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--accounts", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--accel", nargs="+", default=["eager"], choices=ACCEL_MODES + ("native",))
    ap.add_argument("--config", default="small", choices=["small", "full"])
    ap.add_argument("--max-steps", nargs="+", default=[], metavar="N|MODE=N")
    ap.add_argument("--graph-chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--bf16-encoder", action="store_true", help="the batched encoder under bf16 autocast (CUDA)")
    ap.add_argument("--checkpoints", type=int, default=0, metavar="K",
                    help="also time K checkpoints: K separate evaluations vs one batched pass (second table)")
    ap.add_argument("--profile", action="store_true",
                    help="print where the timed calls spent their time (cProfile, top 25 by cumulative time)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    steps = _max_steps(a.max_steps, a.accel)
    from services.trainer.train import TrainConfig  # only to take the preset's shape (bench, not the library)

    print(f"device={dev} config={a.config} threads={torch.get_num_threads()} graph_chunk={a.graph_chunk} "
          f"max_steps: {' '.join(f'{m}={s}' for m, s in steps.items())}")
    head = f"{'bars':>9} {'accounts':>8} {'encode_s':>9}"
    for m in a.accel:
        head += f" | {m + ' steps':>19} {'step_s':>8} {'bars/s':>10}"
    print(head)
    notes = []
    agent = None
    for n in a.bars:
        bars = generate(n_bars=n + 200, seed=0).bars
        feats = compute_features(bars)
        if agent is None:  # one agent for every row: a compiled step is reused, not recompiled per agent
            cfg = TrainConfig.preset(a.config, feats.shape[1]).agent
            torch.manual_seed(0)
            agent = Agent(cfg).to(dev).eval()
        span = (200, 200 + n)
        for B in a.accounts:
            with torch.no_grad():
                m = MarketTensors.from_bars(bars, *span, agent.cfg.window, dev, features=feats)
                market_view(agent, m.windows[:4096], bf16_encoder=a.bf16_encoder)  # warm-up (cuBLAS, allocator)
                _sync(dev)
                t0 = time.perf_counter()
                market_view(agent, m.windows, bf16_encoder=a.bf16_encoder)
                _sync(dev)
            enc = time.perf_counter() - t0
            line = f"{n:>9} {B:>8} {enc:>9.2f}"
            for mode in a.accel:
                L = n if steps[mode] is None else min(n, steps[mode] + 1)
                # B windows of L bars; the encoder covers the full n-bar span as it would in a real run
                starts = np.linspace(200, 200 + n - L, B).astype(int) if B > 1 else np.array([200])
                wins = [(int(s), int(s) + L) for s in starts]
                run = lambda: window_passes(agent, bars, wins, taus=TAUS, features=feats, device=dev,  # noqa: E731
                                            accel=mode, graph_chunk=a.graph_chunk, bf16_encoder=a.bf16_encoder)
                try:
                    if "compile" in mode or mode == "native":
                        t0 = time.perf_counter()
                        if mode == "native":              # the C build: a short pass builds it
                            window_passes(agent, bars, [(w0, w0 + min(L, 300)) for w0, _ in wins], taus=TAUS,
                                          features=feats, device=dev, accel=mode)
                        else:
                            run()
                        _sync(dev)
                        notes.append(f"{n} bars, {B} accounts, {mode}: untimed first call "
                                     f"{time.perf_counter() - t0:.1f} s")
                    _sync(dev)
                    prof = cProfile.Profile() if a.profile else None
                    t0 = time.perf_counter()
                    if prof:
                        prof.enable()
                    run()
                    _sync(dev)
                    if prof:
                        prof.disable()
                        out = io.StringIO()
                        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
                        notes.append(f"{n} bars, {B} accounts, {mode}: profile\n" + out.getvalue())
                except Exception as exc:  # noqa: BLE001  one failing mode must not cost the other columns
                    notes.append(f"{n} bars, {B} accounts, {mode}: FAILED {type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''}")
                    line += f" | {'failed':>19} {'-':>8} {'-':>10}"
                    continue
                # step_s is the whole evaluation of the windows (its own encoder and view over the span they
                # cover included); a cut pass adds the encoder share of the bars it skipped
                step = time.perf_counter() - t0
                rate = B * L / (step + (enc * (n - L) / n if L < n else 0.0))
                line += f" | {L - 1:>19} {step:>8.2f} {rate:>10.0f}"
            print(line, flush=True)
    if a.checkpoints > 0:
        _checkpoint_table(a, dev, steps, TrainConfig)
    for note in notes:
        print("# " + note)


def _checkpoint_table(a, dev: torch.device, steps: dict[str, int | None], TrainConfig) -> None:
    """K checkpoints: K separate `window_passes` vs one `window_passes_many`, per row and mode (same windows)."""
    K = a.checkpoints
    print(f"\n{K} checkpoints: K separate evaluations vs one batched pass (window_passes vs window_passes_many)")
    head = f"{'bars':>9} {'accounts':>8} {'K':>3}"
    for m in a.accel:
        head += (f" | {m + ' steps':>17} {'sep_s':>8} {'batch_s':>8} {'passes':>6} {'speedup':>7}"
                 f" {'pass_sep':>8} {'pass_batch':>10} {'speedup':>7}")
    print(head)
    for n in a.bars:
        bars = generate(n_bars=n + 200, seed=0).bars
        feats = compute_features(bars)
        cfg = TrainConfig.preset(a.config, feats.shape[1]).agent
        agents = []
        for k in range(K):
            torch.manual_seed(k)
            agents.append(Agent(cfg).to(dev).eval())
        for B in a.accounts:
            line = f"{n:>9} {B:>8} {K:>3}"
            for mode in a.accel:
                L = n if steps[mode] is None else min(n, steps[mode] + 1)
                starts = np.linspace(200, 200 + n - L, B).astype(int) if B > 1 else np.array([200])
                wins = [(int(s), int(s) + L) for s in starts]
                kw = dict(taus=TAUS, features=feats, device=dev, accel=mode, graph_chunk=a.graph_chunk,
                          bf16_encoder=a.bf16_encoder)
                window_passes_many(agents, bars, [(w0, w0 + min(L, 300)) for w0, _ in wins], **kw)  # build, warm up
                _sync(dev)
                t0 = time.perf_counter()
                for ag in agents:
                    window_passes(ag, bars, wins, **kw)
                _sync(dev)
                sep = time.perf_counter() - t0
                t0 = time.perf_counter()
                runs = window_passes_many(agents, bars, wins, **kw)
                _sync(dev)
                bat = time.perf_counter() - t0
                passes = K // runs[0][0]["agents_in_pass"]
                # the sequential part alone, on view tables computed beforehand
                lo = int(starts.min())
                market = MarketTensors.from_bars(bars, lo, int(starts.max()) + L, cfg.window, dev, features=feats)
                views = [v for _, v in market_views(agents, market.windows, bf16_encoder=a.bf16_encoder)]
                st = torch.as_tensor(starts - lo, device=dev)
                ctl = PolicyControls.make(dev)
                _sync(dev)
                t0 = time.perf_counter()
                for ag, v in zip(agents, views):
                    greedy_pass(ag, market, v, st, L, ctl, accel=mode, chunk=a.graph_chunk)
                _sync(dev)
                p_sep = time.perf_counter() - t0
                t0 = time.perf_counter()
                greedy_pass_many(agents, market, views, st, L, ctl, accel=mode, chunk=a.graph_chunk)
                _sync(dev)
                p_bat = time.perf_counter() - t0
                line += (f" | {L - 1:>17} {sep:>8.2f} {bat:>8.2f} {passes:>6} {sep / bat:>6.2f}x"
                         f" {p_sep:>8.2f} {p_bat:>10.2f} {p_sep / p_bat:>6.2f}x")
            print(line, flush=True)


if __name__ == "__main__":
    main()
