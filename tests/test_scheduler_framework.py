"""The scheduler framework (router_runtime/scheduling/framework.py): how a profile runs its plugins.
What each preset decides is in test_routing_policies.py and test_decision_trace.py."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.scheduling.framework import (
    Choice,
    Cycle,
    Evidence,
    Profile,
    Scored,
    Scores,
    Unschedulable,
)
from router_runtime.scheduling.pickers import Guard, LowestCost
from router_runtime.scheduling.presets import make_policy
from router_runtime.scheduling.types import Decision, Reason, RouteRequest, Target

BS = 4
A = Target("a", "http://a", 0)
B = Target("b", "http://b", 0)
C = Target("c", "http://c", 0)


class EngineQueue:
    """A toy scorer, as a new signal would be added: each request waiting in an engine's own queue costs
    ``blocks_per_request`` blocks (the queue as the engine reports it, not the router's in-flight count)."""

    name = "engine_queue"

    def __init__(self, waiting: Mapping[str, int], blocks_per_request: float = 2.0) -> None:
        self.waiting = waiting
        self.blocks_per_request = blocks_per_request

    def score(self, cycle: Cycle) -> Scores:
        return Scores([self.blocks_per_request * self.waiting.get(t.engine, 0) for t in cycle.targets])


def test_a_new_scorer_is_one_class_and_one_line_in_a_preset():
    index = RadixIndex(BS)
    tokens = list(range(100, 100 + 4 * BS))
    index.apply_batch(A.carrier, EventBatch(0.0, (BlockStored((1, 2, 3, 4), None, tuple(tokens), BS),)))
    request = RouteRequest(tokens=[*tokens, 7])  # a partial block after: all 4 blocks reusable
    kv = make_policy("kv_aware")
    d = kv.choose(request, [A, B], {}, index)
    assert d.target == A  # A holds all 4 blocks
    kv.ended(d)  # each request here ends before the next is decided (no in-flight prediction lingers)

    waiting = {"a": 3}
    queued = Profile(
        "kv_aware_queued",
        scorers=(*kv.scorers, EngineQueue(waiting)),  # the one line
        picker=kv.picker,
        needs_tokens=True,
    )
    # 3 waiting cost 6 blocks, more than A's 4-block credit: B wins, and the reason says load beat a prefix.
    d = queued.choose(request, [A, B], {}, index)
    assert (d.target, d.reason, d.matched_blocks, d.total_blocks) == (B, Reason.LEAST_LOADED, 0, 4)
    queued.ended(d)
    waiting["a"] = 1  # 2 blocks: the prefix wins again
    d = queued.choose(request, [A, B], {}, index)
    assert (d.target, d.reason, d.matched_blocks) == (A, Reason.PREFIX, 4)


class DropEngine:
    name = "drop"
    decides = None

    def __init__(self, engine: str) -> None:
        self.engine = engine

    def filter(self, cycle: Cycle):
        return [t for t in cycle.targets if t.engine != self.engine]


class Recorder:
    """A picker taking the first candidate, and a pre-request hook and per-target state, recording."""

    name = "recorder"

    def __init__(self) -> None:
        self.cycles: list[Cycle] = []
        self.scored: list[Scored] = []
        self.decided: list[Decision] = []
        self.removed: list[Target] = []

    def pick(self, cycle, scored):
        self.cycles.append(cycle)
        self.scored.append(scored)
        return Choice(0, Reason.LEAST_LOADED)

    def pre_request(self, cycle, decision):
        self.decided.append(decision)

    def remove_target(self, target):
        self.removed.append(target)
        return 7


class Fixed:
    name = "fixed"

    def __init__(self, costs, evidence=None) -> None:
        self.costs, self.evidence = costs, evidence

    def score(self, cycle):
        return Scores(self.costs, self.evidence)


def test_filters_narrow_the_candidates_and_the_cycle_follows():
    rec = Recorder()
    profile = Profile("p", filters=(DropEngine("a"),), picker=rec)
    d = profile.choose(RouteRequest(prefer=C), [A, B, C], {A: 1, B: 2, C: 3}, None)
    cycle = rec.cycles[0]
    assert list(cycle.targets) == [B, C] and list(cycle.loads) == [2, 3] and cycle.prefer == 1
    assert d.target == B and rec.decided == [d]
    assert profile.remove_target(A) == 7 and rec.removed == [A]


def test_costs_sum_rounded_and_evidence_takes_the_stronger():
    rec = Recorder()
    n, c, s = Evidence.NONE, Evidence.CACHED, Evidence.SESSION
    profile = Profile(
        "p", scorers=(Fixed([0.1, 1.0]), Fixed([0.2, -1.0], [s, n]), Fixed(None, [n, c])), picker=rec
    )
    profile.choose(RouteRequest(), [A, B], {}, None)
    scored = rec.scored[0]
    assert list(scored.costs) == [0.3, 0.0]  # 0.1 + 0.2 would be 0.30000000000000004
    assert list(scored.evidence) == [s, c]
    profile = Profile("p", scorers=(Fixed(None),), picker=rec)
    profile.choose(RouteRequest(), [A, B], {}, None)
    assert rec.scored[1] == Scored(None, None)


def test_the_lowest_cost_picker_reasons():
    pick = LowestCost(Guard(2, 1.5)).pick
    cycle = Cycle.of(RouteRequest(prefer=B), [A, B, C], {}, None)
    n, c, s = Evidence.NONE, Evidence.CACHED, Evidence.SESSION
    assert pick(cycle, Scored([0.0, -1.0, 0.0], [n, c, n])).reason is Reason.PREFIX
    assert pick(cycle, Scored([0.0, -1.0, 0.0], [n, s, n])).reason is Reason.SESSION
    assert pick(cycle, Scored([-1.0, 0.0, -2.0], [c, n, n])).reason is Reason.LEAST_LOADED
    got = pick(cycle, Scored(None, None))
    assert (got.index, got.reason) == (1, Reason.NO_MATCH)  # the tie goes to the session's target
    skewed = Cycle.of(RouteRequest(), [A, B, C], {A: 9, B: 0, C: 5}, None)
    got = pick(skewed, Scored([-9.0, 0.0, 0.0], [c, n, n]))
    assert (got.index, got.reason) == (1, Reason.IMBALANCED)


def test_a_pin_decides_and_a_pin_nowhere_is_unschedulable():
    for name in ("kv_aware", "round_robin", "least_loaded"):
        profile = make_policy(name)
        d = profile.choose(RouteRequest(pinned=B), [A, B, C], {B: 50}, None)
        assert (d.target, d.reason) == (B, Reason.RESPONSE)
        with pytest.raises(Unschedulable, match="pinned"):
            profile.choose(RouteRequest(pinned=B), [A, C], {}, None)
    # The pin took no turn: round robin starts where it was.
    assert make_policy("round_robin").choose(RouteRequest(pinned=C), [A, B, C], {}, None).target == C
    rr = make_policy("round_robin")
    rr.choose(RouteRequest(pinned=C), [A, B, C], {}, None)
    assert rr.choose(RouteRequest(), [A, B, C], {}, None).target == A


def test_the_remembered_target_is_seen_first():
    rec = Recorder()
    profile = Profile("p", filters=make_policy("least_loaded").filters, picker=rec)
    profile.choose(RouteRequest(prefer=C), [A, B, C], {}, None)
    assert list(rec.cycles[0].targets) == [C, A, B] and rec.cycles[0].prefer == 0
    profile.choose(RouteRequest(), [A, B, C], {}, None)
    assert list(rec.cycles[1].targets) == [A, B, C] and rec.cycles[1].prefer is None
