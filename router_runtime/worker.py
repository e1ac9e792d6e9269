"""Who the router talks to, as every plane names it: an engine (``WorkerSpec``, what discovery finds)
and one of its data-parallel ranks (``Carrier``, what holds KV blocks). At the bottom of the house:
nothing here imports the rest of the router, so discovery, the proxy and the sessions depend on these
names without depending on the KV plane or ZeroMQ."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from yarl import URL


class Role(enum.StrEnum):
    """What an engine serves in a disaggregated fleet (docs/disaggregation.md). Discovery says it; the
    router never guesses it."""

    BOTH = "both"  # a whole engine: prefills and decodes its own requests (every fleet without P/D)
    PREFILL = "prefill"  # computes a prompt's KV for a decode engine to take; never answers a client
    DECODE = "decode"  # decodes, taking a remote prefill's KV when the router sends it one


@dataclass(frozen=True, slots=True, order=True)
class Carrier:
    """Who holds a block: one engine's data-parallel rank. ``engine`` is the worker identity string."""

    engine: str
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.engine}#{self.rank}"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One engine, as discovery sees it."""

    engine: str  # identity: the HTTP URL for static workers, the pod name in Kubernetes
    url: str  # where requests go
    kv: str | None = None  # PUB endpoint of rank 0; None: the engine publishes no events
    replay: str | None = None  # replay ROUTER of rank 0
    dp_size: int = 1
    topic: bytes = b""
    incarnation: str = ""  # a pod UID, or empty for static workers
    storage_id: str = ""  # the engine's storage identity when discovery knows it (else /server_info)
    storage_epoch: int = 0
    role: Role = Role.BOTH
    # The engine's revision (a pod template hash): a prefill engine hands its KV only to a decode engine
    # of the same revision, whose model and KV layout match. "": unknown (static workers pair freely).
    revision: str = ""
    bootstrap_port: int | None = None  # a prefill engine's KV bootstrap server (SGLang's); None: default

    def carriers(self) -> list[Carrier]:
        return [Carrier(self.engine, r) for r in range(self.dp_size)]

    @property
    def host(self) -> str:
        """The URL's host, an IPv6 address without its brackets (what POD_IP holds)."""
        return URL(self.url).host or ""
