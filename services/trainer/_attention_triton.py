"""The Triton kernels of `services.trainer.fused_attention` (imported only where they run: CUDA, or Triton's
interpreter). One program holds one (window, head): the whole window's queries, keys and values as W × HD tiles
(the window padded to WP, a power of two ≥ 16), so the scores, the softmax and both products stay in registers;
nothing of size W × W goes through memory, forward or backward. The causal kernels read q, k, v from the packed
N × W × 3D projection and write the output as N × W × D (the gradient as N × W × 3D), the layouts the block's
Linear layers use, so no transpose or concatenation runs around them."""
import triton
import triton.language as tl


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b of fp32 operands with fp32 accumulation: exact products when IEEE (fp32 inputs), TF32 otherwise (bf16
    inputs, whose 8-bit mantissas TF32 holds exactly; the softmax's probabilities and gradients keep 10 bits)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def causal_fwd(qkv_ptr, s_n, s_w, o_ptr, so_n, so_w, lse_ptr, W, scale, H: tl.constexpr, HD: tl.constexpr,
               WP: tl.constexpr, IEEE: tl.constexpr):
    """o = softmax(q kᵀ · scale + causal mask) v of one (window n, head h); lse[n, h, i] = log Σ_j exp(s_ij) for
    the backward."""
    n, h = tl.program_id(0) // H, tl.program_id(0) % H
    w = tl.arange(0, WP)[:, None]                                          # WP × 1: bar (query or key)
    d = tl.arange(0, HD)[None, :]                                          # 1 × HD
    wm = w < W
    base = qkv_ptr + n.to(tl.int64) * s_n + w * s_w + h * HD + d
    q = tl.load(base, mask=wm, other=0.0).to(tl.float32)
    k = tl.load(base + H * HD, mask=wm, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * H * HD, mask=wm, other=0.0).to(tl.float32)
    s = _dot(q, tl.trans(k), IEEE) * scale                                 # WP × WP
    keep = (w >= tl.arange(0, WP)[None, :]) & wm                           # j ≤ i (and a real query)
    s = tl.where(keep, s, -float("inf"))
    m = tl.max(s, axis=1, keep_dims=True)
    m = tl.where(wm, m, 0.0)
    p = tl.exp(s - m)
    l = tl.sum(p, axis=1, keep_dims=True)
    l = tl.where(wm, l, 1.0)
    o = _dot(p / l, v, IEEE)                                               # WP × HD
    tl.store(o_ptr + n.to(tl.int64) * so_n + w * so_w + h * HD + d, o.to(o_ptr.dtype.element_ty), mask=wm)
    tl.store(lse_ptr + (n * H + h).to(tl.int64) * WP + w, m + tl.log(l), mask=wm)


@triton.jit
def causal_bwd(qkv_ptr, s_n, s_w, do_ptr, so_n, so_w, lse_ptr, dqkv_ptr, W, scale, H: tl.constexpr,
               HD: tl.constexpr, WP: tl.constexpr, IEEE: tl.constexpr):
    """dq, dk, dv of one (window, head) from the output's gradient (the softmax recomputed from lse), written into
    dqkv (N × W × 3D, the layout of qkv). The softmax's backward term Σ_j p_ij dp_ij is summed from the tile, not
    taken as do_i · o_i from the stored (rounded) output."""
    n, h = tl.program_id(0) // H, tl.program_id(0) % H
    w = tl.arange(0, WP)[:, None]
    d = tl.arange(0, HD)[None, :]
    wm = w < W
    base = qkv_ptr + n.to(tl.int64) * s_n + w * s_w + h * HD + d
    q = tl.load(base, mask=wm, other=0.0).to(tl.float32)
    k = tl.load(base + H * HD, mask=wm, other=0.0).to(tl.float32)
    v = tl.load(base + 2 * H * HD, mask=wm, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + n.to(tl.int64) * so_n + w * so_w + h * HD + d, mask=wm, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + (n * H + h).to(tl.int64) * WP + w, mask=wm, other=0.0)
    keep = (w >= tl.arange(0, WP)[None, :]) & wm
    s = _dot(q, tl.trans(k), IEEE) * scale
    p = tl.where(keep, tl.exp(s - lse), 0.0)                               # WP × WP, the forward's softmax
    dv = _dot(tl.trans(p), do, IEEE)                                       # WP × HD
    dp = _dot(do, tl.trans(v), IEEE)                                       # WP × WP
    delta = tl.sum(p * dp, axis=1, keep_dims=True)                         # Σ_j p_ij dp_ij
    ds = p * (dp - delta) * scale
    dq = _dot(ds, k, IEEE)
    dk = _dot(tl.trans(ds), q, IEEE)
    gbase = dqkv_ptr + n.to(tl.int64) * s_n + w * s_w + h * HD + d
    ty = dqkv_ptr.dtype.element_ty
    tl.store(gbase, dq.to(ty), mask=wm)
    tl.store(gbase + H * HD, dk.to(ty), mask=wm)
    tl.store(gbase + 2 * H * HD, dv.to(ty), mask=wm)


@triton.jit
def last_fwd(q_ptr, sq_n, kv_ptr, s_n, s_w, o_ptr, lse_ptr, W, scale, H: tl.constexpr, HD: tl.constexpr,
             WP: tl.constexpr):
    """The last query of a window against all its W keys, one (window, head): o = softmax(k q · scale) v."""
    n, h = tl.program_id(0) // H, tl.program_id(0) % H
    w = tl.arange(0, WP)[:, None]
    d = tl.arange(0, HD)[None, :]
    wm = w < W
    q = tl.load(q_ptr + n.to(tl.int64) * sq_n + h * HD + d).to(tl.float32)       # 1 × HD
    base = kv_ptr + n.to(tl.int64) * s_n + w * s_w + h * HD + d
    k = tl.load(base, mask=wm, other=0.0).to(tl.float32)
    v = tl.load(base + H * HD, mask=wm, other=0.0).to(tl.float32)
    s = tl.where(wm, tl.sum(k * q, axis=1, keep_dims=True) * scale, -float("inf"))  # WP × 1
    m = tl.max(s, axis=0, keep_dims=True)
    p = tl.exp(s - m)
    l = tl.sum(p, axis=0, keep_dims=True)
    o = tl.sum(p * v, axis=0, keep_dims=True) / l                          # 1 × HD
    tl.store(o_ptr + n.to(tl.int64) * sq_n + h * HD + d, o.to(o_ptr.dtype.element_ty))
    tl.store(lse_ptr + n * H + h + tl.zeros([1, 1], dtype=tl.int32), m + tl.log(l))


@triton.jit
def last_bwd(q_ptr, sq_n, kv_ptr, s_n, s_w, do_ptr, lse_ptr, dq_ptr, dkv_ptr, W, scale, H: tl.constexpr,
             HD: tl.constexpr, WP: tl.constexpr):
    """dq (N × D) and dk, dv (into dkv, N × W × 2D) of the last query's attention, one (window, head)."""
    n, h = tl.program_id(0) // H, tl.program_id(0) % H
    w = tl.arange(0, WP)[:, None]
    d = tl.arange(0, HD)[None, :]
    wm = w < W
    qoff = n.to(tl.int64) * sq_n + h * HD + d
    q = tl.load(q_ptr + qoff).to(tl.float32)
    do = tl.load(do_ptr + qoff).to(tl.float32)
    base = n.to(tl.int64) * s_n + w * s_w + h * HD + d
    k = tl.load(kv_ptr + base, mask=wm, other=0.0).to(tl.float32)
    v = tl.load(kv_ptr + base + H * HD, mask=wm, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + n * H + h + tl.zeros([1, 1], dtype=tl.int32))
    s = tl.sum(k * q, axis=1, keep_dims=True) * scale
    p = tl.where(wm, tl.exp(s - lse), 0.0)                                 # WP × 1
    dp = tl.sum(v * do, axis=1, keep_dims=True)                            # WP × 1
    delta = tl.sum(p * dp, axis=0, keep_dims=True)                         # 1 × 1
    ds = p * (dp - delta) * scale
    ty = dkv_ptr.dtype.element_ty
    tl.store(dq_ptr + qoff, tl.sum(ds * k, axis=0, keep_dims=True).to(dq_ptr.dtype.element_ty))
    tl.store(dkv_ptr + base, (ds * q).to(ty), mask=wm)
    tl.store(dkv_ptr + base + H * HD, (p * do).to(ty), mask=wm)
