"""The controllers' one daemon loop: what each pass and failure does to the next wait.

Passes are scripted (a :class:`loop.Next`, None for finished, or an exception to raise); the wait
is recorded instead of slept, so the table reads as the waits the daemon would make.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kopf._cogs.aiokits import aioenums

from memops.controllers import loop

N, F = loop.Next, loop.Failures
COUNTED = N(seconds=2.0, failures=F.COUNT)
TRANSIENT = N(seconds=2.0, failures=F.KEEP)


class Transient(Exception):
    pass


class Broken(Exception):
    pass


@pytest.mark.parametrize(
    ("script", "waits", "passes"),
    [
        pytest.param([None], [], 1, id="finished-at-once"),
        pytest.param([N(), N(), None], [], 3, id="progress-goes-on-without-waiting"),
        pytest.param([N(seconds=2.0), N(seconds=10.0), None], [2.0, 10.0], 3, id="idle-waits-as-the-pass-says"),
        pytest.param(
            [Broken(), Broken(), Broken(), N(seconds=2.0), None],
            [2.0, 4.0, 6.0, 2.0],
            5,
            id="failures-in-a-row-lengthen-the-wait-until-a-success",
        ),
        pytest.param(
            [Broken()] * 20 + [None], [min(2.0 * n, 30.0) for n in range(1, 21)], 21, id="capped-at-max-seconds"
        ),
        pytest.param(
            [Broken(), Transient(), Broken(), None],
            [2.0, 2.0, 4.0],
            4,
            id="a-transient-error-neither-counts-nor-resets",
        ),
        pytest.param([Broken(), N(), None], [2.0], 3, id="a-success-after-a-failure-goes-on-at-once"),
        pytest.param([Transient(), Exception("stop"), N()], [2.0], 2, id="the-controller-ends-it-on-an-error"),
    ],
)
async def test_the_loop_waits_as_its_passes_say(
    script: Sequence[loop.Next | Exception | None], waits: list[float], passes: int
) -> None:
    setter: aioenums.FlagSetter[object] = aioenums.FlagSetter()
    steps = iter(script)
    ran: list[int] = []
    waited: list[float] = []

    async def one_pass() -> loop.Next | None:
        ran.append(1)
        step = next(steps)
        if isinstance(step, Exception):
            raise step
        return step

    async def on_error(exc: Exception) -> loop.Next | None:
        if isinstance(exc, Broken):
            return COUNTED
        if isinstance(exc, Transient):
            return TRANSIENT
        return None

    async def wait(seconds: float) -> None:
        waited.append(seconds)

    await loop.run(one_pass, on_error, stopped=setter.async_waiter, max_seconds=30.0, wait=wait)
    assert (waited, len(ran)) == (waits, passes)


async def test_a_stopped_daemon_runs_no_further_pass() -> None:
    setter: aioenums.FlagSetter[object] = aioenums.FlagSetter()
    ran: list[int] = []

    async def one_pass() -> loop.Next:
        ran.append(1)
        setter.set()
        return N(seconds=5.0)

    async def on_error(exc: Exception) -> None:
        raise AssertionError(exc)

    await loop.run(one_pass, on_error, stopped=setter.async_waiter, max_seconds=30.0)
    assert ran == [1]
