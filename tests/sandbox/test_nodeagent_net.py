"""A pod's processes find the pod's IP as their own address, as in the pod's network namespace:
``dask worker`` without ``--host`` (the Dask Helm chart's arguments), and each worker of
``--nworkers 2``, listen on it. Real processes, no control plane."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from memops_sandbox import nodeagent_net as net

POD_IP = "127.100.0.5"
LOOKUP = "from distributed.utils import get_ip; import sys; print(get_ip(sys.argv[1]))"


def route_lookup(destination: str, env: dict[str, str]) -> str:
    """distributed's ``get_ip``: the local address through which ``destination`` is reached."""
    done = subprocess.run(
        [sys.executable, "-c", LOOKUP, destination], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_route_lookup_from_the_pod_answers_the_pods_ip(tmp_path: Path) -> None:
    env = net.pod_env(dict(os.environ), site=net.write_site(tmp_path / "site"), pod_ip=POD_IP)
    assert route_lookup("127.100.0.9", env) == POD_IP, "towards another pod: the pod's own IP"
    assert route_lookup("127.0.0.1", env) == POD_IP
    assert route_lookup("127.100.0.9", dict(os.environ)) == "127.0.0.1", "the machine's answer, outside a pod"


def test_the_containers_own_pythonpath_stays_after_the_site(tmp_path: Path) -> None:
    site = net.write_site(tmp_path / "site")
    env = net.pod_env({"PYTHONPATH": "/opt/app"}, site=site, pod_ip=POD_IP)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(site), "/opt/app"]
    assert env[net.POD_IP_ENV] == POD_IP
    assert net.write_site(tmp_path / "site") == site and (site / "sitecustomize.py").read_text() == net.SITECUSTOMIZE


@pytest.mark.parametrize("nworkers", [1, 2])
async def test_dask_worker_without_host_listens_on_its_pods_ip(tmp_path: Path, nworkers: int) -> None:
    """The Dask Helm chart's worker arguments (no ``--host``, no ``--name``) in a pod of the node
    agent: every worker's address is on the pod's IP, as the operator and the preStop hook find
    a pod's workers. (Before: 127.0.0.1 for every pod, whose workers no pod IP matched.)"""
    env = net.pod_env(dict(os.environ), site=net.write_site(tmp_path / "site"), pod_ip=POD_IP)
    async with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=":0", asynchronous=True) as local,
        Client(local, asynchronous=True) as client,
    ):
        worker = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "distributed.cli.dask_worker", local.scheduler_address],
            *["--nthreads", "1", "--nworkers", str(nworkers), "--no-dashboard"],
            env=env,
            start_new_session=True,
        )
        try:

            async def connected() -> dict[str, dict[str, object]]:
                while len(workers := (await client.scheduler.identity())["workers"]) < nworkers:
                    await asyncio.sleep(0.1)
                return workers

            workers = await asyncio.wait_for(connected(), 60)
            assert {address.split("://")[1].rsplit(":", 1)[0] for address in workers} == {POD_IP}
            assert len(workers) == nworkers
        finally:
            worker.terminate()
            await asyncio.wait_for(worker.wait(), 30)
