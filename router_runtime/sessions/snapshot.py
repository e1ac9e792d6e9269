"""The session table in the peer snapshot envelope (``bootstrap/wire.py``'s ``sessions`` field)."""

from __future__ import annotations

from collections.abc import Iterable

from ..bootstrap.wire import WireSession
from .store import Entry, Remembered


def to_wire(entries: Iterable[Entry]) -> list[WireSession]:
    return [
        WireSession(e.digest, e.value.engine, e.value.rank, e.value.incarnation, int(e.age_s * 1000))
        for e in entries
    ]


def from_wire(sessions: Iterable[WireSession]) -> list[Entry]:
    return [Entry(s.digest, Remembered(s.engine, s.rank, s.incarnation), s.age_ms / 1000) for s in sessions]
