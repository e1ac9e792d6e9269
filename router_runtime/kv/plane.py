"""The KV event plane as a whole: the index, its writer, and one subscription per (engine, rank) of the
current worker set. Discovery (static or Kubernetes) hands it the worker set; it diffs and reconciles.

With a disconnect grace window (``disconnect_grace_s`` > 0), an engine that leaves discovery, changes
spec or fails health is not erased: its carriers become DISCONNECTED (invisible to every reader) and,
if it returns within the window, go through the adoption decision of ``adoption.py``. Without one
(the default here), a worker that left is dropped at once and a changed spec is a different engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp
import routerfleet_index
import zmq.asyncio
from prometheus_client import CollectorRegistry

from ..worker import Carrier, WorkerSpec
from .adoption import (
    ALL,
    AdoptionCap,
    AdoptionMetrics,
    CarrierState,
    Decision,
    DisconnectCause,
    EngineRecord,
    Outcome,
    StorageIdentity,
    decide,
    parse_storage,
)
from .events import SequencedBatch
from .fit import Misfit
from .hold import HoldEnd, RankHold
from .index import RadixIndex, as_native
from .metrics import KVMetrics
from .subscription import (
    Endpoints,
    RankSubscription,
    ReplayOutcome,
    ReplayTimeouts,
    StreamPosition,
    payload_hash,
    replay,
)
from .writer import ClearReason, IndexWriter

log = logging.getLogger(__name__)

# Worst first: one return's outcome is its worst rank's.
_OUTCOME_ORDER = (Outcome.IDENTITY_MISMATCH, Outcome.EPOCH_MISMATCH, Outcome.REJECTED, Outcome.SUCCESS)
PROBE_ATTEMPTS = 3  # replays a returning rank's probe may ask for when the first get no answer


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
        block_size: int,
        registry: CollectorRegistry,
        *,
        replay_timeouts: ReplayTimeouts | None = None,
        queue_batches: int = 10_000,
        queue_bytes: int = 256 << 20,
        disconnect_grace_s: float = 0.0,
        adoption_cap: int = 3,
        adoption_window_s: float = 3600.0,
        storage_lookup: Callable[[WorkerSpec], Awaitable[StorageIdentity | None]] | None = None,
        clock: Callable[[], float] = time.monotonic,
        stall_s: float = 2.0,
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
        # Carrier lifecycle (adoption.py): engines we know, OK or DISCONNECTED, and what they proved.
        self.disconnect_grace_s = disconnect_grace_s
        self.adoption_metrics = AdoptionMetrics(registry)
        self._records: dict[str, EngineRecord] = {}
        self._cap = AdoptionCap(adoption_cap, adoption_window_s)
        self._storage_lookup = storage_lookup or lookup_storage
        self._clock = clock
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: dict[str, set[asyncio.Task]] = {}  # per engine: lookups and pending decisions
        self._undecided: dict[Carrier, int] = {}  # returning ranks awaiting a decision -> generation
        # A rank whose engine has owed a batch this long is stalled (doubtful); 0: never.
        self.stall_s = stall_s
        self.metrics.stalled.set_function(self._stalled_ranks)

    async def start(self) -> None:
        self._writer_task = asyncio.create_task(self.writer.run(), name="kv-index-writer")

    async def stop(self) -> None:
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        tasks = [t for _s, t in self._subs.values()]
        tasks += [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
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
                if self.disconnect_grace_s > 0 and old.kv is not None:
                    self._disconnect(old, DisconnectCause.DISCOVERY)
                else:
                    self._drop(old)
        for engine, spec in want.items():
            if self._workers.get(engine) != spec:
                rec = self._records.get(engine)
                if rec is not None and rec.state is CarrierState.DISCONNECTED and spec.kv is not None:
                    self._return(rec, spec)
                else:
                    self._add(spec)
                    self._track(spec)
        self._workers = want
        self.metrics.subscriptions_live.set(sum(1 for s, _t in self._subs.values() if s.connected))

    def _add(self, spec: WorkerSpec, holds: dict[int, RankHold] | None = None) -> dict[int, RankSubscription]:
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
                self._ctx, carrier, endpoints, self.writer, self.metrics, timeouts=self.replay_timeouts
            )
            if holds is not None:
                sub.hold = holds.get(rank)  # a returning engine: held until the adoption decision
            elif self.rank_listener is not None:
                self.rank_listener.rank_added(sub)  # before the socket exists: nothing escapes the hold
            task = asyncio.create_task(sub.run(), name=f"kv-sub-{carrier}")
            self._subs[carrier] = (sub, task)
            subs[rank] = sub
        log.info("subscribed to engine %s (%d ranks)", spec.engine, spec.dp_size)
        return subs

    def _drop(self, spec: WorkerSpec) -> None:
        self._forget(spec.engine)
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

    def misfits(self) -> dict[Carrier, Misfit]:
        """Ranks whose live stores do not fit this router's configuration (kv/fit.py)."""
        return {s.carrier: m for s in self.subscriptions() if (m := s.fit.misfit) is not None}

    # ---- carrier lifecycle: DISCONNECTED, adoption, REMOVED --------------------------------------
    #
    # A map of one return (docs/kv-plane.md, "Carrier lifecycle"). ``_return`` bumps the engine's
    # generation and puts every rank in ``_undecided`` with a hold; each rank then leaves it exactly
    # once, by one of:
    #   same incarnation   _probe -> _rank_proved (continuous: every tier; else cold)
    #                      _probe, cursor -1 -> _recheck_storage (same identity: kept; else below)
    #                      restart seen (live or probe) -> _restarted_in_place -> _decide_new_process
    #   new incarnation    _decide_new_process -> _apply_decision (storage tiers or nothing)
    #   any                hold overflow / stream reset -> _hold_lost -> _resume_cold
    #                      a failed task -> _task_done -> _resume_cold
    #                      leaving again -> _disconnect (nothing decided; the hold dropped)
    # When the last rank of the generation leaves, _settle_if_done -> _reconnected: the engine is OK,
    # its return counted once, and what a new process proved becomes its storage identity (none, if
    # a new process was seen but never judged). A return that discovery ends before it settles
    # (_disconnect) counts nothing; one the breaker stops settles cold when shown again. Every
    # callback carries the generation it was made for; a newer one makes it a no-op.

    def carrier_states(self) -> dict[str, CarrierState]:
        return {e: r.state for e, r in self._records.items()}

    def doubtful(self, carrier: Carrier) -> bool:
        """Whether what the index holds for this rank is in a state allowed to lag its engine: batches
        held (a bootstrap or a re-adoption deciding) or the engine not plainly connected. O(1)."""
        rec = self._records.get(carrier.engine)
        if rec is not None and rec.state is not CarrierState.OK:
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

    def engine_unreachable(self, engine: str) -> None:
        """The engine fails health (its breaker opened): hide its carriers. Its subscriptions keep
        running, so its stream's continuity is still tracked (a gap or a restart clears the rank)."""
        spec = self._workers.get(engine)
        if spec is None or spec.kv is None or self.disconnect_grace_s <= 0:
            return
        rec = self._records.get(engine)
        if (
            rec is not None
            and rec.state is CarrierState.DISCONNECTED
            and not self._undecided_of(rec, rec.generation)
        ):
            return  # already hidden; but a return being decided is stopped (it resumes cold)
        self._disconnect(spec, DisconnectCause.HEALTH)

    def engine_reachable(self, engine: str) -> None:
        """The engine passes health again (its breaker closed). Hidden for health, its subscriptions
        ran all along, but a process can restart behind an open breaker without a batch to show it:
        its ranks are held and proved by their probes, as a returning engine's are."""
        spec = self._workers.get(engine)
        rec = self._records.get(engine)
        if spec is None or rec is None or rec.state is not CarrierState.DISCONNECTED:
            return
        carriers = spec.carriers()
        if not all(c in self._subs for c in carriers) or any(c in self._undecided for c in carriers):
            return  # it left discovery meanwhile, or returned: the discovery path decides
        rec.generation += 1
        self._await_proof(rec, rec.generation, spec, True, {c.rank: self._subs[c][0] for c in carriers})

    def _track(self, spec: WorkerSpec) -> None:
        """A fresh engine: remember it and learn its storage identity (in the background)."""
        if self.disconnect_grace_s <= 0 or spec.kv is None:
            return
        rec = self._records[spec.engine] = EngineRecord(spec.engine, spec)
        gen = rec.generation

        async def learn() -> None:
            storage = await self._lookup(spec)
            if rec.generation == gen and self._records.get(spec.engine) is rec:
                rec.storage = storage

        self._spawn(spec.engine, learn())
        self._publish_states()

    async def _lookup(self, spec: WorkerSpec) -> StorageIdentity | None:
        try:
            return await asyncio.wait_for(self._storage_lookup(spec), self.replay_timeouts.total_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine that cannot prove its storage is treated as having none
            log.info("storage identity of %s unknown: %s", spec.engine, exc)
            return None

    def _spawn(self, engine: str, coro: Awaitable, gen: int | None = None) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        tasks = self._tasks.setdefault(engine, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if gen is not None:
            task.add_done_callback(lambda t: self._task_done(engine, gen, t))
        return task

    def _task_done(self, engine: str, gen: int, task: asyncio.Task) -> None:
        """A probe or decision of generation ``gen`` that failed (a bug) must not leave the engine's
        ranks hidden and held forever: whatever of that generation is still undecided resumes cold."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("engine %s: adoption task failed", engine, exc_info=task.exception())
        rec = self._records.get(engine)
        if rec is None or rec.generation != gen:
            return
        for c in self._undecided_of(rec, gen):
            entry = self._subs.get(c)
            if entry is not None and entry[0].hold is not None:
                hold, entry[0].hold = entry[0].hold, None  # the stream flows to the writer again
                hold.abandon()
            self._resume_cold(rec, c, gen, ClearReason.ADOPTION_FAILED)

    def _keep_evictions(self, c: Carrier, batches: list[SequencedBatch]) -> None:
        """Held batches that will never be applied (their stream's continuity went unproved) may still
        say what the engine evicted: removals only ever make the index colder, so apply those (a
        process that dies right after evicting from its disk must not have them re-adopted)."""
        evictions = routerfleet_index.Batch.evictions([as_native(b.batch) for b in batches])
        if len(evictions):
            self.writer.call(lambda idx: idx.apply_batch(c, evictions))
            self.writer.note_eviction(c)

    def _undecided_of(self, rec: EngineRecord, gen: int) -> list[Carrier]:
        return [c for c, g in self._undecided.items() if c.engine == rec.engine and g == gen]

    def _cancel_tasks(self, engine: str) -> None:
        for t in self._tasks.pop(engine, set()):
            t.cancel()

    def _forget(self, engine: str) -> None:
        self._cancel_tasks(engine)
        h = self._timers.pop(engine, None)
        if h is not None:
            h.cancel()
        if self._records.pop(engine, None) is not None:
            self._publish_states()

    def _disconnect(self, spec: WorkerSpec, cause: DisconnectCause) -> None:
        """OK -> DISCONNECTED: hide every carrier at once (readers never see it again until adopted),
        keep its blocks, start the grace timer."""
        rec = self._records.get(spec.engine)
        if rec is None:
            rec = self._records[spec.engine] = EngineRecord(spec.engine, spec)
        self._cancel_tasks(spec.engine)  # a storage lookup or a decision in flight is stale now
        rec.generation += 1
        if rec.state is not CarrierState.DISCONNECTED:
            rec.state = CarrierState.DISCONNECTED
            rec.disconnected_at = self._clock()
        undecided = False
        for carrier in spec.carriers():
            pending = self._undecided.pop(carrier, None) is not None
            undecided |= pending
            if pending and cause is not DisconnectCause.DISCOVERY:
                rec.outcomes.append(Outcome.REJECTED)  # it resumes cold (below), counted when shown
            if pending and cause is not DisconnectCause.DISCOVERY and carrier in self._subs:
                # Failing health before its adoption was decided, its stream still flowing: what it
                # held is not provable any more; it goes on cold (and hidden).
                self.writer.submit_clear(carrier, ClearReason.UNCOVERED_GAP)
                self._release(self._subs[carrier][0])
            self.index.set_visible(carrier, 0)  # synchronous: the very next match no longer sees it
            # ... and queued: a show still waiting in the writer's queue from the return it ends
            # would otherwise undo it.
            self.writer.call(lambda idx, c=carrier: idx.set_visible(c, 0))
            if cause is DisconnectCause.DISCOVERY:
                entry = self._subs.pop(carrier, None)
                if entry:
                    sub, task = entry
                    if pending:
                        # Gone again before the decision: its held batches were never applied, so
                        # it stays judged against what it was before it returned (less what they
                        # evicted).
                        if sub.hold is not None:
                            self._keep_evictions(carrier, sub.hold.abandon())
                    else:
                        rec.positions[carrier.rank] = sub.position()
                    task.cancel()
                if self.rank_listener is not None:
                    self.rank_listener.rank_removed(carrier)
        if undecided and cause is DisconnectCause.DISCOVERY:
            # A return that ended before it settled (a new-process decision takes every undecided
            # rank at once, so none was made): not counted; its ranks are judged on the next return.
            # Stopped by the breaker instead, its ranks went on cold and it settles when shown.
            rec.reset_return()
        if undecided and cause is DisconnectCause.DISCOVERY and rec.prior_spec is not None:
            rec.spec, rec.prior_spec = rec.prior_spec, None
        h = self._timers.pop(spec.engine, None)
        if h is not None:
            h.cancel()
        gen = rec.generation
        self._timers[spec.engine] = asyncio.get_running_loop().call_later(
            max(0.0, rec.disconnected_at + self.disconnect_grace_s - self._clock()),
            self._expire,
            spec.engine,
            gen,
        )
        log.info("engine %s disconnected (%s)", spec.engine, cause.value)
        self._publish_states()

    def _expire(self, engine: str, generation: int) -> None:
        """DISCONNECTED -> REMOVED: the grace window passed."""
        rec = self._records.get(engine)
        if rec is None or rec.generation != generation or rec.state is not CarrierState.DISCONNECTED:
            return
        self._timers.pop(engine, None)
        m = self.adoption_metrics
        m.grace_expirations.inc()
        m.disconnect_window.observe(self._clock() - (rec.disconnected_at or self._clock()))
        for carrier in rec.spec.carriers():
            self._undecided.pop(carrier, None)
            if carrier in self._subs:
                # Still subscribed (hidden for health): forget its blocks, keep it hidden.
                self.writer.submit_clear(carrier, ClearReason.WORKER_REMOVED)
            else:
                self.writer.submit_remove(carrier)
        rec.reset_return()
        if engine in self._workers:
            rec.positions.clear()
            rec.storage = None
            rec.outcomes.append(Outcome.REJECTED)  # hidden for health: when shown again, it is cold
        else:
            del self._records[engine]
        log.info("engine %s removed: grace window passed", engine)
        self._publish_states()

    def _reconnected(self, rec: EngineRecord) -> None:
        h = self._timers.pop(rec.engine, None)
        if h is not None:
            h.cancel()
        self.adoption_metrics.disconnect_window.observe(
            self._clock() - (rec.disconnected_at or self._clock())
        )
        rec.state = CarrierState.OK
        rec.disconnected_at = None
        rec.prior_spec = None
        rec.generation += 1
        # One attempt per return, however many ranks: its worst rank outcome.
        worst = min(rec.outcomes, key=_OUTCOME_ORDER.index, default=None)
        if worst is not None:
            self.adoption_metrics.attempts.labels(worst.value).inc()
        if rec.judged_new:
            rec.storage = rec.proved  # from now on the identity a return is judged against (or none)
        elif rec.new_process_seen:
            rec.storage = None  # a new process none of whose storage was proved: nothing to judge by
        if rec.new_process_adopted:
            self._cap.record(self._cap_key(rec), self._clock())  # the crash loop the cap exists for
        rec.reset_return()
        self._publish_states()

    def _cap_key(self, rec: EngineRecord) -> str:
        return f"storage:{rec.storage.storage_id}" if rec.storage else f"engine:{rec.engine}"

    def _record_outcome(self, outcome: Outcome | None, rec: EngineRecord) -> None:
        """A rank's outcome in the current return (counted, once per return, when it settles)."""
        if outcome is not None:
            rec.outcomes.append(outcome)

    def _return(self, rec: EngineRecord, spec: WorkerSpec) -> None:
        """A DISCONNECTED engine is back in discovery: subscribe with every rank held, and decide."""
        old: WorkerSpec = rec.spec  # type: ignore[assignment]
        same_shape = old.dp_size == spec.dp_size and old.topic == spec.topic
        for gone in set(old.carriers()) - set(spec.carriers()):
            self.writer.submit_remove(gone)  # fewer DP ranks now: those carriers are not coming back
        cap = self._cap.reached(self._cap_key(rec), self._clock())
        same = spec.incarnation == old.incarnation and same_shape and not cap
        h = self._timers.pop(rec.engine, None)
        if h is not None:
            h.cancel()
        rec.generation += 1
        rec.reset_return()
        gen = rec.generation
        carriers = spec.carriers()
        holds: dict[int, RankHold] = {}
        for c in carriers:
            self._undecided[c] = gen
            if same:
                holds[c.rank] = self._return_hold(rec, c, gen, spec, same_shape)
            else:
                holds[c.rank] = self._decision_hold(rec, c, gen)
        subs = self._add(spec, holds)
        rec.spec, rec.prior_spec = spec, old
        if not same:
            for sub in subs.values():
                if sub.endpoints.replay is not None:  # without one, nothing before its first batch is known
                    sub.resume(StreamPosition(cursor=-1))  # a new process: its stream begins at 0
        if same:
            for rank, sub in subs.items():
                sub.resume(rec.positions.get(rank))
            self._await_proof(rec, gen, spec, same_shape, subs, holds_set=True)
            return
        # An empty incarnation (static workers) cannot prove a new process: ``same`` was False only
        # for a changed shape or the cap, and the decision below rejects those.
        rec.new_process_seen = spec.incarnation != old.incarnation
        self._spawn(
            spec.engine,
            self._decide_new_process(rec, gen, spec, same_shape=same_shape, cap=cap),
            gen,
        )

    def _await_proof(
        self,
        rec: EngineRecord,
        gen: int,
        spec: WorkerSpec,
        same_shape: bool,
        subs: dict[int, RankSubscription],
        *,
        holds_set: bool = False,
    ) -> None:
        """Same incarnation: hold every rank (``holds_set``: ``_return`` gave them their holds) and
        probe each for the proof of continuity."""
        for sub in subs.values():
            c = sub.carrier
            if not holds_set:
                self._undecided[c] = gen
                sub.hold = self._return_hold(rec, c, gen, spec, same_shape)
            self._spawn(spec.engine, self._probe(rec, sub, gen, spec, same_shape), gen)

    def _return_hold(
        self, rec: EngineRecord, c: Carrier, gen: int, spec: WorkerSpec, same_shape: bool
    ) -> RankHold:
        return _ReturnHold(
            on_end=lambda why: self._rank_proved(rec, c, gen, continuous=False, why=why),
            on_restart=lambda: self._restarted_in_place(rec, gen, spec, same_shape),
        )

    def _decision_hold(self, rec: EngineRecord, c: Carrier, gen: int) -> RankHold:
        """Holds a new process's batches until its engine's decision (``_apply_decision``) releases them."""
        return RankHold(on_end=lambda why: self._hold_lost(rec, c, gen, why))

    async def _decide_new_process(
        self,
        rec: EngineRecord,
        gen: int,
        spec: WorkerSpec,
        *,
        same_shape: bool,
        cap: bool,
    ) -> None:
        """A new process (a new incarnation, or the same one whose stream restarted): its memory tiers
        are gone; ask it for its storage identity and adopt the storage tiers only if it proves the one
        it had. Decides every rank still undecided, at once (at most once per return)."""
        storage = await self._lookup(spec)
        if rec.generation != gen:
            return
        ranks = [c for c in spec.carriers() if self._undecided.get(c) == gen]
        subs = {c.rank: e[0] for c in ranks if (e := self._subs.get(c)) is not None}
        caught_up = await asyncio.gather(*(self._catch_up(sub) for sub in subs.values()))
        if rec.generation != gen:
            return
        from_start = all(caught_up)
        if not from_start:
            # What is held may not be this publisher's (its answer contradicted it, or never came):
            # keep only its evictions, and follow the publisher from its sequence 0.
            for sub in subs.values():
                if sub.hold is not None and sub.hold.active:
                    self._keep_evictions(sub.carrier, sub.hold.take())
                if sub.endpoints.replay is not None:
                    sub.resume(StreamPosition(cursor=-1))
        claimed = storage is not None and any(
            r is not rec and r.state is CarrierState.OK and r.storage == storage
            for r in self._records.values()
        )
        d = decide(
            rec.storage,  # what it proved when it last settled: the blocks we hold were kept under it
            storage,
            same_shape=same_shape,
            storage_claimed_by_other=claimed,
            cap_reached=cap,
            from_start=from_start,
        )
        applied = self._apply_decision(rec, gen, ranks, subs, d, kept=rec.kept)
        if applied is not None:
            rec.judged_new, rec.proved = True, storage
            rec.new_process_adopted |= d.outcome is Outcome.SUCCESS
            self._settle_if_done(rec, gen)

    async def _recheck_storage(
        self, rec: EngineRecord, sub: RankSubscription, gen: int, spec: WorkerSpec, same_shape: bool
    ) -> None:
        """A rank adopted from a new process that has published nothing since (cursor -1) returns under
        the same incarnation: no batch can show continuity. All it holds are storage-tier blocks kept
        under ``rec.storage`` (its device tier went at that adoption). If the engine still proves
        that identity and epoch and the rank's stream can be followed from sequence 0, they stay
        (same process or not, that is what a new process would be granted); any other identity means
        other storage behind the engine: the whole engine is judged as a new process, once."""
        c = sub.carrier
        storage = await self._lookup(spec)
        if self._undecided.get(c) != gen or rec.new_process_gen == gen:
            return
        claimed = any(
            r is not rec and r.state is CarrierState.OK and r.storage == storage
            for r in self._records.values()
        )
        if storage is None or rec.storage is None:
            self._rank_proved(rec, c, gen, continuous=False)  # nothing to judge its blocks by: this rank cold
            return
        if storage != rec.storage or claimed:
            self._restarted_in_place(rec, gen, spec, same_shape)  # other storage behind the engine
            return
        followed = await self._catch_up(sub)
        self._rank_proved(rec, c, gen, continuous=followed)

    async def _catch_up(self, sub: RankSubscription) -> bool:
        """A new process's rank, held for the decision: fetch what it published before we subscribed
        (its replay buffer from sequence 0) into the hold, in order, so that the blocks it stored and
        evicted meanwhile land beneath the decision's step like the rest of its stream. True only on
        evidence that we have it all: the buffer answered from sequence 0 to its end, or answered
        that it is empty. No replay socket, no answer, a truncated or broken answer, or a buffer that
        no longer reaches 0: what it evicted before we subscribed is unknowable (False)."""
        if sub.endpoints.replay is None:
            return False
        resumes = sub.resumes
        held = (sub.cursor, sub.cursor_hash)  # what the live loop had taken before we asked
        result = await replay(self._ctx, sub.endpoints.replay, 0, self.replay_timeouts)
        got = result.batches
        if got:
            if result.outcome is not ReplayOutcome.FILLED or got[0][0] != 0:
                return False
        elif result.outcome is not ReplayOutcome.UNCOVERED:  # an empty answer maps to UNCOVERED
            return False
        if sub.resumes != resumes:
            return False  # its position was reset meanwhile (a restart seen): the answer is stale
        # The live loop may have taken batches meanwhile. Where they overlap the answer they must be
        # the same batches: a publisher that died after answering and a successor picked up from its
        # sequence 0 would splice two processes. Past the answer's end, the live loop followed the
        # stream from 0 on its own.
        answer = dict(got)
        cursor, known = held
        if cursor is not None and cursor >= 0:
            at = answer.get(cursor)  # it must be there: the answer was asked for after it
            if at is None or payload_hash(at) != known:
                return False
        cursor = sub.cursor
        if cursor is not None and cursor >= 0:
            at = answer.get(cursor)
            if at is not None and payload_hash(at) != sub.cursor_hash:
                return False
        for seq, payload in got:
            if sub.cursor is not None and seq == sub.cursor + 1:
                sub._accept(seq, payload)  # a live batch or a gap replay may have taken some already
        return True

    def _restarted_in_place(self, rec: EngineRecord, gen: int, spec: WorkerSpec, same_shape: bool) -> bool:
        """A returning engine kept its incarnation (Kubernetes keeps a pod's UID across container
        restarts) but its stream shows a new process: a rank's publisher restarted its sequence, or
        its replay buffer holds nothing at or after our cursor. Every rank of the engine is judged as
        a new process, once: their proof holds become plain holds from sequence 0 of the new stream,
        and nothing from the new process can pass as proof of continuity any more. Returns whether the
        engine's ranks are (now, or already) held for that decision."""
        if rec.generation != gen:
            return False
        if rec.new_process_gen == gen:
            return True
        rec.new_process_gen = gen
        rec.new_process_seen = True
        log.info("engine %s returned as a new process (same incarnation, its stream restarted)", rec.engine)
        for c in spec.carriers():
            entry = self._subs.get(c)
            if entry is None or self._undecided.get(c) != gen:
                continue
            sub = entry[0]
            if sub.hold is not None:
                self._keep_evictions(c, sub.hold.abandon())  # the old process's last word, if any
            sub.hold = self._decision_hold(rec, c, gen)
            sub.resume(StreamPosition(cursor=-1))  # the new publisher's stream begins at 0
        cap = self._cap.reached(self._cap_key(rec), self._clock())
        self._spawn(
            rec.engine,
            self._decide_new_process(rec, gen, spec, same_shape=same_shape, cap=cap),
            gen,
        )
        return True

    def _apply_decision(
        self,
        rec: EngineRecord,
        gen: int,
        carriers: list[Carrier],
        subs: dict[int, RankSubscription],
        d: Decision,
        kept: set[Carrier] = frozenset(),  # type: ignore[assignment]
    ) -> bool | None:
        """Decide ``carriers`` still undecided in ``gen`` at once: drop what is not kept, apply their
        held batches, then show them (each a writer step, in that order). None: none was left; else
        whether every rank's held batches reached the writer (an overflow clears that rank). ``kept``:
        ranks this return already kept, before the engine showed it is a new process: the decision
        drops from them what it drops from the others (they were judged as the old process)."""
        live = [c for c in carriers if self._undecided.get(c) == gen]
        if not live:
            return None  # decided meanwhile (reset, overflow)
        log.info("engine %s returned: %s (%s)", rec.engine, d.outcome or "nothing to adopt", d.why)
        for c in live:
            del self._undecided[c]

        def drop(idx: RadixIndex) -> None:
            for c in live:
                if d.keep != ALL:
                    idx.drop_tiers(c, ALL & ~d.keep)
                    self.writer.note_eviction(c)
                self.writer.applied.pop(c, None)  # the old incarnation's cursor means nothing now
            for c in kept:
                if d.keep != ALL:
                    idx.drop_tiers(c, ALL & ~d.keep)
                    self.writer.note_eviction(c)

        # Drop, then the held batches, then show: a reader never sees a block the new stream had
        # already evicted (the writer yields to readers between batches).
        self.writer.call(drop)
        released = all([self._release(subs.get(c.rank)) for c in live])
        self.writer.call(lambda idx: [idx.set_visible(c, ALL) for c in live])
        self._record_outcome(d.outcome if released else Outcome.REJECTED, rec)
        return released

    def _release(self, sub: RankSubscription | None) -> bool:
        """Hand a rank's held batches to the writer, in order, and let the stream flow. False: the
        writer's queue overflowed and the rank was cleared (cold)."""
        if sub is None or sub.hold is None:
            return True
        hold, sub.hold = sub.hold, None
        batches = hold.abandon()
        for b in batches:
            if not self.writer.submit_batch(sub.carrier, b):
                sub._clear(ClearReason.OVERFLOW)
                return False
        return True

    def _hold_lost(self, rec: EngineRecord, c: Carrier, gen: int, why: HoldEnd) -> None:
        """A new incarnation's hold overflowed or its stream reset before the decision: the rank can no
        longer be joined to what we kept; it resumes cold (and visible) from here."""
        reason = ClearReason.OVERFLOW if why is HoldEnd.OVERFLOW else ClearReason.PUBLISHER_RESTART
        self._resume_cold(rec, c, gen, reason)

    def _resume_cold(self, rec: EngineRecord, c: Carrier, gen: int, reason: ClearReason) -> None:
        """Rank ``c``'s return is rejected: cleared, then shown; its stream goes on from here."""
        if self._undecided.get(c) != gen:
            return
        del self._undecided[c]
        self.writer.submit_clear(c, reason)
        self.writer.call(lambda idx: idx.set_visible(c, ALL))
        self._record_outcome(Outcome.REJECTED, rec)
        self._settle_if_done(rec, gen)

    def _rank_proved(
        self,
        rec: EngineRecord,
        c: Carrier,
        gen: int,
        *,
        continuous: bool,
        why: HoldEnd | None = None,
        replayed: list[tuple[int, bytes]] = (),  # type: ignore[assignment]
    ) -> bool:
        """Same incarnation: rank ``c``'s probe showed our cursor's own batch (``continuous``: every
        tier kept; its held batches, then what the probe's replay brought after them, are applied
        before it is shown) or could not (cold: cleared, then shown; ``why`` when its hold ended)."""
        if self._undecided.get(c) != gen or rec.new_process_gen == gen:
            return False
        del self._undecided[c]
        entry = self._subs.get(c)
        sub = entry[0] if entry else None
        if continuous:
            rec.kept.add(c)
            released = self._release(sub)
            for seq, payload in replayed:  # what it published while we were away, in order
                if sub is not None and sub.cursor is not None and seq == sub.cursor + 1:
                    sub._accept(seq, payload)
            self._record_outcome(Outcome.SUCCESS if released else Outcome.REJECTED, rec)
        else:
            # The subscription already queued a clear (a reset) unless the hold overflowed.
            if why is HoldEnd.OVERFLOW or why is None:
                self.writer.submit_clear(c, ClearReason.OVERFLOW if why else ClearReason.UNCOVERED_GAP)
            if sub is not None and sub.hold is not None:
                sub.hold.abandon()
                sub.hold = None
            self._record_outcome(Outcome.REJECTED, rec)
        self.writer.call(lambda idx: idx.set_visible(c, ALL))
        self._settle_if_done(rec, gen)
        return True

    def _settle_if_done(self, rec: EngineRecord, gen: int) -> None:
        if rec.generation == gen and not self._undecided_of(rec, gen):
            self._reconnected(rec)

    async def _probe(
        self, rec: EngineRecord, sub: RankSubscription, gen: int, spec: WorkerSpec, same_shape: bool
    ) -> None:
        """Same incarnation: the one proof of continuity. Its replay buffer must still hold our cursor's
        batch, the very one we applied (its payload hash): then nothing after it is lost to us, and
        the batches held meanwhile follow it. A live batch numbered cursor + 1 proves nothing by
        itself: a restarted publisher may have reached our sequence numbers. A new process shows
        here: its buffer holds nothing at or after our cursor (its sequence went back; the same
        publisher would still hold our cursor, or later batches if it aged), or another batch at our
        cursor's sequence."""
        c = sub.carrier
        # Both read before any await: the live loop moves them as it holds the new batches.
        cursor, known = sub.cursor, sub.cursor_hash
        if cursor is None:
            self._rank_proved(
                rec, c, gen, continuous=False
            )  # it never published: nothing held, nothing to prove
            return
        if known is None and cursor >= 0:
            self._rank_proved(
                rec, c, gen, continuous=False
            )  # a cursor we never saw a batch for: cannot prove
            return
        if cursor < 0:
            await self._recheck_storage(rec, sub, gen, spec, same_shape)
            return
        if sub.endpoints.replay is None:
            self._rank_proved(rec, c, gen, continuous=False)  # nothing can show our cursor
            return
        for _attempt in range(PROBE_ATTEMPTS):  # a busy engine answers its replay socket late
            result = await replay(self._ctx, sub.endpoints.replay, cursor, self.replay_timeouts)
            if self._undecided.get(c) != gen:
                return  # decided meanwhile (its stream restarted, reset or overflowed)
            if result.outcome is not ReplayOutcome.TIMEOUT:
                break
        got = result.batches
        if (not got and result.outcome is ReplayOutcome.UNCOVERED) or (
            got and got[0][0] == cursor and payload_hash(got[0][1]) != known
        ):
            self._restarted_in_place(rec, gen, spec, same_shape)
            return
        ok = bool(got) and got[0][0] == cursor and result.outcome is not ReplayOutcome.MALFORMED
        if not ok:
            self._rank_proved(rec, c, gen, continuous=False)  # it cannot show our cursor: cold
            return
        self._rank_proved(rec, c, gen, continuous=True, replayed=got[1:])

    def _publish_states(self) -> None:
        counts = dict.fromkeys(CarrierState, 0)
        for r in self._records.values():
            counts[r.state] += r.spec.dp_size  # type: ignore[attr-defined]
        for state, n in counts.items():
            self.adoption_metrics.carriers.labels(state.value).set(n)


class _ReturnHold(RankHold):
    """The plane's RankHold for a returning same-incarnation rank: holds its batches until the probe
    proves continuity; a publisher restart seen on its live stream hands the engine to the new-process
    decision instead of clearing the rank."""

    def __init__(self, *, on_end: Callable[[HoldEnd], None], on_restart: Callable[[], bool]) -> None:
        super().__init__(on_end=on_end)
        self._on_restart = on_restart

    def take_over_restart(self) -> bool:
        return self._on_restart()  # True: replaced by a decision hold (the subscription reads it afresh)


async def lookup_storage(spec: WorkerSpec) -> StorageIdentity | None:
    """The engine's storage identity: its /server_info's ``storage_id``/``storage_epoch``, else the
    one discovery found for it (a pod annotation the deployer set), else none."""
    fallback = StorageIdentity(spec.storage_id, spec.storage_epoch) if spec.storage_id else None
    try:
        async with aiohttp.ClientSession() as session:
            for path in ("/server_info", "/get_server_info"):
                url = spec.url.rstrip("/") + path
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 404:
                        continue
                    r.raise_for_status()
                    body = await r.json(content_type=None)
                    found = parse_storage(body) if isinstance(body, dict) else None
                    return found or fallback
    except (aiohttp.ClientError, TimeoutError, ValueError):
        if fallback is None:
            raise
    return fallback
