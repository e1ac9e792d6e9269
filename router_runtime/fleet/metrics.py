"""Fleet load metrics, under ``routerfleet_fleet_*``: which sources the view is built from right now, and
what became of each report and engine read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_fleet_"
        self.reports = Counter(
            p + "peer_reports", "Sibling load reports received, by outcome", ["outcome"], registry=registry
        )
        self.sends = Counter(
            p + "gossip_sends",
            "Load reports sent to siblings, by outcome (busy: the previous one to it still in flight)",
            ["outcome"],
            registry=registry,
        )
        self.engine_reads = Counter(
            p + "engine_reads",
            "Reads of an engine's /metrics for its load, by outcome",
            ["outcome"],
            registry=registry,
        )
        self.peers_fresh = Gauge(
            p + "peers_reporting",
            "Siblings whose latest load report is within its age bound",
            registry=registry,
        )
        self.load = Gauge(
            p + "load",
            "The fleet load the policy sees per engine (sum over its targets), what each source says, and"
            " the siblings' claims its own reads contradicted (discounted)",
            ["engine", "source"],
            registry=registry,
        )
