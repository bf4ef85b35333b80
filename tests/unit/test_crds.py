"""The CRDs are generated from the spec models, and crds/ must be exactly what they generate."""

from pathlib import Path
from typing import Any

import pytest

from memops import crds, specs

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crds_match_the_models(tmp_path: Path) -> None:
    written = crds.write_crds(tmp_path)
    assert written, "no CRD generated"
    for path in written:
        committed = ROOT / "crds" / path.name
        assert committed.exists(), f"crds/{path.name} is missing: run `memops crds`"
        assert committed.read_text() == path.read_text(), (
            f"crds/{path.name} drifted from memops/specs.py: run `memops crds`"
        )
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(p.name for p in written)


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found.extend(_walk(value, f"{path}/{key}"))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_walk(value, f"{path}/{index}"))
    return found


@pytest.mark.parametrize("kind", specs.KINDS, ids=lambda k: k.kind)
def test_schemas_are_structural(kind: specs.ResourceKind) -> None:
    schema = crds.crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _walk(schema):
        assert "$ref" not in node, path
        assert "anyOf" not in node, path
        assert "title" not in node, path
        assert node.get("additionalProperties") is not False, path
    for name, prop in schema["properties"]["spec"]["properties"].items():
        assert "type" in prop, f"spec.{name} has no type"
        assert prop.get("description"), f"spec.{name} has no description for kubectl explain"


def test_retirement_request_validation_is_in_the_schema() -> None:
    crd = crds.crd_for(specs.RETIREMENT_REQUEST)
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["count"]["minimum"] == 1
    assert spec["properties"]["onTimeout"]["enum"] == ["Abort", "Force"]
    assert spec["properties"]["timeout"]["pattern"] == specs.DURATION_PATTERN
    assert spec["oneOf"] == [{"required": ["count"]}, {"required": ["workers"]}]
    assert crd["spec"]["names"]["shortNames"] == ["retire"]
    assert version["subresources"] == {"status": {}}
    assert ".status.phase" in [c["jsonPath"] for c in version["additionalPrinterColumns"]]


def test_memory_policy_has_scale_subresource() -> None:
    crd = crds.crd_for(specs.MEMORY_POLICY)
    assert crd["spec"]["names"]["shortNames"] == ["mempol"]
    assert crd["spec"]["versions"][0]["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
