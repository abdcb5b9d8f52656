"""The training environment ends an account's episode when a liquidation left it no equity (it could trade no more):
a terminal transition, then a soft reset to equity 1 at a new start; the account beside it trades on untouched."""
from types import SimpleNamespace

import torch

from services.trainer.env import RewardConfig, TrainEnv
from services.trainer.replay import Replay
from shared.execution import CostModel
from shared.market import compute_features
from shared.rollout import MarketTensors
from shared.synthetic import generate

P = 7


def test_a_liquidated_account_ends_its_episode_and_is_reset():
    bars = generate(n_bars=300, seed=1).bars
    market = MarketTensors.from_bars(bars, 0, len(bars), 8, "cpu", features=compute_features(bars))
    market.prices.high[30] = 10.0 * market.prices.close[30]          # a wick past any size-1 short's liquidation
    replay = Replay(256, 2, P, len(market), (1, 5, 20), "cpu")
    env = TrainEnv(market, 2, 0, RewardConfig(episode_bars=10 ** 6), replay, CostModel(cost_bps=1.0),
                   torch.Generator().manual_seed(0))
    env.sim.reset(torch.tensor([20, 20]))
    target = torch.tensor([-1.0, 0.5])                                # a short, and a long beside it
    action = SimpleNamespace(branches=torch.tensor([[0, 0, 0], [2, 0, 0]]), edge=torch.zeros(2))
    dones, equity = [], []
    for _ in range(15):
        res = env.sim.step(target)
        rec = SimpleNamespace(t=env.sim.t.clone(), portfolio=torch.zeros(2, P), regime=torch.zeros(2, dtype=torch.long),
                              action=action, result=res)
        trade_return = res.trade_return.clone()
        env.on_step(rec, u_start=torch.full((2,), 0.5))
        dones.append(replay.done[(int(replay.head_t) - 1) % replay.L].tolist())   # the row just written
        equity.append(env.sim.equity.tolist())
        if dones[-1][0]:
            assert trade_return[0].item() <= -1.0 + 1e-12                   # the liquidated trade's reward term
    ends = [i for i, d in enumerate(dones) if d[0]]
    assert ends == [9], dones                                         # the step into bar 30: terminal, once
    assert equity[9][0] == 1.0 and env.sim.t[0] != 30                 # soft-reset at a new start, equity 1
    assert not any(d[1] for d in dones) and all(e[1] > 0 for e in equity)
