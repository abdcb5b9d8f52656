"""Bus latency and throughput: XADD → handler → XACK for one Python consumer on loopback.

  .venv/bin/python bench/bus_latency.py [--rate 1000] [--seconds 10] [--burst 50000] [--count 32]

Latency: a publisher *process* XADDs events at a fixed rate (sync redis-py); each event carries the
CLOCK_MONOTONIC time (system-wide on Linux) taken just before its XADD. The consumer (shared.bus.Consumer,
asyncio, same code as the services) records now − t0 right after the XACK returned. Throughput: the
stream is pre-filled with `--burst` events, then one consumer drains it (run_burst) and we divide.
Against the embedded server (AOF, its default fsync policy or `--appendfsync`) unless REDIS_URL is set. Prints a markdown table.
Goal: p99 ≤ 1 ms at 1 000 msg/s; ≥ 10 000 msg/s per consumer.
"""
from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared.bus import Bus, Consumer  # noqa: E402
from shared.events import CheckpointPublished, encode_event, stream_name  # noqa: E402
from shared.redis_server import EmbeddedRedis  # noqa: E402

RUN = "bench"


def make_fields(epoch: int, t0_ns: int) -> dict[str, str]:
    e = CheckpointPublished(run_id=RUN, epoch=epoch, checkpoint_id=str(t0_ns), sha256="ab" * 32,
                            key=f"tl:{RUN}:ckpt:{epoch}", size_bytes=1, config_hash="bench")
    return encode_event(e)


def publisher(url: str, stream: str, rate: float, n: int, start_ns: int) -> None:
    """Publish n events at `rate` per second (absolute schedule, so no drift), from its own process."""
    client = redis.Redis.from_url(url)
    period_ns = int(1e9 / rate)
    template = make_fields(0, 0)["data"]
    for i in range(n):
        due = start_ns + i * period_ns
        while (now := time.monotonic_ns()) < due:
            if due - now > 200_000:
                time.sleep((due - now - 150_000) / 1e9)
        t0 = time.monotonic_ns()
        # same bytes as encode_event would give, with t0 in checkpoint_id (avoids pydantic cost in the pacer)
        client.xadd(stream, {"data": template.replace('"checkpoint_id":"0"', f'"checkpoint_id":"{t0}"')
                                              .replace('"epoch":0', f'"epoch":{i}')})
    client.close()


class TimedConsumer(Consumer):
    """Records monotonic time after each XACK for the latency run."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.t0: dict[str, int] = {}
        self.lat_ns: list[int] = []

    async def _ack_many(self, entry_ids):
        await super()._ack_many(entry_ids)
        now = time.monotonic_ns()
        for eid in entry_ids:
            t0 = self.t0.pop(eid, None)
            if t0 is not None:
                self.lat_ns.append(now - t0)


async def latency_run(url: str, rate: float, seconds: float, count: int) -> dict:
    n = int(rate * seconds)
    async with Bus(url, RUN) as bus:
        stream = stream_name(RUN, "checkpoints")
        await bus.redis.delete(stream)
        holder: dict = {}

        async def handler(ev):
            holder["c"].t0[holder["id"]] = int(ev.checkpoint_id)

        c = TimedConsumer(bus, stream, "g", "c1", handler, block_ms=500, count=count)
        holder["c"] = c
        # the handler needs the entry id: wrap _handle to expose it
        orig = c._handle

        async def _handle(entry_id, fields, deliveries):
            holder["id"] = entry_id
            return await orig(entry_id, fields, deliveries)

        c._handle = _handle
        await bus.ensure_group(stream, "g")
        task = asyncio.create_task(c.run())
        start_ns = time.monotonic_ns() + 300_000_000
        proc = mp.get_context("spawn").Process(target=publisher, args=(url, stream, rate, n, start_ns))
        proc.start()
        deadline = time.monotonic() + seconds + 30
        while len(c.lat_ns) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        c.stop()
        await task
        proc.join()
        lat_ms = sorted(x / 1e6 for x in c.lat_ns[int(0.05 * len(c.lat_ns)):])  # drop 5 % warm-up
        if not lat_ms:
            raise SystemExit("no message came through: is the consumer running?")
        return {"n": len(c.lat_ns), "p50": percentile(lat_ms, 50), "p99": percentile(lat_ms, 99),
                "p999": percentile(lat_ms, 99.9), "max": lat_ms[-1]}


def percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted data: the smallest x with at least q % of the data ≤ x."""
    k = max(0, math.ceil(q / 100 * len(sorted_xs)) - 1)
    return sorted_xs[k]


async def throughput_run(url: str, n: int, count: int) -> dict:
    async with Bus(url, RUN) as bus:
        stream = stream_name(RUN, "reports")
        await bus.redis.delete(stream)
        await bus.ensure_group(stream, "g")
        fields = make_fields(0, 0)
        for i in range(0, n, 1000):
            async with bus.redis.pipeline(transaction=False) as pipe:
                for _ in range(min(1000, n - i)):
                    pipe.xadd(stream, fields)
                await pipe.execute()
        seen = 0

        async def handler(ev):
            nonlocal seen
            seen += 1

        c = Consumer(bus, stream, "g", "c1", handler, count=count)
        t = time.perf_counter()
        await c.run_burst()
        dt = time.perf_counter() - t
        assert seen == n and c.stats.processed == n, (seen, c.stats)
        return {"n": n, "seconds": dt, "rate": n / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=1000.0, help="publish rate of the latency run (msg/s)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of the latency run")
    ap.add_argument("--burst", type=int, default=50_000, help="messages of the throughput run")
    ap.add_argument("--count", type=int, default=32, help="XREADGROUP COUNT of the consumer")
    ap.add_argument("--appendfsync", default=None, choices=["always", "everysec"],
                    help="the embedded server's AOF fsync policy (default: EmbeddedRedis's)")
    args = ap.parse_args()
    url = os.environ.get("REDIS_URL")
    server = None
    if not url:
        kw = {"appendfsync": args.appendfsync} if args.appendfsync else {}
        server = EmbeddedRedis(tempfile.mkdtemp(prefix="tl-bench-redis-"), **kw).start()
        url = server.url
    try:
        lat = asyncio.run(latency_run(url, args.rate, args.seconds, args.count))
        thr = asyncio.run(throughput_run(url, args.burst, args.count))
    finally:
        if server:
            server.stop()
    where = f"embedded Redis {server.version} (AOF {server.appendfsync})" if server else "REDIS_URL"
    from redis.utils import HIREDIS_AVAILABLE
    where += ", hiredis parser" if HIREDIS_AVAILABLE else ", pure-Python RESP parser"
    print(f"\nbus latency/throughput — {where}, Python {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"XREADGROUP COUNT {args.count}\n")
    print("| measure | value | goal |")
    print("|---|---|---|")
    print(f"| latency p50 @ {args.rate:.0f} msg/s ({lat['n']} msgs) | {lat['p50']:.3f} ms | |")
    print(f"| latency p99 @ {args.rate:.0f} msg/s | {lat['p99']:.3f} ms | ≤ 1 ms |")
    print(f"| latency p99.9 @ {args.rate:.0f} msg/s | {lat['p999']:.3f} ms | |")
    print(f"| latency max @ {args.rate:.0f} msg/s | {lat['max']:.3f} ms | |")
    print(f"| throughput, one consumer ({thr['n']} msgs in {thr['seconds']:.2f} s) | {thr['rate']:,.0f} msg/s "
          f"| ≥ 10 000 msg/s |")


if __name__ == "__main__":
    main()
