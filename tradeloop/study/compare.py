"""A variant of one finished study against a variant of another, paired by (seed, fold): what a study gains when a
new variant is run later on the same seeds, folds and data (`tradeloop study-compare A_DIR:VARIANT B_DIR:VARIANT`),
or what a replication adds: more pairs of studies after the first (`… A2_DIR:VARIANT B2_DIR:VARIANT`) pool their units.

The two studies must agree on everything that makes their units the same (dataset, seeds, folds, epochs, preset,
base settings, bars, data seed); the differences are taken on the (seed, fold) units both hold, with the same
bootstrap as a study's own paired differences (`stats.paired`), over test periods: runs that trade the same bars
count once, as their mean (`period_key`). Each study's DSR stays deflated by its own
checkpoints only, so it is not compared here. `--any-epochs` pairs studies that differ in epochs alone (a variant
trained for fewer or more epochs than its reference): each run's checkpoint is still chosen on validation among its
own epochs, and the table says how many each side had. `--any-settings` pairs studies that differ in their base
settings too (`--set`: the same runs trained otherwise, e.g. one training cut into more, shorter epochs); the table
says each side's.

Beside the table: the paired difference of the first epoch's validation (from each study's curves). Where the two
variants train their first epoch alike (a change that acts from epoch 2 on), it is a shift between the two studies
themselves (the GPU's run-to-run noise, the code each study ran), which every difference in the table carries too;
on the H200 it reached ±0.1–0.15 (bench/README.md, 2026-12-03 · a32c971).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tradeloop.study.spec import StudyError, StudySpec
from tradeloop.study.stats import by_cluster, describe, power_cells, units_text
from tradeloop.study.intervals import bootstrap_ci, paired, units_to_detect

SAME_UNITS = {"dataset": None, "seeds": None, "folds": None, "epochs": None, "preset": None, "settings": None,
              "bars": None, "data_seed": None, "seeds_per_market": 1}
"""The study settings that must match for two studies' (seed, fold) units to pair, with the value a results.json
that does not name one stands for."""
COMPARED = (("oos_sharpe", "OOS per-trade Sharpe (val-selected)"), ("val_sharpe", "val per-trade Sharpe (selected)"),
            ("last_val_sharpe", "last-epoch val per-trade Sharpe"))


def unit_key(study: dict, key: str):
    """A results.json study's value of a `SAME_UNITS` key (the default it stands for when it names none)."""
    return study.get(key, SAME_UNITS[key])


def unit_differences(sa: dict, sb: dict, free: set[str] | frozenset = frozenset()) -> list[str]:
    """The `SAME_UNITS` keys (but `free`) in which two results.json studies differ: their units pair when none."""
    return [k for k in SAME_UNITS if k not in free
            and json.dumps(unit_key(sa, k), sort_keys=True) != json.dumps(unit_key(sb, k), sort_keys=True)]


def parse_side(text: str) -> tuple[Path, str]:
    """`DIR:VARIANT` → (DIR, VARIANT) (split at the last ':')."""
    d, sep, v = text.rpartition(":")
    if not sep or not d or not v:
        raise StudyError(f"{text!r}: give a study directory and one of its variants as DIR:VARIANT")
    return Path(d), v


def load_side(text: str) -> tuple[dict, str, str]:
    """(results.json of the study, the variant, a label) for `DIR:VARIANT`; StudyError naming what is missing."""
    d, v = parse_side(text)
    path = d / "results.json"
    try:
        res = json.loads(path.read_text())
    except FileNotFoundError:
        raise StudyError(f"{path} is missing: {d} is not a finished study (run it, or `tradeloop study --out {d} "
                         "--report-only`)") from None
    except (OSError, ValueError) as exc:
        raise StudyError(f"{path} is unreadable ({exc})") from None
    names = [x["name"] for x in res.get("study", {}).get("variants", [])]
    if v not in names:
        raise StudyError(f"{d}: no variant {v!r} (it has {', '.join(names) or 'none'})")
    return res, v, f"{d.name}:{v}"


def period_key(a: dict):
    """(seed, fold) → the test period a pair's unit trades, as a key that two pairs of studies on the same data share:
    (dataset, bars, folds, *`StudySpec.cluster_of(seed, fold)`) — the synthetic market and fold, or the real series'
    fold (every seed of a fold trades its bars). None where a results.json has no study `StudySpec` reads (each
    (pair, seed, fold) is then a unit of its own)."""
    try:
        spec = StudySpec.from_dict(a["study"])
    except (KeyError, TypeError, ValueError, StudyError):
        return None
    data = (unit_key(a["study"], "dataset"), json.dumps(unit_key(a["study"], "bars")), unit_key(a["study"], "folds"))
    return lambda s, f: (*data, *spec.cluster_of(s, f))


def compare(a: dict, va: str, b: dict, vb: str, *, n_boot: int = 10_000, seed: int = 0,
            any_epochs: bool = False, any_settings: bool = False) -> dict:
    """Paired a − b per metric over the shared units, each side's mean, and per seed whether a's last-epoch
    validation (mean over folds) is ≥ b's. StudyError when the studies' units differ (in anything but epochs, with
    `any_epochs`, and base settings, with `any_settings`) or none is shared."""
    return compare_pooled([(a, va, b, vb)], n_boot=n_boot, seed=seed, any_epochs=any_epochs,
                          any_settings=any_settings)


def compare_pooled(pairs: list[tuple[dict, str, dict, str]], *, n_boot: int = 10_000, seed: int = 0,
                   any_epochs: bool = False, any_settings: bool = False, detect: float | None = None) -> dict:
    """`compare` over several pairs of studies at once (a replication: the same two variants run again in another
    study), their units pooled: each pair's studies must pair with each other (`SAME_UNITS`; not in epochs with
    `any_epochs`, and then `epochs` lists each pair's (a, b) epochs; not in base settings with `any_settings`, and
    then `settings` lists each pair's). A unit of the bootstrap is a test period (`period_key`): the (pair, seed,
    fold) units that trade the same bars — the seeds of a real series' fold, a population's market, the same seed and
    fold in two pairs of studies on the same data — count once, as their mean. The per-seed count is over (pair,
    seed). `detect`: a difference to plan for; each metric's `a_minus_b` then says in `units_for_detect` the units
    it would take to resolve it (`units_to_detect`; None below 2 units)."""
    raw: dict[str, tuple[dict, dict]] = {key: ({}, {}) for key, _ in COMPARED}   # (pair, seed, fold) → value
    period_of: dict[tuple, tuple] = {}                                           # (pair, seed, fold) → period
    free = {k for k, on in (("epochs", any_epochs), ("settings", any_settings)) if on}
    sides: dict[str, list[tuple]] = {"epochs": [], "settings": []}
    for i, (a, va, b, vb) in enumerate(pairs):
        sa, sb = a["study"], b["study"]
        for k in sides:
            sides[k].append((unit_key(sa, k), unit_key(sb, k)))
        diff = unit_differences(sa, sb, free)
        if diff:
            raise StudyError(f"the studies' units do not pair: they differ in {', '.join(diff)} "
                             f"({'; '.join(f'{k}: {unit_key(sa, k)!r} vs {unit_key(sb, k)!r}' for k in diff)})")
        period = period_key(a) or period_key(b) or (lambda s, f, i=i: (i, s, f))
        for key, _ in COMPARED:
            ra, rb = ({(r["seed"], r["fold"]): r[key] for r in res["runs"] if r["variant"] == v and r.get(key) is not None}
                      for res, v in ((a, va), (b, vb)))
            for u in set(ra) & set(rb):
                raw[key][0][(i, *u)], raw[key][1][(i, *u)] = ra[u], rb[u]
                period_of[(i, *u)] = period(*u)
    # a period as its rank among the periods by their first (pair, seed, fold): the order the bootstrap draws in
    ranks: dict = {}
    for u in sorted(period_of):
        ranks.setdefault(period_of[u], len(ranks))
    period_of = {u: ranks[g] for u, g in period_of.items()}
    by_period = lambda values: by_cluster(values, lambda *u: period_of[u])  # noqa: E731 — each period's mean
    xs = {key: (by_period(xa), by_period(xb)) for key, (xa, xb) in raw.items()}
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731
    out: dict = {"metrics": {}, "pairs": len(pairs), "one_study": all(same(a, b) for a, _, b, _ in pairs)}
    for k, both in sides.items():
        if any(json.dumps(x) != json.dumps(y) for x, y in both):
            out[k] = both
    for key, _ in COMPARED:
        xa, xb = xs[key]
        units = sorted(set(xa) & set(xb))
        if not units:
            raise StudyError(f"no (seed, fold) unit has {key} in both sides of any pair")
        out["metrics"][key] = {"a": bootstrap_ci([xa[u] for u in units], n_boot=n_boot, seed=seed),
                               "b": bootstrap_ci([xb[u] for u in units], n_boot=n_boot, seed=seed),
                               "a_minus_b": paired({u: xa[u] for u in units}, {u: xb[u] for u in units},
                                                   n_boot=n_boot, seed=seed)}
        d = out["metrics"][key]["a_minus_b"]
        if detect is not None:
            d["units_for_detect"] = None if d["sd"] is None else units_to_detect(detect, d["sd"])
    if detect is not None:
        out["detect"] = detect
    first = first_epoch(pairs, raw["oos_sharpe"][0])
    if first is not None:
        out["first_val"] = paired(*(by_period(x) for x in first), n_boot=n_boot, seed=seed)
    la, lb = raw["last_val_sharpe"]
    seeds = sorted({u[:2] for u in set(la) & set(lb)})
    out["last_val_seeds"] = {"a_at_least_b": sum(
        np.mean([la[u] for u in la if u[:2] == s and u in lb]) >= np.mean([lb[u] for u in lb if u[:2] == s and u in la])
        for s in seeds), "seeds": len(seeds)}
    out["units"] = out["metrics"]["oos_sharpe"]["a_minus_b"]["n"]
    out["runs"] = len(set(raw["oos_sharpe"][0]) & set(raw["oos_sharpe"][1]))
    return out


def first_epoch(pairs: list[tuple[dict, str, dict, str]], shared: dict) -> tuple[dict, dict] | None:
    """({(pair, seed, fold): a's epoch-1 val per-trade Sharpe}, {…: b's}) over the units of `shared` where both
    sides' curves have it; None without curves."""
    xa, xb = {}, {}
    for i, (a, va, b, vb) in enumerate(pairs):
        ca, cb = (res.get("curves", {}).get(v, {}) for res, v in ((a, va), (b, vb)))
        for key, curve in ca.items():
            u = (i, *map(int, key.split("/")))
            if u in shared and curve and cb.get(key) and curve[0] is not None and cb[key][0] is not None:
                xa[u], xb[u] = float(curve[0]), float(cb[key][0])
    return (xa, xb) if xa else None


def settings_text(settings) -> str:
    """A study's base settings (`[[key, value], …]`) as `key=value, …` (`none` for none)."""
    return ", ".join(f"{k}={json.dumps(v)}" for k, v in settings or []) or "none"


def markdown(c: dict, la: str, lb: str) -> str:
    runs = c.get("runs", c["units"])
    over = f"{c['units']} units" + (f" of {c['pairs']} pairs of studies, pooled" if c.get("pairs", 1) > 1 else "")
    if runs != c["units"]:
        over += (f" — the {runs} paired (seed, fold) runs trade {c['units']} test periods, and the runs of one "
                 "period count once, as their mean")
    lines = [f"{la} − {lb}, paired by (seed, fold) over {over} (mean [95 % CI]; expanded percentile bootstrap; "
             "resolvable: the smallest difference these units tell from 0 with 80 % power, a paired t-test at 5 %, "
             "and the units it would take to tell the observed one so):",
             "", f"| metric | {la} | {lb} | difference | {la} higher | resolvable | units for the observed |",
             "|---|---|---|---|---|---:|---:|"]
    for key, label in COMPARED:
        m = c["metrics"][key]
        d = m["a_minus_b"]
        lines.append(f"| {label} | {describe(m['a'])} | {describe(m['b'])} | **{describe(d)}** | "
                     f"{d['wins']} of {d['n']} | {power_cells(d)} |")
    if c.get("detect") is not None:
        need = [f"{label} {units_text(d.get('units_for_detect'), c['detect'], d['sd'])}"
                for key, label in COMPARED for d in [c["metrics"][key]["a_minus_b"]]]
        lines += ["", f"Units to resolve a difference of {c['detect']:+g} at 80 % power, at these units' spread: "
                      + "; ".join(need) + "."]
    s = c["last_val_seeds"]
    apart = " (a seed of each pair counted apart)" if c.get("pairs", 1) > 1 else ""
    lines += ["", f"Last-epoch validation (mean over folds) of {la} ≥ {lb} in {s['a_at_least_b']} of {s['seeds']} "
              f"seeds{apart}."]
    if c.get("first_val"):
        lines.append(f"Epoch-1 validation, {la} − {lb}: {describe(c['first_val'])} ({c['first_val']['wins']} of "
                     f"{c['first_val']['n']} higher). Where both variants train their first epoch alike, this is "
                     + ("the noise between runs of one study that train alike (a GPU's), not a difference of the "
                        "variants" if c.get("one_study") else "a shift between the two studies, not between the "
                        "variants") + ", and every row above carries it too.")
    if c.get("epochs"):
        lines.append(f"The sides differ in epochs ({', '.join(f'{ea} against {eb}' for ea, eb in c['epochs'])}): each "
                     "run's checkpoint was chosen on validation among its own, and the last epoch is each side's.")
    if c.get("settings"):
        said = "; ".join(f"{settings_text(x)} against {settings_text(y)}" for x, y in c["settings"])
        lines.append(f"The sides differ in their base settings ({said}): the same units, trained otherwise.")
    return "\n".join(lines) + "\n"
