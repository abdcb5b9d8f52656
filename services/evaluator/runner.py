"""The evaluator library: a checkpoint in, a full `shared.report.EvalReport` out.

    evaluate_checkpoint(ckpt, expected_sha256=..., bars=..., split=..., run_id=..., epoch=...) -> EvalReport
    run_split(agent, bars, window)    -> SplitRun   (one greedy continuous pass over one bar range)
    run_windows(agent, bars, windows) -> [SplitRun] (several ranges at once, as accounts of one simulator)
    window_passes_many(agents, bars, windows, taus=...) -> per agent [dict] (K checkpoints of one architecture in
                                                                   one batched pass)
    report_for_cli(checkpoint, ...)   -> CliEvaluation (the report `tradeloop evaluate` prints, and its inputs)

How a window is backtested
--------------------------
- The checkpoint's sha256 is verified before anything is parsed (`shared.checkpoints.load_checkpoint`); the agent
  is rebuilt from the metadata's `agent_config` and its tensors. The policy runs greedy (ε = 0) with the gates it
  trained under: `gate_threshold` and `regime_confidence` of the checkpoint's knobs (metadata key "knobs"; absent
  → no gate, confidence 1), and its own `maturity` buffer (the protection stack's scale).
- One continuous pass per window: the account starts flat with equity 1 at the window's first bar and is never
  reset; a position still open at the window's last bar is closed at its close (exit_reason "end").
- The market encoder and every head depend on bars only (`Agent.view`), so they are computed batched over every
  bar once; only the portfolio shift and the policy, which read the portfolio state, are stepped bar by bar — by
  `shared.rollout.greedy_pass`, whose step is `shared.rollout.policy_step`, the trainer's own loop body (this
  module never imports `services.trainer`). `accel` "auto" runs that step as a compiled C loop on the host
  (`shared.native`) where a C compiler works; the torch modes (eager, compiled, CUDA graphs of `graph_chunk` bars)
  give the same ledger — `tests/test_eval_graph.py`, `tests/test_native_pass.py`.
- Several windows are run together as accounts of one `Simulator` over the span that covers them (each account
  at its own bar index). Windows of equal length share one sequential pass; different lengths get one pass per
  length. The end close of a window that does not end the span is `Simulator.close_all()`, which books the
  same end fill in the same order as the in-step end exit, so results are bit-identical to a pass over the window
  alone (pinned by tests/test_evaluator.py against `shared.rollout.evaluate_policy` and the trainer's env).
- Per-decision predictions for the autopsy (`services.evaluator.autopsy.Predictions`): the chosen action's Q and
  ensemble std as `act` reported them (every decision, recorded by the pass); Q of each direction (ensemble mean)
  and the IQN quantiles of the chosen direction at `shared.report.TAUS` (sorted: monotone rearrangement) are
  extracted after the pass, batched, from the public `Agent` API on the recorded portfolio vectors — at the
  decisions that opened a trade only (what the autopsy reads), NaN elsewhere.

Indices: a `SplitRun` is in the window's LOCAL bar indices (0 = the window's first bar); `window` holds the
absolute (start, end) of the dataset. Sharpes are un-annualized (per trade unless named otherwise).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import pandas as pd
import torch

from shared.agent import FLAT, Agent, MarketView, PolicyControls, agent_from_checkpoint
from shared.checkpoints import CheckpointError, checkpoint_sha256, load_checkpoint, load_error_reason
from shared.execution import CostModel
from shared.knobs import Knobs
from shared.market import Bars, Split, compute_features
from shared.rollout import (GreedyPass, MarketTensors, chosen_outputs, greedy_pass, greedy_pass_many, market_view,
                            market_views)

if TYPE_CHECKING:
    from services.evaluator import autopsy as ap
    from shared.report import EvalReport

# The report stack (services.evaluator.autopsy / report_builder, shared.report: pydantic) is imported inside the
# functions that build reports, so the passes themselves (`window_passes`) run where only torch is installed.


# ---------------------------------------------------------------------------------------------------------
# Restoring the policy
# ---------------------------------------------------------------------------------------------------------
def restore_agent(ckpt: str | os.PathLike | bytes, *, expected_sha256: str | None,
                  device: str | torch.device = "cpu") -> tuple[Agent, dict, str]:
    """Verify and load a checkpoint; returns (agent in eval mode on `device`, metadata, sha256 of its bytes).

    Bytes need `expected_sha256`; a path may rely on its `<path>.sha256` sidecar instead. Raises
    `CheckpointError` on a sha256 mismatch, a pickle, a bad header, or metadata without an agent config.
    """
    if isinstance(ckpt, (bytes, bytearray, memoryview)):
        data, source = bytes(ckpt), f"<{len(ckpt)} bytes>"
        if expected_sha256 is None:
            raise CheckpointError(source, "no expected sha256 given: the evaluator only runs verified checkpoints")
        tensors, meta = load_checkpoint(data, expected_sha256)
        sha = checkpoint_sha256(data)
    else:
        tensors, meta = load_checkpoint(ckpt, expected_sha256)
        source = str(ckpt)
        sha = checkpoint_sha256(Path(ckpt).read_bytes())
    if "agent_config" not in meta:
        raise CheckpointError(source, "metadata has no 'agent_config' (not an agent checkpoint: a trainer-state "
                                      "file?)")
    try:
        agent = agent_from_checkpoint(tensors, meta, device)       # the one agent loader (shared.agent)
    except (TypeError, KeyError, RuntimeError, ValueError) as exc:
        raise CheckpointError(source, f"tensors do not fit the agent config: {load_error_reason(exc, None)}") from None
    return agent, meta, sha


def trained_knobs(meta: dict) -> Knobs | None:
    """The knobs the checkpoint trained under (metadata key "knobs"), None when the metadata does not say."""
    k = meta.get("knobs")
    return None if k is None else Knobs.from_dict(k)


def eval_controls(knobs: Knobs | None, device: str | torch.device = "cpu", shaping: bool = True) -> PolicyControls:
    """Greedy controls (ε = 0) with the gates as trained: the knobs' E5 gate threshold and E9 regime confidence —
    the knobs that shape the greedy policy itself, so they move validation the next epoch without any learning.
    `shaping=False`: neither (no gate, full size in every regime): the policy as learned. (E1's Q-bias enters
    only the bootstrap targets of the update: it shapes learning, never the greedy policy.)"""
    k = knobs if knobs is not None and shaping else Knobs()
    return PolicyControls.make(device, epsilon=0.0, gate_threshold=k.gate_threshold,
                               regime_confidence=k.regime_confidence)


def shapes_policy(knobs: Knobs | None) -> bool:
    """The knobs change the greedy policy `eval_controls` runs: a finite E5 gate or an E9 confidence below 1."""
    return knobs is not None and (not math.isinf(knobs.gate_threshold)
                                  or any(c != 1.0 for c in knobs.regime_confidence))


# ---------------------------------------------------------------------------------------------------------
# Running windows
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SplitRun:
    """One greedy continuous pass over one window (local indices; see the module docstring)."""

    window: tuple[int, int]
    """(start, end) absolute bar indices of the window (half-open)."""
    ledger: pd.DataFrame
    """Closed trades (`shared.execution.LEDGER_COLUMNS`), account 0, bar indices local to the window."""
    equity: np.ndarray
    """[T] equity at each close (1.0 at the first bar)."""
    bar_returns: np.ndarray
    """[T] equity return over each bar (0 at the first)."""
    positions: np.ndarray
    """[T] position held at each close (0 at the last: closed there)."""
    preds: ap.Predictions
    """Per decision bar t (0..T−2) the policy's outputs; row T−1 (no decision) is flat with zero predictions."""
    regimes: np.ndarray
    """[T] regime label at each bar."""
    targets: np.ndarray
    """[T] target position decided at each close (0 at the last)."""
    engine: str = ""
    """The path that ran the pass (`shared.rollout.ENGINES`: "native-c", "torch-eager", ...)."""
    agents_in_pass: int = 1
    """Checkpoints whose accounts shared the pass (`window_passes_many` on the native loop: K; else 1)."""


def _run_group(agent: Agent, market: MarketTensors, emb: torch.Tensor, view: MarketView, starts: list[int],
               length: int, controls: PolicyControls, costs: CostModel, taus: Sequence[float], pred_chunk: int,
               accel: str, graph_chunk: int) -> list[dict[str, Any]]:
    """B = len(starts) accounts of equal window `length`, local starts into `market` (emb, view: every bar's
    embedding and market view): one `greedy_pass`, then the post hoc predictions batched. Returns per window the
    `SplitRun` fields as plain arrays, with "preds" the keywords of `autopsy.Predictions`."""
    start_t = torch.tensor(starts, dtype=torch.long, device=emb.device)                   # B
    p = greedy_pass(agent, market, view, start_t, length, controls, costs, accel=accel, chunk=graph_chunk)
    return _group_runs(agent, market, emb, p, starts, length, taus, pred_chunk)


def _group_runs(agent: Agent, market: MarketTensors, emb: torch.Tensor, p: GreedyPass, starts: list[int],
                length: int, taus: Sequence[float], pred_chunk: int) -> list[dict[str, Any]]:
    """`_run_group`'s answer from the agent's `GreedyPass` `p` of those B accounts: the post hoc predictions
    batched, then per window the `SplitRun` fields as plain arrays."""
    dev = emb.device
    B, L, S = len(starts), length, length - 1
    start_t = torch.tensor(starts, dtype=torch.long, device=dev)                          # B
    # post hoc predictions (Q of each direction, quantiles of the chosen one), batched, at the decisions that
    # opened a trade — the rows the autopsy and the calibration read; NaN elsewhere (`autopsy.POST_HOC`). Every
    # decision would cost the heads once more per bar: most of the evaluation on a CPU.
    led_acct = p.ledger["account"].to_numpy().astype(np.int64)
    led_row = np.clip(p.ledger["entry_t"].to_numpy().astype(np.int64) - 1 - np.asarray(starts)[led_acct], 0, S - 1)
    rows = np.unique(led_row * B + led_acct)                          # S·B flattening: row i, account k → i·B + k
    q_dir = torch.full((S * B, 3), float("nan"), device=dev)
    quant = torch.full((S * B, len(taus)), float("nan"), device=dev)
    if len(rows):
        r_t = torch.as_tensor(rows, device=dev)
        t_dec = start_t[r_t % B] + r_t // B                           # the decisions' bars in `market`
        qd, qt = chosen_outputs(agent, emb, t_dec, p.portfolio.reshape(S * B, -1)[r_t],
                                p.branches[..., 0].reshape(-1)[r_t],
                                torch.tensor(taus, dtype=torch.float32, device=dev), chunk=pred_chunk)
        q_dir[r_t], quant[r_t] = qd, qt.sort(dim=1).values            # monotone rearrangement of the quantiles

    regime_all = market.regime.cpu().numpy()
    n_sizes = len(agent.cfg.size_levels)
    to = lambda x: x.cpu().numpy()  # noqa: E731
    eq, br, pos, branches, q, q_std = map(to, (p.equity, p.bar_returns, p.positions, p.branches, p.q, p.q_std))
    tgt = np.concatenate([to(p.targets), np.zeros((1, B))])                                  # L × B
    q_dir, quant = to(q_dir.view(S, B, 3)), to(quant.view(S, B, len(taus)))
    bounds = np.searchsorted(p.ledger["account"].to_numpy(), np.arange(B + 1))  # the ledger is sorted by account
    out_runs = []
    for k, s0 in enumerate(starts):
        led = p.ledger.iloc[bounds[k]:bounds[k + 1]].copy()
        led["account"] = 0
        led["entry_t"] -= s0
        led["exit_t"] -= s0
        pad = lambda a, fill: np.concatenate([a, np.full((1, *a.shape[1:]), fill, dtype=a.dtype)])  # noqa: E731
        preds = dict(
            direction=pad(branches[:, k, 0], FLAT), size=pad(branches[:, k, 1], 0), exit=pad(branches[:, k, 2], 0),
            q_mean=pad(q[:, k].astype(np.float64), 0.0), q_quantiles=pad(quant[:, k].astype(np.float64), np.nan),
            ensemble_std=pad(q_std[:, k].astype(np.float64), 0.0),
            q_dir=pad(q_dir[:, k].astype(np.float64), np.nan),
            n_sizes=n_sizes)
        out_runs.append(dict(ledger=led.reset_index(drop=True), equity=eq[:, k], bar_returns=br[:, k],
                             positions=pos[:, k], preds=preds, regimes=regime_all[s0:s0 + L], targets=tgt[:, k],
                             engine=p.engine, agents_in_pass=p.agents_in_pass))
    return out_runs


def _checked_windows(windows: Sequence[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The windows as int pairs; ValueError naming the first that is not a range of ≥ 2 of the n bars."""
    wins = [(int(s), int(e)) for s, e in windows]
    for i, (s, e) in enumerate(wins):
        if not 0 <= s < e <= n or e - s < 2:
            raise ValueError(f"window {i} = ({s}, {e}) must satisfy 0 <= start, start + 2 <= end <= {n} bars")
    return wins


@torch.no_grad()
def window_passes(agent: Agent, bars: Bars, windows: Sequence[tuple[int, int]], *, taus: Sequence[float],
                  controls: PolicyControls | None = None, costs: CostModel = CostModel(),
                  features: np.ndarray | None = None, device: str | torch.device | None = None,
                  encode_chunk: int | None = None, pred_chunk: int = 65536, accel: str = "auto",
                  graph_chunk: int = 64, bf16_encoder: bool = False) -> list[dict[str, Any]]:
    """`run_windows` without the report's types: per window a dict of the `SplitRun` fields as plain arrays
    ("preds": the keywords of `autopsy.Predictions`, quantiles at `taus`). Imports no web stack (pydantic)."""
    agent.eval()
    dev = torch.device(device) if device is not None else next(agent.parameters()).device
    wins = _checked_windows(windows, len(bars))
    if not wins:
        return []
    controls = controls if controls is not None else eval_controls(None, dev)
    feats = compute_features(bars) if features is None else features
    if feats.shape[1] != agent.cfg.n_features:
        raise ValueError(f"the data have {feats.shape[1]} features per bar but the agent expects "
                         f"{agent.cfg.n_features}")
    lo, hi = min(s for s, _ in wins), max(e for _, e in wins)
    market = MarketTensors.from_bars(bars, lo, hi, agent.cfg.window, dev, features=feats)
    # the market encoder, batched over every bar of the span: T × W × F → T × D
    # every head that does not read the portfolio, batched over the span
    emb, view = market_view(agent, market.windows, encode_chunk, bf16_encoder)
    runs: list[dict[str, Any] | None] = [None] * len(wins)
    for length in sorted({e - s for s, e in wins}):
        idx = [i for i, (s, e) in enumerate(wins) if e - s == length]
        res = _run_group(agent, market, emb, view, [wins[i][0] - lo for i in idx], length, controls, costs, taus,
                         pred_chunk, accel, graph_chunk)
        for i, r in zip(idx, res):
            runs[i] = dict(window=wins[i], **r)
    return runs  # type: ignore[return-value]


@torch.no_grad()
def window_passes_many(agents: Sequence[Agent], bars: Bars, windows: Sequence[tuple[int, int]], *,
                       taus: Sequence[float], controls: PolicyControls | Sequence[PolicyControls] | None = None,
                       costs: CostModel = CostModel(), features: np.ndarray | None = None,
                       device: str | torch.device | None = None, encode_chunk: int | None = None,
                       pred_chunk: int = 65536, accel: str = "auto", graph_chunk: int = 64,
                       bf16_encoder: bool = False) -> list[list[dict[str, Any]]]:
    """`window_passes` of K checkpoints of one architecture (ValueError naming what differs otherwise) over the same
    windows, in one batched pass: per agent k, exactly the list `window_passes(agents[k], …, controls=controls[k])`
    returns. `controls`: one per agent, or one for all (default `eval_controls(None)`: no gate).

    The span's market tensors are built once; each agent's encoder and view table run batched over every bar
    (`shared.rollout.market_views`); per window length, the K agents' accounts step in one sequential pass
    (`shared.rollout.greedy_pass_many`: the native loop runs all K·W accounts at once; the torch modes one pass per
    agent — each run's "engine" and "agents_in_pass" say which happened); then each agent's post hoc predictions,
    as `window_passes` computes them."""
    from shared.native import check_same_config

    agents = list(agents)
    check_same_config(agents)
    for a in agents:
        a.eval()
    K = len(agents)
    dev = torch.device(device) if device is not None else next(agents[0].parameters()).device
    wins = _checked_windows(windows, len(bars))
    if not wins:
        return [[] for _ in agents]
    if controls is None or isinstance(controls, PolicyControls):
        ctl = [controls if controls is not None else eval_controls(None, dev)] * K
    else:
        ctl = list(controls)
        if len(ctl) != K:
            raise ValueError(f"{K} agents need one controls each or one for all, got {len(ctl)}")
    feats = compute_features(bars) if features is None else features
    if feats.shape[1] != agents[0].cfg.n_features:
        raise ValueError(f"the data have {feats.shape[1]} features per bar but the agents expect "
                         f"{agents[0].cfg.n_features}")
    lo, hi = min(s for s, _ in wins), max(e for _, e in wins)
    market = MarketTensors.from_bars(bars, lo, hi, agents[0].cfg.window, dev, features=feats)
    tables = market_views(agents, market.windows, encode_chunk, bf16_encoder)          # per agent (emb, view)
    runs: list[list[dict[str, Any] | None]] = [[None] * len(wins) for _ in agents]
    for length in sorted({e - s for s, e in wins}):
        idx = [i for i, (s, e) in enumerate(wins) if e - s == length]
        starts = [wins[i][0] - lo for i in idx]
        passes = greedy_pass_many(agents, market, [v for _, v in tables], torch.tensor(starts, device=dev), length,
                                  ctl, costs, accel=accel, chunk=graph_chunk)
        for k, (agent, (emb, _), p) in enumerate(zip(agents, tables, passes)):
            res = _group_runs(agent, market, emb, p, starts, length, taus, pred_chunk)
            for i, r in zip(idx, res):
                runs[k][i] = dict(window=wins[i], **r)
    return runs  # type: ignore[return-value]


def run_windows(agent: Agent, bars: Bars, windows: Sequence[tuple[int, int]], **kwargs: Any) -> list[SplitRun]:
    """Greedy continuous passes of `agent` over several windows [start, end) of `bars`, batched as accounts.

    Encodes every bar of the covering span once, then steps one pass per distinct window length with all
    windows of that length as accounts of one simulator. Keywords (see `window_passes`): `controls` (default
    `eval_controls(None)`: no gate), `costs`, `features` (`compute_features(bars)` when already computed),
    `device`, `encode_chunk`, `pred_chunk`, and `accel` = "auto" | "native" | "eager" | "compile" | "graph" |
    "compile+graph" with `graph_chunk` bars per CUDA graph (`shared.rollout.greedy_pass`; "auto": the native loop
    where a C compiler works).
    Returns one `SplitRun` per window, in order.
    """
    from services.evaluator import autopsy as ap  # the report's types (pydantic): not needed by the passes
    from shared.report import TAUS

    runs = window_passes(agent, bars, windows, taus=TAUS, **kwargs)
    return [SplitRun(**{**r, "preds": ap.Predictions(**r["preds"])}) for r in runs]


def run_windows_many(agents: Sequence[Agent], bars: Bars, windows: Sequence[tuple[int, int]],
                     **kwargs: Any) -> list[list[SplitRun]]:
    """`run_windows` of K checkpoints of one architecture in one batched pass (`window_passes_many`; keywords as
    there, `controls` one per agent or one for all): per agent, one `SplitRun` per window, in order."""
    from services.evaluator import autopsy as ap
    from shared.report import TAUS

    return [[SplitRun(**{**r, "preds": ap.Predictions(**r["preds"])}) for r in runs]
            for runs in window_passes_many(agents, bars, windows, taus=TAUS, **kwargs)]


def run_split(agent: Agent, bars: Bars, window: tuple[int, int], **kwargs: Any) -> SplitRun:
    """One greedy continuous pass over `window` = (start, end) of `bars` (keywords: see `run_windows`)."""
    return run_windows(agent, bars, [window], **kwargs)[0]


# ---------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------
def insample_window(split: Split, n_bars: int | None) -> tuple[int, int] | None:
    """The in-sample window: the last `n_bars` bars of the training split (None or ≥ its length: all of it;
    0: none)."""
    s, e = split.train
    if n_bars is not None and n_bars <= 0:
        return None
    n = e - s if n_bars is None else min(int(n_bars), e - s)
    return (e - n, e) if n >= 2 else None


def split_reports(named: Sequence[tuple[str, tuple[int, int]]], runs: Sequence[SplitRun], bars: Bars,
                  costs: CostModel, n_trials: int, prior_sharpes: Sequence[float],
                  prior_trades: Sequence[int] | None = None) -> dict:
    """name → `SplitReport` of each named window's run (the val DSR deflated by `n_trials` with `prior_sharpes` as
    the trials' variance; the other windows' DSR by `n_trials` alone)."""
    from services.evaluator.report_builder import build_split_report
    from shared.report import bars_window_hash

    out = {}
    for (name, w), run in zip(named, runs):
        out[name] = build_split_report(
            name, window=w, window_hash=bars_window_hash(bars, *w), ledger=run.ledger,
            bar_returns=run.bar_returns, positions=run.positions, equity=run.equity, preds=run.preds,
            regimes=run.regimes, close=np.asarray(bars.close)[w[0]:w[1]], cost_rate=costs.rate,
            n_trials=n_trials, prior_sharpes=prior_sharpes if name == "val" else (), prior_trades=prior_trades,
            engine=run.engine)
    return out


def evaluate_checkpoint(ckpt_bytes_or_path: str | os.PathLike | bytes, *, expected_sha256: str | None,
                        bars: Bars, split: Split, run_id: str, epoch: int, n_trials: int = 1,
                        prior_sharpes: Sequence[float] = (), prior_trades: Sequence[int] | None = None,
                        insample_bars: int | None = -1,
                        device: str | torch.device = "cpu", costs: CostModel | None = None, dataset: str = "",
                        oos: bool = True, features: np.ndarray | None = None,
                        knobs: Knobs | None = None, shaping: bool = True) -> EvalReport:
    """The full report of one checkpoint: val and OOS backtests (every metric, PSR, DSR deflated by `n_trials`
    = checkpoints evaluated in the run so far, this one included, with `prior_sharpes` = the earlier
    checkpoints' val per-trade Sharpes as the trials' variance, over those of enough validation trades to be
    selected where `prior_trades` gives their trades), the val/OOS gap, ledgers with predictions,
    equity curves and the autopsy, plus an in-sample backtest of the training split for E6/E7.

    insample_bars: bars of the in-sample window at the end of the train split; −1 (default) = as many as the
    validation window (so both share one pass), None = the whole train split, 0 = no in-sample backtest.
    costs: default `CostModel(metadata["costs_bps"])` when the checkpoint says, else `CostModel()`.
    knobs: the knobs the checkpoint trained under, when known from elsewhere (default: its metadata "knobs").
    shaping: False runs the greedy policy without the knobs that shape it (E5 gate, E9 regime confidence:
    `eval_controls`), to tell learning from policy shaping; the report says so (`policy_shaping`) and still
    carries the knobs the checkpoint trained under.
    Raises CheckpointError (untrusted checkpoint) or ValueError (data that do not fit the agent / split).
    """
    from services.evaluator.report_builder import build_eval_report, split_definition

    agent, meta, sha = restore_agent(ckpt_bytes_or_path, expected_sha256=expected_sha256, device=device)
    knobs = knobs if knobs is not None else trained_knobs(meta)
    if costs is None:
        costs = CostModel(float(meta.get("costs_bps", 1.0)))
    if split.test[1] > len(bars):
        raise ValueError(f"split ranges up to bar {split.test[1]} but the data have {len(bars)} bars")
    val_len = split.val[1] - split.val[0]
    ins = insample_window(split, val_len if insample_bars == -1 else insample_bars)
    named = [("val", tuple(split.val))] + ([("oos", tuple(split.test))] if oos else []) + \
            ([("insample", ins)] if ins is not None else [])
    feats = compute_features(bars) if features is None else features
    runs = run_windows(agent, bars, [w for _, w in named], controls=eval_controls(knobs, device, shaping), costs=costs,
                       features=feats, device=device)
    sreps = split_reports(named, runs, bars, costs, n_trials, prior_sharpes, prior_trades)
    return build_eval_report(
        run_id=run_id, epoch=epoch, split=split_definition(split, bars), val=sreps["val"], oos=sreps.get("oos"),
        insample=sreps.get("insample"), n_trials=n_trials, knobs=None if knobs is None else knobs.to_dict(),
        policy_shaping=shaping,
        checkpoint_sha256=sha, config_hash=str(meta.get("config_hash") or ""),
        dataset=dataset or str(meta.get("dataset") or bars.name))


# ---------------------------------------------------------------------------------------------------------
# The command line's entry point
# ---------------------------------------------------------------------------------------------------------
def val_sharpe_of(raw: bytes | str | None) -> tuple[float, int] | None:
    """(validation per-trade Sharpe, validation trades) of a stored report's JSON (None when absent)."""
    if raw is None:
        return None
    m = (json.loads(raw).get("val") or {}).get("metrics") or {}
    s = m.get("per_trade_sharpe")
    return None if s is None else (float(s), int(m.get("n_trades") or 0))
