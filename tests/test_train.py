"""Trainer: weight-decay mask, parameter groups and LR schedule, replay windows and masks, a tiny seeded run,
resume equivalence, and the train / evaluate commands."""
import json

import pytest
import torch
from typer.testing import CliRunner

from services.trainer.env import RewardConfig
from services.trainer.replay import Replay
from services.trainer.train import (TrainConfig, build_optimizer, group_lr, inductor_options, roll_back, set_lrs,
                                    train_epoch, train_run, weight_decay_mask)
from shared.agent import Agent, AgentConfig
from shared.synthetic import generate

TINY_AGENT = AgentConfig(n_features=14, window=8, d_model=16, n_heads=2, hidden=24, n_atoms=11, ensemble=2,
                         iqn_embed=8, iqn_quantiles_act=8)


def tiny_config() -> TrainConfig:
    return TrainConfig(agent=TINY_AGENT, reward=RewardConfig(episode_bars=60, grace_bars=10), n_envs=4,
                       env_steps_per_iter=2, iterations=14, batch_size=16, replay_capacity=400, learning_starts=40,
                       horizons=(1, 2, 4), iqn_quantiles=4, lr_warmup=5, cosine_period=7, emb_refresh=5)


def test_config_override_parses_each_field_as_its_type_and_names_a_bad_one():
    cfg = TrainConfig.preset("full", 16).override(["agent.n_heads=2", "tau=0.04", "bf16=false", "batch_size=512"])
    assert (cfg.agent.n_heads, cfg.tau, cfg.bf16, cfg.batch_size) == (2, 0.04, False, 512)
    for bad in ("nope=1", "agent.nope=1", "tau"):
        with pytest.raises(ValueError, match="FIELD=VALUE"):
            cfg.override([bad])


def test_inductor_options_turn_named_booleans_on_and_name_an_unknown_one():
    assert inductor_options("") == {}
    assert inductor_options("combo_kernels, coordinate_descent_tuning") == {"combo_kernels": True,
                                                                          "coordinate_descent_tuning": True}
    assert inductor_options("aggressive_fusion,!split_reductions") == {"aggressive_fusion": True,
                                                                       "split_reductions": False}
    assert inductor_options("triton.enable_pdl") == {"triton.enable_pdl": True}          # a sub-config's option
    for bad in ("combo_kernel", "combo_kernels_autotune", "!split_reduction", "triton.enable_pd", "triton",
                "nosuch.enable_pdl"):                                                  # typos; not a boolean
        with pytest.raises(ValueError, match=repr(bad.lstrip("!"))):
            inductor_options(bad)


def test_weight_decay_mask_is_trunk_and_value_matrices_only():
    mask = weight_decay_mask(Agent(TINY_AGENT))
    decayed = {n for n, d in mask.items() if d}
    assert decayed == {"enc_in.weight", "enc_blocks.0.qkv.weight", "enc_blocks.0.proj.weight",
                       "enc_blocks.0.mlp.0.weight", "enc_blocks.0.mlp.2.weight", "trunk.0.weight",
                       "trunk.2.weight", "code.weight", "shift.0.weight", "shift.2.weight", "value_w"}
    assert not mask["enc_pos"] and not mask["value_b"] and not mask["adv_w.0"] and not mask["iqn_tau.weight"]


def test_optimizer_groups_cover_each_parameter_once_with_the_mask():
    ag = Agent(TINY_AGENT)
    cfg = tiny_config()
    opt = build_optimizer(ag, cfg, "cpu")
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(seen) == sorted(id(p) for p in ag.parameters())
    names = {id(p): n for n, p in ag.named_parameters()}
    mask = weight_decay_mask(ag)
    for g in opt.param_groups:
        for p in g["params"]:
            assert (g["weight_decay"] > 0) == mask[names[id(p)]]
    assert {g["branch"] for g in opt.param_groups} == {"trunk", "value", "direction", "size", "exit", "risk"}


def test_lr_schedule_warmup_branch_scale_and_cosine_restart_resets_momentum():
    cfg = tiny_config()   # warm-up 5 updates, cosine period 7, floor 0.3
    scale = {"direction": 2.0, "size": 1.0, "exit": 0.5}
    trunk = {"branch": "trunk", "age": 0}
    assert group_lr(trunk, 0, scale, cfg) == pytest.approx(cfg.lr / 5)
    trunk["age"] = 10
    assert group_lr(trunk, 3, scale, cfg) == pytest.approx(cfg.lr)       # no cosine, no scale on the trunk
    d = {"branch": "direction", "age": 10}
    assert group_lr(d, 7, scale, cfg) == pytest.approx(cfg.lr * 2.0)       # restart: cosine factor 1
    # mid-period: 0.3 + 0.7 · ½(1 + cos(π · 3.5/7)) = 0.65
    cfg.cosine_period = 14
    assert group_lr(d, 7, scale, cfg) == pytest.approx(cfg.lr * 2.0 * 0.65)
    # the rollback's lr_decay multiplies every group, the trunk's too, and set_lrs writes it
    assert group_lr(d, 7, scale, cfg, lr_decay=0.25) == pytest.approx(cfg.lr * 2.0 * 0.65 * 0.25)
    assert group_lr(trunk, 3, scale, cfg, lr_decay=0.25) == pytest.approx(cfg.lr * 0.25)
    cfg.cosine_period = 7
    ag = Agent(TINY_AGENT)
    opt = build_optimizer(ag, cfg, "cpu")
    set_lrs(opt, 3, scale, cfg, lr_decay=0.5)
    for g in opt.param_groups:
        assert float(g["lr"]) == pytest.approx(0.5 * group_lr({**g, "age": g["age"] - 1}, 3, scale, cfg))
    opt = build_optimizer(ag, cfg, "cpu")
    sum(p.sum() for p in ag.parameters()).backward()
    opt.step()
    set_lrs(opt, 7, scale, cfg)   # a restart: branch momentum zeroed, trunk momentum kept
    for g in opt.param_groups:
        for p in g["params"]:
            m = opt.state[p]["exp_avg"]
            assert (m.abs().sum() == 0) == (g["branch"] in ("direction", "size", "exit"))


def test_replay_nstep_window_valid_mask_and_bar_boost():
    rp = Replay(capacity=20, n_envs=2, n_portfolio=1, n_bars=100, horizons=(1, 3), device="cpu")
    assert rp.L == 10
    for step in range(6):   # env e at step l: bar 10·l + e, reward l + 0.1·e; env 1 ends its episode at l = 2
        rp.add(torch.tensor([10 * step, 10 * step + 1]), torch.zeros(2, 1), torch.zeros(2, 3, dtype=torch.long),
               torch.zeros(2, dtype=torch.long), torch.tensor([step, step + 0.1]), torch.tensor([False, step == 2]))
    valid = rp.valid_mask()
    # rows 0, 1, 2 have all 3 later steps written; rows 3, 4, 5 (the newest max-horizon rows) do not
    assert valid[:, 0].tolist() == [True, True, True, False, False, False, False, False, False, False]
    b = rp.sample(200, torch.Generator().manual_seed(0))
    assert set((b.bar // 10).tolist()) <= {0, 1, 2}
    for i in range(200):
        l, e = int(b.bar[i]) // 10, int(b.bar[i]) % 10
        assert b.rewards[i].tolist() == pytest.approx([l + s + 0.1 * e for s in range(3)])
        assert b.next_bar[i].tolist() == [10 * (l + 1) + e, 10 * (l + 3) + e]
        assert b.dones[i].tolist() == [e == 1 and l + s == 2 for s in range(3)]
    # bar boost: bar 11 (env 1, row 1) ×1000 dominates sampling
    rp.set_bar_boost([11], [1000.0])
    b = rp.sample(300, torch.Generator().manual_seed(1))
    assert (b.bar == 11).float().mean() > 0.9
    # priorities written from outside
    rp.set_bar_boost([], [])
    rp.set_priority(torch.arange(20), torch.zeros(20))
    rp.set_priority(torch.tensor([2 * 2 + 0]), torch.tensor([1.0]))    # row 2, env 0 → bar 20
    b = rp.sample(50, torch.Generator().manual_seed(2))
    assert torch.all(b.bar == 20)
    # a slot sampled twice takes the larger of its two new priorities, whichever comes first; the others are kept
    rp.update_priorities(torch.tensor([4, 7, 4]), torch.tensor([0.5, -2.0, 3.0]))
    rp.update_priorities(torch.tensor([9, 9]), torch.tensor([-6.0, 1.0]))
    assert rp.priority.view(-1)[[4, 7, 9, 5]].tolist() == pytest.approx([3.001, 2.001, 6.001, 0.0])
    # the number of valid slots the importance weights use, without counting: as counted, at every fill
    probe = Replay(capacity=20, n_envs=2, n_portfolio=1, n_bars=100, horizons=(1, 3), device="cpu")
    for step in range(14):
        assert int(probe.valid_row_count()) == int(probe.valid_rows().sum()), step
        probe.add(torch.tensor([step, step]), torch.zeros(2, 1), torch.zeros(2, 3, dtype=torch.long),
                  torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.tensor([False, False]))
    # the sampling weight kept beside them is priority^α × boost[bar] after every kind of write, bit for bit
    rp.set_bar_boost([20, 41], [3.0, 0.5])
    rp.update_priorities(torch.tensor([4, 5, 4]), torch.tensor([1.0, 2.0, 0.25]))
    rp.add(torch.tensor([20, 41]), torch.zeros(2, 1), torch.zeros(2, 3, dtype=torch.long),
           torch.zeros(2, dtype=torch.long), torch.zeros(2), torch.tensor([False, False]))
    assert torch.equal(rp.weight, rp.priority.pow(rp.alpha) * rp.bar_boost[rp.bar])
    loaded = Replay(capacity=20, n_envs=2, n_portfolio=1, n_bars=100, horizons=(1, 3), device="cpu")
    loaded.load_state(rp.state_tensors(), rp.state_meta())
    assert torch.equal(loaded.weight, rp.weight)
    assert torch.equal(loaded.sample(64, torch.Generator().manual_seed(5)).slot,
                       rp.sample(64, torch.Generator().manual_seed(5)).slot)


def _params(run_dir):
    from shared.checkpoints import load_checkpoint

    ck = sorted((run_dir / "checkpoints").glob("epoch-*[0-9].safetensors"))[-1]
    return load_checkpoint(ck)


@pytest.mark.parametrize("adamw", ["auto", "flat"])
def test_seeded_run_resumes_identically(tmp_path, adamw):
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    cfg.adamw = adamw                           # flat: the optimizer's state is views of its buffers, restored in place
    a = train_run(bars, "synthetic", tmp_path / "a", 2, config=cfg, seed=5)
    train_run(bars, "synthetic", tmp_path / "b", 1, config=cfg, seed=5)
    b = train_run(bars, "synthetic", tmp_path / "b", 2, config=cfg, seed=5)   # resumes from epoch 1
    assert a.epoch == b.epoch == 2 and a.update_step == b.update_step > 0
    for (n, pa), pb in zip(a.agent.state_dict().items(), b.agent.state_dict().values()):
        assert torch.equal(pa, pb), n
    for pa, pb in zip(a.target.parameters(), b.target.parameters()):
        assert torch.equal(pa, pb)
    wa, ma = _params(tmp_path / "a")
    wb, mb = _params(tmp_path / "b")
    assert ma["epoch"] == mb["epoch"] == 2 and ma["config_hash"] == mb["config_hash"]
    assert set(ma["split_hashes"]) == {"train", "val", "test"}
    hist = [json.loads(x) for x in (tmp_path / "a" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2]
    assert hist[0]["epsilon"] > hist[1]["epsilon"]          # the fixed schedule decays ε from epoch 1 on
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert len((tmp_path / "b" / "history.jsonl").read_text().splitlines()) == 2
    if adamw != "auto":
        return
    # a different seed gives different weights (the test can fail)
    c = train_run(bars, "synthetic", tmp_path / "c", 1, config=cfg, seed=6)
    assert not torch.equal(c.agent.value_w, train_run(bars, "synthetic", tmp_path / "b", 1, config=cfg,
                                                      seed=5).agent.value_w)


def test_rollback_restores_the_best_epochs_learner_bit_for_bit(tmp_path):
    """`roll_back` to epoch 1 of a 2-epoch run: the weights, target network, optimizer state and entropy coefficient
    equal epoch 1's files bit for bit; the replay and the counters move on. `train_run`'s rollback hook does the
    same before the epoch it names (its epoch 3 equals this state's epoch 3) and logs it in history.jsonl."""
    from shared.checkpoints import CheckpointError, checkpoint_sha256, load_checkpoint

    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    a = train_run(bars, "synthetic", tmp_path / "a", 2, config=cfg, seed=5, pinned_fn=lambda: {1})
    ck = tmp_path / "a" / "checkpoints"
    # the pruning kept the pinned epoch's trainer state (a run keeps only its last one otherwise)
    assert sorted(p.name for p in ck.glob("*.state.safetensors")) == ["epoch-0001.state.safetensors",
                                                                       "epoch-0002.state.safetensors"]
    w1, _ = load_checkpoint(ck / "epoch-0001.safetensors")
    t1, _ = load_checkpoint(ck / "epoch-0001.state.safetensors")
    assert any(not torch.equal(v, w1[k]) for k, v in a.agent.state_dict().items())    # it has moved since epoch 1
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        roll_back(a, tmp_path / "a", 1, "0" * 64)
    replay = {k: v.clone() for k, v in a.replay.state_tensors().items()}
    steps = (a.epoch, a.update_step, a.env_steps)
    roll_back(a, tmp_path / "a", 1, checkpoint_sha256((ck / "epoch-0001.safetensors").read_bytes()))
    for k, v in a.agent.state_dict().items():
        assert torch.equal(v, w1[k]), k
    for k, v in a.target.state_dict().items():
        assert torch.equal(v, t1[f"target.{k}"]), k
    names = {p: n for n, p in a.agent.named_parameters()}
    n_opt = 0
    for p, st in a.opt.state.items():
        for slot, v in st.items():
            assert torch.equal(torch.as_tensor(v), t1[f"opt.{names[p]}.{slot}"]), (names[p], slot)
            n_opt += 1
    assert n_opt == sum(k.startswith("opt.") for k in t1) > 0
    assert torch.equal(a.buffers.entropy_coef, t1["buf.entropy_coef"])
    assert (a.epoch, a.update_step, a.env_steps) == steps
    assert all(torch.equal(v, replay[k]) for k, v in a.replay.state_tensors().items())
    # train_run's hook: a run rolled back to epoch 1 before epoch 3 trains epoch 3 as this state does
    train_epoch(a, cfg.schedule.knobs(3))
    c = train_run(bars, "synthetic", tmp_path / "c", 3, config=cfg, seed=5, pinned_fn=lambda: {1},
                  rollback_fn=lambda e: (1, "", 0.0, None, False) if e == 3 else None)
    for (n, pa), pc in zip(a.agent.state_dict().items(), c.agent.state_dict().values()):
        assert torch.equal(pa, pc), n
    hist = [json.loads(x) for x in (tmp_path / "c" / "history.jsonl").read_text().splitlines()]
    assert [h["rolled_back_to"] for h in hist] == [None, None, 1]
    assert hist[0]["rollback_s"] is None and hist[1]["rollback_s"] is None and hist[2]["rollback_s"] > 0.0


def test_a_rollback_that_keeps_a_share_blends_the_current_and_the_best_weights(tmp_path):
    """`roll_back(..., keep=k)`: every floating-point tensor of the network and of its target is
    `k·current + (1 − k)·best` (in float64, stored as float32), the optimizer state is the best epoch's bit for bit;
    a share outside [0, 1) is refused before anything changes."""
    from shared.checkpoints import load_checkpoint

    bars = generate(700, seed=3).bars
    a = train_run(bars, "synthetic", tmp_path / "a", 2, config=tiny_config(), seed=5, pinned_fn=lambda: {1})
    ck = tmp_path / "a" / "checkpoints"
    w1, _ = load_checkpoint(ck / "epoch-0001.safetensors")
    t1, _ = load_checkpoint(ck / "epoch-0001.state.safetensors")
    now = {k: v.clone() for k, v in a.agent.state_dict().items()}
    now_t = {k: v.clone() for k, v in a.target.state_dict().items()}
    with pytest.raises(ValueError, match=r"keep must be in \[0, 1\)"):
        roll_back(a, tmp_path / "a", 1, keep=1.0)
    assert all(torch.equal(v, now[k]) for k, v in a.agent.state_dict().items())
    roll_back(a, tmp_path / "a", 1, keep=0.25)
    moved = 0
    for k, v in a.agent.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, (0.25 * now[k].double() + 0.75 * w1[k].double()).float()), k
            moved += not torch.equal(v, w1[k])
        else:
            assert torch.equal(v, w1[k]), k
    assert moved > 0                                   # the blend is neither epoch's weights
    for k, v in a.target.state_dict().items():
        ref = t1[f"target.{k}"]
        assert torch.equal(v, (0.25 * now_t[k].double() + 0.75 * ref.double()).float() if v.is_floating_point()
                           else ref), k
    names = {p: n for n, p in a.agent.named_parameters()}
    for p, st in a.opt.state.items():
        for slot, v in st.items():
            assert torch.equal(torch.as_tensor(v), t1[f"opt.{names[p]}.{slot}"]), (names[p], slot)


def test_flat_adamw_trains_the_agent_as_torch_adamw_does(tmp_path):
    """`adamw="flat"` (`FlatAdamW`, the target's lerp over a flat copy) against torch's AdamW with the per-parameter
    clip and lerp: two epochs of the same seeded run, with warm-up, cosine restarts (their momentum reset) and
    weight decay, end at the same parameters up to the order of float sums."""
    bars = generate(700, seed=3).bars
    runs = {}
    for adamw in ("auto", "flat"):
        cfg = tiny_config()
        cfg.adamw = adamw
        runs[adamw] = train_run(bars, "synthetic", tmp_path / adamw, 2, config=cfg, seed=5)
    a, b = runs["auto"], runs["flat"]
    assert a.update_step == b.update_step > 14
    for (n, pa), pb in zip(a.agent.named_parameters(), b.agent.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-6), n
    for (n, pa), pb in zip(a.target.named_parameters(), b.target.parameters()):
        assert torch.allclose(pa, pb, rtol=1e-4, atol=1e-6), n
    moved = max(float((pa - pb).abs().max()) for pa, pb in zip(a.agent.parameters(), a.target.parameters()))
    assert moved > 1e-4                          # the target trails the agent: the comparison above is not vacuous


def test_evaluate_command_baselines_and_agent(tmp_path):
    from tradeloop.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["evaluate", "--policy", "flat", "--dataset", "synthetic", "--split", "test", "--json"])
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)["metrics"]
    assert m["n_trades"] == 0 and m["total_return"] == 0
    r = runner.invoke(app, ["evaluate", "--policy", "oracle", "--dataset", "sp500", "--split", "val"])
    assert r.exit_code == 2 and "oracle" in r.stderr
    r = runner.invoke(app, ["evaluate", "--policy", str(tmp_path / "nope"), "--dataset", "synthetic"])
    assert r.exit_code == 2 and "nope" in r.stderr
    r = runner.invoke(app, ["train", "--dataset", str(tmp_path / "missing.csv"), "--epochs", "1",
                            "--out", str(tmp_path / "run")])
    assert r.exit_code == 2 and "missing.csv" in r.stderr


def test_view_cache_follows_the_embeddings_and_is_what_collection_acts_on():
    """`act_view_cache`: the online view table equals `Agent.view` of the cached embeddings after the full refresh
    and after each rolling refresh; acting on it right after a refresh takes the actions the heads take on the same
    embeddings; an epoch trains with it (the double-Q selection reads it too)."""
    from services.trainer.train import build_state, refresh_embeddings, refresh_rolling, train_epoch
    from shared.knobs import Knobs
    from shared.market import chronological_split

    bars = generate(700, seed=3).bars
    split = chronological_split(len(bars))
    states = []
    for cache in (True, False):
        cfg = tiny_config()
        cfg.act_view_cache = cache
        st = build_state(cfg, bars, split, 5, "cpu")
        with torch.no_grad():
            st.agent.shift[2].weight.normal_(0.0, 0.05)       # a shift that matters
        st.target.load_state_dict(st.agent.state_dict())
        st.env.reset_all()
        refresh_embeddings(st)
        states.append(st)
    on, off = states
    assert off.buffers.view_online is None
    v, want = on.buffers.view_online, on.agent.view(on.buffers.emb_online)
    for f in ("q", "q_std", "tail", "code"):
        torch.testing.assert_close(getattr(v, f), getattr(want, f))
    for st in states:
        st.controls.set(epsilon=0.0)
        st.runner.collect()
    n = on.replay.count
    assert n == off.replay.count > 0
    assert torch.equal(on.replay.action[:n], off.replay.action[:n])      # same actions, from table or from heads
    # a rolling refresh rewrites the rows it re-encodes (after the weights moved)
    with torch.no_grad():
        for p in on.agent.parameters():
            p.add_(0.01 * torch.randn_like(p))
    before = v.q.clone()
    refresh_rolling(on)
    changed = (v.q != before).any(1)
    assert 0 < int(changed.sum()) <= on.refresh_idx.shape[0]
    torch.testing.assert_close(v.q[changed], on.agent.view(on.buffers.emb_online[changed]).q)
    stats = train_epoch(on, Knobs(epsilon=0.1))
    assert stats.updates > 0 and torch.isfinite(torch.tensor(stats.loss))


@pytest.mark.parametrize("chunk,compiled", [(64, False), (150, False), (10_000, False), (150, True)])
def test_the_full_refresh_in_whole_chunks_fills_every_row_as_the_ragged_chunks_do(chunk, compiled):
    """A compiled pass takes whole chunks only (`StepRunner.encode_bars_compiled`: the last chunk ends at the last
    bar): the tables and the view table hold what chunks cut anywhere give, where the split divides by the chunk,
    where it does not, and where one chunk is longer than the split; each pass sees `chunk` bars or the whole
    split. And with `encode_bars` through `compile_step` (`full_refresh_pass`, which the product compiles on CUDA;
    here the CPU's kernels): the same tables as the eager pass, within float rounding."""
    from services.trainer.runtime import full_refresh_pass
    from services.trainer.train import build_state, refresh_embeddings
    from shared.market import chronological_split
    from shared.rollout import compile_works

    if compiled and not compile_works(torch.device("cpu")):
        pytest.skip("torch.compile cannot build kernels here")

    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    cfg.act_view_cache = True
    st = build_state(cfg, bars, chronological_split(len(bars)), 5, "cpu")
    T = st.env.market.windows.shape[0]
    refresh_embeddings(st, chunk=T)                 # one pass over every bar: the reference
    want = [st.buffers.emb_online.clone(), st.buffers.emb_target.clone(), st.buffers.view_online.q.clone()]
    seen = []
    own = full_refresh_pass(cfg, "cpu", compiled)
    st.runner.encode_bars = lambda net, w, view: (seen.append(w.shape[0]), own(net, w, view))[1]
    st.runner.encode_bars_compiled = True
    for t in (st.buffers.emb_online, st.buffers.emb_target, st.buffers.view_online.q):
        t.fill_(float("nan"))
    refresh_embeddings(st, chunk=chunk)
    assert set(seen) == {min(chunk, T)}
    got = [st.buffers.emb_online, st.buffers.emb_target, st.buffers.view_online.q]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_collection_runs_the_heads_once_per_bar_when_accounts_outnumber_bars():
    """With E × steps ≥ T the collection computes the heads once per bar (`Agent.view_table` of the embedding
    table) and each account-step reads its row: the same decisions and replay as the heads run per account-step."""
    from services.trainer.train import build_state, refresh_embeddings
    from shared.market import chronological_split

    bars = generate(400, seed=4).bars
    split = chronological_split(len(bars))
    runs = []
    for per_bar in (True, False):
        cfg = tiny_config()
        cfg.n_envs = 160
        st = build_state(cfg, bars, split, 2, "cpu")
        with torch.no_grad():
            st.agent.shift[2].weight.normal_(0.0, 0.05)       # a shift that matters
        st.env.reset_all()
        refresh_embeddings(st)
        st.controls.set(epsilon=0.1)
        T = st.buffers.emb_online.shape[0]
        assert st.cfg.n_envs * st.cfg.env_steps_per_iter >= T    # the automatic choice is the per-bar one here
        g = torch.Generator().manual_seed(9)
        for _ in range(3):
            noise = torch.rand(st.cfg.env_steps_per_iter, st.cfg.n_envs, 7, generator=g)
            st.env.collect(st.agent, st.controls, st.cfg.env_steps_per_iter, st.buffers.emb_online, noise,
                           per_bar=per_bar)
        runs.append(st)
    a, b = runs
    n = a.replay.count
    assert n == b.replay.count == 3 * 2
    assert torch.equal(a.replay.bar[:n], b.replay.bar[:n])
    same = (a.replay.action[:n] == b.replay.action[:n]).all(-1).float().mean().item()
    assert same > 0.99, same
    torch.testing.assert_close(a.replay.reward[:n], b.replay.reward[:n])


@pytest.mark.parametrize("S", [1, 255, 256, 257, 5000])
def test_inverse_cdf_in_blocks_equals_the_flat_search(S):
    """The two-level draw picks the slot the flat cumulative sum and search pick, for zeros (never drawn), runs of
    zeros across whole blocks, a ring not a multiple of the block, and u at 0 and just below 1."""
    from services.trainer.replay import inverse_cdf
    g = torch.Generator().manual_seed(S)
    p = torch.rand(S, generator=g) * (torch.rand(S, generator=g) > 0.3)
    p[S // 3: S // 3 + 600] = 0.0                                          # whole blocks of nothing
    p[-1] = 0.0
    if p.sum() == 0:
        p[0] = 1.0
    u = torch.cat([torch.rand(4000, generator=g), torch.tensor([0.0, 1.0 - 2 ** -24])])
    slot, total = inverse_cdf(p, u)
    cdf = torch.cumsum(p.double(), 0)
    flat = torch.searchsorted(cdf, u.double() * cdf[-1], right=True).clamp(max=S - 1)
    assert total.item() == pytest.approx(cdf[-1].item())
    assert torch.equal(slot, flat)
    assert torch.all(p[slot] > 0)


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_grad_norm_equals_torchs(max_norm):
    """The update's gradient clip (written so that inductor fuses the total norm) returns torch's total norm and
    scales the gradients as torch's does: clipped at 0.5, untouched at 1 000."""
    from services.trainer.train import clip_grad_norm
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 4, 6), (1,)]
    grads = [torch.randn(s, generator=g) for s in shapes]
    ours = [torch.zeros(s).requires_grad_() for s in shapes]
    ref = [torch.zeros(s).requires_grad_() for s in shapes]
    for a, b, g0 in zip(ours, ref, grads):
        a.grad, b.grad = g0.clone(), g0.clone()
    n_ours = clip_grad_norm(ours, max_norm)
    n_ref = torch.nn.utils.clip_grad_norm_(ref, max_norm)
    torch.testing.assert_close(n_ours, n_ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad)
    clipped = max_norm < float(n_ref)
    assert clipped == (max_norm == 0.5)
    for a, g0 in zip(ours, grads):
        torch.testing.assert_close(a.grad, g0 * (max_norm / (float(n_ref) + 1e-6) if clipped else 1.0))


def test_the_saved_replay_keeps_its_integers_in_the_narrowest_dtype_and_loads_them_back_as_they_were(tmp_path):
    from services.trainer.checkpoint import narrow_ints
    from shared.checkpoints import load_checkpoint

    t = torch.tensor([0, 5, 127], dtype=torch.int64)
    assert narrow_ints(t).dtype == torch.int8 and torch.equal(narrow_ints(t).long(), t)
    assert narrow_ints(torch.tensor([-129, 0])).dtype == torch.int16
    assert narrow_ints(torch.tensor([0, 40_000])).dtype == torch.int32
    assert narrow_ints(torch.tensor([0, 2**31])).dtype == torch.int64            # too wide for int32: unchanged
    assert narrow_ints(torch.tensor([0.5])).dtype == torch.float32                 # not an integer: unchanged
    assert narrow_ints(torch.zeros(0, dtype=torch.int64)).dtype == torch.int64
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    a = train_run(bars, "synthetic", tmp_path / "a", 1, config=cfg, seed=5)
    saved, _ = load_checkpoint(tmp_path / "a" / "checkpoints" / "epoch-0001.state.safetensors")
    assert saved["replay.action"].dtype == torch.int8 and saved["replay.regime"].dtype == torch.int8
    assert saved["replay.bar"].dtype == torch.int16                                   # 700 bars
    b = train_run(bars, "synthetic", tmp_path / "a", 1, config=cfg, seed=5)    # resumed: a fresh state, restored
    assert b is not a and b.epoch == 1
    for k, v in a.replay.state_tensors().items():
        got = b.replay.state_tensors()[k]
        assert got.dtype == v.dtype and torch.equal(got, v), k


def test_the_trainer_state_is_written_beside_on_epoch_and_complete_before_on_saved(tmp_path, monkeypatch):
    """`train_run`: the weights' file is complete when `on_epoch` runs (what an evaluation loads) while the trainer
    state is written on a thread; `on_saved` comes once both files are complete and the history line is in. The
    state written beside `on_epoch` is the file an inline write gives, byte for byte; a failed state write is raised
    and leaves its epoch incomplete."""
    from services.trainer import checkpoint as ck
    from services.trainer.rundir import checkpoint_path, latest_epoch
    from shared.checkpoints import checkpoint_sha256

    bars, cfg = generate(700, seed=3).bars, tiny_config()
    seen = []

    def history(run):
        p = run / "history.jsonl"
        return [json.loads(x)["epoch"] for x in p.read_text().splitlines()] if p.exists() else []

    def on_epoch(s):
        w = checkpoint_path(tmp_path / "a", s.epoch)
        side = w.with_name(w.name + ".sha256").read_text().split()[0]
        assert checkpoint_sha256(w.read_bytes()) == side
        seen.append(("epoch", s.epoch, history(tmp_path / "a")))

    def on_saved(s):
        seen.append(("saved", s.epoch, history(tmp_path / "a"), latest_epoch(tmp_path / "a"), s.save_s > 0))

    train_run(bars, "synthetic", tmp_path / "a", 2, config=cfg, seed=5, on_epoch=on_epoch, on_saved=on_saved)
    assert seen == [("epoch", 1, []), ("saved", 1, [1], 1, True), ("epoch", 2, [1]), ("saved", 2, [1, 2], 2, True)]
    train_run(bars, "synthetic", tmp_path / "b", 2, config=cfg, seed=5)       # no on_epoch: written inline
    for run in ("a", "b"):
        assert not checkpoint_path(tmp_path / run, 1, state=True).exists()    # pruned once epoch 2 was complete
    assert (checkpoint_path(tmp_path / "a", 2, state=True).read_bytes()
            == checkpoint_path(tmp_path / "b", 2, state=True).read_bytes())

    real = ck.save_checkpoint

    def failing(path, tensors, meta):
        if meta.get("kind") == "trainer_state":
            raise OSError(f"no space left writing {path.name}")
        return real(path, tensors, meta)

    monkeypatch.setattr(ck, "save_checkpoint", failing)
    with pytest.raises(OSError, match="no space left writing epoch-0001.state.safetensors"):
        train_run(bars, "synthetic", tmp_path / "c", 1, config=cfg, seed=5, on_epoch=lambda s: None)
    assert latest_epoch(tmp_path / "c") == 0 and history(tmp_path / "c") == []
