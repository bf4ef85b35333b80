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
  ``CreateContainerConfigError`` that is retried), ``DirectoryOrCreate`` is created with its
  missing parents, each with mode 0755 (:func:`make_dirs`);
- the container sees the directory, not the mount path: an environment value or a command-line
  argument that is a mount path, or a path under one, is rewritten to the directory.
  A process that builds such a path by itself does not see the volume;
- a mount's ``subPath`` (or ``subPathExpr``, expanded with the container's environment) is the
  directory under the volume's, checked and made as the kubelet does (``makeMounts``,
  pkg/kubelet/kubelet_pods.go, and pkg/volume/util/subpath/subpath_linux.go): an absolute one or
  one with a ``..`` component is refused, a missing one is made with the mode of the volume's
  directory (its setuid, setgid and sticky bits included), and one that resolves, through a
  symbolic link, outside the volume is refused. The kubelet then bind-mounts the resolved
  directory; here its path is what the container's mount path is rewritten to.

What no directory can stand for, the node agent cannot enforce: every container runs as the same
host user with the whole host filesystem in view, so a process that names a path outside its
mounts reaches it. A kubelet's container sees only its mounts, and a subPath mount only its
subdirectory. Not emulated either: ``readOnly``, a tmpfs' ``sizeLimit`` (the kubelet's ``size=``
mount option), and the other volume types (their mounts are left out, as before).
"""

from __future__ import annotations

import os
import shutil
import stat
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


def make_dirs(directory: Path) -> None:
    """``DirectoryOrCreate``: the kubelet's ``makeDir`` (pkg/volume/hostpath/host_path.go),
    ``os.MkdirAll(path, 0755)``: every missing component made with 0755 (less the umask), the
    parents too, which Python's ``mkdir(parents=True)`` would make 0777."""
    missing = []
    for path in (directory, *directory.parents):
        if path.exists():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:
            pass
    if not directory.is_dir():
        raise envs.ConfigError(f"hostPath type check failed: {directory} is not a directory")


class _Recorded(dict[str, str]):
    """The container's environment, noting each variable that ``subPathExpr`` names and that is
    unset or empty: the kubelet refuses those (``ExpandContainerVolumeMounts``)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        super().__init__(env)
        self.missing: set[str] = set()

    def get(self, key: str, default: object = None) -> str:
        value = super().get(key)
        if not value:
            self.missing.add(key)
            return ""
        return value


def sub_path(mount: Obj, env: Mapping[str, str]) -> str:
    """The mount's ``subPath``, or its ``subPathExpr`` expanded with the container's ``env``;
    refused as the kubelet refuses it: absolute, or with a ``..`` component."""
    text = str(mount.get("subPath") or "")
    if mount.get("subPathExpr"):
        recorded = _Recorded(env)
        text = envs.expand(str(mount["subPathExpr"]), recorded)
        if recorded.missing:
            raise envs.ConfigError(f"subPathExpr: missing value for {', '.join(sorted(recorded.missing))}")
    if text.startswith("/"):
        raise envs.ConfigError(f"error SubPath `{text}` must not be an absolute path")
    if ".." in text.split("/"):
        raise envs.ConfigError(f"unable to provision SubPath `{text}`: must not contain '..'")
    return text


def _within(path: Path, base: Path) -> bool:
    return path == base or base in path.parents


def _make_sub_path(volume: Path, sub: str) -> None:
    """The kubelet's ``SafeMakeDir``: the missing directories of ``sub``, made one by one with the
    mode of the volume's directory, after the existing part is found to resolve inside it."""
    parts = [part for part in sub.split("/") if part not in ("", ".")]
    existing, index = volume, 0
    while index < len(parts) and (existing / parts[index]).exists():  # following links, as findExistingPrefix
        existing, index = existing / parts[index], index + 1
    base, current = volume.resolve(), existing.resolve()
    if not _within(current, base):
        raise envs.ConfigError(f"subPath {sub!r}: path {current} is outside of allowed base {base}")
    mode = stat.S_IMODE(volume.stat().st_mode)  # GetMode: permissions with setuid, setgid and sticky
    for part in parts[index:]:
        current = current / part
        os.mkdir(current)
        os.chmod(current, mode)  # mkdir's mode passed the umask; the kubelet's fchmod does not


def sub_directory(volume: Path, sub: str) -> Path:
    """Where a mount of ``volume`` at ``sub`` lands: made if missing, resolved, and refused when
    it resolves outside the volume (``safeOpenSubPath``: "not within volume path")."""
    if not sub:
        return volume
    try:
        if not (volume / sub).exists():
            _make_sub_path(volume, sub)
        resolved = (volume / sub).resolve(strict=True)
    except OSError as exc:
        raise envs.ConfigError(f"failed to create subPath directory {sub!r}: {exc}") from None
    base = volume.resolve()
    if not _within(resolved, base):
        raise envs.ConfigError(f"subpath {str(resolved)!r} not within volume path {str(base)!r}")
    return resolved


def mounts(
    pod: Obj, container: Obj, *, tmpfs: Path, scratch: Path, env: Mapping[str, str] | None = None
) -> dict[str, Path]:
    """``mountPath`` -> the node directory, for the container's emptyDir and hostPath mounts;
    ``env``: the container's environment, for ``subPathExpr``."""
    volumes = {str(v.get("name")): v for v in (pod.get("spec") or {}).get("volumes") or []}
    found: dict[str, Path] = {}
    for mount in container.get("volumeMounts") or []:
        volume = volumes.get(str(mount.get("name")))
        if volume is None:
            raise envs.ConfigError(f"volumeMount {mount.get('name')!r}: no such volume")
        if "emptyDir" not in volume and "hostPath" not in volume:
            continue  # a projected token, a Secret...: not mounted, as before
        sub = sub_path(mount, env or {})
        if "emptyDir" in volume:
            memory = (volume["emptyDir"] or {}).get("medium") == "Memory"
            directory = empty_dir(pod, str(volume["name"]), tmpfs=tmpfs, scratch=scratch, memory=memory)
            directory.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            source = volume["hostPath"]
            directory = host_path(str(source.get("path", "")), tmpfs=tmpfs)
            kind = source.get("type") or ""
            if kind == "DirectoryOrCreate":
                make_dirs(directory)
            elif kind == "Directory" and not directory.is_dir():
                # The kubelet's hostPath type check (pkg/volume/hostpath/host_path.go, checkType).
                raise envs.ConfigError(f"hostPath type check failed: {source.get('path')} is not a directory")
            elif kind not in ("", "Directory"):
                raise envs.ConfigError(f"hostPath type {kind!r} is not emulated")
        found[str(mount["mountPath"]).rstrip("/") or "/"] = sub_directory(directory, sub)
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
