"""`replay.scatter_amax_reweigh_`: the priority write and its sampling weights. Its Triton kernel against aten's
`scatter_reduce_` and `index_copy_` (on a CUDA GPU, or under Triton's interpreter on the CPU when `TRITON_INTERPRET=1`
and triton is importable, as `make test` runs this file a second time), and the op under torch.compile: the same
values, written in place into the arrays."""
from __future__ import annotations

import pytest
import torch

from services.trainer import replay
from services.trainer.replay import scatter_amax_reweigh_, scatter_amax_triton
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


@pytest.mark.skipif(KDEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")
@pytest.mark.parametrize("n,slots,block", [(37, 16, 4096), (4096, 3000, 4096), (1000, 100, 64)],
                         ids=["duplicates", "batch 4096", "several passes"])
def test_the_triton_kernel_writes_the_weights_of_the_final_priorities(n, slots, block, monkeypatch):
    """With the weights: weight[i] = priority[i]^α × boost[bar[i]] at the written slots, from the priority after all
    duplicates' max (the kernel's third pass comes after a barrier); the other slots' weights untouched."""
    monkeypatch.setattr(replay, "SCATTER_BLOCK", block)
    dst, index, src = _case(n, slots, seed=n + 1, device=KDEV)
    g = torch.Generator().manual_seed(n)
    bar = torch.randint(0, 40, (slots,), generator=g).to(KDEV)
    boost = (torch.rand(40, generator=g) * 2.0).to(KDEV)
    weight0 = torch.rand(slots, generator=g).to(KDEV)
    want_p = dst.clone().scatter_reduce_(0, index, src, reduce="amax", include_self=False)
    want_w = weight0.clone().index_copy_(0, index, want_p[index].pow(0.6) * boost[bar[index]])
    got_p, got_w = dst.clone(), weight0.clone()
    scatter_amax_triton(got_p, index, src, weigh=(got_w, bar, boost, 0.6))
    assert torch.equal(got_p, want_p)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=0.0)
    untouched = torch.ones(slots, dtype=torch.bool, device=KDEV)
    untouched[index] = False
    assert torch.equal(got_w[untouched], weight0[untouched]) and not torch.equal(got_w, weight0)


@pytest.mark.skipif(KDEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")
@pytest.mark.parametrize("block", [4096, 16], ids=["one pass a segment", "several passes a segment"])
def test_the_triton_kernel_writes_segments_of_runs_side_by_side(block, monkeypatch):
    """`groups`: R runs' writes folded into one call (run r's slots offset by r × slots, as the vmap rule folds
    them), a program a run: every run's priorities and weights as its own write leaves them, duplicates within a
    run included; a count of indices that does not split into the segments is refused."""
    monkeypatch.setattr(replay, "SCATTER_BLOCK", block)
    R, slots, n = 4, 30, 50
    g = torch.Generator().manual_seed(7)
    dst = (torch.rand(R, slots, generator=g) * 5.0).to(KDEV)
    index = torch.randint(0, 10, (R, n), generator=g).to(KDEV)
    src = (torch.rand(R, n, generator=g) * 3.0 + 1e-3).to(KDEV)
    bar = torch.randint(0, 8, (R, slots), generator=g).to(KDEV)
    boost = (torch.rand(8, generator=g) + 0.5).to(KDEV)
    weight0 = torch.rand(R, slots, generator=g).to(KDEV)
    want_p, want_w = dst.clone(), weight0.clone()
    for r in range(R):
        want_p[r].scatter_reduce_(0, index[r], src[r], reduce="amax", include_self=False)
        want_w[r].index_copy_(0, index[r], want_p[r][index[r]].pow(0.6) * boost[bar[r][index[r]]])
    got_p, got_w = dst.clone(), weight0.clone()
    folded = (index + torch.arange(R, device=KDEV).view(R, 1) * slots).reshape(-1)
    scatter_amax_triton(got_p.view(-1), folded, src.reshape(-1), weigh=(got_w.view(-1), bar.view(-1), boost, 0.6),
                        groups=R)
    assert torch.equal(got_p, want_p)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=0.0)
    with pytest.raises(ValueError, match="200 indices do not split into 3 equal segments"):
        scatter_amax_triton(got_p.view(-1), folded, src.reshape(-1), groups=3)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_the_op_compiled_writes_in_place_what_eager_writes(device):
    """Compiled, the op mutates the arrays themselves (views of 2-D ones, as `Replay` passes them): inductor's code
    calls it on the inputs, with no aten scatter or index copy (which it ran on copies of the whole arrays, copied
    back)."""
    from torch._inductor.utils import run_and_get_code

    from shared.rollout import compile_works
    if not compile_works(torch.device(device)):
        pytest.skip("torch.compile cannot build kernels here")
    dst, index, src = _case(4096, 50_000, seed=1, device=device)
    g = torch.Generator().manual_seed(2)
    bar = torch.randint(0, 300, (50_000,), generator=g).to(device).view(500, 100)
    boost = torch.rand(300, generator=g).to(device) + 0.5
    weight = torch.rand(500, 100, generator=g).to(device)

    def write(d, w, i, s):
        scatter_amax_reweigh_(d.view(-1), w.view(-1), i, s.abs() + 1e-3, bar.view(-1), boost, 0.5)
        return s.max()

    eager_p, eager_w = dst.clone().view(500, 100), weight.clone()
    write(eager_p, eager_w, index, src)
    compiled_p, compiled_w = dst.clone().view(500, 100), weight.clone()
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(write), compiled_p, compiled_w, index, src)
    assert torch.equal(compiled_p, eager_p) and torch.equal(compiled_w, eager_w)
    assert not torch.equal(eager_w, weight)
    text = "\n".join(code)
    assert "tradeloop.scatter_amax_reweigh_" in text
    assert "scatter_reduce" not in text and "index_copy" not in text


@pytest.mark.parametrize("shared_boost", [True, False], ids=["one boost table", "a boost table a run"])
def test_the_priority_write_of_stacked_runs_equals_each_runs_own(shared_boost):
    """Under `torch.func.vmap` over R runs' replays (aten on the CPU; the Triton kernel on a GPU): each run's
    priorities and weights are what its own call writes, in place, with indices repeated within a run and the same
    slot indices in different runs."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    R, slots, n, bars = 3, 50, 40, 20
    g = torch.Generator().manual_seed(4)
    priority = (torch.rand(R, slots, generator=g) * 5.0).to(dev)
    weight = torch.rand(R, slots, generator=g).to(dev)
    index = torch.randint(0, 12, (R, n), generator=g).to(dev)
    src = (torch.rand(R, n, generator=g) * 3.0 + 1e-3).to(dev)
    bar = torch.randint(0, bars, (R, slots), generator=g).to(dev)
    boost = (torch.rand(bars, generator=g) + 0.5).to(dev) if shared_boost else \
        (torch.rand(R, bars, generator=g) + 0.5).to(dev)
    want_p, want_w = priority.clone(), weight.clone()
    for r in range(R):
        scatter_amax_reweigh_(want_p[r], want_w[r], index[r], src[r], bar[r], boost if shared_boost else boost[r],
                              0.6)

    def write(p, w, i, s, b, *bo):
        scatter_amax_reweigh_(p, w, i, s, b, bo[0] if bo else boost, 0.6)
        return p

    torch.func.vmap(write)(priority, weight, index, src, bar, *(() if shared_boost else (boost,)))
    assert not torch.equal(want_p, priority.new_zeros(priority.shape))
    torch.testing.assert_close(priority, want_p, rtol=0, atol=0)
    torch.testing.assert_close(weight, want_w, rtol=1e-6, atol=1e-7)
