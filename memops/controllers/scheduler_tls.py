"""The client certificates for a ``tls://`` scheduler, from the Secret that ``spec.scheduler.tls`` names.

Both controllers call :func:`security_for` before they speak to a scheduler: the
RetirementRequest's drain (:mod:`memops.controllers.retirement`) and the MemoryPolicy's pass
(:mod:`memops.controllers.policy`). A Secret that is missing, forbidden or holds no usable
certificate raises :class:`SecretUnusable`, whose message names the field.
"""

from __future__ import annotations

from typing import Any

from memops import specs
from memops.clients import daskrpc, kube


class SecretUnusable(Exception):
    """The scheduler's TLS Secret is missing, or holds no usable client certificate."""

    def __init__(self, name: str, namespace: str, cause: BaseException):
        self.cause = cause
        detail = str(cause) if isinstance(cause, kube.ApiError) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"spec.scheduler.tls.secretName: Secret {name!r} in namespace {namespace} is unusable: {detail}"
        )


async def security_for(client: kube.Kube, namespace: str, scheduler: specs.SchedulerRef) -> Any:
    """A :class:`distributed.security.Security` for ``scheduler``, or None for a ``tcp://`` one.

    The API server's own trouble (a 5xx, a timeout) is raised as it is, to be retried as any
    other; what the Secret's owner must fix is :class:`SecretUnusable`.
    """
    if scheduler.tls is None:
        return None
    name = scheduler.tls.secretName
    try:
        secret = await client.get(kube.resource_path("", "v1", "secrets", namespace, name))
        security: Any = daskrpc.security_from_secret(secret.get("data") or {})
        security.get_connection_args("client")  # loads the certificates: a broken one fails here
    except kube.ApiError as exc:
        if exc.code not in (401, 403, 404):
            raise
        raise SecretUnusable(name, namespace, exc) from exc
    except Exception as exc:
        raise SecretUnusable(name, namespace, exc) from exc
    return security
