"""The drain on SIGTERM: how long the router stays up, not Ready, after its stop was asked for.

Its clients learn that it is going from the outside, each at its own pace: a Service's endpoints and
the kube-proxy rules follow the pod's deletion in about a second; a gateway's data plane follows its
control plane's next xDS push, which on a loaded node can come several seconds later. A request or a
pick that reaches a router which no longer listens is lost (a gateway answers it 500), so the drain
ends only once ``minimum`` has passed and nothing has arrived for ``quiet``, and at ``maximum`` at the
latest (the pod's grace period must still hold the requests in flight after it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

QUIET_S = 1.0  # no request or pick for this long: every client has moved off


@dataclass
class Drain:
    """One drain: when it began, and what still arrived since (the proxy's requests, the picker's
    streams)."""

    minimum: float
    maximum: float
    quiet: float = QUIET_S
    began: float = field(default_factory=time.monotonic)
    requests: int = 0
    picks: int = 0
    last: float | None = None  # when the latest of them arrived

    def request(self) -> None:
        self.requests += 1
        self.last = time.monotonic()

    def pick(self) -> None:
        self.picks += 1
        self.last = time.monotonic()

    def remaining(self, now: float) -> float:
        """How much longer to drain (0: done), by the rule in the module's docstring. With nothing
        arrived, the minimum alone (0: no drain)."""
        quiet = self.quiet - (now - self.last) if self.last is not None else 0.0
        wait = max(self.began + self.minimum - now, quiet, 0.0)
        return min(wait, max(self.began + self.maximum - now, 0.0))

    def summary(self, now: float) -> str:
        """A log line's worth: what arrived while draining, and how late the last of it came."""
        late = f", the last {self.last - self.began:.1f}s in" if self.last is not None else ""
        took = now - self.began
        return f"drained {took:.1f}s: {self.requests} requests and {self.picks} picks arrived{late}"
