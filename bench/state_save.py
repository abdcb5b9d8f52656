"""What writing an epoch's trainer state costs: the file `save_epoch` writes, with the replay's integers in the
narrowest dtype that holds them (`services.trainer.checkpoint.narrow_ints`, what the trainer writes), against the
same tensors with those integers at int64, side by side on this machine.

    python3 -m bench.state_save [--preset full] [--bars 492860] [--device cpu] [--repeat 3]

The state is the preset's (`build_state` on synthetic bars); its replay is filled with values of a run's ranges (bar
indices over the dataset's bars, each branch's action within its choices, regimes 0–8, random rewards and
priorities), so the narrowing is the one a trained run's state gets. Each write is `save_checkpoint` (host copy,
serialisation, sha256, atomic fsync'd write, sidecar) into a temporary directory; the table gives the median of
`--repeat` writes (the narrowing's own reductions and casts included) and the file's size.
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

from services.trainer.checkpoint import NARROW, _state_meta, _state_tensors, narrow_ints  # noqa: E402
from services.trainer.train import TrainConfig, build_state  # noqa: E402
from shared.checkpoints import save_checkpoint  # noqa: E402
from shared.market import chronological_split, compute_features  # noqa: E402
from shared.synthetic import generate  # noqa: E402


def filled_state(preset: str, n_bars: int, device: str):
    """The preset's training state on `n_bars` synthetic bars, its replay filled with values of a run's ranges."""
    bars = generate(n_bars=n_bars, seed=0).bars
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
    st = filled_state(args.preset, args.bars, args.device)
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


if __name__ == "__main__":
    main()
