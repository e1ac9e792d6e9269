"""A small asyncio client for the Kubernetes API, with the content types spelled out.

The operator talks to the API server through kopf's own credentials (``kopf.login_with_service_account``
in a pod, else ``kopf.login_with_kubeconfig``) and aiohttp, so every write says exactly what it is:
server-side apply (``application/apply-patch+yaml`` with one field manager), a strategic merge patch of
``pods/status`` (conditions merge by type, so the kubelet's own conditions are kept), or a JSON merge
patch of the RouterFleet's ``status``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf

from .model import FIELD_MANAGER

APPLY = "application/apply-patch+yaml"
STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
RELOGIN_S = 300.0  # a projected ServiceAccount token rotates: log in again now and then

# kind -> (API prefix, plural) for every kind the operator writes.
KINDS: dict[str, tuple[str, str]] = {
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Secret": ("/api/v1", "secrets"),
    "Service": ("/api/v1", "services"),
    "Pod": ("/api/v1", "pods"),
    "Event": ("/api/v1", "events"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "NetworkPolicy": ("/apis/networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "ControllerRevision": ("/apis/apps/v1", "controllerrevisions"),
    "RouterFleet": ("/apis/routerfleet.io/v1alpha1", "routerfleets"),
}


class ApiError(Exception):
    def __init__(self, status: int, body: Any, what: str):
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, Mapping) else str(body)[:300]
        super().__init__(f"{what}: {status} {msg}")


def path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    prefix, plural = KINDS[kind]
    p = f"{prefix}/namespaces/{quote(namespace)}/{plural}"
    if name:
        p += f"/{quote(name)}"
    if sub:
        p += f"/{sub}"
    return p


def _login() -> kopf.ConnectionInfo:
    """$KUBECONFIG when set; else the pod's ServiceAccount (at $KUBERNETES_SERVICE_HOST:PORT when the
    environment names it); else ~/.kube/config."""
    settings = kopf.OperatorSettings()
    info = None
    if not os.environ.get("KUBECONFIG"):
        info = kopf.login_with_service_account(settings=settings)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if info is not None and host and port:
            host = f"[{host}]" if ":" in host else host
            info = dataclasses.replace(info, server=f"https://{host}:{port}")
    if info is None:
        info = kopf.login_with_kubeconfig(settings=settings)
    if info is None:
        raise RuntimeError("no Kubernetes credentials: neither a kubeconfig nor a ServiceAccount")
    return info


class Kube:
    """One aiohttp session to the API server (re-created every RELOGIN_S)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        self._server = ""
        self._since = 0.0

    async def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or time.monotonic() - self._since > RELOGIN_S:
            info = _login()
            if self._session is not None:
                await self._session.close()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
                    headers={**info.as_http_headers(), "User-Agent": FIELD_MANAGER},
                    timeout=aiohttp.ClientTimeout(total=30),
                )
            self._server = info.server.rstrip("/")
            self._since = time.monotonic()
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        url_path: str,
        body: Any = None,
        *,
        ctype: str = "application/json",
        params: Mapping[str, str] | None = None,
    ) -> Any:
        session = await self._get_session()
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": ctype} if data is not None else {}
        async with session.request(
            method, self._server + url_path, data=data, headers=headers, params=params
        ) as r:
            text = await r.text()
            try:
                payload = json.loads(text) if text else None
            except ValueError:
                payload = text
            if r.status >= 400:
                raise ApiError(r.status, payload, f"{method} {url_path}")
            return payload

    # ---- conveniences ----

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return await self.request("GET", path(kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        out = await self.request("GET", path(kind, namespace), params={"labelSelector": label_selector})
        return list(out.get("items") or [])

    async def apply(self, manifest: Mapping[str, Any]) -> dict:
        """Server-side apply under the operator's field manager, taking over conflicting fields."""
        meta = manifest["metadata"]
        return await self.request(
            "PATCH",
            path(manifest["kind"], meta["namespace"], meta["name"]),
            manifest,
            ctype=APPLY,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
        )

    async def create(self, manifest: Mapping[str, Any]) -> dict:
        meta = manifest["metadata"]
        return await self.request(
            "POST",
            path(manifest["kind"], meta["namespace"]),
            manifest,
            params={"fieldManager": FIELD_MANAGER},
        )

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        """Delete (with a UID precondition when given); False when already gone."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self.request("DELETE", path(kind, namespace, name), body)
            return True
        except ApiError as e:
            if e.status in (404, 409):
                return False
            raise

    async def patch(self, kind: str, namespace: str, name: str, body: Any, *, ctype: str, sub=None) -> Any:
        return await self.request(
            "PATCH",
            path(kind, namespace, name, sub),
            body,
            ctype=ctype,
            params={"fieldManager": FIELD_MANAGER},
        )
