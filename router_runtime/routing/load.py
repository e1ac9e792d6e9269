"""Load helpers shared by the policies: the imbalance guard and least-loaded picks.

Loads are the fleet's in-flight request counts per target (missing = 0; fleet/view.py), read once per decision
into a list parallel to ``targets``; everything here is O(targets).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .types import Target


def load_list(targets: Sequence[Target], loads: Mapping[Target, float]) -> list[float]:
    get = loads.get
    return [get(t, 0) for t in targets]


def imbalanced(lv: Sequence[int], abs_threshold: float, rel_threshold: float) -> bool:
    """sglang-router's guard: the spread is large in absolute terms *and* relative to the least loaded.
    Both must hold, so a small absolute gap at low load (1 vs 3) and a large one at high load (100 vs
    120) both count as balanced."""
    lo = min(lv)
    hi = max(lv)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


def least_loaded_indices(lv: Sequence[int], among: Sequence[int] | None = None) -> list[int]:
    """Indices (into ``lv``) of the least-loaded targets, in target order; ``among`` restricts them."""
    idx = range(len(lv)) if among is None else among
    best = min(lv[i] for i in idx)
    return [i for i in idx if lv[i] == best]


def preferred_index(targets: Sequence[Target], prefer: Target | None) -> int | None:
    """Index of a returning session's remembered target among ``targets`` (None: no preference)."""
    if prefer is None:
        return None
    for i, t in enumerate(targets):
        if t == prefer:
            return i
    return None


def pick(tied: Sequence[int], p: int | None) -> int | None:
    """The preferred index when it is among ``tied`` (a tie goes to the remembered target)."""
    return p if p is not None and p in tied else None
