"""The operator's Prometheus endpoint, scraped around a real drain and parsed with prometheus_client."""

from __future__ import annotations

import urllib.request

import distributed
from prometheus_client.parser import text_string_to_metric_families

from memops.controllers import metrics
from tests.e2e.conftest import Sandbox, retirement_request
from tests.e2e.data import scatter_unique


def scrape(sandbox: Sandbox) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(sandbox.metrics_url(), timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        assert family.name in metrics.NAMES or not family.name.startswith("memops_"), family.name
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_a_drain_shows_in_the_metrics(sandbox: Sandbox) -> None:
    pods = sandbox.pods()
    before = scrape(sandbox)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 4))
        sandbox.apply(retirement_request("measured", scheduler={"address": sandbox.scheduler_address}, count=1))
        sandbox.wait_phase("measured", "Succeeded", "Failed")
        holdings.assert_all_correct()
    after = scrape(sandbox)
    # The operator serves every test's namespace: each figure is this namespace's, or a change.
    ns = {"namespace": sandbox.namespace}
    assert value(after, "memops_drains_started_total", **ns) == value(before, "memops_drains_started_total", **ns) + 1
    finished = {**ns, "outcome": "Succeeded", "reason": "Retired"}
    assert value(after, "memops_drains_finished_total", **finished) == 1
    assert value(after, "memops_drain_moved_bytes_total", **ns) >= 4 * 256 * 1024
    assert value(after, "memops_drained_workers_total", **ns, state="Retired") == 1
    assert value(after, "memops_drain_duration_seconds_count", **ns, outcome="Succeeded") == 1
    decisions = "memops_decision_duration_seconds_count"
    assert value(after, decisions, decision="choose_workers") > value(before, decisions, decision="choose_workers")
    # Bounded labels: no pod (worker) name is ever a label value.
    assert not any(pod in dict(labels).values() for _, labels in after for pod in pods)
