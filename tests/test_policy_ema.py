"""`TrainConfig.policy_ema`: an epoch's checkpoint holds a moving average of the online weights, while training goes
on from the online weights, which the trainer state keeps for a resume, a rollback or a peer's exploit."""
import dataclasses

import pytest
import torch

from services.trainer.config import TrainConfig
from services.trainer.step import ema_weight
from services.trainer.targets import noise_width
from services.trainer.train import roll_back, train_run
from shared.checkpoints import load_checkpoint
from shared.synthetic import generate
from tests.test_train import tiny_config


def test_the_average_is_the_running_mean_until_its_horizon_then_an_ema():
    """w(t) = max(1/t, 1 − β): with β = 0.75, updates 1…6 weigh 1, ½, ⅓, ¼, ¼, ¼ — after update t ≤ 4 the average
    is the mean of θ_1 … θ_t (the initial weights weigh nothing), after that an EMA of rate ¼."""
    w = [float(ema_weight(torch.tensor([t], dtype=torch.float64), 0.25)) for t in range(1, 7)]
    assert w == pytest.approx([1.0, 0.5, 1 / 3, 0.25, 0.25, 0.25])
    avg = torch.tensor([123.0])                                            # the initial weights
    for t, theta in enumerate([2.0, 4.0, 6.0, 8.0, 10.0], start=1):
        avg.lerp_(torch.tensor([theta]), ema_weight(torch.tensor([t], dtype=torch.float64), 0.25))
        if t == 4:
            assert float(avg) == pytest.approx(5.0)                           # the mean of 2, 4, 6, 8
    assert float(avg) == pytest.approx(5.0 + 0.25 * (10.0 - 5.0))


def test_policy_ema_is_checked_and_left_out_of_the_config_at_its_neutral_value():
    cfg = tiny_config()
    assert "policy_ema" not in cfg.to_dict()                   # stored runs' config hashes still match
    ema = dataclasses.replace(cfg, policy_ema=0.99)
    assert ema.to_dict()["policy_ema"] == 0.99 and ema.hash() != cfg.hash()
    assert TrainConfig.from_dict(ema.to_dict()) == ema and TrainConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (1.0, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="policy_ema must be a number in"):
            dataclasses.replace(cfg, policy_ema=bad)
    assert TrainConfig.preset("full", 16).override(["policy_ema=0.999"]).policy_ema == 0.999


@pytest.mark.parametrize("adamw", ["auto", "flat"])
def test_the_checkpoint_holds_the_average_and_training_goes_on_from_the_online_weights(tmp_path, adamw):
    """Two epochs with policy_ema = 0.9 against the same run without it: the online weights are the same bit for bit
    (the average takes nothing from training); each update moves the average by lerp(θ̄, θ, 0.1); epoch 2's
    checkpoint holds the average, its trainer state the online weights and the average; a rollback to epoch 1
    restores both."""
    bars = generate(700, seed=3).bars
    base = dataclasses.replace(tiny_config(), adamw=adamw)
    plain = train_run(bars, "synthetic", tmp_path / "plain", 2, config=base, seed=5)
    cfg = dataclasses.replace(base, policy_ema=0.9)
    a = train_run(bars, "synthetic", tmp_path / "a", 2, config=cfg, seed=5, pinned_fn=lambda: {1})
    assert plain.ema is None and a.ema is not None
    for (n, p), q in zip(a.agent.named_parameters(), plain.agent.parameters()):
        assert torch.equal(p, q), n
    ema = dict(a.ema.named_parameters())
    assert any(not torch.equal(p, ema[n]) for n, p in a.agent.named_parameters())       # the average trails
    ck = tmp_path / "a" / "checkpoints"
    w2, _ = load_checkpoint(ck / "epoch-0002.safetensors")
    t2, _ = load_checkpoint(ck / "epoch-0002.state.safetensors")
    params = dict(a.agent.named_parameters())
    for k, v in a.agent.state_dict().items():
        assert torch.equal(w2[k], ema[k] if k in params else v), k          # parameters averaged, buffers as they are
        assert torch.equal(t2[f"online.{k}"], v), k
    assert all(torch.equal(t2[f"ema.{n}"], p) for n, p in ema.items())
    # one update: θ̄ ← lerp(θ̄, θ, 1 − 0.9) with the θ it produced (past the first 10 updates' running mean)
    before = {n: p.detach().clone() for n, p in ema.items()}
    B = cfg.batch_size
    a.update(a.replay.sample(B, u=torch.rand(B)), torch.rand(B, noise_width(cfg)))
    assert a.update_step > 10
    for n, p in a.agent.named_parameters():
        assert torch.equal(ema[n], before[n].lerp(p.detach(), torch.tensor(1.0 - 0.9, dtype=torch.float64).float())), n
    # a rollback to epoch 1 restores the online weights and the average of that epoch
    t1, _ = load_checkpoint(ck / "epoch-0001.state.safetensors")
    w1, _ = load_checkpoint(ck / "epoch-0001.safetensors")
    roll_back(a, tmp_path / "a", 1)
    for k, v in a.agent.state_dict().items():
        assert torch.equal(v, t1[f"online.{k}"]), k
    for n, p in ema.items():
        assert torch.equal(p, t1[f"ema.{n}"]) and torch.equal(p, w1[n]), n
