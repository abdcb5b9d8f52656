"""Each stored study's verdicts under today's rule (`tradeloop.study.stats.verdict`: the 95 % CI of a variant's mean
DSR at or above the bar), beside the verdict its results.json holds, from the runs' stored DSRs and the study's own
bootstrap settings, over its test periods where units share them (and over a population's groups), as a study's
report reads it today; prints the variants whose verdict differs, then the count.

    python3 -m bench.verdicts docs/study-*/
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tradeloop.study.intervals import bootstrap_ci
from tradeloop.study.spec import StudyError, StudySpec
from tradeloop.study.stats import BOUNDS, by_cluster, verdict


def verdicts(res: dict) -> dict[str, tuple[str | None, str, dict]]:
    """variant → (stored verdict, today's, the mean DSR's CI) of one results.json."""
    s = res.get("study", {})
    try:
        spec = StudySpec.from_dict(s)
        cluster, pops = spec.cluster_of, set(spec.populations())
    except (KeyError, TypeError, ValueError, StudyError):
        cluster, pops = (lambda seed, fold: (seed, fold)), set()
    units = {(r["seed"], r["fold"]) for r in res["runs"]}
    shared = len({cluster(*u) for u in units}) < len(units)
    out = {}
    for name, d in res.get("variants", {}).items():
        per = {(r["seed"], r["fold"]): r["dsr"] for r in res["runs"]
               if r["variant"] == name and r.get("dsr") is not None}
        xs = list((by_cluster(per, cluster) if shared or name in pops else per).values())
        if xs:
            ci = bootstrap_ci(xs, n_boot=s.get("n_boot", 10_000), seed=s.get("ci_seed", 0), bounds=BOUNDS["dsr"])
            out[name] = (d.get("verdict"), verdict(ci), ci)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", type=Path, nargs="+", help="finished studies' directories (their results.json)")
    n = changed = 0
    for study in ap.parse_args(argv).studies:
        path = study / "results.json"
        if not path.is_file():
            continue
        for name, (old, new, ci) in verdicts(json.loads(path.read_text())).items():
            n += 1
            if old != new:
                changed += 1
                print(f"{study.name}:{name}: {old} -> {new} (mean DSR {ci['mean']:.3f}, CI's lower end {ci['lo']:.3f})")
    print(f"{changed} of {n} variants' verdicts differ")


if __name__ == "__main__":
    main()
