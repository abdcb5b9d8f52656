"""The Triton kernel of `services.trainer.fused_linear` (imported only where it runs: CUDA, or Triton's
interpreter)."""
import triton
import triton.language as tl


@triton.jit
def weight_grads(g_ptr, x_ptr, part_ptr, count_ptr, dw_ptr, db_ptr, N, O, I, ROWS: tl.constexpr,
                 SPLITS: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """dW = gᵀx and db = Σ g of g (N × O) and x (N × I), for the BO × BI tile (program_id 0, 1) of dW (O × I,
    fp32) and the rows [split · ROWS, (split + 1) · ROWS) (program_id 2). Each program writes its partial sums to
    its own slot of `part` and counts itself in at its tile's counter; the tile's last program adds the SPLITS
    partials in split order (the same sum whichever program finishes last), writes dW's tile (and db from the first
    input tile) and sets the counter back to 0 for the next call. Operands in fp32: TF32 products of bf16 inputs
    (exact), IEEE ones of fp32 inputs."""
    po, pi, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tile = po * tl.num_programs(1) + pi
    r, c = tl.arange(0, BO), tl.arange(0, BI)
    o, i = po * BO + r, pi * BI + c
    om, im = o < O, i < I
    acc = tl.zeros([BO, BI], dtype=tl.float32)
    bacc = tl.zeros([BO], dtype=tl.float32)
    for step in range(0, ROWS // BN):
        n = ps * ROWS + step * BN + tl.arange(0, BN)
        nm = (n < N)[:, None]
        g = tl.load(g_ptr + n.to(tl.int64)[:, None] * O + o[None, :], mask=nm & om[None, :], other=0.0)
        x = tl.load(x_ptr + n.to(tl.int64)[:, None] * I + i[None, :], mask=nm & im[None, :], other=0.0)
        g, x = g.to(tl.float32), x.to(tl.float32)
        if IEEE:
            acc += tl.dot(tl.trans(g), x, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(g), x, input_precision="tf32")
        bacc += tl.sum(g, axis=0)
    slot = part_ptr + (tile * SPLITS).to(tl.int64) * (BO * BI + BO)
    tl.store(slot + ps * (BO * BI + BO) + r[:, None] * BI + c[None, :], acc)
    tl.store(slot + ps * (BO * BI + BO) + BO * BI + r, bacc)
    # every thread's partial stored before the tile's counter moves (the classic threadfence reduction: a block-wide
    # barrier, then one release-acquire atomic), and the reading threads ordered after the atomic the same way
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    if arrived == SPLITS - 1:
        tl.debug_barrier()
        total = tl.zeros([BO, BI], dtype=tl.float32)
        btotal = tl.zeros([BO], dtype=tl.float32)
        for s in range(0, SPLITS):
            total += tl.load(slot + s * (BO * BI + BO) + r[:, None] * BI + c[None, :], cache_modifier=".cg")
            btotal += tl.load(slot + s * (BO * BI + BO) + BO * BI + r, cache_modifier=".cg")
        tl.store(dw_ptr + o[:, None] * I + i[None, :], total, mask=om[:, None] & im[None, :])
        if pi == 0:
            tl.store(db_ptr + o, btotal, mask=om)
        tl.atomic_xchg(count_ptr + tile, 0)
