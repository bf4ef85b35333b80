"""What a policy with ``spec.eviction.nodePressure`` reads of the kubelets of its workers' Nodes.

Per Node, each pass: the Node (allocatable memory, the ``MemoryPressure`` condition), the
kubelet's summary statistics and its configuration (``evictionHard``, ``enforceNodeAllocatable``)
from the kubelet itself (:mod:`memops.clients.kubelet_api`: ``nodes/stats`` and ``nodes/configz``,
never the node proxy), and the pods bound there (their requests and priorities,
which the kubelet ranks by). The configuration changes only when the kubelet restarts: it is
read once every few minutes. :mod:`memops.decisions.node_pressure` decides from it all.

Pods of every namespace are ranked, as the kubelet ranks them, but only the policy's own are
named in its status. Where the operator may not list the pods of the whole cluster (a
namespaced install: 403), it lists those of the policy's namespace on the Node, where its Role
allows it, so that its workers are ranked by their own requests and priorities; only the pods of
other namespaces are ranked from the summary alone (:func:`memops.decisions.node_pressure.node_memory`),
and the status says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from memops.clients import kube, kubelet_api
from memops.decisions import node_pressure
from memops.decisions.objects import Obj

CONFIG_SECONDS = 300.0
"""How long a kubelet's configuration read is used before it is read again."""
MAX_NODES = 64
"""Nodes read per pass at most: a policy whose workers spread wider reads the first 64 by name."""


Reading = Callable[[kube.Kube], AbstractAsyncContextManager[kubelet_api.Reader]]
"""One pass' reader of the kubelets, for the operator's client (its credentials)."""


class Kubelets:
    """The kubelets' configurations, each reused for :data:`CONFIG_SECONDS` (a cache only: a
    restart reads them again); ``ca_file``: what verifies the kubelets' serving certificates
    (``memops run --kubelet-ca-file``; None: the API server's CA); ``reading``, for tests: what
    answers for the kubelets."""

    def __init__(self, ca_file: str | None = None, reading: Reading | None = None) -> None:
        self.reading: Reading = reading or (lambda client: kubelet_api.reading(client.credentials, ca_file))
        self.configs: dict[str, tuple[float, Mapping[str, Any]]] = {}
        # When the cluster-wide listing of pods was last refused: a namespaced install is refused
        # every time, and asking anyway would cost a 403 per Node and pass.
        self.listing_refused: float | None = None

    async def bound(
        self, client: kube.Kube, node: str, namespaces: Sequence[str]
    ) -> tuple[list[Obj], Sequence[str] | None]:
        """The pods bound to ``node``, and the namespaces they are complete for (None: all). Where
        the cluster-wide listing is refused, those of ``namespaces`` (the policy's), each listed
        there, for :data:`CONFIG_SECONDS` before the cluster-wide one is asked again."""
        on_node = f"spec.nodeName={node}"
        refused = self.listing_refused
        if refused is None or time.monotonic() - refused >= CONFIG_SECONDS:
            try:
                pods = await client.list(kube.resource_path("", "v1", "pods"), field_selector=on_node)
            except kube.ApiError as exc:
                if exc.code != 403:
                    raise
                self.listing_refused = time.monotonic()
            else:
                self.listing_refused = None
                return pods, None
        listed = []
        for namespace in namespaces:
            listed += await client.list(kube.resource_path("", "v1", "pods", namespace), field_selector=on_node)
        return listed, namespaces

    async def config(self, reader: kubelet_api.Reader, node: Obj) -> Mapping[str, Any]:
        name = str((node.get("metadata") or {}).get("name", ""))
        cached = self.configs.get(name)
        if cached is not None and time.monotonic() - cached[0] < CONFIG_SECONDS:
            return cached[1]
        answer = await reader.get(node, "/configz")
        config = answer.get("kubeletconfig")
        found = config if isinstance(config, Mapping) else {}
        self.configs[name] = (time.monotonic(), found)
        return found


async def read(
    client: kube.Kube,
    kubelets: Kubelets,
    *,
    pods: Sequence[Obj],
    margin: int,
    logger: logging.Logger | logging.LoggerAdapter[Any],
) -> node_pressure.Seen:
    """The kubelets' predicted evictions on the Nodes of ``pods`` (the policy's workers, of its
    namespace: the one listed where the cluster-wide listing is refused)."""
    ours: dict[tuple[str, str], str] = {}
    nodes: set[str] = set()
    for pod in pods:
        meta, node = pod.get("metadata") or {}, (pod.get("spec") or {}).get("nodeName")
        if isinstance(node, str) and node:
            ours[(str(meta.get("namespace", "")), str(meta.get("name", "")))] = str(meta.get("name", ""))
            nodes.add(node)
    chosen = sorted(nodes)[:MAX_NODES]
    namespaces = sorted({namespace for namespace, _ in ours})
    async with kubelets.reading(client) as reader:
        answers = await asyncio.gather(
            *(_read_node(client, reader, kubelets, node, namespaces) for node in chosen), return_exceptions=True
        )
    predictions, problems, room, unlisted = [], [], {}, {}
    for node, answer in zip(chosen, answers, strict=True):
        if isinstance(answer, kube.ApiError):
            problems.append(f"node {node}: {answer.message}")
            continue
        if isinstance(answer, BaseException):
            raise answer
        if answer.unlisted:
            unlisted[node] = answer.unlisted
        tightest = answer.tightest
        if tightest is not None:
            room[node] = tightest.headroom - margin
        prediction = node_pressure.predict(answer, margin, ours)
        if prediction is not None:
            predictions.append(prediction)
        if prediction is not None and prediction.ours:
            logger.info(
                "node %s: %d bytes above the kubelet's %s threshold; it would evict %d pods, of this policy %s",
                node,
                prediction.headroom,
                prediction.signal,
                len(prediction.victims),
                list(prediction.ours),
            )
    return node_pressure.Seen(predictions=tuple(predictions), message="; ".join(problems), room=room, unlisted=unlisted)


async def _read_node(
    client: kube.Kube, reader: kubelet_api.Reader, kubelets: Kubelets, node: str, namespaces: Sequence[str]
) -> node_pressure.NodeMemory:
    found = await client.get(kube.resource_path("", "v1", "nodes", name=node))
    summary, config = await asyncio.gather(reader.get(found, "/stats/summary"), kubelets.config(reader, found))
    bound, listed = await kubelets.bound(client, node, namespaces)
    return node_pressure.node_memory(found, summary, config, bound, listed=listed)
