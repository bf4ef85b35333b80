"""Shared spill: what a worker pod gets so that Dask spills to a tmpfs, and whether it fits.

Pure. :func:`memops.decisions.safetynet.plan_injection` (the mutating webhook, at pod creation) calls
:func:`plan` on the new pod and, unless it refuses, :func:`apply` to the pod's spec; the policy
pass calls :func:`condition` on the workload's pod template to report the same verdict in the
policy's status. Both read the same container, so the status says what the webhook does.

The arithmetic (``docs/resources.md``, "Shared spill"): tmpfs pages are charged to the memory
cgroup of the pod that writes them and Dask's thresholds see only the process' RSS. With the
container's memory limit ``L``, Dask's memory limit ``M`` per worker process (``--memory-limit``,
which the webhook never rewrites), ``N`` worker processes (``--nworkers``) and the spill's size
``S``, Dask must keep RSS at or below ``L - S``. Its thresholds are fractions of ``M``, so all four
are scaled by one factor ``k = min(1, (L - S) / (N * M * f_top))``, ``f_top`` the highest enabled
fraction (``terminate`` by default): the last guard (the nanny's terminate) then fires before the
cgroup's OOM killer could, and target < spill < pause < terminate keep their order and gaps.

A ``hostPath`` (medium Node) is mounted only if it is one of the host directories that the
cluster's administrators allowed when they installed the operator (``memops run
--shared-spill-host-root``, :func:`host_root`): whoever may create a MemoryPolicy must not be able
to have any host directory mounted into pods. None allowed (the default): medium Node is refused.

Medium Node is one tmpfs per node, but never one directory for every tenant: the pod's hostPath
volume is ``<root>/<namespace>/<policy>`` itself (:func:`spill_directory`), not the root, so no
mount of it, in any container of the pod, reaches more than the spill of its own policy's workers,
and the hand-over by hardlink (:mod:`memops.worker.handover`) links only between workers of one
policy. A pod that already names the volume is refused (:func:`volume_name_refusal`). A policy's
``sizeLimit`` binds there as Dask's ``max-spill`` per worker process (:data:`MAX_SPILL_ENV`).
"""

from __future__ import annotations

import copy
import dataclasses
import decimal
import enum
import math
import shlex
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from memops import specs
from memops.decisions import counts

MOUNT_PATH = "/memops-spill"
"""Where the spill volume is mounted in the worker container; ``DASK_TEMPORARY_DIRECTORY`` points
here, so distributed spills into ``MOUNT_PATH/dask-scratch-space/worker-<random>/storage``
(``distributed/core.py`` Server.__init__, ``distributed/worker_memory.py``). With medium Node every
worker of one policy on a node mounts the same host directory here, its policy's
``<root>/<namespace>/<policy>``: they share one directory tree, which no other policy's pod sees."""
VOLUME_NAME = "memops-spill"
ANNOTATION = "memops.dev/shared-spill"
"""On a mutated pod: the medium it spills to, or ``Refused`` (with the reason in the webhook's log
and the policy's ``SharedSpillReady`` condition)."""
READY = "SharedSpillReady"
SWAPPABLE = "SharedSpillSwappable"
CONDITIONS = (READY, SWAPPABLE)
LINKS = "SharedSpillLinks"
"""Medium Node: whether the workers took the plugin by which same-node fetches of spilled keys go by
hardlink (:mod:`memops.worker.links`); set after the scheduler is configured, not decided from the spec
(but for ``links: false``, :data:`LINKS_DISABLED`)."""
LINKS_DISABLED = (
    "spec.sharedSpill.links is false: same-node fetches and reads of spilled keys go as stock Dask's"
    " (a scheduler given the plugin before keeps it, and gives it to its workers, until it restarts)"
)
"""``SharedSpillLinks``' message, reason ``Disabled``: memops installs nothing, and uninstalls nothing."""
LINKS_NAMED = 5
"""Workers named in a refusal's message; the rest are counted."""
REASON_CHARACTERS = 200
"""Of each worker's own reason (a worker's words: bounded, never parsed)."""

OWNER = "memops-spill-owner"
"""``swap: SpillOnly``: the native sidecar (an init container that keeps running) whose process
allocates the worker's spill files (:mod:`memops.worker.owner`), and the pod-private emptyDir of its
socket, mounted at :data:`OWNER_PATH` in both containers."""
OWNER_PATH = "/memops-spill-owner"
OWNER_SOCKET = f"{OWNER_PATH}/owner.sock"
OWNER_SOCKET_ENV = "MEMOPS_SPILL_OWNER"
"""The worker's environment: where its spill store asks the owner (:data:`memops.worker.owner.SOCKET_ENV`)."""
OWNER_REQUEST_BYTES = 64 * 2**20
"""The owner's memory request, and what its limit has beyond ``sizeLimit``: its Python process (about
10 MiB) and the margin it keeps free (:data:`memops.worker.owner.MARGIN`). Below its limit: the sidecar
is Burstable, which is what lets the kubelet's LimitedSwap give it swap, in proportion to this request."""
OWNER_USER = 65534
"""The owner runs as nobody: it opens no file, it only allocates the descriptors it is handed."""

TEMPORARY_DIRECTORY_ENV = "DASK_TEMPORARY_DIRECTORY"
MAX_SPILL_ENV = "DASK_DISTRIBUTED__WORKER__MEMORY__MAX_SPILL"
"""``distributed.worker.memory.max-spill``: the bytes a worker process may spill, after which it
keeps its data in memory (and pauses) instead. Set to ``sizeLimit / N``: the one bound of a
cooperative worker on medium Node, whose hostPath has no ``sizeLimit`` of its own."""
THRESHOLDS = ("target", "spill", "pause", "terminate")
THRESHOLD_ENV = {name: f"DASK_DISTRIBUTED__WORKER__MEMORY__{name.upper()}" for name in THRESHOLDS}
DASK_DEFAULTS = {"target": 0.6, "spill": 0.7, "pause": 0.8, "terminate": 0.95}
"""distributed 2026.8.0's ``distributed.yaml``: ``distributed.worker.memory.*``."""

MIN_TARGET = 0.1
"""Refused below this: a worker whose scaled ``target`` (or ``spill``, when ``target`` is off) is
under a tenth of its Dask memory limit keeps almost nothing in memory, and spills and unspills
every key it touches. Only when the scaling takes it there: a fraction that the container itself
sets under a tenth is the user's choice and is kept, scaled (``target`` 0.001 spills every key at
once, so that with same-node links and maps no private copy doubles the shared one). Every enabled
fraction is written as at least :data:`MIN_FRACTION`."""
MIN_FRACTION = 0.001
"""The least fraction written: scaled and rounded down to three decimals, a tiny one would be 0,
which Dask reads as off (``target`` off: nothing is spilled before the ``spill`` threshold)."""
MIN_HEADROOM_BYTES = 256 * 2**20
"""``L - S`` must leave at least this for the worker processes themselves: an idle ``dask worker``
and its nanny take 150-200 MiB of RSS before any data."""


class Refusal(enum.StrEnum):
    NO_CONTAINER = "NoContainer"
    NO_MEMORY_LIMIT = "NoMemoryLimit"
    NO_DASK_LIMIT = "NoDaskMemoryLimit"
    LOCAL_DIRECTORY = "LocalDirectorySet"
    SPILL_DISABLED = "SpillDisabled"
    DOES_NOT_FIT = "DoesNotFit"
    HOST_PATH_NOT_ALLOWED = "HostPathNotAllowed"
    VOLUME_NAME_TAKEN = "VolumeNameTaken"


class QoS(enum.StrEnum):
    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


@dataclasses.dataclass(frozen=True)
class Fit:
    """The verdict for one worker container: the scaled fractions, or why it is refused."""

    container_limit: int | None  # L, bytes
    dask_limit: int | None  # M per worker process, bytes
    workers: int  # N: worker processes in the container
    spill: int  # S, bytes
    scale: float  # k
    fractions: Mapping[str, float | None]  # the scaled thresholds; None: disabled (left as the user has it)
    refusal: Refusal | None = None
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.refusal is None


def _refuse(refusal: Refusal, message: str, *, spill: int, limit: int | None = None, dask: int | None = None) -> Fit:
    return Fit(limit, dask, 1, spill, 0.0, {}, refusal, message)


HOST_ROOT_FLAG = "--shared-spill-host-root"
"""The ``memops run`` flag (repeatable) that allows one host directory for medium Node."""


def _components(path: str) -> tuple[str, ...] | None:
    """An absolute path as its components, ``//`` and ``.`` dropped and a trailing ``/`` ignored;
    None when it is relative or has a ``..`` component. The operator cannot resolve the node's
    symbolic links, and ``..`` taken lexically is wrong behind one: such a path is never allowed."""
    if not path.startswith("/"):
        return None
    parts = tuple(part for part in path.split("/") if part not in ("", "."))
    return None if ".." in parts else parts


def _is_under(parts: tuple[str, ...] | None, root: tuple[str, ...] | None) -> bool:
    """Whether a path lies strictly under a root: compared as components, never as strings."""
    return parts is not None and root is not None and len(parts) > len(root) and parts[: len(root)] == root


def host_root(text: str) -> str:
    """One ``--shared-spill-host-root``, normalised (``/mnt/spill/`` is ``/mnt/spill``).

    ValueError for a path that no policy could ever name (relative, ``..``, characters that
    ``spec.sharedSpill.hostPath`` refuses, a system directory): a mistake the administrator hears
    of when the operator starts, not as policies refused later."""
    parts = _components(text)
    if parts is None or not parts:
        raise ValueError(f"{HOST_ROOT_FLAG} {text!r}: not an absolute directory without '..' components")
    normalised = "/" + "/".join(parts)
    try:
        specs.check_host_path(normalised)
    except ValueError as exc:
        raise ValueError(f"{HOST_ROOT_FLAG} {text!r}: a MemoryPolicy could never use it: {exc}") from None
    return normalised


def host_roots(texts: Iterable[str]) -> frozenset[str]:
    """Every ``--shared-spill-host-root``, normalised (:func:`host_root`). ValueError also when one
    lies under another: the workers of a policy on the outer one could leave a symbolic link where
    the inner one is missing on some node, and a policy naming the inner one would mount its target."""
    roots = frozenset(host_root(text) for text in texts)
    for inner in roots:
        for outer in roots:
            if inner != outer and _is_under(_components(inner), _components(outer)):
                raise ValueError(f"{HOST_ROOT_FLAG} {inner!r} lies under {outer!r}: allow one or the other")
    return roots


def host_path_refusal(path: str, roots: Collection[str]) -> str | None:
    """Why ``spec.sharedSpill.hostPath`` may not be mounted, or None when it is an allowed root.

    Compared component by component (``/mnt/spill-other`` is not ``/mnt/spill``). Only a root
    itself is allowed, not a directory under it: the workers write in the root (it is their spill
    directory), and a symbolic link that one of them leaves there, ``<root>/x -> /etc``, would be
    followed by the kubelet when another policy names ``<root>/x``."""
    allowed = {parts for root in roots if (parts := _components(root))}
    if not allowed:
        return (
            f"spec.sharedSpill.hostPath: {path!r}: this cluster allows no host directory for shared spill"
            f" (the operator runs without {HOST_ROOT_FLAG}; Helm: sharedSpill.hostRoots, or"
            " sharedSpill.nodeDaemonSet.enabled); use medium Memory, or ask the cluster's administrators"
        )
    parts = _components(path)
    if parts in allowed:
        return None
    under = any(_is_under(parts, root) for root in allowed)
    why = (
        ", and not a directory under one: the workers write there, and the kubelet would follow a symbolic"
        " link that they leave"
        if under
        else ""
    )
    return (
        f"spec.sharedSpill.hostPath: {path!r} is not a host directory that this cluster allows for shared"
        f" spill ({HOST_ROOT_FLAG}): it must be one of {', '.join(sorted('/' + '/'.join(r) for r in allowed))}{why}"
    )


def spill_directory(host_path: str, namespace: str, policy: str) -> str | None:
    """The host directory of one policy's workers: ``<root>/<namespace>/<policy>``, the path of
    their hostPath volume; None when ``host_path`` is not an absolute path without ``..`` or either
    name is not one plain path component.

    The volume's own path, not a ``subPath`` of the root: a pod can mount a volume in any of its
    containers (an init container, a second one, an ephemeral one added later through a
    subresource that no webhook sees), with no ``subPath`` or another one, and every such mount
    must still reach only this directory. The kubelet makes it, if missing, as DirectoryOrCreate
    does: ``os.MkdirAll(path, 0755)`` as root (``makeDir``, ``pkg/volume/hostpath/host_path.go``).
    Both names are the API server's (a namespace is a DNS label, a MemoryPolicy's name a DNS
    subdomain): neither holds a ``/`` nor is ``.`` or ``..``; checked again here because a ``/``
    would let one policy's directory lie inside another's."""
    root = _components(host_path)
    if not root:
        return None
    for name in (namespace, policy):
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            return None
    return "/" + "/".join((*root, namespace, policy))


def volume_name_refusal(pod_spec: Mapping[str, Any]) -> str | None:
    """Why the pod may not get the spill volume: it already has a volume of that name, or one of
    its containers already mounts that name; None otherwise.

    A pod could otherwise declare a mount of the volume that memops is about to add (validation
    runs after mutating admission, so the pod is accepted once the volume is there), in a
    container that memops does not look at. The volume's path (:func:`spill_directory`) keeps
    such a mount inside the policy's own directory anyway; this refuses the clash itself."""
    if any(isinstance(v, Mapping) and v.get("name") == VOLUME_NAME for v in pod_spec.get("volumes") or []):
        return f"spec.sharedSpill: the pod already has a volume named {VOLUME_NAME!r}, which memops adds; rename it"
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for container in pod_spec.get(kind) or []:
            if not isinstance(container, Mapping):
                continue
            for mount in container.get("volumeMounts") or []:
                if isinstance(mount, Mapping) and mount.get("name") == VOLUME_NAME:
                    return (
                        f"spec.sharedSpill: {kind} {container.get('name')!r} already mounts {VOLUME_NAME!r},"
                        " the volume that memops adds (to the first container only); remove that mount"
                    )
    return None


def _tokens(container: Mapping[str, Any]) -> list[str]:
    """The container's command line, with ``sh -c "..."`` scripts split as a shell would. Only a
    part with options in it is a script: "4 GiB" stays one value of ``--memory-limit``."""
    found: list[str] = []
    for part in [*(container.get("command") or []), *(container.get("args") or [])]:
        text = str(part)
        if not (" " in text and "--" in text):
            found.append(text)
            continue
        try:
            found.extend(shlex.split(text))
        except ValueError:  # unbalanced quotes
            found.extend(text.split())
    return found


def _option(tokens: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name value`` or ``--name=value`` (click takes the last one)."""
    value = None
    for index, token in enumerate(tokens):
        for name in names:
            if token == name and index + 1 < len(tokens):
                value = tokens[index + 1]
            elif token.startswith(name + "="):
                value = token[len(name) + 1 :]
    return value


def _dask_bytes(text: str) -> int | None:
    """``dask.utils.parse_bytes`` for what ``--memory-limit`` is written as ("4GiB", "4 GB", "4e9")."""
    units = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}
    units |= {f"{u}i": 2 ** (10 * i) for i, u in enumerate("kmgtp", start=1)}
    units |= {f"{u}b": n for u, n in list(units.items()) if u not in ("", "b")}
    text = text.replace(" ", "").lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    suffix = text[len(digits) :]
    try:
        number = float(digits) if digits else 1.0
    except ValueError:
        return None
    if suffix not in units or not math.isfinite(number) or number < 0:
        return None
    return int(number * units[suffix])


def memory_limit_bytes(resources: Mapping[str, Any] | None) -> int | None:
    text = ((resources or {}).get("limits") or {}).get("memory")
    if text is None:
        return None
    try:
        return specs.parse_quantity(str(text))
    except ValueError:
        return None


def _fraction(text: str) -> float | None:
    """A threshold written in the environment: a fraction, or off ("False", "0", "null")."""
    if text.strip().lower() in ("false", "no", "off", "null", "none", "0", "0.0"):
        return None
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value


def base_fractions(container: Mapping[str, Any]) -> dict[str, float | None]:
    """Dask's thresholds as this container would have them: its literal env, else Dask's defaults.

    A value that is not a fraction (or comes from a Secret or ConfigMap) is Dask's default: the
    webhook replaces the variable anyway."""
    env = {str(e.get("name")): e.get("value") for e in container.get("env") or [] if isinstance(e, Mapping)}
    fractions: dict[str, float | None] = {}
    for name in THRESHOLDS:
        text = env.get(THRESHOLD_ENV[name])
        try:
            fractions[name] = _fraction(str(text)) if text is not None else DASK_DEFAULTS[name]
        except ValueError:
            fractions[name] = DASK_DEFAULTS[name]
    return fractions


def worker_container(pod_spec: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The Dask worker's container: the first, as the safety net's preStop hook takes it."""
    containers = pod_spec.get("containers") or []
    return containers[0] if containers and isinstance(containers[0], Mapping) else None


def fit(container: Mapping[str, Any], spill: specs.SharedSpillSpec) -> Fit:
    """Whether Dask's data plus the spill fit in the container's memory limit, and the scaled
    thresholds that make them fit. Every refusal names ``spec.sharedSpill``'s field to change,
    or what of the worker's container stands in the way."""
    size = specs.parse_quantity(spill.sizeLimit)
    limit = memory_limit_bytes(container.get("resources"))
    if limit is None:
        return _refuse(
            Refusal.NO_MEMORY_LIMIT,
            "spec.sharedSpill: the worker container has no memory limit, so its spilled pages (charged to the"
            " pod) cannot be budgeted; set resources.limits.memory on the workload's worker container",
            spill=size,
        )
    tokens = _tokens(container)
    if _option(tokens, "--local-directory") is not None:
        return _refuse(
            Refusal.LOCAL_DIRECTORY,
            "spec.sharedSpill: the worker's --local-directory overrides the spill directory that memops sets"
            " (DASK_TEMPORARY_DIRECTORY); remove it from the worker's arguments",
            spill=size,
            limit=limit,
        )
    try:
        workers = max(int(_option(tokens, "--nworkers", "--nprocs") or "1"), 1)
    except ValueError:
        workers = 1  # "auto" or a negative count depend on the node's cores: counted as one
    written = _option(tokens, "--memory-limit") or "auto"
    if written == "auto":
        # parse_memory_limit: the cgroup limit times min(1, nthreads / cores); --nworkers N
        # gives each process cores // N threads, so about L / N each.
        dask: int | None = limit // workers
    else:
        try:
            number = float(written)
            dask = int(number * limit) if number <= 1 else int(number) if math.isfinite(number) else None
        except ValueError:
            dask = _dask_bytes(written)
        # Dask ignores a limit above the cgroup's and takes the cgroup's. One that memops cannot
        # read (a $(VAR) it does not know) is at most that too: planning with L is the safe side.
        dask = limit if dask is None else min(dask, limit)
    if not dask:
        return _refuse(
            Refusal.NO_DASK_LIMIT,
            f"spec.sharedSpill: the worker's --memory-limit {written!r} turns Dask's memory management off,"
            " so it never spills",
            spill=size,
            limit=limit,
        )
    base = base_fractions(container)
    enabled = [f for f in base.values() if f is not None]
    floor = base["target"] if base["target"] is not None else base["spill"]
    if floor is None or not enabled:
        return _refuse(
            Refusal.SPILL_DISABLED,
            "spec.sharedSpill: the worker's environment turns Dask's target and spill thresholds off,"
            " so it never spills",
            spill=size,
            limit=limit,
            dask=dask,
        )
    # With the spill owner, the kernel charges the spilled pages to the sidecar, not to this container.
    room = limit if owned(spill) else limit - size
    if room < MIN_HEADROOM_BYTES:
        return _refuse(
            Refusal.DOES_NOT_FIT,
            f"spec.sharedSpill.sizeLimit: {spill.sizeLimit} leaves {_mib(room)} of the worker container's"
            f" {_mib(limit)} memory limit for the worker processes, which need at least {_mib(MIN_HEADROOM_BYTES)}",
            spill=size,
            limit=limit,
            dask=dask,
        )
    scale = min(1.0, room / (workers * dask * max(enabled)))
    if floor >= MIN_TARGET and floor * scale < MIN_TARGET:
        return _refuse(
            Refusal.DOES_NOT_FIT,
            f"spec.sharedSpill.sizeLimit: with {spill.sizeLimit} of spill in a {_mib(limit)} limit, Dask's"
            f" threshold would be {floor * scale:.2f} of its {_mib(dask)} memory limit, below {MIN_TARGET}:"
            " lower sizeLimit, raise the memory limit or lower --memory-limit",
            spill=size,
            limit=limit,
            dask=dask,
        )
    fractions = {
        name: None if f is None else max(MIN_FRACTION, math.floor(f * scale * 1000) / 1000) for name, f in base.items()
    }
    return Fit(limit, dask, workers, size, scale, fractions)


def owned(spill: specs.SharedSpillSpec) -> bool:
    """Whether the spill owner sidecar allocates the spill files (``swap: SpillOnly``)."""
    return spill.swap == specs.SpillSwap.SPILL_ONLY


def _host_refusal(spill: specs.SharedSpillSpec, host_roots: Collection[str]) -> Fit | None:
    if spill.medium != specs.SpillMedium.NODE:
        return None
    message = host_path_refusal(str(spill.hostPath), host_roots)
    if message is None:
        return None
    return _refuse(Refusal.HOST_PATH_NOT_ALLOWED, message, spill=specs.parse_quantity(spill.sizeLimit))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f}Mi"


@dataclasses.dataclass(frozen=True)
class Mutation:
    """What the worker pod gets: one volume, one mount, the environment, and node affinity; with
    ``swap: SpillOnly``, the owner sidecar and its socket's volume too, and the worker container's
    memory request raised to its limit."""

    volume: Mapping[str, Any]
    mount: Mapping[str, Any]
    env: tuple[Mapping[str, str], ...]
    node_requirements: tuple[Mapping[str, Any], ...]
    owner: Mapping[str, Any] | None = None
    owner_volume: Mapping[str, Any] | None = None


def owner_sidecar(image: str, size_limit: int, script: str) -> dict[str, Any]:
    """The spill owner's container (a native sidecar): ``script`` (:mod:`memops.worker.owner`'s
    source) run by the worker image's Python, the spill volume read-only (to know its filesystem),
    the socket's directory, a request of :data:`OWNER_REQUEST_BYTES` and a limit of ``sizeLimit``
    beyond it, and no privilege."""
    return {
        "name": OWNER,
        "image": image,
        "restartPolicy": "Always",
        "command": ["python", "-c", script, OWNER_SOCKET, MOUNT_PATH],
        "volumeMounts": [
            {"name": VOLUME_NAME, "mountPath": MOUNT_PATH, "readOnly": True},
            {"name": OWNER, "mountPath": OWNER_PATH},
        ],
        "resources": {
            "requests": {"memory": str(OWNER_REQUEST_BYTES)},
            "limits": {"memory": str(size_limit + OWNER_REQUEST_BYTES)},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": OWNER_USER,
            "runAsGroup": OWNER_USER,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }


def _verdict(pod_spec: Mapping[str, Any], spill: specs.SharedSpillSpec, host_roots: Collection[str]) -> Fit:
    refused = _host_refusal(spill, host_roots)
    if refused is not None:
        return refused
    taken = volume_name_refusal(pod_spec)
    if taken is not None:
        return _refuse(Refusal.VOLUME_NAME_TAKEN, taken, spill=specs.parse_quantity(spill.sizeLimit))
    container = worker_container(pod_spec)
    if container is None:
        return _refuse(Refusal.NO_CONTAINER, "spec.sharedSpill: the pod has no container", spill=0)
    return fit(container, spill)


def volume_and_mount(
    spill: specs.SharedSpillSpec, directory: str | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The pod's spill volume and the worker container's mount of it; None for medium Node
    without a ``directory`` (:func:`spill_directory`): never the whole host root.

    Medium Node: ``hostPath: {path: <root>/<namespace>/<policy>, type: DirectoryOrCreate}``,
    mounted with no ``subPath``: one directory per policy and node, the same for all its workers
    there, so a hand-over by hardlink works between them (both link paths inside their own mount
    of that one directory: no EXDEV) and never reaches another policy's files, whatever else of
    the pod mounts the volume. DirectoryOrCreate because nobody else makes the directory; a node
    without the tmpfs therefore gets a plain directory on its root disk, as the docs warn."""
    mount: dict[str, Any] = {"name": VOLUME_NAME, "mountPath": MOUNT_PATH}
    if spill.medium == specs.SpillMedium.MEMORY:
        return {"name": VOLUME_NAME, "emptyDir": {"medium": "Memory", "sizeLimit": spill.sizeLimit}}, mount
    if directory is None:
        return None
    return {"name": VOLUME_NAME, "hostPath": {"path": directory, "type": "DirectoryOrCreate"}}, mount


def plan(
    pod_spec: Mapping[str, Any],
    spill: specs.SharedSpillSpec,
    *,
    host_roots: Collection[str],
    namespace: str,
    policy: str,
    owner_script: str = "",
) -> tuple[Fit, Mutation | None]:
    """The verdict for the pod's worker container and, when it fits, the mutation. ``host_roots``:
    the host directories that medium Node may mount (:func:`host_path_refusal`); ``namespace`` and
    ``policy``: the pod's namespace and the MemoryPolicy's name, whose directory it mounts;
    ``owner_script``: what the spill owner runs (``swap: SpillOnly``)."""
    verdict = _verdict(pod_spec, spill, host_roots)
    if not verdict.allowed:
        return verdict, None
    built = volume_and_mount(spill, spill_directory(str(spill.hostPath or ""), namespace, policy))
    if built is None:
        # A pod without a namespace (never from the API server): no directory of its own, no spill.
        why = f"spec.sharedSpill.hostPath: no directory of its own for namespace {namespace!r}, policy {policy!r}"
        return _refuse(Refusal.HOST_PATH_NOT_ALLOWED, why, spill=verdict.spill), None
    volume, mount = built
    env = [{"name": TEMPORARY_DIRECTORY_ENV, "value": MOUNT_PATH}]
    env += [
        {"name": THRESHOLD_ENV[name], "value": repr(value)}
        for name, value in verdict.fractions.items()
        if value is not None
    ]
    # Each process' share of sizeLimit: what Dask spills stops there (it keeps the rest in memory
    # and pauses), before the emptyDir's tmpfs is full or, on medium Node, before the worker takes
    # more of the node's tmpfs than its policy allows (docs/resources.md, "Shared spill").
    env.append({"name": MAX_SPILL_ENV, "value": str(verdict.spill // verdict.workers)})
    requirements = tuple(
        {"key": key, "operator": "In", "values": [value]} for key, value in sorted((spill.nodeSelector or {}).items())
    )
    if not owned(spill):
        return verdict, Mutation(volume, mount, tuple(env), requirements)
    env.append({"name": OWNER_SOCKET_ENV, "value": OWNER_SOCKET})
    image = str((worker_container(pod_spec) or {}).get("image") or "")
    sidecar = owner_sidecar(image, verdict.spill, owner_script)
    socket_volume = {"name": OWNER, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}
    return verdict, Mutation(volume, mount, tuple(env), requirements, sidecar, socket_volume)


def apply(pod_spec: dict[str, Any], mutation: Mutation) -> None:
    """Change ``pod_spec`` (a copy the caller owns): the volume, the worker container's mount and
    env, and the node affinity. Applying twice changes nothing more."""
    ours_volumes = [mutation.volume, *([mutation.owner_volume] if mutation.owner_volume is not None else [])]
    names = {v["name"] for v in ours_volumes}
    volumes = [v for v in pod_spec.get("volumes") or [] if v.get("name") not in names]
    pod_spec["volumes"] = [*volumes, *(dict(v) for v in ours_volumes)]
    container = pod_spec["containers"][0]
    ours_mounts = [dict(mutation.mount)]
    if mutation.owner is not None:
        ours_mounts.append({"name": OWNER, "mountPath": OWNER_PATH})
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") not in names]
    container["volumeMounts"] = [*mounts, *ours_mounts]
    ours = {e["name"] for e in mutation.env}
    env = [e for e in container.get("env") or [] if e.get("name") not in ours]
    container["env"] = [*env, *(dict(e) for e in mutation.env)]
    if mutation.owner is not None:
        init = [c for c in pod_spec.get("initContainers") or [] if c.get("name") != OWNER]
        # Last of the init containers: a sidecar starts in order, and the worker right after it.
        pod_spec["initContainers"] = [*init, copy.deepcopy(dict(mutation.owner))]
        _request_the_limit(container)
    if mutation.node_requirements:
        _require_nodes(pod_spec, mutation.node_requirements)


def _request_the_limit(container: dict[str, Any]) -> None:
    """The container's memory request set to its memory limit: the kubelet never swaps such a
    container, under LimitedSwap or NoSwap (``pkg/kubelet/kuberuntime/kuberuntime_container_linux.go``)."""
    resources = container.setdefault("resources", {})
    limit = (resources.get("limits") or {}).get("memory")
    if limit is not None:
        resources["requests"] = {**(resources.get("requests") or {}), "memory": limit}


def _require_nodes(pod_spec: dict[str, Any], requirements: Sequence[Mapping[str, Any]]) -> None:
    """AND the requirements into every term of the pod's required node affinity (terms are ORed,
    so each must carry them), or make the one term."""
    affinity = pod_spec.setdefault("affinity", {}) or {}
    pod_spec["affinity"] = affinity
    node = affinity.setdefault("nodeAffinity", {})
    required = node.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        expressions = list(term.get("matchExpressions") or [])
        term["matchExpressions"] = expressions + [dict(r) for r in requirements if dict(r) not in expressions]
    required["nodeSelectorTerms"] = terms


def _requests_and_limits(container: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    resources = container.get("resources") or {}
    limits = dict(resources.get("limits") or {})
    # A pod's requests default to its limits (SetDefaults_Pod, pkg/apis/core/v1/defaults.go); a
    # template is not defaulted until its pods are created, so do it here for both.
    requests = {**limits, **(resources.get("requests") or {})}
    return requests, limits


def _amount(text: Any) -> decimal.Decimal:
    try:
        return specs.quantity_value(str(text))
    except ValueError:
        return decimal.Decimal(-1)  # unreadable: never equal to a readable one


def _resources_qos(requests: Mapping[str, Any], limits: Mapping[str, Any]) -> QoS:
    if not requests and not limits:
        return QoS.BEST_EFFORT
    found: QoS | None = None
    for resource in ("cpu", "memory"):
        request, limit = _amount(requests.get(resource, "0")), _amount(limits.get(resource, "0"))
        if request != limit:
            return QoS.BURSTABLE
        this = QoS.BEST_EFFORT if request == 0 else QoS.GUARANTEED
        if found is not None and this != found:
            return QoS.BURSTABLE
        found = this
    assert found is not None
    return found


def qos_class(pod_spec: Mapping[str, Any]) -> QoS:
    """The pod's QoS class as Kubernetes computes it (``ComputePodQOS``,
    ``pkg/apis/core/helper/qos/qos.go``): per container over cpu and memory, init containers
    included; pod-level ``resources``, where set, decide alone."""
    if pod_spec.get("resources"):
        pod_resources = pod_spec["resources"]
        return _resources_qos(
            {**(pod_resources.get("limits") or {}), **(pod_resources.get("requests") or {})},
            pod_resources.get("limits") or {},
        )
    found: QoS | None = None
    for container in _containers(pod_spec):
        this = _resources_qos(*_requests_and_limits(container))
        if this == QoS.BURSTABLE:
            return this
        if found is not None and this != found:
            return QoS.BURSTABLE
        found = this
    return found or QoS.BEST_EFFORT


def _containers(pod_spec: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield from pod_spec.get("initContainers") or []
    yield from pod_spec.get("containers") or []


def template_spec(workload: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The pod spec that the workload's pods are made from: a Deployment's template, a
    DaskWorkerGroup's ``spec.worker.spec``."""
    spec = workload.get("spec") or {}
    if workload.get("kind") == specs.WorkloadKind.DASK_WORKER_GROUP.value:
        found = (spec.get("worker") or {}).get("spec")
    else:
        found = (spec.get("template") or {}).get("spec")
    return found if isinstance(found, Mapping) else None


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The policy's shared-spill conditions: (status, reason, message) for each."""

    ready: tuple[bool | None, str, str]
    swappable: tuple[bool | None, str, str] | None  # medium Node only


def condition(
    spill: specs.SharedSpillSpec, pod_spec: Mapping[str, Any] | None, *, host_roots: Collection[str]
) -> Verdict:
    """What the policy's status says of its shared spill, from the workload's pod template. A
    host path that is not allowed is refused before the template is read: it needs none."""
    unknown: tuple[bool | None, str, str] = (None, "TemplateUnknown", "the workload's pod template was not read")
    refused = _host_refusal(spill, host_roots)
    if refused is not None:
        verdict = refused
    elif pod_spec is None:
        return Verdict(unknown, unknown if spill.medium == specs.SpillMedium.NODE else None)
    else:
        verdict = _verdict(pod_spec, spill, host_roots)
    if verdict.allowed:
        shown = ", ".join(f"{name} {value}" for name, value in verdict.fractions.items() if value is not None)
        ready: tuple[bool | None, str, str] = (
            True,
            "Injected",
            f"new worker pods spill to {spill.medium.value} tmpfs at {MOUNT_PATH} (sizeLimit {spill.sizeLimit})"
            + (f", its files allocated by the {OWNER} sidecar" if owned(spill) else "")
            + f"; Dask's thresholds scaled by {verdict.scale:.3f} to fit the memory limit: {shown}",
        )
    else:
        ready = (
            False,
            verdict.refusal.value if verdict.refusal is not None else "Refused",
            f"{verdict.message}; the webhook gives new pods the safety net but not the shared spill",
        )
    if spill.medium != specs.SpillMedium.NODE:
        return Verdict(ready, None)
    if pod_spec is None:
        return Verdict(ready, unknown)
    return Verdict(ready, owner_swap_verdict(pod_spec) if owned(spill) else swap_verdict(pod_spec))


CRITICAL_PRIORITY_CLASSES = ("system-node-critical", "system-cluster-critical")


def swap_verdict(pod_spec: Mapping[str, Any]) -> tuple[bool, str, str]:
    """Whether the worker container may swap under LimitedSwap, as the kubelet decides it
    (``GetContainerSwapBehavior``, ``pkg/kubelet/kuberuntime/kuberuntime_container_linux.go``):
    not a critical pod, a Burstable pod, and a container whose memory request is set and below its limit."""
    qos = qos_class(pod_spec)
    container = worker_container(pod_spec) or {}
    requests, limits = _requests_and_limits(container)
    request, limit = _amount(requests.get("memory", "0")), _amount(limits.get("memory", "0"))
    advice = "give the worker container a memory request below its memory limit"
    critical = _critical(pod_spec)
    if critical is not None:
        return critical
    if qos != QoS.BURSTABLE:
        why = "requests equal limits in every container" if qos == QoS.GUARANTEED else "no requests nor limits"
        return (
            False,
            f"Not{QoS.BURSTABLE.value}",
            f"spec.workload: the worker pods are {qos.value} ({why}); under NodeSwap's LimitedSwap only Burstable"
            f" pods swap, so their spilled pages stay in RAM: {advice}",
        )
    if request == 0 or request == limit:
        return (
            False,
            "WorkerNotSwappable",
            "spec.workload: the pods are Burstable but the worker container's memory request is unset or equal"
            f" to its limit, and the kubelet swaps only containers whose request is below the limit: {advice}",
        )
    return True, "Burstable", "the worker pods are Burstable: under LimitedSwap their pages may reach swap"


def _critical(pod_spec: Mapping[str, Any]) -> tuple[bool, str, str] | None:
    """The verdict for critical pods, which the kubelet never swaps; None for any other."""
    if pod_spec.get("priorityClassName") not in CRITICAL_PRIORITY_CLASSES:
        return None
    why = f"the worker pods are critical ({pod_spec['priorityClassName']}), and critical pods never swap"
    return False, "CriticalPod", f"spec.workload: {why}: their spilled pages stay in RAM"


def owner_swap_verdict(pod_spec: Mapping[str, Any]) -> tuple[bool, str, str]:
    """``swap: SpillOnly``: the spilled pages are the owner sidecar's, which is Burstable (its request
    below its limit), and the worker container requests its limit: under LimitedSwap the spill may
    reach swap and the worker's own memory never does. A critical pod swaps nothing."""
    critical = _critical(pod_spec)
    if critical is not None:
        return critical
    return (
        True,
        "SpillOnly",
        f"spec.sharedSpill.swap SpillOnly: the spilled pages are charged to the {OWNER} sidecar (Burstable), which"
        " may swap under LimitedSwap; the worker container's memory request is raised to its limit, so the kubelet"
        " never swaps its computing memory",
    )


def links_condition(found: Mapping[str, Any]) -> tuple[bool | None, str, str]:
    """``SharedSpillLinks`` from each worker's verdict on the same-node links plugin (address ->
    ``{"status", "reason"}``, :func:`memops.worker.links.statuses`): True when every worker took it;
    False naming the first :data:`LINKS_NAMED` that refused, with their reasons, and counting the rest."""
    if not found:
        return None, "NoWorkers", "no worker is connected: each gets the same-node links plugin when it joins"
    refused = {
        str(address): str((verdict.get("reason") if isinstance(verdict, Mapping) else None) or "no reason given")
        for address, verdict in sorted(found.items(), key=lambda item: str(item[0]))
        if not isinstance(verdict, Mapping) or verdict.get("status") != "Active"
    }
    if not refused:
        return (
            True,
            "Active",
            f"on all {len(found)} workers, same-node fetches of spilled keys go by hardlink and are read back as maps",
        )
    first = list(refused.items())[:LINKS_NAMED]
    named = "; ".join(f"{address}: {reason[:REASON_CHARACTERS]}" for address, reason in first)
    more = f"; and {len(refused) - LINKS_NAMED} more" if len(refused) > LINKS_NAMED else ""
    return (
        False,
        "Refused",
        f"{len(refused)} of {len(found)} workers refused same-node links"
        f" and fetch spilled keys as bytes: {named}{more}",
    )


def spill_status(reports: Mapping[str, Any], now: str) -> specs.SharedSpillStatus:
    """The policy's ``status.sharedSpill`` from each worker's spill report (address -> ``{"bytes",
    "ownBytes", "share"}``, :func:`memops.worker.links.spill`: its bytes with each inode once, those
    of files it wrote itself, and its share of its node's, where an inode that k workers link counts
    1/k to each). A report that is not plain numbers, or whose share or own bytes are not within its
    bytes, is not counted: the workers' words.

    The kernel charges each file to the container that allocated it: the worker that wrote it, or
    its pod's spill owner (``ownerBytes``, ``swap: SpillOnly``: ``bytesChargedToOwners``). A file
    that only workers which linked it still name (its writer drained, or its key unspilled there) is
    ``bytesWithoutWriter``: the whole, less what the workers and their owners allocated."""
    workers, total, per_worker, own, owners = 0, 0.0, 0, 0, 0
    for report in reports.values():
        if not isinstance(report, Mapping):
            continue
        counted, share = counts.plain(report.get("bytes")), report.get("share")
        written = counts.plain(report.get("ownBytes", 0))
        owned_ = counts.plain(report.get("ownerBytes", 0))
        if counted is None or written is None or owned_ is None or written + owned_ > counted:
            continue
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= counted:
            continue
        workers += 1
        per_worker += counted
        total += share
        own += written
        owners += owned_
    return specs.SharedSpillStatus(
        workers=workers,
        bytes=round(total),
        bytesCountedPerWorker=per_worker,
        bytesWithoutWriter=max(0, round(total) - own - owners),
        bytesChargedToOwners=owners,
        lastRead=now,
    )


def linked_bytes(reports: Mapping[str, Any]) -> dict[str, int]:
    """Worker address -> the bytes of spill files it holds but whose pages its own container did not
    allocate: files it holds by a link it made to a peer's file (a fetch by link, a hand-over), and
    files that its pod's spill owner allocated (``swap: SpillOnly``), from the same reports as
    :func:`spill_status`: its ``bytes`` less its ``ownBytes``. The kernel charges those pages to the
    pod that wrote them, or to the owner sidecar, not to this worker's container, so in-place growth
    leaves them out of what counts against its limit
    (:func:`memops.decisions.resize_decisions.used_bytes`).

    A report that is not plain byte counts, that says nothing of its own bytes, or whose own bytes
    exceed its bytes, is left out: its worker counts as linking nothing, and all of Dask's spilled
    bytes count against its limit. That is the safe side: counting too much grows a worker earlier,
    never later. Each figure is at least 0 and less than :data:`memops.decisions.counts.LIMIT`."""
    found: dict[str, int] = {}
    for address, report in reports.items():
        if not isinstance(report, Mapping):
            continue
        counted, written = counts.plain(report.get("bytes")), counts.plain(report.get("ownBytes"))
        if counted is None or written is None or written > counted:
            continue
        found[str(address)] = counted - written
    return found
