/* The evaluator's greedy pass as one compiled CPU loop (`shared.native`; built at first use by the system's C
 * compiler, loaded with ctypes).
 *
 * The same transcription as the Triton kernel of `shared._fused_kernel` (which names its torch sources block by
 * block: `portfolio_features`, `Agent.head`, `Agent.q_values`, `Agent.quantiles`, `act`, `Simulator.step`,
 * `PortfolioTracker.update`), for one account at a time, the head's activations in small stack arrays and its
 * weights read from cache. `tests/test_native_pass.py` pins it to the eager torch path: the same decisions and
 * trades, curves to float64 rounding.
 *
 * Numerics: the heads in float32 (products fused with fmaf; sums in another order than oneDNN's), the portfolio,
 * simulator and tracker in float64 with no contraction (-ffp-contract=off), like torch's elementwise ops.
 * Outputs use the layouts of `shared.fused.FusedOutputs` (rows = step i · B + account).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    /* market, T bars */
    const double *open, *high, *low, *close, *vol;
    const int64_t *regime;
    const float *emb;          /* T × D */
    int64_t T;
    const int64_t *starts;     /* B */
    int64_t B, S;
    /* head weights, row-major K_in × N (shared.fused.FusedWeights) */
    const float *wp, *bp, *w1e, *w1p, *b1, *w2, *b2, *wh, *bh, *z, *phi, *wi1, *bi1, *wi2, *bi2;
    int64_t P, D, DP, H, K, A, NS, NE, MT;
    /* policy */
    float maturity, gate;
    const float *rconf;        /* regimes */
    const double *sizes;       /* NS */
    const double *plans;       /* NE × 2 */
    const double *c;           /* constants, see shared.native */
    /* outputs */
    double *r64;               /* S × B × 4 */
    float *r32;                /* S × B × (4 + P) */
    int32_t *rl;               /* S × B × 4 */
    double *ev64;              /* S × B × 3 */
    int32_t *flags;            /* S × B */
    double *final_;            /* B × 10 */
    int64_t threads;
} Pass;

static inline double sgn(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : 0.0); }
static inline double clampd(double x, double lo, double hi) { return x < lo ? lo : (x > hi ? hi : x); }
static inline double mind(double a, double b) { return a < b ? a : b; }
static inline double maxd(double a, double b) { return a > b ? a : b; }

/* y[0:N] = x[0:KD] · W (+ b), W row-major KD × N; optional ReLU. y must not alias x. Blocks of 64 outputs are
 * held in eight 8-float vector registers across the whole K loop (one load of W per multiply-add); the products
 * are fused multiply-adds (fp-contract on for this function only). */
typedef float v8f __attribute__((vector_size(32)));

__attribute__((optimize("fp-contract=fast")))
static void dense(const float *x, int64_t KD, const float *W, const float *b, int64_t N, float *y, int relu) {
    int64_t n0 = 0;
    for (; n0 + 64 <= N; n0 += 64) {
        v8f acc[8];
        for (int j = 0; j < 8; j++) {
            if (b) memcpy(&acc[j], b + n0 + 8 * j, sizeof(v8f));
            else acc[j] = (v8f){0};
        }
        for (int64_t k = 0; k < KD; k++) {
            const v8f xk = (v8f){0} + x[k];
            const float *w = W + k * N + n0;
            for (int j = 0; j < 8; j++) {
                v8f wj;
                memcpy(&wj, w + 8 * j, sizeof(v8f));
                acc[j] = xk * wj + acc[j];
            }
        }
        for (int j = 0; j < 8; j++) memcpy(y + n0 + 8 * j, &acc[j], sizeof(v8f));
        if (relu)
            for (int j = 0; j < 64; j++) y[n0 + j] = y[n0 + j] > 0.0f ? y[n0 + j] : 0.0f;
    }
    if (n0 < N) {                              /* the last N mod 64 outputs: the same, row by row */
        const int64_t r = N - n0;
        for (int64_t j = 0; j < r; j++) y[n0 + j] = b ? b[n0 + j] : 0.0f;
        for (int64_t k = 0; k < KD; k++) {
            const float xk = x[k];
            const float *w = W + k * N + n0;
            for (int64_t j = 0; j < r; j++) y[n0 + j] = xk * w[j] + y[n0 + j];
        }
        if (relu)
            for (int64_t j = 0; j < r; j++) y[n0 + j] = y[n0 + j] > 0.0f ? y[n0 + j] : 0.0f;
    }
}

/* e^x for x ≤ 0 (softmax arguments), vectorizable: Cody–Waite reduction by ln 2 and the Cephes degree-6
 * polynomial, ~1 ulp like torch's own vectorized exp; below −87 (e^x < 2^−125, nothing next to the max's 1) it
 * returns e^−87. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    union { int32_t i; float f; } sc;
    sc.i = ((int32_t)n + 127) << 23;
    return p * sc.f;
}

/* One branch of one ensemble member: V + A − mean_a A, softmax over the atoms, Q = Σ z p (Agent.q_values).
 * tmp: 2·A floats. */
static void c51_q(const float *v, const float *adv, int64_t nb, int64_t A, const float *z, float *tmp, float *q) {
    float *mean = tmp, *lg = tmp + A;
    for (int64_t a = 0; a < A; a++) {
        float s_ = 0.0f;
        for (int64_t i = 0; i < nb; i++) s_ += adv[i * A + a];
        mean[a] = s_ / (float)nb;
    }
    for (int64_t j = 0; j < nb; j++) {
        float mx = -INFINITY;
        for (int64_t a = 0; a < A; a++) {
            const float l = v[a] + adv[j * A + a] - mean[a];
            lg[a] = l;
            if (l > mx) mx = l;
        }
        float den = 0.0f, num = 0.0f;
        for (int64_t a = 0; a < A; a++) {
            const float e = exp_nonpos(lg[a] - mx);
            den += e;
            lg[a] = e;
        }
        for (int64_t a = 0; a < A; a++) num += (lg[a] / den) * z[a];
        q[j] = num;
    }
}

static int argmax_first(const float *x, int64_t n) {
    int best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = (int)i;
    return best;
}

static void run_account(const Pass *p, int64_t b, float *work) {
    const int64_t P = p->P, D = p->D, DP = p->DP, H = p->H, K = p->K, A = p->A, NS = p->NS, NE = p->NE,
                  MT = p->MT, B = p->B, T = p->T;
    const int64_t NBR = 3 + NS + NE, WK = (1 + NBR) * A, NH = K * WK;
    const double *c = p->c;
    float *x = work, *p1 = x + 16, *in1 = p1 + DP, *h1 = in1 + D + DP, *h2 = h1 + H, *lg = h2 + H, *qk = lg + NH,
          *tmp = qk + K * 8, *u = tmp + 2 * A, *v = u + H, *quant = v + H;   /* quant: MT × 3 */

    /* state: Simulator.reset (flat, equity 1) and PortfolioTracker.__init__ priors */
    int64_t t = p->starts[b];
    double pos = 0, eq = 1, growth = 1, entry_price = 0, entry_size = 0, tp_price = 0, sl_price = 0;
    int64_t entry_t = 0, bars = 0;
    double win_rate = 0.5, mean_win = c[8], mean_loss = c[8], dsr_a = 0, dsr_b = c[7], dsr = 0;
    const double rate = c[0], kelly_floor = c[1], cvar_limit = c[2], min_hold = c[3], dsr_size_cut = c[4];
    const double decay = c[5], eta = c[6], eps_loss = c[9], eps_b = c[10], eps_var = c[11];
    const float m = fminf(fmaxf(p->maturity, 1e-3f), 1.0f);              /* float32, as in act */
    const float cvar_floor = -((float)cvar_limit) / m, gate_m = p->gate / m, hold = (float)min_hold * m;
    const double cut = (double)((float)dsr_size_cut * m);

    for (int64_t i = 0; i < p->S; i++) {
        const int64_t row = i * B + b;
        /* ---- portfolio_features (shared/rollout.py) ---- */
        const double vol_t = p->vol[t], close_t = p->close[t];
        const int in_trade = pos != 0;
        const double side0 = sgn(pos);
        double upnl = in_trade ? (growth - 1.0) / vol_t : 0.0;
        upnl = clampd(upnl, -20.0, 20.0) / 5.0;
        const double barsf = mind((double)bars / 50.0, 4.0);
        double tp_d = (in_trade && fabs(tp_price) < INFINITY) ? side0 * (tp_price / close_t - 1.0) / vol_t : 0.0;
        double sl_d = (in_trade && fabs(sl_price) < INFINITY) ? side0 * (1.0 - sl_price / close_t) / vol_t : 0.0;
        tp_d = clampd(tp_d, -20.0, 20.0) / 10.0;
        sl_d = clampd(sl_d, -20.0, 20.0) / 10.0;
        const double bk = mean_win / maxd(mean_loss, eps_loss);                       /* PortfolioTracker.kelly */
        const double kelly = clampd(win_rate - (1.0 - win_rate) / maxd(bk, eps_b), -1.0, 1.0);
        x[0] = (float)pos; x[1] = (float)upnl; x[2] = (float)barsf; x[3] = (float)tp_d; x[4] = (float)sl_d;
        x[5] = (float)kelly; x[6] = (float)(win_rate - 0.5); x[7] = (float)clampd(dsr, -5.0, 5.0);
        float *rq = p->r32 + row * (4 + P);
        for (int64_t j = 0; j < P; j++) rq[4 + j] = x[j];

        /* ---- Agent.head: port MLP, trunk [emb, port], C51 logits ---- */
        dense(x, P, p->wp, p->bp, DP, p1, 1);
        memcpy(in1, p->emb + t * D, (size_t)D * sizeof(float));
        memcpy(in1 + D, p1, (size_t)DP * sizeof(float));
        /* trunk layer 1: W1 = [w1e; w1p] stacked (D + DP) × H */
        memcpy(h1, p->b1, (size_t)H * sizeof(float));
        for (int64_t k = 0; k < D + DP; k++) {
            const float xk = in1[k];
            const float *w = k < D ? p->w1e + k * H : p->w1p + (k - D) * H;
            for (int64_t n = 0; n < H; n++) h1[n] = fmaf(xk, w[n], h1[n]);
        }
        for (int64_t n = 0; n < H; n++) h1[n] = h1[n] > 0.0f ? h1[n] : 0.0f;
        dense(h1, H, p->w2, p->b2, H, h2, 1);
        dense(h2, H, p->wh, p->bh, NH, lg, 0);
        for (int64_t k = 0; k < K; k++) {
            const float *base = lg + k * WK;
            c51_q(base, base + A, 3, A, p->z, tmp, qk + k * 8);
            c51_q(base, base + 4 * A, NS, A, p->z, tmp, qk + k * 8 + 3);
            c51_q(base, base + (4 + NS) * A, NE, A, p->z, tmp, qk + k * 8 + 3 + NS);
        }
        /* ---- IQN tail quantiles (Agent.quantiles at the act_taus ≤ α; φ precomputed) ---- */
        for (int64_t j = 0; j < MT; j++) {
            for (int64_t n = 0; n < H; n++) u[n] = h2[n] * p->phi[j * H + n];
            dense(u, H, p->wi1, p->bi1, H, v, 1);
            dense(v, H, p->wi2, p->bi2, 3, quant + j * 3, 0);
        }

        /* ---- act (shared/agent.py) ---- */
        float qm[3 + 4 + 4];
        for (int64_t a = 0; a < NBR; a++) {
            float s_ = 0.0f;
            for (int64_t k = 0; k < K; k++) s_ += qk[k * 8 + a];
            qm[a] = s_ / (float)K;
        }
        const int d = argmax_first(qm, 3), s = argmax_first(qm + 3, NS), e = argmax_first(qm + 3 + NS, NE);
        const float edge = fmaxf(qm[0], qm[2]) - qm[1];
        float cvar_dir[3];
        for (int a = 0; a < 3; a++) {
            float s_ = 0.0f;
            for (int64_t j = 0; j < MT; j++) s_ += quant[j * 3 + a];
            cvar_dir[a] = MT > 0 ? s_ / (float)MT : 0.0f;
        }
        const int64_t regime = p->regime[t];
        const double sidef = d == 0 ? -1.0 : (d == 2 ? 1.0 : 0.0);
        const double size = p->sizes[s];
        const double kel = clampd(kelly_floor + (double)x[5], kelly_floor, 1.0);
        const double dsr_scale = 1.0 - cut * clampd(-(double)x[7], 0.0, 1.0);
        const float conf32 = p->rconf[regime];
        const double conf = (double)conf32;
        const double new_target = sidef * size * kel * dsr_scale * conf;
        const double cur_side = side0;
        float mean_d = 0.0f, var_d = 0.0f;
        for (int64_t k = 0; k < K; k++) mean_d += qk[k * 8 + d];
        mean_d /= (float)K;
        for (int64_t k = 0; k < K; k++) var_d += (qk[k * 8 + d] - mean_d) * (qk[k * 8 + d] - mean_d);
        const float q_std0 = sqrtf(var_d / (float)K);
        const int entering = (sidef != 0) && (sidef != cur_side);
        const int blocked = entering && ((cvar_dir[d] < cvar_floor) || (q_std0 > gate_m) || (conf32 <= 0.0f));
        const int committed = (cur_side != 0) && (sidef != cur_side) && ((float)bars < hold);
        double target = ((sidef == cur_side) && (cur_side != 0)) ? pos : new_target;
        if (blocked) target = 0.0;
        if (committed) target = pos;
        const int d_eff = blocked ? 1 : (committed ? (int)(cur_side + 1.0) : d);
        float q = 0.0f, var_e = 0.0f;
        for (int64_t k = 0; k < K; k++) q += qk[k * 8 + d_eff];
        q /= (float)K;
        for (int64_t k = 0; k < K; k++) var_e += (qk[k * 8 + d_eff] - q) * (qk[k * 8 + d_eff] - q);
        const double tp = p->plans[e * 2] * vol_t, sl = p->plans[e * 2 + 1] * vol_t;
        rq[0] = q; rq[1] = sqrtf(var_e / (float)K); rq[2] = edge; rq[3] = cvar_dir[d_eff];
        int32_t *rl = p->rl + row * 4;
        rl[0] = d_eff; rl[1] = s; rl[2] = e; rl[3] = blocked;

        /* ---- Simulator.step (shared/execution.py) ---- */
        const int live = t < T - 1;
        const int64_t t1 = t + 1 < T - 1 ? t + 1 : T - 1;
        const double o = p->open[t1], hi = p->high[t1], lo = p->low[t1], cl = p->close[t1];
        const double tgt = live ? clampd(target, -1.0, 1.0) : pos;
        const double eq0 = eq;
        const double f_gap = 1.0 + pos * (o / close_t - 1.0);
        double g = growth * f_gap;
        double eq1 = eq0 * f_gap;
        const double old_side = sgn(pos), new_side = sgn(tgt);
        const int closes = (old_side != 0) && (new_side != old_side);
        const int opens = (new_side != 0) && (new_side != old_side);
        const int resize = (old_side != 0) && (new_side == old_side);
        const double f_close = 1.0 - rate * fabs(pos), f_open = 1.0 - rate * fabs(tgt);
        const double f_resize = 1.0 - rate * fabs(tgt - pos);
        const double ret1 = closes ? g * f_close - 1.0 : 0.0;
        eq1 = eq1 * (closes ? f_close : 1.0) * (opens ? f_open : 1.0) * (resize ? f_resize : 1.0);
        g = opens ? f_open : (resize ? g * f_resize : g);
        const int flip = new_side != 0;
        const double n_entry_price = opens ? o : entry_price, n_entry_size = opens ? fabs(tgt) : entry_size;
        const int64_t n_entry_t = opens ? t1 : entry_t;
        const double n_tp = opens ? (new_side > 0 ? o * (1.0 + tp) : o * (1.0 - tp)) : tp_price;
        const double n_sl = opens ? (new_side > 0 ? o * (1.0 - sl) : o * (1.0 + sl)) : sl_price;
        double p2 = tgt;
        const int is_long = new_side > 0, is_short = new_side < 0;
        const int stop_hit = (is_long && lo <= n_sl) || (is_short && hi >= n_sl);
        const int tgt_hit = !stop_hit && ((is_long && hi >= n_tp) || (is_short && lo <= n_tp));
        const double stop_px = is_long ? mind(o, n_sl) : maxd(o, n_sl);
        const double tgt_px = is_long ? maxd(o, n_tp) : mind(o, n_tp);
        const int exit_intrabar = stop_hit || tgt_hit;
        const int last = t1 == T - 1;
        const int exit_end = !exit_intrabar && (new_side != 0) && last && live;
        const double exit_px = stop_hit ? stop_px : (tgt_hit ? tgt_px : cl);
        const double f_move = 1.0 + p2 * (exit_px / o - 1.0);
        const int exits2 = exit_intrabar || exit_end;
        const double f_exit = exits2 ? 1.0 - rate * fabs(p2) : 1.0;
        g = g * f_move * f_exit;
        eq1 = eq1 * f_move * f_exit;
        const double ret2 = exits2 ? g - 1.0 : 0.0;
        const int reason2 = stop_hit ? 0 : (tgt_hit ? 1 : 2);
        if (exits2) p2 = 0.0;
        if (live) {   /* commit (an account at the last bar keeps its state) */
            pos = p2;
            eq = eq1;
            growth = p2 != 0 ? g : 1.0;
            entry_price = n_entry_price;
            entry_size = n_entry_size;
            entry_t = n_entry_t;
            tp_price = n_tp;
            sl_price = n_sl;
            bars = p2 != 0 ? bars + 1 : 0;
        }
        t = t1;
        const int n_closed = (closes && live) + (exits2 && live);
        const double bar_ret = live ? eq1 / eq0 - 1.0 : 0.0;
        const double trade_ret = live ? ret1 + ret2 : 0.0;
        p->flags[row] = (opens && live) * 1 + (closes && live) * 2 + (closes && live && flip) * 4 +
                        (exits2 && live) * 8 + reason2 * 16;
        double *ev = p->ev64 + row * 3;
        ev[0] = ret1; ev[1] = ret2; ev[2] = exit_px;
        double *r6 = p->r64 + row * 4;
        r6[0] = target; r6[1] = eq; r6[2] = bar_ret; r6[3] = pos;

        /* ---- PortfolioTracker.update (shared/rollout.py) ---- */
        if (n_closed > 0) {
            const double r = trade_ret;
            win_rate = (1 - decay) * win_rate + decay * (r > 0 ? 1.0 : 0.0);
            if (r > 0) mean_win = (1 - decay) * mean_win + decay * r;
            else mean_loss = (1 - decay) * mean_loss + decay * (-r);
        }
        const double xr = bar_ret, da = xr - dsr_a, db = xr * xr - dsr_b;
        const double var = maxd(dsr_b - dsr_a * dsr_a, eps_var);
        const double dd = (dsr_b * da - 0.5 * dsr_a * db) / pow(var, 1.5);
        dsr = (1 - eta) * dsr + eta * clampd(dd, -10.0, 10.0);
        dsr_a = dsr_a + eta * da;
        dsr_b = dsr_b + eta * db;
    }
    double *fp = p->final_ + b * 10;
    fp[0] = (double)t; fp[1] = pos; fp[2] = eq; fp[3] = growth; fp[4] = entry_price; fp[5] = entry_size;
    fp[6] = (double)entry_t; fp[7] = tp_price; fp[8] = sl_price; fp[9] = (double)bars;
}

/* Work floats one account needs (x, port hidden, trunk input, h1, h2, logits, Q, softmax, IQN). */
int64_t native_work_floats(const Pass *p) {
    const int64_t NH = p->K * (1 + 3 + p->NS + p->NE) * p->A;
    return 16 + p->DP + p->D + p->DP + 2 * p->H + NH + p->K * 8 + 2 * p->A + 2 * p->H + p->MT * 3 + 16;
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
