"""Pickers: one target from the scored candidates, and the reason. The three rules every profile shares
live here, once:

- the imbalance guard (sglang-router's): when the loads are skewed, the least loaded, whatever the scores;
- the session preference (docs/sessions.md, "The promotion rule"): every tie the returning session's
  remembered target is part of goes to it;
- tie spreading: among targets still tied, a hash of the request (new conversations spread over the
  fleet at low concurrency) or target order.

Loads are the fleet's in-flight counts per candidate (``Cycle.loads``, fleet/view.py); all O(candidates).
"""

from __future__ import annotations

import enum
import random
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

from .framework import Choice, Cycle, Evidence, Scored
from .types import Reason, Target

_h = xxhash.xxh3_64_intdigest
_TIE_HASH_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Guard:
    """The imbalance guard: skewed when the spread is large in absolute terms *and* relative to the
    least loaded. Both must hold, so a small gap at low load (1 vs 3) and a large one at high load (100
    vs 120) both count as balanced."""

    abs_threshold: float = 16
    rel_threshold: float = 1.5

    def skewed(self, loads: Sequence[float]) -> bool:
        lo = min(loads)
        hi = max(loads)
        return hi - lo > self.abs_threshold and hi > lo * self.rel_threshold


class Ties(enum.Enum):
    FIRST = "first"  # target order
    SPREAD = "spread"  # a hash of the request's tokens


def least_loaded(loads: Sequence[float], among: Sequence[int] | None = None) -> list[int]:
    """Indices of the least-loaded candidates, in target order; ``among`` restricts them."""
    idx = range(len(loads)) if among is None else among
    best = min(loads[i] for i in idx)
    return [i for i in idx if loads[i] == best]


def preferred(tied: Sequence[int], p: int | None) -> int | None:
    """The remembered target when it is among ``tied`` (a tie goes to it)."""
    return p if p is not None and p in tied else None


def request_hash(tokens: Sequence[int] | None) -> int:
    """A stable (cross-process, cross-replica) hash of a request, for tie-breaking: its length and last
    256 tokens, where conversations differ (the latest turn), in a few microseconds whatever the length
    (hashing all of an 8k-token prompt would cost ~175 us)."""
    if not tokens:
        return 0
    tail = tokens[-_TIE_HASH_TOKENS:]
    try:
        return _h(array("q", tail), seed=len(tokens))
    except (OverflowError, TypeError):
        return hash((len(tokens), *tail)) & 0xFFFF_FFFF_FFFF_FFFF


# What the winner's evidence makes the decision's reason (none: load decided among equals).
_REASONS = {
    Evidence.CACHED: Reason.PREFIX,
    Evidence.INFLIGHT: Reason.INFLIGHT,
    Evidence.SESSION: Reason.SESSION,
}


def _settle(cycle: Cycle, tied: Sequence[int], ties: Ties) -> int:
    i = preferred(tied, cycle.prefer)
    if i is not None:
        return i
    if ties is Ties.SPREAD and len(tied) > 1:
        return tied[request_hash(cycle.request.tokens) % len(tied)]
    return tied[0]


class LowestCost:
    """The lowest summed cost wins; among equal costs the least loaded, then the session's target, then
    ``ties``. Skewed loads (``guard``): the least loaded, whatever the costs. The reason says what won:
    a cached prefix, the session's memory alone, a lower cost (load, evictions) over someone else's
    prefix, or no prefix anywhere."""

    name = "lowest_cost"

    def __init__(self, guard: Guard | None, ties: Ties = Ties.FIRST) -> None:
        self.guard = guard
        self.ties = ties

    def pick(self, cycle: Cycle, scored: Scored) -> Choice:
        loads = cycle.loads
        if self.guard is not None and self.guard.skewed(loads):
            return Choice(_settle(cycle, least_loaded(loads), self.ties), Reason.IMBALANCED)
        costs = scored.costs
        if costs is None:
            tied = least_loaded(loads)
        else:
            best = min(costs)
            tied = least_loaded(loads, [i for i, c in enumerate(costs) if c == best])
        i = _settle(cycle, tied, self.ties)
        evidence = scored.evidence
        if evidence is None:
            return Choice(i, Reason.NO_MATCH)
        held = evidence[i]
        reason = _REASONS.get(held, Reason.LEAST_LOADED)
        return Choice(i, reason)


class RoundRobin:
    """Candidates in turn. The cursor is an index into whatever list is passed, so a changed candidate
    list resumes at the same position modulo its length. A returning session takes its remembered
    target unless the guard trips (then the least loaded, a tie to it); the cursor does not move."""

    name = "round_robin"

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._next = 0

    def pick(self, cycle: Cycle, scored: Scored) -> Choice:
        p = cycle.prefer
        if p is not None:
            if not self.guard.skewed(cycle.loads):
                return Choice(p, Reason.SESSION)
            return Choice(_settle(cycle, least_loaded(cycle.loads), Ties.FIRST), Reason.IMBALANCED)
        i = self._next % len(cycle.targets)
        self._next = i + 1
        return Choice(i, Reason.ROUND_ROBIN)


class LeastLoaded:
    """The fewest in-flight requests. Ties go to the session's target, else rotate: the k-th decision
    takes tied[k % len(tied)], so at low concurrency (everything at 0) it degrades to round robin rather
    than always the first candidate."""

    name = "least_loaded"

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, cycle: Cycle, scored: Scored) -> Choice:
        tied = least_loaded(cycle.loads)
        i = preferred(tied, cycle.prefer)
        if i is None:
            i = tied[self._turn % len(tied)]
            self._turn += 1
        return Choice(i, Reason.LEAST_LOADED)


class PowerOfTwo:
    """Two distinct candidates drawn at random; the lower load wins, the first drawn on a tie. A
    returning session's target is always one of the two (a tie keeps it). Inject a seeded
    ``random.Random`` for reproducible decisions."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def pick(self, cycle: Cycle, scored: Scored) -> Choice:
        n = len(cycle.targets)
        if n == 1:
            return Choice(0, Reason.POWER_OF_TWO)
        p = cycle.prefer
        if p is not None:
            j = self.rng.randrange(n - 1)
            i, j = p, j + (j >= p)
        else:
            i, j = self.rng.sample(range(n), 2)
        loads = cycle.loads
        return Choice(j if loads[j] < loads[i] else i, Reason.POWER_OF_TWO)


def fallbacks(
    chosen: Target, candidates: Sequence[Target], loads: Mapping[Target, float], n: int
) -> list[Target]:
    """Where a gateway may retry when ``chosen`` cannot be reached: up to ``n`` other endpoints (one target
    each, never the chosen one's), the least loaded first, then in candidate order."""
    seen = {chosen.endpoint}
    out: list[Target] = []
    for t in sorted(candidates, key=lambda t: loads.get(t, 0)):  # stable: candidate order breaks ties
        if t.endpoint not in seen:
            seen.add(t.endpoint)
            out.append(t)
            if len(out) == n:
                break
    return out
