"""The images the sandbox's nodes run, made without a registry: their OCI layout, their cache
keys, and, in a throwaway containerd built from the sandbox's own binaries (its own root, state
and socket under a temporary directory, stopped and removed after the module), that
``ctr images import`` takes them and that their programs run under runc.

Needs root (containerd does) and the binaries and images in the cache: ``memops-sandbox build``
makes them first in CI, so that here they are read from the cache."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib.metadata
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from memops_sandbox import build, images

pytestmark = pytest.mark.timeout(300)

CGROUPS = "type=cgroup,src=cgroup,dst=/sys/fs/cgroup,options=ro:nosuid:nodev:noexec"


# --- pure: what the Dockerfile says, cache keys ---------------------------------------------

DOCKERFILE = """ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1
USER builder
ENTRYPOINT ["not", "this"]

FROM ${PYTHON_IMAGE}
# a comment
ENV PATH=/opt/app/bin:$PATH \\
    A=1 \\
    B="two words"
WORKDIR /work
USER 65532:65532
CMD ["first"]
ENTRYPOINT ["app", "run"]
CMD ["--all"]
"""


def test_the_runtime_stage_decides_the_config() -> None:
    config = images.dockerfile_config(DOCKERFILE, {"PATH": "/usr/bin:/bin"})
    assert config.user == "65532:65532"
    assert config.entrypoint == ("app", "run")
    assert config.cmd == ("--all",), "an ENTRYPOINT resets the CMD before it; the CMD after it stands"
    assert dict(config.env) == {"PATH": "/opt/app/bin:/usr/bin:/bin", "A": "1", "B": "two words"}
    assert config.working_dir == "/work"
    assert "PIP_NO_CACHE_DIR" not in dict(config.env), "the build stage's ENV is not the image's"


def test_a_cmd_before_an_entrypoint_is_dropped_as_docker_does() -> None:
    config = images.dockerfile_config('FROM x\nCMD ["a"]\nENTRYPOINT ["b"]\n', {})
    assert (config.entrypoint, config.cmd) == (("b",), ())


@pytest.mark.parametrize(
    ("change", "same"),
    [
        pytest.param({}, True, id="same-inputs"),
        pytest.param({"pins": {"dask": "2026.9.0"}}, False, id="another-dask"),
        pytest.param({"python": {"version": "3.12.1"}}, False, id="another-python"),
    ],
)
def test_an_archive_is_keyed_by_its_inputs(change: dict[str, Any], same: bool) -> None:
    inputs = {"python": {"version": "3.11.7"}, "pins": {"dask": "2026.8.0"}}
    assert (images.cache_key("dask", inputs) == images.cache_key("dask", {**inputs, **change})) is same
    assert images.cache_key("dask", inputs) != images.cache_key("operator", inputs)


def test_the_dask_image_pins_this_environments_versions() -> None:
    pins = images.dask_pins()
    assert set(pins) == set(images.DASK_DISTRIBUTIONS)
    for name, version in pins.items():
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            assert version == importlib.metadata.version(name)
    assert images.dask_ref() == f"localhost/memops/dask:{importlib.metadata.version('distributed')}"


# --- the archives ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def archives() -> dict[str, images.ImageArchive]:
    return images.ensure()


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]


def read_config(archive: images.ImageArchive) -> dict[str, Any]:
    members = _members(archive.path)
    (entry,) = json.loads(members["index.json"])["manifests"]
    manifest = json.loads(members[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
    config: dict[str, Any] = json.loads(members[f"blobs/sha256/{manifest['config']['digest'].removeprefix('sha256:')}"])
    return config


def test_each_archive_is_a_valid_oci_layout(archives: dict[str, images.ImageArchive]) -> None:
    for archive in archives.values():
        members = _members(archive.path)
        assert json.loads(members["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
        for name, data in members.items():
            if name.startswith("blobs/sha256/"):
                assert hashlib.sha256(data).hexdigest() == name.rpartition("/")[2], f"{archive.name}: {name}"
        (entry,) = json.loads(members["index.json"])["manifests"]
        assert entry["annotations"]["io.containerd.image.name"] == archive.ref
        manifest = json.loads(members[f"blobs/sha256/{entry['digest'].removeprefix('sha256:')}"])
        config = read_config(archive)
        diff_ids = [
            "sha256:" + hashlib.sha256(gzip.decompress(members[f"blobs/sha256/{d['digest'][7:]}"])).hexdigest()
            for d in manifest["layers"]
        ]
        assert config["rootfs"]["diff_ids"] == diff_ids
        assert (config["os"], config["architecture"]) == ("linux", "amd64")
    assert read_config(archives["pause"])["config"]["Entrypoint"] == ["/pause"]


# --- a throwaway containerd -----------------------------------------------------------------


class Containerd:
    """A containerd of the sandbox's binaries, alone under ``directory``; ``ctr(...)`` runs ctr
    against it in the kubelet's namespace."""

    def __init__(self, binaries: build.NodeBinaries, directory: Path):
        self.binaries = binaries
        self.directory = directory
        self.socket = directory / "containerd.sock"
        # The shim and runc are found on containerd's PATH.
        self.env = {
            **os.environ,
            "PATH": f"{binaries.containerd_shim_runc_v2.parent}:{binaries.runc.parent}:/usr/bin:/bin",
        }

    def config(self) -> str:
        return "\n".join(
            [
                "version = 3",
                f'root = "{self.directory / "root"}"',
                f'state = "{self.directory / "state"}"',
                # Images only: no CRI here (the kubelet's is the node runtime's business).
                'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
                "[grpc]",
                f'  address = "{self.socket}"',
                "[ttrpc]",
                f'  address = "{self.socket}.ttrpc"',
                "[debug]",
                f'  address = "{self.directory / "debug.sock"}"',
                "",
            ]
        )

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = [str(self.binaries.ctr), "--address", str(self.socket), "--namespace", images.NAMESPACE, *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=self.env, check=False)

    def run(
        self, name: str, ref: str, *command: str, options: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        result = self.ctr("run", "--rm", *options, ref, name, *command)
        result.stderr = "\n".join(line for line in result.stderr.splitlines() if "DEPRECATION" not in line)
        return result


def _unmount_under(directory: Path) -> None:
    """Unmount what a container left under ``directory`` (deepest first)."""
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for mount in sorted((m for m in mounts if m.startswith(f"{directory}/")), reverse=True):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)


@pytest.fixture(scope="module")
def containerd(archives: dict[str, images.ImageArchive]) -> Iterator[Containerd]:
    if os.geteuid() != 0:
        pytest.skip("containerd runs as root only; run as root to import and run the images")
    binaries = build.ensure_node_binaries()
    # Short: a unix socket's path has at most 107 bytes, and pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="memops-ctrd-", dir="/tmp"))
    daemon = Containerd(binaries, directory)
    (directory / "config.toml").write_text(daemon.config())
    log = (directory / "containerd.log").open("w")
    process = subprocess.Popen(
        [str(binaries.containerd), "--config", str(directory / "config.toml")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=daemon.env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while daemon.ctr("version", timeout=10).returncode != 0:
            assert process.poll() is None, (directory / "containerd.log").read_text()
            assert time.monotonic() < deadline, "containerd did not answer in 30 s"
            time.sleep(0.1)
        yield daemon
    finally:
        for task in daemon.ctr("tasks", "list", "--quiet").stdout.split():
            daemon.ctr("tasks", "kill", "--signal", "SIGKILL", task)
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
        _unmount_under(directory)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def imported(containerd: Containerd, archives: dict[str, images.ImageArchive]) -> dict[str, images.ImageArchive]:
    for archive in archives.values():
        images.import_into(containerd.binaries.ctr, containerd.socket, archive)
    return archives


def test_ctr_imports_every_image_under_its_ref(
    containerd: Containerd, imported: dict[str, images.ImageArchive]
) -> None:
    listed = containerd.ctr("images", "list", "--quiet").stdout.split()
    assert {archive.ref for archive in imported.values()} <= set(listed), listed
    assert imported["pause"].ref == images.PAUSE_REF


def test_the_dask_image_imports_distributed_at_this_environments_versions(
    containerd: Containerd, imported: dict[str, images.ImageArchive]
) -> None:
    code = "import json, dask, distributed, numpy, pandas, cloudpickle, msgpack, importlib.metadata as m; "
    code += f"print(json.dumps({{n: m.version(n) for n in {list(images.DASK_DISTRIBUTIONS)!r}}}))"
    result = containerd.run("dask-import", imported["dask"].ref, "python", "-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == images.dask_pins()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_dask_scheduler_and_workers_run_in_the_image_and_read_the_cgroup_limit(
    containerd: Containerd, imported: dict[str, images.ImageArchive]
) -> None:
    """``dask scheduler`` and ``dask worker ... --nworkers 2 --memory-limit auto`` as users run
    them: each worker process gets half the container's cgroup limit."""
    from distributed import Client

    ref, port = imported["dask"].ref, _free_port()
    logs = containerd.directory / "logs"
    logs.mkdir(exist_ok=True)
    limit = 512 * 2**20
    scheduler = containerd.ctr(
        "run", "--detach", "--net-host", "--log-uri", f"file://{logs / 'scheduler.log'}", ref, "dask-scheduler",
        "dask", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
    )  # fmt: skip
    assert scheduler.returncode == 0, scheduler.stderr
    worker = containerd.ctr(
        "run", "--detach", "--net-host", "--log-uri", f"file://{logs / 'worker.log'}", "--memory-limit", str(limit),
        "--mount", CGROUPS, ref, "dask-worker",
        "dask", "worker", f"tcp://127.0.0.1:{port}", "--nworkers", "2", "--memory-limit", "auto",
        "--host", "127.0.0.1", "--no-dashboard",
    )  # fmt: skip
    assert worker.returncode == 0, worker.stderr
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
            try:
                client.wait_for_workers(2, timeout=60)
            except TimeoutError:
                pytest.fail("\n".join(path.read_text() for path in sorted(logs.glob("*.log"))))
            limits = [w["memory_limit"] for w in client.scheduler_info()["workers"].values()]
            assert limits == [limit // 2] * 2
            assert client.submit(sum, [1, 2, 3]).result(timeout=30) == 6
    finally:
        for name in ("dask-worker", "dask-scheduler"):
            containerd.ctr("tasks", "kill", "--signal", "SIGKILL", name)
            containerd.ctr("tasks", "delete", "--force", name)
            containerd.ctr("containers", "delete", name)


def test_the_operator_image_runs_read_only_as_the_dockerfile_says(
    containerd: Containerd, imported: dict[str, images.ImageArchive]
) -> None:
    ref = imported["operator"].ref
    helped = containerd.run("operator-help", ref, "memops", "run", "--help", options=("--read-only",))
    assert helped.returncode == 0 and "--webhook-cert-file" in helped.stdout, helped.stderr
    code = "import os, memops; print(os.getuid(), os.getgid(), memops.__file__)"
    who = containerd.run("operator-who", ref, "python", "-c", code, options=("--read-only",))
    assert who.returncode == 0, who.stderr
    uid, gid, where = who.stdout.split()
    assert (uid, gid) == ("65532", "65532")
    assert where.startswith(f"{images.OPERATOR_PREFIX}/lib/"), "memops from the image's environment"


def test_pause_waits_until_sigterm(containerd: Containerd, imported: dict[str, images.ImageArchive]) -> None:
    started = containerd.ctr("run", "--detach", imported["pause"].ref, "pause")
    assert started.returncode == 0, started.stderr
    try:
        status = containerd.ctr("tasks", "list")
        assert "RUNNING" in next(line for line in status.stdout.splitlines() if line.startswith("pause")), status.stdout
        assert containerd.ctr("tasks", "kill", "--signal", "SIGTERM", "pause").returncode == 0
        deadline = time.monotonic() + 10
        while "RUNNING" in containerd.ctr("tasks", "list").stdout:
            assert time.monotonic() < deadline, "pause ignored SIGTERM"
            time.sleep(0.05)
    finally:
        containerd.ctr("tasks", "delete", "--force", "pause")
        containerd.ctr("containers", "delete", "pause")


def test_archives_for_other_inputs_stay_while_another_environment_may_use_them(tmp_path: Path) -> None:
    """Two checkouts (two environments, two keys) share one cache: neither removes the other's
    archive, only one unused for a week."""
    keep, recent, old = (tmp_path / f"dask-{key}.tar" for key in ("a", "b", "c"))
    for path in (keep, recent, old):
        path.write_bytes(b"")
    week_ago = time.time() - images.PRUNE_AFTER - 60
    os.utime(old, (week_ago, week_ago))
    (tmp_path / "operator-d.tar").write_bytes(b"")
    os.utime(tmp_path / "operator-d.tar", (week_ago, week_ago))
    assert images.prune("dask", keep=keep) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dask-a.tar", "dask-b.tar", "operator-d.tar"]
