"""The safety net's preStop hook: the script that the webhook writes into a worker pod.

It runs in the worker's container, with the image's own Python and only what ``distributed``
brings (msgpack): :mod:`memops.clients.daskcomm`'s source and a short main that drains this pod's
workers through the scheduler. The safety net's pure decision
(:func:`memops.decisions.safetynet.plan_injection`) takes it as text, so that the deciding code
imports no client.
"""

from __future__ import annotations

import inspect

from memops.clients import daskcomm

_PRE_STOP_MAIN = """

# -- the preStop hook: drain this pod's workers through the scheduler ------------------------

import ipaddress

LEAVING = {"closing_gracefully", "closing", "closed"}
# The worker image's msgpack may allocate all of an array's items as its header arrives: short
# arrays keep what a reply's nested empty arrays cost to 8 MiB.
IDENTITY = Limit(bytes=WORKERS.bytes, objects=WORKERS.objects, items=SMALL.items)


def _canonical_ip(text):
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return ""  # a host name: no IP to compare


def _address_host(address):
    rest = str(address).split("://", 1)[-1]
    if rest.startswith("["):
        return _canonical_ip(rest[1:].split("]", 1)[0])
    return _canonical_ip(rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest)


def _is_ours(address, name, ips, names):
    # The pod's IP is the proof: pod IPs are unique in a cluster, and every worker of the pod
    # (dask worker without --name, --nworkers 2) listens on it. A name (the pod's, or
    # DASK_WORKER_NAME) counts only where no IP can disprove it: the worker advertises a host
    # name, or the pod has no IP of its own (hostNetwork). A worker with this name at another IP
    # is another pod's, such as the new pod of a dask-kubernetes worker Deployment, which
    # carries the same DASK_WORKER_NAME: draining it would retire someone else's worker.
    host = _address_host(address)
    if host and host in ips:
        return True
    return str(name) in names and (not ips or not host)


async def _statuses(comm, ips, names, only=None):
    # Worker address -> status, for the workers of this pod (of ``only``, once they are known).
    identity = await comm.call("identity", limit=IDENTITY)
    workers = identity.get("workers") if isinstance(identity, dict) else None
    if not isinstance(workers, dict):
        raise Misbehaved("identity is not a map of workers")
    return {
        str(address): str(info.get("status"))
        for address, info in workers.items()
        if isinstance(info, dict)
        and (str(address) in only if only is not None else _is_ours(address, info.get("name"), ips, names))
    }


async def _drain_states(comm, workers=None):
    # memops' drains (all of them, or of these addresses): address -> figures; {} without the agent.
    arguments = {"workers": sorted(workers)} if workers is not None else {}
    reply = await comm.call("memops_agent", operation="drain_status", limit=IDENTITY, **arguments)
    states = reply.get("result") if isinstance(reply, dict) else None
    if not isinstance(states, dict):
        return {}
    return {str(a): state for a, state in states.items() if isinstance(state, dict)}


async def _drain_by_memops(comm, workers, deadline):
    # memops' drain (the operator's agent in the scheduler): the keys worth most first, off
    # this node, each asked once, stopped at the deadline; every worker of the pod in one drain,
    # so that none takes another's keys. Not installed (or an agent without it): None, and
    # stock retire_workers does it.
    node = os.environ.get("MEMOPS_NODE_NAME", "")
    reply = await comm.call(
        "memops_agent",
        operation="drain",
        workers=sorted(workers),
        deadline=deadline,
        nodes={address: node for address in workers} if node else {},
        origin="preStop",
    )
    if not isinstance(reply, dict) or not isinstance(reply.get("result"), dict) or not reply["result"]:
        return None
    while True:
        states = await _drain_states(comm, workers)
        if not states:
            return None
        if all(state.get("state") != "draining" for state in states.values()):
            for address, state in sorted(states.items()):
                print("memops drain:", address, state, flush=True)
            return states
        await asyncio.sleep(0.2)


async def _retire(comm, workers):
    # Stock retire_workers. The scheduler retires nobody when no other worker can take the
    # unique data (say, in a rollout, before the new pods' workers have connected): the kubelet
    # would then kill the workers with their data. Ask again until every one is retired, or
    # gone, or the timeout ends. A worker that something else is retiring right now is waited
    # for, not retired twice: a second retirement could leave it stuck closing_gracefully.
    while True:
        statuses = await _statuses(comm, (), (), only=workers)
        if not statuses:
            return
        idle = sorted(a for a, status in statuses.items() if status not in LEAVING)
        if idle:
            await comm.call("retire_workers", workers=idle, close_workers=True, remove=True, limit=IDENTITY)
        await asyncio.sleep(0.5)


async def _main(deadline):
    ips = {_canonical_ip(ip.strip()) for ip in os.environ.get("MEMOPS_POD_IPS", "").split(",")} - {""}
    # dask-kubernetes names a worker by DASK_WORKER_NAME (its Deployment); otherwise the pod's name.
    names = {os.environ.get("DASK_WORKER_NAME", ""), os.environ.get("MEMOPS_POD_NAME", "")} - {""}
    context = None
    if os.environ.get("MEMOPS_TLS_CA"):  # PEM texts from the policy's Secret
        context = ssl_context_from_pem(
            os.environ["MEMOPS_TLS_CA"], os.environ["MEMOPS_TLS_CERT"], os.environ["MEMOPS_TLS_KEY"]
        )
    comm = await connect(os.environ["MEMOPS_SCHEDULER_ADDRESS"], ssl_context=context, timeout=10)
    async with comm:
        statuses = await _statuses(comm, ips, names)
        if not statuses:
            # memops' drain already took them (the operator retired this pod's workers, then
            # removed the pod): nothing is left to drain, and the hook did not fail.
            drained = [
                a for a, state in (await _drain_states(comm)).items()
                if state.get("state") != "draining" and _is_ours(a, state.get("name"), ips, names)
            ]
            if drained:
                print("drained by memops already:", ", ".join(sorted(drained)), flush=True)
                return 0
            # The scheduler answered, and no worker of this pod is there: nothing was drained.
            # A failed hook is what the kubelet records (FailedPreStopHook), and memops' status shows.
            print(
                "no worker of this pod is connected to the scheduler (pod IPs: %s, names: %s)"
                % (", ".join(sorted(ips)) or "none", ", ".join(sorted(names)) or "none"),
                file=sys.stderr,
                flush=True,
            )
            return 1
        states = await _drain_states(comm, statuses)
        # Leaving by stock retire_workers (not by memops' drain): waited for, never drained twice.
        # Leaving by memops' drain (the operator's RetirementRequest): asked again, it keeps its
        # drain and takes this hook's deadline if earlier, and this node as dying: a drain that
        # ran on past the hook's end would be killed.
        elsewhere = {
            a for a, status in statuses.items()
            if status in LEAVING and states.get(a, {}).get("state") != "draining"
        }
        ours = set(statuses) - elsewhere
        if ours and await _drain_by_memops(comm, ours, deadline) is None:
            await _retire(comm, ours)
        if elsewhere:
            await _retire(comm, elsewhere)
    return 0


# The pod's grace period, and a shorter one given at deletion (kubectl delete --grace-period,
# a preemption), are not visible in the container: the hook's deadline is what the webhook
# set (MEMOPS_DRAIN_DEADLINE) and no later than the drain's timeout. A shorter window ends the
# hook with SIGKILL; memops' drain has moved the keys worth most by then.
_DEADLINE = min(float(os.environ["MEMOPS_DRAIN_TIMEOUT"]), float(os.environ.get("MEMOPS_DRAIN_DEADLINE") or "inf"))
sys.exit(asyncio.run(asyncio.wait_for(_main(_DEADLINE), _DEADLINE + 5)))
"""

PRE_STOP_SCRIPT = inspect.getsource(daskcomm) + _PRE_STOP_MAIN
"""Runs in the worker's container, with the image's own Python and only what ``distributed``
brings (msgpack). It is :mod:`memops.clients.daskcomm`'s source and a short main, so the hook and the
operator share one client, and the hook never unpickles what the address sends it either.
It finds the pod's workers as the operator does (:func:`memops.decisions.snapshots.workers_by_pod`): every
worker whose address is on the pod's IP (``MEMOPS_POD_IPS``), so ``dask worker`` without
``--name`` and each of ``--nworkers 2`` are found, and drains them all in one drain; a worker
named after the pod (or ``DASK_WORKER_NAME``) only where no IP can tell (a host name as its
address, a ``hostNetwork`` pod). Finding none while the scheduler answers, it exits 1: the kubelet
records ``FailedPreStopHook``, which the policy's status shows (:func:`failed_hooks`), unless
memops' drain already took them (the operator retired them before removing the pod). A worker that
something else is retiring right now is waited for, not retired twice; one that memops' drain is
draining gets this hook's deadline and node in that drain."""
