"""What every benchmark needs: a running ``memops sandbox``, ``kubectl`` against it, its workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import distributed

from memops import sandbox


@dataclass(frozen=True)
class Sandbox:
    state: Path
    env: dict[str, str]  # KUBECONFIG and a private kubectl cache
    address: str  # the Dask scheduler's


@contextlib.contextmanager
def running_sandbox(workers: int, *args: str) -> Iterator[Sandbox]:
    state = Path(tempfile.mkdtemp(prefix="memops-bench-")) / "sandbox"
    process = sandbox.launch(state, workers, *args)
    try:
        env = {**os.environ, "KUBECONFIG": str(state / "kubeconfig"), "KUBECACHEDIR": str(state / "kubecache")}
        yield Sandbox(state, env, (state / "scheduler-address").read_text().strip())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)


def kubectl(env: dict[str, str], *args: str, stdin: str | None = None) -> str:
    kubectl_bin = str(Path(sys.executable).parent / "kubectl")
    return subprocess.run([kubectl_bin, *args], input=stdin, env=env, check=True, capture_output=True, text=True).stdout


def workers(client: distributed.Client) -> dict[str, str]:
    """Worker name (the pod's name) -> Dask address."""
    return {str(i["name"]): a for a, i in client.scheduler_info(n_workers=-1)["workers"].items()}


def times_computed(prefix: str, dask_scheduler: Any = None) -> dict[str, int]:
    """How often each key whose name starts with ``prefix`` reached memory, from the scheduler's
    transition log (run with ``client.run_on_scheduler``): above 1 means it was recomputed."""
    counts: Counter[str] = Counter()
    for entry in dask_scheduler.transition_log:
        key, finish = str(entry[0]), entry[2]
        if key.startswith(prefix) and finish == "memory":
            counts[key] += 1
    return dict(counts)


def recomputed(client: distributed.Client, prefix: str) -> int:
    """Tasks (keys starting with ``prefix``) computed more than once so far."""
    # This module is not importable on the scheduler: send the function by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    counts = client.run_on_scheduler(times_computed, prefix)
    return sum(count - 1 for count in counts.values() if count > 1)
