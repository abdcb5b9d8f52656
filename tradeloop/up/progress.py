"""The loop's state while a run is up and after it: `Progress` polls the services' REST endpoints and shows
epoch, loss, the validation per-trade Sharpe (un-annualized), trades and DSR, the latest signals, stream lag and service
health with rich (a live table on a terminal, one line per event otherwise). OOS is shown for the checkpoint validation
selects alone, as on the dashboard: a per-epoch OOS column invites choosing an epoch by its test result.
`loop_done`, `collect_summary` and `new_dead_letters` read Redis; `trainer_failure` reads the trainer's /status: the
launcher ends a run that cannot finish (a failed trainer, a last epoch's message given up) at once. `RedisWatch`
starts an embedded Redis that exited again on its AOF (within `REDIS_RESTARTS`), and says when an external one stops
and starts answering.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

from shared.report import OFF_NAMES


def write_line(line: str, stream: str = "stdout") -> None:
    """Print a line to sys.stdout or sys.stderr; where that stream is gone (its terminal closed, the pipe's reader
    ended: `| head`, `| tee` stopped by the same Ctrl-C) it is swapped for /dev/null, so the launcher goes on
    stopping its services and writing the run's summary instead of dying on a BrokenPipeError."""
    try:
        print(line, file=getattr(sys, stream), flush=True)
    except OSError:
        setattr(sys, stream, open(os.devnull, "w"))


def get_json(client, url: str) -> Any:
    try:
        r = client.get(url, timeout=2.0)
        return r.json() if r.status_code == 200 else None
    except Exception:  # noqa: BLE001 — a service that is down (re)starting shows as down
        return None


def collect_summary(redis_url: str, run_id: str) -> dict:
    """Per epoch: checkpoint id + sha256, report id, bundle id, the epoch that applied the bundle — from Redis."""
    import redis

    from shared.api import bundle_id, report_id, trainer_history_key
    from shared.store import run_key

    r = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    try:
        hist = sorted((json.loads(v) for v in r.hgetall(trainer_history_key(run_id)).values()),
                      key=lambda x: x["epoch"])
        evals = {int(k): int(v) for k, v in r.hgetall(run_key(run_id, "evaluations")).items()}
        rows = []
        for rec in hist:
            e = rec["epoch"]
            report = r.get(run_key(run_id, "report", e))
            bundle = r.get(run_key(run_id, "bundle", e))
            rep = json.loads(report) if report else None
            # sync mode: the epoch that trained under bundle e; overlap mode: the one whose record lists it applied
            applied = next((h["epoch"] for h in hist
                            if ([b["epoch"] for b in h["bundles_applied"]].count(e) if "bundles_applied" in h
                                else h.get("bundle_epoch") == e)), None)
            val = ((rep or {}).get("val") or {}).get("metrics", {})
            oos = ((rep or {}).get("oos") or {}).get("metrics", {})
            rows.append({
                "epoch": e, "checkpoint_id": rec.get("checkpoint_id"), "checkpoint_sha256": rec.get("sha256"),
                "report_id": report_id(run_id, e, rec["sha256"]) if rep else None,
                "bundle_id": bundle_id(run_id, e, rec["sha256"]) if bundle else None,
                "bundle_applied_in_epoch": applied,
                "trained_under_bundle_epoch": rec.get("bundle_epoch"),
                "trained_under_bundle_id": rec.get("bundle_id"),
                "feedback_timed_out": rec.get("feedback_timed_out"),
                "loss": rec.get("loss"), "epsilon": rec.get("epsilon"), "gamma": rec.get("gamma"),
                "val_per_trade_sharpe": val.get("per_trade_sharpe"), "oos_per_trade_sharpe": oos.get("per_trade_sharpe"),
                "val_dsr": val.get("dsr"), "evaluations": evals.get(e, 0),
                "val_n_trades": None if "n_trades" not in val else int(val["n_trades"]),
                "oos_n_trades": None if "n_trades" not in oos else int(oos["n_trades"]),
                "val_n_trials": (rep or {}).get("n_trials"),
            })
        return {"epochs": rows, "evaluations": {str(k): v for k, v in sorted(evals.items())}}
    finally:
        r.close()


@contextmanager
def redis_client(redis: Any) -> Iterator[Any]:
    """A Redis client for `redis`: a URL (a connection opened here and closed after) or a client, used as it is (the
    launcher's poll keeps one for the run)."""
    if not isinstance(redis, str):
        yield redis
        return
    import redis as redis_py

    r = redis_py.Redis.from_url(redis, socket_timeout=5)
    try:
        yield r
    finally:
        r.close()


def loop_done(redis: Any, run_id: str, epochs: int) -> bool:
    """True when epoch N's checkpoint, report and bundle are all stored (`redis`: a URL or a client)."""
    from redis import RedisError

    from shared.api import trainer_history_key
    from shared.store import run_key

    with redis_client(redis) as r:
        try:
            return bool(r.hexists(trainer_history_key(run_id), str(epochs))
                        and r.exists(run_key(run_id, "report", epochs)) and r.exists(run_key(run_id, "bundle", epochs)))
        except RedisError:  # Redis restarting: the services reconnect by themselves; so does this check
            return False


def new_dead_letters(redis: Any, run_id: str, after: str = "0") -> list[tuple[str, dict]]:
    """The run's dead letters stored after entry id `after` (oldest first): (entry id, the `DeadLetter` as a dict).
    A dead letter is a message a service gave up on (the reason inside); its epoch's step of the loop never happens.
    `redis`: a URL or a client."""
    from redis import RedisError

    from shared.events import decode_event, stream_name

    with redis_client(redis) as r:
        try:
            rows = r.xrange(stream_name(run_id, "dead"), min=f"({after}" if after != "0" else "-")
        except RedisError:  # Redis restarting: read them on the next poll
            return []
    out = []
    for entry_id, fields in rows:
        try:
            out.append((entry_id.decode(), decode_event(fields).model_dump()))
        except Exception as exc:  # noqa: BLE001 — a dead letter that does not decode is still reported
            out.append((entry_id.decode(), {"epoch": -1, "original_stream": "?", "reason": f"undecodable: {exc}"}))
    return out


def dead_letter_line(dl: dict) -> str:
    """A dead letter in words: what was given up, by whom, after how many deliveries, and why."""
    stream = str(dl.get("original_stream", "?")).rsplit(":", 1)[-1]
    epoch = dl.get("epoch", -1)
    who = "/".join(x for x in (dl.get("group"), dl.get("consumer")) if x) or "a consumer"
    return (f"dead letter: the {stream} message of {f'epoch {epoch}' if epoch >= 0 else 'an unknown epoch'} given up "
            f"by {who} after {dl.get('deliveries', '?')} deliveries: {dl.get('reason')}")


def trainer_failure(status: Any) -> str | None:
    """The error of a trainer whose /status says it failed (its loop has ended: the run cannot go on), else None."""
    if not isinstance(status, dict) or status.get("phase") != "failed":
        return None
    return status.get("last_error") or "no error recorded"


class Progress:
    """Polls the services' REST endpoints and renders the loop's state (rich)."""

    def __init__(self, urls: dict[str, str], epochs: int, live: bool):
        import httpx
        from rich.console import Console

        self.urls, self.epochs = urls, epochs
        self.client = httpx.Client()
        self.console = Console(stderr=False)
        self.live_mode = live
        self.live = None
        self.seen_epochs: set[tuple[str, int]] = set()
        self.snapshot: dict[str, Any] = {}

    def __enter__(self) -> "Progress":
        if self.live_mode:
            from rich.live import Live

            self.live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(*exc)
        self.client.close()

    def note(self, msg: str) -> None:
        """A message above the live table (or a plain line)."""
        if not self.live_mode:
            write_line(msg)
            return
        try:
            self.console.print(f"[yellow]{msg}[/yellow]", highlight=False, soft_wrap=True)
        except OSError:                      # the terminal is gone: as `write_line`
            self.console.file = open(os.devnull, "w")

    def refresh(self) -> None:
        c, u = self.client, self.urls
        s = {name: get_json(c, f"{url}/status") for name, url in u.items() if name != "dashboard"}
        if "dashboard" in u:
            s["dashboard"] = get_json(c, f"{u['dashboard']}/health")
        s["history"] = get_json(c, f"{u['trainer']}/api/history") or self.snapshot.get("history") or []
        s["reports"] = get_json(c, f"{u['evaluator']}/reports") or self.snapshot.get("reports") or []
        s["signals"] = get_json(c, f"{u['feedback']}/signals") or self.snapshot.get("signals") or []
        self.snapshot = s
        if self.live is not None:
            self.live.update(self.render())
        else:
            self._print_events()

    def _print_events(self) -> None:
        """A line for each epoch trained, evaluated and given its feedback since the last poll, in epoch order (a
        resumed run's earlier epochs come at once from the three services)."""
        s, lines = self.snapshot, []
        for h in s["history"]:
            if ("t", h["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("t", h["epoch"]))
                late = " (feedback TIMED OUT)" if h.get("feedback_timed_out") else ""
                lines.append((h["epoch"], 0, f"epoch {h['epoch']}/{self.epochs} trained: loss {fmt(h.get('loss'))}, "
                              f"ε {fmt(h.get('epsilon'))}, γ {fmt(h.get('gamma'))}, under bundle "
                              f"{h.get('bundle_epoch')}{late}"))
        for r in s["reports"]:
            if ("r", r["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("r", r["epoch"]))
                lines.append((r["epoch"], 1, f"epoch {r['epoch']} evaluated: val per-trade Sharpe "
                              f"{fmt(r.get('val_per_trade_sharpe'))} over {fmt(r.get('val_n_trades'))} trades, DSR "
                              f"{fmt(r.get('val_dsr'))}"))
        for b in s["signals"]:
            if ("b", b["epoch"]) not in self.seen_epochs:
                self.seen_epochs.add(("b", b["epoch"]))
                k = b.get("knobs") or {}
                fixed = b.get("enabled") is False or set(OFF_NAMES) <= set(b.get("off") or ())
                how = " (all off: the fixed schedule)" if fixed else ""
                lines.append((b["epoch"], 2, f"epoch {b['epoch']} feedback{how}: ε {fmt(k.get('epsilon'))}, γ "
                              f"{fmt(k.get('gamma'))}, q_bias {fmt(k.get('q_bias'))}"
                              f"{' ROLLBACK' if b.get('rollback') else ''}"))
        for _, _, line in sorted(lines, key=lambda x: x[:2]):
            write_line(line)

    def render(self):
        from rich.console import Group
        from rich.table import Table

        s = self.snapshot
        svc = Table.grid(padding=(0, 2))
        cells = []
        for name in ("trainer", "evaluator", "feedback", "dashboard"):
            st = s.get(name)
            if name not in self.urls:
                continue
            if st is None:
                cells.append(f"[red]{name}: down[/red]")
            else:
                lag = st.get("stream_lag") if isinstance(st, dict) else None
                extra = f" {st.get('phase')}" if name == "trainer" and st.get("phase") else ""
                cells.append(f"[green]{name}: up[/green]{extra}" + (f" lag {lag}" if lag is not None else ""))
        svc.add_row(*cells) if cells else None
        t = Table(title=f"tradeloop — {len(s.get('history', []))}/{self.epochs} epochs", expand=False)
        for col in ("epoch", "loss", "val S/trade", "val trades", "DSR", "OOS S/trade (selected)", "ε next", "γ next",
                    "q_bias next", "bundle applied"):
            t.add_column(col, justify="right")
        reports = {r["epoch"]: r for r in s.get("reports", [])}
        bundles = {b["epoch"]: b for b in s.get("signals", [])}
        for h in s.get("history", []):
            e = h["epoch"]
            r, b = reports.get(e, {}), bundles.get(e, {})
            k = b.get("knobs") or {}
            applied = next((x["epoch"] for x in s.get("history", []) if x.get("bundle_epoch") == e), None)
            oos = fmt(r.get("oos_per_trade_sharpe")) if r.get("selected_by_validation") else ""
            t.add_row(str(e), fmt(h.get("loss")), fmt(r.get("val_per_trade_sharpe")), fmt(r.get("val_n_trades")),
                      fmt(r.get("val_dsr")), oos, fmt(k.get("epsilon")),
                      fmt(k.get("gamma")), fmt(k.get("q_bias")),
                      "-" if applied is None else f"epoch {applied}")
        return Group(svc, t)


REDIS_RESTARTS = 5
"""How many times in a row the launcher starts an embedded Redis that exited again (after 1 s, 2 s, 4 s, … as a
service's restart): a server that then runs `REDIS_STEADY_S` clears the count; one more exit stops the run."""
REDIS_STEADY_S = 60.0
REDIS_QUIET_S = 10.0
"""How long Redis may go unanswered in the launcher's poll before it says so (an external Redis; the embedded one is
watched through its process)."""


class RedisWatch:
    """The run's Redis, looked at in each of the launcher's polls (`poll`, returning lines to print). An embedded
    `server` (`shared.redis_server.EmbeddedRedis`) that exited is started again, after a backoff, on the same
    directory, socket and config: it replays its AOF, so every write it acknowledged is there again. After
    `REDIS_RESTARTS` restarts in a row `failure` says why the run cannot go on. For an external Redis (`server`
    None), `client` is PINGed: `REDIS_QUIET_S` of errors are reported once, and so is the answer that ends them."""

    def __init__(self, server: Any, client: Any, *, restarts: int = REDIS_RESTARTS, steady_s: float = REDIS_STEADY_S,
                 quiet_s: float = REDIS_QUIET_S):
        self.server, self.client = server, client
        self.budget, self.steady_s, self.quiet_s = restarts, steady_s, quiet_s
        self.restarts = 0                  # restarts done in the run (the summary's)
        self.in_a_row = 0                  # restarts since the server last ran `steady_s`
        self.backoff_s = 1.0
        self.next_start: float | None = None
        self.started_at = time.monotonic()
        self.failure: str | None = None
        self.silent_since: float | None = None
        self.reported = False

    def poll(self) -> list[str]:
        """Look at Redis once (a restart, when one is due, happens here); the lines to print."""
        if self.failure is not None:
            return []
        if self.server is not None:
            return self._embedded(time.monotonic())
        return self._external(time.monotonic())

    def _embedded(self, now: float) -> list[str]:
        from shared.redis_server import RedisServerError

        srv = self.server
        if srv.running:
            if self.in_a_row and now - self.started_at >= self.steady_s:
                self.in_a_row, self.backoff_s = 0, 1.0
            return []
        if self.next_start is None:              # it has just exited
            return [self._again(now, f"the embedded Redis exited ({exit_words(srv.returncode)}); its log ends: "
                                     f"{log_end(srv)}")]
        if now < self.next_start:
            return []
        self.next_start = None
        self.restarts += 1
        self.in_a_row += 1
        srv.startup_timeout_s = max(srv.startup_timeout_s, 60.0)    # a long AOF takes its time to replay
        try:
            srv.start()
        except RedisServerError as exc:
            return [self._again(time.monotonic(), f"the embedded Redis did not start again (restart "
                                                  f"#{self.restarts}): {str(exc).splitlines()[0]}")]
        self.started_at = time.monotonic()
        return [f"the embedded Redis was restarted on {srv.address} (restart #{self.restarts}, "
                f"{self.budget - self.in_a_row} more in a row allowed), its AOF replayed; the services reconnect"]

    def _again(self, now: float, line: str) -> str:
        """`line`, and what comes next: the next start after the backoff, or, the budget spent, the run's end."""
        log = self.server.data_dir / "redis.log"
        if self.in_a_row >= self.budget:
            self.failure = f"the embedded Redis stopped again after {self.budget} restarts in a row (its log: {log})"
            return line
        self.next_start = now + self.backoff_s
        line += f"; restarting it in {self.backoff_s:.0f}s on its AOF (log: {log})"
        self.backoff_s = min(30.0, self.backoff_s * 2)
        return line

    def _external(self, now: float) -> list[str]:
        from redis import RedisError

        from shared.redis_server import redact_url

        where = redact_url(_url_of(self.client))
        try:
            self.client.ping()
        except RedisError as exc:
            if self.silent_since is None:
                self.silent_since = now
            if not self.reported and now - self.silent_since >= self.quiet_s:
                self.reported = True
                return [f"Redis at {where} has not answered for {now - self.silent_since:.0f}s "
                        f"({type(exc).__name__}: {exc}); the services retry until it does"]
            return []
        lines = []
        if self.reported:
            lines.append(f"Redis at {where} answers again after {now - self.silent_since:.0f}s")
        self.silent_since, self.reported = None, False
        return lines


def _url_of(client: Any) -> str:
    """The address a redis-py client connects to, as a URL for messages."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def exit_words(code: int | None) -> str:
    """A process's exit status in words: "killed by SIGKILL", "exit code 1"."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def log_end(server: Any, n: int = 3, width: int = 100) -> str:
    """The last `n` lines of an embedded Redis's log, each cut to `width` characters, on one line."""
    lines = [ln.strip() for ln in server.log_tail(n).splitlines()]
    return " | ".join(ln if len(ln) <= width else ln[:width - 1] + "…" for ln in lines) or "(empty)"


def fmt(x: Any) -> str:
    """A float in 4 significant digits, an integer (a count) whole, "-" for None."""
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)

