"""Cache-blind policies: round robin, least loaded, power of two choices. Baselines, and the fallback
for deployments without KV events or tokenization."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from ..kv.index import RadixIndex
from .load import least_loaded_indices, load_list
from .types import Decision, Reason, RouteRequest, Target


class RoundRobinPolicy:
    """Targets in turn. The cursor is an index into whatever list is passed, so a changed target list
    resumes at the same position modulo its length."""

    name = "round_robin"
    needs_tokens = False

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, int],
        index: RadixIndex | None,
    ) -> Decision:
        i = self._next % len(targets)
        self._next = i + 1
        return Decision(targets[i], Reason.ROUND_ROBIN)


class LeastLoadedPolicy:
    """The fewest in-flight requests. Ties rotate: the k-th decision takes tied[k % len(tied)], so at
    low concurrency (everything at 0) it degrades to round robin rather than always the first target."""

    name = "least_loaded"
    needs_tokens = False

    def __init__(self) -> None:
        self._turn = 0

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, int],
        index: RadixIndex | None,
    ) -> Decision:
        tied = least_loaded_indices(load_list(targets, loads))
        i = tied[self._turn % len(tied)]
        self._turn += 1
        return Decision(targets[i], Reason.LEAST_LOADED)


class PowerOfTwoPolicy:
    """Two distinct targets drawn at random; the lower load wins, the first drawn on a tie. Inject a
    seeded ``random.Random`` for reproducible decisions."""

    name = "power_of_two"
    needs_tokens = False

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng if rng is not None else random.Random()

    def choose(
        self,
        request: RouteRequest,
        targets: Sequence[Target],
        loads: Mapping[Target, int],
        index: RadixIndex | None,
    ) -> Decision:
        n = len(targets)
        if n == 1:
            return Decision(targets[0], Reason.POWER_OF_TWO)
        i, j = self.rng.sample(range(n), 2)
        a, b = targets[i], targets[j]
        return Decision(b if loads.get(b, 0) < loads.get(a, 0) else a, Reason.POWER_OF_TWO)
