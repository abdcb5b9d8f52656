"""Do a run's later epochs validate above its first? For each variant of finished studies, the mean over its runs of
(the mean validation per-trade Sharpe of epochs 2–E) − (epoch 1's), with its 95 % CI (the study's bootstrap over the
runs, `tradeloop.study.stats.bootstrap_ci`). A knob schedule or a rollback chooses among a run's epochs; only a learner
whose later epochs improve on its first raises the level they are chosen from.

    python3 -m bench.later_epochs docs/study-h200*/results.json [--variants off] [--steps]

Reads the studies' `curves` (each run's validation per-trade Sharpe by epoch); an epoch without a Sharpe is left out
of a run's later mean, a run without epoch 1's or a later one is left out. Sharpes are un-annualized, per trade. The
last column is the study's own widening of the gap in sample − validation after epoch 1 (`stats.gap_widening`; a
study written before the in-sample record has none): later epochs that fall in validation while that gap widens
overfit the training split.
`--steps` prints instead, per variant, the mean validation per-trade Sharpe at each epoch and the change from each
epoch to the next (mean over the runs that have both, 95 % CI by the same bootstrap): where a dip falls.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tradeloop.study.stats import describe, first_and_later_of, first_then_later
from tradeloop.study.intervals import bootstrap_ci


def kept(curves: dict[str, list[float]]) -> list[tuple[float, float]]:
    """(epoch 1, the mean of epochs 2–E) of each run of `curves` that has both (`stats.first_and_later_of`)."""
    return [x for x in map(first_and_later_of, curves.values()) if x is not None]


def later_minus_first(curves: dict[str, list[float]]) -> list[float]:
    """Per kept run: the mean of epochs 2–E minus epoch 1."""
    return [later - first for first, later in kept(curves)]


def rows(paths: list[Path], variants: set[str] | None = None) -> list[dict]:
    out = []
    for path in paths:
        res = json.loads(Path(path).read_text())
        for name, curves in res.get("curves", {}).items():
            if variants and name not in variants:
                continue
            d = later_minus_first(curves)
            if not d:
                continue
            epoch1, later = first_then_later(curves)
            out.append({"study": Path(path).parent.name, "variant": name, "runs": len(d),
                        "epochs": max(len(v) for v in curves.values()), "epoch1": epoch1, "later": later,
                        "diff": bootstrap_ci(d),
                        "gap_widening": res.get("variants", {}).get(name, {}).get("gap_widening")})
    return out


def steps(curves: dict[str, list[float]]) -> tuple[list[float | None], list[dict]]:
    """(the mean over the runs of each epoch's validation per-trade Sharpe, the CI of epoch k+1 − epoch k over the
    runs with both finite), epochs 1…E of the longest run."""
    ok = lambda x: x is not None and np.isfinite(x)  # noqa: E731
    n = max((len(v) for v in curves.values()), default=0)
    at = [[v[k] for v in curves.values() if k < len(v) and ok(v[k])] for k in range(n)]
    means = [float(np.mean(x)) if x else None for x in at]
    deltas = [bootstrap_ci([v[k + 1] - v[k] for v in curves.values()
                            if k + 1 < len(v) and ok(v[k]) and ok(v[k + 1])]) for k in range(n - 1)]
    return means, deltas


def print_steps(paths: list[Path], variants: set[str] | None) -> None:
    print("| study | variant | runs | epoch | mean val | change from the epoch before [95 % CI] |")
    print("|---|---|---:|---:|---:|---|")
    for path in paths:
        res = json.loads(Path(path).read_text())
        for name, curves in res.get("curves", {}).items():
            if variants and name not in variants:
                continue
            means, deltas = steps(curves)
            for k, m in enumerate(means):
                change = describe(deltas[k - 1]) if k else "—"
                print(f"| {Path(path).parent.name} | {name} | {len(curves)} | {k + 1} | "
                      f"{'n/a' if m is None else format(m, '+.3f')} | {change} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="a finished study's results.json (several allowed)")
    ap.add_argument("--variants", nargs="*", help="only these variants")
    ap.add_argument("--steps", action="store_true", help="the mean validation at each epoch and each epoch's change")
    a = ap.parse_args(argv)
    missing = [str(p) for p in a.results if not p.is_file()]
    if missing:
        ap.error(f"no such results.json: {', '.join(missing)}")
    if a.steps:
        print_steps(a.results, set(a.variants) if a.variants else None)
        return
    found = rows(a.results, set(a.variants) if a.variants else None)
    print("| study | variant | runs | epochs | epoch 1 | epochs 2–E | later − first [95 % CI] "
          "| gap widening, in sample − val [95 % CI] |")
    print("|---|---|---:|---:|---:|---:|---|---|")
    for r in found:
        d, w = r["diff"], r["gap_widening"]
        print(f"| {r['study']} | {r['variant']} | {r['runs']} | {r['epochs']} | {r['epoch1']:+.3f} | {r['later']:+.3f} "
              f"| {describe(d)} | {describe(w) if w else '—'} |")
    print(json.dumps(found), file=sys.stderr)


if __name__ == "__main__":
    main()
