"""Every example in deploy/examples is valid against the spec models; the API server's own
validation of them (the generated CRD's schema, CEL rules, unknown fields) is a server-side dry
run in tests/sandbox/test_controlplane.py."""

from pathlib import Path

import pytest
import yaml

from memops import specs

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "deploy" / "examples").glob("*.yaml"))
KINDS = {kind.kind: kind for kind in specs.KINDS}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_valid(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        kind = KINDS[document["kind"]]
        assert document["apiVersion"] == specs.API_VERSION
        kind.spec.model_validate(document["spec"])


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "retirementrequest.yaml",
        "memorypolicy.yaml",
        "memorypolicy-sharedspill-memory.yaml",
        "memorypolicy-sharedspill-node.yaml",
    }
