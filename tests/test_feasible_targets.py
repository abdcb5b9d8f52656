"""`TrainConfig.feasible_targets`: the double-Q selection at a bootstrap state that holds a young trade (the
commitment `shared.policy.act` applies) takes the held direction, as acting would; `TrainConfig.kl_priority`: the
replay priority is the KL of the direction prediction from its target, the cross-entropy less the target's entropy;
`TrainConfig.cut_episodes`: the windows an epoch's fresh episodes cut are never drawn; `TrainConfig.iqn_kappa`: the
IQN loss's κ, which decides whether the risk head learns quantiles or expectiles."""
import dataclasses

import torch

from services.trainer.losses import greedy_next_reference
from services.trainer.objective import make_objective
from services.trainer.targets import INFEASIBLE_Q, infeasible_directions, mask_directions
from services.trainer.train import make_targets, noise_width
from shared.policy import FLAT, LONG, SHORT
from shared.portfolio import BARS_CAP, BARS_SCALE
from tests.test_iqn_batch import _state


def _portfolio(rows: list[tuple[float, int]], width: int) -> torch.Tensor:
    """Portfolio vectors of (position, bars in trade), the other columns 0."""
    pf = torch.zeros(len(rows), width)
    for i, (pos, bars) in enumerate(rows):
        pf[i, 0], pf[i, 2] = pos, bars / BARS_SCALE
    return pf


def test_only_the_held_direction_is_feasible_inside_the_commitment():
    st = _state()
    agent = st.agent
    agent.maturity.fill_(0.5)                          # commitment: min_hold · 0.5 bars
    hold = agent.cfg.min_hold * 0.5
    young, old = int(hold) - 1, int(hold) + 1
    pf = _portfolio([(0.4, young), (-0.3, young), (0.4, old), (0.0, 0), (-0.3, 0)], st.replay.portfolio.shape[-1])
    pen = infeasible_directions(agent, pf)
    want = torch.zeros(5, 3)
    want[0, [SHORT, FLAT]] = INFEASIBLE_Q                # a young long: only long
    want[1, [FLAT, LONG]] = INFEASIBLE_Q                 # a young short: only short
    want[4, [FLAT, LONG]] = INFEASIBLE_Q                 # a short opened this bar
    torch.testing.assert_close(pen, want)
    # the selection then takes the held side whatever the online Q prefers, and leaves the other branches alone
    g = torch.Generator().manual_seed(0)
    K, NB, A = agent.cfg.ensemble, agent.cfg.n_actions, agent.cfg.n_atoms
    logits = torch.randn(5, K, NB, A, generator=g)
    delta = torch.randn(5, NB + 1, generator=g) * 0.01
    delta[:, :3] = torch.tensor([0.05, 0.10, 0.0])       # the online network prefers flat everywhere
    col, _, _ = greedy_next_reference(logits, mask_directions(delta, pen), logits, delta, agent.support,
                                      agent.cfg.branch_sizes)
    free, _, _ = greedy_next_reference(logits, delta, logits, delta, agent.support, agent.cfg.branch_sizes)
    assert col[:, 0].tolist() == [LONG, SHORT, free[2, 0].item(), free[3, 0].item(), SHORT]
    torch.testing.assert_close(col[:, 1:], free[:, 1:])
    assert mask_directions(delta, None) is delta


def test_the_targets_change_only_where_a_bootstrap_state_holds_a_young_trade():
    st = _state()
    st.agent.maturity.fill_(1.0)
    st.target.maturity.fill_(1.0)
    with torch.no_grad():                                # the online network prefers flat at every state
        st.agent.shift[2].bias[FLAT] += 1.0 / float(st.agent.v_max)
    b = st.replay.sample(64, torch.Generator().manual_seed(3))
    noise = torch.rand(64, noise_width(st.cfg), generator=torch.Generator().manual_seed(4))
    plain = make_targets(st.agent, st.target, st.buffers, st.cfg)(b, noise)
    cfg = dataclasses.replace(st.cfg, feasible_targets=True)
    feasible = make_targets(st.agent, st.target, st.buffers, cfg)(b, noise)
    N, H = b.next_portfolio.shape[:2]
    young = (infeasible_directions(st.agent, b.next_portfolio.reshape(N * H, -1)) > 0).any(1).view(N, H).any(1)
    moved = (feasible.value != plain.value) | (feasible.dist != plain.dist).flatten(1).any(1)
    assert young.any() and moved.any()
    assert not (moved & ~young).any()                    # no sample without a young trade ahead changes


def _objectives(changes: dict) -> tuple:
    """The update's objective on one batch of a tiny state, under its config and under `changes` to it, with the
    batch's targets."""
    st = _state()
    b = st.replay.sample(32, torch.Generator().manual_seed(3))
    noise = torch.rand(32, noise_width(st.cfg), generator=torch.Generator().manual_seed(4))
    tg = make_targets(st.agent, st.target, st.buffers, st.cfg)(b, noise)
    windows = st.env.market.windows
    base = make_objective(st.agent, windows, st.buffers, st.cfg)(b, noise, tg, lambda: None)
    changed = make_objective(st.agent, windows, st.buffers, dataclasses.replace(st.cfg, **changes))(
        b, noise, tg, lambda: None)
    return base, changed, tg


def test_the_kl_priority_is_the_cross_entropy_less_the_targets_entropy():
    base, changed, tg = _objectives({"kl_priority": True})
    ce, kl = base.priority, changed.priority
    m = tg.dist[:, 0]
    entropy = -(m * torch.log(m.clamp(min=1e-6))).sum(-1)
    torch.testing.assert_close(kl, (ce - entropy).clamp(min=0.0), rtol=1e-5, atol=1e-6)
    assert (kl >= 0).all() and kl.mean() < 0.5 * ce.mean()
    # the ranking that sampling reads: the KL's spread relative to its mean is far wider than the cross-entropy's
    assert kl.std() / kl.mean() > 5 * ce.std() / ce.mean()


def test_an_epochs_fresh_episodes_cut_the_windows_that_would_cross_them():
    """`cut_episodes`: at fresh episodes the last max-horizon rows of the ring, whose n-step windows would run on
    into the new episodes, get weight 0 and are never drawn, also once their windows are written; without it they
    stay as they were."""
    from services.trainer.loop import fresh_episodes

    st = _state()
    rp, H = st.replay, st.replay.max_h
    head = rp.head
    last = [(head - 1 - k) % rp.L for k in range(H)]
    before = rp.weight.clone()
    fresh_episodes(st)                                   # off: nothing cut
    assert torch.equal(rp.weight, before)
    st.cfg = dataclasses.replace(st.cfg, cut_episodes=True)
    fresh_episodes(st)
    assert (rp.weight[last] == 0).all() and (rp.priority[last] == 0).all()
    others = [r for r in range(rp.L) if r not in last]
    assert torch.equal(rp.weight[others], before[others])
    for _ in range(H + 2):                               # the cut rows' windows are written now
        st.runner.collect()
    assert rp.valid_rows()[last].all()
    slots = rp.sample(4096, torch.Generator().manual_seed(1)).slot
    assert not torch.isin(slots // rp.E, torch.tensor(last)).any()


def test_the_iqn_loss_learns_quantiles_at_an_atoms_kappa_and_expectiles_at_one():
    """`iqn_kappa`: the minimiser of the quantile Huber loss (units of v_max) over samples of a target is their
    τ-quantile when κ is about an atom, and their τ-expectile at κ = 1, where every error of these samples lies in
    the quadratic zone; the objective reads the setting."""
    from services.trainer.losses import quantile_huber_loss

    y = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 0.3        # targets in v_max units
    grid = torch.linspace(-1.0, 1.0, 2001).double()
    tau = 0.05

    def argmin(kappa: float) -> float:
        rows = []
        for chunk in grid.split(500):
            rows.append(quantile_huber_loss(chunk.view(-1, 1), y.double().expand(chunk.shape[0], -1),
                                            torch.full((chunk.shape[0], 1), tau, dtype=torch.float64), kappa=kappa))
        return float(grid[torch.cat(rows).argmin()])

    u = y.double().view(1, -1) - grid.view(-1, 1)
    expectile = float(grid[((tau - (u < 0).double()).abs() * u * u).mean(1).argmin()])
    quantile = float(torch.quantile(y.double(), tau))
    assert abs(argmin(2.0 / 50) - quantile) < 0.02
    assert abs(argmin(1.0) - expectile) < 0.002 and abs(argmin(1.0) - quantile) > 0.1
    base, changed, _ = _objectives({"iqn_kappa": 0.04})
    one, atom = base.metrics, changed.metrics
    assert torch.equal(one["c51"], atom["c51"]) and not torch.equal(one["iqn"], atom["iqn"])


def test_feasible_targets_refuse_a_commitment_longer_than_the_portfolio_vector_counts():
    """The targets read a trade's age from the portfolio vector, capped at BARS_SCALE · BARS_CAP bars; a longer
    commitment would mask directions that acting allows there, so the config refuses it."""
    import pytest

    from services.trainer.config import TrainConfig
    from shared.agent import AgentConfig

    cap = int(BARS_SCALE * BARS_CAP)
    TrainConfig(agent=AgentConfig(n_features=8, min_hold=cap), feasible_targets=True)
    with pytest.raises(ValueError, match=f"stops at {cap} bars; agent.min_hold {cap + 1} is longer"):
        TrainConfig(agent=AgentConfig(n_features=8, min_hold=cap + 1), feasible_targets=True)
    TrainConfig(agent=AgentConfig(n_features=8, min_hold=cap + 1))                      # off: no such reading
