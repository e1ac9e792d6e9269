"""The functional core: classify a request's session once and promote its remembered target (pure).

new        no eligible key, or nothing remembered for it (and no trusted hint)
stale      something is remembered, but that engine is gone, has another incarnation (it
           restarted: its cache is empty), or is not a candidate now (breaker open, or a rank the
           current targets do not have)
returning  the remembered engine is a candidate: it moves to the front of the candidate order for
           this request only, and the policy is told to prefer it (``RouteRequest.prefer``); the
           policy's load guard still decides (docs/sessions.md, "The promotion rule"); it is
           ``vouched`` when the index saw it evict nothing since the memory was written
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..scheduling.types import Target
from ..worker import Carrier
from .store import Remembered


class SessionState(enum.StrEnum):
    NEW = "new"
    STALE = "stale"
    RETURNING = "returning"


class Selection(enum.StrEnum):
    """Where a classified request went: its remembered engine, or wherever the policy chose."""

    REMEMBERED = "remembered"
    POLICY = "policy"


@dataclass(frozen=True, slots=True)
class Classified:
    state: SessionState
    preferred: Target | None = None  # set iff returning
    # The remembered target kept everything since it served the session's last turn: the index has
    # seen no eviction there since (or never any). Only then may kv_aware credit it the whole prefix.
    vouched: bool = False


def classify(
    memory: Remembered | None,
    candidates: Sequence[Target],
    incarnations: Mapping[str, str],
    *,
    since: float | None = None,
    evicted_at: Mapping[Carrier, float] | None = None,
) -> Classified:
    """``incarnations``: engine -> incarnation of every engine this replica knows (healthy or not).
    ``since``: when the memory was written (None: unknown, a hint or a remote store); ``evicted_at``:
    carrier -> when the index last saw it evict (the writer's record), on the same clock."""
    if memory is None:
        return Classified(SessionState.NEW)
    if incarnations.get(memory.engine) != memory.incarnation:
        return Classified(SessionState.STALE)  # gone, or restarted since
    fallback = None
    for t in candidates:
        if t.engine == memory.engine:
            if t.rank == memory.rank:
                return Classified(SessionState.RETURNING, t, vouched(t, since, evicted_at))
            if fallback is None and (memory.rank is None or t.rank is None):
                # Remembered as a whole engine and now targeted per rank (or the reverse): the engine
                # still holds the prefix on one of its ranks; its first target is the best guess.
                fallback = t
    if fallback is not None:  # a guess of the rank: preferred, never credited beyond the index
        return Classified(SessionState.RETURNING, fallback, False)
    return Classified(SessionState.STALE)


def vouched(target: Target, since: float | None, evicted_at: Mapping[Carrier, float] | None) -> bool:
    """Whether the remembered target still holds all it held when it served the session: it never
    evicted, or only before the memory was written. Under memory pressure an engine evicts LRU blocks
    all the time, and a conversation's history is what goes; trusting the memory over the index there
    sends turns to an engine that no longer has their prefix (the affinity bench measured exactly that)."""
    at = evicted_at.get(target.carrier) if evicted_at else None
    return at is None or (since is not None and at < since)


def promote(candidates: Sequence[Target], preferred: Target | None) -> tuple[Target, ...]:
    """The candidate order for one request: ``preferred`` first, the rest in their order."""
    if preferred is None:
        return tuple(candidates)
    return (preferred, *(t for t in candidates if t != preferred))


def selection(classified: Classified, chosen: Target) -> Selection:
    p = classified.preferred
    return Selection.REMEMBERED if p is not None and chosen == p else Selection.POLICY
