"""The safety net's preStop hook, run as the kubelet runs it, against real schedulers (tcp:// and tls://)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest
from distributed import Client, LocalCluster
from distributed.security import Security

from memops import daskrpc, safetynet


async def run_hook(address: str, name: str, extra_env: dict[str, str]) -> int:
    env = {
        **os.environ,
        "MEMOPS_SCHEDULER_ADDRESS": address,
        "MEMOPS_POD_NAME": name,
        "MEMOPS_DRAIN_TIMEOUT": "60",
        **extra_env,
    }
    hook = await asyncio.create_subprocess_exec(sys.executable, "-c", safetynet.PRE_STOP_SCRIPT, env=env)
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
            assert await daskrpc.drain_status(local.scheduler_address) == {}  # installs the agent
            env = {"MEMOPS_NODE_NAME": "node-a", "MEMOPS_DRAIN_DEADLINE": "25"}
            assert await run_hook(local.scheduler_address, name, env) == 0
            state = (await daskrpc.drain_status(local.scheduler_address))[leaving]
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
                await daskrpc.start_drain(address, [leaving], deadline=60, nodes_dying=False, restore=True)
                begun = time.monotonic()
                env = {"MEMOPS_NODE_NAME": "node-a", "MEMOPS_DRAIN_DEADLINE": "3"}
                assert await run_hook(address, name, env) == 0
                assert time.monotonic() - begun < 6, "the hook's deadline, not the operator's"
                state = (await daskrpc.drain_status(address))[leaving]
                assert state["state"] == "deadline" and state["node"] == "node-a"
                assert state["lostAtDeadline"]["keys"] == 20 and state["origin"] == "", "the operator's drain"
                assert local.scheduler.workers[leaving].status.name == "closing_gracefully", "not set back"
            finally:
                os.kill(pid, signal.SIGCONT)
            assert len(await client.gather(list(futures.values()))) == 20
