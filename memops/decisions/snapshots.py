"""The scheduler snapshot model, and pure figures over it: who holds what, what moved, what was lost.

No I/O and no Dask imports. :mod:`memops.clients.daskrpc` builds a :class:`SchedulerSnapshot` from
what the scheduler answers; the controllers, the deciding code and the benchmarks call the
functions here. Which workers a RetirementRequest retires is decided in
:mod:`memops.decisions.retire_choice`.
Keys are Dask's keys as the scheduler sends them (strings, or tuples of them), worker
addresses are Dask comm addresses. A worker belongs to the pod whose IP its address carries
(:func:`workers_by_pod`), or failing that to the pod it is named after.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class WorkerInfo:
    """One connected worker, as the scheduler sees it."""

    name: str
    address: str
    memory_limit: int = 0
    managed_bytes: int = 0
    unique_bytes: int = 0
    unique_keys: int = 0
    nkeys: int = 0
    status: str = "running"
    process_bytes: int = 0  # the worker process' RSS, as its last heartbeat reported it
    spilled_bytes: int = 0  # bytes the worker spilled to disk
    unmanaged_bytes: int = 0  # process memory minus the Dask data held in memory (the scheduler's "unmanaged")
    in_shuffle: bool = False  # running a P2P shuffle's tasks: retiring it would stall the shuffle


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The workers and the key placement at one moment."""

    workers: tuple[WorkerInfo, ...]
    who_has: Mapping[Hashable, tuple[str, ...]] = field(default_factory=dict)
    """Who holds which key, for the keys asked for (Dask's keys, as the scheduler names them)."""
    nbytes: Mapping[Hashable, int] = field(default_factory=dict)
    drains: Mapping[str, Any] | None = None
    """memops' drains in the scheduler, as its agent reports them (worker address -> figures,
    hostile input: each entry is checked where it is read), when asked for and answered; else None."""
    departures: Sequence[Any] | None = None
    """Workers that left the scheduler with keys held nowhere else, as memops' agent reports them
    (hostile input, checked where it is read: :func:`memops.decisions.worker_loss_decisions.parse`), when
    asked for with the drains and answered; else None."""

    def by_name(self, name: str) -> WorkerInfo | None:
        return self._by_name.get(name)

    def by_address(self, address: str) -> WorkerInfo | None:
        return self._by_address.get(address)

    def named_by_pod(self, pods_by_worker_name: Mapping[str, str]) -> SchedulerSnapshot:
        """The same snapshot with each worker renamed to its pod, where the mapping names it."""
        if not pods_by_worker_name:
            return self
        workers = tuple(
            replace(w, name=pods_by_worker_name[w.name]) if w.name in pods_by_worker_name else w for w in self.workers
        )
        return replace(self, workers=workers)

    # Built once per snapshot: callers look up every pod of a workload, which must not cost
    # workers x pods. The first worker wins when two share a name (it does not happen in Dask,
    # which refuses a second worker with a name already in use).
    @cached_property
    def _by_name(self) -> dict[str, WorkerInfo]:
        return {w.name: w for w in reversed(self.workers)}

    @cached_property
    def _by_address(self) -> dict[str, WorkerInfo]:
        return {w.address: w for w in reversed(self.workers)}


def holdings(
    who_has: Mapping[Hashable, Sequence[str]], nbytes: Mapping[Hashable, int]
) -> dict[str, tuple[int, int, int, int]]:
    """Address -> (bytes held, keys held, bytes held by no other worker, keys held by no other
    worker), in one pass over the keys: the figures :mod:`memops.scheduler.holdings` sums inside
    the scheduler, for a scheduler that does not run it. This one's cost grows with the keys.
    """
    result: dict[str, list[int]] = {}
    for key, holders in who_has.items():
        size = nbytes.get(key, 0)
        alone = len(holders) == 1
        for holder in holders:
            entry = result.get(holder)
            if entry is None:
                entry = result[holder] = [0, 0, 0, 0]
            entry[0] += size
            entry[1] += 1
            if alone:
                entry[2] += size
                entry[3] += 1
    return {address: (e[0], e[1], e[2], e[3]) for address, e in result.items()}


@dataclass(frozen=True)
class PodInfo:
    """What the mapping of workers to pods reads of one pod (:func:`memops.controllers.workloads.pod_info`)."""

    name: str
    ips: tuple[str, ...] = ()  # status.podIP and status.podIPs
    worker_names: tuple[str, ...] = ()  # the names its worker may carry: the pod's, DASK_WORKER_NAME
    phase: str = "Running"
    node: str = ""  # spec.nodeName: where it runs, once scheduled
    host_network: bool = False  # spec.hostNetwork: its IP is its node's
    host_ips: tuple[str, ...] = ()  # status.hostIP and status.hostIPs

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def owns_ips(self) -> bool:
        """Whether its IPs are its own: not when it has terminated (another pod may have them now),
        nor when they are its node's (``hostNetwork``, or a pod IP that is the host IP), which every
        hostNetwork pod on that node shares, whatever its namespace."""
        hosts = {canonical_ip(ip) for ip in self.host_ips}
        on_host = self.host_network or any(canonical_ip(ip) in hosts for ip in self.ips)
        return not self.terminated and not on_host


def address_host(address: str) -> str:
    """The host of a Dask comm address (``tcp://10.0.0.5:8786``, ``tls://[fd00::1]:8786``), as an
    IP address in its canonical form where it is one, so that two spellings compare equal."""
    rest = address.split("://", 1)[-1]
    if rest.startswith("["):
        host = rest[1:].split("]", 1)[0]
    else:
        host = rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest
    return canonical_ip(host)


def canonical_ip(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return text


def nodes_of_workers(pods: Sequence[PodInfo], workers: Sequence[WorkerInfo]) -> dict[str, str]:
    """Worker address -> the node of its pod, for every worker whose pod is scheduled: what
    memops' drain needs to choose recipients off a dying node (a worker not in it counts as
    on another node)."""
    node_of = {pod.name: pod.node for pod in pods if pod.node and not pod.terminated}
    return {
        worker.address: node_of[pod]
        for pod, found in workers_by_pod(pods, workers).items()
        if pod in node_of
        for worker in found
    }


def workers_by_pod(pods: Sequence[PodInfo], workers: Sequence[WorkerInfo]) -> dict[str, tuple[WorkerInfo, ...]]:
    """Pod name -> the connected workers that run in it; every pod is a key, with () for none.

    A worker belongs to the pod whose IP is its address' host (primary: pod IPs are unique in a
    cluster, and ``dask worker`` without ``--name``, or with ``--nworkers 2``, names its workers
    otherwise), else to the pod whose name (or ``DASK_WORKER_NAME``) is the worker's name.
    Terminated pods own no address: their IP may already be another pod's; nor do hostNetwork
    pods: their IP is their node's (:attr:`PodInfo.owns_ips`).
    """
    by_ip = {canonical_ip(ip): pod.name for pod in pods if pod.owns_ips for ip in pod.ips}
    by_name = {name: pod.name for pod in pods for name in (pod.name, *pod.worker_names)}
    found: dict[str, list[WorkerInfo]] = {pod.name: [] for pod in pods}
    for worker in workers:
        pod = by_ip.get(address_host(worker.address)) or by_name.get(worker.name)
        if pod is not None:
            found[pod].append(worker)
    return {pod: tuple(ws) for pod, ws in found.items()}


SHUFFLE_PREFIXES = ("shuffle-transfer-", "shuffle-barrier-")
"""Key prefixes of dask's P2P shuffle tasks (dask/dataframe/dask_expr/_shuffle.py, distributed/shuffle)."""


def in_shuffle(processing: Sequence[str]) -> bool:
    """Whether a worker processing these (stringified) keys takes part in a P2P shuffle now."""
    return any(prefix in key for key in processing for prefix in SHUFFLE_PREFIXES)


def _unique_keys_of(before: Mapping[Hashable, tuple[str, ...]], address: str) -> list[Hashable]:
    """The keys that ``address`` held and no other worker did."""
    alone = (address,)  # one tuple comparison a key: this runs over every key the worker held
    return [key for key, holders in before.items() if holders == alone]


def bytes_moved(
    before: Mapping[Hashable, tuple[str, ...]],
    after: Mapping[Hashable, tuple[str, ...]],
    nbytes: Mapping[Hashable, int],
    address: str,
) -> tuple[int, int]:
    """Of the keys only ``address`` held before, (bytes, keys) that another worker holds now."""
    alone = (address,)
    moved = [k for k in _unique_keys_of(before, address) if (holders := after.get(k)) and holders != alone]
    return sum(map(nbytes.get, moved, itertools.repeat(0))), len(moved)


def bytes_lost(
    before: Mapping[Hashable, tuple[str, ...]],
    after: Mapping[Hashable, tuple[str, ...]],
    nbytes: Mapping[Hashable, int],
    address: str,
) -> tuple[int, int]:
    """Of the keys only ``address`` held before, (bytes, keys) that no worker holds now.

    A key still held by ``address`` alone is neither moved nor lost: it is still there.
    A key that its client released meanwhile counts as lost: the scheduler forgets lost and
    released keys alike, and overstating a loss is the safe side of the report.
    """
    lost = [k for k in _unique_keys_of(before, address) if not after.get(k)]
    return sum(map(nbytes.get, lost, itertools.repeat(0))), len(lost)
