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
        df["exit_reason"] = pd.Categorical.from_codes(reason, categories=list(EXIT_REASONS)).astype(str)
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


def _run_positions_vectorized(prices: Prices, tg: torch.Tensor, costs: CostModel,
                              max_elements: int = 1 << 24) -> BacktestResult:
    """`run_positions` without target/stop levels, vectorised over bars (and chunked over accounts).

    With no intrabar exits the position held over bar t is the target decided at close t-1, so every bar's
    factors are known at once; a trade's growth is a segment product, computed as a sum of log-factors:
      gap_t    = 1 + p_{t-1}·(open_t/close_{t-1} - 1)        → the trade held into bar t
      fill_t   = (1 - c|p_{t-1}|) on a close, (1 - c|Δ|) on a resize → the trade held into bar t
      open_t   = (1 - c|p_t|) on an open                     → the trade held out of bar t
      move_t   = 1 + p_t·(close_t/open_t - 1)                → the trade held out of bar t
      end      = (1 - c|p_{T-1}|) at the last close          → the trade held out of the last bar
    """
    B, T = tg.shape
    c = costs.rate
    dev, dt = prices.device, prices.dtype
    o, h, l, cl = prices.open, prices.high, prices.low, prices.close
    gap_r = torch.zeros(T, device=dev, dtype=dt)
    gap_r[1:] = o[1:] / cl[:-1] - 1.0                                  # [T] close t-1 → open t
    move_r = cl / o - 1.0                                              # [T] open t → close t
    rows = max(1, max_elements // T)
    ledgers, equities, rets, poss = [], [], [], []
    for b0 in range(0, B, rows):
        cur = torch.zeros(min(rows, B - b0), T, device=dev, dtype=dt)  # [b, T] position held over bar t
        cur[:, 1:] = tg[b0:b0 + rows, :-1]
        prev = torch.zeros_like(cur)
        prev[:, 1:] = cur[:, :-1]
        s_prev, s_cur = torch.sign(prev), torch.sign(cur)
        closes = (s_prev != 0) & (s_cur != s_prev)
        opens = (s_cur != 0) & (s_cur != s_prev)
        resize = (s_prev != 0) & (s_cur == s_prev)
        f_gap = 1.0 + prev * gap_r
        f_close = torch.where(closes, 1.0 - c * prev.abs(), torch.where(resize, 1.0 - c * (cur - prev).abs(), 1.0))
        f_open = torch.where(opens, 1.0 - c * cur.abs(), 1.0)
        f_move = 1.0 + cur * move_r
        f_end = torch.ones_like(cur)
        f_end[:, -1] = 1.0 - c * cur[:, -1].abs()
        # account equity: product of every factor, bar by bar
        f_bar = f_gap * f_close * f_open * f_move * f_end                # [b, T]
        log_eq = torch.cumsum(torch.log(f_bar), dim=1)
        equity = torch.exp(log_eq)
        bar_ret = torch.zeros_like(cur)
        bar_ret[:, 1:] = f_bar[:, 1:] - 1.0
        # trades: ids in (account, bar) order; the trade held into bar t is the last one opened before t
        flat_open = opens.reshape(-1)
        trade_id = torch.cumsum(flat_open.long(), 0).reshape(cur.shape) - 1   # id of the trade opened at or before t
        n = int(flat_open.sum())
        log_g = torch.zeros(n + 1, device=dev, dtype=dt)                # slot n = "no trade"
        into = torch.where(s_prev != 0, trade_id - opens.long(), n)      # trade held into bar t
        outof = torch.where(s_cur != 0, trade_id, n)                     # trade held out of bar t
        log_g.index_add_(0, into.reshape(-1), torch.log(f_gap * f_close).reshape(-1))
        log_g.index_add_(0, outof.reshape(-1), torch.log(f_open * f_move * f_end).reshape(-1))
        acct, entry_t = opens.nonzero(as_tuple=True)
        # exits: at an open (signal or flip), and at the last close for what is still open (the "end")
        xa, xt = closes.nonzero(as_tuple=True)
        ea = (s_cur[:, -1] != 0).nonzero(as_tuple=True)[0]
        et = torch.full_like(ea, T - 1)
        exit_acct, exit_t = torch.cat([xa, ea]), torch.cat([xt, et])
        is_end = torch.cat([torch.zeros_like(xa, dtype=torch.bool), torch.ones_like(ea, dtype=torch.bool)])
        order = torch.argsort(exit_acct * (2 * T) + 2 * exit_t + is_end.long())  # a flip's close before the end
        exit_acct, exit_t, is_end = exit_acct[order], exit_t[order], is_end[order]
        reason = torch.where(is_end, _END, torch.where(s_cur[exit_acct, exit_t] == 0, _SIGNAL, _FLIP))
        exit_px = torch.where(is_end, cl[exit_t], o[exit_t])
        side = s_cur[acct, entry_t]
        led = pd.DataFrame({
            "account": (acct + b0).cpu().numpy().astype(np.int64),
            "entry_t": entry_t.cpu().numpy().astype(np.int64),
            "exit_t": exit_t.cpu().numpy().astype(np.int64),
            "side": side.cpu().numpy().astype(np.int64),
            "size": cur[acct, entry_t].abs().cpu().numpy(),
            "entry_price": o[entry_t].cpu().numpy(),
            "exit_price": exit_px.cpu().numpy(),
            "net_return": torch.expm1(log_g[:n]).cpu().numpy(),
        })
        r = reason.cpu().numpy()
        led["bars"] = led["exit_t"] - led["entry_t"] + (r >= _STOP).astype(np.int64)
        led["exit_reason"] = pd.Categorical.from_codes(r, categories=list(EXIT_REASONS)).astype(str)
        pos_close = cur.clone()
        pos_close[:, -1] = 0.0
        ledgers.append(led)
        equities.append(equity.cpu().numpy())
        rets.append(bar_ret.cpu().numpy())
        poss.append(pos_close.cpu().numpy())
    ledger = pd.concat(ledgers, ignore_index=True).sort_values(["account", "exit_t", "entry_t"], kind="stable")
    return BacktestResult(ledger.reset_index(drop=True), np.concatenate(equities), np.concatenate(rets),
                          np.concatenate(poss))
