"""Prioritised replay on the training device, laid out time-major per environment: a ring of L steps × E envs.

Keeping each environment's transitions contiguous in time means n-step targets for every horizon are read at
sample time (slots l, l+1, …, l+h of the same env), with no separate n-step buffer. An observation is stored
compactly as the bar index (the encoder recomputes the feature window from the device feature tensor) plus the
portfolio vector.

Sampling probability of slot (l, e):  P ∝ priority[l, e]^α × bar_boost[bar[l, e]] × valid[l, e]
  - `priority` is the PER priority (|TD| updated by the trainer, or written from outside with `set_priority`);
  - `bar_boost` [T_train] is written from outside (E6: boosts for bars of top winning trades);
  - `valid` excludes the newest `max_horizon` steps of the ring, whose n-step window is not yet written.
Importance weights w = (N_valid · P)^−β / max w.

ML core: imports only torch (and on CUDA torch's Triton, for `scatter_amax_reweigh_`'s kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.trainer.run_batch import runs_first

SAMPLE_BLOCK = 256
"""Slots per block of `inverse_cdf`'s first level."""

SCATTER_BLOCK = 4096
"""Indices per pass of `scatter_amax_reweigh_`'s Triton kernel (its one program loops over blocks of this many)."""


@torch.library.custom_op("tradeloop::scatter_amax_reweigh_", mutates_args=("priority", "weight"))
def scatter_amax_reweigh_(priority: torch.Tensor, weight: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                          bar: torch.Tensor, boost: torch.Tensor, alpha: float, groups: int = 1) -> None:
    """The priority write and its sampling weights, in place (flat 1-D priority, weight and bar of the ring's slots):
        priority[index[k]] = the largest src[k'] with index[k'] = index[k]   (the rest untouched: what
                             `priority.scatter_reduce_(0, index, src, reduce="amax", include_self=False)` does)
        weight[i] = priority[i]^alpha × boost[bar[i]] at those slots        (`Replay.weight`)

    Why an op of its own: compiled, the `scatter_reduce_` on the priorities became a copy of the whole array, aten's
    scatter on the copy and a copy back (inductor does not write it in place): 3 kernels, ~24 µs of the batch-4 096
    update on the H200 for 4 096 values, the copies ~8 MB each way (bench/train_profile.py --trace); so
    did the weights' `index_copy_` after it: a copy of the 2-M-slot weight array, the write, and a device-to-device
    memcpy back, 3 kernels and ~14 µs (a trace). torch.compile writes a custom op's declared mutations in
    place (seen in its generated code); on CUDA the op is one Triton kernel (`_replay_triton`), elsewhere aten's
    `scatter_reduce_` and `index_copy_`.
    `groups`: the indices are that many equal segments whose slots no other segment names (R runs' writes folded
    into one call by the vmap rule); the kernel gives each segment a program of its own (one program for 8 runs'
    8 192 indices took 167 µs of an 8-run iteration on the H100, bench/README.md 2026-12-06 · 5fe46c0)."""
    _amax_reweigh_aten(priority, weight, index, src, bar, boost, alpha)


def _amax_reweigh_aten(priority, weight, index, src, bar, boost, alpha) -> None:
    """`scatter_amax_reweigh_` in aten ops (a CPU, or CUDA without Triton)."""
    priority.scatter_reduce_(0, index, src, reduce="amax", include_self=False)
    weight.index_copy_(0, index, priority[index].pow(alpha) * boost[bar[index]])


@scatter_amax_reweigh_.register_fake
def _(priority, weight, index, src, bar, boost, alpha, groups=1) -> None:
    return None


def _amax_reweigh_vmap(info, in_dims, priority, weight, index, src, bar, boost, alpha, groups=1):
    """The op over R runs' replays (`torch.func.vmap`, `services.trainer.run_batch`): each run's priorities and weights
    written in place. With one boost table for every run, the runs' slots are folded into one launch (run r's
    indices offset by r × its slots, a segment each); with a table a run, one launch a run."""
    r = info.batch_size
    if in_dims[0] is None or in_dims[1] is None:
        raise ValueError("scatter_amax_reweigh_ under vmap: the priorities and weights it writes must be one row a run")
    p, w, i, s, b = (runs_first(t, d, r) for t, d in zip((priority, weight, index, src, bar), in_dims))
    if in_dims[5] is None and p.is_contiguous() and w.is_contiguous():
        off = torch.arange(r, device=i.device).view(r, 1) * p.shape[1]
        scatter_amax_reweigh_(p.view(-1), w.view(-1), (i + off).reshape(-1), s.reshape(-1), b.reshape(-1), boost,
                              alpha, r * groups)
    else:
        boosts = runs_first(boost, in_dims[5], r)
        for k in range(r):
            scatter_amax_reweigh_(p[k], w[k], i[k], s[k], b[k], boosts[k], alpha, groups)
    return None, None


scatter_amax_reweigh_.register_vmap(_amax_reweigh_vmap)


@scatter_amax_reweigh_.register_kernel("cuda")
def _(priority, weight, index, src, bar, boost, alpha, groups=1) -> None:
    try:
        import triton  # noqa: F401
    except ImportError:
        _amax_reweigh_aten(priority, weight, index, src, bar, boost, alpha)
        return
    scatter_amax_triton(priority, index, src, weigh=(weight, bar, boost, alpha), groups=groups)


def scatter_amax_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor,
                        weigh: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
                        groups: int = 1) -> None:
    """The priority write through its Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1): dst as
    `scatter_amax_reweigh_`'s priority and, with weigh = (weight, bar, boost, alpha), its weights too; a program for
    each of `groups` equal segments of the indices (`scatter_amax_reweigh_`'s groups)."""
    import triton

    from services.trainer._replay_triton import scatter_amax_kernel
    n = index.numel()
    if n == 0:
        return
    assert dst.dtype == src.dtype == torch.float32 and dst.is_contiguous() and dst.dim() == 1
    weight, bar, boost, alpha = weigh if weigh is not None else (dst, index, src, 1.0)
    if weigh is not None:
        assert weight.dtype == boost.dtype == torch.float32 and weight.is_contiguous() and bar.is_contiguous()
    if groups < 1 or n % groups:
        raise ValueError(f"scatter_amax_triton: {n} indices do not split into {groups} equal segments")
    seg = n // groups
    block = min(triton.next_power_of_2(seg), SCATTER_BLOCK)
    scatter_amax_kernel[(groups,)](dst, index.contiguous(), src.contiguous(), weight, bar, boost.contiguous(),
                                   float(alpha), seg, BLOCK=block, PASSES=triton.cdiv(seg, block),
                                   WEIGH=weigh is not None, num_warps=max(1, min(16, block // 256)))


@dataclass
class Batch:
    """A sampled batch of N transitions with their n-step windows."""

    slot: torch.Tensor
    """Flat ring index l·E + e of each sample, N (for priority updates)."""
    bar: torch.Tensor
    """Bar index of the decision, N."""
    portfolio: torch.Tensor
    """Portfolio vector at the decision, N × P."""
    action: torch.Tensor
    """Branch actions, N × 3."""
    regime: torch.Tensor
    """Regime label at the decision, N."""
    rewards: torch.Tensor
    """Rewards of steps l … l+L−1, N × L (L = max horizon)."""
    dones: torch.Tensor
    """Episode-end flags of those steps, N × L."""
    next_bar: torch.Tensor
    """Bootstrap bar index after h steps, N × H."""
    next_portfolio: torch.Tensor
    """Bootstrap portfolio after h steps, N × H × P."""
    weight: torch.Tensor
    """Importance-sampling weight, N."""


class Replay:
    """Ring buffer [L, E] of transitions on `device`, with priorities and per-bar boosts."""

    def __init__(self, capacity: int, n_envs: int, n_portfolio: int, n_bars: int, horizons: tuple[int, ...],
                 device, *, alpha: float = 0.5, beta: float = 0.4):
        self.E = n_envs
        self.L = max(capacity // n_envs, max(horizons) + 2)
        self.horizons, self.max_h = tuple(horizons), max(horizons)
        self.alpha, self.beta = alpha, beta
        self.device = torch.device(device)
        L, E = self.L, self.E
        z = lambda *s, dt=torch.float32: torch.zeros(*s, dtype=dt, device=self.device)  # noqa: E731
        self.bar = z(L, E, dt=torch.long)
        self.portfolio = z(L, E, n_portfolio)
        self.action = z(L, E, 3, dt=torch.long)
        self.regime = z(L, E, dt=torch.long)
        self.reward = z(L, E)
        self.done = z(L, E, dt=torch.bool)
        self.priority = z(L, E)
        self.bar_boost = torch.ones(n_bars, device=self.device)
        self.weight = z(L, E)
        """priority^α × bar_boost[bar] of every slot, rewritten wherever a factor is: sampling then reads this one
        float array instead of the priorities, the slots' bar indices (int64) and a gather of their boosts, each
        update (three reads of the 2-M-slot ring folded into one). The same arithmetic, so the same draws."""
        # ring position and fill on the device, so a captured collection step writes and advances them
        self.head_t = torch.zeros((), dtype=torch.long, device=self.device)   # next ring row to write
        self.count_t = torch.zeros((), dtype=torch.long, device=self.device)  # rows written (capped at L)
        self.max_priority = torch.ones((), device=self.device)   # device scalar: no host sync on update
        self._steps = torch.arange(self.max_h, device=self.device)           # 0 … max_h − 1
        self._horizons = torch.tensor(self.horizons, device=self.device)     # H
        self._rows = torch.arange(L, device=self.device)

    @property
    def head(self) -> int:
        """Next ring row to write (a host sync: for checkpoints and tests, not the hot path)."""
        return int(self.head_t)

    @property
    def count(self) -> int:
        """Rows written so far, capped at L (a host sync: for checkpoints and tests, not the hot path)."""
        return int(self.count_t)

    def __len__(self) -> int:
        return self.count * self.E

    def add(self, bar, portfolio, action, regime, reward, done) -> None:
        """Write one step for all E envs: bar E, portfolio E × P, action E × 3, regime E, reward E, done E.

        The row index is the device tensor `head_t` (no host integer), so a CUDA graph can capture the write; the
        writes are `index_put_` and out-of-place counter updates, which have vmap rules (one launch for R runs'
        replays under vmap over runs: bench/vmap_update.py --step iteration)."""
        r = (self.head_t.view(1),)
        self.bar.index_put_(r, bar.view(1, -1))
        self.portfolio.index_put_(r, portfolio.unsqueeze(0))
        self.action.index_put_(r, action.unsqueeze(0))
        self.regime.index_put_(r, regime.view(1, -1))
        self.reward.index_put_(r, reward.to(torch.float32).view(1, -1))
        self.done.index_put_(r, done.view(1, -1))
        self.priority.index_put_(r, self.max_priority.expand(1, self.E))
        self.weight.index_put_(r, self._weigh(self.max_priority.expand(self.E), bar).view(1, -1))
        self.head_t.copy_(torch.remainder(self.head_t + 1, self.L))
        self.count_t.copy_(torch.clamp(self.count_t + 1, max=self.L))

    @torch.no_grad()
    def clear(self) -> None:
        """Empty, in place (a captured step keeps its addresses): no row counts as written, every priority and
        sampling weight 0, the priority new rows get back at 1. The ring position stays."""
        self.count_t.zero_()
        self.priority.zero_()
        self.weight.zero_()
        self.max_priority.fill_(1.0)

    @torch.no_grad()
    def cut_windows(self) -> None:
        """Every env's episode is cut after the newest row without an end in the ring (the trainer starts fresh
        episodes): the n-step windows of the last max_h rows would sum the next episode's first rewards and bootstrap
        from its start, so they are never drawn (priority and sampling weight 0; a slot never drawn keeps them)."""
        age = (self.head_t - 1 - self._rows) % self.L                                       # 0 = newest row
        cut = (age < self.max_h).unsqueeze(1)                                                # L × 1
        self.priority.masked_fill_(cut, 0.0)
        self.weight.masked_fill_(cut, 0.0)

    def valid_rows(self) -> torch.Tensor:
        """L bool: ring rows whose full n-step window (max horizon steps after them) is written."""
        age = (self.head_t - 1 - self._rows) % self.L                                       # 0 = newest row
        return (age >= self.max_h) & (age < self.count_t)

    def valid_row_count(self) -> torch.Tensor:
        """`valid_rows().sum()` without counting (a device scalar): the rows' ages are 0 … L − 1, one each, and the
        valid ones are those in [max_h, count). Counted, it was a reduction of its own, 4.6 µs of the batch-4 096
        update on the H200 (over the L·E slots: 3 kernels, ~12 µs)."""
        return (self.count_t - self.max_h).clamp(min=0)

    def valid_mask(self) -> torch.Tensor:
        """L × E bool: `valid_rows` for every env (a row is written for all envs at once)."""
        return self.valid_rows().unsqueeze(1).expand(self.L, self.E)

    def sample(self, n: int, generator: torch.Generator | None = None, u: torch.Tensor | None = None) -> Batch:
        """Sample n transitions by priority (with replacement) and gather their n-step windows.

        Inverse-CDF sampling: slot = first index whose cumulative probability exceeds u, u ~ U[0, 1) (n of them,
        drawn from `generator` unless given), so a captured update can be handed u drawn outside the graph."""
        L, E = self.L, self.E
        if u is None:
            u = torch.rand(n, device=self.device, generator=generator)
        rows = self.valid_rows()
        p = (self.weight * rows.unsqueeze(1)).flatten()                                      # L·E
        slot, total = inverse_cdf(p, u)                                                      # N
        probs_slot = p[slot].double() / total
        n_valid = self.valid_row_count() * E
        w = (n_valid * probs_slot).pow(-self.beta).float()
        w = w / w.max()
        l, e = slot // E, slot % E
        steps = (l.unsqueeze(1) + self._steps) % L                                           # N × Lh
        nxt = (l.unsqueeze(1) + self._horizons) % L                                          # N × H
        ee = e.unsqueeze(1)
        return Batch(slot=slot, bar=self.bar[l, e], portfolio=self.portfolio[l, e], action=self.action[l, e],
                     regime=self.regime[l, e], rewards=self.reward[steps, ee], dones=self.done[steps, ee],
                     next_bar=self.bar[nxt, ee], next_portfolio=self.portfolio[nxt, ee], weight=w)

    @torch.no_grad()
    def update_priorities(self, slot: torch.Tensor, td: torch.Tensor, eps: float = 1e-3) -> None:
        """PER: priority ← |td| + eps at the sampled slots; a slot sampled more than once (draws are with replacement)
        takes the largest of its values. (`index_copy_` would keep whichever write lands last, which on CUDA is not
        fixed, and duplicates differ once their losses read different noise: `TrainConfig.horizon_sample`.)"""
        new = td.detach().abs().float() + eps
        scatter_amax_reweigh_(self.priority.view(-1), self.weight.view(-1), slot, new, self.bar.view(-1),
                              self.bar_boost, self.alpha)
        self.max_priority.copy_(torch.maximum(self.max_priority, new.max()))

    @torch.no_grad()
    def set_priority(self, slot: torch.Tensor, value: torch.Tensor) -> None:
        """Write priorities from outside (flat slots l·E + e)."""
        self.priority.view(-1).index_copy_(0, slot, value.float())
        self._reweigh(slot)

    @torch.no_grad()
    def set_bar_boost(self, bars, multipliers) -> None:
        """E6: reset all boosts to 1, then multiply the sampling weight of transitions at `bars` by `multipliers`."""
        self.bar_boost.fill_(1.0)
        if len(bars):
            b = torch.as_tensor(bars, dtype=torch.long, device=self.device)
            m = torch.as_tensor(multipliers, dtype=torch.float32, device=self.device)
            self.bar_boost[b] = m
        self._reweigh()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """All buffers, for a checkpoint (the host counters go in `state_meta`)."""
        return {k: getattr(self, k) for k in ("bar", "portfolio", "action", "regime", "reward", "done",
                                               "priority", "bar_boost", "max_priority")}

    def state_meta(self) -> dict:
        return {"head": self.head, "count": self.count}

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """`state_tensors` / `state_meta` back, copied into the buffers (a saved integer tensor may be narrower:
        `services.trainer.checkpoint.narrow_ints`; the copy widens it)."""
        for k, v in tensors.items():
            getattr(self, k).copy_(v)
        self.head_t.fill_(int(meta["head"]))
        self.count_t.fill_(int(meta["count"]))
        self._reweigh()

    def _weigh(self, priority: torch.Tensor, bar: torch.Tensor) -> torch.Tensor:
        """The sampling weight priority^α × bar_boost[bar] (`weight`)."""
        return priority.pow(self.alpha) * self.bar_boost[bar]

    def _reweigh(self, slot: torch.Tensor | None = None) -> None:
        """`weight` at the flat slots `slot` after their priorities changed (a slot listed twice gets the same value
        twice), or everywhere (None: the boosts changed, or a checkpoint was loaded)."""
        if slot is None:
            self.weight.copy_(self._weigh(self.priority, self.bar))
            return
        w = self._weigh(self.priority.view(-1)[slot], self.bar.view(-1)[slot])
        self.weight.view(-1).index_copy_(0, slot, w)


def inverse_cdf(p: torch.Tensor, u: torch.Tensor, block: int = SAMPLE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF draws from the unnormalised weights p (S ≥ 0, not all 0) at u ∈ [0, 1) (N): for each u the first
    slot whose cumulative weight exceeds u · Σp, and Σp (float64) — what `torch.searchsorted(cumsum(p), u · Σp,
    right=True)` gives, in two levels: block sums of `block` slots and their cumulative sum pick a block, then the
    cumulative sum of that block's slots alone picks the slot. Nothing of length S is scanned (a cumulative sum
    over the 2-M-slot ring and the search in it were ~0.12 ms of a 2.3-ms update on the H200 at batch 4 096,
    bench/train_profile.py): one reduction reads p, the rest is S / block + N × block.
    Sums in float64, as the flat form's. A slot of weight 0 is never drawn, rounding included: each level's pick is
    capped at its last slot of positive weight."""
    S = p.shape[0]
    nb = -(-S // block)
    pb = F.pad(p.double(), (0, nb * block - S)).view(nb, block)                            # nb × block
    bsum = pb.sum(1)                                                                       # nb
    bcdf = torch.cumsum(bsum, 0)
    total = bcdf[-1]
    target = u.double() * total                                                            # N
    last_block = (bcdf < total).sum()                                 # the last block of positive weight
    blk = torch.minimum(torch.searchsorted(bcdf, target, right=True), last_block)         # N
    row = torch.cumsum(pb[blk], 1)                                                         # N × block
    row_total = row[:, -1:]
    frac = ((target - (bcdf[blk] - bsum[blk])) / bsum[blk]).clamp(0.0, 1.0).unsqueeze(1)  # how far into the block
    # the first slot whose cumulative weight exceeds frac of the block's = the number at or below it
    k = torch.minimum((row <= frac * row_total).sum(1), (row < row_total).sum(1))         # N
    return blk * block + k, total

