"""The Triton kernels of `services.trainer.fused_c51` (imported only where they run: CUDA, or Triton's interpreter).

A program holds ROWS (sample, branch) rows as a ROWS × AP tile (atoms padded to a power of two) and visits the K
ensemble members one after another; what depends on the row alone (its action, its shift, the taps' sources and
weights, its support) is computed once, before that loop. The support z (`z_ptr`) is one row of A atoms for every z_per
samples: one row for all (z_per ≥ N), or one a run when the samples of several runs are folded into one batch
(`services.trainer.run_batch`). Holding all members at once, a ROWS × KP × AP tile
(K = 5 padded to 8), took 159 µs forward + backward at batch 4 096 on the H200 against 136 µs for this layout
(bench/c51_kernel_speed.py). Positions and distances are in atom units (`losses._shift_pairs`): the
source j lands at j + u, u = δ / Δz, exactly at δ = 0. The algorithm is described in `services.trainer.fused_c51`."""
import triton
import triton.language as tl


@triton.jit
def _div(x, y):
    """x / y rounded as IEEE (and torch) rounds it: Triton's `/` on fp32 is an approximate division, and the
    projection's weights and subgradients change at kinks (h ≥ 0, ⌊δ / Δz⌋) where one ulp decides."""
    return tl.math.div_rn(x, y)


@triton.jit
def _row_setup(pid, n_rows, col_ptr, delta_ptr, z_ptr, z_per, NBR: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
               ROWS: tl.constexpr):
    row = pid * ROWS + tl.arange(0, ROWS)[:, None]                         # ROWS × 1: (sample n, branch b)
    i = tl.arange(0, AP)[None, :]                                          # 1 × AP: atom
    rm, am = row < n_rows, i < A
    row = tl.where(rm, row, 0).to(tl.int64)
    n = row // NBR
    c = tl.load(col_ptr + row).to(tl.int64)
    zr = z_ptr + (n // z_per) * A                                          # the support of sample n's run
    dz = _div(tl.load(zr + A - 1) - tl.load(zr), A - 1.0)                  # ROWS × 1: Δz
    u = _div(tl.load(delta_ptr + row), dz)                                 # ROWS × 1: δ / Δz
    s = tl.minimum(tl.maximum(tl.floor(u), -A - 2.0), A + 2.0).to(tl.int32)  # ⌊u⌋
    return row, n, c, i, rm, am, dz, u, s


@triton.jit
def _softmax(base, i, m2, am):
    lg = tl.load(base + i, mask=m2, other=0.0).to(tl.float32)
    lg = tl.where(am, lg, float("-inf"))
    mx = tl.max(lg, axis=1)[:, None]
    e = tl.exp(lg - mx)
    zs = tl.sum(e, axis=1)[:, None]
    return e * _div(1.0, zs), lg - mx - tl.log(zs)


@triton.jit
def _fwd_taps(i, s, u, am, t: tl.constexpr, A: tl.constexpr):
    """Output atom i's candidate source j = i − ⌊u⌋ + t − 2 (clamped) and its hat weight."""
    j = i - s + (t - 2)                                                    # ROWS × AP
    x = j + u                                                              # z_j + δ, in atoms
    valid = (j >= 0) & (j < A) & (x >= 0.0) & (x <= A - 1.0) & am
    h = 1.0 - tl.abs(x - i)
    return tl.minimum(tl.maximum(j, 0), A - 1), tl.where(valid, tl.minimum(tl.maximum(h, 0.0), 1.0), 0.0)


@triton.jit
def c51_fwd(logits_ptr, s_n, s_k, s_c, col_ptr, delta_ptr, target_ptr, z_ptr, z_per, n_rows,
            ce_ptr, ent_ptr, util_ptr, r_ptr,
            NBR: tl.constexpr, K: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
            ROWS: tl.constexpr, EPS: tl.constexpr, UTIL: tl.constexpr):
    pid = tl.program_id(0)
    row, n, c, i, rm, am, dz, u, s = _row_setup(pid, n_rows, col_ptr, delta_ptr, z_ptr, z_per, NBR, A, AP, ROWS)
    m2 = rm & am
    j0, w0 = _fwd_taps(i, s, u, am, 0, A)
    j1, w1 = _fwd_taps(i, s, u, am, 1, A)
    j2, w2 = _fwd_taps(i, s, u, am, 2, A)
    j3, w3 = _fwd_taps(i, s, u, am, 3, A)
    xs = i + u                                                             # where each source atom lands
    lo_m, hi_m = am & (xs < 0.0), am & (xs > A - 1.0)
    tgt = tl.load(target_ptr + row * A + i, mask=m2, other=0.0)
    base = logits_ptr + n * s_n + c * s_c
    r1 = tl.reshape(row, (ROWS,))
    rm1 = tl.reshape(rm, (ROWS,))
    first = rm1 & (r1 % NBR == 0)                                          # the direction branch's rows
    for k in tl.static_range(K):
        p, logp = _softmax(base + k * s_k, i, m2, am)
        ent = -tl.sum(tl.where(am, p * logp, 0.0), axis=1)                # ROWS
        util = tl.sum(tl.where(am & (p > UTIL / A), 1.0, 0.0), axis=1) / A
        q = (tl.gather(p, j0, 1) * w0 + tl.gather(p, j1, 1) * w1
             + tl.gather(p, j2, 1) * w2 + tl.gather(p, j3, 1) * w3)        # from the registers
        low = tl.sum(tl.where(lo_m, p, 0.0), axis=1)[:, None]
        high = tl.sum(tl.where(hi_m, p, 0.0), axis=1)[:, None]
        q += tl.where(i == 0, low, 0.0) + tl.where(i == A - 1, high, 0.0)
        qc = tl.maximum(q, EPS)
        ce = -tl.sum(tl.where(am, tgt * tl.log(qc), 0.0), axis=1)
        tl.store(r_ptr + (row * K + k) * A + i, tl.where(q >= EPS, tgt / qc, 0.0), mask=m2)
        tl.store(ce_ptr + r1 * K + k, ce, mask=rm1)
        tl.store(ent_ptr + (r1 // NBR) * K + k, ent, mask=first)
        tl.store(util_ptr + (r1 // NBR) * K + k, util, mask=first)


@triton.jit
def _bwd_taps(i, s, xs, inside, dz, t: tl.constexpr, A: tl.constexpr):
    """Source atom i's candidate output o = i + ⌊u⌋ − t + 2 (clamped), its hat weight and that weight's derivative
    in z_i + δ (the subgradient clip(h, 0, 1)' · |d|'); xs: where the source lands, in atoms."""
    o = i + s - (t - 2)
    oc = tl.minimum(tl.maximum(o, 0), A - 1)
    valid = (o >= 0) & (o < A) & inside
    d = xs - o
    h = 1.0 - tl.abs(d)
    w = tl.where(valid, tl.minimum(tl.maximum(h, 0.0), 1.0), 0.0)
    sg = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0))
    return oc, w, tl.where(valid & (h >= 0.0), _div(-sg, dz), 0.0)


@triton.jit
def c51_bwd(logits_ptr, s_n, s_k, s_c, col_ptr, delta_ptr, z_ptr, z_per, n_rows, r_ptr, gce_ptr, gent_ptr, gl_ptr, g_sn,
            gd_ptr, NBR: tl.constexpr, K: tl.constexpr, A: tl.constexpr, AP: tl.constexpr,
            ROWS: tl.constexpr, NB: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr,
            MAXB: tl.constexpr):
    pid = tl.program_id(0)
    row, n, c, i, rm, am, dz, u, s = _row_setup(pid, n_rows, col_ptr, delta_ptr, z_ptr, z_per, NBR, A, AP, ROWS)
    m2 = rm & am
    xs = i + u                                                             # z_j + δ of each source j (here i), in atoms
    inside = (xs >= 0.0) & (xs <= A - 1.0) & am
    o0, w0, v0 = _bwd_taps(i, s, xs, inside, dz, 0, A)
    o1, w1, v1 = _bwd_taps(i, s, xs, inside, dz, 1, A)
    o2, w2, v2 = _bwd_taps(i, s, xs, inside, dz, 2, A)
    o3, w3, v3 = _bwd_taps(i, s, xs, inside, dz, 3, A)
    lo_m, hi_m = am & (xs < 0.0), am & (xs > A - 1.0)
    b = row % NBR
    first = tl.where(b == 0, 0, tl.where(b == 1, S0, S0 + S1))
    size = tl.where(b == 0, S0, tl.where(b == 1, S1, S2))
    base = logits_ptr + n * s_n + c * s_c
    gd = tl.zeros((ROWS,), dtype=tl.float32)
    for k in tl.static_range(K):
        p, logp = _softmax(base + k * s_k, i, m2, am)
        gce = tl.load(gce_ptr + row * K + k, mask=rm, other=0.0)          # ROWS × 1
        rrow = r_ptr + (row * K + k) * A
        rt = -gce * tl.load(rrow + i, mask=m2, other=0.0)                  # ∂ce/∂q of each output atom
        g0, g1, g2, g3 = tl.gather(rt, o0, 1), tl.gather(rt, o1, 1), tl.gather(rt, o2, 1), tl.gather(rt, o3, 1)
        gp = g0 * w0 + g1 * w1 + g2 * w2 + g3 * w3
        gdw = g0 * v0 + g1 * v1 + g2 * v2 + g3 * v3
        g_lo = -gce * tl.load(rrow, mask=rm, other=0.0)
        g_hi = -gce * tl.load(rrow + A - 1, mask=rm, other=0.0)
        gp += tl.where(lo_m, g_lo, 0.0) + tl.where(hi_m, g_hi, 0.0)
        gd += tl.sum(tl.where(m2, p * gdw, 0.0), axis=1)
        gl = p * (gp - tl.sum(tl.where(am, p * gp, 0.0), axis=1)[:, None])  # softmax backward
        ent = -tl.sum(tl.where(am, p * logp, 0.0), axis=1)[:, None]
        gent = tl.load(gent_ptr + n * K + k, mask=rm & (b == 0), other=0.0)
        gl += tl.where(am, -gent * p * (logp + ent), 0.0)                 # ∂H/∂l = −p (log p + H)
        # the gradient of every action of this branch: this row at the taken one, zeros at the others
        out = gl.to(gl_ptr.dtype.element_ty)
        for a in tl.static_range(MAXB):
            cc = first + a
            ptr = gl_ptr + n * g_sn + (k * NB + cc) * A + i
            tl.store(ptr, tl.where(cc == c, out, tl.zeros_like(out)), mask=m2 & (a < size))
    tl.store(gd_ptr + tl.reshape(row, (ROWS,)), gd, mask=tl.reshape(rm, (ROWS,)))


@triton.jit
def _direction_tile(logits_ptr, s_n, s_k, s_c, z_ptr, z_per, n, K: tl.constexpr, KP: tl.constexpr, A: tl.constexpr,
                    AP: tl.constexpr):
    """Sample n's direction actions (the first three) of every member as the rows (k, a) of a KP·4 × AP tile: the
    rows, their mask, the atoms, the probabilities (fp32), the support and each row's Q = Σ_i z_i p_i."""
    r = tl.arange(0, KP * 4)
    k, a = r // 4, r % 4
    rm = (k < K) & (a < 3)
    i = tl.arange(0, AP)
    am = i < A
    lg = tl.load(logits_ptr + n * s_n + k[:, None] * s_k + a[:, None] * s_c + i[None, :],
                 mask=rm[:, None] & am[None, :], other=0.0).to(tl.float32)   # padded rows: finite zeros
    lg = tl.where(am[None, :], lg, float("-inf"))
    e = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    p = e * _div(1.0, tl.sum(e, axis=1))[:, None]
    z = tl.load(z_ptr + (n // z_per) * A + i, mask=am, other=0.0)[None, :]
    return k, a, rm, i, am, p, z, tl.sum(p * z, axis=1)


@triton.jit
def qdir_fwd(logits_ptr, s_n, s_k, s_c, z_ptr, z_per, q_ptr, K: tl.constexpr, KP: tl.constexpr, A: tl.constexpr,
             AP: tl.constexpr):
    """q[n, k, a] = Σ_i z_i softmax(logits[n, k, a])_i of the direction actions a < 3 (N × K × 3, fp32)."""
    n = tl.program_id(0).to(tl.int64)
    k, a, rm, i, am, p, z, q = _direction_tile(logits_ptr, s_n, s_k, s_c, z_ptr, z_per, n, K, KP, A, AP)
    tl.store(q_ptr + (n * K + k) * 3 + a, q, mask=rm)


@triton.jit
def qdir_bwd(logits_ptr, s_n, s_k, s_c, z_ptr, z_per, gq_ptr, gl_ptr, g_sn, K: tl.constexpr, KP: tl.constexpr,
             NB: tl.constexpr, A: tl.constexpr, AP: tl.constexpr, PAD: tl.constexpr, PADP: tl.constexpr):
    """Adds ∂/∂logits of Σ g_q · q (∂q/∂l_i = p_i (z_i − q)) into the direction rows of the gradient c51_bwd has
    written (row stride g_sn, each row K × NB × A), and writes zeros into the row's PAD columns after them."""
    n = tl.program_id(0).to(tl.int64)
    k, a, rm, i, am, p, z, q = _direction_tile(logits_ptr, s_n, s_k, s_c, z_ptr, z_per, n, K, KP, A, AP)
    g = tl.load(gq_ptr + (n * K + k) * 3 + a, mask=rm, other=0.0)
    m2 = rm[:, None] & am[None, :]
    ptr = gl_ptr + n * g_sn + (k[:, None] * NB + a[:, None]) * A + i[None, :]
    old = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
    tl.store(ptr, (old + p * (z - q[:, None]) * g[:, None]).to(gl_ptr.dtype.element_ty), mask=m2)
    if PAD > 0:
        j = tl.arange(0, PADP)
        tl.store(gl_ptr + n * g_sn + K * NB * A + j, tl.zeros((PADP,), dtype=gl_ptr.dtype.element_ty), mask=j < PAD)
