"""Kopf's own bookkeeping on memops' objects stays small, whatever users put in them."""

from __future__ import annotations

import json
from typing import Any

import kopf
from kopf._cogs.structs import diffs

from memops import controllers

KEY = "memops.dev/last-handled-configuration"


def _stored(body: dict[str, Any]) -> tuple[str, Any]:
    """The annotation Kopf writes after handling ``body``, and what it reads back from it."""
    settings = kopf.OperatorSettings()
    controllers.configure(settings)
    storage = settings.persistence.diffbase_storage
    essence = storage.build(body=kopf.Body(body))
    patch = kopf.Patch()
    storage.store(body=kopf.Body(body), patch=patch, essence=essence)
    written = patch["metadata"]["annotations"][KEY]
    annotated = {**body, "metadata": {**body["metadata"], "annotations": {KEY: written}}}
    return written, storage.fetch(body=kopf.Body(annotated))


def _request(spec: dict[str, Any], **annotations: str) -> dict[str, Any]:
    return {
        "apiVersion": "memops.dev/v1alpha1",
        "kind": "RetirementRequest",
        "metadata": {"name": "r", "namespace": "default", "annotations": annotations, "labels": {"team": "a"}},
        "spec": spec,
    }


SPEC = {"workload": {"kind": "Deployment", "name": "w"}, "count": 1}


def test_user_annotations_are_not_copied() -> None:
    written, fetched = _stored(_request(SPEC, note="x" * 200_000))
    assert len(written) < 200, "a 200 KB annotation must not be copied into Kopf's"
    assert fetched == {"spec": SPEC}


def test_a_large_spec_is_kept_as_its_digest_and_a_change_still_shows() -> None:
    workers = [f"{'w' * 240}-{i}" for i in range(1000)]
    written, fetched = _stored(_request({**SPEC, "count": None, "workers": workers}))
    assert len(written) < 200
    _, changed = _stored(_request({**SPEC, "count": None, "workers": workers[:-1]}))
    assert fetched != changed
    assert set(fetched["spec"]) == {"sha256"}


def test_a_spec_change_is_a_diff_on_the_spec() -> None:
    """What refuse-spec-change (``field="spec"``) is triggered by."""
    _, old = _stored(_request(SPEC))
    _, new = _stored(_request({**SPEC, "count": 2}, note="changed too"))
    assert [tuple(item) for item in diffs.diff(old, new)] == [("change", ("spec", "count"), 1, 2)]
    assert json.dumps(old).count("note") == 0
