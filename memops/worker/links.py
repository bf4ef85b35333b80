"""Same-node fetches of spilled keys by hardlink, for every fetch: a worker plugin.

Workers of one policy on one node whose spill directories lie on one tmpfs (``sharedSpill``,
medium Node) need not send a spilled key's bytes to each other. With :class:`LinksPlugin`
installed on both (by the scheduler, :func:`install`, as :mod:`memops.worker.handover` is):

- **The sender** answers a peer's ``get_data`` itself (the worker's ``get_data`` handler is
  replaced by :meth:`Links.get_data`; the worker's handler table is distributed's extension point
  for comm operations). For a requester whose identity (``memops_links`` ``identity``: its spill
  filesystem, and that it runs this plugin) says it can link this worker's files, it first spills
  the requested keys it holds in memory that would be read back as maps
  (:meth:`Links.spill_for_peer`), then, for each requested key that is spilled, it links the spill file to
  an outbox name in its own local directory (so that an unspill or a release while the reply is
  on its way cannot remove it: the file is complete, zict names a file only once written) and
  sends, instead of the bytes, a ``Serialized`` value of the :data:`FAMILY` serialization family
  whose header is plain msgpack data: the outbox path, its inode and size. The outbox link goes
  once the requester has acknowledged. Other keys, and every key for any other requester (a
  worker without the plugin, on another node, a client, the scheduler), go as distributed sends
  them, by the same code path as the stock handler.
- **The receiver** deserializes that value with the :data:`FAMILY` deserializer registered in its
  process (distributed's ``register_serialization_family``; nothing is unpickled): it opens the
  file (:func:`memops.worker.handover.open_checked`: inside its own shared root, no ``..``, no
  symbolic link on the way, walked from the root without following one; then a regular file on
  its own device with the inode and size sent), links that descriptor's file into its local
  directory (:func:`memops.worker.handover.link_descriptor`), and reads the value as a memory map
  of the same descriptor (:mod:`memops.worker.maps`): a name that the peer swaps once checked is
  neither linked nor read. The file has no write bits by then (the spill store takes them off
  every file it writes, :meth:`Links.pin` off one written before the plugin came in): what the
  receiver maps is not rewritten or truncated unless its owner (or root) first puts them back.
  The worker stores the value as distributed does every fetched key; when the store spills it
  (a key above the target goes straight to the spill store), the Slow layer's ``dump`` (wrapped
  here) hands back :class:`memops.worker.maps.Linked` frames for that very object and the store
  renames the link into its spill directory instead of writing the bytes again. Both workers
  then hold one inode.

Where the worker's data is not distributed's SpillBuffer over files, or its ``get_data`` is not
the one this module answers for, the plugin refuses itself: :attr:`Links.status` is
:data:`REFUSED` with a :attr:`Links.reason`, reported by the ``status`` operation of its handler
and logged as an event (topic :data:`EVENTS`) in the scheduler; the worker then fetches and
serves as stock Dask does.

Imports nothing of memops but its siblings (sent by value to a stock Dask image).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import mmap
import os
import time
import weakref
from collections.abc import Collection, Sequence
from typing import Any

from distributed.diagnostics.plugin import WorkerPlugin

from memops.worker import accounting, handover, maps

logger = logging.getLogger(__name__)

NAME = "memops_links"
EVENTS = "memops-links"
FAMILY = "memops-link"
"""The serialization family of a link; its header is plain data, its frames none."""
VERSION = 1
ACTIVE = "Active"
REFUSED = "Refused"
PEER_SECONDS = 5.0
"""How long a peer's answer that it can link stands before it is asked again (a no stands 60 s)."""
STAGED_SECONDS = 60.0
"""A link received but never stored (its fetch cancelled meanwhile) is removed after this."""
CALL_SECONDS = 5.0

PEER_SPILL_BYTES = 2**20
"""A key held in memory that a same-node peer asks for is spilled first, then linked, when it is at
least this big (a smaller one is not worth a file of its own) and would be read back as a map."""

GET_DATA_PARAMETERS = ("comm", "keys", "who", "serializers")
"""The stock ``Worker.get_data``'s parameters, which :meth:`Links.get_data` answers for."""

_RECEIVERS: dict[str, Links] = {}
"""Worker address -> its receiving side, in this process (the family is registered per process)."""


class Size:
    """A frame of ``nbytes`` bytes that is never read: the spilled size of a linked file."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


def refusal(worker: Any) -> str:
    """Why this worker cannot take the plugin, or ``""``."""
    _, why = maps.find(getattr(worker, "data", None))
    if why:
        return why
    handlers = getattr(worker, "handlers", None)
    stock = getattr(worker, "get_data", None)
    if not isinstance(handlers, dict) or handlers.get("get_data") != stock or stock is None:
        return "the worker's get_data handler is not distributed's own"
    parameters = tuple(inspect.signature(stock).parameters)
    if parameters != GET_DATA_PARAMETERS:
        return f"distributed's Worker.get_data takes {parameters}, not {GET_DATA_PARAMETERS}"
    for name in ("transfer_outgoing_count", "transfer_outgoing_count_limit", "transfer_outgoing_log"):
        if not hasattr(worker, name):
            return f"the worker has no {name}"
    try:
        from distributed.protocol.serialize import Serialized, register_serialization_family  # noqa: F401
    except ImportError as exc:
        return f"distributed offers no serialization families ({exc})"
    return ""


def _register_family() -> None:
    from distributed.protocol.serialize import register_serialization_family

    # Always this copy's: a plugin installed again (by value, a newer operator) replaces the
    # functions, whose receivers are those of this copy.
    register_serialization_family(FAMILY, _dumps, _loads)


def _dumps(value: Any) -> Any:
    # Never chosen to serialize anything: a link is sent pre-serialized (Serialized).
    raise NotImplementedError(FAMILY)


def _loads(header: Any, frames: Sequence[Any]) -> Any:
    receiver = _RECEIVERS.get(str(header.get("to")))
    if receiver is None:
        raise ValueError(f"{FAMILY}: no receiver {header.get('to')!r} in this process")
    return receiver.receive(header)


class Links:
    """The plugin's state in one worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.status = REFUSED
        self.reason = ""
        self.original_get_data: Any = None
        self.original_dump: Any = None
        self.original_load: Any = None
        # id -> a value read back as a map of its own spill file (the object load made, not one
        # a task derived from it): the values whose held link may stand for them in the store.
        self.reloaded: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
        self.root = ""
        self.device = -1
        self.outbox = ""
        self.counter = itertools.count()
        self.staged: dict[int, tuple[Any, str, int, float]] = {}  # id(value) -> (value, link, size, when)
        self.peers: dict[str, tuple[bool, float]] = {}  # address -> (can link, until)
        self.sent_keys = self.sent_bytes = self.received_keys = self.received_bytes = 0

    # -- set-up -----------------------------------------------------------------------------

    def start(self) -> None:
        worker = self.worker
        why = refusal(worker)
        if not why:
            _, why = maps.install(worker.data)
        if why:
            self.reason = why
            logger.warning("memops links refused on %s: %s", worker.address, why)
            return
        self.root = handover._root(worker)
        self.device = os.stat(self.root).st_dev
        self.outbox = os.path.join(str(worker.local_directory), "memops-links")
        os.makedirs(self.outbox, exist_ok=True)
        _register_family()
        slow = worker.data.slow.data
        self.original_dump = slow.dump
        slow.dump = self.dump
        self.original_load = slow.load
        slow.load = self.load
        _RECEIVERS[worker.address] = self
        self.original_get_data = worker.handlers["get_data"]
        worker.handlers["get_data"] = self.get_data
        self.status = ACTIVE

    def stop(self) -> None:
        """Stop sending links; the receiving side stays for the life of the process, so that a
        link a peer sent before it learned of this is still read."""
        if self.original_get_data is not None and self.worker.handlers.get("get_data") == self.get_data:
            self.worker.handlers["get_data"] = self.original_get_data
        self.status = REFUSED
        self.reason = "the plugin was removed"

    def report(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "status": self.status,
            "reason": self.reason,
            "keysSent": self.sent_keys,
            "bytesSent": self.sent_bytes,
            "keysReceived": self.received_keys,
            "bytesReceived": self.received_bytes,
        }

    def identity(self) -> dict[str, Any]:
        ident = handover.identity(self.worker)
        ident["links"] = VERSION if self.status == ACTIVE else 0
        return ident

    # -- the sender -------------------------------------------------------------------------

    async def can_link(self, who: str) -> bool:
        """Whether ``who`` runs this plugin and can link this worker's files (asked, then kept
        for :data:`PEER_SECONDS`)."""
        now = time.monotonic()
        known = self.peers.get(who)
        if known is not None and known[1] > now:
            return known[0]
        try:
            ident = await self._call(who, "identity")
        except Exception as exc:
            logger.debug("memops links: no identity from %s (%s)", who, exc)
            ident = {}
        ok = (
            isinstance(ident, dict)
            and ident.get("links") == VERSION
            and handover.same_filesystem(handover.identity(self.worker), ident)
        )
        self.peers[who] = (ok, now + (PEER_SECONDS if ok else 60.0))
        return ok

    async def _call(self, address: str, operation: str) -> Any:
        reply = await _ask(address, operation, self.worker.connection_args)
        return reply.get("result") if isinstance(reply, dict) else None

    def spilled(self, keys: Collection[Any]) -> list[Any]:
        """The keys held only in the spill store's files."""
        data = self.worker.data
        file = data.slow.data.d
        return [k for k in keys if k in file.filenames and k not in data.fast]

    def pin(self, key: Any) -> tuple[str, int, int] | None:
        """Link the key's spill file to an outbox name, read-only; (name, inode, size), or None."""
        data = self.worker.data
        file = data.slow.data.d
        with file.lock:
            name = file.filenames.get(key)
            if name is None or key in data.fast:
                return None
            pinned = f"out-{next(self.counter)}"
            # A file spilled before the plugin came in was written with its write bits: the peer
            # will map it, so they go before the peer can see it.
            with handover.read_only(os.path.join(file.directory, name)) as found:
                if found is None:
                    return None
                fd, st = found
                try:
                    handover.link_descriptor(fd, self.outbox, pinned)
                except OSError:
                    return None
        return pinned, st.st_ino, st.st_size

    async def get_data(
        self, comm: Any, keys: Collection[Any], who: str | None = None, serializers: list[str] | None = None
    ) -> Any:
        """The worker's ``get_data``: as distributed's, but spilled keys go by link to a peer
        that can take them."""
        if not who or self.status != ACTIVE or not await self.can_link(who):
            return await self.original_get_data(comm, keys=keys, who=who, serializers=serializers)
        self.spill_for_peer(keys)
        if not self.spilled(keys):
            return await self.original_get_data(comm, keys=keys, who=who, serializers=serializers)
        return await self._reply(comm, list(keys), who, serializers)

    def spill_for_peer(self, keys: Collection[Any]) -> None:
        """Spill the asked keys that this worker holds in memory and would read back as maps
        (:func:`maps.mappable`), so that the peer links the file instead of receiving a private
        copy of its own: the shared-memory spill design's rule. The key's private copy here goes
        (unless a running task still holds it), and both workers then read one set of tmpfs pages,
        charged to this worker's pod. A key the store cannot spill (``max-spill`` reached, a value
        that does not serialize) stays in memory and is sent."""
        from distributed.sizeof import safe_sizeof

        fast = self.worker.data.fast
        for key in keys:
            value = fast.d.get(key) if hasattr(fast, "d") else None  # read without touching the LRU order
            if value is None or not maps.mappable(value) or safe_sizeof(value) < PEER_SPILL_BYTES:
                continue
            try:
                fast.evict(key)  # zict keeps the value in memory if the spill store refuses it
            except Exception as exc:
                logger.debug("memops links: %s stays in memory for %s: %s", key, self.worker.address, exc)

    async def _reply(self, comm: Any, keys: list[Any], who: str, serializers: list[str] | None) -> Any:
        from distributed.core import Status
        from distributed.protocol.serialize import Serialized, to_serialize

        worker = self.worker
        limit = worker.transfer_outgoing_count_limit
        if limit is not False:
            limit *= 2  # a same-host peer, as distributed allows
            if worker.status == Status.paused:
                limit = 1
            if worker.transfer_outgoing_count >= limit:
                return {"status": "busy"}
        worker.transfer_outgoing_count += 1
        worker.transfer_outgoing_count_total += 1
        pinned: list[str] = []
        data: dict[Any, Any] = {}
        linked: dict[Any, int] = {}
        sent: dict[Any, int] = {}
        try:
            for key in keys:
                pin = self.pin(key) if key in self.spilled([key]) else None
                if pin is not None:
                    name, ino, size = pin
                    pinned.append(os.path.join(self.outbox, name))
                    header = {
                        "serializer": FAMILY,
                        "version": VERSION,
                        "to": who,
                        "directory": os.path.realpath(self.outbox),
                        "name": name,
                        "inode": ino,
                        "size": size,
                    }
                    data[key] = Serialized(header, [])
                    linked[key] = worker.state.tasks[key].nbytes or 0
                elif key in worker.data:
                    data[key] = to_serialize(worker.data[key])
                    sent[key] = worker.state.tasks[key].nbytes or 0
            total = sum(sent.values())
            worker.transfer_outgoing_bytes += total
            worker.transfer_outgoing_bytes_total += total
            start = time.time()
            try:
                written = await comm.write({"status": "OK", "data": data}, serializers=serializers)
                response = await comm.read(deserializers=serializers)
                assert response == "OK", response
            except OSError:
                comm.abort()
                raise
            finally:
                worker.transfer_outgoing_bytes -= total
            stop = time.time()
        finally:
            worker.transfer_outgoing_count -= 1
            for path in pinned:  # the requester has linked them (or failed): the outbox names go
                try:
                    os.unlink(path)
                except OSError:
                    pass
        self.sent_keys += len(linked)
        self.sent_bytes += sum(linked.values())
        duration = max(0.001, stop - start)
        worker.transfer_outgoing_log.append(
            {
                "start": start + worker.scheduler_delay,
                "stop": stop + worker.scheduler_delay,
                "middle": (start + stop) / 2 + worker.scheduler_delay,
                "duration": duration,
                "who": who,
                "keys": sent,
                "linked": linked,
                "total": total,
                "compressed": written,
                "bandwidth": total / duration,
            }
        )
        return Status.dont_reply

    # -- the receiver -----------------------------------------------------------------------

    def receive(self, header: Any) -> Any:
        """The value of a link a peer sent: its file checked, linked here, read as a map."""
        from distributed.protocol.serialize import deserialize_bytes
        from distributed.sizeof import safe_sizeof

        self._expire()
        directory, name = header.get("directory"), header.get("name")
        ino, size = header.get("inode"), header.get("size")
        # Never an empty file: mmap refuses one.
        if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (ino, size)):
            raise ValueError(f"{FAMILY}: an inode or size that is not a positive count")
        try:
            fd = handover.open_checked(directory, name, self.root, self.device, ino, size)
        except ValueError as exc:
            raise ValueError(f"{FAMILY}: {exc}") from None
        try:
            linked = f"in-{next(self.counter)}"
            handover.link_descriptor(fd, self.outbox, linked)
            link = os.path.join(self.outbox, linked)
            try:
                value = deserialize_bytes(memoryview(mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)))
            except BaseException:
                os.unlink(link)
                raise
        finally:
            os.close(fd)
        self.received_keys += 1
        self.received_bytes += size
        if safe_sizeof(value) > self.worker.data.n:
            # It goes straight to the spill store, through dump below: keep the link for it.
            self.staged[id(value)] = (value, link, size, time.monotonic())
            accounting.note_linked(self.worker, self.device, ino)
        else:
            # Kept in memory, as a map of the peer's pages; the link stays while the map does, so
            # that a later spill renames it into the store instead of writing the pages again.
            self._remember(value)
            mapped = maps.mapped_base(value)
            if mapped is not None and self.reloaded.get(id(value)) is value:
                maps.hold(mapped, link, from_peer=True)
            else:
                os.unlink(link)
        return value

    def load(self, frames: Any) -> Any:
        """The Slow layer's ``load``: a value read back as a view of its spill file's map is
        remembered, so that :meth:`dump` can put it back by the held link."""
        value = self.original_load(frames)
        mapped = maps.mapped_base(frames)
        if mapped is not None and maps.mapped_base(value) is mapped:
            self._remember(value)
        return value

    def _remember(self, value: Any) -> None:
        try:
            self.reloaded[id(value)] = value
        except TypeError:  # not weakly referenceable (a dict of arrays): spilled as a new file
            pass

    def dump(self, value: Any) -> Any:
        """The Slow layer's ``dump``: a value read from a link goes back as that link."""
        entry = self.staged.pop(id(value), None)
        if entry is not None:
            if entry[0] is value:
                return maps.Linked(Size(entry[2]), entry[1])
            self.staged[id(value)] = entry
        if self.reloaded.get(id(value)) is value:
            held = maps.take_held(value)
            if held is not None:
                path, from_peer = held
                try:
                    st = os.lstat(path)
                except OSError:
                    st = None
                if st is not None:
                    if from_peer:
                        accounting.note_linked(self.worker, st.st_dev, st.st_ino)
                    return maps.Linked(Size(st.st_size), path)
        return self.original_dump(value)

    def _expire(self) -> None:
        now = time.monotonic()
        for ident, (_, link, _, when) in list(self.staged.items()):
            if now - when > STAGED_SECONDS:
                del self.staged[ident]
                try:
                    os.unlink(link)
                except OSError:
                    pass


def handler(links: Links) -> Any:
    def handle(operation: str = "", **arguments: Any) -> dict[str, Any]:
        if operation == "identity":
            return {"result": links.identity()}
        if operation == "status":
            return {"result": links.report()}
        if operation == "spill":
            return {"result": accounting.report(links.worker)}
        return {"error": f"unknown operation {operation!r}"}

    return handle


class LinksPlugin(WorkerPlugin):
    """Same-node fetches of spilled keys by link, and spilled keys read back as maps."""

    name = NAME

    def __init__(self) -> None:
        self.links: Links | None = None

    def setup(self, worker: Any) -> None:
        links = Links(worker)
        try:
            links.start()
        except Exception as exc:  # a refusal, never a worker that fails to start
            links.reason = f"{type(exc).__name__}: {exc}"
            links.status = REFUSED
            logger.warning("memops links refused on %s: %s", worker.address, links.reason)
        self.links = links
        worker.handlers[NAME] = handler(links)
        worker.log_event(EVENTS, {"worker": worker.address, "status": links.status, "reason": links.reason})

    def teardown(self, worker: Any) -> None:
        if self.links is not None:
            self.links.stop()
        worker.handlers.pop(NAME, None)


# -- the scheduler's side -----------------------------------------------------------------------


async def install(scheduler: Any) -> None:
    """Register the plugin on every worker, present and future (idempotent)."""
    from distributed.protocol.pickle import dumps

    if NAME in scheduler.worker_plugins:
        return
    await scheduler.register_worker_plugin(None, dumps(LinksPlugin()), name=NAME, idempotent=True)


NO_PLUGIN = "no plugin"
NO_ANSWER = "no answer"


def unsettled(verdict: Any) -> bool:
    """A worker's verdict that may change by itself: no plugin yet (it joined as the plugin was
    registered), or no answer."""
    reason = verdict.get("reason") if isinstance(verdict, dict) else None
    return isinstance(reason, str) and (reason == NO_PLUGIN or reason.startswith(NO_ANSWER))


async def _ask_all(scheduler: Any, operation: str) -> dict[str, Any]:
    """Worker address -> the ``result`` of its plugin's ``operation`` (a map), or
    ``{"status": "Refused", "reason": ...}`` for a worker that does not answer it plainly."""

    async def one(address: str) -> Any:
        try:
            reply = await _ask(address, operation, scheduler.connection_args)
        except Exception as exc:
            return {"status": REFUSED, "reason": f"{NO_ANSWER}: {type(exc).__name__}"}
        result = reply.get("result") if isinstance(reply, dict) else None
        return result if isinstance(result, dict) else {"status": REFUSED, "reason": NO_PLUGIN}

    addresses = list(scheduler.workers)
    return dict(zip(addresses, await asyncio.gather(*(one(a) for a in addresses)), strict=True))


async def statuses(scheduler: Any) -> dict[str, Any]:
    """Worker address -> its plugin's ``status`` report (:meth:`Links.report`)."""
    return await _ask_all(scheduler, "status")


async def spill(scheduler: Any) -> dict[str, Any]:
    """Worker address -> ``{"files", "bytes", "sharedBytes", "ownBytes", "ownerBytes", "share"}``: its
    spill with each inode once, what of it the worker wrote itself, what its pod's spill owner
    allocated for it, and its share of its node's
    (:func:`memops.worker.accounting.shares`, per kernel: inode numbers are compared only between
    workers of one node)."""
    found = await _ask_all(scheduler, "spill")
    nodes: dict[str, dict[str, Any]] = {}
    for address, report in found.items():
        if isinstance(report.get("inodes"), (list, tuple)):
            nodes.setdefault(str(report.get("boot")), {})[address] = report["inodes"]
    result: dict[str, Any] = {}
    for reports in nodes.values():
        shares, _ = accounting.shares(reports)
        for address, share in shares.items():
            figures = found[address]
            result[address] = {
                "files": figures.get("files", 0),
                "bytes": figures.get("bytes", 0),
                "sharedBytes": figures.get("sharedBytes", 0),
                "ownBytes": figures.get("ownBytes", 0),
                "ownerBytes": figures.get("ownerBytes", 0),
                "share": int(share),
            }
    return result


async def _ask(address: str, operation: str, connection_args: dict[str, Any]) -> Any:
    """A peer's plugin's answer to ``operation``, over a connection of its own, checked to be
    plain data (:func:`memops.worker.handover.plain`) before anything reads it."""
    reply = await handover.call_once(
        address, {"op": NAME, "operation": operation, "reply": True}, connection_args, CALL_SECONDS
    )
    handover.plain(reply)
    return reply
