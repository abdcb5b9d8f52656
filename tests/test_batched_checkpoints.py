"""Several checkpoints of one architecture in one batched pass (`shared.rollout.greedy_pass_many`,
`services.evaluator.runner.window_passes_many`): for every (checkpoint, window) the same ledger, equity, positions
and decisions as a pass of that checkpoint alone — bit for bit on the native loop (the accounts of K checkpoints run
side by side in one compiled loop, each reading its own checkpoint's view rows, portfolio-shift weights, v_max,
maturity and controls), and per checkpoint on the torch modes. Agents of different architectures are refused with
a clear error.
    python3 -m pytest -q tests/test_batched_checkpoints.py
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_native_pass import NATIVE, randomise_shift, require_native  # noqa: E402,F401 (NATIVE uses it)

COSTS_BPS = 2.0


def agents_and_market(k: int, n_bars: int = 420, **cfg_kw):
    """k tiny random agents of one config (different seeds, maturities and portfolio shifts), synthetic bars, the
    market tensors of all of them, and per agent controls (different entry gates and regime confidences)."""
    from shared.agent import Agent, AgentConfig, PolicyControls
    from shared.market import compute_features
    from shared.rollout import MarketTensors
    from shared.synthetic import generate

    bars = generate(n_bars=n_bars, seed=3).bars
    feats = compute_features(bars)
    cfg = AgentConfig(**{**dict(n_features=feats.shape[1], window=8, d_model=16, n_heads=2, hidden=32, n_atoms=11,
                                ensemble=3, exit_plans=((math.inf, math.inf), (1.0, 0.5), (0.5, 1.0))), **cfg_kw})
    agents, controls = [], []
    for i in range(k):
        torch.manual_seed(100 + i)
        a = Agent(cfg).eval()
        a.maturity.fill_(0.4 + 0.2 * i)
        a.v_max.fill_(0.05 * (1 + 0.5 * i))
        randomise_shift(a, seed=11 + i)
        agents.append(a)
        controls.append(PolicyControls.make("cpu", gate_threshold=[0.0015, math.inf, 0.0025][i % 3],
                                            regime_confidence=[1.0, 0.8 - 0.2 * (i % 2), 1.0, 0.6, 1.0, 1.0, 0.9,
                                                               1.0, 0.7]))
    market = MarketTensors.from_bars(bars, 0, len(bars), cfg.window, "cpu", features=feats)
    return agents, market, controls, bars, feats


def assert_identical(p, q):
    """Two `GreedyPass`es of the same accounts: the same ledger, curves and decisions, bit for bit."""
    assert p.ledger.equals(q.ledger)
    for name in ("equity", "bar_returns", "positions", "targets", "branches", "blocked", "q", "q_std", "edge",
                 "cvar", "portfolio"):
        assert torch.equal(getattr(p, name), getattr(q, name)), name


@NATIVE
def test_batched_native_pass_equals_a_pass_per_checkpoint():
    from shared.execution import CostModel
    from shared.rollout import greedy_pass, greedy_pass_many, market_views

    agents, market, controls, _, _ = agents_and_market(3)
    costs = CostModel(cost_bps=COSTS_BPS)
    starts, L = torch.tensor([0, 57, 130]), 290
    views = [v for _, v in market_views(agents, market.windows)]
    torch.set_num_threads(2)
    many = greedy_pass_many(agents, market, views, starts, L, controls, costs, accel="native")
    assert len(many) == 3
    for k, (a, v, c) in enumerate(zip(agents, views, controls)):
        one = greedy_pass(a, market, v, starts, L, c, costs, accel="native")
        assert_identical(many[k], one)
        assert many[k].engine == "native-c" and many[k].agents_in_pass == 3 and one.agents_in_pass == 1
        # and the native loop is the eager reference's (decisions exact, money to float64 rounding)
        eager = greedy_pass(a, market, v, starts, L, c, costs, accel="eager")
        assert torch.equal(eager.branches, one.branches)
        torch.testing.assert_close(eager.equity, many[k].equity, rtol=0, atol=1e-12)
    # the pass exercised stops, targets, signal exits, blocked entries, many trades
    reasons = set().union(*(set(p.ledger["exit_reason"]) for p in many))
    assert {"stop", "target", "signal"} <= reasons and sum(len(p.ledger) for p in many) > 30
    assert all(int(p.blocked.sum()) > 0 for p in many[::2])
    # the checkpoints decide differently: a pass that read one set for every account could not pass
    for k in (1, 2):
        assert not torch.equal(many[0].branches, many[k].branches)
        assert not torch.equal(many[0].equity, many[k].equity)
    # "auto" on a CPU with a compiler is this batched pass
    auto = greedy_pass_many(agents, market, views, starts, L, controls, costs)
    assert all(p.agents_in_pass == 3 for p in auto) and auto[2].ledger.equals(many[2].ledger)


def test_torch_engines_run_a_pass_per_checkpoint():
    from shared.execution import CostModel
    from shared.rollout import greedy_pass, greedy_pass_many, market_views

    agents, market, controls, _, _ = agents_and_market(2, n_bars=200)
    costs = CostModel(cost_bps=COSTS_BPS)
    starts, L = torch.tensor([5, 40]), 150
    views = [v for _, v in market_views(agents, market.windows)]
    many = greedy_pass_many(agents, market, views, starts, L, controls, costs, accel="eager")
    for k in range(2):
        assert many[k].engine == "torch-eager" and many[k].agents_in_pass == 1
        assert_identical(many[k], greedy_pass(agents[k], market, views[k], starts, L, controls[k], costs,
                                              accel="eager"))
    assert not torch.equal(many[0].branches, many[1].branches)


@NATIVE
def test_window_passes_many_equals_window_passes_per_checkpoint():
    """The evaluator's entry point: windows of two lengths (two groups), K checkpoints; every field of every
    window's result, post hoc predictions included."""
    from services.evaluator.runner import window_passes, window_passes_many
    from shared.execution import CostModel

    agents, _, controls, bars, feats = agents_and_market(3, n_bars=500)
    costs = CostModel(cost_bps=COSTS_BPS)
    wins = [(60, 300), (300, 470), (100, 340)]
    taus = (0.1, 0.5, 0.9)
    many = window_passes_many(agents, bars, wins, taus=taus, controls=controls, costs=costs, features=feats)
    assert len(many) == 3 and all(len(r) == len(wins) for r in many)
    for k in range(3):
        one = window_passes(agents[k], bars, wins, taus=taus, controls=controls[k], costs=costs, features=feats)
        for got, want in zip(many[k], one):
            assert got["window"] == want["window"] and got["engine"] == want["engine"] == "native-c"
            assert got["ledger"].equals(want["ledger"])
            for name in ("equity", "bar_returns", "positions", "regimes", "targets"):
                assert np.array_equal(got[name], want[name]), name
            for name, v in want["preds"].items():
                if isinstance(v, np.ndarray):
                    assert np.array_equal(got["preds"][name], v, equal_nan=True), name
                else:
                    assert got["preds"][name] == v
    assert not many[0][0]["ledger"].equals(many[1][0]["ledger"])


def test_checkpoints_of_different_architectures_are_refused():
    from shared.agent import Agent
    from shared.rollout import greedy_pass_many, market_views

    agents, market, controls, bars, _ = agents_and_market(2, n_bars=120)
    other = Agent(agents[0].cfg.__class__(**{**vars(agents[0].cfg), "shift_hidden": 24})).eval()
    views = [v for _, v in market_views(agents, market.windows)] + [None]
    with pytest.raises(ValueError, match=r"agent 2 has another AgentConfig than agent 0 \(differs in "
                                         r"shift_hidden\).*share one architecture"):
        greedy_pass_many(agents + [other], market, views, torch.tensor([0]), 50, controls + controls[:1])
    with pytest.raises(ValueError, match="no agent given"):
        greedy_pass_many([], market, [], torch.tensor([0]), 50, controls)
    from services.evaluator.runner import window_passes_many

    with pytest.raises(ValueError, match="share one architecture"):
        window_passes_many([agents[0], other], bars, [(10, 60)], taus=(0.5,))
