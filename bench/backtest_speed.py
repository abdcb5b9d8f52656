"""Speed of the simulator (shared/execution.py) in account-bars per second, beside a plain Python loop and vectorbt.

    python bench/backtest_speed.py [--device cpu|cuda] [--T 1000000] [--B 1,64,1024] [--seconds 3] [--clock wall|cpu]
                                   [--replay-max-cells 100000000] [--T-replay-large 100000]

Workload: one synthetic OHLC series of T bars (geometric random walk); B accounts, each with its own random
target positions in {−1, 0, 1} held for 1–5 bars (a new trade or a flip every ~3 bars: the worst case for the
ledger). Targets come from a [4096, B] table indexed by step (a [B, T] array would need B·T·8 bytes).

Columns (account-bars/s = B × steps / seconds; each cell runs for about --seconds after a warm-up, so the
first `steps` bars of the T-bar series are timed — the step cost does not depend on T):
- `sim ledger`: `Simulator.step` eagerly, record_ledger=True, the ledger DataFrame built at the end (timed).
- `sim equity`: the same with record_ledger=False.
- `graph ledger` / `graph equity` (CUDA only): the same step code, --graph-steps steps captured into one CUDA
  graph and replayed (the ledger buffer flushed to the host after each replay).
- `replay (vectorised)`: `run_positions(prices, targets)` (the known-path replay, `_run_positions_vectorized`)
  over the whole series at once, ledger DataFrame, equity, bar returns and positions included, on the same
  per-step targets tiled into a [B, T] array; best of --replay-repeats runs after a warm-up on a prefix. When
  B·T would pass --replay-max-cells (memory: the [B, T] inputs and outputs), it runs over --T-replay-large bars
  instead and the cell says so. Its ledger is checked against the Python loop on a prefix (under the table).
- `python loop`: the same fill and cost rules written as a per-bar Python loop for one account (over --T-python
  bars), ledger kept as a list; checked against the simulator on a prefix (printed under the table).
- `vectorbt`: `vbt.Portfolio.from_orders(size_type="targetpercent")` on the same targets (an order at the next
  open where the target changes, same fees), over --T-vectorbt bars, when vectorbt is importable (the `test` extra
  installs it; this script never does).
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from shared.execution import CostModel, Prices, Simulator, run_positions  # noqa: E402

TABLE_ROWS = 4096
CLOCK = time.perf_counter
"""The timer of every cell: wall time, or with --clock cpu this process's CPU time (steadier on a shared machine)."""
STATE = ("t", "position", "units", "cash", "equity", "entry_equity", "entry_price", "entry_size", "tp_price",
         "sl_price", "entry_t", "bars_in_trade")
"""Simulator attributes a step rebinds: the CUDA graph copies them back into its static inputs."""


def make_ohlc(T: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A geometric random walk with small overnight gaps: open, high, low, close float64 [T]."""
    rng = np.random.default_rng(seed)
    close = 100.0 * np.exp(np.cumsum(rng.normal(0.0, 0.01, T)))
    open_ = np.concatenate(([100.0], close[:-1])) * np.exp(rng.normal(0.0, 0.001, T))
    wick = np.abs(rng.normal(0.0, 0.003, (2, T)))
    high = np.maximum(open_, close) * (1.0 + wick[0])
    low = np.minimum(open_, close) * (1.0 - wick[1])
    return open_, high, low, close


def make_targets(rows: int, B: int, seed: int = 1) -> np.ndarray:
    """[rows, B] targets in {−1, 0, 1}, each account holding a value for 1–5 steps (mean 3), then redrawing."""
    rng = np.random.default_rng(seed)
    out = np.empty((rows, B))
    value = rng.integers(-1, 2, B).astype(np.float64)
    left = rng.integers(1, 6, B)
    for k in range(rows):
        out[k] = value
        left -= 1
        redraw = left == 0
        value[redraw] = rng.integers(-1, 2, int(redraw.sum()))
        left[redraw] = rng.integers(1, 6, int(redraw.sum()))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_eager(prices: Prices, table: torch.Tensor, costs: CostModel, ledger: bool, seconds: float) -> tuple[float, int]:
    """account-bars/s of eager `Simulator.step` (and the number of steps timed)."""
    B, dev = table.shape[1], prices.device
    max_steps = len(prices) - 1
    sim = Simulator(prices, B, costs, record_ledger=ledger)
    for k in range(10):  # warm-up (allocator, kernels)
        sim.step(table[k])
    sim = Simulator(prices, B, costs, record_ledger=ledger)
    _sync(dev)
    steps, t0 = 0, CLOCK()
    while steps < max_steps:
        for _ in range(min(64, max_steps - steps)):
            sim.step(table[steps % TABLE_ROWS])
            steps += 1
        _sync(dev)
        if CLOCK() - t0 >= seconds:
            break
    if ledger:
        sim.ledger()
    _sync(dev)
    return B * steps / (CLOCK() - t0), steps


def bench_graph(prices: Prices, table: torch.Tensor, costs: CostModel, ledger: bool, seconds: float,
                K: int, compiled: bool = False) -> tuple[float, int]:
    """account-bars/s of K simulator steps captured in one CUDA graph and replayed (`compiled`: the step
    through torch.compile first, so that its element-wise ops fuse into a few kernels)."""
    B, dev = table.shape[1], prices.device
    assert TABLE_ROWS % K == 0
    sim = Simulator(prices, B, costs, record_ledger=ledger, ledger_flush_every=K)
    lb = sim.ledger_buf
    if lb is not None:
        lb.flush_every = 1 << 62  # never flush inside the graph: flushed by hand after each replay
    step = torch.compile(sim.step, dynamic=False) if compiled else sim.step
    static_tg = table[:K].clone()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        for k in range(3):
            step(static_tg[k])
    torch.cuda.current_stream(dev).wait_stream(side)
    _sync(dev)
    state = {n: getattr(sim, n).clone() for n in STATE}
    for n in STATE:
        setattr(sim, n, state[n])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(K):
            step(static_tg[k])
        for n in STATE:
            state[n].copy_(getattr(sim, n))
    for n in STATE:
        setattr(sim, n, state[n])
    if lb is not None:
        lb.flush()
        lb.chunks.clear()
    max_steps = len(prices) - 1 - 3
    for k in range(2):  # warm replays
        graph.replay()
    _sync(dev)
    steps, t0 = 0, CLOCK()
    while steps + K <= max_steps - 2 * K:
        for _ in range(8):
            r = (steps % TABLE_ROWS)
            static_tg.copy_(table[r:r + K])
            graph.replay()
            if lb is not None:
                lb.flush()
            steps += K
        _sync(dev)
        if CLOCK() - t0 >= seconds:
            break
    if lb is not None:
        sim.ledger()
    _sync(dev)
    return B * steps / (CLOCK() - t0), steps


def python_loop(o, h, l, c, targets, rate: float) -> tuple[float, list[tuple]]:
    """One account, the simulator's rules without profit target / stop loss, one bar at a time: units bought at a
    fill, held until the next one; equity = cash + units × price.

    Returns the final equity and the ledger [(entry_t, exit_t, side, size, entry_price, exit_price, net_return)].
    """
    T = len(o)
    pos, units, cash, eq = 0.0, 0.0, 1.0, 1.0
    entry_t, entry_px, entry_size, entry_eq = 0, 0.0, 0.0, 1.0
    trades = []
    for t in range(T - 1):
        op, cl = o[t + 1], c[t + 1]
        tgt = targets[t]
        if tgt != pos:                                  # a fill at the open
            old_side = (pos > 0) - (pos < 0)
            new_side = (tgt > 0) - (tgt < 0)
            if old_side != 0 and new_side != old_side:  # close (signal or flip)
                cash = (cash + units * op) - rate * abs(units) * op
                units = 0.0
                trades.append((entry_t, t + 1, old_side, entry_size, entry_px, op, cash / entry_eq - 1.0))
            if new_side != 0:                           # open, or resize inside the trade
                eq_fill = cash + units * op
                du = tgt * eq_fill / op - units
                cash = (cash - du * op) - rate * abs(du) * op
                units += du
                if new_side != old_side:
                    entry_t, entry_px, entry_size, entry_eq = t + 1, op, abs(tgt), eq_fill
            pos = tgt
        if t + 1 == T - 1 and pos != 0:                 # last bar: close at its close
            cash = (cash + units * cl) - rate * abs(units) * cl
            units = 0.0
            trades.append((entry_t, t + 1, (pos > 0) - (pos < 0), entry_size, entry_px, cl, cash / entry_eq - 1.0))
            pos = 0.0
        eq = cash + units * cl
    return eq, trades


def check_python_loop(ohlc, targets: np.ndarray, costs: CostModel, n: int) -> str:
    """Run the Python loop and the simulator (CPU, one account) on the first n bars; say how they compare."""
    o, h, l, c = (a[:n] for a in ohlc)
    eq_py, trades_py = python_loop(o.tolist(), h.tolist(), l.tolist(), c.tolist(), targets[:n].tolist(), costs.rate)
    sim = Simulator(Prices.from_arrays(o, h, l, c), 1, costs, record_ledger=True)
    tg = torch.as_tensor(targets[:n])
    for t in range(n - 1):
        sim.step(tg[t:t + 1])
    led = sim.ledger()
    d_eq = abs(float(sim.equity[0]) - eq_py)
    d_ret = max((abs(a - b) for a, b in zip(led["net_return"], (x[6] for x in trades_py))), default=0.0)
    same_spans = [(int(a), int(b)) for a, b in zip(led["entry_t"], led["exit_t"])] == [(x[0], x[1]) for x in trades_py]
    return (f"Python loop vs simulator on {n} bars: trades {len(trades_py)} vs {len(led)}, same spans: {same_spans}, "
            f"max |Δ net_return| = {d_ret:.1e}, |Δ final equity| = {d_eq:.1e}")


def bench_replay(ohlc, table: np.ndarray, costs: CostModel, T: int, device: torch.device,
                 repeats: int) -> float:
    """account-bars/s of `run_positions` (vectorised replay, ledger included) over T bars, best of `repeats`."""
    B = table.shape[1]
    prices = Prices.from_arrays(*(a[:T] for a in ohlc), device=device)
    targets = torch.as_tensor(np.ascontiguousarray(np.resize(table, (T, B)).T), device=device)  # [B, T]
    n = min(T, 5000)
    run_positions(Prices.from_arrays(*(a[:n] for a in ohlc), device=device), targets[:, :n], costs)  # warm-up
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        t0 = CLOCK()
        res = run_positions(prices, targets, costs)
        _sync(device)
        best = min(best, CLOCK() - t0)
        del res
    return B * T / best


def check_replay(ohlc, targets: np.ndarray, costs: CostModel, n: int) -> str:
    """The vectorised replay vs the Python loop on the first n bars, trade by trade."""
    o, h, l, c = (a[:n] for a in ohlc)
    eq_py, trades_py = python_loop(o.tolist(), h.tolist(), l.tolist(), c.tolist(), targets[:n].tolist(), costs.rate)
    res = run_positions(Prices.from_arrays(o, h, l, c), targets[:n], costs)
    led = res.ledger
    cols = ("entry_t", "exit_t", "side", "size", "entry_price", "exit_price", "net_return")
    py = np.array(trades_py, dtype=float).reshape(-1, len(cols))
    vec = led[list(cols)].to_numpy(dtype=float)
    same_len = len(py) == len(vec)
    same_spans = same_len and bool((py[:, :3] == vec[:, :3]).all())
    d = float(np.abs(py[:, 3:] - vec[:, 3:]).max()) if same_len and len(py) else float("nan")
    return (f"Python loop vs replay (vectorised) on {n} bars: trades {len(trades_py)} vs {len(led)}, same "
            f"entry/exit/side: {same_spans}, max |Δ| of size, prices, net_return = {d:.1e}, |Δ final equity| = "
            f"{abs(float(res.equity[0, -1]) - eq_py):.1e}")


def bench_python(ohlc, targets: np.ndarray, costs: CostModel, T: int) -> float:
    o, h, l, c = (a[:T].tolist() for a in ohlc)
    tg = targets[:T].tolist()
    python_loop(o[:1000], h[:1000], l[:1000], c[:1000], tg[:1000], costs.rate)
    t0 = CLOCK()
    python_loop(o, h, l, c, tg, costs.rate)
    return (T - 1) / (CLOCK() - t0)


def bench_vectorbt(ohlc, table: np.ndarray, costs: CostModel, T: int) -> float | str:
    """account-bars/s of vectorbt's Portfolio.from_orders on the same targets, or why it was skipped."""
    try:
        import vectorbt as vbt  # noqa: F401
    except ImportError:
        return "not installed"
    import pandas as pd

    B = table.shape[1]
    o, _, _, c = (a[:T] for a in ohlc)
    tg = np.resize(table, (T, B))  # the same per-step table, tiled over T steps
    size = np.vstack([np.full((1, B), np.nan), tg[:-1]])  # decided at close t → ordered at open t+1
    held = np.vstack([np.full((1, B), np.nan), tg[:-2]])
    size[1:][size[1:] == np.nan_to_num(held, nan=0.0)] = np.nan  # an unchanged target is no order: units held
    close = pd.DataFrame(np.repeat(c[:, None], B, 1))
    price = pd.DataFrame(np.repeat(o[:, None], B, 1))

    def run():
        pf = vbt.Portfolio.from_orders(close, size, size_type="targetpercent", price=price, fees=costs.rate,
                                       direction="both")
        return pf.trades.records_readable  # the ledger, to compare like with like

    run()
    t0 = CLOCK()
    run()
    return B * (T - 1) / (CLOCK() - t0)


def fmt(x) -> str:
    return x if isinstance(x, str) else f"{x:.3g}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--T", type=int, default=1_000_000, help="bars in the price series")
    ap.add_argument("--B", default=None, help="comma-separated account counts (default 1,64,1024; on cuda "
                                              "1,64,1024,4096,16384,65536)")
    ap.add_argument("--seconds", type=float, default=3.0, help="timed seconds per cell (after a warm-up)")
    ap.add_argument("--T-python", type=int, default=200_000, help="bars of the plain Python loop")
    ap.add_argument("--T-vectorbt", type=int, default=100_000, help="bars of the vectorbt run")
    ap.add_argument("--graph-steps", type=int, default=64, help="steps per CUDA graph (cuda only)")
    ap.add_argument("--compile", action="store_true", help="cuda: add a column with the step compiled "
                                                           "(torch.compile) inside the CUDA graph, equity only")
    ap.add_argument("--cost-bps", type=float, default=1.0)
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time cells by wall clock, or by this process's CPU time (all its threads: steadier than "
                         "wall time on a machine other jobs share; the GPU's time is not counted)")
    ap.add_argument("--check-bars", type=int, default=2000, help="bars of the Python-loop vs simulator check")
    ap.add_argument("--replay-max-cells", type=float, default=1e8,
                    help="largest B·T of the replay column; above it the replay runs over --T-replay-large bars")
    ap.add_argument("--T-replay-large", type=int, default=100_000, help="bars of the replay when B·T is too big")
    ap.add_argument("--replay-repeats", type=int, default=2, help="timed replay runs per cell (best is shown)")
    ap.add_argument("--replay-check-bars", type=int, default=20_000, help="bars of the Python-loop vs replay check")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is available")
    dev = torch.device(a.device)
    Bs = [int(x) for x in (a.B or ("1,64,1024,4096,16384,65536" if a.device == "cuda" else "1,64,1024")).split(",")]
    costs = CostModel(cost_bps=a.cost_bps)
    ohlc = make_ohlc(a.T)
    prices = Prices.from_arrays(*ohlc, device=dev)
    one = make_targets(max(a.T_python, a.check_bars), 1)[:, 0]

    cols = ["B", "sim ledger", "sim equity"]
    if dev.type == "cuda":
        cols += [f"graph ledger (K={a.graph_steps})", f"graph equity (K={a.graph_steps})"]
        cols += ["compiled graph equity"] if a.compile else []
    cols += ["replay (vectorised)", "python loop", "vectorbt"]
    rows, notes = [], []
    for B in Bs:
        table_np = make_targets(TABLE_ROWS, B, seed=B)
        table = torch.as_tensor(table_np, device=dev)
        cells = [str(B)]
        for ledger in (True, False):
            rate, steps = bench_eager(prices, table, costs, ledger, a.seconds)
            cells.append(fmt(rate))
            notes.append(f"B={B} sim {'ledger' if ledger else 'equity'}: {steps} steps timed")
        if dev.type == "cuda":
            for ledger in (True, False):
                rate, steps = bench_graph(prices, table, costs, ledger, a.seconds, a.graph_steps)
                cells.append(fmt(rate))
                notes.append(f"B={B} graph {'ledger' if ledger else 'equity'}: {steps} steps timed")
            if a.compile:
                rate, steps = bench_graph(prices, table, costs, False, a.seconds, a.graph_steps, compiled=True)
                cells.append(fmt(rate))
                notes.append(f"B={B} compiled graph equity: {steps} steps timed")
        T_rep = a.T if B * a.T <= a.replay_max_cells else min(a.T, a.T_replay_large)
        rate = bench_replay(ohlc, table_np, costs, T_rep, dev, a.replay_repeats)
        cells.append(fmt(rate) + ("" if T_rep == a.T else f" (T={T_rep})"))
        notes.append(f"B={B} replay (vectorised): T={T_rep}, best of {a.replay_repeats}")
        cells.append(fmt(bench_python(ohlc, one, costs, a.T_python)) if B == 1 else "—")
        vb = bench_vectorbt(ohlc, table_np, costs, min(a.T, a.T_vectorbt))
        cells.append(fmt(vb))
        rows.append(cells)
        print(" | ".join(cells), file=sys.stderr, flush=True)

    dname = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or platform.machine())
    print(f"\naccount-bars/s — device {a.device} ({dname}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads, T={a.T}, cost {a.cost_bps} bps, {a.clock} clock, "
          f"targets in {{-1,0,1}} "
          f"redrawn every 1–5 bars\n")
    print("| " + " | ".join(cols) + " |")
    print("|" + "|".join("---:" for _ in cols) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()
    for n in notes:
        print(f"- {n}")
    print(f"- python loop: one account, {a.T_python} bars")
    print(f"- {check_python_loop(ohlc, one, costs, a.check_bars)}")
    one_r = make_targets(a.replay_check_bars, 1)[:, 0]
    print(f"- {check_replay(ohlc, one_r, costs, min(a.T, a.replay_check_bars))}")
    if math.isfinite(a.T_vectorbt):
        print(f"- vectorbt: {min(a.T, a.T_vectorbt)} bars, B accounts as columns, trades records included")


if __name__ == "__main__":
    main()
