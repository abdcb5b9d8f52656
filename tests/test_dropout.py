"""`TrainConfig.dropout`: the trunk state's dropout in the update's online forward pass, its mask drawn from the
update's noise — checked against the same objective on a network whose trunk rows are scaled by that mask; the
config's bounds; a run without it keeps its noise, config and hash; an epoch trains with it."""
import copy
import dataclasses

import pytest
import torch

from services.trainer.config import TrainConfig
from services.trainer.objective import dropout_keep, make_objective
from services.trainer.targets import dropout_columns
from bench.train_speed import synthetic_dataset
from services.trainer.train import build_state, make_targets, noise_width, train_epoch
from shared.knobs import Knobs
from tests.test_horizon_sample import tiny
from tests.test_iqn_batch import _state


def test_the_objective_with_dropout_is_the_objective_of_the_masked_trunk():
    st = _state()
    cfg0, H, N, p = st.cfg, st.cfg.agent.hidden, 32, 0.25
    cfg1 = dataclasses.replace(cfg0, dropout=p)
    assert noise_width(cfg1) == noise_width(cfg0) + H and dropout_columns(cfg1) == slice(noise_width(cfg0),
                                                                                        noise_width(cfg1))
    b = st.replay.sample(N, torch.Generator().manual_seed(3))
    noise0 = torch.rand(N, noise_width(cfg0), generator=torch.Generator().manual_seed(4))
    # one mask for every row, half of the trunk's units dropped: then dropout is the network with the trunk's last
    # layer's rows scaled by 0 or 1 / (1 − p) (ReLU(c·x) = c·ReLU(x) for c ≥ 0)
    drop = torch.rand(H, generator=torch.Generator().manual_seed(5)) < 0.5
    u = torch.where(drop, 0.1, 0.9)
    noise1 = torch.cat([noise0, u.expand(N, H)], dim=1)
    keep = dropout_keep(noise1, cfg1)
    torch.testing.assert_close(keep, ((~drop).float() / (1 - p)).expand(N, H))
    assert dropout_keep(noise0, cfg0) is None
    windows = st.env.market.windows
    tg = make_targets(st.agent, st.target, st.buffers, cfg0)(b, noise0)
    tg1 = make_targets(st.agent, st.target, st.buffers, cfg1)(b, noise1)        # the targets run the network whole
    for f in ("dist", "value", "quantiles"):
        torch.testing.assert_close(getattr(tg1, f), getattr(tg, f))
    ref = copy.deepcopy(st.agent)
    with torch.no_grad():
        scale = (~drop).float() / (1 - p)
        ref.trunk[2].weight.mul_(scale.unsqueeze(1))
        ref.trunk[2].bias.mul_(scale)
    got = make_objective(st.agent, windows, st.buffers, cfg1)(b, noise1, tg, lambda: None)
    want = make_objective(ref, windows, st.buffers, cfg0)(b, noise0, tg, lambda: None)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.priority, want.priority, rtol=1e-5, atol=1e-6)
    plain = make_objective(st.agent, windows, st.buffers, cfg0)(b, noise0, tg, lambda: None)
    assert abs(plain.loss.item() - got.loss.item()) > 1e-4 * abs(plain.loss.item())   # the mask matters
    got.loss.backward()
    g = st.agent.trunk[2].weight.grad
    assert torch.all(g[drop] == 0) and torch.any(g[~drop] != 0)        # a dropped unit's weights learn nothing


def test_an_epoch_with_dropout_trains():
    bars, split, feats = synthetic_dataset(600)
    st = build_state(tiny(feats, dropout=0.3), bars, split, 0)
    assert st.runner.update_noise[0].shape[1] == 1 + noise_width(st.cfg)      # the step's noise holds the mask's
    before = st.agent.trunk[0].weight.detach().clone()
    stats = train_epoch(st, Knobs(epsilon=0.3))
    assert stats.updates > 0 and all(torch.isfinite(torch.tensor(v)) for v in (stats.loss, stats.c51, stats.iqn))
    assert not torch.equal(st.agent.trunk[0].weight, before)


@pytest.mark.parametrize("bad", [-0.1, 1.0, True, "0.1"])
def test_dropout_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="dropout must be a number in \\[0, 1\\)"):
        TrainConfig(dropout=bad)


def test_without_dropout_the_config_and_its_hash_are_as_before():
    cfg = TrainConfig()
    assert "dropout" not in cfg.to_dict()
    assert TrainConfig.from_dict(cfg.to_dict()).hash() == cfg.hash()
    d = TrainConfig(dropout=0.1).to_dict()
    back = TrainConfig.from_dict(d)
    assert d["dropout"] == 0.1 and back.dropout == 0.1 and back.hash() != cfg.hash()
