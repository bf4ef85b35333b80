"""Each real Node's mounts: a mount namespace of its own, as a machine of its own has.

The Nodes are processes of one machine, which share its mounts: without this, a tmpfs at a host
path would be one filesystem for every Node, and a worker on another Node could link a spilled
key's file that a real node could only receive over the network. So each Node's containerd starts
in a mount namespace of its own (:func:`own_namespace`), and its kubelet joins it
(:func:`joining`); the containers they start see the Node's mounts. Two trees are shared with
the machine, so that what tests and people read on it stays where it was:

- :data:`~memops_sandbox.nodes.DISK_ROOT` (the kubelets' and containerds' roots) is shared both
  ways: a volume that a kubelet mounts (a medium-Memory emptyDir) is seen on the machine;
- :data:`HOST_MOUNTS` goes from the machine to the Nodes only: a tmpfs mounted on the machine
  under it is every Node's (as a DaemonSet's mount on each node would be), and one mounted in a
  Node's namespace (:func:`node_tmpfs`) is that Node's alone.

:func:`share` makes both shared on the machine before the first Node starts (a bind mount each);
the sandbox's clean-up takes them back: the disk root's with the mounts under it, and
:func:`unshare_host_mounts` the other.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from memops_sandbox import mountinfo

HOST_MOUNTS = Path("/var/lib/memops")
"""Mounts made on the machine under here reach every Node; those made in a Node stay there."""
PID_FILE = "mounts.pid"
"""In a Node's run directory: the pid of a process in the Node's mount namespace (its containerd)."""


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, text=True)


def _mount_root(path: Path) -> str | None:
    """The root (within its filesystem) of the mount at ``path``, or None where nothing is mounted
    there: a bind mount of a directory onto itself has that directory's path, a filesystem ``/``."""
    found = mountinfo.at(path)
    return found.root if found is not None else None


def share(disk_root: Path) -> None:
    """Before the first Node starts: ``disk_root`` and :data:`HOST_MOUNTS` each a bind mount of
    itself (unless something is mounted there already), shared, so that the Nodes' namespaces keep
    receiving what is mounted under them."""
    for root in (disk_root, HOST_MOUNTS):
        root.mkdir(parents=True, exist_ok=True)
        if _mount_root(root) is None:
            _mount("--bind", str(root), str(root))
        _mount("--make-shared", str(root))


def unshare_host_mounts() -> None:
    """The bind mount that :func:`share` made at :data:`HOST_MOUNTS` gone (lazily: what is mounted
    under it goes too), and the directory removed when it is empty. A filesystem mounted there (its
    root ``/``: someone else's, not a bind mount of the directory) stays. The disk root's bind mount
    is one of the mounts under the disk root, which the sandbox's clean-up removes already."""
    mounted = _mount_root(HOST_MOUNTS) if HOST_MOUNTS.exists() else None
    if mounted is not None and mounted != "/":
        subprocess.run(["umount", "-l", str(HOST_MOUNTS)], capture_output=True, check=False)
    with contextlib.suppress(OSError):
        HOST_MOUNTS.rmdir()


def own_namespace(argv: Sequence[str]) -> list[str]:
    """``argv`` in a new mount namespace: a copy of the machine's mounts, :data:`HOST_MOUNTS` made
    its slave (it receives, and sends nothing back); the disk root, still shared, stays a peer."""
    script = f'mount --make-rslave {HOST_MOUNTS} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "unchanged", "--", "sh", "-c", script, "sh", *argv]


def joining(pid: int, argv: Sequence[str]) -> list[str]:
    """``argv`` in the mount namespace of process ``pid``."""
    return ["nsenter", f"--mount=/proc/{pid}/ns/mnt", "--", *argv]


def node_pid(run_root: Path, node: str) -> int:
    """A process in Node ``node``'s mount namespace (its containerd)."""
    return int((run_root / node / PID_FILE).read_text())


def on_node(run_root: Path, node: str, path: str | Path) -> Path:
    """Where ``path`` of Node ``node`` (its own mounts) is seen from the machine."""
    return Path(f"/proc/{node_pid(run_root, node)}/root") / Path(path).relative_to("/")


@contextlib.contextmanager
def node_tmpfs(run_root: Path, node: str, path: str, options: str) -> Iterator[Path]:
    """A tmpfs at ``path`` on Node ``node`` alone (``options``: mount's ``-o``), as a DaemonSet's
    privileged pod mounts one on its node; unmounted on exit. Yields where the machine sees it."""
    pid = node_pid(run_root, node)
    directory = Path(path)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)  # under the bind mount: the machine's and every Node's
    mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", path]
    subprocess.run(joining(pid, mount), check=True, capture_output=True)
    try:
        yield on_node(run_root, node, path)
    finally:
        subprocess.run(joining(pid, ["umount", "-l", path]), capture_output=True, check=False)
        if made:
            with contextlib.suppress(OSError):  # another Node's tmpfs may be mounted there still
                directory.rmdir()
