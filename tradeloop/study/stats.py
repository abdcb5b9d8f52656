"""A study's statistics: selection on validation, bootstrap confidence intervals, paired differences, the DSR
deflated by every trial of the study, and the results table. Pure numpy over the runs' summaries; the intervals
(`bootstrap_ci`, `paired`, `detectable`, …) are `tradeloop.study.intervals`.

- Selection (`select_epoch`): each run's checkpoint is the epoch with the best validation per-trade Sharpe among
  those with ≥ `min_trades` validation trades (the earliest on a tie); when no epoch has that many, the best of all,
  and the run is flagged not selectable. OOS is never an input: it is read afterwards for that checkpoint only.
- Units: a (seed, fold) pair. A variant's figure is the mean over its units; its 95 % CI the expanded percentile
  bootstrap over units (`bootstrap_ci`: B resamples of the units with replacement, drawn from
  `numpy.random.default_rng(seed)` as one `integers(0, n, size=(B, n))` call, and the quantiles α′/2 and 1 − α′/2 of
  the resampled statistic, where Φ⁻¹(1 − α′/2) = √(n / (n − 1)) · t₀.₉₇₅,ₙ₋₁: Hesterberg's expanded percentile
  interval, "What Teachers Should Know About the Bootstrap", The American Statistician 69, 2015). The plain 2.5 %
  and 97.5 % quantiles are too narrow at a study's few units (the resampled mean's spread is √((n − 1) / n) of the
  mean's, and its tails those of a normal, not a t); the expansion turns n = 6 into the 0.24 % and 99.76 %
  quantiles, n = 15 into 1.3 % and 98.7 %, and tends to the plain ones as n grows. A percentile interval never
  reaches past the data's own extremes, so at 3–5 units it still falls short (a normal mean at 3 units:
  `tests/test_study_stats.py`); each side is widened to Student's t interval, mean ± t_{(1 + level) / 2, n − 1} ·
  s / √n, where that reaches further (`t_interval`; at the Bonferroni levels below too).
- Paired differences (`paired`): variant − reference on the units both ran, the bootstrap CI of their mean, and
  what the comparison can resolve (`detectable`, `units_to_detect`): the smallest true mean difference a paired
  two-sided t-test at the 5 % level over those n units finds with 80 % power, (t₀.₉₇₅,ₙ₋₁ + t₀.₈,ₙ₋₁) · s / √n with
  s the differences' standard deviation, and the units it would take to resolve the observed mean difference so.
  With m > 1 variants against the reference, each Δ OOS also has its interval at the Bonferroni level 1 − 0.05 / m
  (`family_level`): the m intervals hold their true differences together with probability ≥ 95 %, so a variant
  whose own CI clears 0 and whose family-wise one does not may be the one of m that chance lifted.
- The val/OOS gap of a variant is the gap of its means, 1 − mean OOS / mean val (a per-run gap explodes where val is
  near 0), with its CI from the same resamples (those whose mean val > 0; "n/a" when fewer than 95 % are).
- DSR (`shared.metrics.dsr`): a selected checkpoint's validation trades against the expected maximum Sharpe of N
  trials, N = every distinct checkpoint of every variant of the study (variants × seeds × folds × epochs, a
  byte-identical checkpoint of two variants counted once), with the
  variance of the validation Sharpes of those selection could choose (≥ `min_val_trades` trades:
  `shared.metrics.trials_variance`; a Sharpe of a few trades is mostly its own noise). Verdict per variant
  (`verdict`): "validated edge" only when the 95 % CI of its runs' mean DSR lies at or above 0.95, else "no
  validated edge".
- Test periods: where units share one (every seed of a fold on a real series, or seeds that share a synthetic market:
  `cluster_of`), they are not independent draws of what another period would give. Every mean's CI, gap and paired
  difference is then over the periods — each period's mean over its units — not over the units.
Sharpes are un-annualized, per trade.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from shared.metrics import dsr, trials_variance
from tradeloop.study.intervals import MOST_UNITS, bootstrap_ci, gap_ci, paired

DSR_BAR = 0.95


def select_epoch(val_sharpes: Sequence[float], val_trades: Sequence[int], min_trades: int) -> tuple[int, bool]:
    """(1-based epoch of the best validation per-trade Sharpe among epochs with ≥ min_trades validation trades,
    whether any epoch had that many): `shared.metrics.select_best`, the rule `tradeloop evaluate --checkpoint best`
    uses. Validation only: OOS figures are never passed in."""
    from shared.metrics import select_best

    if not len(val_sharpes) or len(val_sharpes) != len(val_trades):
        raise ValueError("select_epoch needs one validation Sharpe and trade count per epoch")
    best, enough = select_best(list(val_sharpes), list(val_trades), min_trades)
    return best + 1, enough


def study_trials(summaries: Sequence[dict], min_trades: int = 20) -> tuple[int, float | None]:
    """(N, V): N every distinct checkpoint of every run of the study — byte-identical ones (by sha256: variants
    that trained an epoch alike, as on and off do while no act differs) are one trial, not one a run —, V the
    variance of the validation Sharpes of those with ≥ `min_trades` validation trades, the checkpoints selection
    could choose (`shared.metrics.trials_variance`)."""
    s, n, seen = [], [], set()
    for r in (r for m in summaries for r in m["epochs"]):
        sha = r.get("checkpoint_sha256")
        if sha and sha in seen:
            continue
        seen.add(sha)
        s.append(float(r["val_sharpe"]))
        n.append(int(r.get("val_trades", min_trades)))
    return len(s), trials_variance(s, n, min_trades)


def study_dsr(val_trade_returns: Sequence[float], n_trials: int, sharpe_var: float | None) -> float:
    """DSR of a selected checkpoint's validation trades deflated by the study's N trials of variance V."""
    return dsr(val_trade_returns, n_trials=max(1, n_trials), sharpe_var_trials=sharpe_var)


def verdict(dsr_ci: dict) -> str:
    """"validated edge" when the 95 % CI of a variant's mean DSR lies at or above `DSR_BAR` (its lower end: a few runs
    far below the bar cannot hide in the mean of many at 1.0; a single unit has no interval and no verdict of
    one), else "no validated edge"."""
    lo = dsr_ci.get("lo")
    return "validated edge" if lo is not None and dsr_ci.get("n", 0) > 1 and lo >= DSR_BAR else "no validated edge"


def describe(ci: dict, spec: str = "+.3f") -> str:
    """'mean [lo, hi]' of a CI dict."""
    f = lambda x: "n/a" if x is None else format(x, spec)  # noqa: E731
    if ci.get("mean") is None:
        return "n/a"
    if ci.get("lo") is None:
        return f"{f(ci['mean'])} [n/a]"
    if ci.get("n") == 1:
        return f"{f(ci['mean'])} [one unit: no interval]"
    return f"{f(ci['mean'])} [{f(ci['lo'])}, {f(ci['hi'])}]"


def power_cells(d: dict) -> str:
    """A paired difference's "resolvable | units for the observed" cells (`paired`: n/a where the results
    predate them or the units are too few)."""
    det = d.get("detectable")
    units = units_text(d.get("units_to_detect"), d["mean"], d.get("sd"))
    return f"{'n/a' if det is None else format(det, '.3f')} | {units}"


def units_text(units: int | None, delta: float, sd: float | None) -> str:
    """`units_to_detect(delta, sd)`'s answer as text: "n/a" without a spread (`sd` None: too few units, or results
    that predate it); the count; where it said None, "n/a (Δ = 0)" for a difference of 0 (no number of units tells it
    from 0), else "> 100 000" (beyond `MOST_UNITS`)."""
    if sd is None:
        return "n/a"
    if units is not None:
        return str(units)
    return "n/a (Δ = 0)" if delta == 0.0 else f"> {MOST_UNITS:,}".replace(",", " ")


def ruined(max_drawdown: float) -> bool:
    """Whether an account's equity reached zero (a max drawdown of the whole peak, `shared.metrics.max_drawdown`):
    the simulator liquidates such an account and it trades no more (`shared.execution`), so its later trades are
    missing from its per-trade Sharpe rather than counted as losses."""
    return max_drawdown >= 1.0 - 1e-9


BOUNDS = {"dsr": (0.0, 1.0), "val_trades": (0.0, None), "oos_trades": (0.0, None), "val_step": (0.0, None),
          "val_epochs_sd": (0.0, None), "oos_max_drawdown": (0.0, 1.0)}
"""The values a mean's CI may take, where a quantity has bounds (`bootstrap_ci`'s `bounds`); a paired difference of
DSRs lies in [−1, 1]."""

METRICS = (("oos_sharpe", "OOS per-trade Sharpe"), ("val_sharpe", "val per-trade Sharpe"),
           ("dsr", "DSR (study)"), ("val_trades", "val trades"), ("oos_trades", "OOS trades"),
           ("last_val_sharpe", "last-epoch val per-trade Sharpe"))


def aggregate(summaries: Sequence[dict], baselines: Sequence[dict], variants: Sequence[str], reference: str, *,
              n_boot: int = 10_000, seed: int = 0, populations: Sequence[str] = (),
              cluster_of: Callable[[int, int], Any] | None = None, min_trades: int = 20) -> dict:
    """The study's results from its runs' summaries (and the baselines' rows): per variant and baseline the mean and
    CI of each metric, the gap, the verdict; paired differences against `reference`; validation curves.

    `populations`: variants whose runs exploit one another, so that the runs of one population are not independent:
    their means, CIs and paired differences are over populations — the mean of each `cluster_of(seed, fold)` group of
    (seed, fold) units — rather than over units (a paired difference is so whenever either side is one)."""
    n_trials, var = study_trials(summaries, min_trades)
    rows = []
    for m in summaries:
        rows.append({**{k: m[k] for k in ("run_id", "variant", "seed", "fold", "selected_epoch", "selectable",
                                          "val_sharpe", "oos_sharpe", "val_trades", "oos_trades")},
                     "last_val_sharpe": last if np.isfinite(last := epoch_sharpes(m)[-1]) else None,
                     # the policy as learned (no E5/E9 shaping); None in a summary written without it
                     "shaped": m.get("shaped"), "oos_sharpe_unshaped": m.get("oos_sharpe_unshaped"),
                     "val_sharpe_unshaped": m.get("val_sharpe_unshaped"),
                     # the account's OOS equity curve beside its trades (bar returns, flat bars included)
                     "oos_bar_sharpe": (m.get("oos_metrics") or {}).get("per_bar_sharpe"),
                     "oos_max_drawdown": (m.get("oos_metrics") or {}).get("max_drawdown"),
                     "dsr": study_dsr(m["selected_val_trade_returns"], n_trials, var),
                     "run_dsr": m["run_dsr"], "rollbacks": rollbacks(m), "rollback_steps": rollback_steps(m),
                     "exploits": len(exploited(m)),
                     "exploited": exploited(m), "val_step": val_step(m), **typical_epoch(m),
                     **first_and_later(m), "gap_widening": gap_widening(m)})
    def ci(xs, key: str = "") -> dict:               # an undefined value (None) is left out
        return bootstrap_ci([x for x in xs if x is not None], n_boot=n_boot, seed=seed,
                            bounds=BOUNDS.get(key, (None, None)))
    cluster = cluster_of or (lambda s, f: (s, f))
    pops = set(populations)
    units = {(r["seed"], r["fold"]) for r in rows}
    n_periods = len({cluster(*u) for u in units})
    shared = n_periods < len(units)            # units that trade one test period are not independent

    def pooled(name: str | None, values: dict) -> dict:
        """unit → value, as the units a CI of `name` resamples: each test period's (or population's) mean where units
        share one (every variant and baseline then), else the units themselves."""
        return by_cluster(values, cluster) if shared or name in pops else values

    out_v, best_by = {}, {}
    for name in variants:
        rs = sorted((r for r in rows if r["variant"] == name), key=lambda r: (r["seed"], r["fold"]))
        if not rs:
            continue
        d = {k: ci(list(pooled(name, {(r["seed"], r["fold"]): r[k] for r in rs}).values()), k) for k, _ in METRICS}
        if name in pops:
            d["populations"] = len({cluster(r["seed"], r["fold"]) for r in rs})
        gv, go = (pooled(name, {(r["seed"], r["fold"]): r[k] for r in rs}) for k in ("val_sharpe", "oos_sharpe"))
        d["gap"] = gap_ci([gv[c] for c in gv], [go[c] for c in gv], n_boot=n_boot, seed=seed)
        d["n_runs"] = len(rs)
        # fewer than two OOS trades: no per-trade Sharpe, counted as 0.0 — no edge shown (a baseline's is left out)
        d["oos_untraded"] = [r["run_id"] for r in rs if r["oos_trades"] < 2]
        d["selectable"] = sum(r["selectable"] for r in rs)
        d["dsr_at_bar"] = sum(r["dsr"] >= DSR_BAR for r in rs)
        d["verdict"] = verdict(d["dsr"])
        d["rollbacks"] = sum(r["rollbacks"] for r in rs)
        d["exploits"] = sum(r["exploits"] for r in rs)
        d["rollback_chances"] = sum(len(m["epochs"]) - 1 for m in summaries if m["variant"] == name)
        steps = {(r["seed"], r["fold"]): float(np.mean(r["rollback_steps"])) for r in rs if r["rollback_steps"]}
        if steps:
            flat = [x for r in rs for x in r["rollback_steps"]]
            d["after_rollback"] = {**ci(list(pooled(name, steps).values())), "rollbacks": len(flat),
                                   "higher": sum(x > 0 for x in flat)}
        if all(r["val_step"] is not None for r in rs):
            d["val_step"] = ci(list(pooled(name, {(r["seed"], r["fold"]): r["val_step"] for r in rs}).values()),
                               "val_step")
        if all(r["val_epochs_sd"] is not None for r in rs):
            d["epochs_val"] = {k: ci(list(pooled(name, {(r["seed"], r["fold"]): r[f"val_epochs_{k}"]
                                                        for r in rs}).values()), f"val_epochs_{k}")
                               for k in ("mean", "sd")}
        if all(r["gap_widening"] is not None for r in rs):
            wide = pooled(name, {(r["seed"], r["fold"]): r["gap_widening"] for r in rs})
            d["gap_widening"] = {**ci(list(wide.values())), "widened": sum(x > 0 for x in wide.values())}
        if all(r["oos_bar_sharpe"] is not None for r in rs):
            bars = pooled(name, {(r["seed"], r["fold"]): r["oos_bar_sharpe"] for r in rs})
            d["oos_bar_sharpe"] = ci(list(bars.values()))
        if all(r["oos_max_drawdown"] is not None for r in rs):
            dds = pooled(name, {(r["seed"], r["fold"]): r["oos_max_drawdown"] for r in rs})
            d["oos_max_drawdown"] = ci(list(dds.values()), "oos_max_drawdown")
            d["oos_ruined"] = [r["run_id"] for r in rs if ruined(r["oos_max_drawdown"])]
        if all(r["oos_sharpe_unshaped"] is not None for r in rs):
            per_unit = lambda f: list(pooled(name, {(r["seed"], r["fold"]): f(r) for r in rs}).values())  # noqa: E731
            d["unshaped"] = {"shaped_runs": sum(bool(r["shaped"]) for r in rs),
                             **{k: ci(per_unit(lambda r: r[f"{k}_unshaped"])) for k in ("oos_sharpe", "val_sharpe")},
                             "shaping_oos": ci(per_unit(lambda r: r["oos_sharpe"] - r["oos_sharpe_unshaped"]))}
        best = best_validated(rs, cluster)
        if best:
            best_by[name] = best["oos"]
            d["best_validated"] = {"runs": best["runs"], "groups": len(best["oos"]), "oos": ci(list(best["oos"].values())),
                                   "lift": ci([best["oos"][c] - best["mean"][c] for c in best["oos"]]),
                                   "within_sd": best["within_sd"], "between_sd": best["between_sd"]}
        out_v[name] = d
    out_b = {}
    for name in dict.fromkeys(b["policy"] for b in baselines):
        bs = sorted((b for b in baselines if b["policy"] == name), key=lambda b: (b["seed"], b["fold"]))
        # a per-trade Sharpe of < 2 trades is undefined (None): left out, "n/a" where no unit has one
        d = {k: ci(list(pooled(None, {(b["seed"], b["fold"]): b[k] for b in bs if b.get(k) is not None}).values()), k)
             for k in ("oos_sharpe", "val_sharpe", "val_trades", "oos_trades", "oos_bar_sharpe")}
        both = [b for b in bs if b["val_sharpe"] is not None and b["oos_sharpe"] is not None]
        gv, go = (pooled(None, {(b["seed"], b["fold"]): b[k] for b in both}) for k in ("val_sharpe", "oos_sharpe"))
        d["gap"] = gap_ci([gv[c] for c in gv], [go[c] for c in gv], n_boot=n_boot, seed=seed)
        d["n_runs"] = len(bs)
        out_b[name] = d
    out_p = {}
    by = lambda name, k: {(r["seed"], r["fold"]): r[k] for r in rows if r["variant"] == name}  # noqa: E731
    # the variants compared with the reference: their Δ OOS intervals are made together (`paired`'s `family`)
    m = sum(n != reference and n in out_v for n in variants) if reference in out_v else 0
    for name in variants:
        if name == reference or name not in out_v or reference not in out_v:
            continue
        over = name if name in pops else reference

        def pair(k: str, a: str = name, b: str = reference, family: int = 1) -> dict:
            xa, xb = by(a, k), by(b, k)
            both = {u for u in set(xa) & set(xb) if xa[u] is not None and xb[u] is not None}
            return paired(pooled(over, {u: xa[u] for u in both}), pooled(over, {u: xb[u] for u in both}),
                          n_boot=n_boot, seed=seed, family=family, bounds=(-1.0, 1.0) if k == "dsr" else (None, None))

        out_p[name] = {k: pair(k, family=m if k == "oos_sharpe" else 1)
                       for k in ("oos_sharpe", "val_sharpe", "last_val_sharpe", "dsr")}
        if "epochs_val" in out_v[name] and "epochs_val" in out_v[reference]:
            out_p[name]["val_epochs_mean"] = pair("val_epochs_mean")
        if all(r["val_later_mean"] is not None for r in rows if r["variant"] in (name, reference)):
            out_p[name].update({k: pair(k) for k in ("val_epoch1", "val_later_mean")})
        if "gap_widening" in out_v[name] and "gap_widening" in out_v[reference]:
            out_p[name]["gap_widening"] = pair("gap_widening")
        if over in pops:
            out_p[name]["over_populations"] = True
        if name in best_by and reference in best_by:
            out_p[name]["best_validated_oos"] = paired(best_by[name], best_by[reference], n_boot=n_boot, seed=seed)
        if "unshaped" in out_v[name] and "unshaped" in out_v[reference]:
            out_p[name]["oos_sharpe_unshaped"] = pair("oos_sharpe_unshaped")
        if "oos_bar_sharpe" in out_v[name] and "oos_bar_sharpe" in out_v[reference]:
            out_p[name]["oos_bar_sharpe"] = pair("oos_bar_sharpe")
    curves = {name: {str(m["seed"]) + "/" + str(m["fold"]): [x if np.isfinite(x) else None for x in epoch_sharpes(m)]
                     for m in summaries if m["variant"] == name} for name in variants}   # None: < 2 val trades
    return {"n_trials": n_trials, **({"periods": {"periods": n_periods, "units": len(units)}} if shared else {}),
            "trial_sharpe_var": var,
            "reference": reference, "variants": out_v,
            "baselines": out_b, "paired": out_p, "runs": rows, "curves": curves,
            "curves_insample": insample_curves(summaries, variants), "knob_paths": knob_paths(summaries, variants),
            "pairing": pairing_check(summaries),
            # a population's units are not independent: no unit-by-unit choice where one is among the variants
            "choice": choice_by_validation(rows, reference, n_boot=n_boot, seed=seed)
            if len(out_v) > 1 and not shared and not pops & set(out_v) else None}


def by_cluster(values: dict, cluster: Callable[[int, int], Any]) -> dict:
    """(seed, fold) unit → value, as each `cluster(seed, fold)` group's mean (None values left out; a group of none
    defined is None)."""
    groups: dict = {}
    for u, v in values.items():
        groups.setdefault(cluster(*u), []).append(v)
    return {c: float(np.mean(d)) if (d := [x for x in vs if x is not None]) else None for c, vs in groups.items()}


def over_periods(rows: Sequence[dict], variants: Sequence[str], reference: str, cluster: Callable[[int, int], Any],
                 populations: set, *, n_boot: int, seed: int) -> dict | None:
    """Where (seed, fold) units share a test period (`cluster`: one market and fold — every seed of a fold on a real
    series, or `--seeds-per-market` > 1), OOS per-trade Sharpe over the periods: each period's mean over its units,
    then the CI over the periods, per variant and paired against `reference` — `aggregate`'s headline reading, from
    a stored study's run rows alone (`bench/periods.py`). None where every unit has its own period (or a population
    variant, already over its populations, is in the study)."""
    units = {(r["seed"], r["fold"]) for r in rows}
    n = len({cluster(*u) for u in units})
    if n == len(units) or populations & set(variants):
        return None

    def means(name: str, only: set | None = None) -> dict:
        return by_cluster({(r["seed"], r["fold"]): r["oos_sharpe"] for r in rows if r["variant"] == name
                           and (only is None or (r["seed"], r["fold"]) in only)}, cluster)

    out: dict = {"periods": n, "units": len(units), "variants": {}, "paired": {}}
    for name in variants:
        m = means(name)
        if m:
            out["variants"][name] = bootstrap_ci(list(m.values()), n_boot=n_boot, seed=seed)
    ref_units = {(r["seed"], r["fold"]) for r in rows if r["variant"] == reference}
    for name in variants:
        both = ref_units & {(r["seed"], r["fold"]) for r in rows if r["variant"] == name}
        if name != reference and both:
            out["paired"][name] = paired(means(name, both), means(reference, both), n_boot=n_boot, seed=seed)
    return out


KNOBS = (("epsilon", "ε", ".3f"), ("gamma", "γ", ".4f"), ("lr_decay", "learning rates' decay", ".3f"))
"""The scheduled knobs an epoch's record names (what it trained under), their symbols and formats in the report."""


def knob_paths(summaries: Sequence[dict], variants: Sequence[str]) -> dict:
    """Per knob of `KNOBS`, each variant's mean over its runs of the knob's value by epoch — only the knobs whose
    paths differ between the variants (a signal or a setting that moves it), only variants whose every run has it
    at every epoch; {} when none differs."""
    out: dict = {}
    for knob, _, _ in KNOBS:
        paths = {}
        for name in variants:
            ms = [m for m in summaries if m["variant"] == name]
            vals = [[e.get(knob) for e in m["epochs"]] for m in ms]
            if ms and all(v is not None for row in vals for v in row) and len({len(row) for row in vals}) == 1:
                paths[name] = [float(x) for x in np.mean(np.array(vals, dtype=float), axis=0)]
        if len(paths) > 1 and any(not np.allclose(a, b, rtol=0, atol=1e-9) for a in paths.values()
                                  for b in paths.values() if len(a) == len(b)):
            out[knob] = paths
    return out


def insample_curves(summaries: Sequence[dict], variants: Sequence[str]) -> dict:
    """Per variant, each run's in-sample per-trade Sharpe by epoch (`insample_sharpe`: the greedy policy on the
    training split's last bars), keyed as `curves`; only variants whose every run has it at every epoch."""
    out = {}
    for name in variants:
        ms = [m for m in summaries if m["variant"] == name]
        vals = {f"{m['seed']}/{m['fold']}": [e.get("insample_sharpe") for e in m["epochs"]] for m in ms}
        if ms and all(x is not None and np.isfinite(x) for v in vals.values() for x in v):
            out[name] = vals
    return out


def first_then_later(curves: dict[str, list[float]]) -> tuple[float, float] | None:
    """Over the runs of `curves` that have both (`first_and_later_of`): (the mean of epoch 1, the mean of each run's
    mean of epochs 2–E); None where none has."""
    fl = [x for x in map(first_and_later_of, curves.values()) if x is not None]
    return (float(np.mean([f for f, _ in fl])), float(np.mean([la for _, la in fl]))) if fl else None


def rolls_back(epoch: dict) -> bool:
    """Whether the epoch after this one of a summary began from a feedback rollback to the run's own best epoch: its
    bundle asked for one and no exploit took its place."""
    return bool(epoch.get("rollback")) and not epoch.get("exploit")


def rollbacks(summary: dict) -> int:
    """Epochs of a run that began from a feedback rollback to its own best epoch (the last epoch's bundle starts no
    epoch)."""
    return sum(rolls_back(e) for e in summary["epochs"][:-1])


def rollback_steps(summary: dict) -> list[float]:
    """What each rollback of a run led to: the validation per-trade Sharpe of the epoch that began from it minus that
    of the epoch it restored (none from a summary written without `rollback_to`, nor where an exploit took its
    place)."""
    ep = summary["epochs"]
    val = {int(e["epoch"]): float(e["val_sharpe"]) for e in ep}
    return [float(nxt["val_sharpe"]) - val[int(e["rollback_to"])] for e, nxt in zip(ep[:-1], ep[1:])
            if rolls_back(e) and e.get("rollback_to") is not None and int(e["rollback_to"]) in val]


def best_validated(rows: Sequence[dict], cluster: Callable[[int, int], Any]) -> dict | None:
    """Within each group of a variant's runs on the same data and fold (`cluster(seed, fold)`: a synthetic market
    several seeds share, or a real series), the run chosen on validation (the highest val per-trade Sharpe; the first
    in (seed, fold) order on a tie) — what training the group's seeds and keeping the best validated gives.
    {"runs": the smallest group's size, "oos": group → its OOS, "mean": group → the group's mean OOS, "within_sd":
    the runs' OOS spread within a group (the standard deviation pooled over groups, each with n − 1: a run's own
    noise, the same data trained again under another seed), "between_sd": the standard deviation of the groups' mean
    OOS (None for one group)}; None where a group holds fewer than 2 runs."""
    groups: dict = {}
    for r in sorted(rows, key=lambda r: (r["seed"], r["fold"])):
        groups.setdefault(cluster(r["seed"], r["fold"]), []).append(r)
    if not groups or min(len(g) for g in groups.values()) < 2:
        return None
    oos = {c: np.array([r["oos_sharpe"] for r in g], dtype=np.float64) for c, g in groups.items()}
    ss = sum(float(((x - x.mean()) ** 2).sum()) for x in oos.values())
    dof = sum(x.size - 1 for x in oos.values())
    means = [float(x.mean()) for x in oos.values()]
    return {"runs": min(len(g) for g in groups.values()),
            "oos": {c: float(max(g, key=lambda r: r["val_sharpe"])["oos_sharpe"]) for c, g in groups.items()},
            "mean": dict(zip(oos, means)), "within_sd": math.sqrt(ss / dof),
            "between_sd": float(np.std(means, ddof=1)) if len(means) > 1 else None}


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks of `x`, ties sharing their mean rank (Spearman's convention)."""
    r = np.empty(len(x))
    r[np.argsort(x, kind="mergesort")] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        r[x == v] = r[x == v].mean()
    return r


def choice_by_validation(rows: Sequence[dict], reference: str, *, n_boot: int = 10_000, seed: int = 0) -> dict | None:
    """What choosing among the variants by validation would earn, unit by unit: on each (seed, fold) that holds the
    reference and ≥ 2 variants, the OOS of the variant whose selected checkpoint validated highest (`val_chosen`: OOS
    not used to choose, so an honest estimate of keeping the variant validation prefers) and the highest OOS
    (`oos_best`: a ceiling only the test split's hindsight reaches), each against the reference's OOS (`paired`);
    and Spearman's correlation of the variants' val and OOS within a unit (`rank_corr`, units of ≥ 3 variants):
    near 0, validation cannot tell the variants apart there. `rows`: dicts with variant, seed, fold, val_sharpe,
    oos_sharpe. None when no unit qualifies."""
    units: dict = {}
    for r in rows:
        if r.get("val_sharpe") is not None and r.get("oos_sharpe") is not None:
            units.setdefault((r["seed"], r["fold"]), []).append(r)
    chosen, best, ref, corr, n, picks = {}, {}, {}, [], [], {}
    for u, rs in sorted(units.items()):
        mine = [r for r in rs if r["variant"] == reference]
        if not mine or len(rs) < 2:
            continue
        top = max(rs, key=lambda r: r["val_sharpe"])       # the first of a tie, in the rows' order
        chosen[u], best[u], ref[u] = top["oos_sharpe"], max(r["oos_sharpe"] for r in rs), mine[0]["oos_sharpe"]
        picks[top["variant"]] = picks.get(top["variant"], 0) + 1
        n.append(len(rs))
        val, oos = (np.array([r[k] for r in rs], dtype=float) for k in ("val_sharpe", "oos_sharpe"))
        if len(rs) >= 3 and np.ptp(val) > 0 and np.ptp(oos) > 0:
            corr.append(float(np.corrcoef(_ranks(val), _ranks(oos))[0, 1]))
    if not chosen:
        return None
    ci = lambda xs: bootstrap_ci(list(xs), n_boot=n_boot, seed=seed)  # noqa: E731
    return {"reference": reference, "units": len(chosen), "variants_per_unit": [min(n), max(n)],
            "reference_oos": ci(ref.values()), "val_chosen_oos": ci(chosen.values()), "oos_best_oos": ci(best.values()),
            "val_chosen_minus_reference": paired(chosen, ref, n_boot=n_boot, seed=seed),
            "oos_best_minus_reference": paired(best, ref, n_boot=n_boot, seed=seed),
            "rank_corr": ci(corr) if corr else None,
            "chosen_by_val": dict(sorted(picks.items(), key=lambda kv: (-kv[1], kv[0])))}


def epoch_sharpes(summary: dict) -> list[float]:
    """A run's validation per-trade Sharpe by epoch, NaN where the epoch had fewer than 2 validation trades: a
    Sharpe of one trade or none is undefined (the metrics book it 0.0, which read as a measured zero)."""
    return [float(e["val_sharpe"]) if int(e.get("val_trades", 2)) >= 2 else math.nan for e in summary["epochs"]]


def val_step(summary: dict) -> float | None:
    """How far a run's policy moves from one epoch to the next: the mean |Δ| of its consecutive epochs' validation
    per-trade Sharpes, epochs without one left out (None where fewer than 2 have one)."""
    v = [x for x in epoch_sharpes(summary) if np.isfinite(x)]
    return float(np.mean(np.abs(np.diff(v)))) if len(v) > 1 else None


def typical_epoch(summary: dict) -> dict:
    """A run's typical epoch beside the one selection keeps: the mean of its epochs' validation per-trade Sharpes
    (`val_epochs_mean`) and their standard deviation over the epochs (`val_epochs_sd`, ddof 0), epochs without a
    Sharpe left out; None where fewer than 2 epochs have one. The choice on validation keeps the best of the draws,
    so a higher typical epoch with a narrower spread can select no higher (bench/README.md 2026-12-03 · 3d56890)."""
    v = [x for x in epoch_sharpes(summary) if np.isfinite(x)]
    if len(v) < 2:
        return {"val_epochs_mean": None, "val_epochs_sd": None}
    return {"val_epochs_mean": float(np.mean(v)), "val_epochs_sd": float(np.std(v))}


def first_and_later(summary: dict) -> dict:
    """A run's first epoch's validation per-trade Sharpe (`val_epoch1`) and the mean of its later epochs'
    (`val_later_mean`), epochs without a Sharpe left out; both None unless the first and at least one later epoch
    have one. A variant that changes training only after epoch 1 trains epoch 1 as the reference does: its paired
    difference there is the pairing's noise (on a GPU, training's nondeterminism), the yardstick for the later one."""
    fl = first_and_later_of(epoch_sharpes(summary))
    return {"val_epoch1": fl and fl[0], "val_later_mean": fl and fl[1]}


def gap_widening(summary: dict) -> float | None:
    """How much a run's generalization gap grows after its first epoch: with g_e = in-sample − validation per-trade
    Sharpe of epoch e (`insample_sharpe`, the greedy policy on the training split's last bars), the mean of g over
    epochs 2–E minus g_1 (`first_and_later_of`). Above 0: the later epochs fit the training split better than they
    carry to validation; None without the in-sample record at epoch 1 and a later epoch."""
    g = [None if e.get("insample_sharpe") is None else float(e["insample_sharpe"]) - v
         for e, v in zip(summary["epochs"], epoch_sharpes(summary))]
    fl = first_and_later_of(g)
    return None if fl is None else fl[1] - fl[0]


def first_and_later_of(values: Sequence[float | None]) -> tuple[float, float] | None:
    """(epoch 1's value, the mean of the later epochs' values) of one run's values by epoch, missing or non-finite
    later values left out; None unless epoch 1's value and a later one exist."""
    ok = lambda x: x is not None and np.isfinite(x)  # noqa: E731
    later = [float(x) for x in values[1:] if ok(x)]
    if not values or not ok(values[0]) or not later:
        return None
    return float(values[0]), float(np.mean(later))


def exploited(summary: dict) -> list[list]:
    """A run's exploits: [after epoch e, the peer run, its epoch, that epoch's val per-trade Sharpe] — epoch e + 1
    trained from that peer epoch (their number: the epochs that began from another run's epoch)."""
    return [[e["epoch"], x["run"], int(x["epoch"]), float(x["val_sharpe"])]
            for e in summary["epochs"][:-1] if (x := e.get("exploit"))]


def pairing_check(summaries: Sequence[dict]) -> dict:
    """Variants of one unit that trained their first epoch under the same config and knobs (same `first_epoch_key`)
    should agree there: per unit and key, the spread of epoch 1's validation Sharpe and whether the epoch-1
    checkpoints are byte-identical (sha256). On a CPU they are; on a GPU the spread is the run-to-run noise."""
    groups: dict[tuple, list[dict]] = {}
    for m in summaries:
        groups.setdefault((m["seed"], m["fold"], m["first_epoch_key"]), []).append(m)
    spreads, identical, n, later = [], 0, 0, {}
    for ms in groups.values():
        if len(ms) < 2:
            continue
        n += 1
        v = [m["epochs"][0]["val_sharpe"] for m in ms]
        spreads.append(max(v) - min(v))
        identical += len({m["epochs"][0]["checkpoint_sha256"] for m in ms}) == 1
        for e in range(2, alike_epochs(ms) + 1):
            v = [m["epochs"][e - 1]["val_sharpe"] for m in ms]
            later.setdefault(e, []).append(max(v) - min(v))
    return {"groups": n, "identical_checkpoints": identical,
            "max_epoch1_val_spread": max(spreads) if spreads else None,
            "mean_epoch1_val_spread": float(np.mean(spreads)) if spreads else None,
            "later_epochs": {str(e): {"groups": len(s), "mean_val_spread": float(np.mean(s)),
                                      "max_val_spread": float(max(s))} for e, s in sorted(later.items())}}


def alike_epochs(ms: Sequence[dict]) -> int:
    """How many epochs from the first the runs `ms` (one group of `pairing_check`) all trained alike: each epoch under
    the same knobs in every run (`knobs_key`), none begun from a rollback or another run's epoch. 1 for summaries
    without `knobs_key`."""
    k = 1
    while all(len(m["epochs"]) > k for m in ms):
        prev, cur = [m["epochs"][k - 1] for m in ms], [m["epochs"][k] for m in ms]
        keys = {e.get("knobs_key") for e in cur}
        if None in keys or len(keys) > 1 or any(e.get("rollback") or e.get("exploit") for e in prev):
            break
        k += 1
    return k

