"""A real Node's mount namespace: how its processes are started in it, and how the machine sees it."""

from __future__ import annotations

from pathlib import Path

from memops_sandbox import node_mounts


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
