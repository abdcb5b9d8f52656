"""`services.trainer.fused_linear`: a Linear layer whose backward makes the weight's and bias's gradients in one
Triton kernel. The kernel against torch's products (on a CUDA GPU, or under Triton's interpreter when asked); the
layer against F.linear, eager, compiled and under autocast, on the CPU (where the op computes with torch)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.trainer.fused_linear import linear, weight_grads_triton
from triton_device import triton_device

DEV = triton_device()
needs_triton = pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(200, 70, 33), (64, 64, 64), (1000, 8, 130), (3, 5, 7)], ids=str)
def test_the_kernel_makes_gT_x_and_the_row_sum(shape, dtype):
    N, O, I = shape
    gen = torch.Generator().manual_seed(0)
    g, x = torch.randn(N, O, generator=gen).to(dtype), torch.randn(N, I, generator=gen).to(dtype)
    dw, db = weight_grads_triton(g.to(DEV), x.to(DEV))
    assert dw.shape == (O, I) and db.shape == (O,) and dw.dtype == db.dtype == torch.float32
    torch.testing.assert_close(dw.cpu(), g.double().t().mm(x.double()).float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(db.cpu(), g.double().sum(0).float(), rtol=1e-5, atol=1e-4)


def _grads(fn, x, w, b, out_grad):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    b = None if b is None else b.clone().requires_grad_()
    y = fn(x, w, b)
    (y.float() * out_grad).sum().backward()
    return y.detach(), x.grad, w.grad, None if b is None else b.grad


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("mode", ["eager", "compiled", "autocast bf16"])
def test_linear_equals_F_linear_forward_and_backward(mode, bias):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(4, 6, 10, generator=gen), torch.randn(7, 10, generator=gen)
    b = torch.randn(7, generator=gen) if bias else None
    out_grad = torch.randn(4, 6, 7, generator=gen)
    ours, theirs = linear, F.linear
    if mode == "compiled":
        torch._dynamo.reset()
        ours = torch.compile(linear, fullgraph=True)
    if mode == "autocast bf16":
        def under_autocast(fn):
            def run(*a):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return fn(*a)
            return run
        ours, theirs = under_autocast(linear), under_autocast(F.linear)
    got, want = _grads(ours, x, w, b, out_grad), _grads(theirs, x, w, b, out_grad)
    tol = dict(rtol=2e-2, atol=2e-2) if mode == "autocast bf16" else dict(rtol=1e-5, atol=1e-5)
    assert got[0].dtype == want[0].dtype
    for a, e in zip(got, want):
        if e is None:
            assert a is None
        else:
            assert a.dtype == e.dtype and a.shape == e.shape
            torch.testing.assert_close(a, e, **tol)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_agent_through_the_kernel_learns_what_it_learns_through_F_linear(compiled):
    """`Agent.use_linear_kernel`: every Linear product of the network (the encoder's, the last block's sliced
    projections, the trunk's, the heads' padded and stacked ones, the folded logits) through `linear` gives the same
    outputs and parameter gradients as through F.linear; without gradient the agent keeps F.linear."""
    import copy

    from shared.agent import Agent, AgentConfig, Linear
    torch.manual_seed(0)
    plain = Agent(AgentConfig(n_features=6, window=8, d_model=16, n_heads=2, n_layers=2, hidden=24, ensemble=2,
                              n_atoms=11, iqn_embed=8))
    fused = copy.deepcopy(plain)
    calls = []

    def counted(x, w, b):
        calls.append(tuple(w.shape))
        return linear(x, w, b)
    fused.use_linear_kernel(counted)
    assert all(m.fn is counted for m in fused.modules() if isinstance(m, Linear))
    x, pf = torch.randn(5, 8, 6), torch.randn(5, plain.cfg.n_portfolio)
    taus = torch.rand(5, 4)

    def loss(net):
        out = net.head(net.encode(x), pf)
        th = net.quantiles(out.hidden, taus)
        return out.logits.square().mean() + out.value_e.sin().sum() + out.delta.sum() + th.cos().sum()

    results = []
    for net in (plain, fused):
        fn = torch.compile(loss) if compiled else loss
        torch._dynamo.reset()
        value = fn(net)
        value.backward()
        results.append((value.detach(), {n: p.grad for n, p in net.named_parameters()}))
    # encoder (in, 2 × (qkv, proj, 2 mlp) with the last block's qkv in two), trunk 2, logits, code + V_e, shift 2,
    # IQN 3: every product went through the kernel's function
    assert len(calls) == 1 + 4 + 5 + 2 + 1 + 1 + 2 + 3, calls
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, g in results[0][1].items():
        assert g is not None, name
        torch.testing.assert_close(results[1][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused.encode(x), plain.encode(x))


@needs_triton
def test_the_kernel_is_deterministic_and_leaves_its_counters_at_zero():
    """Called again on the same inputs, the same bits (the tile's last program adds the partials in split order);
    the arrival counters are back at 0 after each call (a CUDA graph replays the kernel with no fill)."""
    from services.trainer import fused_linear
    gen = torch.Generator().manual_seed(2)
    g, x = torch.randn(700, 130, generator=gen).to(DEV), torch.randn(700, 70, generator=gen).to(DEV)
    first = weight_grads_triton(g, x)
    second = weight_grads_triton(g, x)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert all(int(c.abs().sum()) == 0 for c in fused_linear._COUNTERS.values())
