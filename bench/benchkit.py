"""What every benchmark needs: a running ``memops sandbox``, ``kubectl`` against it, its workers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
