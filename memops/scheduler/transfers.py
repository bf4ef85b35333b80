"""Copies between workers on their way: how long one may take before whoever asked gives up.

Runs inside the scheduler, and imports nothing else of memops (it is sent there by value with the
modules that use it). The drain (:mod:`memops.scheduler.drain`) and pressure relief
(:mod:`memops.scheduler.relief`) ask workers for copies and follow each one until it lands; a
copy that has not landed within its module's grace period plus its transfer time at
:data:`TRANSFER_BYTES_PER_SECOND` is given up (asked again, or planned afresh). The grace periods
differ on purpose: each module's ``IN_FLIGHT_SECONDS`` says why.
"""

from __future__ import annotations

TRANSFER_BYTES_PER_SECOND = 50 * 2**20
"""A slow worker-to-worker copy: a large key counts as on its way for this much longer, so that it
is not asked for a second time (of a second recipient) while it is still moving."""


def given_up_at(asked: float, nbytes: int, grace: float) -> float:
    """When a copy of ``nbytes`` asked at ``asked`` is given up: ``grace`` plus its transfer time
    (in the clock of ``asked``)."""
    return asked + grace + nbytes / TRANSFER_BYTES_PER_SECOND


def expired(asked: float, nbytes: int, grace: float, now: float) -> bool:
    """Whether a copy asked at ``asked`` is past :func:`given_up_at`."""
    return now > given_up_at(asked, nbytes, grace)
