"""A scheduler address that names a Service of the policy's namespace is dialled at the
Service's cluster IP, as the namespace's pods reach it: the operator's own pod is in another
namespace, where ``dask-scheduler`` means something else, or nothing.

Inputs: the upstream control plane (the suite's ``plane``), a namespace per test with its
Services, read by :func:`memops.controllers.vetting.dialled` as the admin.
"""

from __future__ import annotations

from typing import Any

from memops.clients import kube
from memops.controllers import vetting

POD = "w-1"


def service(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": "dask-scheduler"}, "ports": [{"port": 8786}], **spec},
    }


async def test_a_service_of_the_namespace_is_dialled_at_its_cluster_ip(client: tuple[kube.Kube, str]) -> None:
    kube_client, namespace = client
    created = await kube_client.request("POST", f"/api/v1/namespaces/{namespace}/services", body=service("sched"))
    cluster_ip = created["spec"]["clusterIP"]
    for host in ("sched", f"sched.{namespace}", f"sched.{namespace}.svc", f"sched.{namespace}.svc.cluster.local"):
        assert await vetting.dialled(kube_client, namespace, f"tcp://{host}:8786") == f"tcp://{cluster_ip}:8786"
    assert await vetting.dialled(kube_client, namespace, "tls://sched:8786") == f"tls://{cluster_ip}:8786"


async def test_other_addresses_are_dialled_as_written(client: tuple[kube.Kube, str]) -> None:
    """A headless Service (no cluster IP: its pods' DNS names are the way), a Service that does
    not exist, another namespace's Service, an IP address: as written."""
    kube_client, namespace = client
    path = f"/api/v1/namespaces/{namespace}/services"
    await kube_client.request("POST", path, body=service("headless", clusterIP="None"))
    await kube_client.request("POST", "/api/v1/namespaces", body={"metadata": {"name": f"{namespace}-b"}})
    try:
        await kube_client.request("POST", f"/api/v1/namespaces/{namespace}-b/services", body=service("sched"))
        for address in (
            "tcp://headless:8786",
            "tcp://missing:8786",
            f"tcp://sched.{namespace}-b:8786",
            f"tcp://sched.{namespace}-b.svc.cluster.local:8786",
            "tcp://10.0.0.1:8786",
        ):
            assert await vetting.dialled(kube_client, namespace, address) == address
    finally:
        await kube_client.request("DELETE", f"/api/v1/namespaces/{namespace}-b")
