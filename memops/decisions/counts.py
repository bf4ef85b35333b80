"""Counts and byte sizes in what a peer sends (a scheduler's reply, a worker's report, the
kubelet's summary): believed only as plain integers from 0 to below 2**63."""

from __future__ import annotations

from typing import Any

LIMIT = 2**63
"""A count or size at or over this is not believed (no scheduler, worker or node holds it)."""


def plain(value: Any) -> int | None:
    """``value`` when it is a plain integer from 0 to below :data:`LIMIT` (not a bool, a float
    or a string); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < LIMIT:
        return None
    return value


def or_zero(value: Any) -> int:
    """:func:`plain`, with 0 for anything else: a figure that is only shown."""
    found = plain(value)
    return 0 if found is None else found
