"""The consumer: hold each new rank's batches, pull one snapshot for every pending rank, graft it
beneath the held batches, and prove the live stream joins it.

Ordering is the design. The subscription exists (and holds) before any fetch, so no delta can fall
between a peer's export and our first received batch. The peer's cursor then does two jobs: as a
FILTER it drops held batches the snapshot already reflects, and as a WATERMARK it proves the stream
resumes at cursor + 1. A hole there means a lost delta, and a lost removal is a permanent false cache
hit, so every doubt resolves to a cold rank: an unreachable peer, a 404, a cold peer, a vetting
refusal, an unknown worker, a sequence gap. Two paths are deliberately kept warm, both bounded: a
gap gets one more sweep with a fresh stamp, and a graft that no batch and no peer can speak to is kept
as ``warm_unwitnessed`` after a few unanswered probes (silence is not evidence; discarding on a timer
would cost every quiet fleet its warm tree).

One sweep serves every pending rank: a snapshot is fleet-wide, so sweeping per engine would download
the same document once per engine. The strictest holding-since of the batch becomes ``max_age_ms``.
Grafts run on the index writer, chunk by chunk, behind gates (same epoch, still pending), so a rank
that restarted or left meanwhile is never grafted.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

from ..kv.decode import MalformedFrame, decode
from ..kv.fit import FitTally, Misfit
from ..kv.hold import HoldEnd, RankHold
from ..kv.index import RadixIndex
from ..kv.plane import KVPlane
from ..kv.snapshot import Exporter, Grafter
from ..kv.subscription import RankSubscription, ReplayOutcome, ReplayTimeouts, replay
from ..kv.writer import ClearReason
from ..tasks import end_tasks
from ..worker import Carrier
from .fetch import FetchFailed, SnapshotFetcher
from .metrics import BootstrapMetrics
from .peers import PeerRegistry
from .state import (
    Cause,
    CauseCode,
    Gate,
    OriginOutcome,
    RankBoot,
    RankOutcome,
    RankState,
    SnapshotOutcome,
    SweepResult,
    Verdict,
    readiness,
    seed_failed,
    verdict,
)
from .vetting import HashingConfig, LocalWorker, VetFailed, VettedSnapshot, vet, vet_export, vet_sessions
from .wire import WireSession, WireSnapshot

log = logging.getLogger(__name__)

API_VERSION = "routerfleet.io/bootstrap/v1"
# The longest pause between sweeps while a peer refuses its snapshot beside others that do not (doubling
# from retry_interval_s): short, as readiness may be held meanwhile (a stopping sibling refuses too).
REFUSED_MAX_S = 8.0

_ORIGIN_OUTCOME = {
    ReplayOutcome.FILLED: OriginOutcome.COMPLETE,
    ReplayOutcome.UNCOVERED: OriginOutcome.AGED_OUT,
    ReplayOutcome.TRUNCATED: OriginOutcome.TRUNCATED,
    ReplayOutcome.MALFORMED: OriginOutcome.TRUNCATED,
    ReplayOutcome.HOLE: OriginOutcome.GAP,
    ReplayOutcome.TIMEOUT: OriginOutcome.TIMEOUT,
}


@dataclass(frozen=True, slots=True)
class BootstrapConfig:
    enabled: bool = True
    timeout_s: float = 600.0
    seed_required: bool = False
    hold_batches: int = 50_000
    hold_bytes: int = 256 << 20
    retry_interval_s: float = 1.0  # between sweeps while peers are unsynced, unreachable or refused
    probe_interval_s: float = 2.0  # silence before asking peers whether the watermark was passed
    max_unknown_probes: int = 3
    # Sweeps in a row in which every peer answered and every answer was refused (HTTP errors, corrupt
    # or malformed snapshots): the seed has failed, say so now rather than at the timeout.
    max_refused_sweeps: int = 5
    graft_chunk: int = 4096
    # Origin: rebuild a rank from the engine's own replay buffer when it still reaches sequence 0.
    origin: bool = True
    origin_idle_s: float = 1.0
    origin_timeout_s: float = 30.0
    origin_max_bytes: int = 1 << 30


class Bootstrapper:
    def __init__(
        self,
        plane: KVPlane,
        peers: PeerRegistry,
        fetcher: SnapshotFetcher,
        hashing: HashingConfig,
        metrics: BootstrapMetrics,
        config: BootstrapConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        on_sessions: Callable[[list[WireSession]], object] | None = None,
        on_responses: Callable[[list[WireSession]], object] | None = None,
        blocker: Callable[[], Cause | None] | None = None,
    ) -> None:
        self.plane = plane
        self.peers = peers
        self.fetcher = fetcher
        self.hashing = hashing
        self.metrics = metrics
        self.config = config or BootstrapConfig()
        self._clock = clock
        self._rng = rng or random.Random()
        self.ranks: dict[Carrier, RankBoot] = {}
        # Epochs are drawn from one counter, never per rank: a rank removed and added again (its engine
        # replaced under the same id) must not reuse an epoch a graft in flight was vetted under.
        self._epochs = itertools.count(1)
        self._subs: dict[Carrier, RankSubscription] = {}
        self._queue: set[Carrier] = set()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None
        self.first_rank_at: float | None = None  # the deadline is armed here, never at construction
        self.last_sweep: SweepResult | None = None
        self.candidates_seen = False
        self._settled = False
        self._ready_latched = False
        self.settled_at: float | None = None
        # Handed the vetted session-affinity entries of the snapshot that was grafted.
        self.on_sessions = on_sessions
        # And its response bindings (which engine holds a stored response), vetted the same way.
        self.on_responses = on_responses
        self._sessions_inherited = False
        # What keeps the replica from routing at all (no engines, discovery unsynced).
        self.blocker = blocker
        self._origin_misfits: dict[Carrier, Misfit] = {}  # found in an engine's replay, before any batch
        self._peer_cause: Cause | None = None  # the last refusal or failure of a sweep
        if self.config.enabled:
            plane.rank_listener = self

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.create_task(self._run(), name="kv-bootstrap")

    async def stop(self) -> None:
        try:
            await end_tasks([self._task, *self._tasks], "bootstrap")
        finally:
            await self.fetcher.close()

    # ---- the KV plane's hooks ------------------------------------------------------------------

    def engines_without_events(self) -> None:
        """Engines were discovered and none of them publishes KV events: there is no rank to
        bootstrap and never will be under this configuration, so settle now (verdict ``no_peers``:
        nothing to inherit) instead of waiting for a first rank that cannot come."""
        if not self.config.enabled or self._settled or self.ranks:
            return
        now = self._clock()
        if self.first_rank_at is None:
            self.first_rank_at = now
        self._settled = True
        self.settled_at = now
        self.metrics.settled.set(1)
        log.info("bootstrap settled: no engine publishes KV events, nothing to bootstrap")

    def rank_added(self, sub: RankSubscription) -> None:
        c = sub.carrier
        now = self._clock()
        if self.first_rank_at is None:
            self.first_rank_at = now
            if self.config.enabled:  # the loop checks settlement at the deadline, whatever happens before
                asyncio.get_running_loop().call_later(self.config.timeout_s, self._wake.set)
        if self.check_settled():
            return  # a rank added after settling (a scale-up of engines) joins live, cold
        boot = RankBoot(epoch=next(self._epochs), since=now)
        self.ranks[c] = boot
        self._subs[c] = sub
        sub.attach(self._new_hold(c, boot.epoch))
        sub.on_splice = lambda seq, c=c, e=boot.epoch: self._spliced(c, e, seq)
        if self.config.origin and sub.endpoints.replay:
            boot.origin = self._spawn(self._origin(c, boot.epoch, sub.endpoints.replay), f"kv-origin-{c}")
        self._queue.add(c)
        self._wake.set()
        self._export_state(c)

    def rank_removed(self, carrier: Carrier) -> None:
        boot = self.ranks.pop(carrier, None)
        self._subs.pop(carrier, None)
        self._queue.discard(carrier)
        self._origin_misfits.pop(carrier, None)
        if boot is not None:
            boot.epoch = next(self._epochs)  # refuses any graft chunk still in flight for it
            if boot.origin is not None:
                boot.origin.cancel()  # its replay socket is for a rank that no longer matters
        self.metrics.forget(carrier)

    def _new_hold(self, c: Carrier, epoch: int) -> RankHold:
        return RankHold(
            max_batches=self.config.hold_batches,
            max_bytes=self.config.hold_bytes,
            on_end=lambda why: self._hold_ended(c, epoch, why),
            clock=self._clock,
        )

    def _hold_ended(self, c: Carrier, epoch: int, why: HoldEnd) -> None:
        boot = self.ranks.get(c)
        if boot is None or boot.epoch != epoch:
            return
        boot.epoch = next(self._epochs)
        # A graft chunk may already have landed for this rank without its watermark proved.
        self.plane.writer.submit_clear(
            c, ClearReason.OVERFLOW if why is HoldEnd.OVERFLOW else ClearReason.PUBLISHER_RESTART
        )
        self._settle(c, RankOutcome.OVERFLOW if why is HoldEnd.OVERFLOW else RankOutcome.PUBLISHER_RESET)

    # ---- state ---------------------------------------------------------------------------------

    def _due(self) -> bool:
        """Whether settling is due: every rank resolved, or the deadline counted from the first rank
        passed. Once due, always due: no rank joins the bootstrap after it (``rank_added``)."""
        if self.first_rank_at is None:
            return False
        done = bool(self.ranks) and all(b.state is not RankState.PENDING for b in self.ranks.values())
        return done or self._clock() >= self.first_rank_at + self.config.timeout_s

    @property
    def settled(self) -> bool:
        """A graft landed, every rank resolved, or the timeout passed. Only reports: the loop latches
        the settlement and says so (``check_settled``)."""
        return not self.config.enabled or self._settled or self._due()

    def check_settled(self) -> bool:
        """The loop's settlement check: once it is due, latch it, export it and log it (once)."""
        if self.config.enabled and not self._settled and self._due():
            assert self.first_rank_at is not None
            self._settled = True
            self.settled_at = min(self._clock(), self.first_rank_at + self.config.timeout_s)
            self.metrics.settled.set(1)
            self.metrics.seed_failed.set(1 if self.seed_failed else 0)
            log.info("bootstrap settled: %s", self.verdict.value)
        return self.settled

    @property
    def verdict(self) -> Verdict:
        settled = self.settled
        last = self.last_sweep
        if (
            settled
            and last is None
            and self.ranks
            and any(b.state is RankState.PENDING for b in self.ranks.values())
        ):
            last = SweepResult.TIMED_OUT  # the deadline passed before any sweep could finish
        return verdict(self.config.enabled, settled, self.ranks.values(), last, misfit=bool(self.misfits()))

    @property
    def seed_failed(self) -> bool:
        return seed_failed(self.verdict, self.candidates_seen)

    def misfits(self) -> dict[Carrier, Misfit]:
        """Ranks whose stores do not fit our configuration: the live stream's tally (held or applied),
        else what an origin replay found. A rank whose live stores fit is not one, whatever its replay
        said (kv/fit.py)."""
        live = self.plane.misfits()
        for c, m in self._origin_misfits.items():
            sub = self._subs.get(c)
            if c not in live and (sub is None or not sub.fit.accepted):
                live[c] = m
        return live

    def publish_misfits(self) -> None:
        """The ``routerfleet_kv_config_mismatch`` gauge, from ``misfits`` (at scrape time)."""
        gauge = self.plane.metrics.config_mismatch
        gauge.clear()
        for c, m in self.misfits().items():
            gauge.labels(c.engine, str(c.rank), m.reason.value).set(1)

    def cause(self) -> Cause | None:
        """The first thing a user must fix or wait for, most telling first: a configuration mismatch,
        what keeps the replica from routing at all, unsynced peer discovery, then the last peer that
        failed us (only while that matters: the replica is not warm)."""
        misfits = self.misfits()
        if misfits:
            c, m = min(misfits.items())
            more = f"; {len(misfits) - 1} more rank(s) alike" if len(misfits) > 1 else ""
            return Cause(CauseCode.CONFIG_MISMATCH, f"rank {c}: {m.detail}{more}")
        blocker = self.blocker() if self.blocker is not None else None
        if blocker is not None:
            return blocker
        if self.config.enabled and not self.peers.synced and not self.settled:
            return Cause(CauseCode.PEER_DISCOVERY, "peer discovery has not listed the fleet's replicas yet")
        if self._peer_cause is not None and self.verdict in (Verdict.PENDING, Verdict.TIMED_OUT):
            return self._peer_cause
        return None

    def readiness(self) -> tuple[bool, str]:
        mismatch = self.verdict is Verdict.CONFIG_MISMATCH
        ok, why = readiness(
            Gate(
                enabled=self.config.enabled,
                settled=self.settled,
                seed_required=self.config.seed_required,
                seed_failed=self.seed_failed or mismatch,
                first_rank_at=self.first_rank_at,
                now=self._clock(),
                timeout_s=self.config.timeout_s,
                latched=self._ready_latched,
            )
        )
        if ok and "expired" in why:
            log.warning("bootstrap: seed required but not achieved within 3x the budget; opening readiness")
        if mismatch and (cause := self.cause()) is not None:
            why = f"{why}; cache-blind: {cause.message}" if ok else f"bootstrap: {cause.message}"
        return ok, why

    def exportable(self, c: Carrier) -> bool:
        """Whether our producer may hand this rank's blocks to a sibling: not while it is pending or
        still proving its graft (a graft is only as good as its witness)."""
        boot = self.ranks.get(c)
        return boot is None or boot.state is RankState.SETTLED

    def latch_ready(self) -> None:
        """The first 200 from /readyz latches readiness open: a serving replica never leaves again."""
        self._ready_latched = True

    def report(self) -> dict:
        """The versioned verdict document served at ``/internal/bootstrap``."""
        index = self.plane.index
        return {
            "apiVersion": API_VERSION,
            "settled": self.settled,
            "verdict": self.verdict.value,
            "seedFailed": self.seed_failed,
            "cause": cause.to_dict() if (cause := self.cause()) is not None else None,
            "ranks": [
                {
                    "engine": c.engine,
                    "rank": c.rank,
                    "state": b.state.value,
                    "outcome": b.outcome.value if b.outcome else None,
                }
                for c, b in sorted(self.ranks.items())
            ],
            "index": {
                "nodes": index.node_count(),
                "blocks": sum(sum(index.carrier_blocks(c).values()) for c in index.carriers),
            },
            "peers": {"seen": len(self.peers.peers), "synced": self.peers.synced},
            "since": self.first_rank_at,
            "settledAfterSeconds": (
                None
                if self.settled_at is None or self.first_rank_at is None
                else self.settled_at - self.first_rank_at
            ),
        }

    def _settle(self, c: Carrier, outcome: RankOutcome) -> None:
        boot = self.ranks.get(c)
        if boot is None:
            return
        boot.state = RankState.SETTLED
        boot.outcome = outcome
        self.metrics.ranks.labels(outcome.value).inc()
        self._export_state(c)
        log.info("bootstrap rank %s: %s", c, outcome.value)

    def _export_state(self, c: Carrier) -> None:
        boot = self.ranks.get(c)
        if boot is not None:
            self.metrics.set_state(c, boot.state)

    # ---- the coordinator -----------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = {c for c in self._queue if c in self.ranks and self.ranks[c].state is RankState.PENDING}
            self._queue.clear()
            if batch:
                await self._sweep(batch)
            self.check_settled()

    def _pending(self, batch: set[Carrier]) -> set[Carrier]:
        return {c for c in batch if c in self.ranks and self.ranks[c].state is RankState.PENDING}

    async def _sweep(self, batch: set[Carrier]) -> None:
        cfg = self.config
        assert self.first_rank_at is not None
        deadline = self.first_rank_at + cfg.timeout_s
        # Origin first: it is exact for its rank, where a graft is only as good as its witness.
        origins = [b.origin for c in batch if (b := self.ranks.get(c)) and b.origin and not b.origin.done()]
        if origins:
            await asyncio.wait(origins, timeout=max(0.0, deadline - self._clock()))
            if not self._pending(batch):
                await self._sessions_only(deadline)  # every rank exact: only the session table is missing
        refused_sweeps = 0
        refusing = 0  # sweeps in a row where a peer refused its snapshot: the next waits twice as long
        while True:
            self._settle_misfits(self._pending(batch))  # our own stream's evidence before any peer's
            live = self._pending(batch)
            if not live:
                return
            now = self._clock()
            if now >= deadline:
                return self._give_up(live, SweepResult.TIMED_OUT)
            if not self.peers.synced:
                await asyncio.sleep(min(cfg.retry_interval_s, deadline - now))
                continue
            if refused_sweeps >= cfg.max_refused_sweeps:
                log.warning("bootstrap: every peer refused %d sweeps in a row; giving up", refused_sweeps)
                return self._give_up(live, SweepResult.TIMED_OUT)
            candidates = self.peers.candidates(self._rng)
            if not candidates:
                if self.peers.ever_had_peers:  # a dip to empty after siblings were seen is transient
                    await asyncio.sleep(min(cfg.retry_interval_s, deadline - now))
                    continue
                return self._give_up(live, SweepResult.NO_PEERS)
            self.candidates_seen = True
            since = min(self.ranks[c].since for c in live)
            max_age_ms = max(0, int((self._clock() - since) * 1000))
            outcomes: list[SnapshotOutcome] = []
            for peer in candidates:
                try:
                    # The fetch's own bounds cut a dead or stalled peer; the deadline bounds the hold.
                    left = max(0.001, deadline - self._clock())
                    try:
                        wire = await asyncio.wait_for(self.fetcher.snapshot(peer, max_age_ms), left)
                    except TimeoutError:
                        raise FetchFailed(SnapshotOutcome.UNREACHABLE, "bootstrap deadline") from None
                    # Off the loop: the column checks are one pass each over millions of records, run
                    # by the core with the GIL released, so the loop keeps applying live events.
                    local = self._local()
                    epochs = {c: boot.epoch for c, boot in self.ranks.items()}  # as vetted: see _graft
                    vetted = await asyncio.get_running_loop().run_in_executor(
                        None, vet, wire, local, self.hashing
                    )
                except FetchFailed as exc:
                    outcomes.append(exc.outcome)
                    self.metrics.fetches.labels(exc.outcome.value).inc()
                    log.info("bootstrap: peer %s: %s", peer.name, exc)
                    code = CauseCode.PEER_UNREACHABLE
                    if exc.outcome is not SnapshotOutcome.UNREACHABLE:
                        code = CauseCode.PEER_REFUSED
                    self._peer_cause = Cause(code, f"peer {peer.name}: {exc}")
                    continue
                except VetFailed as exc:
                    o = exc.error.outcome
                    outcomes.append(o)
                    self.metrics.fetches.labels(o.value).inc()
                    self.metrics.vet_errors.labels(exc.error.value).inc()
                    log.info("bootstrap: peer %s refused: %s", peer.name, exc.error.value)
                    if o is not SnapshotOutcome.COLD_PEER:
                        why = f"peer {peer.name}'s snapshot refused: {exc.error.explain}"
                        self._peer_cause = Cause(CauseCode.PEER_REFUSED, why)
                    continue
                self.metrics.fetches.labels(SnapshotOutcome.ACCEPTED.value).inc()
                self.last_sweep = SweepResult.FOUND
                self.metrics.sweeps.labels(SweepResult.FOUND.value).inc()
                await self._graft(vetted, self._pending(live), epochs)
                self._inherit_sessions(wire)
                return
            refused_sweeps = (
                refused_sweeps + 1 if outcomes and set(outcomes) == {SnapshotOutcome.REJECTED} else 0
            )
            # A peer that refuses beside one that is unreachable never ends the sweeps (the count above
            # is of sweeps where every peer refused: those end soon, at the retry interval), and each
            # refusal may be a body of up to 1 GiB fetched and decoded again: back off.
            mixed = SnapshotOutcome.REJECTED in outcomes and refused_sweeps == 0
            refusing = refusing + 1 if mixed else 0
            if outcomes and all(o in (SnapshotOutcome.COLD_PEER, SnapshotOutcome.FOREIGN) for o in outcomes):
                # A foreign peer (another block size or key scheme) holds nothing we can use, but
                # which side is misconfigured only our own streams can tell: give up once they do
                # (these ranks fit, so the peers are wrong; or another rank does not, so we are).
                self._settle_misfits(live)  # a batch may have come in during the fetches
                live = self._pending(live)
                fits = all(self._subs[c].fit.accepted for c in live if c in self._subs)
                if SnapshotOutcome.FOREIGN not in outcomes or fits or self.misfits():
                    return self._give_up(live, SweepResult.FLEET_COLD)
            pause = max(
                cfg.retry_interval_s, min(cfg.retry_interval_s * 2 ** min(refusing, 10), REFUSED_MAX_S)
            )
            await asyncio.sleep(min(pause, max(0.0, deadline - self._clock())))

    async def _sessions_only(self, deadline: float) -> None:
        """Ask one sibling for its session table alone (the tree came from the engines' replay)."""
        if (self.on_sessions is None and self.on_responses is None) or self._sessions_inherited:
            return
        for peer in self.peers.candidates(self._rng):
            left = deadline - self._clock()
            if left <= 0:
                return
            try:
                wire = await asyncio.wait_for(self.fetcher.snapshot(peer, 0, sessions_only=True), left)
            except (FetchFailed, TimeoutError):
                continue
            if wire.producer_ready:
                self._inherit_sessions(wire)
                return

    def _inherit_sessions(self, wire: WireSnapshot) -> None:
        """The sibling's session table and response bindings, vetted (once: the first that has any)."""
        tables = [(self.on_sessions, wire.sessions), (self.on_responses, wire.responses)]
        if not any(take is not None and entries for take, entries in tables):
            return
        self._sessions_inherited = True
        incarnations = {spec.engine: spec.incarnation for spec in self.plane.workers.values()}
        for take, entries in tables:
            if take is None or not entries:
                continue
            try:
                take(vet_sessions(entries, incarnations))
            except Exception:
                log.exception("bootstrap: inheriting a remembered table failed")

    def _local(self) -> dict[tuple[str, int], LocalWorker]:
        return {
            (c.engine, c.rank): LocalWorker(c, spec.incarnation)
            for spec in self.plane.workers.values()
            for c in spec.carriers()
        }

    def _give_up(self, ranks: set[Carrier], result: SweepResult) -> None:
        """Nothing to graft: release the held batches to the writer; the ranks run live from their
        first held batch, cold (everything before our subscription is unknown, never guessed)."""
        self.last_sweep = result
        self.metrics.sweeps.labels(result.value).inc()
        for c in ranks:
            self._release(c)
            self._settle(c, RankOutcome.ABANDONED)

    def _settle_misfits(self, ranks: set[Carrier]) -> None:
        """Ranks whose own stores do not fit our configuration: nothing to graft can make them warm."""
        for c in ranks:
            sub = self._subs.get(c)
            misfit = sub.fit.misfit if sub is not None else None
            if misfit is not None:
                self._mismatched(c, misfit)

    def _mismatched(self, c: Carrier, misfit: Misfit) -> None:
        log.warning("bootstrap rank %s: configuration mismatch: %s", c, misfit.detail)
        self._release(c)
        self._settle(c, RankOutcome.CONFIG_MISMATCH)

    def _release(self, c: Carrier) -> None:
        sub = self._subs.get(c)
        if sub is not None:
            sub.release()

    async def _graft(self, vetted: VettedSnapshot, live: set[Carrier], vetted_at: dict[Carrier, int]) -> None:
        """Graft ``vetted`` onto the ``live`` ranks still in the epoch each had when it was vetted
        (``vetted_at``): a rank removed and added again meanwhile (its engine replaced) is another rank,
        whatever its name."""
        ours = {c for c in live if c in vetted.cursors}
        for c in live - ours:
            self._release(c)
            self._settle(c, RankOutcome.NOT_IN_SNAPSHOT)
        if not ours:
            return
        epochs = {c: vetted_at[c] for c in ours if c in vetted_at}

        def admit(c: Carrier) -> bool:
            boot = self.ranks.get(c)
            return (
                c in epochs
                and boot is not None
                and boot.epoch == epochs[c]
                and boot.state is RankState.PENDING
            )

        carriers = [c if c in ours else None for c in vetted.carriers]
        # Built off the loop: it counts the columns (millions of records); it does not touch the index.
        grafter = await asyncio.get_running_loop().run_in_executor(
            None, Grafter, self.plane.index, vetted.columns, carriers, admit
        )
        chunk = self.config.graft_chunk
        while not await self.plane.writer.call(lambda _index: grafter.step(chunk), touches=ours):
            pass
        writer = self.plane.writer
        for c in ours:
            if admit(c):
                # The graft reflects the publisher's stream up to the cursor: that is now our cursor too
                # (what our own producer reports, until the next batch moves it).
                writer.applied[c] = max(writer.applied.get(c, -1), vetted.cursors[c])
                # What it evicted before the sibling's snapshot was never seen here: a session memory
                # older than the graft is not vouched for (sessions/classify.py).
                writer.note_eviction(c)
                self._splice(c, vetted.cursors[c])

    def _splice(self, c: Carrier, cursor: int, *, exact: bool = False) -> None:
        """Release the held batches above ``cursor`` onto the graft. ``exact`` (an origin rebuild):
        the replay itself proved the history, so only the join with the live stream remains."""
        boot, sub = self.ranks[c], self._subs[c]
        hold = sub.hold
        assert hold is not None
        rest = [b for b in hold.take() if b.seq > cursor]
        if rest and rest[0].seq != cursor + 1:
            return self._gap(c, rest)
        sub.detach()  # emptied above: rest is what it held
        sub.submit(rest)
        if rest or exact:
            if not rest:  # the next live batch must still join; a hole then turns the rank cold
                boot.watermark = cursor
                sub.arm_splice(cursor)
            self._settle(c, RankOutcome.FROM_ORIGIN if exact else RankOutcome.WARM)
            return
        # Nothing held above the cursor: the first live batch must prove the join.
        boot.state = RankState.RECOVERED
        boot.watermark = cursor
        sub.arm_splice(cursor)
        self._export_state(c)
        self._spawn(self._probe(c, boot.epoch), f"kv-bootstrap-probe-{c}")

    def _spawn(self, coro: Coroutine, name: str) -> asyncio.Task:
        """A task of the bootstrap's, kept until it ends (``stop`` cancels and awaits what is left)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spliced(self, c: Carrier, epoch: int, seq: int) -> None:
        """The first live batch above the watermark arrived (called before it is applied)."""
        boot = self.ranks.get(c)
        if boot is None or boot.epoch != epoch or boot.watermark is None:
            return
        if seq == boot.watermark + 1:
            if boot.state is RankState.RECOVERED or boot.outcome is RankOutcome.WARM_UNWITNESSED:
                self._settle(c, RankOutcome.WARM)  # an origin rebuild keeps its from_origin outcome
        else:
            self.plane.writer.submit_clear(c, ClearReason.UNCOVERED_GAP)
            self._settle(c, RankOutcome.GAP)
        boot.watermark = None

    def _gap(self, c: Carrier, rest: list) -> None:
        """The live stream does not join the graft: discard it; one more sweep, stamped now."""
        boot, sub = self.ranks[c], self._subs[c]
        self.plane.writer.submit_clear(c, ClearReason.UNCOVERED_GAP)
        boot.epoch = next(self._epochs)
        if boot.retried:
            sub.detach()  # emptied already: rest is what it held
            sub.submit(rest)
            self._settle(c, RankOutcome.GAP)
            return
        boot.retried = True
        boot.since = self._clock()
        boot.state = RankState.PENDING
        hold = self._new_hold(c, boot.epoch)
        for b in rest:
            hold.add(b)
        sub.attach(hold)
        sub.on_splice = lambda seq, c=c, e=boot.epoch: self._spliced(c, e, seq)
        self._queue.add(c)
        self._wake.set()
        log.info("bootstrap rank %s: gap after graft, retrying once", c)

    async def _origin(self, c: Carrier, epoch: int, endpoint: str) -> None:
        """Replay the rank's whole history from sequence 0 into a private scratch index and, only if
        it provably starts at 0, has no hole and joins the held live batches, publish it. Never splice
        a partial history: anything less leaves the rank to the peer sweep, or cold."""
        cfg = self.config
        result = await replay(
            self.plane.sockets,
            endpoint,
            0,
            ReplayTimeouts(cfg.origin_idle_s, cfg.origin_timeout_s),
            f"origin replay of rank {c}",
            max_bytes=cfg.origin_max_bytes,
        )
        self.metrics.origin_batches.inc(len(result.batches))
        self.metrics.origin_bytes.inc(sum(len(p) for _s, p in result.batches))
        outcome = _ORIGIN_OUTCOME[result.outcome]
        if outcome is not OriginOutcome.COMPLETE or not result.batches:
            self._origin_failed(c, outcome if result.batches else OriginOutcome.TIMEOUT)
            return
        block_size, group = self.plane.index.block_size, self.plane.index.full_attention_group
        scratch = RadixIndex(block_size, full_attention_group=group)
        fit = FitTally()
        for i, (_seq, payload) in enumerate(result.batches):
            try:
                batch = decode(payload)
            except MalformedFrame:
                self._origin_failed(c, OriginOutcome.TRUNCATED)
                return
            fit.add(batch, block_size, group)
            scratch.apply_batch(c, batch)
            if i % 256 == 255:
                await asyncio.sleep(0)  # a private index: yield to the loop, no writer involved
        if fit.misfit is not None:
            # The engine's whole history is refused by our configuration: no sibling can fix that.
            self._origin_failed(c, OriginOutcome.CONFIG_MISMATCH)
            boot = self.ranks.get(c)
            if boot is not None and boot.epoch == epoch and boot.state is RankState.PENDING:
                self._origin_misfits[c] = fit.misfit
                self._mismatched(c, fit.misfit)
            return
        ex = Exporter(scratch)
        while not ex.step(cfg.graft_chunk):
            await asyncio.sleep(0)
        boot = self.ranks.get(c)
        if boot is None or boot.epoch != epoch or boot.state is not RankState.PENDING:
            return
        last = result.batches[-1][0]
        sub = self._subs[c]
        held = sub.hold.take() if sub.hold is not None else []
        rest = [b for b in held if b.seq > last]
        if rest and rest[0].seq != last + 1:
            for b in held:  # not ours to publish: back to the hold for the peer sweep
                sub.hold.add(b)
            self._origin_failed(c, OriginOutcome.GAP)
            return

        def admit(carrier: Carrier) -> bool:
            b = self.ranks.get(carrier)
            return b is not None and b.epoch == epoch and b.state is RankState.PENDING

        # Our own scratch export, through vetting's checks like a peer's (tierless entries name the
        # worker one past the table: None).
        columns = vet_export(ex.columns, len(ex.workers))
        grafter = Grafter(self.plane.index, columns, [*(c for _w in ex.workers), None], admit)
        for b in rest:  # re-held while the graft lands; released right after it
            sub.hold.add(b)
        chunk = cfg.graft_chunk
        while not await self.plane.writer.call(lambda _index: grafter.step(chunk), touches=(c,)):
            pass
        if not admit(c):
            return
        self.plane.writer.applied[c] = max(self.plane.writer.applied.get(c, -1), last)
        self.metrics.origin.labels(OriginOutcome.COMPLETE.value).inc()
        self.metrics.time_to_exact.observe(self._clock() - boot.since)
        self._splice(c, last, exact=True)
        log.info("bootstrap rank %s: exact from the engine's replay (%d batches)", c, len(result.batches))

    def _origin_failed(self, c: Carrier, outcome: OriginOutcome) -> None:
        self.metrics.origin.labels(outcome.value).inc()
        log.info("bootstrap rank %s: origin replay %s", c, outcome.value)

    async def _probe(self, c: Carrier, epoch: int) -> None:
        """Silence is not evidence: ask the fleet whether the publisher moved past our watermark."""
        cfg = self.config
        unknown = 0
        while True:
            await asyncio.sleep(cfg.probe_interval_s)
            boot = self.ranks.get(c)
            if boot is None or boot.epoch != epoch or boot.watermark is None:
                return
            spec = self.plane.workers.get(c.engine)
            incarnation = spec.incarnation if spec else ""
            witness = False
            for peer in self.peers.candidates(self._rng):
                try:
                    table = await self.fetcher.cursors(peer)
                except FetchFailed:
                    continue
                seq = table.get((c.engine, c.rank, incarnation))
                if seq is not None and boot.watermark is not None and seq > boot.watermark:
                    witness = True
                    break
            boot = self.ranks.get(c)
            if boot is None or boot.epoch != epoch or boot.watermark is None:
                return
            if witness:
                # A batch above the watermark was published and we never saw it.
                sub = self._subs.get(c)
                if sub is not None:
                    sub.splice_watermark = None
                boot.watermark = None
                self.plane.writer.submit_clear(c, ClearReason.UNCOVERED_GAP)
                self._settle(c, RankOutcome.GAP)
                return
            unknown += 1
            if unknown >= cfg.max_unknown_probes and boot.state is RankState.RECOVERED:
                # Kept: the watermark check stays armed, so a later batch can still disprove it.
                self._settle(c, RankOutcome.WARM_UNWITNESSED)
                return
