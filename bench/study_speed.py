"""Study throughput: aggregate epochs per second of `tradeloop study` with P runs at once, time-sliced or under CUDA
MPS, against one run alone — the product's own command, side by side in one invocation.

    python3 -m bench.study_speed [--parallel 1 10] [--mps off on] [--mps-share 100 25] [--epochs 4]
                                 [--lockstep 1 8] [--preset full] [--set iterations=1000] [--device cuda]
                                 [--out runs/study-speed]
    python3 -m bench.study_speed --from runs/study-speed     # the table again from the cases' records

Each case is one `tradeloop study --dataset synthetic --bars auto --folds 1` whose runs number P (variants on,off ×
⌈P/2⌉ seeds; P = 1: the variant `on`, seed 0), so every worker holds one run from start to end; the cases share one
compile cache, and the cases of P = 1 run first, so the one that compiles is a run alone. `--lockstep K …` runs
each case of P workers once per K: with K > 1 its P·K runs (on,off × ⌈P·K/2⌉ seeds, `--seeds-per-market` all of
them: one market) train K to a worker in lockstep (the study's `--lockstep K`: each worker's K runs one batched
computation). From the runs' epoch records (`finished_at`):
  epochs/s   steady aggregate rate over the span after every run had finished its first epoch (start-up, data,
             compile) and before the first of them finished its last: the sum over the runs of each one's rate
             between its first and last epoch inside the span (runs in step finish their epochs together, so a
             count of the epochs in the span would depend on where its ends fall). A run that finished every epoch
             before the others' first (the one that warms the compile cache, running ahead) is left out, and
             `in_span` says how many ran together (n/a where the starts spread over every epoch: raise `--epochs`)
  epoch_s    the median seconds between two epochs of one run after its first: P / epoch_s is the aggregate rate
             while all P run
  ×1         that rate over the rate of one run alone (`--parallel 1`; the first case's when it is P = 1)
  setup_s / train_s / eval_s / save_s   median seconds of an epoch's set-up (knobs, fresh episodes, the embedding
             cache's full refresh), training iterations, evaluation, and writing of its weights and trainer state
             inside one run, over the epochs after each run's first (the first compiles; setup_s, save_s: n/a in
             records that predate them); rollback_s: the median over the epochs that began from a rollback
             (restoring the best epoch's learner before the set-up), n/a where none did
  busy       the study's mean GPU utilisation (nvidia-smi) over its whole wall time
  runs at once   P, and "(n at most)" where the study ran fewer at once (`peak_running`: a GPU keeps only the
             runs that fit its memory)
Under the table, each case's notes from its study's events.jsonl: runs that failed, workers that stood down (the
memory one run or group holds), lockstep groups that trained rounds alone, and runs that stored no epoch.
Cases with P = 1 run once whatever `--mps` says (one worker never starts MPS); `--mps` runs each case of P > 1
time-sliced and under MPS by default (`--mps on` for MPS alone). `--case-limit SECONDS` stops a case's study there
(SIGINT: it keeps its records) and reads the case from the epochs it finished (`stopped` in the wall column), so a
bench cut short by a machine's call limit still gives the cases it reached. `--mps-share PCT …` runs each MPS
case once per PCT with the study's `--mps-share PCT` (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` in its workers'
environment): each run's kernels may then occupy at most that share of the SMs, which can let the kernels of more
runs execute at once (100: no limit).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tradeloop.study.loop import PARTS
from tradeloop.study.report import part_medians, upper_median


def steady_rate(finish: list[list[float]]) -> tuple[float | None, int, float]:
    """(aggregate epochs/s, runs in the span, span seconds) from each run's sorted epoch finish times: the span
    runs from the last first epoch to the first last epoch of the runs still going then; each run's rate there is
    (its epochs in the span − 1) over the time between the first and the last of them."""
    t_lo = max(f[0] for f in finish)                  # every run past its first epoch
    going = [f for f in finish if f[-1] > t_lo]       # not a run that finished before the others began
    if not going:
        return None, 0, 0.0
    t_hi = min(f[-1] for f in going)
    rates = []
    for f in going:
        inside = [t for t in f if t_lo <= t <= t_hi]
        if len(inside) >= 2 and inside[-1] > inside[0]:
            rates.append((len(inside) - 1) / (inside[-1] - inside[0]))
    ok = len(rates) == len(going)
    return (sum(rates) if ok else None), len(going), t_hi - t_lo


STOPPED = "stopped.json"
"""In a case's directory: the case was stopped at `--case-limit` ({"wall_s", "limit_s"}); its row is read from the
epochs its runs finished."""


def analyse(out: Path, P: int, mps: str, share: int, wall: float | None = None, isms: int = 0,
            lockstep: int = 1) -> dict:
    """A case's row from its study's records (`out`: the case's study directory): a finished case's, or a stopped
    one's from the epochs its runs finished (no GPU busy %: the study wrote no results)."""
    stopped = (out / STOPPED).exists()
    timing = ({"mps": mps == "on", **json.loads((out / STOPPED).read_text())} if stopped
              else json.loads((out / "results.json").read_text()).get("timing", {}))
    finish: list[list[float]] = []
    parts: list[list[dict]] = []
    idle: list[str] = []
    for run_dir in sorted((out / "runs").iterdir()) if (out / "runs").is_dir() else []:
        recs = sorted((json.loads(p.read_text()) for p in (run_dir / "loop").glob("epoch-*.json")),
                      key=lambda r: r["finished_at"])
        if recs:                                    # a stopped case's run may not have finished an epoch
            finish.append([r["finished_at"] for r in recs])
            parts.append([{f"{k}_s": r["seconds"].get(k) for k in PARTS} for r in recs])
        else:
            idle.append(run_dir.name)
    rate, in_span, span = steady_rate(finish) if finish else (None, 0, 0.0)
    medians = part_medians(parts)
    steps = [b - a for f in finish for a, b in zip(f[1:], f[2:])]
    busy = [v for v in (timing.get("gpu_busy_pct") or {}).values() if v is not None]
    status = out / "status.json"
    peak = timing.get("runs_at_once") or (json.loads(status.read_text()).get("peak_running") if status.exists()
                                          else None)
    return {"P": P, "mps": bool(timing.get("mps")), "mps_asked": mps, "share": share, "iteration_sms": isms,
            "lockstep": lockstep, "runs": len(finish), "at_once": peak,
            "epochs_per_s": rate, "in_span": in_span, "span_s": span,
            "wall_s": wall if wall is not None else timing.get("wall_s"),
            "epoch_s": upper_median(steps),
            **{f"{k}_s": medians[k] for k in PARTS},
            "busy_pct": sum(busy) / len(busy) if busy else None, "stopped": stopped,
            "notes": case_notes(out, idle)}


def case_notes(out: Path, idle: list[str]) -> list[str]:
    """What the case's study logged beside its epochs (its events.jsonl): runs failed, workers stood down, lockstep
    groups that trained rounds alone; and the runs that stored no epoch."""
    gib = 2.0 ** 30
    notes = []
    log = out / "events.jsonl"
    for line in log.read_text().splitlines() if log.exists() else []:
        ev = json.loads(line)
        if ev.get("type") == "error":
            notes.append(f"{ev.get('run')} failed: {str(ev.get('error', '')).splitlines()[0][:200]}")
        elif ev.get("type") == "stand-down":
            notes.append(f"{ev['worker']} stood down: {ev['fit']} at once fit GPU {ev['gpu']} (one holds "
                         f"{ev['run_bytes'] / gib:.1f} GiB of {ev['total_bytes'] / gib:.1f})")
        elif ev.get("type") == "lockstep" and (ev.get("rounds") or {}).get("alone"):
            rd = ev["rounds"]
            notes.append(f"{ev['worker']}: {len(ev['runs'])} runs in lockstep, {rd.get('lockstep')} epochs together, "
                         f"{rd['alone']} rounds alone")
    if idle:
        notes.append(f"no epoch stored by {len(idle)} run(s): {', '.join(idle)}")
    return notes


def run_case(out: Path, P: int, mps: str, args, share: int = 100, isms: int = 0, lockstep: int = 1) -> dict:
    n = P * lockstep
    seeds = max(1, math.ceil(n / 2))
    variants = "on" if n == 1 else "on,off"
    cmd = [sys.executable, "-m", "tradeloop.cli", "study", "--dataset", "synthetic", "--bars", "auto",
           "--variants", variants, "--seeds", str(seeds), "--folds", "1", "--epochs", str(args.epochs),
           "--preset", args.preset, "--device", args.device, "--parallel", str(P), "--mps", mps,
           "--n-boot", "200", "--out", str(out)]
    for s in args.set or []:
        cmd += ["--set", s]
    if share < 100:
        cmd += ["--mps-share", str(share)]
    if isms:
        cmd += ["--iteration-sms", str(isms)]
    cmd += ["--lockstep", str(lockstep)]          # always given: the study's own default pairs runs on CUDA
    if lockstep > 1:
        cmd += ["--seeds-per-market", str(seeds)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=args.case_limit)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)            # the study stops its workers and keeps every record written
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        wall = time.time() - t0
        (out / STOPPED).write_text(json.dumps({"wall_s": wall, "limit_s": args.case_limit}))
        return analyse(out, P, mps, share, wall, isms, lockstep)
    wall = time.time() - t0
    if proc.returncode != 0:
        return {"P": P, "mps": mps, "share": share, "iteration_sms": isms, "lockstep": lockstep,
                "error": (stderr or stdout).strip()[-600:]}
    return analyse(out, P, mps, share, wall, isms, lockstep)


CASE = re.compile(r"p(\d+)-mps-(on|off|auto)-sm(\d+)(?:-it(\d+))?(?:-ls(\d+))?")


def read_cases(source: Path) -> list[dict]:
    """The rows of the cases found under `source` (directories named as `main` names them), a run alone first."""
    if not source.is_dir():
        raise SystemExit(f"--from {source}: no such directory")
    rows = []
    for d in sorted(source.iterdir()):
        m = CASE.fullmatch(d.name)
        if m and ((d / "results.json").exists() or (d / STOPPED).exists()):
            rows.append(analyse(d, int(m[1]), m[2], int(m[3]), isms=int(m[4] or 0), lockstep=int(m[5] or 1)))
    if not rows:
        raise SystemExit(f"--from {source}: no finished or stopped case (pN-mps-M-smS/results.json or "
                         f"{STOPPED}) in it")
    return sorted(rows, key=lambda r: (r["P"] * r["lockstep"] != 1, r["P"], r["lockstep"], r["mps_asked"],
                                       -r["share"], r["iteration_sms"]))


def _cell(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def print_table(rows: list[dict], argv) -> None:
    base = next((r["epochs_per_s"] for r in rows if r["P"] == 1 and r.get("lockstep", 1) == 1
                 and r.get("epochs_per_s")), None)
    print(f"\n`python3 -m bench.study_speed {' '.join(argv if argv is not None else sys.argv[1:])}`\n")
    print("| workers | runs in lockstep a worker | MPS | SM share % | iteration SMs | epochs/s (steady) | in span "
          "| ×1 | epoch_s | rollback_s | setup_s | train_s | eval_s | save_s | GPU busy % | wall s |")
    print("|---" * 16 + "|")
    for r in rows:
        if "error" in r:
            print(f"| {r['P']} | {r.get('lockstep', 1)} | {r['mps']} | {r['share']} | "
                  f"{r.get('iteration_sms') or 'all'} | error: {r['error'][-200:]} |" + " |" * 10)
            continue
        ratio = r["epochs_per_s"] / base if base and r["epochs_per_s"] else None
        cells = [_cell(r["epochs_per_s"], ".3f"), str(r["in_span"]), _cell(ratio, ".2f"), _cell(r["epoch_s"], ".1f"),
                 *(_cell(r.get(f"{k}_s"), ".2f") for k in PARTS),
                 _cell(r["busy_pct"], ".0f"),
                 _cell(r["wall_s"], ".0f") + (" (stopped)" if r.get("stopped") else "")]
        asked = str(r["P"]) if r.get("at_once") in (None, r["P"]) else f"{r['P']} ({r['at_once']} at most)"
        print(f"| {asked} | {r.get('lockstep', 1)} | {'on' if r['mps'] else 'off'} | {r['share']} | "
              f"{r.get('iteration_sms') or 'all'} | "
              + " | ".join(cells) + " |")
    notes = [(r, n) for r in rows for n in r.get("notes") or ()]
    notes += [(r, n) for r in rows if (n := ceiling_note(r, base))]
    if notes:
        print()
    for r, n in notes:
        print(f"- {r['P']} × {r.get('lockstep', 1)} ({'MPS' if r['mps'] else 'no MPS'}): {n}")


def ceiling_note(row: dict, base: float | None) -> str | None:
    """For one worker of K runs in lockstep, against the lone run's steady rate `base`: the most its epochs/s could
    be with the set-ups, evaluations and writes wholly hidden under the iterations (K epochs in the median seconds
    the K runs' batched iterations take an epoch), and the seconds 3× one run leaves for those K epochs."""
    K, train = row.get("lockstep", 1), row.get("train_s")
    if row["P"] != 1 or K < 2 or not base or not train or "error" in row:
        return None
    return (f"the {K} runs' iterations alone take {train:.2f} s an epoch: with every other part hidden at most "
            f"{K / train:.3f} epochs/s, {K / train / base:.2f}× one run; 3× one run leaves {K / (3 * base):.2f} s "
            f"for their {K} epochs")


def case_list(args) -> list[tuple[int, str, int, int, int]]:
    """The cases to run, (P, mps, SM share, iteration SMs, runs in lockstep), a run alone first (it compiles, the
    others find the cache warm). MPS is CUDA's: a CPU study gets its "off" cases alone."""
    cases = []
    for P in args.parallel:
        for mps in (["off"] if P == 1 or not args.device.startswith("cuda") else args.mps):
            for share in (args.mps_share if mps != "off" else [100]):
                for isms in (args.iteration_sms if P > 1 else [0]):
                    cases += [(P, mps, share, isms, k) for k in args.lockstep]
    return sorted(cases, key=lambda c: c[0] * c[4] != 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 10])
    ap.add_argument("--mps", nargs="+", default=["off", "on"], choices=["off", "on", "auto"])
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--preset", default="full")
    ap.add_argument("--set", action="append", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--mps-share", type=int, nargs="+", default=[100],
                    help="SM percentages for each MPS case (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; 100: no limit)")
    ap.add_argument("--iteration-sms", type=int, nargs="+", default=[0],
                    help="SMs each run's training iterations may use, for each case of P > 1 (the study's "
                         "--iteration-sms; 0: no limit)")
    ap.add_argument("--lockstep", type=int, nargs="+", default=[1],
                    help="runs a worker trains in lockstep, for each case of P workers (1: a run a worker)")
    ap.add_argument("--case-limit", type=float, default=None,
                    help="seconds a case's study may run; then it is stopped and read from the epochs it finished")
    ap.add_argument("--out", type=Path, default=Path("runs/study-speed"))
    ap.add_argument("--from", dest="source", type=Path, default=None,
                    help="an earlier --out directory: its cases' table again, from their records (nothing runs)")
    args = ap.parse_args(argv)
    if args.source is not None:
        print_table(read_cases(args.source), argv)
        return
    if any(not 1 <= x <= 100 for x in args.mps_share):
        ap.error("--mps-share takes percentages in 1…100")
    if args.epochs < 3:
        ap.error("--epochs must be ≥ 3 (the steady span lies between every run's first and last epoch)")
    cache = args.out / "cache"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    rows = []
    for P, mps, share, isms, k in case_list(args):
        out = args.out / (f"p{P}-mps-{mps}-sm{share}" + (f"-it{isms}" if isms else "") + (f"-ls{k}" if k > 1 else ""))
        if out.exists():
            shutil.rmtree(out)
        row = run_case(out, P, mps, args, share, isms, k)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print_table(rows, argv)
    (args.out / "study_speed.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
