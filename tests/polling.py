"""The suite's one polling helper: wait for a condition instead of sleeping a fixed time.

``check`` is called (and awaited, if it returns an awaitable) every ``interval`` seconds until it
returns something truthy, which :func:`poll` returns; after ``timeout`` seconds the test fails with
an AssertionError that names ``what`` it waited for.
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
