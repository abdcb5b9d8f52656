"""The device tensors the update and collection read (`UpdateBuffers`: knob tensors, lookup tables, the epoch's
metric sums) and the embedding cache: every training bar's market embedding (online and target networks, and the
online `MarketView` when `act_view_cache`), refreshed whole once per epoch and a rolling chunk per update.

Owns: the buffers' layout and construction, `METRICS`, the cache's refresh (`refresh_embeddings`,
`encode_bars`, `refresh_encode` → `refresh_store`). Imports: torch, `shared.agent` (MarketView), `shared.knobs`,
`services.trainer.config`; `TrainState` for types only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.agent import AgentConfig, MarketView
from shared.knobs import BRANCHES, Knobs
from services.trainer.config import TrainConfig

if TYPE_CHECKING:
    from services.trainer.state import TrainState


@dataclass
class UpdateBuffers:
    """Device tensors the update reads: knobs (γ, Q-bias), the entropy coefficient, lookup tables."""

    gamma: torch.Tensor
    q_bias: torch.Tensor
    entropy_coef: torch.Tensor
    horizon_blend: torch.Tensor
    """N_REGIMES × H."""
    hindsight: torch.Tensor
    """T_train: E7 hindsight-optimal direction per bar, −1 where none."""
    emb_online: torch.Tensor
    """T_train × D: online-network market embedding of every training bar, refreshed every `emb_refresh`
    updates (acting and double-Q selection at bootstrap states read it; the current state is encoded with
    gradient inside the update)."""
    emb_target: torch.Tensor
    """T_train × D: the same for the target network (bootstrap evaluation)."""
    emb_offset: torch.Tensor
    """First bar of the next rolling embedding refresh (device scalar)."""
    view_online: MarketView | None
    """T_train rows: the online network's `MarketView` of every training bar, refreshed with `emb_online` (what
    collection acts on when `act_view_cache`), else None."""
    step: torch.Tensor
    """Updates done so far (device scalar, float64): the LR schedule of a captured step reads it."""
    lr_scale: torch.Tensor
    """Per optimizer group: the E4 scale of its branch (1 for non-branch groups), float64."""
    lr_branch: torch.Tensor
    """Per optimizer group: True for the branch groups (E4 scale and cosine restarts apply)."""
    metric_sums: torch.Tensor
    """Sum over the epoch's updates of each of `METRICS` (read once per epoch)."""


METRICS = ("loss", "c51", "iqn", "expectile", "q_mean", "entropy", "utilisation", "grad_norm")


def make_buffers(cfg: TrainConfig, opt: torch.optim.Optimizer, T: int, device: torch.device) -> UpdateBuffers:
    """Fresh buffers for a training split of T bars and the optimizer's groups (knob tensors at their defaults)."""
    return UpdateBuffers(gamma=torch.tensor(Knobs().gamma, device=device), q_bias=torch.tensor(0.0, device=device),
                         entropy_coef=torch.tensor(cfg.entropy_init, device=device),
                         horizon_blend=torch.tensor(cfg.horizon_blend, dtype=torch.float32, device=device),
                         hindsight=torch.full((T,), -1, dtype=torch.long, device=device),
                         emb_online=torch.zeros(T, cfg.agent.d_model, device=device),
                         emb_target=torch.zeros(T, cfg.agent.d_model, device=device),
                         emb_offset=torch.zeros((), dtype=torch.long, device=device),
                         view_online=_view_table(cfg.agent, T, device) if cfg.act_view_cache else None,
                         step=torch.zeros((), dtype=torch.float64, device=device),
                         lr_scale=torch.ones(len(opt.param_groups), dtype=torch.float64, device=device),
                         lr_branch=torch.tensor([g["branch"] in BRANCHES for g in opt.param_groups], device=device),
                         metric_sums=torch.zeros(len(METRICS), device=device))


def _view_table(cfg: AgentConfig, T: int, device) -> MarketView:
    """A zeroed T-row `MarketView` table (filled by `refresh_embeddings`)."""
    z = lambda *shape: torch.zeros(T, *shape, device=device)  # noqa: E731
    return MarketView(q=z(cfg.n_actions), q_std=z(3), tail=z(cfg.n_tail, 3), code=z(cfg.code_dim))


def _store_view(table: MarketView, idx: torch.Tensor, v: MarketView) -> None:
    """table[idx] = v for each field, in place (`index_put_` of distinct rows: capturable, and with a vmap rule, so
    R runs' tables take their rows in one launch)."""
    for name in MarketView.FIELDS:
        dst = getattr(table, name)
        dst.index_put_((idx,), getattr(v, name).to(dst.dtype))


def encode_bars(net: torch.nn.Module, windows: torch.Tensor, view: bool) -> list[torch.Tensor]:
    """[the market embeddings of `windows` through `net`'s encoder] (+ the fields of its `MarketView` where `view`):
    the full refresh's pass over a chunk of bars (`StepRunner.encode_bars` runs it in the steps' precision, and
    compiled on CUDA)."""
    emb = net.encode(windows)
    return [emb, *(getattr(net.view(emb), name) for name in MarketView.FIELDS)] if view else [emb]


@torch.no_grad()
def refresh_embeddings(state: TrainState, chunk: int = 4096) -> None:
    """Recompute the cached market embeddings of every training bar (online and target networks), in place, through
    the run's `StepRunner.encode_bars` (`encode_bars` itself before a runner exists); the rolling refresh restarts at
    bar 0. A compiled pass takes whole chunks only (one shape: the last starts `chunk` bars before the end)."""
    w, buf, runner = state.env.market.windows, state.buffers, state.runner
    T = w.shape[0]
    run, whole = (runner.encode_bars, runner.encode_bars_compiled) if runner is not None else (encode_bars, False)
    for net, out in ((state.agent, buf.emb_online), (state.target, buf.emb_target)):
        view = buf.view_online is not None and net is state.agent
        for i in range(0, T, chunk):
            i = max(0, min(i, T - chunk)) if whole else i
            got = run(net, w[i:i + chunk], view)
            out[i:i + chunk] = got[0]
            if view:
                rows = torch.arange(i, min(i + chunk, T), device=w.device)
                _store_view(buf.view_online, rows, MarketView(*got[1:]))
    buf.emb_offset.zero_()


@torch.no_grad()
def refresh_encode(state: TrainState) -> list[torch.Tensor]:
    """The next C bars (cyclically) of the rolling refresh encoded with the current parameters: [online embeddings,
    target embeddings] (+ the fields of the online `MarketView` when it is cached). Reads only parameters and
    windows (`refresh_store` writes them into the tables)."""
    buf, T = state.buffers, state.buffers.emb_online.shape[0]
    w = state.env.market.windows[(buf.emb_offset + state.refresh_idx) % T]
    emb = state.agent.encode(w)
    out = [emb, state.target.encode(w)]
    if buf.view_online is not None:
        v = state.agent.view(emb)
        out += [getattr(v, name) for name in MarketView.FIELDS]
    return out


@torch.no_grad()
def refresh_store(state: TrainState, staged: list[torch.Tensor]) -> None:
    """Write `refresh_encode`'s encodings into the tables, in place, and advance the offset: every bar's cached
    embedding is at most `emb_refresh` updates old, at a constant cost per update (capturable: the offset is a
    device scalar)."""
    buf, T = state.buffers, state.buffers.emb_online.shape[0]
    idx = (buf.emb_offset + state.refresh_idx) % T                                         # C
    buf.emb_online.index_put_((idx,), staged[0].to(buf.emb_online.dtype))
    buf.emb_target.index_put_((idx,), staged[1].to(buf.emb_target.dtype))
    if buf.view_online is not None:
        _store_view(buf.view_online, idx, MarketView(*staged[2:]))
    buf.emb_offset.copy_(torch.remainder(buf.emb_offset + state.refresh_idx.shape[0], T))     # copy_: a vmap rule


def refresh_rolling(state: TrainState) -> None:
    """Re-encode the next C bars of both embedding tables (and the online view table), in place."""
    refresh_store(state, refresh_encode(state))
