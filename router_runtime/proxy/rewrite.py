"""The router's edits to a client's JSON body (pure): one member set (a tenant's ``cache_salt``, a
stream's ``stream_options``, a remote prefill's ``kv_transfer_params``), the rest as the client sent it.

A member the body lacks goes in as bytes right after its opening brace, so every other byte reaches the
engine unchanged; a body that already has it is re-encoded (JSON parsers disagree on which of two equal
keys wins), as is a body in a non-ASCII-compatible encoding (UTF-16/32: json accepts those, and an ASCII
insert would corrupt them).
"""

from __future__ import annotations

import json
from typing import Any


def insertable(raw: bytes) -> bool:
    """Whether a member can go in as bytes after ``raw``'s opening brace."""
    start = len(raw) - len(raw.lstrip())
    return raw[start : start + 1] == b"{" and b"\x00" not in raw[:4]


def with_member(raw: bytes, body: dict[str, Any], name: str, value: Any) -> tuple[bytes, dict[str, Any]]:
    """``raw`` and ``body`` with ``body[name] = value``."""
    new = {**body, name: value}
    if name not in body and body and insertable(raw):
        start = len(raw) - len(raw.lstrip())
        member = json.dumps({name: value}, ensure_ascii=False, separators=(",", ":")).encode()[1:-1]
        return raw[: start + 1] + member + b"," + raw[start + 1 :], new
    return encode(new), new


def without_member(raw: bytes, body: dict[str, Any], name: str) -> tuple[bytes, dict[str, Any]]:
    """``raw`` and ``body`` without ``name`` (unchanged when it is absent)."""
    if name not in body:
        return raw, body
    new = {k: v for k, v in body.items() if k != name}
    return encode(new), new


def encode(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8")
