"""A scheduler preload that installs memops' agent, as the operator does, with every feature off.

``bench/dask_own_tests.py`` names this file in ``distributed.scheduler.preload`` so that every
scheduler that Dask's own tests start carries what memops leaves on a scheduler whose policy asks
for nothing: the agent's comm handler and the departures plugin (:func:`memops.scheduler.agent.install`,
the function the operator sends by ``run_function``). Each install appends a line to the file named
by ``MEMOPS_PRELOAD_LOG``, so that the run can show that the preload reached the schedulers.
"""

from __future__ import annotations

import os
from typing import Any

from memops.scheduler import agent


def dask_setup(scheduler: Any) -> None:
    agent.install(scheduler)
    log = os.environ.get("MEMOPS_PRELOAD_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{scheduler.id}\n")
