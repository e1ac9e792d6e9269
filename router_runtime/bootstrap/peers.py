"""Sibling router replicas to bootstrap from.

An empty peer set has two meanings and conflating them is the failure mode: "the watch has not
delivered yet" (routine at start) and "synced and I have no siblings". ``synced`` tells them apart,
and ``ever_had_peers`` marks a dip to empty after siblings were seen (a slice repack, a rollout where
every sibling is briefly not ready) as transient rather than as "alone". A relist is published only
when complete, by the discovery feeding this.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass

from ..worker import WorkerSpec


@dataclass(frozen=True, slots=True)
class Peer:
    name: str  # the pod name (targetRef), or the URL for static peers
    url: str  # base URL of its internal port, e.g. http://10.244.0.7:9090
    ip: str = ""


def peers_of(specs: Iterable[WorkerSpec]) -> list[Peer]:
    """Sibling replicas as the peer watch finds them (a WorkerSpec per pod, ``namespace/pod`` and the
    internal port's URL): the pod name and the address self-exclusion compares with POD_IP (an IPv6
    one without its brackets)."""
    return [Peer(s.engine.rpartition("/")[2], s.url, s.host) for s in specs]


class PeerRegistry:
    def __init__(self, *, self_name: str | None = None, self_ip: str | None = None) -> None:
        # Self-exclusion: POD_NAME against each endpoint's targetRef (it excludes the whole pod, both
        # address families), POD_IP as the fallback for endpoints without one.
        self.self_name = self_name or None
        self.self_ip = self_ip or None
        self.synced = False
        self.ever_had_peers = False
        self._peers: list[Peer] = []

    def publish(self, peers: list[Peer]) -> None:
        """A complete peer set (never a partial relist)."""
        mine = [p for p in peers if not self._is_self(p)]
        self._peers = mine
        self.synced = True
        self.ever_had_peers = self.ever_had_peers or bool(mine)

    def _is_self(self, p: Peer) -> bool:
        if self.self_name and p.name:
            return p.name == self.self_name
        return bool(self.self_ip) and p.ip == self.self_ip

    @property
    def peers(self) -> list[Peer]:
        return list(self._peers)

    def candidates(self, rng: random.Random | None = None) -> list[Peer]:
        """Shuffled, so replicas booting together do not all stampede the first peer."""
        out = list(self._peers)
        (rng or random).shuffle(out)
        return out
