"""The targets' double-Q selection as one Triton kernel (CUDA): `losses.greedy_next(..., fused=True)`.

What it computes is `services.trainer.losses.greedy_next_reference`, for each bootstrap state n:
    Q(n, a) = mean over the K online members of Σ_i z_i softmax(online logits)_i, plus the online portfolio shift δ_a
    c_b = argmax of Q over branch b's actions (the first of equal maxima, as torch.argmax), as a column among NB
    p_next[n, b] = mean over the K target members of softmax(target logits at c_b)          (fp32)
    d_star[n, b] = the target's portfolio shift δ'_{c_b}

Why by hand: compiled, the online Q of every action of every member was one kernel of ~39 µs at batch 4 096 on the
H200 (N × K × NB × A = 8.4 M logits, ~17 MB: a few µs of memory traffic), the argmaxes three more, and the
gathered target softmax one of ~19 µs — ~60 µs of the targets' side stream, which shares the GPU with the online
forward pass (bench/train_profile.py --trace). Here one program holds one state: every member's
logits of every action in one tile of registers, then the greedy actions' target logits in another
(`_greedy_triton`). No gradient: the targets are computed without one.

Triton is torch's own compiler backend, present wherever torch runs on CUDA; it is imported only when the fused
path runs. The op is a torch custom op, so torch.compile keeps it as it is and a CUDA graph captures its launch. Under
`torch.func.vmap` over several runs it folds the runs' states into one launch, each run with its own support
(`services.trainer.run_batch`).
"""
from __future__ import annotations

import torch

from services.trainer.run_batch import support_rows, vmap_by_folding

NUM_WARPS = 1
"""Warps per program (one bootstrap state: tiles of 64 × 64 and 32 × 64 values for the `full` agent). On the H200 at
batch 4 096 (bench/greedy_kernel_speed.py): 26 µs with 1 warp, 78 with 2, 103 with 4, 126 with 8; the
compiled reference 132 µs alone. One warp does each row reduction in its registers and shuffles, with no barrier."""


@torch.library.custom_op("tradeloop::greedy_next", mutates_args=())
def _greedy(on_logits: torch.Tensor, on_delta: torch.Tensor, tg_logits: torch.Tensor, tg_delta: torch.Tensor,
            support: torch.Tensor, branch_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import triton
    from services.trainer._greedy_triton import greedy_fwd
    N, K, NB, A = on_logits.shape
    NBR = len(branch_sizes)
    assert NBR == 3 and sum(branch_sizes) == NB, "three branches covering the NB actions"
    assert on_logits.stride(3) == 1 and tg_logits.stride(3) == 1, "the logits' atoms must be contiguous"
    assert on_delta.stride(1) == 1 and tg_delta.stride(1) == 1, "the shifts' actions must be contiguous"
    dev = on_logits.device
    col = torch.empty(N, NBR, dtype=torch.int64, device=dev)
    p_next = torch.empty(N, NBR, A, dtype=torch.float32, device=dev)
    d_star = torch.empty(N, NBR, dtype=torch.float32, device=dev)
    if N:
        greedy_fwd[(N,)](
            on_logits, on_logits.stride(0), on_logits.stride(1), on_logits.stride(2), on_delta, on_delta.stride(0),
            tg_logits, tg_logits.stride(0), tg_logits.stride(1), tg_logits.stride(2), tg_delta, tg_delta.stride(0),
            *support_rows(support, N), col, p_next, d_star,
            K=K, KP=triton.next_power_of_2(K), NB=NB, NBP=triton.next_power_of_2(NB), A=A, AP=triton.next_power_of_2(A),
            S0=branch_sizes[0], S1=branch_sizes[1], S2=branch_sizes[2], num_warps=NUM_WARPS)
    return col, p_next, d_star


@_greedy.register_fake
def _(on_logits, on_delta, tg_logits, tg_delta, support, branch_sizes):
    N, _, _, A = on_logits.shape
    NBR = len(branch_sizes)
    return (on_logits.new_empty(N, NBR, dtype=torch.int64), on_logits.new_empty(N, NBR, A, dtype=torch.float32),
            on_logits.new_empty(N, NBR, dtype=torch.float32))


vmap_by_folding(_greedy, per_sample=(0, 1, 2, 3), support=4)


def greedy_next_fused(on_logits: torch.Tensor, on_delta: torch.Tensor, tg_logits: torch.Tensor,
                      tg_delta: torch.Tensor, support: torch.Tensor, branch_sizes: tuple[int, ...]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`losses.greedy_next_reference` on CUDA as one Triton kernel (the module's docstring)."""
    return _greedy(on_logits.detach(), on_delta.detach(), tg_logits.detach(), tg_delta.detach(), support.detach(),
                   list(branch_sizes))
