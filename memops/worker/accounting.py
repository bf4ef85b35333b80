"""Spilled bytes on a shared tmpfs, counted once per inode.

Hardlinked spill files (:mod:`memops.worker.handover`, :mod:`memops.worker.links`) are one set of
pages under several names: a worker's own sum of its files' sizes counts a page once per worker
that links it. :func:`report` (in a worker) lists its spill files by ``(st_dev, st_ino)``;
:func:`shares` (anywhere: pure) counts each inode once over the reports of every worker of a
node and gives each worker its share, so that the shares add up to the bytes the tmpfs holds.

Imports nothing of memops (sent by value to a stock Dask image).
"""

from __future__ import annotations

import os
import stat
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

Inode = tuple[int, int]
"""``(st_dev, st_ino)``: one file, whatever its names."""

OWNED = "_memops_owned"
"""The spill store's attribute (:mod:`memops.worker.maps`): the inodes the spill owner allocated."""
OWNER_REFUSALS = "_memops_owner_refusals"
"""The spill store's attribute: ``[files the worker wrote itself, their bytes, the owner's last reason]``."""

LINKED_IN = "_memops_linked_in"
"""The worker's attribute: the inodes it holds by a link it made to a peer's file (a hand-over,
a fetch by link), a set of :data:`Inode`. The kernel charges a tmpfs page to the memory cgroup of
the process that wrote it, and never moves the charge to a process that links, reads or maps it:
the pages of these files count against the writer's pod, not this worker's. (Also set, by this
name, by :mod:`memops.worker.handover`, which imports nothing of memops.)"""


def note_linked(worker: Any, device: int, inode: int) -> None:
    """``worker`` holds the file ``(device, inode)`` by a link it made to a peer's."""
    worker.__dict__.setdefault(LINKED_IN, set()).add((device, inode))


def files(directory: str) -> list[tuple[int, int, int, int]]:
    """``(st_dev, st_ino, st_size, st_nlink)`` of the regular files directly in ``directory``."""
    result: list[tuple[int, int, int, int]] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return result
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue  # removed meanwhile (unspilled, released)
        if stat.S_ISREG(st.st_mode):
            result.append((st.st_dev, st.st_ino, st.st_size, st.st_nlink))
    return result


def summarize(
    found: Iterable[tuple[int, int, int, int]], linked: Collection[Inode] = (), owned: Collection[Inode] = ()
) -> dict[str, Any]:
    """One worker's figures: ``bytes`` (each inode once), ``sharedBytes`` (of files that another
    name links too), ``ownBytes`` (of files it wrote itself, neither in ``linked`` nor in
    ``owned``: what the kernel charges to its cgroup), ``ownerBytes`` (of files in ``owned``, whose
    pages the spill owner allocated: charged to that sidecar, :mod:`memops.worker.owner`),
    ``files``, and ``inodes``: ``[st_dev, st_ino, st_size]`` for :func:`shares`."""
    seen: dict[Inode, tuple[int, int]] = {}
    for dev, ino, size, nlink in found:
        seen[(dev, ino)] = (size, nlink)
    return {
        "files": len(seen),
        "bytes": sum(size for size, _ in seen.values()),
        "sharedBytes": sum(size for size, nlink in seen.values() if nlink > 1),
        "ownBytes": sum(size for inode, (size, _) in seen.items() if inode not in linked and inode not in owned),
        "ownerBytes": sum(size for inode, (size, _) in seen.items() if inode in owned and inode not in linked),
        "inodes": [[dev, ino, size] for (dev, ino), (size, _) in seen.items()],
    }


def report(worker: Any) -> dict[str, Any]:
    """:func:`summarize` of the worker's spill directory (and of links it holds on their way in
    or out), or ``{"files": 0, ...}`` where it spills to no directory."""
    data = getattr(worker, "data", None)
    store = getattr(getattr(getattr(data, "slow", None), "data", None), "d", None)
    directory = getattr(store, "directory", None)
    found: list[tuple[int, int, int, int]] = []
    if isinstance(directory, str):
        found += files(directory)
    found += files(os.path.join(str(getattr(worker, "local_directory", "")), "memops-links"))
    linked: set[Inode] | None = getattr(worker, LINKED_IN, None)
    owned: set[Inode] | None = getattr(store, "__dict__", {}).get(OWNED)
    present = {(dev, ino) for dev, ino, _, _ in found}
    # Files gone since: forgotten, so that an inode number used again is not taken for a link.
    for inodes in (linked, owned):
        if inodes:
            inodes.intersection_update(present)
    refused = getattr(store, "__dict__", {}).get(OWNER_REFUSALS) or [0, 0, ""]
    return {
        **summarize(found, linked or (), owned or ()),
        "ownerRefusedFiles": int(refused[0]),
        "ownerRefusedBytes": int(refused[1]),
        "ownerRefusal": str(refused[2]),
        "boot": boot_id(),
    }


def boot_id() -> str:
    """The kernel's identity: inode numbers mean one file only between workers of one node."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def shares(reports: Mapping[str, Iterable[Iterable[int]]]) -> tuple[dict[str, float], int]:
    """From each worker's ``inodes`` (``[st_dev, st_ino, st_size]``): each worker's share of the
    bytes (an inode that k workers hold counts size/k to each), and the bytes of all inodes, once.
    The shares add up to the total."""
    holders: defaultdict[Inode, set[str]] = defaultdict(set)
    sizes: dict[Inode, int] = {}
    for worker, inodes in reports.items():
        for dev, ino, size in (tuple(i) for i in inodes):
            holders[(dev, ino)].add(worker)
            sizes[(dev, ino)] = size
    share: dict[str, float] = {worker: 0.0 for worker in reports}
    for inode, workers in holders.items():
        for worker in workers:
            share[worker] += sizes[inode] / len(workers)
    return share, sum(sizes.values())
