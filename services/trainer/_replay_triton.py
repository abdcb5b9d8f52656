"""The Triton kernel of `services.trainer.replay.scatter_amax_reweigh_` (imported only where it runs: CUDA, or
Triton's interpreter)."""
import triton
import triton.language as tl


@triton.jit
def scatter_amax_kernel(dst_ptr, index_ptr, src_ptr, weight_ptr, bar_ptr, boost_ptr, alpha, seg,
                        BLOCK: tl.constexpr, PASSES: tl.constexpr, WEIGH: tl.constexpr):
    """dst[index[k]] = max of src[k'] over the k' with index[k'] = index[k]; program g for the segment of `seg`
    indices from g × seg, whose targets no other segment's indices name (one run's slots each). First every
    target is cleared to −inf, then the values are max-ed in atomically; the barrier between the two passes keeps a
    duplicate's clear from landing after another duplicate's max (a barrier orders the program's own global writes,
    which is why a segment is one program). With WEIGH, a third pass after another barrier writes the sampling weight of
    each target from its final priority: weight[i] = dst[i]^alpha × boost[bar[i]] (a slot listed twice gets the same
    value twice); dst > 0 there (a priority is |TD| + eps)."""
    base = tl.program_id(0) * seg
    end = base + seg
    for p in range(PASSES):                                 # PASSES = ⌈seg / BLOCK⌉
        k = base + p * BLOCK + tl.arange(0, BLOCK)
        m = k < end
        i = tl.load(index_ptr + k, mask=m, other=0)
        tl.store(dst_ptr + i, tl.full([BLOCK], float("-inf"), tl.float32), mask=m)
    tl.debug_barrier()
    for p in range(PASSES):                                 # PASSES = ⌈seg / BLOCK⌉
        k = base + p * BLOCK + tl.arange(0, BLOCK)
        m = k < end
        i = tl.load(index_ptr + k, mask=m, other=0)
        tl.atomic_max(dst_ptr + i, tl.load(src_ptr + k, mask=m), mask=m)
    if WEIGH:
        tl.debug_barrier()
        for p in range(PASSES):
            k = base + p * BLOCK + tl.arange(0, BLOCK)
            m = k < end
            i = tl.load(index_ptr + k, mask=m, other=0)
            pr = tl.load(dst_ptr + i, mask=m, other=1.0)
            b = tl.load(bar_ptr + i, mask=m, other=0)
            w = tl.exp2(alpha * tl.log2(pr)) * tl.load(boost_ptr + b, mask=m, other=0.0)
            tl.store(weight_ptr + i, w, mask=m)
