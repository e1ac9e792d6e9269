"""What each sibling last told a plugin (``SharesWithSiblings.accept_peer``), until it ages out.

A replica's load report carries its plugins' shared parts (``fleet/gossip.py``); each part counts here
until the same sibling's next report replaces it, or for ``max_age_s`` at most (a sibling that stopped
reporting is gone). ``version`` moves with every change, so a plugin can keep what it derives from the
parts (a union, an index) until they change.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

Sender = tuple[str, str]  # a sibling process: (replica, incarnation)

P = TypeVar("P")


class Siblings(Generic[P]):
    __slots__ = ("_parts", "version")

    def __init__(self) -> None:
        self._parts: dict[Sender, tuple[float, P]] = {}  # sender -> (counted until, its part)
        self.version = 0

    def put(self, sender: Sender, part: P | None, until: float) -> None:
        """``sender``'s latest part (None or empty: it has nothing to say now), replacing its last."""
        if part:
            self._parts[sender] = (until, part)
        elif self._parts.pop(sender, None) is None:
            return
        self.version += 1

    def expire(self, now: float) -> None:
        gone = [s for s, (until, _) in self._parts.items() if until <= now]
        for sender in gone:
            del self._parts[sender]
        if gone:
            self.version += 1

    def parts(self) -> Iterator[P]:
        """The parts that count, as of the last ``expire``."""
        for _, part in self._parts.values():
            yield part

    def changed(self) -> None:
        """A part was changed in place (``remove_target`` took an engine out of it)."""
        self.version += 1

    def __bool__(self) -> bool:
        return bool(self._parts)
