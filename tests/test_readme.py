"""The README's operator tables cannot silently rot: every TL_ setting of the code is documented there."""
from __future__ import annotations

import re
from pathlib import Path

from shared.config import CommonSettings, DashboardSettings, FeedbackSettings, settings_table
from services.evaluator.worker import EvaluatorServiceSettings
from services.trainer.worker import TrainerServiceSettings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_setting_is_in_the_readme_table():
    text = README.read_text()
    documented = set(re.findall(r"^\| `(TL_[A-Z0-9_]+)` \|", text, flags=re.M))
    in_code = {row[0] for cls in (CommonSettings, TrainerServiceSettings, EvaluatorServiceSettings,
                                  FeedbackSettings, DashboardSettings) for row in settings_table(cls)}
    assert in_code - documented == set(), "settings missing from README.md"
    assert documented - in_code == set(), "README.md documents settings the code does not have"


def test_readme_gives_the_two_commands():
    text = README.read_text()
    assert "make up" in text and "make test" in text
