"""The vectorised replay: `shared.execution.run_positions` over a whole path of targets at once, for the paths
the rules allow it on (no target/stop levels, proportional costs only: `CostModel.proportional`).

It is the same fill rules as `Simulator.step` (`shared.execution`), rewritten over legs of constant units instead of
bars; it reads its cost rate from `CostModel`, its exit codes and ledger columns from `shared.execution`, and hands
the accounts whose equity reaches ≤ 0 back to the step simulator (`_replay_ruined`). `tests/test_execution_fast.py`
pins it to `Simulator.step` in every CI run: the same ledgers, curves to float64 rounding, over random targets,
flips, resizes and ruined accounts.

ML core: imports only torch, numpy and pandas.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from shared.execution import (_END, _FLIP, _SIGNAL, _STOP, EXIT_REASONS, BacktestResult, CostModel, Prices,
                              run_positions)


def _block_shape(B: int, n_bars: int, block_elements: int) -> tuple[int, int]:
    """Rows × bars of one replay block. Either whole rows (several accounts per block, when a row fits) or one
    account per block: so that trades come out already in (account, time) order with no sort."""
    block_elements = max(1, int(block_elements))
    if n_bars <= block_elements:
        return max(1, min(B, block_elements // max(1, n_bars))), max(1, n_bars)
    return 1, block_elements


def _run_positions_vectorized(prices: Prices, tg: torch.Tensor, costs: CostModel,
                              block_elements: int | None = None) -> BacktestResult:
    """`run_positions` without target/stop levels and with proportional costs only (`CostModel.proportional`):
    the same rules vectorised over bars, in cache-sized blocks.

    With no intrabar exits the position held over bar t is p_t = targets[:, t-1] (p_0 = 0), and a fill happens at
    the open of bar t where p_t ≠ p_{t-1}. A *leg* is a run of bars with one p: constant units. A leg of position
    p whose fill was at open o_e, with E its equity before that fill (after the previous trade's closing fill on a
    flip), holds u = p·E/o_e units, so at any price X inside it (c = cost rate)
        equity = E · a(X),   a(X) = 1 − κ + p·(X/o_e − 1),
    κ being its fill's cost over E: c|p| when it opens a trade, c|p − d| on a resize, where d = p'·r/a'(o_e) is
    the fraction of equity the previous leg's units (p', opened at o', r = o_e/o') are worth at that open; a flat
    leg has p = κ = 0 (a = 1). The leg ending at the open o_x of the next leg passes on
        E_next = E · g,   g = a(o_x) − c|p|·o_x/o_e on a close or flip (its closing fill), a(o_x) on a resize,
    so log E of every leg is a cumulative sum of log g over the legs before it, and the equity at each close is
    E·a(close) = cash + units × close, with the leg's cash E·(1 − κ − p) and units E·p/o_e. A trade's net
    return is E at its exit over E at its entry − 1 (both are leg equities: the exit's is the next leg's E, or E·g
    at the last close for the "end" exit). A resize's κ depends on its previous leg's κ through d, a chain only along
    consecutive resizes: κ is solved by fixed-point passes over the resize legs (each pass makes one more leg of
    every chain exact, and shrinks the error by ~c·|d|), until none changes.
    Per bar of a block: the fill mask, an integer cumsum (each bar's leg), two gathers of the legs' cash and units
    and one multiply-add; the logs, the exps and the cumsum of log g run per leg, and entries and exits are read
    off at the fills that change the sign. Blocks are [rows, bars] of about `block_elements`
    (default 2^17 on CPU, 2^25 on CUDA; tests force tiny ones), carrying each account's current leg (p, o_e, κ,
    log E) and last equity into the next. Blocks are whole rows or one account wide, so entries and exits come out
    in (account, time) order: the k-th exit of an account closes its k-th entry, no sort.
    Precision: log E is a running float64 sum over a block's legs, so a trade's log growth carries an absolute
    error ~1e-16 times the largest |log E| summed in its block.
    Ruin: held units can lose more than the equity (a size-1 long whose price falls ~100 % still paid its entry
    fill; a size-1 short whose price more than doubles). The step simulator liquidates a position where an exit
    would leave no equity and opens nothing after; the accounts whose bars reach that price, or whose leg's E or
    last close's equity is ≤ 0 (log E undefined there), are rare and replayed by the step simulator, the reference
    (`_replay_ruined`).
    """
    if not costs.proportional:
        raise ValueError("the vectorised replay takes proportional costs only (no fixed fee, no borrow)")
    if prices.device.type != "cpu":
        return _replay_ruined(prices, tg, costs, _replay_blocks(prices, tg, costs, block_elements or (1 << 25)))
    # CPU: one intra-op thread. The blocks are cache-sized, and handing each small op to a thread pool costs
    # more than it brings; with oversubscribed cores (a busy 2-core VM) the pool's barriers made it 10× slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = _replay_blocks(prices, tg, costs, block_elements or (1 << 17))
    finally:
        torch.set_num_threads(threads)
    return _replay_ruined(prices, tg, costs, res)


def _replay_ruined(prices: Prices, tg: torch.Tensor, costs: CostModel, res: BacktestResult) -> BacktestResult:
    """`res` with the accounts whose equity reached ≤ 0 at a fill or at the last close (the replay's log E is
    undefined there: NaN equity or net returns) replayed bar by bar by the step simulator and spliced in."""
    bad = ~np.isfinite(res.equity).all(axis=1)
    nr = res.ledger["net_return"].to_numpy()
    if not np.isfinite(nr).all():
        bad[np.unique(res.ledger["account"].to_numpy()[~np.isfinite(nr)])] = True
    if not bad.any():
        return res
    idx = np.flatnonzero(bad)
    ref = run_positions(prices, tg[torch.as_tensor(idx, device=tg.device)], costs, fast=False)
    equity, bar_returns, positions = res.equity.copy(), res.bar_returns.copy(), res.positions.copy()
    equity[idx], bar_returns[idx], positions[idx] = ref.equity, ref.bar_returns, ref.positions
    theirs = ref.ledger.assign(account=idx[ref.ledger["account"].to_numpy()])
    ledger = pd.concat([res.ledger[~np.isin(res.ledger["account"].to_numpy(), idx)], theirs], ignore_index=True)
    ledger = ledger.sort_values("account", kind="stable").reset_index(drop=True)
    return BacktestResult(ledger, equity, bar_returns, positions, engine="replay")


def _replay_blocks(prices: Prices, tg: torch.Tensor, costs: CostModel, block_elements: int) -> BacktestResult:
    """The block loop of `_run_positions_vectorized` (see there)."""
    B, T = tg.shape
    c = float(costs.rate)
    dev, dt = prices.device, prices.dtype
    o, cl = prices.open, prices.close
    # outputs [B, T]: on CPU these are the returned numpy arrays themselves (written in place, block by block)
    pos = torch.empty(B, T, device=dev, dtype=dt)                      # position held at each close
    equity = torch.empty_like(pos)
    bar_ret = torch.empty_like(pos)
    pos[:, 0], equity[:, 0], bar_ret[:, 0] = 0.0, 1.0, 0.0
    rows, width = _block_shape(B, T - 1, block_elements)               # bars 1..T-1 are replayed (bar 0: flat)
    n = rows * width
    fbuf = [torch.empty(n, device=dev, dtype=dt) for _ in range(2)]
    chg_buf = torch.empty(n, device=dev, dtype=torch.bool)
    id_buf = torch.empty(n, device=dev, dtype=torch.long)
    pos_flat = pos.view(-1)
    sel = lambda x, i: x.index_select(0, i)  # noqa: E731  1-D gathers (cheaper than advanced indexing)
    ent_acct, ent_t, ent_p, ent_l, ex_t, ex_code, ex_l = [], [], [], [], [], [], []
    for b0 in range(0, B, rows) if T > 1 else ():
        nb = min(rows, B - b0)
        ar = torch.arange(nb, device=dev)
        # the current leg of each account, carried from block to block: entry open, κ, log E; and the last equity
        c_oe = torch.ones(nb, device=dev, dtype=dt)
        c_kap = torch.zeros(nb, device=dev, dtype=dt)
        c_le = torch.zeros(nb, device=dev, dtype=dt)
        c_eq = torch.ones(nb, device=dev, dtype=dt)
        for t0 in range(1, T, width):
            t1 = min(T, t0 + width)
            w = t1 - t0
            last = t1 == T
            cur = pos[b0:b0 + nb, t0:t1]                                  # p_t, t in [t0, t1)
            cur.copy_(tg[b0:b0 + nb, t0 - 1:t1 - 1])
            prev = pos[b0:b0 + nb, t0 - 1:t1 - 1]                         # p_{t-1}
            chg = chg_buf[:nb * w].view(nb, w)
            torch.ne(cur, prev, out=chg)                                  # a fill at the open of bar t
            # legs: each row's carried leg (index r + fills in rows before r), then one leg per fill, row-major
            legid = id_buf[:nb * w]
            torch.cumsum(chg.view(-1), 0, out=legid)
            if nb > 1:
                legid.view(nb, w).add_(ar.unsqueeze(1))
            ci = chg.view(-1).nonzero().view(-1)                          # fills, flat index
            rc = torch.div(ci, w, rounding_mode="floor")
            tc = ci - rc * w
            n_legs = nb + len(ci)
            lid = legid.index_select(0, ci)                               # the leg each fill starts
            per_row = torch.bincount(rc, minlength=nb)
            cidx = ar + torch.cumsum(per_row, 0) - per_row                # each row's carried leg
            lp = torch.empty(n_legs, device=dev, dtype=dt)
            loe, kap, lg = torch.empty_like(lp), torch.empty_like(lp), torch.empty_like(lp)
            flat = (rc + b0) * T + (tc + t0)                              # the fills in pos, flattened
            p_new, p_old = sel(pos_flat, flat), sel(pos_flat, flat - 1)
            o_f = sel(o, tc + t0)
            lp.index_copy_(0, cidx, prev[:, 0]).index_copy_(0, lid, p_new)
            loe.index_copy_(0, cidx, c_oe).index_copy_(0, lid, o_f)
            # the leg before each fill: its end factor g at the fill's open
            pl = lid - 1
            r = o_f / sel(loe, pl)
            flip = torch.sign(p_new) != torch.sign(p_old)                 # the previous trade closes here
            kap.index_copy_(0, cidx, c_kap).index_copy_(0, lid, c * p_new.abs())  # opens; flat legs: p = κ = 0
            rz = (~flip).nonzero().view(-1)                               # resizes: κ by fixed-point passes
            if len(rz):
                lz, pz, rr, pp = sel(lid, rz), sel(p_new, rz), sel(r, rz), sel(p_old, rz)
                for _ in range(len(rz) + 1):
                    d = pp * rr / (1.0 - sel(kap, lz - 1) + pp * (rr - 1.0))
                    k_new = c * (pz - d).abs()
                    if torch.equal(k_new, sel(kap, lz)):
                        break
                    kap.index_copy_(0, lz, k_new)
            g = 1.0 - sel(kap, pl) + p_old * (r - 1.0)
            g.sub_(torch.where(flip, c * p_old.abs() * r, torch.zeros_like(r)))
            # log E of every leg: the carried leg's, plus log g at each fill, summed along the row
            lg.index_copy_(0, cidx, c_le).index_copy_(0, lid, torch.log(g))
            le = torch.cumsum(lg, 0)
            row_of = torch.empty(n_legs, device=dev, dtype=torch.long).index_copy_(0, cidx, ar).index_copy_(0, lid, rc)
            le.sub_(sel(sel(le, cidx) - c_le, row_of))
            # each leg's cash E·(1 − κ − p) and units E·p/o_e; at every close, equity = cash + units × close
            e_leg = torch.exp(le)
            units = e_leg * lp / loe
            cash = e_leg * (1.0 - kap - lp)
            eq_out = equity[b0:b0 + nb, t0:t1]
            eqv = eq_out if eq_out.is_contiguous() else fbuf[0][:nb * w].view(nb, w)   # written in place if it can
            tmp = fbuf[1][:nb * w].view(nb, w)
            torch.index_select(cash, 0, legid, out=eqv.view(-1))
            torch.index_select(units, 0, legid, out=tmp.view(-1))
            eqv.addcmul_(tmp, cl[t0:t1])
            # liquidation (`Simulator.step`): where a bar's low (long) or high (short) would leave an exit fill no
            # equity, the account is the step simulator's (marked NaN here, replayed by `_replay_ruined`)
            worst = torch.where(tmp < 0, prices.high[t0:t1], prices.low[t0:t1])
            exit_eq = eqv + tmp * (worst - cl[t0:t1]) - c * tmp.abs() * worst
            eqv.masked_fill_((exit_eq <= 1e-9 * eqv.abs()).any(dim=1, keepdim=True), float("nan"))
            if last:                                                      # the end exit's fill at the last close
                eqv[:, -1].sub_(c * cl[T - 1] * tmp[:, -1].abs())
            if eqv is not eq_out:
                eq_out.copy_(eqv)
            br = bar_ret[b0:b0 + nb, t0:t1]
            torch.div(eqv[:, 1:], eqv[:, :-1], out=br[:, 1:])
            torch.div(eqv[:, 0], c_eq, out=br[:, 0])
            br.sub_(1.0)
            lend = legid.view(nb, w)[:, -1]
            c_oe, c_kap, c_le, c_eq = sel(loe, lend), sel(kap, lend), sel(le, lend), eqv[:, -1].clone()
            # trades: the fills that change the sign; entries and exits at a leg's E
            oi = (flip & (p_new != 0)).nonzero().view(-1)
            ent_acct.append(sel(rc, oi) + b0)
            ent_t.append(sel(tc, oi) + t0)
            ent_p.append(sel(p_new, oi))
            ent_l.append(sel(le, sel(lid, oi)))
            xi = (flip & (p_old != 0)).nonzero().view(-1)
            rx = sel(rc, xi)
            xt = sel(tc, xi) + t0
            xcode, xl = torch.where(sel(p_new, xi) == 0, _SIGNAL, _FLIP), sel(le, sel(lid, xi))
            if last:                                                      # still open at the last close: "end"
                em = cur[:, -1] != 0
                re = em.nonzero().view(-1)
                l_end = torch.log(eqv[re, -1])
                if nb == 1:
                    xt = torch.cat([xt, torch.full_like(re, T - 1)])
                    xcode = torch.cat([xcode, torch.full_like(re, _END)])
                    xl = torch.cat([xl, l_end])
                else:                                                     # merge each row's end after its closes
                    ends_before = torch.cumsum(em.long(), 0) - em.long()  # [nb] end exits in earlier rows
                    closes_upto = torch.cumsum(torch.bincount(rx, minlength=nb), 0)
                    dc = torch.arange(len(xi), device=dev) + ends_before[rx]
                    de = closes_upto[re] + ends_before[re]
                    m = len(xi) + len(re)
                    xt = torch.empty(m, device=dev, dtype=torch.long).index_copy_(0, dc, xt).index_copy_(
                        0, de, torch.full_like(re, T - 1))
                    xcode = torch.empty(m, device=dev, dtype=torch.long).index_copy_(0, dc, xcode).index_copy_(
                        0, de, torch.full_like(re, _END))
                    xl = torch.empty(m, device=dev, dtype=dt).index_copy_(0, dc, xl).index_copy_(0, de, l_end)
            ex_t.append(xt)
            ex_code.append(xcode)
            ex_l.append(xl)
        pos[b0:b0 + nb, T - 1] = 0.0                                      # closed at the last close
    return BacktestResult(_ledger_frame(prices, ent_acct, ent_t, ent_p, ent_l, ex_t, ex_code, ex_l),
                          equity.cpu().numpy(), bar_ret.cpu().numpy(), pos.cpu().numpy(), engine="replay")


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
