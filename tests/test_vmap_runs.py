"""The network, the update's objective and its targets under `torch.func.vmap` over several runs' parameters stacked
(`torch.func.stack_module_state`): each run's targets, loss and gradients equal those of its own networks, so R
runs' updates can be one batched computation. What makes it hold: the custom autograd Functions
(`layers._DenseGrad`, `losses._ShiftGather`) have a vmap rule (`generate_vmap_rule`, `setup_context`), and the C51
projection adds its mass out of place."""
import copy
import dataclasses

import pytest
import torch
from torch.func import stack_module_state, vmap

from services.trainer.objective import make_objective
from services.trainer.targets import make_targets, noise_width
from services.trainer.train import train_run
from shared.synthetic import generate
from tests.test_train import tiny_config

R = 3


FIXES = [{}, {"feasible_targets": True, "kl_priority": True, "cut_episodes": True}]
"""The configurations the equalities are checked under: the default, and the learning options that add work to the
targets and the priority."""


def runs(tmp_path, seed: int, **kw):
    """A trained tiny state, R copies of its online and target networks made different, and a batch with its
    noise."""
    cfg = dataclasses.replace(tiny_config(), **kw)
    st = train_run(generate(700, seed=3).bars, "synthetic", tmp_path / "run", 1, config=cfg, seed=5)
    gen = torch.Generator().manual_seed(seed)
    online, target = [copy.deepcopy(st.agent) for _ in range(R)], [copy.deepcopy(st.target) for _ in range(R)]
    with torch.no_grad():
        for i in range(1, R):
            for p in [*online[i].parameters(), *target[i].parameters()]:
                p.add_(0.01 * i * torch.randn(p.shape, generator=gen))
    B = cfg.batch_size
    b = st.replay.sample(B, u=torch.rand(B, generator=gen))
    return cfg, st, online, target, b, torch.rand(B, noise_width(cfg), generator=gen)


@pytest.mark.parametrize("kw", FIXES)
def test_the_objective_of_stacked_runs_equals_each_runs_own(tmp_path, kw):
    cfg, st, online, _, b, noise = runs(tmp_path, 0, **kw)
    tg = st.targets(b, noise)
    params, buffers = stack_module_state(online)
    objective = make_objective(st.agent, st.env.market.windows, st.buffers, cfg)

    def loss(p: dict, bf: dict) -> torch.Tensor:
        with torch.nn.utils.stateless._reparametrize_module(st.agent, {**p, **bf}):
            return objective(b, noise, tg, lambda: None).loss

    losses = vmap(loss)(params, buffers)
    losses.sum().backward()
    for r, a in enumerate(online):
        own = make_objective(a, st.env.market.windows, st.buffers, cfg)(b, noise, tg, lambda: None).loss
        own.backward()
        assert torch.allclose(losses[r], own, rtol=1e-6, atol=1e-6), r
        for n, p in a.named_parameters():
            want = torch.zeros_like(p) if p.grad is None else p.grad
            assert torch.allclose(params[n].grad[r], want, rtol=1e-4, atol=1e-5), (r, n)


@pytest.mark.parametrize("kw", FIXES)
def test_the_targets_of_stacked_runs_equal_each_runs_own(tmp_path, kw):
    cfg, st, online, target, b, noise = runs(tmp_path, 1, **kw)
    (po, bo), (pt, bt) = stack_module_state(online), stack_module_state(target)

    def targets(po: dict, bo: dict, pt: dict, bt: dict) -> tuple[torch.Tensor, ...]:
        with torch.nn.utils.stateless._reparametrize_module(st.agent, {**po, **bo}), \
                torch.nn.utils.stateless._reparametrize_module(st.target, {**pt, **bt}):
            return st.targets(b, noise).tensors()

    with torch.no_grad():
        out = vmap(targets)(po, bo, pt, bt)
    for r in range(R):
        own = make_targets(online[r], target[r], st.buffers, cfg)(b, noise).tensors()
        assert all(torch.equal(x[r], y) for x, y in zip(out, own)), r
