"""What a worker of the same policy on the same node can do to a peer's view of the shared spill.

Workers of one policy share the spill root, usually as one uid: each may rename, replace and link
names in the others' directories. These helpers do what such a peer does, at the moment it matters:

- :func:`swap_as_it_links` (run in the receiver, by ``client.run``): renames names the moment the
  receiver links a file into a chosen directory. Python raises the ``os.link`` audit event
  (:pep:`578`) just before its link(2) call, after whatever the receiver checked: the swap lands
  between the check and the link on every run, not once in many tries of a race. The hook only
  watches and renames; nothing of Dask or memops is replaced.
- :func:`tmpfs` and :func:`inode_twin`: a file of another filesystem whose inode number and size
  are those of a given file (a new tmpfs numbers its inodes in sequence from 2).
- :func:`writes_as_owner`: a write and a truncation, tried by an unprivileged uid that owns the file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import cloudpickle
import pytest

# What runs in the workers (client.run) goes by value: they cannot import the tests.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

NOBODY = 65534
"""An unprivileged uid (and gid), whether or not the machine names it."""


def swap_as_it_links(watch: str, moves: Sequence[tuple[str, str]], marker: str) -> None:
    """Installed in a worker: the first time it links a file into the directory ``watch``, rename
    each ``(source, destination)`` of ``moves`` first, then create ``marker`` (so that the test
    knows the swap came)."""
    armed = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "os.link" or not armed[0]:
            return
        _, destination, _, destination_dir_fd = args
        # A link made relative to a directory descriptor names that directory by /proc.
        base = os.readlink(f"/proc/self/fd/{destination_dir_fd}") if destination_dir_fd >= 0 else ""
        if os.path.realpath(os.path.dirname(os.path.join(base, os.fsdecode(destination)))) != watch:
            return
        armed[0] = False
        for source, target in moves:
            os.rename(source, target)
        with open(marker, "w"):
            pass

    sys.addaudithook(hook)


@contextlib.contextmanager
def tmpfs(size: str = "256m") -> Iterator[str]:
    """A new tmpfs mounted on a temporary directory (skips where this process may not mount one)."""
    path = tempfile.mkdtemp(prefix="memops-tmpfs-")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "memops-test", path], capture_output=True, text=True, check=False
    )
    if done.returncode:
        os.rmdir(path)
        pytest.skip(f"no tmpfs of its own here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", path], check=False)
        os.rmdir(path)


def inode_twin(directory: str, inode: int, content: bytes) -> str:
    """A file in ``directory`` (on a tmpfs that numbers its inodes in sequence) whose inode number
    is ``inode``, holding ``content``; skips when the numbering is already past it."""
    path = os.path.join(directory, "twin")
    for _ in range(inode + 1):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        found = os.fstat(fd).st_ino
        if found == inode:
            with open(fd, "wb") as f:
                f.write(content)
            return path
        os.close(fd)
        os.unlink(path)
        if found > inode:
            break
    pytest.skip(f"this tmpfs numbers its inodes past {inode}: no twin for it")


def writes_as_owner(path: str, scratch: str) -> dict[str, str]:
    """Give the file at ``path`` to :data:`NOBODY`, then, as that uid, open it for writing (to
    append nothing) and truncate it to its own size: what each said, ``""`` where it succeeded.
    Neither changes a byte of the file when it succeeds. Root's capabilities pass over file modes,
    so the writer is not root; of all the writers that are not, the file's owner is the least
    restricted (and a peer of the same uid is its owner). ``scratch``: a directory on the file's
    filesystem that the uid may traverse, where it reaches the file by a link of its own."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another uid takes root")
    os.chown(path, NOBODY, NOBODY)
    size = os.stat(path).st_size
    where = tempfile.mkdtemp(prefix="memops-owner-", dir=scratch)
    os.chmod(where, 0o755)
    name = os.path.join(where, "file")
    os.link(path, name)
    commands = {
        "open for writing": ["sh", "-c", ': >> "$1"', "sh", name],
        "truncate": ["truncate", "-s", str(size), name],
    }
    said: dict[str, str] = {}
    try:
        for what, command in commands.items():
            done = subprocess.run(
                command, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True, timeout=10
            )
            said[what] = (done.stderr.strip() or f"exit {done.returncode}") if done.returncode else ""
    finally:
        shutil.rmtree(where, ignore_errors=True)
    return said
