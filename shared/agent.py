"""The distributional trading agent: network (`Agent`) and its policy step (`act`).

Shared by the trainer and the evaluator so both step the very same policy through the very same simulator.

Network (`Agent`)
-----------------
- `encode(windows [N, W, F]) -> emb [N, D]`: the market embedding of the causal feature window ending at a bar.
  Linear input projection + learned positions, one (or more) pre-LN causal self-attention block(s), the last
  token's state. Portfolio-independent, so the evaluator encodes every bar of a split at once.
- `market(emb [N, D]) -> MarketOut`: the heads of the market state alone (portfolio-independent, so batched over
  every bar of a split at once, like the encoder):
  * trunk h = MLP(emb)                                                          # N × H
  * ensemble of K branching dueling C51 heads (Tavakoli et al. 2018 × Bellemare et al. 2017):
        logits_b(s, a) = V(s) + A_b(s, a) − mean_a' A_b(s, a')                  # N × K × n_b × A (atoms)
    one shared value distribution V and one advantage distribution per branch b ∈ {direction, size, exit};
  * IQN quantile head over the direction actions (Dabney et al. 2018): θ(s, a, τ)  # N × M × 3
  * expectile value head (IQL, Kostrikov et al. 2021): V_e(s)                     # N
  * a market code c = W_c h                                                     # N × C (C = `code_dim`, 16)
- `delta(code [N, C], portfolio [N, P]) -> δ [N, n_actions + 1]`: the portfolio's effect, a location shift of the
  return distribution of every action (and of V_e), the same for all ensemble members, in return units:
        δ = v_max · MLP([c, portfolio])                                         # ~2 k multiply-adds a state
  so Q_b(s, p, a) = Q_b(s, a) + δ_b,a(s, p), the IQN quantiles and CVaR shift by δ_direction,a, and the C51
  distribution learned for (s, p, a) is the market one with its atoms moved by δ and projected back onto the
  support (`services.trainer.losses.shift_distribution`).
  Why this split (docs/design.md, "Agent"): everything the policy reads per bar except a ~2 k-MAC MLP is computed
  for all bars at once (`view`, a `MarketView`), so the sequential part of a continuous pass — the only part that
  cannot be batched — costs ~1 µs a bar instead of the 0.2–0.9 M multiply-adds of heads that read the portfolio
  at their first layer (the earlier design).
- `head(emb, portfolio) -> HeadOut`: `market` + `delta`, what the update trains.
- Atom support z_i = linspace(−v_max, v_max, A) with `v_max` a buffer the trainer adapts to the reward scale.
- Buffers that the policy reads: `maturity` (how trained the risk head is, in [0, 1]; scales the protection stack).

Actions: direction {0 short, 1 flat, 2 long} × size level (`size_levels`) × exit plan (`exit_plans`: profit
target and stop as multiples of the bar volatility, +inf = none). The simulator target is
    target = side × size × kelly_scale × regime_confidence[regime]
and an open trade in the chosen direction is held as it is (no resizing churn).

Portfolio vector (`PORTFOLIO_FEATURES`, built in `shared/rollout.py`): position, unrealized P&L in volatility
units, bars in trade (scaled), distance to the plan's target and stop in volatility units, Kelly fraction,
win-rate accumulator, differential-Sharpe accumulator.

ML core: imports only torch (and the standard library).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

BRANCH_NAMES = ("direction", "size", "exit")
DIRECTION_SIDES = (-1.0, 0.0, 1.0)  # action index → side
FLAT = 1
PORTFOLIO_FEATURES = ("position", "upnl_vol", "bars_in_trade", "tp_dist_vol", "sl_dist_vol", "kelly_f",
                      "win_rate", "diff_sharpe")


@dataclass
class AgentConfig:
    """Shape of the network and of the action space (saved in every checkpoint's metadata)."""

    n_features: int = 16
    """F: features per bar (from `shared.market.compute_features`)."""
    window: int = 32
    """W: bars in the feature window of one decision."""
    d_model: int = 48
    """D: width of the temporal encoder."""
    n_heads: int = 4
    """Attention heads in each encoder block."""
    n_layers: int = 1
    """Causal attention blocks."""
    hidden: int = 128
    """H: width of the trunk (encoder + portfolio) MLP."""
    n_atoms: int = 51
    """A: atoms of each C51 distribution."""
    v_max_init: float = 0.05
    """Initial half-width of the atom support (return units); the trainer adapts it to the reward scale."""
    ensemble: int = 3
    """K: C51 heads of the ensemble (their disagreement is the epistemic uncertainty)."""
    size_levels: tuple[float, ...] = (0.5, 1.0)
    """Size branch: fraction of equity per level."""
    exit_plans: tuple[tuple[float, float], ...] = ((math.inf, math.inf), (4.0, 4.0), (8.0, 4.0))
    """Exit branch: (profit target, stop) in units of price × bar volatility; inf = none."""
    iqn_embed: int = 64
    """Cosine basis functions of the IQN τ embedding."""
    iqn_quantiles_act: int = 32
    """Fixed quantile grid used when acting (τ_i = (i + ½)/M)."""
    cvar_alpha: float = 0.1
    """Tail of the CVaR of the chosen direction."""
    cvar_limit: float = 0.1
    """Protection: no new entry where CVaR_α < −cvar_limit / maturity (return units)."""
    min_hold: int = 10
    """Protection (commitment): bars an open trade is held before a signal exit, × maturity."""
    dsr_size_cut: float = 0.5
    """Protection (differential Sharpe): size shrinks by up to this fraction when the account's DSR is negative."""
    kelly_floor: float = 0.5
    """Kelly scaling of size: scale = clamp(kelly_floor + f_kelly, kelly_floor, 1)."""
    code_dim: int = 16
    """C: width of the market code the portfolio shift reads."""
    shift_hidden: int = 64
    """Hidden width of the portfolio shift MLP."""

    @property
    def n_portfolio(self) -> int:
        return len(PORTFOLIO_FEATURES)

    @property
    def n_tail(self) -> int:
        """M_α: points of the acting τ grid (τ_i = (i + ½)/M) inside the CVaR tail, τ_i ≤ cvar_alpha — the IQN
        quantiles `act` evaluates (a leading slice of `act_taus`)."""
        M = self.iqn_quantiles_act
        return sum((i + 0.5) / M <= self.cvar_alpha for i in range(M))

    @property
    def branch_sizes(self) -> tuple[int, int, int]:
        return (3, len(self.size_levels), len(self.exit_plans))

    @property
    def n_actions(self) -> int:
        """NB: actions of all branches together (3 + size levels + exit plans): the columns of `MarketView.q`."""
        return sum(self.branch_sizes)

    def branch_slices(self) -> list[slice]:
        """Column range of each branch in an NB-wide tensor (direction, size, exit)."""
        out, a = [], 0
        for n in self.branch_sizes:
            out.append(slice(a, a + n))
            a += n
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["exit_plans"] = [[None if math.isinf(x) else x for x in p] for p in self.exit_plans]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "AgentConfig":
        d = dict(d)
        d["size_levels"] = tuple(d["size_levels"])
        d["exit_plans"] = tuple(tuple(math.inf if x is None else float(x) for x in p) for p in d["exit_plans"])
        return cls(**d)


@dataclass
class MarketOut:
    """Outputs of `Agent.market` for N market states (no portfolio)."""

    logits: torch.Tensor
    """C51 logits of the market distributions of every action of every branch, N × K × NB × A (the branches side by
    side along dim 2, `AgentConfig.branch_slices`)."""
    hidden: torch.Tensor
    """Trunk state h, N × H (the IQN and expectile heads read it)."""
    value_e: torch.Tensor
    """Expectile value of the market state, N (before the portfolio shift)."""
    code: torch.Tensor
    """Market code c, N × C (what the portfolio shift reads)."""
    wide: torch.Tensor | None = None
    """The logits' product as computed, N × W: each row's first K·NB·A values are `logits`, then on CUDA the zero
    columns that align its rows (a kernel that takes this hands back the gradient of the whole row, with no pad)."""


@dataclass
class HeadOut:
    """Outputs of `Agent.head` for N states (market state + portfolio)."""

    logits: torch.Tensor
    """C51 logits of the market distributions, N × K × NB × A, branches side by side (shifted by `delta` per
    action)."""
    hidden: torch.Tensor
    """Trunk state h, N × H (the IQN head reads it)."""
    value_e: torch.Tensor
    """Expectile value V_e(s, p) = V_e(s) + δ_V, N."""
    delta: torch.Tensor
    """Portfolio shift δ, N × (NB + 1): one column per action of every branch (direction, size, exit), then V_e's."""
    wide: torch.Tensor | None = None
    """`MarketOut.wide`: the padded product whose rows begin with `logits`."""


@dataclass
class MarketView:
    """What acting reads of N market states, portfolio-independent (`Agent.view`): computed for every bar of a split
    at once, then read row by row by `act` — the sequential part of a pass is only the portfolio shift. The shift
    is the same for every ensemble member, so the members' mean Q moves by δ and their spread does not: the view
    keeps the mean and the spread, not the members."""

    q: torch.Tensor
    """Ensemble-mean Q of every action of every branch, N × NB (branches side by side, `branch_slices`)."""
    q_std: torch.Tensor
    """Ensemble std (population) of the Q of each direction, N × 3: the epistemic uncertainty."""
    tail: torch.Tensor
    """IQN quantiles of the three directions at the CVaR tail of the acting grid (`act_taus[:n_tail]`), N × M_α × 3."""
    code: torch.Tensor
    """Market code, N × C."""

    FIELDS = ("q", "q_std", "tail", "code")

    def rows(self, idx: torch.Tensor) -> "MarketView":
        return MarketView(*(getattr(self, f)[idx] for f in self.FIELDS))

    @staticmethod
    def cat(views: list["MarketView"]) -> "MarketView":
        return MarketView(*(torch.cat([getattr(v, f) for v in views]) for f in MarketView.FIELDS))

    def __len__(self) -> int:
        return self.q.shape[0]


def written_out_attention(q: torch.Tensor) -> bool:
    """Whether attention runs written out (`causal_attention_math`, `last_query_attention_math`) rather than as
    PyTorch's fused SDPA: only in a compiled pass without gradient (the trainer's compiled collection and rolling
    embedding refresh) with heads of ≤ 32 dims. There inductor fuses the written-out form — two batched matmuls around
    an fp32 softmax, with the mask and the scale — and it beat the fused kernel the H200 picks (cuDNN flash, tiles of
    64 dims, mostly padding for 16-dim heads): 1.5× on the causal forward and 2.5× on the last query at 8 heads × 16,
    1.4× and 1.2× at 4 × 32; at 2 × 64 SDPA was as fast or faster (1.0× and 0.6×). With gradient, or uncompiled, the
    fused kernel was faster at every width. `bench/attention_speed.py --heads H --dim d` measures each."""
    return torch.compiler.is_compiling() and not torch.is_grad_enabled() and q.shape[-1] <= 32


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d + causal mask) v for N × heads × W × d (W ≤ 64 bars): fused SDPA, or written out where
    that is faster (`written_out_attention`)."""
    if not written_out_attention(q):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return causal_attention_math(q, k, v)


def causal_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` written out (N × heads × W × d)."""
    W = q.shape[-2]
    s = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5                             # N × h × W × W
    mask = torch.ones(W, W, dtype=torch.bool, device=q.device).triu(1)                    # j > i: the future
    return torch.softmax(s.masked_fill(mask, -math.inf), dim=-1).to(v.dtype) @ v          # N × h × W × d


def last_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The last token's attention over its whole window: q N × heads × d, k, v N × heads × W × d → N × heads × d.
    Fused SDPA, or written out where that is faster (`written_out_attention`: elementwise products and sums with an
    fp32 softmax, one fused kernel)."""
    if not written_out_attention(q):
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v).squeeze(2)
    return last_query_attention_math(q, k, v)


def last_query_attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`last_query_attention` written out (q N × heads × d, k, v N × heads × W × d)."""
    s = (k.float() * q.float().unsqueeze(-2)).sum(-1) * q.shape[-1] ** -0.5               # N × h × W
    return (torch.softmax(s, dim=-1).unsqueeze(-1) * v.float()).sum(-2).to(v.dtype)        # N × h × d


def align_pad(width: int, x: torch.Tensor) -> int:
    """Zeros to append to a width of `width` elements so that rows of x's device are 16-byte aligned for cuBLAS
    (a multiple of 8 bf16 values) on CUDA; 0 on a CPU, where alignment buys nothing."""
    return -width % 8 if x.is_cuda else 0


def aligned_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x), on CUDA with both widths padded with zeros to a multiple of 8 (the output sliced back): a row of 3,
    9, 14 or 2 295 bf16 values is not 16-byte aligned, and cuBLAS then falls back to its pre-Hopper `align1` kernels
    (on the H200 those ran the heads' GEMMs and the encoder's input projection; `bench/train_profile.py`). The same
    numbers (zero products add nothing); on a CPU just layer(x)."""
    return _aligned(x, layer.weight, layer.bias)


def _aligned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight, bias) with the widths padded as `aligned_linear` pads them."""
    n_out, n_in = weight.shape
    po, pi = align_pad(n_out, x), align_pad(n_in, x)
    if po == pi == 0:
        return F.linear(x, weight, bias)
    out = F.linear(F.pad(x, (0, pi)), F.pad(weight, (0, pi, 0, po)), F.pad(bias, (0, po)))
    return out[..., :n_out]


def stacked_linear(x: torch.Tensor, layers: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers] as one product: the layers' weights and biases stacked (each through
    `dense_grad`, so their gradients come out in the parameters' own layout), the widths aligned as `aligned_linear`
    aligns them, the output split back. Heads that read the same input then cost one GEMM forward and one of each
    kind backward (input gradient, weight gradient, bias sum) instead of one per head. The same numbers up to the
    order of float sums."""
    w = torch.cat([dense_grad(layer.weight) for layer in layers])
    b = torch.cat([dense_grad(layer.bias) for layer in layers])
    return list(_aligned(x, w, b).split([layer.out_features for layer in layers], dim=-1))


class _DenseGrad(torch.autograd.Function):
    """The identity, whose gradient is handed back contiguous (`dense_grad`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def dense_grad(p: torch.Tensor) -> torch.Tensor:
    """p itself, with its gradient made contiguous where it is computed. A parameter used through `torch.cat` gets
    a strided slice of the joint gradient, which autograd then copies into the parameter's layout, one copy a
    parameter after the backward (on the H200 six `direct_copy` kernels of the update, for the advantage streams'
    weights and biases, session 19). Made contiguous inside the backward, the copy is part of the compiled graph,
    where inductor fuses or groups it, and autograd takes the gradient as it is. The same values."""
    return _DenseGrad.apply(p)


def ln_fold(ln: nn.LayerNorm, layer: nn.Linear, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of layer(ln(x)) (its output rows `rows`) as a product of `ln_plain(x, ln)`: W (γ ⊙ n + β)
    + b = (W diag γ) n + (W β + b). The fold costs O × D on the parameters instead of N × D on the rows: γ's and
    β's gradients come from the weight's and bias's (Σ_o W ⊙ ∂W', Wᵀ ∂b') instead of two reductions over every row
    of the batch (every token of a window, before the encoder's linear layers). W β is summed in fp32 (a matmul
    under bf16 autocast would round it). The same numbers up to float rounding."""
    w, b = layer.weight[rows], layer.bias[rows]
    return w * ln.weight, b + (w * ln.bias).sum(1)


def ln_plain(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    """ln(x) without its affine (`ln_fold`)."""
    return F.layer_norm(x, ln.normalized_shape, None, None, ln.eps)


class CausalBlock(nn.Module):
    """Pre-LN transformer block with causal self-attention: x + Attn(LN x), then x + MLP(LN x)."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.fold_ln = False
        """Each LayerNorm's affine folded into the linear layer after it (`ln_fold`): set by the trainer
        (`TrainConfig.fold_ln`); the same parameters and function."""
        self.fused: tuple[Callable, Callable] | None = None
        """Attention kernels for passes with gradient, (causal(qkv N × W × 3D, heads) → N × W × D, last_query(q
        N × D, kv N × W × 2D, heads) → N × D), or None for SDPA: set by the trainer (`TrainConfig.attention`,
        `services.trainer.fused_attention`); not a parameter, not saved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N, W, D = x.shape
        qkv = F.linear(self._norm(x, self.ln1), *self._params(self.ln1, self.qkv))         # N × W × 3D
        if self.fused is not None and torch.is_grad_enabled():
            a = self.fused[0](qkv, self.n_heads)                                           # N × W × D
        else:
            q, k, v = (y.view(N, W, self.n_heads, D // self.n_heads).transpose(1, 2) for y in qkv.split(D, dim=-1))
            a = causal_attention(q, k, v).transpose(1, 2).reshape(N, W, D)                 # heads side by side
        x = x + self.proj(a)
        return x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        """MLP(LN₂ x)."""
        return self.mlp[2](self.mlp[1](F.linear(self._norm(x, self.ln2), *self._params(self.ln2, self.mlp[0]))))

    def _norm(self, x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
        """ln(x), without its affine when it is folded into the next layer (`fold_ln`)."""
        return ln_plain(x, ln) if self.fold_ln else ln(x)

    def _params(self, ln: nn.LayerNorm, layer: nn.Linear, rows: slice = slice(None)
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight and bias (output rows `rows`) that `layer` applies to `_norm(x, ln)`: ln's affine folded in
        (`ln_fold`) or the layer's own."""
        return ln_fold(ln, layer, rows) if self.fold_ln else (layer.weight[rows], layer.bias[rows])

    def last_token(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x)[:, −1] for what the encoder keeps of its last block: the last token's query against every
        key (a causal mask lets the last row see the whole window), its projection and MLP — N × W × D → N × D.
        The same arithmetic for that token, without the other W − 1 queries and MLP rows (~3× less work)."""
        N, W, D = x.shape
        h = self._norm(x, self.ln1)
        q = F.linear(h[:, -1], *self._params(self.ln1, self.qkv, slice(None, D)))        # N × D
        kv = F.linear(h, *self._params(self.ln1, self.qkv, slice(D, None)))              # N × W × 2D
        if self.fused is not None and torch.is_grad_enabled():
            a = self.fused[1](q, kv, self.n_heads)                                         # N × D
        else:
            hd = D // self.n_heads
            k, v = (y.view(N, W, self.n_heads, hd).transpose(1, 2) for y in kv.split(D, dim=-1))
            a = last_query_attention(q.view(N, self.n_heads, hd), k, v).reshape(N, D)      # heads side by side
        y = x[:, -1] + self.proj(a)
        return y + self._mlp(y)


class Agent(nn.Module):
    """Encoder + branching dueling C51 ensemble + IQN risk head + expectile value head (see module docstring)."""

    def __init__(self, cfg: AgentConfig):
        super().__init__()
        self.cfg = cfg
        D, H, A, K = cfg.d_model, cfg.hidden, cfg.n_atoms, cfg.ensemble
        # --- trunk: encoder + portfolio MLP (weight decay applies here) ---
        self.enc_in = nn.Linear(cfg.n_features, D)
        self.enc_pos = nn.Parameter(torch.zeros(cfg.window, D))
        self.enc_blocks = nn.ModuleList(CausalBlock(D, cfg.n_heads) for _ in range(cfg.n_layers))
        self.enc_ln = nn.LayerNorm(D)
        self.trunk = nn.Sequential(nn.Linear(D, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU())
        # --- portfolio shift: market code + portfolio → δ per action and for V_e (weight decay on the code) ---
        self.code = nn.Linear(H, cfg.code_dim)
        self.shift = nn.Sequential(nn.Linear(cfg.code_dim + cfg.n_portfolio, cfg.shift_hidden), nn.ReLU(),
                                   nn.Linear(cfg.shift_hidden, cfg.n_actions + 1))
        nn.init.zeros_(self.shift[2].weight)                # δ = 0 at first: the market distributions as they are
        nn.init.zeros_(self.shift[2].bias)
        # --- value stream of the C51 ensemble (weight decay applies here) ---
        self.value_w = nn.Parameter(torch.randn(K, H, A) * H ** -0.5)
        self.value_b = nn.Parameter(torch.zeros(K, A))
        # --- one advantage stream per branch (no weight decay) ---
        self.adv_w = nn.ParameterList(nn.Parameter(torch.randn(K, H, n * A) * H ** -0.5) for n in cfg.branch_sizes)
        self.adv_b = nn.ParameterList(nn.Parameter(torch.zeros(K, n * A)) for n in cfg.branch_sizes)
        # --- risk: IQN over direction actions + expectile value (no weight decay) ---
        self.iqn_tau = nn.Linear(cfg.iqn_embed, H)
        self.iqn_out = nn.Sequential(nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 3))
        self.expectile = nn.Linear(H, 1)
        # --- buffers ---
        self.register_buffer("v_max", torch.tensor(float(cfg.v_max_init)))
        self.register_buffer("maturity", torch.tensor(0.0))
        self.register_buffer("iqn_i", torch.arange(cfg.iqn_embed, dtype=torch.float32))
        M = cfg.iqn_quantiles_act
        self.register_buffer("act_taus", (torch.arange(M, dtype=torch.float32) + 0.5) / M)
        # action tables of `act` (not saved: they follow from the config); device tensors, so a captured or
        # compiled step reads them without a host copy
        f64 = dict(dtype=torch.float64)
        self.register_buffer("act_n", torch.tensor(cfg.branch_sizes, dtype=torch.float32), persistent=False)
        self.register_buffer("act_sides", torch.tensor(DIRECTION_SIDES, **f64), persistent=False)
        self.register_buffer("act_sizes", torch.tensor(cfg.size_levels, **f64), persistent=False)
        self.register_buffer("act_plans", torch.tensor(cfg.exit_plans, **f64), persistent=False)
        # first column of each branch among the NB actions: branch-local action indices + this = columns
        self.register_buffer("branch_first", torch.tensor([sl.start for sl in cfg.branch_slices()]),
                             persistent=False)

    # --- support -----------------------------------------------------------------------------------------
    @property
    def support(self) -> torch.Tensor:
        """z_i = −v_max + i Δz, Δz = 2 v_max / (A − 1)   (Eq. 1 of C51, symmetric support)."""
        A = self.cfg.n_atoms
        return self.v_max * torch.linspace(-1.0, 1.0, A, device=self.v_max.device)

    # --- network -----------------------------------------------------------------------------------------
    def fold_layer_norms(self, on: bool) -> None:
        """Fold the encoder blocks' LayerNorm affines into their next linear layers (`CausalBlock.fold_ln`)."""
        for blk in self.enc_blocks:
            blk.fold_ln = on

    def use_attention_kernels(self, kernels: tuple[Callable, Callable] | None) -> None:
        """Run the encoder's attention in passes with gradient through `kernels` (`CausalBlock.fused`), or SDPA
        (None)."""
        for blk in self.enc_blocks:
            blk.fused = kernels

    def encode(self, windows: torch.Tensor) -> torch.Tensor:
        """Market embedding of feature windows: N × W × F → N × D (the last token of the causal encoder)."""
        x = aligned_linear(windows, self.enc_in) + self.enc_pos                            # N × W × D
        blocks = list(self.enc_blocks)
        for blk in blocks[:-1]:
            x = blk(x)
        # only the last token's state is kept: the last block computes that token alone (`CausalBlock.last_token`)
        return self.enc_ln(blocks[-1].last_token(x) if blocks else x[:, -1])                # N × D

    def logit_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The C51 logits of every action of every member as one affine map of the trunk state: (W H × K·NB·A, b
        K·NB·A), member-major, the branches side by side in each member.

        Dueling (Wang et al. 2016, Eq. 9, per atom): logits = V + A_a − mean over the branch's actions of A. V and A
        are linear in h, so the centred sum is too, and it is folded into the weights here — W = W_V + W_A − mean_b
        W_A, the same for the biases — on the K·NB·A columns of the parameters, not the N rows of a batch. One
        product then gives the logits: no N × K × NB × A centre to compute forward or to take apart backward, and
        K·NB·A columns instead of K·(1 + NB)·A. The parameters and their gradients are those of the written-out sum
        (up to the order of float additions)."""
        K, A, H = self.cfg.ensemble, self.cfg.n_atoms, self.cfg.hidden
        # (ParameterLists indexed, not unpacked: torch 2.11's dynamo cannot unpack one into a tuple)
        adv_w = torch.cat([dense_grad(self.adv_w[i]) for i in range(len(self.adv_w))], dim=2).view(K, H, -1, A)
        adv_b = torch.cat([dense_grad(self.adv_b[i]) for i in range(len(self.adv_b))], dim=1).view(K, -1, A)
        slices = self.cfg.branch_slices()
        centre_w = torch.cat([adv_w[:, :, sl].mean(2, keepdim=True).expand(-1, -1, sl.stop - sl.start, -1)
                              for sl in slices], dim=2)
        centre_b = torch.cat([adv_b[:, sl].mean(1, keepdim=True).expand(-1, sl.stop - sl.start, -1) for sl in slices],
                             dim=1)
        w = (self.value_w.unsqueeze(2) + adv_w - centre_w).permute(1, 0, 2, 3).reshape(H, -1)          # H × K·NB·A
        b = (self.value_b.unsqueeze(1) + adv_b - centre_b).reshape(-1)                                # K·NB·A
        return w, b

    def market(self, emb: torch.Tensor) -> MarketOut:
        """The market heads (no portfolio): C51 logits of every action (N × K × NB × A), trunk state, V_e, code."""
        N, A, K, NB = emb.shape[0], self.cfg.n_atoms, self.cfg.ensemble, self.cfg.n_actions
        h = self.trunk(emb)                                                                 # N × H
        w, b = self.logit_weights()
        # rows of 128 bytes on CUDA (a multiple of 64 bf16 values). With rows of 16 (`aligned_linear`; the `full`
        # agent's 2 040 columns) the compiled targets' two logit GEMMs ran without cuBLASLt's bias epilogue: aten
        # first copied the bias into all N rows (~15 µs each at batch 4 096 on the H200); with 2 048 columns the
        # epilogue adds it, and the targets' stream went 252 → 213 µs (bench/train_profile.py, session 21)
        pad = -(K * NB * A) % 64 if h.is_cuda else 0
        if pad:
            w, b = torch.cat([w, w.new_zeros(w.shape[0], pad)], dim=1), torch.cat([b, b.new_zeros(pad)])
        wide = torch.addmm(b, h, w)                                                         # N × W
        logits = wide[:, :K * NB * A].view(N, K, NB, A)                                     # N × K × NB × A
        code, value_e = stacked_linear(h, (self.code, self.expectile))                      # N × C, N × 1
        return MarketOut(logits=logits, hidden=h, value_e=value_e.squeeze(-1), code=code, wide=wide)

    def delta(self, code: torch.Tensor, portfolio: torch.Tensor) -> torch.Tensor:
        """Portfolio shift δ = v_max · MLP([code, portfolio]): N × (NB + 1) in return units, float32."""
        x = torch.cat([code.float(), portfolio.float()], dim=-1)                            # N × (C + P)
        return self.v_max * aligned_linear(self.shift[1](self.shift[0](x)), self.shift[2]).float()

    def head(self, emb: torch.Tensor, portfolio: torch.Tensor) -> HeadOut:
        """Market heads + portfolio shift (what the update trains)."""
        m = self.market(emb)
        d = self.delta(m.code, portfolio)
        return HeadOut(logits=m.logits, hidden=m.hidden, value_e=m.value_e.float() + d[:, -1], delta=d,
                       wide=m.wide)

    @torch.no_grad()
    def view(self, emb: torch.Tensor) -> MarketView:
        """What `act` reads of N market states (`MarketView`), float32."""
        m = self.market(emb)
        q = self.q_values(m.logits)                                                         # N × K × NB
        tail = self.quantiles(m.hidden, self.act_taus[:self.cfg.n_tail]).float()            # N × M_α × 3
        return MarketView(q=q.mean(1), q_std=q[:, :, :3].std(1, unbiased=False), tail=tail, code=m.code.float())

    @torch.no_grad()
    def view_table(self, emb: torch.Tensor, chunk: int = 65536) -> MarketView:
        """`view` of T states in chunks (every bar of a split)."""
        return MarketView.cat([self.view(emb[i:i + chunk]) for i in range(0, emb.shape[0], chunk)])

    def quantiles(self, hidden: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
        """IQN: θ(s, a, τ) for the 3 direction actions. hidden N × H, taus N × M (or M) → N × M × 3."""
        if taus.dim() == 1:
            taus = taus.expand(hidden.shape[0], -1)
        # φ(τ) = ReLU(Σ_i cos(π i τ) w_i + b)   (IQN Eq. 4)                                   # N × M × E
        phi = F.relu(self.iqn_tau(torch.cos(math.pi * taus.unsqueeze(-1) * self.iqn_i)))   # N × M × H
        return aligned_linear(self.iqn_out[1](self.iqn_out[0](hidden.unsqueeze(1) * phi)), self.iqn_out[2])  # N×M×3

    def q_values(self, logits: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """Q(s, a) = Σ_i z_i p_i(s, a) of every action and ensemble member: logits N × K × NB' × A (all the actions,
        or a prefix of them, e.g. the direction's `logits[:, :, :3]`) → N × K × NB' (float32); plus the portfolio
        shift δ_a when `delta` (N × (NB + 1), `head`) is given."""
        q = (torch.softmax(logits.float(), dim=-1) * self.support).sum(-1)
        return q if delta is None else q + delta[:, :q.shape[2]].unsqueeze(1)


def agent_from_checkpoint(tensors: dict[str, torch.Tensor], metadata: dict, device="cpu") -> Agent:
    """Rebuild an agent from `shared.checkpoints.load_checkpoint`'s (tensors, metadata); eval mode.

    The metadata must hold "agent_config" (as written by the trainer's `save_epoch`)."""
    if "agent_config" not in metadata:
        raise ValueError("checkpoint metadata has no 'agent_config': not an agent checkpoint")
    agent = Agent(AgentConfig.from_dict(metadata["agent_config"])).to(device)
    check_tensor_names(agent, tensors)
    agent.load_state_dict({k: v.to(device) for k, v in tensors.items()})
    return agent.eval()


def check_tensor_names(agent: Agent, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming the missing and unexpected tensors when a checkpoint's do not match this agent's; a
    checkpoint of the earlier design (heads reading the portfolio, `port.*` tensors, no `shift.*`) says so."""
    want, have = set(agent.state_dict()), set(tensors)
    if want == have:
        return
    missing, extra = sorted(want - have), sorted(have - want)
    hint = (" — written by the earlier agent whose heads read the portfolio (before the portfolio shift); "
            "retrain it with this version" if any(k.startswith("port.") for k in extra) else "")
    raise ValueError(f"checkpoint tensors do not match the agent: missing {missing[:6]}, unexpected {extra[:6]}{hint}")


# ---------------------------------------------------------------------------------------------------------
# The policy step
# ---------------------------------------------------------------------------------------------------------
@dataclass
class PolicyControls:
    """Device tensors the policy reads (the knobs of `act`), changed in place with `copy_`."""

    epsilon: torch.Tensor
    """ε of the ε-greedy exploration (0 for evaluation), per branch independently. Scalar."""
    gate_threshold: torch.Tensor
    """E5: no new entry where the ensemble std of Q of the chosen direction exceeds it (inf = off). Scalar."""
    regime_confidence: torch.Tensor
    """E9: size multiplier per regime, [N_REGIMES]."""

    @classmethod
    def make(cls, device, epsilon: float = 0.0, gate_threshold: float = math.inf,
             regime_confidence=None, n_regimes: int = 9) -> "PolicyControls":
        rc = [1.0] * n_regimes if regime_confidence is None else list(regime_confidence)
        f = lambda v: torch.tensor(v, dtype=torch.float32, device=device)  # noqa: E731
        return cls(epsilon=f(float(epsilon)), gate_threshold=f(float(gate_threshold)), regime_confidence=f(rc))

    def set(self, *, epsilon=None, gate_threshold=None, regime_confidence=None) -> None:
        """Write new values into the device tensors (no reallocation, so a captured graph keeps reading them)."""
        if epsilon is not None:
            self.epsilon.fill_(float(epsilon))
        if gate_threshold is not None:
            self.gate_threshold.fill_(float(gate_threshold))
        if regime_confidence is not None:
            self.regime_confidence.copy_(torch.as_tensor(regime_confidence, dtype=torch.float32))


@dataclass
class Action:
    """One decision for B accounts (all [B] unless noted)."""

    branches: torch.Tensor
    """Chosen action index per branch, B × 3 (direction, size, exit)."""
    target: torch.Tensor
    """Target position for `Simulator.step`, in [-1, 1]."""
    take_profit: torch.Tensor
    """Profit target as a fraction of the entry price (+inf = none); read by the simulator when a trade opens."""
    stop_loss: torch.Tensor
    """Stop as a fraction of the entry price (+inf = none)."""
    q: torch.Tensor
    """Ensemble-mean Q of the chosen direction (return units)."""
    q_std: torch.Tensor
    """Ensemble std of Q of the chosen direction: the epistemic uncertainty."""
    edge: torch.Tensor
    """Predicted edge of trading: max(Q_long, Q_short) − Q_flat (ensemble mean)."""
    cvar: torch.Tensor
    """CVaR_α of the chosen direction from the IQN quantiles."""
    quantiles: torch.Tensor
    """IQN quantiles of the chosen direction at the CVaR tail of the fixed grid (`act_taus` ≤ cvar_alpha), B × M_α:
    all that acting needs. The full grid is computed after the fact, batched (`shared.rollout.chosen_outputs`)."""
    blocked: torch.Tensor
    """A new entry was blocked by the protection stack (CVaR limit, E5 gate, regime confidence 0)."""


@torch.no_grad()
def act(agent: Agent, view: MarketView, portfolio: torch.Tensor, *, position: torch.Tensor,
        bars_in_trade: torch.Tensor, vol: torch.Tensor, regime: torch.Tensor, controls: PolicyControls,
        generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> Action:
    """The policy: greedy on the ensemble-mean Q per branch, ε-greedy per branch, then the protection stack.

    view: the B market states' `MarketView` (rows of `Agent.view`), portfolio B × P, position B (current simulator
    position), bars_in_trade B (long), vol B (bar volatility, return units), regime B (long). The only network work
    here is the portfolio shift δ (`Agent.delta`, ~2 k multiply-adds a state): Q = view.q + δ, quantiles =
    view.tail + δ_direction. No host syncs, no Python branches on tensor values and no host-to-device copies, so a
    CUDA graph can capture it. `noise` (B × 6 uniforms in [0, 1): three ε draws, three random actions) is drawn from
    `generator` when not given; a captured step is handed noise drawn outside it.
    Protection stack, each scaled by m = agent.maturity (loose while the risk head is untrained):
      CVaR limit      — no new entry where CVaR_α(chosen direction) < −cvar_limit / m;
      epistemic gate  — no new entry where std_K Q(chosen direction) > gate_threshold / m   (E5);
      commitment      — an open trade is not exited by signal before min_hold · m bars;
      diff. Sharpe    — size × (1 − dsr_size_cut · m · clamp(−DSR, 0, 1)).
    """
    cfg = agent.cfg
    B, dev = portfolio.shape[0], portfolio.device
    delta = agent.delta(view.code, portfolio)                                               # B × (NB + 1)
    q_all = view.q + delta[:, :cfg.n_actions]                                               # B × NB
    q_mean = [q_all[:, sl] for sl in cfg.branch_slices()]                                   # [B × n_b]
    greedy = torch.stack([q.argmax(-1) for q in q_mean], dim=1)                             # B × 3
    # ε-greedy per branch: uniform random action with probability ε
    if noise is None:
        noise = torch.rand(B, 6, device=dev, generator=generator)
    n_act = agent.act_n
    rnd = (noise[:, 3:] * n_act).long().clamp(max=n_act.long() - 1)                         # B × 3, uniform
    branches = torch.where(noise[:, :3] < controls.epsilon, rnd, greedy)                    # B × 3
    d, s, e = branches.unbind(1)

    # predicted Q, disagreement and risk of the chosen direction (the shift moves every member alike: the std is
    # the market state's)
    q_std = view.q_std.gather(1, d.view(B, 1)).squeeze(1)
    edge = torch.maximum(q_mean[0][:, 0], q_mean[0][:, 2]) - q_mean[0][:, FLAT]
    # CVaR_α = mean of the quantiles at the grid's tail τ_i ≤ α (the leading M_α of the M grid points: 3 of 32 by
    # default, `view.tail`); the full grid is for reporting (`shared.rollout.chosen_outputs`)
    n_tail = cfg.n_tail                                                                     # M_α (a Python int)
    quant = view.tail + delta[:, :3].unsqueeze(1)                                           # B × M_α × 3
    cvar_dir = quant.sum(1) / max(n_tail, 1)                                                # B × 3 (0 if M_α = 0)
    cvar = cvar_dir.gather(1, d.view(B, 1)).squeeze(1)

    # target position
    m = agent.maturity.clamp(1e-3, 1.0)
    side = agent.act_sides.to(position.dtype)[d]                                            # B
    sizes = agent.act_sizes.to(position.dtype)[s]
    kelly = (cfg.kelly_floor + portfolio[:, 5].to(position.dtype)).clamp(cfg.kelly_floor, 1.0)
    dsr = portfolio[:, 7].to(position.dtype)
    dsr_scale = 1.0 - cfg.dsr_size_cut * m * (-dsr).clamp(0.0, 1.0)
    conf = controls.regime_confidence[regime].to(position.dtype)
    new_target = side * sizes * kelly * dsr_scale * conf

    cur_side = torch.sign(position)
    entering = (side != 0) & (side != cur_side)
    committed = (cur_side != 0) & (side != cur_side) & (bars_in_trade.float() < cfg.min_hold * m)
    # commitment comes first: a young trade is held whatever the signal, so no entry is blocked there
    blocked = entering & ~committed & ((cvar < -cfg.cvar_limit / m) | (q_std > controls.gate_threshold / m)
                                       | (conf <= 0))
    target = torch.where((side == cur_side) & (cur_side != 0), position, new_target)        # hold, no resize
    target = torch.where(blocked, torch.zeros_like(target), target)
    target = torch.where(committed, position, target)

    # the direction actually taken (committed → current side, blocked → flat) is what is reported and learned
    d_eff = torch.where(committed, (cur_side + 1).long(), torch.where(blocked, torch.full_like(d, FLAT), d))
    branches = torch.stack([d_eff, s, e], dim=1)
    q = q_mean[0].gather(1, d_eff.view(B, 1)).squeeze(1)
    q_std = view.q_std.gather(1, d_eff.view(B, 1)).squeeze(1)
    quant_d = quant.gather(2, d_eff.view(B, 1, 1).expand(B, quant.shape[1], 1)).squeeze(2)      # B × M_α
    cvar = cvar_dir.gather(1, d_eff.view(B, 1)).squeeze(1)

    scale = vol.to(position.dtype)
    plans = agent.act_plans.to(position.dtype)                                              # n_exit × 2
    take_profit = plans[e, 0] * scale
    stop_loss = plans[e, 1] * scale
    return Action(branches=branches, target=target, take_profit=take_profit, stop_loss=stop_loss, q=q,
                  q_std=q_std, edge=edge, cvar=cvar, quantiles=quant_d, blocked=blocked)
