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
            f"crds/{path.name} drifted from memops/specs/: run `memops crds`"
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


def _spec_schema(kind: specs.ResourceKind) -> dict[str, Any]:
    schema: dict[str, Any] = crds.crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


@pytest.mark.parametrize("kind", specs.KINDS, ids=lambda k: k.kind)
def test_every_name_in_an_api_path_is_a_dns_subdomain(kind: specs.ResourceKind) -> None:
    spec = _spec_schema(kind)["properties"]["spec"]["properties"]
    names = [spec["workload"]["properties"]["name"], spec["scheduler"]["properties"]["tls"]["properties"]["secretName"]]
    if "workers" in spec:
        names.append(spec["workers"]["items"])
    for name in names:
        assert name["pattern"] == specs.DNS_SUBDOMAIN_PATTERN
        assert name["maxLength"] == 253


def test_workers_are_a_bounded_set() -> None:
    workers = _spec_schema(specs.RETIREMENT_REQUEST)["properties"]["spec"]["properties"]["workers"]
    assert workers["x-kubernetes-list-type"] == "set"
    assert workers["maxItems"] == specs.MAX_WORKERS == 1000


@pytest.mark.parametrize(
    ("kind", "path", "maximum"),
    [
        pytest.param(specs.RETIREMENT_REQUEST, ("timeout",), "168h", id="timeout"),
        pytest.param(specs.MEMORY_POLICY, ("drain", "timeout"), "168h", id="drain"),
        pytest.param(specs.MEMORY_POLICY, ("recycle", "unmanagedMemory", "for"), "168h", id="for"),
        pytest.param(specs.MEMORY_POLICY, ("recycle", "growth", "window"), "168h", id="window"),
        pytest.param(specs.MEMORY_POLICY, ("recycle", "maxAge"), "8760h", id="max-age"),
    ],
)
def test_durations_have_a_maximum_in_the_schema(kind: specs.ResourceKind, path: tuple[str, ...], maximum: str) -> None:
    node = _spec_schema(kind)["properties"]["spec"]
    for part in path:
        node = node["properties"][part]
    assert node["maxLength"] == specs.DURATION_MAX_LENGTH
    assert node["x-kubernetes-validations"] == [
        {"rule": f"duration(self) <= duration('{maximum}')", "message": f"must be at most {maximum}"}
    ]


def test_a_policy_name_fits_in_a_label_value() -> None:
    rules = _spec_schema(specs.MEMORY_POLICY)["x-kubernetes-validations"]
    assert rules[0]["rule"] == "self.metadata.name.size() <= 63"


def test_a_map_keeps_the_schema_of_its_values() -> None:
    """A ``dict[str, str]`` (a node selector, matchLabels) is a map to the API server only with
    ``additionalProperties``: without it every key is unknown, dropped or (strict) refused."""
    schema = crds.crd_for(specs.MEMORY_POLICY)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    pods = schema["properties"]["spec"]["properties"]["replication"]["properties"]["rules"]["items"]["properties"]
    selectors = pods["pods"]["properties"]
    assert selectors["nodeSelector"]["additionalProperties"] == {"type": "string"}
    assert selectors["labelSelector"]["properties"]["matchLabels"]["additionalProperties"] == {"type": "string"}
