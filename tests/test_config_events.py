"""Settings from TL_* variables (with refusals) and the versioned event schemas."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from shared.config import (CommonSettings, ConfigError, DashboardSettings, EvaluatorSettings, FeedbackSettings,
                           TrainerSettings, load_settings, settings_table)
from shared.events import (CheckpointPublished, DeadLetter, EvalCompleted, EventError, FeedbackReady,
                           decode_event, encode_event, raw_fields, stream_for, stream_name)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os
    for k in list(os.environ):
        if k.startswith("TL_") or k == "REDIS_URL":
            monkeypatch.delenv(k)


def test_defaults_are_embedded_loopback():
    s = load_settings(TrainerSettings)
    assert s.embedded and s.host == "127.0.0.1" and s.redis_url is None
    assert s.api_token.get_secret_value() == "dev-token"
    assert (s.port, load_settings(EvaluatorSettings).port, load_settings(FeedbackSettings).port,
            load_settings(DashboardSettings).port) == (8001, 8002, 8003, 8000)
    assert s.config == "small" and load_settings(FeedbackSettings).enabled is True


def test_env_variables_are_read(monkeypatch):
    monkeypatch.setenv("TL_RUN_ID", "exp-7")
    monkeypatch.setenv("TL_EPOCHS", "12")
    monkeypatch.setenv("TL_EVALUATOR_PORT", "9102")
    monkeypatch.setenv("TL_CLAIM_IDLE_MS", "1500")
    monkeypatch.setenv("TL_DEVICE", "cuda:1")
    monkeypatch.setenv("TL_RUN_DIR", "/tmp/runs")
    monkeypatch.setenv("REDIS_URL", "redis://localhost:6390/2")
    s = load_settings(EvaluatorSettings)
    assert (s.run_id, s.epochs, s.port, s.claim_idle_ms, s.device) == ("exp-7", 12, 9102, 1500, "cuda:1")
    assert str(s.run_path) == "/tmp/runs/exp-7" and s.redis_url == "redis://localhost:6390/2"
    monkeypatch.setenv("TL_REDIS_URL", "redis://other:1/0")  # TL_ wins over REDIS_URL
    assert load_settings(CommonSettings).redis_url == "redis://other:1/0"
    monkeypatch.setenv("TL_FEEDBACK_ENABLED", "false")  # not a field name: ignored
    monkeypatch.setenv("TL_ENABLED", "false")
    assert load_settings(FeedbackSettings).enabled is False


def test_default_token_refused_outside_embedded(monkeypatch):
    monkeypatch.setenv("TL_EMBEDDED", "false")
    with pytest.raises(ConfigError, match="TL_API_TOKEN is the default 'dev-token'"):
        load_settings(TrainerSettings)
    monkeypatch.setenv("TL_API_TOKEN", "a-real-secret-9f2c")
    monkeypatch.setenv("TL_HOST", "0.0.0.0")
    s = load_settings(TrainerSettings)
    assert s.host == "0.0.0.0" and "a-real-secret" not in repr(s)  # SecretStr hides it
    assert s.service_url("evaluator") == "http://127.0.0.1:8002"


def test_embedded_mode_binds_loopback_only(monkeypatch):
    monkeypatch.setenv("TL_HOST", "0.0.0.0")
    with pytest.raises(ConfigError, match="loopback"):
        load_settings(CommonSettings)


@pytest.mark.parametrize("var,value,needle", [
    ("TL_EPOCHS", "zero", "TL_EPOCHS"), ("TL_EPOCHS", "0", "greater than or equal to 1"),
    ("TL_DEVICE", "tpu", "TL_DEVICE"), ("TL_RUN_ID", "bad run/id", "TL_RUN_ID"),
    ("TL_TRAINER_PORT", "70000", "TL_TRAINER_PORT"), ("TL_REDIS_URL", "http://x", "TL_REDIS_URL"),
    ("TL_CONFIG", "huge", "TL_CONFIG")])
def test_bad_values_name_the_variable(monkeypatch, var, value, needle):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as ei:
        load_settings(TrainerSettings)
    assert needle in str(ei.value) and value in str(ei.value)


def test_every_field_is_documented():
    for cls in (TrainerSettings, EvaluatorSettings, FeedbackSettings, DashboardSettings):
        rows = settings_table(cls)
        assert rows and all(env.startswith("TL_") and desc for env, _, desc in rows), cls
    assert ("TL_API_TOKEN", "'dev-token'") in [(r[0], r[1]) for r in settings_table(CommonSettings)]


# -- events -------------------------------------------------------------------------------------
def make_events(run="r1"):
    return [CheckpointPublished(run_id=run, epoch=2, checkpoint_id="c2", sha256="0f" * 32, key="tl:r1:ckpt:2",
                                size_bytes=1234, config_hash="cfg", split_hashes={"train": "a", "val": "b"}),
            EvalCompleted(run_id=run, epoch=2, report_id="rep2", checkpoint_id="c2", report_key="tl:r1:report:2",
                          val_per_trade_sharpe=0.31, oos_per_trade_sharpe=-0.05, dsr=0.7, n_trades=41),
            FeedbackReady(run_id=run, epoch=2, bundle_id="b2", report_id="rep2", bundle_key="tl:r1:bundle:2",
                          for_epoch=3),
            DeadLetter(run_id=run, original_stream="tl:r1:stream:checkpoints", entry_id="1-0", reason="x",
                       deliveries=3)]


def test_events_round_trip_and_streams():
    for e in make_events():
        fields = encode_event(e)
        assert list(fields) == ["data"]
        back = decode_event({k.encode(): v.encode() for k, v in fields.items()})  # as redis returns them
        assert back == e and type(back) is type(e)
        assert back.created_at.tzinfo is not None and back.schema_version == 1
    kinds = [stream_for(e) for e in make_events()]
    assert kinds == [stream_name("r1", k) for k in ("checkpoints", "reports", "feedback", "dead")]
    assert kinds[0] == "tl:r1:stream:checkpoints"


def test_event_validation():
    with pytest.raises(ValidationError, match="for_epoch"):
        FeedbackReady(run_id="r1", epoch=2, bundle_id="b", report_id="r", bundle_key="k", for_epoch=2)
    with pytest.raises(ValidationError, match="sha256"):
        CheckpointPublished(run_id="r1", epoch=0, checkpoint_id="c", sha256="xyz", key="k", size_bytes=1,
                            config_hash="h")
    with pytest.raises(ValidationError, match="run id"):
        EvalCompleted(run_id="a:b", epoch=0, report_id="r", checkpoint_id="c", report_key="k")
    with pytest.raises(ValidationError, match="timezone"):
        EvalCompleted(run_id="r", epoch=0, report_id="r", checkpoint_id="c", report_key="k",
                      created_at=datetime(2024, 1, 1))
    e = EvalCompleted(run_id="r", epoch=0, report_id="r", checkpoint_id="c", report_key="k",
                      val_per_trade_sharpe=float("nan"), dsr=float("inf"),
                      created_at=datetime(2024, 1, 1, 2, tzinfo=timezone(timedelta(hours=2))))
    assert e.val_per_trade_sharpe is None and e.dsr is None and e.created_at.hour == 0
    assert "NaN" not in encode_event(e)["data"]


def test_decode_rejects_with_reasons():
    good = json.loads(encode_event(make_events()[1])["data"])
    cases = [
        ({}, "empty entry"),
        ({"x": "1"}, "missing field 'data'"),
        ({"data": "nope"}, "not JSON"),
        ({"data": json.dumps(good)[:-10]}, "truncated JSON"),
        ({"data": "[1, 2]"}, "not a JSON object"),
        ({"data": json.dumps(good | {"schema_version": 2})}, "unknown schema_version 2"),
        ({"data": json.dumps({k: v for k, v in good.items() if k != "schema_version"})}, "unknown schema_version None"),
        ({"data": json.dumps(good | {"type": "eval.started"})}, "unknown event type 'eval.started'"),
        ({"data": json.dumps(good | {"n_trades": -1})}, "n_trades"),
        ({"data": json.dumps(good | {"surprise": 1})}, "surprise"),
        ({"data": json.dumps(good | {"pad": "x" * 70_000})}, "oversized"),
        ({"data": b"\xff\xfe{"}, "UTF-8"),
    ]
    for fields, needle in cases:
        with pytest.raises(EventError) as ei:
            decode_event(fields)
        assert needle in ei.value.reason, (needle, ei.value.reason)


def test_raw_fields_truncated_for_dead_letters():
    out = raw_fields({b"data": b"y" * 10_000, "k": "v"})
    assert out["k"] == "v" and out["data"].startswith("y" * 2048) and out["data"].endswith("[10000 chars]")


def test_run_dir_not_writable_is_refused_naming_the_variable(tmp_path):
    """The trainer's first step: its run directory, created and written to, or a clear refusal (the container case,
    a root-owned directory under a non-root user, is run on a real engine by tests/test_compose_e2e.py)."""
    s = TrainerSettings(run_dir=tmp_path / "runs", run_id="r1")
    assert s.check_run_dir("trainer") == tmp_path / "runs" / "r1" / "trainer" and (tmp_path / "runs/r1/trainer").is_dir()
    assert list((tmp_path / "runs/r1/trainer").iterdir()) == [], "the write check leaves nothing behind"
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ValueError, match=r"TL_RUN_DIR=.*cannot write .* as uid \d+"):
        TrainerSettings(run_dir=tmp_path / "file", run_id="r1").check_run_dir("trainer")


def test_the_product_ships_the_signals_and_the_rollback_off_and_each_can_be_turned_on(monkeypatch):
    """`DEFAULT_OFF` is what the service's settings and every study variant start from; the library's config itself
    switches nothing off; `TL_FEEDBACK_OFF=""` turns every signal and the rollback on."""
    from services.feedback.signals import FeedbackConfig
    from shared.report import DEFAULT_OFF
    from tradeloop.study.spec import StudySpec, parse_variants

    assert DEFAULT_OFF == ("E1", "E2", "E3", "E4", "E5", "E6", "E7", "E8", "E9", "rollback")   # the fixed schedule
    s = load_settings(FeedbackSettings)
    assert s.off == DEFAULT_OFF and FeedbackConfig.coerce(s).off == DEFAULT_OFF
    assert FeedbackConfig().off == ()
    monkeypatch.setenv("TL_FEEDBACK_OFF", "")
    assert load_settings(FeedbackSettings).off == ()
    on, off, no_e1 = parse_variants("on,off,noE1:off=E1")
    spec = StudySpec(dataset="synthetic", variants=[on, off, no_e1], seeds=[0], folds=1, epochs=1)
    assert spec.configs(on, 8)[1].off == DEFAULT_OFF                 # "on" is the loop as shipped
    assert spec.configs(no_e1, 8)[1].off == ("E1",)                  # a variant's `off` replaces the list
    assert spec.acting_on_nothing() == ["on"]                          # "on" trains as the fixed schedule does
    rb, pop, e3, plateau = parse_variants("rb:off=E1+E2+E3+E4+E5+E6+E7+E8+E9,pop:feedback.population=true,e3:off=E1+"
                                          "E2+E4+E5+E6+E7+E8+E9+rollback,plateau:feedback.plateau_lr_factor=0.5")
    acting = StudySpec(dataset="synthetic", variants=[off, rb, pop, e3, plateau], seeds=[0], folds=1, epochs=1)
    assert acting.acting_on_nothing() == []


def test_the_rollback_settings_reach_the_feedback_config(monkeypatch):
    """TL_ROLLBACK_Z / TL_ROLLBACK_LR_FACTOR / TL_ROLLBACK_KEEP set the feedback service's rollback as a study
    variant's `feedback.rollback_z` / `feedback.rollback_lr_factor` / `feedback.rollback_keep` does; unset,
    FeedbackConfig's defaults hold; a value out of range is refused naming the variable."""
    from services.feedback.signals import FeedbackConfig

    names = ("rollback_z", "rollback_lr_factor", "rollback_keep")
    cfg = FeedbackConfig.coerce(load_settings(FeedbackSettings))
    assert [getattr(cfg, n) for n in names] == [getattr(FeedbackConfig(), n) for n in names]
    monkeypatch.setenv("TL_ROLLBACK_Z", "1.5")
    monkeypatch.setenv("TL_ROLLBACK_LR_FACTOR", "0.5")
    monkeypatch.setenv("TL_ROLLBACK_KEEP", "0.25")
    cfg = FeedbackConfig.coerce(load_settings(FeedbackSettings))
    assert [getattr(cfg, n) for n in names] == [1.5, 0.5, 0.25]
    monkeypatch.setenv("TL_PLATEAU_LR_FACTOR", "0.7")
    assert FeedbackConfig.coerce(load_settings(FeedbackSettings)).plateau_lr_factor == 0.7
    monkeypatch.setenv("TL_ROLLBACK_RESTART", "true")
    assert FeedbackConfig.coerce(load_settings(FeedbackSettings)).rollback_restart is True
    monkeypatch.setenv("TL_ROLLBACK_LR_FACTOR", "2")
    with pytest.raises(ConfigError, match="ROLLBACK_LR_FACTOR"):
        load_settings(FeedbackSettings)
    monkeypatch.setenv("TL_ROLLBACK_LR_FACTOR", "0.5")
    monkeypatch.setenv("TL_ROLLBACK_KEEP", "1")
    with pytest.raises(ConfigError, match="ROLLBACK_KEEP"):
        load_settings(FeedbackSettings)
