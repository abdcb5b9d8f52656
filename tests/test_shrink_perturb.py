"""`TrainConfig.shrink_perturb`: before every epoch after the first, the online network moves a share s of the way to
a fresh initialisation drawn from the run's generator; the target, the optimizer and the replay stay."""
import dataclasses

import pytest
import torch

from bench.train_speed import synthetic_dataset
from services.trainer import loop
from services.trainer.config import TrainConfig
from services.trainer.state import build_state, fresh_parameters, perturb_due, shrink_perturb
from shared.knobs import Knobs
from tests.test_horizon_sample import tiny
from tests.test_train import tiny_config


def test_shrink_perturb_is_checked_and_left_out_of_the_config_at_its_neutral_value():
    cfg = tiny_config()
    assert "shrink_perturb" not in cfg.to_dict()               # stored runs' config hashes still match
    sp = dataclasses.replace(cfg, shrink_perturb=0.3)
    assert sp.to_dict()["shrink_perturb"] == 0.3 and sp.hash() != cfg.hash()
    assert TrainConfig.from_dict(sp.to_dict()) == sp
    for bad in (-0.1, 1.5, True, "0.3"):
        with pytest.raises(ValueError, match="shrink_perturb must be a share in"):
            dataclasses.replace(cfg, shrink_perturb=bad)
    assert TrainConfig.preset("full", 16).override(["shrink_perturb=0.3"]).shrink_perturb == 0.3


def test_the_online_network_moves_a_share_toward_a_fresh_one_and_nothing_else_does():
    bars, split, feats = synthetic_dataset(600)
    state = build_state(tiny(feats, shrink_perturb=0.25), bars, split, 5)
    with torch.no_grad():                                       # a trained-looking network, unlike a fresh draw
        for p in state.agent.parameters():
            p.add_(torch.randn_like(p))
    before = {n: p.detach().clone() for n, p in state.agent.named_parameters()}
    target = {n: p.detach().clone() for n, p in state.target.named_parameters()}
    addresses = {n: p.data_ptr() for n, p in state.agent.named_parameters()}
    g = state.generator.get_state()
    fresh = fresh_parameters(state)
    state.generator.set_state(g)                                # shrink_perturb draws the same seed
    shrink_perturb(state)
    for n, p in state.agent.named_parameters():
        assert torch.allclose(p, 0.75 * before[n] + 0.25 * fresh[n], atol=1e-6), n
        assert p.data_ptr() == addresses[n], n                  # in place: a captured step keeps reading it
    for n, p in state.target.named_parameters():
        assert torch.equal(p, target[n]), n
    assert not torch.equal(state.generator.get_state(), g)     # the seed came from the run's generator


def test_train_epoch_perturbs_before_every_epoch_after_the_first(monkeypatch):
    calls = []
    monkeypatch.setattr(loop, "shrink_perturb", lambda st: calls.append(st.epoch))
    bars, split, feats = synthetic_dataset(600)
    state = build_state(tiny(feats, shrink_perturb=0.25), bars, split, 5)
    assert not perturb_due(state)
    for _ in range(3):
        loop.train_epoch(state, Knobs(epsilon=0.3))
    assert calls == [1, 2]
    plain = build_state(tiny(feats), bars, split, 5)
    plain.epoch = 4
    assert not perturb_due(plain)
