"""Copies between workers: where one goes, and how long it may take before whoever asked gives up.

Runs inside the scheduler, and imports nothing else of memops (it is sent there by value with the
modules that use it).

Where: Dask's Active Memory Manager has one rule for a new replica (``_find_recipient``: the
running workers that do not hold the key, the least memory first), and so has memops:
:func:`choose_recipient`, for the drain (:mod:`memops.scheduler.drain`), replication
(:mod:`memops.scheduler.replication`) and pressure relief (:mod:`memops.scheduler.relief`). They
need more than the AMM's: room below a bound that differs for each (the memory target,
``ceiling``, ``above``), the recipients of one pass given equal shares or the most room first,
copies away from the key's other copies, spill shared by link. Each keeps the order of its
candidates (a heap or a sorted list, updated as it places keys: thousands of keys a pass, over up
to a thousand workers); the walk down that order is this one function, whose parameters are
where they differ.

How long: the drain and pressure relief ask workers for copies and follow each one until it
lands; a copy that has not landed within its module's grace period plus its transfer time at
:data:`TRANSFER_BYTES_PER_SECOND` is given up (asked again, or planned afresh). The grace periods
differ on purpose: each module's ``IN_FLIGHT_SECONDS`` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence
from typing import Any

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


def _always(name: str) -> bool:
    return True


def choose_recipient(
    candidates: Iterable[str],
    *,
    excluded: Sequence[Container[str]] = (),
    has_room: Callable[[str], bool] = _always,
    takes: Callable[[str], bool] = _always,
    by_room: bool = False,
    rank: Callable[[str], Any] | None = None,
    best_rank: Any = None,
) -> str | None:
    """The recipient of one key among ``candidates``, in the caller's order of preference, or None.

    ``excluded``: names that may not take it (in any of these: its holders, the pods its rule
    keeps it away from). ``has_room``: whether a candidate has room for it below its bound;
    ``by_room``: the candidates come with the most room first, so the first without room ends the
    search (none after it has more). ``takes``: whether a candidate with room takes it now (the
    drain's window); asked only of candidates with room, so that it may note a refusal. ``rank``:
    a preference before the order (the lowest wins, ties to the first in order; None: the first
    candidate that takes it wins); ``best_rank``: no candidate ranks better, so the first with it
    ends the search.

    Candidates are read one at a time, and only as far as needed: a caller's lazy heap may drop
    the entries it is asked past (a candidate refused, for this key or for the pass).
    """
    best: tuple[Any, str] | None = None
    for name in candidates:
        if any(name in names for names in excluded):
            continue
        if not has_room(name):
            if by_room:
                break
            continue
        if not takes(name):
            continue
        if rank is None:
            return name
        score = rank(name)
        if best is None or score < best[0]:
            best = (score, name)
        if score == best_rank:
            break
    return None if best is None else best[1]
