"""A machine's yardstick: three fixed workloads timed beside a bench's own rows, so that figures from different
machines of the same kind can be told apart from changes of the code.

Two H200 machines replayed the same update in 1.35 and 1.74 ms, and the eager update ran at 58 on one against
27–31 updates/s on another (bench/README.md, entry 9b933ff). A bench's absolute figures from different runs are
comparable only if the machines were; these three say whether they were:

  GEMM        one 4 096³ matrix product (bf16 on CUDA, fp32 on a CPU at 1 024³): the tensor cores' (or cores') rate
  copy        one device-to-device copy of 256 MiB (a CPU: 64 MiB): memory bandwidth
  launch gap  a CUDA graph of 200 dependent one-element kernels, per kernel: the gap between small kernels that a
              captured update with ~300 of them pays (CUDA only)

    python3 bench/yardstick.py            # alone; bench/train_speed.py and train_profile.py print it in their header
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.gemm_speed import timed  # noqa: E402  (mean µs of a call after warm-up; CUDA events on a GPU)


def measure(dev: torch.device | str) -> dict[str, float]:
    """{"GEMM TFLOP/s", "copy GB/s", "launch gap µs" (CUDA only)} of this machine, now."""
    dev = torch.device(dev)
    cuda = dev.type == "cuda"
    n, dt = (4096, torch.bfloat16) if cuda else (1024, torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dt, generator=g)
    out = {"GEMM TFLOP/s": 2 * n ** 3 / timed(lambda: a @ b, dev, 20 if cuda else 3) / 1e6}
    nbytes = (256 if cuda else 64) * 2 ** 20
    src = torch.empty(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    # a copy reads and writes every byte
    out["copy GB/s"] = 2 * nbytes / timed(lambda: dst.copy_(src), dev, 20 if cuda else 5) / 1e3
    if cuda:
        x = torch.zeros(1, device=dev)

        def chain():
            for _ in range(200):
                x.add_(1.0)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            chain()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        out["launch gap µs"] = timed(graph.replay, dev, 20) / 200
    return out


def line(dev: torch.device | str) -> str:
    """The yardstick as one header line of a bench's output."""
    m = measure(dev)
    parts = [f"GEMM {m['GEMM TFLOP/s']:.0f} TFLOP/s" if m["GEMM TFLOP/s"] >= 10 else
             f"GEMM {m['GEMM TFLOP/s']:.2f} TFLOP/s", f"copy {m['copy GB/s']:,.0f} GB/s"]
    if "launch gap µs" in m:
        parts.append(f"launch gap {m['launch gap µs']:.2f} µs a kernel in a graph")
    return "# yardstick (bench/yardstick.py): " + ", ".join(parts)


if __name__ == "__main__":
    print(line("cuda" if torch.cuda.is_available() else "cpu"))
