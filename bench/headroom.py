"""How much could a choice among the variants already tried earn over a reference, run by run? Every variant of the
given finished studies is a candidate (`study:variant`); on each (seed, fold) unit that the reference and at least
two candidates hold, `tradeloop.study.stats.choice_by_validation` (the reading a study's own report gives for its
variants) takes:

- the OOS per-trade Sharpe of the candidate whose selected checkpoint validated highest — what keeping the candidate
  validation prefers would earn (OOS is not used to choose, so no selection bias);
- the highest OOS among the candidates, a ceiling that no choice made without the test split reaches (inflated by
  the noise of a maximum over the candidates);
- Spearman's correlation between the candidates' validation and OOS Sharpes within the unit — near zero,
  validation cannot tell the candidates apart, and no act that chooses by it can earn more than chance.

Differences are against the reference on the same units, mean and 95 % CI (the studies' bootstrap). The studies must
pair (`tradeloop.study.compare.SAME_UNITS`; `--any-settings` lets base settings differ, as `tradeloop
study-compare` does); candidates of different studies also differ by the code each study ran and the GPU's
run-to-run noise (±0.1–0.15 on epoch 1 between studies on the H200, bench/README.md 2026-12-03 · a32c971).

    python3 -m bench.headroom docs/study-h200-gamma [more study directories or results.json] \
        --reference docs/study-h200-gamma:off [--any-settings] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tradeloop.study.compare import unit_differences, unit_key
from tradeloop.study.report import choice_lines
from tradeloop.study.stats import choice_by_validation


def load(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} is missing (a finished study's results.json)") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path} is unreadable ({exc})") from None


def study_name(path: Path) -> str:
    """A study's name: its directory's, given the directory or its results.json."""
    return (path.parent if path.name == "results.json" else path).name


def check_pairing(studies: dict[str, dict], any_settings: bool) -> None:
    """SystemExit naming the key and the studies when two studies' units do not pair."""
    (first, a), *rest = studies.items()
    for name, b in rest:
        if diff := unit_differences(a["study"], b["study"], {"settings"} if any_settings else set()):
            k = diff[0]
            va, vb = unit_key(a["study"], k), unit_key(b["study"], k)
            raise SystemExit(f"error: {first} and {name} do not pair: they differ in {k} ({va!r} vs {vb!r})"
                             + (" (--any-settings lets base settings differ)" if k == "settings" else ""))


def candidates(studies: dict[str, dict]) -> list[dict]:
    """Every run of every study as a row of `choice_by_validation`, its variant named `study:variant`."""
    return [{"variant": f"{name}:{r['variant']}", "seed": r["seed"], "fold": r["fold"],
             "val_sharpe": r["val_sharpe"], "oos_sharpe": r["oos_sharpe"]}
            for name, res in studies.items() for r in res["runs"]]


def headroom(rows: list[dict], reference: str, *, n_boot: int = 10_000, seed: int = 0) -> dict:
    have = sorted({r["variant"] for r in rows})
    if reference not in have:
        raise SystemExit(f"error: --reference {reference}: no such study:variant (have {', '.join(have)})")
    h = choice_by_validation(rows, reference, n_boot=n_boot, seed=seed)
    if h is None:
        raise SystemExit("error: no (seed, fold) unit holds the reference and two candidates")
    return {**h, "candidates": have}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m bench.headroom", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="finished studies (their directories or results.json)")
    ap.add_argument("--reference", required=True, help="DIR:VARIANT (DIR a study as given, or its name)")
    ap.add_argument("--any-settings", action="store_true", help="pair studies whose base settings differ")
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--json", action="store_true", help="the readings as JSON")
    a = ap.parse_args(argv)
    studies = {}
    for p in a.results:
        name = study_name(p)
        if name in studies:
            raise SystemExit(f"error: two studies named {name}")
        studies[name] = load(p)
    check_pairing(studies, a.any_settings)
    d, _, v = a.reference.rpartition(":")
    h = headroom(candidates(studies), f"{study_name(Path(d))}:{v}", n_boot=a.n_boot)
    text = "\n".join([f"{len(h['candidates'])} candidates from {len(studies)} studies.", ""] + choice_lines(h)) + "\n"
    sys.stdout.write(json.dumps(h, indent=1) + "\n" if a.json else text)


if __name__ == "__main__":
    main()
