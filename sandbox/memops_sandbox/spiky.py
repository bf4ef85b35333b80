"""The workload of memory-aware task admission's demonstration, benchmark and tests: ordinary tasks
whose results stay in memory as unique keys, then tasks of one prefix that each hold a large
transient allocation for a second or two (a "spike"), as the memory-hungry steps of real pipelines
do (a decompression, a join, a model's fit).

The task functions are sent by value (a stock Dask image has no memops_sandbox)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

MIB = 2**20


def _tasks() -> tuple[Callable[..., np.ndarray], Callable[..., float], Callable[..., float]]:
    # Nested: pickle cannot name them, so Dask sends them by value (cloudpickle) to workers that
    # cannot import this package, as it sends a notebook's functions.
    def ordinary(i: int, nbytes: int = 8 * MIB) -> np.ndarray:
        """An ordinary task's result: ``nbytes`` of float64 that only this task made."""
        return np.full(nbytes // 8, float(i))

    def spike(i: int, dep: np.ndarray, hold: int = 300 * MIB, seconds: float = 1.5) -> float:
        """Hold ``hold`` bytes (every page touched) for ``seconds``, then free them: one C call that no
        exception raised in the thread can interrupt until it returns."""
        block = np.ones(hold // 8) if hold else np.ones(1)
        time.sleep(seconds)
        return float(block[0]) + i + float(dep[0])

    def grow(i: int, hold: int = 300 * MIB, steps: int = 30, seconds: float = 1.5) -> float:
        """Reach ``hold`` bytes in ``steps`` Python steps over ``seconds``: a task that an exception raised
        in its thread stops between two steps (what preemption can stop)."""
        chunks = []
        for _ in range(steps):
            chunks.append(np.ones(hold // steps // 8))
            time.sleep(seconds / steps)
        return float(sum(float(c[0]) for c in chunks)) + i

    return ordinary, spike, grow


ordinary, spike, grow = _tasks()


def expected(spikes: int, base: int) -> float:
    """The sum of ``spikes`` spike results over ``base`` ordinary ones (the first ``spikes`` of them)."""
    return float(sum(1.0 + i + i for i in range(min(spikes, base))))


def submit(
    client: Any, *, ordinary_tasks: int = 40, spikes: int = 16, hold: int = 300 * MIB, seconds: float = 1.5
) -> tuple[Sequence[Any], Sequence[Any]]:
    """Submit the ordinary tasks, then the spikes (each reading one ordinary result); both lists of
    futures. The ordinary results stay in memory for as long as their futures are held."""
    base = [client.submit(ordinary, i, pure=False) for i in range(ordinary_tasks)]
    tops = [
        client.submit(spike, i, base[i % ordinary_tasks], hold=hold, seconds=seconds, pure=False) for i in range(spikes)
    ]
    return base, tops
