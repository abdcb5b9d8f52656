"""FlatAdamW: the numbers of torch's AdamW after clip_grad_norm_, over parameters flattened into one buffer."""
from __future__ import annotations

import copy

import pytest
import torch

from services.trainer.flat_adamw import ALIGN, FlatAdamW, flatten_parameters


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _groups(net: torch.nn.Module | list[torch.Tensor]) -> list[dict]:
    """Three groups with different decays and learning rates, as the trainer's are (decay mask, branches), of a
    network's parameters (or of a list of them)."""
    ps = list(net.parameters()) if isinstance(net, torch.nn.Module) else net
    return [{"params": [ps[0], ps[4]], "weight_decay": 1e-2, "lr": 3e-3},
            {"params": [ps[1], ps[2], ps[3]], "weight_decay": 0.0, "lr": 1e-3},
            {"params": [ps[5]], "weight_decay": 0.0, "lr": 5e-3}]


def test_flatten_parameters_makes_views_and_keeps_values_and_autograd():
    net = _net()
    before = [p.detach().clone() for p in net.parameters()]
    flat = flatten_parameters(list(net.parameters()))
    assert sum(b.numel() for b in before) <= flat.numel() < sum(b.numel() + ALIGN for b in before)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p, b) and p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        # every view 128 bytes from the buffer's start (allocated aligned on CUDA), as its own allocation would be
        # (packed views stopped a compiled GPU update)
        assert (p.data_ptr() - flat.data_ptr()) % (4 * ALIGN) == 0 and p.is_contiguous()
    assert flat.sum().item() == pytest.approx(sum(b.sum().item() for b in before), rel=1e-5)   # the gaps hold 0
    net(torch.randn(5, 7)).sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in net.parameters())
    with torch.no_grad():
        flat.zero_()
    assert all(float(p.abs().sum()) == 0.0 for p in net.parameters())
    with pytest.raises(ValueError, match="float32"):
        flatten_parameters([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


@pytest.mark.parametrize("max_norm", [0.05, float("inf")])
def test_flat_adamw_matches_torch_adamw_after_the_clip(max_norm):
    ref, net = _net(), _net()
    opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-3, betas=(0.9, 0.999), eps=1e-6)
    opt = FlatAdamW(_groups(net), lr=1e-3, betas=(0.9, 0.999), eps=1e-6)
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        x, y = torch.randn(32, 7, generator=g), torch.randn(32, 3, generator=g)
        if step == 6:                                             # the schedule writes new LRs between steps
            opt_ref.param_groups[2]["lr"] = 2e-4
            opt.param_groups[2]["lr"].fill_(2e-4)                  # in place: a view of the LR vector
        norms = []
        for model, o in ((ref, opt_ref), (net, opt)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            if o is opt_ref:
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
                o.step()
            else:
                norms.append(o.step(max_norm))
        assert torch.allclose(norms[0], norms[1], rtol=1e-5), (step, norms)
        for a, b in zip(ref.parameters(), net.parameters()):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), step
    if max_norm < float("inf"):
        assert float(norms[0]) > max_norm                          # the clip did act
    for a, b in zip(ref.parameters(), net.parameters()):          # the moments, through torch's state interface
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(opt_ref.state[a][k], opt.state[b][k], rtol=1e-5, atol=1e-9)
        assert float(opt.state[b]["step"]) == float(opt_ref.state[a]["step"]) == 12


def test_flat_adamw_reads_device_tensor_learning_rates_and_runs_compiled():
    """LRs written in place between steps, the step through torch.compile: no recompile per LR value."""
    from shared.rollout import compile_works
    ref, net = _net(), _net()
    groups = _groups(net)
    for gr in groups:
        gr["lr"] = torch.tensor(gr["lr"])
    opt = FlatAdamW(groups, lr=1e-3, eps=1e-6)
    opt_ref = torch.optim.AdamW(_groups(ref), lr=1e-3, eps=1e-6)
    x, y = torch.randn(16, 7), torch.randn(16, 3)

    def step(model, o):
        o.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        return o.step(1.0)
    compiled = compile_works(torch.device("cpu"))
    run = torch.compile(step) if compiled else step
    for i in range(3):
        opt.param_groups[0]["lr"].fill_(3e-3 * (i + 1))
        opt_ref.param_groups[0]["lr"] = 3e-3 * (i + 1)
        with torch._dynamo.config.patch(error_on_recompile=compiled and i > 0):   # a new LR value: no recompile
            run(net, opt)
        opt_ref.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
    for a, b in zip(ref.parameters(), net.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_target_lerp_over_a_flat_copy_equals_the_per_parameter_lerp():
    net = _net()
    target = copy.deepcopy(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    expect = [t + 0.01 * (p - t) for t, p in zip(target.parameters(), net.parameters())]
    flat, tflat = flatten_parameters(list(net.parameters())), flatten_parameters(list(target.parameters()))
    tflat.lerp_(flat, 0.01)
    for t, e in zip(target.parameters(), expect):
        assert torch.allclose(t, e)


def test_compiled_step_writes_the_flat_buffer_in_place_without_a_copy_back():
    """Compiled, the step mutates the flat buffer inside its kernels. If a parameter (a view of the buffer) takes
    part in the step, AOTAutograd treats the buffer as an aliased graph input and writes it back afterwards with a
    whole-buffer `copy_` (a device-to-device memcpy at the end of every update on the GPU: bench/README.md, entry
    1f6fa1e). This test fails on such a copy."""
    from shared.rollout import compile_works
    if not compile_works(torch.device("cpu")):
        pytest.skip("torch.compile cannot build kernels here")
    net = _net()
    opt = FlatAdamW(_groups(net), lr=1e-3, eps=1e-6)
    assert any(opt._gaps), "the layout should leave gaps between parameters (their zeros are part of the step)"
    x, y = torch.randn(16, 7), torch.randn(16, 3)
    step = torch.compile(lambda: opt.step(1.0))
    copies = []
    orig = torch.Tensor.copy_

    def spy(self, src, *args, **kwargs):
        if self.data_ptr() == opt.flat.data_ptr():
            copies.append(tuple(self.shape))
        return orig(self, src, *args, **kwargs)
    for spying in (False, True):                 # the first call compiles (tracing runs on fake tensors)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(net(x), y).backward()
        before = opt.flat.clone()
        torch.Tensor.copy_ = spy if spying else orig
        try:
            step()
        finally:
            torch.Tensor.copy_ = orig
        assert not torch.equal(before, opt.flat), "the step should move the parameters"
    assert copies == [], f"the flat buffer was copied back after the compiled step: {copies}"


def test_runs_stacked_in_one_buffer_step_each_as_its_own_flat_adamw():
    """`runs=R`: R runs' parameters stacked along their first dimension (`torch.func.stack_module_state`), their
    gradients from one backward pass through the vmapped losses, step as R FlatAdamWs over each run's own network:
    each run's gradients clipped by their own norm (the largest run's clipped, the smallest's not), the shared
    learning rates written in place between steps; a parameter not stacked R deep is refused."""
    from torch.func import functional_call, stack_module_state, vmap

    R, max_norm = 3, None
    nets = [_net() for _ in range(R)]
    with torch.no_grad():
        for r, net in enumerate(nets):
            for p in net.parameters():
                p.mul_(1.0 + 0.5 * r)
    own = [copy.deepcopy(n) for n in nets]
    own_opts = [FlatAdamW(_groups(n), lr=1e-3, eps=1e-6) for n in own]
    params, _ = stack_module_state(nets)
    names = [n for n, _ in nets[0].named_parameters()]
    opt = FlatAdamW(_groups([params[n] for n in names]), lr=1e-3, eps=1e-6, runs=R)
    g = torch.Generator().manual_seed(2)

    def loss(p, x, y):
        return torch.nn.functional.mse_loss(functional_call(nets[0], p, (x,)), y)
    for step in range(8):
        x = torch.randn(R, 32, 7, generator=g)
        y = torch.randn(R, 32, 3, generator=g) * torch.tensor([1.0, 4.0, 16.0]).view(R, 1, 1)
        if step == 4:
            for o in (opt, *own_opts):
                o.param_groups[2]["lr"].fill_(2e-4)
        for r, (net, o) in enumerate(zip(own, own_opts)):
            o.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x[r]), y[r]).backward()
        if max_norm is None:                                   # between the runs' first norms: one clips, one not
            first = sorted(float(torch.cat([p.grad.flatten() for p in n.parameters()]).norm()) for n in own)
            max_norm = first[1]
        want = torch.stack([o.step(max_norm) for o in own_opts])
        opt.zero_grad(set_to_none=True)
        vmap(loss)(params, x, y).sum().backward()
        got = opt.step(max_norm)
        assert got.shape == (R,) and torch.allclose(got, want, rtol=1e-5), (step, got, want)
        if step == 0:
            assert float(want.min()) < max_norm < float(want.max())
        for r, net in enumerate(own):
            for n, p in net.named_parameters():
                assert torch.allclose(params[n][r], p, rtol=1e-5, atol=1e-7), (step, r, n)
                assert torch.allclose(opt.state[params[n]]["exp_avg"][r], own_opts[r].state[p]["exp_avg"],
                                      rtol=1e-4, atol=1e-8), (step, r, n)
    with pytest.raises(ValueError, match="runs=3 needs every parameter stacked 3 runs deep"):
        flatten_parameters([torch.nn.Parameter(torch.zeros(2, 5))], runs=3)
