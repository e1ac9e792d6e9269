"""The KV event plane as a whole: the index, its writer, and one subscription per (engine, rank) of the
current worker set. Discovery (static or Kubernetes) hands it the worker set; it diffs and reconciles.

With a disconnect grace window (``disconnect_grace_s`` > 0), an engine that leaves discovery, changes
spec or fails health is not erased: its carriers become DISCONNECTED (invisible to every reader) and,
if it returns within the window, go through the adoption decision (``readoption.py`` holds that
lifecycle and its state machines; this class only reconciles subscriptions). Without one, a worker
that left is dropped at once and a changed spec is a different engine."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from prometheus_client import CollectorRegistry

from ..tasks import end_tasks, retire
from ..worker import Carrier, WorkerSpec
from .adoption import CarrierState, DisconnectCause, StorageIdentity
from .config import KvConfig
from .fit import Misfit
from .hold import RankHold
from .index import RadixIndex
from .metrics import KVMetrics
from .readoption import Readoption
from .sockets import Sockets
from .subscription import Endpoints, RankSubscription
from .withhold import Withholds
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


class KVPlane:
    def __init__(
        self,
        config: KvConfig,
        registry: CollectorRegistry,
        *,
        storage_lookup: Callable[[WorkerSpec], Awaitable[StorageIdentity | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.registry = registry
        self.index = RadixIndex(config.block_size)
        self.metrics = KVMetrics(registry)
        self.writer = IndexWriter(
            self.index, self.metrics, max_batches=config.queue_batches, max_bytes=config.queue_bytes
        )
        # Ranks routed cold until the index is known to follow their engine again (withhold.py).
        self.withholds = Withholds(self.index, self.writer, self.metrics, bound_s=config.withhold_s)
        self.replay_timeouts = config.replay
        self.sockets = Sockets()  # every subscription's, replay's and probe's
        self._workers: dict[str, WorkerSpec] = {}
        self._subs: dict[Carrier, tuple[RankSubscription, asyncio.Task]] = {}
        self._ending: set[asyncio.Task] = set()  # subscriptions cancelled, still closing their sockets
        self._writer_task: asyncio.Task | None = None
        # The bootstrap listens here: a new rank starts holding; a removed one stops mattering.
        self.rank_listener: RankListener | None = None
        # Engines across their absence (readoption.py): OK or DISCONNECTED, and what they proved.
        self.readoption = Readoption(
            self,
            registry,
            grace_s=config.disconnect_grace_s,
            cap=config.adoption_cap,
            window_s=config.adoption_window_s,
            storage_lookup=storage_lookup,
            clock=clock,
        )
        # A rank whose engine has owed a batch this long is stalled (doubtful); 0: never.
        self.stall_s = config.stall_s
        self.metrics.stalled.set_function(self._stalled_ranks)

    async def start(self) -> None:
        self._writer_task = asyncio.create_task(self.writer.run(), name="kv-index-writer")

    async def stop(self) -> None:
        """Bounded, and never blocks the loop: every task of the plane is cancelled and awaited (each
        closes its own sockets as it ends), then the ZMQ context is ended, closing whatever a task
        that outlived the bound still holds (both named in a warning)."""
        self.withholds.stop()
        tasks = [*self.readoption.stop(), *(t for _s, t in self._subs.values()), *self._ending]
        try:
            await end_tasks([*tasks, self._writer_task], "KV plane")
        finally:
            self._subs.clear()
            self.sockets.close()

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        return dict(self._workers)

    def set_workers(self, specs: list[WorkerSpec]) -> None:
        """Reconcile subscriptions with a complete worker set (never a partial one)."""
        want = {s.engine: s for s in specs}
        readoption = self.readoption
        for engine, old in list(self._workers.items()):
            if want.get(engine) != old:
                if readoption.enabled and old.kv is not None:
                    readoption.disconnect(old, DisconnectCause.DISCOVERY)
                else:
                    self._drop(old)
        for engine, spec in want.items():
            if self._workers.get(engine) != spec:
                rec = readoption.returning(spec)
                if rec is not None:
                    readoption.back(rec, spec)
                else:
                    self.subscribe(spec)
                    readoption.track(spec)
        self._workers = want
        self.metrics.subscriptions_live.set(sum(1 for s, _t in self._subs.values() if s.connected))

    def subscribe(
        self, spec: WorkerSpec, holds: dict[int, RankHold] | None = None
    ) -> dict[int, RankSubscription]:
        """Subscribe to every rank of ``spec``. ``holds``: a returning engine's, one per rank, attached
        until its re-adoption decides; else the bootstrap is told of each new rank (and may hold it)."""
        if spec.kv is None:
            return {}
        subs = {}
        for rank, carrier in enumerate(spec.carriers()):
            endpoints = Endpoints(
                rank_endpoint(spec.kv, rank),
                rank_endpoint(spec.replay, rank) if spec.replay else None,
                spec.topic,
            )
            sub = RankSubscription(
                self.sockets, carrier, endpoints, self.writer, self.metrics, timeouts=self.replay_timeouts
            )
            if holds is not None:
                if (hold := holds.get(rank)) is not None:
                    sub.attach(hold)
            elif self.rank_listener is not None:
                self.rank_listener.rank_added(sub)  # before the socket exists: nothing escapes the hold
            task = asyncio.create_task(sub.follow(), name=f"kv-sub-{carrier}")
            self._subs[carrier] = (sub, task)
            subs[rank] = sub
        log.info("subscribed to engine %s (%d ranks)", spec.engine, spec.dp_size)
        return subs

    def unsubscribe(self, carrier: Carrier) -> None:
        """End the rank's subscription (if any) and tell the bootstrap it no longer matters."""
        entry = self._subs.pop(carrier, None)
        if entry:
            retire(entry[1], self._ending)
        self.withholds.forget(carrier)
        if self.rank_listener is not None:
            self.rank_listener.rank_removed(carrier)

    def _drop(self, spec: WorkerSpec) -> None:
        self.readoption.forget(spec.engine)
        for carrier in spec.carriers():
            self.unsubscribe(carrier)
            self.writer.submit_remove(carrier)
        log.info("dropped engine %s", spec.engine)

    def subscription(self, carrier: Carrier) -> RankSubscription | None:
        entry = self._subs.get(carrier)
        return entry[0] if entry is not None else None

    def subscriptions(self) -> list[RankSubscription]:
        return [s for s, _t in self._subs.values()]

    def live(self) -> bool:
        """At least one rank subscription is connected to its publisher."""
        subs = self.subscriptions()
        self.metrics.subscriptions_live.set(sum(1 for s in subs if s.connected))
        return any(s.connected for s in subs)

    def misfits(self) -> dict[Carrier, Misfit]:
        """Ranks whose live stores do not fit this router's configuration (kv/fit.py)."""
        return {s.carrier: m for s in self.subscriptions() if (m := s.fit.misfit) is not None}

    # ---- reads -------------------------------------------------------------------------------

    def carrier_states(self) -> dict[str, CarrierState]:
        return self.readoption.carrier_states()

    def doubtful(self, carrier: Carrier) -> bool:
        """Whether what the index holds for this rank is in a state allowed to lag its engine: batches
        held (a bootstrap or a re-adoption deciding) or the engine not plainly connected. O(1)."""
        if self.readoption.hidden(carrier.engine) or carrier in self.withholds:
            return True
        entry = self._subs.get(carrier)
        if entry is None:
            return False
        sub = entry[0]
        hold = sub.hold
        return (
            (hold is not None and hold.active)
            or sub.filling
            or (self.stall_s > 0 and sub.stalled(time.monotonic(), self.stall_s))
        )

    def expect_batch(self, carrier: Carrier, since: float) -> None:
        """A request dispatched to this rank at ``since`` (``time.monotonic()``) made its engine store
        new blocks (its usage says so): a batch is due on the rank's stream. One that stays silent
        past ``stall_s`` makes the rank doubtful until a batch arrives."""
        entry = self._subs.get(carrier)
        if entry is not None:
            entry[0].expect_batch(since)

    def _stalled_ranks(self) -> int:
        if self.stall_s <= 0:
            return 0
        now = time.monotonic()
        return sum(sub.stalled(now, self.stall_s) for sub, _ in self._subs.values())

    # ---- health (the proxy's breakers) ---------------------------------------------------------

    def engine_unreachable(self, engine: str) -> None:
        """The engine fails health (its breaker opened): hide its carriers. Its subscriptions keep
        running, so its stream's continuity is still tracked (a gap or a restart clears the rank)."""
        spec = self._workers.get(engine)
        if spec is not None:
            self.readoption.unreachable(spec)

    def engine_reachable(self, engine: str) -> None:
        """The engine passes health again (its breaker closed): its ranks are proved before shown."""
        spec = self._workers.get(engine)
        if spec is not None:
            self.readoption.reachable(spec)
