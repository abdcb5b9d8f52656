"""The Triton kernel of `services.trainer.fused_linear` (imported only where it runs: CUDA, or Triton's
interpreter)."""
import triton
import triton.language as tl


@triton.jit
def weight_grads(g_ptr, x_ptr, dw_ptr, db_ptr, N, O, I, ROWS: tl.constexpr, BO: tl.constexpr, BI: tl.constexpr,
                 BN: tl.constexpr, IEEE: tl.constexpr):
    """dW += gᵀx and db += Σ g over the rows [split · ROWS, (split + 1) · ROWS) of g (N × O) and x (N × I), for
    the BO × BI tile (program_id 0, 1) of dW (O × I, fp32, zeroed); db from the programs of the first input tile.
    Operands in fp32: TF32 products of bf16 inputs (exact), IEEE ones of fp32 inputs."""
    po, pi, ps = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o = po * BO + tl.arange(0, BO)
    i = pi * BI + tl.arange(0, BI)
    om, im = o < O, i < I
    start = ps * ROWS
    acc = tl.zeros([BO, BI], dtype=tl.float32)
    bacc = tl.zeros([BO], dtype=tl.float32)
    for step in range(0, ROWS // BN):
        n = start + step * BN + tl.arange(0, BN)
        nm = (n < N)[:, None]
        g = tl.load(g_ptr + n.to(tl.int64)[:, None] * O + o[None, :], mask=nm & om[None, :], other=0.0)
        x = tl.load(x_ptr + n.to(tl.int64)[:, None] * I + i[None, :], mask=nm & im[None, :], other=0.0)
        g, x = g.to(tl.float32), x.to(tl.float32)
        if IEEE:
            acc += tl.dot(tl.trans(g), x, input_precision="ieee")
        else:
            acc += tl.dot(tl.trans(g), x, input_precision="tf32")
        bacc += tl.sum(g, axis=0)
    tl.atomic_add(dw_ptr + o[:, None] * I + i[None, :], acc, mask=om[:, None] & im[None, :])
    if pi == 0:
        tl.atomic_add(db_ptr + o, bacc, mask=om)
