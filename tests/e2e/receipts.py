"""Where a drain's keys landed: every key a worker receives, told to the scheduler as it happens.

A drain's copies are ``acquire-replicas``: the recipient fetches the key from a peer, and the key
goes ``flight -> memory`` on it. :class:`Receipts`, a worker plugin, logs each such arrival as a
scheduler event, on the worker's own stream to the scheduler, so the record outlives the worker:
a recipient that was leaving too is gone by the time the test looks, and its receipts are still there.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import cloudpickle
import distributed
from distributed.diagnostics.plugin import WorkerPlugin

TOPIC = "memops-test-receipts"


class Receipts(WorkerPlugin):
    """Logs ``{"key", "worker"}`` (the worker's address) under :data:`TOPIC` for every key that
    arrives from a peer."""

    name = "memops-test-receipts"

    def __init__(self, prefixes: Collection[str]) -> None:
        self.prefixes = tuple(prefixes)
        self.worker: Any = None

    def setup(self, worker: Any) -> None:
        self.worker = worker

    def transition(self, key: Any, start: str, finish: str, **kwargs: Any) -> None:
        # Fetched from a peer. Scattered keys arrive otherwise (released -> memory), and the
        # worker's own results from executing.
        if start == "flight" and finish == "memory" and str(key).startswith(self.prefixes):
            self.worker.log_event(TOPIC, {"key": str(key), "worker": str(self.worker.address)})


def install(client: distributed.Client, prefixes: Collection[str]) -> None:
    """On every worker, and on those that join later."""
    module = sys.modules[Receipts.__module__]
    cloudpickle.register_pickle_by_value(module)  # the workers cannot import the tests
    client.register_plugin(Receipts(prefixes))


@dataclass(frozen=True)
class Landing:
    """What the receipts say about ``keys`` moved off the ``leaving`` pods' workers."""

    keys: int
    receipts: int  # every arrival of one of the keys, on any worker
    by_worker: Mapping[str, int]
    unreceived: list[str]  # moved keys that no worker received
    repeated: dict[str, int]  # keys received more than once, and how often
    on_leaving: dict[str, int]  # receipts by workers that were leaving too, by worker

    @property
    def per_key(self) -> float:
        return self.receipts / max(self.keys, 1)

    def line(self) -> str:
        return (
            f"{self.keys} keys, {self.receipts} receipts ({self.per_key:.2f} per key moved), "
            f"by worker {dict(sorted(self.by_worker.items()))}, {sum(self.on_leaving.values())} on a leaving worker"
        )


def landing(
    client: distributed.Client, keys: Collection[str], pod_of: Mapping[str, str], leaving: Collection[str]
) -> Landing:
    """Read the receipts of ``keys``; ``pod_of``: worker address -> its pod, every worker that
    could have received one; ``leaving``: the pods being deleted (a worker not in ``pod_of``
    counts as one of theirs: unknown is no proof)."""
    wanted = set(keys)
    per_key: Counter[str] = Counter()
    by_worker: Counter[str] = Counter()
    for _, msg in client.get_events(TOPIC):
        if isinstance(msg, dict) and msg.get("key") in wanted:
            per_key[str(msg["key"])] += 1
            by_worker[str(msg["worker"])] += 1
    gone = set(leaving)
    on_leaving: defaultdict[str, int] = defaultdict(int)
    for worker, count in by_worker.items():
        if worker not in pod_of or pod_of[worker] in gone:
            on_leaving[worker] += count
    return Landing(
        keys=len(wanted),
        receipts=sum(per_key.values()),
        by_worker=dict(by_worker),
        unreceived=sorted(wanted - set(per_key)),
        repeated={k: n for k, n in per_key.items() if n > 1},
        on_leaving=dict(on_leaving),
    )
