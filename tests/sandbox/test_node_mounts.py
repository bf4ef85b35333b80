"""A real Node's mount namespace: how its processes are started in it, and how the machine sees it."""

from __future__ import annotations

from pathlib import Path

import pytest
from memops_sandbox import mountinfo, node_mounts


def test_a_nodes_containerd_starts_in_a_namespace_that_receives_the_machines_host_mounts_only() -> None:
    argv = node_mounts.own_namespace(["/bin/containerd", "--config=/c.toml"])
    assert argv[:5] == ["unshare", "--mount", "--propagation", "unchanged", "--"]
    script = argv[argv.index("-c") + 1]
    assert f"mount --make-rslave {node_mounts.HOST_MOUNTS}" in script and script.endswith('exec "$@"')
    assert argv[-2:] == ["/bin/containerd", "--config=/c.toml"]


def test_a_nodes_kubelet_joins_its_containerds_namespace(tmp_path: Path) -> None:
    (tmp_path / "node-1").mkdir()
    (tmp_path / "node-1" / node_mounts.PID_FILE).write_text("4242\n")
    pid = node_mounts.node_pid(tmp_path, "node-1")
    assert node_mounts.joining(pid, ["/bin/kubelet"]) == ["nsenter", "--mount=/proc/4242/ns/mnt", "--", "/bin/kubelet"]
    assert node_mounts.on_node(tmp_path, "node-1", "/var/lib/memops/x") == Path("/proc/4242/root/var/lib/memops/x")


TABLE = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro
40 22 0:35 / /var/lib/memops rw,relatime shared:20 - tmpfs tmpfs rw,size=1024k
41 40 8:1 /var/lib/memops /var/lib/memops rw,relatime shared:21 - ext4 /dev/sda1 rw
42 41 0:36 / /var/lib/memops/node\\040spill rw,nosuid master:3 - tmpfs none rw,size=65536k,mode=755
"""


def test_the_mount_table_is_read_as_the_kernel_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Of two mounts at one point the later is on top; an escaped space is a space; the options are
    the mount's and the superblock's; a mount below another is listed before it."""
    (tmp_path / "mountinfo").write_text(TABLE)
    monkeypatch.setattr(mountinfo, "TABLE", tmp_path / "mountinfo")
    top = mountinfo.at(Path("/var/lib/memops"))
    assert top is not None and top.root == "/var/lib/memops" and top.fstype == "ext4"
    spill = mountinfo.at(Path("/var/lib/memops/node spill"))
    assert spill is not None and spill.fstype == "tmpfs"
    assert {"nosuid", "size=65536k", "mode=755"} <= spill.options
    assert mountinfo.at(Path("/var/lib/memops/other")) is None
    assert mountinfo.under(Path("/var/lib/memops")) == [
        "/var/lib/memops/node spill",
        "/var/lib/memops",
        "/var/lib/memops",
    ]
    monkeypatch.setattr(mountinfo, "TABLE", tmp_path / "absent")
    assert mountinfo.mounts() == []
