"""How much could a choice among the variants already tried earn over a reference, run by run? Every variant of the
given finished studies is a candidate; on each (seed, fold) unit that the reference and at least two candidates hold:

- `val-chosen`: the OOS per-trade Sharpe of the candidate whose selected checkpoint validated highest — what a loop
  that could train every candidate and keep the one validation prefers would earn (OOS is not used to choose, so
  its mean is an honest estimate of that choice, with no selection bias);
- `OOS-best`: the highest OOS among the candidates, a ceiling that no choice made without the test split reaches
  (inflated by the noise of a maximum over the candidates);
- `rank corr`: Spearman's correlation between the candidates' validation and OOS Sharpes within the unit — near
  zero, validation cannot tell the candidates apart, and no act that chooses by it can earn more than chance.

Each row's differences are against the reference on the same units, mean and 95 % CI (the studies' bootstrap,
`tradeloop.study.stats.paired`/`bootstrap_ci`). The studies must pair (`tradeloop.study.compare.SAME_UNITS`;
`--any-settings` lets base settings differ, as `tradeloop study-compare` does); candidates of different studies
also differ by the code each study ran and the GPU's run-to-run noise (±0.1–0.15 on epoch 1 between studies on the
H200, bench/README.md 2026-12-03 · a32c971), so a candidate from another study is a weaker comparison.

    python3 -m bench.headroom docs/study-h200-gamma/results.json [more results.json] --reference \
        docs/study-h200-gamma:off [--any-settings] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from tradeloop.study.compare import SAME_UNITS
from tradeloop.study.stats import bootstrap_ci, describe, paired


def load(path: Path) -> dict:
    path = path / "results.json" if path.is_dir() else path
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"error: {path} is missing (a finished study's results.json)") from None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path} is unreadable ({exc})") from None


def check_pairing(studies: dict[str, dict], any_settings: bool) -> None:
    """SystemExit naming the key and the studies when two studies' units do not pair."""
    keys = [k for k in SAME_UNITS if not (any_settings and k == "settings")]
    (first, a), *rest = studies.items()
    for name, b in rest:
        for k in keys:
            va, vb = (s["study"].get(k, SAME_UNITS[k]) for s in (a, b))
            if json.dumps(va, sort_keys=True) != json.dumps(vb, sort_keys=True):
                raise SystemExit(f"error: {first} and {name} do not pair: they differ in {k} ({va!r} vs {vb!r})"
                                 + (" (--any-settings lets base settings differ)" if k == "settings" else ""))


def candidates(studies: dict[str, dict]) -> pd.DataFrame:
    """One row per run of every variant: study, variant, label (study:variant), seed, fold, val, oos."""
    rows = [{"label": f"{name}:{r['variant']}", "seed": r["seed"], "fold": r["fold"],
             "val": r["val_sharpe"], "oos": r["oos_sharpe"]}
            for name, res in studies.items() for r in res["runs"]
            if r.get("val_sharpe") is not None and r.get("oos_sharpe") is not None]
    return pd.DataFrame(rows, columns=["label", "seed", "fold", "val", "oos"])


def headroom(df: pd.DataFrame, reference: str, *, n_boot: int = 10_000, seed: int = 0) -> dict:
    """The three readings over the units that the reference and ≥ 2 candidates hold (see the module's text)."""
    if reference not in set(df["label"]):
        have = ", ".join(sorted(set(df.label)))
        raise SystemExit(f"error: --reference {reference}: no such study:variant (have {have})")
    ref = df[df.label == reference].set_index(["seed", "fold"])["oos"]
    chosen, best, corr, n_cand = {}, {}, {}, []
    for unit, g in df.groupby(["seed", "fold"]):
        if unit not in ref.index or len(g) < 2:
            continue
        chosen[unit] = float(g.loc[g["val"].idxmax(), "oos"])
        best[unit] = float(g["oos"].max())
        n_cand.append(len(g))
        if len(g) >= 3 and g["val"].nunique() > 1 and g["oos"].nunique() > 1:
            corr[unit] = float(g["val"].rank().corr(g["oos"].rank()))
    if not chosen:
        raise SystemExit("error: no (seed, fold) unit holds the reference and two candidates")
    refd = {u: float(ref[u]) for u in chosen}
    winners = df.loc[df.groupby(["seed", "fold"])["val"].idxmax()]
    return {"reference": reference, "units": len(chosen), "candidates": sorted(set(df.label)),
            "candidates_per_unit": [int(min(n_cand)), int(max(n_cand))],
            "reference_oos": bootstrap_ci(list(refd.values()), n_boot=n_boot, seed=seed),
            "val_chosen_oos": bootstrap_ci(list(chosen.values()), n_boot=n_boot, seed=seed),
            "oos_best_oos": bootstrap_ci(list(best.values()), n_boot=n_boot, seed=seed),
            "val_chosen_minus_reference": paired(chosen, refd, n_boot=n_boot, seed=seed),
            "oos_best_minus_reference": paired(best, refd, n_boot=n_boot, seed=seed),
            "rank_corr": bootstrap_ci(list(corr.values()), n_boot=n_boot, seed=seed) if corr else None,
            "chosen_by_val": winners["label"].value_counts().to_dict()}


def markdown(h: dict) -> str:
    lo, hi = h["candidates_per_unit"]
    per = f"{lo}" if lo == hi else f"{lo}–{hi}"
    lines = [f"{len(h['candidates'])} candidates ({per} on each of {h['units']} (seed, fold) units), reference "
             f"{h['reference']} (mean [95 % CI], OOS per-trade Sharpe of each unit's selected checkpoint):", "",
             "| reading | OOS | − reference | higher |", "|---|---|---|---|",
             f"| reference | {describe(h['reference_oos'])} | | |"]
    for key, label in (("val_chosen", "val-chosen"), ("oos_best", "OOS-best (ceiling)")):
        d = h[f"{key}_minus_reference"]
        lines.append(f"| {label} | {describe(h[f'{key}_oos'])} | **{describe(d)}** | {d['wins']} of {d['n']} |")
    if h["rank_corr"] is not None:
        lines += ["", f"Within a unit, rank correlation of the candidates' val and OOS: {describe(h['rank_corr'])}."]
    top = ", ".join(f"{k} {v}" for k, v in list(h["chosen_by_val"].items())[:6])
    lines += [f"Chosen by validation: {top}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python3 -m bench.headroom", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="finished studies (their directories or results.json)")
    ap.add_argument("--reference", required=True, help="DIR:VARIANT (DIR as given, or its last component)")
    ap.add_argument("--any-settings", action="store_true", help="pair studies whose base settings differ")
    ap.add_argument("--n-boot", type=int, default=10_000)
    ap.add_argument("--json", action="store_true", help="the readings as JSON")
    a = ap.parse_args(argv)
    studies = {}
    for p in a.results:
        name = (p.parent if p.name == "results.json" else p).name
        if name in studies:
            raise SystemExit(f"error: two studies named {name}")
        studies[name] = load(p)
    check_pairing(studies, a.any_settings)
    d, _, v = a.reference.rpartition(":")
    h = headroom(candidates(studies), f"{Path(d).name}:{v}", n_boot=a.n_boot)
    sys.stdout.write(json.dumps(h, indent=1, default=float) + "\n" if a.json else markdown(h))


if __name__ == "__main__":
    main()
