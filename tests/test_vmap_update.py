"""bench/vmap_update.py: R runs' updates as one vmapped computation print their rows for a tiny CPU config, each R's
batched losses checked against the runs' own objectives; each run's batch is the one its own replay gives, bit for
bit; a batched update moves every run's networks, each from its own state at its own learning rates, and writes
each run's priorities as its own replay does (its GPU figures come from the device machine)."""
import json

import torch

from bench import vmap_update
from services.trainer import lockstep
from services.trainer.losses import adapt_entropy_coef
from services.trainer.optim import scheduled_lr


def test_the_bench_times_vmapped_updates_that_move_every_run(capsys, monkeypatch):
    built = []
    make = vmap_update.make_states
    monkeypatch.setattr(vmap_update, "make_states", lambda args, R: built.extend(make(args, R)) or built)
    vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "1", "2", "--steps", "2", "--warmup", "14",
                      "--bars", "6000", "--set", "iterations=4", "--accel", "eager"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["runs"] for r in rows] == [1, 2] and all(r["per_s"] > 0 for r in rows)
    assert all(r["check"] < 1e-5 for r in rows), rows        # each run's batched loss is its own objective's
    with torch.no_grad():                                  # run 1's own knobs and embedding tables
        built[1].buffers.gamma.fill_(0.9)
        built[1].buffers.emb_target.mul_(1.5)
    upd = vmap_update.BatchedUpdate(built)
    assert upd.check(built) < 1e-5
    mixed = vmap_update.BatchedUpdate(built)               # every run reading run 0's buffers: the check sees it
    mixed.bufs = {k: v[:1].expand_as(v) for k, v in mixed.bufs.items()}
    assert mixed.check(built) > 1e-4
    upd.draw()
    batch = upd.sample(upd.replays, upd.u)
    for r, st in enumerate(built):
        own = st.replay.sample(st.cfg.batch_size, u=upd.u[r])
        assert all(torch.equal(x[r], getattr(own, f)) for x, f in zip(batch, vmap_update.BATCH_FIELDS)), r
    before = {n: p.detach().clone() for n, p in upd.p.items()}
    for n, p in built[1].agent.named_parameters():                                # the stack starts from each state
        assert torch.equal(p, before[n][1])
    tbefore = {n: p.clone() for n, p in upd.tp.items()}
    with torch.no_grad():
        td, util = upd.losses()[3:5]                       # each run's TD errors and utilisation, before the update
        coef = upd.bufs["entropy_coef"].clone()
        upd.bufs["step"][1].add_(7.0)                      # run 1 later in its schedule, its branches at half rate
        upd.bufs["lr_scale"][1].mul_(0.5)
    priority = upd.replays["priority"].clone()
    steps, scales = upd.bufs["step"].clone(), upd.bufs["lr_scale"].clone()
    losses = upd()
    for r in range(2):                             # each run's LRs from its own counter and knobs, the counter on
        want = scheduled_lr(steps[r], steps[r], scales[r], upd.bufs["lr_branch"][r], upd.cfg)
        assert torch.equal(upd.opt.lr_vector[r], want.float()) and torch.equal(upd.bufs["step"][r], steps[r] + 1)
    assert not torch.equal(upd.opt.lr_vector[0], upd.opt.lr_vector[1])
    assert losses.shape == (2,) and torch.isfinite(losses).all()
    assert [any(not torch.equal(upd.p[n][r], before[n][r]) for n in before) for r in range(2)] == [True, True]
    assert any(not torch.equal(upd.tp[n], tbefore[n]) for n in tbefore)          # the targets follow
    for r in range(2):                             # each run's entropy coefficient, from its own utilisation
        own = coef[r].clone()
        adapt_entropy_coef(own, util[r], upd.cfg.entropy_target, upd.cfg.entropy_rate)
        assert torch.equal(upd.bufs["entropy_coef"][r], own) and not torch.equal(own, coef[r])
    for r, st in enumerate(built):                 # each run's priorities: what its own replay writes from its TD
        assert not torch.equal(upd.replays["priority"][r], priority[r])
        st.replay.update_priorities(batch[0][r], td[r])
        for k in ("priority", "weight", "max_priority"):
            assert torch.equal(upd.replays[k][r], getattr(st.replay, k)), (r, k)


def test_the_whole_iteration_batched_collects_what_each_run_collects_alone(capsys, monkeypatch):
    """`--step iteration`: R runs' collections in one vmapped computation write what each run's own `collect` writes
    from the same state on the same noise (accounts, episodes, replay rows); a run whose accounts are another's is
    seen; the product's own run is timed beside them."""
    built = []
    make = vmap_update.make_states
    monkeypatch.setattr(vmap_update, "make_states", lambda args, R: built.extend(make(args, R)) or built)
    vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "1", "2", "--steps", "2", "--warmup", "14",
                      "--bars", "6000", "--set", "iterations=4", "--accel", "eager", "--step", "iteration",
                      "--product"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["runs"] for r in rows] == ["product", 1, 2] and all(r["per_s"] > 0 for r in rows)
    assert all(r["check"] < 1e-5 for r in rows), rows
    it = vmap_update.BatchedIteration(built)
    head = it.upd.replays["head_t"].clone()
    assert it.col.check(built) < 1e-9                      # the collection alone: each run's own, to rounding
    n = built[0].cfg.env_steps_per_iter                    # a row per step, for every run
    assert torch.equal(it.upd.replays["head_t"], (head + n) % built[0].replay.L)
    for r, st in enumerate(built):
        assert torch.equal(it.upd.replays["action"][r], st.replay.action)
        assert torch.equal(it.col.state["sim"]["position"][r], st.env.sim.position)
    mixed = vmap_update.BatchedIteration(built)            # every run's accounts run 0's: the check sees it
    mixed.col.state["sim"] = {k: v[:1].expand_as(v).clone() for k, v in mixed.col.state["sim"].items()}
    assert mixed.col.check(built) > 1e-3


def test_a_warmup_too_short_to_sample_from_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "1", "--steps", "2", "--warmup", "5",
                          "--bars", "6000", "--set", "iterations=4", "--accel", "eager"])
    assert "--warmup 5 left the replay of run(s) [0] without a transition" in capsys.readouterr().err


def test_a_profile_is_refused_off_a_gpu(capsys):
    import pytest

    with pytest.raises(SystemExit):
        vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "1", "--profile", "20"])
    assert "--profile reads CUDA kernels: it needs --device cuda" in capsys.readouterr().err


def test_the_batched_refresh_stores_what_each_runs_own_refresh_stores(monkeypatch):
    """Every batched update advances each run's rolling embedding refresh: the tables and the offset after a batched
    refresh are those each run's own `refresh_rolling` gives from the same networks and tables; a run encoding with
    another run's networks is seen."""
    built = []
    make = vmap_update.make_states
    monkeypatch.setattr(vmap_update, "make_states", lambda a, R: built.extend(make(a, R)) or built)
    vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "2", "--steps", "1", "--warmup", "14",
                      "--bars", "6000", "--set", "iterations=4", "--accel", "eager"])
    upd = vmap_update.BatchedUpdate(built)
    offset = upd.bufs["emb_offset"].clone()
    with torch.no_grad():
        upd.p[next(iter(upd.p))][1].mul_(1.01)            # run 1's networks now differ from run 0's
        next(built[1].agent.parameters()).mul_(1.01)
    before = upd.bufs["emb_online"].clone()
    assert upd.refresh.check(built) < 1e-6
    C, T = built[0].refresh_idx.shape[0], upd.bufs["emb_online"].shape[1]
    assert torch.equal(upd.bufs["emb_offset"], (offset + C) % T)
    changed = (upd.bufs["emb_online"] != before).any(dim=-1)                    # R × T: the chunk's rows alone
    for r in range(2):
        rows = set(((offset[r] + torch.arange(C)) % T).tolist())
        assert set(changed[r].nonzero().flatten().tolist()) <= rows and changed[r].any(), r
    mixed = vmap_update.BatchedUpdate(built)              # every run encoding with run 0's networks: the check sees it
    mixed.p = {k: v[:1].expand_as(v).clone() for k, v in mixed.p.items()}
    assert mixed.refresh.check(built) > 1e-6


def test_the_timed_step_keeps_the_vmapped_layers_in_autocasts_precision(capsys, monkeypatch):
    """The step the bench times runs in the product's precision all the way through: with its precision rule set to
    bf16 autocast (CUDA's on the device; the CPU's here), the attention of the vmapped iteration receives bf16, as
    one run's does — vmap alone would hand it fp32 (`run_batch.AutocastLinear`)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    def bf16(fn, cfg, device):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)
        return run

    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention and torch.is_autocast_enabled("cpu"):
                seen.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(lockstep, "in_precision", bf16)          # the rule `batched_precision` reads
    with Spy():
        vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "2", "--steps", "1", "--warmup", "14",
                          "--bars", "6000", "--set", "iterations=4", "--accel", "eager", "--step", "iteration"])
    assert seen and set(seen) == {torch.bfloat16}, seen


def test_the_compiled_step_is_checked_against_the_eager_step(capsys, monkeypatch):
    """Compiled, the vmapped step is traced as the lockstep engine traces it (`lockstep_graphs`: the collection's and
    the updates' graphs apart, or the whole iteration as one), and the bench reads its compiled call against the
    eager step from one state: nothing apart when the recorded graphs run as they are, a gap when they do not."""
    built = []
    make = vmap_update.make_states
    monkeypatch.setattr(vmap_update, "make_states", lambda args, R: built.extend(make(args, R)) or built)
    monkeypatch.setattr(vmap_update, "compile_step", lambda graph, cfg, device: graph)      # no inductor on a CPU
    for graphs in (1, 2):
        built.clear()
        vmap_update.main(["--device", "cpu", "--preset", "small", "--runs", "2", "--steps", "2", "--warmup", "14",
                          "--bars", "6000", "--set", "iterations=4", "--set", f"lockstep_graphs={graphs}",
                          "--accel", "compile", "--step", "iteration"])
        (row,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (row["traced"]["float"], row["traced"]["int"]) == (0.0, 0.0) and row["per_s"] > 0
        assert row["graphs"] == graphs
    it = vmap_update.BatchedIteration(built)
    graphs = [vmap_update.TracedStep(f, lambda graph: graph) for f in (it.col, it.updates)]
    split = vmap_update.Sequenced(*graphs)
    it.draw()
    split()
    assert vmap_update.compiled_difference(it, split) == {"float": 0.0, "float_at": None, "int": 0.0, "int_at": None}
    graphs[0].run = lambda g=graphs[0].graph: (g(), g())[1]                                   # the collection twice
    assert vmap_update.compiled_difference(it, split)["int"] > 0
    it = vmap_update.BatchedIteration(built)
    twice = vmap_update.TracedStep(it, lambda graph: lambda: (graph(), graph())[1])          # two steps a call
    it.draw()
    twice()
    apart = vmap_update.compiled_difference(it, twice)
    assert apart["float"] > 1e-4 and apart["float_at"] in it.tensors()
