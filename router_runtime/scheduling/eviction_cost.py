"""The eviction scorer: what a placement pushes out of the engine's cache. A request stores the blocks of
its prompt the engine does not hold; on an engine with free blocks that costs nothing, on a full one each
stored block evicts a cached one (the least recently used), which some later request may have to compute
again. Each block a placement would evict costs ``weight`` device blocks:

    cost(t) = weight * max(0, stores(t) - free(t))    stores(t) = prompt's full blocks - matched on device

``free(t)`` is the index's own count (kv/index.py ``device_free``: the capacity its evictions showed, less
what it holds now). A carrier that has never evicted is not known to be full and costs nothing, so an
empty engine (a new one, one just reset) costs nothing to fill: without this, once the others hold every
common prefix, their credit outweighs any load gap the guard allows and it never warms. Among full engines
the cost is ``weight`` per block not matched, so a prefix held is worth ``1 + weight`` blocks there: a
cached block saves its prefill and the eviction of another.
"""

from __future__ import annotations

from .framework import Cycle, Scores


class EvictionCost:
    name = "eviction_cost"

    def __init__(self, weight: float = 1.0) -> None:
        self.weight = weight

    def score(self, cycle: Cycle) -> Scores:
        request, index = cycle.request, cycle.index
        if index is None or not request.tokens or self.weight <= 0:
            return Scores()
        free = [index.device_free(t.carrier) for t in cycle.targets]
        if all(f is None for f in free):  # nothing known to be full: no cost anywhere
            return Scores()
        blocks = len(request.tokens) // index.block_size
        total, matches = cycle.prefix_matches()
        # A vouched returning session's target holds its whole prefix (prefix_cache.py credits it so).
        vouched = cycle.vouched
        costs = []
        for i, (t, f) in enumerate(zip(cycle.targets, free, strict=True)):
            if f is None:
                costs.append(0.0)
                continue
            m = matches.get(t.carrier)
            held = m.device_blocks if m is not None else 0
            if i == vouched:
                held = max(held, total)
            costs.append(self.weight * max(blocks - held - f, 0))
        return Scores(costs)
