"""This process' mount table, read from ``/proc/self/mountinfo`` (proc(5)): the one parser of the
sandbox and its tests."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

TABLE = Path("/proc/self/mountinfo")
_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of the table."""

    root: str
    """The directory of its filesystem that is mounted here: ``/``, or a bind mount's source."""
    point: str
    fstype: str
    options: frozenset[str]
    """Its per-mount and per-superblock options together."""
    line: str


def _unescape(field: str) -> str:
    # The kernel writes a space, a tab, a newline and a backslash in a path as octal escapes.
    return _ESCAPE.sub(lambda found: chr(int(found[1], 8)), field)


def mounts() -> list[Mount]:
    """Every mount, in the order they were mounted (of two at one point, the later is on top); none
    where the table cannot be read."""
    try:
        text = TABLE.read_text()
    except OSError:
        return []
    table = []
    for line in text.splitlines():
        fields = line.split()
        after = fields[fields.index("-") + 1 :]  # after the optional fields: type, source, options
        options = frozenset(fields[5].split(",")) | frozenset(after[2].split(","))
        table.append(Mount(_unescape(fields[3]), _unescape(fields[4]), after[0], options, line))
    return table


def at(point: Path) -> Mount | None:
    """The mount on top at ``point``, or None where nothing is mounted there."""
    resolved = str(point.resolve())
    return next((m for m in reversed(mounts()) if m.point == resolved), None)


def under(root: Path) -> list[str]:
    """The mount points at ``root`` and below it, the deepest first (the order to unmount them)."""
    resolved = str(root.resolve())
    points = [m.point for m in mounts() if m.point == resolved or m.point.startswith(resolved + "/")]
    return sorted(points, key=lambda p: -len(p))
