"""The suite's one polling helper: wait for a condition instead of sleeping a fixed time.

``check`` is called (and awaited, if it returns an awaitable) every ``interval`` seconds until it
returns something truthy, which :func:`poll` returns; after ``timeout`` seconds the test fails with
an AssertionError that names ``what`` it waited for. :func:`wait_for` is the same for synchronous
tests (those that drive ``kubectl`` and a synchronous ``distributed.Client``). :func:`stays` is the
negative: that a condition holds throughout a window (``tests/e2e/windows.py`` says how long).
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


def stays(check: Callable[[], Any], *, seconds: float, what: str, interval: float = 0.5) -> None:
    """That something does not happen, asserted over ``seconds`` rather than at one moment: ``check``
    is called every ``interval`` seconds and the test fails the first time it returns something
    falsy (or raises), so a wrong change that comes late still fails it."""
    began = time.monotonic()
    while True:
        if not check():
            raise AssertionError(f"{what}: no longer so {time.monotonic() - began:.1f}s into the {seconds}s watched")
        if time.monotonic() - began >= seconds:
            return
        time.sleep(interval)
