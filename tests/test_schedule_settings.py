"""The fixed ε/γ schedule (`shared.knobs.FixedSchedule`) set through each spelling that users write reaches the
trainer's first epoch and the feedback-off bundle as one schedule; bad values are refused naming the key."""
import json

import pytest

from services.feedback.signals import FeedbackConfig, compute_bundle
from services.trainer.train import TrainConfig, train_run
from shared.knobs import FixedSchedule
from shared.synthetic import generate
from tests.test_signals import alternating, report
from tests.test_train import tiny_config
from tradeloop.study.loop import first_knobs
from tradeloop.study.spec import StudyError, StudySpec, parse_variants, variants_from_toml

WANT = FixedSchedule(eps_start=0.45, eps_end=0.05, eps_decay_epochs=3, gamma=0.95, lr_epoch_factor=0.8)


def feedback_off_knobs(fb: FeedbackConfig, epoch: int = 4):
    """The knobs of the feedback-off bundle after `epoch` under `fb`."""
    b = compute_bundle(report(alternating(30), epoch=epoch), [], FeedbackConfig.coerce({**_fields(fb),
                                                                                      "enabled": False}), now="t")
    assert not b.enabled and b.for_epoch == epoch + 1
    return b.to_knobs()


def _fields(fb: FeedbackConfig) -> dict:
    return {k: getattr(fb, k) for k in fb.__dataclass_fields__}


def _reaches_both(cfg: TrainConfig, fb: FeedbackConfig) -> None:
    assert cfg.schedule == WANT and fb.schedule == WANT
    assert first_knobs(cfg) == WANT.knobs(1) and first_knobs(cfg).epsilon == 0.45 and first_knobs(cfg).gamma == 0.95
    assert feedback_off_knobs(fb) == cfg.schedule.knobs(5) == WANT.knobs(5)


@pytest.mark.parametrize("items", [
    ["eps_start=0.45", "eps_end=0.05", "eps_decay_epochs=3", "gamma=0.95", "lr_epoch_factor=0.8"],
    ["schedule.eps_start=0.45", "schedule.eps_end=0.05", "schedule.eps_decay_epochs=3", "schedule.gamma=0.95",
     "schedule.lr_epoch_factor=0.8"],
    ["eps_start=0.45", "schedule.eps_end=0.05", "eps_decay_epochs=3", "gamma_fixed=0.95", "lr_epoch_factor=0.8"],
])
def test_train_config_set_spellings_give_the_schedule(items):
    cfg = TrainConfig().override(items)
    _reaches_both(cfg, FeedbackConfig(schedule=cfg.schedule))


@pytest.mark.parametrize("text", [
    "x:train.eps_start=0.45;train.eps_end=0.05;train.eps_decay_epochs=3;train.gamma=0.95;train.lr_epoch_factor=0.8",
    "x:schedule.eps_start=0.45;schedule.eps_end=0.05;schedule.eps_decay_epochs=3;schedule.gamma=0.95;"
    "schedule.lr_epoch_factor=0.8",
    "x:eps_start=0.45;eps_end=0.05;eps_decay_epochs=3;gamma=0.95;lr_epoch_factor=0.8",
    "x:feedback.eps_start=0.45;feedback.eps_end=0.05;feedback.eps_decay_epochs=3;feedback.gamma_fixed=0.95;"
    "feedback.lr_epoch_factor=0.8",
    "x:gamma_fixed=0.95;eps_start=0.45;eps_end=0.05;eps_decay_epochs=3;lr_epoch_factor=0.8",
])
def test_study_setting_spellings_reach_trainer_and_feedback_off_alike(text):
    v = parse_variants(text)[0]
    assert sorted(k for k, _ in v.settings) == sorted(f"schedule.{n}" for n in FixedSchedule.names())
    cfg, fb = StudySpec(dataset="synthetic", variants=[v], seeds=[0], folds=1, epochs=1).configs(v, 14)
    _reaches_both(cfg, fb)


@pytest.mark.parametrize("table", [
    {"schedule": {"eps_start": 0.45, "eps_end": 0.05, "eps_decay_epochs": 3, "gamma": 0.95, "lr_epoch_factor": 0.8}},
    {"train": {"eps_start": 0.45, "eps_end": 0.05, "eps_decay_epochs": 3, "gamma": 0.95, "lr_epoch_factor": 0.8}},
    {"feedback": {"eps_start": 0.45, "eps_end": 0.05, "eps_decay_epochs": 3, "gamma_fixed": 0.95,
                  "lr_epoch_factor": 0.8}},
])
def test_study_toml_tables_reach_trainer_and_feedback_off_alike(table):
    v = variants_from_toml({"x": table}, "study.toml")[0]
    cfg, fb = StudySpec(dataset="synthetic", variants=[v], seeds=[0], folds=1, epochs=1).configs(v, 14)
    _reaches_both(cfg, fb)


@pytest.mark.parametrize("mapping", [
    {"eps_start": 0.45, "eps_end": 0.05, "eps_decay_epochs": 3, "gamma_fixed": 0.95, "lr_epoch_factor": 0.8},
    {"schedule": {"eps_start": 0.45, "eps_end": 0.05, "eps_decay_epochs": 3, "gamma": 0.95, "lr_epoch_factor": 0.8}},
    {"schedule": WANT},
])
def test_feedback_config_mappings_give_the_schedule(mapping):
    fb = FeedbackConfig.coerce(mapping)
    assert fb.schedule == WANT
    assert feedback_off_knobs(fb) == WANT.knobs(5)


def test_stored_config_keeps_its_form_and_hash_and_reads_both_forms():
    cfg = TrainConfig().override(["eps_start=0.45", "eps_end=0.05", "eps_decay_epochs=3", "gamma=0.95",
                                  "lr_epoch_factor=0.8"])
    d = cfg.to_dict()
    assert "schedule" not in d and {k: d[k] for k in FixedSchedule.names()} == WANT.to_dict()
    assert TrainConfig.from_dict(json.loads(json.dumps(d))) == cfg
    nested = {k: v for k, v in d.items() if k not in FixedSchedule.names()} | {"schedule": WANT.to_dict()}
    assert TrainConfig.from_dict(nested).hash() == cfg.hash()


@pytest.mark.parametrize("items, message", [
    (["eps_start=1.5"], r"eps_start must be a number in \[0, 1\], got 1.5"),
    (["schedule.gamma=1"], r"gamma must be a number in \(0, 1\)"),
    (["eps_decay_epochs=2.5"], "eps_decay_epochs expects an integer, got '2.5'"),
    (["lr_epoch_factor=0"], r"lr_epoch_factor must be a number in \(0, 1\], got 0.0"),
    (["schedule.lr_epoch_factor=1.2"], r"lr_epoch_factor must be a number in \(0, 1\], got 1.2"),
    (["schedule.eps=0.2"], "FIELD=VALUE"),
])
def test_bad_schedule_values_are_refused_naming_the_key(items, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig().override(items)


def test_bad_schedule_in_a_study_or_feedback_config_is_refused_naming_it():
    with pytest.raises(StudyError, match="eps_start must be a number in"):
        v = parse_variants("x:feedback.eps_start=-0.1")[0]
        StudySpec(dataset="synthetic", variants=[v], seeds=[0], folds=1, epochs=1).validate()
    with pytest.raises(StudyError, match="eps_start and eps_end must be > 0"):   # E2 scales the schedule's ε
        v = parse_variants("x:train.eps_end=0")[0]
        StudySpec(dataset="synthetic", variants=[v], seeds=[0], folds=1, epochs=1).validate()
    with pytest.raises(ValueError, match=r"feedback config: schedule: 'eps' is not a field of the fixed schedule"):
        FeedbackConfig.coerce({"schedule": {"eps": 0.1}})
    with pytest.raises(ValueError, match=r"feedback config: unknown keys \['gamma_fixd'\]"):
        FeedbackConfig.coerce({"gamma_fixd": 0.9})


def test_the_trainers_epochs_train_under_the_set_schedule(tmp_path):
    """`tradeloop train`'s epochs take the schedule's knobs: epoch 1's ε and γ, and epoch 2's learning rates at
    `lr_epoch_factor` of epoch 1's (every group, at the same point of the warm-up and cosine cycle)."""
    from services.trainer.optim import group_lr

    cfg = tiny_config().override(["schedule.eps_start=0.45", "eps_end=0.05", "eps_decay_epochs=3", "gamma=0.95",
                                  "lr_epoch_factor=0.8"])
    seen = []
    st = train_run(generate(700, seed=3).bars, "synthetic", tmp_path / "r", 2, config=cfg, seed=1,
                   on_epoch=seen.append)
    assert (seen[0].epsilon, seen[0].gamma) == (WANT.knobs(1).epsilon, WANT.knobs(1).gamma) == (0.45, 0.95)
    assert st.update_step > 0
    assert [s.knobs["lr_decay"] for s in seen] == [1.0, 0.8] == [WANT.knobs(e).lr_decay for e in (1, 2)]
    for g in st.opt.param_groups:               # the last update's rate: the preset's schedule × 0.8
        full = group_lr({**g, "age": g["age"] - 1}, st.update_step - 1, seen[1].knobs["lr_scale"], st.cfg)
        assert abs(float(g["lr"]) - 0.8 * full) <= 1e-12 * full, g["name"]
    stored = json.loads((tmp_path / "r" / "run.json").read_text())["config"]
    assert TrainConfig.from_dict(stored).schedule == WANT


def test_feedback_config_json_form_reads_back():
    fb = FeedbackConfig(off=("E2", "E3"), schedule=WANT, rollback_z=3.0)
    d = json.loads(json.dumps(fb.to_dict()))
    assert d["schedule"] == WANT.to_dict() and d["off"] == ["E2", "E3"]
    assert FeedbackConfig.coerce(d) == fb


def test_a_study_saved_with_an_older_spelling_of_a_schedule_key_resumes(tmp_path):
    """study.json written when the setting was kept as `train.gamma` is the same study as `schedule.gamma` today;
    a study that differs in its value is still refused."""
    from tradeloop.study.runner import prepare

    v = parse_variants("on,off")
    spec = StudySpec(dataset="synthetic", variants=v, seeds=[0], folds=1, epochs=1, settings=[("schedule.gamma", 0.97)])
    prepare(spec, tmp_path)
    doc = json.loads((tmp_path / "study.json").read_text())
    assert doc["spec"]["settings"] == [["schedule.gamma", 0.97]]
    for part in (doc["spec"], doc["identity"]):
        part["settings"] = [["train.gamma", 0.97]]
    (tmp_path / "study.json").write_text(json.dumps(doc))
    prepare(spec, tmp_path)                                            # the same study: no error
    other = StudySpec(dataset="synthetic", variants=v, seeds=[0], folds=1, epochs=1,
                      settings=[("schedule.gamma", 0.95)])
    with pytest.raises(StudyError, match="differs in settings"):
        prepare(other, tmp_path)


def test_a_study_whose_variant_means_something_else_with_todays_defaults_is_not_resumed(tmp_path, monkeypatch):
    """study.json keeps what each variant resolved to; when the feedback the product ships changes, `on` no longer
    means what its done runs ran, and the resume is refused naming it — a variant that spells its settings out, and
    a study.json from before the check, resume."""
    import tradeloop.study.spec as spec_mod
    from tradeloop.study.runner import prepare

    spec = StudySpec(dataset="synthetic", variants=parse_variants("on,off,e7:off=E7"), seeds=[0], folds=1, epochs=1)
    prepare(spec, tmp_path)
    saved = json.loads((tmp_path / "study.json").read_text())
    assert set(saved["resolved"]) == {"on", "off", "e7"}
    prepare(spec, tmp_path)                                            # same defaults: resumes
    monkeypatch.setattr(spec_mod, "DEFAULT_OFF", ("E7",))
    with pytest.raises(StudyError, match=r"variant\(s\) on resolve to other trainer or feedback configs"):  # not off
        prepare(spec, tmp_path)
    only_explicit = StudySpec(dataset="synthetic", variants=parse_variants("off,e7:off=E7"), seeds=[0], folds=1,
                              epochs=1)
    d2 = tmp_path / "explicit"
    monkeypatch.undo()
    prepare(only_explicit, d2)
    monkeypatch.setattr(spec_mod, "DEFAULT_OFF", ("E7",))
    prepare(only_explicit, d2)                                         # spelled out: the same configs
    del saved["resolved"]
    (tmp_path / "study.json").write_text(json.dumps(saved))
    prepare(spec, tmp_path)                                            # saved before the check: nothing to compare


def test_the_learning_rate_decays_at_their_neutral_value_leave_stored_hashes_as_they_were():
    """`lr_epoch_factor` 1 and `plateau_lr_factor` 1 stay out of a run's stored config (its hash, which every
    checkpoint carries) and of a study's resolved variants, so runs and studies from before the fields existed
    still resume; at another value they are in both."""
    assert "lr_epoch_factor" not in TrainConfig().to_dict()
    assert TrainConfig().override(["lr_epoch_factor=0.7"]).to_dict()["lr_epoch_factor"] == 0.7
    off, on, lr, plateau = parse_variants("off,on,lr:schedule.lr_epoch_factor=0.7,p:feedback.plateau_lr_factor=0.5")
    spec = StudySpec(dataset="synthetic", variants=[off, on, lr, plateau], seeds=[0], folds=1, epochs=1)
    text = {v.name: json.dumps(spec.resolved_doc(v)) for v in spec.variants}
    assert not any(k in text[n] for k in ("lr_epoch_factor", "plateau_lr_factor") for n in ("off", "on"))
    assert text["lr"].count('"lr_epoch_factor": 0.7') == 2          # the trainer's schedule and the feedback's
    assert '"plateau_lr_factor": 0.5' in text["p"] and len(set(spec.resolved().values())) == 4

