"""The node agent's emptyDir and hostPath volumes: node directories, and mount paths rewritten to them."""

from __future__ import annotations

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
        pytest.param(
            {"name": "v", "emptyDir": {}}, {"name": "v", "mountPath": "/m", "subPath": "a"}, "subPath", id="subpath"
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
        volumes.mounts(pod(volume), mounted(mount), tmpfs=tmp_path, scratch=tmp_path)


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
