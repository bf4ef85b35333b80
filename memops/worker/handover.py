"""Zero-copy hand-over of spilled keys between workers that share a spill filesystem.

Workers of one policy on one node, whose spill directories lie on one tmpfs (the ``Node`` medium
of ``sharedSpill``), need not copy a spilled key over the network: the receiver hardlinks the
sender's spill file into its own spill directory and registers the key as spilled, without
reading it. Both workers then hold the key; the tmpfs pages exist once, and are freed when the
last of the two links goes (the sender's, when it is drained and closed).

Two halves, both in this module, which imports nothing of memops (it is sent by value):

- In each worker, :class:`HandoverPlugin` (a worker plugin that the scheduler installs on every
  worker, present and future, through ``register_worker_plugin``, so a stock Dask image works)
  registers the comm handler :data:`NAME`, whose operations answer plain data only:

  - ``identity``: the worker's spill directory, the shared root it lies in (the parent of the
    worker's own local directory, where every worker on the node makes its own), that root's
    device and inode, and the kernel's boot id: two workers may link each other's files when all
    of these but the directory are equal (:func:`same_filesystem`). The inode tells one shared
    directory (a hostPath tmpfs) from two directories that look alike in two containers (two
    emptyDirs on one node's disk, each mounted at the same path);
  - ``offer`` (``keys``): for each key, ``[file name, inode, size]`` of its spill file when it
    is spilled and not in memory, else None;
  - ``take`` (``directory``, ``entries`` of ``[key, file name, inode, size, nbytes]``): links
    each file into its own spill directory and registers the key as spilled (:func:`take`),
    then tells the scheduler it holds them (``add-keys``); returns the indexes of the entries
    taken. A file is linked only when its path, resolved, is a regular file in a directory of
    the receiver's own shared root, on the receiver's device, with the inode and size that the
    sender reported; anything else is refused and falls back to the normal transfer. The file is
    opened from the root down without following a symbolic link (:func:`open_checked`), checked
    on its descriptor, and linked from that descriptor (:func:`link_descriptor`): a name that a
    peer swaps after the checks (for a symbolic link to a file outside the root) is never linked.

  The sender takes the write bits off each file it offers (its owner can): a peer may read it
  as a map from then on, and a map of a file that is rewritten changes under its reader, or
  ends its process with SIGBUS where the file is truncated.

  The shared root lies in the pod's spill mount, which is its policy's own directory of the node's
  tmpfs (``<root>/<namespace>/<policy>``, :func:`memops.decisions.shared_spill.spill_directory`): "inside
  its own shared root" means inside its policy's directory, so another tenant's file is never
  linked, whatever it is named. Paths are the ones each worker sees: two workers of one policy
  mount the one directory at the same mount path, so the sender's path names the same file in
  the receiver's mount, and the link stays inside that one mount (link(2) across two bind mounts
  fails with EXDEV even on one filesystem).

- In the scheduler, :func:`install` registers the plugin, :func:`call` calls a worker's
  handler and reads the reply with ``deserialize=False`` and :func:`plain`, so that anything but
  maps, lists, strings, numbers, booleans, None and bytes is refused, and :func:`hand_over`
  moves keys from one worker to another by link, returning those it could not (which the caller
  sends with ``acquire-replicas``, the normal transfer). :mod:`memops.scheduler.drain` uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from distributed.comm.core import connect
from distributed.diagnostics.plugin import WorkerPlugin

logger = logging.getLogger(__name__)

NAME = "memops_handover"
VERSION = 1
CALL_SECONDS = 10.0
"""A worker that does not answer a hand-over call in this time gets the normal transfer."""
BOOT_ID = "/proc/sys/kernel/random/boot_id"
"""One kernel's identity: pods on one node share it (it is not namespaced), other nodes do not."""
WRITE_BITS = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
"""Taken off a spill file once a peer may hold it (:mod:`memops.worker.maps` takes them off every
file it writes)."""


class Refused(Exception):
    """A worker's reply was not plain data, or not of the expected shape."""


# -- plain data ---------------------------------------------------------------------------------

_SCALARS = (str, int, float, bool, bytes, type(None))


def plain(value: Any, depth: int = 0) -> Any:
    """``value`` if it is plain data (maps with scalar keys, lists, tuples, str, int, float,
    bool, bytes, None) at most 16 levels deep; else :class:`Refused`. A reply read with
    ``deserialize=False`` carries a serialized object as an opaque ``Serialized``: refused here."""
    if depth > 16:
        raise Refused("nested too deeply")
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            plain(item, depth + 1)
        return value
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, _SCALARS):
                raise Refused(f"a map key of type {type(k).__name__}")
            plain(v, depth + 1)
        return value
    raise Refused(f"a value of type {type(value).__name__}")


async def call_once(address: str, message: dict[str, Any], connection_args: Mapping[str, Any], seconds: float) -> Any:
    """Send ``message`` (a handler's call, with ``"reply": True``) to the Dask server at ``address``
    on a connection of its own, closed after the one reply, and return that reply as read with
    ``deserialize=False``; whatever fails is raised (``TimeoutError`` when the connection, the call
    and the close take more than ``seconds`` together).

    Not rpc's send_recv, which unpickles the exception of an error reply. The reply is not checked
    here: each caller passes it through :func:`plain` before reading it, and decides what an
    error means for its own call. The one way that memops' plugins (this module's, the memory
    limits' and the links') call a peer, so that they cannot drift apart."""
    async with asyncio.timeout(seconds):
        comm = await connect(address, deserialize=False, **connection_args)
        try:
            await comm.write(message)
            return await comm.read()
        finally:
            await comm.close()


# -- the worker's side --------------------------------------------------------------------------


def _spill_file(worker: Any) -> Any:
    """The worker's ``zict.File`` of spilled keys, or None when it does not spill to files."""
    data = getattr(getattr(worker, "state", None), "data", None)
    slow = getattr(data, "_slow_uncached", None)
    file = getattr(slow, "d", None)
    if file is None or not isinstance(getattr(file, "filenames", None), dict):
        return None
    return file


def _root(worker: Any) -> str:
    """The directory in which every worker of the policy on the node makes its own
    (``dask-scratch-space``, in the pod's spill mount: its policy's directory)."""
    return os.path.realpath(os.path.dirname(os.path.realpath(str(worker.local_directory))))


def _boot_id() -> str:
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def identity(worker: Any) -> dict[str, Any]:
    file = _spill_file(worker)
    if file is None:
        return {"version": VERSION, "directory": ""}
    root = _root(worker)
    st = os.stat(root)
    return {
        "version": VERSION,
        "directory": os.path.realpath(file.directory),
        "root": root,
        "device": st.st_dev,
        "inode": st.st_ino,
        "boot": _boot_id(),
    }


def offer(worker: Any, keys: Sequence[Any] = ()) -> list[Any]:
    file = _spill_file(worker)
    data = worker.state.data
    result: list[Any] = []
    for key in keys:
        entry = None
        if file is not None and key in file.filenames and key not in data.fast:
            name = file.filenames[key]
            with read_only(os.path.join(file.directory, name)) as found:
                if found is not None:
                    entry = [name, found[1].st_ino, found[1].st_size]
        result.append(entry)
    return result


@contextlib.contextmanager
def read_only(path: str) -> Iterator[tuple[int, os.stat_result] | None]:
    """The regular file at ``path`` (not a symbolic link), open, its write bits taken off: its
    descriptor and status; None when it is not there, not regular, or not this process's to change."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        yield None
        return
    try:
        found: tuple[int, os.stat_result] | None = None
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                # Only write bits go: a mode never grants a read that it did not grant before.
                os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~WRITE_BITS)
                found = (fd, st)
        except OSError:
            pass
        yield found
    finally:
        os.close(fd)


def _source_path(directory: str, name: str, root: str) -> str | None:
    """The path of a peer's spill file, checked: ``name`` is one path component, the directory
    resolves inside ``root`` (the receiver's own shared root), and nothing in between is a link."""
    if not isinstance(directory, str) or not isinstance(name, str):
        return None
    if not name or name in (".", "..") or "/" in name or "\0" in name or "\0" in directory:
        return None
    resolved = os.path.realpath(directory)
    if resolved != os.path.normpath(directory) or ".." in directory.split(os.sep):
        return None  # a symlink or a detour: the sender reports its spill directory resolved
    if os.path.commonpath([resolved, root]) != root or resolved == root:
        return None
    return os.path.join(resolved, name)


def open_checked(directory: Any, name: Any, root: str, device: int, inode: int, size: int) -> int:
    """A descriptor, read-only, of the peer's file ``name`` in ``directory``: a path inside ``root``
    (:func:`_source_path`), walked from ``root`` one directory at a time without following a
    symbolic link, to a regular file on ``device`` with ``inode`` and ``size``. ValueError or
    OSError otherwise. What the caller reads and links is this descriptor's file, whatever a peer
    renames afterwards."""
    source = _source_path(directory, name, root)
    if source is None:
        raise ValueError(f"{directory!r}/{name!r} is not inside {root}")
    here = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in os.path.relpath(os.path.dirname(source), root).split(os.sep):
            # A directory swapped for a symbolic link since _source_path resolved the path fails
            # here (ENOTDIR, ELOOP) instead of leading out of the root.
            inner = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
            os.close(here)
            here = inner
        # O_NONBLOCK: a FIFO put in the file's place would otherwise hold the worker's event loop in open.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=here)
    finally:
        os.close(here)
    try:
        st = os.fstat(fd)
        # The device too: inode numbers repeat across filesystems (a new tmpfs counts from 2).
        if not stat.S_ISREG(st.st_mode) or st.st_dev != device or st.st_ino != inode or st.st_size != size:
            raise ValueError(f"{source} is not the file that was reported")
    except BaseException:
        os.close(fd)
        raise
    return fd


def link_descriptor(fd: int, directory: str, name: str) -> None:
    """Link the file open at ``fd`` as ``name`` in ``directory``: the descriptor's own file, never
    what its former name has become. linkat(2) with AT_SYMLINK_FOLLOW of the descriptor's
    ``/proc/self/fd`` entry (AT_EMPTY_PATH would need CAP_DAC_READ_SEARCH); os.link makes that
    call only when given a directory descriptor, and otherwise calls link(2), which would link the
    ``/proc`` entry itself."""
    where = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=where, follow_symlinks=True)
    finally:
        os.close(where)


def take(worker: Any, directory: str = "", entries: Sequence[Any] = ()) -> list[int]:
    """Link the peer's spill files of ``entries`` into this worker's spill directory; the
    indexes of the entries taken. Called on the worker's event loop, like every handler, so the
    worker's state does not change under it."""
    file = _spill_file(worker)
    if file is None:
        return []
    state = worker.state
    data = state.data
    slow = data._slow_uncached
    root = _root(worker)
    device = os.stat(root).st_dev
    taken: list[int] = []
    keys: list[Any] = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, (list, tuple)) or len(entry) != 5:
            continue
        key, name, ino, size, nbytes = entry
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (ino, size, nbytes)):
            continue
        # Only a key this worker does not know: no task waits for it, nothing fetches it.
        if key in state.tasks or key in data:
            continue
        try:
            fd = open_checked(directory, name, root, device, ino, size)
        except (ValueError, OSError):
            continue
        cache = data.slow  # zict.Cache over Slow: it keeps a generation per key
        try:
            with data.lock, cache.lock, file.lock:
                target = file._safe_key(str(key))
                try:
                    link_descriptor(fd, file.directory, target)
                except OSError:
                    continue
                # Its pages stay charged to the retiring worker's cgroup, then its parent's
                # (memops.worker.accounting.LINKED_IN, by name: this module imports nothing of memops).
                linked_in = worker.__dict__.setdefault("_memops_linked_in", set())
                linked_in.add((device, ino))
                # What Slow.__setitem__ and Cache.__setitem__ record, without the write.
                file.filenames[key] = target
                weight = type(slow.total_weight)(nbytes, size)
                slow.weight_by_key[key] = weight
                slow.total_weight += weight
                cache._gen += 1
                cache._last_updated[key] = cache._gen
        finally:
            os.close(fd)
        _register(state, key, nbytes)
        taken.append(index)
        keys.append(key)
    if keys:
        worker.batched_send({"op": "add-keys", "keys": keys, "stimulus_id": f"memops-handover-{time.time()}"})
    return taken


def _register(state: Any, key: Any, nbytes: int) -> None:
    """The key in memory in the worker's state machine, as ``_transition_to_memory`` leaves a
    scattered key, except that its value is already in the spill store (a transition would
    write the value into ``data``, which is what the hand-over avoids)."""
    from distributed.worker_state_machine import TaskState

    ts = TaskState(key)
    state.tasks[key] = ts
    state.task_counter.new_task(ts)
    ts.state = "memory"
    ts.nbytes = nbytes
    state.nbytes += nbytes
    state.log.append((key, "memops-handover", f"memops-handover-{time.time()}", time.time()))


def handler(worker: Any) -> Any:
    def handle(operation: str = "", **arguments: Any) -> dict[str, Any]:
        if operation == "identity":
            return {"result": identity(worker)}
        if operation == "offer":
            return {"result": offer(worker, keys=list(arguments.get("keys") or ()))}
        if operation == "take":
            return {
                "result": take(
                    worker, directory=str(arguments.get("directory") or ""), entries=arguments.get("entries") or ()
                )
            }
        return {"error": f"unknown operation {operation!r}"}

    return handle


class HandoverPlugin(WorkerPlugin):
    """Registers the hand-over handler on a worker (installed by the scheduler)."""

    name = NAME

    def setup(self, worker: Any) -> None:
        worker.handlers[NAME] = handler(worker)

    def teardown(self, worker: Any) -> None:
        worker.handlers.pop(NAME, None)


# -- the scheduler's side -----------------------------------------------------------------------


async def install(scheduler: Any) -> None:
    """Register the plugin on every worker, present and future (idempotent)."""
    from distributed.protocol.pickle import dumps

    if NAME in scheduler.worker_plugins:
        return
    await scheduler.register_worker_plugin(None, dumps(HandoverPlugin()), name=NAME, idempotent=True)


async def call(scheduler: Any, address: str, operation: str, **arguments: Any) -> Any:
    """A worker's hand-over handler's ``result``, checked to be plain data; :class:`Refused`
    otherwise (an error, a reply of another shape, no answer in :data:`CALL_SECONDS`)."""
    # Here an error is only a reply without a result.
    message = {"op": NAME, "operation": operation, "reply": True, **arguments}
    try:
        reply = await call_once(address, message, scheduler.connection_args, CALL_SECONDS)
    except Exception as exc:
        raise Refused(f"{address}: {type(exc).__name__}: {exc}") from None
    plain(reply)
    if not isinstance(reply, dict) or "result" not in reply:
        raise Refused(f"{address}: no result in its reply")
    return reply["result"]


def same_filesystem(a: Any, b: Any) -> bool:
    """Two identities whose spill directories are on one filesystem of one kernel."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    fields = ("root", "device", "inode", "boot")
    return (
        bool(a.get("directory"))
        and bool(b.get("directory"))
        and bool(a.get("boot"))
        and all(a.get(f) == b.get(f) for f in fields)
        and a.get("directory") != b.get("directory")
    )


def group(ident: Any) -> str | None:
    """A name for the filesystem of an identity (equal for workers that can link each other's files)."""
    if not isinstance(ident, dict) or not ident.get("directory") or not ident.get("boot"):
        return None
    return f"{ident.get('boot')}:{ident.get('device')}:{ident.get('inode')}:{ident.get('root')}"


async def identify(scheduler: Any, address: str) -> dict[str, Any]:
    """A worker's identity, or ``{}`` (no hand-over) when it does not answer plainly."""
    try:
        ident = await call(scheduler, address, "identity")
    except Refused as exc:
        logger.info("memops hand-over: no identity from %s (%s)", address, exc)
        return {}
    if not isinstance(ident, dict) or not isinstance(ident.get("directory"), str):
        return {}
    return ident


async def hand_over(
    scheduler: Any, source: str, target: str, keys: Sequence[Any], directory: str
) -> tuple[list[Any], list[Any]]:
    """Move ``keys`` from ``source`` to ``target`` by link; (keys linked, keys left for the normal
    transfer). ``directory``: the source's spill directory, from its identity."""
    try:
        offered = await call(scheduler, source, "offer", keys=list(keys))
        if not isinstance(offered, (list, tuple)) or len(offered) != len(keys):
            raise Refused(f"{source}: an offer of another length")
        entries: list[list[Any]] = []
        offered_keys: list[Any] = []
        for key, item in zip(keys, offered, strict=True):
            if not isinstance(item, (list, tuple)) or len(item) != 3:
                continue
            name, ino, size = item
            ts = scheduler.tasks.get(key)
            if ts is None or not isinstance(name, str) or not isinstance(ino, int) or not isinstance(size, int):
                continue
            entries.append([key, name, ino, size, max(int(ts.nbytes), 0)])
            offered_keys.append(key)
        if not entries:
            return [], list(keys)
        indexes = await call(scheduler, target, "take", directory=directory, entries=entries)
        if not isinstance(indexes, (list, tuple)):
            raise Refused(f"{target}: take answered no list")
        taken = {i for i in indexes if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(offered_keys)}
    except Refused as exc:
        logger.info("memops hand-over from %s to %s refused: %s", source, target, exc)
        return [], list(keys)
    linked = [offered_keys[i] for i in sorted(taken)]
    linked_set = {offered_keys[i] for i in taken}
    return linked, [k for k in keys if k not in linked_set]
