"""The sequential part of the evaluator's greedy pass as one compiled CPU loop: `greedy_pass(accel="native")`.

Everything the policy reads of the network that does not depend on the portfolio is computed for every bar of a
split at once, batched (`Agent.view_table` → a `MarketView`: ensemble-mean Q of every action, the ensemble std of each
direction's Q, the IQN quantiles of the CVaR tail, the market code). What is left per bar cannot be batched, since it reads the portfolio the previous
bars made: the portfolio vector, the portfolio shift δ (`Agent.delta`, ~2 k multiply-adds), `act`'s greedy
choice and protection stack, `Simulator.step`, `PortfolioTracker.update`. Torch runs that as ~100 small ops a bar
(~2 ms a bar eager on a core of a 2-core AMD EPYC VM); `_native_pass.c` runs it as one plain C loop over the bars
of an account, reading the view's rows, its state in locals (~0.5 µs a bar there, `small` and `full` presets
alike); accounts run side by side on OpenMP threads. Every size
(ensemble, size levels, exit plans, tail quantiles, code and shift widths) is an argument of the loop: any
`AgentConfig` runs. The view may live on a GPU: it is copied to the host once, and the outputs go back to its
device.

The loop writes per bar the records of `greedy_pass` and which fills happened (`PassOutputs`); `ledger_rows`
turns those into the simulator recorder's own rows and `finish_simulator` hands the final state to a `Simulator`,
whose `close_all` ends the pass as in every other mode.

Built at first use with the system's C compiler (`$CC`, else `cc`; `-O3 -march=native -ffp-contract=off`) into
`$TL_NATIVE_CACHE` (default `~/.cache/tradeloop`), keyed by the source, the flags, the compiler and the CPU, and
loaded with ctypes — no Python headers, no torch headers, ~1 s to build. Where no compiler works, `available()` is
False and `greedy_pass(accel="auto")` falls back to the torch modes.

One execution path: `tests/test_native_pass.py` pins the loop to the eager torch pass (same decisions and trades,
curves to float64 rounding), with a portfolio shift that changes decisions. ML core: imports torch, numpy and the
standard library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.agent import PORTFOLIO_FEATURES, Agent, MarketView, PolicyControls
from shared.execution import _END, _FLIP, _SIGNAL, _STOP, _TARGET, CostModel, Simulator, _LedgerBuffer

SOURCE = Path(__file__).with_name("_native_pass.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

# bits of the per-bar fill flags the loop writes
F_OPEN, F_CLOSE1, F_FLIP, F_EXIT2 = 1, 2, 4, 8
F_REASON2_SHIFT = 4  # 0 stop, 1 target, 2 end


class NativeUnavailable(RuntimeError):
    """The compiled loop cannot be built or loaded here (no C compiler, or it failed: the message says why)."""


class _Pass(ctypes.Structure):
    """Mirror of `Pass` in `_native_pass.c` (same order)."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("open", "high", "low", "close", "vol", "regime", "q", "q_std",
                                                 "tail", "code")]
                + [("T", ctypes.c_int64), ("starts", ctypes.c_void_p), ("B", ctypes.c_int64), ("S", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("w1", "w1t", "b1", "w2", "w2t", "b2")]
                + [("v_max", ctypes.c_float)]
                + [(n, ctypes.c_int64) for n in ("P", "C", "S1", "NS", "NE", "MT")]
                + [("maturity", ctypes.c_float), ("gate", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("rconf", "sizes", "plans", "c", "r64", "r32", "rl", "ev64",
                                                  "flags", "final_")]
                + [("threads", ctypes.c_int64)])


@dataclass
class PassOutputs:
    """What the loop writes: `greedy_pass`'s records plus the fills of every bar and the final state."""

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
    """B × 12 float64: t, position, equity, units, cash, entry equity, entry price, entry size, entry t, tp, sl,
    bars in trade."""

    def to(self, device) -> "PassOutputs":
        return PassOutputs(**{k: getattr(self, k).to(device) for k in ("r64", "r32", "rl", "ev64", "flags",
                                                                        "final")})


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The compiled loop (built once per source × flags × compiler × CPU; later processes load the cached file)."""
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"no C compiler ({cc}): {exc}") from None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()).hexdigest()
    cache = Path(os.environ.get("TL_NATIVE_CACHE", Path.home() / ".cache" / "tradeloop"))
    so = cache / f"native-pass-{key[:16]}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                               timeout=300)
            if r.returncode != 0:
                raise NativeUnavailable(f"{cc} failed on {SOURCE.name}: {r.stderr.strip()[-2000:]}")
            os.replace(tmp, so)                         # atomic: a concurrent build of the same key is harmless
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        lib = ctypes.CDLL(str(so))
    except OSError as exc:
        raise NativeUnavailable(f"cannot load {so}: {exc}") from None
    lib.native_greedy_pass.argtypes = [ctypes.POINTER(_Pass)]
    lib.native_greedy_pass.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the compiled loop builds and loads here (probed once per process)."""
    try:
        library()
    except NativeUnavailable:
        return False
    return True


@torch.no_grad()
def run_native(agent: Agent, market, view: MarketView, starts: torch.Tensor, length: int,
               controls: PolicyControls, costs: CostModel, *, threads: int | None = None,
               to_device: bool = True) -> PassOutputs:
    """Run the compiled loop for B = len(starts) accounts, S = length − 1 decisions each, on the host CPU.

    view: the `MarketView` of every bar of `market` (`Agent.view_table`), on any device: its fields are
    copied to the host once (float32, contiguous); the other inputs likewise. The outputs come back on the view's
    device (unless `to_device=False`: they stay on the host). `threads`: accounts stepped at once (default: torch's CPU
    threads). Greedy only (ε = 0)."""
    cfg = agent.cfg
    if float(controls.epsilon) != 0.0:
        raise ValueError(f"the native pass is greedy: controls.epsilon must be 0, got {float(controls.epsilon)}")
    P = len(PORTFOLIO_FEATURES)
    if P != 8 or cfg.n_portfolio != P:
        raise ValueError(f"the native loop builds the 8-feature portfolio vector, the agent reads {cfg.n_portfolio}")
    lib = library()
    dev, cpu = view.q.device, torch.device("cpu")
    B, S, T = len(starts), max(length - 1, 0), len(market)
    NB, C, MT = cfg.n_actions, cfg.code_dim, cfg.n_tail
    NS, NE = cfg.branch_sizes[1], cfg.branch_sizes[2]
    lin1, lin2 = agent.shift[0], agent.shift[2]
    S1 = lin1.out_features
    want = {"q": (T, NB), "q_std": (T, 3), "tail": (T, MT, 3), "code": (T, C)}
    for name, shape in want.items():
        if tuple(getattr(view, name).shape) != shape:
            raise ValueError(f"view.{name} is {tuple(getattr(view, name).shape)}, expected {shape} "
                             f"(Agent.view_table of every bar of the market)")
    if lin1.in_features != C + P or lin2.in_features != S1 or lin2.out_features != NB + 1:
        raise ValueError("agent.shift does not map [code, portfolio] → NB + 1 through one hidden layer")
    keep = []                                         # every array handed to C stays referenced until it returns

    def ptr(x: torch.Tensor, dtype: torch.dtype) -> int:
        x = x.detach().to(device=cpu, dtype=dtype).contiguous()
        keep.append(x)
        return x.data_ptr()

    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    # the loop writes every element (a row per step and account, the final state of every account)
    out = PassOutputs(r64=torch.empty(S, B, 4, dtype=f64), r32=torch.empty(S, B, 4 + P, dtype=f32),
                      rl=torch.empty(S, B, 4, dtype=torch.int32), ev64=torch.empty(S, B, 3, dtype=f64),
                      flags=torch.empty(S, B, dtype=torch.int32), final=torch.empty(B, 12, dtype=f64))
    consts = torch.tensor([costs.rate, cfg.kelly_floor, cfg.cvar_limit, cfg.min_hold, cfg.dsr_size_cut,
                           0.05, 0.01, 1e-4, 0.01, 1e-8, 1e-3, 1e-10, costs.fee, costs.borrow_rate], dtype=f64)
    pr = market.prices
    p = _Pass(open=ptr(pr.open, f64), high=ptr(pr.high, f64), low=ptr(pr.low, f64), close=ptr(pr.close, f64),
              vol=ptr(market.vol, f64), regime=ptr(market.regime, i64),
              q=ptr(view.q, f32), q_std=ptr(view.q_std, f32), tail=ptr(view.tail, f32), code=ptr(view.code, f32),
              T=T,
              starts=ptr(starts, i64), B=B, S=S,
              w1=ptr(lin1.weight, f32), w1t=ptr(lin1.weight.t(), f32), b1=ptr(lin1.bias, f32),
              w2=ptr(lin2.weight, f32), w2t=ptr(lin2.weight.t(), f32), b2=ptr(lin2.bias, f32),
              v_max=float(agent.v_max),
              P=P, C=C, S1=S1, NS=NS, NE=NE, MT=MT,
              maturity=float(agent.maturity), gate=float(controls.gate_threshold),
              rconf=ptr(controls.regime_confidence, f32), sizes=ptr(agent.act_sizes, f64),
              plans=ptr(agent.act_plans, f64), c=ptr(consts, f64),
              r64=out.r64.data_ptr(), r32=out.r32.data_ptr(), rl=out.rl.data_ptr(), ev64=out.ev64.data_ptr(),
              flags=out.flags.data_ptr(), final_=out.final.data_ptr(),
              threads=max(1, min(B, threads or torch.get_num_threads())))
    if B > 0 and lib.native_greedy_pass(ctypes.byref(p)) != 0:
        raise MemoryError("native pass: out of memory for the per-thread work arrays")
    return out.to(dev) if dev.type != "cpu" and to_device else out


def ledger_rows(out: PassOutputs, starts: torch.Tensor, open_prices: torch.Tensor) -> np.ndarray:
    """The `_LedgerBuffer` rows (account, entry_t, exit_t, side, size, entry_price, exit_price, net_return,
    reason) of every trade closed during the pass, from the loop's per-bar fills.

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
            raise RuntimeError("native pass: a trade closed before any opened (loop and ledger disagree)")
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


def finish_simulator(out: PassOutputs, market, costs: CostModel, rows: np.ndarray) -> Simulator:
    """A `Simulator` holding the loop's final state and the pass's ledger rows, on which `close_all` (the end of
    the pass) then runs as in every other mode."""
    B = out.final.shape[0]
    sim = Simulator(market.prices, B, costs, record_ledger=True)
    f = out.final.to(market.prices.open.device)
    sim.t = f[:, 0].long()
    sim.position, sim.equity, sim.units = f[:, 1].clone(), f[:, 2].clone(), f[:, 3].clone()
    sim.cash, sim.entry_equity = f[:, 4].clone(), f[:, 5].clone()
    sim.entry_price, sim.entry_size, sim.entry_t = f[:, 6].clone(), f[:, 7].clone(), f[:, 8].long()
    sim.tp_price, sim.sl_price, sim.bars_in_trade = f[:, 9].clone(), f[:, 10].clone(), f[:, 11].long()
    if len(rows):
        sim.ledger_buf.chunks.append(rows)
    return sim
