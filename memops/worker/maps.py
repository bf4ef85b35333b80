"""Spilled keys read back as memory maps of their spill files, and linked files adopted as spilled.

A worker's spill store is distributed's ``SpillBuffer``: a ``zict.Buffer`` whose ``slow`` layer is
``zict.Cache(Slow(AnyKeyFile(directory)), WeakValueMapping())``. :func:`find` checks that shape
through the layers' public attributes (``Buffer.slow``, ``Cache.data``, ``Func.d``) and says why
when it is not there (a third-party ``data`` mapping, another distributed or zict);
:func:`install` then puts one layer in, :class:`MappedFile` in place of the ``AnyKeyFile``, with
the same state (the one ``__dict__``: file names, counter, lock), so nothing is copied or lost:

- ``__getitem__`` maps the file (``mmap.ACCESS_COPY``: private copy-on-write pages over the
  tmpfs pages) instead of reading it into a new buffer. Dask's deserializers then build numpy
  arrays (and other buffers serialized out of band) as views of the map: N workers that read one
  linked file hold one set of pages. A task that writes into such an array gets its own copy of
  the pages it writes, never the other workers' (zict's own ``memmap`` maps the file shared and
  writable, which would let one worker's in-place write change another's key).
- ``__setitem__`` of :class:`Linked` frames renames a file that :mod:`memops.worker.links` linked
  from a peer into the store under the key's name, instead of writing the bytes again.
- ``__setitem__`` of bytes writes a new file (created, never opened through a name that exists),
  then takes its write bits off on the descriptor: this worker maps the file when it reads the key
  back, and peers link and map it, so it must not change once written. A rewrite would change
  every map of it, a truncation end every process that reads a mapped page past the new end
  with SIGBUS; without write bits neither the writer nor any process of its uid can open it for
  writing (root can, and so can the owner once it puts the bits back).

Imports nothing of memops but its siblings (it runs in a stock Dask image).
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import weakref
from typing import Any

from memops.worker import accounting, owner

MMAP_TYPE = mmap.mmap
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
"""Taken off each spill file once written (as :data:`memops.worker.handover.WRITE_BITS`)."""
HELD_DIRECTORY = "memops-held"
"""In the worker's local directory: one more link to each spill file that a live map reads, so that
the value can go back to the spill store by that link instead of by a new file."""

_HELD: dict[int, tuple[str, bool]] = {}
"""id(a live map) -> (a link to its file, whether a peer wrote that file), while the map lives."""
_COUNTER = itertools.count()


def hold(mapped: Any, path: str, *, from_peer: bool = False) -> None:
    """Keep ``path`` (a link to the file that ``mapped``, an mmap, reads) while the map lives:
    removed when it is garbage-collected, unless :func:`take_held` took it first."""
    _HELD[id(mapped)] = (path, from_peer)
    weakref.finalize(mapped, _release, id(mapped), path)


def _release(ident: int, path: str) -> None:
    if _HELD.get(ident, ("",))[0] == path:
        del _HELD[ident]
    try:
        os.unlink(path)
    except OSError:  # taken into a spill store meanwhile
        pass


def take_held(value: Any) -> tuple[str, bool] | None:
    """The held link to the file that ``value`` is a view of, for the spill store to rename, and
    whether a peer wrote that file; None when there is none (any more)."""
    mapped = mapped_base(value)
    if mapped is None:
        return None
    found = _HELD.pop(id(mapped), None)
    return found if found is not None and os.path.exists(found[0]) else None


class Linked(list[Any]):
    """The frames that :func:`links.dump <memops.worker.links>` returns for a value read from a
    linked file: one buffer over the whole file (so ``Slow`` counts its size as spilled bytes),
    and the path of that link, which :meth:`MappedFile.__setitem__` renames into the store."""

    def __init__(self, buffer: Any, path: str) -> None:
        super().__init__([buffer])
        self.path = path


def find(data: Any) -> tuple[Any, str]:
    """``(the store's zict.File, "")``, or ``(None, why not)`` when ``data`` is not distributed's
    SpillBuffer over a spill directory as this module knows it."""
    try:
        from distributed.spill import AnyKeyFile, Slow, SpillBuffer
    except ImportError as exc:  # pragma: no cover - a distributed without its spill module
        return None, f"distributed has no spill module ({exc})"
    if not isinstance(data, SpillBuffer):
        return None, f"the worker's data is a {type(data).__name__}, not distributed's SpillBuffer"
    slow = getattr(getattr(data, "slow", None), "data", None)
    if not isinstance(slow, Slow):
        return None, f"the SpillBuffer's slow layer holds a {type(slow).__name__}, not distributed's Slow"
    file = getattr(slow, "d", None)
    if not isinstance(file, AnyKeyFile) or not isinstance(getattr(file, "filenames", None), dict):
        return None, f"the spill store is a {type(file).__name__}, not distributed's AnyKeyFile"
    if not callable(getattr(slow, "dump", None)):
        return None, "the spill store's Slow layer has no dump"
    return file, ""


def mapped_file_class() -> type:
    """:class:`MappedFile`, built on the installed distributed's ``AnyKeyFile`` (defined here,
    not at import, so that importing this module needs no distributed)."""
    global _MAPPED
    if _MAPPED is not None:
        return _MAPPED
    from distributed.spill import AnyKeyFile
    from zict.common import locked

    class MappedFile(AnyKeyFile):
        @locked
        def __getitem__(self, key: Any) -> Any:
            path = os.path.join(self.directory, self.filenames[key])
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return bytearray()  # mmap refuses an empty file
                # Private, copy-on-write: writable (Dask's numpy deserializer copies a
                # read-only buffer), yet a write never reaches the file nor its other links.
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            # Unspilled, the key's file leaves the store while the map still reads its pages;
            # spilled again, the value goes back by this link rather than as a second copy.
            held = os.path.join(os.path.dirname(self.directory), HELD_DIRECTORY)
            try:
                os.makedirs(held, exist_ok=True)
                link = os.path.join(held, f"{os.getpid()}-{next(_COUNTER)}")
                os.link(path, link)
                hold(mapped, link)
            except OSError:
                pass  # spilled again as a new file, as distributed would
            return memoryview(mapped)

        @locked
        def __setitem__(self, key: Any, value: Any) -> None:
            if not isinstance(value, Linked):
                self._write(key, value, os.environ.get(owner.SOCKET_ENV))
                return
            self.discard(key)
            name = self._safe_key(key)
            os.rename(value.path, os.path.join(self.directory, name))
            self.filenames[key] = name

        def _write(self, key: Any, value: Any, owner_socket: str | None) -> None:
            """zict's ``File.__setitem__`` (called with the lock held, which the write releases),
            but on a descriptor: where there is a spill owner it allocates the file's pages before
            the bytes are written into them, and once they are in, the file's write bits go."""
            self.discard(key)
            name = self._safe_key(key)
            path = os.path.join(self.directory, name)
            frames = value if isinstance(value, list | tuple) else [value]
            with self.unlock():
                # O_EXCL: a name that a peer put in the way (a symbolic link) fails the write instead
                # of taking the bytes elsewhere.
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                with open(fd, "wb") as fh:  # an open descriptor: nothing is truncated
                    why, size = "", 0
                    if owner_socket:
                        size = sum(memoryview(frame).nbytes for frame in frames)
                        why = owner.allocate(owner_socket, fd, size) if size else "empty"
                    st = os.fstat(fd)
                    fh.writelines(frames)
                    fh.flush()
                    os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~WRITE_BITS)
            if owner_socket:
                _note_owned(self, (st.st_dev, st.st_ino), size, why)
            if key in self.filenames:  # as zict: another thread stored the key meanwhile
                os.remove(path)
            else:
                self.filenames[key] = name

    _MAPPED = MappedFile
    return MappedFile


_MAPPED: type | None = None


def _note_owned(store: Any, inode: tuple[int, int], size: int, why: str) -> None:
    if not why:
        store.__dict__.setdefault(accounting.OWNED, set()).add(inode)
    elif size:
        refused = store.__dict__.setdefault(accounting.OWNER_REFUSALS, [0, 0, ""])
        refused[0] += 1
        refused[1] += size
        refused[2] = why[:200]


def install(data: Any) -> tuple[bool, str]:
    """Put :class:`MappedFile` in the worker's spill store; ``(done, why not)``. Idempotent."""
    file, why = find(data)
    if file is None:
        return False, why
    cls = mapped_file_class()
    if type(file) is cls:
        return True, ""
    mapped: Any = object.__new__(cls)
    # One state for both objects: a thread still inside the old object's method (it releases
    # its lock while it reads or writes) and the new one see the same names, counter and lock.
    mapped.__dict__ = file.__dict__
    data.slow.data.d = mapped
    return True, ""


def uninstall(data: Any) -> None:
    """Put distributed's own ``AnyKeyFile`` back (the plugin's teardown)."""
    file, _ = find(data)
    if file is None or type(file) is not _MAPPED:
        return
    from distributed.spill import AnyKeyFile

    plain: Any = object.__new__(AnyKeyFile)
    plain.__dict__ = file.__dict__
    data.slow.data.d = plain


def mapped_base(value: Any) -> Any:
    """The ``mmap`` under a buffer (a numpy array's ``base`` chain, a memoryview's ``obj``), or None."""
    seen = 0
    while value is not None and seen < 32:
        if isinstance(value, MMAP_TYPE):
            return value
        value = getattr(value, "base", None) if not isinstance(value, memoryview) else value.obj
        seen += 1
    return None


def mappable(value: Any, depth: int = 2) -> bool:
    """Whether a value read back from its spill file would be a view of the map, holding no private
    copy: a numpy array of a fixed-size dtype, a ``memoryview``, or a dict, list or tuple of them
    (``docs/resources.md`` lists what is mapped). Pure-Python data (object arrays, strings, pandas'
    object columns) is not: it is unpickled into private memory on every read."""
    if isinstance(value, memoryview):
        return True
    dtype = getattr(value, "dtype", None)
    if dtype is not None and type(value).__name__ == "ndarray":
        return not bool(getattr(dtype, "hasobject", True))
    if depth > 0 and isinstance(value, dict | list | tuple) and value:
        items = value.values() if isinstance(value, dict) else value
        return all(mappable(item, depth - 1) for item in items)
    return False
