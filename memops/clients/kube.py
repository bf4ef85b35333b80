"""The operator's Kubernetes API client: the one seam between memops and the API server.

Kopf watches and patches memops' own resources; everything else the controllers do to the
cluster (read a Deployment, claim and annotate pods, lower replicas through ``/scale``,
write a request's status mid-drain) goes through the thin functions here.

Credentials come from one :class:`Credentials`, shared by memops' own client and Kopf's login
handler. It loads them with ``kubernetes_asyncio``'s configuration loader, as kubectl would
read them: a kubeconfig's tokens, token files, client certificates, exec credential plugins
(``aws eks get-token``, ``gke-gcloud-auth-plugin``, kubelogin) and OIDC, or the pod's service
account. They are loaded again when they expire, every minute in a pod (the kubelet rotates
the projected token), and after a 401; a request that met a 401 is sent once more with the
new credentials, so that no caller sees a rotation.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import dataclasses
import datetime
import json
import logging
import os
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kopf

from memops.decisions import objects, permissions

logger = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a pod's service account: ``token`` (projected, rotated), ``ca.crt``, ``namespace``."""

TOKEN_FILE_PERIOD = datetime.timedelta(minutes=1)
"""How often a pod's token file is read again, as client-go reads it: the kubelet writes a new
token at 80% of the old one's life, so a minute is far inside the overlap of the two."""

EXPIRY_MARGIN = datetime.timedelta(minutes=1)
"""Credentials that say when they expire (an exec plugin's ``expirationTimestamp``, a token's
``exp``) are loaded again this long before, so that no request carries them past it."""

MIN_VALIDITY = datetime.timedelta(seconds=30)
"""The soonest a reload is planned after a load. A plugin that hands out the same token until
it expires (many cache theirs) would otherwise be asked again at once, in a loop."""


class ApiError(Exception):
    """The API server refused a request; ``code`` and ``reason`` come from its Status."""

    def __init__(self, code: int, reason: str, message: str):
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True)
class Source:
    """Where credentials come from: a kubeconfig (one path, or several as $KUBECONFIG lists them,
    merged as kubectl merges them) and a context in it, or else a pod's service account."""

    kubeconfig: str | None
    context: str | None = None
    service_account: Path = SERVICE_ACCOUNT
    scratch: Path | None = None
    """Where certificates given inline are written as files (Python's ssl reads only files);
    the system's temporary directory if None."""


def choose_source(
    kubeconfig: str | None,
    context: str | None,
    *,
    environ: Mapping[str, str],
    service_account: Path = SERVICE_ACCOUNT,
    home: Path | None = None,
) -> Source:
    """``--kubeconfig``, else $KUBECONFIG, else the pod's service account, else ~/.kube/config.

    The order of controller-runtime's loader (and of client-go's ``BuildConfigFromFlags``): a
    kubeconfig that someone named wins; in a pod, the pod's own account comes before a
    kubeconfig that happens to lie in the image's home directory.
    """
    if kubeconfig:
        return Source(kubeconfig, context)
    if environ.get("KUBECONFIG"):
        return Source(environ["KUBECONFIG"], context)
    if environ.get("KUBERNETES_SERVICE_HOST") and (service_account / "token").is_file():
        return Source(None, service_account=service_account)
    default = (home or Path.home()) / ".kube" / "config"
    if default.is_file():
        return Source(str(default), context)
    raise kopf.LoginError(
        f"no kubeconfig (--kubeconfig, $KUBECONFIG, {default}) and no in-cluster service account at {service_account}"
    )


def token_expiry(token: str | None) -> datetime.datetime | None:
    """The ``exp`` of a JWT bearer token (service account tokens, OIDC ID tokens); None for
    tokens that are not JWTs or say nothing. Read unverified: it only tells when to reload."""
    parts = (token or "").split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
        return datetime.datetime.fromtimestamp(int(claims["exp"]), datetime.UTC)
    except (binascii.Error, ValueError, TypeError, KeyError, OverflowError):
        return None


def renewal_time(now: datetime.datetime, *expiries: datetime.datetime | None) -> datetime.datetime | None:
    """When credentials that expire at ``expiries`` are to be loaded again: :data:`EXPIRY_MARGIN`
    before the first, but not sooner than :data:`MIN_VALIDITY` from ``now``; None if none is known."""
    known = [expiry for expiry in expiries if expiry is not None]
    if not known:
        return None
    return max(min(known) - EXPIRY_MARGIN, now + MIN_VALIDITY)


def split_authorization(header: str | None) -> tuple[str | None, str | None]:
    """An Authorization header's scheme and token (RFC 7235); a bare token has no scheme."""
    if not header:
        return None, None
    scheme, _, token = header.partition(" ")
    return (scheme, token) if token else (None, scheme)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """One load of the credentials.

    ``info.expiration`` is when Kopf logs in again of itself (the credentials' own expiry, less a
    margin); ``reload_at`` is when memops loads them again before it uses them (that, or a
    minute after reading a token file that the kubelet rotates). None: only after a 401.
    """

    info: kopf.ConnectionInfo
    reload_at: datetime.datetime | None = None


async def load(source: Source) -> Loaded:
    """Load the credentials of ``source`` with ``kubernetes_asyncio``'s configuration loader.

    Every load starts afresh: the kubeconfig files and the token file are read again, an exec
    plugin runs again, an OIDC ID token past its expiry is refreshed (and, as kubectl does,
    written back to the kubeconfig).
    """
    # Imported here: it takes a second (the generated API models come with it), which only the
    # operator itself pays, and not `memops crds` or `--help`.
    from kubernetes_asyncio import client, config
    from kubernetes_asyncio.config import kube_config

    configuration = client.Configuration()
    now = datetime.datetime.now(datetime.UTC)
    try:
        if source.kubeconfig is None:
            config.load_incluster_config(  # type: ignore[no-untyped-call]  # the library's one untyped loader
                client_configuration=configuration,
                try_refresh_token=False,  # memops reads the file again itself: see reload_at
                token_filename=str(source.service_account / "token"),
                cert_filename=str(source.service_account / "ca.crt"),
            )
            namespace_file = source.service_account / "namespace"
            namespace = namespace_file.read_text().strip() if namespace_file.is_file() else None
            plugin_expiry = None
        else:
            # load_kube_config() as it is, but for its persister, which its OIDC refresh calls
            # with an argument it does not take (a TypeError, in kubernetes_asyncio 36.1).
            merger = kube_config.KubeConfigMerger(source.kubeconfig)
            loader = kube_config.KubeConfigLoader(
                config_dict=merger.config,
                config_base_path=None,
                active_context=source.context,
                config_persister=lambda _: _write_back(merger),
                temp_file_path=None if source.scratch is None else str(source.scratch),
            )
            await loader.load_and_set(configuration)
            namespace = ((loader.current_context or {}).get("context") or {}).get("namespace")
            plugin_expiry = getattr(loader, "exec_plugin_expiry", None)  # set when a plugin said
        header = await configuration.get_api_key_with_prefix("BearerToken")
    except (config.ConfigException, OSError, ValueError) as error:
        where = source.kubeconfig or f"the service account at {source.service_account}"
        raise kopf.LoginError(f"cannot load credentials from {where}: {error}") from error
    scheme, token = split_authorization(header)
    expiration = renewal_time(now, plugin_expiry, token_expiry(token))
    info = kopf.ConnectionInfo(
        server=str(configuration.host),
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        proxy_url=configuration.proxy,
        default_namespace=namespace or "default",
        expiration=expiration,
    )
    if source.kubeconfig is None:
        reread = now + TOKEN_FILE_PERIOD
        return Loaded(info, reread if expiration is None else min(expiration, reread))
    return Loaded(info, expiration)


def _write_back(merger: Any) -> None:
    """Write a refreshed OIDC token back to its kubeconfig, as kubectl does: an identity provider
    may take each refresh token once. A kubeconfig that cannot be written (a mounted Secret) keeps
    the old one; the refreshed token serves until the operator stops."""
    try:
        merger.save_changes()
    except OSError as error:
        logger.warning("could not write the refreshed token back to the kubeconfig: %s", error)


class Credentials:
    """The credentials that memops' client and Kopf's login share, loaded again when due.

    One instance per operator. :meth:`get` gives the current ones (loading them when they are
    due); :meth:`renew` loads them again after a 401, once for all the requests that met it;
    :meth:`login` is what Kopf's login handler returns.
    """

    def __init__(self, load: Callable[[], Awaitable[Loaded]]):
        self._load = load
        self._loaded: Loaded | None = None
        self._lock = asyncio.Lock()
        self._given_to_kopf: kopf.ConnectionInfo | None = None

    @classmethod
    def fixed(cls, info: kopf.ConnectionInfo) -> Credentials:
        """Credentials that never change (tests, a server with no authentication)."""

        async def same() -> Loaded:
            return Loaded(info)

        return cls(same)

    async def get(self) -> kopf.ConnectionInfo:
        loaded = self._loaded
        now = datetime.datetime.now(datetime.UTC)
        if loaded is not None and (loaded.reload_at is None or now < loaded.reload_at):
            return loaded.info
        async with self._lock:
            if self._loaded is loaded:  # not loaded by another request meanwhile
                try:
                    self._loaded = await self._load()
                except kopf.LoginError as error:
                    if loaded is None:
                        raise
                    # The ones in hand may still serve (a token file being rewritten, say);
                    # a 401 would make renew() try again at once.
                    logger.warning("keeping the current credentials: %s", error)
                    self._loaded = dataclasses.replace(loaded, reload_at=now + MIN_VALIDITY)
            assert self._loaded is not None
            return self._loaded.info

    async def renew(self, failed: kopf.ConnectionInfo | None) -> kopf.ConnectionInfo:
        """Load again, unless the credentials in hand differ from ``failed`` already (another
        request renewed them, or a reload when due found a new token).

        Raises kopf.LoginError if they cannot be loaded.
        """
        async with self._lock:
            if self._loaded is None or self._loaded.info == failed:
                self._loaded = await self._load()
            return self._loaded.info

    async def login(self) -> kopf.ConnectionInfo:
        """For Kopf's login handler. Kopf logs in at its start, then only when the credentials
        it was given failed (a 401) or expired: it gets memops' current ones if they differ from
        those, else ones loaded afresh. (Kopf refuses ones equal to those that failed.)"""
        if self._given_to_kopf is None:
            info = await self.get()
        else:
            info = await self.renew(self._given_to_kopf)
        self._given_to_kopf = info
        return info


def load_connection(kubeconfig: str | None = None, context: str | None = None) -> Credentials:
    """The credentials of ``kubeconfig`` (else $KUBECONFIG, the service account, ~/.kube/config:
    :func:`choose_source`), loaded at their first use."""

    async def load_chosen() -> Loaded:
        return await load(choose_source(kubeconfig, context, environ=os.environ))

    return Credentials(load_chosen)


def resource_path(
    group: str,
    version: str,
    plural: str,
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> str:
    """The API path of a collection or an object; every segment is one path segment, always.

    The names come from users' specs, which the CRD schema already restricts to DNS-1123 names;
    quoting each segment and refusing the empty, ``.`` and ``..`` ones keeps a name from
    leaving its namespace even if one slips past the schema (an older CRD, a bug).
    """
    segments = ["apis", group, version] if group else ["api", version]
    if namespace is not None:
        segments += ["namespaces", namespace]
    segments.append(plural)
    if name is not None:
        segments.append(name)
    if subresource is not None:
        segments.append(subresource)
    for segment in segments:
        if segment in ("", ".", ".."):
            raise ValueError(f"{segment!r} cannot be a segment of an API path (in {segments!r})")
    return "/" + "/".join(urllib.parse.quote(segment, safe="") for segment in segments)


_ERROR_TEXT_LIMIT = 500
"""How much of an error body that is not a Kubernetes Status is kept in the ApiError."""


def _api_error(status: int, reason: str, text: str) -> ApiError:
    """The ApiError for an error response: from its Status when the body is one, else from its text."""
    try:
        payload = json.loads(text) if text else {}
    except ValueError:
        payload = None
    if isinstance(payload, dict):
        return ApiError(status, str(payload.get("reason") or reason), str(payload.get("message", "")))
    return ApiError(status, reason, _truncated(text))


def _truncated(text: str) -> str:
    return text[:_ERROR_TEXT_LIMIT] + ("…" if len(text) > _ERROR_TEXT_LIMIT else "")


REQUEST_TIMEOUT = 30.0
"""Seconds a request may take, from connecting to its last byte."""


def _transport(info: kopf.ConnectionInfo) -> tuple[Any, ...]:
    """What a connection depends on; a new token alone needs no new connections."""
    return (
        info.server,
        info.ca_path,
        info.ca_data,
        info.insecure,
        info.certificate_path,
        info.certificate_data,
        info.private_key_path,
        info.private_key_data,
        info.proxy_url,
        info.trust_env,
    )


async def renewing(
    credentials: Credentials, send: Callable[[kopf.ConnectionInfo], Awaitable[objects.Obj]]
) -> objects.Obj:
    """``send`` with the credentials in hand, and once more with renewed ones after a 401."""
    info = await credentials.get()
    try:
        return await send(info)
    except ApiError as error:
        if error.code != 401:
            raise
        # Unauthenticated, so not done: the token was rotated or revoked, or an exec
        # plugin's credentials ran out. Load them again and send it once more.
        try:
            renewed = await credentials.renew(info)
        except kopf.LoginError as login_error:
            raise ApiError(error.code, error.reason, f"{error.message} (and then {login_error})") from error
        if renewed == info:
            raise  # nothing new to try: the 401 stands
        return await send(renewed)


class Kube:
    """A small async client. One instance per operator; cheap to create per test.

    ``credentials``: the operator's :class:`Credentials`, or fixed ones (a ConnectionInfo).
    """

    def __init__(self, credentials: Credentials | kopf.ConnectionInfo):
        if isinstance(credentials, kopf.ConnectionInfo):
            credentials = Credentials.fixed(credentials)
        self.credentials = credentials
        self._session: aiohttp.ClientSession | None = None
        self._transport: tuple[Any, ...] | None = None
        self._retired: builtins.list[tuple[float, aiohttp.ClientSession]] = []

    async def close(self) -> None:
        sessions = [session for _, session in self._retired] + ([self._session] if self._session else [])
        self._session, self._transport, self._retired = None, None, []
        for session in sessions:
            await session.close()

    async def _session_for(self, info: kopf.ConnectionInfo) -> aiohttp.ClientSession:
        """The session for ``info``'s server, CA and client certificate; a new one when they change
        (an exec plugin that hands out certificates). The old one closes once its requests are done."""
        transport = _transport(info)
        if self._session is None or self._transport != transport:
            if self._session is not None:
                self._retired.append((time.monotonic(), self._session))
            self._session = aiohttp.ClientSession(
                base_url=info.server.rstrip("/") + "/",
                headers={"Accept": "application/json", "User-Agent": "memops"},
                connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
                proxy=info.proxy_url,
                trust_env=info.trust_env,
            )
            self._transport = transport
        done = time.monotonic() - 2 * REQUEST_TIMEOUT
        for retired_at, session in [item for item in self._retired if item[0] < done]:
            self._retired.remove((retired_at, session))
            await session.close()
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> objects.Obj:
        return await renewing(
            self.credentials,
            lambda info: self._send(info, method, path, body=body, params=params, content_type=content_type),
        )

    async def _send(
        self,
        info: kopf.ConnectionInfo,
        method: str,
        path: str,
        *,
        body: Any,
        params: Mapping[str, str] | None,
        content_type: str,
    ) -> objects.Obj:
        session = await self._session_for(info)
        kwargs: dict[str, Any] = {"params": dict(params or {}), "headers": info.as_http_headers()}
        if body is not None:
            kwargs["data"] = json.dumps(body)
            kwargs["headers"]["Content-Type"] = content_type
        async with session.request(method, path.lstrip("/"), **kwargs) as response:
            # Read as text first: a proxy or a webhook may answer with HTML or plain text.
            text = await response.text(errors="replace") if response.content_length != 0 else ""
            if response.status >= 400:
                error = _api_error(response.status, response.reason or "", text)
                if response.status == 403:
                    # Name the missing permission and what grants it: this text reaches conditions.
                    explained = permissions.explain_forbidden(method, path, error.message)
                    error = ApiError(error.code, error.reason, explained)
                raise error
            try:
                payload = json.loads(text) if text else {}
            except ValueError:
                raise ApiError(response.status, "InvalidResponse", f"not JSON: {_truncated(text)}") from None
            return payload if isinstance(payload, dict) else {}

    async def get(self, path: str, **params: str) -> objects.Obj:
        return await self.request("GET", path, params=params)

    async def get_or_none(self, path: str) -> objects.Obj | None:
        try:
            return await self.get(path)
        except ApiError as exc:
            if exc.code == 404:
                return None
            raise

    async def list(
        self, path: str, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> builtins.list[objects.Obj]:
        params = {"labelSelector": label_selector} if label_selector else {}
        if field_selector:
            params["fieldSelector"] = field_selector
        items: builtins.list[objects.Obj] = (await self.request("GET", path, params=params)).get("items", [])
        return items

    async def list_not_older_than(
        self, path: str, resource_version: str | None, *, label_selector: str | None = None
    ) -> tuple[builtins.list[objects.Obj], str | None]:
        """The items, and the list's resourceVersion. With ``resource_version`` (one that an earlier
        list returned), no older than that list (``resourceVersionMatch=NotOlderThan``): the API
        server answers from its watch cache at once, where a consistent list waits until the cache
        has caught up with etcd's latest revision, a write to any resource included (up to the
        cache's 100 ms progress period after a write)."""
        params = {"labelSelector": label_selector} if label_selector else {}
        if resource_version:
            params |= {"resourceVersion": resource_version, "resourceVersionMatch": "NotOlderThan"}
        listed = await self.request("GET", path, params=params)
        version = (listed.get("metadata") or {}).get("resourceVersion")
        return listed.get("items", []), str(version) if version else None

    async def merge_patch(self, path: str, patch: objects.Obj) -> objects.Obj:
        return await self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    async def json_patch(self, path: str, operations: builtins.list[objects.Obj]) -> objects.Obj:
        return await self.request("PATCH", path, body=operations, content_type="application/json-patch+json")

    async def delete(self, path: str, *, propagation_policy: str = "Background") -> objects.Obj:
        return await self.request(
            "DELETE", path, body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation_policy}
        )
