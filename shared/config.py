"""Settings of every service, read from `TL_*` environment variables (pydantic-settings).

Conventions:
- `CommonSettings` holds what every process needs (Redis, run id, token, ports of all services, data,
  run directory); each service has a subclass adding its own fields and a `port` property picking its
  port from the common ones (`TL_TRAINER_PORT`, `TL_EVALUATOR_PORT`, ...), so one environment can
  configure all processes of `tradeloop up` without clashes.
- Every field has a description: the README renders a table from `settings_table()`.
- Secrets are `SecretStr`. The default API token "dev-token" is accepted only in embedded mode
  (`TL_EMBEDDED=true`, loopback only); anywhere else the settings refuse to load. A placeholder secret
  (`is_placeholder`: "change-me…", the form of .env.example's examples) is refused as API token and as Redis
  password everywhere.
- `load_settings(cls)` raises `ConfigError` whose message names each bad variable; command-line code
  prints it and exits 2 instead of showing a traceback.
- The Redis URL is read from `TL_REDIS_URL`, else `REDIS_URL` (redis://, rediss:// or unix://); unset means
  "start the embedded server".
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Literal, get_args
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.events import validate_run_id
from shared.redis_server import redact_url  # noqa: F401  (imported from here by the services and the CLI)
from shared.report import DEFAULT_OFF, parse_off

DEFAULT_API_TOKEN = "dev-token"
ENV_PREFIX = "TL_"
LOOPBACK = "127.0.0.1"
DEFAULT_PORTS = {"dashboard": 8000, "trainer": 8001, "evaluator": 8002, "feedback": 8003}
"""Each service's HTTP port unless `TL_<SERVICE>_PORT` says otherwise."""
_DEVICE_RE = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")
_PLACEHOLDER_RE = re.compile(r"^\s*change[-_ ]?me", re.IGNORECASE)


def cli_command() -> str:
    """`tradeloop` as a printed hint should call it: `tradeloop` where that is on PATH (or this process did not start
    as the `tradeloop` script), else the path it started by — `.venv/bin/tradeloop` under `make up`, whose virtual
    environment is not activated, so a pasted `tradeloop …` would not be found."""
    import shutil
    import sys

    argv0 = sys.argv[0] if sys.argv else ""
    if Path(argv0).name != "tradeloop" or shutil.which("tradeloop"):
        return "tradeloop"
    rel = os.path.relpath(argv0)
    return rel if not rel.startswith("..") else str(Path(argv0).resolve())


def is_placeholder(secret: str) -> bool:
    """True for a secret that is a placeholder to replace ("change-me…", "changeme…", any case): the one rule by
    which the settings refuse a placeholder TL_API_TOKEN or TL_REDIS_PASSWORD."""
    return bool(_PLACEHOLDER_RE.match(secret))


def check_device(device: str, name: str = "device") -> str:
    """`device` when it is a torch device a process may ask for (cpu, cuda, cuda:N or auto); else ValueError
    naming `name`."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ValueError(f"{name} must be cpu, cuda, cuda:N or auto, got {device!r}")
    return device


def check_cuda(device: str, name: str = "--device") -> None:
    """ValueError naming `name` when `device` asks for CUDA (cuda, cuda:N) and this machine has no such device, so a
    command refuses at once rather than its trainer failing once started. Imports torch only for a CUDA device."""
    if not device.startswith("cuda"):
        return
    import torch

    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if not torch.cuda.is_available():
        build = ("a CPU-only build of torch" if torch.version.cuda is None
                 else f"torch built for CUDA {torch.version.cuda}")
        use = f"{name}=cpu" if name.startswith(ENV_PREFIX) else f"{name} cpu"
        raise ValueError(f"{name} {device} but no CUDA device is available here ({build}); use {use}")
    if index >= torch.cuda.device_count():
        raise ValueError(f"{name} {device} but this machine has {torch.cuda.device_count()} CUDA device(s)")


class ConfigError(ValueError):
    """Settings that do not validate; the message lists `TL_<FIELD>: problem` lines."""


TRAINER_STOP_WAIT_S = 120.0
"""The trainer service's longest shutdown wait for the iteration in hand and the save after it (`tradeloop up`
gives the trainer this plus the rest of its shutdown before SIGKILL: `tradeloop.up.supervisor.TRAINER_GRACE_S`)."""


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback IP addresses."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CommonSettings(BaseSettings):
    """Settings shared by every tradeloop process."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    redis_url: str | None = Field(
        default=None, validation_alias=AliasChoices("TL_REDIS_URL", "REDIS_URL"),
        description="Redis URL (redis://[:password@]host:port/db, or unix://[:password@]/path/redis.sock); unset: "
                    "start the embedded server")
    redis_password: SecretStr | None = Field(
        default=None, description="Redis password, taken as it is (any characters); a password inside "
                                  "TL_REDIS_URL must have / ? # @ : % percent-encoded")
    run_id: str = Field(default="dev", description="run namespace of all Redis keys (tl:{run}:…) and of run_dir; "
                                                   "`tradeloop up`: the id of a new run (unset: the time and a "
                                                   "random suffix)")
    api_token: SecretStr = Field(
        default=SecretStr(DEFAULT_API_TOKEN),
        description="bearer token for mutating endpoints; the default is refused outside embedded mode")
    embedded: bool = Field(default=True, description="embedded mode: all processes on one host, loopback only")
    host: str = Field(default=LOOPBACK, description="address the HTTP services bind (loopback when embedded)")
    data: str = Field(default="synthetic", description="dataset name (synthetic, sp500, eurusd) or a CSV/Parquet path")
    epochs: int = Field(default=5, ge=1, le=100_000, description="training epochs of the run")
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:N or auto")
    run_dir: Path = Field(default=Path("runs"), description="directory of run outputs; this run uses run_dir/run_id "
                                                            "(`tradeloop up`: where its runs are)")
    dashboard_origin: str = Field(default=f"http://{LOOPBACK}:{DEFAULT_PORTS['dashboard']}",
                                  description="origin allowed by CORS (the dashboard's URL)")
    max_body_bytes: int = Field(default=1 << 20, ge=1024, description="largest accepted HTTP request body")
    keep_checkpoints: int = Field(default=5, ge=1, description="checkpoints kept per run, in Redis and in the "
                                                               "trainer's directory (the last K)")
    redis_socket_timeout_s: float = Field(default=5.0, gt=0, le=300,
                                          description="socket timeout of Redis calls, so nothing hangs")
    trainer_port: int = Field(default=DEFAULT_PORTS["trainer"], ge=1, le=65535, description="trainer HTTP port")
    evaluator_port: int = Field(default=DEFAULT_PORTS["evaluator"], ge=1, le=65535, description="evaluator HTTP port")
    feedback_port: int = Field(default=DEFAULT_PORTS["feedback"], ge=1, le=65535, description="feedback HTTP port")
    dashboard_port: int = Field(default=DEFAULT_PORTS["dashboard"], ge=1, le=65535, description="dashboard HTTP port")

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        return validate_run_id(v)

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        if v and not v.startswith("unix://"):
            try:
                urlsplit(v).port
            except ValueError as exc:
                raise ValueError(f"not a valid URL ({exc}): percent-encode / ? # @ : % in a password, "
                                 "or give the password in TL_REDIS_PASSWORD instead") from None
        return v or None

    @model_validator(mode="after")
    def _refuse_unsafe(self) -> "CommonSettings":
        token = self.api_token.get_secret_value()
        if not token:
            raise ValueError("TL_API_TOKEN is empty; set a secret token")
        secrets = (("TL_API_TOKEN", token),
                   ("TL_REDIS_PASSWORD", self.redis_password.get_secret_value() if self.redis_password else ""))
        for name, secret in secrets:
            if is_placeholder(secret):
                raise ValueError(f"{name} is a placeholder ('change-me…'); set a secret of your own "
                                 "(e.g. `openssl rand -hex 24`)")
        if not self.embedded and token == DEFAULT_API_TOKEN:
            raise ValueError(f"TL_API_TOKEN is the default {DEFAULT_API_TOKEN!r}, which is allowed only in embedded "
                             "mode (TL_EMBEDDED=true); set TL_API_TOKEN to a secret")
        if self.redis_password is not None and self.redis_url and urlsplit(self.redis_url).password:
            raise ValueError("the Redis password is given twice (in TL_REDIS_URL and in TL_REDIS_PASSWORD); "
                             "keep one")
        if self.embedded and not is_loopback(self.host):
            raise ValueError(f"TL_HOST={self.host!r}: embedded mode binds loopback only (127.0.0.1); "
                             "set TL_EMBEDDED=false and a secret TL_API_TOKEN to bind other addresses")
        return self

    def check_data(self) -> None:
        """Refuse `TL_DATA` naming an existing file that is not valid bars (ValueError naming the file, row and
        rule), so `tradeloop serve` exits 2 with the reason instead of starting a loop that cannot run. Dataset
        names pass, and so does a path that does not exist yet (a volume not mounted): that fails later, on
        /status."""
        from pathlib import Path

        from shared.market import BUNDLED, DataError, load_bars

        data = self.data
        if data.strip().lower() in ("synthetic", *BUNDLED) or not Path(data).exists():
            return
        try:
            load_bars(data)
        except DataError as exc:
            raise ValueError(f"TL_DATA={data}: {exc}") from None
        except OSError as exc:
            raise ValueError(f"TL_DATA={data}: cannot read: {exc}") from None

    def check_run_dir(self, sub: str = "") -> Path:
        """Create this run's directory (`run_path / sub`) and refuse one this process cannot write: ValueError naming
        TL_RUN_DIR, the path, the user and the fix, so `tradeloop serve` exits 2 with the reason instead of failing
        at its first write (a root-owned directory mounted into the container, where the services run as a user)."""
        path = self.run_path / sub if sub else self.run_path
        try:
            path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
                pass
        except OSError as exc:
            uid = os.getuid()
            raise ValueError(f"TL_RUN_DIR={self.run_dir}: cannot write {path} as uid {uid} ({exc.strerror}); make "
                             f"the directory writable by uid {uid} (a host directory mounted into the container: "
                             f"chown -R {uid} it on the host)") from None
        return path

    @property
    def run_path(self) -> Path:
        """This run's directory: run_dir / run_id."""
        return self.run_dir / self.run_id

    def service_url(self, service: Literal["trainer", "evaluator", "feedback", "dashboard"]) -> str:
        """http://host:port of a service (loopback address when bound to all interfaces)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{getattr(self, f'{service}_port')}"


AccelMode = Literal["auto", "eager", "compile", "graph", "compile+graph"]
"""`TL_ACCEL` / `--accel`: "auto" and `shared.graphs.ACCEL_MODES` (tests/test_accel.py keeps them equal;
`shared.graphs.resolve_accel` says what "auto" becomes)."""


def check_accel(accel: str, device: str, accel_name: str = "--accel", device_name: str = "--device") -> None:
    """ValueError naming the option when `accel` is not a mode, or captures CUDA graphs on a cpu device."""
    modes = get_args(AccelMode)
    if accel not in modes:
        raise ValueError(f"{accel_name} must be one of {', '.join(modes)}, got {accel!r}")
    if "graph" in accel and device == "cpu":
        raise ValueError(f"{accel_name}={accel} captures CUDA graphs but {device_name} is cpu; use auto, eager or "
                         "compile")


class TrainerSettings(CommonSettings):
    """Trainer service settings."""

    feedback_timeout_s: float = Field(default=300.0, gt=0,
                                      description="longest wait for epoch e's feedback bundle before epoch e+1")
    feedback_mode: Literal["sync", "overlap"] = Field(
        default="sync",
        description="sync: epoch e+1 starts once bundle e is in (the trainer waits for the evaluation); overlap: "
                    "epoch e+1 starts at once and bundle e is applied at the first iteration boundary after it "
                    "is stored (the trainer waits only when evaluation + feedback outlast a whole epoch)")
    config: Literal["small", "full"] = Field(default="small", description="model/training preset: small or full")
    seed: int = Field(default=0, ge=0, description="random seed of the run")
    accel: AccelMode = Field(
        default="auto",
        description="how the training step runs: auto (compile+graph on CUDA, eager on CPU), eager, compile, graph or "
                    "compile+graph (graph modes need CUDA); compiled kernels are cached in TORCHINDUCTOR_CACHE_DIR, "
                    "default ~/.cache/tradeloop/inductor")

    compile_cache_dir: Path | None = Field(
        default=None,
        description="torch.compile's cache directory (sets TORCHINDUCTOR_CACHE_DIR); unset: TORCHINDUCTOR_CACHE_DIR, "
                    "else ~/.cache/tradeloop/inductor (compose: on the checkpoints volume, so it outlives containers)")

    @model_validator(mode="after")
    def _accel_fits_device(self) -> "TrainerSettings":
        check_accel(self.accel, self.device, "TL_ACCEL", "TL_DEVICE")
        return self

    @property
    def port(self) -> int:
        """The trainer's HTTP port (TL_TRAINER_PORT)."""
        return self.trainer_port


def _default_consumer_name() -> str:
    return f"evaluator-{socket.gethostname()}-{os.getpid()}"


class EvaluatorSettings(CommonSettings):
    """Evaluator service settings."""

    consumer_name: str = Field(default_factory=_default_consumer_name,
                               description="consumer name in the group (unique per replica; default host-pid)")
    claim_idle_ms: int = Field(default=600_000, ge=100,
                               description="claim entries idle this long from a dead replica (> longest evaluation)")

    @property
    def port(self) -> int:
        """The evaluator's HTTP port (TL_EVALUATOR_PORT)."""
        return self.evaluator_port


class FeedbackSettings(CommonSettings):
    """Feedback service settings."""

    enabled: bool = Field(default=True, description="false: the ablation (publish fixed-schedule knobs)")
    feedback_off: str = Field(default=",".join(DEFAULT_OFF),
                              description="signals switched off, comma-separated (E1…E9, rollback): their knobs "
                                          "follow the fixed schedule; empty: every signal on")

    rollback_z: float | None = Field(default=None, gt=0,
                                     description="roll back when validation fell this many standard errors below "
                                                 "the best epoch's (unset: FeedbackConfig's default)")
    rollback_lr_factor: float | None = Field(default=None, gt=0, le=1,
                                             description="multiply every learning rate by this at each rollback "
                                                         "(unset: FeedbackConfig's default, 1: no decay)")
    plateau_lr_factor: float | None = Field(default=None, gt=0, le=1,
                                            description="multiply every learning rate by this after an epoch that "
                                                        "set no new validation best beyond noise (unset: "
                                                        "FeedbackConfig's default, 1: off)")
    rollback_keep: float | None = Field(default=None, ge=0, lt=1,
                                        description="the share of the current weights a rollback keeps (unset: "
                                                    "FeedbackConfig's default, 0: the best epoch's weights exactly)")
    rollback_restart: bool | None = Field(default=None,
                                          description="answer a drop beyond the noise with a fresh learner instead "
                                                      "of the best epoch's (unset: FeedbackConfig's default, false)")

    @field_validator("feedback_off")
    @classmethod
    def _off(cls, v: str) -> str:
        return ",".join(parse_off(v))

    @property
    def off(self) -> tuple[str, ...]:
        """`feedback_off` as the names `FeedbackConfig.off` takes."""
        return parse_off(self.feedback_off)

    @property
    def port(self) -> int:
        """The feedback service's HTTP port (TL_FEEDBACK_PORT)."""
        return self.feedback_port


class DashboardSettings(CommonSettings):
    """Dashboard settings: where its proxy (`/api/<service>/…`) reaches each service."""

    trainer_url: str | None = Field(default=None, description="the trainer's base URL for the dashboard's proxy "
                                                              "(None: TL_HOST and TL_TRAINER_PORT)")
    evaluator_url: str | None = Field(default=None, description="the evaluator's base URL for the dashboard's proxy "
                                                                "(None: TL_HOST and TL_EVALUATOR_PORT)")
    feedback_url: str | None = Field(default=None, description="the feedback service's base URL for the dashboard's "
                                                               "proxy (None: TL_HOST and TL_FEEDBACK_PORT)")

    @field_validator("trainer_url", "evaluator_url", "feedback_url")
    @classmethod
    def _upstream(cls, v: str | None) -> str | None:
        if v is None:
            return None
        if not re.match(r"^https?://[^/\s]+$", v.rstrip("/")):
            raise ValueError(f"must be http(s)://host[:port], got {v!r}")
        return v.rstrip("/")

    def upstream(self, service: Literal["trainer", "evaluator", "feedback"]) -> str:
        """Base URL the dashboard's proxy forwards `/api/<service>/…` to."""
        return getattr(self, f"{service}_url") or self.service_url(service)

    @property
    def port(self) -> int:
        """The dashboard's HTTP port (TL_DASHBOARD_PORT)."""
        return self.dashboard_port


def _env_name(cls: type[BaseSettings], field: str) -> str:
    info = cls.model_fields.get(field)
    alias = getattr(info, "validation_alias", None) if info else None
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"{ENV_PREFIX}{field.upper()}"


def _field_of(cls: type[BaseSettings], loc: str) -> str:
    """The field an error location names: the field itself, or one of its alias choices (e.g. TL_REDIS_URL)."""
    for name, info in cls.model_fields.items():
        alias = getattr(info, "validation_alias", None)
        if loc == name or (isinstance(alias, AliasChoices) and loc in alias.choices):
            return name
    return loc


def load_settings(cls: type[CommonSettings] = CommonSettings, **overrides) -> CommonSettings:
    """Build settings from the environment (+ overrides); raise ConfigError naming each bad variable."""
    try:
        return cls(**overrides)
    except ValidationError as exc:
        lines = []
        for e in exc.errors():
            loc = [str(p) for p in e["loc"]]
            field = _field_of(cls, loc[0]) if loc else None
            where = _env_name(cls, field) if loc else "settings"
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            got = f" (got {value!r})" if loc and not isinstance(value, (dict, SecretStr)) else ""
            if field == "redis_url" and isinstance(value, str):
                got = f" (got {redact_url(value)!r})"     # a URL can hold a password
            lines.append(f"{where}: {msg}{got}" if loc else msg)
        raise ConfigError(f"invalid {cls.__name__}:\n  " + "\n  ".join(lines)) from None


def settings_table(cls: type[BaseSettings]) -> list[tuple[str, str, str]]:
    """(environment variable, default, description) rows of a settings model, for the README."""
    rows = []
    for name, info in cls.model_fields.items():
        if info.default_factory is not None:
            default = "(computed)"
        elif isinstance(info.default, SecretStr):
            default = repr(info.default.get_secret_value())
        else:
            default = repr(info.default)
        rows.append((_env_name(cls, name), default, info.description or ""))
    return rows
