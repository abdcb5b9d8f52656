"""The trainer config's numeric ranges (`services.trainer.config.RANGES`): a value outside is refused where the config
is built — the presets, `--set` on a bench, a study's variant before any run starts — naming the field."""
from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest

from services.trainer.config import RANGES, TrainConfig, check_range
from tradeloop.cmd_study import _options, build_spec, study
from tradeloop.study.spec import StudyError


def test_the_presets_lie_inside_every_range():
    for preset in ("small", "full"):
        TrainConfig.preset(preset, 12).check_ranges()


@pytest.mark.parametrize("name, bad, says", [
    ("lr", -1e-4, "lr must be a number ≥ 0, got -0.0001"),
    ("iterations", 0, "iterations must be a whole number ≥ 1, got 0"),
    ("batch_size", 2.5, "batch_size must be a whole number ≥ 1, got 2.5"),
    ("learning_starts", -1, "learning_starts must be a whole number ≥ 0, got -1"),
    ("tau", 1.5, r"tau must be a number in \[0, 1\], got 1.5"),
    ("ensemble_mask_p", 0.0, r"ensemble_mask_p must be a number in \(0, 1\], got 0.0"),
    ("expectile", 1.0, r"expectile must be a number in \(0, 1\), got 1.0"),
    ("cosine_floor", -0.1, r"cosine_floor must be a number in \[0, 1\], got -0.1"),
    ("weight_decay", math.nan, "weight_decay must be a number ≥ 0, got nan"),
    ("n_envs", True, "n_envs must be a whole number ≥ 1, got True"),
])
def test_a_value_outside_its_range_is_refused_naming_the_field(name, bad, says):
    with pytest.raises(ValueError, match=f"train config: {says}"):
        TrainConfig(**{name: bad})
    with pytest.raises(ValueError, match=f"train config: {says}"):
        check_range(name, bad)
    edge = {"lr": 0.0, "iterations": 1, "batch_size": 1, "learning_starts": 0, "tau": 0.0, "expectile": 0.5,
            "ensemble_mask_p": 1.0,
            "cosine_floor": 0.0, "weight_decay": 0.0, "n_envs": 1}[name]
    assert getattr(TrainConfig(**{name: edge}), name) == edge              # the range's edge is inside


def test_every_ranged_field_is_a_numeric_field_of_the_config():
    cfg = TrainConfig()
    for name, (kind, *_rest) in RANGES.items():
        assert isinstance(getattr(cfg, name), kind) and not isinstance(getattr(cfg, name), bool), name


def test_a_bench_set_and_a_study_variant_are_refused_before_anything_runs(tmp_path: Path):
    with pytest.raises(ValueError, match="train config: grad_clip must be a number > 0, got -1.0"):
        TrainConfig().override(["grad_clip=-1"])
    values = {name: None for name in inspect.signature(study).parameters}
    values.update(dataset="synthetic", epochs=1, out=tmp_path / "o", folds=1, preset="small",
                  variants="off,fast:train.lr=-0.001")
    says = r"variant 'fast': settings \(train.lr=-0.001\): train config: lr must be a number ≥ 0"
    with pytest.raises(StudyError, match=says):
        build_spec(_options(values))                        # what `tradeloop study` reads before it makes its out dir
    assert not (tmp_path / "o").exists()


def test_an_encoder_width_its_heads_do_not_divide_is_refused_before_a_study_starts():
    """agent.d_model=33 with 4 heads passed the study's checks, trained the other variant, and failed its own run at
    the first forward pass ("run the same command again to retry" could not help)."""
    from tradeloop.cmd_study import TOML_KEYS, build_spec
    from tradeloop.study.spec import StudyError

    cli = {**{k: None for k in TOML_KEYS}, "config": None, "dataset": "synthetic", "epochs": 1, "out": "o",
           "variants": "off,dm:agent.d_model=33"}
    with pytest.raises(StudyError, match=r"variant 'dm': .*agent.d_model \(33\) must be a positive multiple of "
                                         r"agent.n_heads \(4\)"):
        build_spec(cli)
