"""The fleet's load on each target, combined from what this replica knows: pure functions of their inputs.

Three sources, each stale in its own way:

- own: this replica's in-flight requests per target, exact and live (``proxy/load.LoadTracker``);
- peers: each sibling replica's in-flight requests per target, as of its last report (gossip);
- engine: the engine's own queue (running + waiting) per DP rank, as of its last metrics read.

Own and peers count disjoint requests, so they add up. The engine counts all of them, plus what no
router here sees (clients that bypass the routers, a sibling that does not report), at the moment it
was read. Only that surplus is taken from it, measured against what the routers knew at the same
moment, so a read taken during a burst does not keep an engine looking busy after the burst drained:

    load(t)   = own(t) + peers(t) + unseen(t)
    unseen(t) = max(0, engine(t) - (own(t) + peers(t)) as of the engine read)

The same read bounds what the siblings may claim: the engine counts every request sent to it, so at
the read theirs were at most its queue less ours (and a few still on the way, ``PEER_SLACK``). A claim
beyond that is discounted until the next read (``overclaimed``): a sibling that lies, or miscounts,
cannot keep an idle engine looking busy, and so starve it, for longer than one read interval.

A source is left out once it is older than its bound: a stale or missing source degrades the view to
what is left, never to a guess. A request never waits for any of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ..scheduling.types import Adapters, Target

LoadKey = tuple[str, int | None]  # (engine, rank): a target's identity across replicas


def key(t: Target) -> LoadKey:
    return (t.engine, t.rank)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One DP rank (or a whole engine) as the engine reports it."""

    running: int = 0
    waiting: int = 0
    kv_usage: float | None = None  # share of the KV cache in use, 0..1, where the engine says
    prompt_tokens: float | None = None  # prompt tokens processed so far (a counter), where the engine says

    @property
    def queue(self) -> int:
        return self.running + self.waiting


@dataclass(frozen=True, slots=True)
class EngineSample:
    """One read of an engine's load: per rank (rank None: the engine did not say which rank)."""

    at: float  # monotonic time of the read
    ranks: Mapping[int | None, RankLoad]
    adapters: Adapters | None = None  # None: the engine reports no adapters (no LoRA, or SGLang)


@dataclass(frozen=True, slots=True)
class TargetReport:
    """One target in a sibling's report."""

    engine: str
    rank: int | None
    inflight: int
    prompt_tokens: int  # prompt tokens of the requests it has in flight there


@dataclass(frozen=True, slots=True)
class Bounds:
    peer_max_age_s: float = 2.0
    engine_max_age_s: float = 2.0


def engine_queues(sample: EngineSample, targets: Sequence[Target]) -> dict[LoadKey, float]:
    """The engine's queue per target of that engine. Ranks the engine labels map onto rank targets; a
    whole-engine target gets the sum; an engine that does not label its ranks is split evenly over its
    rank targets (what it says is the total, not where it sits)."""
    ranks = sample.ranks
    if not targets or not ranks:
        return {}
    total = sum(r.queue for r in ranks.values())
    labelled = any(r is not None for r in ranks)
    out: dict[LoadKey, float] = {}
    for t in targets:
        if t.rank is None:
            out[key(t)] = float(total)
        elif labelled:
            r = ranks.get(t.rank)
            if r is not None:
                out[key(t)] = float(r.queue)
        else:
            out[key(t)] = total / len(targets)
    return out


def peer_inflight(
    reports: Iterable[tuple[float, Sequence[TargetReport]]], now: float, max_age_s: float
) -> dict[LoadKey, int]:
    """The siblings' in-flight requests per target, summed over the reports received within
    ``max_age_s`` (``reports``: (received at, its targets), one per sibling, the latest)."""
    out: dict[LoadKey, int] = {}
    for at, targets in reports:
        if now - at > max_age_s:
            continue
        for r in targets:
            k = (r.engine, r.rank)
            out[k] = out.get(k, 0) + r.inflight
    return out


def unseen(queues: Mapping[LoadKey, float], known: Mapping[LoadKey, int]) -> dict[LoadKey, float]:
    """What an engine read counts beyond what the routers knew at that moment (``known``: own + peers
    per target, taken with the read)."""
    out = {}
    for k, q in queues.items():
        extra = q - known.get(k, 0)
        if extra > 0:
            out[k] = extra
    return out


PEER_SLACK = 4  # requests per target a sibling may have sent that its engine had not counted yet


@dataclass(frozen=True, slots=True)
class AtRead:
    """What the routers knew per target while an engine read was taken: ``known``, ours and the
    siblings' at most (what the read may have counted of them); ``ours`` and ``theirs`` at least (in
    flight all through the read): the siblings' claim is held against the room the read leaves
    beside ours, both taken so that an honest claim is never discounted."""

    known: Mapping[LoadKey, int]
    ours: Mapping[LoadKey, int] = field(default_factory=dict)
    theirs: Mapping[LoadKey, int] = field(default_factory=dict)


def overclaimed(queues: Mapping[LoadKey, float], at: AtRead) -> dict[LoadKey, int]:
    """Per target, the siblings' claim beyond the room the engine's queue leaves besides ours, less
    ``PEER_SLACK``."""
    out = {}
    for k, q in queues.items():
        theirs = at.theirs.get(k, 0)
        if theirs <= PEER_SLACK:
            continue
        extra = math.floor(theirs - max(0.0, q - at.ours.get(k, 0))) - PEER_SLACK
        if extra > 0:
            out[k] = extra
    return out


def fleet_load(own: int, peers: int, unseen: float = 0.0) -> float:
    return float(own + peers) + unseen


@dataclass(frozen=True, slots=True)
class Remote:
    """What the other sources add, precomputed between updates: the per-decision read is two lookups."""

    peers: Mapping[LoadKey, int]  # the siblings' in flight per target, less what engines contradict
    engines: Mapping[LoadKey, float]  # unseen load per target
    valid_until: float  # the first moment a contributing report ages out (recompute then)
    discounted: Mapping[LoadKey, int] = field(default_factory=dict)  # taken off peers: ``overclaimed``
    # What the siblings claim, undiscounted: what an engine read is measured against (a claim discounted
    # by one read is checked again by the next, never taken as settled).
    claimed: Mapping[LoadKey, int] = field(default_factory=dict)


def remote(
    peer_reports: Mapping[tuple[str, str], tuple[float, Sequence[TargetReport]]],
    samples: Mapping[str, tuple[EngineSample, AtRead]],
    targets: Mapping[str, Sequence[Target]],
    now: float,
    bounds: Bounds,
) -> Remote:
    """Combine the fresh peer reports and engine samples, each sample with what the routers knew when
    it was read (``targets``: engine -> its targets)."""
    expiries = [
        at + bounds.peer_max_age_s for at, _ in peer_reports.values() if now - at <= bounds.peer_max_age_s
    ]
    engines: dict[LoadKey, float] = {}
    claimed = peer_inflight(peer_reports.values(), now, bounds.peer_max_age_s)
    peers = dict(claimed)
    discounted: dict[LoadKey, int] = {}
    for engine, (sample, at) in samples.items():
        if now - sample.at > bounds.engine_max_age_s:
            continue
        expiries.append(sample.at + bounds.engine_max_age_s)
        queues = engine_queues(sample, targets.get(engine, ()))
        engines.update(unseen(queues, at.known))
        for k, extra in overclaimed(queues, at).items():
            taken = min(extra, peers.get(k, 0))
            if taken > 0:
                peers[k] -= taken
                discounted[k] = taken
    return Remote(peers, engines, min(expiries, default=math.inf), discounted, claimed)
