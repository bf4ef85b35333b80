"""The one daemon loop of memops' controllers: a pass, then a wait that grows with failures.

Both Kopf daemons (:mod:`memops.controllers.retirement`, one per RetirementRequest, and
:mod:`memops.controllers.policy`, one per MemoryPolicy) run :func:`run`. A pass says what comes
next (:class:`Next`); an exception is handed to the controller, which records it in the object's
status and says what comes next too, so that no failure becomes a crash loop. Nothing here is
kept across passes but the count of failures in a row: the state lives in the objects, and a
restarted operator starts the loop afresh.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable

import kopf


class Failures(enum.Enum):
    """What a pass does to the count of failures in a row, which lengthens the next wait."""

    RESET = "reset"  # the pass succeeded
    COUNT = "count"  # one more failure in a row
    KEEP = "keep"  # neither: a transient error of the API server or the scheduler says nothing of the pass


@dataclasses.dataclass(frozen=True)
class Next:
    """What comes after a pass."""

    seconds: float = 0.0
    """The wait before the next pass, multiplied by the failures in a row; 0: at once."""
    failures: Failures = Failures.RESET


Pass = Callable[[], Awaitable[Next | None]]
"""One pass; None: the work is finished and the daemon ends."""
OnError = Callable[[Exception], Awaitable[Next | None]]
"""Records a pass' exception and says what comes next; None: the daemon ends."""
Wait = Callable[[float], Awaitable[object]]
"""Waits up to this many seconds; it may return earlier (stopped, or woken)."""


async def run(
    one_pass: Pass,
    on_error: OnError,
    *,
    stopped: kopf.DaemonStopped,
    max_seconds: float,
    wait: Wait | None = None,
) -> None:
    """Run passes until one says the work is finished or Kopf stops the daemon.

    ``max_seconds`` caps the wait however many failures came in a row; ``wait`` defaults to a
    wait that only Kopf's stop cuts short.
    """
    wait = wait or stopped.wait
    failures = 0
    while not stopped:
        try:
            after = await one_pass()
        except Exception as exc:  # every failure ends in the status: never a crash loop
            after = await on_error(exc)
        if after is None:
            return
        if after.failures == Failures.RESET:
            failures = 0
        elif after.failures == Failures.COUNT:
            failures += 1
        if after.seconds > 0 and not stopped:
            await wait(min(after.seconds * max(failures, 1), max_seconds))
