"""A study's results out: results.json (everything), report.md (the tables) and report.png (matplotlib: the
per-epoch validation curves per variant, the paired differences, OOS per variant against the baselines).
Sharpes are un-annualized, per trade."""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import warnings
from pathlib import Path

import numpy as np

from shared.redis_server import die_with_parent
from tradeloop.study.loop import PARTS, write_json_atomic
from tradeloop.study.mps import held_to
from tradeloop.study.capacity import usable_cores
from tradeloop.study.spec import StudySpec
from tradeloop.study.stats import DSR_BAR, KNOBS, aggregate, describe, first_then_later, power_cells


def load_summaries(spec: StudySpec, out: Path) -> list[dict]:
    return [json.loads((out / "runs" / r.run_id / "summary.json").read_text()) for r in spec.runs()]


def write_results(spec: StudySpec, out: Path, timing: dict) -> dict:
    """Aggregate the finished study in `out` and write results.json, report.md and report.png; returns the results."""
    out = Path(out)
    summaries = load_summaries(spec, out)
    epoch_s = [e["train_s"] + e["eval_s"] for m in summaries for e in m["epochs"] if e["train_s"] is not None]
    timing = {**timing, "mean_epoch_s": float(np.mean(epoch_s)) if epoch_s else None,
              **compile_times(summaries), "epoch_parts_s": part_medians([m["epochs"] for m in summaries])}
    res = aggregate(summaries, baselines(spec, out, min(usable_cores(), 8)), [v.name for v in spec.variants],
                    spec.reference_name, n_boot=spec.n_boot, seed=spec.ci_seed, populations=spec.populations(),
                    cluster_of=spec.cluster_of, min_trades=spec.min_val_trades)
    res = {"study": spec.to_dict(), "timing": timing, **res}
    write_json_atomic(out / "results.json", res)
    (out / "report.md").write_text(markdown(res))
    plot(res, out / "report.png")
    return res


def compile_times(summaries: list[dict]) -> dict:
    """The seconds each run spent compiling and capturing its step (its epochs' `compile_s`, part of `train_s`):
    the longest (a cold compile cache: the run that fills it while the other workers wait) and the median of the
    others (loading the kernels it left). Empty where no run recorded any (summaries that predate the field)."""
    per_run = sorted(sum(e.get("compile_s") or 0.0 for e in m["epochs"]) for m in summaries
                     if any(e.get("compile_s") is not None for e in m["epochs"]))
    if not per_run:
        return {}
    rest = per_run[:-1]
    return {"compile_max_s": per_run[-1], "compile_median_s": float(np.median(rest)) if rest else None}


def upper_median(xs: list[float]) -> float | None:
    """The median of `xs` (the upper one of an even count), None for none."""
    return float(sorted(xs)[len(xs) // 2]) if xs else None


def part_medians(runs: list[list[dict]]) -> dict:
    """Median seconds of each of an epoch's `PARTS` (`<part>_s` of each run's epochs, in order) over the epochs after
    each run's first (which compiles); `rollback` over the epochs that began from one (None where none did, or
    where the records predate a part); `rollbacks`: how many did."""
    later = [e for epochs in runs for e in epochs[1:]]
    out: dict = {}
    for k in PARTS:
        out[k] = upper_median([e[f"{k}_s"] for e in later if e.get(f"{k}_s") is not None])
    out["rollbacks"] = sum(e.get("rollback_s") is not None for e in later)
    return out


def _n(x, spec: str = "+.3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def paired_list(res: dict, key: str) -> list[str]:
    """Each variant's paired difference `key` against the reference: "name − reference mean [lo, hi] (wins/n)"."""
    return [f"{n} − {res['reference']} {describe(p[key])} ({p[key]['wins']}/{p[key]['n']})"
            for n, p in res["paired"].items() if key in p]


def choice_lines(c: dict) -> list[str]:
    """`stats.choice_by_validation`'s readings as a table (markdown lines), and the within-unit rank correlation."""
    lo, hi = c["variants_per_unit"]
    lines = [f"Choosing among the variants by validation ({lo if lo == hi else f'{lo}–{hi}'} on each of {c['units']} "
             f"(seed, fold) units; OOS per-trade Sharpe, mean [95 % CI], against {c['reference']} on the same units):",
             "", "| reading | OOS | − reference | higher |", "|---|---|---|---|",
             f"| {c['reference']} | {describe(c['reference_oos'])} | | |"]
    for key, label in (("val_chosen", "the variant validation prefers"), ("oos_best", "the best OOS (hindsight)")):
        d = c[f"{key}_minus_reference"]
        lines.append(f"| {label} | {describe(c[f'{key}_oos'])} | {describe(d)} | {d['wins']} of {d['n']} |")
    chosen = ", ".join(f"{k} {v}" for k, v in list(c["chosen_by_val"].items())[:6])
    lines += ["", f"Chosen by validation: {chosen}."]
    rc = c["rank_corr"]
    if rc is not None:
        lines[-1] += (f" Within a unit the variants' val and OOS rank alike by {describe(rc)} (Spearman): "
                      + ("validation tells them apart on this data." if rc["lo"] > 0 else
                         "its CI reaches 0, so validation does not tell them apart on this data and choosing by it "
                         "earns no more than chance."))
    return lines


def over_what(res: dict, units: int) -> str:
    """What a study's intervals resample: its (seed, fold) units, or the test periods they share."""
    per = res.get("periods")
    if per:
        return f"{per['periods']} test periods (each the mean of its {per['units'] // per['periods']} units)" \
            if per["units"] % per["periods"] == 0 else f"{per['periods']} test periods (each the mean of its units)"
    return f"{units} (seed, fold) units"


def markdown(res: dict) -> str:
    s, t = res["study"], res["timing"]
    over = "test periods" if res.get("periods") else "units"          # what the intervals below resample
    units = len(s["seeds"]) * s["folds"]
    lines = [f"# Study: {s['dataset']} — {counted(len(s['variants']), 'variant')} × {counted(len(s['seeds']), 'seed')} "
             f"× {counted(s['folds'], 'fold')} × {counted(s['epochs'], 'epoch')}",
             "",
             f"Preset `{s['preset']}`{', settings ' + '; '.join(f'`{k}={v}`' for k, v in s['settings']) if s['settings'] else ''}"
             f", device {s['device']}, accel {s['accel']}{', deterministic' if s['deterministic'] else ''}; "
             f"bars {s['bars'] or 'dataset default'}; rolling walk-forward folds (train | embargo | val | embargo | "
             f"test). Each run's checkpoint is selected on validation only (best val per-trade Sharpe among epochs with "
             f"≥ {s['min_val_trades']} val trades); OOS is read for that checkpoint alone. Sharpes are un-annualized, "
             f"per trade. Mean [95 % CI]: expanded percentile bootstrap over the {over_what(res, units)}, "
             f"{s['n_boot']} resamples, rng seed {s['ci_seed']}. DSR: the selected checkpoint's validation trades "
             f"deflated by all N = {res['n_trials']} distinct checkpoints of the study (variance of their val Sharpes "
             f"{_n(res['trial_sharpe_var'], '.4f')}); verdict \"validated edge\" only when the 95 % CI of the mean DSR "
             f"lies at or above {DSR_BAR}.",
             "",
             f"Timing: {fmt_timing(t)}.",
             "",
             "| policy | runs | OOS per-trade Sharpe | val per-trade Sharpe | val/OOS gap (of the means) | DSR (study) "
             "| val trades | OOS trades | verdict |",
             "|---|---:|---|---|---|---|---|---|---|"]
    for name, d in res["variants"].items():
        variant = next(v for v in s["variants"] if v["name"] == name)
        what = "; ".join(f"{k}={setting_text(v)}" for k, v in variant["settings"]) or "as shipped"
        lines.append(f"| **{name}** ({what}) | {d['n_runs']} | {describe(d['oos_sharpe'])} | {describe(d['val_sharpe'])} "
                     f"| {describe(d['gap'], '+.1%')} | {describe(d['dsr'], '.3f')} | {describe(d['val_trades'], '.0f')} "
                     f"| {describe(d['oos_trades'], '.0f')} | {d['verdict']} ({d['dsr_at_bar']}/{d['n_runs']} runs "
                     f"≥ {DSR_BAR}) |")
    for name, d in res["baselines"].items():
        lines.append(f"| {name} (baseline) | {d['n_runs']} | {describe(d['oos_sharpe'])} | {describe(d['val_sharpe'])} "
                     f"| {describe(d['gap'], '+.1%')} | — | {describe(d['val_trades'], '.0f')} "
                     f"| {describe(d['oos_trades'], '.0f')} | — |")
    rolled = [f"{name} {d['rollbacks']} of {d['rollback_chances']}" for name, d in res["variants"].items()
              if d.get("rollbacks")]
    if rolled:
        lines += ["", f"Epochs that began from a feedback rollback (of those after a run's first): {'; '.join(rolled)}."]
    after = [f"{name} {describe(d['after_rollback'])} ({d['after_rollback']['higher']} of "
             f"{d['after_rollback']['rollbacks']} higher)" for name, d in res["variants"].items() if d.get("after_rollback")]
    if after:
        lines += ["", "What a rollback led to: the validation per-trade Sharpe of the epoch that began from it minus that "
                  "of the epoch it restored (mean [95 % CI] over the runs that rolled back, each run's mean; below 0: "
                  f"training on from the best epoch lands lower than it): {'; '.join(after)}."]
    taken = [f"{name} {d['exploits']} of {d['rollback_chances']}" for name, d in res["variants"].items()
             if d.get("exploits")]
    if taken:
        lines += ["", f"Epochs that began from another run's epoch (the population's exploit): {'; '.join(taken)}."]
    for knob, sym, fmt in KNOBS:
        if knob in res.get("knob_paths", {}):
            said = "; ".join(f"{name} {', '.join(format(x, fmt) for x in path)}"
                             for name, path in res["knob_paths"][knob].items())
            lines += ["", f"The {sym} each epoch trained under, where the variants differ (mean over a variant's runs, "
                      f"epoch 1 → {len(next(iter(res['knob_paths'][knob].values())))}): {said}."]
    steps = [f"{name} {describe(d['val_step'])}" for name, d in res["variants"].items() if d.get("val_step")]
    if steps:
        lines += ["", "How far the policy moves from one epoch to the next (mean |Δ val per-trade Sharpe| between a "
                  f"run's consecutive epochs; mean [95 % CI] over {over}): {'; '.join(steps)}."]
    typical = [f"{name} {describe(d['epochs_val']['mean'])}, sd {describe(d['epochs_val']['sd'])}"
               for name, d in res["variants"].items() if d.get("epochs_val")]
    if typical:
        pairs = paired_list(res, "val_epochs_mean")
        lines += ["", "The typical epoch beside the selected one (a run's mean val per-trade Sharpe over its epochs, "
                  f"and their standard deviation within the run; mean [95 % CI] over {over} — the choice on "
                  f"validation keeps the best draw, so the spread counts as much as the mean): {'; '.join(typical)}"
                  + (f"; paired {', '.join(pairs)}." if pairs else ".")]
    first, later = paired_list(res, "val_epoch1"), paired_list(res, "val_later_mean")
    if first:
        lines += ["", "The first epoch against the later ones (paired, val per-trade Sharpe; a variant that changes "
                  "training only after epoch 1 trains epoch 1 as the reference does, so its difference there is the "
                  f"pairing's noise): epoch 1 {', '.join(first)}; "
                  + (f"the mean of epochs 2–{s['epochs']} " if s['epochs'] > 2 else "epoch 2 ")
                  + f"{', '.join(later)}."]
    fit = []
    for name, ins in res.get("curves_insample", {}).items():
        a, v = first_then_later(ins), first_then_later({u: res["curves"][name][u] for u in ins})
        if a and v:
            w = res["variants"].get(name, {}).get("gap_widening")
            fit.append(f"{name} in sample {a[0]:+.3f} → {a[1]:+.3f}, validation {v[0]:+.3f} → {v[1]:+.3f}"
                       + (f", the gap between them widening {describe(w)} ({w['widened']}/{w['n']})" if w else ""))
    if fit:
        pairs = paired_list(res, "gap_widening")
        lines += ["", "In sample beside validation (the same greedy policy on the training split's last bars, as many "
                  "as validation's; mean over the runs, epoch 1 → the mean of epochs 2–E — in sample rising while "
                  "validation falls is overfitting the training split; the widening of the gap, in sample − "
                  f"validation, mean [95 % CI] over {over} and how many widened): "
                  f"{'; '.join(fit)}" + (f"; paired widening {', '.join(pairs)}." if pairs else ".")]
    best = {name: d["best_validated"] for name, d in res["variants"].items() if d.get("best_validated")}
    if best:
        pairs = paired_list(res, "best_validated_oos")
        lines += ["", "The run chosen on validation among each market and fold's runs (what training them and keeping "
                  "the best validated gives; mean [95 % CI] over the groups): "
                  + "; ".join(f"{n} OOS {describe(b['oos'])}, {describe(b['lift'])} above the group's mean "
                              f"({b['groups']} groups of ≥ {b['runs']} runs)" for n, b in best.items())
                  + (f"; paired {', '.join(pairs)}." if pairs else ".")]
        spread = {n: b for n, b in best.items() if b.get("within_sd") is not None}
        if spread:
            lines += ["", "What a run draws on its own (the OOS of runs on the same data and fold under different "
                      "seeds; a difference between two single runs carries √2 times it): "
                      + "; ".join(f"{n} within a group {b['within_sd']:.3f} (standard deviation, pooled), between "
                                  f"the groups' means {_n(b['between_sd'], '.3f')}" for n, b in spread.items()) + "."]
    pops = {name: d["populations"] for name, d in res["variants"].items() if "populations" in d}
    if pops:
        lines += ["", "The runs of a population share weights, so they are not independent: the means, CIs and paired "
                  "differences of " + ", ".join(f"{n} ({k} populations)" for n, k in pops.items())
                  + " are over populations — the mean of the runs of one market and fold — not over runs."]
    if res["paired"]:
        lines += ["", f"Paired differences, variant − {res['reference']}, on the same seed and fold "
                      "(mean [95 % CI]; wins: units where the variant is higher; resolvable: the smallest Δ OOS these "
                      "units tell from 0 with 80 % power, a paired t-test at 5 %, and the units it would take to tell "
                      "the observed Δ OOS so):", "",
                  "| variant | Δ OOS per-trade Sharpe | wins | resolvable Δ OOS | units for the observed Δ OOS "
                  "| Δ val per-trade Sharpe | Δ last-epoch val | Δ DSR |",
                  "|---|---|---:|---:|---:|---|---|---|"]
        for name, d in res["paired"].items():
            o = d["oos_sharpe"]
            fw = o.get("family")
            cell = describe(o) + (f"; of {fw['m']}: [{fw['lo']:+.3f}, {fw['hi']:+.3f}]" if fw else "")
            lines.append(f"| {name} | {cell} | {o['wins']}/{o['n']} | {power_cells(o)} "
                         f"| {describe(d['val_sharpe'])} | {describe(d['last_val_sharpe'])} "
                         f"({d['last_val_sharpe']['wins']}/{d['last_val_sharpe']['n']} higher) | {describe(d['dsr'], '+.3f')} |")
        fam = next((o["family"] for o in (d["oos_sharpe"] for d in res["paired"].values()) if "family" in o), None)
        if fam:
            lines += ["", f"{fam['m']} variants are compared with {res['reference']}: beside each Δ OOS CI, \"of "
                          f"{fam['m']}\" gives its Bonferroni interval at {100 * fam['level']:.4g} %, and the "
                          f"{fam['m']} of them hold their true differences together with probability ≥ 95 %. A variant "
                          "whose own CI clears 0 and whose family-wise one does not may be the one that chance lifted."]
    per = res.get("periods")
    if per:
        lines += ["", f"Test periods: the {per['units']} (seed, fold) units share {per['periods']} test periods (the "
                  "seeds of a fold trade one market's same bars), so what holds for another period rests on "
                  f"{per['periods']}, not {per['units']}: every CI, gap and paired difference above is over the "
                  "periods (each period's mean over its units), and \"wins\" counts periods."]
    bar = [f"{n} {describe(d['oos_bar_sharpe'])}" for n, d in res["variants"].items() if d.get("oos_bar_sharpe")]
    bar += [f"{n} (baseline) {describe(d['oos_bar_sharpe'])}" for n, d in res["baselines"].items()
            if bar and d.get("oos_bar_sharpe")]
    if bar:
        pairs = paired_list(res, "oos_bar_sharpe")
        lines += ["", "The account beside its trades: OOS per-bar Sharpe of the selected checkpoints (the equity "
                  "curve's bar returns, flat bars included, un-annualized; a policy that raises its per-trade Sharpe "
                  f"by trading less can lower it; mean [95 % CI] over {over}): " + "; ".join(bar)
                  + (f"; paired {', '.join(pairs)}." if pairs else ".")]
    dd = {n: d for n, d in res["variants"].items() if d.get("oos_max_drawdown")}
    if dd:
        gone = [r for d in dd.values() for r in d["oos_ruined"]]
        lines += ["", "The account's worst fall out of sample: max drawdown of the selected checkpoints' OOS equity "
                  f"(a fraction of its running peak; mean [95 % CI] over {over}): "
                  + "; ".join(f"{n} {describe(d['oos_max_drawdown'], '.3f')}" for n, d in dd.items()) + ". "
                  + (f"Accounts that ran out of equity out of sample (liquidated, then no more trades: their per-trade "
                     f"Sharpe stops there): {', '.join(gone)}." if gone else
                     "No account ran out of equity out of sample.")]
    idle = [r for d in res["variants"].values() for r in d.get("oos_untraded", [])]
    if idle:
        lines += ["", "Runs whose selected checkpoint closed fewer than two trades out of sample (no per-trade Sharpe: "
                  "each counts as 0.0, no edge shown, in its variant's OOS figures; a baseline's undefined Sharpe — "
                  f"flat never trades, buy-and-hold once — is left out of its own): {', '.join(idle)}."]
    shaped = {n: d["unshaped"] for n, d in res["variants"].items() if "unshaped" in d}
    if any(u["shaped_runs"] for u in shaped.values()):
        lines += ["", "Policy shaping apart from learning: the selected checkpoints backtested again without the knobs "
                      "that shape the greedy policy (E5 entry gate, E9 regime confidence), i.e. the policy as learned "
                      "(mean [95 % CI]):", "",
                  f"| variant | runs shaped | OOS as learned | val as learned | OOS shaped − as learned "
                  f"| Δ OOS as learned vs {res['reference']} |", "|---|---:|---|---|---|---|"]
        for name, u in shaped.items():
            pd_ = res["paired"].get(name, {}).get("oos_sharpe_unshaped")
            lines.append(f"| {name} | {u['shaped_runs']}/{res['variants'][name]['n_runs']} | {describe(u['oos_sharpe'])} "
                         f"| {describe(u['val_sharpe'])} | {describe(u['shaping_oos'])} "
                         f"| {describe(pd_) if pd_ else '—'} |")
    if res.get("choice"):
        lines += [""] + choice_lines(res["choice"])
    p = res["pairing"]
    if p["groups"]:
        lines += ["", f"Pairing: in {p['groups']} (seed, fold) groups of variants whose first epoch trains under the "
                      f"same config and knobs, epoch 1's checkpoints were byte-identical in {p['identical_checkpoints']}; "
                      f"epoch-1 val per-trade Sharpe spread within a group: max {_n(p['max_epoch1_val_spread'], '.4f')}, "
                      f"mean {_n(p['mean_epoch1_val_spread'], '.4f')} (0 where identical: the noise a GPU adds)."]
        later = p.get("later_epochs") or {}
        if later:
            lines[-1] += (" Later epochs that every run of a group still trained alike (the same knobs, no rollback or "
                          "exploit yet), val spread within a group: " + "; ".join(
                              f"epoch {e}: mean {_n(d['mean_val_spread'], '.4f')}, max {_n(d['max_val_spread'], '.4f')} "
                              f"({d['groups']} of {p['groups']} groups)" for e, d in later.items()) + ".")
    lines += ["", "| run | seed | fold | selected epoch | val SR | val trades | OOS SR | OOS trades | OOS max DD "
                  "| DSR (study) | DSR (run) | last-epoch val SR |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        lines.append(f"| {r['run_id']} | {r['seed']} | {r['fold']} | {r['selected_epoch']}{'' if r['selectable'] else '*'} "
                     f"| {_n(r['val_sharpe'])} | {r['val_trades']} | {_n(r['oos_sharpe'])} | {r['oos_trades']} "
                     f"| {_n(r.get('oos_max_drawdown'), '.3f')} | {_n(r['dsr'], '.3f')} | {_n(r['run_dsr'], '.3f')} "
                     f"| {_n(r['last_val_sharpe'])} |")
    if any(not r["selectable"] for r in res["runs"]):
        lines.append(f"\n\\* no epoch had {s['min_val_trades']} validation trades: the best of all was taken.")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """report.png: validation curves per variant; paired Δ OOS per variant; OOS per variant and baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["variants"])
    colors = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1.4, 1, 1]})
    ax = axes[0]
    for n in names:
        curves = [np.array(c, dtype=float) for c in res["curves"][n].values()]   # NaN: an epoch with < 2 trades
        for c in curves:
            ax.plot(range(1, len(c) + 1), c, color=colors[n], alpha=0.2, lw=0.8)
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)       # an epoch no run has a Sharpe at stays NaN
            m = np.nanmean(np.array(curves, dtype=float), axis=0)
        ax.plot(range(1, len(m) + 1), m, color=colors[n], lw=2.4, marker="o", ms=4, label=f"{n} (mean of {len(curves)})")
        if ins := res.get("curves_insample", {}).get(n):
            mi = np.mean(np.array(list(ins.values()), dtype=float), axis=0)
            ax.plot(range(1, len(mi) + 1), mi, color=colors[n], lw=1.6, ls="--", label=f"{n} in sample (mean)")
    ax.axhline(0, color="grey", lw=0.8)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="epoch", ylabel="per-trade Sharpe (un-annualized)",
           title="Validation by epoch (thin: each run; dashed: in sample)")
    ax.legend(fontsize=8)
    ax = axes[1]
    ref = res["reference"]
    by_run = {(r["variant"], r["seed"], r["fold"]): r for r in res["runs"]}
    pnames = list(res["paired"])
    rng = np.random.default_rng(0)
    for i, n in enumerate(pnames):
        d = [r["oos_sharpe"] - by_run[(ref, r["seed"], r["fold"])]["oos_sharpe"] for r in res["runs"]
             if r["variant"] == n and (ref, r["seed"], r["fold"]) in by_run]
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(d)), d, color=colors[n], alpha=0.5, s=14)
        ci = res["paired"][n]["oos_sharpe"]
        if fw := ci.get("family"):                      # the Bonferroni interval of one of m, thin and wider
            ax.errorbar([i + 0.2], [ci["mean"]], yerr=[[ci["mean"] - fw["lo"]], [fw["hi"] - ci["mean"]]], fmt="none",
                        color="dimgrey", capsize=3, lw=1)
        ax.errorbar([i], [ci["mean"]], yerr=[[ci["mean"] - ci["lo"]], [ci["hi"] - ci["mean"]]], fmt="D",
                    color="black", capsize=6, ms=6)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(pnames)), pnames, rotation=30, ha="right")
    ax.set_xlim(-0.6, max(len(pnames), 1) - 0.4)
    m = len(pnames)
    ax.set(ylabel=f"Δ OOS per-trade Sharpe vs {ref}", title=f"Paired: variant − {ref} (same seed, fold; 95 % CI"
           + (f"; grey: as one of {m}, Bonferroni)" if m > 1 else ")"))
    ax = axes[2]
    rows = [(n, res["variants"][n]["oos_sharpe"], colors[n]) for n in names] + \
           [(f"{n}\n(baseline)", d["oos_sharpe"], "lightgrey") for n, d in res["baselines"].items()]
    for i, (n, ci, c) in enumerate(rows):
        if ci["mean"] is None:
            continue
        ax.bar(i, ci["mean"], color=c, alpha=0.8)
        ax.errorbar([i], [ci["mean"]], yerr=[[ci["mean"] - ci["lo"]], [ci["hi"] - ci["mean"]]], color="black",
                    capsize=5)
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="OOS per-trade Sharpe (un-annualized)", title="OOS of the val-selected checkpoint (95 % CI)")
    s = res["study"]
    fig.suptitle(f"tradeloop study — {s['dataset']}, {len(s['seeds'])} seeds × {s['folds']} folds × {s['epochs']} "
                 f"epochs, preset {s['preset']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _baseline_unit(spec_doc: dict, seed: int, fold: int) -> list[dict]:
    """The baseline policies of one (seed, fold) on its validation and test windows (a pool task: the spec travels as
    its dict). A buy-and-hold whose units lose more than the equity is replayed bar by bar by the step simulator (the
    vectorised replay's ruin case): on a long synthetic series one such window takes tens of seconds."""
    from tradeloop.cmd_evaluate import policy_metrics
    from tradeloop.study.spec import load_study_bars, study_folds

    spec = StudySpec.from_dict(spec_doc)
    ds = spec.data_seed_of(seed)
    bars = load_study_bars(spec, ds)
    split = study_folds(spec, len(bars))[fold]
    policies = ["random", "flat", "buy-and-hold"] + (["oracle"] if spec.dataset.strip().lower() == "synthetic" else [])
    # the reference variant's costs (the agents are backtested at the costs they trained under)
    cost = spec.configs(spec.variant(spec.reference_name), 14)[0].costs_bps
    rows = []
    for pol in policies:
        m = {w: policy_metrics(pol, spec.dataset, bars, split, w, seed=ds if pol == "oracle" else seed,
                               cost_bps=cost) for w in ("val", "test")}
        rows.append({"policy": pol, "seed": seed, "fold": fold, "costs_bps": cost,
                     "val_sharpe": trade_sharpe(m["val"]), "val_trades": int(m["val"]["n_trades"]),
                     "oos_sharpe": trade_sharpe(m["test"]), "oos_trades": int(m["test"]["n_trades"]),
                     "oos_bar_sharpe": float(m["test"]["per_bar_sharpe"])})
    return rows


def trade_sharpe(metrics: dict) -> float | None:
    """A window's per-trade Sharpe, None where it is undefined: fewer than two trades (flat holds none, buy-and-hold
    one; `shared.metrics` books those as 0.0)."""
    return float(metrics["per_trade_sharpe"]) if int(metrics["n_trades"]) >= 2 else None


def _cached_units(spec: StudySpec, path: Path) -> dict[str, list[dict]]:
    """The units of baselines.json computed for this study's identity ({} when missing, stale or unreadable)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if doc.get("identity") != json.loads(json.dumps(spec.identity())):
        return {}
    rows = [r for u in (doc.get("units") or {}).values() for r in u] + list(doc.get("rows", []))
    if any("costs_bps" not in r for r in rows):   # written before the rows held their costs and per-bar Sharpe
        return {}
    if "units" in doc:
        return doc["units"]
    units: dict[str, list[dict]] = {}
    for row in doc.get("rows", []):
        units.setdefault(f"{row['seed']}-{row['fold']}", []).append(row)
    return units


class BaselinesStopped(Exception):
    """`baselines` was asked to stop (`stop` set): the units it finished are kept in baselines.json."""


def baselines(spec: StudySpec, out: Path, processes: int = 1, slots: threading.Semaphore | None = None,
              stop: threading.Event | None = None) -> list[dict]:
    """The baseline policies on every (seed, fold)'s validation and test windows, cached unit by unit in
    baselines.json (a stopped study keeps the units it finished); missing units run in `processes` worker
    processes (1 and no `slots`: here), each unit kept as it finishes. `slots`: a unit starts only once it takes one
    (released when it ends), so that a caller can widen the pool's use while it works; `stop` set: the pool's
    processes are terminated at once and BaselinesStopped raised (`BackgroundBaselines`)."""
    path = out / "baselines.json"
    units = _cached_units(spec, path)
    keys = [(seed, k) for seed in spec.seeds for k in range(spec.folds)]
    todo = [(s, k) for s, k in keys if f"{s}-{k}" not in units]
    doc = spec.to_dict()

    def keep(s: int, k: int, rows: list[dict]) -> None:
        units[f"{s}-{k}"] = rows
        write_json_atomic(path, {"identity": spec.identity(), "units": units})

    if todo and (processes > 1 or slots is not None):
        import multiprocessing as mp

        running: dict = {}

        def kept() -> None:
            if stop is not None and stop.is_set():
                raise BaselinesStopped()
            for unit in [u for u, res in running.items() if res.ready()]:
                keep(*unit, running.pop(unit).get())
                if slots is not None:
                    slots.release()

        pool = mp.get_context("spawn").Pool(min(processes, len(todo)), initializer=_apart_from_the_study)
        try:
            for s, k in todo:
                while slots is not None and not slots.acquire(timeout=0.2):
                    kept()
                running[(s, k)] = pool.apply_async(_baseline_unit, (doc, s, k))
                kept()
            while running:
                next(iter(running.values())).wait(0.2)
                kept()
        finally:
            pool.terminate()                # no unit left running (they are all kept, or stopped)
            pool.join()
    else:
        for s, k in todo:
            keep(s, k, _baseline_unit(doc, s, k))
    return [row for s, k in keys for row in units[f"{s}-{k}"]]


def _apart_from_the_study() -> None:
    """A baselines' pool process: in a process group of its own, and killed when the study process dies. A signal to
    the study's whole group (`timeout`, `kill -- -PGID`, a batch system's preemption) would otherwise end it where it
    stands, perhaps waiting for a unit with the pool's task-queue lock held, and the pool's terminate — the study's
    own stop, then its exit — would wait on that lock for ever. The study stops the pool itself. (POSIX; elsewhere
    the group is left as it is.)"""
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
    die_with_parent(signal.SIGKILL)


class BackgroundBaselines:
    """The baselines computed while the runs run: a daemon thread hands the units to a pool of up to `most`
    processes, `now` of them at work while the runs take the rest of the cores; `widen()` (the runs done) lets all
    `most` work, so that the report does not wait on units queued behind a few processes (a long synthetic series'
    ruined buy-and-hold replays bar by bar for tens of seconds a window); `stop()` (the study interrupted)
    terminates them, keeping the units done. A failure is left to `write_results`, which computes what is missing
    again (and raises)."""

    def __init__(self, spec: StudySpec, out: Path, now: int, most: int):
        self.now, self.most = max(1, min(now, most)), max(1, most)
        self._slots, self._stop = threading.Semaphore(self.now), threading.Event()
        self._thread = threading.Thread(target=self._compute, args=(spec, out), daemon=True)
        self._thread.start()

    def _compute(self, spec: StudySpec, out: Path) -> None:
        try:
            baselines(spec, out, self.most, self._slots, self._stop)
        except Exception:  # noqa: BLE001 — written again (and raised) when the results are made
            pass

    def widen(self) -> None:
        """Let every process of the pool take units (once: later calls do nothing)."""
        if self.now < self.most:
            self._slots.release(self.most - self.now)
            self.now = self.most

    def join(self) -> None:
        """Widen, then wait for every unit (in short waits: Ctrl-C and SIGTERM are taken at once meanwhile)."""
        self.widen()
        while self._thread.is_alive():
            self._thread.join(0.2)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the pool's processes and wait (up to `timeout` s) for the thread to end."""
        self._stop.set()
        self._thread.join(timeout)


def counted(n: int, noun: str) -> str:
    """'1 run', '3 runs'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def setting_text(value) -> str:
    """A setting's value as a study's variants are written: a list of names joined by '+' (feedback.off)."""
    return "+".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def fmt_timing(t: dict) -> str:
    busy = ", ".join(f"GPU {g}: {v:.0f} %" for g, v in t.get("gpu_busy_pct", {}).items() if v is not None)
    eps = t.get("epochs_per_s")
    wall = "n/a" if t.get("wall_s") is None else f"{t['wall_s']:.0f}"
    starts = t.get("starts") or 1
    total = (f"{t['wall_total_s']:.0f} s and {t['epochs_trained_total']} epochs over {starts} starts of the command; "
             "the last: " if starts > 1 and t.get("wall_total_s") is not None else "")
    mps = f" (sharing the GPU through CUDA MPS{held_to(t.get('mps_share'))})" if t.get("mps") else ""
    if t.get("lockstep"):
        mps += f", up to {t['lockstep']} a worker in lockstep"
    return (total + f"wall {wall} s, {counted(t['runs_at_once'], 'run')} at once{mps}, "
            f"{counted(t.get('epochs_trained') or 0, 'epoch')} trained, aggregate {'n/a' if eps is None else f'{eps:.3f}'} epochs/s" + (f" ({t['from']})" if t.get("from") else "")
            + (f"; busy {busy}" if busy else "")
            + (f"; mean epoch {t['mean_epoch_s']:.1f} s a run (train + evaluation)"
               if t.get("mean_epoch_s") is not None and math.isfinite(t["mean_epoch_s"]) else "")
            + _fmt_parts(t.get("epoch_parts_s") or {}) + _fmt_compile(t))


def _fmt_parts(p: dict) -> str:
    names = {"setup": "set-up", "train": "training", "eval": "evaluation", "save": "writing"}
    cells = [f"{name} {p[k]:.2f} s" for k, name in names.items() if p.get(k) is not None]
    if p.get("rollback") is not None:
        n = p["rollbacks"]
        cells.append(f"restoring a rollback's learner {p['rollback']:.2f} s ({n} epoch{'s' if n != 1 else ''} began "
                     "from one)")
    return f"; an epoch's parts (median after each run's first epoch): {', '.join(cells)}" if cells else ""


def _fmt_compile(t: dict) -> str:
    if t.get("compile_max_s") is None:
        return ""
    rest = t.get("compile_median_s")
    return (f"; compiling and capturing the step: {t['compile_max_s']:.0f} s in the run that took longest (with a "
            f"cold compile cache, the run that fills it while the other workers wait)"
            + (f", {rest:.0f} s in each other (median)" if rest is not None else ""))
