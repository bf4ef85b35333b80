"""Real Nodes: a kubelet with its own containerd per Node, runc, CNI bridges, and kube-proxy.

Each Node of ``memops sandbox --nodes N`` is what a cluster's node runs, on this machine: the
kubelet of the pinned Kubernetes module, talking CRI to a containerd of its own (its own root,
state, socket and runc root), which starts pods with runc in containers whose memory limits
the kernel enforces (cgroups under the Node's own ``cgroupRoot``), networked by the CNI
``bridge`` plugin on a bridge and pod subnet of the Node's own. One kube-proxy (iptables mode)
makes Services work for the whole machine: the Nodes share its network stack, so one set of
rules serves them all. Images come from OCI archives imported into each containerd; nothing is
pulled from a registry.

Everything the sandbox makes on the machine carries its name (:data:`PREFIX`): the bridges
``memops<i>``, the cgroups under ``/memops-sandbox``, the sockets under ``/run/memops-sandbox``,
the mounts under the state directory, and the two bind mounts that give each Node a mount
namespace of its own (:mod:`memops_sandbox.node_mounts`). :func:`clean` removes exactly those, on
stop and before the next start (a crash leaves shims, mounts, cgroups and bridges behind), and
nothing else.
One sandbox with real Nodes runs on a machine at a time: they would share bridge and cgroup
names and kube-proxy's rules (:func:`exclusive`).

Facts of this machine that the configuration follows: cgroup v1 (the kubelet needs
``failCgroupV1: false`` and the cgroupfs driver); no CAP_SYS_RESOURCE (containerd restricts
``oom_score_adj`` to its own, or runc cannot start any container); the API server reaches a
kubelet at its InternalIP, which must be a real interface's address (the Node's bridge).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from memops_sandbox import build, common, images, mountinfo, node_mounts
from memops_sandbox.build import NodeBinaries

logger = logging.getLogger(__name__)

PREFIX = "memops"
CGROUP_PARENT = "memops-sandbox"
"""The cgroup every Node's ``cgroupRoot`` is under, in each hierarchy."""
RUN_ROOT = Path("/run/memops-sandbox")
"""Sockets (a unix socket's path is limited to 108 bytes, the state directory's is not)."""
DISK_ROOT = Path("/var/lib/memops-sandbox")
IMAGE_STORES = Path("/var/lib/memops-sandbox-images")
"""containerd roots with the sandbox's images imported, one per set of images: each Node's
containerd starts from a copy of one (hard links to its immutable blobs and layers), so a sandbox
does not import and unpack every image into every Node again. Beside :data:`DISK_ROOT` (the same
filesystem, for the links), and kept when the sandbox stops."""
"""The kubelets' root directories (pods' volumes; the kubelet's own sockets are in them, so the
path is short), on disk: an emptyDir there is a disk's, as on a node, not memory."""
POD_NETWORK = ipaddress.IPv4Network("10.244.0.0/16")
CGROUP_FS = Path("/sys/fs/cgroup")


class NodesUnavailable(RuntimeError):
    """This machine cannot run real Nodes (no root, no cgroups, a missing tool): the message says
    which, and what to do."""


@dataclasses.dataclass(frozen=True)
class Node:
    """One Node's names, addresses, ports and directories."""

    name: str
    index: int
    root: Path
    run: Path
    kubelet_port: int
    healthz_port: int

    @property
    def bridge(self) -> str:
        return f"{PREFIX}{self.index}"

    @property
    def subnet(self) -> ipaddress.IPv4Network:
        return list(POD_NETWORK.subnets(new_prefix=24))[self.index]

    @property
    def ip(self) -> str:
        """The bridge's address: the Node's InternalIP, and the pods' gateway."""
        return str(self.subnet.network_address + 1)

    @property
    def cgroup_root(self) -> str:
        return f"/{CGROUP_PARENT}/{self.name}"

    @property
    def socket(self) -> Path:
        return self.run / "containerd.sock"


def containerd_root(node: Node) -> Path:
    """Under :data:`DISK_ROOT` (removed when the sandbox stops), beside :data:`IMAGE_STORES`."""
    return DISK_ROOT / node.name / "containerd"


def layout(names: Sequence[str], state_dir: Path) -> list[Node]:
    ports: list[int] = []
    nodes = []
    for index, name in enumerate(names):
        kubelet_port = common.free_port(*ports)
        healthz_port = common.free_port(*ports, kubelet_port)
        ports += [kubelet_port, healthz_port]
        nodes.append(
            Node(
                name=name,
                index=index,
                root=state_dir / "nodes" / name,
                run=RUN_ROOT / name,
                kubelet_port=kubelet_port,
                healthz_port=healthz_port,
            )
        )
    return nodes


# -- configuration (pure) ---------------------------------------------------------------------------


def containerd_config(node: Node, binaries: NodeBinaries, root: Path | None = None) -> str:
    """containerd's ``config.toml`` (version 3) for ``node`` (its root: ``root``, or the Node's own)."""
    runtime = {
        "restrict_oom_score_adj": True,
        # Each pod's network namespace is mounted under the Node's state (RUN_ROOT), not the
        # machine's /var/run/netns: a kill leaves it where stop and the next start remove it, and
        # with it the pod's veth pair (every one kept a veth on the machine, and Dask's system
        # monitor, in every process, reads every interface's counters twice a second).
        "netns_mounts_under_state_dir": True,
        "enable_unprivileged_ports": True,
        "cni": {"bin_dirs": [str(binaries.cni_bin_dir)], "conf_dir": str(node.root / "cni"), "max_conf_num": 1},
        "containerd": {
            "default_runtime_name": "runc",
            "runtimes": {
                "runc": {
                    "runtime_type": "io.containerd.runc.v2",
                    "options": {"BinaryName": str(binaries.runc), "Root": str(node.run / "runc")},
                }
            },
        },
    }
    lines = [
        "version = 3",
        f'root = "{root or containerd_root(node)}"',
        f'state = "{node.run / "state"}"',
        "[grpc]",
        f'  address = "{node.socket}"',
        "[ttrpc]",
        f'  address = "{node.socket}.ttrpc"',
        "[plugins.'io.containerd.cri.v1.images']",
        '  snapshotter = "overlayfs"',
        "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
        f'  sandbox = "{images.PAUSE_REF}"',
        "[plugins.'io.containerd.cri.v1.runtime']",
        *_toml_table(runtime, "plugins.'io.containerd.cri.v1.runtime'"),
        # NRI's socket is one per machine (/var/run/nri/nri.sock): a second containerd fails on it.
        "[plugins.'io.containerd.nri.v1.nri']",
        "  disable = true",
        "[plugins.'io.containerd.grpc.v1.cri']",
        '  stream_server_address = "127.0.0.1"',
        '  stream_server_port = "0"',
    ]
    return "\n".join(lines) + "\n"


def _toml_table(table: dict[str, Any], path: str) -> list[str]:
    """A nested dict as TOML: scalars first, then each sub-table under its dotted path."""
    lines = []
    for key, value in table.items():
        if not isinstance(value, dict):
            lines.append(f"  {key} = {json.dumps(value)}")
    for key, value in table.items():
        if isinstance(value, dict):
            sub = f"{path}.{key}"
            lines.append(f"[{sub}]")
            lines += _toml_table(value, sub)
    return lines


def cni_config(node: Node) -> dict[str, Any]:
    """The Node's pod network: a bridge of its own, addresses from its subnet, port mappings."""
    return {
        "cniVersion": "1.0.0",
        "name": f"{PREFIX}-{node.name}",
        "plugins": [
            {
                "type": "bridge",
                "bridge": node.bridge,
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": str(node.subnet), "gateway": node.ip}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(node.root / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    node: Node,
    ca: Path,
    eviction_hard: dict[str, str] | None = None,
    *,
    node_memory: str | None = None,
    serving: tuple[Path, Path] | None = None,
) -> dict[str, Any]:
    """The KubeletConfiguration of ``node``: cgroup v1 with the cgroupfs driver, its own cgroup
    root, ports, logs and runtime; no image garbage collection (the images exist only here);
    eviction on memory only unless the caller sets ``eviction_hard``, since the disk is the
    machine's, shared by every Node.

    Its API as a production cluster's: clients by x509 certificate (the API server's) or bearer
    token (a TokenReview), each request authorized by the API server (a SubjectAccessReview:
    ``nodes/stats`` for ``/stats``, ``nodes/configz`` for ``/configz``, ``nodes/proxy`` for exec
    and the rest), no anonymous access. ``serving``: its certificate and key, which the cluster's
    CA signs (as ``serverTLSBootstrap`` has it), so that clients can verify it.

    ``node_memory``: the memory of the Node's pods. Every Node is this one machine, whose memory
    its kubelet sees whole; it reserves the rest for the system (``systemReserved``), so that
    its pods' cgroup is limited to about this, and its allocatable memory, and with it the
    ``allocatableMemory.available`` eviction signal, are the Node's own."""
    reserved = {"systemReserved": {"memory": str(machine_memory() - parse_memory(node_memory))}} if node_memory else {}
    return {
        **reserved,
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node.ip,
        "port": node.kubelet_port,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": node.healthz_port,
        "readOnlyPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(ca)},
        },
        "authorization": {"mode": "Webhook"},
        **({"tlsCertFile": str(serving[0]), "tlsPrivateKeyFile": str(serving[1])} if serving else {}),
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": node.cgroup_root,
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{node.socket}",
        "podLogsDir": str(node.root / "pod-logs"),
        "resolvConf": "",
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": eviction_hard
        or {
            "memory.available": "100Mi",
            "nodefs.available": "0%",
            "imagefs.available": "0%",
            "nodefs.inodesFree": "0%",
        },
        "serializeImagePulls": False,
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "staticPodPath": "",
        "registerNode": True,
        "shutdownGracePeriod": "0s",
        "logging": {"format": "text"},
    }


def memory_eviction(threshold: str) -> dict[str, str]:
    """``evictionHard`` with ``memory.available`` at ``threshold``, on memory only (as the default)."""
    return {
        "memory.available": threshold,
        "nodefs.available": "0%",
        "imagefs.available": "0%",
        "nodefs.inodesFree": "0%",
    }


def machine_memory() -> int:
    """The machine's memory in bytes, as the kubelet reads it (``MemTotal``)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise NodesUnavailable("/proc/meminfo has no MemTotal")


def parse_memory(text: str) -> int:
    """A memory quantity (``1536Mi``, ``2Gi``, ``2GiB``, plain bytes) in bytes."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "": 1}
    match = re.fullmatch(r"(\d+)\s*([KMG]iB?|)", text.strip())
    if match is None:
        raise ValueError(f"{text!r}: a memory quantity such as 1536Mi or 2Gi")
    return int(match[1]) * units[match[2]]


def kubelet_argv(node: Node, binaries: NodeBinaries, kubeconfig: Path) -> list[str]:
    return [
        str(binaries.kubelet),
        f"--config={node.root / 'kubelet.yaml'}",
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node.name}",
        f"--node-ip={node.ip}",
        f"--root-dir={DISK_ROOT / node.name}",
        f"--cert-dir={node.root / 'kubelet-pki'}",
        "--v=1",
    ]


def kube_proxy_config(kubeconfig: Path, cluster_cidr: str = str(POD_NETWORK)) -> dict[str, Any]:
    """kube-proxy in iptables mode for every Node of this machine. ``masqueradeAll``: a pod that
    reaches a Service whose endpoint is on its own bridge gets the reply back through the host
    (without br_netfilter the bridge would hand it straight to the pod, un-NATed)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "mode": "iptables",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "clusterCIDR": cluster_cidr,
        "iptables": {"masqueradeAll": True, "syncPeriod": "30s", "minSyncPeriod": "0s"},
        "conntrack": {"maxPerCore": 0},
        "metricsBindAddress": f"127.0.0.1:{common.free_port()}",
        "healthzBindAddress": "",
    }


def container_pid(container_id: str) -> int:
    """The host pid of a running container's first process (``containerd://<id>`` or ``<id>``,
    as a pod's ``status.containerStatuses`` names it), from runc's state under any Node's root."""
    container_id = container_id.removeprefix("containerd://")
    for state in RUN_ROOT.glob(f"*/runc/k8s.io/{container_id}/state.json"):
        return int(json.loads(state.read_text())["init_process_pid"])
    raise LookupError(f"no running container {container_id} on this machine's Nodes")


def memory_cgroup(pid: int) -> Path:
    """The directory of the memory cgroup that ``pid`` is in, from the host's side."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return CGROUP_FS / "memory" / path.lstrip("/")
        if controllers == "":  # cgroup v2
            return CGROUP_FS / path.lstrip("/")
    raise LookupError(f"no memory cgroup for {pid}")


def memory_stat(cgroup: Path) -> dict[str, int]:
    """What the kernel charges to ``cgroup`` (and its children): ``anon`` (the processes' own
    memory), ``shmem`` (tmpfs pages among them), ``swap`` (its pages in swap), ``swapcached``
    (pages on their way to or from swap, which are counted in neither of those two while the write
    is under way) and ``peak`` (the most charged at once), under cgroup v1's or v2's names."""
    pairs = (line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    stat = {name: int(value) for name, value in pairs}
    if (cgroup / "memory.max_usage_in_bytes").exists():  # v1
        peak = int((cgroup / "memory.max_usage_in_bytes").read_text())
        swap = stat.get("total_swap", 0)  # only with swap accounting
        cached = stat.get("total_swapcached", 0)
        return {
            "anon": stat["total_rss"],
            "shmem": stat["total_shmem"],
            "swap": swap,
            "swapcached": cached,
            "peak": peak,
        }
    swapped = cgroup / "memory.swap.current"
    swap = int(swapped.read_text()) if swapped.exists() else 0
    peak = int((cgroup / "memory.peak").read_text())
    cached = stat.get("swapcached", 0)
    return {"anon": stat["anon"], "shmem": stat["shmem"], "swap": swap, "swapcached": cached, "peak": peak}


# -- the machine ------------------------------------------------------------------------------------


def check_machine() -> None:
    """Raise :class:`NodesUnavailable` with one line saying what is missing. The programs the
    Nodes call (runc, iptables, conntrack, ip) are installed first where they are missing and can
    be (:func:`memops_sandbox.build.ensure_machine_tools`)."""
    if os.geteuid() != 0:
        raise NodesUnavailable(
            "real Nodes need root (containers, cgroups, bridges); run as root, or use --node-agent (no containers)"
        )
    if not (CGROUP_FS / "memory").is_dir() and not (CGROUP_FS / "cgroup.controllers").exists():
        raise NodesUnavailable(f"real Nodes need cgroups with the memory controller under {CGROUP_FS}")
    try:
        build.ensure_machine_tools()
    except build.BuildError as error:
        raise NodesUnavailable(f"{error}, or use --node-agent (no containers)") from None


@contextlib.contextmanager
def exclusive() -> Iterator[None]:
    """Hold the machine's one real-Node sandbox lock; fail at once if another sandbox has it."""
    RUN_ROOT.mkdir(parents=True, exist_ok=True)
    with (RUN_ROOT.parent / "memops-sandbox.lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NodesUnavailable(
                "another memops sandbox with real Nodes runs on this machine (one at a time: they share"
                " bridges, cgroups and kube-proxy's rules); stop it first"
            ) from None
        yield


def _hierarchies() -> list[Path]:
    """The cgroup v1 hierarchies (cpu, memory, ...), or the v2 root alone."""
    if (CGROUP_FS / "cgroup.controllers").exists():
        return [CGROUP_FS]
    return sorted(
        path for path in CGROUP_FS.iterdir() if path.is_dir() and not path.is_symlink() and (path / "tasks").exists()
    )


def made_hierarchies() -> list[Path]:
    """Every hierarchy where a Node's cgroups are made: :func:`_hierarchies`, and on a hybrid
    machine (cgroup v1 with the v2 tree mounted at ``unified``) that tree too, where runc makes
    each container's cgroup as well (empty: no controller is enabled there)."""
    unified = CGROUP_FS / "unified"
    extra = [unified] if (unified / "cgroup.procs").exists() and not (CGROUP_FS / "cgroup.controllers").exists() else []
    return [*_hierarchies(), *extra]


def make_cgroups(node: Node) -> None:
    """``cgroupRoot`` in every hierarchy; cpuset's cpus and mems copied down, as a new cpuset is
    empty and refuses tasks."""
    for hierarchy in _hierarchies():
        current = hierarchy
        for part in node.cgroup_root.strip("/").split("/"):
            parent, current = current, current / part
            current.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (current / name).exists() and not (current / name).read_text().strip():
                    (current / name).write_text((parent / name).read_text())


def _cgroup_dirs(top: Path) -> list[Path]:
    """``top`` and the cgroups under it, deepest first. The kubelet and runc remove cgroups
    meanwhile: a walk that meets a vanished directory goes on without it."""
    found = [Path(root) for root, _, _ in os.walk(top, onerror=lambda _: None)]
    return sorted(found, key=lambda path: -len(path.parts))


def _kill_cgroup_tree(top: Path) -> None:
    for directory in _cgroup_dirs(top):
        for name in ("cgroup.procs", "tasks"):
            with contextlib.suppress(OSError):
                for pid in (directory / name).read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)


def _remove_cgroup_tree(top: Path) -> None:
    for directory in _cgroup_dirs(top):
        for _ in range(50):
            try:
                directory.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return [pid for pid in pids if pid != os.getpid()]


SWAP_FILE = DISK_ROOT / "swap"
"""The swap file of ``memops sandbox --swap``."""


@contextlib.contextmanager
def swap(size: int) -> Iterator[Path]:
    """A swap file of ``size`` bytes, on until the block exits: the swap-backed node. Every Node is
    this machine, so the swap is every Node's; the kubelets run with ``failSwapOn: false``."""
    DISK_ROOT.mkdir(parents=True, exist_ok=True)
    SWAP_FILE.unlink(missing_ok=True)
    try:
        subprocess.run(["fallocate", "-l", str(size), str(SWAP_FILE)], check=True, capture_output=True, text=True)
        SWAP_FILE.chmod(0o600)  # mkswap and swapon want no other reader
        for command in ("mkswap", "swapon"):
            subprocess.run([command, str(SWAP_FILE)], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as error:
        detail = error.stderr.strip() if isinstance(error, subprocess.CalledProcessError) else str(error)
        swap_off()
        raise NodesUnavailable(f"no swap file of {size} bytes at {SWAP_FILE}: {detail}") from error
    try:
        yield SWAP_FILE
    finally:
        swap_off()


def swap_off() -> None:
    """Turn off and remove the sandbox's swap file, if a run (or a crashed one) left it on."""
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        name = Path(line.split()[0])
        if name.is_relative_to(DISK_ROOT):
            subprocess.run(["swapoff", str(name)], capture_output=True, check=False)
    SWAP_FILE.unlink(missing_ok=True)


def clean(state_dir: Path, count: int = 16) -> None:
    """Remove what a sandbox with real Nodes left on this machine: its processes (kubelets,
    containerds, shims, containers), its swap file, mounts under ``state_dir`` and :data:`RUN_ROOT`,
    cgroups under :data:`CGROUP_PARENT`, bridges ``memops<i>`` and kube-proxy's rules."""
    # The image store's own containerd names only its store (a killed sandbox's may outlive it).
    for pid in {*_processes_mentioning(str(RUN_ROOT)), *_processes_mentioning(str(IMAGE_STORES))}:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for hierarchy in made_hierarchies():
        if (hierarchy / CGROUP_PARENT).exists():
            _kill_cgroup_tree(hierarchy / CGROUP_PARENT)
    swap_off()
    for root in (state_dir / "nodes", RUN_ROOT, DISK_ROOT):
        for point in mountinfo.under(root):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    node_mounts.unshare_host_mounts()  # after the loop above, which takes the disk root's own
    for hierarchy in made_hierarchies():
        if (hierarchy / CGROUP_PARENT).exists():
            _remove_cgroup_tree(hierarchy / CGROUP_PARENT)
    for index in range(count):
        subprocess.run(["ip", "link", "delete", f"{PREFIX}{index}"], capture_output=True, check=False)
    shutil.rmtree(RUN_ROOT, ignore_errors=True)
    shutil.rmtree(DISK_ROOT, ignore_errors=True)


def prepare_network(nodes: Sequence[Node]) -> None:
    """Forwarding between the bridges, and each Node's bridge up with its address (the CNI
    plugin would make it with the first pod; the kubelet needs its InternalIP before that)."""
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
    for node in nodes:
        subprocess.run(["ip", "link", "add", node.bridge, "type", "bridge"], capture_output=True, check=False)
        subprocess.run(
            ["ip", "addr", "replace", f"{node.ip}/{node.subnet.prefixlen}", "dev", node.bridge],
            check=True,
            capture_output=True,
        )
        subprocess.run(["ip", "link", "set", node.bridge, "up"], check=True, capture_output=True)


def write_configs(node: Node, binaries: NodeBinaries) -> None:
    """The Node's containerd and CNI configuration (the kubelet's needs the plane's CA: :func:`running`)."""
    for directory in (node.root / "cni", node.root / "ipam", node.root / "pod-logs", node.run):
        directory.mkdir(parents=True, exist_ok=True)
    (node.root / "containerd.toml").write_text(containerd_config(node, binaries))
    (node.root / "cni" / "10-memops.conflist").write_text(json.dumps(cni_config(node), indent=2))


async def _wait_for_socket(path: Path, process: asyncio.subprocess.Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.returncode is not None:
            raise RuntimeError(f"containerd exited with {process.returncode} before serving {path}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"containerd did not serve {path} within {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def import_images(
    node: Node,
    binaries: NodeBinaries,
    archives: Sequence[images.ImageArchive],
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Import OCI archives into the Node's containerd, for the CRI (namespace ``k8s.io``), and
    tag each ``aliases`` key as its value's image."""
    for archive in archives:
        started = time.monotonic()
        await asyncio.to_thread(images.import_into, binaries.ctr, node.socket, archive)
        logger.info("%s imported into %s in %.1f s", archive.ref, node.name, time.monotonic() - started)
    for alias, source in (aliases or {}).items():
        await _ctr(node, binaries, "images", "tag", "--force", source, alias)


async def _ctr(node: Node, binaries: NodeBinaries, *args: str) -> None:
    process = await asyncio.create_subprocess_exec(
        str(binaries.ctr),
        f"--address={node.socket}",
        f"--namespace={images.NAMESPACE}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"ctr {' '.join(args)} on {node.name}: {output.decode(errors='replace')[-2000:]}")


async def _start_runtime(
    node: Node,
    binaries: NodeBinaries,
    store: Path | None,
    archives: Sequence[images.ImageArchive],
    aliases: Mapping[str, str],
    logs: Path,
) -> asyncio.subprocess.Process:
    """The Node's containerd, in a mount namespace of its own, its images in place: a copy of
    ``store`` (:func:`image_store`, copied already by :func:`runtimes`), or imported now when there
    is none."""
    from memops_sandbox import controlplane

    containerd = await controlplane.spawn(
        f"containerd-{node.name}",
        node_mounts.own_namespace(
            [str(binaries.containerd), f"--config={node.root / 'containerd.toml'}", "--log-level=warn"]
        ),
        logs,
        env=_runtime_env(binaries),
    )
    (node.run / node_mounts.PID_FILE).write_text(f"{containerd.pid}\n")
    await _wait_for_socket(node.socket, containerd, 30)
    if store is None:
        await import_images(node, binaries, archives, aliases)
    return containerd


def _store_key(binaries: NodeBinaries, archives: Sequence[images.ImageArchive], aliases: Mapping[str, str]) -> str:
    """What an image store is made of: containerd, every archive's file, the aliases."""
    digest = hashlib.sha256()
    stat = binaries.containerd.stat()
    digest.update(f"{binaries.containerd}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    for archive in archives:
        # An archive's name carries the key of its inputs; its mtime is when it was last used.
        digest.update(f"{archive.path.name}\0{archive.path.stat().st_size}\0".encode())
    digest.update(json.dumps([[a.ref for a in archives], sorted(aliases.items())]).encode())
    return digest.hexdigest()[:24]


async def image_store(
    binaries: NodeBinaries, archives: Sequence[images.ImageArchive], aliases: Mapping[str, str], logs: Path
) -> Path | None:
    """A containerd root under :data:`IMAGE_STORES` with ``archives`` imported and ``aliases``
    tagged (made once, by a containerd of its own, then reused); None if it cannot be made here
    (the Nodes then import the images themselves)."""
    from memops_sandbox import controlplane

    store = IMAGE_STORES / _store_key(binaries, archives, aliases)
    if (store / "complete").exists():
        return store / "containerd"
    started = time.monotonic()
    # Its own name: a store that a killed sandbox left half made (its files possibly still mounted
    # or open) is never in the way; such leftovers go below, once this one is made.
    making = IMAGE_STORES / f"{store.name}.making-{os.getpid()}"
    builder = Node(name="images", index=0, root=making, run=RUN_ROOT / "images", kubelet_port=0, healthz_port=0)
    shutil.rmtree(making, ignore_errors=True)
    making.mkdir(parents=True)
    builder.run.mkdir(parents=True, exist_ok=True)
    (making / "containerd.toml").write_text(containerd_config(builder, binaries, root=making / "containerd"))
    containerd = await controlplane.spawn(
        "containerd-images",
        [str(binaries.containerd), f"--config={making / 'containerd.toml'}", "--log-level=warn"],
        logs,
        env=_runtime_env(binaries),
    )
    try:
        await _wait_for_socket(builder.socket, containerd, 30)
        await import_images(builder, binaries, archives, aliases)
    except (OSError, RuntimeError, TimeoutError, images.ImageError):
        logger.exception("the image store could not be made; each Node imports the images itself")
        return None
    finally:
        await common.stop(containerd, grace=5)
        shutil.rmtree(builder.run, ignore_errors=True)
    await asyncio.to_thread(_remove_stores_but, making)
    if (store / "complete").exists():  # made meanwhile by another sandbox
        shutil.rmtree(making, ignore_errors=True)
        return store / "containerd"
    shutil.rmtree(store, ignore_errors=True)  # a half-made one of an older scheme
    making.rename(store)
    (store / "complete").write_text("")
    logger.info("the image store made in %.1f s", time.monotonic() - started)
    return store / "containerd"


def _remove_stores_but(kept: Path) -> None:
    """The stores of other images are of no more use, nor a half-made one that a killed sandbox
    left (its builder's snapshot mounts first)."""
    for old in IMAGE_STORES.iterdir():
        if old != kept:
            for point in mountinfo.under(old):
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
            shutil.rmtree(old, ignore_errors=True)


_COPIED = ("meta.db", "metadata.db")
"""The files of a containerd root that containerd writes in place (bolt databases): copied, where
every other file (content blobs, unpacked layers, never written once made) is linked."""


def _copy_store(store: Path, root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "-l", str(store), str(root)], check=True, capture_output=True)
    for name in _COPIED:
        for linked in root.rglob(name):
            copy = linked.with_name(f"{name}.copy")
            shutil.copy2(linked, copy)
            copy.replace(linked)


def _runtime_env(binaries: NodeBinaries) -> dict[str, str]:
    """containerd and the kubelet find the runc shim on their PATH."""
    return {**os.environ, "PATH": f"{binaries.containerd_shim_runc_v2.parent}:{os.environ.get('PATH', '')}"}


DEVICE_PLUGIN_SOCKET = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
"""Where every kubelet serves its device-plugin registry: a fixed path, not under its root
directory. A kubelet removes the socket, then binds it; two starting at once can both remove it and
one then fails to bind ("address already in use"), and exits. So each Node's kubelet starts once the
one before has bound it."""


async def _device_plugin_socket_bound(since: float, kubelet: asyncio.subprocess.Process, timeout: float = 30) -> None:
    """Until :data:`DEVICE_PLUGIN_SOCKET` is a socket bound after ``since`` (wall clock); a kubelet
    that exits first, or a socket not there by ``timeout``, is left to the wait for Ready to report."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and kubelet.returncode is None:
        with contextlib.suppress(FileNotFoundError):
            if DEVICE_PLUGIN_SOCKET.stat().st_mtime >= since - 0.01:
                return
        await asyncio.sleep(0.05)


async def _ready_nodes(api: Any, names: Sequence[str]) -> bool:
    listed = await api.get("/api/v1/nodes")
    ready = {
        item["metadata"]["name"]
        for item in listed["items"]
        for condition in item.get("status", {}).get("conditions", [])
        if condition["type"] == "Ready" and condition["status"] == "True"
    }
    return set(names) <= ready


@contextlib.contextmanager
def machine(names: Sequence[str], state_dir: Path) -> Iterator[list[Node]]:
    """This machine, ready for Nodes ``names``: checked, held (:func:`exclusive`), cleaned of a
    previous run, with each Node's bridge up (its address is the Node's, which the API server
    advertises to pods before any kubelet runs). On exit, everything is removed again."""
    check_machine()
    nodes = layout(names, state_dir)
    with exclusive():
        clean(state_dir)
        try:
            prepare_network(nodes)
            yield nodes
        finally:
            clean(state_dir)


@contextlib.asynccontextmanager
async def runtimes(
    nodes: Sequence[Node],
    binaries: NodeBinaries,
    archives: Sequence[images.ImageArchive],
    logs: Path,
    *,
    aliases: Mapping[str, str] | None = None,
) -> AsyncIterator[None]:
    """What of real ``nodes`` (of :func:`machine`) needs no API server: each Node's cgroups,
    configuration and containerd, with ``archives`` imported (``aliases``: more refs for imported
    images, ref -> the imported image's ref). The sandbox starts them while its control plane
    starts; :func:`running` adds the kubelets. On exit the containerds stop (after :func:`running`
    has killed the containers)."""
    processes: dict[str, asyncio.subprocess.Process] = {}
    try:
        started = time.monotonic()
        for node in nodes:
            make_cgroups(node)
            write_configs(node, binaries)
        store = await image_store(binaries, archives, aliases or {}, logs)
        if store is not None:
            # Hard links, so before the disk root becomes a mount of its own (no link crosses mounts).
            await asyncio.gather(*(asyncio.to_thread(_copy_store, store, containerd_root(node)) for node in nodes))
        node_mounts.share(DISK_ROOT)
        containerds = await asyncio.gather(
            *(_start_runtime(node, binaries, store, archives, aliases or {}, logs) for node in nodes)
        )
        processes.update({f"containerd-{node.name}": c for node, c in zip(nodes, containerds, strict=True)})
        logger.info("%d containerds up, images imported, after %.1f s", len(nodes), time.monotonic() - started)
        yield
    finally:
        await asyncio.gather(*(common.stop(process, grace=5) for process in processes.values()))


@contextlib.asynccontextmanager
async def running(
    plane: Any,
    nodes: Sequence[Node],
    binaries: NodeBinaries,
    *,
    eviction_hard: dict[str, str] | None = None,
    node_memory: str | None = None,
    timeout: float = 120,
) -> AsyncIterator[None]:
    """Run the kubelets of real ``nodes`` (of :func:`machine`, their :func:`runtimes` up) and a
    kube-proxy against ``plane`` (a :class:`memops_sandbox.controlplane.Plane`) until the block
    exits, then stop them and kill their containers. Yields once every Node is Ready."""
    from memops_sandbox import certs, controlplane

    state_dir: Path = plane.state_dir
    names = [node.name for node in nodes]
    processes: dict[str, asyncio.subprocess.Process] = {}
    try:
        started = time.monotonic()
        proxy_config = plane.client_kubeconfig("kube-proxy", "system:kube-proxy")
        (state_dir / "kube-proxy.yaml").write_text(yaml.safe_dump(kube_proxy_config(proxy_config)))
        for node in nodes:
            serving = plane.pki.kubelet_serving(node.name, node.ip)
            config = kubelet_config(node, plane.pki.path("ca"), eviction_hard, node_memory=node_memory, serving=serving)
            (node.root / "kubelet.yaml").write_text(yaml.safe_dump(config))
            kubeconfig = plane.client_kubeconfig(f"kubelet-{node.name}", certs.node_user(node.name), ("system:nodes",))
            spawned = time.time()
            # In its containerd's mount namespace: the Node's own mounts (:mod:`memops_sandbox.node_mounts`).
            namespace = node_mounts.node_pid(RUN_ROOT, node.name)
            argv = node_mounts.joining(namespace, kubelet_argv(node, binaries, kubeconfig))
            kubelet = await controlplane.spawn(f"kubelet-{node.name}", argv, plane.logs, env=_runtime_env(binaries))
            processes[f"kubelet-{node.name}"] = kubelet
            await _device_plugin_socket_bound(spawned, kubelet)
        processes["kube-proxy"] = await controlplane.spawn(
            "kube-proxy",
            [str(binaries.kube_proxy), f"--config={state_dir / 'kube-proxy.yaml'}", f"--hostname-override={names[0]}"],
            plane.logs,
        )
        async with plane.session() as api:
            await controlplane._poll(
                lambda: _ready_nodes(api, names),
                what=f"Nodes {', '.join(names)} Ready",
                timeout=timeout,
                processes=processes,
                logs=plane.logs,
            )
        logger.info("%d real Nodes Ready after %.1f s", len(nodes), time.monotonic() - started)
        yield
    finally:
        await _stop(processes, binaries)


async def _stop(processes: dict[str, asyncio.subprocess.Process], binaries: NodeBinaries) -> None:
    """Stop kube-proxy and the kubelets, and kill every container (SIGKILL to the Nodes' cgroups: the
    sandbox is going away, and grace periods are the pods' business while it runs); the containerds
    stop next (:func:`runtimes`), and :func:`machine` removes what is left."""
    # Together: each kubelet takes its time to stop, and none waits for another.
    await asyncio.gather(*(common.stop(process, grace=5) for process in processes.values()))
    for hierarchy in made_hierarchies():
        if (hierarchy / CGROUP_PARENT).exists():
            try:
                _kill_cgroup_tree(hierarchy / CGROUP_PARENT)
            except OSError:
                logger.exception("killing the containers under %s", hierarchy / CGROUP_PARENT)
    if "kube-proxy" in processes:
        cleanup = await asyncio.create_subprocess_exec(
            str(binaries.kube_proxy), "--cleanup", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        await cleanup.wait()
