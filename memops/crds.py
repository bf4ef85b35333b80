"""Generate the CustomResourceDefinitions from the pydantic models in :mod:`memops.specs`.

Called by ``memops crds`` (which writes ``crds/``), by the sandbox's installer (through the
chart's copies) and by the drift test.

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: no
``$ref``, no ``anyOf`` with ``null`` for optional fields, no ``title``, no
``additionalProperties: false`` (a map's ``additionalProperties`` schema stays: without it the
API server knows no key of a ``dict[str, str]`` and drops or, under strict field validation,
refuses them all), and every node typed. This module converts one into
the other and nothing more.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from memops import specs

_DROPPED_KEYS = {"title", "$defs", "example"}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    """Resolve ``$ref``s, collapse ``Optional[X]`` and drop what structural schemas refuse."""
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**copy.deepcopy(target), **{k: v for k, v in node.items() if k != "$ref"}}
        return _inline(merged, defs)
    if "anyOf" in node:
        # pydantic renders `X | None` as anyOf [X, null]; in Kubernetes an optional field is
        # simply absent from `required`, so the null branch carries no information.
        branches = [b for b in node["anyOf"] if b.get("type") != "null"]
        if len(branches) == 1:
            rest = {k: v for k, v in node.items() if k != "anyOf"}
            if rest.get("default", ...) is None:
                rest.pop("default")
            return _inline({**branches[0], **rest}, defs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "additionalProperties" and not isinstance(value, dict):
            # ``false`` (extra="forbid") is pydantic's; structural schemas refuse it. A map's value
            # schema is kept: without it the API server prunes the map's entries.
            continue
        if key == "properties":
            out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
        elif key == "default" and value is None:
            continue
        elif key == "description" and isinstance(value, str):
            out[key] = " ".join(value.split())
        else:
            out[key] = _inline(value, defs)
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "integer":
        out.setdefault("format", "int64")
    return out


def structural_schema(model: type[specs.Model]) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of one spec or status model."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    schema: dict[str, Any] = _inline(raw, defs)
    return schema


def _description(model: type[specs.Model]) -> str:
    return " ".join((model.__doc__ or "").split())


def crd_for(kind: specs.ResourceKind) -> dict[str, Any]:
    """The whole CustomResourceDefinition of one kind."""
    spec_schema = structural_schema(kind.spec)
    status_schema = structural_schema(kind.status)
    status_schema.setdefault("description", _description(kind.status))
    root: dict[str, Any] = {
        "type": "object",
        "description": kind.description,
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }
    if kind.validations:
        root["x-kubernetes-validations"] = [dict(rule) for rule in kind.validations]
    subresources: dict[str, Any] = {"status": {}}
    if kind.scale is not None:
        subresources["scale"] = dict(kind.scale)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{specs.GROUP}"},
        "spec": {
            "group": specs.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.singular,
                "shortNames": list(kind.short_names),
                "categories": ["memops", "dask"],
            },
            "versions": [
                {
                    "name": specs.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": [dict(column) for column in kind.printer_columns],
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def all_crds() -> list[dict[str, Any]]:
    return [crd_for(kind) for kind in specs.KINDS]


def render(crd: dict[str, Any]) -> str:
    header = "# Generated by `memops crds` from memops/specs/. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd, sort_keys=False, width=100)


def write_crds(directory: Path) -> list[Path]:
    """Write one file per kind into ``directory``; return the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for crd in all_crds():
        path = directory / f"{crd['metadata']['name']}.yaml"
        path.write_text(render(crd))
        written.append(path)
    return written
