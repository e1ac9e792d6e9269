"""One asyncio client for the Kubernetes API, on aiohttp, with the content types spelled out.

    kube = await KubeClient.connect(user_agent="routerfleet-operator", field_manager="routerfleet-operator")
    fleet = await kube.get("RouterFleet", "llm", "routers")          # None when absent
    await kube.apply(manifest)                                       # server-side apply, one field manager
    async for event in kube.watch(path, {"labelSelector": ...}, timeout_s=300): ...
    await kube.close()

Every write says exactly what it is: server-side apply (``APPLY`` under the client's field manager), a
strategic merge patch (``STRATEGIC``: a pod's conditions merge by type, so the kubelet's are kept), or a
JSON merge patch (``MERGE``). Every failure is one ``ApiError`` with the HTTP status and the metric
``reason`` it counts under; a watch's ERROR events are handed to the caller as events, since what a
410 means (relist) is the caller's to decide.

Not the generated clients (``kubernetes``' or ``kubernetes_asyncio``'): they deserialize every object
into models (slow for a 1000-endpoint EndpointSlice; every caller here wants the JSON), and their watch
reads lines with aiohttp's ``readline``, which refuses lines past 128 KiB, which such a slice's watch
event exceeds. Credentials come from the ``kubernetes`` client's loaders (``credentials.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

import aiohttp

from .credentials import authorization, load_configuration, ssl_context

APPLY = "application/apply-patch+yaml"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
MAX_EVENT_BYTES = 64 << 20

# kind -> (API prefix, plural) for every kind the project addresses by kind (``path``).
KINDS: dict[str, tuple[str, str]] = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Secret": ("/api/v1", "secrets"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "ControllerRevision": ("/apis/apps/v1", "controllerrevisions"),
    "RouterFleet": ("/apis/routerfleet.io/v1alpha1", "routerfleets"),
    "InferenceObjective": ("/apis/inference.networking.x-k8s.io/v1alpha2", "inferenceobjectives"),
    "InferencePool": ("/apis/inference.networking.k8s.io/v1", "inferencepools"),
}


def path(kind: str, namespace: str | None, name: str | None = None, sub: str | None = None) -> str:
    """The API path of ``kind``'s collection in ``namespace`` (None: cluster-scoped, or every
    namespace), of one object ``name`` in it, or of its subresource ``sub``."""
    prefix, plural = KINDS[kind]
    p = f"{prefix}/namespaces/{quote(namespace, safe='')}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        p += f"/{quote(name, safe='')}"
    if sub:
        p += f"/{sub}"
    return p


class ApiError(Exception):
    """A failed API request, a watch ERROR event the caller raised, or an answer that is not the JSON
    expected, with the metric ``reason`` it counts under."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.reason = reason or reason_for(status)


def reason_for(status: int) -> str:
    if status == 401:
        return "unauthorized"
    if status == 403:
        return "forbidden"
    if status == 404:
        return "not_found"
    if status == 410:
        return "gone"
    if status == 429:
        return "throttled"
    if status >= 500:
        return "server_error"
    return "http_error"


class KubeClient:
    """One aiohttp session to the API server. ``field_manager`` names this program's writes (server-side
    apply and every patch or create); ``request_timeout`` bounds each request but a watch."""

    def __init__(
        self,
        cfg,
        *,
        user_agent: str,
        field_manager: str | None = None,
        connect_timeout: float = 10.0,
        request_timeout: float = 30.0,
    ) -> None:
        self.cfg = cfg
        self.host = cfg.host.rstrip("/")
        self.field_manager = field_manager
        self.ssl = ssl_context(cfg)
        self.server_hostname = getattr(cfg, "tls_server_name", None) or None
        self._user_agent = user_agent
        self._connect_timeout = connect_timeout
        self._request_timeout = request_timeout
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, context: str | None = None, **kw) -> KubeClient:
        """With the credentials ``load_configuration`` finds (blocking: files, maybe an exec plugin)."""
        return cls(load_configuration(kubeconfig, context), **kw)

    @classmethod
    async def connect(cls, kubeconfig: str | None = None, context: str | None = None, **kw) -> KubeClient:
        """``from_environment`` off the event loop."""
        return await asyncio.to_thread(cls.from_environment, kubeconfig, context, **kw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=self.ssl if self.ssl is not None else False),
                headers={"Accept": "application/json", "User-Agent": self._user_agent},
            )
        return self._session

    async def headers(self, accept: str | None = None) -> dict[str, str]:
        """The Authorization header, fresh: the refresh hook runs off the loop."""
        out = {}
        if token := await asyncio.to_thread(authorization, self.cfg):
            out["Authorization"] = token
        if accept:
            out["Accept"] = accept
        return out

    def _transport(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.server_hostname:
            kw["server_hostname"] = self.server_hostname
        if getattr(self.cfg, "proxy", None):
            kw["proxy"] = self.cfg.proxy
        return kw

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        total = self._request_timeout if timeout_s is None else timeout_s
        return aiohttp.ClientTimeout(total=total, sock_connect=min(total, self._connect_timeout))

    async def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        *,
        ctype: str = "application/json",
        params: Mapping[str, str] | None = None,
        accept: str | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One request: its JSON body (None when empty), or ApiError with the API's status and message."""
        headers = await self.headers(accept)
        data = None
        if body is not None:
            data = json.dumps(body)
            headers["Content-Type"] = ctype
        async with self._sess().request(
            method,
            self.host + url_path,
            data=data,
            params=params,
            headers=headers,
            timeout=self._timeout(timeout_s),
            **self._transport(),
        ) as r:
            if r.status >= 400:
                await _raise_for(r, f"{method} {url_path}")
            text = await r.text(errors="replace")
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError as e:
            raise ApiError(r.status, f"{method} {url_path}: the answer is not JSON: {e}", "decode") from e

    async def get_object(self, url_path: str, **kw: Any) -> dict:
        """GET one JSON object; an answer that is anything else is an ApiError (``decode``)."""
        body = await self.request("GET", url_path, **kw)
        if not isinstance(body, dict):
            raise ApiError(200, f"GET {url_path}: the answer is not a JSON object", "decode")
        return body

    async def watch(self, url_path: str, params: Mapping[str, str], *, timeout_s: int) -> AsyncIterator[dict]:
        """A watch of ``url_path`` (with bookmarks) that the server ends after ``timeout_s``: its events,
        each a dict with ``type`` and ``object``; ERROR events included."""
        params = {**params, "watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_s)}
        # no total timeout; a read gap well past the server-side timeout means a dead connection
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self._connect_timeout, sock_read=timeout_s + 30
        )
        async with self._sess().get(
            self.host + url_path,
            params=params,
            headers=await self.headers(),
            timeout=timeout,
            **self._transport(),
        ) as r:
            if r.status >= 400:
                await _raise_for(r, f"watch {url_path}")
            async for ev in watch_events(r.content.iter_any()):
                yield ev

    # ---- objects by kind ----

    async def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            return await self.get_object(path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str | None, label_selector: str) -> list[dict]:
        out = await self.get_object(path(kind, namespace), params={"labelSelector": label_selector})
        return list(out.get("items") or [])

    def _managed(self) -> dict[str, str]:
        return {"fieldManager": self.field_manager} if self.field_manager else {}

    async def apply(self, manifest: Mapping[str, Any]) -> dict:
        """Server-side apply under the client's field manager, taking over conflicting fields."""
        assert self.field_manager, "server-side apply needs a field manager"
        meta = manifest["metadata"]
        return await self.request(
            "PATCH",
            path(manifest["kind"], meta.get("namespace"), meta["name"]),
            manifest,
            ctype=APPLY,
            params={**self._managed(), "force": "true"},
        )

    async def create(self, manifest: Mapping[str, Any]) -> dict:
        meta = manifest["metadata"]
        return await self.request(
            "POST", path(manifest["kind"], meta.get("namespace")), manifest, params=self._managed()
        )

    async def delete(self, kind: str, namespace: str | None, name: str, *, uid: str | None = None) -> bool:
        """Delete (with a UID precondition when given); False when already gone, or replaced."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self.request("DELETE", path(kind, namespace, name), body)
            return True
        except ApiError as e:
            if e.status in (404, 409):
                return False
            raise

    async def patch(
        self, kind: str, namespace: str | None, name: str, body: Any, *, ctype: str, sub: str | None = None
    ) -> Any:
        return await self.request(
            "PATCH", path(kind, namespace, name, sub), body, ctype=ctype, params=self._managed()
        )


async def _raise_for(r: aiohttp.ClientResponse, what: str) -> None:
    text = (await r.text(errors="replace"))[:1000]
    try:
        message = json.loads(text).get("message") or text
    except (ValueError, AttributeError):
        message = text
    raise ApiError(r.status, f"{what}: {message}")


async def watch_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """A watch response body (one JSON event per line, in arbitrary chunks) as events. Lines may exceed
    aiohttp's readline limit (a 1000-endpoint slice), so split here, up to ``MAX_EVENT_BYTES``."""
    buf = bytearray()
    async for chunk in chunks:
        scan = len(buf)
        buf += chunk
        start = 0
        while (nl := buf.find(b"\n", scan)) >= 0:
            line = bytes(buf[start:nl])
            start = scan = nl + 1
            if line.strip():
                yield _event(line)
        del buf[:start]
        if len(buf) > MAX_EVENT_BYTES:
            raise ApiError(0, f"watch event longer than {MAX_EVENT_BYTES} bytes", "decode")
    if buf.strip():
        yield _event(bytes(buf))


def _event(line: bytes) -> dict:
    try:
        ev = json.loads(line)
    except ValueError as e:
        raise ApiError(0, f"watch event is not JSON: {e}", "decode") from e
    if not isinstance(ev, dict) or not isinstance(ev.get("object"), dict) or "type" not in ev:
        raise ApiError(0, "watch event lacks type/object", "decode")
    return ev
