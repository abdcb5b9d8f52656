"""bench/train_speed.py's row "as `tradeloop train` runs it" runs on a CPU with tiny settings (the GPU figures come
from the GPU machine): the product's own path (`tradeloop.cmd_train.run_training`, `--accel auto`) timed per epoch,
in the table beside the bench's rows."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_product_row_runs_tradeloop_train_beside_the_bench_rows(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "bench/train_speed.py", "--device", "cpu", "--config", "small", "--modes",
                        "eager", "--batches", "32", "--envs", "8", "--epoch-bars", "0", "--updates", "2",
                        "--collects", "2", "--threads", "1", "--product-set", "iterations=6", "learning_starts=64",
                        "batch_size=32", "n_envs=8"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    assert ("as `tradeloop train --dataset synthetic --config small --device cpu --epochs 2 (preset with "
            "iterations=6 learning_starts=64 batch_size=32 n_envs=8)` runs it: --accel auto → eager; torch.compile "
            f"cache cold ({tmp_path / 'tradeloop' / 'inductor'})") in out
    assert re.search(r"epoch 1: [\d.]+ s \(compile 0\.0 s\), [\d,.]+ updates/s", out)
    row = re.search(r"^\| `tradeloop train` updates/s, epoch 2 \(batch 32\) \| ([\d,.]+) \|$", out, re.M)
    assert row and float(row.group(1).replace(",", "")) > 0, out
    assert re.search(r"^\| updates/s @ batch 32 \| [\d,.]+ \|$", out, re.M)
    assert re.search(r"^\| `tradeloop train` epoch 1 / 2 s \(compile s\) \| [\d.]+ / [\d.]+ \(0\.0, cold cache\) \|$",
                     out, re.M)
