"""Prometheus metrics of the KV event plane. One instance per router, on the router's own registry (so
several routers can run in one process, as the tests do)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class KVMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_kv_"
        self.events = Counter(
            p + "events", "KV events applied, by type and medium", ["event", "medium"], registry=registry
        )
        self.blocks = Counter(
            p + "event_blocks", "Block tiers stored or removed in the index", ["op"], registry=registry
        )
        self.batches = Counter(p + "batches", "Event batches applied", registry=registry)
        self.gaps = Counter(p + "gaps", "Sequence gaps detected on a rank's stream", registry=registry)
        self.stalled = Gauge(
            p + "stalled_ranks",
            "Ranks whose engine owes a batch (it stored blocks for a request) for longer than the stall"
            " threshold: a silent stream, its predictions doubtful",
            registry=registry,
        )
        self.replays = Counter(p + "replays", "Gap replays, by outcome", ["outcome"], registry=registry)
        self.ranks_cleared = Counter(
            p + "ranks_cleared", "Ranks whose blocks were cleared, by reason", ["reason"], registry=registry
        )
        self.malformed = Counter(
            p + "malformed_frames", "Frames skipped as malformed, by reason", ["reason"], registry=registry
        )
        self.skipped_events = Counter(
            p + "skipped_events", "Events or fields skipped while decoding", ["reason"], registry=registry
        )
        self.skipped_blocks = Counter(
            p + "skipped_blocks", "Blocks not indexed, by reason", ["reason"], registry=registry
        )
        self.config_mismatch = Gauge(
            p + "config_mismatch",
            "1 for a rank whose stores this router's configuration refuses and none it accepts",
            ["engine", "rank", "reason"],
            registry=registry,
        )
        self.withholds = Counter(
            p + "rank_withholds",
            "Ranks whose credit was withheld (routed cold, predictions doubtful), by reason",
            ["reason"],
            registry=registry,
        )
        self.withhold_ends = Counter(
            p + "rank_withhold_ends",
            "Withheld ranks given their credit back, by how",
            ["how"],
            registry=registry,
        )
        self.withheld = Gauge(p + "ranks_withheld", "Ranks whose credit is withheld now", registry=registry)
        self.nodes = Gauge(p + "index_nodes", "Nodes in the radix index", registry=registry)
        self.index_blocks = Gauge(
            p + "index_blocks",
            "Blocks held per engine, rank and tier",
            ["engine", "rank", "tier"],
            registry=registry,
        )
        self.device_capacity = Gauge(
            p + "device_capacity_blocks",
            "Device cache size per engine and rank, as its evictions showed (absent until one evicts)",
            ["engine", "rank"],
            registry=registry,
        )
        self.subscriptions_live = Gauge(
            p + "subscriptions_live", "Rank subscriptions receiving events", registry=registry
        )
        self.queue_depth = Gauge(p + "queue_depth", "Batches waiting for the index writer", registry=registry)
        self.queue_bytes = Gauge(
            p + "queue_bytes", "Payload bytes waiting for the index writer", registry=registry
        )
        self.queue_overflows = Counter(
            p + "queue_overflows", "Batches dropped on a full writer queue", registry=registry
        )
        self.apply_seconds = Histogram(
            p + "apply_seconds",
            "Time to apply one batch to the index",
            registry=registry,
            buckets=(1e-6, 5e-6, 2e-5, 1e-4, 5e-4, 2e-3, 1e-2, 5e-2, 0.25),
        )
        # Every label value exists from the start, so dashboards and alerts see zeros, not gaps.
        # (Imported here: the subscription module imports this one.)
        from .decode import MalformedReason
        from .subscription import ReplayOutcome

        for o in (*ReplayOutcome, "unavailable"):
            self.replays.labels(str(o))
        for r in (*MalformedReason, "rank_mismatch"):
            self.malformed.labels(str(r))
