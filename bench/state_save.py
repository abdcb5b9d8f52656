"""What writing an epoch's trainer state costs: the file `save_epoch` writes, with the replay's integers in the
narrowest dtype that holds them (`services.trainer.checkpoint.narrow_ints`, what the trainer writes), against the
same tensors with those integers at int64, side by side on this machine.

    python3 -m bench.state_save [--preset full] [--bars 492860] [--device cpu] [--repeat 3]

The state is the preset's (`build_state` on synthetic bars); its replay is filled with values of a run's ranges (bar
indices over the dataset's bars, each branch's action within its choices, regimes 0–8, random rewards and
priorities), so the narrowing is the one a trained run's state gets. Each write is `save_checkpoint` (host copy,
serialisation, sha256, atomic fsync'd write, sidecar) into a temporary directory; the table gives the median of
`--repeat` writes (the narrowing's own reductions and casts included) and the file's size.

A second table, an epoch's close as a study's loop runs it: both checkpoint files, then the validation backtest of
the weights (`evaluate_checkpoint` as `tradeloop.study.loop` calls it), against `train_run`'s order — the weights'
file, the backtest while the trainer state is written on a thread (`start_save_epoch`), then the wait for it. Each
the median of `--repeat` after one close untimed (the evaluator's first call), side by side in one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from services.evaluator.runner import evaluate_checkpoint  # noqa: E402
from services.trainer.checkpoint import (NARROW, _state_meta, _state_tensors, narrow_ints, save_epoch,  # noqa: E402
                                         start_save_epoch)
from services.trainer.train import TrainConfig, build_state  # noqa: E402
from shared.checkpoints import save_checkpoint  # noqa: E402
from shared.market import chronological_split, compute_features  # noqa: E402
from shared.synthetic import generate  # noqa: E402


def filled_state(preset: str, n_bars: int, device: str, bars=None):
    """The preset's training state on `n_bars` synthetic bars (or `bars`), its replay filled with values of a run's
    ranges."""
    bars = generate(n_bars=n_bars, seed=0).bars if bars is None else bars
    feats = compute_features(bars)
    cfg = TrainConfig.preset(preset, feats.shape[1])
    st = build_state(cfg, bars, chronological_split(len(bars)), 0, device, features=feats, accel="eager")
    rp, g = st.replay, torch.Generator(device=st.device).manual_seed(0)
    rp.bar.random_(0, n_bars, generator=g)
    for b, n in enumerate(cfg.agent.branch_sizes):
        rp.action[..., b].random_(0, n, generator=g)
    rp.regime.random_(0, 9, generator=g)
    rp.reward.normal_(generator=g)
    rp.priority.uniform_(generator=g)
    rp.count_t.fill_(rp.L)
    return st


def timed_writes(build, meta: dict, repeat: int) -> tuple[float, int]:
    """(median seconds of `repeat` times building the tensors with `build()` and writing them, the file's bytes)."""
    times = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "epoch-0001.state.safetensors"
        for _ in range(repeat):
            t0 = time.perf_counter()
            save_checkpoint(path, build(), meta)
            times.append(time.perf_counter() - t0)
        size = path.stat().st_size
    return statistics.median(times), size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="full")
    ap.add_argument("--bars", type=int, default=492_860)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    bars = generate(n_bars=args.bars, seed=0).bars
    st = filled_state(args.preset, args.bars, args.device, bars)
    meta = {"kind": "trainer_state", **_state_meta(st)}
    rest = {k: v for k, v in _state_tensors(st).items() if not k.startswith("replay.")}   # the same either way
    replay = st.replay.state_tensors()
    wide = lambda: {**rest, **{f"replay.{k}": v.contiguous() for k, v in replay.items()}}  # noqa: E731
    narrow = lambda: {**rest, **{f"replay.{k}": narrow_ints(v.contiguous()) for k, v in replay.items()}}  # noqa: E731
    rows = [("int64 (as held)", *timed_writes(wide, meta, args.repeat)),
            ("narrowed (as written)", *timed_writes(narrow, meta, args.repeat))]
    kinds = ", ".join(f"{k[len('replay.'):]} {str(v.dtype).replace('torch.', '')}" for k, v in narrow().items()
                      if k.startswith("replay.") and v.dtype in NARROW)
    print(f"`python3 -m bench.state_save --preset {args.preset} --bars {args.bars} --device {args.device} "
          f"--repeat {args.repeat}` (replay integers written as: {kinds})\n")
    print("| replay integers | write s (median) | × | file MB |")
    print("|---|---|---|---|")
    for name, s, size in rows:
        print(f"| {name} | {s:.3f} | {rows[0][1] / s:.2f} | {size / 1e6:.1f} |")
    closes = epoch_closes(st, bars, args.repeat)
    print("\n| an epoch's close | seconds (median) | × | the validation backtest s |")
    print("|---|---|---|---|")
    for name, (s, ev) in closes.items():
        print(f"| {name} | {s:.3f} | {closes['written, then the backtest'][0] / s:.2f} | {ev:.3f} |")


def epoch_closes(st, bars, repeat: int) -> dict[str, tuple[float, float]]:
    """{way: (median seconds of the close, median seconds of its backtest)}: both files then the validation backtest
    (`save_epoch`, `evaluate_checkpoint`), and the backtest while the state is written (`start_save_epoch`)."""
    split, feats = chronological_split(len(bars)), compute_features(bars)
    st.epoch = 1

    def backtest(path: Path) -> float:
        t0 = time.perf_counter()
        evaluate_checkpoint(path, expected_sha256=None, bars=bars, split=split, run_id="bench", epoch=1,
                            device=st.device, oos=False, features=feats)
        return time.perf_counter() - t0

    def sequential(d: Path) -> float:
        path, _ = save_epoch(st, d, {})
        return backtest(path)

    def overlapped(d: Path) -> float:
        path, _, write = start_save_epoch(st, d, {})
        ev = backtest(path)
        write.wait()
        return ev

    with tempfile.TemporaryDirectory() as d:     # the evaluator's first call builds what later calls reuse
        sequential(Path(d))
    out = {}
    for name, close in (("written, then the backtest", sequential), ("the backtest while the state is written",
                                                                     overlapped)):
        times, evals = [], []
        for _ in range(repeat):
            with tempfile.TemporaryDirectory() as d:
                t0 = time.perf_counter()
                evals.append(close(Path(d)))
                times.append(time.perf_counter() - t0)
        out[name] = (statistics.median(times), statistics.median(evals))
    return out


if __name__ == "__main__":
    main()
