"""The distributional trading agent: the network (`Agent`), its configuration and what it outputs.

Its building blocks are in `shared/layers.py`, its policy step (`act`, `PolicyControls`, `Action`) in
`shared/policy.py`; both are re-exported here.

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
  Why this split (docs/ARCHITECTURE.md, "Agent"): everything the policy reads per bar except a ~2 k-MAC MLP is computed
  for all bars at once (`view`, a `MarketView`), so the sequential part of a continuous pass — the only part that
  cannot be batched — costs ~1 µs a bar instead of the 0.2–0.9 M multiply-adds a bar of heads that would read the
  portfolio at their first layer.
- `head(emb, portfolio) -> HeadOut`: `market` + `delta`, what the update trains.
- Atom support z_i = linspace(−v_max, v_max, A) with `v_max` a buffer the trainer adapts to the reward scale.
- Buffers that the policy reads: `maturity` (how trained the risk head is, in [0, 1]; scales the protection stack).

Actions: direction {0 short, 1 flat, 2 long} × size level (`size_levels`) × exit plan (`exit_plans`: profit
target and stop as multiples of the bar volatility, +inf = none). The simulator target is
    target = side × size × kelly_scale × regime_confidence[regime]
and an open trade in the chosen direction is held as it is (no resizing churn).

Portfolio vector (`PORTFOLIO_FEATURES`, built in `shared/portfolio.py`): position, unrealized P&L in volatility
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

from shared.layers import (CausalBlock, aligned_linear, causal_attention, causal_attention_math,  # noqa: F401
                           dense_grad, last_query_attention, last_query_attention_math, ln_fold, ln_plain,
                           stacked_linear, written_out_attention)
from shared.policy import (BRANCH_NAMES, DIRECTION_SIDES, FLAT, Action, PolicyControls, act)  # noqa: F401
from shared.portfolio import PORTFOLIO_FEATURES



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

    def market(self, emb: torch.Tensor, keep: torch.Tensor | None = None) -> MarketOut:
        """The market heads (no portfolio): C51 logits of every action (N × K × NB × A), trunk state, V_e, code.
        `keep`: N × H multipliers of the trunk state (a dropout mask already scaled by 1 / (1 − p)); None: none."""
        N, A, K, NB = emb.shape[0], self.cfg.n_atoms, self.cfg.ensemble, self.cfg.n_actions
        h = self.trunk(emb)                                                                 # N × H
        if keep is not None:
            h = h * keep.to(h.dtype)
        w, b = self.logit_weights()
        # rows of 128 bytes on CUDA (a multiple of 64 bf16 values). With rows of 16 (`aligned_linear`; the `full`
        # agent's 2 040 columns) the compiled targets' two logit GEMMs ran without cuBLASLt's bias epilogue: aten
        # first copied the bias into all N rows (~15 µs each at batch 4 096 on the H200); with 2 048 columns the
        # epilogue adds it, and the targets' stream went 252 → 213 µs (bench/train_profile.py)
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

    def head(self, emb: torch.Tensor, portfolio: torch.Tensor, keep: torch.Tensor | None = None) -> HeadOut:
        """Market heads + portfolio shift (what the update trains); `keep` as in `market`."""
        m = self.market(emb, keep)
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
    checkpoint of an agent whose heads read the portfolio (`port.*` tensors, no `shift.*`) says so."""
    want, have = set(agent.state_dict()), set(tensors)
    if want == have:
        return
    missing, extra = sorted(want - have), sorted(have - want)
    hint = (" — written by the earlier agent whose heads read the portfolio (before the portfolio shift); "
            "retrain it with this version" if any(k.startswith("port.") for k in extra) else "")
    raise ValueError(f"checkpoint tensors do not match the agent: missing {missing[:6]}, unexpected {extra[:6]}{hint}")
