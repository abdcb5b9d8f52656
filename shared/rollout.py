"""THE one rollout loop: steps `shared.agent`'s policy through `shared.execution.Simulator`.

The trainer calls `run_rollout` with exploration on and an `on_step` callback (rewards, replay writes, episode
resets: `services/trainer/env.py`); the evaluator calls `greedy_pass` (continuous greedy passes of B accounts,
exploration and callbacks off, with the same `policy_step` as its loop body; capturable in CUDA graphs), through
`evaluate_policy` (one account over a whole range: the ledger, per-bar curves and, per decision bar, the
predicted Q / IQN quantiles / ensemble disagreement of the chosen action) or `services.evaluator.runner`.
`greedy_pass_many` runs K checkpoints of one architecture over the same windows: their K·W accounts in one native
pass, each account reading its own checkpoint's view and weights (the torch modes: one `greedy_pass` per checkpoint).

Conventions
-----------
- `MarketTensors` holds one bar range [start, stop) of a dataset on a device, in *local* bar indices 0..T−1
  (the simulator's `t`). Features, volatility and regimes are computed on the whole series (they are causal)
  and then sliced, so the first window of a split sees the bars just before it.
- The decision at local bar t reads the feature window ending at t and the portfolio at close t.
- The portfolio vector and its accumulators (`PortfolioTracker`) live in `shared/portfolio.py`.

ML core: imports only torch, numpy and pandas.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
import torch

from shared.agent import Action, Agent, MarketView, PolicyControls, act
from shared.execution import CostModel, Prices, Simulator, StepResult, _LedgerBuffer
from shared.market import Bars, compute_features, regime_labels, volatility
from shared.portfolio import PortfolioTracker, portfolio_features


@dataclass
class MarketTensors:
    """One bar range of a dataset on a device, in local indices (see module docstring)."""

    prices: Prices
    windows: torch.Tensor
    """T × W × F view: windows[t] is the feature window ending at local bar t (float32)."""
    vol: torch.Tensor
    """T: causal per-bar volatility (float64)."""
    regime: torch.Tensor
    """T: causal regime label (long)."""
    start: int
    """Global index of local bar 0."""

    @classmethod
    def from_bars(cls, bars: Bars, start: int, stop: int, window: int, device="cpu",
                  features: np.ndarray | None = None) -> "MarketTensors":
        """Slice [start, stop) of `bars`, with the W−1 feature rows before `start` (zeros before bar 0)."""
        feats = compute_features(bars) if features is None else features                    # T_all × F
        lo = start - window + 1
        pad = max(0, -lo)
        f = feats[max(lo, 0):stop]
        if pad:
            f = np.concatenate([np.zeros((pad, feats.shape[1]), dtype=np.float32), f])
        ft = torch.as_tensor(f, dtype=torch.float32, device=device)                          # (T + W − 1) × F
        windows = ft.unfold(0, window, 1).transpose(1, 2)                                    # T × W × F
        return cls(prices=Prices.from_bars(bars.slice(start, stop), device=device), windows=windows,
                   vol=torch.tensor(volatility(bars)[start:stop], dtype=torch.float64, device=device),
                   regime=torch.tensor(regime_labels(bars)[start:stop], dtype=torch.long, device=device),
                   start=start)

    def __len__(self) -> int:
        return len(self.prices)


@dataclass
class StepRecord:
    """One decision of B accounts and what the simulator did with it (what `on_step` receives)."""

    t: torch.Tensor
    """Local bar of the decision, B."""
    portfolio: torch.Tensor
    """Portfolio vector at the decision, B × P."""
    regime: torch.Tensor
    """Regime label at the decision, B."""
    action: Action
    result: StepResult


def policy_step(agent: Agent, sim: Simulator, tracker: PortfolioTracker, market: MarketTensors,
                controls: PolicyControls, *, emb: torch.Tensor | None = None, view: MarketView | None = None,
                force_flat: torch.Tensor | None = None, generator: torch.Generator | None = None,
                noise: torch.Tensor | None = None) -> StepRecord:
    """The loop body: observe (market view + portfolio) → `act` → `Simulator.step` → tracker update.

    The B accounts' market view (`Agent.view`) may be given precomputed (`view`, evaluation: every bar at once), or
    their embeddings (`emb`, B × D: the trainer's cached ones); else the windows are encoded here. `force_flat`
    (B bool) sets the target to 0 (episode ends, end of data)."""
    t = sim.t.clone()
    if view is None:
        view = agent.view(agent.encode(market.windows[t]) if emb is None else emb)
    port = portfolio_features(sim, tracker, market)
    regime = market.regime[t]
    a = act(agent, view, port, position=sim.position, bars_in_trade=sim.bars_in_trade, vol=market.vol[t],
            regime=regime, controls=controls, generator=generator, noise=noise)
    if force_flat is not None:
        a.target = torch.where(force_flat, torch.zeros_like(a.target), a.target)
        a.branches[:, 0] = torch.where(force_flat & (a.target == 0), torch.ones_like(a.branches[:, 0]),
                                       a.branches[:, 0])
    res = sim.step(a.target, a.take_profit, a.stop_loss)
    tracker.update(res)
    return StepRecord(t=t, portfolio=port, regime=regime, action=a, result=res)


@torch.no_grad()
def run_rollout(agent: Agent, sim: Simulator, tracker: PortfolioTracker, market: MarketTensors,
                controls: PolicyControls, n_steps: int, *, on_step: Callable[[StepRecord], None] | None = None,
                force_flat: Callable[[], torch.Tensor] | None = None, emb_table: torch.Tensor | None = None,
                generator: torch.Generator | None = None) -> None:
    """Step all accounts `n_steps` times; after each step `on_step(record)` (trainer: rewards, replay, resets).

    `emb_table` (T × D, optional): precomputed market embeddings of every bar, read instead of encoding."""
    for _ in range(n_steps):
        rec = policy_step(agent, sim, tracker, market, controls,
                          emb=None if emb_table is None else emb_table[sim.t],
                          force_flat=None if force_flat is None else force_flat(), generator=generator)
        if on_step is not None:
            on_step(rec)


@contextlib.contextmanager
def tf32_matmuls(device):
    """On CUDA, float32 matmuls on TF32 tensor cores inside the block (as the trainer runs them, `TrainConfig.tf32`),
    the previous setting restored after: the batched encoder and heads of an evaluation. No effect on a CPU."""
    if torch.device(device).type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@torch.no_grad()
def market_view(agent: Agent, windows: torch.Tensor, chunk: int | None = None,
                bf16_encoder: bool = False) -> tuple[torch.Tensor, MarketView]:
    """The batched part of a pass: every bar's embedding (T × D) and `MarketView`, in chunks of `chunk` windows
    (default 4 096 on a CPU, 8 192 on CUDA — at `full` on an H100 2 % slower than 32 768 and a quarter of its 10
    GiB peak, which decides how many study runs fit a GPU: `bench.encode_memory`; TF32 matmuls on CUDA).
    `bf16_encoder` (CUDA): the encoder under bf16 autocast, as the trainer's `bf16` runs it; the heads stay
    float32/TF32."""
    cuda = windows.device.type == "cuda"
    if chunk is None:
        chunk = 8192 if cuda else 4096
    with tf32_matmuls(windows.device):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and bf16_encoder):
            emb = torch.cat([agent.encode(windows[i:i + chunk]).float()
                             for i in range(0, windows.shape[0], chunk)])
        return emb, agent.view_table(emb, chunk=4 * chunk)


@dataclass
class PolicyRun:
    """A greedy pass of the agent over one bar range (one account)."""

    ledger: pd.DataFrame
    """Closed trades (`shared.execution.LEDGER_COLUMNS`), bar indices local to the range."""
    equity: np.ndarray
    """T: equity at each close."""
    bar_returns: np.ndarray
    """T: equity return over each bar (0 at bar 0)."""
    positions: np.ndarray
    """T: position held at each close."""
    decisions: pd.DataFrame
    """Per decision bar t (0..T−2): t, direction, size, exit, target, q, q_std, edge, cvar, blocked, regime."""
    quantiles: np.ndarray
    """(T−1) × M: IQN quantiles of the chosen direction at each decision (τ grid `agent.act_taus`)."""
    start: int
    """Global index of local bar 0."""


@torch.no_grad()
def evaluate_policy(agent: Agent, market: MarketTensors, controls: PolicyControls | None = None, *,
                    costs: CostModel = CostModel(), chunk: int | None = None, accel: str = "auto") -> PolicyRun:
    """One continuous greedy pass over the whole range: encode every bar and compute its market view at once, then
    `greedy_pass` (the portfolio shift, the policy and the simulator bar by bar; `accel` as there), then the full quantile grid of every decision, batched.

    Open positions are closed at the last bar's close (exit_reason "end")."""
    agent.eval()
    dev = market.windows.device
    if controls is None:
        controls = PolicyControls.make(dev)
    T = len(market)
    emb, view = market_view(agent, market.windows, chunk)                                    # T × D, T rows
    p = greedy_pass(agent, market, view, torch.zeros(1, dtype=torch.long, device=dev), T, controls, costs,
                    accel=accel)
    col = lambda x: x[:, 0].cpu().numpy()  # noqa: E731  account 0 of an S × 1 record
    decisions = pd.DataFrame({
        "t": np.arange(T - 1), "direction": col(p.branches[..., 0]), "size": col(p.branches[..., 1]),
        "exit": col(p.branches[..., 2]), "target": col(p.targets), "q": col(p.q), "q_std": col(p.q_std),
        "edge": col(p.edge), "cvar": col(p.cvar), "blocked": col(p.blocked),
        "regime": market.regime[:T - 1].cpu().numpy(),
    })
    _, quant = chosen_outputs(agent, emb, torch.arange(T - 1, device=dev), p.portfolio[:, 0], p.branches[:, 0, 0],
                              agent.act_taus)
    return PolicyRun(ledger=p.ledger, equity=col(p.equity), bar_returns=col(p.bar_returns),
                     positions=col(p.positions), decisions=decisions, quantiles=quant.cpu().numpy(),
                     start=market.start)


# ---------------------------------------------------------------------------------------------------------
# The evaluation pass: greedy, bar by bar, eager or compiled or captured in CUDA graphs
# ---------------------------------------------------------------------------------------------------------
@dataclass
class GreedyPass:
    """B accounts' continuous greedy passes of L bars each (`greedy_pass`): S = L − 1 decisions per account.

    Device tensors, rows = steps, columns = accounts: row i of an S-row record is the decision at the close of
    local bar starts[b] + i; row t of an L-row curve is the close of bar starts[b] + t."""

    ledger: pd.DataFrame
    """Closed trades of every account (`shared.execution.LEDGER_COLUMNS`), bar indices local to the market."""
    equity: torch.Tensor
    """L × B equity at each close (1 at the first; the last after the end close)."""
    bar_returns: torch.Tensor
    """L × B equity return over each bar (0 at the first)."""
    positions: torch.Tensor
    """L × B position held at each close (0 at the last: closed there)."""
    targets: torch.Tensor
    """S × B target position decided (`Action.target`), float64."""
    branches: torch.Tensor
    """S × B × 3 actions taken (direction after the protection stack, size, exit), long."""
    q: torch.Tensor
    """S × B `Action.q` (float32; likewise q_std, edge, cvar)."""
    q_std: torch.Tensor
    edge: torch.Tensor
    cvar: torch.Tensor
    blocked: torch.Tensor
    """S × B `Action.blocked`, bool."""
    portfolio: torch.Tensor
    """S × B × P portfolio vector at each decision (what post hoc predictions re-read), float32."""
    engine: str = ""
    """The path that ran the sequential part (`ENGINES`): "native-c", "torch-eager", "torch-compile", "torch-graph"
    or "torch-compile+graph"."""
    agents_in_pass: int = 1
    """Checkpoints whose accounts ran in this same sequential pass: K where `greedy_pass_many` batched K of them in
    one native loop, 1 for a pass of one agent's own."""


class _ChunkLedger(_LedgerBuffer):
    """The simulator's own ledger recorder (the same rows, the same frame), minus the flush it schedules inside
    `Simulator.step`: that flush reads the row count on the host, a sync a CUDA graph cannot capture. Sized for
    `flush_every` steps; `greedy_pass` flushes it after each chunk of at most that many steps, outside any graph."""

    def tick(self) -> None:
        """No flush here: the pass flushes between chunks (see the class docstring)."""


def _greedy_bar(agent: Agent, sim: Simulator, tracker: PortfolioTracker, market: MarketTensors,
                controls: PolicyControls, view: MarketView,
                noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One bar of every account (`policy_step` on the precomputed market view of every bar) as the three rows that
    `greedy_pass` records: float64 B × 4 (target, equity, bar return, position), float32 B × (4 + P) (q, q_std, edge,
    cvar, portfolio) and long B × 4 (direction, size, exit, blocked). Device ops only: compilable and capturable."""
    rec = policy_step(agent, sim, tracker, market, controls, view=view.rows(sim.t), noise=noise)
    a, r = rec.action, rec.result
    return (torch.stack([a.target, sim.equity, r.bar_return, r.position], dim=1),
            torch.cat([torch.stack([a.q, a.q_std, a.edge, a.cvar], dim=1), rec.portfolio], dim=1),
            torch.cat([a.branches, a.blocked.long().unsqueeze(1)], dim=1))


ENGINES = {"native": "native-c", "eager": "torch-eager", "compile": "torch-compile", "graph": "torch-graph",
           "compile+graph": "torch-compile+graph"}
"""`greedy_pass`'s modes → the engine name a pass and a report carry (`GreedyPass.engine`, `SplitReport.engine`)."""

AUTO_COMPILE_STEPS = 20_000
"""Steps from which `greedy_pass(accel="auto")` compiles the bar where the native loop is unavailable: compiling costs
~20–30 s, so only a pass this long gains more than the compilation costs."""


@functools.lru_cache(maxsize=None)
def compile_works(device: torch.device) -> bool:
    """Whether `torch.compile` can build and run a kernel on `device` here (a CPU build needs a C++ compiler):
    probed once per process with a one-line function."""
    try:
        return bool(torch.compile(lambda x: x * 2.0 + 1.0)(torch.ones(4, device=device)).sum() == 12.0)
    except Exception:  # noqa: BLE001 — any failure of the toolchain means: do not compile
        return False


@torch.no_grad()
def greedy_pass(agent: Agent, market: MarketTensors, view: MarketView, starts: torch.Tensor, length: int,
                controls: PolicyControls, costs: CostModel = CostModel(), *, accel: str = "auto",
                chunk: int = 64) -> GreedyPass:
    """B = len(starts) accounts of one `Simulator`, each flat with equity 1 at local bar starts[b], stepped greedily
    for S = length − 1 bars; what is still open at each account's last bar is then closed at its close
    (`Simulator.close_all`, exit_reason "end"). view: the `MarketView` of every bar of `market` (`Agent.view_table`
    of the encoder's embeddings: all the network work that does not read the portfolio, done batched).

    One step = `_greedy_bar` (`policy_step`: portfolio vector → `act` (portfolio shift, choice, protection) →
    `Simulator.step` → tracker update) plus three `index_copy_` writes at a device step counter into preallocated
    S × B records. Nothing in it syncs with the host or copies from it, so the same code runs
      eager          — step by step from Python (CPU, or CUDA when asked);
      compile        — `_greedy_bar` through `torch.compile` (not fullgraph: a piece dynamo cannot trace runs eagerly
                       between the compiled parts, which a CUDA graph captures all the same);
      graph          — CUDA: `chunk` steps recorded in one CUDA graph and replayed (one launch per chunk instead of
                       ~100 per bar). The first chunk runs eagerly on a side stream as the capture's warm-up (real
                       steps); the simulator's and tracker's state is pinned (`shared.graphs.StaticState`) so each
                       replay continues where the last one stopped; the tail of S mod `chunk` steps runs eagerly.
                       Fewer than two full chunks: all eager;
      compile+graph  — both: the compiled bar captured in the graph;
      native         — the whole sequential part as one compiled C loop on the host CPU (`shared.native`), an OpenMP
                       thread per account, reading the view's rows (copied to the host once): the portfolio shift is
                       ~2 k multiply-adds a bar, so the loop runs ~1 µs a bar (bench/README.md, eval_speed).
    "auto" = native wherever a C compiler works (CPU or CUDA: the view is computed on the device, the loop runs on the
    host); otherwise a pass of at least `AUTO_COMPILE_STEPS` steps is compiled (compile+graph on CUDA, compile on a
    CPU where `torch.compile` works), a shorter one runs graph on CUDA, eager on a CPU.
    The ledger is recorded by the simulator's own recorder with its flush moved out of the step (`_ChunkLedger`):
    one host read after each chunk, between replays.
    The pass is greedy: `act` is handed zero uniforms, so `controls.epsilon` must be 0 (ValueError otherwise).
    The result names the mode that actually ran (`GreedyPass.engine`, `ENGINES`): what a report says produced it.
    """
    from shared.graphs import StaticState, capture, resolve_accel

    dev = view.q.device
    if float(controls.epsilon) != 0.0:
        raise ValueError(f"greedy_pass is greedy: controls.epsilon must be 0, got {float(controls.epsilon)}")
    if accel == "auto":
        from shared import native
        if native.available():
            accel = "native"
    if accel == "native":
        return _native_greedy_pass(agent, market, view, starts, length, controls, costs)
    if accel == "auto" and length - 1 >= AUTO_COMPILE_STEPS and compile_works(dev):
        accel = "compile+graph" if dev.type == "cuda" else "compile"
    accel = resolve_accel(accel, dev)
    B, L, S, P = len(starts), length, length - 1, agent.cfg.n_portfolio
    sim = Simulator(market.prices, B, costs)
    sim.reset(starts)
    sim.ledger_buf = _ChunkLedger(B, dev, market.prices.dtype, flush_every=chunk)
    tracker = PortfolioTracker(B, dev)
    noise = torch.zeros(B, 6, device=dev)                          # ε = 0: the greedy action whatever the uniforms
    records = (torch.zeros(S, B, 4, dtype=torch.float64, device=dev),
               torch.zeros(S, B, 4 + P, dtype=torch.float32, device=dev),
               torch.zeros(S, B, 4, dtype=torch.long, device=dev))
    i = torch.zeros(1, dtype=torch.long, device=dev)               # the step counter: the records' row
    bar = torch.compile(_greedy_bar) if "compile" in accel else _greedy_bar

    def steps(n: int) -> None:
        for _ in range(n):
            for rec, row in zip(records, bar(agent, sim, tracker, market, controls, view, noise)):
                rec.index_copy_(0, i, row.unsqueeze(0))
            i.add_(1)

    n_full, n_eager = S // chunk, S
    if "graph" in accel and n_full >= 2:
        pinned = StaticState(sim, tracker)

        def one_chunk() -> None:
            steps(chunk)
            pinned.commit()

        graphed = capture(one_chunk, warmup=1)                     # the warm-up ran the first chunk for real
        sim.ledger_buf.flush()
        for _ in range(n_full - 1):
            graphed()
            sim.ledger_buf.flush()
        n_eager = S - n_full * chunk
    else:
        accel = accel.replace("+graph", "").replace("graph", "eager")          # too short to capture: no graph
    for a in range(0, n_eager, chunk):
        steps(min(chunk, n_eager - a))
        sim.ledger_buf.flush()
    sim.close_all()

    return _assemble(sim, records, L, B, dev, ENGINES[accel])


def _assemble(sim: Simulator, records: tuple[torch.Tensor, torch.Tensor, torch.Tensor], L: int, B: int,
              dev, engine: str) -> GreedyPass:
    """`GreedyPass` from the S-row records and the simulator after its end-of-pass `close_all`."""
    r64, r32, rl = records
    f64 = dict(dtype=torch.float64, device=dev)
    eq, br, pos = torch.ones(L, B, **f64), torch.zeros(L, B, **f64), torch.zeros(L, B, **f64)
    eq[1:], br[1:], pos[1:] = r64[..., 1], r64[..., 2], r64[..., 3]
    eq[L - 1] = sim.equity                                         # after the end close
    br[L - 1] = torch.where(eq[L - 2] > 0, eq[L - 1] / eq[L - 2] - 1.0, torch.zeros_like(eq[L - 1]))   # as `step`
    pos[L - 1] = 0.0
    return GreedyPass(ledger=sim.ledger(), equity=eq, bar_returns=br, positions=pos, targets=r64[..., 0],
                      branches=rl[..., :3], q=r32[..., 0], q_std=r32[..., 1], edge=r32[..., 2], cvar=r32[..., 3],
                      blocked=rl[..., 3].bool(), portfolio=r32[..., 4:], engine=engine)


@torch.no_grad()
def _native_greedy_pass(agent: Agent, market: MarketTensors, view: MarketView, starts: torch.Tensor, length: int,
                        controls: PolicyControls, costs: CostModel) -> GreedyPass:
    """`greedy_pass(accel="native")`: the sequential part as one compiled CPU loop (`shared.native`), then
    `_native_result`."""
    from shared import native

    host = native.run_native(agent, market, view, starts, length, controls, costs, to_device=False)
    return _native_result(host, market, starts, length, costs, view.q.device)


def _native_result(host, market: MarketTensors, starts: torch.Tensor, length: int, costs: CostModel,
                   dev) -> GreedyPass:
    """The native loop's outputs of B = len(starts) accounts (on the host) → the simulator's ledger rows rebuilt from
    the loop's per-bar fills, its end-of-pass `close_all` on the final state, and the same records as every other
    mode (on `dev`)."""
    from shared import native

    rows = native.ledger_rows(host, starts, market.prices.open)                # read on the host, where it is
    out = host.to(dev) if dev.type != "cpu" else host
    sim = native.finish_simulator(out, market, costs, rows)
    sim.close_all()
    return _assemble(sim, (out.r64, out.r32, out.rl.long()), length, len(starts), dev, ENGINES["native"])


@torch.no_grad()
def market_views(agents: list[Agent], windows: torch.Tensor, chunk: int | None = None,
                 bf16_encoder: bool = False) -> list[tuple[torch.Tensor, MarketView]]:
    """`market_view` of each of K agents over the same windows: the batched part of a pass of K checkpoints. Each
    agent's encoder and heads run over every bar in its own batched calls, so each table is exactly the one a pass of
    that agent alone reads. (A `torch.func.vmap` over stacked weights does not run here: the agent's
    `shared.layers.dense_grad` is an autograd.Function without functorch support; its batched matmuls could also
    round float32 sums otherwise.)"""
    return [market_view(a, windows, chunk, bf16_encoder) for a in agents]


@torch.no_grad()
def greedy_pass_many(agents: list[Agent], market: MarketTensors, views: list[MarketView], starts: torch.Tensor,
                     length: int, controls: PolicyControls | list[PolicyControls], costs: CostModel = CostModel(), *,
                     accel: str = "auto", chunk: int = 64) -> list[GreedyPass]:
    """`greedy_pass` of K agents of one `AgentConfig` (ValueError naming what differs otherwise) over the same W =
    len(starts) windows: per agent k (its market view `views[k]`, its `controls[k]`, or one `controls` for all) the
    `GreedyPass` of its W accounts that `greedy_pass(agents[k], market, views[k], starts, …)` returns.

    native (and "auto" where a C compiler works): ONE sequential pass of K·W accounts — the same compiled loop
    (`shared.native.run_native_sets`), each account reading its own agent's view rows, portfolio-shift weights,
    v_max, maturity and controls — then each agent's W accounts finished as `greedy_pass` finishes a native pass
    (`GreedyPass.agents_in_pass` = K). The torch modes (eager, compile, graph, compile+graph, and "auto" without a
    compiler) step one agent's policy at a time: one `greedy_pass` per agent (`agents_in_pass` = 1), the engine as
    each pass names it."""
    from shared import native

    native.check_same_config(agents)
    K, W = len(agents), len(starts)
    ctl = list(controls) if isinstance(controls, (list, tuple)) else [controls] * K
    if len(views) != K or len(ctl) != K:
        raise ValueError(f"{K} agents need {K} market views and {K} controls, got {len(views)} and {len(ctl)}")
    for c in ctl:
        if float(c.epsilon) != 0.0:
            raise ValueError(f"greedy_pass is greedy: controls.epsilon must be 0, got {float(c.epsilon)}")
    if accel == "native" or (accel == "auto" and native.available()):
        dev = views[0].q.device
        sets = torch.arange(K).repeat_interleave(W)
        host = native.run_native_sets(agents, market, views, starts.repeat(K), sets, length, ctl, costs,
                                      to_device=False)
        out = []
        for k in range(K):
            p = _native_result(host.accounts(k * W, (k + 1) * W), market, starts, length, costs, dev)
            p.agents_in_pass = K
            out.append(p)
        return out
    return [greedy_pass(a, market, v, starts, length, c, costs, accel=accel, chunk=chunk)
            for a, v, c in zip(agents, views, ctl)]


@torch.no_grad()
def chosen_outputs(agent: Agent, emb: torch.Tensor, bars: torch.Tensor, portfolio: torch.Tensor,
                   direction: torch.Tensor, taus: torch.Tensor, *,
                   chunk: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions of N recorded decisions, after the fact and batched (what acting itself does not need):
    Q of each direction (ensemble mean, N × 3) and the IQN quantiles of the chosen `direction` at `taus`
    (N × M, in τ order). emb T × D embeddings, bars N (rows of emb), portfolio N × P, direction N (long)."""
    q_dir, quant = [], []
    for a in range(0, bars.shape[0], chunk):
        b = min(a + chunk, bars.shape[0])
        out = agent.head(emb[bars[a:b]], portfolio[a:b])
        q_dir.append(agent.q_values(out.logits[:, :, :3], out.delta).mean(1))                 # n × 3
        qt = agent.quantiles(out.hidden, taus).float() + out.delta[:, :3].unsqueeze(1)        # n × M × 3
        quant.append(qt.gather(2, direction[a:b].view(-1, 1, 1).expand(-1, qt.shape[1], 1)).squeeze(2))
    return torch.cat(q_dir), torch.cat(quant)
