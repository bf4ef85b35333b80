"""The eviction gate (a validating webhook on ``pods/eviction``) and the node signals.

The gate answers each eviction of a MemoryPolicy's worker pod by :func:`memops.decisions.eviction_gate.decide`:
admitted when the pod holds nothing unique, else refused with 429, which ``kubectl drain``,
cluster-autoscaler and Karpenter retry, while the node's workers drain in one RetirementRequest
with ``removePods: false``. The node handler starts that request as soon as a Node is tainted or
labelled for its end (:func:`memops.decisions.eviction_gate.node_signal`), before any eviction arrives.

The webhook must answer within its ``timeoutSeconds``: the scheduler is given
:data:`ASK_SECONDS`, and one that does not answer in time counts as unknown (refused while the
drain's deadline has not passed). State lives in the RetirementRequests only; their names are
the idempotency keys (:func:`memops.decisions.eviction_gate.request_name`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import kopf
import pydantic

from memops import specs
from memops.clients import daskrpc, kube
from memops.controllers import leases, policy, safetynet_webhook, scheduler_tls, standing, vetting, workloads
from memops.decisions import eviction_gate, leadership, objects, shapes, snapshots, timestamps

ASK_SECONDS = 4.0
"""The scheduler's share of the webhook's time (the chart's timeoutSeconds is 10)."""

Obj = dict[str, Any]

LEASE_ANNOTATION = objects.POLICY_LABEL
"""On the gate's Lease: ``<namespace>/<policy>``, the policy whose evictions it locks."""


def _policy_body(policies: Iterable[Mapping[str, Any]], name: str) -> Mapping[str, Any] | None:
    return next((p for p in policies if p["metadata"]["name"] == name), None)


eviction_requests = eviction_gate.node_requests


async def unique_bytes(client: kube.Kube, namespace: str, spec: specs.MemoryPolicySpec, pod: Obj) -> int | None:
    """What the pod's workers hold alone, by the scheduler; None if it cannot be told in time."""

    async def ask() -> int | None:
        # Identity only (no code sent) until the scheduler is shown to be this namespace's, then
        # the holdings on that same connection.
        query = {"processing": False}
        async with vetting.vetted(client, namespace, spec.scheduler, timeout=ASK_SECONDS, snapshot=query) as found:
            snapshot = found.snapshot
        assert snapshot is not None
        info = workloads.pod_info(pod)
        located = snapshots.workers_by_pod([info], snapshot.workers)
        return sum(w.unique_bytes for w in located.get(info.name, ()))

    try:
        return await asyncio.wait_for(ask(), timeout=ASK_SECONDS)
    except (
        TimeoutError,
        daskrpc.SchedulerUnreachable,
        daskrpc.Unvouched,
        scheduler_tls.SecretUnusable,
        kube.ApiError,
        ValueError,
    ):
        return None


async def request_drain(
    client: kube.Kube,
    *,
    policy_body: Mapping[str, Any],
    spec: specs.MemoryPolicySpec,
    node: str,
    pods: list[str],
    earlier: int,
    why: str,
    requested_by: str | None = None,
) -> Obj:
    """Create the node's Eviction RetirementRequest for these pods (a 409 means it exists: the
    same pods, the same name); return it as the API answered (on a 409: as it was sent, stamped
    now). ``requested_by``: the user of the eviction that started it (the gate's), recorded in
    :data:`memops.decisions.eviction_gate.REQUESTED_BY_ANNOTATION`."""
    namespace, name = str(policy_body["metadata"]["namespace"]), str(policy_body["metadata"]["name"])
    owner = objects.Owner(name=name, namespace=namespace, uid=str(policy_body["metadata"]["uid"]))
    body = eviction_gate.drain_request(
        owner, spec, node=node, pods=pods, earlier=earlier, why=why, requested_by=requested_by
    )
    try:
        created = await client.request(
            "POST", kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace), body=body
        )
    except kube.ApiError as exc:
        if exc.code != 409:
            raise
        created = {}
    if not (created.get("metadata") or {}).get("name"):
        created = body
        body["metadata"]["creationTimestamp"] = timestamps.render(timestamps.now())
    return created


async def post_event(
    client: kube.Kube, pod: Mapping[str, Any], reason: str, message: str, *, name: str, type_: str = "Warning"
) -> None:
    """An event on the pod, posted directly: Kopf's ``kopf.event`` works in resource handlers
    only, not in admission handlers. ``name`` is its idempotency key: an event of that name
    exists already (a retried eviction, the same episode) and nothing is posted."""
    meta = pod["metadata"]
    now = timestamps.render(timestamps.now())
    event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "memops"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        await client.request("POST", kube.resource_path("", "v1", "events", str(meta["namespace"])), body=event)
    except kube.ApiError as exc:
        if exc.code != 409:
            raise


def _policies(cache: policy.Cache) -> list[Mapping[str, Any]]:
    return [p for bodies in cache.of("memorypolicies").values() for p in bodies]


def _spec(body: Mapping[str, Any]) -> specs.MemoryPolicySpec | None:
    try:
        return specs.MemoryPolicySpec.model_validate(body.get("spec", {}))
    except pydantic.ValidationError:
        return None


def register_gate(registry: kopf.OperatorRegistry) -> None:
    """The webhook; registered only where the operator serves webhooks."""

    @kopf.on.validate(
        "pods",
        subresource="eviction",
        operations=["CREATE"],
        registry=registry,
        id="eviction-gate",
        ignore_failures=True,
    )
    async def gate(
        body: kopf.Body,
        memo: kopf.Memo,
        dryrun: bool,
        userinfo: kopf.UserInfo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,
    ) -> None:
        namespace = str(body.metadata.namespace or "")
        indexes = {index: kwargs[index] for index in policy.INDEX_NAMES.values()}
        try:
            cache = await standing.webhook_cache(memo, namespace, indexes)
        except kube.ApiError as exc:
            logger.warning("eviction review of %s/%s: cannot read its policies: %s", namespace, body.metadata.name, exc)
            return  # the API server decides the eviction itself, as when the operator is down
        await answer(body, memo=memo, cache=cache, dryrun=dryrun, userinfo=userinfo, logger=logger)

    # Optional: no finalizer on policies for it. A Lease left by a deletion the operator missed is
    # a few hundred bytes, and taken again by a policy of the same name.
    @kopf.on.delete(specs.GROUP, specs.VERSION, "memorypolicies", registry=registry, id="gate-lease", optional=True)
    async def forget_lease(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
        peer: standing.Standing | None = getattr(memo, "standing", None)
        if peer is not None and namespace:
            await leases.delete(memo.kube, peer.home, leadership.lease_name(namespace, name))


async def read_review(client: kube.Kube, body: kopf.Body, dryrun: bool) -> tuple[bool, Obj | None] | None:
    """The review's dry-run flag and the pod it names (None: no such pod); None when the API
    server could not tell (it decides the eviction itself). Raises a 400 for a malformed one."""
    namespace, name = str(body.metadata.namespace or ""), str(body.metadata.name or "")
    pod: Obj | None = None
    try:
        dryrun = eviction_gate.dry_run(shapes.check(shapes.EVICTION, dict(body), "eviction"), dryrun)
        if namespace and name:
            pod = await client.get_or_none(kube.resource_path("", "v1", "pods", namespace, name))
            if pod is not None:
                shapes.check(shapes.LISTED_POD, pod, "pod")
    except kube.ApiError:
        return None
    except shapes.MalformedObject as exc:  # refused: what the pod holds cannot be judged
        raise kopf.AdmissionError(f"memops cannot read this eviction: {exc}", code=400) from None
    return dryrun, pod


async def answer(
    body: kopf.Body,
    *,
    memo: kopf.Memo,
    cache: policy.Cache,
    dryrun: bool,
    userinfo: kopf.UserInfo,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> None:
    """The gate's answer to one eviction: returns to admit it, raises AdmissionError to refuse it."""
    # What the review says is a claim until the API bears it out: a review may come from
    # anyone who reaches the webhook (see memops.decisions.eviction_gate's docstring).
    namespace, name = str(body.metadata.namespace or ""), str(body.metadata.name or "")
    client: kube.Kube = memo.kube
    review = await read_review(client, body, dryrun)
    if review is None:
        return  # the API server decides the eviction itself
    dryrun, pod = review
    doubt = eviction_gate.confirm_claim(dict(body), pod)
    if doubt is not None or pod is None:
        logger.info("eviction review of %s/%s: nothing to do, %s", namespace, name, doubt)
        return
    found = safetynet_webhook.policy_for(
        namespace,
        dict((pod.get("metadata") or {}).get("labels") or {}),
        policies=cache.of("memorypolicies").get((namespace,), []),
        deployments=cache.of("deployments"),
    )
    if found is None or not found[1].eviction.gate:
        return
    policy_name, spec = found
    peer: standing.Standing | None = getattr(memo, "standing", None)
    held = await unique_bytes(client, namespace, spec, pod)
    user = eviction_gate.requested_by(userinfo)
    decision = await decide_and_drain(
        client,
        cache,
        memo.eviction_gate.guard(namespace, policy_name),
        pod=pod,
        policy_name=policy_name,
        spec=spec,
        held=held,
        dryrun=dryrun,
        user=user,
        logger=logger,
        holder=None if peer is None else peer.holder,
    )
    if decision.warning and not dryrun:
        try:
            event = eviction_gate.refusal_event_name(name, decision.episode)
            await post_event(
                client, pod, eviction_gate.REFUSED_EVENT, f"{decision.message} (eviction by {user})", name=event
            )
        except kube.ApiError as exc:  # the answer matters more than its event
            logger.warning("could not post the EvictionRefused event on %s: %s", name, exc)
    if not decision.allowed:
        raise kopf.AdmissionError(decision.message, code=decision.code)
    logger.info("eviction of %s by %s admitted: %s", name, user, decision.message)


@dataclasses.dataclass
class Guard:
    """One policy's gate: its decisions and drains one at a time, and the requests it made that
    the index may not show yet (see :func:`memops.decisions.eviction_gate.unseen_requests`)."""

    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    created: list[Mapping[str, Any]] = dataclasses.field(default_factory=list)


class Guards:
    """The gate's :class:`Guard` per (namespace, policy), in the operator's memo.

    Only a policy that exists (found in the index) gets one, and at most ``kept`` are
    kept: past that the least recently used idle ones (unlocked, nothing unseen) are forgotten.
    A busy one is never dropped, so that two reviews of one policy never hold two locks."""

    def __init__(self, kept: int = 1024):
        self.kept = kept
        self._guards: collections.OrderedDict[tuple[str, str], Guard] = collections.OrderedDict()

    def guard(self, namespace: str, policy_name: str) -> Guard:
        key = (namespace, policy_name)
        found = self._guards.get(key)
        if found is None:
            found = self._guards[key] = Guard()
        self._guards.move_to_end(key)
        if len(self._guards) > self.kept:
            idle = [k for k, g in self._guards.items() if k != key and not g.lock.locked() and not g.created]
            for k in idle[: len(self._guards) - self.kept]:
                del self._guards[k]
        return found

    def __len__(self) -> int:
        return len(self._guards)


async def decide_and_drain(
    client: kube.Kube,
    cache: policy.Cache,
    guard: Guard,
    *,
    pod: Obj,
    policy_name: str,
    spec: specs.MemoryPolicySpec,
    held: int | None,
    dryrun: bool,
    user: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    holder: leases.Holder | None = None,
) -> eviction_gate.Decision:
    """The gate's decision on ``pod``'s eviction (``held``: its unique bytes, by the scheduler),
    and the drain it starts, under ``guard``: reviews are answered concurrently, and each would
    otherwise read the same index and start its own drain past the bounds of
    :func:`memops.decisions.eviction_gate.guard_drain`.

    ``holder``: this replica, where the operator runs as several: the decision is then also made
    under the policy's Lease (:mod:`memops.controllers.leases`, in the operator's namespace), from the policy's
    requests as the API holds them, so that the bounds hold across replicas. While another
    replica holds the Lease the eviction is refused (429), to be retried."""
    async with guard.lock, _requests(client, cache, pod, policy_name, holder) as listed:
        if listed is None:
            return eviction_gate.Decision(
                eviction_gate.Verdict.REFUSE,
                f"another replica of memops decides an eviction of policy {policy_name}'s workers: retry the eviction",
            )
        return await _decide(
            client,
            cache,
            guard,
            listed,
            pod=pod,
            policy_name=policy_name,
            spec=spec,
            held=held,
            dryrun=dryrun,
            user=user,
            logger=logger,
        )


@contextlib.asynccontextmanager
async def _requests(
    client: kube.Kube, cache: policy.Cache, pod: Obj, policy_name: str, holder: leases.Holder | None
) -> AsyncIterator[Sequence[Mapping[str, Any]] | None]:
    """The policy's RetirementRequests the gate decides from: without ``holder``, its index's;
    with it, the API's, read and decided on under the policy's Lease; None while another
    replica holds the Lease."""
    namespace = str(pod["metadata"]["namespace"])
    if holder is None:
        yield list(cache.of("retirementrequests").get((namespace, policy_name), []))
        return
    name = leadership.lease_name(namespace, policy_name)
    locks = {LEASE_ANNOTATION: f"{namespace}/{policy_name}"}
    async with leases.held(client, holder.namespace, name, holder.identity, annotations=locks) as taken:
        if not taken:
            yield None
            return
        path = kube.resource_path(specs.GROUP, specs.VERSION, "retirementrequests", namespace)
        yield await client.list(path, label_selector=f"{objects.POLICY_LABEL}={policy_name}")


async def _decide(
    client: kube.Kube,
    cache: policy.Cache,
    guard: Guard,
    listed: Iterable[Mapping[str, Any]],
    *,
    pod: Obj,
    policy_name: str,
    spec: specs.MemoryPolicySpec,
    held: int | None,
    dryrun: bool,
    user: str,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> eviction_gate.Decision:
    """:func:`decide_and_drain` under its locks, from the policy's requests ``listed``."""
    name, node = str(pod["metadata"]["name"]), str(pod["spec"]["nodeName"])
    now = timestamps.now()
    indexed = shapes.well_formed(shapes.REQUEST, listed)
    guard.created = eviction_gate.unseen_requests(guard.created, indexed, now)
    mine = [*indexed, *guard.created]
    requests = eviction_requests(mine, node)
    decision = eviction_gate.guard_drain(
        eviction_gate.decide(
            pod=name,
            unique_bytes=held,
            request=eviction_gate.latest_request(name, requests),
            dry_run=dryrun,
            now=now,
        ),
        pod=name,
        node=node,
        running=eviction_gate.in_flight(requests),
        started=eviction_gate.gate_drains_since(mine, now),
    )
    if decision.start_drain and not dryrun:
        created = await start_drain(
            client,
            cache,
            pod=pod,
            policy_name=policy_name,
            spec=spec,
            node=node,
            user=user,
            logger=logger,
            earlier=len(requests),
        )
        if created is not None:
            guard.created.append(created)
    return decision


async def start_drain(
    client: kube.Kube,
    cache: policy.Cache,
    *,
    pod: Obj,
    policy_name: str,
    spec: specs.MemoryPolicySpec,
    node: str,
    user: str,
    earlier: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> Obj | None:
    """The gate's drain of ``pod``'s node: its workers of the policy, listed afresh from the API
    (the pod must be one of them), in one Eviction RetirementRequest that records ``user``; that
    request, or None if none was made. A failure is logged: the eviction is refused (429) all the
    same, and its retry tries again."""
    namespace, name = str(pod["metadata"]["namespace"]), str(pod["metadata"]["name"])
    policy_body = _policy_body(cache.of("memorypolicies").get((namespace,), []), policy_name)
    if policy_body is None:
        return None
    try:
        listed = shapes.well_formed(shapes.LISTED_POD, await workloads.pods(client, namespace, spec.workload))
        chosen = eviction_gate.pods_to_drain(listed, node, ())
        if name not in chosen:
            logger.info(
                "eviction of %s: not one of policy %s's running workers on %s; no drain", name, policy_name, node
            )
            return None
        made = await request_drain(
            client,
            policy_body=policy_body,
            spec=spec,
            node=node,
            pods=chosen,
            earlier=earlier,
            why=f"eviction of pod {name} by {user}",
            requested_by=user,
        )
    except kube.ApiError as exc:  # still refused (429): the next attempt creates it
        logger.warning("could not start the drain of %s: %s", name, exc)
        return None
    created = str(made["metadata"]["name"])
    logger.info("eviction of %s by %s refused; draining %s in %s", name, user, chosen, created)
    drains = ", ".join(chosen)
    message = f"eviction of pod {name} by {user} refused: memops drains {drains} first (RetirementRequest {created})"
    try:
        event = eviction_gate.drain_event_name(name, created)
        await post_event(client, pod, eviction_gate.DRAIN_STARTED_EVENT, message, name=event, type_="Normal")
    except kube.ApiError as exc:  # the request records the user too
        logger.warning("could not post the EvictionDrainStarted event on %s: %s", name, exc)
    return made


def register_node_signals(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.event("", "v1", "nodes", registry=registry, id="node-signals")
    async def node_signals(
        body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | logging.LoggerAdapter[Any], **kwargs: Any
    ) -> None:
        node = str(body.metadata.name)
        cache = policy.Cache({index: kwargs[index] for index in policy.INDEX_NAMES.values()})
        # This node's memo (Kopf keeps one per object): what was acted on last, per policy, so
        # that a storm of Node updates is not a storm of pod lists.
        seen: dict[str, tuple[str, float]] = memo.setdefault("memops_node_signals", {})
        for policy_body in _policies(cache):
            spec = _spec(policy_body)
            if spec is None:
                continue
            signal = eviction_gate.node_signal(dict(body), spec.eviction.nodeSignals)
            namespace, policy_name = str(policy_body["metadata"]["namespace"]), str(policy_body["metadata"]["name"])
            key, now = f"{namespace}/{policy_name}", time.monotonic()
            if signal is None:
                seen.pop(key, None)  # the node is back: a new signal acts at once
                continue
            if not eviction_gate.node_signal_due(seen, key, signal, now):
                continue
            seen[key] = (signal, now)
            requests = eviction_requests(cache.of("retirementrequests").get((namespace, policy_name), []), node)
            # Pods already in any of the node's Eviction requests were drained once: the gate
            # handles what they hold again, when their eviction comes.
            done = {w for r in requests for w in (r.get("spec") or {}).get("workers") or []}
            try:
                pods = eviction_gate.pods_to_drain(
                    await workloads.pods(memo.kube, namespace, spec.workload), node, done
                )
            except kube.ApiError as exc:
                del seen[key]  # the next event of this node tries again
                raise kopf.TemporaryError(f"cannot list the workers on node {node}: {exc}", delay=5) from exc
            if pods:
                made = await request_drain(
                    memo.kube,
                    policy_body=policy_body,
                    spec=spec,
                    node=node,
                    pods=pods,
                    earlier=len(requests),
                    why=f"node {node}: {signal}",
                )
                created = made["metadata"]["name"]
                logger.info("node %s has %s: draining %s in RetirementRequest %s", node, signal, pods, created)
