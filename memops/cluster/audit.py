"""The emulated API server's audit log: who asked for what, in RBAC's terms.

With a path (``memops sandbox --audit-log``, or ``$MEMOPS_AUDIT_LOG``), the API server appends
one JSON line per resource request: the user (the bearer token: in the emulated cluster a
token is just a name), the user agent, and the RBAC attributes that a real API server derives
from the request (verb, API group, resource, subresource, namespace, name). The packaging tests
read it to check that the shipped RBAC grants exactly what the operator uses.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def rbac_verb(method: str, *, named: bool, watch: bool) -> str:
    """The RBAC verb of a request, as the API server's RequestInfoFactory derives it.

    GET on one object is ``get``, on a collection ``list``, and with ``?watch`` ``watch``;
    POST ``create``, PUT ``update``, PATCH ``patch``; DELETE on one object ``delete``, on a
    collection ``deletecollection``.
    """
    method = method.upper()
    if method in ("GET", "HEAD"):
        return "watch" if watch else ("get" if named else "list")
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


def user_of(authorization: str) -> str:
    """The requesting user: the bearer token, which names a user in the emulated cluster."""
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else "system:anonymous"


def write(path: Path, entry: dict[str, Any]) -> None:
    """Append one entry; one ``write`` on an O_APPEND file, so concurrent servers never interleave."""
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
