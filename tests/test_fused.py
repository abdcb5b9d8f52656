"""The fused C51 loss kernel (`services.trainer.fused`) against its torch form: values and gradients, at the
portfolio shift's kinks (δ = 0, whole atom steps) and past the support's ends.

On a CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before Triton compiles anything, so in
a fresh interpreter); on the GPU machine the CUDA test runs it compiled:
    python3 -m pytest -q tests/test_fused.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cases(device="cpu", dtype=torch.float32):
    """Logits as the update hands them (a non-contiguous view of the N × K × NB × A heads), shifts on and off the
    kinks and beyond the support, targets (one a single atom), the support of `Agent.support`, and an upstream
    gradient."""
    g = torch.Generator().manual_seed(0)
    N, NBR, K, A, v_max = 6, 3, 5, 51, 0.05
    support = v_max * torch.linspace(-1.0, 1.0, A)
    dz = 2 * v_max / (A - 1)
    heads = torch.randn(N, K, NBR + 2, A, generator=g) * 2
    delta = torch.tensor([[0.0, 0.0, 0.0], [dz, -dz, 2.5 * dz], [0.3 * dz, -7.2 * dz, 0.0],
                          [0.2, -0.2, 0.049], [1e-9, -1e-9, 0.0], [0.01, -0.013, 0.04]])
    target = torch.softmax(torch.randn(N, NBR, A, generator=g) * 3, -1)
    target[0, 0] = torch.nn.functional.one_hot(torch.tensor(10), A).float()
    up = torch.randn(N, NBR, K, generator=g)
    to = dict(device=device)
    return (heads.to(dtype=dtype, **to)[:, :, :NBR].transpose(1, 2), delta.to(**to), support.to(**to),
            target.to(**to), up.to(**to))


def compare(ce, grads, ref_ce, ref_grads, tol=1e-5):
    torch.testing.assert_close(ce, ref_ce, rtol=tol, atol=tol)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.float(), r.float(), rtol=tol, atol=tol * r.abs().max().item())


def reference(logits, delta, support, target, up):
    from services.trainer.fused import shifted_c51_reference
    lg, d = logits.detach().clone().requires_grad_(True), delta.clone().requires_grad_(True)
    ce = shifted_c51_reference(lg, d, support, target)
    return ce.detach(), torch.autograd.grad((ce * up).sum(), [lg, d])


INTERPRETED = """
import torch
from services.trainer.fused import shifted_c51_launch
from tests.test_fused import cases, compare, reference
logits, delta, support, target, up = cases()
ce, g_logits, g_delta = shifted_c51_launch(logits, delta, support, target)
ref_ce, ref_grads = reference(logits, delta, support, target, up)
compare(ce, [up.unsqueeze(-1) * g_logits, (up * g_delta).sum(-1)], ref_ce, ref_grads)
assert (ref_grads[1][0] != 0).any() and (ref_grads[1][3, :2] == 0).all()   # kinks at 0 count, past the ends not
# through torch.compile as one graph (the kernel is an opaque operator to it), with autograd, as in the update
import services.trainer.fused as fused
fused.fused_available = lambda t: True
lg, d = logits.detach().clone().requires_grad_(True), delta.clone().requires_grad_(True)
loss = torch.compile(lambda lg, d: (fused.shifted_c51_cross_entropy(lg, d, support, target) * up).sum(),
                     fullgraph=True)
value = loss(lg, d)
compare(value, torch.autograd.grad(value, [lg, d]), (ref_ce * up).sum(), ref_grads)
print("ok", ce.shape)
"""


def test_the_kernel_under_the_interpreter_equals_the_torch_form_also_compiled():
    pytest.importorskip("triton", reason="Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", INTERPRETED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok torch.Size([6, 3, 5])" in out.stdout, out.stderr[-3000:]


UPDATE = """
import dataclasses, torch
import services.trainer.fused as fused
from tests.test_iqn_batch import _state
from services.trainer.train import noise_width
st = _state()                                                  # lr 0, τ 0: updates leave the networks as they are
b = st.replay.sample(32, torch.Generator().manual_seed(3))
noise = torch.rand(32, noise_width(st.cfg), generator=torch.Generator().manual_seed(4))
ref = {k: v.item() for k, v in st.update(b, noise).items()}
grads_ref = [p.grad.clone() for p in st.agent.parameters() if p.grad is not None]
st.cfg.fused_c51 = True
fused.fused_available = lambda t: True
out = {k: v.item() for k, v in st.update(b, noise).items()}
grads = [p.grad.clone() for p in st.agent.parameters() if p.grad is not None]
for k in ref:
    assert abs(out[k] - ref[k]) <= 1e-5 * abs(ref[k]) + 1e-6, (k, out[k], ref[k])
assert len(grads) == len(grads_ref)
for g, r in zip(grads, grads_ref):
    torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * r.abs().max().item() + 1e-9)   # sums reordered
print("ok", ref["c51"])
"""


def test_the_update_with_the_kernel_equals_the_update_without():
    """`TrainConfig.fused_c51` hands the kernel the update's tensors in the layout it expects: the same losses and
    gradients (the interpreter stands in for the GPU)."""
    pytest.importorskip("triton", reason="Triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", UPDATE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_the_cpu_takes_the_torch_form():
    from services.trainer.fused import shifted_c51_cross_entropy, shifted_c51_reference
    logits, delta, support, target, _ = cases()
    assert torch.equal(shifted_c51_cross_entropy(logits, delta, support, target),
                       shifted_c51_reference(logits, delta, support, target))


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_on_cuda_equals_the_torch_form(dtype):
    from services.trainer.fused import shifted_c51_cross_entropy
    logits, delta, support, target, up = cases("cuda", dtype)
    lg, d = logits.detach().clone().requires_grad_(True), delta.clone().requires_grad_(True)
    ce = shifted_c51_cross_entropy(lg, d, support, target)
    grads = torch.autograd.grad((ce * up).sum(), [lg, d])
    assert grads[0].dtype == dtype
    ref_ce, ref_grads = reference(logits, delta, support, target, up)
    compare(ce, grads, ref_ce, ref_grads, tol=1e-5 if dtype == torch.float32 else 1e-2)


@cuda
def test_the_kernel_compiles():
    """Inside torch.compile, as the update runs it (captured in CUDA graphs: tests/test_train_graph.py, "fused")."""
    from services.trainer.fused import shifted_c51_cross_entropy
    logits, delta, support, target, up = cases("cuda")
    lg, d = logits.detach().clone().requires_grad_(True), delta.clone().requires_grad_(True)

    @torch.compile(fullgraph=False)
    def loss(lg, d):
        return (shifted_c51_cross_entropy(lg, d, support, target) * up).sum()

    ref_ce, ref_grads = reference(logits, delta, support, target, up)
    for _ in range(2):
        value = loss(lg, d)
        compare(value, torch.autograd.grad(value, [lg, d]), (ref_ce * up).sum(), ref_grads)
