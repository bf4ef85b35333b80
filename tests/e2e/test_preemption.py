"""A preemption on the upstream control plane: ``kubectl delete pod --grace-period=25`` of a node's workers.

In a namespace of the session's sandbox: two real Nodes, four worker pods spread two per node,
unique scattered data on the two of one node, then the real ``kubectl delete`` of each, a second
apart, with a 25 s grace period, which the kubelet honours (preStop within the grace, SIGTERM,
SIGKILL at its end). With a MemoryPolicy, the safety net's hook drains both off the node within
the window and nothing is lost; with none (the webhook adds no hook to the namespace's pods), the
node's data is lost. ``bench/preemption_plane.py`` is the larger version, with stock
``retire_workers`` from a preStop hook beside them.

Where the keys went is measured, not assumed: each worker logs every key it receives from a peer
(:mod:`tests.e2e.receipts`), so a key that stopped on the sibling worker of the same node on its
way off it shows, though that worker is gone by the end.

Then what a hook's drain could not move is in the policy's status and metrics, read from memops'
agent in the scheduler: counted once, however many passes read it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import distributed
from memops_sandbox import dask_direct

from memops.scheduler import drain
from tests import polling
from tests.e2e import data, receipts, windows
from tests.e2e import test_metrics as metrics
from tests.e2e.conftest import SPREAD_OVER_NODES, Sandbox, spread_rolled_out

GRACE = 25
SIZE = 96 * 2**20  # per dying worker: enough that no hook, or a slow one, shows; small for 2 cores
KEY = 4 * 2**20
LATE = 64 * 2**10
STAGGER = 1.0


def spread(sandbox: Sandbox, client: distributed.Client, hooked: bool) -> dict[str, str]:
    """Roll the workers out two per node (pods created now get the policy's hook); pod -> node."""
    sandbox.kubectl("patch", "deployment/dask-worker", "--type=strategic", "-p", json.dumps(SPREAD_OVER_NODES))

    def settled() -> dict[str, str] | None:
        items = sandbox.get("pods", "-l", "app=dask-worker")["items"]
        if len(items) != 4 or any(p["status"].get("phase") != "Running" for p in items):
            return None
        if any(("preStop" in (p["spec"]["containers"][0].get("lifecycle") or {})) != hooked for p in items):
            return None
        if not spread_rolled_out(sandbox, items):
            return None
        placed = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in items}
        names = {str(w["name"]) for w in client.scheduler_info(n_workers=-1)["workers"].values()}
        return (
            placed
            if sorted(list(placed.values()).count(n) for n in set(placed.values())) == [2, 2] and names == set(placed)
            else None
        )

    placed: dict[str, str] = sandbox.wait_for(settled, 300, "four workers, two per node")
    return placed


def located(client: distributed.Client) -> dict[str, str]:
    """Worker name -> node, as the operator's passes told memops' drain in the scheduler."""
    name = drain.NAME

    # Nested, so that it goes by value: the scheduler imports neither the tests nor memops.
    def read(dask_scheduler: Any) -> dict[str, str]:
        plugin = dask_scheduler.plugins.get(name)
        nodes = plugin.nodes if plugin is not None else {}
        return {str(ws.name): nodes[a] for a, ws in dask_scheduler.workers.items() if a in nodes}

    found: dict[str, str] = client.run_on_scheduler(read)
    return found


def preempt(sandbox: Sandbox, client: distributed.Client, pods: list[str]) -> tuple[float, list[str]]:
    """Unique data on ``pods``, then ``kubectl delete --grace-period=25`` of each, ``STAGGER``
    seconds apart: the seconds until their workers left the scheduler, and the keys lost."""

    # A worker may be between two connections (CI's load once had one miss its heartbeats just after
    # the roll-out settled): the data goes once each pod's worker is there, at its address then.
    futures: list[distributed.Future] = []
    for pod in pods:
        futures += data.scatter_onto(client, pod, {f"{pod}-{i}": os.urandom(KEY) for i in range(SIZE // KEY)}).values()
    addresses = data.workers_by_name(client)
    dying = {addresses[p] for p in pods}
    began = time.monotonic()
    # One pod, then the next a second later: the node's hooks need not start together (a node's
    # shutdown, a preemption of one pod after another), and the first hook's drain must not use
    # a worker of the same node whose own hook has not started yet.
    for i, pod in enumerate(pods):
        if i:
            time.sleep(STAGGER)
        sandbox.kubectl("delete", "pod", pod, f"--grace-period={GRACE}", "--wait=false")
    sandbox.wait_for(
        lambda: not dying & set(client.scheduler_info(n_workers=-1)["workers"]), GRACE + 30, "the workers to leave"
    )
    seconds = time.monotonic() - began
    who_has = client.sync(client.scheduler.who_has, keys=[f.key for f in futures])
    return seconds, sorted(k for k, holders in who_has.items() if not holders)


def scrape(sandbox: Sandbox, name: str, **labels: str) -> float:
    return metrics.value(metrics.scrape(sandbox), name, **labels)


def test_memops_loses_nothing_within_the_window_and_records_what_a_hook_could_not_move(sandbox: Sandbox) -> None:
    sandbox.apply(
        {
            "apiVersion": "memops.dev/v1alpha1",
            "kind": "MemoryPolicy",
            "metadata": {"name": "spot"},
            "spec": {
                "scheduler": {"address": sandbox.scheduler_address},
                "workload": {"kind": "Deployment", "name": "dask-worker"},
                "drain": {"timeout": "2m"},
            },
        }
    )

    def ready() -> bool:
        conditions = sandbox.get("memorypolicy", "spot").get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    sandbox.wait_for(ready, 120, "the policy to be Ready")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        placed = spread(sandbox, client, hooked=True)
        # The policy's next pass tells the scheduler where the new workers run: each hook names
        # only its own node, and they need not start together.
        sandbox.wait_for(lambda: located(client) == placed, 60, "the operator to locate the workers")
        node = sorted(set(placed.values()))[0]
        pods = sorted(p for p, n in placed.items() if n == node)
        receipts.install(client, prefixes=[f"{p}-" for p in pods])
        pod_of = {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        seconds, lost = preempt(sandbox, client, pods)
        print(f"memops: the node's workers left {seconds:.1f} s after the deletion, {len(lost)} keys lost")
        assert lost == [], sandbox.operator_log()[-3000:]
        assert seconds < GRACE, "drained and closed within the window, not killed at its end"
        # Each key once, to a worker that stays: none stopped on the sibling (whose own hook
        # would have moved it again), however far apart the two hooks start. A replacement pod
        # may land on the same node here (the node stays; only its pods were deleted), and is a
        # recipient like any other.
        before = set(pod_of)
        pod_of |= {a: str(w["name"]) for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        moved = [f"{p}-{i}" for p in pods for i in range(SIZE // KEY)]
        landing = receipts.landing(client, moved, pod_of, leaving=pods)
        print(f"memops: the preempted node's keys: {landing.line()}")
        assert landing.on_leaving == {}, f"keys received by a leaving worker: {landing.line()}"
        assert landing.repeated == {}, landing
        # A replacement that joins during the drain may take keys that the receipts do not record
        # (CI once had all of the second pod's keys on its sibling's replacement, none lost, none
        # recorded): a key that no receipt mentions must be held by such a late worker, and by it
        # alone, so that none of them stopped on a leaving worker unseen.
        late = set(pod_of) - before
        unrecorded = client.sync(client.scheduler.who_has, keys=landing.unreceived) if landing.unreceived else {}
        print(f"memops: {len(unrecorded)} keys on workers that joined during the drain, unrecorded")
        assert all(holders and set(holders) <= late for holders in unrecorded.values()), (landing, unrecorded, late)
        assert landing.receipts == landing.keys - len(unrecorded), landing
        drains = asyncio.run(dask_direct.drain_status(sandbox.scheduler_address))
        hooks = {d["name"]: d for d in drains.values() if d.get("origin") == "preStop"}
        assert set(hooks) == set(pods) and all(d["state"] == "done" for d in hooks.values()), drains

        # A hook's drain that runs out of time: one asked as the hook asks (by name, origin
        # preStop), with one key on its way at a time and a 1 s deadline, on a worker of the
        # other node.
        survivor = sorted(p for p in placed if p not in pods)[0]
        address = {str(w["name"]): a for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}[survivor]
        # Many small keys: a round trip per key and recipient, far more than the 1 s deadline.
        held = client.scatter({f"late-{i}": os.urandom(LATE) for i in range(400)}, workers=[address], hash=False)
        asyncio.run(
            dask_direct.start_drain(
                sandbox.scheduler_address,
                names=[survivor],
                deadline=1.0,
                window=1,
                close_workers=False,
                restore=True,
                origin="preStop",
            )
        )

        def recorded() -> list[dict[str, Any]]:
            status = sandbox.get("memorypolicy", "spot").get("status", {})
            return list((status.get("safetyNet") or {}).get("lostAtDeadline") or [])

        (loss,) = sandbox.wait_for(recorded, 60, "the hook's loss in the policy's status")
        assert loss["pod"] == survivor and loss["cause"] == "deadline"
        # Under load the deadline may pass before the first key moves: all 400 are then the loss.
        assert 0 < loss["keys"] <= 400 and loss["bytes"] >= loss["keys"] * LATE
        labels = {"namespace": sandbox.namespace, "policy": "spot", "cause": "deadline"}
        assert scrape(sandbox, "memops_safety_net_lost_keys_total", **labels) == loss["keys"]
        assert scrape(sandbox, "memops_safety_net_lost_bytes_total", **labels) == loss["bytes"]

        # Two more passes of the policy read the same drain status: it is counted once.
        def counted_once() -> bool:
            samples = metrics.scrape(sandbox)  # one scrape for both figures
            return (
                recorded() == [loss]
                and metrics.value(samples, "memops_safety_net_lost_keys_total", **labels) == loss["keys"]
                and metrics.value(samples, "memops_safety_net_lost_bytes_total", **labels) == loss["bytes"]
            )

        polling.stays(
            counted_once,
            seconds=2 * windows.POLICY_PASS,
            what="the hook's loss counted once",
        )
        assert len(client.gather(list(held.values()))) == 400  # restored: the worker kept them


def test_with_no_hook_the_nodes_data_is_lost(sandbox: Sandbox) -> None:
    """No MemoryPolicy in the namespace: the webhook adds no hook, and memops leaves its pods alone."""
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        placed = spread(sandbox, client, hooked=False)
        node = sorted(set(placed.values()))[0]
        pods = sorted(p for p, n in placed.items() if n == node)
        _, lost = preempt(sandbox, client, pods)
        assert len(lost) == 2 * SIZE // KEY
