"""services/trainer/lockstep.py: runs trained epoch by epoch in lockstep (their iterations one vmapped computation)
end each epoch where `train_epoch` leaves each of them alone — the same weights, optimizer moments, replay, accounts
and epoch statistics, up to the order of float sums — and the group falls back to training alone when its runs are
out of step."""
import pytest
import torch

from services.trainer import lockstep
from services.trainer.lockstep import LockstepEngine, in_step, train_in_lockstep
from services.trainer.loop import train_epoch
from services.trainer.state import build_state
from services.trainer.train import TrainConfig
from services.trainer.traced import Sequenced, TracedStep
from shared.market import chronological_split
from shared.synthetic import generate
from tests.test_train import tiny_config

BARS = generate(700, seed=3).bars


def states(seeds, bars=BARS, **changes):
    cfg = tiny_config()
    cfg.support_at_start = True               # the first learning iteration's per-run support: exercised too
    for k, v in changes.items():
        setattr(cfg, k, v)
    return [build_state(cfg, bars, chronological_split(len(bars)), s, "cpu", accel="eager") for s in seeds]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not a.is_floating_point():
        return torch.equal(a, b)
    return torch.allclose(a.double(), b.double(), rtol=2e-4, atol=2e-5)


def assert_same_run(got, want) -> None:
    for (n, a), b in zip(got.agent.named_parameters(), want.agent.parameters()):
        assert close(a, b), n
    for (n, a), b in zip(got.target.named_parameters(), want.target.parameters()):
        assert close(a, b), f"target {n}"
    for p, q in zip(got.agent.parameters(), want.agent.parameters()):
        sa, sb = got.opt.state[p], want.opt.state[q]
        assert close(sa["exp_avg"], sb["exp_avg"]) and close(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert float(sa["step"]) == float(sb["step"]) > 0
    for k, t in got.replay.state_tensors().items():
        assert close(t, want.replay.state_tensors()[k]), f"replay {k}"
    assert close(got.buffers.entropy_coef, want.buffers.entropy_coef)
    assert close(got.agent.v_max, want.agent.v_max)
    assert (got.epoch, got.update_step, got.env_steps) == (want.epoch, want.update_step, want.env_steps)
    assert torch.equal(got.generator.get_state(), want.generator.get_state())


@pytest.mark.parametrize("accel", ["eager", "traced", "traced in two graphs"])
def test_a_lockstep_epoch_trains_each_run_as_it_trains_alone(accel, monkeypatch):
    graphs = 2 if accel == "traced in two graphs" else 1
    together, alone = states([0, 1], lockstep_graphs=graphs), states([0, 1])
    if accel != "eager":           # the compiled engine's step: traced once (`TracedStep`), then its recorded graph
        monkeypatch.setattr(lockstep, "compile_step", lambda graph, cfg, device: graph)    # run as is, no inductor
        for st in together:
            st.accel = "compile"
    engine = LockstepEngine(together)
    kind = {"eager": None, "traced": TracedStep, "traced in two graphs": Sequenced}[accel]
    assert kind is None or type(engine.step) is kind
    if kind is Sequenced:          # the collection's graph, then the updates'
        assert len(engine.step.steps) == 2
    for epoch in (1, 2):
        knobs = [s.cfg.schedule.knobs(epoch) for s in together]
        stats = engine.epoch([0, 1], together, knobs, [None, None])
        own = [train_epoch(s, k) for s, k in zip(alone, knobs)]
        for got, want, a, b in zip(together, alone, stats, own):
            assert_same_run(got, want)
            assert a.updates == b.updates > 0 and a.env_steps == b.env_steps
            assert a.train_trades == b.train_trades
            for k in ("loss", "c51", "iqn", "expectile", "q_mean", "entropy", "utilisation"):
                assert getattr(a, k) == pytest.approx(getattr(b, k), rel=1e-3, abs=1e-5), k
    if kind is not None:                     # every learning iteration after the first ran the recorded graph
        assert engine.step.traced and engine.calls == engine.warm_calls == 2
    # the two runs learned different things: the check above compares each with its own
    assert not torch.allclose(next(together[0].agent.parameters()), next(together[1].agent.parameters()))


def test_lockstep_graphs_is_one_or_two():
    with pytest.raises(ValueError, match="lockstep_graphs must be 1 or 2, got 3"):
        TrainConfig.from_dict({**tiny_config().to_dict(), "lockstep_graphs": 3})


def train_together(sts: list, epochs: int, knobs=None) -> tuple[dict, list[BaseException]]:
    """Each state's loop in a thread of its own (`train_in_lockstep`), training in one group (its knobs: the
    schedule's, or `knobs`) until it has `epochs` epochs or fails; (the group's rounds, the errors the members met)."""
    errors: list[BaseException] = []

    def loop(st, train_fn) -> None:
        try:
            while st.epoch < epochs:
                train_fn(st, knobs or st.cfg.schedule.knobs(st.epoch + 1))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    return train_in_lockstep(sts, loop), errors


def test_a_group_trains_in_lockstep_in_step_and_alone_out_of_step():
    fresh = states([2, 3])
    rounds, errors = train_together(fresh, 2)
    assert not errors and [s.epoch for s in fresh] == [2, 2]
    assert rounds == {"lockstep": 2, "alone": 0}

    sts = states([0, 1])
    train_epoch(sts[1], sts[1].cfg.schedule.knobs(1))          # run 1 an epoch ahead: not in step
    assert not in_step(sts)
    rounds, errors = train_together(sts, 3)
    assert not errors and [s.epoch for s in sts] == [3, 3]
    # round 1: run 0's epoch 1 alone while run 1's epoch 2 waits; then both at epoch 1, in step: epochs 2 and 3
    # together
    assert rounds == {"lockstep": 2, "alone": 1}

    one_ahead = states([4, 5])                                   # at one epoch, not in step: each alone
    for st in one_ahead:
        train_epoch(st, st.cfg.schedule.knobs(1))
    one_ahead[1].update_step += 1
    rounds, errors = train_together(one_ahead, 2)
    assert not errors and [s.epoch for s in one_ahead] == [2, 2]
    assert rounds == {"lockstep": 0, "alone": 1}


def test_an_error_in_a_round_reaches_every_member_and_runs_on_other_markets_are_refused():
    other = states([1], bars=generate(700, seed=4).bars)[0]
    with pytest.raises(ValueError, match="different markets"):
        LockstepEngine([states([0])[0], other])
    with pytest.raises(ValueError, match="policy_ema"):
        LockstepEngine(states([0, 1], policy_ema=0.9))
    _, errors = train_together(states([0, 1]), 1, knobs="not knobs")
    assert len(errors) == 2                                      # both members of the failed round, none hung
