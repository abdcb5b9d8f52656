"""The fused evaluation pass (`greedy_pass(accel="fused")`: one Triton kernel, `shared.fused`) gives what the
eager pass gives: the same decisions, the same trades, the same curves (float64 rounding aside).

CPU: the kernel in Triton's interpreter (a subprocess with TRITON_INTERPRET=1, set before Triton is imported),
three accounts in one program, stops, targets and blocked entries included. GPU (skipped without CUDA): the
compiled kernel, one account per program and 16 per program (the tl.dot path), against eager on CUDA.
    python3 -m pytest -q tests/test_fused_pass.py
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and Triton")


def compare(device: str, starts: list[int], length: int, block: int | None) -> dict:
    """Eager `greedy_pass` vs the fused kernel on the fixtures of tests/test_eval_graph.py; asserts equality and
    returns what the pass exercised (trades by exit reason, blocked entries)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_eval_graph import COSTS, assert_same, setup

    from shared.market import compute_features
    from shared.rollout import _fused_greedy_pass, greedy_pass
    from shared.synthetic import generate

    bars = generate(n_bars=700, seed=3).bars
    agent, market, emb, controls = setup(bars, compute_features(bars), device)
    st = torch.tensor(starts, device=device)
    eager = greedy_pass(agent, market, emb, st, length, controls, COSTS, accel="eager")
    fused = _fused_greedy_pass(agent, market, emb, st, length, controls, COSTS, block=block)
    assert_same(fused, eager, exact=False)
    torch.testing.assert_close(fused.targets, eager.targets, rtol=0, atol=1e-9)
    torch.testing.assert_close(fused.portfolio, eager.portfolio, rtol=0, atol=1e-6)
    for name in ("q_std", "edge", "cvar"):
        torch.testing.assert_close(getattr(fused, name), getattr(eager, name), rtol=1e-5, atol=1e-6)
    return {"reasons": sorted(set(eager.ledger["exit_reason"])), "trades": len(eager.ledger),
            "blocked": int(eager.blocked.sum())}


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton (its interpreter runs the kernel on a CPU)")
@pytest.mark.timeout(600)
def test_fused_pass_equals_eager_in_the_interpreter():
    code = ("import json, sys; sys.path.insert(0, 'tests'); from test_fused_pass import compare; "
            "print(json.dumps(compare('cpu', [10, 200, 305], 150, 4)))")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=580)
    assert r.returncode == 0, r.stderr[-4000:]
    import json
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert {"stop", "target"} <= set(seen["reasons"]) and seen["trades"] > 20 and seen["blocked"] > 0, seen


def test_fused_needs_triton_or_cuda(monkeypatch):
    """Off CUDA and without the interpreter, accel="fused" is refused with a clear error (no Triton launch)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_eval_graph import setup

    from shared.market import compute_features
    from shared.rollout import greedy_pass
    from shared.synthetic import generate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    bars = generate(n_bars=200, seed=3).bars
    agent, market, emb, controls = setup(bars, compute_features(bars))
    with pytest.raises(ValueError, match="accel='fused' needs Triton"):
        greedy_pass(agent, market, emb, torch.tensor([10]), 50, controls, accel="fused")


@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("starts, block", [([40], None), ([10, 200, 305, 111], None),
                                           ([10, 200, 305, 111, 20, 30, 40, 50, 60, 70, 80, 90, 100, 120, 130,
                                             140, 150, 160], 16)])
def test_cuda_fused_pass_equals_eager(starts, block):
    seen = compare("cuda", starts, 390, block)
    assert {"stop", "target"} <= set(seen["reasons"]), seen
