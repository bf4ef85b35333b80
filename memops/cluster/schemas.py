"""Validate custom resources against their CRD's openAPIV3Schema, as the API server does.

Used by the emulated API server for every create and update of a custom resource, so that
``kubectl apply`` of an invalid RetirementRequest is refused with 422 and a message naming
the field, in the API server's own wording. Defaults from the schema are applied first,
and fields the schema does not know are pruned (or, with ``fieldValidation=Strict``, which
kubectl sends by default, refused).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema

from memops.cluster.memstore import ApiError, Obj

_TYPE_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number"}


IMPLICIT_ROOT_FIELDS = ("apiVersion", "kind", "metadata")
"""Implicit at the root of every structural schema: the API server keeps them whether or not the
CRD declares them (dask-kubernetes' CRDs do not)."""


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Fill in ``default``s of absent properties, recursively (apiextensions defaulting)."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(value[name], sub)
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(item, schema["items"]) for item in value]
    return value


def unknown_fields(value: Any, schema: Mapping[str, Any], path: str = "") -> Iterator[str]:
    """Paths of fields that the schema does not declare (structural pruning's victims)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and "properties" in schema:
        for name, sub_value in value.items():
            sub_path = f"{path}.{name}" if path else name
            if name not in schema["properties"]:
                yield sub_path
            else:
                yield from unknown_fields(sub_value, schema["properties"][name], sub_path)
    elif isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            yield from unknown_fields(item, schema["items"], f"{path}[{index}]")


def duplicates(value: Any, schema: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, str]]:
    """(field, detail) for each repeated item of an ``x-kubernetes-list-type: set`` list.

    CEL rules (``x-kubernetes-validations``) are not evaluated here; the operator checks the
    same bounds again with pydantic.
    """
    if isinstance(value, dict) and "properties" in schema:
        for name, sub_value in value.items():
            if name in schema["properties"]:
                yield from duplicates(sub_value, schema["properties"][name], f"{path}.{name}" if path else name)
    elif isinstance(value, list) and "items" in schema:
        if schema.get("x-kubernetes-list-type") == "set":
            seen: set[str] = set()
            for index, item in enumerate(value):
                key = json.dumps(item, sort_keys=True)
                if key in seen:
                    yield f"{path}[{index}]", f"Duplicate value: {key}"
                seen.add(key)
        for index, item in enumerate(value):
            yield from duplicates(item, schema["items"], f"{path}[{index}]")


def prune(value: Any, schema: dict[str, Any]) -> Any:
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return value
    if isinstance(value, dict) and "properties" in schema:
        return {k: prune(v, schema["properties"][k]) for k, v in value.items() if k in schema["properties"]}
    if isinstance(value, list) and "items" in schema:
        return [prune(item, schema["items"]) for item in value]
    return value


def _field_path(error: jsonschema.ValidationError) -> str:
    path = ""
    for part in error.absolute_path:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _describe(error: jsonschema.ValidationError) -> tuple[str, str]:
    """(field, detail) worded as the API server words its validation errors."""
    field = _field_path(error)
    value, validator = error.instance, error.validator
    expected: Any = error.validator_value
    shown = f'"{value}"' if isinstance(value, str) else ("null" if value is None else value)
    if validator == "required":
        missing = error.message.split("'")[1]
        field = f"{field}.{missing}" if field else missing
        return field, "Required value"
    if validator == "enum":
        supported = ", ".join(f'"{v}"' for v in expected)
        return field, f"Unsupported value: {shown}: supported values: {supported}"
    if validator == "type":
        actual = _TYPE_NAMES.get(type(value), "null")
        return field, f'Invalid value: "{actual}": {field} in body must be of type {expected}: "{actual}"'
    if validator == "oneOf":
        matching = sum(1 for sub in expected if jsonschema.Draft7Validator(sub).is_valid(value))
        detail = f"Found {matching} valid alternatives" if matching else "no alternative matched"
        return field, f'Invalid value: "object": must validate one and only one schema (oneOf). {detail}'
    wording = {
        "minimum": f"should be greater than or equal to {expected}",
        "maximum": f"should be less than or equal to {expected}",
        "pattern": f"should match '{expected}'",
        "minLength": f"should be at least {expected} chars long",
        "maxLength": f"should be at most {expected} chars long",
        "minItems": f"should have at least {expected} items",
        "maxItems": f"should have at most {expected} items",
    }.get(str(validator), error.message)
    return field, f"Invalid value: {shown}: {field} in body {wording}"


def validate(obj: Obj, schema: dict[str, Any], *, kind: str, group: str, strict: bool = False) -> Obj:
    """Default, prune and check ``obj``; raise a 422 ``ApiError`` naming every bad field."""
    obj = apply_defaults(copy.deepcopy(obj), schema)
    meta = obj.get("metadata", {})
    implicit = {k: obj[k] for k in ("apiVersion", "kind") if k in obj}
    body = {k: v for k, v in obj.items() if k not in IMPLICIT_ROOT_FIELDS}
    unknown = sorted(unknown_fields(body, schema))
    if strict and unknown:
        raise ApiError(
            400, "BadRequest", "strict decoding error: " + ", ".join(f'unknown field "{f}"' for f in unknown)
        )
    body = prune(body, schema)
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path)))
    described = [_describe(error) for error in errors] + list(duplicates(body, schema))
    if described:
        name = meta.get("name", "")
        raise ApiError(
            422,
            "Invalid",
            f'{kind}.{group} "{name}" is invalid: ' + ", ".join(f"{field}: {detail}" for field, detail in described),
            {
                "name": name,
                "group": group,
                "kind": kind,
                "causes": [
                    {"reason": "FieldValueInvalid", "message": detail, "field": field} for field, detail in described
                ],
            },
        )
    return {**implicit, **body, "metadata": meta}
