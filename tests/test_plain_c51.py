"""bench/plain_c51.py, the reference's plain branching-C51 update: it learns (the loss on a batch it trains on
falls), and the bench's table prints (its GPU figures come from the device machine)."""
import subprocess
import sys
from pathlib import Path

import torch

from bench.plain_c51 import Plain

ROOT = Path(__file__).resolve().parents[1]


def test_the_plain_update_learns_its_batch():
    p = Plain(64, torch.device("cpu"), n_in=32, hidden=32, atoms=11, pool=256, v_max=2.0, lr=3e-3)
    p.idx.copy_(torch.arange(64))
    p.done.fill_(1.0)               # terminal: each target is its reward projected on two atoms (entropy ≤ ln 2)
    first = p.step().item()
    for _ in range(100):
        last = p.step().item()
    assert first > 2.0 and last < 1.0, (first, last)
    assert all(torch.isfinite(t).all() for t in p.net.parameters())


def test_the_bench_prints_its_table():
    out = subprocess.run([sys.executable, "bench/plain_c51.py", "--device", "cpu", "--modes", "eager", "compile",
                          "--batches", "32", "--updates", "3", "--pool", "512"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| 32 |"))
    gflop, eager, compiled, ratio = (c.strip() for c in row.strip("|").split("|")[1:])
    assert float(eager) > 0 and float(compiled) > 0 and ratio.endswith("×")
    # batch 32: 2·32·(1024·256 + 256·256 + 256·408) multiply-adds forward, ×3 with backward, + the target's forward
    assert 0.08 < float(gflop) < 0.12, gflop
