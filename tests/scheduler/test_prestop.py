"""The safety net's preStop hook, run as the kubelet runs it, against real schedulers (tcp:// and tls://)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from distributed import Client, LocalCluster
from distributed.security import Security
from memops_sandbox import dask_direct

from memops.clients import prestop_hook
from tests import polling


async def run_hook(address: str, name: str, extra_env: dict[str, str]) -> int:
    env = {
        **os.environ,
        "MEMOPS_SCHEDULER_ADDRESS": address,
        "MEMOPS_POD_NAME": name,
        "MEMOPS_DRAIN_TIMEOUT": "60",
        **extra_env,
    }
    hook = await asyncio.create_subprocess_exec(sys.executable, "-c", prestop_hook.PRE_STOP_SCRIPT, env=env)
    return await asyncio.wait_for(hook.wait(), 90)


@pytest.mark.parametrize("protocol", ["tcp://", "tls://"])
async def test_the_hook_retires_its_own_worker_and_the_data_moves(protocol: str) -> None:
    security = Security.temporary() if protocol == "tls://" else None
    async with LocalCluster(
        n_workers=2,
        processes=True,
        threads_per_worker=1,
        dashboard_address=None,
        asynchronous=True,
        protocol=protocol,
        **({"security": security} if security is not None else {}),
    ) as local:
        async with Client(local, asynchronous=True, **({"security": security} if security else {})) as client:
            info = await client.scheduler.identity()
            leaving, staying = sorted(info["workers"])
            name = str(info["workers"][leaving]["name"])
            futures = await client.scatter({f"k{i}": os.urandom(1024) for i in range(10)}, workers=[leaving])
            tls_env = {}
            if security is not None:
                tls_env = {
                    "MEMOPS_TLS_CA": security.tls_ca_file,
                    "MEMOPS_TLS_CERT": security.tls_client_cert,
                    "MEMOPS_TLS_KEY": security.tls_client_key,
                }
            assert await run_hook(local.scheduler_address, name, tls_env) == 0
            who_has = await client.who_has(list(futures.values()))
            assert all(holders == (staying,) for holders in who_has.values()), who_has
            assert leaving not in (await client.scheduler.identity())["workers"]


async def test_the_hook_waits_for_a_worker_to_take_the_data() -> None:
    """The only worker holds unique data: the scheduler cannot retire it (it returns nothing), so
    the hook asks again until a second worker connects, then the data moves there. (Before: the
    hook returned at once and the kubelet killed the worker with its data, as in a rollout whose
    new pods were Ready before their workers connected.)"""
    async with LocalCluster(
        n_workers=1, processes=True, threads_per_worker=1, dashboard_address=None, asynchronous=True
    ) as local:
        async with Client(local, asynchronous=True) as client:
            info = await client.scheduler.identity()
            [leaving] = info["workers"]
            name = str(info["workers"][leaving]["name"])
            futures = await client.scatter({f"k{i}": os.urandom(1024) for i in range(10)}, workers=[leaving])
            hook = asyncio.create_task(run_hook(local.scheduler_address, name, {}))
            await asyncio.sleep(3)
            assert not hook.done(), "the hook returned while its worker held the only copy"
            assert leaving in (await client.scheduler.identity())["workers"]
            local.scale(2)
            assert await hook == 0
            who_has = await client.who_has(list(futures.values()))
            assert all(holders and leaving not in holders for holders in who_has.values()), who_has


async def test_the_hook_drains_with_memops_where_the_agent_runs() -> None:
    """With memops' agent in the scheduler (the operator installs it), the hook starts memops'
    drain of its worker by name, with its node, and waits for it: the worker is drained by value
    and closed, each key received once."""
    async with LocalCluster(
        n_workers=3, processes=True, threads_per_worker=1, dashboard_address=None, asynchronous=True
    ) as local:
        async with Client(local, asynchronous=True) as client:
            info = await client.scheduler.identity()
            leaving, *_ = sorted(info["workers"])
            name = str(info["workers"][leaving]["name"])
            futures = await client.scatter({f"k{i}": os.urandom(4096) for i in range(100)}, workers=[leaving])
            assert await dask_direct.drain_status(local.scheduler_address) == {}  # installs the agent
            env = {"MEMOPS_NODE_NAME": "node-a", "MEMOPS_DRAIN_DEADLINE": "25"}
            assert await run_hook(local.scheduler_address, name, env) == 0
            state = (await dask_direct.drain_status(local.scheduler_address))[leaving]
            assert state["state"] == "done" and state["node"] == "node-a" and state["keysMoved"] == 100
            # Told from the operator's drains: the policy's status records what a hook's drain loses.
            assert state["origin"] == "preStop" and state["name"] == name
            assert state["asked"] == 100 and 20 < state["deadlineIn"] + state["seconds"] <= 25
            assert leaving not in (await client.scheduler.identity())["workers"]
            assert len(await client.gather(list(futures.values()))) == 100


async def test_the_hook_gives_its_deadline_and_node_to_the_operators_running_drain() -> None:
    """The operator's drain of the worker runs (a RetirementRequest's: a minute, its node staying,
    the worker set back to running at the deadline), and cannot finish: the worker is frozen, so
    nothing it holds lands anywhere. Its pod is deleted: the hook finds the worker leaving, by
    memops' drain, and asks that drain again instead of waiting for it, which then stops at the
    hook's deadline (3 s), knows the worker's node, and leaves the worker closing_gracefully, as its
    pod is going. (Before: the hook waited for the drain's own deadline and was killed first.)"""
    async with LocalCluster(
        n_workers=3, processes=True, threads_per_worker=1, dashboard_address=None, asynchronous=True
    ) as local:
        async with Client(local, asynchronous=True) as client:
            info = await client.scheduler.identity()
            leaving, *_ = sorted(info["workers"])
            name = str(info["workers"][leaving]["name"])
            futures = await client.scatter({f"k{i}": os.urandom(4096) for i in range(20)}, workers=[leaving])
            pid = (await client.run(os.getpid, workers=[leaving]))[leaving]
            os.kill(pid, signal.SIGSTOP)
            try:
                address = local.scheduler_address
                await dask_direct.start_drain(address, [leaving], deadline=60, nodes_dying=False, restore=True)
                begun = time.monotonic()
                env = {"MEMOPS_NODE_NAME": "node-a", "MEMOPS_DRAIN_DEADLINE": "3"}
                assert await run_hook(address, name, env) == 0
                assert time.monotonic() - begun < 6, "the hook's deadline, not the operator's"
                state = (await dask_direct.drain_status(address))[leaving]
                assert state["state"] == "deadline" and state["node"] == "node-a"
                assert state["lostAtDeadline"]["keys"] == 20 and state["origin"] == "", "the operator's drain"
                assert local.scheduler.workers[leaving].status.name == "closing_gracefully", "not set back"
            finally:
                os.kill(pid, signal.SIGCONT)
            assert len(await client.gather(list(futures.values()))) == 20


# -- a pod's workers found by its IP -----------------------------------------------------------

POD_IP = "127.0.0.2"  # the pod whose hook runs: its workers listen on its IP, as in a pod
OTHER_IP = "127.0.0.3"  # another pod's


@contextlib.asynccontextmanager
async def dask_workers(address: str, host: str, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``dask worker`` as the Dask Helm chart runs it (no ``--name``), on ``host`` as on a pod's IP."""
    command = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--host", host]
    process = await asyncio.create_subprocess_exec(
        *command, "--nthreads", "1", "--no-dashboard", *args, start_new_session=True
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            os.killpg(process.pid, signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 30)


async def wait_for_workers(client: Client, count: int) -> dict[str, Any]:
    async def connected() -> dict[str, Any] | None:
        workers: dict[str, Any] = (await client.scheduler.identity())["workers"]
        return workers if len(workers) >= count else None

    return await polling.poll(connected, timeout=60, what=f"{count} workers")


def host_of(address: str) -> str:
    return address.split("://", 1)[1].rsplit(":", 1)[0]


@pytest.mark.parametrize("agent", [True, False], ids=["memops-drain", "retire-workers"])
async def test_the_hook_drains_every_worker_on_its_pods_ip_named_or_not(agent: bool) -> None:
    """``dask worker --nworkers 2`` without ``--name`` (the Dask Helm chart's arguments): neither
    worker is named after the pod. The hook finds both by the pod's IP and drains both, by memops'
    drain where its agent runs and by ``retire_workers`` elsewhere; the other pod's worker takes
    the data. (Before: the hook looked for a worker named after the pod, found none, exited 0,
    and the kubelet killed both workers with their data.)"""
    async with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=":0", asynchronous=True) as local,
        Client(local, asynchronous=True) as client,
    ):
        address = local.scheduler_address
        async with dask_workers(address, POD_IP, "--nworkers", "2"), dask_workers(address, OTHER_IP):
            workers = await wait_for_workers(client, 3)
            leaving = sorted(a for a in workers if host_of(a) == POD_IP)
            [staying] = [a for a in workers if host_of(a) == OTHER_IP]
            assert len(leaving) == 2 and all(str(workers[a]["name"]) != "dask-worker-7d4b9-x2x9z" for a in leaving)
            futures = {}
            for worker in leaving:
                values = {f"{worker}-{i}": os.urandom(4096) for i in range(20)}
                futures.update(await client.scatter(values, workers=[worker], hash=False))
            if agent:
                assert await dask_direct.drain_status(address) == {}  # installs the agent
            env = {"MEMOPS_POD_NAME": "dask-worker-7d4b9-x2x9z", "MEMOPS_POD_IPS": POD_IP, "MEMOPS_NODE_NAME": "node-a"}
            assert await run_hook(address, "dask-worker-7d4b9-x2x9z", env) == 0
            assert set((await client.scheduler.identity())["workers"]) == {staying}
            who_has = await client.who_has(list(futures.values()))
            assert all(holders == (staying,) for holders in who_has.values()), who_has
            if agent:
                states = await dask_direct.drain_status(address)
                assert sorted(states) == leaving and all(s["origin"] == "preStop" for s in states.values())
                assert sum(s["keysMoved"] for s in states.values()) == 40


async def test_the_hook_fails_when_no_worker_of_its_pod_is_connected() -> None:
    """A scheduler that answers but has no worker on the pod's IP: the hook exits non-zero, so that
    the kubelet records FailedPreStopHook and the policy's status shows the pod. A worker named
    after the pod but on another pod's IP is that pod's (a restarted dask-kubernetes worker carries
    the same DASK_WORKER_NAME): the IP wins, and it is left alone. (Before: the hook retired the
    named worker of the other pod, and exited 0 for a pod whose worker it never found.)"""
    async with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=":0", asynchronous=True) as local,
        Client(local, asynchronous=True) as client,
    ):
        address = local.scheduler_address
        async with (
            dask_workers(address, OTHER_IP, "--name", "dask-worker-7d4b9-x2x9z"),
            dask_workers(address, OTHER_IP),
        ):
            workers = await wait_for_workers(client, 2)
            assert await dask_direct.drain_status(address) == {}  # installs the agent
            env = {"MEMOPS_POD_IPS": POD_IP, "DASK_WORKER_NAME": "dask-worker-7d4b9-x2x9z"}
            assert await run_hook(address, "dask-worker-7d4b9-x2x9z", env) == 1
            assert set((await client.scheduler.identity())["workers"]) == set(workers), "no worker retired"
            assert await dask_direct.drain_status(address) == {}, "no worker drained"


async def test_the_hook_of_a_pod_that_memops_already_drained_succeeds() -> None:
    """The operator retired the pod's workers with memops' drain (a RetirementRequest, a policy's
    scale-down), then removes the pod: no worker of the pod is connected any more, but memops'
    drain took them, so the hook has nothing to do and did not fail (no FailedPreStopHook)."""
    async with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=":0", asynchronous=True) as local,
        Client(local, asynchronous=True) as client,
    ):
        address = local.scheduler_address
        async with dask_workers(address, POD_IP, "--nworkers", "2"), dask_workers(address, OTHER_IP):
            workers = await wait_for_workers(client, 3)
            leaving = sorted(a for a in workers if host_of(a) == POD_IP)
            await dask_direct.start_drain(address, leaving, deadline=30, nodes_dying=False)

            async def drained() -> bool:
                return not set((await client.scheduler.identity())["workers"]) & set(leaving)

            await polling.poll(drained, timeout=60, what="the drained workers gone")
            assert await run_hook(address, "dask-worker-7d4b9-x2x9z", {"MEMOPS_POD_IPS": POD_IP}) == 0
