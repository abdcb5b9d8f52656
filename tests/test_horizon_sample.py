"""`TrainConfig.horizon_sample`: one bootstrap horizon per sample, drawn from its regime's blend, gives the blended
targets in expectation — checked exactly by drawing each horizon in turn and weighting by the blend."""
import copy

import torch

from bench.train_speed import fill_for_updates, synthetic_dataset
from services.trainer.env import RewardConfig
from services.trainer.train import TrainConfig, build_state, make_targets, noise_width, train_epoch
from shared.agent import AgentConfig
from shared.knobs import Knobs


def tiny(feats, **kw) -> TrainConfig:
    cfg = TrainConfig(agent=AgentConfig(n_features=feats.shape[1], window=8, d_model=16, n_heads=2, hidden=24,
                                        n_atoms=11, ensemble=3, iqn_embed=8, iqn_quantiles_act=8),
                      reward=RewardConfig(episode_bars=60, grace_bars=10), env_steps_per_iter=4, iterations=30,
                      batch_size=32, replay_capacity=2000, learning_starts=40, iqn_quantiles=4, emb_refresh=5)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def test_drawn_horizons_weighted_by_the_blend_give_the_blended_targets():
    bars, split, feats = synthetic_dataset(600)
    st = build_state(tiny(feats), bars, split, 0)
    st.env.reset_all()
    fill_for_updates(st)
    for _ in range(20):
        st.runner.collect()
    b = st.replay.sample(32, torch.Generator().manual_seed(3))
    cfg, K, M, H = st.cfg, st.cfg.agent.ensemble, st.cfg.iqn_quantiles, len(st.cfg.horizons)
    # the update's noise: K mask draws, M online τ, then the target's τ' — the same τ' block at every horizon
    g = torch.Generator().manual_seed(4)
    head, taus_t = torch.rand(32, K + M, generator=g), torch.rand(32, M, generator=g)
    full = make_targets(st.agent, st.target, st.buffers, cfg)(b, torch.cat([head] + [taus_t] * H, dim=1))
    cfg_s = copy.copy(cfg)
    cfg_s.horizon_sample = True
    sample = make_targets(st.agent, st.target, st.buffers, cfg_s)
    w = st.buffers.horizon_blend[b.regime]                                                 # N × H
    edges = torch.cat([torch.zeros(32, 1), w.cumsum(1)], dim=1)                            # N × (H + 1)
    dist = torch.zeros_like(full.dist)
    value = torch.zeros_like(full.value)
    for h in range(H):
        u = (edges[:, h] + edges[:, h + 1]) / 2                                            # inside horizon h's interval
        noise = torch.cat([head, taus_t, u.unsqueeze(1)], dim=1)
        assert noise.shape[1] == noise_width(cfg_s)
        t = sample(b, noise)
        assert t.quantiles.shape == (32, 1, M) and torch.equal(t.blend, torch.ones(32, 1))
        torch.testing.assert_close(t.quantiles[:, 0], full.quantiles[:, h])               # the same τ', the same h
        dist += w[:, h:h + 1, None] * t.dist
        value += w[:, h] * t.value
    torch.testing.assert_close(dist, full.dist, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(value, full.value, rtol=1e-5, atol=1e-6)
    assert (w > 0).all() and (w < 1).all()                                   # every horizon was drawn with weight


def test_an_epoch_trains_with_one_horizon_per_sample():
    bars, split, feats = synthetic_dataset(600)
    st = build_state(tiny(feats, horizon_sample=True), bars, split, 0)
    before = [p.detach().clone() for p in st.agent.parameters()]
    stats = train_epoch(st, Knobs(epsilon=0.3))
    assert stats.updates > 0 and all(torch.isfinite(torch.tensor(v)) for v in (stats.loss, stats.c51, stats.iqn))
    assert any(not torch.equal(p, q) for p, q in zip(st.agent.parameters(), before))
