"""The load scorer: one in-flight request costs as much as prefilling ``load_cost_tokens`` uncached
tokens, in blocks (``load_cost_tokens / block_size`` per request), so it trades against the prefix
scorer's credit: a cached block saves its prefill. Without tokens or an index there is no block to
price in, and it says nothing (the picker then balances by load alone)."""

from __future__ import annotations

from .framework import Cycle, Scores


class LoadCost:
    name = "load_cost"

    def __init__(self, load_cost_tokens: float = 256.0) -> None:
        self.load_cost_tokens = load_cost_tokens

    def score(self, cycle: Cycle) -> Scores:
        index = cycle.index
        if index is None or not cycle.request.tokens:
            return Scores()
        per_request = self.load_cost_tokens / index.block_size
        return Scores([per_request * load for load in cycle.loads])
