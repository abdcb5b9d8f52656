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


def test_restart_replay_is_checked_and_left_out_of_the_config_when_off():
    cfg = tiny_config()
    assert "restart_replay" not in cfg.to_dict()                 # stored runs' config hashes still match
    on = dataclasses.replace(cfg, restart_every=1, restart_replay=True)
    assert on.to_dict()["restart_replay"] is True and TrainConfig.from_dict(on.to_dict()) == on
    with pytest.raises(ValueError, match="restart_replay must be true or false"):
        dataclasses.replace(cfg, restart_replay=1)
    assert TrainConfig.preset("full", 16).override(["restart_replay=true"]).restart_replay is True


def test_a_restart_with_the_replay_emptied_trains_its_epoch_as_the_first(tmp_path):
    """restart_every = 1 with restart_replay: epoch 2 starts from an empty replay, waits for `learning_starts`
    transitions again and warms its LRs up again, so it makes as many updates as epoch 1 and ends holding epoch 2's
    rows alone; the emptied replay's gate survives a resume from the saved trainer state."""
    bars = generate(700, seed=3).bars
    base = dataclasses.replace(tiny_config(), restart_every=1)
    cfg = dataclasses.replace(base, restart_replay=True)
    one = train_run(bars, "synthetic", tmp_path / "e", 1, config=cfg, seed=5)
    rows = cfg.iterations * cfg.env_steps_per_iter
    assert one.replay.count == rows and 0 < one.update_step < cfg.iterations * cfg.updates_per_iter
    two = train_run(bars, "synthetic", tmp_path / "e", 2, config=cfg, seed=5)         # resumes epoch 1, trains 2
    assert two.update_step == 2 * one.update_step                      # epoch 2 waited as epoch 1 did
    assert two.replay.count == rows and two.learn_from == one.env_steps
    assert all(g["age"] == one.update_step for g in two.opt.param_groups)            # ages counted from the restart
    kept = train_run(bars, "synthetic", tmp_path / "k", 2, config=base, seed=5)
    assert kept.replay.count == 2 * rows and kept.update_step - one.update_step == cfg.iterations * cfg.updates_per_iter
    three = train_run(bars, "synthetic", tmp_path / "e", 3, config=cfg, seed=5)       # resumes epoch 2's state
    assert three.update_step == 3 * one.update_step and three.learn_from == two.env_steps


def test_a_rollback_that_asks_for_a_restart_trains_on_from_a_fresh_learner(tmp_path):
    """`roll_back(..., restart=True)` (a bundle's `rollback_restart`): the learner is the fresh one `restart_learner`
    makes, not the rolled-back-to epoch's, and under `restart_replay` the replay is emptied; `train_run` applies it
    from a rollback request as the study's runs get it."""
    from services.trainer.checkpoint import roll_back
    bars = generate(700, seed=3).bars
    cfg = dataclasses.replace(tiny_config(), restart_replay=True)
    st = train_run(bars, "synthetic", tmp_path / "a", 1, config=cfg, seed=5)
    twin = train_run(bars, "synthetic", tmp_path / "b", 1, config=cfg, seed=5)
    kept = train_run(bars, "synthetic", tmp_path / "c", 1, config=tiny_config(), seed=5)   # restart_replay off
    trained = {n: p.detach().clone() for n, p in st.agent.named_parameters()}
    roll_back(st, tmp_path / "a", 1, restart=True)
    restart_learner(twin)
    roll_back(kept, tmp_path / "c", 1, restart=True)
    for n, p in st.agent.named_parameters():
        assert torch.equal(p, dict(twin.agent.named_parameters())[n]), n
    assert any(not torch.equal(p, trained[n]) for n, p in st.agent.named_parameters())
    assert st.replay.count == 0 and st.learn_from == st.env_steps and kept.replay.count > 0
    assert all(float(v.abs().sum()) == 0 for v in _opt_tensors(st))
    calls = []

    def rollback_fn(e: int):
        calls.append(e)
        return (1, "", 0.0, None, True) if e == 2 else None
    two = train_run(bars, "synthetic", tmp_path / "d", 2, config=cfg, seed=5, rollback_fn=rollback_fn)
    rows = cfg.iterations * cfg.env_steps_per_iter
    assert calls == [1, 2] and two.replay.count == rows          # epoch 2 from the emptied replay: its rows alone
    assert two.learn_from == st.env_steps                         # the gate counted from epoch 2's start


def test_an_emptied_replay_holds_nothing_to_sample_until_it_is_written_again():
    from services.trainer.replay import Replay
    rp = Replay(40, 2, 3, 50, (1, 2), "cpu")
    for t in range(6):
        rp.add(torch.full((2,), t), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long),
               torch.ones(2), torch.zeros(2, dtype=torch.bool))
    rp.update_priorities(torch.tensor([0, 3]), torch.tensor([5.0, 2.0]))
    head = rp.head
    assert rp.count == 6 and int(rp.valid_row_count()) == 4 and float(rp.max_priority) > 1
    rp.clear()
    assert (rp.count, rp.head, int(rp.valid_row_count()), float(rp.max_priority)) == (0, head, 0, 1.0)
    assert float(rp.priority.abs().sum()) == 0 and float(rp.weight.abs().sum()) == 0 and not rp.valid_rows().any()
    for t in range(3):
        rp.add(torch.full((2,), 10 + t), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long),
               torch.zeros(2, dtype=torch.long), torch.ones(2), torch.zeros(2, dtype=torch.bool))
    assert rp.count == 3 and int(rp.valid_row_count()) == 1
    assert set(rp.sample(64, generator=torch.Generator().manual_seed(0)).bar.tolist()) == {10}   # the new rows only
