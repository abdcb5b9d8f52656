"""`docker compose up`, for real: the image built and the stack run by a Docker engine.

1. `docker compose up --build --scale evaluator=2` of docker-compose.yml with a tiny run (4 epochs on 60 000 bars of
   `synthetic`, a few iterations each), every setting passed through compose from an env file of its own; a Redis
   password with characters a URL reserves; every published port 0, so the engine picks free ones (nothing on the
   host can collide). compose starts the trainer once Redis and both consumers pass their healthchecks.
2. Mid-run, the evaluator replica holding a checkpoint (its /status says `evaluating`) is stopped with SIGSTOP (not
   `docker pause`: the cgroup freezer fails on some hosts), the entry checked pending on it in Redis, and the
   container `docker kill`ed; the other replica claims the entry after
   TL_CLAIM_IDLE_MS.
3. Every container reaches `healthy`; every service's /status and the dashboard (the page, /config.json and its
   proxy /api/<service>/..., compared with the services' own answers) are read through the published ports.
4. The run ends with one checkpoint (a file on the volume and in Redis), one report and one bundle per epoch;
   each checkpoint evaluated once (the killed replica's by the other), one event per epoch on each stream,
   nothing dead-lettered or pending; bundle e applied in epoch e + 1. The run's reports and bundles, written by
   both replicas and feedback, are files of one run directory on the named volume, which the dashboard's run
   browser lists; no container has an anonymous volume.
5. The image's trainer on a checkpoints directory its user cannot write exits 2 naming TL_RUN_DIR and the fix; with
   TL_DEVICE=cuda on the CPU image it exits 2 naming TL_DEVICE. `docker compose down -v` leaves no container and no
   volume.
`docker compose config` (no GPU, no daemon needed) checks the GPU and data overrides, that .env.example as it is
(its secrets empty) is refused naming them, and that DASHBOARD_ADDRESS publishes the dashboard alone.

Images: BASE_IMAGE, REDIS_IMAGE and TORCH_WHEEL from the environment when set (`scripts/docker-ci.sh start`
prints them; .ci/run exports them), else the Dockerfile's and the compose file's official images. Skipped where no
Docker daemon answers (a laptop without Docker) — under CI=true that is a failure.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from polling import poll_until

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 4
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# what the compose processes see of this environment: the engine's address and the images; nothing else, so a
# developer's TL_* variables or .env cannot change the run
PASSED = ("PATH", "HOME", "DOCKER_HOST", "DOCKER_CONFIG", "DOCKER_CONTEXT", "DOCKER_CERT_PATH", "DOCKER_TLS_VERIFY",
          "BASE_IMAGE", "REDIS_IMAGE", "TORCH_WHEEL")
BUS_TRANSIENT = ("TimeoutError: Timeout reading from redis", "ConnectionError")
"""The bus errors a service survives by reconnecting (`shared.bus`), the only `last_error` a passing run may show."""
SETTINGS = {
    "REDIS_PASSWORD": "e2e/pa@ss+w0rd=",   # / @ + = : would break a redis:// URL; compose passes it beside the URL
    "TL_API_TOKEN": "e2e-" + secrets.token_hex(8),
    "TL_RUN_ID": "e2e", "TL_EPOCHS": str(EPOCHS), "TL_DATA": "synthetic", "TL_DATA_SEED": "0",
    # a tiny run: few iterations per epoch, on enough bars (60 000: validation and test windows of ~9 000) that an
    # evaluation lasts long enough (~0.5–2 s) for the replica holding it to be caught and stopped mid-way (on 1 000
    # bars it lasts 0.07–0.2 s, often over before the SIGSTOP lands)
    "TL_DATA_BARS": "60000", "TL_TRAIN_ITERATIONS": "6", "TL_TRAIN_LEARNING_STARTS": "32",
    "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4", "TL_FEEDBACK_TIMEOUT_S": "300",
    # a dead replica's checkpoint is claimed by the other after 15 s (longer than any evaluation of this run)
    "TL_CLAIM_IDLE_MS": "15000",
    "DASHBOARD_ADDRESS": "127.0.0.1", "SERVICES_ADDRESS": "127.0.0.1",
    "TRAINER_PORT": "0", "EVALUATOR_PORTS": "0", "FEEDBACK_PORT": "0",
    "DASHBOARD_PORT": "0",
}

# Run inside the trainer container (its image, its TL_REDIS_* and its volume): what Redis and the volume hold.
PROBE = r'''
import json, os, re
from pathlib import Path
import redis
from shared.events import stream_name
from shared.store import run_key
run = os.environ["TL_RUN_ID"]
r = redis.Redis.from_url(os.environ["TL_REDIS_URL"], password=os.environ["TL_REDIS_PASSWORD"], decode_responses=True)
try:
    consumers = {c["name"]: c["pending"] for c in r.xinfo_consumers(stream_name(run, "checkpoints"), "evaluator")}
    group = next(g for g in r.xinfo_groups(stream_name(run, "checkpoints")) if g["name"] == "evaluator")["pending"]
except (redis.ResponseError, StopIteration):
    consumers, group = {}, None
ck = Path(os.environ["TL_RUN_DIR"], run, "trainer", "checkpoints")
run_dir = Path(os.environ["TL_RUN_DIR"], run)
print(json.dumps({
    "run_files": {k: sorted(p.name for p in (run_dir / k).glob("epoch-*.json")) for k in ("reports", "bundles")},
    "index": {k: sorted(int(x) for x in r.zrange(run_key(run, k, "index"), 0, -1)) for k in ("ckpt", "report", "bundle")},
    "evaluations": r.hgetall(run_key(run, "evaluations")), "evaluated_by": r.hgetall(run_key(run, "evaluated_by")),
    "streams": {s: [json.loads(f["data"])["epoch"] for _, f in r.xrange(stream_name(run, s))]
                for s in ("checkpoints", "reports", "feedback")},
    "dead": r.xlen(stream_name(run, "dead")), "consumers": consumers, "group_pending": group,
    "files": sorted(p.name for p in ck.glob("*") if re.fullmatch(r"epoch-\d{4}\.safetensors", p.name)),
}))
'''


def _why_no_docker(need_daemon: bool) -> str | None:
    """None when the docker CLI with its compose plugin (and, if asked, a daemon) answers; else why not."""
    if shutil.which("docker") is None:
        return "no docker command"
    if subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60).returncode != 0:
        return "the docker compose plugin is missing"
    if need_daemon:
        r = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
                           timeout=60)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["docker version failed"])[-1]
            return f"no Docker daemon answers ({last})"
    return None


def require_docker(need_daemon: bool = True) -> None:
    """Skip (or, under CI=true, fail) naming what is missing."""
    why = _why_no_docker(need_daemon)
    if why:
        if IN_CI:
            pytest.fail(f"CI=true and {why}: .ci/run sets Docker up with scripts/docker-ci.sh start")
        pytest.skip(f"{why}: `scripts/docker-ci.sh start` sets one up (CI runs it)")


def docker(*args: str, timeout: float = 60) -> str:
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"docker {' '.join(args)} exited {r.returncode}: {r.stderr.strip()}"
    return r.stdout


class Stack:
    """One compose project of docker-compose.yml under a unique name, configured by SETTINGS only."""

    def __init__(self, tmp_path: Path):
        self.project = f"tle2e{uuid.uuid4().hex[:8]}"
        self.env_file = tmp_path / "compose.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in SETTINGS.items()))
        self.env = {k: os.environ[k] for k in PASSED if k in os.environ}

    def compose(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        cmd = ["docker", "compose", "--project-name", self.project, "--project-directory", str(ROOT),
               "--env-file", str(self.env_file), "-f", str(ROOT / "docker-compose.yml"), *args]
        r = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            pytest.fail(f"docker compose {' '.join(args)} exited {r.returncode}:\n{r.stdout[-3000:]}\n"
                        f"{r.stderr[-6000:]}\n{self.logs()}")
        return r

    def logs(self) -> str:
        r = self.compose("logs", "--no-color", "--tail", "60", timeout=60, check=False)
        return "--- compose logs ---\n" + r.stdout[-12000:]

    def containers(self) -> list[dict]:
        """`docker compose ps --all` as dicts (Name, Service, State, Health, Publishers, ...)."""
        out = self.compose("ps", "--all", "--format", "json").stdout.strip()
        if not out:
            return []
        return json.loads(out) if out.startswith("[") else [json.loads(line) for line in out.splitlines()]

    def probe(self) -> dict:
        """What Redis and the checkpoints volume hold (PROBE, run in the trainer container)."""
        return json.loads(self.compose("exec", "-T", "trainer", "python", "-c", PROBE, timeout=60).stdout)


def published(container: dict, port: int) -> str:
    """http://127.0.0.1:<host port> of a container port (the engine chose the host port)."""
    ports = [p["PublishedPort"] for p in container.get("Publishers") or []
             if p["TargetPort"] == port and p["PublishedPort"]]
    assert ports, f"{container['Name']}: container port {port} is not published: {container.get('Publishers')}"
    return f"http://127.0.0.1:{ports[0]}"


def get_json(client: httpx.Client, url: str):
    r = client.get(url, timeout=5)
    assert r.status_code == 200, f"GET {url}: {r.status_code} {r.text[:300]}"
    return r.json()


def get_or_none(client: httpx.Client, url: str):
    try:
        r = client.get(url, timeout=3)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def kill_an_evaluator_mid_evaluation(stack: Stack, client: httpx.Client, evaluators: dict[str, str],
                                     seen: dict, deadline_s: float) -> tuple[str, str, int, bool]:
    """Stop (SIGSTOP) the replica that reports `evaluating`, check the checkpoint is pending on it in Redis, `docker kill`
    it: (container, consumer, epoch, stored) where `stored` says the stopped replica had already written that
    epoch's evaluation (it was stopped between the write and the XACK). A replica that finished before the stop
    is resumed (SIGCONT), and the next tried."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for name, url in evaluators.items():
            st = get_or_none(client, f"{url}/status")
            if st is None:
                continue
            seen[name] = st
            if st.get("evaluating"):
                docker("kill", "--signal", "SIGSTOP", name)
                held = stack.probe()
                if held["consumers"].get(st["consumer"], 0) > 0:
                    docker("kill", name)   # SIGKILL: the restart policy leaves a killed container down
                    epoch = int(st["evaluating"])
                    return name, st["consumer"], epoch, str(epoch) in held["evaluations"]
                docker("kill", "--signal", "SIGCONT", name)
        time.sleep(0.1)
    pytest.fail(f"no evaluator was seen holding a checkpoint in {deadline_s:.0f}s; last status: {seen}\n{stack.logs()}")


@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_compose_up_runs_the_loop_and_survives_a_killed_evaluator(tmp_path):
    require_docker()
    stack = Stack(tmp_path)
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        # build (cached layers after the first time) and start; compose holds the trainer until redis, both
        # evaluators and feedback are healthy
        stack.compose("up", "--build", "--detach", "--scale", "evaluator=2", timeout=1500)
        timings["up --build"] = time.monotonic() - t0
        by_service: dict[str, list[dict]] = {}
        for c in stack.containers():
            by_service.setdefault(c["Service"], []).append(c)
        assert {s: len(cs) for s, cs in by_service.items()} == {
            "redis": 1, "trainer": 1, "evaluator": 2, "feedback": 1, "dashboard": 1}, by_service
        assert "Publishers" not in by_service["redis"][0] or not any(
            p["PublishedPort"] for p in by_service["redis"][0]["Publishers"]), "Redis must not be published"
        trainer = published(by_service["trainer"][0], 8001)
        feedback = published(by_service["feedback"][0], 8003)
        dashboard = published(by_service["dashboard"][0], 8000)
        evaluators = {c["Name"]: published(c, 8002) for c in by_service["evaluator"]}
        assert len(set(evaluators.values())) == 2, f"the replicas share a host port: {evaluators}"

        with httpx.Client() as client:
            seen: dict[str, dict] = {}
            killed, killed_consumer, killed_epoch, stored_before_kill = kill_an_evaluator_mid_evaluation(
                stack, client, evaluators, seen, deadline_s=600)
            timings["evaluator killed"] = time.monotonic() - t0
            assert set(seen) == set(evaluators), f"every replica's /status read before the kill: {sorted(seen)}"
            survivor = next(n for n in evaluators if n != killed)
            survivor_consumer = seen[survivor]["consumer"]
            assert survivor_consumer != killed_consumer

            # the healthchecks: every container but the killed one reaches healthy
            def health() -> dict[str, str]:
                return {c["Name"]: c.get("Health") or c["State"] for c in stack.containers()}

            states = poll_until(lambda: (h := health()) and all(
                v == "healthy" for n, v in h.items() if n != killed) and h, "every container healthy",
                timeout_s=300, interval_s=1)
            assert states[killed] == "exited", f"the killed evaluator was restarted: {states}"

            # the run goes on without the killed replica: its checkpoint is claimed by the other one
            poll_until(lambda: stack.probe()["index"]["bundle"] == list(range(1, EPOCHS + 1)),
                       f"{EPOCHS} bundles stored", timeout_s=600, interval_s=2)
            status = poll_until(lambda: (s := get_json(client, f"{trainer}/status"))["phase"] == "done" and s,
                                "the trainer done", timeout_s=120, interval_s=1)
            timings["run done"] = time.monotonic() - t0
            trainer_log = stack.compose("logs", "--no-color", "trainer", timeout=60).stdout
            assert f"run {SETTINGS['TL_RUN_ID']} done: {EPOCHS} of TL_EPOCHS={EPOCHS} epochs trained" in trainer_log
            probe = stack.probe()

            # every service's /status through its published port
            ev_status = get_json(client, f"{evaluators[survivor]}/status")
            fb_status = get_json(client, f"{feedback}/status")
            for st, name in ((status, "trainer"), (ev_status, "evaluator"), (fb_status, "feedback")):
                assert st["service"] == name and st["run_id"] == SETTINGS["TL_RUN_ID"] and st["ready"], st
                # no error but a read of the bus that Redis did not answer within the socket timeout (a loaded CI
                # host): the bus survives those by reconnecting, and the checks below show that nothing was lost
                assert st["last_error"] is None or st["last_error"].startswith(BUS_TRANSIENT), st
            assert status["epoch"] == EPOCHS and status["counters"]["checkpoints_published"] == EPOCHS, status
            assert ev_status["consumer_stats"]["claimed"] >= 1, f"the survivor claimed nothing: {ev_status}"
            assert fb_status["epoch"] == EPOCHS, fb_status
            with pytest.raises(httpx.HTTPError):
                client.get(f"{evaluators[killed]}/status", timeout=3).raise_for_status()

            # nothing lost, nothing doubled
            epochs = list(range(1, EPOCHS + 1))
            assert probe["index"] == {"ckpt": epochs, "report": epochs, "bundle": epochs}, probe
            assert probe["files"] == [f"epoch-{e:04d}.safetensors" for e in epochs], probe["files"]
            assert probe["evaluations"] == {str(e): "1" for e in epochs}, probe["evaluations"]
            # the survivor claimed the killed replica's pending entry: it evaluated that epoch, or, when the killed
            # replica had written the evaluation before its XACK, found it stored and acknowledged it (still one)
            expected = killed_consumer if stored_before_kill else survivor_consumer
            assert probe["evaluated_by"][str(killed_epoch)] == expected, (killed_epoch, stored_before_kill, probe)
            assert set(probe["evaluated_by"].values()) <= {killed_consumer, survivor_consumer}, probe
            assert probe["streams"] == {"checkpoints": epochs, "reports": epochs, "feedback": epochs}, probe
            assert probe["dead"] == 0 and probe["group_pending"] == 0, probe
            assert probe["consumers"].get(killed_consumer) == 0, f"the killed replica's entry stayed pending: {probe}"

            # what the services say == what Redis holds; bundle e trained epoch e + 1
            reports = get_json(client, f"{evaluators[survivor]}/reports")
            signals = get_json(client, f"{feedback}/signals")
            history = get_json(client, f"{trainer}/api/history")
            assert [r["epoch"] for r in reports] == epochs, reports
            assert sorted(b["epoch"] for b in signals) == epochs, signals
            assert [h["epoch"] for h in history] == epochs
            assert [h.get("bundle_epoch") for h in history] == [None, *epochs[:-1]], history

            # the dashboard through its published port: the page, its config, and the services behind its proxy
            page = client.get(f"{dashboard}/", timeout=5)
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            config = get_json(client, f"{dashboard}/config.json")
            assert {k: config[k] for k in ("trainer", "evaluator", "feedback")} == {
                "trainer": "api/trainer", "evaluator": "api/evaluator", "feedback": "api/feedback"}, config
            assert get_json(client, f"{dashboard}/{config['evaluator']}/reports") == reports
            assert get_json(client, f"{dashboard}/{config['feedback']}/signals") == signals
            assert get_json(client, f"{dashboard}/{config['trainer']}/api/history") == history
            via = get_json(client, f"{dashboard}/{config['trainer']}/status")
            assert (via["service"], via["pid"], via["epoch"]) == ("trainer", status["pid"], EPOCHS), via
            # scaled: the name resolves to the live replica only (the killed one is gone from the network)
            for _ in range(4):
                assert get_json(client, f"{dashboard}/{config['evaluator']}/status")["consumer"] == survivor_consumer
            # a report (MBs) streamed through the proxy, byte for byte
            direct = client.get(f"{evaluators[survivor]}/reports/{EPOCHS}", timeout=30)
            proxied = client.get(f"{dashboard}/{config['evaluator']}/reports/{EPOCHS}", timeout=30)
            assert proxied.status_code == direct.status_code == 200 and proxied.content == direct.content
            # the run directory on the one named volume: every replica's reports and feedback's bundles in it, and
            # the dashboard's run browser lists the run and serves its documents from there
            files = [f"epoch-{e:04d}.json" for e in epochs]
            assert probe["run_files"] == {"reports": files, "bundles": files}, probe["run_files"]
            listed = get_json(client, f"{dashboard}/runs")
            assert listed["root"] == "runs" and SETTINGS["TL_RUN_ID"] in [r["id"] for r in listed["runs"]], listed
            on_disk = get_json(client, f"{dashboard}/runs/{SETTINGS['TL_RUN_ID']}/evaluator/reports")
            assert [r["epoch"] for r in on_disk] == epochs, on_disk
            assert client.get(f"{dashboard}/api/redis/info", timeout=5).status_code == 404
            assert client.post(f"{dashboard}/{config['trainer']}/control/stop", timeout=5).status_code == 405

        # the image's user and a checkpoints directory it cannot write (a root-owned host directory): the trainer
        # exits 2 at once naming TL_RUN_DIR, the user and the fix (not a traceback, not unhealthy forever)
        image = by_service["trainer"][0]["Image"]
        root_owned = tmp_path / "root-owned"
        root_owned.mkdir(mode=0o755)
        r = subprocess.run(["docker", "run", "--rm", "-v", f"{root_owned}:/data/runs", "-e", "TL_EMBEDDED=false",
                            "-e", "TL_HOST=0.0.0.0", "-e", f"TL_API_TOKEN={SETTINGS['TL_API_TOKEN']}",
                            "-e", "TL_REDIS_URL=redis://redis.invalid:6379/0", "-e", "TL_RUN_DIR=/data/runs",
                            image, "tradeloop", "serve", "trainer"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "TL_RUN_DIR=/data/runs: cannot write" in r.stderr, (r.returncode, r.stderr)
        assert "uid 10001" in r.stderr and "Traceback" not in r.stderr, r.stderr
        # TL_DEVICE=cuda on the CPU image (the GPU override left out): exit 2 naming TL_DEVICE, no traceback
        r = subprocess.run(["docker", "run", "--rm", "-e", "TL_EMBEDDED=false", "-e", "TL_HOST=0.0.0.0",
                            "-e", f"TL_API_TOKEN={SETTINGS['TL_API_TOKEN']}", "-e", "TL_DEVICE=cuda",
                            "-e", "TL_REDIS_URL=redis://redis.invalid:6379/0", "-e", "TL_RUN_DIR=/tmp/runs",
                            image, "tradeloop", "serve", "trainer"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "TL_DEVICE cuda but no CUDA device is available here" in r.stderr, (
            r.returncode, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr

        # no anonymous volume: every volume mounted is one of the compose file's named volumes
        named = {f"{stack.project}_{v}" for v in ("checkpoints", "compile-cache", "redis-data")}
        for cid in docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={stack.project}"
                          ).split():
            mounts = json.loads(docker("inspect", "--format", "{{json .Mounts}}", cid))
            assert all(m["Type"] != "volume" or m["Name"] in named for m in mounts), (cid, mounts)
    except BaseException:
        print(stack.logs())
        raise
    finally:
        t_down = time.monotonic()
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "5", timeout=300, check=False)
        timings["down -v"] = time.monotonic() - t_down
        left = docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={stack.project}")
        volumes = docker("volume", "ls", "--quiet", "--filter", f"label=com.docker.compose.project={stack.project}")
        print(f"compose e2e timings (s, from the start of the test): "
              f"{ {k: round(v, 1) for k, v in timings.items()} }")
    assert not left.strip() and not volumes.strip(), f"left behind: containers {left.split()}, volumes {volumes.split()}"


def _config(*files: str, env_file: str = ".env.example", **env_vars: str) -> subprocess.CompletedProcess:
    """`docker compose config --format json` of `files`, with .env.example and `env_vars` (shell variables take
    precedence over the env file, as for a user's shell)."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    env.update(env_vars)
    args = [a for f in files for a in ("-f", f)]
    return subprocess.run(["docker", "compose", "--env-file", env_file, *args, "config", "--format", "json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


SECRETS = {"REDIS_PASSWORD": "a-redis-secret", "TL_API_TOKEN": "an-api-secret"}


def test_env_example_as_it_is_is_refused():
    """`cp .env.example .env && docker compose up`: compose refuses before anything starts, naming the secret."""
    require_docker(need_daemon=False)
    r = _config("docker-compose.yml")
    assert r.returncode != 0 and re.search(r"(REDIS_PASSWORD|TL_API_TOKEN) in \.env", r.stderr), r.stderr
    for secret in SECRETS:
        r = _config("docker-compose.yml", **{k: v for k, v in SECRETS.items() if k != secret})
        assert r.returncode != 0 and f"set {secret} in .env" in r.stderr, (secret, r.stderr)
    assert _config("docker-compose.yml", **SECRETS).returncode == 0


def test_dashboard_address_opens_the_dashboard_alone():
    """DASHBOARD_ADDRESS=0.0.0.0 publishes the dashboard there; the trainer's control API, the evaluator and
    feedback stay on the host's loopback (SERVICES_ADDRESS)."""
    require_docker(need_daemon=False)
    r = _config("docker-compose.yml", DASHBOARD_ADDRESS="0.0.0.0", **SECRETS)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    host_ips = {name: {p.get("host_ip") for p in services[name]["ports"]}
                for name in ("dashboard", "trainer", "evaluator", "feedback")}
    assert host_ips == {"dashboard": {"0.0.0.0"}, "trainer": {"127.0.0.1"}, "evaluator": {"127.0.0.1"},
                        "feedback": {"127.0.0.1"}}, host_ips
    # every service that reads or writes run files mounts the one named volume; the trainer alone its compile cache
    for name in ("trainer", "evaluator", "feedback", "dashboard"):
        vols = [(v["type"], v["source"], v["target"]) for v in services[name]["volumes"]]
        want = [("volume", "checkpoints", "/data/runs")] + (
            [("volume", "compile-cache", "/data/compile-cache")] if name == "trainer" else [])
        assert vols == want, (name, vols)
    assert services["dashboard"]["volumes"][0].get("read_only") is True


def test_data_override_config():
    """docker-compose.data.yml mounts DATA_DIR read-only at /data/in in the trainer and the evaluator."""
    require_docker(need_daemon=False)
    r = _config("docker-compose.yml", "docker-compose.data.yml", **SECRETS)
    assert r.returncode != 0 and "DATA_DIR" in r.stderr, r.stderr
    r = _config("docker-compose.yml", "docker-compose.data.yml", DATA_DIR="/srv/bars", **SECRETS)
    assert r.returncode == 0, r.stderr
    services = json.loads(r.stdout)["services"]
    for name in ("trainer", "evaluator"):
        bars = [v for v in services[name]["volumes"] if v["target"] == "/data/in"]
        assert [(v["type"], v["source"], v.get("read_only")) for v in bars] == [("bind", "/srv/bars", True)], bars
    assert all(v["target"] != "/data/in" for v in services["feedback"]["volumes"])


def test_gpu_override_config():
    """The GPU override, merged by compose itself: the trainer reserves an NVIDIA GPU, trains on cuda, and gets its
    own image with a CUDA torch (never the CPU wheel); every other service is as in the base file."""
    require_docker(need_daemon=False)
    env = {"TORCH_WHEEL": "docker/wheels/torch-0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", **SECRETS}

    def config(*files: str) -> dict:
        r = _config(*files, **env)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    base = config("docker-compose.yml")["services"]
    gpu = config("docker-compose.yml", "docker-compose.gpu.yml")["services"]
    trainer = gpu["trainer"]
    device, = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and int(device["count"]) == 1 and device["capabilities"] == ["gpu"], device
    assert trainer["environment"]["TL_DEVICE"] == "cuda"
    assert trainer["image"] == "tradeloop:gpu" != base["trainer"]["image"]
    args = trainer["build"]["args"]
    assert re.fullmatch(r"https://download\.pytorch\.org/whl/cu\d+", args["TORCH_INDEX_URL"]), args
    assert args["TORCH_WHEEL"] == "" and base["trainer"]["build"]["args"]["TORCH_WHEEL"] == env["TORCH_WHEEL"], args
    assert args["BASE_IMAGE"] == base["trainer"]["build"]["args"]["BASE_IMAGE"]
    for name in ("redis", "evaluator", "feedback", "dashboard"):
        assert gpu[name] == base[name], name
    assert {k: v for k, v in trainer.items() if k not in ("deploy", "environment", "image", "build")} == {
        k: v for k, v in base["trainer"].items() if k not in ("deploy", "environment", "image", "build")}
