"""The sequential part of the evaluator's greedy pass as one compiled CPU loop: `greedy_pass(accel="native")`.

Everything the policy reads of the network that does not depend on the portfolio is computed for every bar of a
split at once, batched (`Agent.view_table` → a `MarketView`: ensemble-mean Q of every action, the ensemble std of
each direction's Q, the IQN quantiles of the CVaR tail, the market code). What is left per bar cannot be batched,
since it reads the portfolio the previous bars made: the portfolio vector, the portfolio shift δ (`Agent.delta`,
~2 k multiply-adds), `act`'s greedy choice and protection stack, `Simulator.step`, `PortfolioTracker.update`. Torch runs that as ~100 small ops a bar
(~2 ms a bar eager on a core of a 2-core AMD EPYC VM); `_native_pass.c` runs it as one plain C loop over the bars
of an account, reading the view's rows, its state in locals (~0.5 µs a bar there, `small` and `full` presets
alike); accounts run side by side on OpenMP threads. Every size
(ensemble, size levels, exit plans, tail quantiles, code and shift widths) is an argument of the loop: any
`AgentConfig` runs. The view may live on a GPU: it is copied to the host once, and the outputs go back to its
device.

The loop writes per bar the records of `greedy_pass` and which fills happened (`PassOutputs`); `ledger_rows`
turns those into the simulator recorder's own rows and `finish_simulator` hands the final state to a `Simulator`,
whose `close_all` ends the pass as in every other mode.

Its constants are not written in C: `header()` generates `tradeloop_native.h` from the Python definitions — the
portfolio vector's scales and the tracker's rates and priors (`shared.portfolio`), the direction sides and the
maturity floor (`shared.policy`), the position limit and exit-reason codes (`shared.execution`), the flag bits and
output layouts below — and the `Pass` struct and its ctypes mirror are both generated from `PASS_FIELDS`; the
protection stack's settings and the costs arrive in `Pass` at run time. At load the library reports its struct's
sizeof and offsets, checked against ctypes (`_check_layout`).

Built at first use with the system's C compiler (`$CC`, else `cc`; `-O3 -march=native -ffp-contract=off`) into
`$TL_NATIVE_CACHE` (default `~/.cache/tradeloop`), keyed by the source, the generated header, the flags, the
compiler and the CPU, and loaded with ctypes — no Python headers, no torch headers, ~1 s to build. Where no compiler
works, `available()` is False and `greedy_pass(accel="auto")` falls back to the torch modes.

The torch code is the reference: `tests/test_native_pass.py` pins the loop to the eager torch pass (same decisions
and trades, curves to float64 rounding), with a portfolio shift that changes decisions, in every CI run (under
CI a missing compiler fails it). ML core: imports torch, numpy and the standard library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.agent import PORTFOLIO_FEATURES, Agent, MarketView, PolicyControls
from shared.execution import (_FLIP, _SIGNAL, EXIT_REASONS, MAX_POSITION, CostModel, Simulator,
                              _LedgerBuffer)

SOURCE = Path(__file__).with_name("_native_pass.c")
HEADER_NAME = "tradeloop_native.h"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")

# bits of the per-bar fill flags the loop writes; the exit reason of the intrabar or end exit (its code in
# `shared.execution.EXIT_REASONS`) sits above them
FLAG_BITS = {"OPEN": 1, "CLOSE1": 2, "FLIP": 4, "EXIT2": 8}
F_OPEN, F_CLOSE1, F_FLIP, F_EXIT2 = (FLAG_BITS[k] for k in ("OPEN", "CLOSE1", "FLIP", "EXIT2"))
F_REASON2_SHIFT, F_REASON2_MASK = 4, 7
assert len(EXIT_REASONS) <= F_REASON2_MASK + 1 and max(FLAG_BITS.values()) < 1 << F_REASON2_SHIFT

# the columns of the loop's outputs (`PassOutputs`), by name
R64_FIELDS = ("target", "equity", "bar_return", "position")
R32_FIELDS = ("q", "q_std", "edge", "cvar")                     # then the portfolio vector
RL_FIELDS = ("direction", "size", "exit", "blocked")
EV_FIELDS = ("ret_open", "ret_exit", "exit_price")
FINAL_FIELDS = ("t", "position", "equity", "units", "cash", "entry_equity", "entry_price", "entry_size", "entry_t",
                "tp_price", "sl_price", "bars_in_trade")
"""The final state of every account: `Simulator` attributes (`finish_simulator` sets them by these names)."""

# `Pass`, the loop's one argument: C type of every field, in order. The C struct and its ctypes mirror are both
# generated from this table; the loaded library reports its own layout and `library()` checks it against ctypes.
PASS_FIELDS = (
    *((n, "const double *") for n in ("open", "high", "low", "close", "vol")),     # market, T bars
    ("regime", "const int64_t *"),
    *((n, "const float *") for n in ("q", "q_std", "tail", "code")),               # the market view of every bar
    ("T", "int64_t"), ("starts", "const int64_t *"), ("B", "int64_t"), ("S", "int64_t"),
    # weight sets (checkpoints of one AgentConfig): NK of them, account b reads set sets[b]; every per-set array
    # (the view's fields above, the shift's weights, v_max, maturity, gate, rconf) holds the NK sets one after the
    # other
    ("NK", "int64_t"), ("sets", "const int64_t *"),
    # the portfolio shift MLP (Agent.shift): each layer's weight as torch holds it (N × K_in) and transposed
    *((n, "const float *") for n in ("w1", "w1t", "b1", "w2", "w2t", "b2")),
    ("v_max", "const float *"),
    *((n, "int64_t") for n in ("P", "C", "S1", "NS", "NE", "MT")),
    # policy: the agent's state, the controls (NR regimes' confidences per set), the action tables, the protection
    # stack's settings
    ("maturity", "const float *"), ("gate", "const float *"), ("NR", "int64_t"),
    ("rconf", "const float *"), ("sizes", "const double *"), ("plans", "const double *"),
    *((n, "double") for n in ("kelly_floor", "cvar_limit", "min_hold", "dsr_size_cut")),
    # costs (`CostModel.rate`, `.fee`, `.borrow_rate`)
    *((n, "double") for n in ("rate", "fee", "borrow")),
    # outputs (`PassOutputs`)
    ("r64", "double *"), ("r32", "float *"), ("rl", "int32_t *"), ("ev64", "double *"), ("flags", "int32_t *"),
    ("final_", "double *"),
    ("threads", "int64_t"),
)
_CTYPES = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


class NativeUnavailable(RuntimeError):
    """The compiled loop cannot be built or loaded here (no C compiler, or it failed: the message says why)."""


class _Pass(ctypes.Structure):
    """`Pass` of `_native_pass.c`, from `PASS_FIELDS` (pointers as void pointers)."""

    _fields_ = [(n, ctypes.c_void_p if "*" in t else _CTYPES[t]) for n, t in PASS_FIELDS]


def _c_float(x: float) -> str:
    """A C double literal that reads back as x exactly (hexadecimal)."""
    if not math.isfinite(x):
        raise ValueError(f"the native header takes finite constants, got {x!r}")
    return x.hex()


def header() -> str:
    """The C header the loop is compiled with: every constant of the fill rules, the portfolio vector, the tracker
    and the policy, taken from their Python definitions (`shared.execution`, `shared.portfolio`, `shared.policy`);
    the layouts of the outputs; the `Pass` struct."""
    from shared import policy, portfolio

    out = ["/* Generated by shared/native.py from the Python definitions at build time: not a source file. */",
           "#include <stdint.h>", ""]
    define = lambda name, value: out.append(f"#define TL_{name} {value}")  # noqa: E731
    for name, v in {**portfolio.native_constants(), **policy.native_constants(),
                    "MAX_POSITION": MAX_POSITION}.items():
        out.append(f"#define TL_{name} ({_c_float(v)})  /* {v!r} */")
    define("ND", len(policy.DIRECTION_SIDES))
    out.append("static const double TL_DIRECTION_SIDES[TL_ND] = {"
               + ", ".join(_c_float(float(x)) for x in policy.DIRECTION_SIDES) + "};")
    for name in ("SHORT", "FLAT", "LONG"):
        define(name, getattr(policy, name))
    for prefix, names in (("PF", portfolio.PORTFOLIO_FEATURES), ("R64", R64_FIELDS), ("R32", R32_FIELDS),
                          ("RL", RL_FIELDS), ("EV", EV_FIELDS), ("FINAL", FINAL_FIELDS), ("REASON", EXIT_REASONS)):
        for i, name in enumerate(names):
            define(f"{prefix}_{name.upper()}", i)
        define(f"N_{prefix}", len(names))
    for name, bit in FLAG_BITS.items():
        define(f"F_{name}", bit)
    define("F_REASON2_SHIFT", F_REASON2_SHIFT)
    out += ["", "typedef struct {"] + [f"    {t}{'' if t.endswith('*') else ' '}{n};" for n, t in PASS_FIELDS]
    out += ["} Pass;", "", "#define TL_PASS_FIELDS " + " ".join(f"X({n})" for n, _ in PASS_FIELDS), ""]
    return "\n".join(out)


def _check_layout(lib: ctypes.CDLL) -> None:
    """The library's `Pass` (sizeof, then every field's offset, as its compiler laid it out) against `_Pass`."""
    n = len(PASS_FIELDS) + 1
    got = (ctypes.c_int64 * n)()
    lib.native_pass_layout.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
    lib.native_pass_layout.restype = ctypes.c_int64
    m = lib.native_pass_layout(got, n)
    want = [ctypes.sizeof(_Pass)] + [getattr(_Pass, name).offset for name, _ in PASS_FIELDS]
    if m != n or list(got) != want:
        raise NativeUnavailable(f"the compiled Pass struct ({m - 1} fields, sizeof and offsets {list(got)[:m]}) "
                                f"does not match its ctypes mirror ({want})")


@dataclass
class PassOutputs:
    """What the loop writes: `greedy_pass`'s records plus the fills of every bar and the final state."""

    r64: torch.Tensor
    """S × B × 4 float64 (`R64_FIELDS`): target, equity, bar return, position."""
    r32: torch.Tensor
    """S × B × (4 + P) float32 (`R32_FIELDS`, then the portfolio vector): q, q_std, edge, cvar."""
    rl: torch.Tensor
    """S × B × 4 int32 (`RL_FIELDS`): direction taken, size, exit, blocked."""
    ev64: torch.Tensor
    """S × B × 3 float64 (`EV_FIELDS`): return of the trade closed at the open, of the trade exited intrabar/at the
    end, and that exit's price."""
    flags: torch.Tensor
    """S × B int32: F_OPEN | F_CLOSE1 | F_FLIP | F_EXIT2 | (EXIT_REASONS code of the exit2) << F_REASON2_SHIFT."""
    final: torch.Tensor
    """B × 12 float64 (`FINAL_FIELDS`): t, position, equity, units, cash, entry equity, entry price, entry size,
    entry t, tp, sl, bars in trade."""

    def to(self, device) -> "PassOutputs":
        return PassOutputs(**{k: getattr(self, k).to(device) for k in ("r64", "r32", "rl", "ev64", "flags",
                                                                        "final")})

    def accounts(self, lo: int, hi: int) -> "PassOutputs":
        """The outputs of accounts lo..hi − 1 alone (as a pass of only those accounts would have written them)."""
        return PassOutputs(**{k: getattr(self, k)[:, lo:hi].contiguous() for k in ("r64", "r32", "rl", "ev64",
                                                                                   "flags")},
                           final=self.final[lo:hi].contiguous())


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
    """The compiled loop (built once per source × generated header × flags × compiler × CPU; later processes load
    the cached file), its `Pass` layout checked against `_Pass`."""
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise NativeUnavailable(f"no C compiler ({cc}): {exc}") from None
    src, hdr = SOURCE.read_bytes(), header().encode()
    key = hashlib.sha256(src + hdr + " ".join(FLAGS).encode() + version.encode() + _cpu_flags().encode()).hexdigest()
    cache = Path(os.environ.get("TL_NATIVE_CACHE", Path.home() / ".cache" / "tradeloop"))
    so = cache / f"native-pass-{key[:16]}.so"
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        try:
            with tempfile.TemporaryDirectory(dir=cache) as inc:
                Path(inc, HEADER_NAME).write_bytes(hdr)
                r = subprocess.run([cc, *FLAGS, "-I", inc, "-o", tmp, str(SOURCE), "-lm"], capture_output=True,
                                   text=True, timeout=300)
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
    _check_layout(lib)
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
    threads). Greedy only (ε = 0). One weight set: `run_native_sets` with K = 1."""
    return run_native_sets([agent], market, [view], starts, torch.zeros(len(starts), dtype=torch.long), length,
                           [controls], costs, threads=threads, to_device=to_device)


def check_same_config(agents) -> None:
    """ValueError unless every agent has the first one's `AgentConfig` (what one batched pass of several
    checkpoints needs: the same shapes, action tables and protection settings)."""
    if not agents:
        raise ValueError("no agent given: a batched pass needs at least one")
    cfg = agents[0].cfg
    for i, a in enumerate(agents[1:], 1):
        if a.cfg != cfg:
            diff = sorted(k for k, v in vars(cfg).items() if getattr(a.cfg, k) != v)
            raise ValueError(f"agent {i} has another AgentConfig than agent 0 (differs in {', '.join(diff)}): "
                             "checkpoints evaluated in one batched pass must share one architecture")


@torch.no_grad()
def run_native_sets(agents, market, views, starts: torch.Tensor, sets: torch.Tensor, length: int, controls,
                    costs: CostModel, *, threads: int | None = None, to_device: bool = True) -> PassOutputs:
    """The compiled loop over B = len(starts) accounts of K weight sets: account b steps from local bar starts[b]
    with agent `agents[sets[b]]` — its market view `views[sets[b]]` (every bar of `market`), its portfolio shift,
    v_max and maturity, and its `controls[sets[b]]` (gate threshold, regime confidence). The agents must share one
    `AgentConfig` (ValueError otherwise, `check_same_config`). Each account's outputs are those of a pass of its
    agent alone: the accounts do not interact. Otherwise as `run_native`."""
    check_same_config(agents)
    K = len(agents)
    if len(views) != K or len(controls) != K:
        raise ValueError(f"{K} agents need {K} views and {K} controls, got {len(views)} and {len(controls)}")
    agent = agents[0]
    cfg = agent.cfg
    for c in controls:
        if float(c.epsilon) != 0.0:
            raise ValueError(f"the native pass is greedy: controls.epsilon must be 0, got {float(c.epsilon)}")
    P = len(PORTFOLIO_FEATURES)
    if cfg.n_portfolio != P:
        raise ValueError(f"the native loop builds the {P}-feature portfolio vector, the agent reads {cfg.n_portfolio}")
    lib = library()
    dev, cpu = views[0].q.device, torch.device("cpu")
    B, S, T = len(starts), max(length - 1, 0), len(market)
    NB, C, MT = cfg.n_actions, cfg.code_dim, cfg.n_tail
    NS, NE = cfg.branch_sizes[1], cfg.branch_sizes[2]
    lin1, lin2 = agent.shift[0], agent.shift[2]
    S1 = lin1.out_features
    want = {"q": (T, NB), "q_std": (T, 3), "tail": (T, MT, 3), "code": (T, C)}
    for k, view in enumerate(views):
        for name, shape in want.items():
            if tuple(getattr(view, name).shape) != shape:
                raise ValueError(f"view {k}: .{name} is {tuple(getattr(view, name).shape)}, expected {shape} "
                                 f"(Agent.view_table of every bar of the market)")
    if lin1.in_features != C + P or lin2.in_features != S1 or lin2.out_features != NB + 1:
        raise ValueError("agent.shift does not map [code, portfolio] → NB + 1 through one hidden layer")
    sets = sets.detach().to(device=cpu, dtype=torch.int64)
    if sets.shape != (B,) or (B and (int(sets.min()) < 0 or int(sets.max()) >= K)):
        raise ValueError(f"sets must hold one weight set in [0, {K}) per account ({B}), got {sets.tolist()[:8]}")
    NR = controls[0].regime_confidence.numel()
    if any(c.regime_confidence.numel() != NR for c in controls):
        raise ValueError("every controls' regime_confidence must have as many regimes")
    keep = []                                         # every array handed to C stays referenced until it returns

    def ptr(x: torch.Tensor, dtype: torch.dtype) -> int:
        x = x.detach().to(device=cpu, dtype=dtype).contiguous()
        keep.append(x)
        return x.data_ptr()

    def per_set(get, dtype: torch.dtype) -> int:
        """The K sets' tensors `get(k)`, one after the other (a lone set as it is)."""
        xs = [get(k).detach().to(device=cpu, dtype=dtype).reshape(-1) for k in range(K)]
        return ptr(xs[0] if K == 1 else torch.cat(xs), dtype)

    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    # the loop writes every element (a row per step and account, the final state of every account)
    out = PassOutputs(r64=torch.empty(S, B, len(R64_FIELDS), dtype=f64),
                      r32=torch.empty(S, B, len(R32_FIELDS) + P, dtype=f32),
                      rl=torch.empty(S, B, len(RL_FIELDS), dtype=torch.int32),
                      ev64=torch.empty(S, B, len(EV_FIELDS), dtype=f64), flags=torch.empty(S, B, dtype=torch.int32),
                      final=torch.empty(B, len(FINAL_FIELDS), dtype=f64))
    pr = market.prices
    view_of = lambda name: per_set(lambda k: getattr(views[k], name), f32)  # noqa: E731
    layer = lambda i, name: per_set(lambda k: getattr(agents[k].shift[i], name), f32)  # noqa: E731
    p = _Pass(open=ptr(pr.open, f64), high=ptr(pr.high, f64), low=ptr(pr.low, f64), close=ptr(pr.close, f64),
              vol=ptr(market.vol, f64), regime=ptr(market.regime, i64),
              q=view_of("q"), q_std=view_of("q_std"), tail=view_of("tail"), code=view_of("code"),
              T=T,
              starts=ptr(starts, i64), B=B, S=S, NK=K, sets=ptr(sets, i64),
              w1=layer(0, "weight"), w1t=per_set(lambda k: agents[k].shift[0].weight.t(), f32), b1=layer(0, "bias"),
              w2=layer(2, "weight"), w2t=per_set(lambda k: agents[k].shift[2].weight.t(), f32), b2=layer(2, "bias"),
              v_max=per_set(lambda k: agents[k].v_max, f32),
              P=P, C=C, S1=S1, NS=NS, NE=NE, MT=MT,
              maturity=per_set(lambda k: agents[k].maturity, f32),
              gate=per_set(lambda k: controls[k].gate_threshold, f32), NR=NR,
              rconf=per_set(lambda k: controls[k].regime_confidence, f32), sizes=ptr(agent.act_sizes, f64),
              plans=ptr(agent.act_plans, f64), kelly_floor=cfg.kelly_floor, cvar_limit=cfg.cvar_limit,
              min_hold=cfg.min_hold, dsr_size_cut=cfg.dsr_size_cut,
              rate=costs.rate, fee=float(costs.fee), borrow=costs.borrow_rate,
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
    target = out.r64[..., R64_FIELDS.index("target")].cpu().numpy()
    o_side = np.sign(target[o_step, o_acct])
    o_size = np.abs(np.clip(target[o_step, o_acct], -MAX_POSITION, MAX_POSITION))
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
            exit_px, ret = opens_np[t1], ev[s_i, b_i, EV_FIELDS.index("ret_open")]
        else:
            reason = (flags[s_i, b_i] >> F_REASON2_SHIFT) & F_REASON2_MASK     # its EXIT_REASONS code
            exit_px, ret = ev[s_i, b_i, EV_FIELDS.index("exit_price")], ev[s_i, b_i, EV_FIELDS.index("ret_exit")]
        rows.append(np.stack([b_i, t1_open[j], t1, o_side[j], o_size[j], o_price[j], exit_px, ret, reason],
                             axis=1).astype(np.float64))
    return np.concatenate(rows) if rows else np.zeros((0, _LedgerBuffer.FIELDS))


def finish_simulator(out: PassOutputs, market, costs: CostModel, rows: np.ndarray) -> Simulator:
    """A `Simulator` holding the loop's final state and the pass's ledger rows, on which `close_all` (the end of
    the pass) then runs as in every other mode."""
    B = out.final.shape[0]
    sim = Simulator(market.prices, B, costs, record_ledger=True)
    f = out.final.to(market.prices.open.device)
    for i, name in enumerate(FINAL_FIELDS):                    # the integer state (t, entry_t, bars) as long
        like = getattr(sim, name)
        setattr(sim, name, f[:, i].to(like.dtype) if like.dtype == torch.long else f[:, i].clone())
    if len(rows):
        sim.ledger_buf.chunks.append(rows)
    return sim
