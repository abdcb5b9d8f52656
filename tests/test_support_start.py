"""`TrainConfig.support_at_start`: the run's first learning iteration collects only and sets the reward support to
its target (weight 1) before the first update; off, the first epoch learns on `agent.v_max_init`."""
import dataclasses

import pytest
import torch

from services.trainer import loop
from services.trainer.config import TrainConfig
from services.trainer.state import adapt_support
from services.trainer.train import train_run
from shared.synthetic import generate
from tests.test_train import tiny_config


def test_the_field_is_checked_and_left_out_of_the_config_when_off():
    cfg = tiny_config()
    assert "support_at_start" not in cfg.to_dict()               # stored runs' config hashes still match
    on = dataclasses.replace(cfg, support_at_start=True)
    assert on.to_dict()["support_at_start"] is True and on.hash() != cfg.hash()
    assert TrainConfig.from_dict(on.to_dict()) == on
    with pytest.raises(ValueError, match="support_at_start must be true or false"):
        dataclasses.replace(cfg, support_at_start=1)
    assert TrainConfig.preset("full", 16).override(["support_at_start=true"]).support_at_start is True


def test_the_support_is_set_once_before_the_first_update(tmp_path, monkeypatch):
    bars = generate(700, seed=3).bars
    calls = []

    def spy(state, weight=0.5, **kw):
        calls.append((weight, state.update_step, state.replay.count))
        adapt_support(state, weight, **kw)
        calls[-1] += (float(state.agent.v_max),)
    monkeypatch.setattr(loop, "adapt_support", spy)
    off = train_run(bars, "synthetic", tmp_path / "off", 1, config=tiny_config(), seed=5)
    init = tiny_config().agent.v_max_init
    assert float(off.agent.v_max) == pytest.approx(init) and [c[0] for c in calls] == [0.5]   # too few rows: kept
    calls.clear()
    cfg = dataclasses.replace(tiny_config(), support_at_start=True)
    on = train_run(bars, "synthetic", tmp_path / "on", 1, config=cfg, seed=5)
    assert [c[:2] for c in calls] == [(0.5, 0), (1.0, 0)]       # the epoch's start, then the first learning iteration
    v = calls[1][3]
    assert v != pytest.approx(init) and float(on.agent.v_max) == v == float(on.target.v_max)
    assert off.update_step - on.update_step == cfg.updates_per_iter    # that iteration collected only


def test_weight_one_sets_the_support_to_its_target():
    class Replay:
        count = 12
        reward = torch.tensor([[0.01, -0.002]] * 12)              # L × E: constant rewards per account
    class State:
        replay, cfg = Replay(), dataclasses.replace(tiny_config(), support_quantile=1.0, support_margin=2.0)
        generator = torch.Generator().manual_seed(0)
    State.agent = State.target = type("N", (), {})()
    State.agent.v_max = torch.tensor(0.05)
    adapt_support(State, weight=1.0, min_rows=5)                   # |4-step sums| ≤ 0.04, × margin 2
    assert float(State.agent.v_max) == pytest.approx(0.08)
