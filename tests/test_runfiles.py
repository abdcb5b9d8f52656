"""Runs on disk: the documents stored in Redis are also files of the run directory (shared/runfiles.py, written by
`shared.store.RunStore`), the views the dashboard and the evaluator serve from them (shared/runview.py), the
dashboard's run browser over a directory of runs (services/dashboard/runs.py), and the operator's metrics.

Real Redis (the session's embedded server) where the store is involved; the views are checked against independent
computations (pandas for monthly returns, plain loops for drawdown and decimation).
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest

from shared.metrics import MIN_SELECTION_TRADES
from shared.report import TradeTable, pack
from shared.runfiles import RunFiles, atomic_write, find_runs
from shared import runview

TRADE = dict(entry_t=11, exit_t=12, decision_t=10, side=1, size=1.0, entry_price=100.0, exit_price=101.0,
             net_return=0.01, bars=2, exit_reason="target", regime=3, direction_idx=2, size_idx=0, exit_idx=1,
             q_pred=0.5, q_quantiles=[-0.5, -0.25, 0.0, 0.25, 0.5], ensemble_std=0.25, q_dir=[-0.5, 0.0, 0.5],
             direction_error=False, size_error=False, exit_error=False, best_exit_return=0.02,
             hindsight_returns=None, hindsight_dir=None)


def report_doc(epoch: int, val_sharpe: float | None, window=(10, 20), n_bars: int = 10, seed: int = 0) -> dict:
    """A stored report's JSON shape (what the views read), with a random equity curve of `n_bars` bars and two
    trades."""
    rng = np.random.default_rng(seed)
    eq = np.cumprod(1 + rng.normal(0, 0.01, n_bars))
    eq /= eq[0]
    o = window[0] - 10                                  # the trades sit at bars 11→12 and 14→16 of the window
    rows = [{**TRADE, "entry_t": 11 + o, "exit_t": 12 + o, "decision_t": 10 + o},
            {**TRADE, "entry_t": 14 + o, "exit_t": 16 + o, "decision_t": 13 + o, "side": -1, "net_return": -0.02}]
    return {"epoch": epoch, "run_id": "r1", "checkpoint_sha256": "ab" * 32, "n_trials": epoch, "val_oos_gap": 0.5,
            "knobs": {"epsilon": 0.2, "gate_threshold": None}, "dataset": "synthetic",
            "val": {"metrics": {"per_trade_sharpe": val_sharpe, "dsr": 0.7, "n_trades": 2}, "window": list(window),
                    "trades": TradeTable.from_records(rows).to_json_dict(), "equity": pack(eq)},
            "oos": {"metrics": {"per_trade_sharpe": 0.1}, "window": [30, 40],
                    "trades": TradeTable.empty().to_json_dict(), "equity": pack(np.ones(10))}}


# ------------------------------------------------------------------------------------------------ files
def test_atomic_write_replaces_whole_files_and_leaves_nothing_behind(tmp_path, monkeypatch):
    p = tmp_path / "d" / "doc.json"
    atomic_write(p, "first")
    atomic_write(p, b"second")
    assert p.read_text() == "second" and oct(p.stat().st_mode & 0o777) == "0o644"

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write(p, "third")
    assert p.read_text() == "second" and sorted(x.name for x in p.parent.iterdir()) == ["doc.json"]


def test_find_runs_finds_run_directories_at_any_depth(tmp_path):
    RunFiles(tmp_path / "a").write("report", 1, "{}")
    RunFiles(tmp_path / "study" / "s0").write("bundle", 2, "{}")
    (tmp_path / "study" / "s1" / "trainer").mkdir(parents=True)
    (tmp_path / "study" / "s1" / "trainer" / "run.json").write_text(json.dumps({"dataset": "sp500"}))
    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    RunFiles(tmp_path / "a" / "reports" / "nested").write("report", 1, "{}")   # inside a run: not a run of its own
    assert [p.relative_to(tmp_path).as_posix() for p in find_runs(tmp_path)] == ["a", "study/s0", "study/s1"]
    assert find_runs(tmp_path / "a") == [tmp_path / "a"]
    assert RunFiles(tmp_path / "study" / "s1").run_json() == {"dataset": "sp500"}
    assert RunFiles(tmp_path / "a").epochs("report") == [1] and RunFiles(tmp_path / "a").epochs("bundle") == []


def test_market_files_round_trip(tmp_path):
    f = RunFiles(tmp_path)
    ts = pd.date_range("2020-01-01", periods=5, freq="D").as_unit("ns").asi8
    f.write_market("val", np.arange(100, 105), ts, np.linspace(1, 2, 5), np.linspace(1, 1.5, 5))
    m = f.read_market("val")
    assert m["bar"].tolist() == list(range(100, 105)) and m["timestamp"].tolist() == ts.tolist()
    assert f.has_market("val", (100, 105)) and not f.has_market("val", (100, 106)) and not f.has_market("oos", (0, 5))
    assert pd.read_parquet(f.market_path("val")).columns.tolist() == ["bar", "timestamp", "close", "buy_and_hold"]


@pytest.mark.redis
def test_the_store_writes_every_document_to_the_run_directory(redis_url, run_id, tmp_path):
    from shared.bus import Bus

    async def go():
        async with Bus(redis_url, run_id, run_dir=tmp_path) as bus:
            st, files = bus.store, RunFiles(tmp_path)
            assert await st.put_report(1, report_doc(1, 0.3))
            assert files.read("report", 1)["val"]["metrics"]["per_trade_sharpe"] == 0.3
            assert not await st.put_report(1, report_doc(1, 0.9))          # first wins, in Redis and on disk
            assert files.read("report", 1)["val"]["metrics"]["per_trade_sharpe"] == 0.3
            files.path("report", 1).unlink()                                # a crash between the two writes
            assert await st.mirror("report", 1) and files.read("report", 1) == await st.get_report(1)
            assert not await st.mirror("report", 1)                         # already there
            assert await st.put_bundle(1, {"epoch": 1, "knobs": {}})
            assert files.read("bundle", 1) == {"epoch": 1, "knobs": {}}
            await st.put_epoch_record(1, {"epoch": 1, "loss": 2.5})
            await st.put_epoch_record(1, {"epoch": 1, "loss": 2.0})         # re-published: rewritten in both
            assert files.read("epoch", 1) == {"epoch": 1, "loss": 2.0}
            assert json.loads(await bus.redis.hget(f"tl:{run_id}:trainer:history", "1")) == {"epoch": 1, "loss": 2.0}
            files.path("epoch", 1).unlink()
            assert await st.mirror("epoch", 1) and files.history() == [{"epoch": 1, "loss": 2.0}]
        async with Bus(redis_url, run_id) as bus:                           # no run_dir: Redis only
            assert bus.store.files is None and not await bus.store.mirror("report", 1)

    asyncio.run(go())


# ------------------------------------------------------------------------------------------------ views
def test_the_checkpoint_validation_selects():
    rows = [{"epoch": 1, "val_per_trade_sharpe": 0.2, "val_n_trades": 40}, {"epoch": 2, "val_per_trade_sharpe": None},
            {"epoch": 3, "val_per_trade_sharpe": 0.5, "val_n_trades": 40, "oos_per_trade_sharpe": -9},
            {"epoch": 4, "val_per_trade_sharpe": 0.5, "val_n_trades": 40, "oos_per_trade_sharpe": 9},
            {"epoch": 5, "val_per_trade_sharpe": 2.0, "val_n_trades": MIN_SELECTION_TRADES - 1}]
    assert runview.selected_epoch(rows) == 3            # the earliest of the best with enough trades; OOS ignored
    assert [r["selected_by_validation"] for r in runview.report_rows(rows[::-1])] == [False, False, True, False, False]
    assert runview.selected_epoch([{"epoch": 1, "val_per_trade_sharpe": None}]) is None
    few = [{"epoch": 1, "val_per_trade_sharpe": 0.1, "val_n_trades": 2}, {"epoch": 2, "val_per_trade_sharpe": 0.3,
                                                                         "val_n_trades": 3}]
    assert runview.selected_epoch(few) == 2                                 # none has enough: the best of all


def test_monthly_returns_match_pandas():
    rng = np.random.default_rng(1)
    for freq, n in (("h", 3000), ("D", 900), ("min", 100_000), ("h", 5)):
        ts = pd.date_range("2020-01-15 05:00", periods=n, freq=freq)
        ts = ts[~((ts >= "2020-03-01") & (ts < "2020-04-01"))]               # a month without a bar
        eq = np.cumprod(1 + rng.normal(0, 0.01, len(ts)))
        got = runview.monthly_returns(eq, ts.as_unit("ns").asi8)
        s = pd.Series(eq, index=ts)
        ends = s.groupby(s.index.to_period("M")).last()
        ref = ends / ends.shift(1).fillna(eq[0]) - 1
        assert [g["month"] for g in got] == [str(p) for p in ref.index]
        np.testing.assert_allclose([g["return"] for g in got], ref.to_numpy(), rtol=1e-12)


def test_equity_view_keeps_at_most_max_points_with_a_benchmark_beside_it():
    n = 5000
    doc = report_doc(1, 0.3, window=(100, 100 + n), n_bars=n, seed=3)
    eq = np.frombuffer(__import__("base64").b64decode(doc["val"]["equity"]), "<f8")
    bench = np.cumprod(1 + np.random.default_rng(4).normal(0, 0.01, n))
    market = {"bar": np.arange(100, 100 + n), "timestamp": np.arange(n, dtype=np.int64) * 10**9, "buy_and_hold": bench}
    for m in (4, 5, 6, 10, 11, 200, 4999):
        view = runview.equity_view(doc, "val", market, max_points=m)
        assert view["n_points"] <= m and view["x"][0] == 0 and view["x"][-1] == n - 1, m
        assert int(np.argmin(eq)) in view["x"] and int(np.argmax(eq)) in view["x"], m
        if m >= 6:                                                           # room for both curves' extremes
            assert int(np.argmin(bench)) in view["x"] and int(np.argmax(bench)) in view["x"], m


def test_equity_view_drawdown_dates_benchmark_and_packing():
    n = 5000
    doc = report_doc(1, 0.3, window=(100, 100 + n), n_bars=n, seed=3)
    eq = np.frombuffer(__import__("base64").b64decode(doc["val"]["equity"]), "<f8")
    ts = np.datetime64("2021-01-01", "ns").astype(np.int64) + np.arange(n, dtype=np.int64) * 3_600_000_000_000
    bench = np.cumprod(np.full(n, 1.0001))
    market = {"bar": np.arange(100, 100 + n), "timestamp": ts, "buy_and_hold": bench}
    full = runview.equity_view(doc, "val", market)
    peak, dd = -np.inf, []
    for v in eq:                                                            # drawdown by a plain loop
        peak = max(peak, v)
        dd.append(v / peak - 1)
    np.testing.assert_allclose(full["drawdown"], dd, rtol=1e-12)
    assert full["x"] == list(range(n)) and full["t"][1] - full["t"][0] == 3600 and full["benchmark"] == bench.tolist()
    small = runview.equity_view(doc, "val", market, max_points=200)
    packed = runview.equity_view(doc, "val", market, max_points=200, packed=True)
    assert small["n_points"] == packed["n_points"] <= 400 and small["n_bars"] == n
    for k in ("equity", "drawdown", "t", "benchmark", "benchmark_drawdown"):
        assert np.frombuffer(__import__("base64").b64decode(packed[k]), "<f8").tolist() == small[k]
    assert int(np.argmin(eq)) in small["x"] and int(np.argmax(bench)) in small["x"]
    other = {**market, "bar": market["bar"] + 1}                            # another window's market: not used
    assert runview.equity_view(doc, "val", other)["t"] is None
    sheet = runview.tearsheet(doc, "val", market)
    assert sheet["start"] == "2021-01-01T00:00:00" and sheet["benchmark"]["total_return"] == pytest.approx(bench[-1] / bench[0] - 1)
    assert [m["month"] for m in sheet["monthly"]] == ["2021-01", "2021-02", "2021-03", "2021-04", "2021-05", "2021-06",
                                                      "2021-07"]
    page = runview.trades_page(doc, "val", market, offset=1, limit=5)
    assert page["n_trades"] == 2 and len(page["trades"]) == 1
    (t,) = page["trades"]                                                   # bars 104 → 106 of the window
    assert (t["entry_t"], t["entry_time"], t["exit_time"]) == (104, "2021-01-01T04:00:00", "2021-01-01T06:00:00")


# ------------------------------------------------------------------------------------------------ the run browser
def test_the_run_browser_serves_runs_on_disk(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi.testclient import TestClient

    from services.dashboard.app import create_app
    from shared.config import DashboardSettings

    for i, run in enumerate(("study/s0", "study/s1")):
        f = RunFiles(tmp_path / run)
        for e, s in ((1, 0.1), (2, 0.4 - i), (3, 0.2)):
            f.write("report", e, json.dumps(report_doc(e, s)))
            f.write("epoch", e, json.dumps({"epoch": e, "loss": 3.0 - e}))
        f.write("bundle", 2, json.dumps({"epoch": 2, "for_epoch": 3, "rollback": True, "run_id": "r1",
                                          "signals": {"E5": {"knob": "gate_threshold", "value": None}},
                                          "knobs": {"gate_threshold": None}}))
    client = TestClient(create_app(DashboardSettings(run_id="unused"), runs_dir=tmp_path))
    listed = client.get("/runs").json()
    assert listed["live"] is None and [r["id"] for r in listed["runs"]] == ["study/s0", "study/s1"]
    assert [r["selected_epoch"] for r in listed["runs"]] == [2, 3]
    base = "/runs/study/s0"
    rows = client.get(f"{base}/evaluator/reports").json()
    assert [r["selected_by_validation"] for r in rows] == [False, True, False]
    assert client.get(f"{base}/trainer/api/history").json()[-1] == {"epoch": 3, "loss": 0.0}
    assert client.get(f"{base}/trainer/status").json()["phase"] == "finished"
    assert client.get(f"{base}/evaluator/reports/2").json() == report_doc(2, 0.4)
    assert client.get(f"{base}/evaluator/reports/2/trades?limit=1").json()["n_trades"] == 2
    assert client.get(f"{base}/evaluator/reports/2/equity?packed=true").json()["packed"] is True
    assert client.get(f"{base}/evaluator/reports/2/tearsheet?split=oos").json()["metrics"] == {"per_trade_sharpe": 0.1}
    (sig,) = client.get(f"{base}/feedback/signals").json()
    assert sig["rollback"] and sig["signals"]["E5"]["value"] is None
    assert client.get(f"{base}/evaluator/reports/9").status_code == 404
    assert client.get("/runs/nope/evaluator/reports").status_code == 404
    assert client.get("/runs/study/evaluator/reports").status_code == 404   # not a run: nothing read there
    assert client.get("/api/trainer/status").status_code == 404             # runs only: no live services
    assert "no live service behind this dashboard" in client.get("/api/trainer/status").json()["detail"]
    assert client.get("/vendor/uPlot.iife.min.js").status_code == 200
    assert client.get("/vendor/LICENSE-uPlot").status_code == 404           # only the page's files are served
    assert client.get("/favicon.ico").status_code == 204                    # no icon, and no 404 for one


def test_an_up_run_without_its_summary_is_unfinished_with_the_epochs_it_was_started_for(tmp_path):
    """A `tradeloop up` run on disk mid-way (its launcher live, or killed before the summary): its up.json gives the
    epochs asked, and its status is not "finished"; once summary.json is there it is."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi.testclient import TestClient

    from services.dashboard.app import create_app
    from shared.config import DashboardSettings
    from shared.runfiles import UP_FILE

    f = RunFiles(tmp_path / "r1")
    f.write("report", 1, json.dumps(report_doc(1, 0.2)))
    f.write("epoch", 1, json.dumps({"epoch": 1, "loss": 1.0}))
    (tmp_path / "r1" / UP_FILE).write_text(json.dumps({"run_id": "r1", "epochs": 30, "dataset": "synthetic"}))
    client = TestClient(create_app(DashboardSettings(run_id="unused"), runs_dir=tmp_path))
    (row,) = client.get("/runs").json()["runs"]
    assert row["epochs_requested"] == 30
    st = client.get("/runs/r1/trainer/status").json()
    assert (st["phase"], st["epoch"], st["epochs"]) == ("unfinished", 1, 30)
    (tmp_path / "r1" / "summary.json").write_text(json.dumps({"run_id": "r1", "epochs_requested": 30,
                                                              "status": "interrupted"}))
    assert client.get("/runs/r1/trainer/status").json()["phase"] == "finished"


def test_one_unreadable_report_hides_nothing_else_in_the_run_list(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi.testclient import TestClient

    from services.dashboard.app import create_app
    from shared.config import DashboardSettings

    for run in ("a", "b"):
        f = RunFiles(tmp_path / run)
        for e in (1, 2):
            f.write("report", e, json.dumps(report_doc(e, 0.1 * e)))
            f.write("epoch", e, json.dumps({"epoch": e, "loss": 1.0}))
    bad = RunFiles(tmp_path / "a").path("report", 2)
    bad.write_text("{not json")
    client = TestClient(create_app(DashboardSettings(run_id="unused"), runs_dir=tmp_path))
    r = client.get("/runs")
    assert r.status_code == 200, r.text
    rows = {x["id"]: x for x in r.json()["runs"]}
    assert (rows["a"]["n_reports"], rows["b"]["n_reports"]) == (1, 2) and rows["b"]["unreadable"] == []
    (why,) = rows["a"]["unreadable"]
    # named from the served directory on: the dashboard says no absolute path (tests/test_dashboard_paths.py)
    assert f"{tmp_path.resolve().name}/{bad.relative_to(tmp_path).as_posix()}" in why and "not JSON" in why
    assert client.get("/runs/a/evaluator/reports").status_code == 422     # the run's own rows still name it


def test_serve_and_show_refuse_a_missing_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, words in ((["serve", "dashboard", "--runs", str(tmp_path / "nope")], "no such directory"),
                        (["show", str(tmp_path / "nope")], "no such directory"),
                        (["show", str(tmp_path / "file")], "not a directory"), (["show", str(tmp_path)], "no run"),
                        (["show", str(tmp_path), "--log-level", "loud"], "--log-level 'loud' is not one of"),
                        (["serve", "trainer", "--runs", str(tmp_path)], "--runs")):
        r = subprocess.run([sys.executable, "-m", "tradeloop.cli", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith("tradeloop ") and "Traceback" not in r.stderr, (args, r.stderr)
        assert words in r.stderr, (args, r.stderr)


# ------------------------------------------------------------------------------------------------ metrics
def test_labelled_gauges_and_knobs_on_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from shared.api import ServiceState, _StateCollector, knob_gauges
    from shared.knobs import Knobs

    g = knob_gauges(Knobs().to_dict())
    assert g["gate_threshold"] == float("inf") and g["epsilon"] == Knobs().epsilon
    assert g["lr_scale_direction"] == 1.0 and g["regime_weight_0"] == 1.0 and g["priority_boost_count"] == 0.0
    assert len([k for k in g if k.startswith("regime_confidence_")]) == len(Knobs().regime_confidence)
    state = ServiceState("trainer", "r1")
    state.set_labeled("knob", "knob", g)
    state.set_labeled("phase", "phase", {"training": 1, "done": 0})
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_StateCollector(state))
    text = generate_latest(reg).decode()
    assert 'tradeloop_trainer_knob{knob="gate_threshold",run_id="r1"} +Inf' in text
    assert 'tradeloop_trainer_phase{phase="training",run_id="r1"} 1.0' in text
