"""Holding a rank's batches while its bootstrap decides what to graft beneath them.

The subscription starts first, so no batch can fall between a peer's export and our first receipt;
until the rank's bootstrap resolves, its batches wait here instead of reaching the writer. Bounded in
count and bytes: overflow discards the held prefix and the rank resumes live, cold (replaying a
discontiguous prefix would be worse than resuming).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable

from .events import SequencedBatch


class HoldEnd(enum.StrEnum):
    """Why a hold ended without a graft deciding it; reported to the bootstrap."""

    OVERFLOW = "overflow"
    PUBLISHER_RESET = "publisher_reset"  # the rank was cleared (restart, uncovered gap, bad batch)


class RankHold:
    def __init__(
        self,
        *,
        max_batches: int = 50_000,
        max_bytes: int = 256 << 20,
        on_end: Callable[[HoldEnd], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.on_end = on_end
        self.since = clock()  # holding_since: a snapshot built before this cannot cover our stream
        self.active = True
        self.watermark: int | None = None  # after a graft with nothing held: the seq to prove
        self._batches: deque[SequencedBatch] = deque()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._batches)

    def add(self, batch: SequencedBatch) -> None:
        if len(self._batches) >= self.max_batches or self._bytes + batch.nbytes > self.max_bytes:
            self.end(HoldEnd.OVERFLOW)
            return
        self._batches.append(batch)
        self._bytes += batch.nbytes

    def take(self) -> list[SequencedBatch]:
        out = list(self._batches)
        self._batches.clear()
        self._bytes = 0
        return out

    def abandon(self) -> list[SequencedBatch]:
        """Its owner is done with it: it holds nothing more, and hands back what it held, in order, to
        apply or judge (an ended hold hands back nothing: ``end`` dropped it)."""
        self.active = False
        return self.take()

    def take_over_restart(self) -> bool:
        """The rank's publisher restarted its sequence while held. False: the rank is cleared as usual
        (a bootstrap's hold). An owner that judges a new process itself (warm re-adoption) says True
        and keeps the rank's new stream held until it decides."""
        return False

    def end(self, why: HoldEnd) -> None:
        """The hold is over without a graft: drop what it held (the rank is empty in the index, so
        dropping loses only blocks, never adds any) and let the bootstrap know."""
        if not self.active:
            return
        self.active = False
        self.take()
        if self.on_end is not None:
            self.on_end(why)
