"""Start the upstream control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, from the binaries of :mod:`memops_sandbox.build`.

:func:`running` makes fresh certificates (:mod:`memops_sandbox.certs`), starts the four
processes (each in its own process group, its log in ``DIR/logs/<name>.log``), waits until
the API server's ``/readyz`` answers ok and the ``default`` ServiceAccount exists (the
controller-manager is then working), writes the admin kubeconfig to ``DIR/kubeconfig``, and
yields a :class:`Plane`. On exit it stops every process, last started first.

The API server authorizes with Node and RBAC, admits with its default plugins plus
NodeRestriction, and writes an audit log (``DIR/audit.log``, JSON lines at Metadata level:
user, verb, resource, response code) so that tests can read who did what. It calls admission
webhooks at ``127.0.0.1:<Plane.webhook_port>`` with a client certificate of the sandbox's
webhook-client CA (:func:`admission_configuration`), as a cluster's API server is given one for
memops' webhook, which then answers no one else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import json
import logging
import signal
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from memops_sandbox import build, certs, common

logger = logging.getLogger(__name__)
CLUSTER_NAME = "memops-sandbox"
HPA_SYNC_PERIOD = "2s"
HPA_DOWNSCALE_STABILIZATION = "30s"
SERVICE_CIDR = "10.96.0.0/16"  # routed by kube-proxy on real Nodes; only allocated on the node agent's
KUBERNETES_SERVICE_IP = "10.96.0.1"
"""The ``kubernetes`` Service's ClusterIP: the first of :data:`SERVICE_CIDR`."""
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        # Leases are renewed every few seconds by every node and controller: no one asks who. The
        # leases of other namespaces (memops' eviction gate's) are logged.
        {
            "level": "None",
            "namespaces": ["kube-node-lease", "kube-system"],
            "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}],
        },
        {"level": "Metadata"},
    ],
}


def kubeconfig(
    server: str,
    ca: bytes,
    *,
    user: str,
    cert: bytes | None = None,
    key: bytes | None = None,
    token: str | None = None,
    token_file: Path | None = None,
    namespace: str = "default",
) -> str:
    """A kubeconfig with everything embedded: a client certificate, or a bearer token; or one that
    names the file holding its token (``tokenFile``: clients read it again when it changes)."""
    return multi_kubeconfig(server, ca, {user: _credentials(cert, key, token, token_file)}, namespace=namespace)


def _credentials(
    cert: bytes | None, key: bytes | None, token: str | None, token_file: Path | None = None
) -> dict[str, str]:
    credentials: dict[str, str] = {}
    if cert is not None and key is not None:
        credentials["client-certificate-data"] = base64.b64encode(cert).decode()
        credentials["client-key-data"] = base64.b64encode(key).decode()
    if token is not None:
        credentials["token"] = token
    if token_file is not None:
        credentials["tokenFile"] = str(token_file)
    return credentials


def multi_kubeconfig(server: str, ca: bytes, users: dict[str, dict[str, str]], *, namespace: str = "default") -> str:
    """A kubeconfig with one context per user, each named as its user; the first is current."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CLUSTER_NAME,
                "cluster": {"server": server, "certificate-authority-data": base64.b64encode(ca).decode()},
            }
        ],
        "users": [{"name": user, "user": credentials} for user, credentials in users.items()],
        "contexts": [
            {"name": user, "context": {"cluster": CLUSTER_NAME, "user": user, "namespace": namespace}} for user in users
        ],
        "current-context": next(iter(users)),
    }
    return yaml.safe_dump(config, sort_keys=False)


def _die_with_parent() -> None:
    """Run in the child before exec: the kernel SIGKILLs it if the sandbox dies without
    stopping it (a SIGKILL to the sandbox, a crash), so no component outlives its sandbox."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


async def spawn(
    name: str, argv: Sequence[str], logs: Path, env: dict[str, str] | None = None
) -> asyncio.subprocess.Process:
    """Start one component in its own process group, its output appended to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)
    with (logs / f"{name}.log").open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    (logs / f"{name}.pid").write_text(f"{process.pid}\n")
    return process


@dataclasses.dataclass
class Plane:
    """A running control plane, and an admin's way to talk to it."""

    state_dir: Path
    server: str
    pki: certs.ClusterPki
    processes: dict[str, asyncio.subprocess.Process]
    webhook_port: int = 0
    """Where the operator's webhook is to listen: the API server presents its webhook client
    certificate to ``127.0.0.1`` at this port only."""

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def logs(self) -> Path:
        return self.state_dir / "logs"

    @property
    def audit_log(self) -> Path:
        return self.state_dir / "audit.log"

    @property
    def ca(self) -> bytes:
        return self.pki.ca.pem

    def client_kubeconfig(self, name: str, user: str, organizations: tuple[str, ...] = ()) -> Path:
        """Issue a client certificate for ``user`` and write a kubeconfig for it to ``DIR/<name>.kubeconfig``."""
        cert, key = self.pki.client(name, user, organizations)
        path = self.state_dir / f"{name}.kubeconfig"
        path.write_text(kubeconfig(self.server, self.ca, user=user, cert=cert.read_bytes(), key=key.read_bytes()))
        return path

    def nodes_kubeconfig(self, nodes: Sequence[str]) -> Path:
        """``DIR/nodes.kubeconfig``: a context per node, named ``system:node:<node>``, with a client
        certificate in group ``system:nodes``, as the Node authorizer and NodeRestriction expect."""
        users = {}
        for node in nodes:
            user = certs.node_user(node)
            cert, key = self.pki.client(f"node-{node}", user, ("system:nodes",))
            users[user] = _credentials(cert.read_bytes(), key.read_bytes(), None)
        path = self.state_dir / "nodes.kubeconfig"
        path.write_text(multi_kubeconfig(self.server, self.ca, users))
        return path

    def ssl_context(self) -> ssl.SSLContext:
        """TLS as the admin: the cluster CA to verify the server, the admin certificate to log in."""
        context = ssl.create_default_context(cadata=self.ca.decode())
        context.load_cert_chain(self.pki.path("admin"), self.pki.path("admin", "key"))
        return context

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Api]:
        connector = aiohttp.TCPConnector(ssl=self.ssl_context())
        async with aiohttp.ClientSession(self.server, connector=connector) as session:
            yield Api(session)


class ApiError(RuntimeError):
    def __init__(self, status: int, body: Any):
        self.status = status
        self.body = body
        message = body.get("message", body) if isinstance(body, dict) else body
        super().__init__(f"{status}: {message}")


@dataclasses.dataclass
class Api:
    """The few REST calls the sandbox makes as admin (kubectl is a test-only dependency)."""

    session: aiohttp.ClientSession

    async def request(self, method: str, path: str, body: Any = None) -> Any:
        async with self.session.request(method, path, json=body, timeout=aiohttp.ClientTimeout(total=30)) as response:
            text = await response.text()
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if response.status >= 400:
                raise ApiError(response.status, payload)
            return payload

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def create(self, path: str, body: dict[str, Any], *, exist_ok: bool = True) -> Any:
        try:
            return await self.request("POST", path, body)
        except ApiError as error:
            if exist_ok and error.status == 409:
                return None
            raise


async def _poll(
    check: Callable[[], Any], *, what: str, timeout: float, processes: dict[str, asyncio.subprocess.Process], logs: Path
) -> Any:
    """Call ``check`` (a coroutine function) until it returns something true; fail early, with
    the component's log, if a component exits meanwhile."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for name, process in processes.items():
            if process.returncode is not None:
                tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {process.returncode} while waiting for {what}:\n{tail}")
        try:
            value = await check()
            if value:
                return value
        except (OSError, aiohttp.ClientError, ApiError, TimeoutError) as error:
            last = error
        await asyncio.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last})")


def admission_configuration(kubeconfig_path: Path) -> dict[str, Any]:
    """The API server's AdmissionConfiguration: both webhook plugins find their client
    credentials, by the webhook's host, in ``kubeconfig_path``."""
    webhooks = {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "WebhookAdmissionConfiguration",
        "kubeConfigFile": str(kubeconfig_path),
    }
    return {
        "apiVersion": "apiserver.config.k8s.io/v1",
        "kind": "AdmissionConfiguration",
        "plugins": [
            {"name": "ValidatingAdmissionWebhook", "configuration": webhooks},
            {"name": "MutatingAdmissionWebhook", "configuration": webhooks},
        ],
    }


def webhook_client_kubeconfig(pki: certs.ClusterPki, *webhook_hosts: str) -> str:
    """The credentials the API server presents to the webhooks at ``webhook_hosts`` (``host:port``,
    as the API server looks a URL webhook up, or a Service's ``<name>.<namespace>.svc``): the
    webhook-client certificate. No other host gets any, and no cluster or context is needed: the
    API server reads only ``users``."""
    cert, key = (
        pki.path("apiserver-webhook-client").read_bytes(),
        pki.path("apiserver-webhook-client", "key").read_bytes(),
    )
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "users": [{"name": host, "user": _credentials(cert, key, None)} for host in webhook_hosts],
        }
    )


def etcd_argv(binaries: build.Binaries, data_dir: Path, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(binaries[build.ETCD]),
        "--name=sandbox",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=sandbox={peer}",
        "--listen-metrics-urls=",
        # A throwaway store: no fsync (envtest does the same), small log.
        "--unsafe-no-fsync",
        "--log-level=warn",
    ]


def apiserver_argv(
    binaries: build.Binaries,
    pki: certs.ClusterPki,
    state_dir: Path,
    etcd_port: int,
    port: int,
    advertise: str | None = None,
) -> list[str]:
    """With ``advertise`` (real Nodes: pods reach the API server through the ``kubernetes``
    Service), it listens on every address and advertises that one; else on loopback only."""
    path = pki.path
    if advertise is None:
        # With a loopback advertise address the `kubernetes` Service's endpoints would point at
        # 127.0.0.1, which the API server refuses to reconcile: there are none.
        listen = ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none"]
    else:
        listen = ["--bind-address=0.0.0.0", f"--advertise-address={advertise}"]
    return [
        str(binaries["kube-apiserver"]),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        *listen,
        f"--secure-port={port}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--tls-cert-file={path('apiserver')}",
        f"--tls-private-key-file={path('apiserver', 'key')}",
        f"--client-ca-file={path('ca')}",
        f"--kubelet-client-certificate={path('apiserver-kubelet-client')}",
        f"--kubelet-client-key={path('apiserver-kubelet-client', 'key')}",
        # A real Node's InternalIP is its bridge's address (logs, exec, port-forward go there).
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        "--authorization-mode=Node,RBAC",
        "--enable-admission-plugins=NodeRestriction",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        f"--service-account-key-file={path('sa')}",
        f"--service-account-signing-key-file={path('sa', 'key')}",
        # The aggregation layer's front proxy; without it the controllers log errors forever.
        f"--requestheader-client-ca-file={path('front-proxy-ca')}",
        "--requestheader-allowed-names=front-proxy-client",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-username-headers=X-Remote-User",
        f"--proxy-client-cert-file={path('front-proxy-client')}",
        f"--proxy-client-key-file={path('front-proxy-client', 'key')}",
        f"--admission-control-config-file={state_dir / 'admission.yaml'}",
        f"--audit-policy-file={state_dir / 'audit-policy.yaml'}",
        f"--audit-log-path={state_dir / 'audit.log'}",
        "--audit-log-format=json",
        "--audit-log-mode=blocking",  # each line is written before the response: tests read it at once
        "--allow-privileged=true",
        "--profiling=false",
    ]


CONTROLLERS = (
    # What a Dask cluster, memops and its tests use: workloads and their pods, Services, namespaces,
    # ServiceAccounts and their tokens, the CA ConfigMap that every pod's token volume projects,
    # autoscaling, disruption budgets and Node health. Volumes, certificate signing, quotas, cron
    # jobs and the alpha resources are left out: nothing here uses them, and the controller-manager
    # starts its controllers one by one, before the first ServiceAccount exists.
    "clusterrole-aggregation-controller",
    "daemonset-controller",
    "deployment-controller",
    "disruption-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "horizontal-pod-autoscaler-controller",
    "job-controller",
    "namespace-controller",
    "node-lifecycle-controller",
    "pod-garbage-collector-controller",
    "replicaset-controller",
    "root-ca-certificate-publisher-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "statefulset-controller",
    "taint-eviction-controller",
)


def controller_manager_argv(binaries: build.Binaries, pki: certs.ClusterPki, state_dir: Path) -> list[str]:
    config = state_dir / "controller-manager.kubeconfig"
    return [
        str(binaries["kube-controller-manager"]),
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--secure-port=0",  # no metrics or health server: nothing reads them
        "--leader-elect=false",
        f"--controllers={','.join(CONTROLLERS)}",
        # Each controller acts as its own ServiceAccount, so RBAC applies to it as upstream.
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki.path('sa', 'key')}",
        f"--root-ca-file={pki.path('ca')}",
        f"--cluster-signing-cert-file={pki.path('ca')}",
        f"--cluster-signing-key-file={pki.path('ca', 'key')}",
        f"--cluster-name={CLUSTER_NAME}",
        # The HorizontalPodAutoscaler controller, quicker than on a cluster (15 s and 5 min): an
        # autoscaler tried against the sandbox answers within seconds, its scale-downs within
        # half a minute of the metric falling. An HPA's own behavior.scaleDown overrides the latter.
        f"--horizontal-pod-autoscaler-sync-period={HPA_SYNC_PERIOD}",
        f"--horizontal-pod-autoscaler-downscale-stabilization={HPA_DOWNSCALE_STABILIZATION}",
        "--profiling=false",
    ]


def scheduler_argv(binaries: build.Binaries, state_dir: Path) -> list[str]:
    config = state_dir / "scheduler.kubeconfig"
    return [
        str(binaries["kube-scheduler"]),
        f"--kubeconfig={config}",
        f"--authentication-kubeconfig={config}",
        f"--authorization-kubeconfig={config}",
        "--secure-port=0",
        "--leader-elect=false",
        "--profiling=false",
    ]


async def stop_all(processes: dict[str, asyncio.subprocess.Process]) -> None:
    """Stop every component, last started first: SIGTERM to its process group, SIGKILL after 10 s."""
    for process in reversed(list(processes.values())):
        await common.stop(process, grace=10)


@contextlib.asynccontextmanager
async def running(
    state_dir: Path,
    binaries: build.Binaries,
    *,
    timeout: float = 120,
    meanwhile: Callable[[Plane, Api], Awaitable[None]] | None = None,
    advertise: str | None = None,
    webhook_services: Sequence[str] = (),
) -> AsyncIterator[Plane]:
    """Run the control plane until the block exits; see the module's docstring.

    ``meanwhile`` runs as soon as the API server is ready, while the controllers start (they
    take seconds to create the first ServiceAccounts): installing what needs only the API server
    then costs no start-up time.
    """
    started = time.monotonic()
    state_dir.mkdir(parents=True, exist_ok=True)
    addresses = () if advertise is None else (advertise, KUBERNETES_SERVICE_IP)
    pki = certs.make_pki(state_dir / "pki", addresses)
    (state_dir / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
    etcd_port = common.free_port()
    peer_port = common.free_port(etcd_port)
    api_port = common.free_port(etcd_port, peer_port)
    # Chosen now: the API server reads which webhook host gets its client certificate at start.
    webhook_port = common.free_port(etcd_port, peer_port, api_port)
    webhook_clients = state_dir / "webhook-clients.kubeconfig"
    webhook_clients.write_text(webhook_client_kubeconfig(pki, f"127.0.0.1:{webhook_port}", *webhook_services))
    webhook_clients.chmod(0o600)
    (state_dir / "admission.yaml").write_text(yaml.safe_dump(admission_configuration(webhook_clients)))
    server = f"https://127.0.0.1:{api_port}"
    processes: dict[str, asyncio.subprocess.Process] = {}
    plane = Plane(state_dir=state_dir, server=server, pki=pki, processes=processes, webhook_port=webhook_port)
    logs = plane.logs
    try:
        processes["etcd"] = await spawn("etcd", etcd_argv(binaries, state_dir / "etcd", etcd_port, peer_port), logs)
        apiserver = apiserver_argv(binaries, pki, state_dir, etcd_port, api_port, advertise)
        processes["kube-apiserver"] = await spawn("kube-apiserver", apiserver, logs)
        plane.client_kubeconfig("controller-manager", "system:kube-controller-manager")
        plane.client_kubeconfig("scheduler", "system:kube-scheduler")
        admin = plane.client_kubeconfig("admin", "kubernetes-admin", ("system:masters",))
        async with plane.session() as api:

            async def ready() -> bool:
                return bool(await api.request("GET", "/readyz") == "ok")

            await _poll(ready, what="kube-apiserver /readyz", timeout=timeout, processes=processes, logs=logs)
            logger.info("kube-apiserver ready at %s after %.1f s", server, time.monotonic() - started)
            # Not before: the controller-manager gives the API server only 10 s to become healthy.
            processes["kube-controller-manager"] = await spawn(
                "kube-controller-manager", controller_manager_argv(binaries, pki, state_dir), logs
            )
            processes["kube-scheduler"] = await spawn("kube-scheduler", scheduler_argv(binaries, state_dir), logs)

            async def default_account() -> Any:
                return await api.get("/api/v1/namespaces/default/serviceaccounts/default")

            async def controllers() -> None:
                await _poll(
                    default_account, what="the default ServiceAccount", timeout=timeout, processes=processes, logs=logs
                )
                logger.info("controllers working after %.1f s", time.monotonic() - started)

            await asyncio.gather(controllers(), *([meanwhile(plane, api)] if meanwhile else []))
        # Written last, when it works: whoever waits for the file can use it at once.
        admin.replace(plane.kubeconfig)
        keeper = asyncio.create_task(restarting(processes, "kube-apiserver", apiserver, logs))
        try:
            yield plane
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
    finally:
        await stop_all(processes)


async def restarting(
    processes: dict[str, asyncio.subprocess.Process], name: str, argv: Sequence[str], logs: Path
) -> None:
    """As a kubelet keeps a static pod: the component started again, with its arguments, each time
    it exits (a second later: a component that cannot start does not spin), until cancelled. The API
    server restarted is one of the faults that ``bench/soak.py`` injects (its pid is in
    ``logs/kube-apiserver.pid``)."""
    while True:
        code = await processes[name].wait()
        logger.warning("%s exited with %s: starting it again", name, code)
        await asyncio.sleep(1)
        processes[name] = await spawn(name, argv, logs)
