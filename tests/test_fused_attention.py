"""The encoder's attention kernels (`services.trainer.fused_attention`) against PyTorch's SDPA: the causal block's
and the last query's outputs and their gradients with respect to the packed projections.

Runs on a CUDA GPU; without one under Triton's interpreter on the CPU when asked (`TRITON_INTERPRET=1` with triton
importable, as `make test`'s second pytest run does); skipped otherwise."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_device import triton_device

DEV = triton_device()
pytestmark = pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")

SHAPES = [(3, 64, 2, 64), (2, 20, 2, 16), (2, 32, 4, 32)]     # N windows, W bars, heads, head dims
FP32 = dict(rtol=1e-4, atol=2e-5)


def _close(got: torch.Tensor, want: torch.Tensor, sdpa_same_dtype: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: got ≈ want (the fp32 reference). bf16: got's largest error from the fp32 reference is no more than 1.5×
    that of SDPA itself run in bf16 on the same inputs (plus a rounding step of the largest value): as close as
    PyTorch's own kernel at that precision."""
    got = got.float().cpu()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32)
        return
    ours, theirs = (got - want).abs().max(), (sdpa_same_dtype.float().cpu() - want).abs().max()
    assert ours <= 1.5 * theirs + 2 ** -8 * want.abs().max(), (float(ours), float(theirs))


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    N, W, D = x.shape
    return x.view(N, W, H, D // H).transpose(1, 2)


def _reference_causal(qkv: torch.Tensor, H: int, keep_dtype: bool = False) -> torch.Tensor:
    q, k, v = (_heads(t, H) for t in (qkv if keep_dtype else qkv.float()).split(qkv.shape[2] // 3, dim=-1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)


def _reference_last(q: torch.Tensor, kv: torch.Tensor, H: int, keep_dtype: bool = False) -> torch.Tensor:
    k, v = (_heads(t, H) for t in (kv if keep_dtype else kv.float()).split(kv.shape[2] // 2, dim=-1))
    N, D = q.shape
    o = F.scaled_dot_product_attention((q if keep_dtype else q.float()).view(N, H, 1, D // H), k, v)
    return o.reshape(N, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-W{}-H{}-d{}".format(*s))
def test_causal_attention_and_its_gradient_match_sdpa(shape, dtype):
    from services.trainer.fused_attention import causal_attention
    N, W, H, hd = shape
    g = torch.Generator().manual_seed(0)
    qkv = (torch.randn(N, W, 3 * H * hd, generator=g) * 1.5).to(dtype)
    grad = torch.randn(N, W, H * hd, generator=g)
    ref = qkv.clone().float().requires_grad_()
    want = _reference_causal(ref, H)
    (want * grad).sum().backward()
    same = qkv.to(DEV).clone().requires_grad_()                     # SDPA at the inputs' own precision
    base = _reference_causal(same, H, keep_dtype=True)
    (base.float() * grad.to(DEV)).sum().backward()
    x = qkv.to(DEV).clone().requires_grad_()
    got = causal_attention(x, H)
    assert got.shape == (N, W, H * hd) and got.dtype == dtype
    (got.float() * grad.to(DEV)).sum().backward()
    _close(got, want.detach(), base.detach(), dtype)
    _close(x.grad, ref.grad, same.grad, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-W{}-H{}-d{}".format(*s))
def test_last_query_attention_and_its_gradient_match_sdpa(shape, dtype):
    from services.trainer.fused_attention import last_query_attention
    N, W, H, hd = shape
    g = torch.Generator().manual_seed(1)
    q0 = (torch.randn(N, H * hd, generator=g) * 1.5).to(dtype)
    kv0 = (torch.randn(N, W, 2 * H * hd, generator=g) * 1.5).to(dtype)
    grad = torch.randn(N, H * hd, generator=g)
    rq, rkv = q0.clone().float().requires_grad_(), kv0.clone().float().requires_grad_()
    want = _reference_last(rq, rkv, H)
    (want * grad).sum().backward()
    sq, skv = q0.to(DEV).clone().requires_grad_(), kv0.to(DEV).clone().requires_grad_()
    base = _reference_last(sq, skv, H, keep_dtype=True)
    (base.float() * grad.to(DEV)).sum().backward()
    q, kv = q0.to(DEV).clone().requires_grad_(), kv0.to(DEV).clone().requires_grad_()
    got = last_query_attention(q, kv, H)
    assert got.shape == (N, H * hd) and got.dtype == dtype
    (got.float() * grad.to(DEV)).sum().backward()
    _close(got, want.detach(), base.detach(), dtype)
    _close(q.grad, rq.grad, sq.grad, dtype)
    _close(kv.grad, rkv.grad, skv.grad, dtype)


def test_the_encoder_through_the_kernels_learns_what_it_learns_through_sdpa():
    """`Agent.use_attention_kernels`: the encoder's embedding and every parameter's gradient as with SDPA (fp32), for
    a causal block and the last-token block; without gradient the block keeps SDPA."""
    import copy

    from services.trainer import fused_attention
    from shared.agent import Agent, AgentConfig
    torch.manual_seed(0)
    sdpa = Agent(AgentConfig(n_features=6, window=24, d_model=32, n_heads=2, n_layers=2, hidden=16)).to(DEV)
    fused = copy.deepcopy(sdpa)
    fused.use_attention_kernels((fused_attention.causal_attention, fused_attention.last_query_attention))
    x = torch.randn(5, 24, 6, device=DEV)
    grads = []
    for net in (sdpa, fused):
        emb = net.encode(x)
        (emb * torch.linspace(-1, 1, emb.shape[1], device=DEV)).sum().backward()
        grads.append((emb.detach(), {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-4, atol=1e-5)
    assert grads[1][1].keys() == grads[0][1].keys() and any(k.startswith("enc_blocks.0.qkv") for k in grads[0][1])
    for name, g in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], g, rtol=1e-4, atol=1e-5, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(fused.encode(x), sdpa.encode(x))
