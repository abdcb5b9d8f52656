"""The evaluator's greedy pass as ONE Triton kernel: each program steps a block of accounts over every bar.

`shared.rollout.greedy_pass` in its other modes launches the bar's ~100 small kernels (or replays them from a
CUDA graph) once per bar: ~300 µs a bar for one account even compiled and captured, so a 10^6-bar validation
pass took minutes. Here the whole bar — portfolio vector, the agent's heads, `act`'s greedy choice and protection
stack, `Simulator.step`, `PortfolioTracker.update` — runs inside one persistent kernel: program p owns accounts
[p·BB, (p+1)·BB) and loops over the bars with their state in registers; the activations of the heads go through a
small per-program scratch buffer (L1/L2-resident), the weights stream from L2.

What is precomputed, batched, outside the loop (it does not depend on the portfolio):
  - the market embedding of every bar (`Agent.encode`), and from it the embedding part of the trunk's first
    layer, E1[t] = W1[:, :D] · emb[t] + b1   (T × H, one GEMM);
  - the IQN cosine embeddings φ(τ_i) of the tail quantiles that `act` reads (constants of the agent).

One execution path. The kernel is the same arithmetic as `shared.agent.act`, `shared.rollout.portfolio_features`,
`Simulator.step` and `PortfolioTracker.update`, transcribed line by line (the comments name the source) and pinned
to them by `tests/test_fused_pass.py`: the same decisions and trades, curves to float64 rounding, on the CPU
(Triton's interpreter) and on the GPU. The ledger is written by the simulator's own recorder: the kernel emits per
bar which fills happened (a trade closed at the open, a trade opened, an intrabar or end exit) with their returns
and prices, `ledger_rows` turns them into `_LedgerBuffer` rows, and the end-of-pass close is `Simulator.close_all`
on the kernel's final state. Greedy only (ε = 0): exploration belongs to the trainer.

Numerics: the heads run in float32 with IEEE products (no TF32), the simulator and tracker in float64, like the
eager path; matrix products sum in another order than cuBLAS/oneDNN, so Q values differ from eager in the last
bits and an exact tie between two actions' Q could resolve differently — the tests check every decision.

ML core: imports torch, numpy and Triton (the compiler `torch.compile` itself runs on; imported lazily, so a
machine without it can still use every other accel mode). On a CPU the kernel runs in Triton's interpreter
(`TRITON_INTERPRET=1`, set before the first import of triton): exact but slow — for tests, not for speed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from shared.agent import Agent, PolicyControls
from shared.execution import _END, _FLIP, _SIGNAL, _STOP, _TARGET, CostModel, Simulator, _LedgerBuffer

# bits of the per-bar fill flags the kernel writes
F_OPEN, F_CLOSE1, F_FLIP, F_EXIT2 = 1, 2, 4, 8
F_REASON2_SHIFT = 4  # 0 stop, 1 target, 2 end


def triton_available(device: torch.device | str) -> bool:
    """Whether the fused pass can run on `device`: Triton importable, and either CUDA or the interpreter on."""
    dev = torch.device(device)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # noqa: BLE001 — any import failure means: not available
        return False
    return True



def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass
class FusedWeights:
    """The agent's head weights laid out for the kernel (row-major K_in × N, float32) and its constants."""

    wp: torch.Tensor
    bp: torch.Tensor
    w1e: torch.Tensor
    """D × H: the embedding half of the trunk's first layer (applied batched: E1 = emb · w1e + b1)."""
    b1: torch.Tensor
    w1p: torch.Tensor
    bz: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor
    wh: torch.Tensor
    """H × K·(1 + n_branches)·A: per ensemble member k, the value stream then each branch's advantage streams."""
    bh: torch.Tensor
    z: torch.Tensor
    phi: torch.Tensor
    """M_α × H: φ(τ_i) of the tail quantiles `act` reads."""
    wi1: torch.Tensor
    bi1: torch.Tensor
    wi2: torch.Tensor
    bi2: torch.Tensor
    n_tail: int

    @classmethod
    @torch.no_grad()
    def from_agent(cls, agent: Agent) -> "FusedWeights":
        cfg = agent.cfg
        D, H, K = cfg.d_model, cfg.hidden, cfg.ensemble
        f = lambda x: x.detach().float().contiguous()  # noqa: E731
        lin1, lin2 = agent.trunk[0], agent.trunk[2]
        cols = []
        biases = []
        for k in range(K):
            cols.append(agent.value_w[k])                                  # H × A
            biases.append(agent.value_b[k])
            for w, b in zip(agent.adv_w, agent.adv_b):
                cols.append(w[k])                                          # H × n_b·A
                biases.append(b[k])
        n_tail = cfg.n_tail
        taus = agent.act_taus[:n_tail]
        phi = torch.relu(agent.iqn_tau(torch.cos(math.pi * taus.unsqueeze(-1) * agent.iqn_i)))   # M_α × H
        return cls(wp=f(agent.port[0].weight.t()), bp=f(agent.port[0].bias),
                   w1e=f(lin1.weight[:, :D].t()), b1=f(lin1.bias), w1p=f(lin1.weight[:, D:].t()),
                   bz=torch.zeros(H, device=lin1.bias.device), w2=f(lin2.weight.t()), b2=f(lin2.bias),
                   wh=f(torch.cat(cols, dim=1)), bh=f(torch.cat(biases)), z=f(agent.support), phi=f(phi),
                   wi1=f(agent.iqn_out[0].weight.t()), bi1=f(agent.iqn_out[0].bias),
                   wi2=f(agent.iqn_out[2].weight.t()), bi2=f(agent.iqn_out[2].bias), n_tail=n_tail)


@dataclass
class FusedOutputs:
    """What the kernel writes: `greedy_pass`'s records plus the fills of every bar and the final state."""

    r64: torch.Tensor
    """S × B × 4 float64: target, equity, bar return, position."""
    r32: torch.Tensor
    """S × B × (4 + P) float32: q, q_std, edge, cvar, portfolio vector."""
    rl: torch.Tensor
    """S × B × 4 int32: direction taken, size, exit, blocked."""
    ev64: torch.Tensor
    """S × B × 3 float64: return of the trade closed at the open, of the trade exited intrabar/at the end, and
    that exit's price."""
    flags: torch.Tensor
    """S × B int32: F_OPEN | F_CLOSE1 | F_FLIP | F_EXIT2 | reason2 << F_REASON2_SHIFT."""
    final: torch.Tensor
    """B × 10 float64: t, position, equity, growth, entry price, entry size, entry t, tp, sl, bars in trade."""


TUNING: dict = {}
"""Overrides of `launch_shape` ("block", "tiles"), for benchmarks."""


def launch_shape(n_accounts: int) -> tuple[int, tuple[int, int, int]]:
    """Accounts per program and (BK, BN, num_warps) of the matrix-vector tiles, measured on the H200
    (`bench/fused_tune.py`, small and full presets): the pass is latency-bound (each bar is a chain of dependent
    loads), so below a few hundred accounts one account per program with wide tiles and 8 warps is fastest; from
    256 accounts, 16 accounts per program as tl.dot tiles (fewer programs, each weight load serving 16 rows)."""
    if n_accounts >= 256:
        shape = (16, (32, 128, 4))
    else:
        shape = (1, (128, 128, 8))
    return TUNING.get("block", shape[0]), TUNING.get("tiles", shape[1])


def parse_shape(text: str) -> tuple[int, tuple[int, int, int]]:
    """"BLOCK:BKxBNxWARPS" (the benchmarks' notation of a launch shape) → (block, (BK, BN, num_warps))."""
    blk, _, tiles = text.partition(":")
    bk, bn, warps = (int(x) for x in tiles.split("x"))
    return int(blk), (bk, bn, warps)


def supports(agent: Agent) -> bool:
    """Whether the kernel covers this agent's action space (≤ 4 size levels, ≤ 4 exit plans)."""
    _, ns, ne = agent.cfg.branch_sizes
    return ns <= 4 and ne <= 4 and agent.cfg.n_portfolio == 8


def run_kernel(agent: Agent, market, emb: torch.Tensor, starts: torch.Tensor, length: int,
               controls: PolicyControls, costs: CostModel, *, block: int | None = None,
               tiles: tuple[int, int, int] | None = None) -> FusedOutputs:
    """Launch the fused kernel for B = len(starts) accounts, S = length − 1 decisions each (see the module
    docstring); `emb` T × D market embeddings of every bar of `market`. `block` accounts per program (a power of
    2; from 16 the products run as tl.dot tiles), `tiles` = (BK, BN, num_warps); defaults: `launch_shape`."""
    d_block, d_tiles = launch_shape(len(starts))
    tiles, block = tiles or d_tiles, block or d_block
    from shared import _fused_kernel as fk
    from shared.agent import PORTFOLIO_FEATURES

    cfg = agent.cfg
    if float(controls.epsilon) != 0.0:
        raise ValueError(f"the fused pass is greedy: controls.epsilon must be 0, got {float(controls.epsilon)}")
    dev = emb.device
    B, S, T = len(starts), length - 1, len(market)
    P, D, H, A, K = len(PORTFOLIO_FEATURES), cfg.d_model, cfg.hidden, cfg.n_atoms, cfg.ensemble
    NS, NE = cfg.branch_sizes[1], cfg.branch_sizes[2]
    if not supports(agent):
        raise ValueError("the fused pass supports at most 4 size levels and 4 exit plans")
    w = FusedWeights.from_agent(agent)
    e1 = torch.addmm(w.b1, emb.float(), w.w1e).contiguous()                              # T × H
    BB = block
    DP = D // 2
    NH = K * (1 + 3 + NS + NE) * A
    # scratch columns per account row: x (P) | port hidden (DP) | h1 (H) | h2 (H) | logits (NH) | Q (K·8) |
    # IQN in (H) | IQN hidden (H) | IQN out (M_α·4)
    # IQN in / hidden / out: BB·M_α rows of HS columns each, after those
    widths = dict(O_X=P, O_P1=DP, O_H1=H, O_H2=H, O_LG=NH, O_Q=K * 8)
    offs, o = {}, 0
    for name, wd in widths.items():
        offs[name] = o
        o += (wd + 15) // 16 * 16
    SCR, HS, MTP = o, (H + 15) // 16 * 16, _pow2(max(w.n_tail, 1))
    n_prog = -(-B // BB)
    scratch = torch.zeros(n_prog * (BB * SCR + 2 * BB * MTP * HS), dtype=torch.float32, device=dev)
    out = FusedOutputs(r64=torch.zeros(S, B, 4, dtype=torch.float64, device=dev),
                       r32=torch.zeros(S, B, 4 + P, dtype=torch.float32, device=dev),
                       rl=torch.zeros(S, B, 4, dtype=torch.int32, device=dev),
                       ev64=torch.zeros(S, B, 3, dtype=torch.float64, device=dev),
                       flags=torch.zeros(S, B, dtype=torch.int32, device=dev),
                       final=torch.zeros(B, 10, dtype=torch.float64, device=dev))
    consts = torch.tensor([costs.rate, cfg.kelly_floor, cfg.cvar_limit, cfg.min_hold, cfg.dsr_size_cut,
                           0.05, 0.01, 1e-4, 0.01, 1e-8, 1e-3, 1e-10], dtype=torch.float64, device=dev)
    pr = market.prices
    f64 = lambda x: x.to(torch.float64).contiguous()  # noqa: E731
    fk.greedy_pass_kernel[(n_prog,)](
        f64(pr.open), f64(pr.high), f64(pr.low), f64(pr.close), f64(market.vol), market.regime.contiguous(), e1, T,
        starts.to(torch.int64).contiguous(), B, S,
        w.wp, w.bp, w.w1p, w.bz, w.w2, w.b2, w.wh, w.bh, w.z, w.phi, w.wi1, w.bi1, w.wi2, w.bi2,
        agent.maturity.float().reshape(1), controls.gate_threshold.float().reshape(1),
        controls.regime_confidence.float().contiguous(), f64(agent.act_sizes), f64(agent.act_plans),
        consts, out.r64, out.r32, out.rl, out.ev64, out.flags, out.final, scratch,
        BB=BB, P=P, DP=DP, H=H, HP=_pow2(H), K=K, KP=_pow2(K), A=A, AP=_pow2(A), NS=NS, NE=NE,
        MT=w.n_tail, MTP=MTP, BK=tiles[0], BN=tiles[1], DOT=BB >= 16, SCR=SCR, HS=HS, num_warps=tiles[2],
        **offs)
    return out


def ledger_rows(out: FusedOutputs, starts: torch.Tensor, open_prices: torch.Tensor) -> np.ndarray:
    """The `_LedgerBuffer` rows (account, entry_t, exit_t, side, size, entry_price, exit_price, net_return,
    reason) of every trade closed during the pass, from the kernel's per-bar fills.

    Per account the fills alternate open, close, open, …; within a bar the order is: the close at the open (a
    signal exit or a flip), the open, then the intrabar or end exit. So the trade a close ends is the account's
    last open before it: for a close at the open of step i, the opens of steps < i; for an intrabar exit, those
    of steps ≤ i."""
    flags = out.flags.cpu().numpy()                                            # S × B
    S, B = flags.shape
    if S == 0:
        return np.zeros((0, _LedgerBuffer.FIELDS))
    st = starts.cpu().numpy().astype(np.int64)
    opened = (flags & F_OPEN) != 0
    n_open = np.cumsum(opened, axis=0)                                         # opens up to and including step i
    # open events in (account, step) order, and each account's first event index
    o_acct, o_step = np.nonzero(opened.T)
    first = np.concatenate([[0], np.cumsum(opened.sum(axis=0))])[:-1]        # B
    t1_open = st[o_acct] + o_step + 1
    target = out.r64[..., 0].cpu().numpy()
    o_side = np.sign(target[o_step, o_acct])
    o_size = np.abs(np.clip(target[o_step, o_acct], -1.0, 1.0))
    opens_np = open_prices.cpu().numpy()
    o_price = opens_np[t1_open]
    ev = out.ev64.cpu().numpy()
    rows = []
    for kind in ("close1", "exit2"):
        bit = F_CLOSE1 if kind == "close1" else F_EXIT2
        s_i, b_i = np.nonzero((flags & bit) != 0)
        if not len(s_i):
            continue
        k = n_open[s_i, b_i] - (opened[s_i, b_i] if kind == "close1" else 0) - 1   # the account's trade index
        if (k < 0).any():
            raise RuntimeError("fused pass: a trade closed before any opened (kernel and ledger disagree)")
        j = first[b_i] + k
        t1 = st[b_i] + s_i + 1
        if kind == "close1":
            reason = np.where((flags[s_i, b_i] & F_FLIP) != 0, _FLIP, _SIGNAL)
            exit_px, ret = opens_np[t1], ev[s_i, b_i, 0]
        else:
            code = (flags[s_i, b_i] >> F_REASON2_SHIFT) & 3
            reason = np.choose(code, [_STOP, _TARGET, _END])
            exit_px, ret = ev[s_i, b_i, 2], ev[s_i, b_i, 1]
        rows.append(np.stack([b_i, t1_open[j], t1, o_side[j], o_size[j], o_price[j], exit_px, ret, reason],
                             axis=1).astype(np.float64))
    return np.concatenate(rows) if rows else np.zeros((0, _LedgerBuffer.FIELDS))


def finish_simulator(out: FusedOutputs, market, costs: CostModel, rows: np.ndarray) -> Simulator:
    """A `Simulator` holding the kernel's final state and the pass's ledger rows, on which `close_all` (the end
    of the pass) then runs as in every other mode."""
    B = out.final.shape[0]
    sim = Simulator(market.prices, B, costs, record_ledger=True)
    f = out.final
    sim.t = f[:, 0].long()
    sim.position, sim.equity, sim.growth = f[:, 1].clone(), f[:, 2].clone(), f[:, 3].clone()
    sim.entry_price, sim.entry_size, sim.entry_t = f[:, 4].clone(), f[:, 5].clone(), f[:, 6].long()
    sim.tp_price, sim.sl_price, sim.bars_in_trade = f[:, 7].clone(), f[:, 8].clone(), f[:, 9].long()
    if len(rows):
        sim.ledger_buf.chunks.append(rows)
    return sim
