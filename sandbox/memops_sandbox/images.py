"""Container images for the sandbox's real nodes, made without a registry or a container engine.

Each image is an OCI image layout in a tar file (``oci-layout``, ``index.json``, ``blobs/sha256/``:
one manifest, one config, gzip'd tar layers), written with :mod:`tarfile` and :mod:`hashlib`, and
imported into each node's containerd with ``ctr images import``. Nothing is pulled from anywhere
at run time; PyPI is read (through pip and its cache) only while an image is built.

- ``pause`` (:data:`PAUSE_REF`): the static pause program of :mod:`memops_sandbox.build`, alone.
- ``dask`` (:func:`dask_ref`): Python, and exactly this environment's versions of dask,
  distributed, numpy, pandas, cloudpickle, msgpack (and of what they require), in a virtual
  environment at ``/opt/dask`` whose ``bin/`` (``dask``, ``python``) is first on PATH.
- ``operator`` (:data:`OPERATOR_REF`): the memops wheel built from this checkout and its
  dependencies at this environment's versions, in ``/opt/memops``, with the user, entry point,
  command and environment of ``operator/Dockerfile``'s runtime stage, read from that file. Its
  root filesystem may be mounted read-only.

Python is "distroless": this machine's interpreter installation (``sys.base_prefix``, without its
site-packages, tests and build files) at the same path, the shared libraries that ``ldd`` lists
for the interpreter and every extension module shipped, and ``/etc/passwd``, ``/etc/group``,
``/etc/nsswitch.conf``, CA certificates and a ``/tmp``. The Dask and operator images share that
base layer. Debian's own root filesystem (debootstrap) would take minutes and a hundred more
megabytes for nothing Python uses.

Archives are cached in ``$XDG_CACHE_HOME/memops/images/<name>-<key>.tar``, the key a hash of
everything that decides their content (Python's version and path, the pinned distributions, the
pause program's version, the operator's sources and Dockerfile), built under a lock into a
temporary file and renamed, so that an archive that exists is complete.

API (what the sandbox calls)::

    archives = images.ensure()                  # {"pause": ImageArchive, "dask": ..., "operator": ...}
    images.import_into(ctr, socket, archives["dask"])   # into the "k8s.io" namespace
    archives["pause"].ref                       # "localhost/memops/pause:1": the sandbox image

``ensure(names=...)`` builds only some; :func:`dask_ref` is the Dask image's ref
(``localhost/memops/dask:<distributed version>``). Pods use ``imagePullPolicy: IfNotPresent`` or
``Never``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

import packaging.requirements

from memops_sandbox import build

PAUSE_REF = "localhost/memops/pause:1"
OPERATOR_REF = "localhost/memops/operator:dev"
DASK_REPOSITORY = "localhost/memops/dask"
NAMESPACE = "k8s.io"
"""The containerd namespace that the kubelet's CRI plugin reads."""
NAMES = ("pause", "dask", "operator")
FORMAT = "2"
"""Bumped when the way images are written changes: part of every cache key."""
PRUNE_AFTER = 7 * 24 * 3600
"""Seconds after its last use that an archive for other inputs is removed."""

DASK_DISTRIBUTIONS = ("dask", "distributed", "numpy", "pandas", "cloudpickle", "msgpack")
FALLBACK_PINS = {"numpy": "2.4.6", "pandas": "3.1.1"}
"""Versions for a distribution of :data:`DASK_DISTRIBUTIONS` that this environment lacks (memops
and the sandbox need neither numpy nor pandas; the test extras have both, so that a client of the
tests or the README has the image's versions): the newest that PyPI serves for Python 3.11."""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The base images' PATH, as in Debian's images (the ``$PATH`` that the Dockerfile extends)."""
BASE_ENV = {"PATH": PATH, "LANG": "C.UTF-8"}
DOCKERFILE = Path(__file__).resolve().parents[2] / "operator" / "Dockerfile"
OPERATOR_PREFIX = "/opt/memops"
DASK_PREFIX = "/opt/dask"
PAUSE_USER = "65535:65535"

_STDLIB_EXCLUDED = {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "site-packages", "venv"}
_DYNLOAD_EXCLUDED = re.compile(r"^(_tkinter|_test|_xxtest|xxlimited|_ctypes_test).*\.so$")


class ImageError(RuntimeError):
    """An image could not be built or imported."""


@dataclasses.dataclass(frozen=True)
class ImageArchive:
    """An OCI image layout tar: ``ctr images import`` makes ``ref`` of it."""

    name: str
    ref: str
    path: Path


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI image config that a container runs with."""

    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = tuple(BASE_ENV.items())
    working_dir: str = "/"

    def to_json(self) -> dict[str, Any]:
        config: dict[str, Any] = {"Env": [f"{key}={value}" for key, value in self.env], "WorkingDir": self.working_dir}
        if self.user:
            config["User"] = self.user
        if self.entrypoint:
            config["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            config["Cmd"] = list(self.cmd)
        return config


# --- operator/Dockerfile, read -------------------------------------------------------------


def _logical_lines(text: str) -> list[str]:
    """Dockerfile instructions, continuation lines joined and comments dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        if not current and raw.lstrip().startswith("#"):
            continue
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def _expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: env.get(m.group(1), ""), value)


def dockerfile_config(text: str, base_env: dict[str, str] | None = None) -> ImageConfig:
    """The runtime (last) stage's USER, ENTRYPOINT, CMD, ENV and WORKDIR, as the image config
    that ``docker build`` would write (``$VAR`` in ENV expanded from the base's environment)."""
    env = dict(BASE_ENV if base_env is None else base_env)
    stage = [line for line in _logical_lines(text)]
    starts = [i for i, line in enumerate(stage) if line.upper().startswith("FROM ")]
    if not starts:
        raise ImageError("the Dockerfile has no FROM")
    user, workdir = "", "/"
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    for line in stage[starts[-1] + 1 :]:
        instruction, _, argument = line.partition(" ")
        instruction, argument = instruction.upper(), argument.strip()
        if instruction == "USER":
            user = argument
        elif instruction == "WORKDIR":
            workdir = argument
        elif instruction in ("ENTRYPOINT", "CMD"):
            try:
                form = tuple(json.loads(argument))
            except json.JSONDecodeError:
                form = ("/bin/sh", "-c", argument)  # the shell form
            if instruction == "ENTRYPOINT":
                entrypoint, cmd = form, ()  # an ENTRYPOINT resets the CMD inherited
            else:
                cmd = form
        elif instruction == "ENV":
            for word in shlex.split(argument):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ImageError(f"ENV {argument!r}: only the KEY=VALUE form is read")
                env[key] = _expand(value, env)
    return ImageConfig(user=user, entrypoint=entrypoint, cmd=cmd, env=tuple(env.items()), working_dir=workdir)


# --- OCI layout ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
    """A gzip'd tar layer in a file: its digest (of the gzip) and diff id (of the tar)."""

    path: Path
    digest: str
    diff_id: str
    size: int


class _HashingWriter(io.RawIOBase):
    """A file object that hashes what goes through it to another."""

    def __init__(self, target: Any):
        self.target = target
        self.hash = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hash.update(data)
        self.size += len(data)
        self.target.write(data)
        return len(data)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One file of a layer: a directory, a regular file (copied from ``source``), a symlink, or
    bytes given inline."""

    path: str
    kind: str  # "dir" | "file" | "symlink" | "data"
    mode: int = 0o755
    source: Path | None = None
    target: str = ""
    data: bytes = b""


def write_layer(entries: Iterable[Entry], path: Path) -> Layer:
    """A gzip'd tar of ``entries`` (parents first), owned by root, at ``path``."""
    with path.open("wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(fileobj=compressed, mode="wb", compresslevel=1, mtime=0) as gz:
            uncompressed = _HashingWriter(gz)
            with tarfile.open(fileobj=uncompressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for entry in entries:
                    _add(tar, entry)
    return Layer(
        path, f"sha256:{compressed.hash.hexdigest()}", f"sha256:{uncompressed.hash.hexdigest()}", compressed.size
    )


def _add(tar: tarfile.TarFile, entry: Entry) -> None:
    info = tarfile.TarInfo(entry.path.lstrip("/"))
    info.mode = entry.mode
    info.uid = info.gid = 0
    if entry.kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif entry.kind == "symlink":
        info.type, info.linkname = tarfile.SYMTYPE, entry.target
        tar.addfile(info)
    elif entry.kind == "data":
        info.size = len(entry.data)
        tar.addfile(info, io.BytesIO(entry.data))
    else:
        assert entry.source is not None
        status = entry.source.stat()
        # The file's own mtime: a .pyc is valid only beside a source of the mtime it records.
        info.size, info.mtime = status.st_size, int(status.st_mtime)
        with entry.source.open("rb") as handle:
            tar.addfile(info, handle)


def _blob(directory: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (directory / digest).write_bytes(data)
    return f"sha256:{digest}", len(data)


def write_archive(ref: str, config: ImageConfig, layers: list[Layer], path: Path) -> None:
    """An OCI image layout tar of one linux/amd64 image named ``ref``, at ``path``."""
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        blobs = Path(scratch)
        image_config = {
            "architecture": "amd64",
            "os": "linux",
            "config": config.to_json(),
            "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
            "history": [{"created_by": "memops-sandbox images", "comment": layer.path.name} for layer in layers],
        }
        config_digest, config_size = _blob(blobs, json.dumps(image_config, sort_keys=True).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer.digest, "size": layer.size}
                for layer in layers
            ],
        }
        manifest_digest, manifest_size = _blob(blobs, json.dumps(manifest, sort_keys=True).encode())
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": ref,
                        "org.opencontainers.image.ref.name": ref.rpartition(":")[2],
                    },
                }
            ],
        }
        with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in (
                ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
                ("index.json", json.dumps(index, sort_keys=True).encode()),
            ):
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            for directory in ("blobs", "blobs/sha256"):
                info = tarfile.TarInfo(directory)
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            for blob in sorted(blobs.iterdir()):
                tar.add(blob, f"blobs/sha256/{blob.name}", filter=_root_owned)
            for layer in layers:
                tar.add(layer.path, f"blobs/sha256/{layer.digest.removeprefix('sha256:')}", filter=_root_owned)


def _root_owned(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644
    return info


# --- root filesystems ----------------------------------------------------------------------

PASSWD = (
    "root:x:0:0:root:/root:/usr/sbin/nologin\n"
    "memops:x:65532:65532:memops:/nonexistent:/usr/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = "root:x:0:\nmemops:x:65532:\nnogroup:x:65534:\n"
NSSWITCH = "passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\n"
CA_CERTIFICATES = Path("/etc/ssl/certs/ca-certificates.crt")


def _parents(path: str, seen: set[str]) -> list[Entry]:
    """Directory entries for the parents of ``path`` not yet in ``seen`` (readable by all, so that
    a non-root user reaches a Python under /root)."""
    entries = []
    parts = Path(path).parts[1:-1]
    for i in range(len(parts)):
        directory = "/" + "/".join(parts[: i + 1])
        if directory not in seen:
            seen.add(directory)
            entries.append(Entry(directory, "dir", 0o1777 if directory == "/tmp" else 0o755))
    return entries


def _tree(root: Path, seen: set[str], *, skip: Any = None) -> Iterator[Entry]:
    """Every directory, file and symlink under ``root``, at the same absolute path."""
    yield from _parents(str(root / "x"), seen)
    for directory, dirnames, filenames in os.walk(root):
        here = Path(directory)
        dirnames[:] = sorted(d for d in dirnames if not (skip and skip(here / d)))
        for name in dirnames:
            path = here / name
            if path.is_symlink():
                yield Entry(str(path), "symlink", target=os.readlink(path))
            else:
                seen.add(str(path))
                yield Entry(str(path), "dir", 0o755)
        for name in sorted(filenames):
            path = here / name
            if skip and skip(path):
                continue
            if path.is_symlink():
                yield Entry(str(path), "symlink", target=os.readlink(path))
            else:
                mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
                yield Entry(str(path), "file", mode, source=path)


def _skip_in_prefix(prefix: Path) -> Any:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"

    def skip(path: Path) -> bool:
        if path.parent == stdlib and (path.name in _STDLIB_EXCLUDED or path.name.startswith("config-")):
            return True
        if path.parent.name == "lib-dynload" and _DYNLOAD_EXCLUDED.match(path.name):
            return True
        if path.parent == prefix:
            return path.name not in ("bin", "lib")
        if path.parent == prefix / "bin":
            return not (path.name == version or path.name in ("python3", "python"))
        if path.parent == prefix / "lib":
            return path.name not in (version,) and not path.name.startswith("libpython")
        # Optimized bytecode is never used (no -O); the plain .pyc is.
        return path.suffix == ".pyc" and ".opt-" in path.name

    return skip


def shared_libraries(files: Iterable[Path]) -> set[Path]:
    """The shared libraries that ``files`` (ELF executables and extension modules) load, as
    ``ldd`` resolves them here, with the dynamic loader, except those under ``prefix``."""
    found: set[Path] = set()
    batch = [str(path) for path in files]
    for start in range(0, len(batch), 200):
        chunk = batch[start : start + 200]
        result = subprocess.run(["ldd", *chunk], capture_output=True, text=True, timeout=120, check=False)
        for line in result.stdout.splitlines():
            line = line.strip()
            if "not found" in line:
                raise ImageError(f"a library of the image is missing on this machine: {line}")
            match = re.match(r"^(?:\S+ => )?(/\S+) \(0x", line)
            if match:
                found.add(Path(match.group(1)))
    return found


def _elf_files(roots: Iterable[Path]) -> list[Path]:
    files = []
    for root in roots:
        for path in root.rglob("*.so*") if root.is_dir() else [root]:
            if path.is_file() and not path.is_symlink():
                with path.open("rb") as handle:
                    if handle.read(4) == b"\x7fELF":
                        files.append(path)
    return files


def _system_entries(libraries: set[Path], seen: set[str]) -> list[Entry]:
    """The libraries at the paths ``ldd`` named (their content, symlinks resolved), /etc, /tmp."""
    entries: list[Entry] = []
    for directory in ("/etc", "/etc/ssl", "/etc/ssl/certs", "/tmp", "/root", "/home"):
        entries.extend(_parents(directory + "/x", seen))
    for name, text in (
        ("passwd", PASSWD),
        ("group", GROUP),
        ("nsswitch.conf", NSSWITCH),
        ("hosts", "127.0.0.1 localhost\n::1 localhost\n"),
        ("resolv.conf", ""),
        ("hostname", ""),
    ):
        entries.append(Entry(f"/etc/{name}", "data", 0o644, data=text.encode()))
    if CA_CERTIFICATES.is_file():
        entries.append(Entry(str(CA_CERTIFICATES), "file", 0o644, source=CA_CERTIFICATES.resolve()))
    for library in sorted(libraries):
        entries.extend(_parents(str(library), seen))
        entries.append(Entry(str(library), "file", 0o755, source=library.resolve()))
    return entries


def python_base_entries(extra_elf_roots: Iterable[Path]) -> list[Entry]:
    """The base layer: this interpreter's installation (without site-packages), the shared
    libraries it and the extension modules under ``extra_elf_roots`` load, /etc and /tmp."""
    prefix = Path(sys.base_prefix)
    seen: set[str] = set()
    skip = _skip_in_prefix(prefix)
    python_entries = list(_tree(prefix, seen, skip=skip))
    own = [e.source for e in python_entries if e.kind == "file" and e.source is not None]
    elves = _elf_files([p for p in own if p.suffix == ".so" or ".so." in p.name or p.parent.name == "bin"])
    libraries = {
        lib for lib in shared_libraries([*elves, *_elf_files(extra_elf_roots)]) if not lib.is_relative_to(prefix)
    }
    # Libraries a wheel brings (numpy.libs, ...) are in the application layer already.
    libraries = {lib for lib in libraries if "site-packages" not in lib.parts}
    return [*_system_entries(libraries, seen), *python_entries]


# --- Python environments -------------------------------------------------------------------


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment_pins(exclude: Iterable[str] = ()) -> dict[str, str]:
    """``{distribution: version}`` of this environment, except ``exclude`` and editable installs
    (which PyPI does not have)."""
    excluded = {_canonical(name) for name in exclude}
    pins: dict[str, str] = {}
    for distribution in importlib.metadata.distributions():
        name = _canonical(distribution.metadata["Name"] or "")
        if not name or name in excluded:
            continue
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            continue
        pins.setdefault(name, distribution.version)
    return pins


def dask_pins() -> dict[str, str]:
    """The Dask image's distributions, at this environment's versions (or :data:`FALLBACK_PINS`)."""
    pins = {}
    for name in DASK_DISTRIBUTIONS:
        try:
            pins[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pins[name] = FALLBACK_PINS[name]
    return pins


def dask_ref() -> str:
    return f"{DASK_REPOSITORY}:{dask_pins()['distributed']}"


def pip_install(target: Path, requirements: list[str], constraints: dict[str, str], stream: TextIO) -> None:
    """``pip install --target`` of ``requirements`` (names pinned, or wheel paths), every other
    distribution constrained to ``constraints``' versions: binary wheels only, no tests run."""
    target.mkdir(parents=True, exist_ok=True)
    constraint_file = target.parent / "constraints.txt"
    constraint_file.write_text("".join(f"{name}=={version}\n" for name, version in sorted(constraints.items())))
    argv = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(target), "--only-binary", ":all:", "--constraint", str(constraint_file), *requirements,
    ]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if result.returncode != 0:
        raise ImageError(f"pip install into the image failed:\n{result.stdout}{result.stderr}")
    print(f"memops-sandbox: installed {', '.join(requirements)} into an image", file=stream)


def console_scripts(site_packages: Path, python: str) -> dict[str, bytes]:
    """``{name: script}`` for each console script of the distributions in ``site_packages``,
    run by ``python`` (pip --target writes its own with this machine's interpreter)."""
    scripts = {}
    for distribution in importlib.metadata.distributions(path=[str(site_packages)]):
        for entry in distribution.entry_points.select(group="console_scripts"):
            module, _, attribute = entry.value.partition(":")
            head = attribute.split(".")[0]
            # The __main__ guard as pip writes it: multiprocessing's spawn (the nanny's worker
            # processes) imports this file again in each child.
            body = (
                f"#!{python}\nimport sys\nfrom {module} import {head}\n\n"
                f"if __name__ == '__main__':\n    sys.exit({attribute}())\n"
            )
            scripts[entry.name] = body.encode()
    return scripts


def venv_entries(prefix: str, site_packages: Path, seen: set[str]) -> list[Entry]:
    """A virtual environment at ``prefix`` in the image: this interpreter by symlink, pyvenv.cfg,
    ``site_packages`` (pip's ``bin/`` left out) and console scripts run by ``prefix/bin/python``."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    base = Path(sys.base_prefix)
    entries = _parents(f"{prefix}/bin/x", seen)
    for directory in (f"{prefix}/bin", f"{prefix}/lib", f"{prefix}/lib/{version}"):
        if directory not in seen:
            seen.add(directory)
            entries.append(Entry(directory, "dir"))
    cfg = f"home = {base / 'bin'}\ninclude-system-site-packages = false\nversion = {sysconfig.get_python_version()}\n"
    entries.append(Entry(f"{prefix}/pyvenv.cfg", "data", 0o644, data=cfg.encode()))
    entries.append(Entry(f"{prefix}/bin/python", "symlink", target=str(base / "bin" / version)))
    entries.append(Entry(f"{prefix}/bin/python3", "symlink", target="python"))
    for name, script in sorted(console_scripts(site_packages, f"{prefix}/bin/python").items()):
        entries.append(Entry(f"{prefix}/bin/{name}", "data", 0o755, data=script))
    image_site = f"{prefix}/lib/{version}/site-packages"
    entries.append(Entry(image_site, "dir"))
    for entry in _tree(site_packages, set(), skip=lambda p: p.parent == site_packages and p.name == "bin"):
        if not Path(entry.path).is_relative_to(site_packages) or entry.path == str(site_packages):
            continue  # the build directory's own parents
        relative = Path(entry.path).relative_to(site_packages)
        entries.append(dataclasses.replace(entry, path=f"{image_site}/{relative}"))
    return entries


def _strip(site_packages: Path) -> None:
    """What no container of the sandbox runs: tests shipped inside packages, optimized bytecode."""
    for tests in [*site_packages.glob("*/tests"), *site_packages.glob("*/*/tests")]:
        if tests.is_dir() and tests.parent.name in ("numpy", "pandas", "_core", "core", "lib"):
            shutil.rmtree(tests)
    for pyc in site_packages.rglob("*.opt-*.pyc"):
        pyc.unlink()


# --- repository sources (the operator) -----------------------------------------------------


def has_checkout() -> bool:
    """Whether the sandbox runs from a memops checkout (the operator image's sources)."""
    return (DOCKERFILE.parents[1] / "pyproject.toml").is_file() and DOCKERFILE.is_file()


def repository_root() -> Path:
    """The checkout this sandbox was installed from: the operator image is built from it."""
    root = DOCKERFILE.parents[1]
    if not (root / "pyproject.toml").is_file() or not DOCKERFILE.is_file():
        raise ImageError(f"the operator image is built from a memops checkout; none at {root}")
    return root


def operator_sources(root: Path) -> list[Path]:
    """What the Dockerfile's build stage copies from the repository (its COPY lines), as files."""
    build_stage = DOCKERFILE.read_text().split("\nFROM ")[1]
    files: list[Path] = []
    for line in re.findall(r"^COPY (?!--)(.+)$", build_stage, flags=re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            origin = root / source
            if origin.is_dir():
                files.extend(p for p in origin.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
            else:
                files.append(origin)
    return sorted(files)


def build_wheel(root: Path, output: Path) -> Path:
    """The memops wheel, as the Dockerfile's build stage makes it (``pip wheel --no-deps``), from
    a copy of exactly the files the Dockerfile copies."""
    context = output / "src"
    for path in operator_sources(root):
        destination = context / path.relative_to(root)
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, destination)
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(output), str(context)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        raise ImageError(f"pip wheel of memops failed:\n{result.stdout}{result.stderr}")
    (wheel,) = output.glob("memops-*.whl")
    return wheel


# --- cache keys ----------------------------------------------------------------------------


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def python_identity() -> dict[str, str]:
    return {"prefix": sys.base_prefix, "version": sys.version, "libc": os.confstr("CS_GNU_LIBC_VERSION") or ""}


def cache_key(name: str, inputs: dict[str, Any]) -> str:
    """The hash that names an archive of ``name``: everything that decides its content."""
    return _digest({"format": FORMAT, "name": name, **inputs})


def image_inputs(name: str) -> dict[str, Any]:
    """What decides the content of image ``name`` (read cheaply: no build)."""
    if name == "pause":
        return {"pause": build.pause().version, "ref": PAUSE_REF}
    if name == "dask":
        return {"python": python_identity(), "pins": dask_pins(), "constraints": _dask_constraints(), "ref": dask_ref()}
    if name == "operator":
        root = repository_root()
        sources = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in operator_sources(root)}
        return {
            "python": python_identity(),
            "sources": sources,
            "dockerfile": DOCKERFILE.read_text(),
            "constraints": _operator_constraints(),
            "ref": OPERATOR_REF,
        }
    raise ImageError(f"no image called {name!r}: {', '.join(NAMES)}")


def requirement_closure(names: Iterable[str]) -> set[str]:
    """``names`` and every distribution they require, transitively, as installed here (extras
    off): what pip may install for them, so the only versions that decide their image."""
    seen: set[str] = set()
    todo = [_canonical(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            lines = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in lines:
            requirement = packaging.requirements.Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(_canonical(requirement.name))
    return seen


def _constraints(names: Iterable[str]) -> dict[str, str]:
    # Only the closure: another environment that differs elsewhere (a test tool, a linter) makes
    # the same image, under the same key.
    closure = requirement_closure(names)
    pins = environment_pins(exclude=("memops", "memops-sandbox", "pip", "setuptools", "wheel"))
    return {name: version for name, version in pins.items() if name in closure}


def _dask_constraints() -> dict[str, str]:
    return {**_constraints(DASK_DISTRIBUTIONS), **dask_pins()}


def _operator_constraints() -> dict[str, str]:
    return _constraints(["memops"])


def archive_path(name: str, key: str) -> Path:
    return build.memops_cache() / "images" / f"{name}-{key}.tar"


# --- building ------------------------------------------------------------------------------


def _build_pause(directory: Path, output: Path, stream: TextIO) -> None:
    program = build.ensure_component(build.pause(), stream=stream)["pause"]
    layer = write_layer(
        [Entry("/pause", "file", 0o755, source=program), Entry("/tmp", "dir", 0o1777)], directory / "pause.tar.gz"
    )
    config = ImageConfig(user=PAUSE_USER, entrypoint=("/pause",), env=(("PATH", PATH),))
    write_archive(PAUSE_REF, config, [layer], output)


def _python_image(
    ref: str, prefix: str, requirements: list[str], constraints: dict[str, str], config: ImageConfig,
    directory: Path, output: Path, stream: TextIO,
) -> None:  # fmt: skip
    site_packages = directory / "site-packages"
    pip_install(site_packages, requirements, constraints, stream)
    _strip(site_packages)
    base = write_layer(python_base_entries([site_packages]), directory / "python.tar.gz")
    application = write_layer(venv_entries(prefix, site_packages, set()), directory / "application.tar.gz")
    write_archive(ref, config, [base, application], output)


def _build_dask(directory: Path, output: Path, stream: TextIO) -> None:
    pins = dask_pins()
    env = {**BASE_ENV, "PATH": f"{DASK_PREFIX}/bin:{PATH}", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}
    config = ImageConfig(cmd=("dask", "--help"), env=tuple(env.items()))
    requirements = [f"{name}=={version}" for name, version in pins.items()]
    _python_image(dask_ref(), DASK_PREFIX, requirements, _dask_constraints(), config, directory, output, stream)


def _build_operator(directory: Path, output: Path, stream: TextIO) -> None:
    wheel = build_wheel(repository_root(), directory / "wheel")
    config = dockerfile_config(DOCKERFILE.read_text())
    _python_image(
        OPERATOR_REF, OPERATOR_PREFIX, [str(wheel)], _operator_constraints(), config, directory, output, stream
    )


_BUILDERS = {"pause": _build_pause, "dask": _build_dask, "operator": _build_operator}


def ref_of(name: str) -> str:
    return {"pause": PAUSE_REF, "operator": OPERATOR_REF}.get(name) or dask_ref()


def ensure_image(name: str, *, stream: TextIO = sys.stderr) -> ImageArchive:
    """The archive of image ``name``, built first if the cache has none for its inputs."""
    key = cache_key(name, image_inputs(name))
    archive = ImageArchive(name=name, ref=ref_of(name), path=archive_path(name, key))
    if archive.path.is_file():
        archive.path.touch()  # in use: see prune()
        return archive
    archive.path.parent.mkdir(parents=True, exist_ok=True)
    # One lock per image name: under it, a staging directory of that name is a killed build's.
    with build._locked(archive.path.parent / f"{name}.lock", stream):
        if archive.path.is_file():
            return archive
        for stale in archive.path.parent.glob(f".{name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        print(f"memops-sandbox: building the {name} image ({archive.ref})", file=stream, flush=True)
        with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=archive.path.parent) as scratch:
            staging = Path(scratch) / "image.tar"
            _BUILDERS[name](Path(scratch), staging, stream)
            staging.rename(archive.path)
        prune(name, keep=archive.path)
        size = archive.path.stat().st_size / 2**20
        print(
            f"memops-sandbox: the {name} image built in {time.monotonic() - started:.0f} s ({size:.0f} MiB)",
            file=stream,
        )
    return archive


def prune(name: str, *, keep: Path, now: float | None = None) -> list[Path]:
    """Remove archives of ``name`` for other inputs not used for :data:`PRUNE_AFTER` seconds.
    Not at once: two environments (two checkouts, two virtual environments) may share the cache
    and each use its own."""
    now = time.time() if now is None else now
    removed = []
    for stale in keep.parent.glob(f"{name}-*.tar"):
        if stale != keep and now - stale.stat().st_mtime > PRUNE_AFTER:
            stale.unlink(missing_ok=True)
            removed.append(stale)
    return removed


def ensure(names: Iterable[str] = NAMES, *, stream: TextIO = sys.stderr) -> dict[str, ImageArchive]:
    """``{name: archive}`` of the images ``names`` (all by default), each built first if needed."""
    return {name: ensure_image(name, stream=stream) for name in names}


def import_into(ctr: Path | str, socket: Path | str, archive: ImageArchive, *, namespace: str = NAMESPACE) -> None:
    """Import ``archive`` into the containerd at ``socket`` (unpacked for its default
    snapshotter), in ``namespace``: the kubelet's CRI plugin then finds ``archive.ref``."""
    argv = [str(ctr), "--address", str(socket), "--namespace", namespace, "images", "import", "--all-platforms"]
    result = subprocess.run([*argv, str(archive.path)], capture_output=True, text=True, timeout=300, check=False)
    if result.returncode != 0:
        raise ImageError(f"ctr images import {archive.path} failed: {result.stderr.strip() or result.stdout.strip()}")
