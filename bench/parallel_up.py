"""N `tradeloop up` started together on one machine: do they all complete, each in a run of its own?

Starts N launchers `--stagger` seconds apart (each with `--free-ports --no-dashboard --no-live` and the options
after `--`), waits for all, and prints a markdown table: each launcher's exit code, run id, its summary's status,
epochs, wall seconds and Redis, and whether every launcher got a run directory of its own.

    python bench/parallel_up.py --n 6 --run-dir runs/par -- --dataset synthetic --device cuda --epochs 1 \
        --iterations 40 --data-bars 3000
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=6, help="launchers (default 6)")
    ap.add_argument("--stagger", type=float, default=0.2, help="seconds between starts (default 0.2)")
    ap.add_argument("--run-dir", type=Path, default=Path("runs/parallel-up"), help="parent of the runs")
    ap.add_argument("--timeout", type=float, default=900.0, help="each launcher's --timeout (default 900 s)")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in args.run_dir.iterdir()}
    t0 = time.monotonic()
    procs = []
    for i in range(args.n):
        cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--free-ports", "--no-dashboard", "--no-live",
               "--run-dir", str(args.run_dir), "--timeout", str(args.timeout), *extra]
        log = open(args.run_dir / f"launcher-{i + 1}.log", "wb")
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
        time.sleep(args.stagger)
    ends = []
    for p, log in procs:
        p.wait()
        log.close()
        ends.append(time.monotonic() - t0)
    runs = sorted(p for p in args.run_dir.iterdir() if p.is_dir() and p.name not in before)
    print(f"{args.n} × `tradeloop up {' '.join(extra)}`, {args.stagger} s apart\n")
    print("| launcher | exit | exited at (s) |\n|---|---|---|")
    for i, ((p, _), t) in enumerate(zip(procs, ends)):
        print(f"| {i + 1} | {p.returncode} | {t:.1f} |")
    print("\n| run | status | epochs | wall (s) | Redis |\n|---|---|---|---|---|")
    for r in runs:
        try:
            s = json.loads((r / "summary.json").read_text())
        except (OSError, ValueError):
            s = {}
        print(f"| {r.name} | {s.get('status', 'no summary')} | {s.get('epochs_completed')}/{s.get('epochs_requested')} "
              f"| {s.get('wall_seconds')} | {s.get('redis')} |")
    ok = all(p.returncode == 0 for p, _ in procs) and len(runs) == args.n
    print(f"\n{sum(p.returncode == 0 for p, _ in procs)} of {args.n} exited 0; {len(runs)} new run directories "
          f"({'all distinct' if len(runs) == args.n else 'NOT one per launcher'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
