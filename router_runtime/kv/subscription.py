"""One subscription per (engine, DP rank): a ZMQ SUB on the engine's PUB endpoint, sequence tracking,
and gap replay over a DEALER on the engine's replay endpoint.

While a replay runs, live batches simply wait in the SUB socket's queue (bounded by its high-water
mark; anything ZMQ drops past it shows up as the next gap). Every doubt resolves to a cleared rank,
never to a guess: a replay that cannot cover the gap, a publisher restart, a batch that does not decode
or does not fit the writer's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
import zmq
import zmq.asyncio

from ..worker import Carrier
from .cursor import Arrival, classify
from .decode import MalformedFrame, decode, parse_pub_message, parse_replay_reply, topic_matches
from .events import DecodeStats, SequencedBatch
from .fit import FitTally
from .hold import HoldEnd, RankHold
from .metrics import KVMetrics
from .sockets import Sockets
from .writer import ClearReason, IndexWriter

log = logging.getLogger(__name__)


class ReplayOutcome(enum.StrEnum):
    FILLED = "filled"  # every missing batch came back
    UNCOVERED = "uncovered"  # the buffer had moved on: its first sequence was past our cursor + 1
    TRUNCATED = "truncated"  # some batches, then silence (old vLLM's send HWM drops the tail)
    TIMEOUT = "timeout"  # nothing at all
    MALFORMED = "malformed"
    HOLE = "hole"  # the replay itself skipped a sequence


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where a rank's stream stood when we let go of it: enough to resume it, and to recognise its
    publisher again. ``cursor_hash`` is the hash of the cursor's batch payload: a restarted publisher
    that has reached the same sequence number holds another batch there (vLLM's carry a timestamp)."""

    cursor: int | None = None
    live_last: int | None = None
    cursor_hash: int | None = None


class Fill(enum.Enum):
    DONE = "done"
    RESET = "reset"  # the position was reset while the replay was out: nothing changed, ask again
    STALE = "stale"  # the answering publisher did not send the live batch in hand


# After a rank's subscription failed: the pause before it is followed again.
RESUBSCRIBE_S = 1.0
RECENT_HASHES = 4096  # applied batches whose payload hash a rank remembers (about 100 KiB)
# After a graft, batches at or below its cursor are already in it, but only the few a sibling can be
# ahead of our own stream (published between our subscribe and its export). A batch further below
# disproves the cursor (a hostile or broken peer, or a publisher that restarted): the rank goes cold.
SPLICE_MAX_LEAD = 65_536
# ... and only while they can still be in flight: read within this of the splice, on the same connection.
SPLICE_IN_FLIGHT_S = 1.0


def payload_hash(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


@dataclass(frozen=True, slots=True)
class Endpoints:
    pub: str
    replay: str | None
    topic: bytes = b""


@dataclass(slots=True)
class ReplayTimeouts:
    idle_s: float = 1.0  # silence between replies (vLLM services replay between queue polls, ~100 ms)
    total_s: float = 10.0


@dataclass(frozen=True, slots=True)
class ReplayResult:
    outcome: ReplayOutcome
    batches: list[tuple[int, bytes]]  # contiguous from the first replayed sequence


class RankSubscription:
    def __init__(
        self,
        sockets: Sockets,
        carrier: Carrier,
        endpoints: Endpoints,
        writer: IndexWriter,
        metrics: KVMetrics,
        *,
        timeouts: ReplayTimeouts | None = None,
        rcvhwm: int = 100_000,
    ) -> None:
        self.sockets = sockets
        self.carrier = carrier
        self.endpoints = endpoints
        self.writer = writer
        self.metrics = metrics
        self.timeouts = timeouts or ReplayTimeouts()
        self.rcvhwm = rcvhwm
        self.cursor: int | None = None  # last sequence handed to the writer
        self.cursor_hash: int | None = None  # xxh3 of that batch's payload (None: not known)
        self.live_last: int | None = None  # last sequence seen on the live stream
        self.connected = False
        # The connection went since the last live batch: the publisher there may be another process,
        # whose sequence has passed ours (what it sent while we reconnected was lost): the next batch
        # in sequence is not taken on trust (``on_live``).
        self.reconnected = False
        self.last_event_at: float | None = None
        # A gap seen and being replayed: until it is filled (or the rank cleared), the index lacks
        # batches the engine sent (a prediction now is doubtful).
        self.filling = False
        # Since when the engine owes us a batch: a request it served stored new blocks (the proxy
        # says so, ``expect_batch``). A batch arriving after that pays the debt.
        self.owed_since: float | None = None
        # While a bootstrap or a re-adoption decides this rank, its batches wait here instead of the
        # writer. Its one owner sets and ends it with ``attach`` / ``detach`` / ``release``.
        self.hold: RankHold | None = None
        # Set by the bootstrap after a graft whose held batches did not reach past the snapshot's
        # cursor: batches at or below it are already in the graft and are dropped; the first one above
        # it is reported to ``on_splice`` (proved if it is exactly watermark + 1) before it is applied.
        self.splice_watermark: int | None = None
        # Until when a batch at or below it may still be one that was on its way when the graft was
        # spliced (``arm_splice``); after that, or on a new connection, it is another process's.
        self.splice_in_flight_until = 0.0
        self.on_splice: Callable[[int], None] | None = None
        self._stats = DecodeStats()
        # What the index's rule makes of this rank's stores, held or applied (a mismatch shows here
        # before any held batch reaches the index).
        self.fit = FitTally()
        self._resumes = 0
        self._recent: dict[int, int] = {}  # seq -> payload hash of the last RECENT_HASHES applied

    @property
    def resumes(self) -> int:
        """Bumped by every reset of the position (``resume``, a publisher restart seen)."""
        return self._resumes

    def position(self) -> StreamPosition:
        return StreamPosition(self.cursor, self.live_last, self.cursor_hash)

    def resume(self, position: StreamPosition | None) -> None:
        """Take up a stream where we let go of it (None: from wherever it is)."""
        p = position or StreamPosition()
        self.cursor, self.live_last, self.cursor_hash = p.cursor, p.live_last, p.cursor_hash
        self._recent = {} if p.cursor_hash is None else {p.cursor: p.cursor_hash}
        self._resumes += 1  # a gap fill in flight is filling from the old cursor: it must start over

    # ---- holding -------------------------------------------------------------------------------

    def attach(self, hold: RankHold) -> None:
        """From now on batches wait in ``hold`` instead of reaching the writer. One attached already is
        replaced: its owner has judged what it held (``detach`` it first to keep that)."""
        self.hold = hold

    def detach(self) -> list[SequencedBatch]:
        """The owner is done with the hold: batches flow to the writer again. Returns what it held, in
        order (nothing once it ended: ``RankHold.end`` dropped it)."""
        hold, self.hold = self.hold, None
        return hold.abandon() if hold is not None else []

    def submit(self, batches: list[SequencedBatch]) -> bool:
        """Hand held batches to the writer, in order. False: the writer's queue overflowed, so the rank
        was cleared (cold) and the rest dropped (applying them past the hole would be a guess)."""
        for b in batches:
            if not self.writer.submit_batch(self.carrier, b):
                self.clear(ClearReason.OVERFLOW)
                return False
        return True

    def release(self) -> bool:
        """Detach the hold and hand what it held to the writer (``submit``)."""
        return self.submit(self.detach())

    def accept_replayed(self, batches: list[tuple[int, bytes]]) -> None:
        """Replayed ``(seq, payload)`` batches that continue this rank's cursor, applied in order (held,
        if a hold is attached); those the live loop or a gap fill took meanwhile are skipped."""
        for seq, payload in batches:
            if self.cursor is not None and seq == self.cursor + 1:
                self._accept(seq, payload, replayed=True)

    # ---- the live loop -------------------------------------------------------------------------

    async def follow(self) -> None:
        """``run``, for as long as the rank is followed. A failure (a bug, an endpoint ZMQ refuses) must
        not end it while the index keeps the rank's blocks and their removals go unheard: the rank is
        cleared (cold, and counted) and followed again, from its stream's next batch."""
        while True:
            try:
                await self.run()
                return
            except Exception as e:
                # libzmq's own words name the endpoint; any other error's text might carry a batch's.
                detail = str(e) if isinstance(e, zmq.ZMQError) else type(e).__name__
                log.error(
                    "rank %s: its subscription failed (%s): cleared, followed again in %g s",
                    self.carrier,
                    detail,
                    RESUBSCRIBE_S,
                )
                self.clear(ClearReason.SUBSCRIPTION_FAILED)
                self.resume(None)
            await asyncio.sleep(RESUBSCRIBE_S)

    async def run(self) -> None:
        name = f"rank {self.carrier}"
        watch: asyncio.Task | None = None
        try:
            with (
                self.sockets.open(zmq.SUB, f"live SUB of {name}") as sub,
                self.sockets.monitor(
                    sub, zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED, f"live SUB monitor of {name}"
                ) as monitor,
            ):
                sub.setsockopt(zmq.RCVHWM, self.rcvhwm)
                # ZMQ reconnects by itself; bound its backoff so a restarted engine is picked up quickly.
                sub.setsockopt(zmq.RECONNECT_IVL, 100)
                sub.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
                sub.setsockopt(zmq.SUBSCRIBE, self.endpoints.topic)
                sub.connect(self.endpoints.pub)
                watch = asyncio.create_task(self._watch(monitor), name=f"kv-monitor-{self.carrier}")
                while True:
                    frames = await sub.recv_multipart(copy=True)
                    await self.on_live(frames)
        finally:
            # Both sockets are closed by now, whatever interrupted the loop; the watch ends with them.
            self.connected = False
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            msg = parse_monitor_message(await monitor.recv_multipart())
            self.connected = msg["event"] == zmq.EVENT_CONNECTED
            if msg["event"] == zmq.EVENT_DISCONNECTED:
                self.reconnected = True
                self.splice_in_flight_until = 0.0  # nothing sent before comes on a new connection
            log.info("rank %s %s", self.carrier, "connected" if self.connected else "disconnected")

    async def on_live(self, frames: list[bytes]) -> None:
        try:
            topic, seq, payload = parse_pub_message(frames)
        except MalformedFrame as exc:
            self.metrics.malformed.labels(str(exc.reason)).inc()
            return
        if not topic_matches(topic, self.endpoints.topic):
            return
        self.last_event_at = time.monotonic()
        arrival = classify(self.cursor, seq, live_last=self.live_last)
        self.live_last = seq
        if arrival is Arrival.DUPLICATE:
            # A held duplicate of a replayed batch, or a restarted publisher whose sequence has not
            # yet passed ours (live_last cannot tell when the batches came by replay): the batch we
            # applied at that sequence, when we still know it, tells.
            known = self._recent.get(seq)
            if known is not None and known != payload_hash(payload):
                arrival = Arrival.RESTART
        if arrival is Arrival.RESTART:
            self._restarted(seq)
            arrival = classify(self.cursor, seq)
        # After a reconnect even the next batch in sequence is checked, by a replay from our cursor's
        # (a gap's replay always starts there).
        checked = self.reconnected and arrival is Arrival.NEXT
        self.reconnected = False
        if arrival is Arrival.GAP or checked:
            if arrival is Arrival.GAP:
                self.metrics.gaps.inc()
            self.filling = True
            try:
                while (fill := await self._fill_gap(seq)) is Fill.RESET:
                    pass  # the position was reset meanwhile: fill again from the new cursor
            finally:
                self.filling = False
            if fill is Fill.STALE:
                return  # the live batch in hand is a dead process's
            arrival = classify(self.cursor, seq)
            if arrival is Arrival.GAP:  # the replay could not reach the live stream
                self.clear(ClearReason.REPLAY_FAILED)
                arrival = Arrival.FIRST
        if arrival is not Arrival.DUPLICATE:
            self._accept(seq, payload)

    def _restarted(self, live_last: int | None) -> None:
        """Another process publishes now: the rank goes cold, unless a hold that judges a new process
        itself takes the restart over (warm re-adoption), and the new stream is followed from its
        sequence 0."""
        hold = self.hold
        if hold is None or not hold.active or not hold.take_over_restart():
            self.clear(ClearReason.PUBLISHER_RESTART)
        self.resume(StreamPosition(-1, live_last))

    def expect_batch(self, since: float) -> None:
        """A request dispatched at ``since`` made the engine store new blocks: a batch is due."""
        if self.owed_since is None or (self.last_event_at or float("-inf")) >= self.owed_since:
            self.owed_since = since

    def stalled(self, now: float, after_s: float) -> bool:
        """The engine has owed us a batch for longer than ``after_s``: its stream is silent while it
        serves (a partition that TCP hides, a stuck publisher), so the index may lag it."""
        owed = self.owed_since
        return owed is not None and (self.last_event_at or float("-inf")) < owed and now - owed > after_s

    # ---- applying ------------------------------------------------------------------------------

    def _accept(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        self.cursor, self.cursor_hash = seq, payload_hash(payload)
        recent = self._recent
        recent[seq] = self.cursor_hash
        if len(recent) > RECENT_HASHES:
            del recent[next(iter(recent))]
        try:
            batch = decode(payload, self._stats)
        except MalformedFrame as exc:
            # The batch is lost to us and may have removed blocks: forget this rank rather than guess.
            self.metrics.malformed.labels(str(exc.reason)).inc()
            self.clear(ClearReason.MALFORMED_BATCH)
            return
        self._flush_decode_stats()
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != self.carrier.rank:
            self.metrics.malformed.labels("rank_mismatch").inc()
            self.clear(ClearReason.MALFORMED_BATCH)
            return
        index = self.writer.index
        self.fit.add(batch, index.block_size, index.full_attention_group)
        sb = SequencedBatch(seq, batch, len(payload))
        hold = self.hold
        if hold is not None and hold.active:
            hold.add(sb)
            return
        wm = self.splice_watermark
        if wm is not None:
            on_time = replayed or time.monotonic() <= self.splice_in_flight_until
            if seq <= wm and wm - seq <= SPLICE_MAX_LEAD and on_time:
                return  # the graft already reflects it; re-applying an old store could undo a removal
            self.splice_watermark = None
            if self.on_splice is not None:
                self.on_splice(seq)  # proves the join at watermark + 1; anything else clears the rank
        if not self.writer.submit_batch(self.carrier, sb):
            self.clear(ClearReason.OVERFLOW)

    def arm_splice(self, cursor: int) -> None:
        """A graft reflects this rank's stream up to ``cursor`` and nothing held reached past it: the
        first batch above it must join it (``on_splice``). Batches at or below it are dropped (already in
        the graft) when a replay from our cursor resends them, or while they can be live ones already on
        their way (SPLICE_IN_FLIGHT_S, the same connection): the process that sent them sends nothing
        twice live, so a later one is another process's (restarted under the same incarnation), and the
        rank is cleared rather than credited with the dead one's blocks."""
        self.splice_watermark = cursor
        self.splice_in_flight_until = time.monotonic() + SPLICE_IN_FLIGHT_S

    def clear(self, reason: ClearReason) -> None:
        """Drop the rank's blocks (it runs cold from here) and end any hold: its owner hears a reset."""
        self.writer.submit_clear(self.carrier, reason)
        if self.hold is not None:
            self.hold.end(HoldEnd.PUBLISHER_RESET)

    def _flush_decode_stats(self) -> None:
        s = self._stats
        if s.unknown_tags:
            self.metrics.skipped_events.labels("unknown_tag").inc(sum(s.unknown_tags.values()))
            s.unknown_tags.clear()
        if s.unknown_fields:
            self.metrics.skipped_events.labels("unknown_field").inc(s.unknown_fields)
            s.unknown_fields = 0

    # ---- replay --------------------------------------------------------------------------------

    async def _fill_gap(self, live_seq: int) -> Fill:
        """Replay what lies between our cursor and ``live_seq``. RESET, having changed nothing, when our
        position was reset (``resume``) while the replay was out: its answer filled the old cursor; or
        having cleared the rank, when the publisher holds another batch at our cursor than the one we
        applied (a restarted process whose sequence passed ours): ask again, from its start. STALE
        when the answer ended before ``live_seq``: a publisher buffers a batch before it sends it, so
        the one that answered did not send the live batch in hand; a dead process did."""
        start = self.cursor + 1
        if self.endpoints.replay is None:
            self.metrics.replays.labels("unavailable").inc()
            return Fill.DONE
        # From our cursor's own batch when we know its hash (not after a graft or an uncovered gap).
        checks = start > 0 and self.cursor_hash is not None
        resumes = self._resumes
        result = await replay(
            self.sockets,
            self.endpoints.replay,
            start - 1 if checks else start,
            self.timeouts,
            f"gap replay of rank {self.carrier}",
            stop_at=live_seq,
            need=start,
        )
        if self._resumes != resumes:
            return Fill.RESET
        self.metrics.replays.labels(str(result.outcome)).inc()
        log.info("rank %s replay from %d: %s", self.carrier, start, result.outcome.value)
        got = result.batches
        if checks and got and got[0][0] == start - 1:
            if payload_hash(got[0][1]) != self.cursor_hash:
                log.info("rank %s: another publisher's batch at our cursor: a restarted engine", self.carrier)
                self._restarted(self.live_last)
                return Fill.RESET
            got = got[1:]
        answered = result.outcome in (ReplayOutcome.FILLED, ReplayOutcome.UNCOVERED)
        stale = answered and (not got or got[-1][0] < live_seq)
        if stale:
            # Whatever our cursor's batches were, the publisher now is another: cold, and followed
            # from what it answered (from its sequence 0 next, when it answered nothing).
            self.clear(ClearReason.PUBLISHER_RESTART)
            self.resume(StreamPosition((got[0][0] - 1) if got else -1))
        elif result.outcome is ReplayOutcome.UNCOVERED:
            # What happened between our cursor and the buffer's oldest batch is unknowable.
            self.clear(ClearReason.UNCOVERED_GAP)
            self.cursor = got[0][0] - 1
            self.cursor_hash = None
        # Continuing our cursor (its own batch checked first), the replay is the process the graft
        # reflects: what it resends at or below the graft's cursor is in the graft. Otherwise the rank
        # was cleared above, the graft with it.
        same = not stale and result.outcome is not ReplayOutcome.UNCOVERED
        if not same and self.splice_watermark is not None:
            self.splice_watermark = None
            if self.on_splice is not None and got:
                self.on_splice(got[0][0])  # not the join: the bootstrap says the rank went cold
        for seq, payload in got:
            if classify(self.cursor, seq) is Arrival.NEXT:
                self._accept(seq, payload, replayed=same)
        return Fill.STALE if stale else Fill.DONE


async def replay(
    sockets: Sockets,
    endpoint: str,
    start: int,
    timeouts: ReplayTimeouts,
    name: str,
    *,
    stop_at: int | None = None,
    max_bytes: int | None = None,
    need: int | None = None,
) -> ReplayResult:
    """Ask a replay ROUTER for every buffered batch from ``start``; collect until the end marker, or
    (once ``stop_at`` is reached) stop early. Past ``max_bytes`` of payload it stops as truncated.
    Returns the contiguous run it got and how it ended: UNCOVERED when it begins after ``need`` (the
    first sequence the caller cannot do without; ``start`` by default). ``name`` names its DEALER
    (``Sockets``)."""
    got: list[tuple[int, bytes]] = []
    size = 0
    outcome = ReplayOutcome.TIMEOUT
    with sockets.open(zmq.DEALER, name) as dealer:
        dealer.connect(endpoint)
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + timeouts.total_s
        while True:
            left = min(timeouts.idle_s, deadline - time.monotonic())
            if left <= 0 or not await dealer.poll(left * 1000):
                outcome = ReplayOutcome.TRUNCATED if got else ReplayOutcome.TIMEOUT
                break
            try:
                reply = parse_replay_reply(await dealer.recv_multipart())
            except MalformedFrame:
                outcome = ReplayOutcome.MALFORMED
                break
            if reply is None:
                outcome = ReplayOutcome.FILLED
                break
            seq, payload = reply
            if seq < start:
                continue
            if got and seq != got[-1][0] + 1:
                outcome = ReplayOutcome.HOLE
                break
            got.append((seq, payload))
            size += len(payload)
            if max_bytes is not None and size > max_bytes:
                outcome = ReplayOutcome.TRUNCATED
                break
            if stop_at is not None and seq >= stop_at:
                outcome = ReplayOutcome.FILLED
                break
    if got and got[0][0] > (start if need is None else need):
        outcome = ReplayOutcome.UNCOVERED
    elif not got and outcome is ReplayOutcome.FILLED:
        outcome = ReplayOutcome.UNCOVERED  # an empty buffer past our cursor covers nothing
    return ReplayResult(outcome, got)
