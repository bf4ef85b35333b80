"""A container's ``emptyDir`` and ``hostPath`` volumes, as directories of the node: pure but for mkdir.

The kubelet mounts a volume into the container's mount namespace at ``volumeMounts[].mountPath``.
The node agent runs containers as plain processes, with no mount namespace, so it does the next
best thing and says so:

- each volume is a directory of the node: an ``emptyDir`` at the kubelet's own layout,
  ``pods/<uid>/volumes/kubernetes.io~empty-dir/<name>`` (``getPath``, pkg/volume/emptydir/empty_dir.go),
  under the node's tmpfs directory for ``medium: Memory`` (the kubelet mounts a tmpfs there) and
  under its scratch directory otherwise; removed with the pod, as the kubelet removes it;
- a ``hostPath`` is ``<node tmpfs dir>/host/<path>``: the sandbox's node filesystem for host paths
  lives on a tmpfs, as if the shared-spill DaemonSet had mounted one there (the only host paths
  memops gives pods). ``type: Directory`` must exist (the kubelet's ``FailedMount``, here a
  ``CreateContainerConfigError`` that is retried), ``DirectoryOrCreate`` is created;
- the container sees the directory, not the mount path: an environment value or a command-line
  argument that is a mount path, or a path under one, is rewritten to the directory.
  A process that builds such a path by itself does not see the volume.

Not emulated: ``subPath``, ``readOnly``, a tmpfs' ``sizeLimit`` (the kubelet's ``size=`` mount
option), and the other volume types (their mounts are left out, as before).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from memops_sandbox import nodeagent_env as envs

Obj = dict[str, Any]
EMPTY_DIR = "kubernetes.io~empty-dir"


def empty_dir(pod: Obj, name: str, *, tmpfs: Path, scratch: Path, memory: bool) -> Path:
    uid = str(pod["metadata"].get("uid", ""))
    return (tmpfs if memory else scratch) / "pods" / uid / "volumes" / EMPTY_DIR / name


def host_path(path: str, *, tmpfs: Path) -> Path:
    parts = [part for part in path.split("/") if part]
    if not path.startswith("/") or any(part in (".", "..") for part in parts):
        raise envs.ConfigError(f"hostPath {path!r}: not an absolute path")
    return tmpfs.joinpath("host", *parts)


def mounts(pod: Obj, container: Obj, *, tmpfs: Path, scratch: Path) -> dict[str, Path]:
    """``mountPath`` -> the node directory, for the container's emptyDir and hostPath mounts."""
    volumes = {str(v.get("name")): v for v in (pod.get("spec") or {}).get("volumes") or []}
    found: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(str(mount.get("name")))
        if volume is None:
            raise envs.ConfigError(f"volumeMount {mount.get('name')!r}: no such volume")
        if "emptyDir" not in volume and "hostPath" not in volume:
            continue  # a projected token, a Secret...: not mounted, as before
        if mount.get("subPath") or mount.get("subPathExpr"):
            raise envs.ConfigError(f"volumeMount {mount.get('name')!r}: subPath is not emulated")
        if "emptyDir" in volume:
            memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            directory = empty_dir(pod, str(volume["name"]), tmpfs=tmpfs, scratch=scratch, memory=memory)
            directory.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            source = volume["hostPath"]
            directory = host_path(str(source.get("path", "")), tmpfs=tmpfs)
            kind = source.get("type") or ""
            if kind == "DirectoryOrCreate":
                directory.mkdir(parents=True, exist_ok=True)
            elif kind == "Directory" and not directory.is_dir():
                # The kubelet's hostPath type check (pkg/volume/hostpath/host_path.go, checkType).
                raise envs.ConfigError(f"hostPath type check failed: {source.get('path')} is not a directory")
            elif kind not in ("", "Directory"):
                raise envs.ConfigError(f"hostPath type {kind!r} is not emulated")
        found[str(mount["mountPath"]).rstrip("/") or "/"] = directory
    return found


def translate(text: str, found: Mapping[str, Path]) -> str:
    """A mount path, or a path under one, as the node directory that stands for it."""
    for mount_path, directory in sorted(found.items(), key=lambda item: -len(item[0])):
        if text == mount_path:
            return str(directory)
        if text.startswith(mount_path + "/"):
            return str(directory) + text[len(mount_path) :]
    return text


def remove_empty_dirs(pod: Obj, *, tmpfs: Path, scratch: Path) -> None:
    """The pod's emptyDirs go with it (the kubelet's ``cleanupOrphanedPodDirs``); host paths stay."""
    uid = str(pod["metadata"].get("uid", ""))
    if uid:
        for root in (tmpfs, scratch):
            shutil.rmtree(root / "pods" / uid, ignore_errors=True)
