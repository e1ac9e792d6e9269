"""Re-adoption: what the KV plane does for an engine across its absence, and the per-rank state
machine of a return. ``adoption.py`` holds the pure parts (the records, the decision, the cap); this
module drives them over the plane's subscriptions.

Engine states (``CarrierState``), one per engine::

    OK --leaves discovery / fails health--> DISCONNECTED --grace window passes--> REMOVED
    OK --its breaker closes, a return having settled while it was open--> DISCONNECTED (proved again)
    DISCONNECTED --every rank of its return decided--> OK

Rank phases (``RankPhase``), one per rank of a return being decided. ``_return`` (or a health
recovery, ``reachable``) bumps the engine's generation and enters each rank, held; each rank then
leaves exactly once, by one of::

    PROVING   (same incarnation)   _probe -> _rank_proved (continuous: every tier; else cold)
                                   _probe, cursor -1 -> _recheck_storage (same identity: kept)
                                   held by its bootstrap (a health return) -> _rank_proved, cold
              --restart seen (live or probe)--> DECIDING   (_restarted_in_place)
    DECIDING  (a new process)      _decide_new_process -> _apply_decision (storage tiers or nothing)
    either                         hold overflow / stream reset -> _hold_lost -> _resume_cold
                                   a failed task -> _task_done -> _resume_cold
                                   leaving again -> disconnect (nothing decided; the hold dropped)

When the last rank of the generation leaves, ``_settle_if_done`` -> ``_reconnected``: the engine is
OK, its return counted once, and what a new process proved becomes its storage identity (none, if a
new process was seen but never judged). A return that discovery ends before it settles counts
nothing; one the breaker stops settles cold when shown again. Every callback carries the generation
it was made for; a newer one makes it a no-op (docs/kv-plane.md, "Carrier lifecycle").
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import routerfleet_index
from prometheus_client import CollectorRegistry

from ..tasks import retire
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
from .hold import HoldEnd, RankHold
from .index import RadixIndex, as_native
from .subscription import RankSubscription, ReplayOutcome, StreamPosition, payload_hash, replay
from .writer import ClearReason

if TYPE_CHECKING:
    from .plane import KVPlane

log = logging.getLogger(__name__)

# Worst first: one return's outcome is its worst rank's.
_OUTCOME_ORDER = (Outcome.IDENTITY_MISMATCH, Outcome.EPOCH_MISMATCH, Outcome.REJECTED, Outcome.SUCCESS)
PROBE_ATTEMPTS = 3  # replays a returning rank's probe may ask for when the first get no answer


class RankPhase(enum.StrEnum):
    """Where one rank of a returning engine stands until it is decided (the module docstring's map)."""

    PROVING = "proving"  # same incarnation: held while its probe looks for our cursor's own batch
    DECIDING = "deciding"  # a new process: held for its engine's storage decision


# The one move between phases; a rank enters in either and leaves (decided) from either.
_MOVES = {(RankPhase.PROVING, RankPhase.DECIDING)}


@dataclass(slots=True)
class _Pending:
    generation: int
    phase: RankPhase


class Readoption:
    """The engine records of one KV plane and the returns being decided (``disconnect_grace_s`` > 0)."""

    def __init__(
        self,
        plane: KVPlane,
        registry: CollectorRegistry,
        *,
        grace_s: float,
        cap: int,
        window_s: float,
        storage_lookup: Callable[[WorkerSpec], Awaitable[StorageIdentity | None]] | None,
        clock: Callable[[], float],
    ) -> None:
        self.plane = plane
        self.writer = plane.writer
        self.grace_s = grace_s
        self.metrics = AdoptionMetrics(registry)
        self._records: dict[str, EngineRecord] = {}
        self._cap = AdoptionCap(cap, window_s)
        self._storage_lookup = storage_lookup or lookup_storage
        self._clock = clock
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: dict[str, set[asyncio.Task]] = {}  # per engine: lookups and pending decisions
        self._ending: set[asyncio.Task] = set()  # cancelled, not yet ended (``retire``)
        self._undecided: dict[Carrier, _Pending] = {}  # the ranks of returns being decided

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0

    def stop(self) -> list[asyncio.Task]:
        """Cancel the timers; hand the tasks in flight to the plane, which cancels and awaits them."""
        for h in self._timers.values():
            h.cancel()
        self._timers.clear()
        tasks = [t for ts in self._tasks.values() for t in ts]
        self._tasks.clear()
        return [*tasks, *self._ending]

    # ---- reads ---------------------------------------------------------------------------------

    def record(self, engine: str) -> EngineRecord | None:
        return self._records.get(engine)

    def carrier_states(self) -> dict[str, CarrierState]:
        return {e: r.state for e, r in self._records.items()}

    def phases(self) -> dict[Carrier, RankPhase]:
        """The ranks of returns being decided, each in its phase (a rank leaves once decided)."""
        return {c: p.phase for c, p in self._undecided.items()}

    def busy(self, engine: str) -> bool:
        """A storage lookup, a probe or a decision of this engine is in flight."""
        return bool(self._tasks.get(engine))

    def cap_uses(self, engine: str) -> int:
        """New-process adoptions the cap has counted for this engine's storage (or the engine)."""
        rec = self._records[engine]
        return self._cap.uses(self._cap_key(rec))

    def hidden(self, engine: str) -> bool:
        """Its carriers are invisible to readers (not OK: disconnected, or a return undecided)."""
        rec = self._records.get(engine)
        return rec is not None and rec.state is not CarrierState.OK

    # ---- the rank state machine ----------------------------------------------------------------

    def _enter(self, c: Carrier, gen: int, phase: RankPhase) -> None:
        self._undecided[c] = _Pending(gen, phase)

    def _move(self, c: Carrier, gen: int, phase: RankPhase) -> None:
        p = self._undecided[c]
        assert p.generation == gen and (p.phase, phase) in _MOVES, (p, phase)
        p.phase = phase

    def _pending(self, c: Carrier, gen: int) -> bool:
        p = self._undecided.get(c)
        return p is not None and p.generation == gen

    def _leave(self, c: Carrier, gen: int) -> bool:
        """Rank ``c`` is decided in ``gen``: False if it was not pending there (decided meanwhile)."""
        if not self._pending(c, gen):
            return False
        del self._undecided[c]
        return True

    def _undecided_of(self, rec: EngineRecord, gen: int) -> list[Carrier]:
        return [c for c, p in self._undecided.items() if c.engine == rec.engine and p.generation == gen]

    # ---- engine transitions (called by the plane) ----------------------------------------------

    def track(self, spec: WorkerSpec) -> None:
        """A fresh engine: remember it and learn its storage identity (in the background)."""
        if not self.enabled or spec.kv is None:
            return
        rec = self._records[spec.engine] = EngineRecord(spec.engine, spec)
        gen = rec.generation

        async def learn() -> None:
            storage = await self._lookup(spec)
            if rec.generation == gen and self._records.get(spec.engine) is rec:
                rec.storage = storage

        self._spawn(spec.engine, learn())
        self._publish_states()

    def returning(self, spec: WorkerSpec) -> EngineRecord | None:
        """The record of a DISCONNECTED engine that ``spec`` brings back (None: a fresh engine)."""
        rec = self._records.get(spec.engine)
        if rec is not None and rec.state is CarrierState.DISCONNECTED and spec.kv is not None:
            return rec
        return None

    def forget(self, engine: str) -> None:
        self._cancel_tasks(engine)
        h = self._timers.pop(engine, None)
        if h is not None:
            h.cancel()
        if self._records.pop(engine, None) is not None:
            self._publish_states()

    def unreachable(self, spec: WorkerSpec) -> None:
        """Its health check fails (the breaker opened): hide it; a return being decided is stopped."""
        if spec.kv is None or not self.enabled:
            return
        rec = self._records.get(spec.engine)
        if (
            rec is None
            or rec.state is not CarrierState.DISCONNECTED
            or self._undecided_of(rec, rec.generation)
        ):  # unless already hidden: a return being decided is stopped (it resumes cold)
            self.disconnect(spec, DisconnectCause.HEALTH)
        self._records[spec.engine].unhealthy = True

    def reachable(self, spec: WorkerSpec) -> None:
        """Its health check passes again (the breaker closed). Hidden for health, its subscriptions ran
        all along, but a process can restart behind an open breaker without a batch to show it: its
        ranks are held and proved by their probes, as a returning engine's are. So are an engine's
        shown by a return that settled while its breaker was open (its spec changed meanwhile)."""
        rec = self._records.get(spec.engine)
        if rec is None or not rec.unhealthy:
            return
        rec.unhealthy = False
        if rec.state is CarrierState.OK:
            self.disconnect(spec, DisconnectCause.HEALTH)
        if rec.state is not CarrierState.DISCONNECTED:
            return
        carriers = spec.carriers()
        subs = {c.rank: sub for c in carriers if (sub := self.plane.subscription(c)) is not None}
        if len(subs) < len(carriers) or any(c in self._undecided for c in carriers):
            return  # it left discovery meanwhile, or returned: the discovery path decides
        rec.generation += 1
        self._await_proof(rec, rec.generation, spec, True, subs)

    def disconnect(self, spec: WorkerSpec, cause: DisconnectCause) -> None:
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
            sub = self.plane.subscription(carrier)
            if pending and cause is not DisconnectCause.DISCOVERY:
                rec.outcomes.append(Outcome.REJECTED)  # it resumes cold (below), counted when shown
                if sub is not None:
                    # Failing health before its adoption was decided, its stream still flowing: what
                    # it held is not provable any more; it goes on cold (and hidden).
                    self.writer.submit_clear(carrier, ClearReason.UNCOVERED_GAP)
                    sub.release()
            self.plane.index.set_visible(carrier, 0)  # synchronous: the very next match no longer sees it
            # ... and queued: a show still waiting in the writer's queue from the return it ends
            # would otherwise undo it.
            self.writer.call(lambda idx, c=carrier: idx.set_visible(c, 0))
            if cause is DisconnectCause.DISCOVERY:
                if sub is not None:
                    if pending:
                        # Gone again before the decision: its held batches were never applied, so
                        # it stays judged against what it was before it returned (less what they
                        # evicted).
                        self._keep_evictions(carrier, sub.detach())
                    else:
                        rec.positions[carrier.rank] = sub.position()
                self.plane.unsubscribe(carrier)
        if undecided and cause is DisconnectCause.DISCOVERY:
            # A return that ended before it settled (a new-process decision takes every undecided
            # rank at once, so none was made): not counted; its ranks are judged on the next return.
            # Stopped by the breaker instead, its ranks went on cold and it settles when shown.
            rec.reset_return()
            if rec.prior_spec is not None:
                rec.spec, rec.prior_spec = rec.prior_spec, None
        h = self._timers.pop(spec.engine, None)
        if h is not None:
            h.cancel()
        gen = rec.generation
        self._timers[spec.engine] = asyncio.get_running_loop().call_later(
            max(0.0, rec.disconnected_at + self.grace_s - self._clock()),
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
        m = self.metrics
        m.grace_expirations.inc()
        m.disconnect_window.observe(self._clock() - (rec.disconnected_at or self._clock()))
        for carrier in rec.spec.carriers():
            self._undecided.pop(carrier, None)
            if self.plane.subscription(carrier) is not None:
                # Still subscribed (hidden for health): forget its blocks, keep it hidden.
                self.writer.submit_clear(carrier, ClearReason.WORKER_REMOVED)
            else:
                self.writer.submit_remove(carrier)
        rec.reset_return()
        if engine in self.plane.workers:
            rec.positions.clear()
            rec.storage = None
            rec.outcomes.append(Outcome.REJECTED)  # hidden for health: when shown again, it is cold
        else:
            del self._records[engine]
        log.info("engine %s removed: grace window passed", engine)
        self._publish_states()

    def _reconnected(self, rec: EngineRecord) -> None:
        """DISCONNECTED -> OK: every rank of the return is decided."""
        h = self._timers.pop(rec.engine, None)
        if h is not None:
            h.cancel()
        self.metrics.disconnect_window.observe(self._clock() - (rec.disconnected_at or self._clock()))
        rec.state = CarrierState.OK
        rec.disconnected_at = None
        rec.prior_spec = None
        rec.generation += 1
        # One attempt per return, however many ranks: its worst rank outcome.
        worst = min(rec.outcomes, key=_OUTCOME_ORDER.index, default=None)
        if worst is not None:
            self.metrics.attempts.labels(worst.value).inc()
        if rec.judged_new:
            rec.storage = rec.proved  # from now on the identity a return is judged against (or none)
        elif rec.new_process_seen:
            rec.storage = None  # a new process none of whose storage was proved: nothing to judge by
        if rec.new_process_adopted:
            self._cap.record(self._cap_key(rec), self._clock())  # the crash loop the cap exists for
        rec.reset_return()
        self._publish_states()

    def back(self, rec: EngineRecord, spec: WorkerSpec) -> None:
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
        holds: dict[int, RankHold] = {}
        for c in spec.carriers():
            if same:
                self._enter(c, gen, RankPhase.PROVING)
                holds[c.rank] = self._return_hold(rec, c, gen, spec, same_shape)
            else:
                self._enter(c, gen, RankPhase.DECIDING)
                holds[c.rank] = self._decision_hold(rec, c, gen)
        subs = self.plane.subscribe(spec, holds)
        rec.spec, rec.prior_spec = spec, old
        if same:
            for rank, sub in subs.items():
                sub.resume(rec.positions.get(rank))
            self._await_proof(rec, gen, spec, same_shape, subs, entered=True)
            return
        for sub in subs.values():
            if sub.endpoints.replay is not None:  # without one, nothing before its first batch is known
                sub.resume(StreamPosition(cursor=-1))  # a new process: its stream begins at 0
        # An empty incarnation (static workers) cannot prove a new process: ``same`` was False only
        # for a changed shape or the cap, and the decision below rejects those.
        rec.new_process_seen = spec.incarnation != old.incarnation
        self._spawn(
            spec.engine,
            self._decide_new_process(rec, gen, spec, same_shape=same_shape, cap=cap),
            gen,
        )

    # ---- background work -----------------------------------------------------------------------

    def _cap_key(self, rec: EngineRecord) -> str:
        return f"storage:{rec.storage.storage_id}" if rec.storage else f"engine:{rec.engine}"

    async def _lookup(self, spec: WorkerSpec) -> StorageIdentity | None:
        try:
            timeout = self.plane.replay_timeouts.total_s
            return await asyncio.wait_for(self._storage_lookup(spec), timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine that cannot prove its storage is treated as having none
            log.info("storage identity of %s unknown: %s", spec.engine, exc)
            return None

    def _spawn(self, engine: str, coro: Awaitable, gen: int | None = None) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.set_name(f"kv-readoption-{engine}")
        tasks = self._tasks.setdefault(engine, set())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        if gen is not None:
            task.add_done_callback(lambda t: self._task_done(engine, gen, t))
        return task

    def _cancel_tasks(self, engine: str) -> None:
        for t in self._tasks.pop(engine, set()):
            retire(t, self._ending)

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
            sub = self.plane.subscription(c)
            if sub is not None:
                sub.detach()  # the stream flows to the writer again
            self._resume_cold(rec, c, gen, ClearReason.ADOPTION_FAILED)

    def _keep_evictions(self, c: Carrier, batches: list[SequencedBatch]) -> None:
        """Held batches that will never be applied (their stream's continuity went unproved) may still
        say what the engine evicted: removals only ever make the index colder, so apply those (a
        process that dies right after evicting from its disk must not have them re-adopted)."""
        if not batches:
            return
        evictions = routerfleet_index.Batch.evictions([as_native(b.batch) for b in batches])
        if len(evictions):
            self.writer.call(lambda idx: idx.apply_batch(c, evictions), touches=(c,))
            self.writer.note_eviction(c)

    # ---- holds ---------------------------------------------------------------------------------

    def _await_proof(
        self,
        rec: EngineRecord,
        gen: int,
        spec: WorkerSpec,
        same_shape: bool,
        subs: dict[int, RankSubscription],
        *,
        entered: bool = False,
    ) -> None:
        """Same incarnation: hold every rank (``entered``: ``back`` entered them with their holds) and
        probe each for the proof of continuity. A rank its bootstrap still holds (a health return:
        its subscription ran all along) cannot be proved beneath a graft still to come, and one hold
        has one owner: it turns cold, and the bootstrap, its hold ended, abandons it."""
        if not entered:  # every rank first: a rank decided at once must not settle the engine alone
            for sub in subs.values():
                self._enter(sub.carrier, gen, RankPhase.PROVING)
        for sub in subs.values():
            c = sub.carrier
            if not entered:
                if sub.hold is not None and sub.hold.active:
                    sub.clear(ClearReason.BOOTSTRAP_HELD)
                    self._rank_proved(rec, c, gen, continuous=False, why=HoldEnd.PUBLISHER_RESET)
                    continue
                sub.attach(self._return_hold(rec, c, gen, spec, same_shape))
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

    # ---- PROVING -------------------------------------------------------------------------------

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
            self._rank_proved(rec, c, gen, continuous=False)  # it never published: nothing to prove
            return
        if known is None and cursor >= 0:
            self._rank_proved(rec, c, gen, continuous=False)  # a cursor we never saw a batch for
            return
        if cursor < 0:
            await self._recheck_storage(rec, sub, gen, spec, same_shape)
            return
        if sub.endpoints.replay is None:
            self._rank_proved(rec, c, gen, continuous=False)  # nothing can show our cursor
            return
        for _attempt in range(PROBE_ATTEMPTS):  # a busy engine answers its replay socket late
            result = await replay(
                self.plane.sockets,
                sub.endpoints.replay,
                cursor,
                self.plane.replay_timeouts,
                f"re-adoption probe of rank {c}",
            )
            if not self._pending(c, gen):
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
        if not self._pending(c, gen) or rec.new_process_gen == gen:
            return
        claimed = any(
            r is not rec and r.state is CarrierState.OK and r.storage == storage
            for r in self._records.values()
        )
        if storage is None or rec.storage is None:
            self._rank_proved(rec, c, gen, continuous=False)  # nothing to judge its blocks by: cold
            return
        if storage != rec.storage or claimed:
            self._restarted_in_place(rec, gen, spec, same_shape)  # other storage behind the engine
            return
        followed = await self._catch_up(sub)
        self._rank_proved(rec, c, gen, continuous=followed)

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
        """PROVING -> decided: rank ``c``'s probe showed our cursor's own batch (``continuous``: every
        tier kept; its held batches, then what the probe's replay brought after them, are applied
        before it is shown) or could not (cold: cleared, then shown; ``why`` when its hold ended)."""
        if rec.new_process_gen == gen or not self._leave(c, gen):
            return False
        sub = self.plane.subscription(c)
        if continuous:
            rec.kept.add(c)
            released = sub.release() if sub is not None else True
            if sub is not None:
                sub.accept_replayed(replayed)  # what it published while we were away, in order
            self._record_outcome(Outcome.SUCCESS if released else Outcome.REJECTED, rec)
        else:
            # The subscription already queued a clear (a reset) unless the hold overflowed.
            if why is HoldEnd.OVERFLOW or why is None:
                self.writer.submit_clear(c, ClearReason.OVERFLOW if why else ClearReason.UNCOVERED_GAP)
            if sub is not None:
                sub.detach()
            self._record_outcome(Outcome.REJECTED, rec)
        self.writer.call(lambda idx: idx.set_visible(c, ALL))
        self._settle_if_done(rec, gen)
        return True

    def _restarted_in_place(self, rec: EngineRecord, gen: int, spec: WorkerSpec, same_shape: bool) -> bool:
        """PROVING -> DECIDING, for every rank of the engine at once. A returning engine kept its
        incarnation (Kubernetes keeps a pod's UID across container restarts) but its stream shows a
        new process: a rank's publisher restarted its sequence, or its replay buffer holds nothing at
        or after our cursor. Every rank of the engine is judged as a new process, once: their proof
        holds become plain holds from sequence 0 of the new stream, and nothing from the new process
        can pass as proof of continuity any more. Returns whether the engine's ranks are (now, or
        already) held for that decision."""
        if rec.generation != gen:
            return False
        if rec.new_process_gen == gen:
            return True
        rec.new_process_gen = gen
        rec.new_process_seen = True
        log.info("engine %s returned as a new process (same incarnation, its stream restarted)", rec.engine)
        for c in spec.carriers():
            sub = self.plane.subscription(c)
            if sub is None or not self._pending(c, gen):
                continue
            self._move(c, gen, RankPhase.DECIDING)
            self._keep_evictions(c, sub.detach())  # the old process's last word, if any
            sub.attach(self._decision_hold(rec, c, gen))
            sub.resume(StreamPosition(cursor=-1))  # the new publisher's stream begins at 0
        cap = self._cap.reached(self._cap_key(rec), self._clock())
        self._spawn(
            rec.engine,
            self._decide_new_process(rec, gen, spec, same_shape=same_shape, cap=cap),
            gen,
        )
        return True

    # ---- DECIDING ------------------------------------------------------------------------------

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
        ranks = [c for c in spec.carriers() if self._pending(c, gen)]
        subs = {c.rank: sub for c in ranks if (sub := self.plane.subscription(c)) is not None}
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
        result = await replay(
            self.plane.sockets,
            sub.endpoints.replay,
            0,
            self.plane.replay_timeouts,
            f"re-adoption catch-up of rank {sub.carrier}",
        )
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
        sub.accept_replayed(got)  # a live batch or a gap replay may have taken some already
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
        """DECIDING -> decided, for ``carriers`` still pending in ``gen``, at once: drop what is not
        kept, apply their held batches, then show them (each a writer step, in that order). None: none
        was left; else whether every rank's held batches reached the writer (an overflow clears that
        rank). ``kept``: ranks this return already kept, before the engine showed it is a new process:
        the decision drops from them what it drops from the others (they were judged as the old
        process)."""
        live = [c for c in carriers if self._leave(c, gen)]
        if not live:
            return None  # decided meanwhile (reset, overflow)
        log.info("engine %s returned: %s (%s)", rec.engine, d.outcome or "nothing to adopt", d.why)

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
        self.writer.call(drop, touches=[*live, *kept])
        released = all([sub.release() if (sub := subs.get(c.rank)) else True for c in live])
        self.writer.call(lambda idx: [idx.set_visible(c, ALL) for c in live])
        self._record_outcome(d.outcome if released else Outcome.REJECTED, rec)
        return released

    # ---- either phase --------------------------------------------------------------------------

    def _hold_lost(self, rec: EngineRecord, c: Carrier, gen: int, why: HoldEnd) -> None:
        """A new incarnation's hold overflowed or its stream reset before the decision: the rank can no
        longer be joined to what we kept; it resumes cold (and visible) from here."""
        reason = ClearReason.OVERFLOW if why is HoldEnd.OVERFLOW else ClearReason.PUBLISHER_RESTART
        self._resume_cold(rec, c, gen, reason)

    def _resume_cold(self, rec: EngineRecord, c: Carrier, gen: int, reason: ClearReason) -> None:
        """Rank ``c``'s return is rejected: cleared, then shown; its stream goes on from here."""
        if not self._leave(c, gen):
            return
        self.writer.submit_clear(c, reason)
        self.writer.call(lambda idx: idx.set_visible(c, ALL))
        self._record_outcome(Outcome.REJECTED, rec)
        self._settle_if_done(rec, gen)

    def _record_outcome(self, outcome: Outcome | None, rec: EngineRecord) -> None:
        """A rank's outcome in the current return (counted, once per return, when it settles)."""
        if outcome is not None:
            rec.outcomes.append(outcome)

    def _settle_if_done(self, rec: EngineRecord, gen: int) -> None:
        if rec.generation == gen and not self._undecided_of(rec, gen):
            self._reconnected(rec)

    def _publish_states(self) -> None:
        counts = dict.fromkeys(CarrierState, 0)
        for r in self._records.values():
            counts[r.state] += r.spec.dp_size  # type: ignore[attr-defined]
        for state, n in counts.items():
            self.metrics.carriers.labels(state.value).set(n)


class _ReturnHold(RankHold):
    """A returning same-incarnation rank's hold: its batches wait until the probe proves continuity;
    a publisher restart seen on its live stream hands the engine to the new-process decision instead
    of clearing the rank."""

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
