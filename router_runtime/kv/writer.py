"""The index writer: the one task that mutates the index.

Subscriptions hand it decoded batches and control commands; it applies them in arrival order, each
synchronously, so readers on the same loop only ever see whole batches. Batches are bounded in count
and bytes: a batch that does not fit is refused and the subscription treats it as lost (it clears its
rank: cold, never wrong). Control commands (clear, remove) are never refused, so ordering holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..worker import Carrier
from .events import SequencedBatch
from .index import TIER_ORDER, ApplyStats, RadixIndex
from .metrics import KVMetrics

log = logging.getLogger(__name__)


class ClearReason(enum.StrEnum):
    """Why a rank's blocks were dropped; a metric label."""

    PUBLISHER_RESTART = "publisher_restart"
    UNCOVERED_GAP = "uncovered_gap"  # the engine's replay buffer had moved past our cursor
    REPLAY_FAILED = "replay_failed"  # the replay timed out, was truncated or malformed
    MALFORMED_BATCH = "malformed_batch"
    OVERFLOW = "overflow"
    WORKER_REMOVED = "worker_removed"
    ADOPTION_FAILED = "adoption_failed"  # a re-adoption decision failed (a bug): the rank resumes cold
    BOOTSTRAP_HELD = "bootstrap_held"  # its health returned while its bootstrap held it: unprovable
    FLUSH = "flush"  # a flush through the router reset its engine (kv/withhold.py)
    WITHHOLD_EXPIRED = "withhold_expired"  # its credit was withheld and nothing proved it in time
    SUBSCRIPTION_FAILED = "subscription_failed"  # its subscription failed (a bug, a refused endpoint)


@dataclass(slots=True)
class _Item:
    carrier: Carrier
    batch: SequencedBatch | None = None
    clear: ClearReason | None = None
    remove: bool = False
    call: Callable[[RadixIndex], object] | None = None
    done: asyncio.Future | None = None
    touches: tuple[Carrier, ...] = ()  # the carriers a call changes: their gauges are read again


# How long the eviction record of a carrier that left the index is kept: longer than any sensible
# session TTL (default 10 minutes), so a memory cannot outlive the record that contradicts it.
EVICTION_MEMORY_S = 24 * 3600.0
MAX_CREDIT_WATCHES = 4096  # per carrier: requests in flight on a credited prefix; past it the oldest go


@dataclass(slots=True, eq=False)
class CreditWatch:
    """A decision's credited prefix on one carrier (its first ``blocks`` blocks of ``tokens``), watched
    while its request runs: ``evicted`` once a batch of the engine's own removals or clears, applied
    after the decision, leaves the index crediting less of it (the engine evicted what the index
    credited, and said so). The prefix is matched again only after such a batch on that carrier, so a
    cache that evicts nothing costs nothing."""

    carrier: Carrier
    tokens: Sequence[int]
    lora_name: str | None
    cache_salt: str | None
    blocks: int
    evicted: bool = False


class IndexWriter:
    def __init__(
        self,
        index: RadixIndex,
        metrics: KVMetrics,
        *,
        max_batches: int = 10_000,
        max_bytes: int = 256 << 20,
        yield_every: int = 64,
    ) -> None:
        self.index = index
        self.metrics = metrics
        # Told of every batch applied, with what it did, and of every rank cleared or removed (None):
        # kv/withhold.py ends a withhold on that evidence.
        self.on_applied: Callable[[Carrier, ApplyStats | None], None] | None = None
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.yield_every = yield_every
        self._queue: deque[_Item] = deque()
        self._batches = 0
        self._bytes = 0
        self._wake = asyncio.Event()
        self._touched: set[Carrier] = set()
        # The last sequence applied per carrier: the cursors a snapshot export reports. A cleared or
        # removed carrier has none until its next batch (nothing could prove continuity for it).
        self.applied: dict[Carrier, int] = {}
        # How many times each carrier was cleared or removed: a snapshot's walk spans writer turns, and
        # a carrier cleared meanwhile (a restart, under the same incarnation or a new one) is left out.
        self.resets: dict[Carrier, int] = {}
        # When each carrier last lost blocks, or may have lost some we did not see (monotonic): a
        # removal, a clear, tiers dropped on adoption, a graft, the carrier removed, and its first
        # batch after joining or a clear (what it evicted before is unknown to us). Session affinity
        # trusts a remembered engine beyond the index only if nothing of that happened since the
        # memory was written (sessions/classify.py); a carrier never seen here (events off) has no
        # entry. Kept after a carrier is removed (it may come back under the same identity, cold);
        # entries older than EVICTION_MEMORY_S of carriers gone from the index are pruned.
        self.evicted_at: dict[Carrier, float] = {}
        self._watched: set[Carrier] = set()  # carriers with a batch applied since their last clear
        self._credits: dict[Carrier, dict[int, CreditWatch]] = {}  # by id, oldest first
        self._pruned_at = time.monotonic()

    def watch_credit(self, w: CreditWatch) -> CreditWatch:
        """Watch ``w`` until ``unwatch_credit``."""
        on = self._credits.setdefault(w.carrier, {})
        on[id(w)] = w
        if len(on) > MAX_CREDIT_WATCHES:
            del on[next(iter(on))]
        return w

    def unwatch_credit(self, w: CreditWatch) -> None:
        on = self._credits.get(w.carrier)
        if on is not None:
            on.pop(id(w), None)
            if not on:
                del self._credits[w.carrier]

    def _check_credits(self, carrier: Carrier) -> None:
        """After the engine's removals or clears on ``carrier``: which watched prefixes lost credit."""
        index = self.index
        if carrier in index.withheld:  # the index credits it nothing now, whatever the engine holds
            return
        for w in self._credits[carrier].values():
            if not w.evicted:
                m = index.match(w.tokens, lora_name=w.lora_name, cache_salt=w.cache_salt).get(carrier)
                w.evicted = (m.blocks if m is not None else 0) < w.blocks

    def note_eviction(self, carrier: Carrier) -> None:
        """On the writer task (a ``call`` step) or in its place: ``carrier`` lost blocks just now."""
        self.evicted_at[carrier] = time.monotonic()

    # ---- producers -----------------------------------------------------------------------------

    def submit_batch(self, carrier: Carrier, batch: SequencedBatch) -> bool:
        if self._batches >= self.max_batches or self._bytes + batch.nbytes > self.max_bytes:
            self.metrics.queue_overflows.inc()
            return False
        self._batches += 1
        self._bytes += batch.nbytes
        self._push(_Item(carrier, batch=batch))
        return True

    def submit_clear(self, carrier: Carrier, reason: ClearReason) -> None:
        self._push(_Item(carrier, clear=reason))

    def submit_remove(self, carrier: Carrier) -> None:
        self._push(_Item(carrier, remove=True, clear=ClearReason.WORKER_REMOVED))

    def call(self, fn: Callable[[RadixIndex], object], touches: Iterable[Carrier] = ()) -> asyncio.Future:
        """Run ``fn(index)`` on the writer, in order with everything queued before it. ``touches``: the
        carriers whose blocks it may change (their gauges are read again after it)."""
        fut = asyncio.get_running_loop().create_future()
        self._push(_Item(Carrier(""), call=fn, done=fut, touches=tuple(touches)))
        return fut

    async def drain(self) -> None:
        """Wait until everything queued so far has been applied."""
        await self.call(lambda _index: None)

    def _push(self, item: _Item) -> None:
        self._queue.append(item)
        self.metrics.queue_depth.set(self._batches)
        self.metrics.queue_bytes.set(self._bytes)
        self._wake.set()

    # ---- the writer task -----------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            n = 0
            while self._queue:
                self._apply(self._queue.popleft())
                n += 1
                if n % self.yield_every == 0:
                    self.index.maintain()
                    self._publish_gauges()
                    await asyncio.sleep(0)  # let readers and the sockets in between batches
            self.index.maintain()
            self._publish_gauges()

    def _apply(self, item: _Item) -> None:
        m = self.metrics
        index = self.index
        if item.call is not None:
            try:
                result = item.call(index)
            except Exception as exc:  # the caller gets it; the writer goes on
                if not item.done.done():
                    item.done.set_exception(exc)
            else:
                if not item.done.done():
                    item.done.set_result(result)
            self._touched.update(item.touches)
            return
        self._touched.add(item.carrier)
        if item.batch is not None:
            sb = item.batch
            self._batches -= 1
            self._bytes -= sb.nbytes
            t0 = time.perf_counter()
            stats = index.apply_batch(item.carrier, sb.batch)
            self.applied[item.carrier] = sb.seq
            if stats.removed or stats.cleared or item.carrier not in self._watched:
                self.note_eviction(item.carrier)
                self._watched.add(item.carrier)
                if (stats.removed or stats.cleared) and item.carrier in self._credits:
                    self._check_credits(item.carrier)
            m.apply_seconds.observe(time.perf_counter() - t0)
            m.batches.inc()
            self._count(stats)
            if self.on_applied is not None:
                self.on_applied(item.carrier, stats)
            return
        self.applied.pop(item.carrier, None)
        self.resets[item.carrier] = self.resets.get(item.carrier, 0) + 1
        self.note_eviction(item.carrier)
        self._watched.discard(item.carrier)
        if item.remove:
            index.remove_carrier(item.carrier)
            self._prune_evictions()
        else:
            index.clear_carrier(item.carrier)
        m.ranks_cleared.labels(item.clear.value).inc()
        log.info("rank %s cleared: %s", item.carrier, item.clear.value)
        if self.on_applied is not None:
            self.on_applied(item.carrier, None)

    def _prune_evictions(self) -> None:
        """Forget the records of carriers long gone from the index (no session memory outlives them);
        at most once a minute, so a mass removal does not scan the table per carrier."""
        now = time.monotonic()
        if now - self._pruned_at < 60:
            return
        self._pruned_at = now
        horizon = now - EVICTION_MEMORY_S
        live = set(self.index.carriers)
        for c in [c for c, t in self.evicted_at.items() if t < horizon and c not in live]:
            del self.evicted_at[c]
            self.resets.pop(c, None)  # long gone: no walk spans its removal

    def _count(self, stats: ApplyStats) -> None:
        m = self.metrics
        for (event, medium), n in stats.events.items():
            m.events.labels(event, medium or "none").inc(n)
            if event == "AllBlocksCleared":
                m.ranks_cleared.labels("all_blocks_cleared").inc(n)
        if stats.stored:
            m.blocks.labels("stored").inc(stats.stored)
        if stats.removed:
            m.blocks.labels("removed").inc(stats.removed)
        for reason, n in stats.skipped.items():
            m.skipped_blocks.labels(str(reason)).inc(n)

    def _publish_gauges(self) -> None:
        m = self.metrics
        m.queue_depth.set(self._batches)
        m.queue_bytes.set(self._bytes)
        m.nodes.set(self.index.node_count())
        known = set(self.index.carriers)
        for carrier in self._touched:
            counts = self.index.carrier_blocks(carrier)
            for tier in TIER_ORDER:
                labels = (carrier.engine, str(carrier.rank), tier.name.lower())
                if carrier in known:
                    m.index_blocks.labels(*labels).set(counts[tier])
                else:
                    with contextlib.suppress(KeyError):
                        m.index_blocks.remove(*labels)
            capacity = self.index.device_capacity(carrier)  # None once the carrier is removed
            if capacity is not None:
                m.device_capacity.labels(carrier.engine, str(carrier.rank)).set(capacity)
            else:
                with contextlib.suppress(KeyError):
                    m.device_capacity.remove(carrier.engine, str(carrier.rank))
        self._touched.clear()
