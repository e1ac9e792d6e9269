"""Prometheus metrics of the request plane, on the router's own registry (like ``KVMetrics``).

Label children are cached per label tuple, so the hot path costs a dict lookup and an ``inc`` rather
than ``labels()``'s lock and validation per request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .audit import TIERS, Audit, AuditOutcome, Prediction

_DECISION_BUCKETS = (1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 5e-3, 2.5e-2)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
_TOKEN_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
_UPSTREAM_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_"
        self.requests = Counter(
            p + "requests",
            "Requests answered, by policy, outcome and the status sent to the client",
            ["policy", "outcome", "status"],
            registry=registry,
        )
        self.decision_seconds = Histogram(
            p + "routing_decision_seconds",
            "Time the policy took to choose a target",
            registry=registry,
            buckets=_DECISION_BUCKETS,
        )
        self.shed = Counter(
            p + "shed_requests",
            "Requests turned away (429) because their objective is sheddable and every engine was"
            " saturated (scheduling/admission.py)",
            registry=registry,
        )
        self.untokenized = Counter(
            p + "untokenized_requests",
            "Requests routed without tokens: the router cannot tokenize them as the engine would",
            ["reason"],
            registry=registry,
        )
        self.matched_ratio = Histogram(
            p + "routing_matched_prefix_ratio",
            "Matched share of the request's prefix on the chosen target (blocks, or characters)",
            registry=registry,
            buckets=_RATIO_BUCKETS,
        )
        self.inflight = Gauge(
            p + "inflight", "Requests the router has in flight, per engine", ["engine"], registry=registry
        )
        self.body_budget_held = Gauge(
            p + "body_budget_held_bytes",
            "Bytes the request bodies being read and parsed hold of the body budget (--body-budget-bytes;"
            " a request that found it full waited, then got a 503: outcome overloaded)",
            registry=registry,
        )
        self.upstream_seconds = Histogram(
            p + "upstream_seconds",
            "Engine response time: to the response headers (first_byte) and to its end (total)",
            ["phase"],
            registry=registry,
            buckets=_UPSTREAM_BUCKETS,
        )
        self.retries = Counter(
            p + "retries", "Requests retried on another engine, by reason", ["reason"], registry=registry
        )
        self.decisions = Counter(
            p + "routing_decisions",
            "Routing decisions, by policy and reason",
            ["policy", "reason"],
            registry=registry,
        )
        self.engines = Gauge(
            p + "engines", "Known engines by circuit-breaker state", ["state"], registry=registry
        )
        self.breaker_transitions = Counter(
            p + "breaker_transitions",
            "Circuit-breaker state changes, by the state entered",
            ["state"],
            registry=registry,
        )
        # The prediction audit (audit.py): the router's credited prefix against the engine's report.
        audit = ["engine", "policy", "doubtful"]
        self.audit_requests = Counter(
            p + "audit_requests",
            "Routed requests by how the engine's cached tokens compared with the prediction",
            ["engine", "policy", "outcome", "doubtful"],
            registry=registry,
        )
        self.audit_predicted = Counter(
            p + "audit_predicted_tokens", "Cached tokens predicted, on audited requests", audit,
            registry=registry,
        )  # fmt: skip
        self.audit_predicted_tier = Counter(
            p + "audit_predicted_tier_tokens",
            "Cached tokens predicted on audited requests, by the tier the index holds them in",
            ["engine", "policy", "tier"],
            registry=registry,
        )
        self.audit_cached = Counter(
            p + "audit_cached_tokens", "Cached tokens the engines reported, on audited requests", audit,
            registry=registry,
        )  # fmt: skip
        self.audit_false_hit = Counter(
            p + "audit_false_hit_tokens",
            "Tokens predicted cached that the engine did not have (the promise this router keeps)",
            audit,
            registry=registry,
        )
        self.audit_missed_hit = Counter(
            p + "audit_missed_hit_tokens", "Tokens the engine had cached beyond the prediction", audit,
            registry=registry,
        )  # fmt: skip
        self.audit_evicted = Counter(
            p + "audit_evicted_tokens",
            "Tokens predicted cached that the engine evicted before admitting the request, as its own"
            " events since the decision show (not a false hit: the index was right when it decided)",
            audit,
            registry=registry,
        )
        # Decisions on an in-flight prediction (a request just sent there, not yet stored): what they
        # counted on beyond the index, and what of it the engine then served from its cache.
        self.audit_inflight_predicted = Counter(
            p + "audit_inflight_predicted_tokens",
            "Tokens predicted by requests just sent to the engine (not yet stored), on audited requests",
            audit,
            registry=registry,
        )
        self.audit_inflight_reused = Counter(
            p + "audit_inflight_reused_tokens",
            "Of the in-flight predicted tokens, those the engine reported cached",
            audit,
            registry=registry,
        )
        self.audit_false_hit_per_request = Histogram(
            p + "audit_false_hit_tokens_per_request",
            "False-hit tokens of one audited request",
            ["policy"],
            registry=registry,
            buckets=_TOKEN_BUCKETS,
        )
        self.first_byte = self.upstream_seconds.labels("first_byte")
        self.total = self.upstream_seconds.labels("total")
        self._requests: dict[tuple[str, str, int], object] = {}
        self._decisions: dict[tuple[str, str], object] = {}
        self._inflight: dict[str, object] = {}
        self._retries: dict[str, object] = {}
        self._audit: dict[tuple[str, str, str], _AuditSeries] = {}

    def request(self, policy: str, outcome: str, status: int) -> None:
        key = (policy, outcome, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.requests.labels(policy, outcome, str(status))
        child.inc()

    def decision(self, policy: str, reason: str) -> None:
        key = (policy, reason)
        child = self._decisions.get(key)
        if child is None:
            child = self._decisions[key] = self.decisions.labels(policy, reason)
        child.inc()

    def retry(self, reason: str) -> None:
        child = self._retries.get(reason)
        if child is None:
            child = self._retries[reason] = self.retries.labels(reason)
        child.inc()

    def set_inflight(self, engine: str, n: int) -> None:
        child = self._inflight.get(engine)
        if child is None:
            child = self._inflight[engine] = self.inflight.labels(engine)
        child.set(n)

    def audit(self, engine: str, policy: str, prediction: Prediction, audit: Audit) -> None:
        doubtful = "true" if prediction.doubtful else "false"
        key = (engine, policy, doubtful)
        c = self._audit.get(key)
        if c is None:  # the label lookups cost more than the rest of the audit: once per series
            c = self._audit[key] = _AuditSeries(
                {o: self.audit_requests.labels(engine, policy, o.value, doubtful) for o in AuditOutcome},
                self.audit_predicted.labels(engine, policy, doubtful),
                self.audit_cached.labels(engine, policy, doubtful),
                self.audit_false_hit.labels(engine, policy, doubtful),
                self.audit_missed_hit.labels(engine, policy, doubtful),
                self.audit_false_hit_per_request.labels(policy),
                tuple(self.audit_predicted_tier.labels(engine, policy, t) for t in TIERS),
                self.audit_inflight_predicted.labels(engine, policy, doubtful),
                self.audit_inflight_reused.labels(engine, policy, doubtful),
                self.audit_evicted.labels(engine, policy, doubtful),
            )
        c.requests[audit.outcome].inc()
        if audit.outcome is AuditOutcome.UNAUDITED:
            return
        c.predicted.inc(prediction.tokens)
        c.cached.inc(
            prediction.tokens
            - audit.false_hit_tokens
            - audit.evicted_tokens
            + audit.missed_hit_tokens
            + audit.inflight_reused_tokens
            + audit.transferred_tokens
        )
        if prediction.inflight_tokens:
            c.inflight_predicted.inc(prediction.inflight_tokens)
            c.inflight_reused.inc(audit.inflight_reused_tokens)
        for child, n in zip(c.tiers, prediction.tiers, strict=True):
            if n:
                child.inc(n)
        # Incremented by zero too: a router that is never wrong shows a false-hit ratio of 0, not no data.
        c.false_hit.inc(audit.false_hit_tokens)
        c.missed_hit.inc(audit.missed_hit_tokens)
        if audit.evicted_tokens:
            c.evicted.inc(audit.evicted_tokens)
        c.false_hit_per_request.observe(audit.false_hit_tokens)

    def forget_engines(self, keep: set[str]) -> None:
        """Drop the inflight series of engines that left (and have nothing in flight)."""
        for engine in list(self._inflight):
            if engine not in keep:
                del self._inflight[engine]
                self.inflight.remove(engine)


@dataclass(frozen=True, slots=True)
class _AuditSeries:
    """The audit's children for one (engine, policy, doubtful)."""

    requests: dict[AuditOutcome, Any]
    predicted: Any
    cached: Any
    false_hit: Any
    missed_hit: Any
    false_hit_per_request: Any
    tiers: tuple[Any, ...]
    inflight_predicted: Any
    inflight_reused: Any
    evicted: Any
