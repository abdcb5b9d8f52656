"""Loop latency per stage: checkpoint published → report stored → bundle stored → knobs applied by the trainer.

Runs `tradeloop up` (embedded Redis, tiny CPU config unless told otherwise) as a subprocess, then reopens the
run's Redis (its AOF) and reads the events' `created_at` and the trainer's `knobs_applied_at`:

  evaluate  = eval.completed.created_at   − checkpoint.published.created_at   (queue + load + backtests + store)
  feedback  = feedback.ready.created_at   − eval.completed.created_at         (queue + E1–E9 + store)
  apply     = epoch e+1 knobs_applied_at  − feedback.ready.created_at         (trainer's wait → apply)
  total     = epoch e+1 knobs_applied_at  − checkpoint.published.created_at
  wait      = how long the trainer waited for bundle e before epoch e+1 (its `feedback_wait_s`)
  wait %    = wait / the trainer's epoch time (the goal: < 5 %)

`--feedback-mode overlap` (the trainer's TL_FEEDBACK_MODE): epoch e+1 starts at once and applies bundle e at the
first iteration boundary after it is stored; `apply` then ends at that application (`bundles_applied` of the
epoch records), `at it` is that iteration, and `wait` is what the trainer waited for bundle e after epoch e+1
(only when evaluation + feedback outlast a whole epoch).

    .venv/bin/python bench/loop_latency.py [--epochs 3] [--data-bars 1000 | --val-bars 100000] [--iterations 6]
                                           [--evaluators 1] [--device cpu|cuda] [--full-size]
                                           [--feedback-mode sync|overlap] [--config small|full]

`--val-bars N` sizes the synthetic dataset so that its validation split holds about N bars (the evaluator's
continuous pass covers that many bars, plus as many out of sample and an in-sample window).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

import redis

from shared.api import trainer_history_key
from shared.redis_server import EmbeddedRedis


def _chunk_csv(frame) -> str:
    return frame.to_csv(header=False)


def write_csv(frame, path: Path) -> None:
    """`frame.to_csv(path)`, the rows formatted in parallel chunks (5·10^6 rows: ~70 s on one core)."""
    from concurrent.futures import ProcessPoolExecutor

    n = max(1, min(os.cpu_count() or 1, 16))
    step = -(-len(frame) // n)
    with ProcessPoolExecutor(n) as pool, open(path, "w") as f:
        f.write(frame.head(0).to_csv())
        for text in pool.map(_chunk_csv, [frame.iloc[i:i + step] for i in range(0, len(frame), step)]):
            f.write(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--data-bars", type=int, default=1000)
    ap.add_argument("--val-bars", type=int, default=None, help="size the data for about this many validation bars")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--evaluators", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--full-size", action="store_true", help="the preset's sizes instead of the tiny test sizes")
    ap.add_argument("--feedback-mode", default="sync", choices=["sync", "overlap"])
    ap.add_argument("--config", default="small", choices=["small", "full"], help="the trainer's preset")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tl-latency-"))
    data: list[str] = []
    if a.val_bars:
        # a synthetic series long enough that its validation split (~19.6 % of the bars) holds --val-bars bars,
        # written as a user CSV (the bundled `synthetic` has a fixed length)
        from shared.synthetic import generate
        a.data_bars = int(a.val_bars / 0.196) + 1
        csv = tmp / "bars.csv"
        freq = "h" if a.data_bars < 2_000_000 else "min"       # hourly stamps past 2262 overflow nanoseconds
        write_csv(generate(n_bars=a.data_bars, seed=0, freq=freq).bars.to_frame().rename_axis("timestamp"), csv)
        data = ["--dataset", str(csv)]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TL_REDIS_URL")}
    cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--epochs", str(a.epochs), "--device", a.device,
           "--no-dashboard", "--no-live", "--free-ports", "--run-dir", str(tmp), "--run-id", "bench",
           "--evaluators", str(a.evaluators), "--feedback-mode", a.feedback_mode, "--config", a.config, *data]
    env["TL_FEEDBACK_TIMEOUT_S"] = "7200"          # measure the whole wait, however long the evaluation takes
    if not a.full_size:
        env.update({"TL_TRAIN_LEARNING_STARTS": "32", "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4"})
        cmd += ["--iterations", str(a.iterations)]
    if not a.full_size and not a.val_bars:
        cmd += ["--data-bars", str(a.data_bars)]
    rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL).returncode
    if rc != 0:
        sys.exit(f"tradeloop up exited with {rc}; logs in {tmp / 'bench' / 'logs'}")
    server = EmbeddedRedis(tmp / "bench" / "redis").start()
    r = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        at: dict[tuple[str, int], float] = {}
        for stream in ("checkpoints", "reports", "feedback"):
            for _, f in r.xrange(f"tl:bench:stream:{stream}"):
                ev = json.loads(f["data"])
                at.setdefault((stream, ev["epoch"]), datetime.fromisoformat(ev["created_at"]).timestamp())
        hist = {int(k): json.loads(v) for k, v in r.hgetall(trainer_history_key("bench")).items()}
    finally:
        r.close()
        server.stop()
    print(f"loop latency per stage (s), {a.evaluators} evaluator(s), device {a.device}, "
          f"{a.config + ' preset' if a.full_size else 'tiny'} config, {a.data_bars} bars (~{int(a.data_bars * 0.196)} validation), "
          f"feedback mode {a.feedback_mode}")
    print(f"{'epoch':>5} {'evaluate':>9} {'feedback':>9} {'apply':>7} {'total':>7} {'at it':>6} {'epoch s':>8} "
          f"{'wait':>7} {'wait %':>7}")
    applied = {b["epoch"]: b for h in hist.values() for b in h.get("bundles_applied", [])}
    for e in range(1, a.epochs + 1):
        c, rp, fb = at.get(("checkpoints", e)), at.get(("reports", e)), at.get(("feedback", e))
        nxt = hist.get(e + 1, {})
        ep_s = nxt.get("seconds")
        if a.feedback_mode == "overlap":
            ap_t, it = applied.get(e, {}).get("at"), applied.get(e, {}).get("iteration")
            wait = hist.get(e + 2, {}).get("feedback_wait_s", 0.0 if e + 1 in hist and it is not None else None)
        else:
            ap_t, it, wait = nxt.get("knobs_applied_at"), (0 if nxt else None), nxt.get("feedback_wait_s")
        cells = [rp - c if rp and c else None, fb - rp if fb and rp else None,
                 ap_t - fb if ap_t and fb else None, ap_t - c if ap_t and c else None, it, ep_s, wait,
                 100.0 * wait / ep_s if wait is not None and ep_s else None]
        print(f"{e:>5} " + " ".join(
            (f"{x:>{w}d}" if isinstance(x, int) else f"{x:>{w}.2f}") if x is not None else f"{'-':>{w}}"
            for x, w in zip(cells, (9, 9, 7, 7, 6, 8, 7, 7))))


if __name__ == "__main__":
    main()
