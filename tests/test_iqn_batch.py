"""`TrainConfig.iqn_batch`: the IQN risk head trains on the first n_q samples of each batch (a random subset), and
the rest of the update is untouched — checked against the same update on those n_q samples alone."""
import dataclasses

import torch

from bench.train_speed import fill_for_updates, synthetic_dataset
from services.trainer.train import build_state, make_targets, noise_width, train_epoch
from shared.knobs import Knobs
from tests.test_horizon_sample import tiny


def _state(**kw):
    bars, split, feats = synthetic_dataset(600)
    # lr 0 and τ 0: an update leaves both networks as they were, so updates on one state can be compared
    st = build_state(tiny(feats, lr=0.0, tau=0.0, **kw), bars, split, 0)
    st.env.reset_all()
    fill_for_updates(st)
    for _ in range(20):
        st.runner.collect()
    return st


def _rows(b, n: int):
    return dataclasses.replace(b, **{f.name: getattr(b, f.name)[:n] for f in dataclasses.fields(b)})


def test_the_targets_of_the_first_samples_are_the_whole_batchs_first_rows():
    st = _state()
    b = st.replay.sample(32, torch.Generator().manual_seed(3))
    noise = torch.rand(32, noise_width(st.cfg), generator=torch.Generator().manual_seed(4))
    full = make_targets(st.agent, st.target, st.buffers, st.cfg)(b, noise)
    part = make_targets(st.agent, st.target, st.buffers, dataclasses.replace(st.cfg, iqn_batch=8))(b, noise)
    assert part.quantiles.shape == (8,) + full.quantiles.shape[1:]
    torch.testing.assert_close(part.quantiles, full.quantiles[:8])
    for f in ("dist", "value", "blend"):                                 # the other targets cover the whole batch
        torch.testing.assert_close(getattr(part, f), getattr(full, f))


def test_the_iqn_loss_reads_the_first_samples_and_the_c51_loss_all_of_them():
    st = _state()
    b = st.replay.sample(32, torch.Generator().manual_seed(3))
    noise = torch.rand(32, noise_width(st.cfg), generator=torch.Generator().manual_seed(4))
    whole = {k: v.item() for k, v in st.update(b, noise).items()}
    first = {k: v.item() for k, v in st.update(_rows(b, 8), noise[:8]).items()}
    st.cfg.iqn_batch = 8                                                 # the update reads its config when called
    part = {k: v.item() for k, v in st.update(b, noise).items()}
    assert abs(part["iqn"] - first["iqn"]) < 1e-5 * abs(first["iqn"]) + 1e-7
    assert abs(part["iqn"] - whole["iqn"]) > 1e-4 * abs(whole["iqn"])     # a different subset, another mean
    for k in ("c51", "expectile", "q_mean"):
        assert abs(part[k] - whole[k]) < 1e-5 * abs(whole[k]) + 1e-7, k


def test_an_epoch_trains_the_risk_head_on_a_sub_batch():
    bars, split, feats = synthetic_dataset(600)
    st = build_state(tiny(feats, iqn_batch=8), bars, split, 0)
    before = {n: p.detach().clone() for n, p in st.agent.named_parameters()}
    stats = train_epoch(st, Knobs(epsilon=0.3))
    assert stats.updates > 0 and all(torch.isfinite(torch.tensor(v)) for v in (stats.loss, stats.c51, stats.iqn))
    assert not torch.equal(st.agent.iqn_out[0].weight, before["iqn_out.0.weight"])
