"""The prompt tokens each target is still to prefill, as this replica sent them: what the decider weighs
when a prefill engine is backed up (decider.py, ``sooner``).

A remote prefill leg counts on its prefill engine from dispatch to its answer; a prompt a decode engine
prefills itself counts there from dispatch to its first byte. Only this replica's requests are counted
(siblings do not report theirs), on both sides alike, so the comparison holds while the fleet's
replicas share the traffic.
"""

from __future__ import annotations

from ..scheduling.types import Target


class Queued:
    """One prompt's place in a target's queue; ``done`` (once, whenever) takes it out."""

    __slots__ = ("_queues", "target", "tokens")

    def __init__(self, queues: PrefillQueues, target: Target, tokens: int) -> None:
        self._queues: PrefillQueues | None = queues
        self.target = target
        self.tokens = tokens

    def done(self) -> None:
        if self._queues is not None:
            self._queues._remove(self.target, self.tokens)
            self._queues = None


class PrefillQueues:
    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: dict[Target, int] = {}

    def add(self, target: Target, tokens: int) -> Queued:
        if tokens > 0:
            self._tokens[target] = self._tokens.get(target, 0) + tokens
        return Queued(self, target, max(tokens, 0))

    def get(self, target: Target) -> int:
        return self._tokens.get(target, 0)

    @property
    def total(self) -> int:
        return sum(self._tokens.values())

    def _remove(self, target: Target, tokens: int) -> None:
        left = self._tokens.get(target, 0) - tokens
        if left > 0:
            self._tokens[target] = left
        else:
            self._tokens.pop(target, None)
