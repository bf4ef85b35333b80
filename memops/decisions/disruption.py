"""Node autoscalers told to leave a worker's node while it holds data that exists nowhere else.

Pure: :func:`plan_annotations` says which worker pods get a merge-patch of
``karpenter.sh/do-not-disrupt: "true"`` and ``cluster-autoscaler.kubernetes.io/safe-to-evict:
"false"`` (set while the worker holds unique bytes, taken off once it holds none), from each pod's
annotations and labels and the unique bytes the scheduler reports per worker. The policy pass
(:mod:`memops.controllers.policy`) reads both and writes the patches
(:func:`memops.controllers.workloads.patch_metadata`): one merge-patch per pod that changes, none
for the others.

Both annotations block the autoscaler for as long as they stay (cluster-autoscaler issue 3183: a
forgotten one blocks scale-down for ever), so memops marks the ones it sets
(:data:`memops.decisions.objects.PROTECTED_ANNOTATION`) and takes off only those; a pod that
carries either annotation without memops' mark is its owner's and is never written. A worker's
unique bytes come and go with every task that finishes, so protection is added at once but taken
off no sooner than :data:`MIN_SECONDS` after it was set: a pod is written at most twice a minute.

Protection never outlives what justifies it, whatever a scheduler (the tenant's own) reports:

- it is bounded in time, per pod: from the first time memops protected the pod
  (:data:`memops.decisions.objects.PROTECTION_BEGAN_ANNOTATION`, kept for the pod's life) to
  :func:`bound` later, the lower of the policy's ``spec.eviction.maxDisruptionProtection`` and the
  administrator's ``memops run --max-disruption-protection``. Counted from the first protection,
  not the latest, so that a scheduler whose unique bytes come and go cannot renew it;
- it goes once the scheduler has been out of reach for :data:`UNREACHABLE_SECONDS`: nothing can
  say any more that the worker holds data alone;
- it goes from pods that left the policy's workload (a new ``spec.workload``) and, with
  :func:`release`, from every pod of a policy that is gone or cannot act: those are found by
  memops' own label (:data:`memops.decisions.objects.PROTECTED_LABEL`), not by the workload;
- the administrator turns it off per namespace (:class:`Administrator`).

Past the bound a worker's data is still drained before its pod goes: the eviction gate refuses an
autoscaler's eviction (429) while memops drains it, and the preStop hook drains on deletion.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping

from memops import specs
from memops.decisions.objects import (
    DO_NOT_DISRUPT,
    PROTECTED_ANNOTATION,
    PROTECTED_LABEL,
    PROTECTION_BEGAN_ANNOTATION,
    SAFE_TO_EVICT,
)

PROTECTED = {DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"}
"""What a pod with unique data carries."""
MIN_SECONDS = 30.0
"""Protection stays at least this long once set: the replication annotations' write period
(:data:`memops.decisions.replication_plan.MIN_SECONDS`)."""
DEFAULT_MAX = "1h"
"""The administrator's bound unless ``memops run --max-disruption-protection`` says otherwise: long
enough for a drain or a burst of work to move the data on, short enough that an autoscaler gets
its node back the same hour."""
MAX_MAX = specs.MAX_AGE
"""The longest bound an administrator may set: a year, as a recycling ``maxAge``."""
UNREACHABLE_SECONDS = 300.0
"""Protection goes once the scheduler has been out of reach this long: a restarted scheduler is
back well within it, and cluster-autoscaler then still waits its scale-down-unneeded-time (10
minutes by default) before it removes the node."""
_SKEW_SECONDS = 60.0
"""How far ahead of this operator's clock a time written by another of its replicas may be."""
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

Patch = dict[str, dict[str, str | None]]
"""A merge-patch of a pod's metadata: ``annotations`` and ``labels``, where None removes one."""


@dataclasses.dataclass(frozen=True)
class Administrator:
    """What the cluster's administrators set for every policy: the longest protection
    (``memops run --max-disruption-protection``) and the namespaces with none at all
    (``--no-disruption-protection-in``). An operator flag rather than a label on the namespace:
    only whoever runs the operator can change it, it needs no permission on Namespaces (which
    namespaced mode does not hold), and no tenant who may edit their namespace can take it back."""

    max_seconds: float = specs.parse_duration(DEFAULT_MAX).total_seconds()
    off_namespaces: frozenset[str] = frozenset()

    def max_in(self, namespace: str) -> float:
        """The administrator's bound in ``namespace``: 0 where protection is off."""
        return 0.0 if namespace in self.off_namespaces else self.max_seconds


DEFAULTS = Administrator()


def administrator(max_protection: str = DEFAULT_MAX, off_namespaces: Iterable[str] = ()) -> Administrator:
    """The operator's flags, checked: raises ValueError for a duration that is none or longer than
    :data:`MAX_MAX`, or a namespace that is no namespace name (a typo would turn nothing off)."""
    seconds = specs.parse_duration(max_protection, MAX_MAX).total_seconds()
    off = frozenset(off_namespaces)
    for namespace in sorted(off):
        if len(namespace) > 63 or not _NAMESPACE.match(namespace):
            raise ValueError(f"--no-disruption-protection-in: {namespace!r} is not a namespace name")
    return Administrator(max_seconds=seconds, off_namespaces=off)


def bound(eviction: specs.EvictionSpec, administrator_seconds: float) -> float:
    """How long a pod of the policy may be protected in all (0: never): the policy's own
    ``maxDisruptionProtection`` can only lower the administrator's bound."""
    own = eviction.maxDisruptionProtection
    if own is None:
        return administrator_seconds
    return min(specs.parse_duration(own).total_seconds(), administrator_seconds)


@dataclasses.dataclass(frozen=True)
class PodSeen:
    """One pod as the pass read it."""

    annotations: Mapping[str, str]
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    ours: bool = True
    """A pod of the policy's current ``spec.workload``; False: found only by memops' label."""


def plan_annotations(
    pods: Mapping[str, PodSeen],
    unique: Mapping[str, int] | None,
    *,
    policy: str,
    enabled: bool,
    max_seconds: float,
    now: float,
    unreachable_since: float | None = None,
) -> dict[str, Patch]:
    """Pod name -> the merge-patch of its metadata (pods not listed get no write).

    ``pods``: the workload's pods and those carrying ``policy``'s label. ``unique``: the bytes each
    pod's worker holds alone, a pod missing there (its worker not connected) being left as it is;
    None when the scheduler was not reached, since ``unreachable_since`` (None: unknown, counted
    as long ago). ``enabled``: ``spec.eviction.disruptionAnnotations``; ``max_seconds``:
    :func:`bound`. Off, or 0, memops takes off what it set.
    """
    patches: dict[str, Patch] = {}
    for name, pod in pods.items():
        if not (enabled and pod.ours and max_seconds > 0):
            patch = _release_one(pod, policy, now)
        elif unique is None:
            gone = unreachable_since is None or now - unreachable_since >= UNREACHABLE_SECONDS
            patch = _plan_one(pod, None, policy=policy, max_seconds=max_seconds, now=now, give_up=gone)
        else:
            patch = _plan_one(pod, unique.get(name), policy=policy, max_seconds=max_seconds, now=now)
        if patch:
            patches[name] = patch
    return patches


def release(pods: Mapping[str, PodSeen], policy: str, now: float) -> dict[str, Patch]:
    """Pod name -> the merge-patch that takes ``policy``'s protection off it: the policy is gone, or
    cannot act. A pod that another policy labelled since is that policy's."""
    patches = {name: _release_one(pod, policy, now) for name, pod in pods.items()}
    return {name: patch for name, patch in patches.items() if patch}


def _plan_one(
    pod: PodSeen, unique: int | None, *, policy: str, max_seconds: float, now: float, give_up: bool = False
) -> Patch:
    current = pod.annotations
    mine = PROTECTED_ANNOTATION in current
    if not mine and any(key in current for key in PROTECTED):
        return _unlabel(pod, policy)  # set by someone else: theirs to remove
    began = _began(current, now)
    expired = began is not None and now - began >= max_seconds
    if mine and (expired or give_up):
        return _unprotect(pod, began)
    if unique is not None and unique > 0 and not expired:
        return _protect(pod, policy, now)
    if mine and unique is not None and now - _since(current[PROTECTED_ANNOTATION], now) >= MIN_SECONDS:
        return _unprotect(pod, began)
    return {} if mine else _unlabel(pod, policy)


def _release_one(pod: PodSeen, policy: str, now: float) -> Patch:
    label = pod.labels.get(PROTECTED_LABEL)
    if label is not None and label != policy:
        return {}
    if PROTECTED_ANNOTATION in pod.annotations:
        return _unprotect(pod, _began(pod.annotations, now))
    return _unlabel(pod, policy)


def _protect(pod: PodSeen, policy: str, now: float) -> Patch:
    """The marks, memops' mark since when, when protection first began, and the policy's label;
    nothing when the pod carries them all already."""
    current = pod.annotations
    since = current.get(PROTECTED_ANNOTATION) or f"{now:.0f}"
    annotations = {**PROTECTED, PROTECTED_ANNOTATION: since, PROTECTION_BEGAN_ANNOTATION: _began_text(current, since)}
    if all(current.get(k) == v for k, v in annotations.items()) and pod.labels.get(PROTECTED_LABEL) == policy:
        return {}
    return {"annotations": dict(annotations), "labels": {PROTECTED_LABEL: policy}}


def _unprotect(pod: PodSeen, began: float | None) -> Patch:
    """Off, all that memops set but when protection first began, which stays: a later protection of
    the pod counts towards the same bound."""
    annotations: dict[str, str | None] = dict.fromkeys((*PROTECTED, PROTECTED_ANNOTATION))
    if PROTECTION_BEGAN_ANNOTATION not in pod.annotations:
        annotations[PROTECTION_BEGAN_ANNOTATION] = f"{began:.0f}" if began is not None and math.isfinite(began) else "0"
    patch: Patch = {"annotations": annotations}
    if PROTECTED_LABEL in pod.labels:
        patch["labels"] = {PROTECTED_LABEL: None}
    return patch


def _unlabel(pod: PodSeen, policy: str) -> Patch:
    """The policy's label alone, left on a pod without memops' mark (its annotations taken off by hand)."""
    return {"labels": {PROTECTED_LABEL: None}} if pod.labels.get(PROTECTED_LABEL) == policy else {}


def _began(annotations: Mapping[str, str], now: float) -> float | None:
    """When memops first protected the pod; marks set before that was recorded count from their own
    time. None: never protected."""
    text = annotations.get(PROTECTION_BEGAN_ANNOTATION) or annotations.get(PROTECTED_ANNOTATION)
    return _since(text, now) if text is not None else None


def _began_text(annotations: Mapping[str, str], since: str) -> str:
    return annotations.get(PROTECTION_BEGAN_ANNOTATION) or since


def _since(text: str, now: float) -> float:
    """A time memops wrote. Whoever may edit the pod may edit it too, so one that is unreadable, or
    later than now (beyond the operator replicas' clock skew: a bound that would never run out),
    counts as long ago: protection then ends."""
    try:
        found = float(text)
    except ValueError:
        return float("-inf")
    return found if math.isfinite(found) and found <= now + _SKEW_SECONDS else float("-inf")
