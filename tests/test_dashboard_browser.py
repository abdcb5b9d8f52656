"""The dashboard in headless Chromium against a real running loop.

Starts the loop as processes — the session's real Redis (tests/conftest.py) plus `tradeloop serve trainer |
evaluator | feedback | dashboard` on free ports, a tiny training run on `synthetic` — waits (polling the REST
APIs, with a deadline) until two epochs are evaluated and a feedback bundle exists, then loads the page in
Chromium (Playwright driving Debian's /usr/bin/chromium; no browser is ever downloaded) and checks:
  - every service shows as up;
  - the Sharpe/DSR charts hold one point per evaluated epoch (counted against /reports);
  - the validation equity curve holds the report's equity points and one marker per trade entry and exit
    (counted against /reports/{epoch}/trades);
  - the E1–E9 charts hold data, and the throughput chart one point per trained epoch;
then kills the feedback process and checks that the page shows it as down while the others stay up and the
charts keep their data.

Set TL_DASHBOARD_SCREENSHOT=path to save a full-page screenshot of the loaded page (docs/dashboard.png).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tradeloop.cmd_up import bind_listeners

pytestmark = [pytest.mark.browser, pytest.mark.redis, pytest.mark.timeout(420)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
SERVICES = ("trainer", "evaluator", "feedback", "dashboard")
EPOCHS = 3

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is missing (install Debian's chromium: apt-get install chromium; .ci/run does)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="python package playwright is not installed")


def get_json(url: str, timeout: float = 3.0):
    """GET url → JSON (raises on connection errors and non-2xx)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


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


@pytest.fixture
def loop(redis_url, run_id, tmp_path):
    """The four services as `tradeloop serve` processes on free ports, each serving on a socket bound here (as
    `tradeloop up` does: no window for another process to take a port); yields (urls, procs, logs)."""
    listeners = bind_listeners("127.0.0.1", {name: 0 for name in SERVICES})
    ports = {name: s.getsockname()[1] for name, s in listeners.items()}
    env = {k: v for k, v in os.environ.items() if not k.startswith("TL_") and k != "REDIS_URL"}
    env.update({
        "TL_REDIS_URL": redis_url, "TL_RUN_ID": run_id, "TL_RUN_DIR": str(tmp_path / "runs"),
        "TL_EMBEDDED": "true", "TL_HOST": "127.0.0.1", "TL_DEVICE": "cpu", "TL_DATA": "synthetic",
        "TL_DASHBOARD_ORIGIN": f"http://127.0.0.1:{ports['dashboard']}",
        "TL_EPOCHS": str(EPOCHS), "TL_FEEDBACK_TIMEOUT_S": "120",
        # a tiny run: a slice of the synthetic market, few iterations per epoch
        "TL_DATA_BARS": "1500", "TL_TRAIN_ITERATIONS": "20", "TL_TRAIN_LEARNING_STARTS": "64",
        "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4",
        **{f"TL_{n.upper()}_PORT": str(p) for n, p in ports.items()},
    })
    exe = shutil.which("tradeloop", path=str(Path(sys.executable).parent)) or shutil.which("tradeloop")
    assert exe, "the `tradeloop` console script is not installed"
    procs, logs = {}, {}
    try:
        for name in SERVICES:
            logs[name] = tmp_path / f"{name}.log"
            fd = listeners[name].fileno()
            procs[name] = subprocess.Popen([exe, "serve", name, "--log-level", "warning"],
                                           env={**env, "TL_LISTEN_FD": str(fd)}, pass_fds=(fd,),
                                           stdout=open(logs[name], "wb"), stderr=subprocess.STDOUT,
                                           start_new_session=True)
            listeners[name].close()  # the child's copy is the only one: once it dies, its port refuses
        urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
        yield urls, procs, logs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for sock in listeners.values():
            sock.close()


def chart_counts(page) -> dict:
    """{chart id: {points, series, markers}} as the page's charts report them."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('.tl-chart')].map(e =>
        [e.id, {points: +e.dataset.points, series: +e.dataset.series, markers: +e.dataset.markers}]))""")


def service_states(page) -> dict:
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('.svc')].map(e =>
        [e.id.replace('svc-', ''), e.dataset.state]))""")


def test_dashboard_shows_the_loop_and_a_stopped_service(loop, tmp_path):
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
    latest = reports[-1]["epoch"]
    val_trades = get_json(f"{urls['evaluator']}/reports/{latest}/trades?split=val&limit=2000")["trades"]
    val_equity = get_json(f"{urls['evaluator']}/reports/{latest}/equity?split=val&max_points=4000")["equity"]
    history = get_json(urls["trainer"] + "/api/history")

    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(urls["dashboard"] + "/?poll=500")

            # the page has caught up with what the REST APIs held a moment ago
            n_reports = len(reports)
            page.wait_for_function(
                """n => +document.getElementById('chart-sharpe').dataset.points >= n
                        && +document.getElementById('chart-equity-val').dataset.points > 0
                        && +document.getElementById('chart-E2').dataset.points > 0
                        && ['trainer','evaluator','feedback'].every(s =>
                              document.getElementById('svc-' + s).dataset.state === 'up')""",
                arg=n_reports, timeout=30_000)
            counts = chart_counts(page)
            states = service_states(page)
            assert states == {"trainer": "up", "evaluator": "up", "feedback": "up"}, states
            # val and OOS per-trade Sharpe: one point per evaluated epoch each (the run evaluates both splits)
            n_now = len(get_json(urls["evaluator"] + "/reports"))
            assert n_reports <= counts["chart-sharpe"]["points"] // 2 <= n_now, counts["chart-sharpe"]
            assert counts["chart-sharpe"]["series"] == 2 and counts["chart-dsr"]["series"] == 2, counts
            # the equity chart of the epoch it shows: every bar, and an entry + exit marker per trade
            shown = page.evaluate("() => window.tradeloopDashboard.state.latestDetail.epoch")
            if shown != latest:  # a newer epoch landed meanwhile: compare with that one
                val_trades = get_json(f"{urls['evaluator']}/reports/{shown}/trades?split=val&limit=2000")["trades"]
                val_equity = get_json(f"{urls['evaluator']}/reports/{shown}/equity?split=val&max_points=4000")["equity"]
            assert counts["chart-equity-val"]["points"] == len(val_equity) > 1, counts["chart-equity-val"]
            assert counts["chart-equity-val"]["markers"] == 2 * len(val_trades), (counts["chart-equity-val"],
                                                                                 len(val_trades))
            assert counts["chart-equity-oos"]["points"] > 1
            for sid in ("E1", "E2", "E3", "E4", "E6", "E7", "E8", "E9"):
                assert counts[f"chart-{sid}"]["points"] >= len(bundles), (sid, counts[f"chart-{sid}"])
            assert counts["chart-E4"]["series"] == 3 and counts["chart-E9"]["series"] == 9, counts
            assert counts["chart-throughput"]["points"] >= len(history) >= 2, counts["chart-throughput"]
            assert page.inner_text("#epochs") == str(EPOCHS)
            if os.environ.get("TL_DASHBOARD_SCREENSHOT"):
                page.screenshot(path=os.environ["TL_DASHBOARD_SCREENSHOT"], full_page=True)

            # stop one service: the page shows it down, keeps the others up and keeps every chart's data
            procs["feedback"].send_signal(signal.SIGKILL)
            procs["feedback"].wait(timeout=10)
            page.wait_for_function("() => document.getElementById('svc-feedback').dataset.state === 'down'",
                                   timeout=15_000)
            before = page.inner_text("#last-poll")
            page.wait_for_function("t => document.getElementById('last-poll').textContent !== t", arg=before,
                                   timeout=15_000)  # still polling
            after = chart_counts(page)
            states = service_states(page)
            assert states["feedback"] == "down" and states["trainer"] == "up" and states["evaluator"] == "up", states
            assert page.inner_text("#svc-feedback .badge") == "down"
            for cid, c in counts.items():
                assert after[cid]["points"] >= c["points"] > 0 or cid == "chart-E5" or cid == "chart-lag", (cid, c,
                                                                                                         after[cid])
            assert not errors, errors
        finally:
            browser.close()
