"""`TrainConfig.restart_every`: before every epoch that follows a multiple of it the learner restarts — fresh weights
for the network, its target and its average, fresh optimizer moments and step counts — while the replay, the
tracker, the reward support and the schedule's counters stay."""
import dataclasses

import pytest
import torch

from services.trainer.config import TrainConfig
from services.trainer.state import restart_due, restart_learner
from services.trainer.train import train_run
from shared.synthetic import generate
from tests.test_train import tiny_config


def test_restart_every_is_checked_and_left_out_of_the_config_at_its_neutral_value():
    cfg = tiny_config()
    assert "restart_every" not in cfg.to_dict()                 # stored runs' config hashes still match
    r = dataclasses.replace(cfg, restart_every=2)
    assert r.to_dict()["restart_every"] == 2 and r.hash() != cfg.hash()
    assert TrainConfig.from_dict(r.to_dict()) == r
    for bad in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="restart_every must be a whole number"):
            dataclasses.replace(cfg, restart_every=bad)
    assert TrainConfig.preset("full", 16).override(["restart_every=1"]).restart_every == 1


def test_which_epochs_restart():
    class S:
        cfg = dataclasses.replace(tiny_config(), restart_every=2)
    due = []
    for epoch in range(6):                                     # state.epoch: the epochs done before the next one
        S.epoch = epoch
        due.append(restart_due(S))
    assert due == [False, False, True, False, True, False]
    S.cfg = tiny_config()
    assert not any(restart_due(S) for S.epoch in range(6))


def _opt_tensors(state):
    return [v for st in state.opt.state.values() for v in st.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("adamw", ["auto", "flat"])
def test_a_restart_makes_a_fresh_learner_and_keeps_what_was_collected(tmp_path, adamw):
    bars = generate(700, seed=3).bars
    cfg = dataclasses.replace(tiny_config(), adamw=adamw, policy_ema=0.9)
    st = train_run(bars, "synthetic", tmp_path / "a", 1, config=cfg, seed=5)
    twin = train_run(bars, "synthetic", tmp_path / "b", 1, config=cfg, seed=5)
    trained = {n: p.detach().clone() for n, p in st.agent.named_parameters()}
    buffers = {n: b.clone() for n, b in st.agent.named_buffers()}
    replay = {k: v.clone() for k, v in st.replay.state_tensors().items()}
    rng = torch.get_rng_state()
    assert any(float(v.abs().sum()) > 0 for v in _opt_tensors(st))
    restart_learner(st)
    restart_learner(twin)
    fresh = dict(st.agent.named_parameters())
    assert all(not torch.equal(fresh[n], trained[n]) for n in trained if trained[n].abs().sum() > 0)
    for net in (st.target, st.ema):                             # target and average start where the network does
        assert all(torch.equal(p, fresh[n]) for n, p in net.named_parameters())
    for n, p in twin.agent.named_parameters():                  # the fresh weights follow from the run's generator
        assert torch.equal(p, fresh[n]), n
    assert all(float(v.abs().sum()) == 0 for v in _opt_tensors(st))
    assert all(torch.equal(b, buffers[n]) for n, b in st.agent.named_buffers())         # v_max, maturity stay
    assert all(torch.equal(v, replay[k]) for k, v in st.replay.state_tensors().items())
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("adamw", ["auto", "flat"])
def test_train_epoch_restarts_the_learner_when_due(tmp_path, adamw):
    """Three epochs with restart_every = 2: the optimizer's step count after epoch 3 covers epoch 3's updates only
    (it restarted before epoch 3), after epoch 2 both epochs' (no restart before epoch 2)."""
    bars = generate(700, seed=3).bars
    cfg = dataclasses.replace(tiny_config(), adamw=adamw, restart_every=2)

    def steps(state) -> int:
        return int(next(iter(state.opt.state.values()))["step"])

    two = train_run(bars, "synthetic", tmp_path / "r", 2, config=cfg, seed=5)
    assert steps(two) == two.update_step
    three = train_run(bars, "synthetic", tmp_path / "r", 3, config=cfg, seed=5)       # resumes epoch 2, trains 3
    assert 0 < steps(three) < three.update_step
    assert steps(three) == three.update_step - two.update_step
