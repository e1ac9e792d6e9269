"""The seed-gated rollout decision: every verdict combination (exhaustive), random fleets (hypothesis),
and the scenarios of a fleet's life on a simulated cluster."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from routerfleet_operator.model import ANNOTATION_RESTARTED_AT, OnSeedFailure, Verdict
from routerfleet_operator.render import revision_of
from routerfleet_operator.rollout import Admission, BootstrapReport, Cause, PodView, classify, decide
from routerfleet_operator.spec import BootstrapSpec, Fleet

from .helpers import T0, Cluster, Script, SimPod, failing, fleet_obj, natural, report, schema, schema_errors

STATUS_SCHEMA = schema()["properties"]["status"]
SETTLED = [v for v in Verdict if v is not Verdict.PENDING]
# Every state a replica's report can be in: none yet, pending, or settled with each verdict, with and
# without seedFailed, with peer discovery synced or not.
REPORTS: list[BootstrapReport | None] = [
    None,
    report(Verdict.PENDING, settled=False),
    *(report(v, seed_failed=f, synced=s) for v in SETTLED for f in (False, True) for s in (True, False)),
]
POLICIES = list(OnSeedFailure)


def rid(r: BootstrapReport | None) -> str:
    if r is None:
        return "none"
    return f"{r.verdict.value}{'-seedFailed' if r.seed_failed else ''}{'' if r.peers_synced else '-unsynced'}"


CONDITION_TYPES = ["Ready", "Reconciling", "Stalled", "Available", "Progressing", "CacheWarm"]


# ---- the per-pod rule -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rep", REPORTS, ids=rid)
@pytest.mark.parametrize("siblings", [False, True], ids=["alone", "with-seeded-sibling"])
@pytest.mark.parametrize("passing", ["default", "with-timed_out", "strict"])
def test_classify_every_report(rep, siblings, passing):
    verdicts = {
        "default": BootstrapSpec().pass_verdicts,
        "with-timed_out": BootstrapSpec().pass_verdicts | {Verdict.TIMED_OUT},
        "strict": frozenset({Verdict.WARM, Verdict.NO_PEERS, Verdict.FLEET_COLD}),
    }[passing]
    b = BootstrapSpec(pass_verdicts=verdicts)
    got, reason = classify(PodView("p", "r", report=rep), b, siblings)
    if rep is None or not rep.settled:
        assert got is Admission.WAIT
    elif rep.verdict in verdicts:
        assert got is Admission.PASS
    elif not siblings:
        assert got is Admission.COLD  # never gate without a serving sibling (deadlock)
    elif rep.verdict is Verdict.TIMED_OUT and not rep.seed_failed:
        # No candidate was ever reachable: not a failed seed, unless discovery never even synced.
        assert got is (Admission.COLD if rep.peers_synced else Admission.FAIL)
    else:
        assert got is Admission.FAIL and reason is not None
    # no_peers and fleet_cold (required in passVerdicts by the CRD) are never gated.
    if rep is not None and rep.settled and rep.verdict in (Verdict.NO_PEERS, Verdict.FLEET_COLD):
        assert got is Admission.PASS
    # With bootstrap off, every pod passes at once.
    assert classify(PodView("p", "r", report=rep), replace(b, enabled=False), siblings)[0] is Admission.PASS


@pytest.mark.parametrize("rep", REPORTS, ids=rid)
def test_classify_timed_out_without_siblings_is_cold(rep):
    if rep is not None and rep.settled:
        assert classify(PodView("p", "r", report=rep), BootstrapSpec(), False)[0] in (
            Admission.PASS,
            Admission.COLD,
        )


# ---- invariants of every decision -------------------------------------------------------------------------


def check_decision(obj, pods: list[PodView], d) -> None:
    f = Fleet.parse(obj)
    s = f.spec
    prior = obj.get("status") or {}
    live = {p.name: p for p in pods if not p.gone}
    update = revision_of(f)
    assert d.update_revision == update
    assert len(set(d.admit)) == len(d.admit)
    for name in d.admit:
        p = live[name]
        assert not p.gate, "admitted twice"
        if s.bootstrap.enabled:
            assert p.report is not None and p.report.settled, "admitted before its bootstrap settled"
    if s.paused:
        assert d.admit == () and d.delete == () and d.pause_deployment is True
    assert d.pause_deployment == (s.paused or "hold" in d.status["rollout"])
    if d.rollback:
        assert s.rollout.on_seed_failure is OnSeedFailure.ROLLBACK
        assert d.deploy_revision == prior.get("currentRevision") == d.status["currentRevision"] != update
    # The status is whole and survives the API server's schema (nothing pruned).
    assert schema_errors(d.status, STATUS_SCHEMA, "status") == []
    conds = {c["type"]: c for c in d.status["conditions"]}
    assert [c["type"] for c in d.status["conditions"]] == CONDITION_TYPES
    assert all(c["observedGeneration"] == f.generation for c in conds.values())
    assert d.status["observedGeneration"] == f.generation
    if conds["Stalled"]["status"] == "True":
        assert conds["Reconciling"]["status"] == "False" and conds["Ready"]["status"] == "False"
    if conds["Ready"]["status"] == "True":
        assert conds["Reconciling"]["status"] == "False" and d.status["currentRevision"] == update


def settled_eligible_unadmitted(obj, pods, d) -> list[PodView]:
    eligible = {d.deploy_revision, (obj.get("status") or {}).get("currentRevision")}
    return [
        p
        for p in pods
        if not p.gate and p.revision in eligible and p.name not in d.admit and p.report and p.report.settled
    ]


def _rollout_status(current: str) -> dict:
    return {
        "currentRevision": current,
        "updateRevision": current,
        "rollout": {"phase": "Complete", "step": 1},
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_every_verdict_pair_first_deploy(policy):
    """Two new replicas of a first deploy (nobody seeded yet), every pair of reports: every settled one
    is admitted (nothing to gate on), nothing is held, nothing waits that has settled."""
    obj = fleet_obj({"rollout": {"onSeedFailure": policy.value}})
    rev = revision_of(Fleet.parse(obj))
    for a, b in itertools.product(REPORTS, REPORTS):
        pods = [PodView("a", rev, "1", report=a), PodView("b", rev, "2", report=b)]
        d = decide(obj, pods, T0)
        check_decision(obj, pods, d)
        assert settled_eligible_unadmitted(obj, pods, d) == []
        assert "hold" not in d.status["rollout"] and not d.rollback


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("sibling_seeded", [False, True])
def test_every_verdict_pair_during_a_rollout(policy, sibling_seeded):
    """A rollout from revision A (pod "old") to B (pod "new"), every pair of reports, with the old pod
    seeded and serving or not: the decision keeps the rules, and a pod is held only for a failed seed
    while a seeded sibling served."""
    obj = fleet_obj({"replicas": 1, "rollout": {"onSeedFailure": policy.value}})
    new_rev = revision_of(Fleet.parse(obj))
    obj["status"] = _rollout_status("aaaaaaaaaa")
    for a, b in itertools.product(REPORTS, REPORTS):
        old = PodView("old", "aaaaaaaaaa", "1", gate=sibling_seeded, ready=sibling_seeded, report=a)
        new = PodView("new", new_rev, "2", report=b)
        pods = [old, new]
        d = decide(obj, pods, T0)
        check_decision(obj, pods, d)
        for p in settled_eligible_unadmitted(obj, pods, d):
            assert sibling_seeded and p.report.verdict not in BootstrapSpec().pass_verdicts
            assert policy is not OnSeedFailure.PROCEED
            if policy is OnSeedFailure.PAUSE:
                assert p.name in d.status["rollout"]["hold"]["pods"] and d.pause_deployment
        if policy is OnSeedFailure.PROCEED:
            assert settled_eligible_unadmitted(obj, pods, d) == []
        if d.rollback:
            assert d.deploy_revision == "aaaaaaaaaa" and "new" not in d.admit
            assert d.status["rollout"]["phase"] == "RolledBack"
        # Deciding again on the applied decision changes nothing: no new admission, same state.
        applied = [replace(p, gate=p.gate or p.name in d.admit) for p in pods]
        again = decide({**obj, "status": json.loads(json.dumps(d.status))}, applied, T0)
        assert again.admit == () and again.delete == ()
        assert again.deploy_revision == d.deploy_revision and again.pause_deployment == d.pause_deployment
        assert again.status["rollout"] == d.status["rollout"]


pod_states = st.tuples(
    st.sampled_from(["aaaaaaaaaa", "bbbbbbbbbb", "new"]),  # revision ("new": the spec's)
    st.booleans(),  # gate
    st.booleans(),  # container ready
    st.booleans(),  # gone
    st.sampled_from(REPORTS),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    states=st.lists(pod_states, max_size=6),
    policy=st.sampled_from(POLICIES),
    paused=st.booleans(),
    current=st.sampled_from([None, "aaaaaaaaaa", "new"]),
    replicas=st.integers(0, 4),
    held=st.booleans(),
    retry=st.booleans(),
)
def test_random_fleets_keep_the_rules(states, policy, paused, current, replicas, held, retry):
    meta = {"annotations": {"routerfleet.io/retry": "r1"}} if retry else {}
    obj = fleet_obj(
        {"replicas": replicas, "paused": paused, "rollout": {"onSeedFailure": policy.value}}, **meta
    )
    rev = revision_of(Fleet.parse(obj))
    pods = []
    for i, (r, gate, ready, term, rep) in enumerate(states):
        r = rev if r == "new" else r
        pods.append(PodView(f"p{i}", r, f"{i:03d}", gate=gate, ready=gate and ready, gone=term, report=rep))
    if current is not None:
        cur = rev if current == "new" else current
        obj["status"] = {
            "currentRevision": cur,
            "updateRevision": rev,
            "rollout": {"phase": "Progressing", "step": 0},
        }
        if held and pods:
            obj["status"]["rollout"]["hold"] = {
                "reason": "SeedFailed",
                "revision": rev,
                "pods": [pods[0].name],
                "since": "2026-01-01T00:00:00Z",
                "message": "m",
            }
    d = decide(obj, pods, T0)
    check_decision(obj, pods, d)
    if not paused and not any(p.gate for p in pods if not p.gone):
        # Nobody serves: nothing settled may be held back (that is the deadlock).
        held_pods = set((obj.get("status") or {}).get("rollout", {}).get("hold", {}).get("pods", ()))
        stuck = [
            p for p in settled_eligible_unadmitted(obj, pods, d) if not p.gone and p.name not in held_pods
        ]
        assert stuck == []


# ---- scenarios on a simulated cluster ---------------------------------------------------------------


def first_deploy(replicas: int = 3, **spec) -> Cluster:
    c = Cluster(fleet_obj({"replicas": replicas, **spec}))
    c.run(8)
    return c


def test_first_deploy_passes_as_no_peers():
    c = first_deploy()
    assert c.revisions() == {c.status["updateRevision"]: 3}
    assert c.status["verdicts"]["noPeers"] == 3
    assert c.status["rollout"]["phase"] == "Complete"
    assert c.status["currentRevision"] == c.status["updateRevision"]
    assert c.condition("Ready") == ("True", "AllReplicasReady")
    assert c.condition("CacheWarm") == ("True", "FleetColdStart")
    assert c.condition("Stalled") == ("False", "AsExpected")
    assert (c.status["readyReplicas"], c.status["warmReplicas"], c.status["updatedReplicas"]) == (3, 3, 3)
    assert len(c.events("RolloutComplete")) == 1


def test_a_cold_start_is_called_warm_once_its_index_holds_blocks():
    """The verdict of a first deploy stays no_peers; once live events filled the index, CacheWarm says
    AllWarm instead of FleetColdStart."""
    c = first_deploy()
    assert c.condition("CacheWarm") == ("True", "FleetColdStart")
    for p in c.pods.values():  # the routers' reports after some traffic
        p.report = report(Verdict.NO_PEERS, blocks=120)
    c.run(2)
    assert c.condition("CacheWarm") == ("True", "AllWarm")
    assert c.status["verdicts"]["noPeers"] == 3  # the seeded-with verdicts are unchanged


def test_a_full_restart_passes_as_fleet_cold():
    c = Cluster(fleet_obj({"replicas": 2}), script=lambda p, c: report(Verdict.FLEET_COLD, nodes=0))
    c.run(6)
    assert c.condition("Ready")[0] == "True" and c.status["verdicts"]["fleetCold"] == 2


def test_warm_rollout_replica_by_replica():
    c = first_deploy()
    old = c.status["currentRevision"]
    new = c.set_spec(router={"image": "routerfleet:v2"})
    c.min_ready_seen = None
    steps = []
    for _ in range(30):
        d = c.reconcile()
        # With maxSurge 1 at most one new replica is bootstrapping at a time.
        assert sum(1 for p in c.pods.values() if p.revision == new and not p.gate) <= 1
        steps.append(c.status["rollout"]["step"])
        if c.status["rollout"]["phase"] == "Progressing":
            assert c.condition("Ready")[0] == "False" and c.condition("Reconciling") == (
                "True",
                "RolloutInProgress",
            )
        c.tick()
        del d
    assert c.min_ready_seen >= 3, "a warm replica left before its replacement was seeded"
    assert steps == sorted(steps) and set(range(4)) <= set(steps), "the step moves one replica at a time"
    assert c.revisions() == {new: 3}
    assert c.status["currentRevision"] == new and c.status["rollout"]["phase"] == "Complete"
    assert c.status["verdicts"]["warm"] == 3
    assert c.condition("CacheWarm") == ("True", "AllWarm")
    assert c.condition("Ready") == ("True", "AllReplicasReady")
    assert len(c.events("RolloutStarted")) == 1 and old in c.events("RolloutStarted")[0]


def test_rolling_restart_by_annotation_is_seed_gated():
    c = first_deploy()
    before = c.status["currentRevision"]
    new = c.annotate(ANNOTATION_RESTARTED_AT, "2026-01-02T00:00:00Z")
    assert new != before
    c.min_ready_seen = None
    c.run(30)
    assert c.revisions() == {new: 3} and c.status["currentRevision"] == new
    assert c.min_ready_seen >= 3 and c.status["verdicts"]["warm"] == 3


def seed_failure(policy: OnSeedFailure) -> tuple[Cluster, str, str]:
    c = first_deploy(rollout={"onSeedFailure": policy.value})
    old = c.status["currentRevision"]
    c.obj["spec"]["router"]["image"] = "routerfleet:broken"
    c.obj["metadata"]["generation"] += 1
    new = revision_of(c.fleet)
    c.script = failing({new})
    c.min_ready_seen = None
    c.run(15)
    return c, old, new


def test_seed_failure_pause_holds_then_retry_resumes():
    c, old, new = seed_failure(OnSeedFailure.PAUSE)
    assert c.status["rollout"]["phase"] == "Paused" and c.status["rollout"]["pauseReason"] == "SeedFailed"
    assert c.condition("Stalled") == ("True", "SeedFailurePaused")
    assert c.condition("Ready") == ("False", "SeedFailurePaused")
    assert c.condition("Reconciling")[0] == "False"  # kstatus: Failed, not InProgress
    assert c.condition("Progressing") == ("False", "SeedFailurePaused")
    assert c.deploy_paused and c.status["currentRevision"] == old
    held = c.status["rollout"]["hold"]["pods"]
    assert len(held) == 1 and not c.pods[held[0]].gate and c.pods[held[0]].revision == new
    assert c.revisions() == {old: 3, new: 1} and c.min_ready_seen >= 3
    assert "retry" in next(x["message"] for x in c.status["conditions"] if x["type"] == "Stalled")
    # The snapshot path is fixed; a retry deletes the held pod and resumes the rollout.
    c.script = failing(set())
    c.retry("attempt-2")
    d = c.reconcile()
    assert d.delete == tuple(held) and d.pause_deployment is False
    assert c.status["rollout"]["handledRetry"] == "attempt-2"
    c.run(30)
    assert c.revisions() == {new: 3} and c.status["currentRevision"] == new
    assert c.condition("Ready") == ("True", "AllReplicasReady") and c.min_ready_seen >= 3
    # The same annotation value again does nothing.
    assert c.reconcile().delete == ()


def test_seed_failure_rollback_restores_the_previous_template():
    c, old, new = seed_failure(OnSeedFailure.ROLLBACK)
    assert c.status["rollout"]["phase"] == "RolledBack" and c.status["rollout"]["rolledBackRevision"] == new
    assert c.deploy_revision == old and not c.deploy_paused
    assert c.revisions() == {old: 3} and c.min_ready_seen >= 3
    assert c.condition("Stalled") == ("True", "SeedFailureRolledBack")
    assert c.condition("Progressing") == ("False", "RolledBack")
    assert c.decisions[-1].rollback and len(c.events("RolledBack")) == 1
    # It stays rolled back (no re-roll of the failed revision) ...
    c.run(10)
    assert c.revisions() == {old: 3} and c.deploy_revision == old
    # ... until the spec moves on.
    c.script = failing({new})
    fixed = c.set_spec(router={"image": "routerfleet:fixed"})
    c.run(30)
    assert c.revisions() == {fixed: 3} and c.status["currentRevision"] == fixed
    assert c.condition("Ready")[0] == "True"


def test_seed_failure_rollback_then_retry_tries_again():
    c, _old, new = seed_failure(OnSeedFailure.ROLLBACK)
    c.script = failing(set())
    c.retry()
    c.run(30)
    assert c.revisions() == {new: 3} and c.status["currentRevision"] == new


def test_the_step_counts_the_update_replicas_seeded_now_through_a_rollback_and_a_retry():
    c = first_deploy(rollout={"onSeedFailure": "Rollback"})
    new = c.set_spec(router={"image": "v2"})
    seeded: list[str] = []

    def first_only(p: SimPod, c_: Cluster) -> BootstrapReport:  # the update's first replica seeds, no other
        if p.revision != new:
            return natural(p, c_)
        if not seeded or seeded == [p.name]:
            seeded[:] = [p.name]
            return report(Verdict.WARM)
        return report(Verdict.TIMED_OUT, seed_failed=True, nodes=0)

    c.script = first_only
    c.run(30)
    assert c.status["rollout"]["phase"] == "RolledBack" and c.revisions() == {c.deploy_revision: 3}
    assert c.status["rollout"]["step"] == 0  # its seeded replica went with the rollback
    c.script = natural
    c.retry()
    c.run(4)
    before = c.status["rollout"]["progressAt"]
    c.run(30)
    assert c.status["currentRevision"] == new and c.status["rollout"]["step"] == 3
    assert c.status["rollout"]["progressAt"] > before  # each seed after the retry counted as progress


def test_seed_failure_proceed_admits_cold():
    c, _old, new = seed_failure(OnSeedFailure.PROCEED)
    c.run(20)
    assert c.revisions() == {new: 3} and c.status["currentRevision"] == new
    assert c.condition("Ready") == ("True", "AllReplicasReady")
    assert c.condition("CacheWarm") == ("False", "SeedTimedOut")
    assert c.status["verdicts"]["timedOut"] >= 1 and c.status["warmReplicas"] < 3
    assert c.events("SeedFailedProceeding") and c.min_ready_seen >= 3


def test_peer_discovery_never_synced_is_its_own_reason():
    c = first_deploy()
    new = c.set_spec(router={"image": "v2"})
    c.script = lambda p, c_: (
        report(Verdict.TIMED_OUT, synced=False) if p.revision == new else report(Verdict.WARM)
    )
    c.run(10)
    assert c.condition("Stalled") == ("True", "PeerDiscoveryNotSynced")
    assert c.status["rollout"]["pauseReason"] == "PeerDiscoveryNotSynced"


def test_spec_paused_pauses_everything():
    c = first_deploy()
    c.set_spec(paused=True)
    new = c.set_spec(router={"image": "v2"})
    # Even a pod of the new revision that shows up (created before the pause took) is not seeded.
    c.run(10)
    assert c.deploy_paused and c.status["rollout"] == {
        **c.status["rollout"],
        "phase": "Paused",
        "pauseReason": "User",
    }
    assert all(not p.gate for p in c.pods.values() if p.revision == new)
    assert c.condition("Ready") == ("False", "Paused")
    assert c.condition("Reconciling") == ("False", "Paused")
    assert c.condition("Progressing") == ("Unknown", "Paused")
    c.set_spec(paused=False)
    c.run(30)
    assert c.revisions() == {new: 3} and c.condition("Ready")[0] == "True"


def test_a_rollout_resumed_after_a_long_pause_has_its_whole_progress_deadline():
    c = first_deploy()
    c.set_spec(paused=True)
    c.set_spec(router={"image": "v2"})
    c.run(2)
    c.now += timedelta(hours=2)  # paused far longer than the progress deadline (10 min by default)
    c.set_spec(paused=False)
    c.reconcile()
    assert c.condition("Stalled")[0] == "False", c.status["conditions"]
    assert c.events("ProgressDeadlineExceeded") == []


def test_scale_up_pods_are_seeded_warm():
    c = first_deploy(replicas=2)
    c.set_spec(replicas=4)
    c.run(10)
    assert c.status["readyReplicas"] == 4 and c.status["verdicts"] == {
        **c.status["verdicts"],
        "noPeers": 2,
        "warm": 2,
    }
    assert c.condition("Ready")[0] == "True"


def test_progress_deadline_stalls_and_a_retry_rearms_it():
    c = first_deploy(rollout={"progressDeadline": "1m"}, bootstrap={"timeout": "30s"})
    new = c.set_spec(router={"image": "v2"})
    c.script = lambda p, c_: (
        report(Verdict.PENDING, settled=False) if p.revision == new else report(Verdict.WARM)
    )
    c.run(5)
    assert c.condition("Stalled")[0] == "False"
    c.now += timedelta(minutes=2)
    c.reconcile()
    assert c.condition("Stalled") == ("True", "ProgressDeadlineExceeded")
    assert c.condition("Progressing") == ("False", "ProgressDeadlineExceeded")
    assert c.status["rollout"]["phase"] == "Progressing"
    c.retry("again")
    c.reconcile()
    assert c.condition("Stalled")[0] == "False"


def test_bootstrap_disabled_seeds_every_pod():
    c = Cluster(
        fleet_obj({"replicas": 2, "router": {"policy": "round_robin"}, "bootstrap": {"enabled": False}})
    )
    c.script = lambda p, c_: report(Verdict.DISABLED)
    c.run(6)
    assert c.condition("Ready")[0] == "True" and c.condition("CacheWarm") == ("Unknown", "BootstrapDisabled")


@settings(max_examples=25, deadline=None)
@given(crashes=st.sets(st.integers(0, 39), max_size=15), restart=st.booleans())
def test_operator_restart_mid_rollout_resumes_exactly(crashes, restart):
    """The operator dies after acting and before writing status, at random points of a rollout (and,
    with ``restart``, every decision starts from the JSON the API would return): the rollout ends
    the same, no pod is admitted twice (asserted by the simulator), and no step is skipped."""
    ref = first_deploy()
    ref.set_spec(router={"image": "v2"})
    ref.run(40)

    c = first_deploy()
    new = c.set_spec(router={"image": "v2"})
    c.min_ready_seen = None
    seen_steps = []
    for i in range(40):
        c.reconcile(crash=i in crashes, restart=restart)
        seen_steps.append(c.status["rollout"]["step"] if c.status.get("updateRevision") == new else 0)
        c.tick()
    c.reconcile()
    assert c.revisions() == ref.revisions() == {new: 3}
    assert c.status["currentRevision"] == ref.status["currentRevision"] == new
    assert c.status["rollout"]["step"] == ref.status["rollout"]["step"] == 3
    assert c.min_ready_seen >= 3
    assert all(b - a <= 3 for a, b in itertools.pairwise(seen_steps)) and seen_steps == sorted(seen_steps)
    assert [x["type"] for x in c.status["conditions"]] == CONDITION_TYPES
    assert {x["type"]: (x["status"], x["reason"]) for x in c.status["conditions"]} == {
        x["type"]: (x["status"], x["reason"]) for x in ref.status["conditions"]
    }


def test_a_paused_rollout_survives_an_operator_restart():
    c, _, _ = seed_failure(OnSeedFailure.PAUSE)
    status = json.loads(json.dumps(c.status))
    d = c.reconcile(restart=True)
    assert d.admit == () and d.pause_deployment is True
    assert c.status["rollout"]["hold"] == status["rollout"]["hold"]


def test_a_settled_fleet_rewrites_the_same_status():
    """Nothing changed, nothing to write: the same status an hour later (no patch loops), and the
    conditions keep their lastTransitionTime."""
    c = first_deploy()
    before = json.loads(json.dumps(c.status))
    c.now += timedelta(hours=1)
    d = c.reconcile()
    assert c.status == before and d.admit == () and d.events == () and d.requeue_after_s is None


def test_a_new_generation_flips_ready_in_the_same_decision():
    c = first_deploy()
    c.set_spec(router={"image": "v2"})
    c.reconcile()
    ready = next(x for x in c.status["conditions"] if x["type"] == "Ready")
    assert ready["status"] == "False" and ready["observedGeneration"] == c.obj["metadata"]["generation"]
    assert c.status["observedGeneration"] == c.obj["metadata"]["generation"]


def test_invalid_spec_touches_nothing():
    c = first_deploy()
    c.obj["spec"]["bootstrap"] = {"passVerdicts": ["warm"]}  # stored under an older CRD, say
    d = c.reconcile()
    assert d.admit == () and d.delete == () and d.deploy_revision is None and d.pause_deployment is None
    assert c.condition("Stalled") == ("True", "InvalidSpec") and c.condition("Ready") == (
        "False",
        "InvalidSpec",
    )
    assert "no_peers" in next(x["message"] for x in c.status["conditions"] if x["type"] == "Stalled")
    assert c.status["currentRevision"]  # the rollout state is kept
    assert c.reconcile().events == ()  # said once
    assert schema_errors(c.status, STATUS_SCHEMA, "status") == []


def test_members_are_capped():
    obj = fleet_obj({"replicas": 100})
    rev = revision_of(Fleet.parse(obj))
    pods = [PodView(f"p{i:03d}", rev, f"{i:03d}", report=report(Verdict.WARM)) for i in range(100)]
    d = decide(obj, pods, T0)
    assert len(d.status["members"]) == 64 and d.status["membersOmitted"] == 36


def test_bootstrap_report_parse():
    doc = {
        "apiVersion": "routerfleet.io/bootstrap/v1",
        "settled": True,
        "verdict": "timed_out",
        "seedFailed": True,
        "ranks": [],
        "index": {"nodes": 7, "blocks": 9},
        "peers": {"seen": 2, "synced": True},
    }
    r = BootstrapReport.parse(doc)
    assert (r.verdict, r.seed_failed, r.index_nodes, r.index_blocks, r.peers_seen) == (
        Verdict.TIMED_OUT,
        True,
        7,
        9,
        2,
    )
    with pytest.raises(ValueError):
        BootstrapReport.parse({**doc, "apiVersion": "routerfleet.io/bootstrap/v2"})
    with pytest.raises(ValueError):
        BootstrapReport.parse({**doc, "verdict": "lukewarm"})
    # The router's "disabled" document (no bootstrapper) has no index or peers.
    assert BootstrapReport.parse(
        {"apiVersion": "routerfleet.io/bootstrap/v1", "settled": True, "verdict": "disabled"}
    ).settled


def test_pod_view_from_a_pod():
    pod = {
        "metadata": {
            "name": "rf-abc",
            "labels": {"routerfleet.io/revision": "r1"},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "status": {
            "conditions": [
                {"type": "routerfleet.io/seeded", "status": "True"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"},
            ]
        },
    }
    v = PodView.from_pod(pod)
    assert (v.name, v.revision, v.gate, v.ready, v.gone) == ("rf-abc", "r1", True, True, False)
    assert v.ready_since == T0 + timedelta(minutes=1)
    evicted = {**pod, "status": {**pod["status"], "phase": "Failed", "reason": "Evicted"}}
    assert PodView.from_pod(evicted).gone  # left in place until garbage-collected
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:02:00Z"
    assert PodView.from_pod(pod).gone


# ---- the status says what the routers know (causes, mismatch, history) -----------------------------------

MISMATCH = (
    "ConfigMismatch",
    "rank e1#0: the engine publishes block size 16; this router is configured for 32",
)


def mismatching(bad: set[str]) -> Script:
    """Pods of the ``bad`` revisions run another block size than the engines: config_mismatch."""

    def script(pod: SimPod, c: Cluster) -> BootstrapReport:
        if pod.revision in bad:
            return report(Verdict.CONFIG_MISMATCH, nodes=0, cause=MISMATCH)
        return natural(pod, c)

    return script


def stalled_message(c: Cluster) -> str:
    return next(x["message"] for x in c.status["conditions"] if x["type"] == "Stalled")


def test_a_config_mismatch_pauses_naming_it_and_reverting_the_spec_is_instant():
    c = first_deploy()
    old = c.status["currentRevision"]
    new = c.set_spec(router={"blockSize": 32})
    c.script = mismatching({new})
    c.min_ready_seen = None
    c.run(10)
    assert c.status["rollout"]["pauseReason"] == "ConfigMismatch"
    assert c.condition("Stalled") == ("True", "ConfigMismatch")
    assert c.condition("Ready") == ("False", "ConfigMismatch")
    message = stalled_message(c)
    assert "block size 16; this router is configured for 32" in message and "spec.router.blockSize" in message
    assert "Revert the spec" in message
    held = c.status["rollout"]["hold"]["pods"]
    member = next(m for m in c.status["members"] if m["pod"] == held[0])
    assert member["verdict"] == "config_mismatch" and member["cause"]["code"] == "ConfigMismatch"
    assert c.status["verdicts"]["configMismatch"] == 1
    assert c.revisions() == {old: 3, new: 1} and c.min_ready_seen >= 3  # the old replicas serve
    # Undo: put the spec back. The old pods are still there and seeded: Ready at once, no bootstrap.
    assert c.set_spec(router={"blockSize": 16}) == old
    d = c.reconcile()
    assert d.pause_deployment is False and d.deploy_revision == old and d.admit == ()
    assert c.condition("Ready") == ("False", "ReplicasNotReady")  # the held pod is still running
    c.tick()  # the Deployment controller removes it
    c.reconcile()
    assert c.revisions() == {old: 3}
    assert c.condition("Ready") == ("True", "AllReplicasReady") and c.condition("Stalled")[0] == "False"


def test_a_config_mismatch_with_no_sibling_serving_is_admitted_and_called_cache_blind():
    c = Cluster(fleet_obj({"replicas": 2}))
    c.script = mismatching({revision_of(c.fleet)})
    c.run(8)
    assert c.condition("Ready") == ("True", "AllReplicasReady")  # never gate alone: that deadlocks
    status, reason = c.condition("CacheWarm")
    assert (status, reason) == ("False", "ConfigMismatch")
    cache = next(x["message"] for x in c.status["conditions"] if x["type"] == "CacheWarm")
    assert "block size 16" in cache and c.status["warmReplicas"] == 0


def test_a_rollback_names_the_cause_of_the_failed_seed():
    c = first_deploy(rollout={"onSeedFailure": "Rollback"})
    new = c.set_spec(router={"blockSize": 32})
    c.script = mismatching({new})
    c.run(10)
    assert c.status["rollout"]["phase"] == "RolledBack"
    assert "block size 16; this router is configured for 32" in stalled_message(c)
    assert "block size 16" in c.status["rollout"]["rollbackMessage"]


def test_a_failed_seed_carries_the_routers_cause():
    c = first_deploy()
    new = c.set_spec(router={"image": "v2"})
    refused = ("PeerRefused", "peer rf-a's snapshot refused: hashing_mismatch (another block size)")
    c.script = lambda p, c_: (
        report(Verdict.TIMED_OUT, seed_failed=True, cause=refused) if p.revision == new else natural(p, c_)
    )
    c.run(10)
    assert c.condition("Stalled") == ("True", "SeedFailurePaused")
    assert "peer rf-a's snapshot refused: hashing_mismatch" in stalled_message(c)


def test_a_fleet_whose_engines_cannot_be_discovered_stalls_after_the_bound_and_recovers():
    c = first_deploy()
    new = c.set_spec(engines={"serviceName": "missing"})
    blind = ("NoEnginesDiscovered", "no engines discovered: no ready endpoint in EndpointSlices ...")
    engines_found = False

    def script(p, c_):
        if p.revision == new and not engines_found:
            return report(Verdict.PENDING, settled=False, cause=blind)
        return natural(p, c_)

    c.script = script
    c.run(30)
    assert c.condition("Stalled") == ("False", "AsExpected")  # within the bound: progressing
    c.now += timedelta(seconds=31)
    c.reconcile()
    assert c.condition("Stalled") == ("True", "NoEnginesDiscovered")
    assert c.condition("Ready") == ("False", "NoEnginesDiscovered")
    assert "no engines discovered" in stalled_message(c) and "spec.engines" in stalled_message(c)
    assert len(c.events("NoEnginesDiscovered")) == 1
    c.reconcile()
    assert len(c.events("NoEnginesDiscovered")) == 1  # said once
    c.now += timedelta(hours=1)  # past the progress deadline too: the condition's reason stays
    for _ in range(3):
        c.reconcile()
    assert c.condition("Stalled") == ("True", "NoEnginesDiscovered")
    assert len(c.events("NoEnginesDiscovered")) == 1 and c.events("ProgressDeadlineExceeded") == []
    # Not a hold: the engines appear and the rollout goes on by itself.
    engines_found = True
    for p in c.pods.values():
        if p.revision == new:
            p.report = report(Verdict.PENDING, settled=False)
    c.run(30)
    assert c.status["currentRevision"] == new and c.condition("Ready")[0] == "True"


def test_each_member_keeps_the_verdict_it_was_seeded_with():
    c = first_deploy(replicas=2)
    seeded = {m["pod"]: (m["seededVerdict"], m["seededAt"]) for m in c.status["members"]}
    assert {v for v, _at in seeded.values()} == {"no_peers"} and all(at for _v, at in seeded.values())
    # The engines restart, the routers' live verdicts change; the history does not.
    for p in c.pods.values():
        p.report = report(Verdict.WARM_UNWITNESSED)
    c.run(3)
    after = {m["pod"]: (m["seededVerdict"], m["seededAt"], m["verdict"]) for m in c.status["members"]}
    assert {k: v[:2] for k, v in after.items()} == seeded
    assert {v[2] for v in after.values()} == {"warm_unwitnessed"}


def test_a_cause_is_read_leniently():
    assert Cause.parse({"code": "ConfigMismatch", "message": "x" * 2000}).message == "x" * 512
    for bad in (None, "text", {"code": 3}, {"code": "lower"}, {"code": "Bad Code"}, {"code": "A" * 65}):
        assert Cause.parse(bad) is None
    assert Cause.parse({"code": "PeerRefused"}) == Cause("PeerRefused", "")
