"""A study's runs in the run browser: a tiny `tradeloop study` (one variant with its signals on, one seed, one fold,
three epochs, on the CPU), then `tradeloop show OUT` as a process, queried over HTTP. Each run's reports and bundles
come from its epoch records (loop/epoch-NNNN.json): validation per epoch, the epoch the study selected (its
summary.json) with that checkpoint's OOS metrics, and the feedback signals — equal to what the records hold."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_study import TINY

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3
RUN = "runs/signals-s0-f0"


def _study_file() -> str:
    """The end-to-end study's tiny settings (tests/test_study.py), one seed and fold, three epochs, and one variant
    with its signals on."""
    text = TINY
    for old, new in (("seeds = 2\nfolds = 2\nepochs = 2\n", f"seeds = 1\nfolds = 1\nepochs = {EPOCHS}\n"),
                     ("n_boot = 2000", "n_boot = 200"),
                     ("[variants.on]\n[variants.off]\n", '[variants.signals]\n"feedback.off" = ["E6", "E7"]\n')):
        assert old in text, old
        text = text.replace(old, new)
    return text


STUDY = _study_file()


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("study")
    (d / "tiny.toml").write_text(STUDY)
    out = d / "out"
    p = subprocess.run([sys.executable, "-m", "tradeloop.cli", "study", "--config", str(d / "tiny.toml"), "--out",
                        str(out), "--parallel", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def shown(study):
    """`tradeloop show OUT` (no Redis anywhere) on a free port; yields (GET url-path → JSON, the run's directory)."""
    proc = subprocess.Popen([sys.executable, "-m", "tradeloop.cli", "show", str(study)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        seen = []
        for line in proc.stdout:              # printed once the socket listens: requests queue until it serves
            seen.append(line)
            if " at http://" in line:
                break
        else:
            pytest.fail(f"tradeloop show exited {proc.wait()}:\n{''.join(seen)[-3000:]}")
        url = line.split(" at ", 1)[1].split()[0].rstrip("/")

        def get(path: str):
            try:
                with urllib.request.urlopen(url + path, timeout=60) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code

        yield get, study / RUN
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_study_run_shows_its_records_reports_selection_and_signals(shown):
    from shared.report import FeedbackBundle
    from shared.runfiles import read_records

    get, run_dir = shown
    recs = read_records(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    sel = summary["selected_epoch"]
    assert sorted(recs) == list(range(1, EPOCHS + 1))

    (row,) = [r for r in get("/runs")["runs"] if r["id"] == RUN]
    assert (row["n_reports"], row["n_bundles"], row["selected_epoch"]) == (EPOCHS, EPOCHS, sel)
    assert row["selected"]["val_per_trade_sharpe"] == recs[sel]["val"]["per_trade_sharpe"]
    assert row["selected"]["oos_per_trade_sharpe"] == summary["oos_sharpe"]

    base = f"/runs/{RUN}"
    reps = get(f"{base}/evaluator/reports")
    assert [r["epoch"] for r in reps] == sorted(recs)
    assert [r["val_per_trade_sharpe"] for r in reps] == [recs[e]["history"]["val_sharpe"] for e in sorted(recs)]
    assert [r["val_n_trades"] for r in reps] == [recs[e]["history"]["val_n_trades"] for e in sorted(recs)]
    assert [r["epoch"] for r in reps if r["selected_by_validation"]] == [sel]
    # OOS: the selected checkpoint's alone, as the study backtested it
    assert [r["epoch"] for r in reps if r["oos_per_trade_sharpe"] is not None] == [sel]

    sheet = get(f"{base}/evaluator/reports/{sel}/tearsheet")
    assert sheet["metrics"] == recs[sel]["val"] and sheet["knobs"] == recs[sel]["knobs"]
    assert sheet["window"] == summary["split"]["val"] and sheet["n_trials"] == sel
    assert sheet["n_bars"] == summary["split"]["val"][1] - summary["split"]["val"][0] > 0   # the window's, not 0
    assert get(f"{base}/evaluator/reports/{sel}/tearsheet?split=oos")["metrics"] == summary["oos_metrics"]
    # a record keeps no trade list: the page says so and counts the trades the metrics count, not 0
    page = get(f"{base}/evaluator/reports/{sel}/trades")
    assert (page["listed"], page["trades"], page["n_trades"]) == (False, [], int(recs[sel]["val"]["n_trades"]))
    other = next(e for e in recs if e != sel)
    assert get(f"{base}/evaluator/reports/{other}/tearsheet?split=oos") == 404
    assert get(f"{base}/evaluator/reports/{EPOCHS + 1}") == 404

    sigs = get(f"{base}/feedback/signals")
    assert [(s["epoch"], s["for_epoch"]) for s in sigs] == [(e, e + 1) for e in sorted(recs)]
    for s in sigs:
        rec = recs[s["epoch"]]
        assert s["off"] == ["E6", "E7"] and s["rollback"] == rec["bundle"]["rollback"]
        assert s["knobs"]["epsilon"] == rec["next_knobs"]["epsilon"] == s["signals"]["E2"]["value"]
        assert s["signals"]["E3"]["value"] == rec["next_knobs"]["gamma"]
        assert s["signals"]["E6"]["count"] == len(rec["bundle"]["signals"]["E6"]["value"])
    full = FeedbackBundle.model_validate(get(f"{base}/feedback/signals/1"))
    assert full.knobs == recs[1]["next_knobs"] and full.report_checkpoint_sha256 == recs[1]["checkpoint_sha256"]


def test_the_checkpoint_flagged_is_the_one_the_study_selected(study, tmp_path):
    """The study selects by its own `--min-val-trades`: the browser flags its summary.json's epoch, not its own
    rule's, and that checkpoint's report alone carries the OOS metrics."""
    import shutil
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")           # starlette's note on its httpx client
        from fastapi.testclient import TestClient

    from services.dashboard.app import create_app
    from shared.config import DashboardSettings

    run = tmp_path / "run"
    shutil.copytree(study / RUN, run)
    summary = json.loads((run / "summary.json").read_text())
    other = next(e for e in range(1, EPOCHS + 1) if e != summary["selected_epoch"])
    (run / "summary.json").write_text(json.dumps({**summary, "selected_epoch": other}))
    client = TestClient(create_app(DashboardSettings(run_id="unused"), runs_dir=tmp_path))
    (row,) = client.get("/runs").json()["runs"]
    assert row["selected_epoch"] == other and row["selected"]["oos_per_trade_sharpe"] == summary["oos_sharpe"]
    reps = client.get("/runs/run/evaluator/reports").json()
    assert [r["epoch"] for r in reps if r["selected_by_validation"]] == [other]
    assert [r["epoch"] for r in reps if r["oos_per_trade_sharpe"] is not None] == [other]
