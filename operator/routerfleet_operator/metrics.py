"""The operator's Prometheus metrics (served by ``routerfleet-operator run --metrics-port N``; off by
default).

    routerfleet_operator_reconciles_total{result}            ok | conflict | invalid | gone | error
    routerfleet_operator_reconcile_duration_seconds{result}  one reconcile (read, decide, apply)
    routerfleet_operator_rollouts_total{outcome}             started | complete | paused | rolled_back |
                                                             deadline_exceeded (from the decision's Events)
    routerfleet_operator_seeded_total{verdict}               replicas seeded, by their bootstrap verdict
    routerfleet_operator_seed_failures_total{policy}         failed seeds, by onSeedFailure (Pause |
                                                             Rollback | Proceed)
    routerfleet_operator_fleet_verdicts{namespace,fleet,verdict}   status.verdicts (replicas per verdict)
    routerfleet_operator_fleet_phase{namespace,fleet,phase}        1 for the fleet's rollout phase, else 0
    routerfleet_operator_fleet_replicas{namespace,fleet,kind}      desired | ready | warm | updated

The per-fleet gauges are dropped when the fleet is gone. ``observe`` only reads a Decision: the metrics
never feed back into a decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .model import OnSeedFailure, Phase

PREFIX = "routerfleet_operator_"
RESULTS = ("ok", "conflict", "invalid", "gone", "error")
# Event reasons of a Decision -> the rollout outcome they mark.
OUTCOME_OF_EVENT = {
    "RolloutStarted": "started",
    "RolloutComplete": "complete",
    "SeedFailurePaused": "paused",
    "RolledBack": "rolled_back",
    "ProgressDeadlineExceeded": "deadline_exceeded",
}
SEED_FAILURE_EVENTS = {
    "SeedFailurePaused": "Pause",
    "RolledBack": "Rollback",
    "SeedFailedProceeding": "Proceed",
}
REPLICA_KINDS = (
    ("desired", None),
    ("ready", "readyReplicas"),
    ("warm", "warmReplicas"),
    ("updated", "updatedReplicas"),
)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY):
        p = PREFIX
        self.reconciles = Counter(
            p + "reconciles", "Reconciles of a fleet, by result", ["result"], registry=registry
        )
        self.reconcile_seconds = Histogram(
            p + "reconcile_duration_seconds",
            "Duration of one reconcile (read, decide, apply), by result",
            ["result"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        self.rollouts = Counter(
            p + "rollouts", "Rollout transitions, by outcome", ["outcome"], registry=registry
        )
        self.seeded = Counter(
            p + "seeded", "Replicas seeded (gate set), by bootstrap verdict", ["verdict"], registry=registry
        )
        self.seed_failures = Counter(
            p + "seed_failures",
            "Failed seeds, by the onSeedFailure policy applied",
            ["policy"],
            registry=registry,
        )
        for policy in OnSeedFailure:  # zeros from the start, not a gap on the dashboard
            self.seed_failures.labels(policy=policy.value)
        self.fleet_verdicts = Gauge(
            p + "fleet_verdicts",
            "Replicas of a fleet per bootstrap verdict (status.verdicts)",
            ["namespace", "fleet", "verdict"],
            registry=registry,
        )
        self.fleet_phase = Gauge(
            p + "fleet_phase",
            "1 for the fleet's rollout phase, 0 for the others",
            ["namespace", "fleet", "phase"],
            registry=registry,
        )
        self.fleet_replicas = Gauge(
            p + "fleet_replicas",
            "Replicas of a fleet: desired, ready, warm, updated",
            ["namespace", "fleet", "kind"],
            registry=registry,
        )
        for r in RESULTS:  # the series exist from the start (rate() over a fresh counter)
            self.reconciles.labels(result=r)
        for o in OUTCOME_OF_EVENT.values():
            self.rollouts.labels(outcome=o)
        self._verdicts_seen: dict[tuple[str, str], set[str]] = {}

    def reconciled(self, result: str, seconds: float) -> None:
        self.reconciles.labels(result=result).inc()
        self.reconcile_seconds.labels(result=result).observe(seconds)

    def observe(
        self,
        namespace: str,
        fleet: str,
        obj: Mapping[str, Any],
        status: Mapping[str, Any] | None,
        event_reasons: list[str],
        admitted_verdicts: list[str],
        desired: int | None = None,
    ) -> None:
        """One applied decision: its Events, its admissions and the status it wrote. ``desired``: the
        parsed spec's replicas (default: ``obj``'s spec.replicas, else 0)."""
        for reason in event_reasons:
            if (outcome := OUTCOME_OF_EVENT.get(reason)) is not None:
                self.rollouts.labels(outcome=outcome).inc()
            if (policy := SEED_FAILURE_EVENTS.get(reason)) is not None:
                self.seed_failures.labels(policy=policy).inc()
        for v in admitted_verdicts:
            self.seeded.labels(verdict=v).inc()
        if not status:
            return
        key = (namespace, fleet)
        counts = status.get("verdicts") or {}
        for v in self._verdicts_seen.get(key, set()) - set(counts):
            self.fleet_verdicts.remove(namespace, fleet, v)
        for v, n in counts.items():
            self.fleet_verdicts.labels(namespace, fleet, v).set(n)
        self._verdicts_seen[key] = set(counts)
        phase = (status.get("rollout") or {}).get("phase")
        for ph in Phase:
            self.fleet_phase.labels(namespace, fleet, ph.value).set(1 if ph.value == phase else 0)
        if desired is None:
            desired = (obj.get("spec") or {}).get("replicas") or 0
        for kind, field in REPLICA_KINDS:
            value = desired if field is None else status.get(field) or 0
            self.fleet_replicas.labels(namespace, fleet, kind).set(value)

    def forget(self, namespace: str, fleet: str) -> None:
        """The fleet is gone: drop its series."""
        for v in self._verdicts_seen.pop((namespace, fleet), set()):
            self.fleet_verdicts.remove(namespace, fleet, v)
        for gauge, values in (
            (self.fleet_phase, [ph.value for ph in Phase]),
            (self.fleet_replicas, [k for k, _ in REPLICA_KINDS]),
        ):
            for value in values:
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, fleet, value)


METRICS = OperatorMetrics()
