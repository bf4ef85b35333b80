"""The API server's audit log (upstream JSON lines, ``DIR/audit.log`` of each sandbox), read as
RBAC sees each request: ``(apiGroup, resource[/subresource], verb, namespace or "")``."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import yaml

Request = tuple[str, str, str, str]


def kubeconfig_user(kubeconfig: Path) -> str:
    """The user of a kubeconfig's first entry: for the operator's, its ServiceAccount's username."""
    return str(yaml.safe_load(kubeconfig.read_text())["users"][0]["name"])


def lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    with path.open() as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)  # a sandbox appends its log whole, under LOCK_EX
        return handle.read().splitlines()


def requests(path: Path, user: str, *, since: int = 0) -> list[Request]:
    """``user``'s requests after the first ``since`` lines, in order. Lines of other formats and
    requests with no object (``/readyz``, discovery) are skipped; a request the API server refused
    is kept (it was made)."""
    found: list[Request] = []
    for line in lines(path)[since:]:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("apiVersion") != "audit.k8s.io/v1":
            continue
        ref = event.get("objectRef") or {}
        if (event.get("user") or {}).get("username") != user or not ref.get("resource"):
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        found.append((ref.get("apiGroup") or "", resource, str(event["verb"]), ref.get("namespace") or ""))
    return found
