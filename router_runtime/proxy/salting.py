"""Tenant cache salts (``--tenant-cache-salt``): every prompt-bearing request's ``cache_salt`` is derived
from its tenant, so no engine serves one tenant's cached blocks to another (pure).

vLLM mixes ``cache_salt`` into a prompt's first block hash (SGLang keys its tree by it), so two requests
share cached blocks only when their salts are equal. A client could otherwise choose its salt, or leave
it out, and share (or probe) another tenant's cache. The derived salt keeps a client's own salt as a
namespace inside its tenant: ``rf`` and 32 hex digits of a digest of (tenant, the client's salt), within
vLLM's rules for a salt (at most 128 characters, none of ``@ / \\`` or NUL). The router's prediction
matches under the salt the engine will see: the body is salted before it is scheduled.
"""

from __future__ import annotations

import hashlib
from typing import Any

from .rewrite import with_member

_DOMAIN = b"routerfleet/cache-salt/v1\x00"


def tenant_salt(tenant: str, own: str | None) -> str:
    """The salt a request of ``tenant`` (sessions/keys.py's digest) carries, given the client's own."""
    h = hashlib.blake2b(_DOMAIN, digest_size=16)
    h.update(tenant.encode() + b"\x00")
    if own is not None:
        h.update(b"\x01" + own.encode("utf-8", "surrogatepass"))
    return "rf" + h.hexdigest()


def salted(raw: bytes, body: Any, tenant: str) -> tuple[bytes, Any]:
    """``raw`` and ``body`` with ``cache_salt`` set to the tenant's (rewrite.py). A body that is not a JSON
    object is left as it is, for the request parser's 400."""
    if not isinstance(body, dict):
        return raw, body
    own = body.get("cache_salt")
    if own is not None and not isinstance(own, str):
        return raw, body  # the request's own 400 names the field (request.py)
    return with_member(raw, body, "cache_salt", tenant_salt(tenant, own))
