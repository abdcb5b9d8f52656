"""What an exploit across runs could gain: within each group of a finished study's runs that trained on the same data
(the same data seed; on a real series, all of a fold), how far the OOS per-trade Sharpe of the run chosen on
validation among k of them is above their mean OOS — the premise of `feedback.population` (population-based training's
exploit step), measured on runs that did not share weights. Run differences that are luck on validation give 0 here;
differences that carry out of sample give the headroom.

    python3 -m bench.population_headroom docs/study-h200-loo/results.json --k 2 3 5

Prints per group the correlation of val and OOS across its runs, and per k the mean gain over every k-subset of each
group (exact, no sampling). Sharpes are un-annualized, per trade.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np


def groups(results: dict) -> dict[tuple, list[tuple[float, float]]]:
    """(data seed or "series", fold) → the (val, OOS) per-trade Sharpes of the runs trained on that data."""
    study = results["study"]
    synthetic = study["dataset"] == "synthetic"
    out: dict[tuple, list[tuple[float, float]]] = {}
    for r in results["runs"]:
        data = (study.get("data_seed") if study.get("data_seed") is not None else r["seed"]) if synthetic else "series"
        out.setdefault((data, r["fold"]), []).append((float(r["val_sharpe"]), float(r["oos_sharpe"])))
    return out


def best_of_k_gain(runs: list[tuple[float, float]], k: int) -> float:
    """Mean over every k-subset of `runs` of (OOS of the subset's best-val run − the subset's mean OOS)."""
    gains = []
    for sub in itertools.combinations(runs, k):
        best = max(sub, key=lambda x: x[0])
        gains.append(best[1] - float(np.mean([x[1] for x in sub])))
    return float(np.mean(gains))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a finished study's results.json")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 5], help="population sizes")
    a = ap.parse_args()
    g = groups(json.loads(a.results.read_text()))
    print(f"# population_headroom: {a.results}, {len(g)} groups of runs on the same data\n")
    print("| data, fold | runs | corr(val, OOS) | mean OOS | OOS of the best val |")
    print("|---|---:|---:|---:|---:|")
    for key, runs in sorted(g.items(), key=lambda kv: str(kv[0])):
        v, o = np.array(runs).T
        corr = f"{np.corrcoef(v, o)[0, 1]:+.2f}" if len(runs) > 2 and v.std() > 0 and o.std() > 0 else "n/a"
        print(f"| {key[0]}, {key[1]} | {len(runs)} | {corr} | {o.mean():+.3f} | {o[v.argmax()]:+.3f} |")
    print("\n| k | OOS of the best-val run − the k runs' mean OOS (mean over groups and k-subsets) |")
    print("|---:|---:|")
    for k in a.k:
        gains = [best_of_k_gain(runs, k) for runs in g.values() if len(runs) >= k]
        print(f"| {k} | {np.mean(gains):+.3f} |" if gains else f"| {k} | n/a (no group of {k} runs) |")


if __name__ == "__main__":
    main()
