"""What an exploit across runs could gain: within each group of a finished study's runs that trained on the same data
(the same data seed; on a real series, all of a fold), how far the OOS per-trade Sharpe of the run chosen on
validation among k of them is above their mean OOS — the premise of `feedback.population` (population-based training's
exploit step), measured on runs that did not share weights. Run differences that are luck on validation give 0 here;
differences that carry out of sample give the headroom.

    python3 -m bench.population_headroom docs/study-h200-loo/results.json --k 2 3 5
    python3 -m bench.population_headroom docs/study-h200-pop/results.json --by-variant

Prints per group the correlation of val and OOS across its runs, and per k the mean gain over every k-subset of each
group (exact, no sampling). Sharpes are un-annualized, per trade.

`--by-variant` groups each variant's runs apart (a population variant's runs share one market and fold: a group is a
population) and compares the variants two ways, paired by group against the study's reference: the groups' mean OOS
(what the study's report compares), and the OOS of each group's run chosen on validation — what a user who trains the
group and keeps its best-validated run gets. An exploit that only copies a peer's better epoch, with no learning of
its own beyond it, gains in the first and not in the second: choosing among independent runs on validation gets that
much already.

`--after-exploit` asks whether an exploited epoch's edge survives further training: for each exploit, the validation
per-trade Sharpe of the epoch trained from the peer's epoch minus that epoch's, against the same step after a run's
own running-best epoch in every variant. It reads the exploits from the results' runs (`exploited`); a study written
before they were recorded there gives them by its console lines (`--log`, the lines of finished runs: only runs that
exploited after every epoch, whose exploits' epochs the line fixes).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np


def data_of(study: dict, seed: int) -> int | str:
    """The market a run of `seed` trained on: the synthetic data seed (`StudySpec.data_seed_of`), or "series"."""
    if study["dataset"] != "synthetic":
        return "series"
    if study.get("data_seed") is not None:
        return study["data_seed"]
    return seed // int(study.get("seeds_per_market") or 1)


def groups(results: dict, variant: str | None = None) -> dict[tuple, list[tuple[float, float]]]:
    """(market, fold) → the (val, OOS) per-trade Sharpes of the runs trained on that data (of `variant` alone, or of
    every variant)."""
    out: dict[tuple, list[tuple[float, float]]] = {}
    for r in results["runs"]:
        if variant is None or r["variant"] == variant:
            key = (data_of(results["study"], r["seed"]), r["fold"])
            out.setdefault(key, []).append((float(r["val_sharpe"]), float(r["oos_sharpe"])))
    return out


def by_variant(results: dict) -> list[str]:
    """Markdown: per variant, the groups' mean OOS and the OOS of their best-validated run, and both paired against
    the reference variant by group (`tradeloop.study.stats.paired`: mean [95 % CI], wins)."""
    from tradeloop.study.stats import best_validated, describe
    from tradeloop.study.intervals import bootstrap_ci, paired

    study = results["study"]
    names = [v["name"] for v in study["variants"]]
    ref = study.get("reference") or names[0]
    cluster = lambda seed, fold: (data_of(study, seed), fold)  # noqa: E731
    per = {}
    for name in names:
        b = best_validated([r for r in results["runs"] if r["variant"] == name], cluster)
        if b is None:
            raise SystemExit(f"{name}: a market and fold with fewer than 2 runs: nothing to choose among")
        per[name] = (b["mean"], b["oos"], b["runs"])
    lines = ["| variant | groups | runs a group | mean OOS of a group | OOS of its best-val run | best-val − mean |",
             "|---|---:|---:|---|---|---|"]
    for name, (mean, best, k) in per.items():
        lift = {u: best[u] - mean[u] for u in mean}
        lines.append(f"| {name} | {len(mean)} | {k} | {describe(bootstrap_ci(list(mean.values())))} | "
                     f"{describe(bootstrap_ci(list(best.values())))} | {describe(bootstrap_ci(list(lift.values())))} |")
    lines += ["", f"| variant − {ref}, paired by group | Δ mean OOS | wins | Δ OOS of the best-val run | wins |",
              "|---|---|---:|---|---:|"]
    for name in names:
        if name != ref:
            dm, db = paired(per[name][0], per[ref][0]), paired(per[name][1], per[ref][1])
            lines.append(f"| {name} | {describe(dm)} | {dm['wins']}/{dm['n']} | {describe(db)} | {db['wins']}/{db['n']} |")
    return lines


def best_of_k_gain(runs: list[tuple[float, float]], k: int) -> float:
    """Mean over every k-subset of `runs` of (OOS of the subset's best-val run − the subset's mean OOS)."""
    gains = []
    for sub in itertools.combinations(runs, k):
        best = max(sub, key=lambda x: x[0])
        gains.append(best[1] - float(np.mean([x[1] for x in sub])))
    return float(np.mean(gains))


def exploits_of(results: dict, log: Path | None = None) -> list[tuple[str, int, float]]:
    """(run, epoch e, the exploited epoch's val per-trade Sharpe): epoch e + 1 of the run trained from that epoch."""
    rows = [r for r in results["runs"] if "exploited" in r]
    if rows:
        return [(r["run_id"], int(e), float(v)) for r in rows for e, _, _, v in r["exploited"]]
    if log is None:
        return []
    import re

    curves, epochs, out = results["curves"], results["study"]["epochs"], []
    for line in log.read_text().splitlines():
        m = re.match(r"(\S+): epoch \d+ selected on validation .*; exploited (.*)$", line)
        peers = re.findall(r"(\S+)-s(\d+)-f(\d+) e(\d+)", m.group(2)) if m else []
        if len(peers) == epochs - 1:
            out += [(m.group(1), k, curves[v][f"{s}/{f}"][int(pe) - 1]) for k, (v, s, f, pe) in enumerate(peers, 1)]
    return out


def after_exploit(results: dict, log: Path | None = None) -> list[str]:
    """Markdown: the next epoch's val − the exploited epoch's val, and the next − a run's own running best."""
    from tradeloop.study.stats import describe
    from tradeloop.study.intervals import bootstrap_ci

    curves = {f"{v}-s{k.replace('/', '-f')}": c for v, cs in results["curves"].items() for k, c in cs.items()}
    steps = [curves[run][e] - val for run, e, val in exploits_of(results, log) if curves[run][e] is not None]
    lines = ["| after | n | next epoch's val − its start's val | share higher |", "|---|---:|---|---:|"]
    if steps:
        lines.append(f"| an exploit (the peer epoch's val) | {len(steps)} | {describe(bootstrap_ci(steps))} | "
                     f"{np.mean([x > 0 for x in steps]):.2f} |")
    for name, cs in results["curves"].items():
        d = [c[i + 1] - c[i] for c in cs.values() for i in range(len(c) - 1)      # None: an epoch with < 2 trades
             if None not in c[:i + 2] and c[i] >= max(c[:i + 1])]
        if d:
            lines.append(f"| a running best of {name} | {len(d)} | {describe(bootstrap_ci(d))} | "
                         f"{np.mean([x > 0 for x in d]):.2f} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a finished study's results.json")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 3, 5], help="population sizes")
    ap.add_argument("--by-variant", action="store_true", help="each variant's groups apart, paired to the reference")
    ap.add_argument("--after-exploit", action="store_true", help="the epoch after an exploit against its start")
    ap.add_argument("--log", type=Path, help="the study's console lines (exploits of a study that did not record them)")
    a = ap.parse_args()
    results = json.loads(a.results.read_text())
    if a.after_exploit:
        print(f"# population_headroom --after-exploit: {a.results}\n")
        print("\n".join(after_exploit(results, a.log)))
        return
    if a.by_variant:
        print(f"# population_headroom --by-variant: {a.results}\n")
        print("\n".join(by_variant(results)))
        return
    g = groups(results)
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
