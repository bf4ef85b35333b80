"""The README's walk-through, on real Nodes, as a newcomer types it: data on the workers, then
``kubectl apply -f deploy/examples/retirementrequest.yaml`` as it is. Its address,
``tcp://dask-scheduler:8786``, is how the namespace's pods reach the scheduler's Service; the
operator, a pod of another namespace, dials that Service of the request's namespace."""

from __future__ import annotations

import os
from pathlib import Path

import distributed
import yaml

from tests.e2e.conftest import Sandbox

EXAMPLE = Path(__file__).parents[2] / "deploy" / "examples" / "retirementrequest.yaml"


def test_the_example_retirement_request_applies_as_it_is(real_sandbox: Sandbox) -> None:
    sandbox = real_sandbox
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["spec"]["scheduler"]["address"] == "tcp://dask-scheduler:8786"
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        client.wait_for_workers(4, timeout=60)
        # The README's one command that puts data on the workers.
        client.publish_dataset(demo=client.scatter([os.urandom(2**20) for _ in range(64)]))
        held = client.has_what()
        assert sum(1 for keys in held.values() if keys) >= 2, held

        sandbox.kubectl("apply", "-f", str(EXAMPLE))
        request = sandbox.wait_phase("shrink", "Succeeded", "Failed", timeout=180)
        assert request["status"]["phase"] == "Succeeded", request["status"]
        assert request["status"]["bytesMoved"] > 0, "the drained workers held data: some of it moved"
        assert sandbox.replicas() == 2
        sandbox.wait_for(lambda: len(sandbox.pods()) == 2, what="the drained pods gone")
        demo = client.get_dataset("demo")
        assert len(client.gather(demo)) == 64, "every key of the dataset is still there"
