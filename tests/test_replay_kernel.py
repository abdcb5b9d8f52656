"""`replay.scatter_amax_`: the priority write. Its Triton kernel against aten's `scatter_reduce_` (on a CUDA GPU, or
under Triton's interpreter on the CPU when `TRITON_INTERPRET=1` and triton is importable, as `make test` runs this
file a second time), and the op under torch.compile: the same values, written in place into the array."""
from __future__ import annotations

import pytest
import torch

from services.trainer import replay
from services.trainer.replay import scatter_amax_, scatter_amax_triton
from triton_device import triton_device


KDEV = triton_device()


def _case(n: int, slots: int, seed: int, device: str):
    g = torch.Generator().manual_seed(seed)
    dst = torch.rand(slots, generator=g) * 5.0
    index = torch.randint(0, slots, (n,), generator=g)        # few slots: many indices sampled more than once
    src = torch.rand(n, generator=g) * 3.0 + 1e-3
    return dst.to(device), index.to(device), src.to(device)


@pytest.mark.skipif(KDEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")
@pytest.mark.parametrize("n,slots,block", [(1, 10, 4096), (37, 16, 4096), (4096, 3000, 4096), (1000, 100, 64)],
                         ids=["one", "duplicates", "batch 4096", "several passes"])
def test_the_triton_kernel_equals_scatter_reduce_amax(n, slots, block, monkeypatch):
    monkeypatch.setattr(replay, "SCATTER_BLOCK", block)
    dst, index, src = _case(n, slots, seed=n, device=KDEV)
    want = dst.clone().scatter_reduce_(0, index, src, reduce="amax", include_self=False)
    got = dst.clone()
    scatter_amax_triton(got, index, src)
    assert torch.equal(got, want)                         # a max picks one of the values: exact
    untouched = torch.ones(slots, dtype=torch.bool, device=KDEV)
    untouched[index] = False
    assert torch.equal(got[untouched], dst[untouched]) and (got[index] <= dst.max() + 3.0).all()
    # the old value does not take part (include_self=False): a priority can go down
    assert (got[index] < dst[index]).any() or n == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_op_compiled_writes_in_place_what_eager_writes(device):
    """Compiled, the op mutates the array itself: inductor's code calls it on the input, with no aten scatter
    (which it ran on a copy of the whole array, copied back)."""
    from torch._inductor.utils import run_and_get_code

    from shared.rollout import compile_works
    if not compile_works(torch.device(device)):
        pytest.skip("torch.compile cannot build kernels here")
    dst, index, src = _case(4096, 50_000, seed=1, device=device)

    def write(d, i, s):
        scatter_amax_(d.view(-1), i, s.abs() + 1e-3)
        return s.max()

    eager = dst.clone()
    write(eager, index, src)
    compiled = dst.clone()
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(write), compiled, index, src)
    assert torch.equal(compiled, eager)
    text = "\n".join(code)
    assert "tradeloop.scatter_amax_" in text and "scatter_reduce" not in text
