"""bench/chaos.py — faults injected into a running embedded loop, and what they cost.

    .venv/bin/python bench/chaos.py                      # 10 epochs, every fault once (3 evaluator kills), ~2-3 min CPU
    .venv/bin/python bench/chaos.py --epochs 12 --iterations 30 --keep runs/chaos

The loop is `tradeloop up` (the real launcher and supervisor) as a subprocess on a tiny CPU config, talking to a
Redis this script owns (`shared.redis_server.EmbeddedRedis` on 127.0.0.1, AOF, password; passed as REDIS_URL),
so Redis itself can be killed and restarted on its AOF. Faults, in order (each waits for its moment by polling
the services' /status and Redis, with deadlines — never a fixed sleep):

  poison           XADD to the live streams: not JSON, truncated JSON, wrong schema_version, oversized, bad schema,
                   and a valid checkpoint.published whose checkpoint does not exist (the handler fails: retried
                   max_deliveries times) — all must be dead-lettered with the reason while the loop goes on
  evaluator kill   SIGKILL the evaluator while it is evaluating a checkpoint (an entry pending in its group and no
                   report for that epoch yet); ×3, on three different epochs; the supervisor restarts it
  trainer kill     SIGKILL the trainer mid-epoch (phase "training")
  trainer kill mid-write  the launcher is SIGSTOPped (so its supervisor cannot restart the trainer yet), the trainer
                   SIGKILLed mid-epoch, and the files a kill inside `save_epoch` leaves are laid down for that epoch:
                   a truncated temp file, the weights renamed in place, the trainer state renamed in place but its
                   sha256 sidecar not yet written; then SIGCONT. The resumed trainer must train the epoch again
                   and never load (or publish) the partial one.
  redis kill       SIGKILL Redis, keep it down `--redis-down` s, restart it on its AOF; then XGROUP DESTROY both
                   consumer groups (a Redis that lost them): the consumers must recreate them and re-read the
                   streams idempotently; everything acknowledged before the kill must still be there
  feedback stop    SIGSTOP the feedback service until the trainer has timed out waiting for a bundle and trained
                   an epoch on the last one, then SIGCONT: feedback catches up, the trainer trains under fresh
                   bundles again

Counted at the end from Redis and the run directory: epochs completed (checkpoint + report + bundle), lost
(an epoch 1..N missing any of them or their events), duplicated (more than one checkpoint.published /
eval.completed / feedback.ready event, stored evaluation, or history.jsonl line for an epoch), dead letters.
"Recover" is measured from the fault to: the killed epoch's report stored (evaluator), the killed epoch's checkpoint
published (trainer), both groups recreated and a new record stored after the restart (Redis), every injected poison entry
dead-lettered, all bundles caught up with the reports (feedback).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shared.api import trainer_history_key  # noqa: E402
from shared.config import CommonSettings  # noqa: E402
from shared.redis_server import EmbeddedRedis, free_port  # noqa: E402
from shared.runfiles import TRAINER_DIR  # noqa: E402
from shared.store import run_key  # noqa: E402

TINY_ENV = {"TL_TRAIN_LEARNING_STARTS": "32", "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4",
            "OMP_NUM_THREADS": "1"}
SERVICES = ("trainer", "evaluator", "feedback")


@dataclass
class Fault:
    """One injected fault: what, when (monotonic s), on which epoch, and when the loop had recovered."""

    name: str
    epoch: int | None = None
    injected_at: float = 0.0
    recovered_at: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.injected_at


def wait_for(cond: Callable[[], Any], what: str, timeout_s: float, every_s: float = 0.05) -> Any:
    """Poll `cond()` until it returns something truthy (returned); TimeoutError naming `what` after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(every_s)


class ChaosLoop:
    """`tradeloop up` on a tiny CPU config against a Redis this object owns (killable, restartable)."""

    def __init__(self, workdir: Path, *, epochs: int = 10, run_id: str = "chaos", iterations: int = 12,
                 data_bars: int = 1000, feedback_timeout_s: float = 8.0):
        self.workdir = Path(workdir)
        self.epochs, self.run_id, self.iterations = epochs, run_id, iterations
        self.data_bars, self.feedback_timeout_s = data_bars, feedback_timeout_s
        self.server = EmbeddedRedis(self.workdir / "redis")
        self.ports = {k: free_port() for k in (*SERVICES, "dashboard")}
        self.run_dir = self.workdir / "runs" / run_id
        self.proc: subprocess.Popen | None = None
        self.http = httpx.Client(timeout=2.0)
        self._r: redis.Redis | None = None
        self.faults: list[Fault] = []
        self.t0 = 0.0

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> "ChaosLoop":
        """Start Redis and `tradeloop up` (REDIS_URL: ours); returns when the command is launched."""
        self.server.start()
        env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "TL_REDIS_URL")}
        env.update(TINY_ENV)
        env.update({f"TL_{k.upper()}_PORT": str(v) for k, v in self.ports.items()})
        env["REDIS_URL"] = self.server.url
        env["TL_KEEP_CHECKPOINTS"] = str(self.epochs)   # every epoch's weights stay on disk, to check against Redis
        cmd = [sys.executable, "-m", "tradeloop.cli", "up", "--epochs", str(self.epochs), "--dataset", "synthetic",
               "--device", "cpu", "--data-bars", str(self.data_bars), "--iterations", str(self.iterations),
               "--no-dashboard", "--no-live", "--run-dir", str(self.workdir / "runs"), "--run-id", self.run_id,
               "--feedback-timeout", str(self.feedback_timeout_s), "--timeout", "900"]
        self.log = open(self.workdir / "up.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.t0 = time.monotonic()
        return self

    def close(self) -> None:
        """Stop everything this object started (by pid), whatever state it is in."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for svc in SERVICES:  # children that outlived the launcher (they also die with it: PDEATHSIG)
            pid = getattr(self, f"_last_pid_{svc}", None)
            if pid:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
        self.http.close()
        if self._r is not None:
            self._r.close()
        self.server.stop()
        self.log.close()

    def wait_done(self, timeout_s: float = 300.0) -> int:
        """Wait for `tradeloop up` to exit (it exits once epoch N's checkpoint, report and bundle exist)."""
        wait_for(lambda: self.proc.poll() is not None, "tradeloop up to finish", timeout_s, every_s=0.2)
        return self.proc.returncode

    # -- reading state ------------------------------------------------------------------------------------------
    @property
    def r(self) -> redis.Redis:
        if self._r is None:
            self._r = redis.Redis.from_url(self.server.url, socket_timeout=3, socket_connect_timeout=1,
                                           decode_responses=True)
        return self._r

    def rq(self, fn: Callable[[redis.Redis], Any], default: Any = None) -> Any:
        """A Redis read that returns `default` while Redis is down."""
        try:
            return fn(self.r)
        except redis.RedisError:
            return default

    def status(self, svc: str) -> dict | None:
        """GET /status of a service (None while it is down)."""
        try:
            resp = self.http.get(f"http://127.0.0.1:{self.ports[svc]}/status")
            return resp.json() if resp.status_code == 200 else None
        except httpx.HTTPError:
            return None

    def pid(self, svc: str) -> int:
        """PID of the service process now serving (from its /status)."""
        pid = wait_for(lambda: (self.status(svc) or {}).get("pid"), f"{svc} /status", 120)
        setattr(self, f"_last_pid_{svc}", pid)
        return pid

    def epochs_of(self, kind: str) -> set[int]:
        """Epochs with a stored report / bundle (kind 'report'|'bundle'), or stored checkpoint ('ckpt')."""
        return {int(x) for x in self.rq(lambda r: r.zrange(run_key(self.run_id, kind, "index"), 0, -1), [])}

    def history(self) -> dict[int, dict]:
        """The trainer's epoch records in Redis."""
        raw = self.rq(lambda r: r.hgetall(trainer_history_key(self.run_id)), {})
        return {int(k): json.loads(v) for k, v in raw.items()}

    def stream(self, kind: str) -> list[tuple[str, dict]]:
        """Entries of `tl:{run}:stream:{kind}` with their JSON decoded where possible."""
        out = []
        for i, f in self.rq(lambda r: r.xrange(f"tl:{self.run_id}:stream:{kind}"), []):
            try:
                out.append((i, json.loads(f.get("data", ""))))
            except (json.JSONDecodeError, TypeError):
                out.append((i, {}))
        return out

    def evaluating_epoch(self) -> int | None:
        """Epoch of a checkpoint the evaluator holds (pending in its group) with no report stored yet."""
        stream = f"tl:{self.run_id}:stream:checkpoints"
        try:
            rows = self.r.xpending_range(stream, "evaluator", min="-", max="+", count=10)
            for row in rows:
                mid = row["message_id"]
                (entry,) = self.r.xrange(stream, min=mid, max=mid) or [(None, {})]
                ep = json.loads(entry[1]["data"]).get("epoch")
                if isinstance(ep, int) and ep <= self.epochs and not self.r.exists(run_key(self.run_id, "report", ep)):
                    return ep
        except (redis.RedisError, ValueError, KeyError, TypeError):
            return None
        return None

    # -- faults -------------------------------------------------------------------------------------------------
    def inject_poison(self) -> Fault:
        """Malformed entries on both consumed streams + one valid event whose handler must fail."""
        from shared.events import CheckpointPublished

        ck, rp = f"tl:{self.run_id}:stream:checkpoints", f"tl:{self.run_id}:stream:reports"
        good = CheckpointPublished(run_id=self.run_id, epoch=9000, checkpoint_id="forged", sha256="0" * 64,
                                   key=run_key(self.run_id, "ckpt", 9000), size_bytes=1, config_hash="x")
        doc = json.loads(good.model_dump_json())
        entries = [
            (ck, "not json", {"data": "{{{ this is not json"}),
            (ck, "truncated", {"data": good.model_dump_json()[:60]}),
            (ck, "wrong version", {"data": json.dumps({**doc, "schema_version": 99})}),
            (ck, "oversized", {"data": json.dumps({**doc, "checkpoint_id": "x" * 70_000})}),
            (rp, "bad schema", {"data": json.dumps({"type": "eval.completed", "schema_version": 1,
                                                    "run_id": self.run_id, "epoch": "two"})}),
            (ck, "handler fails", {"data": good.model_dump_json()}),
        ]
        f = Fault("poison messages", injected_at=time.monotonic(), detail={"injected": len(entries)})
        ids = {(stream, self.r.xadd(stream, fields)): what for stream, what, fields in entries}
        self.faults.append(f)

        def all_dead():
            dead = {(d.get("original_stream"), d.get("entry_id")): d for _, d in self.stream("dead")}
            return {ids[i]: dead[i]["reason"] for i in ids} if set(ids) <= set(dead) else None
        f.detail["reasons"] = wait_for(all_dead, "every poison entry dead-lettered", 60)
        f.recovered_at = time.monotonic()
        return f

    def kill_evaluator_mid_backtest(self, after_epoch: int = 0) -> Fault:
        """SIGKILL the evaluator while it evaluates a checkpoint of an epoch > after_epoch."""
        pid = self.pid("evaluator")
        ep = wait_for(lambda: (e := self.evaluating_epoch()) and e > after_epoch and e, "an evaluation in progress", 120,
                      every_s=0.02)
        os.kill(pid, signal.SIGKILL)
        f = Fault("evaluator kill -9 mid-backtest", ep, time.monotonic(), detail={"pid": pid})
        self.faults.append(f)
        wait_for(lambda: self.status("evaluator") is None or self.status("evaluator")["pid"] != pid, "evaluator down", 10)
        wait_for(lambda: ep in self.epochs_of("report"), f"report {ep} after the kill", 120)
        f.recovered_at = time.monotonic()
        f.detail["new_pid"] = self.pid("evaluator")
        return f

    def _trainer_training(self, after_epoch: int) -> int | None:
        st = self.status("trainer") or {}
        e = st.get("training_epoch")
        return e if st.get("phase") == "training" and isinstance(e, int) and e > after_epoch else None

    def kill_trainer_mid_epoch(self, after_epoch: int = 0, *, partial_write: bool = False) -> Fault:
        """SIGKILL the trainer mid-epoch; with `partial_write`, lay down what a kill inside save_epoch leaves."""
        pid = self.pid("trainer")
        ep = wait_for(lambda: self._trainer_training(after_epoch), "the trainer training an epoch", 120, every_s=0.02)
        name = "trainer kill -9 mid-checkpoint-write" if partial_write else "trainer kill -9 mid-epoch"
        if partial_write:
            os.kill(self.proc.pid, signal.SIGSTOP)  # the supervisor must not restart it before the files are laid
        try:
            os.kill(pid, signal.SIGKILL)
            f = Fault(name, ep, time.monotonic(), detail={"pid": pid})
            if partial_write:
                f.detail["planted_sha256"] = self._plant_partial_checkpoint(ep)
        finally:
            if partial_write:
                os.kill(self.proc.pid, signal.SIGCONT)
        self.faults.append(f)
        wait_for(lambda: ep in self.history(), f"epoch {ep} published after the kill", 180)
        f.recovered_at = time.monotonic()
        f.detail["published_sha256"] = self.history()[ep]["sha256"]
        return f

    def _plant_partial_checkpoint(self, epoch: int) -> str:
        """Files of a trainer killed inside save_epoch(epoch): weights + sidecar renamed in place, trainer state
        renamed in place without its sidecar, and a cut temp file. Returns the planted weights' sha256."""
        import hashlib

        ck = self.run_dir / TRAINER_DIR / "checkpoints"
        prev_w, prev_s = ck / f"epoch-{epoch - 1:04d}.safetensors", ck / f"epoch-{epoch - 1:04d}.state.safetensors"
        wait_for(lambda: prev_w.exists() and prev_s.exists(), f"epoch {epoch - 1} files", 10)
        w, s = ck / f"epoch-{epoch:04d}.safetensors", ck / f"epoch-{epoch:04d}.state.safetensors"
        data = prev_w.read_bytes()
        w.write_bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        (ck / f"{w.name}.sha256").write_text(f"{sha}  {w.name}\n")
        shutil.copyfile(prev_s, s)  # complete bytes, but the kill came before its sidecar was written
        (ck / f".{s.name}.k1ll3d.tmp").write_bytes(prev_s.read_bytes()[:1000])
        return sha

    def kill_redis(self, down_s: float = 1.5) -> Fault:
        """SIGKILL Redis, restart it on its AOF after `down_s`, destroy both consumer groups; check nothing acked
        was lost; recovered when a new record is stored."""
        before = {"report": self.epochs_of("report"), "bundle": self.epochs_of("bundle"),
                  "ckpt": self.epochs_of("ckpt"), "history": set(self.history()),
                  **{f"stream:{k}": len(self.stream(k)) for k in ("checkpoints", "reports", "feedback")}}
        marks = len(before["report"]) + len(before["bundle"]) + len(before["history"])
        self.server.kill()
        f = Fault("redis kill -9 + AOF restart", max(before["history"] or {0}), time.monotonic())
        self.faults.append(f)
        deadline = time.monotonic() + down_s  # the outage itself lasts down_s (a fault, not a wait)
        while time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.start()
        if self._r is not None:
            self._r.close()
            self._r = None
        destroyed = [self.r.xgroup_destroy(f"tl:{self.run_id}:stream:{s}", g)
                     for s, g in (("checkpoints", "evaluator"), ("reports", "feedback"))]
        after = {"report": self.epochs_of("report"), "bundle": self.epochs_of("bundle"),
                 "ckpt": self.epochs_of("ckpt"), "history": set(self.history()),
                 **{f"stream:{k}": len(self.stream(k)) for k in ("checkpoints", "reports", "feedback")}}
        lost = {k: sorted(before[k] - after[k]) for k in ("report", "bundle", "ckpt", "history")}
        # the store keeps the last K checkpoints: one published between the two snapshots (the trainer goes on as
        # soon as Redis is back) trims the oldest, which is not a loss; an epoch is lost only if fewer than K newer
        # ones are stored (it would still be kept)
        keep = CommonSettings().keep_checkpoints
        lost["ckpt"] = [e for e in lost["ckpt"] if sum(a > e for a in after["ckpt"]) < keep]
        lost.update({k: before[k] - after[k] for k in before if k.startswith("stream:") and before[k] > after[k]})
        f.detail.update(acked_before=marks, lost_after_restart={k: v for k, v in lost.items() if v},
                        groups_destroyed=sum(map(int, destroyed)))

        def progressed():
            n = len(self.epochs_of("report")) + len(self.epochs_of("bundle")) + len(self.history())
            return n > marks
        def groups():
            return sorted(g["name"] for s in ("checkpoints", "reports")
                          for g in self.rq(lambda r, s=s: r.xinfo_groups(f"tl:{self.run_id}:stream:{s}"), []))
        wait_for(lambda: progressed() and len(groups()) == 2, "groups recreated and a new record stored", 180)
        f.detail["groups_after"] = groups()
        f.recovered_at = time.monotonic()
        return f

    def stop_feedback(self) -> Fault:
        """SIGSTOP feedback until the trainer timed out and trained an epoch on the last bundle; SIGCONT."""
        pid = self.pid("feedback")
        hist0 = self.history()
        os.kill(pid, signal.SIGSTOP)
        f = Fault("feedback SIGSTOP past the trainer's timeout", max(hist0 or {0}) + 1, time.monotonic(),
                  detail={"pid": pid, "timeout_s": self.feedback_timeout_s})
        self.faults.append(f)
        try:
            timed = wait_for(lambda: [e for e, h in self.history().items() if e not in hist0
                                      and h.get("feedback_timed_out")], "a trainer feedback timeout", 180, every_s=0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        f.detail["stopped_s"] = round(time.monotonic() - f.injected_at, 2)
        f.detail["timed_out_epochs"] = sorted(timed)
        wait_for(lambda: self.epochs_of("bundle") >= self.epochs_of("report") and len(self.epochs_of("report"))
                 >= max(timed) - 1, "feedback to catch up", 120, every_s=0.1)
        f.recovered_at = time.monotonic()
        return f

    # -- verdict ------------------------------------------------------------------------------------------------
    def tally(self) -> dict[str, Any]:
        """Completed / lost / duplicated epochs and dead letters, from Redis and the run directory."""
        n = self.epochs
        counts: dict[str, dict[int, int]] = {}
        for kind in ("checkpoints", "reports", "feedback"):
            c: dict[int, int] = {}
            for _, d in self.stream(kind):
                if isinstance(d.get("epoch"), int) and d.get("type") in ("checkpoint.published", "eval.completed",
                                                                          "feedback.ready") and d["epoch"] <= n:
                    c[d["epoch"]] = c.get(d["epoch"], 0) + 1
            counts[kind] = c
        evals = {int(k): int(v) for k, v in self.rq(lambda r: r.hgetall(run_key(self.run_id, "evaluations")), {}).items()}
        jsonl: dict[int, int] = {}
        hist_file = self.run_dir / TRAINER_DIR / "history.jsonl"
        for line in (hist_file.read_text().splitlines() if hist_file.exists() else []):
            try:
                e = json.loads(line)["epoch"]
            except (json.JSONDecodeError, KeyError):
                continue
            jsonl[e] = jsonl.get(e, 0) + 1
        reports, bundles, hist = self.epochs_of("report"), self.epochs_of("bundle"), self.history()
        complete = [e for e in range(1, n + 1) if e in hist and e in reports and e in bundles
                    and all(counts[k].get(e, 0) >= 1 for k in counts)]
        dup_epochs = sorted({e for c in (*counts.values(), evals, jsonl) for e, k in c.items() if k > 1})
        dead = [d for _, d in self.stream("dead")]
        return {"epochs_completed": len(complete), "lost": n - len(complete), "duplicated": len(dup_epochs),
                "duplicated_epochs": dup_epochs, "event_counts": counts, "evaluations": evals,
                "history_jsonl": jsonl, "dead_letters": len(dead), "history": hist}


def run_all(workdir: Path, *, epochs: int = 10, iterations: int = 12, feedback_timeout_s: float = 8.0,
            redis_down_s: float = 1.5, log: Callable[[str], None] = print) -> tuple[ChaosLoop, dict]:
    """Start a loop, inject every fault in turn, wait for it to finish; returns (loop, tally). Caller closes."""
    loop = ChaosLoop(workdir, epochs=epochs, iterations=iterations, feedback_timeout_s=feedback_timeout_s).start()
    try:
        wait_for(lambda: 1 in loop.epochs_of("bundle"), "the first bundle", 180, every_s=0.1)
        log(f"[{time.monotonic() - loop.t0:6.1f}s] loop warm (epoch 1 closed)")
        steps: list[Callable[[], Fault]] = [loop.inject_poison]
        last = [1]

        def ev():
            f = loop.kill_evaluator_mid_backtest(after_epoch=last[0])
            last[0] = f.epoch
            return f
        steps += [ev, ev, ev]
        steps.append(lambda: loop.kill_trainer_mid_epoch(after_epoch=max(loop.history())))
        steps.append(lambda: loop.kill_redis(redis_down_s))
        steps.append(lambda: loop.kill_trainer_mid_epoch(after_epoch=max(loop.history()), partial_write=True))
        steps.append(loop.stop_feedback)
        for step in steps:
            f = step()
            log(f"[{time.monotonic() - loop.t0:6.1f}s] {f.name} (epoch {f.epoch}): recovered in {f.recover_s:.2f}s "
                f"{json.dumps({k: v for k, v in f.detail.items() if k != 'reasons'})}")
        code = loop.wait_done(300)
        t = loop.tally()
        t["up_exit_code"], t["wall_s"] = code, round(time.monotonic() - loop.t0, 1)
        return loop, t
    except BaseException:
        loop.close()
        raise


def table(loop: ChaosLoop, t: dict) -> str:
    """The markdown table of faults and the run's verdict."""
    rows = ["| fault | injected | epochs hit | seconds to recover (max) |", "|---|---:|---|---:|"]
    by: dict[str, list[Fault]] = {}
    for f in loop.faults:
        by.setdefault(f.name, []).append(f)
    for name, fs in by.items():
        rec = [f.recover_s for f in fs if f.recover_s is not None]
        rows.append(f"| {name} | {len(fs)} | {', '.join(str(f.epoch) for f in fs)} | "
                    f"{max(rec):.2f} |" if rec else f"| {name} | {len(fs)} | - | - |")
    rows += ["", "| epochs requested | completed | lost | duplicated | dead letters | faults injected | wall s |",
             "|---:|---:|---:|---:|---:|---:|---:|",
             f"| {loop.epochs} | {t['epochs_completed']} | {t['lost']} | {t['duplicated']} | {t['dead_letters']} | "
             f"{len(loop.faults)} | {t['wall_s']} |"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--iterations", type=int, default=12, help="trainer iterations per epoch")
    ap.add_argument("--feedback-timeout", type=float, default=8.0, help="trainer's wait for a bundle (s)")
    ap.add_argument("--redis-down", type=float, default=1.5, help="seconds Redis stays down")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run here (default: a temp dir, removed)")
    a = ap.parse_args(argv)
    if a.epochs < 9:
        ap.error("--epochs must be >= 9 (one warm epoch + the faults need the epochs after it)")
    work = a.keep or Path(tempfile.mkdtemp(prefix="tl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    loop, t = run_all(work, epochs=a.epochs, iterations=a.iterations, feedback_timeout_s=a.feedback_timeout,
                      redis_down_s=a.redis_down)
    try:
        print()
        print(table(loop, t))
        print(f"\nup exit code {t['up_exit_code']}; run dir {loop.run_dir}")
    finally:
        loop.close()
        if a.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if t["lost"] == 0 and t["duplicated"] == 0 and t["up_exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
