"""The kubelet's own eviction under node memory pressure, on real Nodes, with and without memops.

Each Node has 3 GiB for its pods (``--node-memory 3Gi``: its kubelet reserves the rest of the
machine), so the kubelet's ``allocatableMemory.available`` signal (threshold ``evictionHard``
``memory.available`` 768Mi, ``--eviction-threshold``) is within reach. Four workers as users often write them, a small
memory request under a larger limit (2 GiB; spilling off, as for data that cannot spill), spread over
the two Nodes. Unique keys fill the two workers of one Node past what the Node can hold.

Stock, the kubelet evicts the worker that is furthest over its request, with no grace period and
no preStop hook, and its keys are lost. Under a MemoryPolicy with ``spec.eviction.nodePressure``,
memops reads what the kubelet decides by (its summary statistics and configuration, from each
kubelet itself with ``nodes/stats`` and ``nodes/configz`` and never ``nodes/proxy``; the pods'
requests and priorities), predicts that victim while the Node is still within the margin, and
drains it first: 0 keys lost. The kubelets authenticate and authorize every caller through the API
server (``Webhook``), as a production cluster's do: a token without those rights is refused.
"""

from __future__ import annotations

import copy
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
from memops_sandbox import common as sandbox_cli

from memops.specs.common import parse_quantity
from tests.e2e.conftest import Sandbox
from tests.e2e.data import Holdings

MiB = 2**20
NODE_MEMORY = "3Gi"
THRESHOLD = "768Mi"  # the kubelets' evictionHard memory.available
CHUNK = 32 * MiB
# Seconds between chunks. The kubelet's statistics are up to 10 s old and it looks every 10 s:
# between its threshold and the pods' cgroup limit (the kernel's OOM kill) there must be room for
# what arrives in 20 s.
PACE = 1.0
# Unpaced while the Node is surely further than this from its threshold: what was sent since the
# statistics could have been taken (STATS_LAG before they were read) counts as already there.
FAST_UNTIL = 768 * MiB
STATS_LAG = 25.0
APP = "pressed"


pytestmark = pytest.mark.owns_cluster("it fills a Node to its kubelet's eviction threshold")


@pytest.fixture
def pressed(tmp_path: Path) -> Iterator[Callable[[bool], Sandbox]]:
    started: list[Sandbox] = []

    def start(operator: bool) -> Sandbox:
        state_dir = tmp_path / f"pressed{len(started)}"
        args = ["--nodes", "2", "--worker-memory", "512MiB", "--node-memory", NODE_MEMORY]
        args += ["--eviction-threshold", THRESHOLD]
        args += ["--set", "rbac.kubeletStats=true"] if operator else ["--no-operator"]
        sandbox = Sandbox(state_dir, sandbox_cli.launch(state_dir, 1, *args, real_nodes=True))
        started.append(sandbox)
        return sandbox

    yield start
    for sandbox in started:
        sandbox.stop()


def workload(sandbox: Sandbox) -> None:
    """Four workers of 2 GiB with a 64 MiB request, two per Node, spilling off."""
    body = copy.deepcopy(sandbox_cli.worker_deployment(sandbox.scheduler_address, 4, image=sandbox_cli.DASK_IMAGE))
    body["metadata"]["name"] = body["spec"]["template"]["metadata"]["labels"]["app"] = APP
    body["metadata"]["labels"] = body["spec"]["selector"]["matchLabels"] = {"app": APP}
    spec = body["spec"]["template"]["spec"]
    [container] = spec["containers"]
    container["resources"] = {"requests": {"memory": "64Mi"}, "limits": {"memory": "2Gi"}}
    # Neither spilled, paused nor killed by its nanny: the Node runs out of memory before they do.
    container["env"] = [
        *container.get("env", []),
        *(
            {"name": f"DASK_DISTRIBUTED__WORKER__MEMORY__{threshold}", "value": "False"}
            for threshold in ("TARGET", "SPILL", "PAUSE", "TERMINATE")
        ),
    ]
    spec["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": APP}},
        }
    ]
    sandbox.apply(body)


def pressed_pods(sandbox: Sandbox) -> list[dict[str, Any]]:
    return [p for p in sandbox.get("pods", "-l", f"app={APP}")["items"] if not p["metadata"].get("deletionTimestamp")]


def the_full_node(sandbox: Sandbox) -> str:
    """The Node to fill: the one without the Dask scheduler, whose loss would lose everything."""
    [scheduler] = sandbox.get("pods", "-l", "app=dask-scheduler")["items"]
    nodes = {p["spec"]["nodeName"] for p in pressed_pods(sandbox)}
    [node] = nodes - {scheduler["spec"]["nodeName"]}
    return str(node)


def headroom(sandbox: Sandbox, node: str) -> int:
    """Bytes the Node's pods may still take before the kubelet's allocatable threshold."""
    summary = json.loads(sandbox.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/stats/summary").stdout)
    [pods] = [c for c in summary["node"]["systemContainers"] if c["name"] == "pods"]
    return int(pods["memory"]["availableBytes"] - parse_quantity(THRESHOLD))


def workers_on(client: distributed.Client, sandbox: Sandbox, node: str) -> dict[str, str]:
    """Pod -> worker address, for the running pressed workers of ``node``."""
    pods = {p["metadata"]["name"] for p in pressed_pods(sandbox) if p["spec"].get("nodeName") == node}
    return {
        str(info["name"]): address
        for address, info in client.scheduler_info(n_workers=-1)["workers"].items()
        if str(info["name"]) in pods and info.get("status") == "running"
    }


def fill(client: distributed.Client, sandbox: Sandbox, holdings: Holdings, node: str, budget: int) -> None:
    """Unique keys onto the two workers of ``node``, ``CHUNK`` at a time to each in turn, until the
    Node's pods are past the kubelet's threshold by a margin it cannot miss between two of its
    looks, or a worker of it was evicted, or ``budget`` bytes were sent. While one of the two is
    away (drained, its container restarting) the workload waits for it, rather than pour
    everything into the other one up to its own limit. Chunks go at ``PACE`` from :data:`FAST_UNTIL`
    before the threshold, as near as the kubelet's stale statistics can tell, and at once before."""
    sent, step, deadline = 0, 0, time.monotonic() + 300
    sends: list[float] = []  # when each chunk went
    room, read_at = 0, 0.0
    workers: list[tuple[str, str]] = []
    while sent < budget and time.monotonic() < deadline:
        if step % 4 == 0:
            room, read_at = headroom(sandbox, node), time.monotonic()
            if room < -128 * MiB or evicted(sandbox):
                return
        unseen = CHUNK * sum(1 for at in sends if at >= read_at - STATS_LAG)
        fast = room - unseen > FAST_UNTIL
        if not fast or step % 4 == 0 or len(workers) < 2:  # far from the threshold nobody leaves
            workers = sorted(workers_on(client, sandbox, node).items())
        step += 1
        if len(workers) < 2:
            time.sleep(PACE)
            continue
        pod, address = workers[step % 2]
        key = f"{pod}-{step}"
        value = os.urandom(CHUNK)
        try:
            scattered = client.scatter({key: value}, workers=[address], hash=False, broadcast=False, timeout=10)
        except (OSError, TimeoutError, KeyError):
            workers = []
            continue  # the worker left (drained, or evicted) as the chunk went
        holdings.futures[key], holdings.values[key], holdings.owner[key] = scattered[key], value, pod
        sent += CHUNK
        sends.append(time.monotonic())
        time.sleep(0.0 if fast else PACE)


def evicted(sandbox: Sandbox) -> list[str]:
    """The pressed pods that the kubelet evicted, by its Evicted events."""
    events = sandbox.get("events", "--field-selector", "reason=Evicted")["items"]
    return sorted({e["involvedObject"]["name"] for e in events if e["involvedObject"]["name"].startswith(f"{APP}-")})


def scenario(sandbox: Sandbox, client: distributed.Client) -> tuple[Holdings, str]:
    workload(sandbox)
    client.wait_for_workers(5, timeout=120)
    node = the_full_node(sandbox)
    holdings = Holdings(client)
    before, began = headroom(sandbox, node), time.monotonic()
    # What takes the Node past its threshold: its headroom, and the statistics' lag.
    fill(client, sandbox, holdings, node, before + 384 * MiB)
    print(
        f"{node}: {before // MiB} MiB to the threshold before the fill, {headroom(sandbox, node) // MiB} after"
        f" ({len(holdings.values)} chunks in {time.monotonic() - began:.0f} s)"
    )
    return holdings, node


def test_without_memops_the_kubelet_evicts_a_worker_and_its_keys_are_lost(
    pressed: Callable[[bool], Sandbox],
) -> None:
    sandbox = pressed(False)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings, node = scenario(sandbox, client)
        sandbox.wait_for(lambda: evicted(sandbox), timeout=60, what="the kubelet to evict a worker")
        sandbox.wait_for(lambda: holdings.lost(), timeout=30, what="the evicted worker's keys to be lost")
        lost_owners = {holdings.owner[k] for k in holdings.lost()}
        assert lost_owners <= set(evicted(sandbox)), "only the evicted worker's keys are lost"
        print(
            f"stock: evicted {evicted(sandbox)} on {node}; {len(holdings.lost())} of {len(holdings.values)} keys lost"
        )


def kubelet_get(sandbox: Sandbox, node: str, path: str, token: str) -> int:
    """The HTTP status of ``path`` on ``node``'s kubelet, asked directly with ``token``, its
    serving certificate verified against the cluster's CA."""
    found = sandbox.get("node", node)
    [address] = [a["address"] for a in found["status"]["addresses"] if a["type"] == "InternalIP"]
    port = found["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    context = ssl.create_default_context(cafile=str(sandbox.state_dir / "pki" / "ca.crt"))
    request = urllib.request.Request(f"https://{address}:{port}{path}", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)


def assert_least_privilege(sandbox: Sandbox) -> None:
    """The operator may read the kubelets' statistics and configuration, and not proxy to them;
    the kubelets ask the API server: a token of an account without those rights is refused."""
    operator = "system:serviceaccount:memops-system:memops"
    for subresource, allowed in (("stats", "yes"), ("configz", "yes"), ("proxy", "no")):
        asked = ("auth", "can-i", "get", "nodes", f"--subresource={subresource}", f"--as={operator}")
        said = sandbox.kubectl(*asked, check=False).stdout.strip()
        assert said == allowed, f"the operator's account: get nodes/{subresource}: {said}"
    sandbox.kubectl("create", "serviceaccount", "nobody")
    nobody = sandbox.kubectl("create", "token", "nobody").stdout.strip()
    node = sandbox.get("nodes")["items"][0]["metadata"]["name"]
    assert kubelet_get(sandbox, node, "/stats/summary", nobody) == 403, "the kubelet authorizes through the API server"
    assert kubelet_get(sandbox, node, "/configz", "not-a-token") == 401, "and authenticates through it"


def test_memops_drains_the_kubelets_next_victim_before_it_is_evicted(pressed: Callable[[bool], Sandbox]) -> None:
    sandbox = pressed(True)
    assert_least_privilege(sandbox)
    sandbox.apply(
        {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "MemoryPolicy",
            "metadata": {"name": APP},
            "spec": {
                "scheduler": {"address": "tcp://dask-scheduler:8786"},
                "workload": {"kind": "Deployment", "name": APP},
                "eviction": {"nodePressure": {"margin": "256Mi"}},
            },
        }
    )
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings, node = scenario(sandbox, client)

        def drained() -> dict[str, Any] | None:
            status = sandbox.get("mempol", APP).get("status", {}).get("nodePressure") or {}
            return status if status.get("drains", 0) >= 1 else None

        status = sandbox.wait_for(drained, timeout=60, what="memops to drain the kubelet's next victim")
        # Two of the kubelet's looks (every 10 s) after the fill, the keys are all there.
        time.sleep(25)
        assert holdings.lost() == [], f"lost {len(holdings.lost())} keys; evicted {evicted(sandbox)}"
        # A few keys at a time: the scheduler relays what a client gathers, within its own limit.
        keys = sorted(holdings.values)
        for start in range(0, len(keys), 4):
            batch = keys[start : start + 4]
            gathered = client.gather([holdings.futures[k] for k in batch])
            assert all(value == holdings.values[k] for k, value in zip(batch, gathered, strict=True)), batch
        requests = sandbox.get("retire", "-l", "memops.dev/reason=eviction")["items"]
        assert requests and all(r["spec"]["removePods"] is False for r in requests)
        events = sandbox.get("events", "--field-selector", "reason=NodePressureDrain")["items"]
        assert events, "the drain is announced on the policy"
        print(
            f"memops: {status['drains']} drained ahead of the kubelet on {node};"
            f" {len(holdings.values)} keys, 0 lost; evicted anyway: {evicted(sandbox)}"
        )
