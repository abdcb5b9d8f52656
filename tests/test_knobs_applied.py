"""Each feedback knob (E1–E9) reaches the trainer state it is meant to steer (services/trainer/: state, targets, optim).

Pure library tests on a tiny CPU trainer: `apply_knobs` / `train_epoch` set the knobs, and each test checks the
effect where the design says it lands — bootstrap targets (E1 q_bias, E3 γ), the collection policy (E2 ε, E5
gate, E9 regime confidence: read back from what the rollout wrote into replay), the per-branch learning rates of
the optimizer (E4), replay sampling (E6), the hindsight auxiliary loss (E7) and episode starts (E8). Expected
values are computed here from the formulas (γ^h, ratios of weights), not read back from the code under test.
"""
from __future__ import annotations

import math

import pytest
import torch

import services.trainer.targets as targets_mod
from services.trainer.train import TrainConfig, apply_knobs, build_state, train_epoch
from shared.agent import FLAT, AgentConfig
from shared.knobs import BRANCHES, N_REGIMES, Knobs
from shared.market import chronological_split, compute_features
from shared.synthetic import generate

N_BARS = 900


@pytest.fixture(scope="module")
def data():
    bars = generate(n_bars=N_BARS, seed=3).bars
    return bars, chronological_split(len(bars)), compute_features(bars)


def tiny_cfg(n_features: int, **kw) -> TrainConfig:
    cfg = TrainConfig(agent=AgentConfig(n_features=n_features, window=8, d_model=8, n_heads=2, hidden=16,
                                        n_atoms=11, ensemble=2, iqn_embed=8, iqn_quantiles_act=8),
                      n_envs=8, env_steps_per_iter=4, iterations=8, batch_size=32, replay_capacity=4000,
                      learning_starts=10 ** 9, iqn_quantiles=4, lr_warmup=1, emb_refresh=10 ** 6)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def make_state(data, seed: int = 0, **kw):
    bars, split, feats = data
    return build_state(tiny_cfg(feats.shape[1], **kw), bars, split, seed, features=feats)


def filled(r):
    """(bar, position before, regime, direction) of every transition written to replay."""
    n = r.count
    return r.bar[:n].flatten(), r.portfolio[:n, :, 0].flatten(), r.regime[:n].flatten(), r.action[:n, :, 0].flatten()


# --- E1 q_bias and E3 γ: the bootstrap targets ---------------------------------------------------------------
def test_q_bias_and_gamma_shift_the_bootstrap_targets(data, monkeypatch):
    st = make_state(data)
    train_epoch(st, Knobs(epsilon=1.0))                                     # collection only: fills replay
    batch = st.replay.sample(64, torch.Generator().manual_seed(0))
    seen = []
    real = targets_mod.project_distribution

    def spy(tz, p, z):
        seen.append((tz.detach().clone(), z.detach().clone()))
        return real(tz, p, z)

    monkeypatch.setattr(targets_mod, "project_distribution", spy)
    H, A = len(st.cfg.horizons), st.cfg.agent.n_atoms

    def targets(knobs):
        """(R − q_bias·(1 − disc)) N × H and the discount N × H the update used, from the target atoms
        tz = R + disc·z."""
        apply_knobs(st, knobs)
        seen.clear()
        st.update(batch)
        tz, z = seen[0]                                                     # N × branches × H·A
        tz = tz[:, 0].view(-1, H, A).double()                               # the direction branch
        disc = (tz[..., -1] - tz[..., 0]) / float(z[-1] - z[0])
        return tz[..., 0] - disc * float(z[0]), disc

    r0, d0 = targets(Knobs(gamma=0.9, q_bias=0.0))
    r1, d1 = targets(Knobs(gamma=0.9, q_bias=0.02))
    assert torch.allclose(d1, d0, atol=1e-5)
    # each backup takes q_bias·(1 − disc): the fixed point Q* of T(Q) = R − b·(1 − disc) + disc·Q' is Q*₀ − b
    assert torch.allclose(r1 - r0, -0.02 * (1 - d0), atol=2e-5)
    assert ((d0[:, 0] - d0[:, -1]) > 0.5).all()                              # not a constant: 1 − γ^h by horizon
    q0 = torch.linspace(-0.05, 0.05, r0.shape[0], dtype=torch.float64).unsqueeze(1)   # a Q* for each sample
    fixed0 = r0 + d0 * q0                                                   # the unbiased backup of Q* (scalar)
    assert torch.allclose(r1 + d1 * (q0 - 0.02), fixed0 - 0.02, atol=2e-5)  # shifted Q* backs up to itself − b

    # γ: disc^(h) = γ^h where the episode did not end within h steps (hand formula), 0 where it did
    alive = [(~batch.dones[:, :h]).all(1) for h in st.cfg.horizons]
    for gamma in (0.9, 0.99):
        _, d = targets(Knobs(gamma=gamma))
        for i, h in enumerate(st.cfg.horizons):
            want = torch.where(alive[i], torch.tensor(gamma ** h, dtype=torch.float64), torch.zeros((), dtype=torch.float64))
            assert torch.allclose(d[:, i], want, atol=1e-4), (gamma, h)
    assert (d[:, 2] > 0).any()                                                # the γ^20 check was not vacuous


# --- E2 ε: the collection policy --------------------------------------------------------------------------------
def test_epsilon_is_the_exploration_of_collection(data):
    # the exit branch is never rewritten by the gates, so what replay recorded is the ε-greedy draw itself:
    # P(recorded = greedy) = (1 − ε) + ε / n_exit  (hand formula; ties have probability 0 with float Q)
    for eps in (0.0, 0.5, 1.0):
        st = make_state(data, iterations=16)
        train_epoch(st, Knobs(epsilon=eps))                                  # no updates: the net stays fixed
        assert float(st.controls.epsilon) == eps
        n = st.replay.count
        bar, port, act = st.replay.bar[:n].flatten(), st.replay.portfolio[:n].flatten(0, 1), st.replay.action[:n]
        with torch.no_grad():
            out = st.agent.head(st.agent.encode(st.env.market.windows[bar]), port)
            exit_cols = st.cfg.agent.branch_slices()[2]
            greedy = st.agent.q_values(out.logits[:, :, exit_cols], out.delta[:, exit_cols]).mean(1).argmax(-1)
        match = (act[:, :, 2].flatten() == greedy).float().mean().item()
        n_exit = len(st.cfg.agent.exit_plans)
        assert match == pytest.approx(1 - eps + eps / n_exit, abs=0.001 if eps == 0 else 0.07), eps


# --- E4 per-branch LR scales --------------------------------------------------------------------------------------
def test_lr_scale_sets_the_branch_groups_lr(data):
    st = make_state(data, learning_starts=64)
    scale = {"direction": 1.0, "size": 2.0, "exit": 0.5}
    train_epoch(st, Knobs(lr_scale=scale))
    assert st.update_step > 0
    lr = {g["name"]: float(g["lr"]) for g in st.opt.param_groups}
    branch = {b: [v for n, v in lr.items() if n.split("/")[0] == b] for b in BRANCHES}
    trunk = [v for n, v in lr.items() if n.split("/")[0] == "trunk"]
    assert all(branch[b] for b in BRANCHES) and trunk
    d = branch["direction"][0]
    assert math.isclose(branch["size"][0] / d, 2.0, rel_tol=1e-9)
    assert math.isclose(branch["exit"][0] / d, 0.5, rel_tol=1e-9)
    # the trunk is not a branch: no E4 scale (it differs from direction only by the branch cosine factor ≤ 1)
    assert trunk[0] >= d
    train_epoch(st, Knobs())                                                  # the next epoch's scales replace them
    lr = {g["branch"]: float(g["lr"]) for g in st.opt.param_groups}
    assert math.isclose(lr["size"] / lr["direction"], 1.0, rel_tol=1e-9)


def test_the_rollbacks_lr_decay_scales_every_group(data):
    """`lr_decay` (the rollback's annealing) multiplies every group's learning rate, the trunk's and the risk
    head's too: the same epoch under decay 0.25 ends with each group at a quarter of its LR under decay 1."""
    from services.trainer.optim import group_lr

    st = make_state(data, learning_starts=64)
    train_epoch(st, Knobs(lr_decay=0.25))
    assert st.update_step > 0
    for g in st.opt.param_groups:
        full = group_lr({**g, "age": g["age"] - 1}, st.update_step - 1, Knobs().lr_scale, st.cfg)
        assert math.isclose(float(g["lr"]), 0.25 * full, rel_tol=1e-9), g["name"]


# --- E5 gate and E9 regime confidence: entries blocked during collection ---------------------------------------
def test_gate_threshold_zero_blocks_every_entry(data):
    st = make_state(data)
    train_epoch(st, Knobs(epsilon=1.0, gate_threshold=0.0))
    _, pos, _, d = filled(st.replay)
    assert (pos == 0).all() and (d == FLAT).all()                           # never entered, every step flat
    st2 = make_state(data)                                                    # control: no gate → it trades
    train_epoch(st2, Knobs(epsilon=1.0))
    _, pos2, _, d2 = filled(st2.replay)
    assert (pos2 != 0).any() and (d2 != FLAT).any()


def test_regime_confidence_zero_closes_that_regime_to_entries(data):
    st = make_state(data)
    regimes = st.env.market.regime
    k = int(torch.bincount(regimes[100:], minlength=N_REGIMES).argmax())    # the commonest regime
    conf = [1.0] * N_REGIMES
    conf[k] = 0.0
    train_epoch(st, Knobs(epsilon=1.0, regime_confidence=conf))
    _, pos, reg, d = filled(st.replay)
    flat_in_k = (pos == 0) & (reg == k)
    flat_else = (pos == 0) & (reg != k)
    assert flat_in_k.sum() > 20 and flat_else.sum() > 20
    assert (d[flat_in_k] == FLAT).all()                                      # no entry decided in regime k
    assert (d[flat_else] != FLAT).any()                                      # entries elsewhere
    assert float(st.controls.regime_confidence[k]) == 0.0


# --- E6 replay priorities --------------------------------------------------------------------------------------
def test_priority_boost_raises_sampling_of_those_bars(data):
    st = make_state(data)
    train_epoch(st, Knobs(epsilon=0.5))                                     # fill replay, equal priorities
    bar, _, _, _ = filled(st.replay)
    valid = st.replay.valid_mask()[: st.replay.count].flatten()
    counts = torch.bincount(bar[valid], minlength=len(st.env.market))
    boosted = [int(b) for b in torch.nonzero(counts >= 1).flatten()[:10]]
    apply_knobs(st, Knobs(priority_boost=[(b, 4.0) for b in boosted] + [(10 ** 7, 4.0)]))  # out of range: ignored
    assert len(boosted) == 10 and float(st.replay.bar_boost[boosted].min()) == 4.0
    assert float(st.replay.bar_boost.sum()) == pytest.approx(len(st.env.market) + 3.0 * len(boosted))
    n = 200_000
    s = st.replay.sample(n, torch.Generator().manual_seed(1))
    hit = torch.isin(s.bar, torch.tensor(boosted)).float().mean().item()
    # equal PER priorities: P(boosted) = 4·m / (4·m + (N − m)), m = valid slots at boosted bars (hand formula)
    m = float(counts[boosted].sum())
    N = float(valid.sum())
    want = 4 * m / (4 * m + N - m)
    assert hit == pytest.approx(want, rel=0.05)
    assert want > 2.5 * m / N                                                 # clearly above the unboosted share
    apply_knobs(st, Knobs())                                                  # next epoch without E6: reset
    assert (st.replay.bar_boost == 1).all()


# --- E7 hindsight labels ---------------------------------------------------------------------------------------
def test_hindsight_labels_add_the_auxiliary_loss(data):
    states = [make_state(data, seed=5) for _ in range(3)]
    for st in states:
        train_epoch(st, Knobs(epsilon=1.0))
    T = len(states[0].env.market)
    labels = [(b, b % 3) for b in range(T)] + [(T + 5, 2), (3, 7)]          # out of range / bad label: ignored
    losses = []
    for st, hs in zip(states, ([], labels, [])):
        apply_knobs(st, Knobs(hindsight=hs))
        losses.append(float(st.update(st.replay.sample(64, torch.Generator().manual_seed(2)))["loss"]))
    lab = states[1].buffers.hindsight
    assert int(lab[4]) == 1 and int(lab[3]) == 0 and int((lab >= 0).sum()) == T
    assert losses[0] == losses[2]                                             # deterministic: same state, same loss
    assert losses[1] > losses[0] + 1e-6                                       # + hindsight_coef · CE (> 0)
    apply_knobs(states[1], Knobs())
    assert (states[1].buffers.hindsight == -1).all()                          # labels do not outlive their epoch


# --- E8 episode-start weights ----------------------------------------------------------------------------------
def test_regime_weights_shape_episode_starts(data):
    st = make_state(data)
    reg = st.env.market.regime
    room = torch.zeros_like(reg, dtype=torch.bool)
    room[st.env.warmup:max(st.env.warmup + 1, len(reg) - 64)] = True
    cnt = torch.bincount(reg[room], minlength=N_REGIMES)
    a, b = [int(i) for i in cnt.argsort(descending=True)[:2]]                  # two regimes with room
    w = [0.0] * N_REGIMES
    w[a], w[b] = 3.0, 1.0
    apply_knobs(st, Knobs(regime_weights=w))
    starts = st.env.sample_starts(40_000)
    r = reg[starts]
    assert set(r.unique().tolist()) <= {a, b}                                 # weight 0: never a start
    # P(a) = 3·n_a / (3·n_a + n_b) over the bars with room (hand formula)
    want = 3 * float(cnt[a]) / (3 * float(cnt[a]) + float(cnt[b]))
    assert (r == a).float().mean().item() == pytest.approx(want, abs=0.02)
    # and the epoch's episodes do start there: reset_all at the start of train_epoch
    w1 = [0.0] * N_REGIMES
    w1[b] = 1.0
    st.cfg.iterations = 0
    train_epoch(st, Knobs(regime_weights=w1))
    assert (reg[st.env.sim.t] == b).all()
