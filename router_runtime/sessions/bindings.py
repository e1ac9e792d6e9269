"""Response bindings: which engine holds a stored response of the Responses API (docs/sessions.md).

A hard requirement, not a preference: a stored response exists only on the engine that made it, so a
request naming it (``previous_response_id``; GET, DELETE or cancel of ``/v1/responses/{id}``) must go
there, whichever replica receives it. Elsewhere it fails, or silently runs without its context.

The engine's answer names the id (``ResponseIdScan`` finds it at the head of the body or stream); the
router binds it to the engine, DP rank and incarnation that answered, in its local table and, when one
is configured, in the fleet's shared store. A lookup asks the local table, then the shared store under a
hard deadline, then (the proxy's probe) the engines themselves. ``resolve`` turns what was found into a
verdict against the engines now routable: an engine that restarted lost its responses (vLLM keeps them
in memory), so a binding to an older incarnation is ``gone``, never routed.

Only digests of ids are kept; ids, prompts and answers are never logged.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..scheduling.hooks import Exchange, ResponseWatch
from ..scheduling.types import Kind, Target
from ..tasks import end_tasks
from .keys import response_digest
from .store import Entry, LocalStore, Remembered, SampledWarnings, SessionStore, settle_quietly

log = logging.getLogger(__name__)

SCAN_HEAD_BYTES = 64 << 10  # the id is the response object's first field, in the first event of a stream
# vLLM and OpenAI spell them resp_<hex or base62>; an output item's id (msg_, rs_, fc_) never matches.
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[A-Za-z0-9_-]{1,200})"')


@dataclass(frozen=True, slots=True)
class BindingConfig:
    ttl_s: float = 86_400.0  # a binding lives this long after it was written
    max_entries: int = 200_000  # local table bound (least recently used beyond it)
    lookup_timeout_s: float = 0.02  # hard deadline of one shared-store lookup
    write_timeout_s: float = 0.05  # how long a response waits for its binding to reach the shared store
    probe_timeout_s: float = 1.0  # hard deadline of asking the engines (0: never ask them)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (math.isfinite(v) and (v > 0 or (f.name == "probe_timeout_s" and v == 0))):
                raise ValueError(f"response binding {f.name}={v!r}: must be a positive number")


# Bindings kept for a late write while the shared store is down (the oldest go first beyond it), and the
# longest pause between tries.
MAX_UNWRITTEN = 10_000
LATE_WRITE_MAX_PAUSE_S = 30.0


class Source(enum.StrEnum):
    """Where a binding was found (``routerfleet_response_lookups_total``)."""

    LOCAL = "local"
    STORE = "store"
    PROBE = "probe"
    NONE = "none"
    STORE_UNAVAILABLE = "store_unavailable"  # not here, and the shared store could not be asked


class Verdict(enum.StrEnum):
    """What a request naming a response gets."""

    FOUND = "found"  # routed to the engine holding it
    UNKNOWN = "unknown"  # no table, store or engine knows it: 404
    GONE = "gone"  # its engine restarted (its responses lost) or left the fleet: 404
    UNAVAILABLE = "unavailable"  # its engine is in the fleet but not routable now: 503


def resolve(
    bound: Remembered | None, candidates: Sequence[Target], incarnations: Mapping[str, str]
) -> tuple[Verdict, Target | None]:
    """A binding against the engines now routable (pure): its own (engine, rank) target, else any
    target of its engine (the store is the engine's, not the rank's)."""
    if bound is None:
        return Verdict.UNKNOWN, None
    if incarnations.get(bound.engine) != bound.incarnation:
        return Verdict.GONE, None
    same = [t for t in candidates if t.engine == bound.engine]
    if not same:
        return Verdict.UNAVAILABLE, None
    return Verdict.FOUND, next((t for t in same if t.rank == bound.rank), same[0])


class ResponseIdScan:
    """Finds the response id at the head of an answer relayed chunk by chunk (``found``: once)."""

    __slots__ = ("_head", "done", "found")

    def __init__(self) -> None:
        self._head = b""
        self.found: str | None = None
        self.done = False

    def feed(self, chunk: bytes) -> str | None:
        """The id, the first time the head shows it; None before, after, and when it never does."""
        if self.done:
            return None
        head = self._head + chunk
        m = _RESPONSE_ID.search(head)
        if m is not None:
            self.done = True
            self.found = m.group(1).decode()
            self._head = b""
            return self.found
        if len(head) > SCAN_HEAD_BYTES:
            self.done = True
            self._head = b""
        else:
            self._head = head
        return None


class BindingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "routerfleet_response_"
        self.lookups = Counter(
            p + "lookups",
            "Requests naming a stored response, by where its binding was found (none: nowhere)",
            ["source"],
            registry=registry,
        )
        self.verdicts = Counter(
            p + "verdicts",
            "Requests naming a stored response, by verdict (found: routed to its engine; unknown, gone:"
            " 404; unavailable: 503)",
            ["verdict"],
            registry=registry,
        )
        self.binds = Counter(
            p + "binds",
            "Response ids bound to their engine, by the shared store's result (local: no shared store)",
            ["result"],
            registry=registry,
        )
        self.entries = Gauge(p + "bindings", "Entries in the local response-binding table", registry=registry)
        self.inherited = Counter(
            p + "bindings_inherited",
            "Response bindings inherited from a sibling's snapshot",
            registry=registry,
        )
        self._lookups = {s: self.lookups.labels(s.value) for s in Source}
        self._verdicts = {v: self.verdicts.labels(v.value) for v in Verdict}
        results = ("local", "stored", "timeout", "error", "stored_late")  # stored_late: after an outage
        self._binds = {r: self.binds.labels(r) for r in results}

    def lookup(self, source: Source) -> None:
        self._lookups[source].inc()

    def verdict(self, verdict: Verdict) -> None:
        self._verdicts[verdict].inc()

    def bind(self, result: str) -> None:
        self._binds[result].inc()


class ResponseBindings:
    """The local table (always) and the fleet's shared store (optional) of response bindings."""

    def __init__(
        self,
        config: BindingConfig,
        metrics: BindingMetrics,
        incarnations: Callable[[], Mapping[str, str]],
        shared: SessionStore | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.incarnations = incarnations
        self.local = LocalStore(ttl_s=config.ttl_s, max_entries=config.max_entries)
        self.shared = shared
        self._warn = SampledWarnings(log, "using this replica's table only")
        # Bindings the shared store did not take, oldest first, and the task writing them later.
        self._unwritten: dict[bytes, tuple[float, Remembered]] = {}
        self._writing: asyncio.Task | None = None

    async def find(self, response_id: str, tenant: str = "") -> tuple[Remembered | None, Source]:
        """The binding of ``response_id`` (``tenant``'s) in the local table, else the shared store (a
        timeout or an error there is STORE_UNAVAILABLE, warned about: not known, and not known to be
        absent)."""
        digest = response_digest(response_id, tenant)
        value = self.local.get_nowait(digest)
        if value is not None:
            return value, Source.LOCAL
        if self.shared is not None:
            task = asyncio.ensure_future(self.shared.get(digest))
            done, _ = await asyncio.wait((task,), timeout=self.config.lookup_timeout_s)
            if not done:
                task.cancel()
                task.add_done_callback(settle_quietly)
                self._warn("the shared store did not answer a response lookup in time")
                return None, Source.STORE_UNAVAILABLE
            if task.exception() is not None:
                self._warn(
                    f"a response lookup in the shared store failed ({type(task.exception()).__name__})"
                )
                return None, Source.STORE_UNAVAILABLE
            if isinstance(value := task.result(), Remembered):
                self.local.put_nowait(digest, value)
                self._gauge()
                return value, Source.STORE
        return None, Source.NONE

    async def bind(self, response_id: str, target: Target, tenant: str = "") -> Remembered | None:
        """Bind ``response_id`` to ``target``: locally at once, then in the shared store (awaited up to
        the write deadline, so a follow-up sent as soon as the answer ends finds it on any replica).
        Returns the binding (None: an engine name too long to keep)."""
        value = Remembered(target.engine, target.rank, self.incarnations().get(target.engine, ""))
        if not value.fits():
            return None
        digest = response_digest(response_id, tenant)
        self.local.put_nowait(digest, value)
        self._gauge()
        if self.shared is None:
            self.metrics.bind("local")
            return value
        try:
            await asyncio.wait_for(self.shared.put(digest, value), self.config.write_timeout_s)
        except TimeoutError:
            self.metrics.bind("timeout")
            self._warn("a response binding did not reach the shared store in time")
            self._defer(digest, value)
        except Exception as exc:
            self.metrics.bind("error")
            self._warn(f"a response binding write to the shared store failed ({type(exc).__name__})")
            self._defer(digest, value)
        else:
            self.metrics.bind("stored")
        return value

    def _defer(self, digest: bytes, value: Remembered) -> None:
        """A binding the shared store did not take: written later, once it answers again (until then the
        other replicas answer 503 for it, never a 404 for a response that exists)."""
        unwritten = self._unwritten
        unwritten[digest] = (asyncio.get_running_loop().time(), value)
        while len(unwritten) > MAX_UNWRITTEN:
            del unwritten[next(iter(unwritten))]
        if self._writing is None or self._writing.done():
            self._writing = asyncio.create_task(self._write_later(), name="response-bindings-late")

    async def _write_later(self) -> None:
        assert self.shared is not None
        pause = 1.0
        loop = asyncio.get_running_loop()
        while self._unwritten:
            await asyncio.sleep(pause)
            for digest, (at, value) in list(self._unwritten.items()):
                if loop.time() - at > self.config.ttl_s:  # expired in the store by now anyway
                    self._unwritten.pop(digest, None)
                    continue
                try:
                    await asyncio.wait_for(self.shared.put(digest, value), self.config.write_timeout_s)
                except Exception:  # still down (or in its backoff): wait longer
                    pause = min(pause * 2, LATE_WRITE_MAX_PAUSE_S)
                    break
                self._unwritten.pop(digest, None)
                self.metrics.bind("stored_late")
            else:
                pause = 1.0

    async def close(self) -> None:
        """Stop writing late bindings (the shared store is closing)."""
        await end_tasks([self._writing], "response bindings")
        self._writing = None

    # ---- the peer snapshot ---------------------------------------------------------------------

    def export(self) -> list[Entry]:
        return self.local.entries()

    def inherit(self, entries: Iterable[Entry]) -> int:
        n = self.local.inherit(entries)
        self.metrics.inherited.inc(n)
        self._gauge()
        log.info("response bindings: inherited %d from a sibling", n)
        return n

    def _gauge(self) -> None:
        self.metrics.entries.set(len(self.local))


class BindResponseId:
    """The request hook: a Responses API answer's id is bound to the engine that made it as the id
    passes, before the client can see it (a follow-up sent at once must find it, on any replica)."""

    name = "response_binding"

    def __init__(self, bindings: ResponseBindings) -> None:
        self.bindings = bindings

    def pre_request(self, exchange: Exchange) -> ResponseWatch | None:
        if exchange.kind is not Kind.RESPONSES or exchange.unstored:
            return None
        return _Bind(self.bindings, exchange)


class _Bind(ResponseWatch):
    def __init__(self, bindings: ResponseBindings, exchange: Exchange) -> None:
        self.bindings, self.exchange = bindings, exchange
        self.scan: ResponseIdScan | None = ResponseIdScan()

    def response_received(self, status: int, headers) -> None:
        if not 200 <= status < 300:
            self.scan = None  # an error stores nothing

    def response_streaming(self, chunk: bytes) -> bytes | Awaitable[bytes]:
        if self.scan is not None and (rid := self.scan.feed(chunk)) is not None:
            return self._bound(rid, chunk)  # the id reaches the client once its binding is stored
        return chunk

    async def _bound(self, rid: str, chunk: bytes) -> bytes:
        await self.bindings.bind(rid, self.exchange.target, self.exchange.tenant)
        return chunk
