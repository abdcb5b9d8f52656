"""Can one continuous greedy pass be evaluated in parallel over time? A decision fixed-point (Jacobi) experiment.

    .venv/bin/python -m bench.fixed_point [--checkpoint PATH] [--bars 3000] [--dataset synthetic]

The pass is sequential because each decision reads the portfolio its predecessors left. Parallel-in-time
methods guess every decision at once and iterate: given guessed decisions (greedy direction, size, exit and the
risk block of the chosen direction — all `act` takes from the network), the portfolio path is one cheap scan
(`Simulator.step` + `PortfolioTracker.update`, no network); given that path, the network's decisions at every bar
are one batched pass. A fixed point is exactly the sequential pass (by induction over bars), and every iteration
makes at least the prefix up to the first mismatch final — so it converges in ≤ T iterations; it pays only if
it converges in a handful. This prints, per iteration, the bars whose decisions changed, the first of them, and
how far the taken directions still are from the eager pass (`greedy_pass(accel="eager")`).

Measured (this VM, `bench/learning.py` checkpoint of seed 2, epoch 6, 3 000 synthetic bars): 106 iterations,
313–1 949 bars (median 708) changing per iteration over the first 100 (the portfolio features — unrealized P&L, bars in trade,
Kelly and DSR accumulators — move the argmax at many bars). Not a route to a faster validation pass.
"""
from __future__ import annotations

import argparse
import time

import torch

from shared.agent import FLAT, Agent, AgentConfig, PolicyControls
from shared.execution import CostModel, Simulator
from shared.market import load_dataset
from shared.rollout import MarketTensors, PortfolioTracker, greedy_pass, portfolio_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="agent checkpoint (default: a random small agent)")
    ap.add_argument("--bars", type=int, default=3000)
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--max-iterations", type=int, default=1000)
    a = ap.parse_args()
    bars = load_dataset(a.dataset)
    if a.checkpoint is None:
        from shared.market import compute_features
        torch.manual_seed(0)
        agent = Agent(AgentConfig(n_features=compute_features(bars).shape[1])).eval()
    else:
        from services.evaluator.runner import restore_agent
        agent, _, _ = restore_agent(a.checkpoint, expected_sha256=None)
    cfg, T = agent.cfg, a.bars
    start = len(bars) - T - 10
    market = MarketTensors.from_bars(bars, start, start + T, cfg.window)
    ctl = PolicyControls.make("cpu")
    S = T - 1
    with torch.no_grad():
        emb = torch.cat([agent.encode(market.windows[i:i + 2048]) for i in range(0, T, 2048)])
        ref = greedy_pass(agent, market, emb, torch.zeros(1, dtype=torch.long), T, ctl, accel="eager")
    ref_d = ref.branches[:, 0, 0]
    m = agent.maturity.clamp(1e-3, 1.0)
    n_tail = cfg.n_tail

    def decide(port: torch.Tensor) -> torch.Tensor:
        """`act`'s network half at every bar at once: greedy d, s, e and the risk block of d (S × 4)."""
        out = agent.head(emb[:S], port)
        qs = agent.q_values(out.logits)
        g = torch.stack([q.mean(1).argmax(-1) for q in qs], 1)
        d = g[:, 0]
        qk = qs[0].gather(2, d.view(-1, 1, 1).expand(-1, qs[0].shape[1], 1)).squeeze(2)
        quant = agent.quantiles(out.hidden, agent.act_taus[:n_tail])
        cvar = (quant.sum(1) / max(n_tail, 1)).gather(1, d.view(-1, 1)).squeeze(1)
        risk = (cvar < -cfg.cvar_limit / m) | (qk.std(1, unbiased=False) > ctl.gate_threshold / m)
        return torch.cat([g, risk.long().unsqueeze(1)], 1)

    def scan(dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The portfolio path of guessed decisions (act's protection stack, then the simulator): S × P, S."""
        sim = Simulator(market.prices, 1, CostModel())
        sim.reset(torch.zeros(1, dtype=torch.long))
        tr = PortfolioTracker(1, "cpu")
        ports, taken = torch.zeros(S, cfg.n_portfolio), torch.zeros(S, dtype=torch.long)
        for i in range(S):
            port = portfolio_features(sim, tr, market)
            ports[i] = port[0]
            d, s, e, risk = dec[i].tolist()
            pos = sim.position
            side, size = agent.act_sides[d].to(pos.dtype), agent.act_sizes[s]
            kelly = (cfg.kelly_floor + port[:, 5].double()).clamp(cfg.kelly_floor, 1.0)
            dsr_scale = 1.0 - cfg.dsr_size_cut * m * (-port[:, 7].double()).clamp(0.0, 1.0)
            conf = ctl.regime_confidence[market.regime[sim.t]].double()
            cur = torch.sign(pos)
            blocked = (side != 0) & (side != cur) & (bool(risk) | (conf <= 0))
            committed = (cur != 0) & (side != cur) & (sim.bars_in_trade.float() < cfg.min_hold * m)
            tgt = torch.where((side == cur) & (cur != 0), pos, side * size * kelly * dsr_scale * conf)
            tgt = torch.where(blocked, torch.zeros_like(tgt), tgt)
            tgt = torch.where(committed, pos, tgt)
            taken[i] = FLAT if bool(blocked) else (int(cur) + 1 if bool(committed) else d)
            vol = market.vol[sim.t]
            tr.update(sim.step(tgt, agent.act_plans[e, 0] * vol, agent.act_plans[e, 1] * vol))
        return ports, taken

    print(f"{T} bars, maturity {float(agent.maturity):.3f}, eager pass: {len(ref.ledger)} trades")
    print(f"{'iteration':>9} {'changed bars':>12} {'first':>6} {'taken != eager':>14} {'s':>5}")
    with torch.no_grad():
        prior = torch.zeros(S, cfg.n_portfolio)                  # flat, Kelly 0, win rate 0.5, DSR 0
        dec = decide(prior)
        for it in range(1, a.max_iterations + 1):
            t0 = time.time()
            ports, taken = scan(dec)
            new = decide(ports)
            diff = (new != dec).any(1)
            n = int(diff.sum())
            first = int(diff.nonzero()[0]) if n else -1
            print(f"{it:>9} {n:>12} {first:>6} {int((taken != ref_d).sum()):>14} {time.time() - t0:>5.1f}",
                  flush=True)
            if n == 0:
                break
            dec = new


if __name__ == "__main__":
    main()
