"""Mutating admission as the API server does it: match a webhook's rules, POST an
AdmissionReview v1 to its ``clientConfig.url``, apply the JSONPatch it answers with.

Used by :class:`memops.cluster.apiserver.ApiServer` for every creation. Only URL webhooks
are called (an emulated cluster has no Services to route to); ``caBundle`` is used to verify
an https URL.
"""

from __future__ import annotations

import base64
import ssl
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import jsonpatch

from memops.cluster.memstore import Kind, Obj


class Denied(Exception):
    """The webhook answered ``allowed: false``."""


def rules_match(rules: Sequence[Mapping[str, Any]], kind: Kind, operation: str) -> bool:
    def fits(values: Sequence[str], value: str) -> bool:
        return "*" in values or value in values

    return any(
        fits(rule.get("apiGroups", []), kind.group)
        and fits(rule.get("apiVersions", []), kind.version)
        and fits(rule.get("resources", []), kind.plural)
        and fits(rule.get("operations", []), operation)
        for rule in rules
    )


def _ssl(client_config: Mapping[str, Any]) -> ssl.SSLContext | bool:
    bundle = client_config.get("caBundle")
    if not str(client_config.get("url", "")).startswith("https://"):
        return False
    return ssl.create_default_context(cadata=base64.b64decode(bundle).decode()) if bundle else True


async def call_webhook(hook: Mapping[str, Any], kind: Kind, obj: Obj, *, operation: str) -> Obj:
    client_config = hook.get("clientConfig", {})
    url = client_config.get("url")
    if not url:
        raise RuntimeError("only clientConfig.url webhooks are served by the emulated API server")
    meta = obj.get("metadata", {})
    gvk = {"group": kind.group, "version": kind.version, "kind": kind.kind}
    gvr = {"group": kind.group, "version": kind.version, "resource": kind.plural}
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": gvk,
            "resource": gvr,
            "requestKind": gvk,
            "requestResource": gvr,
            "name": meta.get("name", ""),
            "namespace": meta.get("namespace"),
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            "object": obj,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
    timeout = aiohttp.ClientTimeout(total=float(hook.get("timeoutSeconds", 10)))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url, json=review, ssl=_ssl(client_config)) as response:
            response.raise_for_status()
            answer = (await response.json()).get("response", {})
    if not answer.get("allowed", False):
        raise Denied(answer.get("status", {}).get("message", "denied"))
    if answer.get("patch"):
        if answer.get("patchType", "JSONPatch") != "JSONPatch":
            raise RuntimeError(f"unsupported patchType {answer.get('patchType')!r}")
        operations = jsonpatch.JsonPatch.from_string(base64.b64decode(answer["patch"]).decode())
        patched: Obj = operations.apply(obj)
        return patched
    return obj
