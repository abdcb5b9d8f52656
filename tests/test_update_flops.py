"""bench/update_flops.py: the FLOP split by network part adds up to the whole and names the networks' parts."""
import pytest

from bench.train_speed import synthetic_dataset
from bench.update_flops import count_update, part_of
from services.trainer.env import RewardConfig
from services.trainer.train import TrainConfig
from shared.agent import AgentConfig


def test_part_of_picks_the_outermost_module_of_either_network():
    assert part_of({"Global", "online.enc_blocks", "online.enc_blocks.0.mlp"}) == "online.enc_blocks"
    assert part_of({"Global", "target.iqn_out.1"}) == "target.iqn_out"
    assert part_of({"Global"}).startswith("outside modules")


def test_update_flops_split_by_part_and_by_operator_add_up_to_the_total():
    feats = synthetic_dataset(600)[2]
    cfg = TrainConfig(agent=AgentConfig(n_features=feats.shape[1], window=8, d_model=16, n_heads=2, hidden=24,
                                        n_atoms=11, ensemble=2, iqn_embed=8, iqn_quantiles_act=8),
                      reward=RewardConfig(episode_bars=60, grace_bars=10), env_steps_per_iter=2, iterations=4,
                      replay_capacity=2000, learning_starts=40, horizons=(1, 2, 4), iqn_quantiles=4, emb_refresh=5)
    total, by_op, by_part = count_update(cfg, 32, 600)
    assert total > 0
    assert sum(by_op.values()) == pytest.approx(total)
    assert sum(by_part.values()) == pytest.approx(total)
    # the backward pass, the encoder's forward and both networks' IQN heads each count
    assert by_part["backward (all parts)"] > 0 and by_part["online.enc_blocks"] > 0
    assert by_part["online.iqn_out"] > 0 and by_part["target.iqn_out"] > 0
