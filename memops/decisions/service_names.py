"""Which Service of the policy's namespace a scheduler address's host names, if any.

Users write the address as a pod of their namespace would dial it (``tcp://dask-scheduler:8786``,
as in the Dask Helm chart and the examples). The operator runs in its own namespace, where the
same short name would resolve to a Service of that namespace, or to nothing. So a host that a pod
of the policy's namespace would resolve to one of its Services (``name``, ``name.<namespace>``,
``name.<namespace>.svc``, ``name.<namespace>.svc.<cluster domain>``) is looked up as that Service,
through the API server. Any other host (an IP address, another namespace's Service, a name
outside the cluster) is dialled as written. Pure.
"""

from __future__ import annotations

import ipaddress
import re

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A Service name (an RFC 1035 label, as the API server requires it), or a DNS label."""


def service_of(host: str, namespace: str) -> str | None:
    """The name of the Service of ``namespace`` that ``host`` names, or None."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    name, *rest = host.lower().removesuffix(".").split(".")
    if not _LABEL.match(name):
        return None
    if rest in ([], [namespace], [namespace, "svc"]):
        return name
    # A cluster domain of any name (cluster.local by default), after the namespace and svc.
    if len(rest) > 2 and rest[:2] == [namespace, "svc"] and all(_LABEL.match(label) for label in rest[2:]):
        return name
    return None
