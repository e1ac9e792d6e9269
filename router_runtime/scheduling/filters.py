"""Filters every preset starts with: the request's constraints on where it may go, before any choice.

- ``EndpointSubset``: a gateway may name the endpoints a request may go to (the Endpoint Picker
  protocol's subset hint): the candidates outside it are dropped; none left is Unschedulable.
- ``PinnedTarget``: a request that continues a stored response (``RouteRequest.pinned``) runs where that
  response's context is. That target alone, with the reason ``response`` (nothing was chosen); or none,
  when its engine is not a candidate (down, or failed to connect): the caller says so, nowhere else
  holds it.
- ``PreferredFirst``: a returning session's remembered target first, the rest in their order, so that
  every tie-break by target order sees it first (docs/sessions.md, "The promotion rule").
"""

from __future__ import annotations

from collections.abc import Sequence

from .framework import Cycle
from .types import Reason, Target


def within(targets: Sequence[Target], subset: frozenset[str] | None) -> Sequence[Target]:
    """The targets whose endpoint the subset allows (``targets`` itself when there is none)."""
    if subset is None:
        return targets
    return [t for t in targets if t.endpoint in subset]


class EndpointSubset:
    name = "subset"
    decides = None

    def filter(self, cycle: Cycle) -> Sequence[Target]:
        return within(cycle.targets, cycle.request.subset)


class PinnedTarget:
    name = "pinned"
    decides = Reason.RESPONSE

    def filter(self, cycle: Cycle) -> Sequence[Target]:
        pinned = cycle.request.pinned
        if pinned is None:
            return cycle.targets
        return [pinned] if pinned in cycle.targets else []


class PreferredFirst:
    name = "preferred_first"
    decides = None

    def filter(self, cycle: Cycle) -> Sequence[Target]:
        p = cycle.prefer
        if not p:  # none, or already first
            return cycle.targets
        targets = cycle.targets
        return [targets[p], *targets[:p], *targets[p + 1 :]]
