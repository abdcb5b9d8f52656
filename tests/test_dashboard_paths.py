"""The dashboard's run browser names no path of the server's file system: `/runs` (unauthenticated, on the one
service published beyond loopback) gives a run's path relative to the served directory and that directory by its name
alone, and its errors (an unknown run, a missing document, a report that does not parse) say the same."""
from __future__ import annotations

import json
import warnings

from test_runfiles import report_doc

from shared.runfiles import RunFiles


def _no_absolute_path(text: str, root) -> None:
    assert str(root) not in text and str(root.resolve()) not in text, text
    assert '"/' not in text and "'/" not in text and " /" not in text, text     # no value or message starts with "/"


def test_the_run_list_and_its_errors_name_no_absolute_path(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi.testclient import TestClient

    from services.dashboard.app import create_app
    from shared.config import DashboardSettings

    root = tmp_path / "served"
    for run in ("a", "study/seed-1"):
        f = RunFiles(root / run)
        for e in (1, 2):
            f.write("report", e, json.dumps(report_doc(e, 0.1 * e)))
            f.write("epoch", e, json.dumps({"epoch": e, "loss": 1.0}))
    RunFiles(root / "a").path("report", 2).write_text("{not json")
    client = TestClient(create_app(DashboardSettings(run_id="unused"), runs_dir=root))
    r = client.get("/runs")
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["root"] == "served", doc                 # what the page shows of the directory: its name
    assert sorted((x["id"], x["path"]) for x in doc["runs"]) == [("a", "a"), ("study/seed-1", "study/seed-1")], doc
    (why,) = next(x for x in doc["runs"] if x["id"] == "a")["unreadable"]
    assert why.startswith("served/a/") and "not JSON" in why, why
    _no_absolute_path(r.text, root)
    for url, code in (("/runs/nope/evaluator/reports", 404), ("/runs/a/evaluator/reports/7", 404),
                      ("/runs/a/evaluator/reports/2", 422), ("/runs/a/evaluator/reports", 422),
                      ("/runs/a/feedback/signals/1", 404)):
        r = client.get(url)
        assert r.status_code == code, (url, r.text)
        _no_absolute_path(r.text, root)
