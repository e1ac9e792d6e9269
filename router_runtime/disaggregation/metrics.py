"""Prometheus metrics of disaggregation, on the router's registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from ..proxy.audit import Audit
from .decider import Verdict

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class PdMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_pd_"
        self.prefills = Counter(
            p + "prefills",
            "Requests to a disaggregated fleet, by how their prompt was prefilled (remote, or why not)",
            ["verdict"],
            registry=registry,
        )
        self.remote_tokens = Counter(
            p + "remote_prefill_tokens",
            "Prompt tokens the decode engines lacked (by the index) when a prefill engine computed them",
            registry=registry,
        )
        self.leg_failures = Counter(
            p + "prefill_leg_failures",
            "Prefill legs that gave no transfer parameters, by reason",
            ["reason"],
            registry=registry,
        )
        self.leg_seconds = Histogram(
            p + "prefill_leg_seconds",
            "A successful prefill leg, from dispatch to its whole answer",
            registry=registry,
            buckets=_SECONDS,
        )
        self.audits = Counter(
            p + "prefill_audits",
            "Prefill legs audited: the prefill engine's cached tokens against its decision's credit",
            ["outcome"],
            registry=registry,
        )
        self.audit_false_hit = Counter(
            p + "prefill_audit_false_hit_tokens",
            "Tokens a prefill decision credited that the prefill engine did not have cached",
            registry=registry,
        )
        self._verdicts = {v: self.prefills.labels(v.value) for v in Verdict}

    def verdict(self, v: Verdict) -> None:
        self._verdicts[v].inc()

    def prefill_audit(self, audit: Audit) -> None:
        self.audits.labels(audit.outcome.value).inc()
        self.audit_false_hit.inc(audit.false_hit_tokens)
