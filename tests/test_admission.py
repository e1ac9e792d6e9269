"""Shedding, as pure functions: an objective's priority from the pool's InferenceObjectives, the pool's
saturation from the engines' reads, and the admission that combines them (scheduling/admission.py)."""

from __future__ import annotations

import pytest

from router_runtime.fleet.saturation import SaturationLimits, saturated
from router_runtime.fleet.view import EngineSample, RankLoad
from router_runtime.gateway.objectives import priorities
from router_runtime.scheduling.admission import OBJECTIVE_HEADER, Admission
from router_runtime.scheduling.types import Target

A0, A1, B = Target("a", "http://a", 0), Target("a", "http://a", 1), Target("b", "http://b")
LIMITS = SaturationLimits(queue_depth=2, kv_usage=0.8)


def sample(at: float, **ranks: RankLoad) -> EngineSample:
    return EngineSample(at, {None if k == "whole" else int(k[1:]): v for k, v in ranks.items()})


def test_a_target_has_room_when_a_fresh_read_shows_a_short_queue_and_kv_cache_to_spare():
    busy, free = RankLoad(running=4, waiting=3), RankLoad(running=4, waiting=2, kv_usage=0.8)
    assert saturated([A0, A1], {"a": sample(10.0, r0=busy, r1=busy)}, 10.5, 1.0, LIMITS)
    assert not saturated([A0, A1], {"a": sample(10.0, r0=busy, r1=free)}, 10.5, 1.0, LIMITS)
    full = RankLoad(waiting=0, kv_usage=0.81)
    assert saturated([A0], {"a": sample(10.0, r0=full)}, 10.5, 1.0, LIMITS)


def test_no_read_or_a_stale_one_shows_no_room():
    free = RankLoad(waiting=0)
    assert saturated([B], {}, 10.0, 1.0, LIMITS)
    assert saturated([B], {"b": sample(8.0, whole=free)}, 10.0, 1.0, LIMITS)
    assert not saturated([B], {"b": sample(9.5, whole=free)}, 10.0, 1.0, LIMITS)
    assert saturated([], {"b": sample(9.5, whole=free)}, 10.0, 1.0, LIMITS)


def test_ranks_map_onto_targets_as_the_engine_labels_them():
    free, busy = RankLoad(waiting=0), RankLoad(waiting=9)
    # a whole-engine target has room when any of its ranks has
    assert not saturated([B], {"b": sample(10.0, r0=busy, r1=free)}, 10.0, 1.0, LIMITS)
    # a rank the engine does not label is judged by its unlabelled figures
    assert not saturated([A1], {"a": sample(10.0, whole=free)}, 10.0, 1.0, LIMITS)
    assert saturated([A1], {"a": sample(10.0, r0=free)}, 10.0, 1.0, LIMITS)


def test_limits_are_vetted():
    with pytest.raises(ValueError):
        SaturationLimits(kv_usage=1.5)
    with pytest.raises(ValueError):
        SaturationLimits(queue_depth=-1)


def objective(name: str, pool: str, priority=None, **ref) -> dict:
    spec = {"poolRef": {"name": pool, **ref}}
    if priority is not None:
        spec["priority"] = priority
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def test_priorities_are_the_pools_own_objectives_with_the_crds_defaults():
    objects = [
        objective("batch", "pool", -1),
        objective("chat", "pool", 10, group="inference.networking.k8s.io", kind="InferencePool"),
        objective("plain", "pool"),  # unset: 0
        objective("odd", "pool", "high"),  # not an integer: unset
        objective("flag", "pool", True),  # a bool is not a priority either
        objective("theirs", "other", -1),
        objective("alien", "pool", -1, group="example.com"),
        objective("kind", "pool", -1, kind="Service"),
        {**objective("going", "pool", -1), "metadata": {"name": "going", "deletionTimestamp": "now"}},
    ]
    assert priorities(objects, "pool") == {"batch": -1, "chat": 10, "plain": 0, "odd": 0, "flag": 0}


def test_only_a_sheddable_objective_is_turned_away_and_only_while_the_pool_is_saturated():
    table = {"batch": -1, "chat": 10}
    full = {"saturated": True}
    admission = Admission(lambda name: table.get(name, 0), lambda targets: full["saturated"])
    assert admission.sheds({OBJECTIVE_HEADER: "batch"}, [B])
    assert not admission.sheds({OBJECTIVE_HEADER: "chat"}, [B])
    assert not admission.sheds({OBJECTIVE_HEADER: "unknown"}, [B])  # nothing is shed on a name alone
    assert not admission.sheds({}, [B])
    assert not admission.sheds({OBJECTIVE_HEADER: ""}, [B])
    full["saturated"] = False
    assert not admission.sheds({OBJECTIVE_HEADER: "batch"}, [B])
