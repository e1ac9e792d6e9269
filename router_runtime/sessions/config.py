"""The sessions package's configuration sections and their flags: session affinity
(``RouterConfig.sessions``), the fleet-shared store (``.store``) and response bindings (``.responses``,
a ``bindings.BindingConfig``); defaults follow the design (docs/sessions.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..flags import Count, Flag, Ms, Switch, Text
from .redis_store import store_url


@dataclass(frozen=True, slots=True)
class SessionConfig:
    enabled: bool = False  # off: no lookups, no writes, no engine-id header; hints are still stripped
    ttl_s: float = 600.0  # an entry lives this long after its last write
    max_entries: int = 100_000  # local store bound (LRU beyond it)
    lookup_timeout_s: float = 0.02  # hard deadline of one lookup; past it the request is "new"
    write_timeout_s: float = 1.0  # bound on a background write to a non-local store
    key_header: str = "x-session-id"  # request header carrying a session id ("" to disable)
    engine_header: str = "X-RouterFleet-Engine-Id"  # response header: the serving engine's opaque id
    hint_header: str = "X-RouterFleet-Last-Engine"  # request header: an echoed engine id
    trust_hints: bool = False  # use inbound hints (else they are only stripped)
    user_ids: bool = False  # Anthropic's metadata.user_id is a session key (one user, one conversation)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not (math.isfinite(v) and v > 0):
                raise ValueError(f"session config {f.name}={v!r}: must be a positive number")
        if self.max_entries <= 0:
            raise ValueError(f"session config max_entries={self.max_entries!r}: must be positive")
        for name in ("engine_header", "hint_header"):
            v = getattr(self, name)
            if not v or not all(c.isalnum() or c in "-_" for c in v):
                raise ValueError(f"session config {name}={v!r}: must be a header name")
        if self.key_header and not all(c.isalnum() or c in "-_" for c in self.key_header):
            raise ValueError(f"session config key_header={self.key_header!r}: must be a header name")
        if len({self.key_header.lower(), self.engine_header.lower(), self.hint_header.lower()}) != 3:
            raise ValueError("session config: the key, engine-id and hint headers must differ")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """The fleet-shared store of sessions and response bindings (redis://, rediss:// or unix://), and
    its password's file; None: each replica's own memory."""

    url: str | None = None
    password_file: str | None = None


FLAGS = (
    Flag(
        "--session-affinity",
        "sessions.enabled",
        Switch(),
        "remember each explicit session's engine and send its next turn there",
    ),
    Flag(
        "--session-ttl-ms",
        "sessions.ttl_s",
        Ms(1),
        "a session's engine is remembered this long after its last 2xx",
    ),
    Flag(
        "--session-max-entries",
        "sessions.max_entries",
        Count(1),
        "sessions remembered per replica, LRU beyond",
    ),
    Flag(
        "--session-lookup-timeout-ms",
        "sessions.lookup_timeout_s",
        Ms(1, 1_000),
        "hard deadline of a session lookup; past it the request is routed as new",
    ),
    Flag(
        "--session-header",
        "sessions.key_header",
        Text(),
        metavar="NAME",
        help="request header carrying a session id, besides the prompt_cache_key and conversation_id"
        " body fields; '' for none",
    ),
    Flag(
        "--session-engine-header",
        "sessions.engine_header",
        Text(),
        metavar="NAME",
        help="response header with the serving engine's opaque id",
    ),
    Flag(
        "--session-hint-header",
        "sessions.hint_header",
        Text(),
        metavar="NAME",
        help="request header echoing that id back; always stripped before proxying",
    ),
    Flag(
        "--session-store",
        "store.url",
        Text(store_url),
        metavar="URL",
        default_text="each replica's own memory",
        help="the fleet-shared store of session memory and response bindings (Redis or Valkey:"
        " redis://host:6379/0, rediss://..., unix:///path)",
    ),
    Flag(
        "--session-store-password-file",
        "store.password_file",
        Text(),
        metavar="PATH",
        help="file holding the store's password (a mounted Secret)",
    ),
    Flag(
        "--session-user-ids",
        "sessions.user_ids",
        Switch(negatable=False),
        "treat an Anthropic request's metadata.user_id as its session key (where each user holds one"
        " conversation at a time)",
    ),
    Flag(
        "--session-trust-hints",
        "sessions.trust_hints",
        Switch(negatable=False),
        "use inbound hint headers to classify a session (only behind a gateway that sets them)",
    ),
)

RESPONSE_FLAGS = (
    Flag(
        "--response-ttl-ms",
        "responses.ttl_s",
        Ms(1),
        "how long a response id stays bound to its engine",
    ),
    Flag(
        "--response-max-entries",
        "responses.max_entries",
        Count(1),
        "response bindings kept per replica, LRU beyond",
    ),
    Flag(
        "--response-probe-timeout-ms",
        "responses.probe_timeout_s",
        Ms(0, 60_000),
        "deadline for asking the engines which holds a response no table knows",
        zero="never ask",
    ),
)
