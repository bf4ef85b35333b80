"""Node autoscalers' annotations end to end: a worker pod carries them only while it holds data
that exists nowhere else, and a pod's own annotation is its owner's."""

from __future__ import annotations

from typing import Any

import distributed
import pytest

from memops.decisions import disruption
from memops.decisions.objects import DO_NOT_DISRUPT, PROTECTED_ANNOTATION, SAFE_TO_EVICT
from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import memory_policy


def annotations(sandbox: Sandbox, pod: str) -> dict[str, str]:
    found: dict[str, str] = sandbox.get("pod", pod)["metadata"].get("annotations") or {}
    return found


def autoscaler_view(sandbox: Sandbox, pod: str) -> dict[str, Any]:
    """What a node autoscaler reads of the pod, and memops' mark."""
    found = annotations(sandbox, pod)
    return {key: found.get(key) for key in (DO_NOT_DISRUPT, SAFE_TO_EVICT, PROTECTED_ANNOTATION)}


def owner_only(sandbox: Sandbox, pod: str) -> bool:
    """The pod carries its owner's do-not-disrupt and nothing of memops'."""
    found = annotations(sandbox, pod)
    return found.get(DO_NOT_DISRUPT) == "true" and SAFE_TO_EVICT not in found and PROTECTED_ANNOTATION not in found


@pytest.mark.timeout(420)  # two windows of a disruption decision each, and the protection's minimum time
def test_a_worker_with_unique_data_keeps_node_autoscalers_away_until_it_holds_none(
    sandbox: Sandbox,
) -> None:
    holder, owned, bare, *_ = sandbox.pods()
    # The pod's owner protects this one: memops never writes an annotation it did not set.
    sandbox.kubectl("annotate", "pod", owned, f"{DO_NOT_DISRUPT}=true")
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, {holder: 4})
        sandbox.apply(memory_policy("protect", sandbox.scheduler_address))

        protected = sandbox.wait_for(
            lambda: (view := autoscaler_view(sandbox, holder))[DO_NOT_DISRUPT] and view,
            what="the unique data's pod protected",
        )
        assert protected[DO_NOT_DISRUPT] == "true" and protected[SAFE_TO_EVICT] == "false", protected
        assert protected[PROTECTED_ANNOTATION], "memops marks what it set"
        # The holder's protection was one decision; a wrong mark may come on any later one.
        polling.stays(
            lambda: autoscaler_view(sandbox, bare) == dict.fromkeys(protected) and owner_only(sandbox, owned),
            seconds=windows.DISRUPTION_DECISION,
            what="a worker without unique data is free, and the owner's pod carries only its owner's annotation",
        )

        holdings.assert_all_correct()
        # The data released: the holder has nothing left to lose, and both annotations go (no
        # sooner than the minimum time they stay once set). (A second copy would do too, but
        # Dask's own ReduceReplicas drops it within seconds.)
        client.cancel(list(holdings.futures.values()))
        holdings.futures.clear()
        sandbox.wait_for(
            lambda: not client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)),
            what="the keys released",
        )
        released = sandbox.wait_for(
            lambda: (view := autoscaler_view(sandbox, holder))[DO_NOT_DISRUPT] is None and view,
            timeout=disruption.MIN_SECONDS + 90,
            what="the protection taken off once the worker holds no unique data",
        )
        assert released == dict.fromkeys(released), released
        polling.stays(
            lambda: owner_only(sandbox, owned),
            seconds=windows.DISRUPTION_DECISION,
            what="the owner's annotation stays",
        )
