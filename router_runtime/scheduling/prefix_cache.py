"""The KV-aware scorer: what the radix index says each (engine, rank) candidate holds of the request's
prefix that the engine would reuse (reuse.py: never the last token), weighted by tier, as a credit in
blocks (docs/routing.md has the rationale and a worked example):

    credit(t) = device + host_weight * host + disk_weight * disk + external_weight * external   [blocks]

A candidate the index does not know (new, cold, or another rank) gets nothing: never invent. A returning
session's remembered target that is vouched for (``prefer_vouched``: the index saw it evict nothing since
it served the conversation's previous turn) is credited the request's whole reusable prefix (its full
blocks, at device weight) when the index credits it less, because the index may not have seen that turn
yet (events off or lagging); its evidence is then the session's alone if the index credited it nothing.
Once it has evicted, the index is the better witness of what is left.
"""

from __future__ import annotations

from .framework import Cycle, Evidence, Measure, Scores
from .types import Target


class PrefixCache:
    name = "prefix_cache"

    def __init__(self, *, host_weight: float = 0.5, disk_weight: float = 0.25, external_weight: float = 0.1):
        self.host_weight = host_weight
        self.disk_weight = disk_weight
        self.external_weight = external_weight

    def score(self, cycle: Cycle) -> Scores:
        request, index, targets = cycle.request, cycle.index, cycle.targets
        if index is None or not request.tokens:
            return Scores()
        # Only what the engine will reuse counts (its own rules: never the last token); ``total`` is in
        # full blocks of that, so a match is a prediction of the engine's cached tokens.
        total, matches = cycle.prefix_matches()
        if not total:
            return Scores(measure=lambda _t: Measure())

        def measure(t: Target) -> Measure:
            m = matches.get(t.carrier)
            return Measure(total_blocks=total) if m is None else Measure(m.blocks, total, m.tier_blocks)

        credits: list[float] | None = None
        if matches:
            wh, ws, we = self.host_weight, self.disk_weight, self.external_weight
            credits = []
            for t in targets:
                m = matches.get(t.carrier)
                if m is None:
                    credits.append(0.0)
                else:
                    d, h, s, e = m.tier_blocks
                    credits.append(d + wh * h + ws * s + we * e)
            if max(credits) <= 0:
                credits = None
        evidence = None if credits is None else [Evidence.CACHED if c > 0 else Evidence.NONE for c in credits]
        p = cycle.vouched
        if p is not None and (credits is None or credits[p] < total):
            if credits is None:
                credits = [0.0] * len(targets)
                evidence = [Evidence.NONE] * len(targets)
            if credits[p] <= 0:
                evidence[p] = Evidence.SESSION
            credits[p] = float(total)
        if credits is None:
            return Scores(measure=measure)
        return Scores([-c for c in credits], evidence, measure)
