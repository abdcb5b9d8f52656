"""A finished study's OOS over its test periods, from its results.json alone (`tradeloop.study.stats.over_periods`):
for a study written before the report read them, or whose runs are no longer on disk.

    python3 -m bench.periods docs/study-h100-real-eurusd docs/study-h100-real-sp500

Prints, per study, each variant's mean OOS per-trade Sharpe over the periods (each period's mean over its units) and
each paired difference against the reference, mean [95 % CI] over the periods.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tradeloop.study.spec import StudySpec
from tradeloop.study.stats import describe, over_periods


def read(study: Path) -> str:
    res = json.loads((study / "results.json").read_text())
    spec = StudySpec.from_dict(res["study"])
    per = over_periods(res["runs"], [v.name for v in spec.variants], res["reference"], spec.cluster_of, set(),
                       n_boot=spec.n_boot, seed=spec.ci_seed)
    if per is None:
        return f"{study}: every (seed, fold) unit has a test period of its own"
    return (f"{study}: {per['periods']} test periods of {per['units']} units; "
            + "; ".join(f"{n} {describe(d)}" for n, d in per["variants"].items())
            + "".join(f"; paired {n} − {res['reference']} {describe(p)} ({p['wins']}/{p['n']})"
                      for n, p in per["paired"].items()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", type=Path, nargs="+", help="finished studies' directories (their results.json)")
    for study in ap.parse_args(argv).studies:
        print(read(study))


if __name__ == "__main__":
    main()
