"""`TrainConfig.policy_swa`: from a given epoch on, an epoch's checkpoint holds the mean of the online weights at the
ends of the epochs since, while training goes on from the online weights."""
import dataclasses

import pytest
import torch

from services.trainer.config import TrainConfig
from services.trainer.state import restart_learner
from services.trainer.train import roll_back, train_run
from shared.checkpoints import load_checkpoint
from shared.synthetic import generate
from tests.test_train import tiny_config


def test_policy_swa_is_checked_and_left_out_of_the_config_at_its_neutral_value():
    cfg = tiny_config()
    assert "policy_swa" not in cfg.to_dict()                   # stored runs' config hashes still match
    swa = dataclasses.replace(cfg, policy_swa=2)
    assert swa.to_dict()["policy_swa"] == 2 and swa.hash() != cfg.hash()
    assert TrainConfig.from_dict(swa.to_dict()) == swa
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="policy_swa must be a whole number"):
            dataclasses.replace(cfg, policy_swa=bad)
    with pytest.raises(ValueError, match="policy_swa and policy_ema both set"):
        dataclasses.replace(cfg, policy_swa=1, policy_ema=0.9)
    assert TrainConfig.preset("full", 16).override(["policy_swa=3"]).policy_swa == 3


def test_the_checkpoints_hold_the_mean_of_the_epoch_ends_from_the_first_averaged(tmp_path):
    """Three epochs with policy_swa = 2 against the same run without it: the online weights are the same bit for bit;
    epoch 1's checkpoint holds epoch 1's online weights, epoch 2's epoch 2's (the mean of one end), epoch 3's the mean
    of the ends of epochs 2 and 3; the trainer state keeps the online weights, the mean and its count, and a rollback
    to epoch 2 restores them; a restart of the learner starts the mean again."""
    bars = generate(700, seed=3).bars
    base = tiny_config()
    keep = lambda: {1, 2, 3}                                                   # noqa: E731
    plain = train_run(bars, "synthetic", tmp_path / "plain", 3, config=base, seed=5, pinned_fn=keep)
    cfg = dataclasses.replace(base, policy_swa=2)
    a = train_run(bars, "synthetic", tmp_path / "a", 3, config=cfg, seed=5, pinned_fn=keep)
    for (n, p), q in zip(a.agent.named_parameters(), plain.agent.parameters()):
        assert torch.equal(p, q), n                                           # the mean takes nothing from training
    assert a.swa_count == 2
    ck, pk = tmp_path / "a" / "checkpoints", tmp_path / "plain" / "checkpoints"
    w = {e: load_checkpoint(ck / f"epoch-000{e}.safetensors")[0] for e in (1, 2, 3)}
    online = {e: load_checkpoint(pk / f"epoch-000{e}.safetensors")[0] for e in (1, 2, 3)}
    params = dict(a.agent.named_parameters())
    for k in online[1]:
        assert torch.equal(w[1][k], online[1][k]) and torch.equal(w[2][k], online[2][k]), k
        if k in params:
            torch.testing.assert_close(w[3][k], (online[2][k] + online[3][k]) / 2, rtol=1e-6, atol=1e-7)
            assert not torch.equal(w[3][k], online[3][k]) or torch.equal(online[2][k], online[3][k]), k
        else:
            assert torch.equal(w[3][k], online[3][k]), k                        # buffers are the agent's own
    t3, _ = load_checkpoint(ck / "epoch-0003.state.safetensors")
    assert int(t3["swa.count"]) == 2
    assert all(torch.equal(t3[f"online.{k}"], v) for k, v in online[3].items())
    roll_back(a, tmp_path / "a", 2)
    assert a.swa_count == 1
    assert all(torch.equal(p, online[2][n]) for n, p in a.ema.named_parameters())
    assert all(torch.equal(p, online[2][n]) for n, p in a.agent.named_parameters())
    restart_learner(a)
    assert a.swa_count == 0
