"""The node agent's emptyDir and hostPath volumes: node directories, and mount paths rewritten to them."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import nodeagent_env as envs
from memops_sandbox import nodeagent_volumes as volumes


def pod(*volume: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "w", "uid": "u-1"}, "spec": {"volumes": list(volume)}}


def mounted(*mount: dict[str, Any]) -> dict[str, Any]:
    return {"name": "worker", "volumeMounts": list(mount)}


def test_an_emptydir_of_medium_memory_is_on_the_nodes_tmpfs_and_goes_with_the_pod(tmp_path: Path) -> None:
    tmpfs, scratch = tmp_path / "shm", tmp_path / "disk"
    body = pod({"name": "spill", "emptyDir": {"medium": "Memory"}}, {"name": "cache", "emptyDir": {}})
    found = volumes.mounts(
        body,
        mounted({"name": "spill", "mountPath": "/spill/"}, {"name": "cache", "mountPath": "/cache"}),
        tmpfs=tmpfs,
        scratch=scratch,
    )
    assert found["/spill"] == tmpfs / "pods" / "u-1" / "volumes" / "kubernetes.io~empty-dir" / "spill"
    assert found["/cache"] == scratch / "pods" / "u-1" / "volumes" / "kubernetes.io~empty-dir" / "cache"
    assert all(d.is_dir() for d in found.values())
    volumes.remove_empty_dirs(body, tmpfs=tmpfs, scratch=scratch)
    assert not any(d.exists() for d in found.values())


def test_host_paths_are_under_the_nodes_tmpfs_and_directory_must_exist(tmp_path: Path) -> None:
    body = pod({"name": "spill", "hostPath": {"path": "/var/lib/memops/spill", "type": "Directory"}})
    container = mounted({"name": "spill", "mountPath": "/memops-spill"})
    with pytest.raises(envs.ConfigError, match="is not a directory"):
        volumes.mounts(body, container, tmpfs=tmp_path, scratch=tmp_path)
    prepared = tmp_path / "host" / "var" / "lib" / "memops" / "spill"
    prepared.mkdir(parents=True)  # what the node DaemonSet does
    assert volumes.mounts(body, container, tmpfs=tmp_path, scratch=tmp_path) == {"/memops-spill": prepared}
    volumes.remove_empty_dirs(body, tmpfs=tmp_path, scratch=tmp_path)
    assert prepared.is_dir(), "a host path outlives the pod"


@pytest.mark.parametrize(
    ("volume", "mount", "message"),
    [
        pytest.param({"name": "v", "emptyDir": {}}, {"name": "x", "mountPath": "/m"}, "no such volume", id="missing"),
        # The kubelet's own refusals (makeMounts): absolute, backsteps, an unset variable.
        pytest.param(
            {"name": "v", "emptyDir": {}},
            {"name": "v", "mountPath": "/m", "subPath": "/etc"},
            "must not be an absolute path",
            id="absolute-subpath",
        ),
        pytest.param(
            {"name": "v", "emptyDir": {}},
            {"name": "v", "mountPath": "/m", "subPath": "a/../../b"},
            "must not contain '..'",
            id="dotdot-subpath",
        ),
        pytest.param(
            {"name": "v", "emptyDir": {}},
            {"name": "v", "mountPath": "/m", "subPathExpr": "$(NOWHERE)/x"},
            "missing value for NOWHERE",
            id="unset-subpathexpr",
        ),
        pytest.param(
            {"name": "v", "emptyDir": {}},
            {"name": "v", "mountPath": "/m", "subPathExpr": "$(UP)/x"},
            "must not contain '..'",
            id="dotdot-subpathexpr",
        ),
        pytest.param({"name": "v", "hostPath": {"path": "/a/../b"}}, {"name": "v", "mountPath": "/m"}, "absolute"),
        pytest.param(
            {"name": "v", "hostPath": {"path": "/a", "type": "Socket"}}, {"name": "v", "mountPath": "/m"}, "type"
        ),
    ],
)
def test_what_is_not_emulated_is_an_error(
    tmp_path: Path, volume: dict[str, Any], mount: dict[str, Any], message: str
) -> None:
    with pytest.raises(envs.ConfigError, match=message):
        volumes.mounts(pod(volume), mounted(mount), tmpfs=tmp_path, scratch=tmp_path, env={"UP": ".."})


SPILL = {"name": "spill", "hostPath": {"path": "/var/lib/memops/spill", "type": "Directory"}}


def _root(tmp_path: Path, mode: int = 0o2770) -> Path:
    root = tmp_path / "host" / "var" / "lib" / "memops" / "spill"
    root.mkdir(parents=True)  # what the node DaemonSet does
    root.chmod(mode)
    return root


def test_a_subpath_mounts_its_directory_made_with_the_volumes_mode(tmp_path: Path) -> None:
    """As the kubelet: the missing ``<namespace>/<policy>`` directories are made, each with the
    mode of the volume's directory (setgid included), and the mount path stands for the last."""
    root = _root(tmp_path)
    container = mounted({"name": "spill", "mountPath": "/memops-spill", "subPath": "team-a/spill"})
    found = volumes.mounts(pod(SPILL), container, tmpfs=tmp_path, scratch=tmp_path)
    assert found == {"/memops-spill": root / "team-a" / "spill"}
    for made in (root / "team-a", root / "team-a" / "spill"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o2770, oct(made.stat().st_mode)
    # Mounted again (another pod of the policy): the same directory, left as it is.
    (root / "team-a" / "spill" / "kept").write_text("x")
    assert volumes.mounts(pod(SPILL), container, tmpfs=tmp_path, scratch=tmp_path) == found
    assert (root / "team-a" / "spill" / "kept").exists()
    assert volumes.translate("/memops-spill/dask-scratch-space", found) == str(root / "team-a/spill/dask-scratch-space")


def test_directory_or_create_makes_each_missing_directory_0755_as_the_kubelet(tmp_path: Path) -> None:
    """``hostPath`` ``DirectoryOrCreate`` of ``<root>/<namespace>/<policy>`` (medium Node's volume):
    ``os.MkdirAll(path, 0755)``, so each made directory is 0755 whatever the root's mode, with the
    setgid bit (and so the group) that the kernel carries down from a setgid root."""
    root = _root(tmp_path)
    volume = {"name": "spill", "hostPath": {"path": "/var/lib/memops/spill/team-a/spill", "type": "DirectoryOrCreate"}}
    old = os.umask(0)  # no umask: the mode is makeDir's 0755, not a default of 0777 less the umask
    try:
        found = volumes.mounts(
            pod(volume), mounted({"name": "spill", "mountPath": "/memops-spill"}), tmpfs=tmp_path, scratch=tmp_path
        )
    finally:
        os.umask(old)
    assert found == {"/memops-spill": root / "team-a" / "spill"}
    for made in (root / "team-a", root / "team-a" / "spill"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o2755, oct(made.stat().st_mode)
    assert stat.S_IMODE(root.stat().st_mode) == 0o2770, "the root is left as it is"


def test_a_subpathexpr_expands_the_containers_environment(tmp_path: Path) -> None:
    root = _root(tmp_path)
    container = mounted({"name": "spill", "mountPath": "/memops-spill", "subPathExpr": "$(NS)/spill"})
    found = volumes.mounts(pod(SPILL), container, tmpfs=tmp_path, scratch=tmp_path, env={"NS": "team-b"})
    assert found == {"/memops-spill": root / "team-b" / "spill"}


@pytest.mark.parametrize("link", ["team-b", "team-b/spill"])
def test_a_subpath_through_a_link_outside_the_volume_is_refused(tmp_path: Path, link: str) -> None:
    """A link left where a namespace's or a policy's directory goes, to outside the volume: the
    kubelet refuses the mount (its existing part, or the resolved subpath, is not within the volume)."""
    root = _root(tmp_path)
    outside = tmp_path / "etc"
    outside.mkdir()
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(outside)
    container = mounted({"name": "spill", "mountPath": "/memops-spill", "subPath": "team-b/spill"})
    with pytest.raises(envs.ConfigError, match=r"outside of allowed base|not within volume path"):
        volumes.mounts(pod(SPILL), container, tmpfs=tmp_path, scratch=tmp_path)
    assert not list(outside.iterdir()), "nothing made outside the volume"


def test_a_subpath_through_a_link_inside_the_volume_is_followed(tmp_path: Path) -> None:
    """Inside the volume, the kubelet follows a link (EvalSymlinks, then the within-volume check):
    what a pod can do with it is only what it could do in the volume anyway."""
    root = _root(tmp_path)
    (root / "team-a").mkdir()
    (root / "team-b").symlink_to(root / "team-a")
    container = mounted({"name": "spill", "mountPath": "/memops-spill", "subPath": "team-b/spill"})
    assert volumes.mounts(pod(SPILL), container, tmpfs=tmp_path, scratch=tmp_path) == {
        "/memops-spill": root / "team-a" / "spill"
    }


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/memops-spill", "/node/spill"),
        ("/memops-spill/dask-scratch-space", "/node/spill/dask-scratch-space"),
        ("/memops-spillover", "/memops-spillover"),
        ("/data/x", "/node/data/x"),
        ("/data/deeper/x", "/node/deeper/x"),
        ("tcp://s:8786", "tcp://s:8786"),
    ],
)
def test_translate(text: str, expected: str) -> None:
    found = {"/memops-spill": Path("/node/spill"), "/data": Path("/node/data"), "/data/deeper": Path("/node/deeper")}
    assert volumes.translate(text, found) == expected


def test_other_volumes_are_left_out_as_before(tmp_path: Path) -> None:
    token = {"name": "kube-api-access", "projected": {"sources": []}}
    container = mounted({"name": "kube-api-access", "mountPath": "/var/run/secrets/x", "subPath": "token"})
    assert volumes.mounts(pod(token), container, tmpfs=tmp_path, scratch=tmp_path) == {}
