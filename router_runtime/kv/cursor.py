"""Per-rank sequence tracking: the pure decision of what a received sequence number means.

Publishers number batches from 0, +1 per batch, per process; there is no epoch, so a restarted
publisher starts again at 0. The cursor is the last sequence this router applied for the rank.
"""

from __future__ import annotations

import enum


class Arrival(enum.StrEnum):
    FIRST = "first"  # nothing applied yet: we joined mid-stream, start here
    NEXT = "next"  # exactly cursor + 1
    DUPLICATE = "duplicate"  # already applied (a replay overlapping the live stream)
    GAP = "gap"  # batches cursor+1 .. seq-1 were lost: replay them
    RESTART = "restart"  # the sequence went backwards: the publisher restarted, its old state is gone


def classify(cursor: int | None, seq: int, *, live_last: int | None = None) -> Arrival:
    """What ``seq`` means given the ``cursor``. ``live_last`` is the last sequence seen on the live
    stream (None for replayed batches): only a live sequence at or below the previous live one proves a
    restart; live batches at or below the cursor after a replay are the held duplicates of it."""
    if live_last is not None and seq <= live_last:
        return Arrival.RESTART
    if cursor is None:
        return Arrival.FIRST
    if seq <= cursor:
        return Arrival.DUPLICATE
    if seq == cursor + 1:
        return Arrival.NEXT
    return Arrival.GAP
