"""bench/yardstick.py: the machine's three fixed workloads, here on the CPU (the launch gap needs CUDA)."""
import math

import torch

from bench import yardstick


def test_yardstick_measures_positive_finite_rates_and_prints_them():
    m = yardstick.measure("cpu")
    assert set(m) == {"GEMM TFLOP/s", "copy GB/s"}
    assert all(math.isfinite(v) and v > 0 for v in m.values()), m
    assert 1e-4 < m["GEMM TFLOP/s"] < 100 and 0.1 < m["copy GB/s"] < 10_000      # a CPU's orders of magnitude
    line = yardstick.line("cpu")
    assert line.startswith("# yardstick") and "TFLOP/s" in line and "GB/s" in line and "launch gap" not in line
    if torch.cuda.is_available():
        assert yardstick.measure("cuda")["launch gap µs"] > 0
