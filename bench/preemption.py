"""A simulated preemption: a node's worker pods deleted with a 25 s grace period, three ways.

Real Dask processes at the scheduler level (no Kubernetes): a scheduler, and four ``dask worker``
processes (nanny and worker, as in a pod), two on the node being preempted ("node-a"), each
holding SIZE of data that exists nowhere else (scattered: it cannot be recomputed). At t=0
both of node-a's pods are "deleted with --grace-period=25", as the kubelet does it: each pod's
preStop hook runs, then SIGTERM, and whatever still runs at t=25 s gets SIGKILL.

- memops: the safety net's preStop hook (``memops.decisions.prestop_hook.PRE_STOP_SCRIPT``) with memops'
  agent in the scheduler (the operator installs it): memops' drain, by value, off node-a;
- stock: the same hook on a scheduler without the agent: stock ``retire_workers``;
- nothing: no hook: SIGTERM at once (``dask worker`` closes without draining).

Reported: GiB of node-a's data still held by the surviving workers once node-a's workers are
gone (saved within the window), keys lost, and when the last node-a worker left.

    python bench/preemption.py                 # 1 GiB per worker, as in docs/performance.md
    python bench/preemption.py --size-mib 64   # the small pass CI runs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import distributed
from memops_sandbox import dask_direct

from memops.clients import prestop_hook

MIB = 2**20
GIB = 2**30
GRACE = 25.0
KEY = 8 * MIB


@dataclass(frozen=True)
class Outcome:
    mode: str
    saved: int  # bytes of node-a's data held by a surviving worker afterwards
    total: int
    lost_keys: int
    seconds: float  # t=0 -> the last node-a worker left the scheduler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "distributed.cli.dask_" + args[0], *args[1:]],
        start_new_session=True,  # its own process group: SIGKILL takes the nanny's worker too
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )


def kill(process: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def run(mode: str, size: int, memory: str) -> Outcome:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = spawn("scheduler", "--host", "127.0.0.1", "--port", str(port), "--dashboard-address", ":0")
    workers: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in ("a-0", "a-1", "b-0", "b-1"):
            workers[name] = spawn(
                "worker", address, "--name", name, "--nthreads", "1", "--memory-limit", memory, "--no-dashboard"
            )
        with distributed.Client(address, timeout=60) as client:
            client.wait_for_workers(4, timeout=120)
            by_name = {info["name"]: a for a, info in client.scheduler_info()["workers"].items()}
            futures = []
            for name in ("a-0", "a-1"):
                base = os.urandom(KEY)
                for first in range(0, size // KEY, 16):
                    batch = {
                        f"{name}-{i}": base[:-8] + i.to_bytes(8, "little")
                        for i in range(first, min(first + 16, size // KEY))
                    }
                    futures += client.scatter(batch, workers=[by_name[name]], hash=False).values()
            dying = [by_name["a-0"], by_name["a-1"]]
            if mode == "memops":
                # The operator installed the agent earlier; a generous bound, as CI runs this beside its tests.
                asyncio.run(dask_direct.drain_status(address, timeout=60))
            start = time.monotonic()
            hooks = []
            for name in ("a-0", "a-1"):
                if mode == "nothing":
                    kill(workers[name], signal.SIGTERM)
                    continue
                env = {
                    **os.environ,
                    "MEMOPS_SCHEDULER_ADDRESS": address,
                    "MEMOPS_POD_NAME": name,
                    "MEMOPS_NODE_NAME": "node-a",
                    "MEMOPS_DRAIN_TIMEOUT": "600",
                    # What the webhook sets for a drain timeout of 10 minutes; the deletion's 25 s
                    # grace is not visible to the hook, and SIGKILL ends it.
                    "MEMOPS_DRAIN_DEADLINE": "600",
                }
                hooks.append(
                    (
                        name,
                        subprocess.Popen(
                            [sys.executable, "-c", prestop_hook.PRE_STOP_SCRIPT],
                            env=env,
                            start_new_session=True,
                            stdout=subprocess.DEVNULL,
                        ),
                    )
                )
            # The kubelet: SIGTERM once a pod's hook returns, SIGKILL at the end of the grace period.
            pending = dict(hooks)
            while time.monotonic() - start < GRACE:
                for name, hook in list(pending.items()):
                    if hook.poll() is not None:
                        kill(workers[name], signal.SIGTERM)
                        del pending[name]
                alive = set(client.scheduler_info()["workers"])
                if not alive & set(dying):
                    break
                time.sleep(0.1)
            left = time.monotonic() - start
            for _, hook in hooks:
                kill(hook, signal.SIGKILL)
            for name in ("a-0", "a-1"):
                kill(workers[name], signal.SIGKILL)
            deadline = time.monotonic() + 30
            while set(client.scheduler_info()["workers"]) & set(dying) and time.monotonic() < deadline:
                time.sleep(0.1)
            # By key, from the scheduler: a future whose data was lost is cancelled client-side.
            who_has = client.sync(client.scheduler.who_has, keys=[f.key for f in futures])
            held = {k for k, h in who_has.items() if h}
            return Outcome(mode, len(held) * KEY, len(futures) * KEY, len(futures) - len(held), left)
    finally:
        for process in workers.values():
            kill(process, signal.SIGKILL)
        kill(scheduler, signal.SIGKILL)
        for process in [*workers.values(), scheduler]:
            process.wait(30)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1024, help="data on each preempted worker")
    args = parser.parse_args(argv)
    size = args.size_mib * MIB
    memory = f"{max(4 * size // GIB, 1) * 1024 + 512}MiB"
    results = []
    for mode in ("memops", "stock", "nothing"):
        results.append(run(mode, size, memory))
        print(results[-1], flush=True)
    print(f"\nSimulated preemption: 2 workers on one node, {args.size_mib} MiB each, grace period {GRACE:.0f} s\n")
    print("| preStop | GiB saved | of GiB | keys lost | last worker left, s |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r.mode} | {r.saved / GIB:.2f} | {r.total / GIB:.2f} | {r.lost_keys} | {r.seconds:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
