"""The trading simulator of tradeloop: B accounts × T bars, batched in torch, CPU or CUDA — the reference of the
fill rules below.

`Simulator.step` is the definition: the trainer's environment steps it, and so do the evaluator's torch passes
(`shared.rollout.greedy_pass`) and `run_positions` with stops, targets, fixed fees or borrow. Two fast paths apply
the same rules, each checked against `Simulator.step` in every CI run:
- the vectorised replay (`shared/vector_replay.py`): `run_positions` without target/stop levels and with
  proportional costs (`tradeloop backtest`, the baselines); pinned by `tests/test_execution.py` and
  `tests/test_execution_fast.py`; the accounts it cannot replay (equity ≤ 0) are handed back to the simulator;
- the evaluator's compiled loop (`shared/_native_pass.c` via `shared.native`): the default evaluation path on the
  host CPU wherever a C compiler works; it takes its constants from the Python definitions (a header generated
  at build time) and is pinned to the eager torch pass by `tests/test_native_pass.py`.
Every backtest the evaluator reports names the path that produced it (`shared.report.SplitReport.engine`).

The convention, checkable by hand
---------------------------------
A fill at a bar's open turns the target fraction of equity into units at that open price, and the units are held
unchanged until the next fill, so equity = cash + units × price. A trade's net return is its own P&L (price moves
of its units, minus its costs) over the equity at its entry: a long at size 1 gives exactly exit / entry − 1, a
short at size s gives −s · (exit / entry − 1), at zero cost.

Fill rules
----------
- A target position in [-1, 1] (a signed fraction of equity) decided at the close of bar t fills at the open
  of bar t+1. No look-ahead: the decision at t never sees bar t+1.
- A fill happens when the target differs from the position held (the target of the last fill, `position`); a
  target equal to it holds the units (no fill, no cost). The fill sets units = target × equity / open, the equity
  taken at that open after any closing fill of the same bar. Between fills the fraction of equity the units are
  worth drifts with the price; nothing rebalances it.
- Costs per fill: `(cost_bps + slippage_bps) · 1e-4` of the traded notional |Δunits| × fill price, plus the fixed
  `fee` (in units of the starting equity, which is 1). A short held at a bar's close pays borrow on its notional
  there, `borrow_bps · 1e-4 / bars_per_year` a bar. Costs come out of cash. Slippage is extra bps, not a moved
  fill price; ledger prices are the raw bar prices.
- Profit target / stop loss are fractions of the entry price, fixed when a trade opens (`+inf` = none). On each
  bar a position is held, the bar's low/high are checked; when both levels are inside the bar's range the stop
  is assumed first (the conservative order). A level the open already gapped through fills at the open.
  After a stop or target the account is flat until the next decision (which may re-enter at the next open).
- A trade runs from a flat position to the next flat position. A change of size with the same sign (a resize)
  changes the units at its fill and stays in the trade; a sign flip is two fills at the same open: the old trade
  closes (its cost is the old trade's), then the new one opens on the equity left.
- A position still open on the last bar is closed at that bar's close, with `exit_reason = "end"`.
- Liquidation: a held position is also stopped at the price where its exit fill would leave the account no equity
  (cash + units·x − the fill's cost = 0: for a size-1 short without costs, twice its entry price), when that comes
  before its own stop; the fill is at that price (or at an open already past it), `exit_reason = "stop"`, net return
  −1 (below it when an open gapped past). An account with no equity left at an open (≤ 0) opens and resizes
  nothing: it stays flat, equity unchanged, bar returns 0, to the end of the pass or the next `reset`.

Trade accounting: each trade keeps the equity at its entry (before its entry fill, after the previous trade's
closing fill on a flip). `net_return = equity after its exit fill / equity at its entry − 1`: while it is open the
trade is the account's only source of P&L, so that is its own P&L, costs included, over its entry equity. When
the account is flat between trades, equity is exactly the product of `(1 + net_return)` over its trades.
Without a resize and at zero cost, `net_return = side · size · (exit_price / entry_price − 1)`
(`held_return` gives the closed form with costs).

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

from shared.costs import EXIT_REASONS, CostModel, held_return  # noqa: F401  (their home: shared.costs)

MAX_POSITION = 1.0
"""Targets are signed fractions of equity in [−MAX_POSITION, MAX_POSITION] (clamped there)."""
RUIN_CHECK_EVERY = 64
"""`run_positions` stops stepping once every account is `Simulator.ruined`, looking every this many bars."""
_SIGNAL, _FLIP, _STOP, _TARGET, _END = (EXIT_REASONS.index(r) for r in ("signal", "flip", "stop", "target", "end"))
LEDGER_COLUMNS = ("account", "entry_t", "exit_t", "side", "size", "entry_price", "exit_price",
                  "net_return", "bars", "exit_reason")


@dataclass(frozen=True)
class Prices:
    """OHLC as 1-D tensors on one device: the simulator's view of the bars."""

    open: torch.Tensor
    high: torch.Tensor
    low: torch.Tensor
    close: torch.Tensor

    @classmethod
    def from_bars(cls, bars, device=None, dtype=torch.float64) -> "Prices":
        return cls.from_arrays(bars.open, bars.high, bars.low, bars.close, device=device, dtype=dtype)

    @classmethod
    def from_arrays(cls, open, high, low, close, device=None, dtype=torch.float64) -> "Prices":
        def t(a) -> torch.Tensor:
            a = np.asarray(a, dtype=np.float64)
            # a read-only array (bars loaded from a file) is copied: torch warns on a tensor over one
            return torch.as_tensor(a if a.flags.writeable else a.copy(), dtype=dtype, device=device)

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
    trade_return_sq: torch.Tensor
    """Sum of the squared net returns of the trades closed during the step: with `trade_return` and `n_closed`, the
    moments of every trade though two close in one step."""
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
    """B accounts stepping through one price series, each at its own bar index `t`.

    State per account ([B] tensors): `position` (the target of the last fill: the signed fraction of equity the
    trade was opened or resized to), `units` (signed units held), `cash`, `equity` (cash + units × the close of
    bar t), the open trade's `entry_equity`, `entry_price`, `entry_size`, `entry_t`, `tp_price`, `sl_price` and
    `bars_in_trade`. Every account starts flat with cash = equity = 1."""

    def __init__(self, prices: Prices, n_accounts: int, costs: CostModel = CostModel(), *,
                 record_ledger: bool = False, ledger_flush_every: int = 256):
        if len(prices) < 2:
            raise ValueError("the simulator needs at least 2 bars")
        self.prices, self.costs, self.B = prices, costs, n_accounts
        dev, dt = prices.device, prices.dtype
        self.T = len(prices)
        self.rate, self.fee, self.borrow = costs.rate, float(costs.fee), costs.borrow_rate
        z = lambda: torch.zeros(n_accounts, device=dev, dtype=dt)  # noqa: E731
        self.t = torch.zeros(n_accounts, device=dev, dtype=torch.long)
        self.position, self.units, self.cash, self.equity = z(), z(), z() + 1.0, z() + 1.0
        self.entry_equity, self.entry_price, self.entry_size = z() + 1.0, z(), z()
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
    def ruined(self) -> torch.Tensor:
        """Accounts flat with no equity (no units, cash ≤ 0): the ruin rule of `step` refuses their every open, so
        every later step leaves them unchanged, with a bar return of 0 and nothing in the ledger."""
        return (self.units == 0) & (self.cash <= 0)

    @property
    def trade_return_open(self) -> torch.Tensor:
        """Net return of the open trade so far (marked at the current close, costs to date included; 0 when flat)."""
        return torch.where(self.position != 0, self.equity / self.entry_equity - 1.0, torch.zeros_like(self.equity))

    def reset(self, start: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Put the selected accounts flat at bar `start` with equity 1 (no trade is recorded: they must be flat,
        or their open trade is dropped — callers that need it recorded close it first)."""
        start = torch.as_tensor(start, device=self.t.device, dtype=torch.long).expand(self.B)
        m = torch.ones(self.B, dtype=torch.bool, device=self.t.device) if mask is None else mask
        zero = torch.zeros_like(self.equity)
        self.t = torch.where(m, start, self.t)
        self.position = torch.where(m, zero, self.position)
        self.units = torch.where(m, zero, self.units)
        self.cash = torch.where(m, zero + 1.0, self.cash)
        self.equity = torch.where(m, zero + 1.0, self.equity)
        self.entry_equity = torch.where(m, zero + 1.0, self.entry_equity)
        self.bars_in_trade = torch.where(m, torch.zeros_like(self.bars_in_trade), self.bars_in_trade)

    def _fill_cost(self, units: torch.Tensor, price: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Cost of fills of |units| at `price` where `mask` (0 elsewhere): bps of the notional plus the fixed fee."""
        return torch.where(mask, self.rate * units.abs() * price + self.fee, torch.zeros_like(price))

    # --- the step ------------------------------------------------------------------------------------------
    def step(self, target: torch.Tensor, take_profit: torch.Tensor | None = None,
             stop_loss: torch.Tensor | None = None) -> StepResult:
        """Move every account not yet at the last bar from bar t to t+1 (see the module docstring)."""
        P = self.prices
        live = ~self.done                                                     # [B]
        t1 = torch.clamp(self.t + 1, max=self.T - 1)
        o, h, l, cl = P.open[t1], P.high[t1], P.low[t1], P.close[t1]
        zero = torch.zeros_like(self.equity)
        inf = torch.full_like(self.equity, float("inf"))
        tp = inf if take_profit is None else torch.as_tensor(take_profit, dtype=zero.dtype, device=zero.device)
        sl = inf if stop_loss is None else torch.as_tensor(stop_loss, dtype=zero.dtype, device=zero.device)
        target = torch.where(live, torch.clamp(target.to(zero.dtype), -MAX_POSITION, MAX_POSITION), self.position)
        pos, u, cash, eq0 = self.position, self.units, self.cash, self.equity

        # 1) fills at the open of t+1; the units held overnight are marked at it
        fill = target != pos
        old_side, new_side = torch.sign(pos), torch.sign(target)
        closes = fill & (old_side != 0) & (new_side != old_side)             # old trade ends here
        opens = fill & (new_side != 0) & (new_side != old_side)              # a new trade starts here
        resize = fill & (old_side != 0) & (new_side == old_side)
        cash = torch.where(closes, cash + u * o, cash) - self._fill_cost(u, o, closes)
        u = torch.where(closes, zero, u)
        eq_fill = cash + u * o                      # equity at the open after any closing fill: what targets apply to
        closed_ret1 = torch.where(closes, eq_fill / self.entry_equity - 1.0, zero)
        if self.ledger_buf is not None:
            reason = torch.where(new_side == 0, _SIGNAL, _FLIP)
            self.ledger_buf.add(closes, self.entry_t, t1, old_side, self.entry_size, self.entry_price, o,
                                closed_ret1, reason)
        # ruin: an account whose equity at the open could not pay for the fill and for closing it again at that
        # price (costs at most 2·(rate·equity + fee): no fill trades more than the equity) opens and resizes
        # nothing (a resize keeps its units, which the liquidation below then closes at this open). A fixed fee so
        # never takes an account below 0; only a gap past the liquidation price leaves a debt
        solvent = eq_fill * (1.0 - 2.0 * self.rate) > 2.0 * self.fee
        refused = (opens | resize) & ~solvent
        target = torch.where(refused, torch.where(resize, pos, zero), target)
        opens, resize = opens & solvent, resize & solvent
        new_side = torch.sign(target)
        sets = opens | resize
        u_new = torch.where(sets, target * eq_fill / o, u)
        du = u_new - u
        cash = cash - du * o - self._fill_cost(du, o, sets)
        u = u_new
        entry_equity = torch.where(opens, eq_fill, self.entry_equity)
        entry_price = torch.where(opens, o, self.entry_price)
        entry_size = torch.where(opens, target.abs(), self.entry_size)
        entry_t = torch.where(opens, t1, self.entry_t)
        tp_price = torch.where(opens, torch.where(new_side > 0, o * (1.0 + tp), o * (1.0 - tp)), self.tp_price)
        sl_price = torch.where(opens, torch.where(new_side > 0, o * (1.0 - sl), o * (1.0 + sl)), self.sl_price)
        side = new_side

        # 2) intrabar: stop first, then target; a level the open is already past fills at the open. The stop is
        # the trade's own level or its liquidation price, whichever comes first: where an exit fill would leave
        # the account no equity (cash + u·x − rate·|u|·x − fee = 0)
        long, short = side > 0, side < 0
        au = torch.where(u != 0, u.abs(), torch.ones_like(u))
        liq = torch.where(long, (self.fee - cash) / (au * (1.0 - self.rate)),
                          (cash - self.fee) / (au * (1.0 + self.rate)))
        liquidating = torch.where(long, liq > sl_price, liq < sl_price)
        stop_level = torch.where(liquidating, liq, sl_price)
        stop_hit = (long & (l <= stop_level)) | (short & (h >= stop_level))
        tgt_hit = ~stop_hit & ((long & (h >= tp_price)) | (short & (l <= tp_price)))
        stop_px = torch.where(long, torch.minimum(o, stop_level), torch.maximum(o, stop_level))
        tgt_px = torch.where(long, torch.maximum(o, tp_price), torch.minimum(o, tp_price))
        exit_intrabar = stop_hit | tgt_hit
        last = t1 == self.T - 1
        exit_end = ~exit_intrabar & (side != 0) & last & live
        exit_px = torch.where(stop_hit, stop_px, torch.where(tgt_hit, tgt_px, cl))
        if self.borrow:                             # a short held at the close pays its borrow there
            cash = cash - torch.where(short & ~exit_intrabar, self.borrow * u.abs() * cl, zero)
        exits2 = exit_intrabar | exit_end
        cash = torch.where(exits2, cash + u * exit_px, cash) - self._fill_cost(u, exit_px, exits2)
        cash = torch.where(stop_hit & liquidating, torch.minimum(cash, zero), cash)   # liquidated: none left
        u = torch.where(exits2, zero, u)
        eq = cash + u * cl
        closed_ret2 = torch.where(exits2, cash / entry_equity - 1.0, zero)  # flat after the exit: equity = cash
        if self.ledger_buf is not None:
            reason = torch.where(stop_hit, _STOP, torch.where(tgt_hit, _TARGET, _END))
            self.ledger_buf.add(exits2 & live, entry_t, t1, side, entry_size, entry_price, exit_px, closed_ret2,
                                reason)
            self.ledger_buf.tick()
        pos = torch.where(exits2, zero, target)

        # commit (accounts at the last bar keep their state)
        keep = lambda new, old: torch.where(live, new, old)  # noqa: E731
        self.position, self.units = keep(pos, self.position), keep(u, self.units)
        self.cash, self.equity = keep(cash, self.cash), keep(eq, self.equity)
        self.entry_equity = keep(entry_equity, self.entry_equity)
        self.entry_price, self.entry_size = keep(entry_price, self.entry_price), keep(entry_size, self.entry_size)
        self.entry_t = keep(entry_t, self.entry_t)
        self.tp_price, self.sl_price = keep(tp_price, self.tp_price), keep(sl_price, self.sl_price)
        in_trade = pos != 0
        self.bars_in_trade = keep(torch.where(in_trade, self.bars_in_trade + 1, torch.zeros_like(self.bars_in_trade)),
                                  self.bars_in_trade)
        self.t = t1
        n_closed = (closes & live).long() + (exits2 & live).long()
        return StepResult(
            bar_return=torch.where(live & (eq0 > 0), eq / eq0 - 1.0, zero),
            trade_return=torch.where(live, closed_ret1 + closed_ret2, zero),
            n_closed=n_closed,
            trade_return_sq=torch.where(live, closed_ret1 * closed_ret1 + closed_ret2 * closed_ret2, zero),
            opened=opens & live,
            position=self.position,
        )

    def close_all(self) -> torch.Tensor:
        """Close open positions at the current bar's close (exit_reason "end"); returns their net returns."""
        open_ = self.position != 0
        cl = self.prices.close[self.t]
        cash = torch.where(open_, self.cash + self.units * cl, self.cash) - self._fill_cost(self.units, cl, open_)
        ret = torch.where(open_, cash / self.entry_equity - 1.0, torch.zeros_like(cash))
        if self.ledger_buf is not None:
            self.ledger_buf.add(open_, self.entry_t, self.t, torch.sign(self.position), self.entry_size,
                                self.entry_price, cl, ret, torch.full_like(self.t, _END))
        self.cash, self.equity = cash, cash
        self.units = torch.zeros_like(self.units)
        self.position = torch.zeros_like(self.position)
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
    engine: str = "simulator"
    """What produced it: "simulator" (`Simulator.step` bar by bar) or "replay" (the vectorised replay)."""


def run_positions(prices: Prices, targets, costs: CostModel = CostModel(), *, take_profit=None,
                  stop_loss=None, fast: bool = True) -> BacktestResult:
    """Replay target positions through the simulator: `targets[:, t]` is decided at the close of bar t.

    `targets` is [T] or [B, T] (the last column is unused: no bar follows it). Accounts start flat at bar 0;
    positions still open at the last bar close at its close. `take_profit` / `stop_loss` are fractions of the
    entry price ([B, T] like targets, or scalars), read when a trade opens.

    Without target/stop levels, fixed fee or borrow cost the whole path is known in advance, and `fast=True`
    takes the vectorised form of the same rules (`shared.vector_replay`, pinned to `Simulator.step` by
    equivalence tests); otherwise the step simulator runs bar by bar, until every account is ruined
    (`Simulator.ruined`: from there on the path is constant).
    """
    tg = torch.as_tensor(targets, dtype=prices.dtype, device=prices.device)
    if tg.dim() == 1:
        tg = tg.unsqueeze(0)
    B, T = tg.shape
    if T != len(prices):
        raise ValueError(f"targets cover {T} bars but the prices have {len(prices)}")
    if not torch.isfinite(tg).all():
        raise ValueError("targets must be finite")
    tg = tg.clamp(-MAX_POSITION, MAX_POSITION)
    if take_profit is None and stop_loss is None and fast and costs.proportional:
        from shared.vector_replay import _run_positions_vectorized  # it imports this module

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
        if t % RUIN_CHECK_EVERY == 0 and bool(sim.ruined.all()):     # the rest of the path is constant
            eq[:, t + 2:] = sim.equity.unsqueeze(1)
            break
    return BacktestResult(sim.ledger(), eq.cpu().numpy(), br.cpu().numpy(), pos.cpu().numpy())
