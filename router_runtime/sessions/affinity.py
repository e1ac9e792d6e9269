"""The shell the proxy calls: session key, hint, lookup under a hard deadline, classification once per
request, the write on 2xx headers, metrics and the debug log. Keys never appear in a log line or a
metric label; only their digests are held, and only in the store.

Per request::

    begin(headers, body)      digest of the explicit key; a trusted hint resolves to an engine, else
                              the store is asked (deadline: lookup_timeout_s; timeout or error = miss)
    classify(ctx, targets)    once, on the first routing decision (a retry keeps it)
    selected(ctx, decision)   metric + debug log
    remember(ctx, target)     on the upstream's 2xx response headers, before the body is relayed
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..scheduling.hooks import Exchange, ResponseWatch
from ..scheduling.types import Target
from ..worker import Carrier
from .classify import Classified, SessionState, classify, selection
from .config import SessionConfig
from .keys import session_digest
from .metrics import SessionMetrics
from .store import Entry, LocalStore, Remembered, SampledWarnings, SessionStore, settle_quietly

log = logging.getLogger(__name__)


def engine_id(engine: str, incarnation: str, rank: int | None) -> str:
    """The opaque id a response carries: stable for one engine incarnation (and DP rank), meaningless
    outside the fleet, and changing when the engine restarts (an echoed id then resolves to nothing)."""
    h = hashlib.sha256()
    for part in (engine, incarnation):
        b = part.encode()
        h.update(len(b).to_bytes(8, "big") + b)
    base = "e1." + h.hexdigest()[:24]
    return base if rank is None else f"{base}.{rank}"


class SessionCtx:
    __slots__ = ("classified", "digest", "hint_unknown", "memory", "since")

    def __init__(self, digest: bytes | None) -> None:
        self.digest = digest
        self.memory: Remembered | None = None
        self.since: float | None = None  # when the memory was written (local store only), monotonic
        self.hint_unknown = False
        self.classified: Classified | None = None


class SessionAffinity:
    def __init__(
        self,
        config: SessionConfig,
        metrics: SessionMetrics,
        shared: SessionStore | None = None,
        evicted_at: Callable[[], Mapping[Carrier, float]] | None = None,
    ) -> None:
        """``shared``: the fleet's store (Redis), asked first under the deadline; this replica's own
        table answers when it misses, fails or is late. ``evicted_at``: the index writer's record of when
        each carrier last evicted (monotonic)."""
        self.config = config
        self.evicted_at = evicted_at
        self.metrics = metrics
        self.local = LocalStore(ttl_s=config.ttl_s, max_entries=config.max_entries, on_evict=metrics.evicted)
        self.shared = shared
        self.enabled = config.enabled
        self.strip = frozenset({config.hint_header.lower()})  # never forwarded to an engine
        self._incarnations: dict[str, str] = {}
        self._ids: dict[str, Remembered] = {}
        self._writes: set[asyncio.Task] = set()
        self._warn = SampledWarnings(log, "routing without session memory")

    # ---- the engine set ------------------------------------------------------------------------

    def set_workers(self, specs: Iterable[Any]) -> None:
        """Every known engine (a ``WorkerSpec``: engine, incarnation, dp_size)."""
        inc: dict[str, str] = {}
        ids: dict[str, Remembered] = {}
        for s in specs:
            inc[s.engine] = s.incarnation
            for rank in (None, *range(s.dp_size)):
                ids[engine_id(s.engine, s.incarnation, rank)] = Remembered(s.engine, rank, s.incarnation)
        self._incarnations, self._ids = inc, ids

    @property
    def incarnations(self) -> Mapping[str, str]:
        return self._incarnations

    def engine_id(self, target: Target) -> str:
        return engine_id(target.engine, self._incarnations.get(target.engine, ""), target.rank)

    # ---- per request ---------------------------------------------------------------------------

    async def begin(self, headers: Mapping[str, str], body: Any, tenant: str = "") -> SessionCtx:
        cfg = self.config
        ctx = SessionCtx(session_digest(body, headers, cfg.key_header or None, cfg.user_ids, tenant))
        hint = headers.get(cfg.hint_header)
        if hint is not None:
            if not cfg.trust_hints:
                self.metrics.hint("ignored")
            else:
                memory = self._ids.get(hint.strip())
                if memory is None:
                    self.metrics.hint("unknown")
                    ctx.hint_unknown = True
                else:
                    self.metrics.hint("used")
                    ctx.memory = memory
                return ctx  # a trusted hint decides; the store is not asked
        if ctx.digest is not None:
            ctx.memory, ctx.since = await self._lookup(ctx.digest)
        return ctx

    async def _lookup(self, digest: bytes) -> tuple[Remembered | None, float | None]:
        """The remembered engine and when it was written (None: not known; ``since`` is known for an
        entry of the local table only). The shared store is the fleet's latest word; this replica's
        table stands in when it has nothing, fails or is late (a store outage degrades, never fails)."""
        t0 = time.perf_counter()
        value: Remembered | None = None
        since: float | None = None
        result = "miss"
        try:
            if self.shared is not None:
                task = asyncio.ensure_future(self.shared.get(digest))
                done, _ = await asyncio.wait((task,), timeout=self.config.lookup_timeout_s)
                if done:
                    value = task.result()
                    result = "hit" if value is not None else "miss"
                else:
                    # Not awaited: a store that ignores cancellation still cannot hold the request.
                    task.cancel()
                    task.add_done_callback(settle_quietly)
                    result = "timeout"
                    self._warn("session lookup timed out")
            if value is not None and not isinstance(value, Remembered):
                value, result = None, "error"
        except Exception as exc:  # never fails the request
            value, result = None, "error"
            self._warn(f"session lookup failed ({type(exc).__name__})")
        if value is None:  # the local table: synchronous and O(1)
            value = self.local.get_nowait(digest)
            if value is not None:
                since = self.local.written_at(digest)
                result = "hit" if result == "miss" else result
        self.metrics.lookup(result, time.perf_counter() - t0)
        return value, since

    def classify(self, ctx: SessionCtx, candidates: tuple[Target, ...]) -> Classified:
        """Once per request: the first call decides, later calls (a retry) return the same state."""
        if ctx.classified is None:
            if ctx.hint_unknown:
                ctx.classified = Classified(SessionState.STALE)
            else:
                evicted = self.evicted_at() if self.evicted_at is not None else None
                ctx.classified = classify(
                    ctx.memory, candidates, self._incarnations, since=ctx.since, evicted_at=evicted
                )
        return ctx.classified

    def selected(self, ctx: SessionCtx, chosen: Target, policy: str) -> None:
        c = ctx.classified
        assert c is not None
        sel = selection(c, chosen)
        self.metrics.selection(c.state, sel)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "session selection: state=%s selection=%s promoted=%s vouched=%s engine=%s rank=%s policy=%s",
                c.state.value,
                sel.value,
                c.preferred is not None,
                c.vouched,
                chosen.engine,
                chosen.rank,
                policy,
            )

    def remember(self, ctx: SessionCtx, target: Target) -> None:
        """The upstream answered 2xx (headers only so far): remember its engine for the session."""
        if ctx.digest is None:
            return
        value = Remembered(target.engine, target.rank, self._incarnations.get(target.engine, ""))
        if not value.fits():
            self.metrics.write("too_large")
            return
        self.local.put_nowait(ctx.digest, value)
        self._gauge()
        if self.shared is None:
            self.metrics.write("written")
            return
        task = asyncio.ensure_future(self._put(ctx.digest, value))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _put(self, digest: bytes, value: Remembered) -> None:
        try:
            await asyncio.wait_for(self.shared.put(digest, value), self.config.write_timeout_s)
        except TimeoutError:
            self.metrics.write("timeout")
            self._warn("session write timed out")
        except Exception as exc:
            self.metrics.write("error")
            self._warn(f"session write failed ({type(exc).__name__})")
        else:
            self.metrics.write("written")

    # ---- the peer snapshot ---------------------------------------------------------------------

    def export(self) -> list[Entry]:
        """The local table for a booting sibling (empty when off)."""
        return self.local.entries() if self.enabled else []

    def inherit(self, entries: Iterable[Entry]) -> int:
        """A sibling's vetted entries, after a graft. Returns how many were taken."""
        if not self.enabled:
            return 0
        n = self.local.inherit(entries)
        self.metrics.inherited.inc(n)
        self._gauge()
        log.info("sessions: inherited %d entries from a sibling", n)
        return n

    # ---- helpers -------------------------------------------------------------------------------

    def _gauge(self) -> None:
        self.metrics.entries.set(len(self.local))


class RememberSession:
    """The request hook: every answer names its engine (``engine_header``, the id a client hints with);
    a 2xx answer's headers make the session remember that engine, before any body byte is relayed."""

    name = "session"

    def __init__(self, sessions: SessionAffinity) -> None:
        self.sessions = sessions

    def pre_request(self, exchange: Exchange) -> ResponseWatch | None:
        return _Remember(self.sessions, exchange) if self.sessions.enabled else None


class _Remember(ResponseWatch):
    def __init__(self, sessions: SessionAffinity, exchange: Exchange) -> None:
        self.sessions, self.exchange = sessions, exchange

    def response_received(self, status: int, headers) -> None:
        sessions, target, ctx = self.sessions, self.exchange.target, self.exchange.session
        headers[sessions.config.engine_header] = sessions.engine_id(target)
        if 200 <= status < 300 and ctx is not None:
            sessions.remember(ctx, target)
