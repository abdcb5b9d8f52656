"""The Triton kernel of `shared.fused` (kept apart so that importing `shared.fused` never imports Triton).

Each block below names the torch code it transcribes; `tests/test_fused_pass.py` pins the two together.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sign(x):
    return tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0)).to(x.dtype)


@triton.jit
def _dense(x_ptr, w_ptr, b_ptr, y_ptr, add_ptr, add_rows, SCR: tl.constexpr, BB: tl.constexpr, KD: tl.constexpr,
           N: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, RELU: tl.constexpr, ADD: tl.constexpr,
           DOT: tl.constexpr):
    """y[r, :N] = act(x[r, :KD] · W + b (+ add[add_rows[r], :N])) for the BB rows of a scratch region (row stride
    SCR); W is KD × N row-major (the transposed nn.Linear weight). float32, IEEE products."""
    rb = tl.arange(0, BB)
    for n0 in range(0, N, BN):
        cn = n0 + tl.arange(0, BN)
        nm = cn < N
        acc = tl.zeros([BB, BN], dtype=tl.float32)
        for k0 in range(0, KD, BK):
            ck = k0 + tl.arange(0, BK)
            km = ck < KD
            x = tl.load(x_ptr + rb[:, None] * SCR + ck[None, :], mask=km[None, :], other=0.0)
            w = tl.load(w_ptr + ck[:, None] * N + cn[None, :], mask=km[:, None] & nm[None, :], other=0.0)
            if DOT:
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.sum(x[:, :, None] * w[None, :, :], axis=1)
        acc += tl.load(b_ptr + cn, mask=nm, other=0.0)[None, :]
        if ADD:
            acc += tl.load(add_ptr + add_rows[:, None] + cn[None, :], mask=nm[None, :], other=0.0)
        if RELU:
            acc = tl.maximum(acc, 0.0)
        tl.store(y_ptr + rb[:, None] * SCR + cn[None, :], acc, mask=nm[None, :])


@triton.jit
def _c51_q(lg_ptr, q_ptr, z_ptr, SCR: tl.constexpr, BB: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
           V_OFF: tl.constexpr, B_OFF: tl.constexpr, NB: tl.constexpr, Q_OFF: tl.constexpr):
    """One branch of one ensemble member: dueling logits V + A − mean_a A (`Agent.head`), softmax over the atoms
    and Q = Σ_i z_i p_i (`Agent.q_values`); writes the NB Q values at scratch column Q_OFF."""
    rb = tl.arange(0, BB)
    ca = tl.arange(0, AP)
    cj = tl.arange(0, 4)
    am = ca < A
    jm = cj < NB
    v = tl.load(lg_ptr + rb[:, None] * SCR + V_OFF + ca[None, :], mask=am[None, :], other=0.0)          # BB × AP
    m3 = jm[None, :, None] & am[None, None, :]
    adv = tl.load(lg_ptr + rb[:, None, None] * SCR + B_OFF + cj[None, :, None] * A + ca[None, None, :],
                  mask=m3, other=0.0)                                                                   # BB × 4 × AP
    mean = tl.sum(adv, axis=1) / NB
    lg = v[:, None, :] + adv - mean[:, None, :]
    lg = tl.where(m3, lg, -1e30)
    mx = tl.max(lg, axis=2)
    e = tl.where(m3, tl.exp(lg - mx[:, :, None]), 0.0)
    den = tl.where(jm[None, :], tl.sum(e, axis=2), 1.0)                    # (1 for the padding actions)
    p = e / den[:, :, None]
    z = tl.load(z_ptr + ca, mask=am, other=0.0)
    q = tl.sum(p * z[None, None, :], axis=2)                                                            # BB × 4
    tl.store(q_ptr + rb[:, None] * SCR + Q_OFF + cj[None, :], q, mask=jm[None, :])


@triton.jit
def _pick(x, cols, j):
    """x[r, j[r]] of a BB × C tile."""
    return tl.sum(tl.where(cols[None, :] == j[:, None], x, 0.0), axis=1)


@triton.jit(do_not_specialize=["T", "B", "S"])   # one compiled kernel whatever the lengths
def greedy_pass_kernel(
        open_ptr, high_ptr, low_ptr, close_ptr, vol_ptr, regime_ptr, e1_ptr, T,
        starts_ptr, B, S,
        wp_ptr, bp_ptr, w1p_ptr, bz_ptr, w2_ptr, b2_ptr, wh_ptr, bh_ptr, z_ptr, phi_ptr,
        wi1_ptr, bi1_ptr, wi2_ptr, bi2_ptr,
        maturity_ptr, gate_ptr, rconf_ptr, sizes_ptr, plans_ptr,
        c_ptr,
        r64_ptr, r32_ptr, rl_ptr, ev64_ptr, evf_ptr, final_ptr, scratch_ptr,
        BB: tl.constexpr, P: tl.constexpr, DP: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, K: tl.constexpr,
        KP: tl.constexpr, A: tl.constexpr, AP: tl.constexpr, NS: tl.constexpr, NE: tl.constexpr,
        MT: tl.constexpr, MTP: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
        SCR: tl.constexpr, O_X: tl.constexpr, O_P1: tl.constexpr, O_H1: tl.constexpr, O_H2: tl.constexpr,
        O_LG: tl.constexpr, O_Q: tl.constexpr, HS: tl.constexpr):
    pid = tl.program_id(0)
    rb = tl.arange(0, BB)
    acct = pid * BB + rb
    am = acct < B
    acct64 = acct.to(tl.int64)
    # per program: BB rows of SCR columns, then the IQN rows (BB·MTP in, BB·MTP hidden; HS columns each)
    scr = scratch_ptr + pid * (BB * SCR + 2 * BB * MTP * HS)
    iq = scr + BB * SCR
    NB_ALL: tl.constexpr = 3 + NS + NE
    W_K: tl.constexpr = (1 + NB_ALL) * A           # logits columns per ensemble member: V, then every branch's A
    c4 = tl.arange(0, 4)
    ck = tl.arange(0, KP)
    chp = tl.arange(0, HP)
    cmt = tl.arange(0, MTP)
    zero = tl.zeros([BB], dtype=tl.float64)

    # state: Simulator.reset (flat, equity 1) and PortfolioTracker.__init__ priors
    t = tl.load(starts_ptr + acct, mask=am, other=0).to(tl.int64)
    pos, eq, growth = zero, zero + 1.0, zero + 1.0
    entry_price, entry_size, entry_t = zero, zero, t * 0
    tp_price, sl_price = zero, zero
    bars = t * 0
    win_rate, mean_win, mean_loss = zero + 0.5, zero + tl.load(c_ptr + 8), zero + tl.load(c_ptr + 8)
    dsr_a, dsr_b, dsr = zero, zero + tl.load(c_ptr + 7), zero
    # float64 constants come from a float64 buffer (a Python float in a Triton kernel is a float32 constant)
    rate, kelly_floor = tl.load(c_ptr + 0), tl.load(c_ptr + 1)
    cvar_limit, min_hold, dsr_size_cut = tl.load(c_ptr + 2), tl.load(c_ptr + 3), tl.load(c_ptr + 4)
    decay, eta = tl.load(c_ptr + 5), tl.load(c_ptr + 6)
    eps_loss, eps_b, eps_var = tl.load(c_ptr + 9), tl.load(c_ptr + 10), tl.load(c_ptr + 11)
    m = tl.minimum(tl.maximum(tl.load(maturity_ptr), 1e-3), 1.0)                   # float32, as in act
    gate = tl.load(gate_ptr)
    cvar_floor = -(cvar_limit.to(tl.float32)) / m                                  # float32, as in act
    hold = min_hold.to(tl.float32) * m
    cut = (dsr_size_cut.to(tl.float32) * m).to(tl.float64)

    row = acct64 - B                                # the records' row of (step i, account): i·B + account
    for i in range(0, S):
        row += B
        # ---- portfolio_features (shared/rollout.py) ------------------------------------------------------
        vol_t = tl.load(vol_ptr + t)
        close_t = tl.load(close_ptr + t)
        in_trade = pos != 0
        side0 = _sign(pos)
        upnl = tl.where(in_trade, (growth - 1.0) / vol_t, 0.0)
        upnl = tl.minimum(tl.maximum(upnl, -20.0), 20.0) / 5.0
        barsf = tl.minimum(bars.to(tl.float64) / 50.0, 4.0)
        tp_ok = in_trade & (tl.abs(tp_price) < float("inf"))
        sl_ok = in_trade & (tl.abs(sl_price) < float("inf"))
        tp_d = tl.where(tp_ok, side0 * (tp_price / close_t - 1.0) / vol_t, 0.0)
        sl_d = tl.where(sl_ok, side0 * (1.0 - sl_price / close_t) / vol_t, 0.0)
        tp_d = tl.minimum(tl.maximum(tp_d, -20.0), 20.0) / 10.0
        sl_d = tl.minimum(tl.maximum(sl_d, -20.0), 20.0) / 10.0
        bk = mean_win / tl.maximum(mean_loss, eps_loss)                                  # PortfolioTracker.kelly
        kelly = win_rate - (1.0 - win_rate) / tl.maximum(bk, eps_b)
        kelly = tl.minimum(tl.maximum(kelly, -1.0), 1.0)
        f0, f1, f2 = pos.to(tl.float32), upnl.to(tl.float32), barsf.to(tl.float32)
        f3, f4, f5 = tp_d.to(tl.float32), sl_d.to(tl.float32), kelly.to(tl.float32)
        f6 = (win_rate - 0.5).to(tl.float32)
        f7 = tl.minimum(tl.maximum(dsr, -5.0), 5.0).to(tl.float32)
        xs = scr + rb * SCR + O_X
        tl.store(xs + 0, f0)
        tl.store(xs + 1, f1)
        tl.store(xs + 2, f2)
        tl.store(xs + 3, f3)
        tl.store(xs + 4, f4)
        tl.store(xs + 5, f5)
        tl.store(xs + 6, f6)
        tl.store(xs + 7, f7)
        rp = r32_ptr + row * (4 + P) + 4
        tl.store(rp + 0, f0, mask=am)
        tl.store(rp + 1, f1, mask=am)
        tl.store(rp + 2, f2, mask=am)
        tl.store(rp + 3, f3, mask=am)
        tl.store(rp + 4, f4, mask=am)
        tl.store(rp + 5, f5, mask=am)
        tl.store(rp + 6, f6, mask=am)
        tl.store(rp + 7, f7, mask=am)
        tl.debug_barrier()

        # ---- Agent.head: port MLP, trunk, C51 logits ---------------------------------------------------------
        _dense(scr + O_X, wp_ptr, bp_ptr, scr + O_P1, e1_ptr, t, SCR, BB, P, DP, BK, BN, True, False, DOT)
        tl.debug_barrier()
        # the trunk's first layer: its embedding half and bias are E1[t] (precomputed); zero bias here
        _dense(scr + O_P1, w1p_ptr, bz_ptr, scr + O_H1, e1_ptr, t * H, SCR, BB, DP, H, BK, BN, True, True, DOT)
        tl.debug_barrier()
        _dense(scr + O_H1, w2_ptr, b2_ptr, scr + O_H2, e1_ptr, t, SCR, BB, H, H, BK, BN, True, False, DOT)
        tl.debug_barrier()
        _dense(scr + O_H2, wh_ptr, bh_ptr, scr + O_LG, e1_ptr, t, SCR, BB, H, K * W_K, BK, BN, False, False, DOT)
        tl.debug_barrier()
        for k in tl.static_range(K):
            _c51_q(scr + O_LG, scr + O_Q, z_ptr, SCR, BB, A, AP, k * W_K, k * W_K + A, 3, k * 8)
            _c51_q(scr + O_LG, scr + O_Q, z_ptr, SCR, BB, A, AP, k * W_K, k * W_K + 4 * A, NS, k * 8 + 3)
            _c51_q(scr + O_LG, scr + O_Q, z_ptr, SCR, BB, A, AP, k * W_K, k * W_K + (4 + NS) * A, NE,
                   k * 8 + 3 + NS)
        # ---- IQN tail quantiles (Agent.quantiles at the act_taus ≤ α; φ precomputed) -------------------------
        # rows (account r, tail quantile j) = r·MTP + j of the IQN scratch (row stride HS), all M_α at once
        riq = tl.arange(0, BB * MTP)
        hmask = (chp[None, :] < H) & ((riq % MTP) < MT)[:, None]
        h2 = tl.load(scr + (riq // MTP)[:, None] * SCR + O_H2 + chp[None, :], mask=hmask, other=0.0)
        phi = tl.load(phi_ptr + (riq % MTP)[:, None] * H + chp[None, :], mask=hmask, other=0.0)
        tl.store(iq + riq[:, None] * HS + chp[None, :], h2 * phi, mask=chp[None, :] < H)
        tl.debug_barrier()
        _dense(iq, wi1_ptr, bi1_ptr, iq + BB * MTP * HS, e1_ptr, t, HS, BB * MTP, H, H, BK, BN, True, False,
               DOT)
        tl.debug_barrier()
        _dense(iq + BB * MTP * HS, wi2_ptr, bi2_ptr, iq, e1_ptr, t, HS, BB * MTP, H, 3, BK, 4, False, False,
               DOT)
        tl.debug_barrier()

        # ---- act (shared/agent.py): greedy per branch on the ensemble mean ------------------------------------
        qmask = (ck[None, :, None] < K) & (c4[None, None, :] < 3)
        qd = tl.load(scr + rb[:, None, None] * SCR + O_Q + ck[None, :, None] * 8 + c4[None, None, :],
                     mask=qmask, other=0.0)                                                       # BB × KP × 4
        qm_dir = tl.sum(qd, axis=1) / K
        d = tl.argmax(tl.where(c4[None, :] < 3, qm_dir, float("-inf")), axis=1)
        qs = tl.load(scr + rb[:, None, None] * SCR + O_Q + ck[None, :, None] * 8 + 3 + c4[None, None, :],
                     mask=(ck[None, :, None] < K) & (c4[None, None, :] < NS), other=0.0)
        s = tl.argmax(tl.where(c4[None, :] < NS, tl.sum(qs, axis=1) / K, float("-inf")), axis=1)
        qe = tl.load(scr + rb[:, None, None] * SCR + O_Q + ck[None, :, None] * 8 + 3 + NS + c4[None, None, :],
                     mask=(ck[None, :, None] < K) & (c4[None, None, :] < NE), other=0.0)
        e = tl.argmax(tl.where(c4[None, :] < NE, tl.sum(qe, axis=1) / K, float("-inf")), axis=1)
        edge = tl.maximum(_pick(qm_dir, c4, d * 0), _pick(qm_dir, c4, d * 0 + 2)) - _pick(qm_dir, c4, d * 0 + 1)
        quant = tl.load(iq + (rb[:, None, None] * MTP + cmt[None, :, None]) * HS + c4[None, None, :],
                        mask=(cmt[None, :, None] < MT) & (c4[None, None, :] < 3), other=0.0)     # BB × MTP × 4
        cvar_dir = tl.sum(quant, axis=1) / MT

        regime = tl.load(regime_ptr + t)
        sidef = tl.where(d == 0, -1.0, tl.where(d == 2, 1.0, 0.0)).to(tl.float64)
        size = tl.load(sizes_ptr + s)
        kel = tl.minimum(tl.maximum(kelly_floor + f5.to(tl.float64), kelly_floor), 1.0)
        dsr_scale = 1.0 - cut * tl.minimum(tl.maximum(-(f7.to(tl.float64)), 0.0), 1.0)
        conf32 = tl.load(rconf_ptr + regime)
        conf = conf32.to(tl.float64)
        new_target = sidef * size * kel * dsr_scale * conf
        cur_side = side0
        # q_std and cvar of the chosen direction (before the protection stack)
        qk = tl.sum(tl.where(c4[None, None, :] == d[:, None, None], qd, 0.0), axis=2)             # BB × KP
        qmean = tl.sum(qk, axis=1) / K
        dev_ = tl.where(ck[None, :] < K, qk - qmean[:, None], 0.0)
        q_std = tl.sqrt(tl.sum(dev_ * dev_, axis=1) / K)
        cvar = _pick(cvar_dir, c4, d)
        entering = (sidef != 0) & (sidef != cur_side)
        blocked = entering & ((cvar < cvar_floor) | (q_std > gate / m) | (conf32 <= 0))
        committed = (cur_side != 0) & (sidef != cur_side) & (bars.to(tl.float32) < hold)
        target = tl.where((sidef == cur_side) & (cur_side != 0), pos, new_target)
        target = tl.where(blocked, 0.0, target)
        target = tl.where(committed, pos, target)
        d_eff = tl.where(blocked, 1, tl.where(committed, (cur_side + 1.0).to(tl.int32), d.to(tl.int32)))
        qk = tl.sum(tl.where(c4[None, None, :] == d_eff[:, None, None], qd, 0.0), axis=2)
        q = tl.sum(qk, axis=1) / K
        dev_ = tl.where(ck[None, :] < K, qk - q[:, None], 0.0)
        q_std = tl.sqrt(tl.sum(dev_ * dev_, axis=1) / K)
        cvar = _pick(cvar_dir, c4, d_eff)
        tp = tl.load(plans_ptr + e * 2) * vol_t
        sl = tl.load(plans_ptr + e * 2 + 1) * vol_t
        rq = r32_ptr + row * (4 + P)
        tl.store(rq + 0, q, mask=am)
        tl.store(rq + 1, q_std, mask=am)
        tl.store(rq + 2, edge, mask=am)
        tl.store(rq + 3, cvar, mask=am)
        rl = rl_ptr + row * 4
        tl.store(rl + 0, d_eff, mask=am)
        tl.store(rl + 1, s.to(tl.int32), mask=am)
        tl.store(rl + 2, e.to(tl.int32), mask=am)
        tl.store(rl + 3, blocked.to(tl.int32), mask=am)

        # ---- Simulator.step (shared/execution.py) -------------------------------------------------------------
        live = t < T - 1
        t1 = tl.minimum(t + 1, T - 1)
        o = tl.load(open_ptr + t1)
        hi = tl.load(high_ptr + t1)
        lo = tl.load(low_ptr + t1)
        cl = tl.load(close_ptr + t1)
        c_prev = close_t
        tgt = tl.where(live, tl.minimum(tl.maximum(target, -1.0), 1.0), pos)
        eq0 = eq
        f_gap = 1.0 + pos * (o / c_prev - 1.0)
        g = growth * f_gap
        eq1 = eq0 * f_gap
        old_side = _sign(pos)
        new_side = _sign(tgt)
        closes = (old_side != 0) & (new_side != old_side)
        opens = (new_side != 0) & (new_side != old_side)
        resize = (old_side != 0) & (new_side == old_side)
        f_close = 1.0 - rate * tl.abs(pos)
        f_open = 1.0 - rate * tl.abs(tgt)
        f_resize = 1.0 - rate * tl.abs(tgt - pos)
        closed_g = g * f_close
        ret1 = tl.where(closes, closed_g - 1.0, 0.0)
        eq1 = eq1 * tl.where(closes, f_close, 1.0) * tl.where(opens, f_open, 1.0) * tl.where(resize, f_resize, 1.0)
        g = tl.where(opens, f_open, tl.where(resize, g * f_resize, g))
        flip = new_side != 0
        n_entry_price = tl.where(opens, o, entry_price)
        n_entry_size = tl.where(opens, tl.abs(tgt), entry_size)
        n_entry_t = tl.where(opens, t1, entry_t)
        n_tp = tl.where(opens, tl.where(new_side > 0, o * (1.0 + tp), o * (1.0 - tp)), tp_price)
        n_sl = tl.where(opens, tl.where(new_side > 0, o * (1.0 - sl), o * (1.0 + sl)), sl_price)
        p2 = tgt
        is_long = new_side > 0
        is_short = new_side < 0
        stop_hit = (is_long & (lo <= n_sl)) | (is_short & (hi >= n_sl))
        tgt_hit = (stop_hit == 0) & ((is_long & (hi >= n_tp)) | (is_short & (lo <= n_tp)))
        stop_px = tl.where(is_long, tl.minimum(o, n_sl), tl.maximum(o, n_sl))
        tgt_px = tl.where(is_long, tl.maximum(o, n_tp), tl.minimum(o, n_tp))
        exit_intrabar = stop_hit | tgt_hit
        last = t1 == T - 1
        exit_end = (exit_intrabar == 0) & (new_side != 0) & last & live
        exit_px = tl.where(stop_hit, stop_px, tl.where(tgt_hit, tgt_px, cl))
        f_move = 1.0 + p2 * (exit_px / o - 1.0)
        exits2 = exit_intrabar | exit_end
        f_exit = tl.where(exits2, 1.0 - rate * tl.abs(p2), 1.0)
        g = g * f_move * f_exit
        eq1 = eq1 * f_move * f_exit
        ret2 = tl.where(exits2, g - 1.0, 0.0)
        reason2 = tl.where(stop_hit, 0, tl.where(tgt_hit, 1, 2))
        p2 = tl.where(exits2, 0.0, p2)
        # commit (accounts at the last bar keep their state)
        pos = tl.where(live, p2, pos)
        eq = tl.where(live, eq1, eq)
        growth = tl.where(live, tl.where(p2 != 0, g, 1.0), growth)
        entry_price = tl.where(live, n_entry_price, entry_price)
        entry_size = tl.where(live, n_entry_size, entry_size)
        entry_t = tl.where(live, n_entry_t, entry_t)
        tp_price = tl.where(live, n_tp, tp_price)
        sl_price = tl.where(live, n_sl, sl_price)
        bars = tl.where(live, tl.where(p2 != 0, bars + 1, 0), bars)
        t = t1
        n_closed = (closes & live).to(tl.int32) + (exits2 & live).to(tl.int32)
        bar_ret = tl.where(live, eq1 / eq0 - 1.0, 0.0)
        trade_ret = tl.where(live, ret1 + ret2, 0.0)
        # fills, for the ledger (`ledger_rows`)
        flags = ((opens & live).to(tl.int32) * 1 + (closes & live).to(tl.int32) * 2
                 + (closes & live & flip).to(tl.int32) * 4 + (exits2 & live).to(tl.int32) * 8
                 + reason2 * 16)
        tl.store(evf_ptr + row, flags, mask=am)
        ev = ev64_ptr + row * 3
        tl.store(ev + 0, ret1, mask=am)
        tl.store(ev + 1, ret2, mask=am)
        tl.store(ev + 2, exit_px, mask=am)
        r6 = r64_ptr + row * 4
        tl.store(r6 + 0, target, mask=am)
        tl.store(r6 + 1, eq, mask=am)
        tl.store(r6 + 2, bar_ret, mask=am)
        tl.store(r6 + 3, pos, mask=am)

        # ---- PortfolioTracker.update (shared/rollout.py) ------------------------------------------------------
        closed = n_closed > 0
        r = trade_ret
        win = (r > 0).to(tl.float64)
        win_rate = tl.where(closed, (1 - decay) * win_rate + decay * win, win_rate)
        mean_win = tl.where(closed & (r > 0), (1 - decay) * mean_win + decay * r, mean_win)
        mean_loss = tl.where(closed & (r <= 0), (1 - decay) * mean_loss + decay * (-r), mean_loss)
        x = bar_ret
        da = x - dsr_a
        db = x * x - dsr_b
        var = tl.maximum(dsr_b - dsr_a * dsr_a, eps_var)
        dd = (dsr_b * da - 0.5 * dsr_a * db) / (var * tl.sqrt(var))
        dsr = (1 - eta) * dsr + eta * tl.minimum(tl.maximum(dd, -10.0), 10.0)
        dsr_a = dsr_a + eta * da
        dsr_b = dsr_b + eta * db

    fp = final_ptr + acct64 * 10
    tl.store(fp + 0, t.to(tl.float64), mask=am)
    tl.store(fp + 1, pos, mask=am)
    tl.store(fp + 2, eq, mask=am)
    tl.store(fp + 3, growth, mask=am)
    tl.store(fp + 4, entry_price, mask=am)
    tl.store(fp + 5, entry_size, mask=am)
    tl.store(fp + 6, entry_t.to(tl.float64), mask=am)
    tl.store(fp + 7, tp_price, mask=am)
    tl.store(fp + 8, sl_price, mask=am)
    tl.store(fp + 9, bars.to(tl.float64), mask=am)
