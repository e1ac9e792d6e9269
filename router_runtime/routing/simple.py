"""Cache-blind policies: round robin, least loaded, power of two choices. Baselines, and the fallback
for deployments without KV events or tokenization.

A returning session (``request.prefer``, docs/sessions.md): round robin takes the remembered target
unless the imbalance guard (the same thresholds as the cache-aware policies) trips and it is not among
the least loaded; least loaded takes it when it is among the least loaded; power of two draws it as
one of the two (the lower load wins, a tie goes to it). The round-robin cursor does not move for it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ..kv.index import RadixIndex
from .load import imbalanced, least_loaded_indices, load_list, pick, preferred_index
from .types import Decision, KeepsNoTargetState, Reason, RouteRequest, Target


class RoundRobinPolicy(KeepsNoTargetState):
    """Targets in turn. The cursor is an index into whatever list is passed, so a changed target list
    resumes at the same position modulo its length."""

    name = "round_robin"
    needs_tokens = False
    needs_text = False

    def __init__(self, *, balance_abs_threshold: int = 16, balance_rel_threshold: float = 1.5) -> None:
        self._next = 0
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Decision:
        p = preferred_index(targets, request.prefer)
        if p is not None:
            lv = load_list(targets, loads)
            if not imbalanced(lv, self.balance_abs_threshold, self.balance_rel_threshold):
                return Decision(targets[p], Reason.SESSION)
            tied = least_loaded_indices(lv)
            i = pick(tied, p)
            return Decision(targets[tied[0] if i is None else i], Reason.IMBALANCED)
        i = self._next % len(targets)
        self._next = i + 1
        return Decision(targets[i], Reason.ROUND_ROBIN)


class LeastLoadedPolicy(KeepsNoTargetState):
    """The fewest in-flight requests. Ties rotate: the k-th decision takes tied[k % len(tied)], so at
    low concurrency (everything at 0) it degrades to round robin rather than always the first target."""

    name = "least_loaded"
    needs_tokens = False
    needs_text = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Decision:
        tied = least_loaded_indices(load_list(targets, loads))
        i = pick(tied, preferred_index(targets, request.prefer))
        if i is not None:
            return Decision(targets[i], Reason.LEAST_LOADED)
        i = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(targets[i], Reason.LEAST_LOADED)


class PowerOfTwoPolicy(KeepsNoTargetState):
    """Two distinct targets drawn at random; the lower load wins, the first drawn on a tie. Inject a
    seeded ``random.Random`` for reproducible decisions."""

    name = "power_of_two"
    needs_tokens = False
    needs_text = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, float],
        index: RadixIndex | None,
    ) -> Decision:
        n = len(targets)
        if n == 1:
            return Decision(targets[0], Reason.POWER_OF_TWO)
        p = preferred_index(targets, request.prefer)
        if p is not None:  # the remembered target and one other at random; a tie keeps it
            j = self.rng.randrange(n - 1)
            i, j = p, j + (j >= p)
        else:
            i, j = self.rng.sample(range(n), 2)
        a, b = targets[i], targets[j]
        return Decision(b if loads.get(b, 0) < loads.get(a, 0) else a, Reason.POWER_OF_TWO)
