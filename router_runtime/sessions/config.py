"""Session-affinity configuration; defaults follow the design (docs/sessions.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


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
