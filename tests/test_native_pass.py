"""The compiled CPU pass (`greedy_pass(accel="native")`: one C loop, `shared.native`) gives what the eager pass
gives: the same decisions, the same trades, the same curves (float64 rounding aside) — several accounts at
different starts on two threads, stops, targets and blocked entries included. And where no C compiler works,
"auto" falls back to the torch modes with the compiler's reason kept.
    python3 -m pytest -q tests/test_native_pass.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from shared import native  # noqa: E402

NATIVE = pytest.mark.skipif(not native.available(), reason="no working C compiler here")


@NATIVE
@pytest.mark.parametrize("starts,length", [([10, 200, 305, 321], 300), ([0], 690)])
def test_native_pass_equals_eager(starts, length):
    from test_eval_graph import COSTS, assert_same, setup

    from shared.market import compute_features
    from shared.rollout import greedy_pass
    from shared.synthetic import generate

    bars = generate(n_bars=700, seed=3).bars
    agent, market, emb, controls = setup(bars, compute_features(bars), "cpu")
    st = torch.tensor(starts)
    eager = greedy_pass(agent, market, emb, st, length, controls, COSTS, accel="eager")
    torch.set_num_threads(2)
    nat = greedy_pass(agent, market, emb, st, length, controls, COSTS, accel="native")
    assert_same(nat, eager, exact=False)
    torch.testing.assert_close(nat.targets, eager.targets, rtol=0, atol=1e-9)
    torch.testing.assert_close(nat.portfolio, eager.portfolio, rtol=0, atol=1e-6)
    for name in ("q", "q_std", "edge", "cvar"):
        torch.testing.assert_close(getattr(nat, name), getattr(eager, name), rtol=1e-5, atol=1e-6)
    # the pass exercised what it must: exits by stop and by target, blocked entries, many trades
    assert {"stop", "target"} <= set(eager.ledger["exit_reason"]), set(eager.ledger["exit_reason"])
    assert len(eager.ledger) > 20 and int(eager.blocked.sum()) > 0
    # and "auto" on a CPU is this pass
    auto = greedy_pass(agent, market, emb, st, length, controls, COSTS)
    assert torch.equal(auto.branches, nat.branches) and torch.equal(auto.equity, nat.equity)


@NATIVE
def test_native_pass_is_greedy_only():
    from test_eval_graph import COSTS, setup

    from shared.agent import PolicyControls
    from shared.market import compute_features
    from shared.rollout import greedy_pass
    from shared.synthetic import generate

    bars = generate(n_bars=300, seed=1).bars
    agent, market, emb, _ = setup(bars, compute_features(bars), "cpu")
    with pytest.raises(ValueError, match="epsilon"):
        greedy_pass(agent, market, emb, torch.tensor([0]), 100, PolicyControls.make("cpu", epsilon=0.1), COSTS,
                    accel="native")


def test_without_a_compiler_auto_falls_back(tmp_path):
    code = ("import sys, torch; sys.path.insert(0, 'tests'); from shared import native\n"
            "from test_eval_graph import COSTS, setup; from shared.market import compute_features\n"
            "from shared.rollout import greedy_pass; from shared.synthetic import generate\n"
            "assert not native.available()\n"
            "try:\n    native.library()\nexcept native.NativeUnavailable as e:\n    print('REASON', e)\n"
            "bars = generate(n_bars=200, seed=1).bars\n"
            "agent, market, emb, ctl = setup(bars, compute_features(bars), 'cpu')\n"
            "a = greedy_pass(agent, market, emb, torch.tensor([0]), 150, ctl, COSTS)\n"
            "b = greedy_pass(agent, market, emb, torch.tensor([0]), 150, ctl, COSTS, accel='eager')\n"
            "assert torch.equal(a.equity, b.equity) and torch.equal(a.branches, b.branches)\n"
            "print('AUTO OK')\n")
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), TL_NATIVE_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "REASON no C compiler" in r.stdout and "no-such-cc" in r.stdout and "AUTO OK" in r.stdout
