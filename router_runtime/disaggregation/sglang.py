"""SGLang's disaggregated serving on the wire (pure): one request, sent to the prefill and the decode
engine at once, carrying the same bootstrap room, as SGLang's own load balancer sends it.

    both legs:  the client's body with ``bootstrap_host`` (the prefill engine's host),
                ``bootstrap_port`` (its KV bootstrap server's port: ``--disaggregation-bootstrap-port``)
                and ``bootstrap_room`` (a random 63-bit id pairing the two)
    prefill:    computes the prompt and sends its KV to whoever joins the room; its answer is drained
    decode:     joins the room, takes the KV and generates; its answer goes to the client

A decode engine (``--disaggregation-mode decode``) cannot prefill by itself: every request it takes
needs a room, so the decider's threshold does not apply. A client's own bootstrap fields never reach an
engine (they would pair a decode engine with a prefill engine of the client's choosing).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from ..proxy.rewrite import with_member, without_member
from ..scheduling.types import Kind

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
KINDS = frozenset({Kind.COMPLETION, Kind.CHAT, Kind.GENERATE})
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


@dataclass(frozen=True, slots=True)
class Room:
    host: str
    port: int
    room: int

    @classmethod
    def new(cls, host: str, port: int) -> Room:
        return cls(host, port, secrets.randbits(63))


def without_bootstrap(raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The body without any bootstrap field of the client's."""
    for name in FIELDS:
        raw, body = without_member(raw, body, name)
    return raw, body


def with_room(raw: bytes, body: dict[str, Any], room: Room) -> bytes:
    """Both legs' body: the client's (without its own bootstrap fields) with ``room``."""
    raw, body = without_bootstrap(raw, body)
    for name, value in zip(FIELDS, (room.host, room.port, room.room), strict=True):
        raw, body = with_member(raw, body, name, value)
    return raw
