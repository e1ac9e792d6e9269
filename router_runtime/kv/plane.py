"""The KV event plane as a whole: the index, its writer, and one subscription per (engine, rank) of the
current worker set. Discovery (static or Kubernetes) hands it the worker set; it diffs and reconciles.
A worker whose incarnation changed is a different engine: its old blocks are gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

import zmq.asyncio
from prometheus_client import CollectorRegistry

from .index import Carrier, RadixIndex
from .metrics import KVMetrics
from .subscription import Endpoints, RankSubscription, ReplayTimeouts
from .writer import IndexWriter

log = logging.getLogger(__name__)


class RankListener(Protocol):
    def rank_added(self, sub: RankSubscription) -> None: ...

    def rank_removed(self, carrier: Carrier) -> None: ...


def rank_endpoint(base: str, rank: int) -> str:
    """Engines bind one PUB (and one replay ROUTER) per DP rank at base port + rank (tcp only)."""
    if rank == 0:
        return base
    head, _, port = base.rpartition(":")
    if not head.startswith("tcp://") or not port.isdigit():
        raise ValueError(f"per-rank endpoints need tcp://host:port, got {base!r}")
    return f"{head}:{int(port) + rank}"


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

    def carriers(self) -> list[Carrier]:
        return [Carrier(self.engine, r) for r in range(self.dp_size)]


class KVPlane:
    def __init__(
        self,
        block_size: int,
        registry: CollectorRegistry,
        *,
        replay_timeouts: ReplayTimeouts | None = None,
        queue_batches: int = 10_000,
        queue_bytes: int = 256 << 20,
    ) -> None:
        self.registry = registry
        self.index = RadixIndex(block_size)
        self.metrics = KVMetrics(registry)
        self.writer = IndexWriter(self.index, self.metrics, max_batches=queue_batches, max_bytes=queue_bytes)
        self.replay_timeouts = replay_timeouts or ReplayTimeouts()
        self._ctx = zmq.asyncio.Context()
        self._workers: dict[str, WorkerSpec] = {}
        self._subs: dict[Carrier, tuple[RankSubscription, asyncio.Task]] = {}
        self._writer_task: asyncio.Task | None = None
        # The bootstrap listens here: a new rank starts holding; a removed one stops mattering.
        self.rank_listener: RankListener | None = None

    async def start(self) -> None:
        self._writer_task = asyncio.create_task(self.writer.run(), name="kv-index-writer")

    async def stop(self) -> None:
        tasks = [t for _s, t in self._subs.values()]
        if self._writer_task:
            tasks.append(self._writer_task)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._subs.clear()
        self._ctx.term()

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        return dict(self._workers)

    def set_workers(self, specs: list[WorkerSpec]) -> None:
        """Reconcile subscriptions with a complete worker set (never a partial one)."""
        want = {s.engine: s for s in specs}
        for engine, old in list(self._workers.items()):
            if want.get(engine) != old:
                self._drop(old)
        for engine, spec in want.items():
            if self._workers.get(engine) != spec:
                self._add(spec)
        self._workers = want
        self.metrics.subscriptions_live.set(sum(1 for s, _t in self._subs.values() if s.connected))

    def _add(self, spec: WorkerSpec) -> None:
        if spec.kv is None:
            return
        for rank, carrier in enumerate(spec.carriers()):
            endpoints = Endpoints(
                rank_endpoint(spec.kv, rank),
                rank_endpoint(spec.replay, rank) if spec.replay else None,
                spec.topic,
            )
            sub = RankSubscription(
                self._ctx, carrier, endpoints, self.writer, self.metrics, timeouts=self.replay_timeouts
            )
            if self.rank_listener is not None:
                self.rank_listener.rank_added(sub)  # before the socket exists: nothing escapes the hold
            task = asyncio.create_task(sub.run(), name=f"kv-sub-{carrier}")
            self._subs[carrier] = (sub, task)
        log.info("subscribed to engine %s (%d ranks)", spec.engine, spec.dp_size)

    def _drop(self, spec: WorkerSpec) -> None:
        for carrier in spec.carriers():
            entry = self._subs.pop(carrier, None)
            if entry:
                entry[1].cancel()
            if self.rank_listener is not None:
                self.rank_listener.rank_removed(carrier)
            self.writer.submit_remove(carrier)
        log.info("dropped engine %s", spec.engine)

    def subscriptions(self) -> list[RankSubscription]:
        return [s for s, _t in self._subs.values()]

    def live(self) -> bool:
        """At least one rank subscription is connected to its publisher."""
        subs = self.subscriptions()
        self.metrics.subscriptions_live.set(sum(1 for s in subs if s.connected))
        return any(s.connected for s in subs)
