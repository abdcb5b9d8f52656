"""The embedded Redis server: a Unix socket (or loopback TCP), password, AOF, version check, kill -9 and restart."""
from __future__ import annotations

import os

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.redis_server import (EmbeddedRedis, RedisServerError, check_redis_url, check_redis_version,
                                 SUN_PATH_MAX, parse_version)

pytestmark = pytest.mark.redis


def test_version_check():
    assert parse_version("6.2.14") == (6, 2, 14) and parse_version("7.0.0-rc1") == (7, 0, 0)
    assert check_redis_version({"redis_version": "6.2.0"}) == "6.2.0"
    assert check_redis_version({b"redis_version": b"7.2.4"}) == "7.2.4"
    with pytest.raises(RedisServerError, match="6.0.16 is too old"):
        check_redis_version({"redis_version": "6.0.16"})
    with pytest.raises(RedisServerError, match="no redis_version"):
        check_redis_version({})


def test_embedded_server_is_loopback_passworded_aof_and_restartable(tmp_path):
    data = tmp_path / "redis"
    with EmbeddedRedis(data, tcp=True, appendfsync="always") as server:
        assert server.url.startswith("redis://:") and f"@127.0.0.1:{server.port}/0" in server.url
        assert parse_version(server.version) >= (6, 2) and check_redis_url(server.url) == server.version
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        cfg = client.config_get("*")
        assert (cfg["appendonly"], cfg["appendfsync"], cfg["bind"]) == ("yes", "always", "127.0.0.1")
        assert cfg["dir"] == str(data.resolve())
        anon = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anon.ping()
        anon.close()
        client.set("k", "before-crash")
        client.xadd("s", {"a": "1"})
        port, pid = server.port, server.pid
        server.kill()  # SIGKILL
        assert not server.running
        with pytest.raises(redis.ConnectionError):
            client.ping()
        server.start()  # same dir, port, password; replays the AOF
        assert server.port == port and server.pid != pid
        assert client.get("k") == b"before-crash" and client.xlen("s") == 1
        client.close()
    assert not server.running
    # a new object on the same directory reuses the stored password
    again = EmbeddedRedis(data, tcp=True, port=port)
    assert again.password == server.password
    with again:
        c = redis.Redis.from_url(again.url, socket_timeout=5)
        assert c.get("k") == b"before-crash"
        c.close()


def test_unix_socket_server_has_no_tcp_listener_and_survives_a_kill(tmp_path):
    data = tmp_path / "redis"
    with EmbeddedRedis(data, appendfsync="always") as server:
        assert server.socket_path == data.resolve() / "redis.sock" and server.url.startswith("unix://:")
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        cfg = client.config_get("*")
        assert (cfg["port"], cfg["unixsocket"], cfg["unixsocketperm"]) == ("0", str(server.socket_path), "700")
        assert oct(server.socket_path.stat().st_mode & 0o777) == "0o700"
        # the password, the config that repeats it and the AOF (every stored value) are the owner's alone
        assert oct(data.stat().st_mode & 0o777) == "0o700"
        assert {f.name: oct(f.stat().st_mode & 0o077) for f in (data / "password", data / "redis.conf")} == \
            {"password": "0o0", "redis.conf": "0o0"}
        anon = redis.Redis(unix_socket_path=str(server.socket_path), socket_timeout=5, retry=Retry(NoBackoff(), 0))
        with pytest.raises(redis.AuthenticationError):
            anon.ping()
        anon.close()
        client.set("k", "v")
        url = server.url
        server.kill()
        server.start()  # same socket, same URL, the AOF replayed
        assert server.url == url and client.get("k") == b"v"
        client.close()


def test_a_long_directory_puts_the_socket_in_a_short_private_one(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "redis"
    with EmbeddedRedis(deep) as server:
        sock = server.socket_path
        assert len(os.fsencode(deep / "redis.sock")) > SUN_PATH_MAX >= len(os.fsencode(sock))
        assert sock.parent != deep and oct(sock.parent.stat().st_mode & 0o777) == "0o700"
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.ping() and client.config_get("dir")["dir"] == str(deep.resolve())
        client.close()
    assert not sock.parent.exists()  # stop() removed the short directory


def test_a_socket_path_with_spaces_round_trips_through_the_url(tmp_path):
    with EmbeddedRedis(tmp_path / "a dir %20" / "r") as server:
        c = redis.Redis.from_url(server.url, socket_timeout=5)
        assert c.ping()
        # by default every write is fsynced before its reply: an acknowledged write survives a kill -9
        assert c.config_get("appendfsync")["appendfsync"] == "always"
        c.close()


@pytest.mark.parametrize("url", ["notaurl", "http://127.0.0.1:6379", "redis://:pw@"])
def test_a_string_that_is_no_redis_url_is_a_clear_error(url):
    with pytest.raises(RedisServerError, match=r"not a Redis URL|cannot use Redis"):
        check_redis_url(url, timeout_s=1)


def test_unreachable_url_is_a_clear_error(tmp_path):
    with EmbeddedRedis(tmp_path / "r", tcp=True) as server:
        bad = server.url.replace(server.password, "wrong")
        with pytest.raises(RedisServerError, match=r"\*\*\*@127.0.0.1"):  # password redacted
            check_redis_url(bad, timeout_s=2)
        with pytest.raises(ValueError, match="appendfsync"):
            EmbeddedRedis(tmp_path / "x", appendfsync="no")
        with pytest.raises(ValueError, match="tcp=True"):
            EmbeddedRedis(tmp_path / "x", port=6400)
