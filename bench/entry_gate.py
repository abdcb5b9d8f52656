"""What does a tighter entry gate, chosen on validation, do to the checkpoints a study selected?

The E5 gate (`shared.policy`: no new entry where the ensemble's std of Q for the chosen direction exceeds
θ) shapes the greedy policy without any learning. For every run of the given finished studies whose
selected checkpoint is kept, this re-runs that checkpoint (under the knobs it trained under) over its validation and
test windows with the gate at the `--levels` quantiles of its own validation trades' ensemble std, and without one,
all in one batched pass (`services.evaluator.runner.run_windows_many`). Per run the level is chosen on validation
only: the highest validation per-trade Sharpe among the levels that keep ≥ `--min-trades` validation trades (no
gate included; ties → the looser gate). Printed, as differences chosen − no gate, mean and 95 % CI over the
(seed, fold) units (each unit the mean of its runs; the studies' bootstrap):

- OOS per-trade Sharpe (un-annualized) — the metric the studies rank by;
- OOS per-bar Sharpe of the same passes — the account's risk-adjusted return, flat bars included;
- OOS trades, as a ratio to the ungated policy's.

The OOS of every level is printed too, as a hindsight curve (no choice may use it), and the runs whose ungated OOS
differs from the one their study recorded (a study run under other fill rules).

    python3 -m bench.entry_gate runs/cpu-gamma-low [more study directories] [--levels 0.05,0.1,0.2,0.3,0.5,0.7]
        [--min-trades 200] [--variants off,...] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

CHOICE_KEYS = ("oos_sharpe", "oos_bar_sharpe", "oos_trades")


def choose_level(levels: list[dict], min_trades: int) -> dict:
    """The level validation prefers: the highest `val_sharpe` among those with `val_trades` ≥ min_trades (a level's
    `q` None = no gate, always a candidate); ties → the looser gate (no gate loosest). Reads nothing else."""
    ok = [lv for lv in levels if lv["q"] is None or lv["val_trades"] >= min_trades]
    return max(ok, key=lambda lv: (lv["val_sharpe"], math.inf if lv["q"] is None else lv["q"]))


def unit_deltas(rows: list[dict]) -> dict[str, list[float]]:
    """Per (seed, fold) unit, the mean over its runs of chosen − no gate for each of `CHOICE_KEYS` (trades as a
    ratio)."""
    units: dict[tuple, list[dict]] = {}
    for r in rows:
        units.setdefault((r["data_seed"], r["fold"]), []).append(r)
    out: dict[str, list[float]] = {k: [] for k in CHOICE_KEYS}
    for _, rs in sorted(units.items()):
        for k in CHOICE_KEYS:
            if k == "oos_trades":
                d = [r["chosen"][k] / max(r["ungated"][k], 1) for r in rs]
            else:
                d = [r["chosen"][k] - r["ungated"][k] for r in rs]
            out[k].append(float(np.mean(d)))
    return out


def gate_levels(run_dir: Path, s: dict, spec, levels: list[float], cache: dict) -> list[dict]:
    """Validation and OOS of `run_dir`'s selected checkpoint (its summary `s`) at each gate level (and none), one
    batched pass."""
    from services.evaluator.autopsy import build_trades
    from services.evaluator.runner import eval_controls, restore_agent, run_windows_many
    from shared.costs import CostModel
    from shared.features import compute_features
    from shared.knobs import Knobs
    from shared.metrics import per_bar_sharpe, per_trade_sharpe
    from shared.policy import PolicyControls
    from tradeloop.study.spec import load_study_bars

    seed = s["data_seed"]
    if cache.get("seed") != seed:
        bars = load_study_bars(spec, seed)
        cache.update(seed=seed, bars=bars, feats=compute_features(bars))
    bars, feats = cache["bars"], cache["feats"]
    e = s["selected_epoch"]
    knobs = Knobs.from_dict(json.loads((run_dir / "loop" / f"epoch-{e:04d}.json").read_text())["knobs"])
    agent, meta, _ = restore_agent(run_dir / "checkpoints" / f"epoch-{e:04d}.safetensors", expected_sha256=None,
                                   device="cpu")
    costs = CostModel(float(meta.get("costs_bps", 1.0)))
    val, test = tuple(s["split"]["val"]), tuple(s["split"]["test"])
    base = run_windows_many([agent], bars, [val], controls=eval_controls(knobs), costs=costs, features=feats)[0][0]
    close = np.asarray(bars.close)[val[0]:val[1]]
    std = build_trades(base.ledger, base.preds, base.regimes, close, cost_rate=costs.rate).ensemble_std
    qs: list[float | None] = [*levels, None]
    thetas = [math.inf if q is None or not std.size else float(np.quantile(std, q)) for q in qs]
    ctl = [PolicyControls.make("cpu", epsilon=0.0, gate_threshold=t, regime_confidence=knobs.regime_confidence)
           for t in thetas]
    runs = run_windows_many([agent] * len(ctl), bars, [val, test], controls=ctl, costs=costs, features=feats)
    out = []
    for q, (v, o) in zip(qs, runs):
        out.append({"q": q, "val_sharpe": per_trade_sharpe(v.ledger["net_return"]), "val_trades": len(v.ledger),
                    "oos_sharpe": per_trade_sharpe(o.ledger["net_return"]), "oos_trades": len(o.ledger),
                    "oos_bar_sharpe": per_bar_sharpe(o.bar_returns)})
    return out


def main(argv: list[str] | None = None) -> None:
    from tradeloop.study.spec import StudySpec
    from tradeloop.study.stats import describe
    from tradeloop.study.intervals import bootstrap_ci

    ap = argparse.ArgumentParser(prog="python3 -m bench.entry_gate", description=__doc__.split("\n\n")[0])
    ap.add_argument("studies", nargs="+", type=Path, help="finished study directories (their runs/ kept)")
    ap.add_argument("--levels", default="0.05,0.1,0.2,0.3,0.5,0.7",
                    help="gate levels: quantiles of the run's validation trades' ensemble std")
    ap.add_argument("--min-trades", type=int, default=200, help="validation trades a level must keep to be chosen")
    ap.add_argument("--variants", default=None, help="only these variants (comma list; default every one)")
    ap.add_argument("--json", type=Path, default=None, help="also write every run's levels here")
    a = ap.parse_args(argv)
    try:
        levels = [float(x) for x in a.levels.split(",")]
    except ValueError:
        raise SystemExit(f"error: --levels {a.levels!r}: a comma list of quantiles in (0, 1)") from None
    if not levels or any(not 0.0 < q < 1.0 for q in levels):
        raise SystemExit(f"error: --levels {a.levels!r}: a comma list of quantiles in (0, 1)")
    keep = None if a.variants is None else set(a.variants.split(","))
    rows: list[dict] = []
    for study in a.studies:
        try:
            spec = StudySpec.from_dict(json.loads((study / "study.json").read_text())["spec"])
        except (OSError, ValueError, KeyError) as exc:
            raise SystemExit(f"error: {study}/study.json is missing or unreadable ({exc})") from None
        cache: dict = {}
        runs = [(sj.parent, json.loads(sj.read_text())) for sj in (study / "runs").glob("*/summary.json")]
        for run_dir, s in sorted(runs, key=lambda r: (r[1]["data_seed"], r[0].name)):   # one market at a time
            if (keep is not None and s["variant"] not in keep) or not s.get("selectable"):
                continue
            lv = gate_levels(run_dir, s, spec, levels, cache)
            chosen = choose_level(lv, a.min_trades)
            rows.append({"study": study.name, "run": s["run_id"], "variant": s["variant"], "data_seed": s["data_seed"],
                         "fold": s["fold"], "levels": lv, "chosen": chosen, "ungated": lv[-1],
                         "recorded_oos_sharpe": s["oos_sharpe"]})
            print(f"{study.name}/{s['run_id']}: gate at q = {chosen['q']}, OOS {chosen['oos_sharpe']:+.3f} "
                  f"({chosen['oos_trades']} trades) against {lv[-1]['oos_sharpe']:+.3f} ({lv[-1]['oos_trades']})",
                  flush=True)
    if not rows:
        raise SystemExit("error: no run with a selected checkpoint kept in the given studies")
    d = unit_deltas(rows)
    print(f"\n{len(rows)} runs, {len(d['oos_sharpe'])} (seed, fold) units; chosen − no gate, "
          "mean [95 % CI] over units:\n")
    print("| OOS per-trade Sharpe | OOS per-bar Sharpe | OOS trades (ratio) | runs gated |")
    print("|---|---|---|---|")
    cis = {k: bootstrap_ci(v) for k, v in d.items()}
    gated = sum(r["chosen"]["q"] is not None for r in rows)
    print(f"| {describe(cis['oos_sharpe'])} | {describe(cis['oos_bar_sharpe'], '+.4f')} | "
          f"{describe(cis['oos_trades'], '.2f')} | {gated}/{len(rows)} |")
    moved = [r for r in rows if abs(r["ungated"]["oos_sharpe"] - r["recorded_oos_sharpe"]) > 1e-9]
    print(f"\nNo gate against the OOS the study recorded (the simulator then and now): {len(moved)} of {len(rows)} "
          f"runs differ" + (", by " + ", ".join(f"{r['ungated']['oos_sharpe'] - r['recorded_oos_sharpe']:+.3f}"
                                                  for r in moved) if moved else "") + ".")
    print("\nHindsight (OOS at every level, mean over runs): "
          + ", ".join(f"q {lv['q']}: per-trade {np.mean([r['levels'][i]['oos_sharpe'] for r in rows]):+.3f}, "
                      f"per-bar {np.mean([r['levels'][i]['oos_bar_sharpe'] for r in rows]):+.4f}"
                      for i, lv in enumerate(rows[0]["levels"])))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "cis": cis}, indent=1))


if __name__ == "__main__":
    main()
