"""Does a green context's stream hold work to its SMs, eagerly and as a CUDA graph (`services.trainer.sm_partition`)?

    TL_ITERATION_SMS=16 python3 -m bench.sm_partition_probe [--n 2048] [--reps 40]

Times `reps` bf16 matmuls of n × n on the default stream (the whole GPU) and on the partition's stream, eagerly, as a
graph captured on the partition's stream, as a graph captured on an ordinary stream and replayed on the partition's,
and as a graph whose work forks to another of the partition's streams. Held to s of S SMs, compute-bound work takes
about S / s times as long. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from services.trainer.sm_partition import ENV_SMS, make_partition, partition_streams


def timed(fn, stream, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        stream.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()                        # the green context's stream: a device sync may not wait for it
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    dev = torch.device("cuda")
    a = torch.randn(args.n, args.n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(args.n, args.n, device=dev, dtype=torch.bfloat16)
    out = {"sms_asked": int(os.environ.get(ENV_SMS, "0") or 0), "device_sms":
           torch.cuda.get_device_properties(dev).multi_processor_count, "torch": torch.__version__}

    def work():
        for _ in range(args.reps):
            torch.mm(a, b, out=c)

    c = torch.empty_like(a)
    streams = partition_streams(dev, 2)
    main_s = torch.cuda.current_stream()
    out["whole_eager_s"] = timed(work, main_s)
    if not streams:
        out["partition"] = None
        print(json.dumps(out))
        return
    part, side = streams
    out["partitions"] = {str(k): make_partition(0, out["sms_asked"], k)[1:] for k in range(2)}
    out["part_eager_s"] = timed(work, part)
    g = torch.cuda.CUDAGraph()
    part.wait_stream(main_s)
    with torch.cuda.graph(g, stream=part):
        work()
    out["graph_on_part_s"] = timed(g.replay, part)
    out["graph_on_part_replayed_whole_s"] = timed(g.replay, main_s)
    g2, plain = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.graph(g2, stream=plain):
        work()
    out["graph_plain_replayed_on_part_s"] = timed(g2.replay, part)
    out["graph_plain_replayed_whole_s"] = timed(g2.replay, main_s)

    def forked():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(args.reps // 2):
                torch.mm(b, a, out=d)
        for _ in range(args.reps // 2):
            torch.mm(a, b, out=c)
        torch.cuda.current_stream().wait_stream(side)

    d = torch.empty_like(a)
    g3 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g3, stream=part):
        forked()
    out["graph_forked_on_part_s"] = timed(g3.replay, part)
    out["whole_forked_eager_s"] = timed(forked, main_s)
    ok = torch.allclose(c.float(), (a.float() @ b.float()), rtol=0.05, atol=2.0)
    out["result_ok"] = bool(ok)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
