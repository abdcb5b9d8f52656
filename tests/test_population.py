"""The exploit across runs (`feedback.population`, population-based training's exploit step): the decision against
hand-computed cases (`services.feedback.fallbacks.exploit_target`), a peer's epoch restored bit for bit from the links
a run keeps of it after the peer has deleted its own files, the closed loop that exploits a peer's better epoch
(`tradeloop.study.loop.run_closed_loop` with `peers`), and a study's populations (`StudySpec.peers`)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from bench.population_headroom import after_exploit, best_of_k_gain, by_variant, groups
from services.feedback.fallbacks import PeerPoint, exploit_target
from services.feedback.guard import HistoryPoint
from services.feedback.signals import FeedbackConfig
from services.trainer.train import roll_back, train_run
from shared.checkpoints import checkpoint_sha256, load_checkpoint
from shared.knobs import Knobs
from shared.market import walk_forward_folds
from shared.report import DEFAULT_OFF
from shared.synthetic import generate
from tests.test_train import tiny_config
from tradeloop.study.loop import PEER_DIR, checkpoint_path, link_peer_epoch, run_closed_loop
from tradeloop.study.spec import StudyError, StudySpec, Variant

POP = FeedbackConfig(off=DEFAULT_OFF, population=True)


def pt(epoch: int, sharpe: float, trades: int, se: float) -> HistoryPoint:
    return HistoryPoint(epoch=epoch, val_sharpe=sharpe, val_n_trades=trades, knobs=Knobs(), val_sharpe_se=se,
                        checkpoint_sha256=f"{epoch:064d}")


def test_a_peer_epoch_is_exploited_only_beyond_the_noise_of_the_difference():
    own = [pt(1, 0.30, 200, 0.06), pt(2, 0.10, 200, 0.08)]          # this run's best: epoch 1, 0.30 ± 0.06
    a = PeerPoint("a", pt(3, 0.50, 200, 0.08))                      # gain 0.20, se hypot(0.06, 0.08) = 0.10
    b = PeerPoint("b", pt(2, 0.40, 200, 0.02))                      # gain 0.10, se hypot(0.06, 0.02) = 0.0632
    z = lambda v: FeedbackConfig(off=DEFAULT_OFF, population=True, population_z=v)  # noqa: E731
    assert exploit_target(own, [a, b], POP) is None                  # 0.20 ≤ 2·0.10 and 0.10 ≤ 2·0.0632
    ex = exploit_target(own, [a, b], z(1.9))                         # a: 0.20 > 0.19; b: 0.10 ≤ 0.120
    assert ex.peer is a and ex.gain == pytest.approx(0.20) and ex.se == pytest.approx(0.10)
    assert exploit_target(own, [b, a], z(1.5)).peer is a            # both beyond: the highest validation
    assert exploit_target(own, [b], z(1.5)).peer is b               # 0.10 > 1.5·0.0632 = 0.0949
    assert exploit_target(own, [b], z(1.6)) is None                  # 0.10 ≤ 1.6·0.0632 = 0.1012
    # a peer beyond the noise is taken although a higher one is not
    assert exploit_target(own, [PeerPoint("c", pt(4, 0.60, 200, 0.30)), b], z(1.5)).peer is b


def test_no_exploit_off_the_population_without_evidence_or_from_an_epoch_of_too_few_trades():
    own = [pt(1, 0.10, 200, 0.05)]
    big = PeerPoint("a", pt(1, 0.90, 200, 0.05))
    assert exploit_target(own, [big], POP).peer is big
    assert exploit_target(own, [big], FeedbackConfig(off=DEFAULT_OFF)) is None                     # population off
    assert exploit_target(own, [big], FeedbackConfig(off=DEFAULT_OFF, population=True, enabled=False)) is None
    assert exploit_target(own, [PeerPoint("a", pt(1, 0.90, 9, 0.05))], POP) is None                # < 10 trades
    assert exploit_target([pt(1, 0.10, 9, 0.05)], [big], POP) is None       # no own epoch of enough trades
    assert exploit_target(own, [], POP) is None
    assert exploit_target(own, [PeerPoint("a", pt(1, 0.90, 200, math.inf))], POP) is None         # SE unknown


def test_an_exploit_restores_the_peers_epoch_bit_for_bit_after_the_peer_deleted_it(tmp_path):
    """A peer's epoch 1, linked into another run's directory and then deleted by the peer (its pruning), restores
    into that run's learner: weights, target network and optimizer state equal the peer's files bit for bit. A peer
    epoch already gone is not linked."""
    bars = generate(700, seed=3).bars
    cfg = tiny_config()
    train_run(bars, "synthetic", tmp_path / "a", 2, config=cfg, seed=5, pinned_fn=lambda: {1})
    w1, _ = load_checkpoint(checkpoint_path(tmp_path / "a", 1))
    t1, _ = load_checkpoint(checkpoint_path(tmp_path / "a", 1, state=True))
    sha = checkpoint_sha256(checkpoint_path(tmp_path / "a", 1).read_bytes())
    b = train_run(bars, "synthetic", tmp_path / "b", 1, config=cfg, seed=6)
    assert any(not torch.equal(v, w1[k]) for k, v in b.agent.state_dict().items())
    into = tmp_path / "b" / PEER_DIR
    assert link_peer_epoch(tmp_path / "a", 1, into)
    for f in (tmp_path / "a" / "checkpoints").glob("epoch-0001*"):
        f.unlink()                                                   # the peer prunes its epoch
    roll_back(b, into, 1, sha)
    for k, v in b.agent.state_dict().items():
        assert torch.equal(v, w1[k]), k
    for k, v in b.target.state_dict().items():
        assert torch.equal(v, t1[f"target.{k}"]), k
    names = {p: n for n, p in b.agent.named_parameters()}
    assert all(torch.equal(torch.as_tensor(v), t1[f"opt.{names[p]}.{slot}"])
               for p, st in b.opt.state.items() for slot, v in st.items())
    assert not link_peer_epoch(tmp_path / "a", 1, tmp_path / "c" / PEER_DIR)
    assert not (tmp_path / "c" / PEER_DIR).exists()


def test_the_loop_starts_its_next_epoch_from_a_peers_better_epoch(tmp_path):
    """Run a (2 epochs), then run b (3 epochs) with a as its population and no noise threshold: after b's epoch 2
    (a's epoch 2 holds 73 validation trades, its epoch 1 none) b's bundle names a's epoch 2 and b's epoch 3 trains
    from it (history.jsonl: rolled back to 2); nothing is exploited after the last epoch, and the links are gone once
    the epoch that used them is saved."""
    bars = generate(3000, seed=0).bars
    split = walk_forward_folds(len(bars), n_folds=1)[0]
    cfg = tiny_config()
    fb = FeedbackConfig(off=DEFAULT_OFF, population=True, population_z=-1e6)
    ra = run_closed_loop(bars, "synthetic", tmp_path / "a", 2, config=cfg, feedback=fb, split=split, seed=0)
    assert [r["history"]["val_n_trades"] >= 10 for r in ra] == [False, True]
    rb = run_closed_loop(bars, "synthetic", tmp_path / "b", 3, config=cfg, feedback=fb, split=split, seed=1,
                         peers=[tmp_path / "a"])
    ex = [r["bundle"]["exploit"] for r in rb]
    assert ex[1] is not None and (ex[1]["run"], ex[1]["epoch"]) == ("a", 2)
    assert ex[1]["checkpoint_sha256"] == ra[1]["checkpoint_sha256"] and "exploit: a's epoch 2" in rb[1]["bundle"]["reason"]
    assert ex[2] is None                                             # the last epoch: nothing trains from it
    hist = [json.loads(x) for x in (tmp_path / "b" / "history.jsonl").read_text().splitlines()]
    assert hist[2]["rolled_back_to"] == 2
    assert not (tmp_path / "b" / PEER_DIR).exists()


def test_a_studys_population_is_a_variants_seeds_of_one_fold_on_the_same_data():
    pop = Variant("pop", (("feedback.population", True),))
    spec = StudySpec(dataset="synthetic", variants=(Variant("on", ()), pop), seeds=(0, 1, 2), folds=2, epochs=2,
                     data_seed=0)
    rs = next(r for r in spec.runs() if r.run_id == "pop-s1-f1")
    assert [r.run_id for r in spec.peers(rs)] == ["pop-s0-f1", "pop-s2-f1"]
    assert spec.peers(next(r for r in spec.runs() if r.run_id == "on-s1-f1")) == []
    # the runs of a fold come together, so a population's runs start close together
    assert [r.run_id for r in spec.runs()][:6] == ["on-s0-f0", "pop-s0-f0", "on-s1-f0", "pop-s1-f0", "on-s2-f0",
                                                   "pop-s2-f0"]
    with pytest.raises(StudyError, match="variant 'pop': feedback.population needs runs on the same data"):
        StudySpec(dataset="synthetic", variants=(pop,), seeds=(0, 1), folds=1, epochs=2).validate()  # a market a seed
    StudySpec(dataset="sp500", variants=(pop,), seeds=(0, 1), folds=1, epochs=2).validate()       # one series
    # seeds that share a market: seed s on market s // 2, so pop has two populations a fold
    grouped = StudySpec(dataset="synthetic", variants=(pop,), seeds=(0, 1, 2, 3), folds=1, epochs=2,
                        seeds_per_market=2).validate()
    assert [grouped.data_seed_of(s) for s in range(4)] == [0, 0, 1, 1]
    assert [r.run_id for r in grouped.peers(grouped.run("pop-s3-f0"))] == ["pop-s2-f0"]
    assert grouped.cluster_of(3, 0) == (1, 0) and grouped.populations() == ["pop"]
    for bad in (dict(seeds_per_market=0), dict(seeds_per_market=2, data_seed=0)):
        with pytest.raises(StudyError, match="seeds-per-market"):
            StudySpec(dataset="synthetic", variants=(pop,), seeds=(0, 1), folds=1, epochs=2, **bad).validate()


def test_the_headroom_of_an_exploit_is_the_best_val_runs_oos_over_the_mean_of_every_k_subset():
    """bench/population_headroom.py against a hand case: runs (val, OOS) a (0.1, 0.2), b (0.3, 0.5), c (0.2, 0.1);
    pairs {a, b} → b: 0.5 − 0.35, {a, c} → c: 0.1 − 0.15, {b, c} → b: 0.5 − 0.3; mean 0.1. Groups are the runs on
    the same data: one synthetic market a seed (or the study's data seed), one real series a fold."""
    assert best_of_k_gain([(0.1, 0.2), (0.3, 0.5), (0.2, 0.1)], 2) == pytest.approx(0.1)
    assert best_of_k_gain([(0.1, 0.2), (0.3, 0.5), (0.2, 0.1)], 3) == pytest.approx(0.5 - 0.8 / 3)
    runs = [{"seed": s, "fold": f, "val_sharpe": 0.1, "oos_sharpe": 0.1} for s in (0, 1) for f in (0, 1)]
    assert sorted(groups({"study": {"dataset": "synthetic", "data_seed": None}, "runs": runs})) == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert sorted(groups({"study": {"dataset": "synthetic", "data_seed": 7}, "runs": runs})) == [(7, 0), (7, 1)]
    assert sorted(groups({"study": {"dataset": "sp500"}, "runs": runs})) == [("series", 0), ("series", 1)]


def test_by_variant_compares_the_groups_means_and_their_best_validated_runs_against_the_reference():
    """Seeds 0–3 on two markets (`seeds_per_market` 2), one fold. off: market 0 runs (val, OOS) (0.1, 0.2), (0.3, 0.6)
    → mean 0.4, best-val 0.6; market 1 (0.2, 0.3), (0.1, 0.1) → 0.2, 0.3. pop: market 0 (0.5, 0.5), (0.4, 0.5) → 0.5,
    0.5; market 1 (0.3, 0.2), (0.2, 0.4) → 0.3, 0.2. pop − off: means +0.1 and +0.1 (2 wins); best-val −0.1, −0.1
    (0 wins): a gain in the mean that choosing on validation among the reference's runs already had."""
    vo = {"off": [(0.1, 0.2), (0.3, 0.6), (0.2, 0.3), (0.1, 0.1)], "pop": [(0.5, 0.5), (0.4, 0.5), (0.3, 0.2), (0.2, 0.4)]}
    runs = [{"variant": v, "seed": s, "fold": 0, "val_sharpe": x[0], "oos_sharpe": x[1]}
            for v, xs in vo.items() for s, x in enumerate(xs)]
    study = {"dataset": "synthetic", "data_seed": None, "seeds_per_market": 2, "reference": "off",
             "variants": [{"name": "off"}, {"name": "pop"}]}
    res = {"study": study, "runs": runs}
    assert groups(res, "pop") == {(0, 0): [(0.5, 0.5), (0.4, 0.5)], (1, 0): [(0.3, 0.2), (0.2, 0.4)]}
    table = by_variant(res)
    assert table[2].startswith("| off | 2 | 2 | +0.300 [") and "| +0.450 [" in table[2]
    assert table[-1] == "| pop | +0.100 [+0.100, +0.100] | 2/2 | -0.100 [-0.100, -0.100] | 0/2 |"


def test_after_exploit_measures_the_next_epoch_against_the_exploited_epoch_and_a_running_best(tmp_path):
    """pop-s1-f0 exploited pop-s0-f0's epoch 2 (val 0.8) after its epoch 1 and after its epoch 2: its epochs 2 and 3
    validated 0.5 and 0.7 → −0.3, −0.1. Running bests (an epoch at or above every earlier one of its run, not the
    last): pop-s0-f0 [0.2, 0.8, 0.4] → +0.6, −0.4; pop-s1-f0 [0.3, 0.5, 0.7] → +0.2, +0.2: mean +0.15. The same from
    the console line of a study that did not record its exploits."""
    curves = {"pop": {"0/0": [0.2, 0.8, 0.4], "1/0": [0.3, 0.5, 0.7]}}
    runs = [{"run_id": "pop-s1-f0", "exploited": [[1, "pop-s0-f0", 2, 0.8], [2, "pop-s0-f0", 2, 0.8]]},
            {"run_id": "pop-s0-f0", "exploited": []}]
    table = after_exploit({"study": {"epochs": 3}, "runs": runs, "curves": curves})
    assert table[2] == "| an exploit (the peer epoch's val) | 2 | -0.200 [-1.471, +1.071] | 0.00 |"   # −0.2 ± 12.706 · 0.1
    assert table[3].startswith("| a running best of pop | 4 | +0.150 [") and table[3].endswith("| 0.75 |")
    log = tmp_path / "console.txt"
    log.write_text("pop-s1-f0: epoch 3 selected on validation (val +0.700, 50 trades) → OOS +0.1 (40 trades), run DSR "
                   "1.00, 9 s ; exploited pop-s0-f0 e2, pop-s0-f0 e2\n")
    bare = [{"run_id": r["run_id"]} for r in runs]
    assert after_exploit({"study": {"epochs": 3}, "runs": bare, "curves": curves}, log)[2] == table[2]


def test_a_study_runs_its_population_and_keeps_what_a_later_run_exploits(tmp_path):
    """`tradeloop study` with a population variant (2 seeds on one market, one worker: the runs one after the other),
    no noise threshold: the second run exploits an epoch of the first, which kept its selected epoch's trainer state
    for it; the report counts the exploit and says the units are not independent."""
    import os
    import subprocess
    import sys

    from tests.test_study import ROOT, TINY

    toml = TINY.replace("seeds = 2", "seeds = 2\ndata_seed = 0").replace("folds = 2", "folds = 1")
    toml = toml.replace(f"epochs = {2}", "epochs = 3").replace("[variants.on]\n[variants.off]\n",
                                                               "[variants.pop]\npopulation = true\npopulation_z = -1000\n")
    assert "data_seed = 0" in toml and "[variants.pop]" in toml and "epochs = 3" in toml
    (tmp_path / "pop.toml").write_text(toml)
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "tradeloop.cli", "study", "--config", str(tmp_path / "pop.toml"),
                        "--out", str(out), "--parallel", "1"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    first = json.loads((out / "runs" / "pop-s0-f0" / "summary.json").read_text())
    second = json.loads((out / "runs" / "pop-s1-f0" / "summary.json").read_text())
    taken = [e["exploit"] for e in second["epochs"][:-1] if e["exploit"]]
    assert taken and all(x["run"] == "pop-s0-f0" for x in taken)
    assert checkpoint_path(out / "runs" / "pop-s0-f0", first["selected_epoch"], state=True).exists()
    assert not (out / "runs" / "pop-s1-f0" / PEER_DIR).exists()
    assert f"; exploited {taken[0]['run']} e{taken[0]['epoch']}" in p.stdout       # the run's line says so
    report = (out / "report.md").read_text()
    assert "Epochs that began from another run's epoch" in report and "not independent" in report
