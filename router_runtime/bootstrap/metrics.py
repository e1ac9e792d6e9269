"""Bootstrap metrics, under ``routerfleet_bootstrap_*`` (the index size is ``routerfleet_kv_index_nodes``).
``seed_failed`` is exported whether or not the readiness gate is armed: with it off, this gauge is the
only thing that says the seed did not land."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..worker import Carrier
from .state import OriginOutcome, RankOutcome, RankState, SnapshotOutcome, SweepResult
from .vetting import VetError

_STATE_VALUE = {RankState.PENDING: 0, RankState.RECOVERED: 1, RankState.SETTLED: 2}


class BootstrapMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_bootstrap_"
        self.settled = Gauge(p + "settled", "1 once this replica's bootstrap has settled", registry=registry)
        self.seed_failed = Gauge(
            p + "seed_failed",
            "1 when siblings were there and their index could not be pulled",
            registry=registry,
        )
        self.state = Gauge(
            p + "rank_state",
            "Per-rank state: 0 pending, 1 recovered (proving), 2 settled",
            ["engine", "rank"],
            registry=registry,
        )
        self.fetches = Counter(
            p + "snapshot_fetches", "Snapshot fetches by outcome", ["outcome"], registry=registry
        )
        self.vet_errors = Counter(
            p + "vet_errors", "Snapshots refused by vetting, by reason", ["reason"], registry=registry
        )
        self.ranks = Counter(
            p + "ranks", "Ranks that finished bootstrapping, by outcome", ["outcome"], registry=registry
        )
        self.sweeps = Counter(p + "sweeps", "Sweeps by result", ["result"], registry=registry)
        self.origin = Counter(
            p + "origin_attempts",
            "Rebuilds from an engine's replay buffer, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.origin_batches = Counter(
            p + "origin_replayed_batches", "Batches replayed for origin rebuilds", registry=registry
        )
        self.origin_bytes = Counter(
            p + "origin_replayed_bytes", "Payload bytes replayed for origin rebuilds", registry=registry
        )
        self.time_to_exact = Histogram(
            p + "origin_time_to_exact_seconds",
            "From a rank's subscription to its exact rebuilt state",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self.peers = Gauge(p + "peers", "Sibling replicas known", registry=registry)
        self.peers_synced = Gauge(
            p + "peers_synced", "1 once peer discovery has listed completely", registry=registry
        )
        # Every label value exists from the start, so dashboards and alerts see zeros, not gaps.
        for o in SnapshotOutcome:
            self.fetches.labels(o.value)
        for r in RankOutcome:
            self.ranks.labels(r.value)
        for s in SweepResult:
            self.sweeps.labels(s.value)
        for o in OriginOutcome:
            self.origin.labels(o.value)
        for e in VetError:
            self.vet_errors.labels(e.value)

    def set_state(self, c: Carrier, state: RankState) -> None:
        self.state.labels(c.engine, str(c.rank)).set(_STATE_VALUE[state])

    def forget(self, c: Carrier) -> None:
        with contextlib.suppress(KeyError):
            self.state.remove(c.engine, str(c.rank))
