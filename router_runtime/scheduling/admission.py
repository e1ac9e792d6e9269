"""Admission before scheduling: a request whose InferenceObjective is sheddable (priority below 0, as
the Gateway API Inference Extension defines it) is turned away while the pool is saturated; every
other request is admitted. The priority and the pool's saturation come from outside (the objectives a
picker follows, the fleet's engine reads); the judgement is this pure function of them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .types import Target

# The request header naming a request's InferenceObjective (as the gateway or the client sets it).
OBJECTIVE_HEADER = "x-gateway-inference-objective"


@dataclass(frozen=True, slots=True)
class Admission:
    priority: Callable[[str], int]  # an objective's priority (0: unknown)
    saturated: Callable[[Sequence[Target]], bool]  # whether none of these targets has room

    def sheds(self, headers: Mapping[str, str], candidates: Sequence[Target]) -> bool:
        objective = headers.get(OBJECTIVE_HEADER)
        return bool(objective) and self.priority(objective) < 0 and self.saturated(candidates)
