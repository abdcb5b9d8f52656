"""The embedded Redis server: loopback, password, AOF, version check, kill -9 and restart."""
from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from shared.redis_server import (EmbeddedRedis, RedisServerError, check_redis_url, check_redis_version,
                                 parse_version)

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
    with EmbeddedRedis(data, appendfsync="always") as server:
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
    again = EmbeddedRedis(data, port=port)
    assert again.password == server.password
    with again:
        c = redis.Redis.from_url(again.url, socket_timeout=5)
        assert c.get("k") == b"before-crash"
        c.close()


def test_unreachable_url_is_a_clear_error(tmp_path):
    with EmbeddedRedis(tmp_path / "r") as server:
        bad = server.url.replace(server.password, "wrong")
        with pytest.raises(RedisServerError, match=r"\*\*\*@127.0.0.1"):  # password redacted
            check_redis_url(bad, timeout_s=2)
        with pytest.raises(ValueError, match="appendfsync"):
            EmbeddedRedis(tmp_path / "x", appendfsync="no")
