"""The update's Triton ops under `torch.func.vmap` over several runs (`services.trainer.run_batch`): the runs' samples
folded into one launch give each run the outputs and gradients its own call gives, each run with its own C51
support, eagerly and compiled.

Runs on a CUDA GPU; without one, under Triton's interpreter on the CPU when asked (`TRITON_INTERPRET=1` with
triton importable, as `make test`'s second pytest run sets up); skipped otherwise."""
from __future__ import annotations

import pytest
import torch
from torch.func import vmap

from services.trainer.losses import c51_branch_losses, c51_branch_losses_q, greedy_next
from services.trainer.run_batch import support_rows
from tests.test_fused_c51 import BRANCHES, _inputs as c51_inputs
from tests.test_fused_greedy import _inputs as greedy_inputs
from triton_device import triton_device

DEV = triton_device()
needs_triton = pytest.mark.skipif(DEV is None, reason="needs a CUDA GPU (or TRITON_INTERPRET=1 with triton)")

R = 3
V_MAX = (0.05, 0.08, 0.03)                              # each run's support: linspace(−v, v, A)
EXACT = dict(rtol=1e-6, atol=1e-7)                      # the same row arithmetic: equal up to float reordering


def _stack(xs: list[torch.Tensor], grad: bool = False) -> torch.Tensor:
    t = torch.stack(xs).detach().to(DEV)
    return t.requires_grad_() if grad else t


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got, want = got.detach(), want.detach()
    if not want.is_floating_point():
        assert torch.equal(got.cpu(), want.cpu()), what
        return
    scale = 1.0 + float(want.abs().max())
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=EXACT["rtol"], atol=EXACT["atol"] * scale,
                               msg=lambda m: f"{what}: {m}")


def _c51_runs(dtype: torch.dtype):
    """R runs' inputs of the C51 ops (different logits, actions, shifts and targets) and their supports."""
    runs = [c51_inputs("random", dtype, N=6 if DEV == "cuda" else 2, seed=r) for r in range(R)]   # 2: interpreter
    A = runs[0][7][3]
    z = [torch.linspace(-v, v, A) for v in V_MAX]
    return runs, z


def _c51_loss(with_q: bool, K: int, NB: int, A: int):
    def loss(wide, col, delta, target, z, w_ce, w_ent, w_q):
        if with_q:
            ce, ent, util, q = c51_branch_losses_q(wide, K, col, delta, target, z, BRANCHES, fused=True)
        else:
            logits = wide[..., :K * NB * A].unflatten(-1, (K, NB, A))
            (ce, ent, util), q = c51_branch_losses(logits, col, delta, target, z, BRANCHES, fused=True), w_q * 0.0
        return (ce * w_ce).sum() + (ent * w_ent).sum() + (q * w_q).sum(), (ce, ent, util, q)
    return loss


@needs_triton
@pytest.mark.parametrize("with_q,dtype", [(False, torch.bfloat16), (True, torch.float32)],
                         ids=["C51 terms, bf16", "with the direction Q, fp32"])
def test_the_c51_ops_of_stacked_runs_equal_each_runs_own(with_q, dtype):
    runs, z = _c51_runs(dtype)
    N, K, NB, A = runs[0][7]
    loss = _c51_loss(with_q, K, NB, A)
    w_q = [torch.randn(N, K, 3, generator=torch.Generator().manual_seed(r)) for r in range(R)]
    own = []
    for r, (wide, col, delta, target, _, w_ce, w_ent, _) in enumerate(runs):
        wide, delta = wide.to(DEV, copy=True).requires_grad_(), delta.to(DEV, copy=True).requires_grad_()
        value, outs = loss(wide, col.to(DEV), delta, target.to(DEV), z[r].to(DEV), w_ce.to(DEV), w_ent.to(DEV),
                           w_q[r].to(DEV))
        value.backward()
        own.append((value.detach(), *outs, wide.grad, delta.grad))
    wide, delta = _stack([x[0] for x in runs], grad=True), _stack([x[2] for x in runs], grad=True)
    cols, targets, w_ce, w_ent = (_stack([x[i] for x in runs]) for i in (1, 3, 5, 6))

    def one(*args):
        return loss(*args)

    values, outs = vmap(one)(wide, cols, delta, targets, _stack(z), w_ce, w_ent, _stack(w_q))
    values.sum().backward()
    names = ("loss", "ce", "entropy", "utilisation", "q", "d/dlogits", "d/dδ")
    for r in range(R):
        got = (values[r], *(o[r] for o in outs), wide.grad[r], delta.grad[r])
        for name, g, w in zip(names, got, own[r]):
            _close(g, w, f"run {r}, {name}")
    assert own[1][5].abs().sum() > 0 and not torch.equal(own[0][1], own[1][1])


@needs_triton
@pytest.mark.parametrize("shared", [False, True], ids=["a support a run", "one support"])
def test_the_targets_greedy_op_of_stacked_runs_equals_each_runs_own(shared):
    runs = [greedy_inputs(torch.float32, N=8, seed=r, shift=0.02) for r in range(R)]
    A = runs[0][4].shape[0]
    z = [torch.linspace(-V_MAX[0 if shared else r], V_MAX[0 if shared else r], A) for r in range(R)]
    own = [greedy_next(*(t.to(DEV) for t in x[:4]), z[r].to(DEV), BRANCHES, fused=True) for r, x in enumerate(runs)]
    stacked = [_stack([x[i] for x in runs]) for i in range(4)]

    def one(on, on_d, tg, tg_d, *support):
        return greedy_next(on, on_d, tg, tg_d, support[0] if support else z[0].to(DEV), BRANCHES, fused=True)

    got = vmap(one)(*stacked) if shared else vmap(one)(*stacked, _stack(z))
    for r in range(R):
        for name, g, w in zip(("columns", "p_next", "d_star"), (o[r] for o in got), own[r]):
            _close(g, w, f"run {r}, {name}")


@needs_triton
def test_the_attention_ops_of_stacked_runs_equal_each_runs_own():
    from services.trainer.fused_attention import causal_attention, last_query_attention
    N, W, H, hd = 3, 20, 2, 16
    g = torch.Generator().manual_seed(0)
    qkv, q, kv = (torch.randn(R, N, *s, generator=g) for s in ((W, 3 * H * hd), (H * hd,), (W, 2 * H * hd)))
    go, gl = torch.randn(R, N, W, H * hd, generator=g).to(DEV), torch.randn(R, N, H * hd, generator=g).to(DEV)
    own = []
    for r in range(R):
        x, y, z = (t[r].to(DEV, copy=True).requires_grad_() for t in (qkv, q, kv))
        o, last = causal_attention(x, H), last_query_attention(y, z, H)
        ((o * go[r]).sum() + (last * gl[r]).sum()).backward()
        own.append((o.detach(), last.detach(), x.grad, y.grad, z.grad))
    x, y, z = (t.to(DEV, copy=True).requires_grad_() for t in (qkv, q, kv))
    o, last = vmap(lambda a, b, c: (causal_attention(a, H), last_query_attention(b, c, H)))(x, y, z)
    ((o * go).sum() + (last * gl).sum()).backward()
    for r in range(R):
        got = (o[r], last[r], x.grad[r], y.grad[r], z.grad[r])
        for name, a, b in zip(("causal", "last query", "d/dqkv", "d/dq", "d/dkv"), got, own[r]):
            _close(a, b, f"run {r}, {name}")


@needs_triton
def test_the_c51_op_of_stacked_runs_compiled_equals_eager():
    """torch.compile traces the vmap rule: the compiled run-batched loss and its gradients are the eager ones."""
    runs, z = _c51_runs(torch.float32)
    N, K, NB, A = runs[0][7]
    loss = _c51_loss(True, K, NB, A)
    w_q = _stack([torch.randn(N, K, 3, generator=torch.Generator().manual_seed(r)) for r in range(R)])
    col, target, w_ce, w_ent = (_stack([x[i] for x in runs]) for i in (1, 3, 5, 6))
    fixed = [col, target, _stack(z), w_ce, w_ent]

    def total(wide, delta):
        def one(w, c, d, t, s, a, b, q):
            return loss(w, c, d, t, s, a, b, q)[0]
        return vmap(one)(wide, fixed[0], delta, *fixed[1:], w_q).sum()

    got = []
    for fn in (total, torch.compile(total, fullgraph=True)):
        wide, delta = _stack([x[0] for x in runs], grad=True), _stack([x[2] for x in runs], grad=True)
        value = fn(wide, delta)
        value.backward()
        got.append((value.detach(), wide.grad, delta.grad))
    for name, a, b in zip(("loss", "d/dlogits", "d/dδ"), *got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_support_is_one_row_for_all_or_a_row_for_each_runs_samples():
    z = torch.linspace(-1, 1, 5)
    assert support_rows(z, 12)[1] == 12 and support_rows(z, 0)[1] == 1
    rows, per = support_rows(torch.stack([z, 2 * z, 3 * z]), 12)
    assert per == 4 and rows.shape == (3, 5)
    with pytest.raises(ValueError, match=r"support of shape \(5, 5\) for 12 samples"):
        support_rows(torch.zeros(5, 5), 12)


def test_linear_layers_vmapped_over_runs_stay_in_autocasts_dtype():
    """`AutocastLinear`: under bf16 autocast, linear layers vmapped over R runs' weights (a bias of their own and one
    computed from parameters, as `ln_fold` computes it) come out bf16 with each run's own autocast values; without
    autocast the mode changes nothing. Pure logic on the CPU."""
    import torch.nn.functional as F
    from torch.func import functional_call, stack_module_state
    from services.trainer.run_batch import AutocastLinear

    g = torch.Generator().manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)) for _ in range(R)]
    for net in nets:
        for p in net.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    params, _ = stack_module_state(nets)
    x = torch.randn(R, 5, 16, generator=g)

    def one(p, x):
        h = functional_call(nets[0], p, (x,))
        return F.linear(h, p["2.weight"][:, :8], p["2.bias"] + p["0.bias"][:8])   # a bias computed in fp32

    def own(r):
        net = nets[r]
        return F.linear(net(x[r]), net[2].weight[:, :8], net[2].bias + net[0].bias[:8])

    with torch.no_grad():
        plain = vmap(one)(params, x)
        with AutocastLinear():
            assert torch.equal(vmap(one)(params, x), plain)                          # no autocast: no change
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with AutocastLinear():
                got = vmap(one)(params, x)
            want = torch.stack([own(r) for r in range(R)])
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
