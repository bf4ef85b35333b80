"""The mutating admission webhook: worker pods of a MemoryPolicy's workload get the safety net.

Kopf serves the webhook and, with ``settings.admission.managed``, creates the
MutatingWebhookConfiguration itself (the sandbox); the Helm chart and the kustomize manifests
ship their own and run ``memops run --webhook-unmanaged`` with a certificate from a Secret.
The handler finds the policy whose workload selects the new pod and applies
:func:`memops.decisions.safetynet.plan_injection`. It ignores its own failures (``failurePolicy: Ignore``):
an operator that is down must never block pod creation.

On the replica that reconciles, a pod creation costs no API request: the policies and
Deployments come from the Kopf indexes that the policy controller keeps anyway
(:mod:`memops.controllers.policy`), and a DaskWorkerGroup's pods are recognised by labels made of
its name alone. A paused replica's indexes are stale: its webhook reads the pod's namespace's
policies and their Deployments from the API (:mod:`memops.controllers.standing`). Only the pod's own
namespace is looked at, so a reply never names another namespace's policy or Secret.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import kopf
import pydantic

from memops import specs
from memops.clients import prestop_hook
from memops.controllers import policy, standing, webhook_server, workloads
from memops.decisions import safetynet, selectors, shapes, shared_spill
from memops.worker import owner

CONFIGURATION = "memops.dev"
OWNER_SCRIPT = inspect.getsource(owner)
"""What the spill owner sidecar runs (``sharedSpill.swap: SpillOnly``): :mod:`memops.worker.owner`,
stdlib only, by the worker image's Python."""


def configure(
    settings: kopf.OperatorSettings,
    *,
    port: int,
    host: str,
    insecure: bool,
    certfile: str | None = None,
    pkeyfile: str | None = None,
    managed: bool = True,
    client_ca: str | None = None,
    client_names: Collection[str] = (),
) -> None:
    """Serve the webhook; Kopf registers the MutatingWebhookConfiguration only when ``managed``.
    ``client_ca``/``client_names``: who may call it (:mod:`memops.controllers.webhook_server`)."""
    settings.admission.server = webhook_server.server(
        port=port,
        host=host,
        insecure=insecure,
        certfile=certfile,
        pkeyfile=pkeyfile,
        client_ca=client_ca,
        client_names=client_names,
    )
    settings.admission.managed = CONFIGURATION if managed else None


def policy_for(
    namespace: str,
    labels: Mapping[str, str],
    *,
    policies: Iterable[Mapping[str, Any]],
    deployments: Mapping[tuple[str, ...], Iterable[Mapping[str, Any]]],
) -> tuple[str, specs.MemoryPolicySpec] | None:
    """The oldest valid MemoryPolicy of ``namespace`` whose workload selects these labels.

    ``policies`` are the namespace's policies and ``deployments`` the Deployments by
    ``(namespace, name)``, as the policy controller's indexes keep them. A policy of another
    namespace is never chosen, even if handed in: its Secret could not be the pod's. Malformed
    cached objects (not :data:`memops.decisions.shapes.LISTED`) are left out.
    """
    listed = shapes.well_formed(shapes.LISTED, policies)
    mine = [p for p in listed if p["metadata"].get("namespace", namespace) == namespace]
    for body in sorted(mine, key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"])):
        try:
            spec = specs.MemoryPolicySpec.model_validate(body.get("spec", {}))
        except pydantic.ValidationError:
            continue
        if spec.workload.kind == specs.WorkloadKind.DASK_WORKER_GROUP:
            # Its pods carry labels made of the group's name: nothing to read.
            name = spec.workload.name
            workload: dict[str, Any] | None = {"kind": spec.workload.kind.value, "metadata": {"name": name}}
        else:
            found = shapes.well_formed(shapes.LISTED, deployments.get((namespace, spec.workload.name)) or [])
            workload = {"kind": "Deployment", **found[0]} if found else None
        if workload is not None and selectors.matches(workloads.selector_of(workload), labels):
            return str(body["metadata"]["name"]), spec
    return None


def plan_for_pod(
    pod: Mapping[str, Any],
    *,
    policies: Iterable[Mapping[str, Any]],
    deployments: Mapping[tuple[str, ...], Iterable[Mapping[str, Any]]],
    host_roots: frozenset[str] = frozenset(),
) -> tuple[str, dict[str, Any]] | None:
    """The new pod's change (:func:`memops.decisions.safetynet.plan_injection`) and its policy's name, or
    None when no policy's workload selects it. Pure: what the handler decides, from the pod and
    the caches. Raises :class:`memops.decisions.shapes.MalformedObject` for a pod whose fields are not what
    the API server sends; malformed cached objects are left out."""
    shapes.check(shapes.POD, pod, "pod")
    metadata = pod.get("metadata") or {}
    namespace = metadata.get("namespace") or "default"
    found = policy_for(
        namespace,
        dict(metadata.get("labels") or {}),
        policies=policies,
        deployments=deployments,
    )
    if found is None:
        return None
    name, spec = found
    return name, safetynet.plan_injection(
        pod,
        name,
        spec,
        hook=prestop_hook.PRE_STOP_SCRIPT,
        host_roots=host_roots,
        namespace=namespace,
        owner_script=OWNER_SCRIPT,
    )


def register(registry: kopf.OperatorRegistry, *, host_roots: frozenset[str] = frozenset()) -> None:
    """The webhook's handler; ``host_roots``: the host directories medium Node may mount."""

    @kopf.on.mutate("pods", operations=["CREATE"], registry=registry, id="safety-net", ignore_failures=True)
    async def inject(
        body: kopf.Body,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **kwargs: Any,
    ) -> None:
        namespace = body.metadata.namespace or "default"
        try:
            indexes = {name: kwargs[name] for name in policy.INDEX_NAMES.values()}
            cache = await standing.webhook_cache(memo, namespace, indexes)
            planned = plan_for_pod(
                dict(body),
                policies=cache.of("memorypolicies").get((namespace,), []),
                deployments=cache.of("deployments"),
                host_roots=host_roots,
            )
        except shapes.MalformedObject as exc:  # created as it is: the webhook never blocks a pod
            logger.warning("pod left without the safety net: %s", exc)
            return
        except Exception:
            # Kopf answers any other exception with allowed: false, which failurePolicy: Ignore
            # does not cover (the call succeeded): a defect here must not block pod creation.
            logger.exception("pod left without the safety net: the webhook failed")
            return
        if planned is None:
            return
        name, change = planned
        patch.spec.update(change["spec"])
        patch.metadata["annotations"] = change["annotations"]
        logger.info(
            "pod of MemoryPolicy %s: preStop drain and a grace period of %ss",
            name,
            change["spec"].get("terminationGracePeriodSeconds"),
        )
        spilled = change["annotations"].get(shared_spill.ANNOTATION)
        if spilled is not None:
            # The reason's full text is the policy's SharedSpillReady condition.
            log = logger.warning if spilled.startswith("Refused") else logger.info
            log("pod of MemoryPolicy %s: shared spill: %s", name, spilled)
