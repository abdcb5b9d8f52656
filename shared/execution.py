"""The one trading simulator of tradeloop: B accounts × T bars, batched in torch, CPU or CUDA.

Used by the trainer's environment, by every evaluator backtest and by `tradeloop backtest`; nothing else in
tradeloop turns positions into trades.

Fill rules
----------
- A target position in [-1, 1] (a signed fraction of equity) decided at the close of bar t fills at the open
  of bar t+1. No look-ahead: the decision at t never sees bar t+1.
- Positions are fractions of equity: between fills the account holds `position × equity` of notional, so a
  bar's account return is `position × price return` (re-marked each bar, no rebalancing cost).
- Costs: a fill that changes the position by |Δ| costs `(cost_bps + slippage_bps) · 1e-4 · |Δ|` of equity.
  Slippage is modelled as extra bps, not as a moved fill price; ledger prices are the raw bar prices.
- Profit target / stop loss are fractions of the entry price, fixed when a trade opens (`+inf` = none). On each
  bar a position is held, the bar's low/high are checked; when both levels are inside the bar's range the stop
  is assumed first (the conservative order). A level the open already gapped through fills at the open.
  After a stop or target the account is flat until the next decision (which may re-enter at the next open).
- A trade runs from a flat position to the next flat position. A change of size with the same sign stays in
  the trade; a sign flip closes one trade and opens the next at the same open.
- A position still open on the last bar is closed at that bar's close, with `exit_reason = "end"`.

Cost convention (how a trade's net return includes costs)
----------------------------------------------------------
Each trade keeps its own growth factor `g`, the product of the factors its own P&L and costs applied to
equity: `(1 - c·|size_entry|)` at entry, `(1 + p·r)` for each price move held, `(1 - c·|Δ|)` for each size
change, `(1 - c·|p|)` at exit. Its `net_return = g - 1`: the trade's equity after its exit fill over equity
before its entry fill. On a flip, the closing part of the turnover (|old|) is charged to the old trade and
the opening part (|new|) to the new one. When the account is flat between trades, equity is exactly the
product of `(1 + net_return)` over its trades.

Ledger columns: account, entry_t, exit_t (bar indices of the entry and exit fills), side (+1/-1), size
(|position| at entry), entry_price, exit_price, net_return, bars (bars the position was held, the entry bar
counted), exit_reason ("signal" | "flip" | "stop" | "target" | "end").

ML core: imports only torch, numpy and pandas.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

EXIT_REASONS = ("signal", "flip", "stop", "target", "end")
_SIGNAL, _FLIP, _STOP, _TARGET, _END = range(5)
LEDGER_COLUMNS = ("account", "entry_t", "exit_t", "side", "size", "entry_price", "exit_price",
                  "net_return", "bars", "exit_reason")


@dataclass(frozen=True)
class CostModel:
    cost_bps: float = 1.0
    """Commission and spread, in basis points of traded notional."""
    slippage_bps: float = 0.0
    """Extra basis points of traded notional for slippage."""

    @property
    def rate(self) -> float:
        """Fraction of equity lost per unit of |Δposition|."""
        return (self.cost_bps + self.slippage_bps) * 1e-4

    def __post_init__(self) -> None:
        if not (self.cost_bps >= 0 and self.slippage_bps >= 0):
            raise ValueError(f"costs must be non-negative, got cost_bps={self.cost_bps}, slippage_bps={self.slippage_bps}")


@dataclass(frozen=True)
class Prices:
    """OHLC as 1-D tensors on one device: the simulator's view of the bars."""

    open: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    close: torch.Tensor

    @classmethod
    def from_bars(cls, bars, device=None, dtype=torch.float64) -> "Prices":
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=dtype, device=device)  # noqa: E731
        return cls(t(bars.open), t(bars.high), t(bars.low), t(bars.close))

    @classmethod
    def from_arrays(cls, open, high, low, close, device=None, dtype=torch.float64) -> "Prices":
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64), dtype=dtype, device=device)  # noqa: E731
        return cls(t(open), t(high), t(low), t(close))

    def __len__(self) -> int:
        return int(self.open.shape[0])

    @property
    def device(self) -> torch.device:
        return self.open.device

    @property
    def dtype(self) -> torch.dtype:
        return self.open.dtype


@dataclass
class StepResult:
    """What one step did, per account ([B] tensors)."""

    bar_return: torch.Tensor
    """The account's equity return over the step (close t → close t+1)."""
    trade_return: torch.Tensor
    """Sum of the net returns of trades closed during the step (0 where none): the trade-level reward."""
    n_closed: torch.Tensor
    """Number of trades closed during the step (0, 1 or 2: a flip then a stop on the new trade)."""
    opened: torch.Tensor
    """A trade opened at this step's open."""
    position: torch.Tensor
    """Position held after the step (at the close of bar t+1)."""


class _LedgerBuffer:
    """Append-only device buffer of closed trades, written without host syncs and flushed in chunks.

    A close event is scattered to `count + rank` (rank = its place among this call's events); events that are
    not real go to a dump row past the end. The host copy happens in `flush`, every `flush_every` steps.
    """

    FIELDS = 9  # account, entry_t, exit_t, side, size, entry_price, exit_price, net_return, reason

    def __init__(self, n_accounts: int, device, dtype, flush_every: int = 256):
        self.capacity = 2 * n_accounts * flush_every + 1
        self.buf = torch.zeros(self.capacity + 1, self.FIELDS, device=device, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self.flush_every = flush_every
        self.steps = 0
        self.chunks: list[np.ndarray] = []
        self.accounts = torch.arange(n_accounts, device=device, dtype=torch.float64)

    def add(self, mask, entry_t, exit_t, side, size, entry_price, exit_price, net_return, reason) -> None:
        rank = torch.cumsum(mask.long(), 0) - 1
        dest = torch.where(mask, self.count + rank, torch.full_like(rank, self.capacity))
        row = torch.stack([self.accounts, entry_t.double(), exit_t.double(), side.double(), size.double(),
                           entry_price.double(), exit_price.double(), net_return.double(),
                           reason.double()], dim=1)
        self.buf.index_copy_(0, dest, row)
        self.count += mask.sum()

    def tick(self) -> None:
        self.steps += 1
        if self.steps % self.flush_every == 0:
            self.flush()

    def flush(self) -> None:
        n = int(self.count)  # the one host sync, once per chunk
        if n:
            self.chunks.append(self.buf[:n].cpu().numpy().copy())
        self.count.zero_()

    def frame(self) -> pd.DataFrame:
        self.flush()
        rows = np.concatenate(self.chunks) if self.chunks else np.zeros((0, self.FIELDS))
        df = pd.DataFrame({
            "account": rows[:, 0].astype(np.int64),
            "entry_t": rows[:, 1].astype(np.int64),
            "exit_t": rows[:, 2].astype(np.int64),
            "side": rows[:, 3].astype(np.int64),
            "size": rows[:, 4],
            "entry_price": rows[:, 5],
            "exit_price": rows[:, 6],
            "net_return": rows[:, 7],
        })
        reason = rows[:, 8].astype(np.int64)
        # bars held: an exit at an open does not hold the exit bar; a stop/target/end exit does.
        df["bars"] = df["exit_t"] - df["entry_t"] + (reason >= _STOP).astype(np.int64)
        # a take and a str cast (not a categorical's: that hashes every row)
        df["exit_reason"] = pd.Series(np.asarray(EXIT_REASONS, dtype=object)[reason]).astype(str)
        return df.sort_values(["account", "exit_t", "entry_t"], kind="stable").reset_index(drop=True)


class Simulator:
    """B accounts stepping through one price series, each at its own bar index `t`."""

    def __init__(self, prices: Prices, n_accounts: int, costs: CostModel = CostModel(), *,
                 record_ledger: bool = False, ledger_flush_every: int = 256):
        if len(prices) < 2:
            raise ValueError("the simulator needs at least 2 bars")
        self.prices, self.costs, self.B = prices, costs, n_accounts
        dev, dt = prices.device, prices.dtype
        self.T = len(prices)
        self.rate = costs.rate
        z = lambda: torch.zeros(n_accounts, device=dev, dtype=dt)  # noqa: E731
        self.t = torch.zeros(n_accounts, device=dev, dtype=torch.long)
        self.position, self.equity = z(), z() + 1.0
        self.entry_price, self.entry_size, self.growth = z(), z(), z() + 1.0
        self.tp_price, self.sl_price = z(), z()
        self.entry_t = torch.zeros(n_accounts, device=dev, dtype=torch.long)
        self.bars_in_trade = torch.zeros(n_accounts, device=dev, dtype=torch.long)
        self.ledger_buf = _LedgerBuffer(n_accounts, dev, dt, ledger_flush_every) if record_ledger else None

    # --- state -------------------------------------------------------------------------------------------
    @property
    def done(self) -> torch.Tensor:
        """Accounts at the last bar: stepping them further leaves them unchanged."""
        return self.t >= self.T - 1

    @property
    def trade_return_open(self) -> torch.Tensor:
        """Net return of the open trade so far, costs to date included (0 when flat)."""
        return torch.where(self.position != 0, self.growth - 1.0, torch.zeros_like(self.growth))

    def reset(self, start: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Put the selected accounts flat at bar `start` with equity 1 (no trade is recorded: they must be flat,
        or their open trade is dropped — callers that need it recorded close it first)."""
        start = torch.as_tensor(start, device=self.t.device, dtype=torch.long).expand(self.B)
        m = torch.ones(self.B, dtype=torch.bool, device=self.t.device) if mask is None else mask
        zero = torch.zeros_like(self.equity)
        self.t = torch.where(m, start, self.t)
        self.position = torch.where(m, zero, self.position)
        self.equity = torch.where(m, zero + 1.0, self.equity)
        self.growth = torch.where(m, zero + 1.0, self.growth)
        self.bars_in_trade = torch.where(m, torch.zeros_like(self.bars_in_trade), self.bars_in_trade)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self, target: torch.Tensor, take_profit: torch.Tensor | None = None,
             stop_loss: torch.Tensor | None = None) -> StepResult:
        """Move every account not yet at the last bar from bar t to t+1 (see the module docstring)."""
        P, c = self.prices, self.rate
        live = ~self.done                                                     # [B]
        t1 = torch.clamp(self.t + 1, max=self.T - 1)
        o, h, l, cl = P.open[t1], P.high[t1], P.low[t1], P.close[t1]
        c_prev = P.close[self.t]
        zero, one = torch.zeros_like(self.equity), torch.ones_like(self.equity)
        inf = torch.full_like(self.equity, float("inf"))
        tp = inf if take_profit is None else torch.as_tensor(take_profit, dtype=zero.dtype, device=zero.device)
        sl = inf if stop_loss is None else torch.as_tensor(stop_loss, dtype=zero.dtype, device=zero.device)
        target = torch.where(live, torch.clamp(target.to(zero.dtype), -1.0, 1.0), self.position)

        pos, g, eq0 = self.position, self.growth, self.equity
        # 1) overnight: close t → open t+1 with the old position
        f_gap = 1.0 + pos * (o / c_prev - 1.0)
        g, eq = g * f_gap, eq0 * f_gap

        # 2) fill at the open
        old_side, new_side = torch.sign(pos), torch.sign(target)
        closes = (old_side != 0) & (new_side != old_side)                    # old trade ends here
        opens = (new_side != 0) & (new_side != old_side)                     # a new trade starts here
        resize = (old_side != 0) & (new_side == old_side)
        f_close = 1.0 - c * pos.abs()
        f_open = 1.0 - c * target.abs()
        f_resize = 1.0 - c * (target - pos).abs()
        closed_g = g * f_close                                               # net growth of the closing trade
        closed_ret1 = torch.where(closes, closed_g - 1.0, zero)
        eq = eq * torch.where(closes, f_close, one) * torch.where(opens, f_open, one) * torch.where(resize, f_resize, one)
        g = torch.where(opens, f_open, torch.where(resize, g * f_resize, g))
        if self.ledger_buf is not None:
            reason = torch.where(new_side == 0, _SIGNAL, _FLIP)
            self.ledger_buf.add(closes, self.entry_t, t1, old_side, self.entry_size, self.entry_price, o,
                                closed_ret1, reason)
        entry_price = torch.where(opens, o, self.entry_price)
        entry_size = torch.where(opens, target.abs(), self.entry_size)
        entry_t = torch.where(opens, t1, self.entry_t)
        tp_price = torch.where(opens, torch.where(new_side > 0, o * (1.0 + tp), o * (1.0 - tp)), self.tp_price)
        sl_price = torch.where(opens, torch.where(new_side > 0, o * (1.0 - sl), o * (1.0 + sl)), self.sl_price)
        pos = target
        side = new_side

        # 3) intrabar: stop first, then target; a level the open is already past fills at the open
        long, short = side > 0, side < 0
        stop_hit = (long & (l <= sl_price)) | (short & (h >= sl_price))
        tgt_hit = ~stop_hit & ((long & (h >= tp_price)) | (short & (l <= tp_price)))
        stop_px = torch.where(long, torch.minimum(o, sl_price), torch.maximum(o, sl_price))
        tgt_px = torch.where(long, torch.maximum(o, tp_price), torch.minimum(o, tp_price))
        exit_intrabar = stop_hit | tgt_hit
        last = t1 == self.T - 1
        exit_end = ~exit_intrabar & (side != 0) & last & live
        exit_px = torch.where(stop_hit, stop_px, torch.where(tgt_hit, tgt_px, cl))
        # open → exit price (or → close when held), then the exit fill's cost
        f_move = 1.0 + pos * (exit_px / o - 1.0)
        exits2 = exit_intrabar | exit_end
        f_exit = torch.where(exits2, 1.0 - c * pos.abs(), one)
        g, eq = g * f_move * f_exit, eq * f_move * f_exit
        closed_ret2 = torch.where(exits2, g - 1.0, zero)
        if self.ledger_buf is not None:
            reason = torch.where(stop_hit, _STOP, torch.where(tgt_hit, _TARGET, _END))
            self.ledger_buf.add(exits2 & live, entry_t, t1, side, entry_size, entry_price, exit_px, closed_ret2,
                                reason)
            self.ledger_buf.tick()
        pos = torch.where(exits2, zero, pos)

        # commit (accounts at the last bar keep their state)
        keep = lambda new, old: torch.where(live, new, old)  # noqa: E731
        self.position = keep(pos, self.position)
        self.equity = keep(eq, self.equity)
        self.growth = keep(torch.where(pos != 0, g, one), self.growth)
        self.entry_price, self.entry_size = keep(entry_price, self.entry_price), keep(entry_size, self.entry_size)
        self.entry_t = keep(entry_t, self.entry_t)
        self.tp_price, self.sl_price = keep(tp_price, self.tp_price), keep(sl_price, self.sl_price)
        in_trade = pos != 0
        self.bars_in_trade = keep(torch.where(in_trade, self.bars_in_trade + 1, torch.zeros_like(self.bars_in_trade)),
                                  self.bars_in_trade)
        self.t = t1
        n_closed = (closes & live).long() + (exits2 & live).long()
        return StepResult(
            bar_return=torch.where(live, eq / eq0 - 1.0, zero),
            trade_return=torch.where(live, closed_ret1 + closed_ret2, zero),
            n_closed=n_closed,
            opened=opens & live,
            position=self.position,
        )

    def close_all(self) -> torch.Tensor:
        """Close open positions at the current bar's close (exit_reason "end"); returns their net returns."""
        open_ = self.position != 0
        f_exit = 1.0 - self.rate * self.position.abs()
        g = self.growth * f_exit
        ret = torch.where(open_, g - 1.0, torch.zeros_like(g))
        if self.ledger_buf is not None:
            self.ledger_buf.add(open_, self.entry_t, self.t, torch.sign(self.position), self.entry_size,
                                self.entry_price, self.prices.close[self.t], ret,
                                torch.full_like(self.t, _END))
        self.equity = torch.where(open_, self.equity * f_exit, self.equity)
        self.position = torch.zeros_like(self.position)
        self.growth = torch.ones_like(self.growth)
        self.bars_in_trade = torch.zeros_like(self.bars_in_trade)
        return ret

    def ledger(self) -> pd.DataFrame:
        """Closed trades so far, as a DataFrame with `LEDGER_COLUMNS`."""
        if self.ledger_buf is None:
            raise RuntimeError("the ledger was not recorded: create the Simulator with record_ledger=True")
        return self.ledger_buf.frame()


@dataclass
class BacktestResult:
    ledger: pd.DataFrame
    equity: np.ndarray
    """[B, T] equity at each bar's close (1.0 at bar 0)."""
    bar_returns: np.ndarray
    """[B, T] equity return over each bar (0 at bar 0)."""
    positions: np.ndarray
    """[B, T] position held at each bar's close (after that bar's fills and exits)."""


def run_positions(prices: Prices, targets, costs: CostModel = CostModel(), *, take_profit=None,
                  stop_loss=None, fast: bool = True) -> BacktestResult:
    """Replay target positions through the simulator: `targets[:, t]` is decided at the close of bar t.

    `targets` is [T] or [B, T] (the last column is unused: no bar follows it). Accounts start flat at bar 0;
    positions still open at the last bar close at its close. `take_profit` / `stop_loss` are fractions of the
    entry price ([B, T] like targets, or scalars), read when a trade opens.

    Without target/stop levels the whole path is known in advance, and `fast=True` takes the vectorised
    form of the same rules (`_run_positions_vectorized`, pinned to `Simulator.step` by an equivalence test).
    """
    tg = torch.as_tensor(targets, dtype=prices.dtype, device=prices.device)
    if tg.dim() == 1:
        tg = tg.unsqueeze(0)
    B, T = tg.shape
    if T != len(prices):
        raise ValueError(f"targets cover {T} bars but the prices have {len(prices)}")
    if not torch.isfinite(tg).all():
        raise ValueError("targets must be finite")
    tg = tg.clamp(-1.0, 1.0)
    if take_profit is None and stop_loss is None and fast:
        return _run_positions_vectorized(prices, tg, costs)
    sim = Simulator(prices, B, costs, record_ledger=True)
    sim.reset(torch.zeros(B, dtype=torch.long, device=prices.device))

    def per_bar(x, t):
        if x is None:
            return None
        x = torch.as_tensor(x, dtype=prices.dtype, device=prices.device)
        if x.dim() == 0:
            return x.expand(B)
        return (x.unsqueeze(0) if x.dim() == 1 else x)[:, t].expand(B)

    eq = torch.ones(B, T, dtype=prices.dtype, device=prices.device)
    br = torch.zeros_like(eq)
    pos = torch.zeros_like(eq)
    for t in range(T - 1):
        r = sim.step(tg[:, t], per_bar(take_profit, t), per_bar(stop_loss, t))
        eq[:, t + 1], br[:, t + 1], pos[:, t + 1] = sim.equity, r.bar_return, r.position
    return BacktestResult(sim.ledger(), eq.cpu().numpy(), br.cpu().numpy(), pos.cpu().numpy())


def _block_shape(B: int, n_bars: int, block_elements: int) -> tuple[int, int]:
    """Rows × bars of one replay block. Either whole rows (several accounts per block, when a row fits) or one
    account per block: so that trades come out already in (account, time) order with no sort."""
    block_elements = max(1, int(block_elements))
    if n_bars <= block_elements:
        return max(1, min(B, block_elements // max(1, n_bars))), max(1, n_bars)
    return 1, block_elements


def _post_log(cv: torch.Tensor, mr: torch.Tensor, at_end: torch.Tensor, c: float) -> torch.Tensor:
    """Log of the factors a trade opened at a bar's open owns on that bar: open cost, open → close move and,
    on the last bar, the end-of-data exit cost. `cv` is the position held out of the bar (0 → 0)."""
    cost = torch.log1p(-c * cv.abs())
    return cost * (1.0 + at_end.to(cv.dtype)) + torch.log1p(cv * mr)


def _run_positions_vectorized(prices: Prices, tg: torch.Tensor, costs: CostModel,
                              block_elements: int | None = None) -> BacktestResult:
    """`run_positions` without target/stop levels: the same rules vectorised over bars, in cache-sized blocks.

    With no intrabar exits the position held over bar t is p_t = targets[:, t-1] (p_0 = 0), so every bar's
    account factor is known at once (c = cost rate, ρg_t = open_t/close_{t-1} - 1, ρm_t = close_t/open_t - 1):
      f_t = (1 + p_{t-1}·ρg_t) · fill_t · (1 + p_t·ρm_t)   [· (1 - c|p_{T-1}|) on the last bar: the end exit]
      fill_t = 1 - c|p_t - p_{t-1}|, or (1 - c|p_{t-1}|)(1 - c|p_t|) on a flip
             = 1 - c·(|p_t - p_{t-1}| + c·min(p_{t-1}·p_t, 0))
    and log equity L_t = Σ_{s≤t} log f_s. A trade's growth is a segment of that sum: the trade opened at the
    open of bar e and closed at the open of bar x owns everything in between except the part of bar e before
    its fill (owned by the trade it flipped out of, if any) and the part of bar x after the exit fill (owned by
    the next trade, if a flip). With post_t = log(1 - c|p_t|) + log(1 + p_t·ρm_t) [+ log(1 - c|p_t|) at T-1],
    the part of an open bar after its fill,
      log g = (L_x - post_x) - (L_e - post_e);   for the "end" exit at the last close, L_{T-1} - (L_e - post_e).
    So the per-bar work is a handful of element-wise passes, one cumsum and one exp per block; entries and
    exits are read off at the sign changes. Blocks are [rows, bars] of about `block_elements` (default 2^17 on
    CPU, 2^25 on CUDA; tests force tiny ones), carrying the account's log equity (and, through the bar before
    the block, its position) from one block to the next. Blocks are whole rows or one account wide, so entries
    and exits come out in (account, time) order: the k-th exit of an account closes its k-th entry, no sort.
    Precision: L is a running float64 sum, so a trade's log growth carries an absolute error ~1e-16·|L|.
    """
    if prices.device.type != "cpu":
        return _replay_blocks(prices, tg, costs, block_elements or (1 << 25))
    # CPU: one intra-op thread. The blocks are cache-sized, and handing each small op to a thread pool costs
    # more than it brings; with oversubscribed cores (a busy 2-core VM) the pool's barriers made it 10× slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay_blocks(prices, tg, costs, block_elements or (1 << 17))
    finally:
        torch.set_num_threads(threads)


def _replay_blocks(prices: Prices, tg: torch.Tensor, costs: CostModel, block_elements: int) -> BacktestResult:
    """The block loop of `_run_positions_vectorized` (see there)."""
    B, T = tg.shape
    c = float(costs.rate)
    dev, dt = prices.device, prices.dtype
    o, cl = prices.open, prices.close
    gap_r = torch.zeros(T, device=dev, dtype=dt)
    gap_r[1:] = o[1:] / cl[:-1] - 1.0                                  # [T] close t-1 → open t
    move_r = cl / o - 1.0                                              # [T] open t → close t
    # outputs [B, T]: on CPU these are the returned numpy arrays themselves (written in place, block by block)
    pos = torch.empty(B, T, device=dev, dtype=dt)                      # position held at each close
    equity = torch.empty_like(pos)
    bar_ret = torch.empty_like(pos)
    pos[:, 0], equity[:, 0], bar_ret[:, 0] = 0.0, 1.0, 0.0
    rows, width = _block_shape(B, T - 1, block_elements)               # bars 1..T-1 are replayed (bar 0: flat)
    n = rows * width
    fbuf = [torch.empty(n, device=dev, dtype=dt) for _ in range(4)]
    sbuf = torch.empty(rows * (width + 1), device=dev, dtype=dt)
    mbuf = [torch.empty(n, device=dev, dtype=torch.bool) for _ in range(4)]
    one = torch.ones((), device=dev, dtype=dt)
    ent_acct, ent_t, ent_p, ent_l, ex_t, ex_code, ex_l = [], [], [], [], [], [], []
    for b0 in range(0, B, rows) if T > 1 else ():
        nb = min(rows, B - b0)
        lcarry = torch.zeros(nb, 1, device=dev, dtype=dt)                # log equity at the close before the block
        for t0 in range(1, T, width):
            t1 = min(T, t0 + width)
            w = t1 - t0
            last = t1 == T
            view = lambda buf, k=w: buf[:nb * k].view(nb, k)  # noqa: E731  contiguous [nb, k] scratch
            cur = pos[b0:b0 + nb, t0:t1]                                  # p_t, t in [t0, t1)
            cur.copy_(tg[b0:b0 + nb, t0 - 1:t1 - 1])
            prev = pos[b0:b0 + nb, t0 - 1:t1 - 1]                         # p_{t-1}
            gr, mr = gap_r[t0:t1], move_r[t0:t1]
            # f = (1 + p_{t-1}ρ^gap)(1 + p_tρ^mv)(1 - c·(|Δp| + c·min(p_{t-1}p_t, 0)))
            d, q, f, lg = (view(b) for b in fbuf)
            torch.sub(cur, prev, out=d).abs_()
            torch.mul(prev, cur, out=q).clamp_(max=0.0)
            d.add_(q, alpha=c)                                            # |Δp| + c·min(p_{t-1}p_t, 0)
            torch.addcmul(one, prev, gr, out=f)
            torch.addcmul(one, cur, mr, out=q)
            f.mul_(q)
            f.addcmul_(f, d, value=-c)
            if last:                                                      # the end exit at the last close
                f[:, -1].mul_(1.0 - c * cur[:, -1].abs())
            torch.sub(f, 1.0, out=bar_ret[b0:b0 + nb, t0:t1])
            torch.log(f, out=lg)
            torch.cumsum(lg, dim=1, out=f)
            f.add_(lcarry)                                                # f is now L_t
            torch.exp(f, out=equity[b0:b0 + nb, t0:t1])
            lcarry = f[:, -1:].clone()
            L = f.view(-1)
            # trades: sign changes of the position between bar t-1 and bar t
            s = sbuf[:nb * (w + 1)].view(nb, w + 1)
            torch.sign(pos[b0:b0 + nb, t0 - 1:t1], out=s)
            sp, sc = s[:, :-1], s[:, 1:]
            chg, held, opens, closes = (view(b) for b in mbuf)
            torch.ne(sc, sp, out=chg)
            torch.ne(sp, 0.0, out=held)
            torch.logical_and(chg, held, out=closes)
            torch.ne(sc, 0.0, out=held)
            torch.logical_and(chg, held, out=opens)
            oi = opens.view(-1).nonzero().view(-1)
            ro = torch.div(oi, w, rounding_mode="floor")
            to = oi - ro * w
            cv = cur[ro, to]
            ent_acct.append(ro + b0)
            ent_t.append(to + t0)
            ent_p.append(cv)
            ent_l.append(L[oi] - _post_log(cv, mr[to], to + t0 == T - 1, c))
            ci = closes.view(-1).nonzero().view(-1)
            rc = torch.div(ci, w, rounding_mode="floor")
            tc = ci - rc * w
            cx = cur[rc, tc]                                              # 0: back to flat; else a flip
            xt, xcode = tc + t0, torch.where(cx == 0, _SIGNAL, _FLIP)
            xl = L[ci] - _post_log(cx, mr[tc], tc + t0 == T - 1, c)
            if last:                                                      # still open at the last close: "end"
                em = cur[:, -1] != 0
                re = em.nonzero().view(-1)
                if nb == 1:
                    xt = torch.cat([xt, torch.full_like(re, T - 1)])
                    xcode = torch.cat([xcode, torch.full_like(re, _END)])
                    xl = torch.cat([xl, f[re, -1]])
                else:                                                     # merge each row's end after its closes
                    ends_before = torch.cumsum(em.long(), 0) - em.long()  # [nb] end exits in earlier rows
                    closes_upto = torch.cumsum(torch.bincount(rc, minlength=nb), 0)
                    dc = torch.arange(len(ci), device=dev) + ends_before[rc]
                    de = closes_upto[re] + ends_before[re]
                    m = len(ci) + len(re)
                    xt = torch.empty(m, device=dev, dtype=torch.long).index_copy_(0, dc, xt).index_copy_(
                        0, de, torch.full_like(re, T - 1))
                    xcode = torch.empty(m, device=dev, dtype=torch.long).index_copy_(0, dc, xcode).index_copy_(
                        0, de, torch.full_like(re, _END))
                    xl = torch.empty(m, device=dev, dtype=dt).index_copy_(0, dc, xl).index_copy_(0, de, f[re, -1])
            ex_t.append(xt)
            ex_code.append(xcode)
            ex_l.append(xl)
        pos[b0:b0 + nb, T - 1] = 0.0                                      # closed at the last close
    return BacktestResult(_ledger_frame(prices, ent_acct, ent_t, ent_p, ent_l, ex_t, ex_code, ex_l),
                          equity.cpu().numpy(), bar_ret.cpu().numpy(), pos.cpu().numpy())


def _ledger_frame(prices: Prices, ent_acct, ent_t, ent_p, ent_l, ex_t, ex_code, ex_l) -> pd.DataFrame:
    """The ledger DataFrame from the replay's entry and exit lists (aligned row by row once concatenated)."""
    dev, dt = prices.device, prices.dtype
    cat = lambda xs, dtype: torch.cat(xs) if xs else torch.zeros(0, device=dev, dtype=dtype)  # noqa: E731
    acct, et, ep, el = cat(ent_acct, torch.long), cat(ent_t, torch.long), cat(ent_p, dt), cat(ent_l, dt)
    xt, code, xl = cat(ex_t, torch.long), cat(ex_code, torch.long), cat(ex_l, dt)
    if len(et) != len(xt):  # cannot happen: every trade opened is closed (by a signal, a flip or the end)
        raise AssertionError(f"replay ledger: {len(et)} entries but {len(xt)} exits")
    is_end = code == _END
    exit_px = torch.where(is_end, prices.close[xt], prices.open[xt])
    bars = xt - et + (code >= _STOP).long()
    host = lambda x: x.cpu().numpy()  # noqa: E731
    code_np = host(code).astype(np.intp)
    return pd.DataFrame({
        "account": host(acct),
        "entry_t": host(et),
        "exit_t": host(xt),
        "side": host(torch.sign(ep).long()),
        "size": host(ep.abs().double()),
        "entry_price": host(prices.open[et].double()),
        "exit_price": host(exit_px.double()),
        "net_return": host(torch.expm1(xl - el).double()),
        "bars": host(bars),
        # strings, typed as the step simulator's ledger; a take from 5 categories, not millions of str()
        "exit_reason": pd.array(list(EXIT_REASONS), dtype="str").take(code_np),
    }, copy=False)
