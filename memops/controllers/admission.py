"""The mutating admission webhook: worker pods of a MemoryPolicy's workload get the safety net.

Kopf serves the webhook and, with ``settings.admission.managed``, creates the
MutatingWebhookConfiguration itself (the sandbox); the Helm chart and the kustomize manifests
ship their own and run ``memops run --webhook-unmanaged`` with a certificate from a Secret.
The handler finds the policy whose workload selects the new pod and applies
:func:`memops.safetynet.plan_injection`. It ignores its own failures (``failurePolicy: Ignore``):
an operator that is down must never block pod creation.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pydantic

from memops import kube, safetynet, selectors, specs
from memops.controllers import workloads

CONFIGURATION = "memops.dev"


def configure(
    settings: kopf.OperatorSettings,
    *,
    port: int,
    host: str,
    insecure: bool,
    certfile: str | None = None,
    pkeyfile: str | None = None,
    managed: bool = True,
) -> None:
    """Serve the webhook; Kopf registers the MutatingWebhookConfiguration only when ``managed``."""
    settings.admission.server = kopf.WebhookServer(
        addr=host, port=port, host=host, insecure=insecure, certfile=certfile, pkeyfile=pkeyfile
    )
    settings.admission.managed = CONFIGURATION if managed else None


async def policy_for(
    client: kube.Kube, namespace: str, labels: dict[str, str]
) -> tuple[str, specs.MemoryPolicySpec] | None:
    """The oldest valid MemoryPolicy in the namespace whose workload selects these labels."""
    policies = await client.list(kube.resource_path(specs.GROUP, specs.VERSION, "memorypolicies", namespace))
    for policy in sorted(policies, key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"])):
        try:
            spec = specs.MemoryPolicySpec.model_validate(policy.get("spec", {}))
        except pydantic.ValidationError:
            continue
        workload = await workloads.get(client, namespace, spec.workload)
        if workload is not None and selectors.matches(workloads.selector_of(workload), labels):
            return str(policy["metadata"]["name"]), spec
    return None


def register(registry: kopf.OperatorRegistry) -> None:
    @kopf.on.mutate("pods", operations=["CREATE"], registry=registry, id="safety-net", ignore_failures=True)
    async def inject(
        body: kopf.Body,
        patch: kopf.Patch,
        memo: kopf.Memo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        namespace = body.metadata.namespace or "default"
        found = await policy_for(memo.kube, namespace, dict(body.metadata.labels))
        if found is None:
            return
        name, spec = found
        change = safetynet.plan_injection(dict(body), name, spec)
        patch.spec.update(change["spec"])
        patch.metadata["annotations"] = change["annotations"]
        logger.info(
            "pod of MemoryPolicy %s: preStop drain and a grace period of %ss",
            name,
            change["spec"].get("terminationGracePeriodSeconds"),
        )
