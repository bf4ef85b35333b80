"""Replication targets, operator side: pure decisions from pods, nodes and the scheduler's figures.

Called by :mod:`memops.controllers.replication_install` on every policy pass:

- :func:`agent_rules`: ``spec.replication`` as the plain data that memops' agent takes
  (:func:`memops.scheduler.rules.parse`): key rules as written, each pod rule turned into the
  addresses of the worker pods it marks (by their node's labels, or their own), and each
  worker's node and zone (``topology.kubernetes.io/zone``) for placement;
- :func:`plan_annotations`: which worker pods get a merge-patch of memops' annotations, so that
  ``kubectl get pods`` shows what each pod holds alone. Written only when a value moved by a
  meaningful amount, and at most once per pod per :data:`MIN_SECONDS`: a worker's figures move
  on every pass, and a write per pod per pass would load the API server (at 200 workers and a
  2 s pass, 6,000 writes a minute). ``controller.kubernetes.io/pod-deletion-cost`` rides in the
  same patch, so that a scale-down that memops does not drive (an HPA on the Deployment, a
  ``kubectl scale``) still removes the pod that holds the least data alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions.objects import POD_DELETION_COST

ZONE_LABEL = "topology.kubernetes.io/zone"
UNIQUE_BYTES = "memops.dev/unique-bytes"
REPLICATED_BYTES = "memops.dev/replicated-bytes"
TARGET = "memops.dev/replication-target"
UNDER = "memops.dev/under-replicated-keys"
UPDATED = "memops.dev/replication-updated"  # when memops last wrote them (seconds, wall clock)
ANNOTATIONS = (UNIQUE_BYTES, REPLICATED_BYTES, TARGET, UNDER)
MIN_SECONDS = 30.0
"""A pod's annotations are written at most this often."""
MOVED_SHARE = 0.10
MOVED_BYTES = 2**20
"""A byte figure is rewritten when it moved by more than both of these (10% and 1 MiB)."""
MAX_COST = 2**31 - 1  # pod-deletion-cost is an int32

Obj = Mapping[str, Any]


def label_selector_matches(selector: specs.LabelSelector, labels: Mapping[str, str]) -> bool:
    """Kubernetes' LabelSelector semantics: every matchLabels pair and every expression holds."""
    if any(labels.get(k) != v for k, v in selector.matchLabels.items()):
        return False
    for expression in selector.matchExpressions:
        present = expression.key in labels
        value = labels.get(expression.key)
        if expression.operator == "In" and value not in expression.values:
            return False
        if expression.operator == "NotIn" and present and value in expression.values:
            return False
        if expression.operator == "Exists" and not present:
            return False
        if expression.operator == "DoesNotExist" and present:
            return False
    return True


def marks(selector: specs.PodSelector, pod: Obj, node_labels: Mapping[str, str]) -> bool:
    if selector.nodeSelector is not None:
        return all(node_labels.get(k) == v for k, v in selector.nodeSelector.items())
    assert selector.labelSelector is not None  # the spec's validator: exactly one
    return label_selector_matches(selector.labelSelector, pod.get("metadata", {}).get("labels") or {})


def agent_rules(
    spec: specs.ReplicationSpec,
    *,
    pods: Sequence[Obj],
    nodes: Mapping[str, Mapping[str, str]],
    addresses: Mapping[str, str],
    ceiling: float,
) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """(rules, places) for the agent. ``nodes``: node name -> its labels; ``addresses``: pod
    name -> its worker's address (pods with no worker yet are left out)."""
    key_rules: list[dict[str, Any]] = []
    pod_rules: list[dict[str, Any]] = []
    for rule in spec.rules:
        if rule.keys is not None:
            key_rules.append({**rule.keys.model_dump(exclude_none=True), "replicas": rule.replicas})
            continue
        assert rule.pods is not None
        marked = sorted(
            addresses[name]
            for pod in pods
            if (name := str(pod["metadata"]["name"])) in addresses
            and marks(rule.pods, pod, nodes.get(str(pod.get("spec", {}).get("nodeName", "")), {}))
        )
        pod_rules.append({"workers": marked, "replicas": rule.replicas})
    places: dict[str, tuple[str, str]] = {}
    for pod in pods:
        name = str(pod["metadata"]["name"])
        node = str(pod.get("spec", {}).get("nodeName") or "")
        if name in addresses:
            places[addresses[name]] = (node, str(nodes.get(node, {}).get(ZONE_LABEL, "")))
    rules = {
        "default": spec.default,
        "keys": key_rules,
        "pods": pod_rules,
        "maxReplicatedFraction": spec.maxReplicatedFraction,
        "ceiling": ceiling,
    }
    return rules, places


@dataclasses.dataclass(frozen=True)
class PodFigures:
    unique_bytes: int
    replicated_bytes: int
    target: int
    under_keys: int

    def annotations(self) -> dict[str, str]:
        return {
            UNIQUE_BYTES: str(self.unique_bytes),
            REPLICATED_BYTES: str(self.replicated_bytes),
            TARGET: str(self.target),
            UNDER: str(self.under_keys),
            POD_DELETION_COST: str(min(self.unique_bytes // 2**20, MAX_COST)),
        }


def _moved(old: str | None, new: str, *, counts: bool) -> bool:
    if old is None:
        return True
    try:
        before, after = int(old), int(new)
    except ValueError:
        return True
    if counts:
        return before != after
    return abs(after - before) > max(MOVED_BYTES, MOVED_SHARE * max(before, after))


def plan_annotations(
    pods: Mapping[str, Mapping[str, str]], figures: Mapping[str, PodFigures], now: float
) -> dict[str, dict[str, str]]:
    """Pod name -> the annotations to merge-patch onto it (pods not listed get no write).

    ``pods``: each pod's current annotations. A pod is written when one of its figures moved
    meaningfully (a byte figure by more than 10% and 1 MiB; a count or target at all), and
    its last write (:data:`UPDATED`) is at least :data:`MIN_SECONDS` old, or it has none.
    """
    patches: dict[str, dict[str, str]] = {}
    for pod, new in figures.items():
        current = pods.get(pod)
        if current is None:
            continue
        try:
            last = float(current.get(UPDATED, "") or "-inf")
        except ValueError:
            last = float("-inf")
        if now - last < MIN_SECONDS:
            continue
        wanted = new.annotations()
        if any(
            _moved(current.get(k), v, counts=k in (TARGET, UNDER)) for k, v in wanted.items() if k != POD_DELETION_COST
        ):
            patches[pod] = {**wanted, UPDATED: f"{now:.0f}"}
    return patches


def pod_figures(
    *, agent_workers: Mapping[str, Sequence[int]], addresses: Mapping[str, str], default: int
) -> dict[str, PodFigures]:
    """Pod name -> its figures, from the agent's per-worker ``[replicated bytes,
    under-replicated keys, target, unique bytes]`` (by address)."""
    result = {}
    for pod, address in addresses.items():
        given = [int(x) for x in agent_workers.get(address, ())][:4]
        replicated, under, target, unique = given + [0, 0, default, 0][len(given) :]
        result[pod] = PodFigures(unique, replicated, target, under)
    return result
