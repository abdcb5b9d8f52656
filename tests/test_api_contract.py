"""The REST contract of the four services, on real servers (uvicorn on free loopback ports) over a real Redis.

- Every GET route answers, for documents the real code wrote (an `EvalReport` built from the autopsy of its trades,
  the `FeedbackBundle` `compute_bundle` makes of it, epoch records, the window's market file), JSON that its OpenAPI
  response schema accepts; no route goes unchecked.
- The routes behind the token declare the bearer scheme and answer 401 without it, 403 with another.
- schemathesis fuzzes each service from its OpenAPI document with all its checks, bounded examples, the token sent:
  no failure (server errors, undocumented status codes or content types, bodies off their schemas, invalid input
  accepted, auth ignored, ...).
"""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import httpx
import jsonschema
import numpy as np
import pandas as pd
import pytest
from test_services_api import ORIGIN, TOKEN, Server, redis_url, run_id  # noqa: F401 — module-scoped fixtures

from polling import poll_until
from shared.bus import Bus
from shared.redis_server import free_port
from shared.report import EvalReport, SplitDefinition, SplitReport, TradeRecord

pytestmark = pytest.mark.redis
EPOCH = 2
SPLIT = SplitDefinition(n_bars=400, train=(0, 200), val=(210, 300), test=(310, 400), embargo=10,
                        train_hash="a" * 64, val_hash="b" * 64, test_hash="c" * 64)
FUZZ_EXAMPLES = int(os.environ.get("TL_FUZZ_EXAMPLES", "12"))
"""Examples schemathesis generates per operation and mode."""


def _trade(i: int, start: int, r: float, *, regime: int, insample: bool) -> TradeRecord:
    e = start + 1 + 3 * i
    loser = insample and r < 0
    return TradeRecord(entry_t=e, exit_t=e + 2, decision_t=e - 1, side=1 if i % 3 else -1, size=0.5,
                       entry_price=100.0, exit_price=100.0 * (1 + r), net_return=r, bars=3, exit_reason="signal",
                       regime=regime, direction_idx=2, size_idx=1, exit_idx=0, q_pred=r / 2,
                       q_quantiles=[r - 0.02, r - 0.01, r, r + 0.01, r + 0.02], ensemble_std=0.01 * (1 + i % 4),
                       q_dir=[-0.01, 0.0, 0.01], direction_error=r < 0, size_error=i % 5 == 0, exit_error=False,
                       best_exit_return=max(r, 0.0), hindsight_returns=[0.01, 0.0, -0.01] if loser else None,
                       hindsight_dir=0 if loser else None)


def _split_report(name: str, window: tuple[int, int], window_hash: str, seed: int) -> SplitReport:
    from services.evaluator import autopsy as ap

    rng = np.random.default_rng(seed)
    n = (window[1] - window[0]) // 3 - 1
    trades = [_trade(i, window[0], float(rng.normal(0.002, 0.01)), regime=i % 9, insample=name == "insample")
              for i in range(n)]
    r = np.array([t.net_return for t in trades])
    equity = np.cumprod(1 + rng.normal(0.0005, 0.005, window[1] - window[0]))
    metrics = {"per_trade_sharpe": float(r.mean() / r.std(ddof=1)), "n_trades": float(n), "dsr": 0.6, "psr": 0.7,
               "total_return": float(equity[-1] / equity[0] - 1), "max_drawdown": 0.05, "profit_factor": None}
    win, lose = ap.disagreement(trades)
    return SplitReport(split=name, window=window, window_hash=window_hash, metrics=metrics, trades=trades,
                       equity=(equity / equity[0]).tolist(), regimes=ap.regime_stats(trades),
                       branches=ap.branch_stats(trades), calibration=ap.calibration(trades),
                       gate_curve=ap.gate_curve(trades), disagreement_winners=win, disagreement_losers=lose,
                       top_winners=ap.top_winners(trades) if name == "insample" else [],
                       losers=ap.losing_with_hindsight(trades) if name == "insample" else [])


def _documents(run_id: str) -> tuple[dict, dict, dict]:  # noqa: F811 — the fixtures imported above
    """(report, bundle, epoch record) of epoch EPOCH, as the evaluator, feedback and trainer store them."""
    from services.feedback.signals import compute_bundle
    from shared.knobs import Knobs

    knobs = Knobs().to_dict()
    report = EvalReport(run_id=run_id, epoch=EPOCH, checkpoint_sha256="ab" * 32, dataset="synthetic", split=SPLIT,
                        n_trials=EPOCH, val=_split_report("val", SPLIT.val, SPLIT.val_hash, 1),
                        oos=_split_report("oos", SPLIT.test, SPLIT.test_hash, 2),
                        insample=_split_report("insample", (0, 200), SPLIT.train_hash, 3), val_oos_gap=0.4,
                        knobs=knobs, created_at="2026-12-01T00:00:00+00:00")
    bundle = compute_bundle(report, now="2026-12-01T00:00:01+00:00")
    record = {"epoch": EPOCH, "loss": 0.5, "c51": 0.4, "iqn": 0.1, "expectile": None, "epsilon": 0.3, "gamma": 0.99,
              "env_steps": 640, "updates": 20, "env_steps_per_s": 300.0, "updates_per_s": 9.5, "seconds": 2.1,
              "compile_s": 0.0, "train_per_trade_sharpe": 0.05, "train_trades": 31, "knobs": knobs,
              "rolled_back_to": None, "bundle_epoch": 1, "bundle_id": f"{run_id}-bundle-e0001-{'cd' * 6}",
              "feedback_timed_out": False, "feedback_wait_s": 0.2, "knobs_source": "bundle 1",
              "checkpoint_id": f"{run_id}-e0002-{'ab' * 6}", "sha256": "ab" * 32}
    return report.model_dump(mode="json"), bundle.model_dump(mode="json"), record


@pytest.fixture(scope="module")
def live(redis_url, run_id, tmp_path_factory):  # noqa: F811 — the fixtures imported above
    """The four services of one run over the session's Redis, with epoch EPOCH's documents stored (also as the run
    directory's files, so the dashboard's run browser serves the run from disk too)."""
    from services.dashboard.app import create_app as dash_app
    from services.evaluator.app import create_app as ev_app
    from services.feedback.app import create_app as fb_app
    from services.trainer.app import create_app as tr_app
    from shared.config import DashboardSettings, load_settings
    from shared.runfiles import RunFiles

    run_dir = tmp_path_factory.mktemp("contract")
    report, bundle, record = _documents(run_id)

    async def store():
        async with Bus(redis_url, run_id, run_dir=run_dir / run_id) as bus:
            await bus.store.put_report(EPOCH, report)
            await bus.store.put_bundle(EPOCH, bundle)
            await bus.store.put_epoch_record(EPOCH, record)
    asyncio.run(store())
    ts = pd.date_range("2024-01-01", periods=SPLIT.val[1] - SPLIT.val[0], freq="D").as_unit("ns").asi8
    RunFiles(run_dir / run_id).write_market("val", np.arange(*SPLIT.val), ts, np.linspace(100, 120, len(ts)),
                                            np.linspace(1.0, 1.2, len(ts)))
    ports = {name: free_port() for name in ("trainer", "evaluator", "feedback")}
    env = {"TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_API_TOKEN": TOKEN, "TL_EMBEDDED": "true",
           "TL_DASHBOARD_ORIGIN": ORIGIN, "TL_MAX_BODY_BYTES": "2048", "TL_RUN_DIR": str(run_dir),
           "TL_DATA": str(run_dir / "missing.csv"), "TL_CONSUMER_NAME": "contract",
           **{f"TL_{name.upper()}_URL": f"http://127.0.0.1:{port}" for name, port in ports.items()}}
    servers = {}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            for name, make in (("trainer", tr_app), ("evaluator", ev_app), ("feedback", fb_app)):
                servers[name] = Server(make(), ports[name]).start()
            servers["dashboard"] = Server(dash_app(load_settings(DashboardSettings)), free_port()).start()
        with httpx.Client() as c:
            for name in ("evaluator", "feedback"):
                poll_until(lambda: c.get(f"{servers[name].url}/ready").status_code == 200, f"{name} ready")
        yield servers
    finally:
        for s in servers.values():
            s.stop()


def _openapi(url: str) -> dict:
    doc = httpx.get(f"{url}/openapi.json").raise_for_status().json()
    assert doc["openapi"].startswith("3.1")
    return doc


def _paths(url: str, method: str = "get") -> set[str]:
    return {p for p, ops in _openapi(url)["paths"].items() if method in ops}


def _schema_of(doc: dict, path: str, status: str = "200") -> dict:
    content = doc["paths"][path]["get"]["responses"][status]["content"]
    return {**content["application/json"]["schema"], "components": doc.get("components", {})}


# a request for every GET route (path template → concrete URLs): each must answer 200 with JSON of its schema
E = EPOCH
REQUESTS = {
    "trainer": {"/health": ["/health"], "/status": ["/status"], "/api/history": ["/api/history"]},
    "evaluator": {"/health": ["/health"], "/ready": ["/ready"], "/status": ["/status"], "/reports": ["/reports"],
                  "/reports/{epoch}": [f"/reports/{E}"],
                  "/reports/{epoch}/trades": [f"/reports/{E}/trades?limit=5", f"/reports/{E}/trades?split=oos",
                                              f"/reports/{E}/trades?split=insample&offset=3"],
                  "/reports/{epoch}/equity": [f"/reports/{E}/equity", f"/reports/{E}/equity?packed=true",
                                              f"/reports/{E}/equity?split=oos&max_points=8"],
                  "/reports/{epoch}/tearsheet": [f"/reports/{E}/tearsheet", f"/reports/{E}/tearsheet?split=oos"]},
    "feedback": {"/health": ["/health"], "/ready": ["/ready"], "/status": ["/status"], "/signals": ["/signals"],
                 "/signals/{epoch}": [f"/signals/{E}"]},
    "dashboard": {"/health": ["/health"], "/ready": ["/ready"], "/config.json": ["/config.json"], "/runs": ["/runs"],
                  "/runs/{run}/trainer/status": ["/runs/{run}/trainer/status"],
                  "/runs/{run}/trainer/api/history": ["/runs/{run}/trainer/api/history"],
                  "/runs/{run}/evaluator/reports": ["/runs/{run}/evaluator/reports"],
                  "/runs/{run}/evaluator/reports/{epoch}": [f"/runs/{{run}}/evaluator/reports/{E}"],
                  "/runs/{run}/evaluator/reports/{epoch}/trades": [f"/runs/{{run}}/evaluator/reports/{E}/trades"],
                  "/runs/{run}/evaluator/reports/{epoch}/equity": [
                      f"/runs/{{run}}/evaluator/reports/{E}/equity?packed=true&max_points=16"],
                  "/runs/{run}/evaluator/reports/{epoch}/tearsheet": [
                      f"/runs/{{run}}/evaluator/reports/{E}/tearsheet"],
                  "/runs/{run}/feedback/signals": ["/runs/{run}/feedback/signals"],
                  "/runs/{run}/feedback/signals/{epoch}": [f"/runs/{{run}}/feedback/signals/{E}"]},
}
NOT_JSON = {"/metrics", "/", "/{name}", "/api/{service}/{path}"}
"""GET routes that are not JSON documents (Prometheus text, the page's files, the proxy), checked apart."""
BUSY = {("trainer", "/ready")}
"""Answers 503 here: the trainer has no data to load (its schema is checked on that answer)."""


@pytest.mark.parametrize("service", list(REQUESTS))
def test_every_route_answers_json_of_its_schema(live, run_id, service):  # noqa: F811 — the fixtures imported above
    url = live[service].url
    doc = _openapi(url)
    assert _paths(url) - NOT_JSON == set(REQUESTS[service]) | {p for s, p in BUSY if s == service}
    with httpx.Client(timeout=30) as c:
        for template, urls in REQUESTS[service].items():
            for u in urls:
                r = c.get(url + u.replace("{run}", run_id))
                assert r.status_code == 200, (u, r.text[:300])
                assert r.headers["content-type"] == "application/json"
                try:
                    jsonschema.validate(r.json(), _schema_of(doc, template))
                except jsonschema.ValidationError as exc:
                    raise AssertionError(f"{service} {u}: {exc.message} at {list(exc.absolute_path)}") from None
        for s, template in BUSY:
            if s == service:
                r = c.get(url + template)
                assert r.status_code == 503
                jsonschema.validate(r.json(), _schema_of(doc, template, "503"))


def test_the_documents_are_served_as_stored_and_the_views_carry_their_fields(
        live, run_id):  # noqa: F811 — the fixtures imported above
    report, bundle, record = _documents(run_id)
    ev, fb, dash = live["evaluator"].url, live["feedback"].url, live["dashboard"].url
    with httpx.Client(timeout=30) as c:
        assert c.get(f"{ev}/reports/{EPOCH}").json() == report
        assert c.get(f"{dash}/runs/{run_id}/evaluator/reports/{EPOCH}").json() == report
        got = c.get(f"{fb}/signals/{EPOCH}").json()
        assert {k: v for k, v in got.items() if k != "created_at"} == \
               {k: v for k, v in bundle.items() if k != "created_at"}
        assert c.get(f"{live['trainer'].url}/api/history").json() == [record]
        page = c.get(f"{ev}/reports/{EPOCH}/trades", params={"limit": 2}).json()
        assert page["trades"][0]["entry_time"].startswith("2024-01-") and page["n_trades"] == 29
        assert "entry_time" not in c.get(f"{ev}/reports/{EPOCH}/trades", params={"split": "oos"}).json()["trades"][0]
        sheet = c.get(f"{ev}/reports/{EPOCH}/tearsheet").json()
        assert sheet["benchmark"]["name"] == "buy-and-hold" and set(sheet["monthly"][0]) == {"month", "return",
                                                                                             "benchmark"}
        (row,) = c.get(f"{fb}/signals").json()
        assert row["for_epoch"] == EPOCH + 1 and set(row["signals"]["E6"]) == {"knob", "count", "reason"}
        (runrow,) = [r for r in c.get(f"{dash}/runs").json()["runs"] if r["id"] == run_id]
        assert runrow["live"] and runrow["selected_epoch"] == EPOCH and runrow["n_reports"] == 1


def test_metrics_and_the_page_declare_what_they_serve(live):
    for name, s in live.items():
        doc = _openapi(s.url)
        if name != "dashboard":
            declared = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
            assert list(declared) == ["text/plain; version=0.0.4"]
            r = httpx.get(f"{s.url}/metrics")
            assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            assert re.search(rf"^tradeloop_{name}_up\{{", r.text, re.M)
    dash = live["dashboard"].url
    r = httpx.get(f"{dash}/app.js")
    assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in \
        _openapi(dash)["paths"]["/{name}"]["get"]["responses"]["200"]["content"]


def test_mutating_routes_need_the_token(live):
    """Every route that is not a GET declares the bearer scheme and refuses a request without the token (401) or
    with another (403); the trainer's are the only ones."""
    seen = []
    with httpx.Client() as c:
        for name, s in live.items():
            doc = _openapi(s.url)
            for path, ops in doc["paths"].items():
                for method, op in ops.items():
                    if method == "get":
                        assert "security" not in op, (name, path)
                        continue
                    seen.append((name, method, path))
                    assert op["security"] == [{"HTTPBearer": []}] and {"401", "403"} <= set(op["responses"])
                    none = c.request(method, s.url + path)
                    assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
                    wrong = c.request(method, s.url + path, headers={"Authorization": f"Bearer {TOKEN}x"})
                    assert wrong.status_code == 403 and wrong.json() == {"detail": "invalid token"}
            if any(n == name for n, _, _ in seen):
                assert doc["components"]["securitySchemes"]["HTTPBearer"] == {"type": "http", "scheme": "bearer",
                                                                              "description": "TL_API_TOKEN"}
    assert sorted(seen) == [("trainer", "post", f"/control/{a}") for a in ("pause", "resume", "stop")]


FUZZ_CONFIG = """
[[operations]]
include-path = "/ready"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
"""
"""/ready's 503 is its documented answer while the service is not ready (the trainer here: no data to load)."""


@pytest.mark.contract
@pytest.mark.parametrize("service", ["trainer", "evaluator", "feedback", "dashboard"])
def test_schemathesis_finds_no_failure(live, service, tmp_path):
    """schemathesis's CLI against the running service: all checks, positive and negative examples, the token sent."""
    url = live[service].url
    config = tmp_path / "schemathesis.toml"
    config.write_text(FUZZ_CONFIG)
    cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "run", f"{url}/openapi.json",
           "--checks", "all",
           "--mode", "all", "--max-examples", str(FUZZ_EXAMPLES), "--phases", "examples,coverage,fuzzing",
           "--generation-deterministic", "--suppress-health-check", "all", "--workers", "1",
           "--header", f"Authorization: Bearer {TOKEN}", "--request-timeout", "30", "--no-color",
           "--report-dir", str(tmp_path)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "HYPOTHESIS_STORAGE_DIRECTORY": str(tmp_path / "hypothesis")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert re.search(r"\b\d+ passed\b", out) and "failed" not in out.split("SUMMARY")[-1].lower(), out[-3000:]
