"""How much arithmetic one training update is: floating-point operations counted by torch's FlopCounterMode.

    .venv/bin/python bench/update_flops.py                                  # full preset, batches 256 and 4 096
    .venv/bin/python bench/update_flops.py --rates 693 301                  # with measured rates: achieved TFLOP/s

Runs one update eagerly on the CPU (the count is the same on any device up to the CUDA heads' atoms padded to 56)
on a synthetic training split of `--train-bars` bars, whose size sets the rolling refresh's chunk. Counted: matrix
products (mm, addmm, bmm) and attention (dense, as torch counts it on CUDA, though the causal kernels skip the
masked half); element-wise work, reductions, softmaxes and the optimizer are not. Prints per batch: GFLOP per
update by operator, and by network part in the forward passes (attribute names of the online and target networks;
products outside their submodules are the heads' batched weights) with the backward pass as one row; the TFLOP/s
that 1 000 updates/s would take; and with `--rates` (updates/s measured by train_speed.py on the GPU, one per
batch) the TFLOP/s achieved. The default split, 20 000 bars, is train_speed.py's for its updates/s rows.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count  # noqa: E402

from bench.train_speed import fill_for_updates, synthetic_dataset  # noqa: E402
from services.trainer.train import TrainConfig, build_state  # noqa: E402

aten = torch.ops.aten


def _cpu_attention(query, key, value, *args, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_attention_backward(grad_out, query, key, value, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# torch's table names the CUDA attention kernels only; the CPU's flash attention has the same arithmetic
CPU_ATTENTION = {aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward}


def part_of(parents: set[str]) -> str:
    """The network part of the outermost module being run ('online.enc_blocks.0.mlp' → 'online.enc_blocks');
    'outside modules' when none of the two networks' modules is."""
    names = sorted((p for p in parents if p.split(".")[0] in ("online", "target") and "." in p), key=len)
    return ".".join(names[0].split(".")[:2]) if names else "outside modules (the heads' batched weights)"


class PartCounter(FlopCounterMode):
    """FlopCounterMode whose per-module split is by network part in the forward pass and one row for the whole
    backward pass. (Its own split attributes backward FLOPs to every module still on its stack, and a module whose
    input needs no gradient — the IQN's cosine embedding of τ — never leaves it, so parts overlapped.)"""

    def __init__(self, **kwargs) -> None:
        super().__init__(display=False, **kwargs)
        self.parts: dict[str, float] = defaultdict(float)

    def _count_flops(self, func_packet, out, args, kwargs):     # FlopCounterMode's hook for each counted op
        if func_packet in self.flop_registry:
            n = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            self.flop_counts["Global"][func_packet] += n
            tracker = self.mod_tracker
            self.parts["backward (all parts)" if tracker.is_bw else part_of(set(tracker.parents))] += n
        return out


def count_update(cfg: TrainConfig, batch: int, train_bars: int) -> tuple[float, dict[str, float], dict[str, float]]:
    """(total FLOP, FLOP by operator, FLOP by network part) of one update at `batch` after a warm-up update."""
    bars, split, feats = synthetic_dataset(train_bars)
    cfg.batch_size, cfg.n_envs = batch, 256
    st = build_state(cfg, bars, split, 0, "cpu", features=feats, accel="eager")
    st.env.reset_all()
    fill_for_updates(st)
    st.runner.update()
    counter = PartCounter(custom_mapping=CPU_ATTENTION)
    for net, model in (("online", st.agent), ("target", st.target)):   # modules by attribute path, not class name
        for name, mod in model.named_modules():
            counter.mod_tracker._known_modules[mod] = f"{net}.{name}" if name else net
    with counter:
        st.runner.update()
    by_op = {str(op).replace("aten.", ""): float(f) for op, f in counter.flop_counts["Global"].items()}
    return float(counter.get_total_flops()), by_op, dict(counter.parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="full", choices=["small", "full"])
    ap.add_argument("--batches", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--train-bars", type=int, default=20_000, help="training split (sets the refresh's chunk)")
    ap.add_argument("--rates", type=float, nargs="*", default=[],
                    help="measured updates/s, one per batch (train_speed.py on the GPU): adds achieved TFLOP/s")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="override preset fields")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.rates and len(a.rates) != len(a.batches):
        ap.error(f"--rates: {len(a.rates)} given for {len(a.batches)} batches")
    if a.threads:
        torch.set_num_threads(a.threads)
    feats = synthetic_dataset(2_000)[2]
    print(f"# update_flops: config={a.config} set={a.set} train bars≈{a.train_bars:,} torch={torch.__version__}")
    rows = []
    for b in a.batches:
        cfg = TrainConfig.preset(a.config, feats.shape[1]).override(a.set)
        t0 = time.perf_counter()
        total, by_op, by_part = count_update(cfg, b, a.train_bars)
        print(f"\n## batch {b}: {total / 1e9:.1f} GFLOP per update ({time.perf_counter() - t0:.0f} s)")
        print("\n| operator | GFLOP | share |\n|---|---:|---:|")
        for op, f in sorted(by_op.items(), key=lambda kv: -kv[1]):
            print(f"| {op} | {f / 1e9:.2f} | {f / total:.0%} |")
        print("\n| network part | GFLOP | share |\n|---|---:|---:|")
        for part, f in sorted(by_part.items(), key=lambda kv: -kv[1]):
            if f > 0:
                print(f"| {part} | {f / 1e9:.2f} | {f / total:.0%} |")
        rows.append((b, total))
    print("\n| batch | GFLOP per update | TFLOP/s at 1 000 updates/s |" + (" measured updates/s | TFLOP/s achieved |"
                                                                        if a.rates else ""))
    print("|---:|---:|---:|" + ("---:|---:|" if a.rates else ""))
    for i, (b, total) in enumerate(rows):
        extra = f" {a.rates[i]:g} | {total * a.rates[i] / 1e12:.1f} |" if a.rates else ""
        print(f"| {b} | {total / 1e9:.1f} | {total * 1000 / 1e12:.0f} |" + extra)


if __name__ == "__main__":
    main()
