"""The import contracts (``[tool.importlinter]`` in pyproject.toml) cover every module of memops/.

``lint-imports`` checks only the modules that a contract names: a new module named in none is
checked by none. These tests read the contracts with tomllib and list memops' modules from the
filesystem (no import), so a module added without a place in the contracts fails here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "memops"


def memops_modules() -> list[str]:
    """Every module and package of memops/, dotted, the root package itself left out."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if len(parts) > 1:
            names.append(".".join(parts))
    return names


def contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return found


def layer_names(contract: dict[str, Any]) -> list[str]:
    """The modules that a layers contract places, dotted in full (``|`` and ``:`` separate siblings)."""
    names = [
        name.strip()
        for layer in contract["layers"]
        for group in layer.split("|")
        for name in group.split(":")
        if name.strip()
    ]
    containers = contract.get("containers") or [""]
    return [f"{container}.{name}" if container else name for container in containers for name in names]


def named_modules(contract: dict[str, Any]) -> list[str]:
    """The modules that a contract constrains: its layers, its sources, its independent modules."""
    if contract["type"] == "layers":
        return layer_names(contract)
    return list(contract.get("source_modules", [])) + list(contract.get("modules", []))


def is_within(module: str, name: str) -> bool:
    """import-linter's reading of a name in a contract: the module and every module under it."""
    return module == name or module.startswith(name + ".")


def children(package: str) -> list[str]:
    return [m for m in memops_modules() if m.rpartition(".")[0] == package]


def test_the_modules_are_found() -> None:
    modules = memops_modules()
    assert {"memops.specs", "memops.controllers", "memops.controllers.policy", "memops.scheduler.agent"} <= set(modules)
    assert "memops" not in modules


def test_every_module_is_in_a_contract() -> None:
    named = [name for contract in contracts() for name in named_modules(contract)]
    assert named, "no import contract in pyproject.toml"
    uncovered = [m for m in memops_modules() if not any(is_within(m, name) for name in named)]
    assert uncovered == [], f"in no import contract of pyproject.toml: {uncovered}"


@pytest.mark.parametrize(
    "contract",
    [pytest.param(c, id=c["name"]) for c in contracts() if c["type"] == "layers"],
)
def test_a_layers_contract_places_every_module_of_its_package(contract: dict[str, Any]) -> None:
    names = layer_names(contract)
    packages = {name.rpartition(".")[0] for name in names}
    assert len(packages) == 1, f"layers of more than one package: {sorted(packages)}"
    (package,) = packages
    missing = sorted(set(children(package)) - set(names))
    assert missing == [], f"{package}'s modules in no layer of {contract['name']!r}: {missing}"


def outside(module: str) -> set[str]:
    """Every module of memops that is neither ``module``, nor under it, nor a package above it:
    the siblings of the module and of each package that holds it."""
    parts = module.split(".")
    ancestors = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    return {m for package in ancestors - {module} for m in children(package)} - ancestors


def test_outside_a_module() -> None:
    assert "memops.clients.kube" in outside("memops.clients.daskcomm")
    assert "memops.decisions" in outside("memops.clients.daskcomm")
    assert not {"memops.clients", "memops.clients.daskcomm"} & outside("memops.clients.daskcomm")


@pytest.mark.parametrize(
    ("isolated", "allowed"),
    [
        # Sent to the scheduler by value: a stock Dask image has no memops. It installs the
        # worker plugin in the workers, which goes by value with it, as do the rules' bounds and glob.
        pytest.param("memops.scheduler", {"memops.worker", "memops.rulesyntax"}, id="scheduler"),
        # Sent by value with the scheduler's code, and from there installed in the workers.
        pytest.param("memops.worker", set(), id="worker"),
        # Sent by value with the scheduler's code; the specs import it too.
        pytest.param("memops.rulesyntax", set(), id="rulesyntax"),
        # Carried as source into the preStop hook, which runs in a stock Dask image.
        pytest.param("memops.clients.daskcomm", set(), id="daskcomm"),
    ],
)
def test_an_isolated_module_is_forbidden_every_other_module(isolated: str, allowed: set[str]) -> None:
    found = [c for c in contracts() if c["type"] == "forbidden" and c["source_modules"] == [isolated]]
    assert len(found) == 1, f"not one forbidden contract whose only source is {isolated}: {len(found)}"
    (contract,) = found
    forbidden = contract["forbidden_modules"]
    missing = sorted(m for m in outside(isolated) - allowed if not any(is_within(m, name) for name in forbidden))
    assert missing == [], f"{contract['name']!r} does not forbid {missing}"


def test_the_folders_are_the_layers() -> None:
    """memops/ holds the command, the CRD generator and its package's init; everything else is in
    a folder that the top layers contract places."""
    top = next(c for c in contracts() if c["type"] == "layers" and "memops.cli" in layer_names(c))
    flat = sorted(m for m in children("memops") if not (PACKAGE / m.rpartition(".")[2]).is_dir())
    assert flat == ["memops.cli", "memops.crds"], flat
    assert set(children("memops")) == set(layer_names(top))
