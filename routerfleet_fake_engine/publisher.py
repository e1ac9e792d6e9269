"""The fake engine's KV event plane: per DP rank, a ZMQ PUB stream and a replay ROUTER, as vLLM runs them.

Rank ``r`` binds its PUB at ``kv_port + r`` and its replay ROUTER at ``replay_port + r``. Every
published batch gets the rank's next sequence number (from 0, +1 per batch), is sent as
``[topic, seq (8 bytes BE), payload]`` and kept in a bounded replay buffer. A DEALER sending
``[b"", start_seq (8 bytes BE)]`` gets every buffered batch with ``seq >= start_seq`` in the dialect's
reply framing, then the end marker (all framing comes from ``router_runtime.kv.encode``).

Threading: all of this runs on the engine's asyncio loop. The PUB socket is a plain (sync) socket
because a PUB send never blocks (ZMQ drops for a subscriber at its high-water mark instead), which also
keeps the wire order exactly the sequence order with no send queue in between. The ROUTER side is a
``zmq.asyncio`` socket served by one task per rank, so a long replay never stalls the HTTP loop.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from router_runtime.kv.encode import encode_batch, pub_frames, replay_end_frames, replay_reply_frames
from router_runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, EventBatch
from router_runtime.tasks import end_tasks

log = logging.getLogger(__name__)

_PUB_HWM = 100_000  # vLLM's default hwm
_BIND_ATTEMPTS = 64
_EPHEMERAL_BASES = (20_000, 60_000)


class Drop(enum.StrEnum):
    """Simulated loss of one sequenced batch (tests of gap detection and replay)."""

    NONE = "none"  # delivered normally
    PUB = "pub"  # lost on the PUB stream only; replay still has it, so a consumer can fill the gap
    ALL = "all"  # lost everywhere: the seq is consumed but the batch never existed


@dataclass(slots=True)
class RankStats:
    batches: int = 0  # sequence numbers consumed (including dropped ones)
    events: dict[str, int] = field(default_factory=dict)  # by event type, batches actually built
    replays: int = 0


@dataclass(slots=True)
class _RankStream:
    rank: int
    pub: zmq.Socket
    router: zmq.asyncio.Socket
    kv_port: int
    replay_port: int
    buffer: deque[tuple[int, bytes]]
    next_seq: int = 0
    stats: RankStats = field(default_factory=RankStats)
    task: asyncio.Task | None = None
    muted: bool = False  # every batch kept for replay, none sent on PUB (a silent stream)


def bind_port_range(sockets: list[zmq.Socket], host: str, base: int) -> int:
    """Bind socket ``i`` to ``tcp://host:base+i`` and return the base. With ``base == 0``, find a base
    where all ``len(sockets)`` consecutive ports are free, so the base+rank contract holds even for
    ephemeral ports (binding is the test, so there is no check-then-bind race)."""
    if base:
        for i, sock in enumerate(sockets):
            sock.bind(f"tcp://{host}:{base + i}")
        return base
    rng = random.Random()  # port choice need not be deterministic; only the event stream must be
    for _ in range(_BIND_ATTEMPTS):
        candidate = rng.randrange(*_EPHEMERAL_BASES)
        bound: list[tuple[zmq.Socket, bytes]] = []
        try:
            for i, sock in enumerate(sockets):
                sock.bind(f"tcp://{host}:{candidate + i}")
                bound.append((sock, sock.last_endpoint))  # resolved ("*" -> 0.0.0.0): what unbind needs
            return candidate
        except zmq.ZMQError:
            for sock, endpoint in bound:
                sock.unbind(endpoint)
    raise OSError(f"no {len(sockets)} consecutive free ports found after {_BIND_ATTEMPTS} attempts")


class KvPublisher:
    """All ranks' PUB + replay sockets, sequence counters and replay buffers for one engine."""

    def __init__(
        self,
        *,
        dialect: Dialect,
        dp_size: int,
        host: str,
        kv_port: int,
        replay_port: int,
        topic: str = "",
        replay_buffer: int = 10_000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dialect = dialect
        self.topic = topic.encode()
        self._clock = clock
        self._host = host
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context(shadow=self._ctx)
        pubs: list[zmq.Socket] = []
        routers: list[zmq.asyncio.Socket] = []
        try:
            for _ in range(dp_size):
                pub = self._ctx.socket(zmq.PUB)
                pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
                pub.setsockopt(zmq.LINGER, 0)
                pubs.append(pub)
                router = self._actx.socket(zmq.ROUTER)
                # As vLLM 0.33: room for a whole buffer's replay, so a replay is never cut short by HWM.
                router.setsockopt(zmq.SNDHWM, 2 * (replay_buffer + 1))
                router.setsockopt(zmq.LINGER, 0)
                routers.append(router)
            kv_base = bind_port_range(pubs, host, kv_port)
            replay_base = bind_port_range(routers, host, replay_port)  # type: ignore[arg-type]
        except BaseException:
            for sock in (*pubs, *routers):
                sock.close(0)
            self._ctx.term()
            raise
        self._ranks = [
            _RankStream(r, pubs[r], routers[r], kv_base + r, replay_base + r, deque(maxlen=replay_buffer))
            for r in range(dp_size)
        ]
        self._closed = False

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start serving replay requests (needs a running loop)."""
        for stream in self._ranks:
            if stream.task is None:
                stream.task = asyncio.create_task(
                    self._serve_replay(stream), name=f"replay-rank{stream.rank}"
                )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await end_tasks([s.task for s in self._ranks], "KV publisher")
        finally:  # every socket closed first, so the term cannot block
            for stream in self._ranks:
                stream.pub.close(0)
                stream.router.close(0)
            self._ctx.term()

    def reset(self) -> None:
        """A new incarnation: sequences restart at 0 and replay buffers empty. Sockets stay bound, like
        a restarted engine coming back on the same ports."""
        for stream in self._ranks:
            stream.next_seq = 0
            stream.buffer.clear()

    # --------------------------------------------------------------- addresses

    @property
    def dp_size(self) -> int:
        return len(self._ranks)

    @property
    def kv_port_base(self) -> int:
        return self._ranks[0].kv_port

    @property
    def replay_port_base(self) -> int:
        return self._ranks[0].replay_port

    def _connect_host(self) -> str:
        return "127.0.0.1" if self._host == "*" else self._host

    def kv_endpoint(self, rank: int) -> str:
        """Where a SUB connects for ``rank``."""
        return f"tcp://{self._connect_host()}:{self._ranks[rank].kv_port}"

    def replay_endpoint(self, rank: int) -> str:
        """Where a DEALER connects for ``rank``'s replay."""
        return f"tcp://{self._connect_host()}:{self._ranks[rank].replay_port}"

    # -------------------------------------------------------------- publishing

    def last_seq(self, rank: int) -> int:
        """The last sequence number consumed on ``rank`` (-1 before the first batch)."""
        return self._ranks[rank].next_seq - 1

    def stats(self, rank: int) -> RankStats:
        return self._ranks[rank].stats

    def publish(self, rank: int, events: list | tuple, drop: Drop = Drop.NONE) -> int:
        """Publish one scheduler step's events on ``rank`` as the next batch, stamped with the rank.
        Returns its seq."""
        batch = EventBatch(ts=self._clock(), events=tuple(events), data_parallel_rank=rank)
        counts = self._ranks[rank].stats.events
        for event in batch.events:
            name = _EVENT_NAMES.get(type(event), "Other")
            counts[name] = counts.get(name, 0) + 1
        return self.publish_payload(rank, encode_batch(self.dialect, batch), drop)

    def publish_payload(self, rank: int, payload: bytes, drop: Drop = Drop.NONE) -> int:
        """Publish pre-encoded payload bytes (possibly garbage, for malformed-input tests) as the next
        sequenced batch on ``rank``. Returns its seq."""
        stream = self._ranks[rank]
        seq = stream.next_seq
        stream.next_seq += 1
        stream.stats.batches += 1
        if drop is not Drop.ALL:
            stream.buffer.append((seq, payload))
        if drop is Drop.NONE and not stream.muted:
            stream.pub.send_multipart(pub_frames(self.topic, seq, payload), copy=False)
        return seq

    def mute(self, rank: int, on: bool) -> None:
        """While muted, ``rank`` sends nothing on PUB and keeps its batches for replay: the silent
        stream of a partition (the next batch after it shows the gap)."""
        self._ranks[rank].muted = on

    def skip(self, rank: int, n: int, keep_in_replay: bool = True) -> int:
        """Consume ``n`` sequence numbers on ``rank`` without sending anything on PUB: a lost batch.
        With ``keep_in_replay`` each skipped seq is buffered as an empty batch, so a consumer that
        replays the gap gets it filled; without, the seqs are gone for good. Returns the last seq."""
        drop = Drop.PUB if keep_in_replay else Drop.ALL
        for _ in range(n):
            self.publish(rank, (), drop)
        return self.last_seq(rank)

    # ------------------------------------------------------------------ replay

    async def _serve_replay(self, stream: _RankStream) -> None:
        while True:
            try:
                frames = await stream.router.recv_multipart()
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:  # socket closed under us during shutdown
                log.debug("replay socket for rank %d stopped: %s", stream.rank, e)
                return
            # vLLM accepts exactly [identity, b"", start_seq] and ignores anything else.
            if len(frames) != 3 or frames[1] != b"":
                log.warning(
                    "rank %d: ignoring malformed replay request (%d frames)", stream.rank, len(frames)
                )
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            stream.stats.replays += 1
            # Snapshot first: publishing may continue while we send, and a deque cannot be iterated
            # while it changes.
            pending = [(seq, payload) for seq, payload in stream.buffer if seq >= start]
            try:
                for seq, payload in pending:
                    frames_out = replay_reply_frames(self.dialect, self.topic, seq, payload)
                    await stream.router.send_multipart([identity, *frames_out], copy=False)
                await stream.router.send_multipart([identity, *replay_end_frames(self.dialect)])
            except zmq.ZMQError as e:
                log.warning("rank %d: replay reply failed: %s", stream.rank, e)


_EVENT_NAMES = {
    BlockStored: "BlockStored",
    BlockRemoved: "BlockRemoved",
    AllBlocksCleared: "AllBlocksCleared",
}
