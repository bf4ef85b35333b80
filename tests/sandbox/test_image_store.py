"""The real Nodes' image store: made once per set of images, copied into each Node's containerd
root with links to what containerd never writes, and real copies of what it does."""

from __future__ import annotations

import os
from pathlib import Path

from memops_sandbox import images, nodes
from memops_sandbox.build import NodeBinaries


def binaries(tmp_path: Path) -> NodeBinaries:
    containerd = tmp_path / "bin" / "containerd"
    containerd.parent.mkdir(parents=True)
    containerd.write_bytes(b"containerd")
    other = tmp_path / "bin" / "other"
    return NodeBinaries(
        kubelet=other,
        kube_proxy=other,
        containerd=containerd,
        containerd_shim_runc_v2=other,
        ctr=other,
        cni_bin_dir=other,
        runc=other,
        pause=other,
    )


def archive(tmp_path: Path, name: str, content: bytes = b"layers") -> images.ImageArchive:
    path = tmp_path / name
    path.write_bytes(content)
    return images.ImageArchive(name=name.split("-")[0], ref=f"localhost/memops/{name}", path=path)


def test_the_store_is_the_same_while_the_archives_are_only_used(tmp_path: Path) -> None:
    """Using an archive touches it (the image cache prunes by mtime): that must not make a new
    store, or every sandbox would import every image again."""
    found = binaries(tmp_path)
    dask = archive(tmp_path, "dask-1111.tar")
    key = nodes._store_key(found, [dask], {"ghcr.io/dask/dask:1": dask.ref})
    os.utime(dask.path, (1, 1))
    assert nodes._store_key(found, [dask], {"ghcr.io/dask/dask:1": dask.ref}) == key


def test_another_image_or_alias_is_another_store(tmp_path: Path) -> None:
    found = binaries(tmp_path)
    dask = archive(tmp_path, "dask-1111.tar")
    key = nodes._store_key(found, [dask], {})
    rebuilt = archive(tmp_path, "dask-2222.tar")  # other inputs: another name
    assert nodes._store_key(found, [rebuilt], {}) != key
    assert nodes._store_key(found, [dask], {"ghcr.io/dask/dask:1": dask.ref}) != key
    found.containerd.write_bytes(b"another containerd")
    assert nodes._store_key(found, [dask], {}) != key


def test_a_copy_links_blobs_and_layers_and_copies_the_databases(tmp_path: Path) -> None:
    """Blobs and unpacked layers are shared (no second 500 MiB per Node); the bolt databases,
    which containerd writes in place, are each Node's own: a write to one leaves the store as it was."""
    store = tmp_path / "store" / "containerd"
    blob = store / "io.containerd.content.v1.content" / "blobs" / "sha256" / "abc"
    layer = store / "io.containerd.snapshotter.v1.overlayfs" / "snapshots" / "1" / "fs" / "usr" / "python"
    for path, content in (
        (blob, b"blob"),
        (layer, b"python"),
        (store / "io.containerd.metadata.v1.bolt" / "meta.db", b"images"),
        (store / "io.containerd.snapshotter.v1.overlayfs" / "metadata.db", b"snapshots"),
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    root = tmp_path / "node-0" / "containerd"
    nodes._copy_store(store, root)

    assert (root / blob.relative_to(store)).stat().st_ino == blob.stat().st_ino
    assert (root / layer.relative_to(store)).stat().st_ino == layer.stat().st_ino
    for database in ("io.containerd.metadata.v1.bolt/meta.db", "io.containerd.snapshotter.v1.overlayfs/metadata.db"):
        copy = root / database
        assert copy.stat().st_ino != (store / database).stat().st_ino
        copy.write_bytes(b"containers of node-0")
        assert (store / database).read_bytes() in (b"images", b"snapshots")

    nodes._copy_store(store, root)  # a root left by a crashed run is replaced, not merged into
    assert (root / "io.containerd.metadata.v1.bolt" / "meta.db").read_bytes() == b"images"
