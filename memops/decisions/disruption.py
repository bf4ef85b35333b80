"""Node autoscalers told to leave a worker's node while it holds data that exists nowhere else.

Pure: :func:`plan_annotations` says which worker pods get a merge-patch of
``karpenter.sh/do-not-disrupt: "true"`` and ``cluster-autoscaler.kubernetes.io/safe-to-evict:
"false"`` (set while the worker holds unique bytes, taken off once it holds none), from each pod's
annotations and the unique bytes the scheduler reports per worker. The policy pass
(:mod:`memops.controllers.policy`) reads both and writes the patches with the replication
annotations' writer (:func:`memops.controllers.workloads.patch_annotations`): one merge-patch per
pod that changes, none for the others.

Both annotations block the autoscaler for as long as they stay (cluster-autoscaler issue 3183: a
forgotten one blocks scale-down for ever), so memops marks the ones it sets
(:data:`memops.decisions.objects.PROTECTED_ANNOTATION`) and takes off only those; a pod that
carries either annotation without memops' mark is its owner's and is never written. A worker's
unique bytes come and go with every task that finishes, so protection is added at once but taken
off no sooner than :data:`MIN_SECONDS` after it was set: a pod is written at most twice a minute.
"""

from __future__ import annotations

from collections.abc import Mapping

from memops.decisions.objects import DO_NOT_DISRUPT, PROTECTED_ANNOTATION, SAFE_TO_EVICT

PROTECTED = {DO_NOT_DISRUPT: "true", SAFE_TO_EVICT: "false"}
"""What a pod with unique data carries."""
MIN_SECONDS = 30.0
"""Protection stays at least this long once set: the replication annotations' write period
(:data:`memops.decisions.replication_plan.MIN_SECONDS`)."""

Patch = dict[str, str | None]
"""A merge-patch of a pod's annotations: None removes one."""


def plan_annotations(
    pods: Mapping[str, Mapping[str, str]], unique: Mapping[str, int], *, enabled: bool, now: float
) -> dict[str, Patch]:
    """Pod name -> the annotations to merge-patch onto it (pods not listed get no write).

    ``pods``: each worker pod's current annotations. ``unique``: the bytes each pod's worker holds
    alone; a pod missing there (its worker not connected) is left as it is. ``enabled``:
    ``spec.eviction.disruptionAnnotations``; off, memops takes off what it set.
    """
    patches: dict[str, Patch] = {}
    for pod, current in pods.items():
        patch = _plan_one(current, unique.get(pod), enabled=enabled, now=now)
        if patch:
            patches[pod] = patch
    return patches


def _plan_one(current: Mapping[str, str], unique: int | None, *, enabled: bool, now: float) -> Patch:
    mine = PROTECTED_ANNOTATION in current
    if not mine and any(key in current for key in PROTECTED):
        return {}  # set by someone else: theirs to remove
    if not enabled:
        return _unprotect() if mine else {}
    if unique is None:
        return {}
    if unique > 0:
        if mine and all(current.get(k) == v for k, v in PROTECTED.items()):
            return {}
        since = current.get(PROTECTED_ANNOTATION) if mine else None
        return {**PROTECTED, PROTECTED_ANNOTATION: since or f"{now:.0f}"}
    if mine and now - _since(current[PROTECTED_ANNOTATION]) >= MIN_SECONDS:
        return _unprotect()
    return {}


def _unprotect() -> Patch:
    return dict.fromkeys((*PROTECTED, PROTECTED_ANNOTATION))


def _since(text: str) -> float:
    """When memops set the protection; an unreadable mark counts as long ago (it is then removed)."""
    try:
        return float(text)
    except ValueError:
        return float("-inf")
