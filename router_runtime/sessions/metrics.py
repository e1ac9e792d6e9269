"""Session-affinity metrics, on the router's registry. Every (session_state, selection) pair and every
lookup and write result is initialised to zero, so rates exist before the first event."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .classify import Selection, SessionState

LOOKUP_RESULTS = ("hit", "miss", "timeout", "error")
WRITE_RESULTS = ("written", "too_large", "timeout", "error")
HINT_RESULTS = ("used", "unknown", "ignored")
EVICTION_REASONS = ("ttl", "capacity")
_LOOKUP_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 5e-2)


class SessionMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_session_"
        self.selections = Counter(
            p + "selections",
            "Classified routing selections: the session state and whether the remembered engine was chosen",
            ["session_state", "selection"],
            registry=registry,
        )
        self.lookups = Counter(
            p + "lookups", "Session store lookups, by result", ["result"], registry=registry
        )
        self.lookup_seconds = Histogram(
            p + "lookup_seconds",
            "Session store lookup time (bounded by the lookup deadline)",
            registry=registry,
            buckets=_LOOKUP_BUCKETS,
        )
        self.writes = Counter(p + "writes", "Session store writes, by result", ["result"], registry=registry)
        self.hints = Counter(
            p + "hints",
            "Inbound engine hints: used (trusted and resolved), unknown (trusted, names no engine we "
            "know), ignored (untrusted: stripped)",
            ["result"],
            registry=registry,
        )
        self.entries = Gauge(p + "store_entries", "Entries in the local session store", registry=registry)
        self.evictions = Counter(
            p + "store_evictions", "Session store evictions, by reason", ["reason"], registry=registry
        )
        self.inherited = Counter(
            p + "inherited", "Session entries inherited from a sibling's snapshot", registry=registry
        )
        self._sel = {
            (s, k): self.selections.labels(s.value, k.value) for s in SessionState for k in Selection
        }
        self._lookups = {r: self.lookups.labels(r) for r in LOOKUP_RESULTS}
        self._writes = {r: self.writes.labels(r) for r in WRITE_RESULTS}
        self._hints = {r: self.hints.labels(r) for r in HINT_RESULTS}
        self._evictions = {r: self.evictions.labels(r) for r in EVICTION_REASONS}

    def selection(self, state: SessionState, sel: Selection) -> None:
        self._sel[(state, sel)].inc()

    def lookup(self, result: str, seconds: float) -> None:
        self._lookups[result].inc()
        self.lookup_seconds.observe(seconds)

    def write(self, result: str) -> None:
        self._writes[result].inc()

    def hint(self, result: str) -> None:
        self._hints[result].inc()

    def evicted(self, reason: str) -> None:
        self._evictions[reason].inc()
