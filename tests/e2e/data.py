"""Unique, unrecomputable data on chosen workers (scattered), and a check that none is lost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import distributed

from tests import polling


@dataclass
class Holdings:
    """Scattered keys, by the pod (worker name) that held them first. Keeps the futures alive."""

    client: distributed.Client
    futures: dict[str, distributed.Future] = field(default_factory=dict)
    values: dict[str, bytes] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)

    def keys_of(self, pod: str) -> list[str]:
        return [k for k, p in self.owner.items() if p == pod]

    def lost(self) -> list[str]:
        """Keys that no worker holds any more."""
        # Ask the scheduler by key: futures of lost data may be cancelled client-side.
        who_has: dict[str, Any] = self.client.sync(self.client.scheduler.who_has, keys=list(self.futures))
        return sorted(str(k) for k, holders in who_has.items() if not holders)

    def assert_all_correct(self) -> None:
        assert self.lost() == [], "keys were lost"
        gathered = self.client.gather(self.futures)
        for key, value in self.values.items():
            assert gathered[key] == value, f"{key} has a wrong value"


def workers_by_name(client: distributed.Client) -> dict[str, str]:
    return {str(info["name"]): address for address, info in client.scheduler_info(n_workers=-1)["workers"].items()}


def scatter_onto(client: distributed.Client, pod: str, values: dict[str, bytes]) -> dict[str, distributed.Future]:
    """Scatter ``values`` onto the worker named ``pod``, one copy each.

    The worker's address is read just before, and read again if the scheduler no longer knows it by
    the time the data arrives (the scheduler's KeyError): a worker that reconnects comes back at a
    new port. A worker that does not come back within a minute fails the test, naming it."""
    for _ in range(3):
        addresses = polling.wait_for(
            lambda: (found := workers_by_name(client)) and pod in found and found,
            timeout=60,
            what=f"the worker {pod} in the scheduler",
        )
        try:
            futures: dict[str, distributed.Future] = client.scatter(
                values, workers=[addresses[pod]], hash=False, broadcast=False
            )
        except KeyError as gone:
            left = gone
            continue
        return futures
    raise AssertionError(f"the worker {pod} kept leaving the scheduler while data was scattered onto it: {left}")


def scatter_unique(client: distributed.Client, keys_per_pod: dict[str, int], size: int = 256 * 1024) -> Holdings:
    """Scatter ``n`` distinct random values of ``size`` bytes onto each named pod's worker, one copy each."""
    holdings = Holdings(client)
    for pod, count in keys_per_pod.items():
        values = {f"{pod}-{i}": os.urandom(size) for i in range(count)}
        futures = scatter_onto(client, pod, values)
        holdings.futures.update(futures)
        holdings.values.update(values)
        holdings.owner.update(dict.fromkeys(values, pod))
    who_has = client.who_has(list(holdings.futures.values()))
    assert all(len(holders) == 1 for holders in who_has.values()), "scattered data must be unique"
    return holdings
