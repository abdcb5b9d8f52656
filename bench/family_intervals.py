"""Finished studies' paired differences read as one family: each variant's Δ OOS against the study's reference
with its own 95 % CI and its Bonferroni interval as one of the study's m comparisons (`tradeloop.study.stats.paired`
with `family=m`, the interval a study's report now prints beside each Δ OOS), from the runs' rows of each
results.json and the study's own resamples (its `n_boot` and `ci_seed`). Studies with one comparison are listed
without a family; a population variant (its units are populations, not runs) is left out.

    python3 -m bench.family_intervals docs/study-h200-gamma docs/study-h200-loo [more study directories] [--json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.headroom import load, study_name
from tradeloop.study.intervals import paired


def family_rows(res: dict) -> list[dict]:
    """Per variant compared with the reference: its Δ OOS (mean, 95 % CI) and, with m ≥ 2, its family interval."""
    ref, rows, study = res["reference"], res["runs"], res["study"]
    pops = {n for n, d in res["variants"].items() if "populations" in d}
    names = [n for n in res["paired"] if n not in pops and ref not in pops]
    oos = lambda n: {(r["seed"], r["fold"]): r["oos_sharpe"] for r in rows if r["variant"] == n}  # noqa: E731
    out = []
    for n in names:
        p = paired(oos(n), oos(ref), n_boot=study.get("n_boot", 10_000), seed=study.get("ci_seed", 0),
                   family=len(names))
        out.append({"variant": n, "reference": ref, "m": len(names), "n": p["n"], "mean": p["mean"], "lo": p["lo"],
                    "hi": p["hi"], "family": p.get("family")})
    return out


def _ci(lo: float, hi: float) -> str:
    return f"[{lo:+.3f}, {hi:+.3f}]" + (" clears 0" if lo > 0 or hi < 0 else "")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m bench.family_intervals", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="finished studies (their directories or results.json)")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args(argv)
    table = {study_name(p): family_rows(load(p)) for p in args.results}
    if args.json:
        print(json.dumps(table, indent=1))
        return
    print("| study | variant − reference | units | Δ OOS per-trade Sharpe [95 % CI] | m | family-wise interval |")
    print("|---|---|---:|---|---:|---|")
    for name, rows in table.items():
        for r in rows:
            fw = r["family"]
            print(f"| {name} | {r['variant']} − {r['reference']} | {r['n']} | {r['mean']:+.3f} "
                  f"{_ci(r['lo'], r['hi'])} | {r['m']} | "
                  + (f"{_ci(fw['lo'], fw['hi'])} ({100 * fw['level']:.4g} %)" if fw else "—") + " |")


if __name__ == "__main__":
    main()
