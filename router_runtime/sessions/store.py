"""Where a session's last engine is remembered.

``SessionStore`` is the small async interface the proxy talks to; the proxy enforces the lookup
deadline itself, so any implementation (a remote one included) can be slow or fail without delaying
a request beyond it. ``LocalStore`` is the default: an in-process LRU with a TTL and an entry bound,
whose operations are synchronous and O(1) (the async methods wrap them; ``get_nowait`` lets the
proxy skip a task for it).

Values are ``Remembered`` (engine identity, DP rank, incarnation), bounded in size; keys are 32-byte
digests (``keys.digest``), never raw keys.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

MAX_ENGINE_BYTES = 512
MAX_INCARNATION_BYTES = 256


@dataclass(frozen=True, slots=True)
class Remembered:
    """The engine that served a session's last 2xx response."""

    engine: str
    rank: int | None
    incarnation: str

    def fits(self) -> bool:
        return (
            len(self.engine.encode()) <= MAX_ENGINE_BYTES
            and len(self.incarnation.encode()) <= MAX_INCARNATION_BYTES
            and (self.rank is None or 0 <= self.rank < 1 << 16)
        )


@dataclass(frozen=True, slots=True)
class Entry:
    """One exported entry (the peer snapshot carries these)."""

    digest: bytes
    value: Remembered
    age_s: float


class SampledWarnings:
    """A store's warnings, at most one per ``every_s`` (a sick store must not flood the log), each
    saying what the request did instead (``instead``)."""

    def __init__(self, logger: logging.Logger, instead: str, every_s: float = 10.0) -> None:
        self._log, self._instead, self._every_s = logger, instead, every_s
        self._last = -every_s

    def __call__(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last >= self._every_s:
            self._last = now
            self._log.warning("%s; %s", message, self._instead)


def settle_quietly(task: asyncio.Task) -> None:
    """A done-callback for a lookup abandoned at its deadline: its late failure is not an error."""
    if not task.cancelled():
        task.exception()


class SessionStore(Protocol):
    async def get(self, digest: bytes) -> Remembered | None: ...

    async def put(self, digest: bytes, value: Remembered) -> None: ...


class LocalStore:
    """LRU + TTL. An entry lives ``ttl_s`` from its last write (reads refresh its LRU position, not its
    TTL); beyond ``max_entries`` the least recently used goes. Expired entries are dropped when read,
    and a few at a time from the LRU end on every write, so the table never grows past the bound."""

    def __init__(
        self,
        *,
        ttl_s: float = 600.0,
        max_entries: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if ttl_s <= 0 or max_entries <= 0:
            raise ValueError("ttl_s and max_entries must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._on_evict = on_evict or (lambda _reason: None)
        # digest -> (value, written_at)
        self._d: OrderedDict[bytes, tuple[Remembered, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get_nowait(self, digest: bytes) -> Remembered | None:
        item = self._d.get(digest)
        if item is None:
            return None
        value, at = item
        if self._clock() - at >= self.ttl_s:
            del self._d[digest]
            self._on_evict("ttl")
            return None
        self._d.move_to_end(digest)
        return value

    def written_at(self, digest: bytes) -> float | None:
        """When the entry was last written (this store's clock), without touching its LRU position."""
        item = self._d.get(digest)
        return item[1] if item is not None else None

    def put_nowait(self, digest: bytes, value: Remembered, *, written_at: float | None = None) -> None:
        d = self._d
        d[digest] = (value, self._clock() if written_at is None else written_at)
        d.move_to_end(digest)
        self._trim()

    def _trim(self) -> None:
        d = self._d
        now = self._clock()
        for _ in range(2):  # expired entries at the LRU end go first
            if not d:
                break
            k, (_v, at) = next(iter(d.items()))
            if now - at < self.ttl_s:
                break
            del d[k]
            self._on_evict("ttl")
        while len(d) > self.max_entries:
            d.popitem(last=False)
            self._on_evict("capacity")

    async def get(self, digest: bytes) -> Remembered | None:
        return self.get_nowait(digest)

    async def put(self, digest: bytes, value: Remembered) -> None:
        self.put_nowait(digest, value)

    def entries(self) -> list[Entry]:
        """Live entries, least recently used first, with their age (for the peer snapshot)."""
        now = self._clock()
        return [Entry(k, v, now - at) for k, (v, at) in self._d.items() if now - at < self.ttl_s]

    def inherit(self, entries: Iterable[Entry]) -> int:
        """Take a sibling's entries (vetted), oldest first; an entry we already hold wins (ours is at
        least as fresh as anything a sibling saw before we booted). Returns how many were added."""
        now = self._clock()
        added = 0
        for e in sorted(entries, key=lambda e: -e.age_s):
            if e.digest in self._d or not 0 <= e.age_s < self.ttl_s or not e.value.fits():
                continue
            self._d[e.digest] = (e.value, now - e.age_s)
            self._d.move_to_end(e.digest)
            added += 1
        self._trim()
        return added
