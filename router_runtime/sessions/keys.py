"""Session keys (pure). Only explicit keys are eligible: the OpenAI ``prompt_cache_key`` and
``conversation_id`` body fields and one configurable request header. A request without any is new and
routed as before; nothing is derived from the prompt.

A key is only ever kept as ``digest``: SHA-256 over the length-prefixed (source, model, key), so two
sources or two models never share an entry, and the raw key is neither stored nor logged.

With a tenant header configured (``--tenant-header``), every session key and response id is scoped to
its tenant (``tenant_of``: a digest of that header's value) as well: another tenant's id or key finds
nothing. Without one the tenant is empty and the digests are those of a router without tenants.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Any

MAX_KEY_BYTES = 4096  # longer keys are not eligible (not a session id anyone sends)
_DOMAIN = b"routerfleet/session/v1"
_RESPONSE_DOMAIN = b"routerfleet/response/v1"
_TENANT_DOMAIN = b"routerfleet/tenant/v1"


class KeySource(enum.StrEnum):
    PROMPT_CACHE_KEY = "prompt_cache_key"
    CONVERSATION_ID = "conversation_id"
    CONVERSATION = "conversation"  # the Responses API's: an id, or {"id": ...}
    USER_ID = "metadata.user_id"  # Anthropic's Messages API: only where the operator opts in
    HEADER = "header"


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def tenant_of(headers: Mapping[str, str], header: str | None) -> str:
    """The request's tenant: a digest of ``header``'s value ("" without a tenant header configured; an
    absent header is a tenant of its own, not every tenant's)."""
    if not header:
        return ""
    value = headers.get(header, "")
    return hashlib.sha256(_TENANT_DOMAIN + value.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _scoped(h, tenant: str) -> bytes:
    if tenant:
        h.update(_lp(tenant.encode()))
    return h.digest()


def digest(source: KeySource | str, model: str, key: str, tenant: str = "") -> bytes:
    """SHA-256 of the length-prefixed (source, model, key[, tenant]); 32 bytes."""
    h = hashlib.sha256(_DOMAIN)
    for part in (str(source), model, key):
        h.update(_lp(part.encode("utf-8", "surrogatepass")))
    return _scoped(h, tenant)


def response_digest(response_id: str, tenant: str = "") -> bytes:
    """A Responses API id's key in the binding table and the shared store; 32 bytes."""
    return _scoped(
        hashlib.sha256(_RESPONSE_DOMAIN + _lp(response_id.encode("utf-8", "surrogatepass"))), tenant
    )


def _usable(v: Any) -> str | None:
    if isinstance(v, str) and v and len(v.encode("utf-8", "surrogatepass")) <= MAX_KEY_BYTES:
        return v
    return None


def _body_key(body: dict, source: KeySource) -> str | None:
    if source is KeySource.CONVERSATION:
        v = body.get("conversation")
        return _usable(v.get("id") if isinstance(v, dict) else v)
    if source is KeySource.USER_ID:
        meta = body.get("metadata")
        return _usable(meta.get("user_id")) if isinstance(meta, dict) else None
    return _usable(body.get(source.value))


def session_digest(
    body: Any, headers: Mapping[str, str], header: str | None, user_ids: bool = False, tenant: str = ""
) -> bytes | None:
    """The request's session digest, or None when it carries no eligible key. Precedence:
    ``prompt_cache_key``, ``conversation_id``, the Responses API's ``conversation``, Anthropic's
    ``metadata.user_id`` (with ``user_ids``: a user may hold several conversations), then the header.
    Never raises: a malformed key makes the request ineligible, not invalid."""
    model = ""
    if isinstance(body, dict):
        m = body.get("model")
        model = m if isinstance(m, str) else ""
        sources = [KeySource.PROMPT_CACHE_KEY, KeySource.CONVERSATION_ID, KeySource.CONVERSATION]
        for source in sources + [KeySource.USER_ID] * user_ids:
            key = _body_key(body, source)
            if key is not None:
                return digest(source, model, key, tenant)
    if header:
        key = _usable(headers.get(header))
        if key is not None:
            return digest(KeySource.HEADER, model, key, tenant)
    return None
