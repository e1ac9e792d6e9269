"""Whether the pool has room for a request that may be shed: the engines' own reads (engine_metrics.py),
judged as the inference extension's utilization detector judges them.

A target has room when a fresh read of its engine shows its rank waiting at most ``queue_depth``
requests with at most ``kv_usage`` of its KV cache in use; the pool is saturated when no candidate has
room. A read older than the board's bound, or none at all, shows no room (the reads are what tells).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..scheduling.types import Target
from .view import EngineSample, RankLoad


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    queue_depth: int = 5  # requests waiting on a rank beyond which it has no room
    kv_usage: float = 0.8  # share of a rank's KV cache in use beyond which it has no room

    def __post_init__(self) -> None:
        if self.queue_depth < 0 or not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"saturation limits: queue_depth >= 0 and 0 <= kv_usage <= 1, got {self}")


def has_room(load: RankLoad, limits: SaturationLimits) -> bool:
    return load.waiting <= limits.queue_depth and (load.kv_usage is None or load.kv_usage <= limits.kv_usage)


def saturated(
    targets: Sequence[Target],
    samples: Mapping[str, EngineSample],
    now: float,
    max_age_s: float,
    limits: SaturationLimits,
) -> bool:
    """True when no target in ``targets`` has room by its engine's latest read (``samples``, by engine)
    no older than ``max_age_s``. A whole-engine target has room when any of its ranks has; a rank the
    engine does not label is judged by the engine's unlabelled figures."""
    for t in targets:
        sample = samples.get(t.engine)
        if sample is None or now - sample.at > max_age_s:
            continue
        ranks = sample.ranks
        if t.rank is None:
            loads = list(ranks.values())
        else:
            load = ranks.get(t.rank, ranks.get(None))
            loads = [load] if load is not None else []
        if any(has_room(load, limits) for load in loads):
            return False
    return True
