"""The dashboard in headless Chromium (Playwright driving Debian's /usr/bin/chromium; no browser is ever downloaded).

Finished runs, no Redis: two tiny `tradeloop up` runs (a "study" of two seeds on the bundled S&P 500 sample, run
once per session and shared by the tests) end — their embedded Redis servers stopped — and `tradeloop serve dashboard
--runs DIR` serves their directories. The page must show:
  - a finished run: epoch charts (validation only), the selected checkpoint's tearsheet (equity and drawdown with
    dates against buy-and-hold, monthly returns, paged trades, the E1–E9 knobs), with no Redis anywhere;
  - a tearsheet whose numbers equal `tradeloop evaluate --report` of that checkpoint;
  - the two runs overlaid;
  - distinct tick labels on every axis of every chart it drew;
  - OOS per epoch only once the toggle is ticked (before that: the selected checkpoint's OOS only);
  - a loading state, never an empty page, before the first answer;
  - a 10^6-bar equity curve drawn in under a second (a run directory written here from a simulator backtest).
The live run: the services as processes (the session's real Redis), the same page through the dashboard's proxy;
every service up, the charts fed, the operator's metrics on /metrics, then a killed service shown down.

TL_DASHBOARD_SCREENSHOTS=DIR saves the pages as PNGs into DIR (docs/: dashboard.png, dashboard-run.png,
dashboard-compare.png).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tradeloop.up.endpoints import bind_listeners

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SERVICES = ("trainer", "evaluator", "feedback", "dashboard")
EPOCHS = 3
TINY = {"TL_TRAIN_LEARNING_STARTS": "32", "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4", "OMP_NUM_THREADS": "1"}
STUDY = ("study/seed-0", "study/seed-1")
SHOTS = os.environ.get("TL_DASHBOARD_SCREENSHOTS")

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium: apt-get install chromium; .ci/run does)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="python package playwright is not installed")


def get_json(url: str, timeout: float = 5.0):
    """GET url → JSON (raises on connection errors and non-2xx)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def get_text(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def wait_for(what: str, predicate, deadline_s: float, procs: dict, interval: float = 0.5):
    """Poll `predicate()` until it returns a truthy value; fail naming `what` (and any dead process)."""
    end = time.monotonic() + deadline_s
    last_exc = None
    while time.monotonic() < end:
        dead = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
        if dead:
            pytest.fail(f"while waiting for {what}: processes exited {dead}")
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 — not up yet
            last_exc = exc
        time.sleep(interval)
    pytest.fail(f"timed out after {deadline_s:.0f}s waiting for {what} (last error: {last_exc})")


def tradeloop_exe() -> str:
    exe = shutil.which("tradeloop", path=str(Path(sys.executable).parent)) or shutil.which("tradeloop")
    assert exe, "the `tradeloop` console script is not installed"
    return exe


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    env.update(extra)
    return env


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def study(tmp_path_factory) -> Path:
    """Two finished runs (seeds 0 and 1) of `tradeloop up` under <root>/study/, run side by side; each launcher
    started and stopped its own embedded Redis. Returns <root>."""
    root = tmp_path_factory.mktemp("runs")
    procs = []
    for run in STUDY:
        seed = run.rsplit("-", 1)[1]
        cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--free-ports", "--epochs", str(EPOCHS), "--dataset",
               "sp500", "--device", "cpu", "--data-bars", "1500", "--iterations", "6", "--no-dashboard", "--no-live",
               "--run-dir", str(root / "study"), "--run-id", run.split("/")[1], "--feedback-timeout", "200",
               "--timeout", "280"]
        procs.append(subprocess.Popen(cmd, env=clean_env(**TINY, TL_SEED=seed), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        stop(procs)
    for run, p, out in zip(STUDY, procs, outs):
        assert p.returncode == 0, f"{run}: tradeloop up exited {p.returncode}:\n{out[-3000:]}"
    return root


def write_big_run(root: Path, n_bars: int = 1_000_000) -> None:
    """A run directory whose validation window has `n_bars` bars: a random-walk market, a policy that redraws a
    random side about every 200 bars and buy-and-hold, both through the simulator (one call), the report built by
    the evaluator's own report builder (predictions zero: this run has no agent) and the market file."""
    from services.evaluator import autopsy as ap
    from services.evaluator.report_builder import build_eval_report, build_split_report
    from shared.execution import CostModel, Prices, run_positions
    from shared.report import TAUS, SplitDefinition
    from shared.runfiles import RunFiles

    rng = np.random.default_rng(7)
    close = 100.0 * np.exp(np.cumsum(rng.normal(2e-7, 1e-3, n_bars)))
    open_ = np.r_[close[0], close[:-1]]
    high, low = np.maximum(open_, close) * 1.0002, np.minimum(open_, close) * 0.9998
    redraw = rng.random(n_bars) < 1 / 200
    redraw[0] = True
    side = rng.integers(-1, 2, n_bars).astype(np.float64)[np.maximum.accumulate(np.where(redraw, np.arange(n_bars), 0))]
    res = run_positions(Prices.from_arrays(open_, high, low, close), np.stack([side, np.ones(n_bars)]), CostModel(1.0))
    zero = np.zeros(n_bars)
    preds = ap.Predictions(direction=(side + 1).astype(np.int64), size=np.zeros(n_bars, np.int64),
                           exit=np.zeros(n_bars, np.int64), q_mean=zero, q_quantiles=np.zeros((n_bars, len(TAUS))),
                           ensemble_std=zero, q_dir=np.zeros((n_bars, 3)))
    w = (1_000_000, 1_000_000 + n_bars)
    val = build_split_report("val", window=w, window_hash="0" * 64, ledger=res.ledger, bar_returns=res.bar_returns,
                             positions=res.positions, equity=res.equity, preds=preds,
                             regimes=np.zeros(n_bars, np.int64), close=close, cost_rate=1e-4)
    split = SplitDefinition(n_bars=w[1] + 1, train=(0, w[0]), val=w, test=(w[1], w[1] + 1))
    files = RunFiles(root / "million")
    files.write("report", 1, build_eval_report(run_id="million", epoch=1, split=split, val=val,
                                               dataset="random walk").model_dump_json())
    minute = np.int64(60_000_000_000)
    ts = np.datetime64("2001-01-01", "ns").astype(np.int64) + np.arange(n_bars, dtype=np.int64) * minute
    files.write_market("val", np.arange(*w), ts, close, res.equity[1])


@contextlib.contextmanager
def serve_runs(root: Path):
    """`tradeloop serve dashboard --runs <root>` (no Redis) on a socket bound here; yields its URL."""
    listener = bind_listeners("127.0.0.1", {"dashboard": 0})["dashboard"]
    port = listener.getsockname()[1]
    fd = listener.fileno()
    log = root / "dashboard.log"
    proc = subprocess.Popen([tradeloop_exe(), "serve", "dashboard", "--runs", str(root), "--log-level", "warning"],
                            env=clean_env(TL_LISTEN_FD=str(fd), TL_DASHBOARD_PORT=str(port), TL_RUN_DIR=str(root)),
                            pass_fds=(fd,), stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    listener.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for("the dashboard", lambda: get_json(url + "/ready")["status"] == "ready", 60, {"dashboard": proc})
        yield url
    finally:
        stop([proc])
        print(log.read_text(errors="replace")[-2000:])


@pytest.fixture(scope="module")
def disk_dashboard(study):
    """The runs of `study` served on disk. Yields (url, root)."""
    with serve_runs(study) as url:
        yield url, study


@pytest.fixture(scope="module")
def chromium():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(chromium):
    """A fresh page; the test fails on any JavaScript error it raised."""
    p = chromium.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    yield p
    p.close()
    assert not errors, errors


def open_page(page, url: str) -> None:
    page.goto(url)
    page.wait_for_function("() => window.tradeloopDashboard && window.tradeloopDashboard.state.loaded", timeout=30_000)


def charts(page) -> dict:
    """{chart id: {points, series, markers, ticks}} of every chart the page holds."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('.tl-chart')].map(e =>
        [e.id, {points: +e.dataset.points, series: +e.dataset.series, markers: +e.dataset.markers,
                ticks: JSON.parse(e.dataset.ticks || '[[],[]]')}]))""")


def assert_distinct_ticks(page) -> int:
    """Every drawn chart's axes carry distinct labels; returns how many charts were checked."""
    checked = 0
    for cid, c in charts(page).items():
        if not c["points"]:
            continue
        for axis, labels in zip(("x", "y"), c["ticks"]):
            shown = [s for s in labels if s]
            assert len(shown) >= 2, (cid, axis, labels)
            assert len(set(shown)) == len(shown), f"{cid}: {axis} axis repeats a label: {labels}"
        checked += 1
    return checked


def shot(page, name: str, selector: str | None = None, max_height: int = 1400) -> None:
    """With TL_DASHBOARD_SCREENSHOTS: a PNG of the page's top (or of `selector`, at most `max_height` px)."""
    if not SHOTS:
        return
    Path(SHOTS).mkdir(parents=True, exist_ok=True)
    page.wait_for_timeout(300)                                # uPlot draws on the next frame
    if selector is None:
        page.screenshot(path=str(Path(SHOTS) / name))
        return
    box = page.locator(selector).bounding_box()
    page.screenshot(path=str(Path(SHOTS) / name), full_page=True,
                    clip={"x": 0, "y": max(0, box["y"] - 60), "width": page.viewport_size["width"],
                          "height": min(max_height, box["height"] + 60)})


def run_docs(root: Path, run: str) -> tuple[list[dict], list[dict]]:
    """(reports, bundles) of a run directory, read from its files."""
    from shared.runfiles import RunFiles

    f = RunFiles(root / run)
    return [f.read("report", e) for e in f.epochs("report")], [f.read("bundle", e) for e in f.epochs("bundle")]


# ------------------------------------------------------------------------------------------------- runs on disk
def test_a_finished_run_is_browsed_with_no_redis(disk_dashboard, page):
    url, root = disk_dashboard
    run = STUDY[0]
    for r in STUDY:    # each launcher stopped its Redis: the port its config named refuses connections
        conf = (root / r / "redis" / "redis.conf").read_text()
        port = int(next(line.split()[1] for line in conf.splitlines() if line.startswith("port ")))
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    reports, bundles = run_docs(root, run)
    assert len(reports) == len(bundles) == EPOCHS
    listed = get_json(url + "/runs")
    assert listed["live"] is None and {r["id"] for r in listed["runs"]} == set(STUDY)

    open_page(page, f"{url}/#run={run}")
    c = charts(page)
    assert c["chart-sharpe"]["points"] == EPOCHS and c["chart-dsr"]["points"] == EPOCHS
    assert c["chart-loss"]["points"] == 3 * EPOCHS and c["chart-updates"]["points"] == EPOCHS
    selected = max(reports, key=lambda d: d["val"]["metrics"]["per_trade_sharpe"])["epoch"]
    rollbacks = sum(bool(b["rollback"]) for b in bundles)
    assert c["chart-sharpe"]["markers"] == 1 + rollbacks          # best epoch and every rollback marked
    assert page.input_value("#epoch-select") == str(selected)     # the checkpoint validation selects, by default
    rep = reports[selected - 1]
    n_val = len(np.frombuffer(__import__("base64").b64decode(rep["val"]["equity"]), "<f8"))
    assert c["chart-equity-val"]["series"] == 2 and 0 < c["chart-equity-val"]["points"] <= 2 * n_val  # + buy-and-hold
    assert c["chart-drawdown-val"]["series"] == 2
    assert all(re.fullmatch(r"\d{4}(-\d\d){0,2}", t) for t in c["chart-equity-val"]["ticks"][0] if t)   # dates
    # monthly returns: one cell per calendar month of the validation window
    months = page.eval_on_selector_all("#monthly table:first-of-type td[data-month]", "es => es.filter(e => e.textContent).length")
    start, end = page.inner_text("#headline tr:last-child td").split("→")
    assert months >= 10, (months, start, end)
    shot(page, "dashboard-run.png", "#tearsheet")
    # the trade table pages through every trade
    n_trades = int(rep["val"]["metrics"]["n_trades"])
    assert page.get_attribute("#trades", "data-total") == str(n_trades)
    assert page.get_attribute("#trades", "data-rows") == str(min(25, n_trades))
    if n_trades > 25:
        page.click("#trades-next")
        page.wait_for_function("() => document.getElementById('trades-range').textContent.startsWith('trades 26')")
    # the knobs it trained under: E5 reads "no gate" where the gate is off
    gate = (rep["knobs"] or {}).get("gate_threshold")
    e5 = page.inner_text('#knobs tr[data-signal="E5"] td.knob-value')
    assert (e5 == "no gate") == (gate is None), (e5, gate)
    no_gate = [b["for_epoch"] for b in bundles if b["knobs"]["gate_threshold"] is None]
    note = page.inner_text("#note-E5")
    assert ("no gate" in note) == bool(no_gate) and "no data" not in page.inner_text("#chart-E5")
    assert assert_distinct_ticks(page) >= 10


def test_the_tearsheet_equals_evaluate_report(disk_dashboard, page):
    url, root = disk_dashboard
    run = STUDY[1]
    reports, _ = run_docs(root, run)
    selected = max(reports, key=lambda d: d["val"]["metrics"]["per_trade_sharpe"])["epoch"]
    ckpt = root / run / "trainer" / "checkpoints" / f"epoch-{selected:04d}.safetensors"
    out = subprocess.run([tradeloop_exe(), "evaluate", "--policy", str(ckpt), "--report"], env=clean_env(),
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)

    open_page(page, f"{url}/#run={run}")
    page.wait_for_selector('#headline td[data-split="oos"][data-key="per_trade_sharpe"]')
    cells = page.eval_on_selector_all("#headline td[data-key][data-value]",
                                      "es => es.map(e => [e.dataset.key, e.dataset.split, +e.dataset.value])")
    got = {(k, s): v for k, s, v in cells}
    for split in ("val", "oos"):
        for key, value in cli[split]["metrics"].items():
            if value is not None:
                assert got[(key, split)] == pytest.approx(value, rel=1e-12, abs=1e-15), (split, key)
    if cli["val"]["metrics"]["per_trade_sharpe"] > 0:
        assert got[("val_oos_gap", "oos")] == pytest.approx(cli["val_oos_gap"], rel=1e-12)
    else:                                   # no edge on validation: no share of it to lose
        assert page.inner_text('#headline td[data-key="val_oos_gap"]') == "n/a (validation ≤ 0)"
    assert got[("n_trials", "val")] == cli["n_trials"]
    # the first page of trades is the report's first 25 trades
    from shared.report import TradeTable

    want = TradeTable.of(cli["val"]["trades"]).net_return[:25]
    shown = page.eval_on_selector_all("#trades td.num[data-value]", "es => es.map(e => +e.dataset.value)")
    np.testing.assert_allclose(shown, want, rtol=1e-12)


def test_an_open_run_still_being_written_shows_its_new_epochs(study, page, tmp_path):
    """A run on disk whose files grow while the page shows it (`tradeloop show` beside a running loop): the page
    reloads it once the run list says it changed, without a click or a reload."""
    from shared.runfiles import KINDS

    run = STUDY[0]
    shutil.copytree(study / run, tmp_path / run, ignore=shutil.ignore_patterns("redis", "logs", "*.lock"))
    held = {k: tmp_path / run / d / f"epoch-{EPOCHS:04d}.json" for k, d in KINDS.items()}
    later = {k: p.read_bytes() for k, p in held.items() if p.exists()}
    for p in held.values():
        p.unlink(missing_ok=True)
    with serve_runs(tmp_path) as url:
        open_page(page, f"{url}/?poll=250#run={run}")
        options = "() => document.querySelectorAll('#epoch-select option').length"
        assert page.evaluate(options) == EPOCHS - 1
        for k, data in later.items():                       # the last epoch arrives
            held[k].write_bytes(data)
        page.wait_for_function(f"{options[6:]} === {EPOCHS}", timeout=20_000)
        assert charts(page)["chart-sharpe"]["points"] == EPOCHS


def test_two_runs_overlaid(disk_dashboard, page):
    url, root = disk_dashboard
    open_page(page, f"{url}/#compare={','.join(STUDY)}")
    page.wait_for_function("() => +document.getElementById('chart-compare-equity').dataset.series === 2")
    c = charts(page)
    n = {r: len(run_docs(root, r)[0]) for r in STUDY}
    assert c["chart-compare-sharpe"]["series"] == 2 and c["chart-compare-sharpe"]["points"] == sum(n.values())
    assert c["chart-compare-loss"]["series"] == 2 and c["chart-compare-loss"]["points"] == 2 * EPOCHS
    rows = page.eval_on_selector_all("#compare-table tr[data-run]", "es => es.map(e => e.dataset.run)")
    assert rows == list(STUDY)
    for r in STUDY:                           # each row: that run's selected checkpoint
        best = max(d["val"]["metrics"]["per_trade_sharpe"] for d in run_docs(root, r)[0])
        v = page.get_attribute(f'#compare-table tr[data-run="{r}"] td[data-key="val_per_trade_sharpe"]', "data-value")
        assert float(v) == pytest.approx(best, rel=1e-12)
    assert page.is_hidden("#run") and page.is_visible("#compare")
    assert assert_distinct_ticks(page) == 3
    shot(page, "dashboard-compare.png")


def test_oos_per_epoch_is_hidden_until_toggled(disk_dashboard, page):
    url, root = disk_dashboard
    run = STUDY[0]
    reports, _ = run_docs(root, run)
    selected = max(reports, key=lambda d: d["val"]["metrics"]["per_trade_sharpe"])["epoch"]
    other = next(d["epoch"] for d in reports if d["epoch"] != selected)
    open_page(page, f"{url}/#run={run}&epoch={other}")
    page.wait_for_selector('#headline td[data-split="val"][data-key="per_trade_sharpe"]')
    oos_values = {f"{d['oos']['metrics']['per_trade_sharpe']:.4f}" for d in reports}
    assert charts(page)["chart-sharpe"]["series"] == 1 and charts(page)["chart-dsr"]["series"] == 1
    assert page.query_selector('#headline td[data-split="oos"]') is None
    assert page.is_hidden("#chart-equity-oos") and charts(page)["chart-equity-oos"]["points"] == 0
    assert "not the checkpoint validation selects" in page.inner_text("#headline-note")
    assert not [v for v in oos_values if v in page.inner_text("#run")], "an OOS Sharpe is on the page"
    label = page.inner_text("#oos-toggle-label")
    assert "leaks the test set" in label and "risk" in label

    page.check("#oos-toggle")
    page.wait_for_selector('#headline td[data-split="oos"][data-key="per_trade_sharpe"]')
    c = charts(page)
    assert c["chart-sharpe"]["series"] == 2 and c["chart-sharpe"]["points"] == 2 * len(reports)
    assert c["chart-equity-oos"]["points"] > 0
    assert "oos=1" in page.url
    assert assert_distinct_ticks(page) >= 12
    # the selected checkpoint shows its OOS without the toggle
    page.goto("about:blank")
    open_page(page, f"{url}/#run={run}&epoch={selected}")
    page.wait_for_selector('#headline td[data-split="oos"][data-key="per_trade_sharpe"]')
    assert charts(page)["chart-sharpe"]["series"] == 1


def test_a_loading_state_before_the_first_answer(disk_dashboard, page):
    url, _ = disk_dashboard
    held = []
    page.route("**/runs", lambda route: held.append(route))          # the run list does not answer yet
    page.goto(f"{url}/#run={STUDY[0]}")
    page.wait_for_function("() => document.readyState === 'complete'")
    assert held, "the page asked for the run list"
    assert page.is_visible("#loading") and "Loading" in page.inner_text("#loading")
    assert page.is_hidden("#run")
    for route in held:
        route.continue_()
    page.unroute("**/runs")
    page.wait_for_function("() => window.tradeloopDashboard.state.loaded", timeout=30_000)
    assert page.is_hidden("#loading") and page.is_visible("#run")


def test_a_million_bar_equity_is_drawn_in_under_a_second(disk_dashboard, page):
    url, root = disk_dashboard
    write_big_run(root)                   # a run appearing beside the others: the page finds it
    wait_for("the new run listed", lambda: "million" in {r["id"] for r in get_json(url + "/runs")["runs"]}, 10, {})
    open_page(page, f"{url}/#run=million")
    timing = page.evaluate("() => window.tradeloopDashboard.state.timings.equity_val")
    c = charts(page)["chart-equity-val"]
    print(f"10^6-bar validation equity: drawn {timing['ms']:.0f} ms after the request "
          f"(fetch {timing['fetch_ms']:.0f} ms; {timing['points']} points shipped, {timing['n_bars']} bars)")
    assert timing["n_bars"] == 1_000_000 and 0 < timing["points"] <= 8000 and c["points"] == 2 * timing["points"]
    assert timing["ms"] < 1000, timing


# ------------------------------------------------------------------------------------------------- the live run
@pytest.fixture
def loop(redis_url, run_id, tmp_path):
    """The four services as `tradeloop serve` processes on free ports, each serving on a socket bound here (as
    `tradeloop up` does: no window for another process to take a port); yields (urls, procs, logs)."""
    listeners = bind_listeners("127.0.0.1", {name: 0 for name in SERVICES})
    ports = {name: s.getsockname()[1] for name, s in listeners.items()}
    env = clean_env(**{
        "TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_RUN_DIR": str(tmp_path / "runs"),
        "TL_EMBEDDED": "true", "TL_HOST": "127.0.0.1", "TL_DEVICE": "cpu", "TL_DATA": "synthetic",
        "TL_DASHBOARD_ORIGIN": f"http://127.0.0.1:{ports['dashboard']}",
        "TL_EPOCHS": str(EPOCHS), "TL_FEEDBACK_TIMEOUT_S": "120",
        # a tiny run: a slice of the synthetic market, few iterations per epoch
        "TL_DATA_BARS": "1500", "TL_TRAIN_ITERATIONS": "6", **TINY,
        **{f"TL_{n.upper()}_PORT": str(p) for n, p in ports.items()},
    })
    procs, logs = {}, {}
    try:
        for name in SERVICES:
            logs[name] = tmp_path / f"{name}.log"
            fd = listeners[name].fileno()
            procs[name] = subprocess.Popen([tradeloop_exe(), "serve", name, "--log-level", "warning"],
                                           env={**env, "TL_LISTEN_FD": str(fd)}, pass_fds=(fd,),
                                           stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT,
                                           start_new_session=True)
            listeners[name].close()  # the child's copy is the only one: once it dies, its port refuses
        urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        yield urls, procs, logs
    finally:
        stop(list(procs.values()))
        for sock in listeners.values():
            sock.close()


def metric_values(url: str) -> dict:
    """{(name, frozenset of labels except run_id): value} of a Prometheus /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(get_text(url + "/metrics")):
        for s in fam.samples:
            out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "run_id"))] = s.value
    return out


def service_states(page) -> dict:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('.svc')].map(e =>
        [e.id.replace('svc-', ''), e.dataset.state]))""")


@pytest.mark.redis
def test_the_live_run_and_a_stopped_service(loop, chromium, run_id):
    urls, procs, logs = loop
    try:
        wait_for("every service ready", lambda: all(
            urllib.request.urlopen(urls[n] + "/ready", timeout=2).status == 200 for n in SERVICES), 90, procs)
        reports = wait_for("two evaluated epochs", lambda: (r := get_json(urls["evaluator"] + "/reports"))
                           and len(r) >= 2 and r, 300, procs)
        bundles = wait_for("a feedback bundle", lambda: get_json(urls["feedback"] + "/signals"), 120, procs)
    except BaseException:
        for name, path in logs.items():
            print(f"--- {name} log ---\n{path.read_text(errors='replace')[-3000:]}")
        raise
    history = get_json(urls["trainer"] + "/api/history")

    # what an operator alerts on, on each service's /metrics
    tr, ev, fb = (metric_values(urls[n]) for n in ("trainer", "evaluator", "feedback"))
    for name in ("tradeloop_trainer_loss", "tradeloop_trainer_updates_per_s", "tradeloop_trainer_env_steps_per_s",
                 "tradeloop_trainer_dead_letters", "tradeloop_trainer_feedback_wait_seconds"):
        assert (name, frozenset()) in tr, name
    assert np.isfinite(tr[("tradeloop_trainer_loss", frozenset())])
    # progress inside the epoch (a read at an epoch's very start sees iteration 0: wait for its first iteration)
    st = wait_for("an iteration of the epoch done", lambda: (s := get_json(urls["trainer"] + "/status"))
                  and s.get("iteration") and s, 60, procs)
    assert st["iterations"] == 6 and 1 <= st["iteration"] <= 6 and st["updates_per_s"] >= 0, st
    progress = wait_for("epoch progress on /metrics", lambda: metric_values(urls["trainer"])[
        ("tradeloop_trainer_epoch_progress", frozenset())], 60, procs)
    assert 0 < progress <= 1
    phases = {dict(k[1])["phase"]: v for k, v in tr.items() if k[0] == "tradeloop_trainer_phase"}
    assert sum(phases.values()) == 1 and {"training", "waiting_feedback", "done"} <= set(phases)
    knobs = {dict(k[1])["knob"] for k in tr if k[0] == "tradeloop_trainer_knob"}
    assert {"epsilon", "gamma", "q_bias", "gate_threshold", "lr_scale_direction", "regime_weight_0",
            "regime_confidence_8", "priority_boost_count", "hindsight_count"} <= knobs
    assert np.isfinite(ev[("tradeloop_evaluator_last_val_per_trade_sharpe", frozenset())])
    for name in ("tradeloop_evaluator_last_val_dsr", "tradeloop_evaluator_last_eval_seconds",
                 "tradeloop_evaluator_last_eval_latency_seconds", "tradeloop_evaluator_dead_letters",
                 "tradeloop_evaluator_dead_lettered_total"):
        assert (name, frozenset()) in ev, name
    assert ev[("tradeloop_evaluator_last_eval_latency_seconds", frozenset())] >= \
        ev[("tradeloop_evaluator_last_eval_seconds", frozenset())] > 0
    assert ev[("tradeloop_evaluator_dead_letters", frozenset())] == 0
    assert ev[("tradeloop_evaluator_last_report_epoch", frozenset())] >= 2
    for name in ("tradeloop_feedback_last_feedback_latency_seconds", "tradeloop_feedback_last_bundle_seconds",
                 "tradeloop_feedback_dead_letters", "tradeloop_feedback_rollbacks_total"):
        assert (name, frozenset()) in fb, name
    assert ("tradeloop_feedback_knob", frozenset({("knob", "epsilon")})) in fb

    with_page = chromium.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    with_page.on("pageerror", lambda e: errors.append(str(e)))
    page = with_page
    try:
        open_page(page, urls["dashboard"] + "/?poll=500")
        n_reports = len(reports)
        page.wait_for_function(
            """n => +document.getElementById('chart-sharpe').dataset.points >= n
                    && +document.getElementById('chart-equity-val').dataset.points > 0
                    && +document.getElementById('chart-E2').dataset.points > 0
                    && ['trainer','evaluator','feedback'].every(s =>
                          document.getElementById('svc-' + s).dataset.state === 'up')""",
            arg=n_reports, timeout=30_000)
        assert page.evaluate("() => window.tradeloopDashboard.state.live") == run_id
        assert page.is_visible("#live") and "(live)" in page.inner_text("#run-title")
        c = charts(page)
        assert service_states(page) == {"trainer": "up", "evaluator": "up", "feedback": "up"}
        n_now = len(get_json(urls["evaluator"] + "/reports"))
        assert n_reports <= c["chart-sharpe"]["points"] <= n_now and c["chart-sharpe"]["series"] == 1  # val only
        for sid in ("E1", "E2", "E3", "E4", "E6", "E7", "E8", "E9"):
            assert c[f"chart-{sid}"]["points"] >= len(bundles), (sid, c[f"chart-{sid}"])
        assert c["chart-E4"]["series"] == 3 and c["chart-E9"]["series"] == 9, c
        assert c["chart-loss"]["points"] >= 3 * len(history) and c["chart-updates"]["points"] >= len(history) >= 2
        assert page.inner_text("#epochs") == str(EPOCHS)
        assert_distinct_ticks(page)
        shot(page, "dashboard.png")

        # stop one service: the page shows it down, keeps the others up and keeps every chart's data
        procs["feedback"].send_signal(signal.SIGKILL)
        procs["feedback"].wait(timeout=10)
        page.wait_for_function("() => document.getElementById('svc-feedback').dataset.state === 'down'",
                               timeout=15_000)
        before = page.inner_text("#last-poll")
        page.wait_for_function("t => document.getElementById('last-poll').textContent !== t", arg=before,
                               timeout=15_000)  # still polling
        after = charts(page)
        states = service_states(page)
        assert states["feedback"] == "down" and states["trainer"] == "up" and states["evaluator"] == "up", states
        assert page.inner_text("#svc-feedback .badge") == "down"
        for cid, v in c.items():
            assert after[cid]["points"] >= v["points"], (cid, v, after[cid])
        assert not errors, errors
    finally:
        page.close()
