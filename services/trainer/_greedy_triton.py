"""The Triton kernel of `services.trainer.fused_greedy` (imported only where it runs: CUDA, or Triton's interpreter).

One program holds one bootstrap state n, in two tiles, each one load and a few row reductions:
  1. the online logits of every (member k, action b) as the rows of a KP·NBP × AP tile (members, actions and atoms
     padded to powers of two): each row's Q = Σ_i z_i softmax_i, summed over the members (the tile reshaped to
     KP × NBP), divided by K, plus the online portfolio shift — the ensemble-mean Q of every action;
  2. the target logits of every (branch, member) as the rows of a 4·KP × AP tile: each row first finds its branch's
     greedy column (an argmax of the mean Q over the branch's actions), then reads that action's logits of its
     member; the softmaxes summed over the members give each branch's mean distribution.
A form that visited the members and the branches one after another (1 + 3 members' loops of row
reductions and a load that waited on each argmax): 72 µs at batch 4 096 on the H200, more than the compiled chain
it replaced (bench/train_profile.py --trace). The support z (`z_ptr`) is one row of A atoms for every z_per states (one
row for all, or one a run when several runs' states are folded into one batch: `services.trainer.run_batch`)."""
import triton
import triton.language as tl


@triton.jit
def _div(x, y):
    """x / y rounded as IEEE (and torch) rounds it: Triton's `/` on fp32 is an approximate division."""
    return tl.math.div_rn(x, y)


@triton.jit
def _softmax_rows(lg, am):
    """softmax over the atoms (axis 1) of a rows × AP tile, the padded atoms (am false) excluded, fp32."""
    lg = tl.where(am[None, :], lg, float("-inf"))
    e = tl.exp(lg - tl.max(lg, axis=1)[:, None])
    return e, tl.sum(e, axis=1)


@triton.jit
def greedy_fwd(on_ptr, on_sn, on_sk, on_sc, ond_ptr, ond_sn, tg_ptr, tg_sn, tg_sk, tg_sc, tgd_ptr, tgd_sn, z_ptr,
               z_per, col_ptr, p_ptr, d_ptr,
               K: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, A: tl.constexpr,
               AP: tl.constexpr, S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, AP)                                                   # atom
    am = i < A
    # 1. the ensemble-mean Q of every action: rows (k, b) of the online tile
    r = tl.arange(0, KP * NBP)
    k, b = r // NBP, r % NBP
    rm = (k < K) & (b < NB)
    lg = tl.load(on_ptr + n * on_sn + k[:, None] * on_sk + b[:, None] * on_sc + i[None, :],
                 mask=rm[:, None] & am[None, :], other=0.0).to(tl.float32)  # padded rows: finite zeros
    e, s = _softmax_rows(lg, am)
    z = tl.load(z_ptr + (n // z_per) * A + i, mask=am, other=0.0)          # the support of state n's run
    qk = tl.where(rm, _div(tl.sum(e * z[None, :], axis=1), s), 0.0)        # member k's Q of action b
    a = tl.arange(0, NBP)
    q = _div(tl.sum(tl.reshape(qk, (KP, NBP)), axis=0), K * 1.0)
    q += tl.load(ond_ptr + n * ond_sn + a, mask=a < NB, other=0.0).to(tl.float32)   # NBP
    # 2. rows (branch br, member k) of the target tile: the branch's greedy column c, then that action's logits
    r = tl.arange(0, 4 * KP)
    br, k = r // KP, r % KP
    first = tl.where(br == 0, 0, tl.where(br == 1, S0, S0 + S1))
    last = tl.where(br == 0, S0, tl.where(br == 1, S0 + S1, S0 + S1 + S2))
    inside = (a[None, :] >= first[:, None]) & (a[None, :] < last[:, None])
    c = tl.argmax(tl.where(inside, q[None, :], float("-inf")), axis=1).to(tl.int64)  # the first of equal maxima
    rm = (br < 3) & (k < K)
    lg = tl.load(tg_ptr + n * tg_sn + k[:, None] * tg_sk + c[:, None] * tg_sc + i[None, :],
                 mask=rm[:, None] & am[None, :], other=0.0).to(tl.float32)
    e, s = _softmax_rows(lg, am)
    p = tl.where(rm[:, None], e * _div(1.0, s)[:, None], 0.0)
    pm = _div(tl.sum(tl.reshape(p, (4, KP, AP)), axis=1), K * 1.0)          # 4 × AP: each branch's members' mean
    bo = tl.arange(0, 4)
    tl.store(p_ptr + (n * 3 + bo[:, None]) * A + i[None, :], pm, mask=(bo < 3)[:, None] & am[None, :])
    one = (k == 0) & (br < 3)                                              # a row of each branch
    tl.store(col_ptr + n * 3 + br, c, mask=one)
    tl.store(d_ptr + n * 3 + br, tl.load(tgd_ptr + n * tgd_sn + c, mask=one, other=0.0).to(tl.float32), mask=one)
