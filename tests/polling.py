"""Waiting in tests: poll a condition with a deadline (never a fixed sleep)."""
from __future__ import annotations

import asyncio
import inspect
import time
from typing import Any, Callable, TypeVar

T = TypeVar("T")


def poll_until(predicate: Callable[[], T], what: str, *, timeout_s: float = 20.0, interval_s: float = 0.05,
               alive: Callable[[], bool] = lambda: True) -> T:
    """Return `predicate()`'s first truthy value; fail naming `what` after `timeout_s`, or at once when `alive()`
    turns False (the process under test exited)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert alive(), f"gave up waiting for {what}: the process under test exited"
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        time.sleep(interval_s)


async def apoll_until(predicate: Callable[[], Any], what: str, *, timeout_s: float = 20.0,
                      interval_s: float = 0.05) -> Any:
    """`poll_until` inside an event loop: `predicate()` may return a value or an awaitable of one; the loop runs
    between polls."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f}s waiting for {what}"
        await asyncio.sleep(interval_s)
