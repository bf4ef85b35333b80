"""Every example in deploy/examples is valid against the generated CRD and the spec models."""

from pathlib import Path

import pytest
import yaml

from memops import crds, specs
from memops.cluster import schemas

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))
KINDS = {kind.kind: kind for kind in specs.KINDS}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        kind = KINDS[document["kind"]]
        schema = crds.crd_for(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert list(schemas.unknown_fields({k: v for k, v in document.items() if k != "metadata"}, schema)) == []
        schemas.validate(document, schema, kind=kind.kind, group=specs.GROUP)
        kind.spec.model_validate(document["spec"])


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "retirementrequest.yaml",
        "memorypolicy.yaml",
        "memorypolicy-sharedspill-memory.yaml",
        "memorypolicy-sharedspill-node.yaml",
    }
