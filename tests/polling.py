"""The suite's one polling helper: wait for a condition instead of sleeping a fixed time.

``check`` is called (and awaited, if it returns an awaitable) every ``interval`` seconds until it
returns something truthy, which :func:`poll` returns; after ``timeout`` seconds the test fails with
an AssertionError that names ``what`` it waited for. :func:`wait_for` is the same for synchronous
tests (those that drive ``kubectl`` and a synchronous ``distributed.Client``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def poll(
    check: Callable[[], Any | Awaitable[Any]], *, timeout: float, what: str = "the condition", interval: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


def wait_for(check: Callable[[], Any], *, timeout: float, what: str = "the condition", interval: float = 0.2) -> Any:
    """:func:`poll` from synchronous code: ``check`` runs in this thread, between sleeps."""
    return asyncio.run(poll(check, timeout=timeout, what=what, interval=interval))
