"""The fused C51 kernels (`services.trainer.fused_c51`) against the reference chain they replace
(`losses.c51_branch_losses_reference`): values and gradients, at the shifts where the projection has kinks.

Runs on a CUDA GPU; without one, under Triton's interpreter on the CPU when asked (`TRITON_INTERPRET=1` with
triton importable), as `make test` does in a second pytest run (the Makefile installs triton beside the venv);
skipped otherwise. The interpreter executes the kernels' code with numpy, so it checks their indexing and
arithmetic but not the GPU's rounding: at kinks that decided the subgradient, which only the GPU run caught
(bench/README.md, entry cbcddb4)."""
from __future__ import annotations

import pytest
import torch

from services.trainer.losses import c51_branch_losses
from triton_device import triton_device


DEV = triton_device()
pytestmark = pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")

BRANCHES = (3, 2, 3)


def rows_for(rows_a_program: int) -> int:
    """Rows of a batch: on the GPU a batch of programs; under the interpreter (numpy, one program after another, ~1 s
    each here) two whole programs and a partial last one, where a program holds more than one row."""
    return 40 if DEV == "cuda" else 2 * rows_a_program + 2


def _inputs(case: str, dtype: torch.dtype, N: int | None = None, K: int = 5, A: int = 51, seed: int = 0):
    from services.trainer.fused_c51 import LAUNCH
    N = rows_for(LAUNCH["rows"]) if N is None else N
    g = torch.Generator().manual_seed(seed)
    NB = sum(BRANCHES)
    z = torch.linspace(-0.05, 0.05, A)
    dz = 0.1 / (A - 1)
    # the market logits as the agent makes them: a row of one wider GEMM output, sliced (not contiguous)
    wide = torch.randn(N, K * NB * A + 8, generator=g) * 2.0
    first = torch.tensor([0, BRANCHES[0], BRANCHES[0] + BRANCHES[1]])
    col = torch.stack([torch.randint(0, n, (N,), generator=g) for n in BRANCHES], 1) + first
    delta = {"random": torch.randn(N, 3, generator=g) * 0.03, "zero": torch.zeros(N, 3),
             "whole steps": torch.randint(-12, 12, (N, 3), generator=g).float() * dz,
             "past the ends": torch.linspace(-0.3, 0.3, N * 3).view(N, 3),
             "on the ends": torch.tensor([-0.1, 0.1, 0.0]).repeat(N, 1)}[case]
    target = torch.softmax(torch.randn(N, 3, A, generator=g) * 2.0, -1)
    w_ce, w_ent = torch.rand(N, 3, K, generator=g), torch.rand(N, K, generator=g)
    return wide.to(dtype), col, delta, target, z, w_ce, w_ent, (N, K, NB, A)


@pytest.fixture(params=[1, 4], ids=["1 row a program", "4 rows a program"])
def launch(request):
    from services.trainer import fused_c51
    saved = dict(fused_c51.LAUNCH)
    fused_c51.LAUNCH.update(rows=request.param, num_warps=request.param)
    yield
    fused_c51.LAUNCH.update(saved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "zero", "whole steps", "past the ends", "on the ends"])
def test_fused_equals_the_reference_values_and_gradients(case, dtype, launch):
    wide0, col, delta0, target, z, w_ce, w_ent, (N, K, NB, A) = _inputs(case, dtype)
    out = []
    for fused in (False, True):
        wide = wide0.to(DEV, copy=True).requires_grad_()
        delta = delta0.to(DEV, copy=True).requires_grad_()
        logits = wide[:, :K * NB * A].view(N, K, NB, A)
        ce, ent, util = c51_branch_losses(logits, col.to(DEV), delta, target.to(DEV), z.to(DEV), BRANCHES,
                                          fused=fused)
        ((ce * w_ce.to(DEV)).sum() + (ent * w_ent.to(DEV)).sum()).backward()
        out.append([x.detach().float().cpu() for x in (ce, ent, util, wide.grad, delta.grad)])
    for name, ref, got in zip(("ce", "entropy", "utilisation", "d/dlogits", "d/dδ"), *out):
        scale = 1.0 + float(ref.abs().max())
        tol = dict(rtol=1e-4, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2 * scale)
        if name == "d/dlogits" and dtype == torch.bfloat16:
            # the reference rounds each term's gradient to bf16 and adds them; the kernel adds in fp32, then rounds
            tol = dict(rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{case}, {dtype}, {name}: {m}")
    grad = out[1][3][:, :K * NB * A].view(N, K, NB, A)
    taken = torch.zeros(N, NB, dtype=torch.bool).scatter_(1, col, True)
    assert torch.all(grad[~taken.view(N, 1, NB).expand(N, K, NB)] == 0), "untaken actions get no gradient"
    assert torch.all(out[1][3][:, K * NB * A:] == 0), "the padding columns get no gradient"
    assert out[1][4].abs().sum() > 0


@pytest.mark.parametrize("with_q", [False, True], ids=["C51 terms", "with the direction Q"])
def test_fused_under_torch_compile_equals_eager(with_q):
    """Compiled, the custom ops stay whole: the same numbers as called eagerly (`c51_branch_losses`, and
    `c51_branch_losses_q` on the padded rows)."""
    if DEV != "cuda":
        pytest.skip("torch.compile of the custom op: CUDA only")
    from services.trainer.losses import c51_branch_losses_q
    wide0, col, delta0, target, z, w_ce, w_ent, (N, K, NB, A) = _inputs("random", torch.bfloat16)
    w_q = torch.randn(N, K, 3, device="cuda")

    def loss(wide, delta):
        args = (col.cuda(), delta, target.cuda(), z.cuda(), BRANCHES)
        if with_q:
            ce, ent, _, q = c51_branch_losses_q(wide, K, *args, fused=True)
        else:
            (ce, ent, _), q = c51_branch_losses(wide[:, :K * NB * A].view(N, K, NB, A), *args, fused=True), 0.0 * w_q
        return (ce * w_ce.cuda()).sum() + (ent * w_ent.cuda()).sum() + (q * w_q).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        wide, delta = wide0.cuda().requires_grad_(), delta0.cuda().requires_grad_()
        value = fn(wide, delta)
        value.backward()
        grads.append((value.detach(), wide.grad, delta.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["random", "zero", "past the ends"])
def test_fused_with_the_direction_q_on_the_padded_output_equals_the_reference(case, dtype):
    """`c51_branch_losses_q`: the C51 terms and every member's direction Q from the heads' padded output, values and
    gradients (of the whole padded row: zeros in its padding, the direction Q's gradient added to the C51 one's)."""
    from services.trainer.losses import c51_branch_losses_q
    wide0, col, delta0, target, z, w_ce, w_ent, (N, K, NB, A) = _inputs(case, dtype)
    w_q = torch.randn(N, K, 3, generator=torch.Generator().manual_seed(5))
    out = []
    for fused in (False, True):
        wide = wide0.to(DEV, copy=True).requires_grad_()
        delta = delta0.to(DEV, copy=True).requires_grad_()
        ce, ent, util, q = c51_branch_losses_q(wide, K, col.to(DEV), delta, target.to(DEV), z.to(DEV), BRANCHES,
                                               fused=fused)
        ((ce * w_ce.to(DEV)).sum() + (ent * w_ent.to(DEV)).sum() + (q * w_q.to(DEV)).sum()).backward()
        out.append([x.detach().float().cpu() for x in (ce, ent, util, q, wide.grad, delta.grad)])
    for name, ref, got in zip(("ce", "entropy", "utilisation", "q", "d/dwide", "d/dδ"), *out):
        scale = 1.0 + float(ref.abs().max())
        tol = dict(rtol=1e-4, atol=1e-5 * scale) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2 * scale)
        torch.testing.assert_close(got, ref, **tol, msg=lambda m: f"{case}, {dtype}, {name}: {m}")
    assert torch.all(out[1][4][:, K * NB * A:] == 0), "the padding columns get no gradient"
    direction = out[1][4][:, :K * NB * A].view(N, K, NB, A)[:, :, :3]
    assert torch.all(direction.abs().sum(-1) > 0), "every direction action gets the Q's gradient, taken or not"

