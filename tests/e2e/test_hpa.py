"""A real HorizontalPodAutoscaler, the controller-manager's, scales a MemoryPolicy through its
``/scale`` subresource, and every scale-down it decides is a drain.

Its metric comes from a small external metrics server that this test runs and serves over TLS:
``external.metrics.k8s.io/v1beta1`` registered by an APIService (with the test's CA as its
``caBundle``) whose Service is of type ``ExternalName`` pointing at ``localhost``. The API
server's aggregator resolves such a Service to ``https://<externalName>:<APIService port>``
(``ResolveCluster`` in k8s.io/apiserver's util/proxy; the sandbox does not set
``--enable-aggregator-routing``, which would ask for Endpoints, and Endpoints with a loopback
address are refused by validation). The HPA controller asks the aggregator, the aggregator asks
the server, with the front proxy's client certificate.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import distributed
import pytest
from memops_sandbox import certs
from memops_sandbox import common as sandbox_cli

from tests import polling
from tests.e2e import windows
from tests.e2e.conftest import Sandbox
from tests.e2e.data import scatter_unique
from tests.e2e.test_policy import memory_policy, owned_requests
from tests.e2e.test_upstream_controllers import ready

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
METRIC = "dask_pending_work"
SERVICE = "test-metrics"
API_SERVICE = f"v1beta1.{GROUP_VERSION.split('/')[0]}"


class MetricsServer:
    """``external.metrics.k8s.io/v1beta1`` with one metric in every namespace, whose value the
    test sets; it records the paths it was asked for."""

    def __init__(self, directory: Path, value: int, namespace: str):
        self.value = value
        self.namespace = namespace
        self.asked: list[str] = []
        self.ca = certs.authority("test-metrics-ca")
        # The aggregator verifies the name <service>.<namespace>.svc against the caBundle.
        host = f"{SERVICE}.{namespace}.svc"
        pair = certs.issue(self.ca, host, dns_names=(host,), server=True)
        cert, key = pair.write(directory, "metrics")
        self.port = sandbox_cli.free_port()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                owner.asked.append(path)
                prefix = f"/apis/{GROUP_VERSION}"
                if path == prefix:
                    resource = {"name": METRIC, "namespaced": True, "kind": "ExternalMetricValueList", "verbs": ["get"]}
                    body: dict[str, Any] = {
                        "kind": "APIResourceList",
                        "apiVersion": "v1",
                        "groupVersion": GROUP_VERSION,
                        "resources": [resource],
                    }
                elif path.startswith(f"{prefix}/namespaces/") and path.endswith(f"/{METRIC}"):
                    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
                    item = {"metricName": METRIC, "metricLabels": {}, "timestamp": now, "value": str(owner.value)}
                    body = {"kind": "ExternalMetricValueList", "apiVersion": GROUP_VERSION, "items": [item]}
                else:
                    self.send_error(404)
                    return
                payload = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the test's output is for its assertions

        return Handler

    def __enter__(self) -> MetricsServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metrics(tmp_path: Path, sandbox: Sandbox) -> Iterator[MetricsServer]:
    """The server, for the test's namespace; its APIService (cluster-wide) goes before the namespace."""
    with MetricsServer(tmp_path, value=4, namespace=sandbox.namespace) as server:
        try:
            yield server
        finally:
            sandbox.kubectl("delete", "apiservice", API_SERVICE, "--ignore-not-found", check=False)


def register(sandbox: Sandbox, server: MetricsServer) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE},
        "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"port": server.port}]},
    }
    api_service = {
        "apiVersion": "apiregistration.k8s.io/v1",
        "kind": "APIService",
        "metadata": {"name": API_SERVICE},
        "spec": {
            "group": GROUP_VERSION.split("/")[0],
            "version": "v1beta1",
            "service": {"name": SERVICE, "namespace": server.namespace, "port": server.port},
            "caBundle": base64.b64encode(server.ca.pem).decode(),
            "groupPriorityMinimum": 100,
            "versionPriority": 100,
        },
    }
    sandbox.apply(service)
    sandbox.apply(api_service)

    def available() -> bool:
        status = sandbox.get("apiservice", api_service["metadata"]["name"]).get("status", {})
        return any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", []))

    sandbox.wait_for(available, timeout=60, what="the APIService Available")


def autoscaler(policy: str) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": policy},
        "spec": {
            "scaleTargetRef": {"apiVersion": "memops.dev/v1alpha1", "kind": "MemoryPolicy", "name": policy},
            "minReplicas": 1,
            "maxReplicas": 4,
            "metrics": [
                {
                    "type": "External",
                    "external": {"metric": {"name": METRIC}, "target": {"type": "AverageValue", "averageValue": "1"}},
                }
            ],
            # At once, for the test; the controller-manager's default window (5 minutes, 30 s in
            # the sandbox) is what a cluster wants.
            "behavior": {"scaleDown": {"stabilizationWindowSeconds": 0}},
        },
    }


def hpa_condition(sandbox: Sandbox, name: str, kind: str) -> dict[str, Any] | None:
    status = sandbox.get("hpa", name).get("status", {})
    return next((c for c in status.get("conditions", []) if c["type"] == kind), None)


def test_a_real_hpa_scales_the_policy_and_every_scale_down_is_a_drain(sandbox: Sandbox, metrics: MetricsServer) -> None:
    pods = sandbox.pods()
    assert len(pods) == 4
    sandbox.apply(memory_policy("autoscaled", sandbox.scheduler_address, replicas=4))
    sandbox.wait_for(lambda: ready(sandbox, "autoscaled"), what="the policy Ready")
    register(sandbox, metrics)
    with distributed.Client(sandbox.scheduler_address, timeout=30) as client:
        holdings = scatter_unique(client, dict.fromkeys(pods, 5))
        sandbox.apply(autoscaler("autoscaled"))

        def active() -> bool:
            condition = hpa_condition(sandbox, "autoscaled", "ScalingActive")
            return bool(condition and condition["status"] == "True")

        sandbox.wait_for(active, timeout=60, what="the HPA reading the metric (ScalingActive)")
        # A wrong scale could come on any later sync of the HPA (every 2 s here) and be acted on by
        # any pass of the policy: none comes over a whole pass.
        polling.stays(
            lambda: (
                sandbox.get("mempol", "autoscaled")["spec"]["replicas"] == 4
                and sandbox.replicas() == 4
                and not owned_requests(sandbox, "autoscaled")
            ),
            seconds=windows.POLICY_PASS,
            what="4 pending / 1 per worker: no change",
        )

        metrics.value = 2  # the HPA wants ceil(2 / 1) = 2 workers
        sandbox.wait_for(
            lambda: sandbox.get("mempol", "autoscaled")["spec"]["replicas"] == 2,
            timeout=60,
            what="the HPA writing replicas 2 through /scale",
        )
        sandbox.wait_for(
            lambda: sandbox.replicas() == 2 and len(sandbox.pods()) == 2, timeout=180, what="the drained scale-down"
        )
        gone = set(pods) - set(sandbox.pods())
        requests = sandbox.wait_for(
            lambda: (
                (found := owned_requests(sandbox, "autoscaled"))
                and all(r.get("status", {}).get("phase") in ("Succeeded", "Failed") for r in found)
                and found
            ),
            timeout=60,
            what="the policy's RetirementRequests finished",
        )
        assert [r["status"]["phase"] for r in requests] == ["Succeeded"] * len(requests)
        retired = {w["pod"] for r in requests for w in r["status"].get("workers", [])}
        assert gone <= retired, f"pods removed without a drain: {gone - retired}"
        assert holdings.lost() == []
        holdings.assert_all_correct()
        assert set(client.has_what()) and len(client.has_what()) == 2

    hpa = sandbox.get("hpa", "autoscaled")
    assert hpa["status"]["desiredReplicas"] == 2
    assert hpa["status"]["currentMetrics"][0]["external"]["metric"]["name"] == METRIC
    # The HPA asked this server, through the aggregator, for the policy's namespace.
    assert f"/apis/{GROUP_VERSION}/namespaces/{sandbox.namespace}/{METRIC}" in metrics.asked
