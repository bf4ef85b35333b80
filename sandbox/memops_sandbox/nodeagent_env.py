"""A container's environment and command line, as the kubelet computes them: pure functions.

The node agent builds one environment per container start and uses it for the process, its
exec probes and its exec hooks alike (upstream runs those inside the container, where they see
the container's environment). Secrets and ConfigMaps are fetched by the caller beforehand.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

Obj = dict[str, Any]


class ConfigError(ValueError):
    """The container cannot be configured: the kubelet's CreateContainerConfigError."""


def expand(text: str, variables: Mapping[str, str]) -> str:
    """``$(VAR)`` expansion exactly as upstream's ``third_party/forked/golang/expansion/expand.go``
    (``Expand`` with ``MappingFuncFor``): ``$$`` is a literal ``$``, ``$(NAME)`` is replaced
    when NAME is defined and kept as written when not, anything up to the first ``)`` is a
    name, an unclosed ``$(`` and a ``$`` before any other character stay as they are."""
    out: list[str] = []
    cursor = 0
    checkpoint = 0
    while cursor < len(text):
        if text[cursor] == "$" and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            following = text[cursor + 1]
            if following == "$":
                out.append("$")
                cursor += 1
            elif following == "(":
                closer = text.find(")", cursor + 2)
                if closer == -1:
                    out.append("$(")
                    cursor += 1
                else:
                    name = text[cursor + 2 : closer]
                    out.append(variables.get(name, f"$({name})"))
                    cursor = closer
            else:
                out.append("$" + following)
                cursor += 1
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


_SUBSCRIPTED = re.compile(r"^(metadata\.labels|metadata\.annotations)\['(.*)'\]$")
_FIELDS: dict[str, Callable[[Obj, str, str], str]] = {
    "metadata.name": lambda pod, ip, host: str(pod["metadata"].get("name", "")),
    "metadata.namespace": lambda pod, ip, host: str(pod["metadata"].get("namespace", "")),
    "metadata.uid": lambda pod, ip, host: str(pod["metadata"].get("uid", "")),
    "spec.nodeName": lambda pod, ip, host: str(pod.get("spec", {}).get("nodeName", "")),
    "spec.serviceAccountName": lambda pod, ip, host: str(pod.get("spec", {}).get("serviceAccountName", "")),
    "status.podIP": lambda pod, ip, host: ip,
    "status.podIPs": lambda pod, ip, host: ip,
    "status.hostIP": lambda pod, ip, host: host,
    "status.hostIPs": lambda pod, ip, host: host,
}


def field_value(pod: Obj, path: str, *, pod_ip: str, host_ip: str) -> str:
    """A ``fieldRef`` value: upstream's ``podFieldSelectorRuntimeValue`` (pkg/kubelet/kubelet_pods.go),
    falling back to ``fieldpath.ExtractFieldPathAsString`` (pkg/fieldpath/fieldpath.go) for
    metadata, where a missing label or annotation is the empty string. The pod IP is the one
    the agent assigned before the container starts, as the sandbox's IP is known upstream."""
    subscripted = _SUBSCRIPTED.match(path)
    if subscripted:
        kind = subscripted.group(1).split(".")[1]
        return str((pod["metadata"].get(kind) or {}).get(subscripted.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        # fieldpath.FormatMap: sorted key="value" lines.
        values = pod["metadata"].get(path.split(".")[1]) or {}
        return "\n".join(f'{key}="{values[key]}"' for key in sorted(values))
    if path not in _FIELDS:
        raise ConfigError(f"unsupported fieldPath: {path}")
    return _FIELDS[path](pod, pod_ip, host_ip)


def references(container: Obj) -> tuple[set[str], set[str]]:
    """The names of the Secrets and ConfigMaps the container's environment reads."""
    secrets: set[str] = set()
    config_maps: set[str] = set()
    for source in container.get("envFrom") or []:
        if "secretRef" in source:
            secrets.add(source["secretRef"]["name"])
        if "configMapRef" in source:
            config_maps.add(source["configMapRef"]["name"])
    for item in container.get("env") or []:
        ref = item.get("valueFrom") or {}
        if "secretKeyRef" in ref:
            secrets.add(ref["secretKeyRef"]["name"])
        if "configMapKeyRef" in ref:
            config_maps.add(ref["configMapKeyRef"]["name"])
    return secrets, config_maps


def _lookup(
    kind: str, objects: Mapping[str, Obj | None], ref: Obj, namespace: str, *, secret: bool
) -> tuple[bool, str | None]:
    """(skip, value) for one key reference: optional references to something missing are skipped."""
    optional = bool(ref.get("optional"))
    obj = objects.get(ref["name"])
    if obj is None:
        if optional:
            return True, None
        raise ConfigError(f'{kind} "{ref["name"]}" not found')
    data = obj.get("data") or {}
    if ref["key"] not in data:
        if optional:
            return True, None
        raise ConfigError(f"couldn't find key {ref['key']} in {kind} {namespace}/{ref['name']}")
    value = str(data[ref["key"]])
    return False, base64.b64decode(value).decode() if secret else value


def container_env(
    pod: Obj,
    container: Obj,
    *,
    pod_ip: str,
    host_ip: str,
    secrets: Mapping[str, Obj | None],
    config_maps: Mapping[str, Obj | None],
) -> dict[str, str]:
    """The container's environment as upstream's ``makeEnvironmentVariables`` builds it
    (pkg/kubelet/kubelet_pods.go): ``envFrom`` first (a prefix, later sources win), then each
    ``env`` entry in order; a non-empty ``value`` is expanded against what is defined so far,
    ``valueFrom`` values are never expanded. Service links are not emulated."""
    namespace = str(pod["metadata"].get("namespace", ""))
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix", ""))
        secret = "secretRef" in source
        ref = source["secretRef"] if secret else source.get("configMapRef") or {}
        obj = (secrets if secret else config_maps).get(ref.get("name", ""))
        if obj is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f'{"secret" if secret else "configmap"} "{ref.get("name")}" not found')
        for key, value in (obj.get("data") or {}).items():
            env[prefix + key] = base64.b64decode(value).decode() if secret else str(value)
    for item in container.get("env") or []:
        name = str(item["name"])
        value_from = item.get("valueFrom")
        if item.get("value"):
            env[name] = expand(str(item["value"]), env)
        elif value_from:
            if "fieldRef" in value_from:
                env[name] = field_value(pod, value_from["fieldRef"]["fieldPath"], pod_ip=pod_ip, host_ip=host_ip)
            elif "secretKeyRef" in value_from:
                skip, value = _lookup("Secret", secrets, value_from["secretKeyRef"], namespace, secret=True)
                if skip:
                    continue
                env[name] = str(value)
            elif "configMapKeyRef" in value_from:
                skip, value = _lookup("ConfigMap", config_maps, value_from["configMapKeyRef"], namespace, secret=False)
                if skip:
                    continue
                env[name] = str(value)
            else:
                raise ConfigError(f"env {name}: only fieldRef, secretKeyRef and configMapKeyRef are emulated")
        else:
            env[name] = ""
    return env


def command_line(container: Obj, env: Mapping[str, str]) -> list[str]:
    """``command`` + ``args`` expanded against the full environment, as upstream's
    ``ExpandContainerCommandAndArgs`` (pkg/kubelet/container/helpers.go). There are no images:
    the command must be given and be on PATH."""
    if not container.get("command"):
        raise ConfigError(f"container {container.get('name')!r}: the node agent runs no images, command is required")
    return [expand(str(part), env) for part in [*container["command"], *(container.get("args") or [])]]


def probe_command(command: list[str], container: Obj) -> list[str]:
    """An exec probe's command, expanded against the container's static ``env`` values only, as
    upstream's prober does (``ExpandContainerCommandOnlyStatic``, pkg/kubelet/prober/prober.go).
    Exec hooks are not expanded at all (pkg/kubelet/lifecycle/handlers.go, ``Run``)."""
    static = {str(item["name"]): str(item.get("value", "")) for item in container.get("env") or [] if "value" in item}
    return [expand(str(part), static) for part in command]
