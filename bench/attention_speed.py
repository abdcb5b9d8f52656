"""The encoder's attention at the training shapes: PyTorch's fused SDPA kernels vs the written-out form the agent
uses in compiled passes without gradient (`shared.agent.causal_attention_math`, `last_query_attention_math`), eager
and compiled, FlexAttention compiled (Triton kernels inductor writes for these shapes), and the update's own Triton
kernels (`services.trainer.fused_attention`), side by side in one run.

    python3 bench/attention_speed.py                 # on the H200

    python3 bench/attention_speed.py --heads 8 --dim 16    # 8 × 16 (`full`'s heads before f897c8b)

    python3 bench/attention_speed.py --windows 256 4002    # the update's encoder batch (256 windows)

Shapes (`full` config: 2 heads × 64 dims, 64-bar windows, bf16 as under the trainer's autocast):
  causal, fwd+bwd @ 1 024   the update's first encoder block (the encoder learns from 1 024 windows)
  causal, fwd @ 4 002       the rolling refresh of both embedding tables (2 001 bars each at 10^6 training bars)
  last query, fwd+bwd @ 1 024 / fwd @ 4 002   the last block, which keeps the last token only
Prints µs per call (CUDA events, after a warm-up) and each form's ratio to the default SDPA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from shared.agent import causal_attention_math, last_query_attention_math  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / reps


def sdpa(backend=None, last=False):
    def f(q, k, v):
        if last:
            q = q.unsqueeze(2)
        if backend is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=not last)
        else:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=not last)
        return out.squeeze(2) if last else out
    return f


def flex(window: int, dev: str):
    """FlexAttention (`torch.nn.attention.flex_attention`) through torch.compile: inductor writes Triton kernels for
    these shapes (forward and backward), with the causal mask as a block mask; the last query attends to every bar."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=window, KV_LEN=window, device=dev)
    attend = torch.compile(flex_attention)
    return (lambda q, k, v: attend(q, k, v, block_mask=mask),
            lambda q, k, v: attend(q.unsqueeze(2), k, v).squeeze(2))


def fused(heads: int):
    """`services.trainer.fused_attention`'s kernels (what the update uses), fed q, k, v in the
    packed layouts they read: the packing copies are timed with them, as the block's transposes are with SDPA."""
    from services.trainer.fused_attention import causal_attention, last_query_attention

    def packed(*ts):
        return torch.cat([t.transpose(1, 2).flatten(2) for t in ts], dim=-1)              # N × W × (k · D)

    def full(q, k, v):
        return causal_attention(packed(q, k, v), heads)

    def last(q, k, v):
        return last_query_attention(q.flatten(1), packed(k, v), heads)
    return full, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--windows", type=int, nargs=2, default=[1024, 4002], metavar=("GRAD", "NO_GRAD"),
                    help="windows of the cases with gradient and without (the update's encoder batch is 256)")
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print(f"# attention_speed: {torch.cuda.get_device_name()} torch={torch.__version__} heads={a.heads} "
          f"dim={a.dim} window={a.window} bf16")
    forms = {
        "SDPA (default)": (sdpa(), sdpa(last=True)),
        "SDPA flash": (sdpa(SDPBackend.FLASH_ATTENTION), sdpa(SDPBackend.FLASH_ATTENTION, True)),
        "SDPA mem-efficient": (sdpa(SDPBackend.EFFICIENT_ATTENTION), sdpa(SDPBackend.EFFICIENT_ATTENTION, True)),
        "written out": (causal_attention_math, last_query_attention_math),
        "written out, compiled": (torch.compile(causal_attention_math), torch.compile(last_query_attention_math)),
        "FlexAttention, compiled": flex(a.window, dev),
        "Triton (fused_attention)": fused(a.heads),
    }
    ng, nn_ = a.windows
    cases = [(f"causal, fwd+bwd @ {ng}", ng, False, True), (f"causal, fwd @ {nn_}", nn_, False, False),
             (f"last query, fwd+bwd @ {ng}", ng, True, True), (f"last query, fwd @ {nn_}", nn_, True, False)]
    table: dict[str, dict[str, float | None]] = {}
    for label, n, last, grad in cases:
        g = torch.Generator(device=dev).manual_seed(0)
        k, v = (torch.randn(n, a.heads, a.window, a.dim, device=dev, dtype=dt, generator=g, requires_grad=grad)
                for _ in range(2))
        qs = (n, a.heads, a.dim) if last else (n, a.heads, a.window, a.dim)
        q = torch.randn(*qs, device=dev, dtype=dt, generator=g, requires_grad=grad)
        table[label] = {}
        for name, (full, lastf) in forms.items():
            fn = lastf if last else full

            def call(fn=fn):
                if grad:
                    fn(q, k, v).float().sum().backward()
                else:
                    with torch.no_grad():
                        fn(q, k, v)
            try:
                table[label][name] = timed(call, a.reps)
            except Exception as exc:                 # a backend that refuses these shapes: say so, keep the rest
                table[label][name] = None
                print(f"  {label} [{name}]: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    names = list(forms)
    print("\n| shape | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for label, row in table.items():
        base = row.get("SDPA (default)")
        cells = []
        for nm in names:
            t = row[nm]
            cells.append("–" if t is None else f"{t:.0f} µs" + (f" ({base / t:.1f}×)" if base and nm != "SDPA (default)" else ""))
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
