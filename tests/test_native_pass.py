"""The compiled CPU pass (`greedy_pass(accel="native")`: one C loop over the market view's rows, `shared.native`)
gives what the eager pass gives: the same decisions, the same trades, the same curves (float64 rounding aside) —
several accounts at different starts on two threads, stops, targets and blocked entries included, with a portfolio
shift δ that changes decisions (a freshly built agent's δ is 0: the tests randomise it), for the tests' tiny agent
and for an agent of other sizes (ensemble, branches, tail quantiles, code and shift widths). And where no C compiler
works, "auto" falls back to the torch modes with the compiler's reason kept. The loop's constants and `Pass` struct
come from the Python definitions (a generated header), and its struct layout matches the ctypes mirror. Under CI=true
a missing compiler fails these tests instead of skipping them.
    python3 -m pytest -q tests/test_native_pass.py
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from shared import native  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _why_no_native() -> str | None:
    try:
        native.library()
    except native.NativeUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture
def require_native():
    """Skip where no C compiler works (a laptop without one); under CI=true that is a failure: CI has one."""
    why = _why_no_native()
    if why:
        if IN_CI:
            pytest.fail(f"CI=true and the compiled pass cannot be built: {why}")
        pytest.skip(f"no working C compiler here: {why}")


NATIVE = pytest.mark.usefixtures("require_native")


def randomise_shift(agent, seed: int = 11, std: float = 0.2) -> None:
    """A non-zero portfolio shift (a new agent's last shift layer is zero-initialised: δ = 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        last = agent.shift[2]
        last.weight.copy_(torch.randn(last.weight.shape, generator=g) * std)
        last.bias.copy_(torch.randn(last.bias.shape, generator=g) * std * 0.2)


def make(n_bars: int, seed: int, *, gate: float = 0.001, conf=(1.0, 0.8, 1.0, 0.6, 1.0, 1.0, 0.9, 1.0, 0.7),
         **sizes):
    """A tiny random agent on synthetic bars, protection stack on (maturity 0.6), exit plans of 0.5–1 bar
    volatilities (stops and targets fire), a random portfolio shift; its market view of every bar, and controls
    whose epistemic gate blocks a few entries. `sizes`: `AgentConfig` fields to change."""
    from shared.agent import Agent, AgentConfig, PolicyControls
    from shared.market import compute_features
    from shared.rollout import MarketTensors
    from shared.synthetic import generate

    bars = generate(n_bars=n_bars, seed=seed).bars
    feats = compute_features(bars)
    torch.manual_seed(5)
    kw = dict(n_features=feats.shape[1], window=8, d_model=16, n_heads=2, hidden=32, n_atoms=11, ensemble=3,
              exit_plans=((math.inf, math.inf), (1.0, 0.5), (0.5, 1.0)))
    agent = Agent(AgentConfig(**{**kw, **sizes})).eval()
    agent.maturity.fill_(0.6)
    randomise_shift(agent)
    market = MarketTensors.from_bars(bars, 0, len(bars), agent.cfg.window, "cpu", features=feats)
    with torch.no_grad():
        view = agent.view_table(agent.encode(market.windows))
    controls = PolicyControls.make("cpu", gate_threshold=gate, regime_confidence=list(conf))
    return agent, market, view, controls


def zero_shift(agent):
    """A copy of the agent with δ = 0 (the market view alone decides)."""
    import copy

    z = copy.deepcopy(agent)
    with torch.no_grad():
        z.shift[2].weight.zero_()
        z.shift[2].bias.zero_()
    return z


def check_same(nat, eager):
    from test_eval_graph import assert_same

    assert_same(nat, eager, exact=False)
    torch.testing.assert_close(nat.targets, eager.targets, rtol=0, atol=1e-9)
    torch.testing.assert_close(nat.portfolio, eager.portfolio, rtol=0, atol=1e-6)
    for name in ("q", "q_std", "edge", "cvar"):
        torch.testing.assert_close(getattr(nat, name), getattr(eager, name), rtol=1e-5, atol=1e-6)


@NATIVE
@pytest.mark.parametrize("starts,length", [([10, 200, 305, 321], 300), ([0], 690)])
def test_native_pass_equals_eager(starts, length):
    from test_eval_graph import COSTS

    from shared.rollout import greedy_pass

    agent, market, view, controls = make(700, 3)
    st = torch.tensor(starts)
    eager = greedy_pass(agent, market, view, st, length, controls, COSTS, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, length, controls, COSTS, accel="native")
    check_same(nat, eager)
    # the pass exercised what it must: exits by stop and by target, blocked entries, many trades
    assert {"stop", "target"} <= set(eager.ledger["exit_reason"]), set(eager.ledger["exit_reason"])
    assert len(eager.ledger) > 20 and int(eager.blocked.sum()) > 0
    # the portfolio shift is not idle: without it the decisions differ (so a loop ignoring δ cannot pass)
    flat = greedy_pass(zero_shift(agent), market, view, st, length, controls, COSTS, accel="native")
    changed = (flat.branches[..., 0] != nat.branches[..., 0]).float().mean().item()    # direction taken
    assert changed > 0.05, changed
    # and "auto" on a CPU is this pass
    auto = greedy_pass(agent, market, view, st, length, controls, COSTS)
    assert torch.equal(auto.branches, nat.branches) and torch.equal(auto.equity, nat.equity)


@NATIVE
def test_native_pass_equals_eager_through_liquidations():
    """Wicks ten times the price liquidate the shorts held through them without a stop of their own
    (`Simulator.step`: an exit that would leave no equity), and a ruined account opens nothing after: in the loop
    as in the simulator."""
    from test_eval_graph import COSTS

    from shared.rollout import greedy_pass

    agent, market, view, controls = make(700, 3, exit_plans=((math.inf, math.inf),))
    market.prices.high[40::23] *= 10.0
    st = torch.tensor([10, 200, 305, 321])
    eager = greedy_pass(agent, market, view, st, 300, controls, COSTS, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, 300, controls, COSTS, accel="native")
    check_same(nat, eager)
    led = eager.ledger
    ruin = led[led.net_return <= -1.0 + 1e-9]
    assert len(ruin) >= 2 and (ruin.side < 0).all() and (ruin.exit_reason == "stop").all()
    for acct, exit_t in zip(ruin.account, ruin.exit_t):          # the ruinous trade is its account's last
        assert led[led.account == acct].exit_t.max() == exit_t
    # flat on no equity to the end: bar returns 0 there, the last bar's included (no 0 / 0)
    assert torch.isfinite(nat.bar_returns).all() and torch.isfinite(eager.bar_returns).all()
    assert (eager.bar_returns[-5:, torch.as_tensor(ruin.account.unique())] == 0).all()


@NATIVE
def test_native_pass_equals_eager_with_fixed_fees_and_borrow():
    """The fixed fee per fill and the borrow of shorts held at a close, in the loop as in `Simulator.step`."""
    from test_eval_graph import COSTS

    from shared.execution import CostModel
    from shared.rollout import greedy_pass

    costs = CostModel(cost_bps=2.0, fee=2e-4, borrow_bps=300.0, bars_per_year=250.0)
    agent, market, view, controls = make(450, 3)
    st = torch.tensor([10, 120])
    eager = greedy_pass(agent, market, view, st, 320, controls, costs, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, 320, controls, costs, accel="native")
    check_same(nat, eager)
    assert (eager.ledger.side < 0).any() and len(eager.ledger) > 10
    plain = greedy_pass(agent, market, view, st, 320, controls, COSTS, accel="native")
    assert not torch.allclose(plain.equity, nat.equity, rtol=0, atol=1e-6)       # the fee and borrow were charged


@NATIVE
def test_native_pass_equals_eager_where_fixed_fees_exhaust_the_accounts():
    """A fee of 6 % of the starting equity a fill wears the accounts down to where a fill and its close no longer
    fit the equity left: from there they open nothing (`Simulator.step`'s ruin rule), in the loop as in the
    simulator, and no account's equity goes below 0."""
    from shared.execution import CostModel
    from shared.rollout import greedy_pass

    costs = CostModel(cost_bps=5.0, fee=0.06)
    agent, market, view, controls = make(700, 3)
    st = torch.tensor([10, 200, 321])
    eager = greedy_pass(agent, market, view, st, 360, controls, costs, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, 360, controls, costs, accel="native")
    check_same(nat, eager)
    assert len(eager.ledger) > 8 and (eager.equity >= 0).all(), eager.equity.min()
    assert (eager.equity[-1] < 4 * costs.fee).any()          # some account ran out of what a round trip costs


@NATIVE
@pytest.mark.parametrize("cvar_alpha", [0.2, 0.01])          # M_α = 6 tail quantiles; none (CVaR = 0)
def test_native_pass_other_sizes(cvar_alpha):
    """No fixed limits in the loop: a 9-member ensemble (vectorised sums in torch), 5 size levels, 4 exit plans,
    a 5-wide code, a 70-wide shift layer (one 64-block and a remainder)."""
    from test_eval_graph import COSTS

    from shared.rollout import greedy_pass

    agent, market, view, controls = make(
        500, 4, gate=0.0013, conf=(1.0, 0.8, 1.0, 0.6, 1.0, 0.0, 0.9, 1.0, 0.7), ensemble=9,
        size_levels=(0.2, 0.4, 0.6, 0.8, 1.0), exit_plans=((math.inf, math.inf), (1.0, 0.5), (0.5, 1.0), (2.0, 2.0)),
        iqn_quantiles_act=32, cvar_alpha=cvar_alpha, code_dim=5, shift_hidden=70)
    assert agent.cfg.n_tail == (6 if cvar_alpha == 0.2 else 0)
    st = torch.tensor([0, 37, 120])
    eager = greedy_pass(agent, market, view, st, 380, controls, COSTS, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, 380, controls, COSTS, accel="native")
    check_same(nat, eager)
    assert len(eager.ledger) > 10 and int(eager.blocked.sum()) > 0
    flat = greedy_pass(zero_shift(agent), market, view, st, 380, controls, COSTS, accel="native")
    assert (flat.branches[..., 0] != nat.branches[..., 0]).float().mean().item() > 0.05


@NATIVE
def test_native_pass_is_greedy_only():
    from test_eval_graph import COSTS

    from shared.agent import PolicyControls
    from shared.rollout import greedy_pass

    agent, market, view, _ = make(300, 1)
    greedy = PolicyControls.make("cpu", epsilon=0.1)
    with pytest.raises(ValueError, match="epsilon"):
        greedy_pass(agent, market, view, torch.tensor([0]), 100, greedy, COSTS, accel="native")
    with pytest.raises(ValueError, match="epsilon"):
        native.run_native(agent, market, view, torch.tensor([0]), 100, greedy, COSTS)


def test_without_a_compiler_auto_falls_back(tmp_path):
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from shared import native\n"
            "from test_eval_graph import COSTS; from test_native_pass import make\n"
            "from shared.rollout import greedy_pass\n"
            "assert not native.available()\n"
            "try:\n    native.library()\nexcept native.NativeUnavailable as e:\n    print('REASON', e)\n"
            "agent, market, view, ctl = make(200, 1)\n"
            "a = greedy_pass(agent, market, view, torch.tensor([0]), 150, ctl, COSTS)\n"
            "b = greedy_pass(agent, market, view, torch.tensor([0]), 150, ctl, COSTS, accel='eager')\n"
            "assert torch.equal(a.equity, b.equity) and torch.equal(a.branches, b.branches)\n"
            "print('AUTO OK')\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), TL_NATIVE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REASON no C compiler" in r.stdout and "no-such-cc" in r.stdout and "AUTO OK" in r.stdout


@NATIVE
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_pass_reads_a_cuda_view():
    """A view on the GPU is copied to the host once; the outputs come back on its device, the same pass."""
    from test_eval_graph import COSTS

    from shared.agent import PolicyControls

    agent, market, view, controls = make(500, 2)
    st = torch.tensor([0, 40])
    host = native.run_native(agent, market, view, st, 400, controls, COSTS)
    dev = torch.device("cuda")
    ctl = PolicyControls(**{k: getattr(controls, k).to(dev) for k in vars(controls)})
    out = native.run_native(agent.to(dev), market, view.to(dev), st.to(dev), 400, ctl, COSTS)
    for k in ("r64", "r32", "rl", "ev64", "flags", "final"):
        assert getattr(out, k).device.type == "cuda", k
        assert torch.equal(getattr(out, k).cpu(), getattr(host, k)), k


def flip_happy(agent, strength: float = 10.0):
    """Make the portfolio shift push every open trade toward the opposite side (δ_short = k·v_max·relu(position),
    δ_long = k·v_max·relu(−position)): each trade is asked to flip at every bar, so the commitment holds it and the
    protection stack judges the flip."""
    C = agent.cfg.code_dim
    with torch.no_grad():
        w1, w2 = agent.shift[0].weight, agent.shift[2].weight
        w1[:2].zero_()
        agent.shift[0].bias[:2].zero_()
        w1[0, C + 0], w1[1, C + 0] = 1.0, -1.0                # hidden 0 = relu(position), 1 = relu(−position)
        w2[:, :2].zero_()
        w2[0, 0], w2[2, 1] = strength, strength               # short when long, long when short


@NATIVE
def test_native_pass_commitment_before_the_entry_block():
    """A trade asked to flip while young is held (commitment), and the flip it asks for would often be blocked (the
    epistemic gate): the loop must apply commitment first, as `act` does — reported direction = the trade's side,
    no block reported."""
    from test_eval_graph import COSTS

    from shared.rollout import greedy_pass

    agent, market, view, controls = make(700, 3, gate=0.0013,      # trades end by signal or flip: held for long
                                         exit_plans=((math.inf, math.inf), (math.inf, math.inf), (8.0, 8.0)))
    flip_happy(agent)
    st = torch.tensor([10, 200, 305, 321])
    eager = greedy_pass(agent, market, view, st, 300, controls, COSTS, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, view, st, 300, controls, COSTS, accel="native")
    check_same(nat, eager)
    pos = eager.positions[:-1]                                   # position at each decision (S × B)
    held = (pos != 0) & (eager.targets == pos)                   # open trades kept as they are
    assert int(held.sum()) > 100 and "flip" in set(eager.ledger["exit_reason"]) and int(eager.blocked.sum()) > 0


@NATIVE
def test_the_header_comes_from_the_python_definitions(monkeypatch):
    """Every constant of the loop is generated from its Python definition (change one, the header and so the build
    key change), and the compiled `Pass` has the layout of its ctypes mirror."""
    from shared import execution, policy, portfolio

    hdr = native.header()
    for name, value in (("DSR_CLIP", portfolio.DSR_CLIP), ("TRACKER_DECAY", portfolio.TRACKER_DECAY),
                        ("MATURITY_FLOOR", policy.MATURITY_FLOOR), ("MAX_POSITION", execution.MAX_POSITION)):
        assert f"#define TL_{name} ({value.hex()})" in hdr, name
    assert f"#define TL_REASON_STOP {execution.EXIT_REASONS.index('stop')}" in hdr
    assert f"#define TL_FLAT {policy.FLAT}" in hdr
    monkeypatch.setattr(portfolio, "DSR_CLIP", 3.0)
    assert native.header() != hdr and f"#define TL_DSR_CLIP ({(3.0).hex()})" in native.header()
    native._check_layout(native.library())                      # raises NativeUnavailable on a mismatch
