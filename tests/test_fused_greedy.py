"""The targets' fused double-Q selection (`services.trainer.fused_greedy`) against the reference it replaces
(`losses.greedy_next_reference`): the greedy columns, the target members' mean distribution and portfolio shift there.

Runs on a CUDA GPU; without one, under Triton's interpreter on the CPU when asked (`TRITON_INTERPRET=1` with triton
importable, as `make test`'s second pytest run sets up); skipped otherwise."""
from __future__ import annotations

import pytest
import torch

from services.trainer.losses import greedy_columns, greedy_next
from triton_device import triton_device

DEV = triton_device()
pytestmark = pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")

BRANCHES = (3, 2, 3)


def _inputs(dtype: torch.dtype, N: int = 64, K: int = 5, A: int = 51, seed: int = 0, shift: float = 0.02):
    """Online and target logits as the agent makes them (rows of one wider GEMM output, sliced: not contiguous),
    their portfolio shifts (N × (NB + 1), sliced too) and the support."""
    g = torch.Generator().manual_seed(seed)
    NB = sum(BRANCHES)
    z = torch.linspace(-0.05, 0.05, A)

    def logits():
        return (torch.randn(N, K * NB * A + 8, generator=g) * 2.0).to(dtype)[:, :K * NB * A].view(N, K, NB, A)

    def delta():
        return (torch.randn(N, NB + 3, generator=g) * shift)[:, :NB + 1]
    return logits(), delta(), logits(), delta(), z


def _run(fused: bool, *inputs):
    return [x.cpu() for x in greedy_next(*(t.to(DEV) for t in inputs), BRANCHES, fused=fused)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shift", [0.0, 0.02, 1.0], ids=["no shift", "shift", "the shift decides"])
def test_fused_selection_equals_the_reference(dtype, shift):
    inputs = _inputs(dtype, shift=shift)
    (col_r, p_r, d_r), (col_f, p_f, d_f) = _run(False, *inputs), _run(True, *inputs)
    assert col_f.dtype == torch.int64 and col_f.shape == (64, 3)
    assert torch.equal(col_f, col_r), f"greedy columns differ at {(col_f != col_r).nonzero().tolist()}"
    torch.testing.assert_close(p_f, p_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_f, d_r, rtol=0, atol=0)
    # the columns lie inside their branches, and the shift is read at them
    first = torch.tensor([0, 3, 5])
    assert torch.all((col_f >= first) & (col_f < first + torch.tensor(BRANCHES)))
    assert torch.allclose(p_f.sum(-1), torch.ones(64, 3), atol=1e-5)
    assert len(set(col_f[:, 0].tolist())) > 1, "the inputs should not make one action greedy everywhere"


def test_the_online_shift_and_mean_q_choose_and_the_target_evaluates():
    """Built so that a wrong reading shows: the online members agree on a best action per branch only on average,
    the online shift overturns it for half the states, and the target's logits at that action are distinctive."""
    N, K, NB, A = 8, 5, 8, 51
    z = torch.linspace(-0.05, 0.05, A)
    on = torch.zeros(N, K, NB, A)
    on[:, :, :, -1] = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 1.0, 0.0, 2.5])   # mass on the top atom: higher Q
    on[:, 0, 2, -1] = 12.0                  # one member alone likes action 2 of the direction branch: not the mean
    on_delta = torch.zeros(N, NB + 1)
    on_delta[N // 2:, 0] = 1.0              # the portfolio shift makes action 0 best for half the states
    tg = torch.randn(N, K, NB, A, generator=torch.Generator().manual_seed(1))
    tg_delta = torch.arange(N * (NB + 1), dtype=torch.float32).view(N, NB + 1)
    col, p, d = _run(True, on, on_delta, tg, tg_delta, z)
    ref = greedy_columns((torch.softmax(on, -1) * z).sum(-1).mean(1) + on_delta[:, :NB], BRANCHES)
    assert torch.equal(col, ref)
    assert col[:N // 2].tolist() == [[1, 4, 7]] * (N // 2) and col[N // 2:, 0].tolist() == [0] * (N // 2)
    want = torch.softmax(tg.gather(2, col.view(N, 1, 3, 1).expand(N, K, 3, A)), -1).mean(1)
    torch.testing.assert_close(p, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(d, tg_delta.gather(1, col))


def test_fused_selection_under_torch_compile_equals_eager():
    """Compiled, the custom op stays whole: the same numbers as called eagerly."""
    if DEV != "cuda":
        pytest.skip("torch.compile of the custom op: CUDA only")
    inputs = [t.cuda() for t in _inputs(torch.bfloat16)]

    def fn(*xs):
        col, p, d = greedy_next(*xs, BRANCHES, fused=True)
        return col, p * 2.0, d + 1.0
    for a, b in zip(fn(*inputs), torch.compile(fn, fullgraph=True)(*inputs)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
