"""The evaluator's greedy pass as one compiled CPU loop: `greedy_pass(accel="native")`.

On a CPU, torch runs the bar's ~100 small ops one at a time (~1 ms a bar compiled, ~4 ms eager on one core of a
small VM), although the head is only ~0.25 M multiply-adds (`small` preset). `_native_pass.c` is the same
transcription as the Triton kernel of `shared.fused` (portfolio vector, `Agent.head`, C51 Q values, the IQN tail,
`act`'s greedy choice and protection stack, `Simulator.step`, `PortfolioTracker.update`) as a plain C loop over
the bars of one account, its weights cache-resident; accounts run side by side on OpenMP threads. It writes the
kernel's outputs (`shared.fused.FusedOutputs`), so the ledger, the end-of-pass close and the records are built by
the very same code as for the fused pass.

Built at first use with the system's C compiler (`$CC`, else `cc`; `-O3 -march=native -ffp-contract=off`) into
`$TL_NATIVE_CACHE` (default `~/.cache/tradeloop`), keyed by the source, the flags and the compiler, and loaded with
ctypes — no Python headers, no torch headers, ~1 s to build. Where no compiler works, `available()` is False and
`greedy_pass(accel="auto")` falls back to the torch modes.

One execution path: `tests/test_native_pass.py` pins the loop to the eager torch pass (same decisions and trades,
curves to float64 rounding). ML core: imports torch, numpy and the standard library.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from shared.agent import Agent, PolicyControls
from shared.execution import CostModel

SOURCE = Path(__file__).with_name("_native_pass.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """The compiled loop cannot be built or loaded here (no C compiler, or it failed: the message says why)."""


class _Pass(ctypes.Structure):
    """Mirror of `Pass` in `_native_pass.c` (same order)."""

    _fields_ = ([(n, ctypes.c_void_p) for n in ("open", "high", "low", "close", "vol", "regime", "emb")]
                + [("T", ctypes.c_int64), ("starts", ctypes.c_void_p), ("B", ctypes.c_int64), ("S", ctypes.c_int64)]
                + [(n, ctypes.c_void_p) for n in ("wp", "bp", "w1e", "w1p", "b1", "w2", "b2", "wh", "bh", "z", "phi",
                                                  "wi1", "bi1", "wi2", "bi2")]
                + [(n, ctypes.c_int64) for n in ("P", "D", "DP", "H", "K", "A", "NS", "NE", "MT")]
                + [("maturity", ctypes.c_float), ("gate", ctypes.c_float)]
                + [(n, ctypes.c_void_p) for n in ("rconf", "sizes", "plans", "c", "r64", "r32", "rl", "ev64",
                                                  "flags", "final_")]
                + [("threads", ctypes.c_int64)])


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


def head_macs(agent: Agent) -> int:
    """Multiply-adds of one bar of the loop: port MLP, trunk, every C51 stream, the IQN tail quantiles."""
    cfg = agent.cfg
    D, H, A, K, P = cfg.d_model, cfg.hidden, cfg.n_atoms, cfg.ensemble, cfg.n_portfolio
    n_tail = cfg.n_tail
    NH = K * (1 + sum(cfg.branch_sizes)) * A
    return P * (D // 2) + (D + D // 2) * H + H * H + H * NH + n_tail * (H * H + 3 * H)


GPU_HOST_MAX_MACS = 400_000
"""Beside a GPU, the compiled loop is the faster pass (a CPU core per account) only for heads up to about this many
multiply-adds a bar; above, the fused Triton kernel is. Measured on the H200 machine (`bench/eval_speed.py`,
10^5 bars, 1 and 3 accounts): `small` preset (175 k) native 1.2–1.5× fused's bars/s; `full` (902 k) fused 1.4–1.5×
native's."""


@torch.no_grad()
def run_native(agent: Agent, market, emb: torch.Tensor, starts: torch.Tensor, length: int,
               controls: PolicyControls, costs: CostModel, *, threads: int | None = None):
    """Run the compiled loop for B = len(starts) accounts, S = length − 1 decisions each, on the CPU (inputs on
    another device are copied to it; the outputs come back on emb's device). Returns `shared.fused.FusedOutputs`.
    `threads`: accounts stepped at once (default: torch's CPU threads)."""
    from shared import fused
    from shared.agent import PORTFOLIO_FEATURES

    cfg = agent.cfg
    if float(controls.epsilon) != 0.0:
        raise ValueError(f"the native pass is greedy: controls.epsilon must be 0, got {float(controls.epsilon)}")
    if not fused.supports(agent):
        raise ValueError("the native pass supports at most 4 size levels and 4 exit plans")
    lib = library()
    dev, cpu = emb.device, torch.device("cpu")
    B, S, T = len(starts), length - 1, len(market)
    P, D, H, A, K = len(PORTFOLIO_FEATURES), cfg.d_model, cfg.hidden, cfg.n_atoms, cfg.ensemble
    NS, NE = cfg.branch_sizes[1], cfg.branch_sizes[2]
    w = fused.FusedWeights.from_agent(agent)
    keep = []                                         # every array handed to C stays referenced until it returns

    def ptr(x: torch.Tensor, dtype: torch.dtype) -> int:
        x = x.detach().to(device=cpu, dtype=dtype).contiguous()
        keep.append(x)
        return x.data_ptr()

    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    out = fused.FusedOutputs(r64=torch.zeros(S, B, 4, dtype=f64), r32=torch.zeros(S, B, 4 + P, dtype=f32),
                             rl=torch.zeros(S, B, 4, dtype=torch.int32), ev64=torch.zeros(S, B, 3, dtype=f64),
                             flags=torch.zeros(S, B, dtype=torch.int32), final=torch.zeros(B, 10, dtype=f64))
    consts = torch.tensor([costs.rate, cfg.kelly_floor, cfg.cvar_limit, cfg.min_hold, cfg.dsr_size_cut,
                           0.05, 0.01, 1e-4, 0.01, 1e-8, 1e-3, 1e-10], dtype=f64)
    pr = market.prices
    p = _Pass(open=ptr(pr.open, f64), high=ptr(pr.high, f64), low=ptr(pr.low, f64), close=ptr(pr.close, f64),
              vol=ptr(market.vol, f64), regime=ptr(market.regime, i64), emb=ptr(emb, f32), T=T,
              starts=ptr(starts, i64), B=B, S=S,
              **{n: ptr(getattr(w, n), f32) for n in ("wp", "bp", "w1e", "w1p", "b1", "w2", "b2", "wh", "bh", "z",
                                                      "phi", "wi1", "bi1", "wi2", "bi2")},
              P=P, D=D, DP=D // 2, H=H, K=K, A=A, NS=NS, NE=NE, MT=w.n_tail,
              maturity=float(agent.maturity), gate=float(controls.gate_threshold),
              rconf=ptr(controls.regime_confidence, f32), sizes=ptr(agent.act_sizes, f64),
              plans=ptr(agent.act_plans, f64), c=ptr(consts, f64),
              r64=out.r64.data_ptr(), r32=out.r32.data_ptr(), rl=out.rl.data_ptr(), ev64=out.ev64.data_ptr(),
              flags=out.flags.data_ptr(), final_=out.final.data_ptr(),
              threads=min(B, threads or torch.get_num_threads()))
    if S > 0 and lib.native_greedy_pass(ctypes.byref(p)) != 0:
        raise MemoryError("native pass: out of memory for the per-thread work arrays")
    if dev.type != "cpu":
        out = fused.FusedOutputs(**{k: getattr(out, k).to(dev) for k in ("r64", "r32", "rl", "ev64", "flags",
                                                                          "final")})
    return out
