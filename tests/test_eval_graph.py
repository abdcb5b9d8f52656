"""The evaluator's sequential pass (`shared.rollout.greedy_pass`) in every `accel` mode gives what a plain
bar-by-bar loop gives: the same ledger, equity, positions and decisions; and `act`'s tail-only quantiles give the
CVaR of the full grid.

CPU tests: the pass against a reference loop (`policy_step` + the simulator's own ledger recorder), 1 and 3
accounts, exit plans tight enough that stops and targets fire; the chunk schedule of the graph modes with an
eager stand-in for the capture. GPU tests (skipped without CUDA): graph and compile+graph against eager on CUDA.
Runs where only torch, numpy, pandas and pytest are installed:
    python3 -m pytest -q tests/test_eval_graph.py
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import shared.graphs
from shared.agent import Agent, AgentConfig, PolicyControls, act
from shared.execution import CostModel, Simulator
from shared.market import compute_features
from shared.rollout import (MarketTensors, PortfolioTracker, chosen_outputs, evaluate_policy, greedy_pass,
                            policy_step)
from shared.synthetic import generate

COSTS = CostModel(cost_bps=2.0)
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def bars():
    return generate(n_bars=700, seed=3).bars


@pytest.fixture(scope="module")
def feats(bars):
    return compute_features(bars)


def make_agent(n_features: int, device="cpu") -> Agent:
    """A tiny agent, protection stack on, with exit plans of 0.5–1 bar volatilities (stops and targets fire)."""
    torch.manual_seed(5)
    cfg = AgentConfig(n_features=n_features, window=8, d_model=16, n_heads=2, hidden=32, n_atoms=11, ensemble=3,
                      exit_plans=((math.inf, math.inf), (1.0, 0.5), (0.5, 1.0)))
    agent = Agent(cfg).eval()
    agent.maturity.fill_(0.6)
    torch.manual_seed(1)
    with torch.no_grad():                  # a portfolio shift that matters (a fresh agent's last layer is zero)
        agent.shift[2].weight.normal_(0.0, 0.05)
    return agent.to(device)


def setup(bars, feats, device="cpu"):
    agent = make_agent(feats.shape[1], device)
    market = MarketTensors.from_bars(bars, 0, len(bars), agent.cfg.window, device, features=feats)
    with torch.no_grad():
        emb = agent.encode(market.windows)
    view = agent.view_table(emb)
    controls = PolicyControls.make(device, gate_threshold=0.0022,  # the epistemic gate blocks a few entries
                                   regime_confidence=[1.0, 0.8, 1.0, 0.6, 1.0, 1.0, 0.9, 1.0, 0.7])
    return agent, market, emb, view, controls


@torch.no_grad()
def reference(agent, market, view, starts, length, controls):
    """The plain loop: `policy_step` bar by bar, the simulator recording its own ledger, then the end close."""
    B = len(starts)
    sim = Simulator(market.prices, B, COSTS, record_ledger=True)
    sim.reset(starts)
    tracker = PortfolioTracker(B, view.q.device)
    eq, pos, recs = [sim.equity.clone()], [sim.position.clone()], []
    for _ in range(length - 1):
        rec = policy_step(agent, sim, tracker, market, controls, view=view.rows(sim.t))
        eq.append(sim.equity.clone())
        pos.append(rec.result.position.clone())
        recs.append(rec)
    sim.close_all()
    eq[-1], pos[-1] = sim.equity.clone(), torch.zeros_like(pos[-1])
    return sim.ledger(), torch.stack(eq), torch.stack(pos), recs


def assert_same(p, q, *, exact: bool = True):
    """Two `GreedyPass`es: same trades and curves (bit for bit, or to 1e-9 where compiled kernels round
    differently) and the same decisions."""
    cols = ["account", "entry_t", "exit_t", "side", "bars", "exit_reason"]
    assert p.ledger[cols].equals(q.ledger[cols])
    if exact:
        assert p.ledger.equals(q.ledger)
        assert torch.equal(p.equity, q.equity) and torch.equal(p.positions, q.positions)
    else:
        for c in ("size", "entry_price", "exit_price", "net_return"):
            np.testing.assert_allclose(p.ledger[c], q.ledger[c], rtol=0, atol=1e-9)
        torch.testing.assert_close(p.equity, q.equity, rtol=0, atol=1e-9)
        torch.testing.assert_close(p.positions, q.positions, rtol=0, atol=1e-9)
    assert torch.equal(p.branches, q.branches) and torch.equal(p.blocked, q.blocked)
    torch.testing.assert_close(p.q, q.q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("starts", [[40], [10, 200, 305]])
def test_pass_equals_the_plain_loop(bars, feats, starts):
    agent, market, emb, view, controls = setup(bars, feats)
    st, L = torch.tensor(starts), 390
    p = greedy_pass(agent, market, view, st, L, controls, COSTS, accel="eager", chunk=16)  # 16: many flushes
    ledger, eq, pos, recs = reference(agent, market, view, st, L, controls)
    reasons = set(ledger["exit_reason"])
    assert {"stop", "target"} <= reasons and len(ledger) > 15 * len(starts), reasons
    assert p.ledger.equals(ledger)
    assert torch.equal(p.equity, eq) and torch.equal(p.positions, pos)
    assert torch.equal(p.bar_returns[1:], p.equity[1:] / p.equity[:-1] - 1.0)
    stack = lambda f: torch.stack([f(r) for r in recs])  # noqa: E731
    assert torch.equal(p.branches, stack(lambda r: r.action.branches))
    assert torch.equal(p.targets, stack(lambda r: r.action.target))
    assert torch.equal(p.blocked, stack(lambda r: r.action.blocked)) and p.blocked.any()
    for name in ("q", "q_std", "edge", "cvar"):
        assert torch.equal(getattr(p, name), stack(lambda r: getattr(r.action, name))), name
    assert torch.equal(p.portfolio, stack(lambda r: r.portfolio))


def test_graph_chunk_schedule_with_an_eager_stand_in(bars, feats, monkeypatch):
    """The graph modes' schedule (warm-up chunk, replays, eager tail, a ledger flush after each) with the capture
    replaced by calling the chunk: the same pass as eager, for chunk sizes that do and do not divide the steps."""
    agent, market, emb, view, controls = setup(bars, feats)
    st = torch.tensor([10, 200, 305])
    base = greedy_pass(agent, market, view, st, 390, controls, COSTS, accel="eager")
    calls = []

    def fake_capture(fn, warmup):
        for _ in range(warmup):
            fn()
        calls.append(fn)
        return fn

    monkeypatch.setattr(shared.graphs, "capture", fake_capture)
    monkeypatch.setattr("shared.graphs.resolve_accel", lambda accel, device: accel)
    for chunk in (389, 97, 20):   # S = 389 steps: one chunk (no capture), 4 chunks + 1 tail step, 19 + a tail of 9
        calls.clear()
        p = greedy_pass(agent, market, view, st, 390, controls, COSTS, accel="graph", chunk=chunk)
        assert len(calls) == (1 if 389 // chunk >= 2 else 0)
        assert_same(p, base)


def test_act_tail_quantiles_give_the_full_grid_cvar(bars, feats):
    agent, market, emb, view, controls = setup(bars, feats)
    p = greedy_pass(agent, market, view, torch.tensor([10, 200]), 300, controls, COSTS)
    d = p.branches[..., 0].reshape(-1)
    t_dec = (torch.tensor([10, 200]) + torch.arange(299).unsqueeze(1)).reshape(-1)
    _, full = chosen_outputs(agent, emb, t_dec, p.portfolio.reshape(d.shape[0], -1), d, agent.act_taus)
    tail = (agent.act_taus <= agent.cfg.cvar_alpha).float()
    assert int(tail.sum()) == 3   # of 32: only these are evaluated while acting
    cvar_full = (full * tail).sum(1) / tail.sum()
    torch.testing.assert_close(p.cvar.reshape(-1), cvar_full, rtol=1e-5, atol=1e-7)
    # act's own quantiles are the tail's columns of the full grid
    B = 4
    a = act(agent, view.rows(torch.arange(B)), p.portfolio[0, :1].expand(B, -1), position=torch.zeros(B, dtype=torch.float64),
            bars_in_trade=torch.zeros(B, dtype=torch.long), vol=market.vol[:B], regime=market.regime[:B],
            controls=controls)
    _, full_b = chosen_outputs(agent, emb, torch.arange(B), p.portfolio[0, :1].expand(B, -1), a.branches[:, 0],
                               agent.act_taus)
    torch.testing.assert_close(a.quantiles, full_b[:, :3], rtol=1e-5, atol=1e-7)


def test_evaluate_policy_reports_the_full_grid(bars, feats):
    agent, market, emb, view, controls = setup(bars, feats)
    m = MarketTensors.from_bars(bars, 100, 400, agent.cfg.window, features=feats)
    pr = evaluate_policy(agent, m, controls, costs=COSTS)
    assert pr.quantiles.shape == (299, agent.cfg.iqn_quantiles_act)
    np.testing.assert_allclose(pr.quantiles[:, :3].mean(1), pr.decisions["cvar"], rtol=1e-5, atol=1e-7)


def test_auto_compiles_long_passes_only(bars, feats, monkeypatch):
    """accel="auto" on a CPU without the compiled pass (no C compiler; `tests/test_native_pass.py` covers it): a
    pass of ≥ AUTO_COMPILE_STEPS steps goes through torch.compile (when it works here), a shorter one runs eagerly;
    the compile is stood in by an identity wrapper that records the call."""
    import shared.native as native
    import shared.rollout as rollout
    monkeypatch.setattr(native, "available", lambda: False)
    agent, market, emb, view, controls = setup(bars, feats)
    compiled = []

    def fake_compile(fn, **kw):
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(rollout, "compile_works", lambda device: True)
    monkeypatch.setattr(rollout, "AUTO_COMPILE_STEPS", 100)
    base = greedy_pass(agent, market, view, torch.tensor([10]), 101, controls, COSTS, accel="eager")
    assert compiled == []
    short = greedy_pass(agent, market, view, torch.tensor([10]), 100, controls, COSTS)        # 99 steps: eager
    assert compiled == []
    long = greedy_pass(agent, market, view, torch.tensor([10]), 101, controls, COSTS)         # 100 steps: compile
    assert compiled == ["_greedy_bar"]
    assert_same(long, base)
    assert short.equity.shape == (100, 1)
    monkeypatch.setattr(rollout, "compile_works", lambda device: False)                      # no toolchain: eager
    greedy_pass(agent, market, view, torch.tensor([10]), 101, controls, COSTS)
    assert compiled == ["_greedy_bar"]


def test_modes_are_checked(bars, feats):
    agent, market, emb, view, _ = setup(bars, feats)
    st = torch.tensor([10])
    with pytest.raises(ValueError, match="needs a CUDA device"):
        greedy_pass(agent, market, view, st, 50, PolicyControls.make("cpu"), accel="graph")
    with pytest.raises(ValueError, match="epsilon must be 0"):
        greedy_pass(agent, market, view, st, 50, PolicyControls.make("cpu", epsilon=0.1))


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("mode, starts", [("graph", [40]), ("graph", [10, 200, 305, 111]),
                                          ("compile+graph", [10, 200, 305, 111])])
def test_cuda_graph_pass_equals_eager(bars, feats, mode, starts):
    """On CUDA: the captured (and compiled) pass gives the eager pass's ledger and equity; graph replays the
    very kernels eager launches (bit-identical), compiled kernels may round float64 arithmetic differently."""
    agent, market, emb, view, controls = setup(bars, feats, "cuda")
    st = torch.tensor(starts, device="cuda")
    eager = greedy_pass(agent, market, view, st, 390, controls, COSTS, accel="eager", chunk=16)
    graphed = greedy_pass(agent, market, view, st, 390, controls, COSTS, accel=mode, chunk=16)
    assert {"stop", "target"} <= set(eager.ledger["exit_reason"])
    assert_same(graphed, eager, exact=mode == "graph")


@pytest.mark.gpu
@CUDA
def test_cuda_window_passes_graph_equals_eager(bars, feats):
    """The runner's passes (windows of two lengths) with accel graph vs eager on CUDA."""
    from services.evaluator.runner import window_passes

    agent = make_agent(feats.shape[1], "cuda")
    wins = [(200, 330), (400, 530), (560, 650)]
    kw = dict(taus=(0.05, 0.5, 0.95), costs=COSTS, features=feats, device="cuda", graph_chunk=8)
    for e, g in zip(window_passes(agent, bars, wins, accel="eager", **kw),
                    window_passes(agent, bars, wins, accel="graph", **kw)):
        assert e["ledger"].equals(g["ledger"])
        np.testing.assert_allclose(g["equity"], e["equity"], rtol=0, atol=1e-9)
        np.testing.assert_array_equal(g["preds"]["direction"], e["preds"]["direction"])
