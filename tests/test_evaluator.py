"""The evaluator library (services/evaluator/runner.py): alignment with the trainer's environment, a full report
that round-trips through JSON, refused checkpoints, and a handcrafted policy whose ledger is known in advance.

Tiny agents (window 8, width 16) on a few hundred synthetic bars keep this file to seconds.
"""
from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from services.evaluator.runner import (eval_controls, evaluate_checkpoint, restore_agent, run_split,
                                       run_windows)
from services.trainer.env import RewardConfig, TrainEnv
from services.trainer.replay import Replay
from shared.agent import Agent, AgentConfig
from shared.checkpoints import CheckpointError, checkpoint_to_bytes, save_checkpoint
from shared.execution import CostModel, Prices, Simulator, run_positions
from shared.knobs import Knobs
from shared.market import chronological_split, compute_features, load_dataset
from shared.metrics import compute_metrics
from shared.report import EvalReport
from shared.rollout import MarketTensors, evaluate_policy, run_rollout

COSTS = CostModel(cost_bps=2.0)


@pytest.fixture(scope="module")
def bars():
    return load_dataset("synthetic", seed=3).slice(0, 700)


@pytest.fixture(scope="module")
def feats(bars):
    return compute_features(bars)


def tiny_agent(n_features: int, seed: int = 0, **kw) -> Agent:
    torch.manual_seed(seed)
    cfg = AgentConfig(n_features=n_features, window=8, d_model=16, n_heads=2, hidden=32, n_atoms=11, ensemble=3,
                      **kw)
    return Agent(cfg).eval()


def _metrics(ledger, bar_returns, positions):
    return compute_metrics(ledger["net_return"].to_numpy(), bar_returns, positions, ledger["bars"].to_numpy())


def test_alignment_trainer_env_and_evaluator(bars, feats):
    """Same weights, same window: the trainer's env (TrainEnv.on_step via run_rollout, ε = 0, protection on)
    and the evaluator give identical trades, curves and metrics; so does shared.rollout.evaluate_policy."""
    agent = tiny_agent(feats.shape[1], seed=2)
    agent.maturity.fill_(0.6)  # protection stack active (CVaR limit, commitment, differential Sharpe)
    with torch.no_grad():      # a portfolio shift that matters (zero in a fresh agent)
        agent.shift[2].weight.normal_(0.0, 0.05)
    s, e = 300, 480
    L = e - s
    controls = eval_controls(Knobs(gate_threshold=0.05, regime_confidence=[1.0, 0.8, 1.0, 0.6, 1.0, 1.0, 0.9,
                                                                           1.0, 0.7]))
    ev = run_split(agent, bars, (s, e), controls=controls, costs=COSTS, features=feats)
    assert len(ev.ledger) >= 5, "the random policy should trade in this window"

    # the trainer's environment on the same window (+2 bars so neither its end-of-split forcing nor its episode
    # end reaches the L−1 decisions), with the ledger recorded and no episode end
    market = MarketTensors.from_bars(bars, s, e + 2, agent.cfg.window, features=feats)
    replay = Replay(1024, 1, agent.cfg.n_portfolio, len(market), (1, 5, 20), "cpu")
    env = TrainEnv(market, 1, 0, RewardConfig(episode_bars=10 ** 6), replay, COSTS, torch.Generator().manual_seed(0))
    env.sim = Simulator(market.prices, 1, COSTS, record_ledger=True)
    env.sim.reset(torch.zeros(1, dtype=torch.long))
    eq, pos = [1.0], [0.0]

    def on_step(rec):
        env.on_step(rec)
        eq.append(float(env.sim.equity[0]))
        pos.append(float(rec.result.position[0]))

    run_rollout(agent, env.sim, env.tracker, market, controls, L - 1, on_step=on_step, force_flat=env.force_flat)
    env.sim.close_all()
    eq[-1], pos[-1] = float(env.sim.equity[0]), 0.0
    tr_ledger = env.sim.ledger()
    eq = np.array(eq)
    br = np.concatenate([[0.0], eq[1:] / eq[:-1] - 1.0])

    assert len(replay) == L - 1  # it really was the trainer's env writing transitions
    cols = ["entry_t", "exit_t", "side", "size", "entry_price", "exit_price", "net_return", "bars", "exit_reason"]
    assert tr_ledger[cols].equals(ev.ledger[cols])
    np.testing.assert_array_equal(eq, ev.equity)
    np.testing.assert_allclose(br, ev.bar_returns, rtol=0, atol=1e-15)
    np.testing.assert_array_equal(np.array(pos), ev.positions)
    assert _metrics(tr_ledger, br, np.array(pos)) == pytest.approx(_metrics(ev.ledger, ev.bar_returns, ev.positions),
                                                                  rel=1e-12, abs=1e-15)

    # and C's single-account evaluation loop over the window alone
    pr = evaluate_policy(agent, MarketTensors.from_bars(bars, s, e, agent.cfg.window, features=feats), controls,
                         costs=COSTS)
    assert pr.ledger.equals(ev.ledger)
    np.testing.assert_array_equal(pr.equity, ev.equity)
    np.testing.assert_array_equal(pr.decisions["direction"].to_numpy(), ev.preds.direction[:-1])
    np.testing.assert_allclose(pr.decisions["q"].to_numpy(), ev.preds.q_mean[:-1], rtol=1e-5, atol=1e-7)


def test_batched_windows_equal_single_runs(bars, feats):
    """Windows run together as accounts (two of one length, one of another) equal their runs one by one."""
    agent = tiny_agent(feats.shape[1], seed=2)
    wins = [(200, 330), (400, 530), (560, 650)]
    together = run_windows(agent, bars, wins, costs=COSTS, features=feats)
    for w, r in zip(wins, together):
        alone = run_split(agent, bars, w, costs=COSTS, features=feats)
        assert r.window == w and r.ledger.equals(alone.ledger)
        np.testing.assert_array_equal(r.equity, alone.equity)
        np.testing.assert_array_equal(r.preds.direction, alone.preds.direction)
    # the extracted predictions agree with themselves: Q of the chosen direction = the per-direction Q at it; they
    # exist at every trade's entry decision (what the autopsy reads) and nowhere else
    n_entries = 0
    for r in together:
        entries = np.unique(np.maximum(r.ledger["entry_t"].to_numpy() - 1, 0))
        n_entries += len(entries)
        d = r.preds.direction[entries]
        np.testing.assert_allclose(r.preds.q_dir[entries, d], r.preds.q_mean[entries], rtol=1e-5, atol=1e-7)
        assert np.all(np.diff(r.preds.q_quantiles[entries], axis=1) >= 0)
        others = np.setdiff1d(np.arange(len(r.preds.q_dir)), entries)
        assert np.isnan(r.preds.q_dir[others]).all() and np.isnan(r.preds.q_quantiles[others]).all()
    assert n_entries >= 3


def _checkpoint_meta(agent: Agent, knobs: Knobs | None) -> dict:
    meta = {"kind": "agent", "epoch": 3, "agent_config": agent.cfg.to_dict(), "config_hash": "c" * 64,
            "dataset": "synthetic"}
    if knobs is not None:
        meta["knobs"] = knobs.to_dict()
    return meta


def test_report_round_trips_through_json(bars, feats, tmp_path):
    agent = tiny_agent(feats.shape[1], seed=4)
    knobs = Knobs(epsilon=0.05, gate_threshold=0.5)
    path = tmp_path / "epoch-0003.safetensors"
    sha = save_checkpoint(path, agent.state_dict(), _checkpoint_meta(agent, knobs))
    split = chronological_split(len(bars), embargo=10)
    rep = evaluate_checkpoint(path, expected_sha256=sha, bars=bars, split=split, run_id="r1", epoch=3, n_trials=3,
                              prior_sharpes=[0.1, -0.2], costs=COSTS, features=feats)
    back = EvalReport.model_validate_json(rep.model_dump_json())
    assert back == rep
    assert rep.checkpoint_sha256 == sha and rep.config_hash == "c" * 64 and rep.n_trials == 3
    assert rep.trained_knobs() == Knobs.from_dict(knobs.to_dict())
    assert rep.val.window == split.val and rep.oos.window == split.test
    s, e = rep.insample.window
    assert split.train[0] <= s < e == split.train[1] and e - s == split.val[1] - split.val[0]
    for sr in (rep.val, rep.oos, rep.insample):
        assert sr.metrics["n_trades"] == len(sr.trades) > 0
        assert len(sr.equity) == sr.window[1] - sr.window[0] and sr.equity[0] == 1.0
        r = np.array([t.net_return for t in sr.trades])
        # equity is flat-to-flat the product of (1 + trade return): the ledger and the curve agree
        assert sr.equity[-1] == pytest.approx(np.prod(1.0 + r), rel=1e-12)
    vs, os_ = rep.val.metric("per_trade_sharpe"), rep.oos.metric("per_trade_sharpe")
    assert rep.val_oos_gap == pytest.approx(1.0 - os_ / vs)
    assert rep.oos.metrics["dsr"] <= rep.oos.metrics["psr"]  # deflated by 3 trials
    # the report names the path that produced it: the compiled loop where a C compiler works, else eager torch
    from shared import native

    want = "native-c" if native.available() else "torch-eager"
    assert rep.engine == want and {sr.engine for sr in (rep.val, rep.oos, rep.insample)} == {want}


def test_the_report_names_the_torch_path_it_ran_on(bars, feats):
    """A window run by the torch pass says so (`SplitRun.engine` → `SplitReport.engine`)."""
    agent = tiny_agent(feats.shape[1], seed=4)
    assert run_split(agent, bars, (200, 260), costs=COSTS, features=feats, accel="eager").engine == "torch-eager"


def test_gates_as_trained_are_applied(bars, feats):
    """A checkpoint trained with regime confidence 0 everywhere (E9 closes every regime) never enters."""
    agent = tiny_agent(feats.shape[1], seed=4)
    closed = Knobs(regime_confidence=[0.0] * 9)
    blob = checkpoint_to_bytes(agent.state_dict(), _checkpoint_meta(agent, closed))
    rep = evaluate_checkpoint(blob, expected_sha256=hashlib.sha256(blob).hexdigest(), bars=bars,
                              split=chronological_split(len(bars), embargo=10), run_id="r", epoch=1,
                              insample_bars=0, oos=False, features=feats)
    assert len(rep.val.trades) == 0 and rep.val.equity[-1] == 1.0 and rep.insample is None and rep.oos is None
    assert rep.policy_shaping and rep.trained_knobs() == closed


def test_without_shaping_the_policy_runs_as_learned(bars, feats, tmp_path):
    """`shaping=False` drops the knobs that shape the greedy policy (E5 gate, E9 regime confidence): the checkpoint
    closed to every regime trades, exactly as one trained with neutral knobs; the report says so and keeps the
    knobs it trained under (what feedback reads)."""
    agent = tiny_agent(feats.shape[1], seed=4)
    gated = Knobs(regime_confidence=[0.0] * 9, gate_threshold=0.0)
    reps = {}
    for name, k in (("gated", gated), ("plain", Knobs())):
        blob = checkpoint_to_bytes(agent.state_dict(), _checkpoint_meta(agent, k))
        reps[name] = evaluate_checkpoint(blob, expected_sha256=hashlib.sha256(blob).hexdigest(), bars=bars,
                                         split=chronological_split(len(bars), embargo=10), run_id="r", epoch=1,
                                         insample_bars=0, oos=False, features=feats, shaping=False)
    g, p = reps["gated"], reps["plain"]
    assert len(g.val.trades) > 0 and not g.policy_shaping and g.trained_knobs() == gated
    assert g.val.metrics == p.val.metrics
    # the command line: `tradeloop evaluate --no-shaping` (the plain metrics path runs the same controls)
    import json

    from typer.testing import CliRunner

    from tradeloop.cli import app

    path = tmp_path / "epoch-0001.safetensors"
    save_checkpoint(path, agent.state_dict(), _checkpoint_meta(agent, gated))
    n = {}
    for flag in ("--shaping", "--no-shaping"):
        r = CliRunner().invoke(app, ["evaluate", "--policy", str(path), "--dataset", "synthetic", "--seed", "3",
                                     "--split", "val", "--json", flag])
        assert r.exit_code == 0, r.output
        n[flag] = json.loads(r.stdout)["metrics"]["n_trades"]
    assert n["--shaping"] == 0 < n["--no-shaping"]
    c_off, c_on = eval_controls(gated, shaping=False), eval_controls(gated)
    assert float(c_off.gate_threshold) == math.inf and c_off.regime_confidence.tolist() == [1.0] * 9
    assert float(c_on.gate_threshold) == 0.0 and c_on.regime_confidence.tolist() == [0.0] * 9


def test_sha256_mismatch_and_untrusted_input_refused(bars, feats, tmp_path):
    agent = tiny_agent(feats.shape[1])
    blob = checkpoint_to_bytes(agent.state_dict(), _checkpoint_meta(agent, None))
    split = chronological_split(len(bars), embargo=10)
    kw = dict(bars=bars, split=split, run_id="r", epoch=1)
    with pytest.raises(CheckpointError, match="sha256 mismatch"):
        evaluate_checkpoint(blob, expected_sha256="0" * 64, **kw)
    with pytest.raises(CheckpointError, match="no expected sha256"):
        evaluate_checkpoint(blob, expected_sha256=None, **kw)
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"\x80\x04\x95" + b"\x00" * 64)  # a pickle, with the right sha256: still never unpickled
    with pytest.raises(CheckpointError, match="pickle"):
        restore_agent(bad, expected_sha256=hashlib.sha256(bad.read_bytes()).hexdigest())
    with pytest.raises(CheckpointError, match="no sha256"):
        restore_agent(bad, expected_sha256=None)


def momentum_sign_agent(n_features: int, feature: int = 0) -> Agent:
    """A handcrafted agent: long when feature `feature` (ret_1) of the decision bar is > 0, short when < 0, flat at
    0, size level 0 (0.5), no target/stop; Kelly, differential-Sharpe and protection scaling switched off."""
    agent = tiny_agent(n_features, kelly_floor=1.0, dsr_size_cut=0.0, min_hold=0)
    A, D = agent.cfg.n_atoms, agent.cfg.d_model
    with torch.no_grad():
        for p in agent.parameters():
            p.zero_()
        for blk in agent.enc_blocks:  # identity blocks; LayerNorms keep weight 1
            blk.ln1.weight.fill_(1.0), blk.ln2.weight.fill_(1.0)
        agent.enc_ln.weight.fill_(1.0)
        agent.enc_in.weight[0, feature] = 1e4            # token = 1e4·f·e0 → emb_0 = sign(f)·sqrt(D − 1)
        agent.trunk[0].weight[0, 0], agent.trunk[0].weight[1, 0] = 1.0, -1.0  # h0 = relu(emb_0), h1 = relu(−emb_0)
        agent.trunk[2].weight.copy_(torch.eye(agent.cfg.hidden))
        agent.adv_w[0][:, 0, 2 * A + A - 1] = 10.0       # h0 → long's top atom
        agent.adv_w[0][:, 1, 0 * A + A - 1] = 10.0       # h1 → short's top atom
        agent.adv_b[0][:, 1 * A + A - 1] = 1e-3          # flat by a hair when f = 0
    assert D > 1
    return agent


def test_handcrafted_policy_gives_the_expected_ledger(bars, feats):
    """The momentum-sign policy's ledger equals an independent replay of its target positions
    0.5·sign(ret_1 feature) through the vectorised `run_positions`."""
    agent = momentum_sign_agent(feats.shape[1])
    s, e = 250, 450
    ev = run_split(agent, bars, (s, e), costs=COSTS, features=feats)
    expect_targets = 0.5 * np.sign(feats[s:e, 0].astype(np.float64))
    np.testing.assert_array_equal(ev.targets[:-1], expect_targets[:-1])
    ref = run_positions(Prices.from_bars(bars.slice(s, e)), expect_targets, COSTS)
    assert len(ev.ledger) == len(ref.ledger) > 10
    for c in ("entry_t", "exit_t", "side", "bars", "exit_reason"):
        assert ev.ledger[c].tolist() == ref.ledger[c].tolist(), c
    for c in ("size", "entry_price", "exit_price", "net_return"):
        np.testing.assert_allclose(ev.ledger[c].to_numpy(), ref.ledger[c].to_numpy(), rtol=1e-10, atol=1e-13)
    np.testing.assert_allclose(ev.equity, ref.equity[0], rtol=1e-10)
    # what the report will say at entry: the chosen direction, and no ensemble disagreement
    d = ev.preds.direction[ev.ledger["entry_t"].to_numpy() - 1]
    assert np.array_equal(d, np.where(ev.ledger["side"].to_numpy() > 0, 2, 0))
    assert np.all(ev.preds.ensemble_std[:-1] == 0.0) and math.isfinite(ev.preds.q_mean.sum())
