"""docker-compose.yml / docker-compose.gpu.yml / .env.example / Dockerfile against the code.

No Docker engine is needed: the compose files are parsed (a tiny parser for the YAML subset they are written
in; PyYAML is not a dependency) and checked against the entry points (`tradeloop serve <service>`) and the
settings models of shared/config.py: every TL_* variable is a real setting of that service, the values
validate, container ports and healthcheck URLs are the ports the settings make the service bind, the
dashboard's proxy reaches each service by its compose name and container port, and every ${VAR} (and every
variable passed through without a value) is documented in .env.example. The secrets of .env.example are empty
(compose refuses to start until they are set) and the services refuse a placeholder; only the dashboard's port
follows DASHBOARD_ADDRESS (the service APIs stay on loopback); every service reads and writes the run directory on
the one named volume, and the Dockerfile declares no VOLUME (no anonymous volume piles up); the trainer service
refuses TL_DEVICE=cuda where torch sees no CUDA device, and a restart of its run (compose keeps TL_RUN_ID and the
volume) given other values of the settings the run keeps. tests/test_compose_e2e.py runs the files on a Docker
engine.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shared import config as cfg

ROOT = Path(__file__).resolve().parents[1]
TL_SERVICES = ("trainer", "evaluator", "feedback", "dashboard")


def settings_class(service: str):
    """The settings model `tradeloop serve <service>` loads (the entry point's own choice)."""
    from tradeloop.cmd_serve import _factory

    cls, _ = _factory(service)
    assert issubclass(cls, cfg.CommonSettings)
    return cls


# --------------------------------------------------------------------------------------------- tiny YAML
def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _split_flow(s: str) -> list[str]:
    parts, cur, quote = [], "", None
    for ch in s:
        if quote:
            cur += ch
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote, cur = ch, cur + ch
        elif ch == ",":
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _scalar(s: str):
    s = s.strip()
    if s.startswith('"'):
        return json.loads(s)
    if s.startswith("'"):
        return s[1:-1].replace("''", "'")
    if s.startswith("["):
        assert s.endswith("]"), f"unterminated flow sequence {s!r}"
        return [_scalar(p) for p in _split_flow(s[1:-1])]
    return s if s else None


_KEY = re.compile(r"^([A-Za-z0-9_.\-]+):(?:\s+(.*))?$")


def parse_yaml(text: str):
    """Parse the YAML subset of our compose files: block mappings and sequences, quoted/plain/flow scalars.

    Every scalar stays a string (compose itself treats them so). No anchors, multi-line strings or tags:
    what it cannot read, it refuses with the line number.
    """
    lines = []
    for no, raw in enumerate(text.splitlines(), 1):
        body = _strip_comment(raw)
        if body.strip():
            if "\t" in raw[: len(raw) - len(raw.lstrip())]:
                raise ValueError(f"line {no}: tab in indentation")
            lines.append([len(body) - len(body.lstrip()), body.strip(), no])

    def block(i: int, ind: int):
        if lines[i][1].startswith("-"):
            out = []
            while i < len(lines) and lines[i][0] == ind and lines[i][1].startswith("-"):
                item = lines[i][1][1:].strip()
                if not item:
                    value, i = block(i + 1, lines[i + 1][0])
                elif _KEY.match(item) and not item.startswith(("\"", "'")):
                    lines[i] = [ind + 2, item, lines[i][2]]   # "- key: v" opens a mapping at ind + 2
                    value, i = block(i, ind + 2)
                else:
                    value, i = _scalar(item), i + 1
                out.append(value)
            return out, i
        out = {}
        while i < len(lines) and lines[i][0] == ind:
            m = _KEY.match(lines[i][1])
            if not m:
                raise ValueError(f"line {lines[i][2]}: cannot parse {lines[i][1]!r}")
            key, rest = m.group(1), m.group(2)
            if key in out:
                raise ValueError(f"line {lines[i][2]}: duplicate key {key!r}")
            if rest is None and i + 1 < len(lines) and lines[i + 1][0] > ind:
                out[key], i = block(i + 1, lines[i + 1][0])
            else:
                out[key], i = _scalar(rest or ""), i + 1
        if i < len(lines) and lines[i][0] > ind:
            raise ValueError(f"line {lines[i][2]}: unexpected indentation")
        return out, i

    if not lines:
        return {}
    value, i = block(0, lines[0][0])
    if i != len(lines):
        raise ValueError(f"line {lines[i][2]}: unexpected dedent")
    return value


def test_tiny_parser_hand_case():
    text = ('a:  # comment\n  b: "x # not a comment"\n  c:\n    - 1\n    - "two"\n  d: [e, "f g"]\n'
            'list:\n  - k: v\n    k2: v2\n  - plain\nempty:\n')
    assert parse_yaml(text) == {"a": {"b": "x # not a comment", "c": ["1", "two"], "d": ["e", "f g"]},
                                "list": [{"k": "v", "k2": "v2"}, "plain"], "empty": None}
    with pytest.raises(ValueError, match="line 2"):
        parse_yaml("a: 1\n  b: 2\n")


# --------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def compose() -> dict:
    return parse_yaml((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def gpu() -> dict:
    return parse_yaml((ROOT / "docker-compose.gpu.yml").read_text())


@pytest.fixture(scope="module")
def data_override() -> dict:
    return parse_yaml((ROOT / "docker-compose.data.yml").read_text())


SECRETS = {"REDIS_PASSWORD": "r3dis/pa@ss+w0rd=", "TL_API_TOKEN": "a-secret-token-of-the-user"}
"""What the user puts in .env for the two secrets .env.example leaves empty."""


@pytest.fixture(scope="module")
def compose_env(env_example) -> dict[str, str]:
    """.env.example with its secrets set, as a user's .env."""
    return {**env_example, **SECRETS}


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    out = {}
    for no, line in enumerate((ROOT / ".env.example").read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", key), f".env.example line {no}: not KEY=value: {line!r}"
            out[key] = value
    return out


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def substitute(value: str, env: dict[str, str]) -> str:
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} interpolation ($$ is a literal $)."""
    def one(m: re.Match) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env and (env[name] != "" or op not in (":-", ":?")):
            return env[name]
        if op in (":-", "-"):
            return arg
        raise AssertionError(f"${{{name}}} is required and unset: {arg}")
    return _VAR.sub(one, value).replace("$$", "$")


def service_env(svc: dict, env: dict[str, str], passed: dict[str, str] | None = None) -> dict[str, str]:
    """The container's environment: the valued entries interpolated from `env`; an entry without a value passes
    through from the caller's environment (`passed`) when set there, and is absent otherwise (as compose does)."""
    raw = svc.get("environment") or {}
    assert isinstance(raw, dict), "environment must be a mapping"
    out = {k: substitute(v, env) for k, v in raw.items() if v is not None}
    out.update({k: passed[k] for k, v in raw.items() if v is None and k in (passed or {})})
    return out


def passthrough(svc: dict) -> set[str]:
    """The environment entries listed without a value."""
    return {k for k, v in (svc.get("environment") or {}).items() if v is None}


def settings_from(monkeypatch, cls, environ: dict[str, str]):
    import os

    for k in list(os.environ):
        if k.startswith("TL_") or k == "REDIS_URL":
            monkeypatch.delenv(k)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    return cfg.load_settings(cls)


def env_names(cls) -> set[str]:
    return {cfg._env_name(cls, f) for f in cls.model_fields}


def port_of(mapping: str, env: dict[str, str]) -> tuple[str, int]:
    """'${PUBLISH_ADDRESS:-127.0.0.1}:${EVALUATOR_PORTS:-8002-8011}:8002' → ('8002-8011', 8002) with `env`'s
    values: (host port or range, container port)."""
    parts = substitute(mapping, env).split(":")
    return parts[-2], int(parts[-1])


# --------------------------------------------------------------------------------------------- tests
def test_services_and_entry_points(compose):
    from typer.testing import CliRunner

    from tradeloop.cli import app

    assert set(compose["services"]) == {"redis", *TL_SERVICES}
    help_text = CliRunner().invoke(app, ["serve", "--help"]).output
    for name in TL_SERVICES:
        svc = compose["services"][name]
        assert svc["command"] == ["tradeloop", "serve", name], name
        assert name in help_text, f"`tradeloop serve --help` does not offer {name!r}:\n{help_text}"
        build = svc["build"]
        assert build["context"] == "." and build["dockerfile"] == "Dockerfile", name
        assert svc["image"] == "tradeloop:latest", f"{name}: all services share one image"
        assert "container_name" not in svc, f"{name}: container_name prevents --scale"
    assert (ROOT / "Dockerfile").is_file()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^tradeloop\s*=\s*"tradeloop\.cli:main"', pyproject, re.M), "console script `tradeloop` missing"


@pytest.mark.parametrize("name", TL_SERVICES)
def test_environment_is_the_settings_model(compose, compose_env, monkeypatch, name):
    env_example = compose_env
    svc = compose["services"][name]
    cls = settings_class(name)
    env = service_env(svc, env_example)
    listed = set(svc.get("environment") or {})
    unknown = {k for k in listed if k.startswith("TL_")} - env_names(cls)
    assert not unknown, f"{name}: {sorted(unknown)} are not settings of {cls.__name__}"
    non_tl = {k for k in listed if not k.startswith("TL_")}
    assert not non_tl, f"{name}: variables outside the TL_ namespace: {sorted(non_tl)}"
    settings = settings_from(monkeypatch, cls, env)   # raises ConfigError naming a bad value
    assert settings.embedded is False and settings.host == "0.0.0.0"
    assert settings.api_token.get_secret_value() == env_example["TL_API_TOKEN"]
    assert "TL_DASHBOARD_ORIGIN" not in env, f"{name}: the page reaches the services through the dashboard (no CORS)"

    # the port the service binds == the container port compose publishes == the healthcheck's port, on /ready
    (host_ports, container_port), = [port_of(p, env_example) for p in svc["ports"]]
    address = "DASHBOARD_ADDRESS" if name == "dashboard" else "SERVICES_ADDRESS"
    assert svc["ports"][0].startswith(f"${{{address}:-127.0.0.1}}:"), f"{name}: published on {svc['ports'][0]}"
    assert settings.port == container_port, f"{name}: binds {settings.port}, compose publishes {container_port}"
    test = " ".join(svc["healthcheck"]["test"])
    assert f"http://127.0.0.1:{settings.port}/ready" in test, f"{name}: healthcheck {test!r}"
    if name != "dashboard":
        # the password beside the URL, taken as it is: any character of a secret works (none goes into a URL)
        assert settings.redis_url == "redis://redis:6379/0", f"{name}: {settings.redis_url}"
        assert settings.redis_password.get_secret_value() == env_example["REDIS_PASSWORD"]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
    # one run directory for the run: the named volume holds TL_RUN_DIR in every service (the dashboard reads it)
    assert str(settings.run_dir) == "/data/runs", f"{name}: TL_RUN_DIR {settings.run_dir}"
    mounts = ["checkpoints:/data/runs" + (":ro" if name == "dashboard" else "")]
    if name == "trainer":
        # torch.compile's cache is loaded with pickle: the trainer's alone, never on the volume other services write
        mounts.append("compile-cache:/data/compile-cache")
        assert env["TL_COMPILE_CACHE_DIR"] == "/data/compile-cache"
    assert svc.get("volumes") == mounts, f"{name}: volumes {svc.get('volumes')}, expected {mounts!r}"
    if name == "trainer":
        assert settings.device == "cpu"
        # as `tradeloop up` does: the trainer starts once the consumers are ready
        assert {k: v["condition"] for k, v in svc["depends_on"].items()} == {
            "redis": "service_healthy", "evaluator": "service_healthy", "feedback": "service_healthy"}
    # the size of a run passes through when set (a tiny CI run), else the presets apply
    size = dict.fromkeys(passthrough(svc), "1000")
    sized = settings_from(monkeypatch, cls, service_env(svc, env_example, passed=size))
    for k in size:
        field = next(f for f in cls.model_fields if cfg._env_name(cls, f) == k)
        assert getattr(sized, field) == int(size[k]), (name, k)


def test_evaluator_scales(compose, env_example):
    (host, container), = [port_of(p, env_example) for p in compose["services"]["evaluator"]["ports"]]
    lo, _, hi = host.partition("-")
    assert hi and int(hi) - int(lo) >= 3, f"evaluator host port {host!r}: a fixed port breaks --scale evaluator=N"


def test_secrets_are_required_and_placeholders_refused(compose, env_example, monkeypatch):
    """.env.example leaves both secrets empty, so `cp .env.example .env && docker compose up` stops at compose's
    ${VAR:?} guard naming the variable; a placeholder ("change-me…") that gets past compose is refused by every
    service's settings, naming the variable."""
    for secret in SECRETS:
        assert env_example[secret] == "", f".env.example must not give {secret} a usable value"
    for name in TL_SERVICES:
        with pytest.raises(AssertionError, match=r"TL_API_TOKEN\} is required"):
            service_env(compose["services"][name], env_example)
    with pytest.raises(AssertionError, match=r"REDIS_PASSWORD\} is required"):
        service_env(compose["services"]["redis"], env_example)
    for secret, var in (("TL_API_TOKEN", "TL_API_TOKEN"), ("REDIS_PASSWORD", "TL_REDIS_PASSWORD")):
        env = {**env_example, **SECRETS, secret: f"change-me-{secret.lower()}"}
        for name in TL_SERVICES:
            svc = compose["services"][name]
            if var == "TL_REDIS_PASSWORD" and name == "dashboard":
                continue    # the dashboard has no Redis
            with pytest.raises(cfg.ConfigError, match=f"{var} is a placeholder") as info:
                settings_from(monkeypatch, settings_class(name), service_env(svc, env))
            assert "change-me-" + secret.lower() not in str(info.value), "the message does not echo the secret"


def test_only_the_dashboard_follows_its_address(compose, compose_env):
    """DASHBOARD_ADDRESS=0.0.0.0 (a browser on another machine) publishes the dashboard there and leaves the
    trainer's control API, the evaluator and feedback on loopback; SERVICES_ADDRESS alone opens those."""
    def addresses(env: dict[str, str]) -> dict[str, str]:
        return {name: substitute(compose["services"][name]["ports"][0], env).split(":")[0] for name in TL_SERVICES}

    assert addresses(compose_env) == dict.fromkeys(TL_SERVICES, "127.0.0.1")
    remote = addresses({**compose_env, "DASHBOARD_ADDRESS": "0.0.0.0"})
    assert remote == {"dashboard": "0.0.0.0", "trainer": "127.0.0.1", "evaluator": "127.0.0.1",
                      "feedback": "127.0.0.1"}, remote
    assert addresses({**compose_env, "SERVICES_ADDRESS": "0.0.0.0"})["dashboard"] == "127.0.0.1"


def test_no_anonymous_volumes():
    """A VOLUME in the image gives each container without a mount there an anonymous volume, which `docker compose
    down` leaves behind; the run directory lives on the compose file's named volume instead."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert not re.search(r"^\s*VOLUME\b", dockerfile, re.M | re.I), "the Dockerfile declares a VOLUME"


def test_data_override_mounts_the_bars_into_trainer_and_evaluator(data_override, compose_env):
    """docker-compose.data.yml: DATA_DIR read-only at /data/in in both services that read TL_DATA, required."""
    assert set(data_override["services"]) == {"trainer", "evaluator"}
    for name, svc in data_override["services"].items():
        mount, = svc["volumes"]
        assert mount.startswith("${DATA_DIR:?") and mount.endswith("}:/data/in:ro"), (name, mount)
        assert substitute(mount, {**compose_env, "DATA_DIR": "/srv/bars"}) == "/srv/bars:/data/in:ro"
        with pytest.raises(AssertionError, match=r"DATA_DIR\} is required"):
            substitute(mount, compose_env)


def test_trainer_service_refuses_cuda_without_a_device(monkeypatch, tmp_path):
    """TL_DEVICE=cuda on the CPU image (the GPU override left out): `tradeloop serve trainer` exits 2 with one line
    naming TL_DEVICE, before any run file is written, instead of a torch traceback in a container never ready."""
    import torch
    from typer.testing import CliRunner

    from tradeloop.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = {"TL_DEVICE": "cuda", "TL_REDIS_URL": "redis://redis.invalid:6379/0", "TL_RUN_DIR": str(tmp_path),
           "TL_RUN_ID": "cuda1"}
    settings_from(monkeypatch, settings_class("trainer"), env)   # the settings themselves are valid
    result = CliRunner().invoke(app, ["serve", "trainer"])
    assert result.exit_code == 2, result.output
    assert "tradeloop serve trainer: TL_DEVICE cuda but no CUDA device is available here" in result.output
    assert "use TL_DEVICE=cpu" in result.output and "Traceback" not in result.output, result.output
    assert not any(tmp_path.iterdir()), "nothing written before the refusal"


def test_dashboard_proxies_to_the_compose_services(compose, compose_env, monkeypatch):
    """The page calls only the dashboard (relative paths); its proxy reaches each service by its compose name on
    the port that service binds, so any published port, or none, works for the page."""
    from services.dashboard.app import page_config

    settings = settings_from(monkeypatch, settings_class("dashboard"),
                             service_env(compose["services"]["dashboard"], compose_env))
    page = page_config(settings)
    for name in ("trainer", "evaluator", "feedback"):
        _, container_port = port_of(compose["services"][name]["ports"][0], compose_env)
        assert settings.upstream(name) == f"http://{name}:{container_port}", name
        assert page[name] == f"api/{name}", f"the page would poll {page[name]} for {name}"
    assert "depends_on" not in compose["services"]["dashboard"], "the page shows services down until they are up"


def test_redis_service(compose):
    redis = compose["services"]["redis"]
    image = re.fullmatch(r"\$\{REDIS_IMAGE:-([^}]+)\}", redis["image"]).group(1)   # the official image by default
    assert re.fullmatch(r"redis:(\d+)\.(\d+)\.(\d+)(-[a-z0-9.]+)?", image), f"redis image not pinned: {image}"
    major, minor = map(int, re.match(r"redis:(\d+)\.(\d+)", image).groups())
    assert (major, minor) >= (6, 2), "tradeloop needs Redis >= 6.2 (XAUTOCLAIM)"
    cmd = " ".join(redis["command"])
    assert "--appendonly yes" in cmd and "--requirepass" in cmd and "$$REDIS_PASSWORD" in cmd
    health = " ".join(redis["healthcheck"]["test"])
    assert "ping" in health.lower() and "REDISCLI_AUTH=" in health and " -a " not in health, "no password in argv"
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?"), "no default password"
    assert "ports" not in redis, "Redis is reachable only inside the compose network"
    assert {"checkpoints", "compile-cache", "redis-data"} <= set(compose["volumes"])
    assert "redis-data:/data" in redis["volumes"], "AOF must live on a volume"


def test_env_example_documents_every_variable(compose, env_example):
    text = "".join((ROOT / f).read_text() for f in ("docker-compose.yml", "docker-compose.gpu.yml",
                                                     "docker-compose.data.yml"))
    used = {m.group(1) for m in _VAR.finditer(text)}
    assert used == set(env_example), (f"in compose, not in .env.example: {sorted(used - set(env_example))}; "
                                      f"in .env.example, unused: {sorted(set(env_example) - used)}")
    passed = set().union(*(passthrough(svc) for svc in compose["services"].values()))
    documented = set(re.findall(r"^# (TL_[A-Z0-9_]+)=", (ROOT / ".env.example").read_text(), re.M))
    assert passed == documented, f"passed through: {sorted(passed)}; documented in .env.example: {sorted(documented)}"
    for secret in ("REDIS_PASSWORD", "TL_API_TOKEN"):
        assert f"${{{secret}:?" in text, f"{secret} must be required (no default) in docker-compose.yml"
        assert env_example[secret] == "", f"{secret}: .env.example leaves it to the user"


def test_gpu_override(gpu, compose_env, compose, monkeypatch):
    env_example = compose_env
    assert set(gpu["services"]) == {"trainer"}
    trainer = gpu["services"]["trainer"]
    device, = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    merged = {**service_env(compose["services"]["trainer"], env_example), **service_env(trainer, env_example)}
    assert settings_from(monkeypatch, settings_class("trainer"), merged).device == "cuda"
    assert trainer["build"]["args"]["TORCH_INDEX_URL"].startswith("${TORCH_CUDA_INDEX_URL")
    assert trainer["build"]["args"]["TORCH_WHEEL"] == "", "the GPU image never gets the CPU wheel"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL" in dockerfile and "ARG TORCH_WHEEL" in dockerfile


def test_services_agree_on_the_run(compose, compose_env, monkeypatch):
    """Trainer and evaluator must read the same data (same bars, same seed) of the same run on the same Redis."""
    env_example = compose_env
    loaded = {name: settings_from(monkeypatch, settings_class(name), service_env(compose["services"][name], env_example))
              for name in TL_SERVICES}
    assert len({s.run_id for s in loaded.values()}) == 1
    assert loaded["trainer"].redis_url == loaded["evaluator"].redis_url == loaded["feedback"].redis_url
    assert loaded["trainer"].redis_password == loaded["evaluator"].redis_password == loaded["feedback"].redis_password
    for field in ("data", "data_seed"):
        assert getattr(loaded["trainer"], field) == getattr(loaded["evaluator"], field), field
    for name in TL_SERVICES:
        for other in ("trainer", "evaluator", "feedback", "dashboard"):
            assert getattr(loaded[name], f"{other}_port") == loaded[other].port, (name, other)


def test_dashboard_app_serves_the_page_and_its_config(tmp_path):
    """The image's dashboard process: the page's files, /config.json, /ready naming a missing file."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from fastapi.testclient import TestClient

    from services.dashboard.app import PAGE_FILES, create_app

    settings = cfg.DashboardSettings(trainer_port=18001, evaluator_port=18002, feedback_port=18003, run_id="r1")
    client = TestClient(create_app(settings, poll_ms=750))
    assert client.get("/config.json").json() == {
        "trainer": "api/trainer", "evaluator": "api/evaluator", "feedback": "api/feedback", "poll_ms": 750,
        "run_id": "r1"}
    # embedded (`tradeloop up`): the proxy reaches the services on the ports the launcher gave them
    assert [settings.upstream(n) for n in ("trainer", "evaluator", "feedback")] == [
        "http://127.0.0.1:18001", "http://127.0.0.1:18002", "http://127.0.0.1:18003"]
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert not src.startswith(("http:", "https:", "//")), f"the page loads {src} from elsewhere (no CDN)"
        assert client.get("/" + src).status_code == 200, src
    assert client.get("/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/pyproject.toml").status_code == 404
    assert client.get("/ready").status_code == 200

    (tmp_path / "index.html").write_text("<html></html>")
    partial = TestClient(create_app(settings, static_dir=tmp_path))
    r = partial.get("/ready")
    assert r.status_code == 503 and any(m.endswith("charts.js") for m in r.json()["missing"])
    assert set(PAGE_FILES) == {"index.html", "app.js", "charts.js", "style.css", "vendor/uPlot.iife.min.js",
                               "vendor/uPlot.min.css"}


def test_trainer_service_refuses_changed_settings_of_its_run(monkeypatch, tmp_path):
    """compose keeps TL_RUN_ID and the volume: `up` again after editing .env restarts the same run. The run records
    the settings it keeps for good; a restart given another value of one exits 2 naming each variable with both
    values (as `tradeloop up --resume` refuses), and the same settings resume it."""
    from typer.testing import CliRunner

    from services.trainer.app import create_app
    from tradeloop.cli import app

    base = {"TL_REDIS_URL": "redis://redis.invalid:6379/0", "TL_RUN_DIR": str(tmp_path), "TL_RUN_ID": "same",
            "TL_DATA_BARS": "1000", "TL_TRAIN_ITERATIONS": "6", "TL_TRAIN_LEARNING_STARTS": "32",
            "TL_TRAIN_BATCH_SIZE": "32", "TL_TRAIN_N_ENVS": "4"}
    settings = settings_from(monkeypatch, settings_class("trainer"), base)
    create_app(settings).state.worker._build()      # the run as its first start opens it: run.json written
    recorded = json.loads((tmp_path / "same" / "trainer" / "run.json").read_text())["service_settings"]
    assert recorded["config"] == "small" and recorded["train_iterations"] == 6 and recorded["seed"] == 0, recorded

    create_app(settings_from(monkeypatch, settings_class("trainer"), base))     # the same settings: accepted
    settings_from(monkeypatch, settings_class("trainer"),
                  {**base, "TL_CONFIG": "full", "TL_SEED": "1", "TL_TRAIN_ITERATIONS": "12"})
    result = CliRunner().invoke(app, ["serve", "trainer"])
    assert result.exit_code == 2, result.output
    assert ("run same keeps TL_CONFIG=small, TL_SEED=0, TL_TRAIN_ITERATIONS=6 (it was started so; given "
            "TL_CONFIG=full, TL_SEED=1, TL_TRAIN_ITERATIONS=12); set them back, or set another TL_RUN_ID") in (
        result.output), result.output
    assert create_app(settings_from(monkeypatch, settings_class("trainer"),
                                    {**base, "TL_RUN_ID": "other", "TL_CONFIG": "full"}))   # a new run: any settings
