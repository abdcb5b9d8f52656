/* The sequential part of the evaluator's greedy pass as one compiled CPU loop (`shared.native`; built at first
 * use by the system's C compiler, loaded with ctypes).
 *
 * What the loop reads of the network is precomputed for every bar at once (`Agent.view`, a `MarketView`): the
 * ensemble-mean Q of every action of every branch q[t] (NB), the ensemble std of each direction's Q q_std[t] (ND),
 * the IQN quantiles of the CVaR tail tail[t] (MT × ND) and the market code code[t] (C). Per bar and account it
 * computes only what reads the portfolio, transcribing the torch reference block by block: the portfolio vector
 * (`shared.portfolio.portfolio_features`), the portfolio shift δ (`Agent.delta`: v_max · MLP([code, portfolio]),
 * ~2 k multiply-adds), then `act` (`shared.policy`: Q = q + δ, greedy choice, CVaR of the shifted tail,
 * protection stack), `Simulator.step` (`shared.execution`) and `PortfolioTracker.update` (`shared.portfolio`).
 * One account at a time, its state in locals; accounts side by side on OpenMP threads. Every size is a runtime
 * argument (ensemble, size levels, exit plans, tail quantiles, code and hidden widths): no limits.
 * The pass may hold NK weight sets — several checkpoints of one `AgentConfig`, each with its own view table,
 * portfolio-shift weights, v_max, maturity and controls — and each account reads the set `sets[b]` names
 * (`shared.native.run_native_sets`): the same loop, K checkpoints × W windows as K·W accounts of one pass.
 *
 * No constant of those rules is written here: the feature scales, the tracker's rates, priors and floors, the
 * direction sides, the maturity floor, the position limit, the exit-reason codes, the flag bits, the output
 * layouts and the `Pass` struct itself come from `tradeloop_native.h`, which `shared.native.header()` generates
 * from the Python definitions at build time (the build is keyed by it); the protection stack's settings and the
 * costs come in `Pass` at run time. `shared.native` checks the compiled struct's layout against its ctypes mirror
 * at load (`native_pass_layout`), and `tests/test_native_pass.py` pins the loop to the eager torch pass in every CI
 * run: the same decisions and trades, curves to float64 rounding.
 *
 * Numerics: δ in float32 (fused multiply-adds like a BLAS kernel, but not always in the order of torch's sgemm /
 * sgemv, which depends on the shape and the CPU: δ agrees with torch's to the last bits, not always bit for bit;
 * an exact tie between two actions' Q could resolve differently, so the tests check every decision), then `act`'s
 * CVaR sum in torch's own CPU order (`torch_sum_row`: the cascade sum of ATen's SumKernel), the portfolio,
 * simulator and tracker in float64 with no contraction (-ffp-contract=off), like torch's elementwise ops.
 * Outputs use the layouts of `shared.native.PassOutputs` (rows = step i · B + account).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tradeloop_native.h"

/* The layout of `Pass` as this compiler lays it out: sizeof, then each field's offset in the order of
 * TL_PASS_FIELDS; writes at most n values and returns how many there are (`shared.native._check_layout`). */
int64_t native_pass_layout(int64_t *out, int64_t n) {
    const int64_t lay[] = {(int64_t)sizeof(Pass)
#define X(f) , (int64_t)offsetof(Pass, f)
                           TL_PASS_FIELDS
#undef X
    };
    const int64_t m = (int64_t)(sizeof lay / sizeof lay[0]);
    for (int64_t i = 0; i < m && i < n; i++) out[i] = lay[i];
    return m;
}

static inline double sgn(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }
static inline double clampd(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }
static inline double mind(double a, double b) { return a < b ? a : b; }
static inline double maxd(double a, double b) { return a > b ? a : b; }

/* y[0:N] = W x + b (a torch Linear), optional ReLU; W in torch's layout (N × KD row-major) and Wt its transpose
 * (KD × N). y must not alias x. The products are fused multiply-adds (fp-contract on for these functions only).
 * Blocks of 64 outputs: eight 8-float vector accumulators held in registers across the whole K loop, one row of Wt
 * per x[k] (the sum in k order, then the bias, as a BLAS gemm with beta = 1 does); the last N mod 64 outputs: one
 * dot product each over a row of W, 8 lanes of partial sums then the lanes added pairwise — short dependency
 * chains, where the same k-order loop would wait on one accumulator per output (δ's layer of NB + 1 outputs). */
typedef float v8f __attribute__((vector_size(32)));

__attribute__((optimize("fp-contract=fast")))
static inline float dot(const float *x, const float *w, int64_t n) {
    v8f acc = (v8f){0};
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        v8f xv, wv;
        memcpy(&xv, x + k, sizeof(v8f));
        memcpy(&wv, w + k, sizeof(v8f));
        acc = xv * wv + acc;
    }
    float s = 0.0f;
    for (; k < n; k++) s = x[k] * w[k] + s;
    return (((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))) + s;
}

__attribute__((optimize("fp-contract=fast")))
static void dense(const float *x, int64_t KD, const float *W, const float *Wt, const float *b, int64_t N, float *y,
                  int relu) {
    int64_t n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) {
        v8f acc[8];
        for (int j = 0; j < 8; j++) acc[j] = (v8f){0};
        for (int64_t k = 0; k < KD; k++) {
            const v8f xk = (v8f){0} + x[k];
            const float *w = Wt + k * N + n0;
            for (int j = 0; j < 8; j++) {
                v8f wj;
                memcpy(&wj, w + 8 * j, sizeof(v8f));
                acc[j] = xk * wj + acc[j];
            }
        }
        for (int j = 0; j < 8; j++) {
            v8f bj;
            memcpy(&bj, b + n0 + 8 * j, sizeof(v8f));
            acc[j] = acc[j] + bj;
            memcpy(y + n0 + 8 * j, &acc[j], sizeof(v8f));
        }
    }
    for (int64_t n = n0; n < N; n++) y[n] = dot(x, W + n * KD, KD) + b[n];
    if (relu)
        for (int64_t n = 0; n < N; n++) y[n] = y[n] > 0.0f ? y[n] : 0.0f;
}

/* ---- torch's float32 sums on the CPU (aten/src/ATen/native/cpu/SumKernel.cpp), one output at a time ----
 * cascade: `multi_row_sum` for one column: n elements at stride st added in order into level 0, every 16 of them
 * moved up a level (levels of 2^4: exact for n < 2^20), the levels added at the end.
 * row:     `row_sum`: the elements as an (n / 4) × 4 array, a cascade per column (4 partial sums), the n mod 4
 *          left over added to the first, then the first + the second + the third + the fourth.
 * Which one torch runs depends on the layout (`cascade_sum`'s four loops); the callers below name theirs. */
static inline float torch_sum_cascade(const float *x, int64_t st, int64_t n) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    while (i + 16 <= n) {
        for (int j = 0; j < 16; j++, i++) acc[0] += x[i * st];
        for (int j = 1; j < 4; j++) {
            acc[j] += acc[j - 1];
            acc[j - 1] = 0.0f;
            if ((i & ((int64_t)15 << (4 * j))) != 0) break;
        }
    }
    for (; i < n; i++) acc[0] += x[i * st];
    for (int j = 1; j < 4; j++) acc[0] += acc[j];
    return acc[0];
}

static inline float torch_sum_row(const float *x, int64_t st, int64_t n) {
    if (n < 8) {                               /* partial sums of at most one element each */
        float s_ = 0.0f;
        if (n < 4) {                           /* all in the first: 0 + x0 + x1 + … */
            for (int64_t i = 0; i < n; i++) s_ += x[i * st];
            return s_;
        }
        s_ += x[0];                            /* 4 ≤ n < 8: (((0 + x0) + x4 + …) + x1) + x2) + x3 */
        for (int64_t i = 4; i < n; i++) s_ += x[i * st];
        return ((s_ + x[st]) + x[2 * st]) + x[3 * st];
    }
    const int64_t m = n / 4;
    float part[4];
    for (int k = 0; k < 4; k++) part[k] = torch_sum_cascade(x + k * st, 4 * st, m);
    for (int64_t i = 4 * m; i < n; i++) part[0] += x[i * st];
    for (int k = 1; k < 4; k++) part[0] += part[k];
    return part[0];
}

static int argmax_first(const float *x, int64_t n) {
    int best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = (int)i;
    return best;
}

/* Work floats one account needs: [code, port], shift hidden, δ, shifted Q, shifted tail quantiles; each rounded
 * up to 16. */
static int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

int64_t native_work_floats(const Pass *p) {
    const int64_t NB = TL_ND + p->NS + p->NE;
    return round16(p->C + p->P) + round16(p->S1) + round16(NB + 1) + round16(NB) + round16(p->MT * TL_ND + 1);
}

static void run_account(const Pass *p, int64_t b, float *work) {
    const int64_t P = p->P, C = p->C, S1 = p->S1, NS = p->NS, NE = p->NE, MT = p->MT, B = p->B, T = p->T;
    const int64_t NB = TL_ND + NS + NE;
    float *xin = work, *hid = xin + round16(C + P), *dl = hid + round16(S1), *qm = dl + round16(NB + 1),
          *quant = qm + round16(NB);                                                       /* quant: MT × ND */
    float *x = xin + C;                        /* the portfolio vector, after the code */

    /* the account's weight set k (one checkpoint of the NK the pass runs): its rows of the market view, its
     * portfolio-shift weights, its v_max, maturity and controls; every set is laid out like the first, one after
     * the other */
    const int64_t k = p->sets[b];
    const float *view_q = p->q + k * T * NB, *view_q_std = p->q_std + k * T * TL_ND,
                *view_tail = p->tail + k * T * MT * TL_ND, *view_code = p->code + k * T * C;
    const int64_t n_w1 = S1 * (C + P), n_w2 = (NB + 1) * S1;
    const float *w1 = p->w1 + k * n_w1, *w1t = p->w1t + k * n_w1, *b1 = p->b1 + k * S1, *w2 = p->w2 + k * n_w2,
                *w2t = p->w2t + k * n_w2, *b2 = p->b2 + k * (NB + 1);
    const float v_max = p->v_max[k], maturity = p->maturity[k], gate = p->gate[k], *rconf = p->rconf + k * p->NR;

    /* state: Simulator.reset (flat, cash = equity = 1) and PortfolioTracker.__init__ priors */
    int64_t t = p->starts[b];
    double pos = 0, units = 0, cash = 1, eq = 1, entry_equity = 1, entry_price = 0, entry_size = 0, tp_price = 0,
           sl_price = 0;
    int64_t entry_t = 0, bars = 0;
    double win_rate = TL_WIN_RATE_PRIOR, mean_win = TL_MEAN_TRADE_PRIOR, mean_loss = TL_MEAN_TRADE_PRIOR, dsr_a = 0,
           dsr_b = TL_DSR_B_PRIOR, dsr = 0;
    const double rate = p->rate, fee = p->fee, borrow = p->borrow, kelly_floor = p->kelly_floor;
    const double cvar_limit = p->cvar_limit, min_hold = p->min_hold, dsr_size_cut = p->dsr_size_cut;
    const double decay = TL_TRACKER_DECAY, eta = TL_DSR_ETA;
    const float m = fminf(fmaxf(maturity, (float)TL_MATURITY_FLOOR), 1.0f);   /* float32, as in act */
    const float cvar_floor = -((float)cvar_limit) / m, hold = (float)min_hold * m;
    const double cut = (double)((float)dsr_size_cut * m);
    const float n_tail = (float)(MT > 1 ? MT : 1);                       /* max(n_tail, 1) */

    for (int64_t i = 0; i < p->S; i++) {
        const int64_t row = i * B + b;
        /* ---- portfolio_features (shared/portfolio.py) ---- */
        const double vol_t = p->vol[t], close_t = p->close[t];
        const int in_trade = pos != 0;
        const double side0 = sgn(pos);
        double upnl = in_trade ? (eq / entry_equity - 1.0) / vol_t : 0.0;
        upnl = clampd(upnl, -TL_UPNL_CLIP, TL_UPNL_CLIP) / TL_UPNL_SCALE;
        const double barsf = mind((double)bars / TL_BARS_SCALE, TL_BARS_CAP);
        double tp_d = (in_trade && fabs(tp_price) < INFINITY) ? side0 * (tp_price / close_t - 1.0) / vol_t : 0.0;
        double sl_d = (in_trade && fabs(sl_price) < INFINITY) ? side0 * (1.0 - sl_price / close_t) / vol_t : 0.0;
        tp_d = clampd(tp_d, -TL_PLAN_CLIP, TL_PLAN_CLIP) / TL_PLAN_SCALE;
        sl_d = clampd(sl_d, -TL_PLAN_CLIP, TL_PLAN_CLIP) / TL_PLAN_SCALE;
        const double bk = mean_win / maxd(mean_loss, TL_KELLY_LOSS_EPS);             /* PortfolioTracker.kelly */
        const double kelly = clampd(win_rate - (1.0 - win_rate) / maxd(bk, TL_KELLY_RATIO_EPS), -1.0, 1.0);
        x[TL_PF_POSITION] = (float)pos; x[TL_PF_UPNL_VOL] = (float)upnl; x[TL_PF_BARS_IN_TRADE] = (float)barsf;
        x[TL_PF_TP_DIST_VOL] = (float)tp_d; x[TL_PF_SL_DIST_VOL] = (float)sl_d; x[TL_PF_KELLY_F] = (float)kelly;
        x[TL_PF_WIN_RATE] = (float)(win_rate - TL_WIN_RATE_PRIOR);
        x[TL_PF_DIFF_SHARPE] = (float)clampd(dsr, -TL_DSR_CLIP, TL_DSR_CLIP);
        float *rq = p->r32 + row * (TL_N_R32 + P);
        for (int64_t j = 0; j < P; j++) rq[TL_N_R32 + j] = x[j];

        /* ---- Agent.delta: δ = v_max · (W2 relu(W1 [code, port] + b1) + b2), NB + 1 ---- */
        memcpy(xin, view_code + t * C, (size_t)C * sizeof(float));
        dense(xin, C + P, w1, w1t, b1, S1, hid, 1);
        dense(hid, S1, w2, w2t, b2, NB + 1, dl, 0);
        for (int64_t j = 0; j < NB + 1; j++) dl[j] = v_max * dl[j];

        /* ---- act (shared/policy.py) ---- */
        /* q_all = view.q + δ[:NB] (the ensemble-mean Q, shifted); per branch its first argmax */
        const float *qt = view_q + t * NB, *qs = view_q_std + t * TL_ND;
        for (int64_t j = 0; j < NB; j++) qm[j] = qt[j] + dl[j];
        const int d = argmax_first(qm, TL_ND), s = argmax_first(qm + TL_ND, NS),
                  e = argmax_first(qm + TL_ND + NS, NE);
        const float edge = fmaxf(qm[TL_SHORT], qm[TL_LONG]) - qm[TL_FLAT];
        /* quant = view.tail + δ[:ND]; CVaR per direction = quant.sum(1) / max(M_α, 1) */
        const float *tt = view_tail + t * MT * TL_ND;
        for (int64_t j = 0; j < MT * TL_ND; j++) quant[j] = tt[j] + dl[j % TL_ND];
        float cvar_dir[TL_ND];
        for (int a = 0; a < TL_ND; a++) cvar_dir[a] = torch_sum_row(quant + a, TL_ND, MT) / n_tail;
        const int64_t regime = p->regime[t];
        const double sidef = TL_DIRECTION_SIDES[d];
        const double size = p->sizes[s];
        const double kel = clampd(kelly_floor + (double)x[TL_PF_KELLY_F], kelly_floor, 1.0);
        const double dsr_scale = 1.0 - cut * clampd(-(double)x[TL_PF_DIFF_SHARPE], 0.0, 1.0);
        const float conf32 = rconf[regime];
        const double conf = (double)conf32;
        const double new_target = sidef * size * kel * dsr_scale * conf;
        const double cur_side = side0;
        const float q_std0 = qs[d];
        const int entering = (sidef != 0) && (sidef != cur_side);
        /* commitment first: a young trade is held whatever the signal, so no entry is blocked there */
        const int committed = (cur_side != 0) && (sidef != cur_side) && ((float)bars < hold);
        const int blocked = entering && !committed &&
                            ((cvar_dir[d] < cvar_floor) || (q_std0 > gate) || (conf32 <= 0.0f));
        double target = ((sidef == cur_side) && (cur_side != 0)) ? pos : new_target;
        if (blocked) target = 0.0;
        if (committed) target = pos;
        const int d_eff = committed ? (int)(cur_side + TL_FLAT) : (blocked ? TL_FLAT : d);
        const float q = qm[d_eff];
        const double tp = p->plans[e * 2] * vol_t, sl = p->plans[e * 2 + 1] * vol_t;
        rq[TL_R32_Q] = q; rq[TL_R32_Q_STD] = qs[d_eff]; rq[TL_R32_EDGE] = edge; rq[TL_R32_CVAR] = cvar_dir[d_eff];
        int32_t *rl = p->rl + row * TL_N_RL;
        rl[TL_RL_DIRECTION] = d_eff; rl[TL_RL_SIZE] = s; rl[TL_RL_EXIT] = e; rl[TL_RL_BLOCKED] = blocked;

        /* ---- Simulator.step (shared/execution.py) ---- */
        const int live = t < T - 1;
        const int64_t t1 = t + 1 < T - 1 ? t + 1 : T - 1;
        const double o = p->open[t1], hi = p->high[t1], lo = p->low[t1], cl = p->close[t1];
        double tgt = live ? clampd(target, -TL_MAX_POSITION, TL_MAX_POSITION) : pos;
        const double eq0 = eq;
        /* fills at the open: the closing fill, then the opening or resizing one on the equity left */
        const int fill = tgt != pos;
        const double old_side = sgn(pos);
        double new_side = sgn(tgt);
        const int closes = fill && (old_side != 0) && (new_side != old_side);
        int opens = fill && (new_side != 0) && (new_side != old_side);
        int resize = fill && (old_side != 0) && (new_side == old_side);
        double u = units, csh = cash;
        if (closes) {
            csh = (csh + u * o) - (rate * fabs(u) * o + fee);
            u = 0.0;
        }
        const double eq_fill = csh + u * o;
        const double ret1 = closes ? eq_fill / entry_equity - 1.0 : 0.0;
        const int flip = new_side != 0;                /* the reason a close records: a flip was asked for */
        /* ruin: no equity at the open to pay for the fill and its close at that price opens nothing */
        if (!(eq_fill * (1.0 - 2.0 * rate) > 2.0 * fee) && (opens || resize)) {
            tgt = resize ? pos : 0.0;
            opens = resize = 0;
            new_side = sgn(tgt);
        }
        if (opens || resize) {
            const double u_new = tgt * eq_fill / o;
            const double du = u_new - u;
            csh = (csh - du * o) - (rate * fabs(du) * o + fee);
            u = u_new;
        }
        const double n_entry_equity = opens ? eq_fill : entry_equity;
        const double n_entry_price = opens ? o : entry_price, n_entry_size = opens ? fabs(tgt) : entry_size;
        const int64_t n_entry_t = opens ? t1 : entry_t;
        const double n_tp = opens ? (new_side > 0 ? o * (1.0 + tp) : o * (1.0 - tp)) : tp_price;
        const double n_sl = opens ? (new_side > 0 ? o * (1.0 - sl) : o * (1.0 + sl)) : sl_price;
        double p2 = tgt;
        const int is_long = new_side > 0, is_short = new_side < 0;
        /* the stop: the trade's own level or its liquidation price (an exit there leaves no equity) */
        const double au = u != 0 ? fabs(u) : 1.0;
        const double liq = is_long ? (fee - csh) / (au * (1.0 - rate)) : (csh - fee) / (au * (1.0 + rate));
        const int liquidating = is_long ? liq > n_sl : liq < n_sl;
        const double stop_level = liquidating ? liq : n_sl;
        const int stop_hit = (is_long && lo <= stop_level) || (is_short && hi >= stop_level);
        const int tgt_hit = !stop_hit && ((is_long && hi >= n_tp) || (is_short && lo <= n_tp));
        const double stop_px = is_long ? mind(o, stop_level) : maxd(o, stop_level);
        const double tgt_px = is_long ? maxd(o, n_tp) : mind(o, n_tp);
        const int exit_intrabar = stop_hit || tgt_hit;
        const int last = t1 == T - 1;
        const int exit_end = !exit_intrabar && (new_side != 0) && last && live;
        const double exit_px = stop_hit ? stop_px : (tgt_hit ? tgt_px : cl);
        if (borrow != 0 && is_short && !exit_intrabar) csh = csh - borrow * fabs(u) * cl;
        const int exits2 = exit_intrabar || exit_end;
        if (exits2) {
            csh = (csh + u * exit_px) - (rate * fabs(u) * exit_px + fee);
            if (stop_hit && liquidating) csh = mind(csh, 0.0);   /* liquidated: none left */
            u = 0.0;
        }
        const double eq1 = csh + u * cl;
        const double ret2 = exits2 ? csh / n_entry_equity - 1.0 : 0.0;
        const int reason2 = stop_hit ? TL_REASON_STOP : (tgt_hit ? TL_REASON_TARGET : TL_REASON_END);
        if (exits2) p2 = 0.0;
        if (live) {   /* commit (an account at the last bar keeps its state) */
            pos = p2;
            units = u;
            cash = csh;
            eq = eq1;
            entry_equity = n_entry_equity;
            entry_price = n_entry_price;
            entry_size = n_entry_size;
            entry_t = n_entry_t;
            tp_price = n_tp;
            sl_price = n_sl;
            bars = p2 != 0 ? bars + 1 : 0;
        }
        t = t1;
        const int n_closed = (closes && live) + (exits2 && live);
        const double bar_ret = live && eq0 > 0 ? eq1 / eq0 - 1.0 : 0.0;
        const double trade_ret = live ? ret1 + ret2 : 0.0;
        p->flags[row] = (opens && live) * TL_F_OPEN + (closes && live) * TL_F_CLOSE1 +
                        (closes && live && flip) * TL_F_FLIP + (exits2 && live) * TL_F_EXIT2 +
                        (reason2 << TL_F_REASON2_SHIFT);
        double *ev = p->ev64 + row * TL_N_EV;
        ev[TL_EV_RET_OPEN] = ret1; ev[TL_EV_RET_EXIT] = ret2; ev[TL_EV_EXIT_PRICE] = exit_px;
        double *r6 = p->r64 + row * TL_N_R64;
        r6[TL_R64_TARGET] = target; r6[TL_R64_EQUITY] = eq; r6[TL_R64_BAR_RETURN] = bar_ret; r6[TL_R64_POSITION] = pos;

        /* ---- PortfolioTracker.update (shared/portfolio.py) ---- */
        if (n_closed > 0) {
            const double r = trade_ret;
            win_rate = (1 - decay) * win_rate + decay * (r > 0 ? 1.0 : 0.0);
            if (r > 0) mean_win = (1 - decay) * mean_win + decay * r;
            else mean_loss = (1 - decay) * mean_loss + decay * (-r);
        }
        const double xr = bar_ret, da = xr - dsr_a, db = xr * xr - dsr_b;
        const double var = maxd(dsr_b - dsr_a * dsr_a, TL_DSR_VAR_EPS);
        const double dd = (dsr_b * da - 0.5 * dsr_a * db) / pow(var, 1.5);
        dsr = (1 - eta) * dsr + eta * clampd(dd, -TL_DSR_STEP_CLIP, TL_DSR_STEP_CLIP);
        dsr_a = dsr_a + eta * da;
        dsr_b = dsr_b + eta * db;
    }
    double *fp = p->final_ + b * TL_N_FINAL;
    fp[TL_FINAL_T] = (double)t; fp[TL_FINAL_POSITION] = pos; fp[TL_FINAL_EQUITY] = eq; fp[TL_FINAL_UNITS] = units;
    fp[TL_FINAL_CASH] = cash; fp[TL_FINAL_ENTRY_EQUITY] = entry_equity; fp[TL_FINAL_ENTRY_PRICE] = entry_price;
    fp[TL_FINAL_ENTRY_SIZE] = entry_size; fp[TL_FINAL_ENTRY_T] = (double)entry_t; fp[TL_FINAL_TP_PRICE] = tp_price;
    fp[TL_FINAL_SL_PRICE] = sl_price; fp[TL_FINAL_BARS_IN_TRADE] = (double)bars;
}

/* All B accounts, `threads` of them at a time (OpenMP). Returns 0, or −1 when out of memory. */
int native_greedy_pass(const Pass *p) {
    const int64_t W = native_work_floats(p);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(p->threads > 0 ? p->threads : 1)
    for (int64_t b = 0; b < p->B; b++) {
        float *work = (float *)malloc((size_t)W * sizeof(float));
        if (!work) {
            failed = 1;
            continue;
        }
        run_account(p, b, work);
        free(work);
    }
    return failed ? -1 : 0;
}
