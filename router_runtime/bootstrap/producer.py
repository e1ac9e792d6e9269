"""The producer half: builds this replica's snapshot for booting siblings.

Builds are single-flighted and cached, so a boot herd shares one walk; each format's body is encoded
from the cached export once, on first request, off the loop. The entry is stamped BEFORE the cursors
are read, and the cursors are read in the same writer turn that starts the walk, so a body never
claims to cover more of a publisher's stream than it does; the consumer's ``max_age_ms`` (its strictest
holding-since) decides whether a cached body is fresh enough.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gzip
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ..kv.plane import KVPlane
from ..kv.snapshot import Columns, Exporter
from ..worker import Carrier
from .vetting import HashingConfig
from .wire import FORMAT, LEGACY_FORMAT, WireSession, WireSnapshot, WireWorker, encode

# Walks of the index per build before giving up (not ready: the sibling asks another peer, or the origin).
_WALKS = 3


@dataclass(slots=True)
class Built:
    at: float  # monotonic stamp taken before the cursors were read
    snapshot: WireSnapshot  # the export; each format's body is encoded from it on first request
    # (format, gzipped) -> the encoding of that body, single-flighted
    bodies: dict[tuple[int, bool], asyncio.Future] = field(default_factory=dict)


class SnapshotProducer:
    def __init__(
        self,
        plane: KVPlane,
        hashing: HashingConfig,
        *,
        producer_id: str,
        producer_incarnation: str,
        ready: Callable[[], bool],
        include: Callable[[Carrier], bool],
        default_max_age_s: float = 2.0,
        chunk: int = 4096,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        sessions: Callable[[], list[WireSession]] | None = None,
        responses: Callable[[], list[WireSession]] | None = None,
    ) -> None:
        self.plane = plane
        self.hashing = hashing
        self.producer_id = producer_id
        self.producer_incarnation = producer_incarnation
        self._ready = ready
        self._include = include
        self.default_max_age_s = default_max_age_s
        self.chunk = chunk
        self._clock, self._wall = clock, wall
        # What a booting sibling inherits besides the tree: the session-affinity table and the
        # response bindings.
        self._sessions = sessions
        self._responses = responses
        self._cached: Built | None = None
        self._inflight: asyncio.Task | None = None

    def ready(self) -> bool:
        """Non-empty tree, hashing established (static here) and our own bootstrap settled."""
        return self.plane.index.node_count() > 0 and self._ready()

    def _incarnation(self, carrier: Carrier) -> str:
        spec = self.plane.workers.get(carrier.engine)
        return spec.incarnation if spec is not None else ""

    def cursors(self) -> list[tuple[Carrier, str, int]]:
        """The live cursor table, never cached: a witness only needs to have seen the stream, so this
        is a superset of what an export covers."""
        return [
            (c, self._incarnation(c), seq)
            for c, seq in sorted(self.plane.writer.applied.items())
            if self._include(c)
        ]

    async def get(self, max_age_s: float | None = None) -> Built:
        """A body stamped no earlier than ``max_age_s`` before this call. The bound is fixed when the
        request arrives, so a build started after it always qualifies (no rebuild chase)."""
        not_before = self._clock() - (self.default_max_age_s if max_age_s is None else max_age_s)
        while True:
            cached = self._cached
            if cached is not None and cached.at >= not_before:
                return cached
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._build())
                self._inflight.add_done_callback(lambda _t: setattr(self, "_inflight", None))
            built = await asyncio.shield(self._inflight)
            if built.at >= not_before:
                return built
            # That build started before the caller's bound: the next one will not.

    def sessions_body(self, fmt: int = LEGACY_FORMAT) -> bytes:
        """An envelope holding only the session table and the response bindings (no nodes): for a
        sibling that rebuilt every rank from the engines' own replay buffers and so fetched no
        snapshot. Never cached: small."""
        snap = self._snapshot([], {}, Columns(), self.ready(), self._tables())
        return encode(dataclasses.replace(snap, format=fmt))

    async def body(self, built: Built, fmt: int, gzipped: bool) -> bytes:
        """``built`` in format ``fmt``, encoded once per format off the loop. Format 1 is gzipped when
        asked (its digests barely compress, but an old consumer expects it); format 2 never is (its
        columns that compress are packed inside)."""
        key = (fmt, gzipped and fmt == LEGACY_FORMAT)
        task = built.bodies.get(key)
        if task is None:
            snap = dataclasses.replace(built.snapshot, format=fmt)
            task = built.bodies[key] = asyncio.ensure_future(
                asyncio.get_running_loop().run_in_executor(None, _encode_body, snap, key[1])
            )
        return await asyncio.shield(task)

    async def _build(self) -> Built:
        at = self._clock()
        if not self.ready():
            built = Built(at, self._snapshot([], {}, Columns(), ready=False))
            self._cached = built
            return built
        writer = self.plane.writer

        def state(index, carriers) -> dict[Carrier, tuple[str, int]]:
            """What must not change under a walk, per carrier we may export: its engine's incarnation
            and how often it was cleared; a rank withheld (its blocks in doubt) is not exported."""
            return {
                c: (self._incarnation(c), writer.resets.get(c, 0))
                for c in carriers
                if self._include(c) and c not in index.withheld
            }

        def start(index):
            now = state(index, writer.applied)
            applied = {c: s for c, s in writer.applied.items() if c in now}
            return applied, now, Exporter(index, include=lambda c: c in applied)

        for _ in range(_WALKS):
            applied, before, ex = await writer.call(start)
            while not await writer.call(lambda _index, ex=ex: ex.step(self.chunk)):
                pass
            # A rank cleared, restarted or withheld during the walk: its blocks may be the old process's
            # under the new one's name. Walk again (a boot herd waits on this one build).
            if await writer.call(lambda index, was=applied, then=before: state(index, was) == then):
                names = {c: incarnation for c, (incarnation, _) in before.items()}
                snap = self._snapshot(ex.workers, applied, ex.columns, True, self._tables(), names)
                built = Built(at, snap)
                break
        else:
            built = Built(at, self._snapshot([], {}, Columns(), ready=False))
        self._cached = built
        return built

    def _snapshot(
        self,
        workers: list[Carrier],
        applied: dict[Carrier, int],
        cols: Columns,
        ready: bool,
        tables: dict[str, list[WireSession]] | None = None,
        incarnations: Mapping[Carrier, str] | None = None,
    ) -> WireSnapshot:
        """``incarnations``: each exported worker's, as the walk saw them (else read now)."""
        named = incarnations or {}
        return WireSnapshot(
            format=FORMAT,
            producer_id=self.producer_id,
            producer_incarnation=self.producer_incarnation,
            producer_ready=ready,
            block_size=self.hashing.block_size,
            scheme=self.hashing.scheme,
            workers=[WireWorker(c.engine, c.rank, named.get(c, self._incarnation(c))) for c in workers],
            cursors=[(i, applied[c]) for i, c in enumerate(workers) if c in applied],
            built_ms=int(self._wall() * 1000),
            columns=cols,
            **(tables or {}),
        )

    def _tables(self) -> dict[str, list[WireSession]]:
        """The remembered tables, read on the loop."""
        return {
            "sessions": self._sessions() if self._sessions is not None else [],
            "responses": self._responses() if self._responses is not None else [],
        }


def _encode_body(snap: WireSnapshot, gzipped: bool) -> bytes:
    body = encode(snap)
    # Level 1: this runs on a replica that is serving traffic during a boot herd.
    return gzip.compress(body, compresslevel=1) if gzipped else body
