"""Kubernetes timestamps (RFC 3339, UTC, whole seconds), as every status field of memops writes them."""

from __future__ import annotations

import datetime

FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def now() -> datetime.datetime:
    return datetime.datetime.now(tz=datetime.UTC)


def parse(text: str) -> datetime.datetime:
    return datetime.datetime.strptime(text, FORMAT).replace(tzinfo=datetime.UTC)


def parse_or_none(text: object) -> datetime.datetime | None:
    """``text`` parsed, or None when it is not such a timestamp (what an object says is hostile)."""
    if not isinstance(text, str):
        return None
    try:
        return parse(text)
    except ValueError:
        return None


def render(moment: datetime.datetime) -> str:
    return moment.strftime(FORMAT)


def age_seconds(text: str | None) -> float | None:
    """Seconds since ``text``, or None when there is no timestamp."""
    return (now() - parse(text)).total_seconds() if text else None
