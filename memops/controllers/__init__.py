"""The operator: Kopf handlers, and the only code that talks to the Kubernetes API.

``make_registry()`` builds a fresh Kopf registry with every memops handler (tests make one
per test); ``run()`` runs the operator with memops' own Kopf settings: the ``memops.dev``
persistence prefix, finalizer and peering, so that memops never collides with another Kopf
operator (dask-kubernetes' is one) in the same cluster.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any, cast

import kopf

from memops.clients import kube
from memops.controllers import eviction_webhook, policy, retirement, safetynet_webhook, standing
from memops.decisions import disruption, leadership, resize_decisions

PREFIX = "memops.dev"


DIFFBASE_LIMIT = 4096
"""Bytes of spec that Kopf's diff base keeps verbatim; a larger spec is kept as its digest."""


class SpecDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """Kopf's last-handled-configuration annotation, holding the spec only, and at most ~4 KiB.

    Kopf's default copies the object's labels and annotations into the annotation, so a user's
    200 KB annotation became a 600 KB object, past the API server's 256 KiB cap on
    annotations (and every patch of Kopf's then failed). memops' handlers react to spec
    changes only (``refuse-spec-change``, ``field="spec"``), so the spec is all the diff needs;
    a spec too large to copy (a thousand long pod names) is kept as its SHA-256, which still
    tells a change, though not what changed.
    """

    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        essence: dict[str, Any] = dict(super().build(body=body, extra_fields=extra_fields))
        essence.pop("metadata", None)
        spec = essence.get("spec")
        if spec is not None:
            text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
            if len(text) > DIFFBASE_LIMIT:
                essence["spec"] = {"sha256": hashlib.sha256(text.encode()).hexdigest()}
        return cast(kopf.BodyEssence, essence)


def configure(settings: kopf.OperatorSettings) -> None:
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = SpecDiffBaseStorage(prefix=PREFIX, key="last-handled-configuration")
    settings.peering.name = standing.PEERING
    settings.peering.mandatory = False
    settings.peering.lifetime = leadership.PEERING_LIFETIME
    # Kopf turns handler logs into Kubernetes events from INFO up; memops posts its own
    # events, so only warnings and errors from the handlers become events.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300


@dataclasses.dataclass(frozen=True)
class Webhook:
    """Where the admission webhook listens and how it is reached.

    ``insecure`` serves plain HTTP (the sandbox only). ``certfile``/``pkeyfile`` serve TLS with a
    certificate from files (a mounted Secret; Kopf re-reads them when they change); without them
    Kopf self-signs. ``managed``: Kopf creates and patches the MutatingWebhookConfiguration; off
    when the installer (Helm chart, kustomize) ships it. ``client_ca``: a PEM bundle of the CA
    that signs the API server's client certificate for webhooks, which is then required;
    ``client_names``: the names (CN or DNS SAN) that certificate may carry, if pinned.
    """

    port: int
    host: str = "127.0.0.1"
    insecure: bool = False
    certfile: str | None = None
    pkeyfile: str | None = None
    managed: bool = True
    client_ca: str | None = None
    client_names: tuple[str, ...] = ()


def _log_settings(
    logger: logging.Logger | logging.LoggerAdapter[Any],
    host_roots: frozenset[str],
    protection: disruption.Administrator,
    growth: resize_decisions.Administrator,
) -> None:
    """What the administrators allowed, once at start: ``memops run``'s flags that bound the tenants."""
    if host_roots:
        logger.info("shared spill of medium Node may mount: %s", ", ".join(sorted(host_roots)))
    else:
        logger.info("shared spill of medium Node is refused: no --shared-spill-host-root")
    logger.info(
        "disruption annotations: at most %.0f s per pod; none in: %s",
        protection.max_seconds,
        ", ".join(sorted(protection.off_namespaces)) or "no namespace",
    )
    logger.info(
        "in-place growth: in %s; up to %s%s",
        ", ".join(sorted(growth.namespaces)) or "no namespace (no --resize-in)",
        resize_decisions.to_quantity(growth.ceiling),
        "".join(f", {n}: {resize_decisions.to_quantity(c)}" for n, c in growth.ceilings),
    )


def make_registry(
    kubeconfig: str | None = None,
    webhook: Webhook | None = None,
    *,
    host_roots: frozenset[str] = frozenset(),
    protection: disruption.Administrator = disruption.DEFAULTS,
    growth: resize_decisions.Administrator = resize_decisions.NOBODY,
    kubelet_ca: str | None = None,
    peer: standing.Standing | None = None,
) -> kopf.OperatorRegistry:
    """The administrator's bounds, ``memops run``'s flags: ``host_roots`` (``--shared-spill-host-root``),
    ``protection`` (the disruption annotations), ``growth`` (``--resize-in``, in-place growth) and
    ``kubelet_ca`` (``--kubelet-ca-file``; None: the API server's CA verifies the kubelets).
    ``peer``: this replica's identity and priority among the operator's replicas; None runs
    without peers (a standalone operator, and tests)."""
    registry = kopf.OperatorRegistry()
    # One source of credentials for Kopf and for memops' own client: when Kopf logs in again (a
    # 401, or the credentials' expiration), memops' client gets the new ones too, and the other way.
    credentials = kube.load_connection(kubeconfig)

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.ConnectionInfo:
        return await credentials.login()

    @kopf.on.startup(registry=registry)
    async def startup(
        settings: kopf.OperatorSettings,
        memo: kopf.Memo,
        logger: logging.Logger | logging.LoggerAdapter[Any],
        **_: Any,
    ) -> None:
        configure(settings)
        if peer is not None:
            settings.peering.priority = peer.priority
        memo.standing = peer
        if webhook is not None:
            safetynet_webhook.configure(settings, **dataclasses.asdict(webhook))
        memo.kube = kube.Kube(credentials)
        _log_settings(logger, host_roots, protection, growth)
        memo.policy_wakers = {}  # policy uid -> asyncio.Event: see memops.controllers.policy
        memo.retirement_daemons = set()  # uids of requests whose daemon runs: see memops.controllers.retirement
        # per policy: see memops.controllers.eviction_webhook.decide_and_drain
        memo.eviction_gate = eviction_webhook.Guards()

    @kopf.on.cleanup(registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        if getattr(memo, "kube", None) is not None:
            await memo.kube.close()

    retirement.register(registry)
    policy.register(registry, host_roots=host_roots, protection=protection, growth=growth, kubelet_ca=kubelet_ca)
    eviction_webhook.register_node_signals(registry)
    if webhook is not None:
        safetynet_webhook.register(registry, host_roots=host_roots)
        eviction_webhook.register_gate(registry)
    return registry


async def run(
    *,
    namespaces: Sequence[str] = (),
    kubeconfig: str | None = None,
    liveness_endpoint: str | None = None,
    standalone: bool = False,
    webhook: Webhook | None = None,
    host_roots: frozenset[str] = frozenset(),
    protection: disruption.Administrator = disruption.DEFAULTS,
    growth: resize_decisions.Administrator = resize_decisions.NOBODY,
    kubelet_ca: str | None = None,
) -> None:
    """Run the operator until cancelled; cluster-wide unless namespaces are given."""
    peer = None if standalone else standing.standing(tuple(namespaces))
    registry = make_registry(
        kubeconfig,
        webhook,
        host_roots=host_roots,
        protection=protection,
        growth=growth,
        kubelet_ca=kubelet_ca,
        peer=peer,
    )
    await kopf.operator(
        registry=registry,
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness_endpoint,
        standalone=standalone,
        memo=kopf.Memo(),
        identity=None if peer is None else cast(Any, peer.identity),
    )
