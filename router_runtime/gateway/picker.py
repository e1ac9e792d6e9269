"""The endpoint picker: one ext_proc stream per HTTP request Envoy processes (transport.py serves them).

    request_headers   the path says which API (proxy/endpoints.py); a request without a body (a
                      stored response's GET, DELETE) is picked at once, else Envoy sends the body
    request_body      the whole body (BUFFERED, or FULL_DUPLEX_STREAMED chunks gathered; capped) parsed
                      as the proxy parses it; the scheduler prepares and decides; the answer names the
                      engine (protocol.py): in duplex mode the deferred headers answer, then the body
    response_headers  the request hooks see the status and headers (the breakers, session memory)
    response_body     each chunk through the hooks (STREAMED, or FULL_DUPLEX_STREAMED: passed on as
                      the picker's own answer)

The chosen target counts in the fleet's load from the pick until the stream ends (Envoy ends it with
the request). In a disaggregated fleet the pick may also name a remote prefill (``x-prefiller-host-port``)
for the sidecar beside the decode engine, decided as the proxy decides it (docs/disaggregation.md). The
stream's request and body are never logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING
from urllib.parse import unquote

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from multidict import CIMultiDict

from ..disaggregation.prefill import PrefillFailed, RemotePrefill, Unservable, streams
from ..disaggregation.queues import Queued
from ..fleet.inflight import LoadTracker
from ..proxy.audit import USAGE_OPTION_KINDS, request_usage
from ..proxy.bodies import Bodies, Share
from ..proxy.config import ProxyConfig
from ..proxy.endpoints import FORWARDED, RESPONSE_ITEM, ROUTED
from ..proxy.errors import ProxyError, bad_request, method_not_allowed, no_engine, not_found, too_large
from ..proxy.headers import ENGINE_HEADER
from ..proxy.health import HealthBoard
from ..proxy.responses import unstored, without_chosen_id
from ..proxy.salting import salted
from ..proxy.scheduler import Inbound, Scheduled, Scheduler, unschedulable
from ..proxy.targets import TargetBook
from ..scheduling.filters import within
from ..scheduling.framework import Unschedulable
from ..scheduling.hooks import Exchange, RequestHook, ResponseWatch, chunk_watchers, watching
from ..scheduling.pickers import fallbacks
from ..scheduling.presets import make_policy
from ..scheduling.types import Decision, Kind, Reason, RouteRequest, Target
from ..sessions.keys import tenant_of
from ..tracing.attributes import upstream as upstream_attributes
from ..tracing.spans import NO_SPAN, NO_TRACE, OFF, Span, SpanKind, Trace, Tracer, server_error
from .protocol import (
    PREFILLER,
    ROUTER_ONLY,
    TEST_SELECTION,
    TEST_SERVED,
    duplex_of,
    header_pairs,
    headers_of,
    named_endpoints,
    picked,
    proceed,
    refused,
    rewritten,
    served_by,
    served_metadata,
    status_of,
    streamed,
    subset_of,
    with_headers,
)

if TYPE_CHECKING:
    from .transport import Answers

log = logging.getLogger(__name__)

_RESPONSE_ITEM = "/v1/responses/"


class _Stream:
    """One HTTP request's state across its ext_proc messages (transport.py's ``Stream``)."""

    __slots__ = (
        "body",
        "chunks",
        "closed",
        "duplex_in",
        "duplex_out",
        "ended",
        "exchange",
        "finished",
        "headers",
        "held",
        "held_size",
        "outcome",
        "picker",
        "prefilled",
        "prefiller",
        "queued",
        "share",
        "size",
        "status",
        "subset",
        "target",
        "trace",
        "upstream",
        "watches",
    )

    def __init__(self, picker: EndpointPicker, share: Share) -> None:
        self.picker = picker
        self.finished = False  # answered for good (an immediate response)
        self.closed = False
        # Whether the request's and the response's bodies come FULL_DUPLEX_STREAMED (Envoy says so
        # with the stream's first message).
        self.duplex_in = self.duplex_out = False
        # FULL_DUPLEX_STREAMED: a response that is not an event stream goes on once whole, as the
        # reference picker answers it: Envoy (1.40) can leave such a response unended when its body was
        # answered before its end arrived. None: chunks go on as they come.
        self.held: list[bytes] | None = None
        self.held_size = 0
        # Case-insensitive, as the proxy's: the tenant, session and hint headers are named in any case.
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.subset: frozenset[str] | None = None  # the gateway's subset hint (None: any endpoint)
        self.body: list[bytes] = []
        self.size = 0
        self.share = share  # of the router's body budget, until the request is picked
        self.target: Target | None = None  # counted in the load until the stream ends
        self.ended: Callable[[], None] | None = None  # tells the scheduler the picked request is over
        # A remote prefill the picker named (a disaggregated fleet): the prefill engine's ip:port, and
        # what ends its count once the decode engine answers (its sidecar ran the prefill leg first);
        # and the prompt's place in the queue of the engine that prefills it, until the first byte.
        self.prefiller: str | None = None
        self.prefilled: Callable[[], None] | None = None
        self.queued: Queued | None = None
        self.watches: Sequence[ResponseWatch] = ()
        self.chunks: Sequence[ResponseWatch] = ()  # the watches that look at body chunks
        self.exchange: Exchange | None = None
        self.trace: Trace = NO_TRACE  # started with the request's headers
        self.upstream: Span = NO_SPAN  # from the pick to the response's end (traced requests)
        self.status = 0  # the engine's status, once its response headers pass (or the picker's refusal)
        self.outcome = "cancelled"  # as the proxy's metrics name how a request ended

    def step(self, message: ep.ProcessingRequest) -> Answers | Awaitable[Answers]:
        return self.picker._message(self, message)

    def close(self) -> None:
        self.picker._closed(self)


class EndpointPicker:
    def __init__(
        self,
        scheduler: Scheduler,
        config: ProxyConfig,
        *,
        targets: TargetBook,
        load: LoadTracker,
        hooks: Sequence[RequestHook] = (),
        health: HealthBoard | None = None,
        fallbacks: int = 0,
        bodies: Bodies | None = None,
        tracer: Tracer = OFF,
        conformance_test: bool = False,
        arrived: Callable[[], None] = lambda: None,
        prefill: RemotePrefill | None = None,
        strip_headers: frozenset[str] = frozenset(),
    ) -> None:
        self.scheduler = scheduler
        # The router's own request headers (the debug header, a session hint): taken out of each
        # request it picks for, as the proxy never forwards them.
        self.strip = (*ROUTER_ONLY, *sorted(strip_headers - set(ROUTER_ONLY)))
        self.prefill = prefill  # a disaggregated fleet's remote prefill step (the proxy's)
        self.arrived = arrived  # each stream, as it opens (the router's drain counts them)
        # TEST ONLY (--epp-conformance-test): requests name their endpoints (protocol.TEST_SELECTION).
        self.conformance_test = conformance_test
        self.tracer = tracer
        # The bodies being read and parsed: the proxy's, so both front doors hold one budget.
        self.bodies = bodies or Bodies(config.body_budget_bytes)
        self.targets = targets
        self.load = load
        self.hooks = tuple(hooks)
        # The request plane's own section: the body limit, the tenant header, the usage ask (audit.py).
        self.config = config
        self.health = health  # a pick the gateway could not reach counts against its breaker
        self.fallbacks = fallbacks  # endpoints named after the pick, for the gateway's retries
        self._by_load = make_policy("least_loaded")

    def open(self) -> _Stream:
        """A new ext_proc stream's ``Stream`` (transport.py relays its messages and closes it)."""
        self.arrived()
        return _Stream(self, self.bodies.share())

    def _message(self, stream: _Stream, message: ep.ProcessingRequest) -> Answers | Awaitable[Answers]:
        if message.HasField("protocol_config"):  # with the stream's first message
            stream.duplex_in, stream.duplex_out = duplex_of(message)
        try:
            answers = self._step(stream, message.WhichOneof("request"), message)
        except ProxyError as e:
            return _refused(stream, e)
        if isinstance(answers, list):
            return _answered(stream, answers)
        return self._answers_when_done(stream, answers)

    @staticmethod
    async def _answers_when_done(stream: _Stream, pending: Awaitable[list[ep.ProcessingResponse]]) -> Answers:
        try:
            answers = await pending
        except ProxyError as e:
            return _refused(stream, e)
        return _answered(stream, answers)

    def _closed(self, stream: _Stream) -> None:
        """The stream is over, however it ended: what it held goes back (once)."""
        if stream.closed:
            return
        stream.closed = True
        stream.share.release()
        _prefill_over(stream)
        _prefilled(stream)
        if stream.target is not None:
            self.load.release(stream.target)
        if stream.ended is not None:
            stream.ended()
        if stream.trace.recording:
            _end_trace(stream)

    def _step(
        self, stream: _Stream, phase: str, message: ep.ProcessingRequest
    ) -> list[ep.ProcessingResponse] | Awaitable[list[ep.ProcessingResponse]]:
        """The answers to one message, in order (awaitable where the step waits: a pick, the body
        budget, a hook): one each, except in FULL_DUPLEX_STREAMED mode, where the request's headers are
        answered once its body is whole, then its body goes on as answers."""
        if phase == "request_headers":
            # a repeated header's first value, as the proxy reads it (the tenant is the same at both doors)
            stream.headers = CIMultiDict(header_pairs(message.request_headers))
            stream.subset = subset_of(message.metadata_context)
            headers = stream.headers
            stream.trace = self.tracer.start(
                headers, lambda: f"{headers.get(':method', '?')} {_route(headers)}"
            )
            if message.request_headers.end_of_stream:
                return self._picked_without_body(stream, phase)
            return [] if stream.duplex_in else [proceed(phase)]
        if phase == "request_body":
            part = message.request_body
            stream.size += len(part.body)
            if stream.size > self.config.max_body_bytes:
                raise too_large(self.config.max_body_bytes)
            if not stream.share.grow_now(stream.size):
                return self._body_once_budgeted(stream, phase, part)
            return self._body(stream, phase, part)
        if phase == "request_trailers":
            if stream.duplex_in and stream.target is None:  # the trailers end a body not yet answered
                return self._request_ended(stream, phase, trailers=True)
            return [proceed(phase)]
        if phase == "response_headers":
            return [self._response_headers(stream, message)]
        if phase == "response_body":
            _prefilled(stream)
            part = message.response_body
            if (
                stream.upstream.recording
                and "routerfleet.time_to_first_chunk_ms" not in stream.upstream.attributes
            ):
                stream.upstream.set("routerfleet.time_to_first_chunk_ms", _ms_since(stream.upstream))
            return self._chunk(stream, part, part.body, 0)
        if phase == "response_trailers":  # the trailers end the body: what is held and what the hooks add
            extra = self._response_ended(stream)  # go before them
            if stream.held is not None:
                extra, stream.held = b"".join(stream.held) + extra, None
            body = streamed("response_body", extra, end=False) if stream.duplex_out and extra else []
            return [*body, proceed(phase)]
        return [proceed(phase)]

    async def _picked_without_body(self, stream: _Stream, phase: str) -> list[ep.ProcessingResponse]:
        decision, x, _ = await self._pick(stream, None)
        return [self._decided(stream, decision, x, None, phase)]

    def _body(
        self, stream: _Stream, phase: str, part: ep.HttpBody
    ) -> list[ep.ProcessingResponse] | Awaitable[list[ep.ProcessingResponse]]:
        """A request body's part, its bytes held in the budget: gathered, and the pick once it is whole."""
        stream.body.append(part.body)
        if not part.end_of_stream:
            return [] if stream.duplex_in else [proceed(phase)]
        return self._request_ended(stream, phase, trailers=False)

    async def _body_once_budgeted(
        self, stream: _Stream, phase: str, part: ep.HttpBody
    ) -> list[ep.ProcessingResponse]:
        await stream.share.grow_to(stream.size)  # others give theirs back first (or a 503)
        return await _settled(self._body(stream, phase, part))

    def _chunk(
        self, stream: _Stream, part: ep.HttpBody, chunk: bytes, start: int
    ) -> list[ep.ProcessingResponse] | Awaitable[list[ep.ProcessingResponse]]:
        """A response chunk through the hooks that watch chunks, from the ``start``-th on (the ones
        before it have seen it: the chunk went on once the one before awaited), then answered."""
        watchers = stream.chunks
        for i in range(start, len(watchers)):
            out = watchers[i].response_streaming(chunk)
            if not isinstance(out, bytes):
                return self._chunk_awaited(stream, part, out, i + 1)
            chunk = out
        if part.end_of_stream:
            chunk += self._response_ended(stream)
        if stream.duplex_out:
            return self._passed_on(stream, chunk, part.end_of_stream)
        return [proceed("response_body") if chunk == part.body else rewritten("response_body", chunk)]

    async def _chunk_awaited(
        self, stream: _Stream, part: ep.HttpBody, pending: Awaitable[bytes], start: int
    ) -> list[ep.ProcessingResponse]:
        return await _settled(self._chunk(stream, part, await pending, start))

    async def _request_ended(
        self, stream: _Stream, phase: str, *, trailers: bool
    ) -> list[ep.ProcessingResponse]:
        """The request's body is whole: pick, and answer (duplex: the deferred headers answer, then the
        body as sent or rewritten, then the trailers' answer when they ended it)."""
        raw = b"".join(stream.body)
        try:
            decision, x, sent = await self._pick(stream, raw)
        finally:
            stream.share.release()  # parsed: what the request still holds is its bytes alone
        if not stream.duplex_in:
            return [self._decided(stream, decision, x, sent, phase)]
        answers = [self._decided(stream, decision, x, None, "request_headers")]
        answers += streamed("request_body", raw if sent is None else sent, end=not trailers)
        if trailers:
            answers.append(proceed("request_trailers"))
        return answers

    def _passed_on(self, stream: _Stream, chunk: bytes, end: bool) -> list[ep.ProcessingResponse]:
        """A FULL_DUPLEX_STREAMED response chunk as the picker's answers (or held until the response is
        whole: ``_Stream.held``, up to the body cap, past which what is held goes on)."""
        if stream.held is not None:
            stream.held.append(chunk)
            stream.held_size += len(chunk)
            if not end and stream.held_size <= self.config.max_body_bytes:
                return []
            chunk, stream.held = b"".join(stream.held), None
        return streamed("response_body", chunk, end=end)

    def _response_headers(self, stream: _Stream, request: ep.ProcessingRequest) -> ep.ProcessingResponse:
        message = request.response_headers
        headers = headers_of(message)
        stream.status = status_of(headers)
        _prefill_over(stream)
        if stream.upstream.recording:
            stream.upstream.set("http.response.status_code", stream.status)
            stream.upstream.set("routerfleet.time_to_headers_ms", _ms_since(stream.upstream))
        if stream.duplex_out and "text/event-stream" not in headers.get("content-type", ""):
            stream.held = []
        served = served_by(request.attributes, request.metadata_context)
        if stream.target is not None and served is not None and served != stream.target.endpoint:
            self._failed_over(stream, served)
        seen = CIMultiDict(headers)  # the hooks read and write names in any case, as HTTP has them
        if stream.target is not None and self.config.engine_header:  # as the proxy's answers say
            seen[ENGINE_HEADER] = stream.target.engine
        status = status_of(headers)
        for w in stream.watches:
            w.response_received(status, seen)
        if message.end_of_stream:  # no body follows
            self._response_ended(stream)
        added = {k: v for k, v in seen.items() if headers.get(k.lower()) != v}
        if self.conformance_test:  # the metadata alone, as the reference picker answers: a gateway's test
            stated = served_metadata(request.metadata_context)
            added[TEST_SERVED] = stated or "fail: missing destination endpoint served metadata"
        return with_headers(proceed("response_headers"), added)

    @staticmethod
    def _response_ended(stream: _Stream) -> bytes:
        """The response is over: what the hooks add at its end (the usage chunk they took out comes
        back as nothing), then each hook's completion; once per stream."""
        stream.upstream.end()
        stream.outcome = "ok" if stream.status < 400 else "upstream_status"
        watches, stream.watches, stream.chunks = stream.watches, (), ()
        extra = b"".join(w.response_ended() for w in watches)
        for w in watches:
            w.response_complete()
        return extra

    async def _pick(self, stream: _Stream, raw: bytes | None) -> tuple[Decision, Exchange, bytes | None]:
        """The decision, the exchange the hooks watch, and the body to send instead (None: as sent)."""
        headers = stream.headers
        candidates = self.targets.candidates()
        if not candidates:
            raise no_engine("no engine can take the request (none discovered, or all unhealthy)")
        if self.conformance_test:
            named = named_endpoints(headers.get(TEST_SELECTION), [t.endpoint for t in candidates])
            if named is not None:
                stream.subset = named if stream.subset is None else named & stream.subset
        path = headers.get(":path", "/").split("?", 1)[0]
        tenant = tenant_of(headers, self.config.tenant_header)
        start = asyncio.get_running_loop().time()
        kind = ROUTED.get(path)
        if kind is not None and raw is not None:
            if not raw:
                raise bad_request("the request has no body")
            with stream.trace.span("parse") as span:
                body = await self.bodies.parse(stream.share, raw)
                span.set("routerfleet.request.bytes", len(raw))
            sent = raw
            if self.config.tenant_cache_salt:
                raw, body = salted(raw, body, tenant)
            raw, body = without_chosen_id(raw, body, kind)
            prefill = self.prefill if self.targets.disaggregated else None  # the remote prefill step
            if prefill is not None and isinstance(body, dict):
                raw, body = prefill.without_clients_fields(raw, body)
            scheduled = await self.scheduler.prepare(
                Inbound(kind, headers, body, len(raw), tenant, stream.subset, stream.trace), candidates
            )
            asked = None
            if self.config.audit_stream_usage and kind in USAGE_OPTION_KINDS and scheduled.predicts:
                asked = request_usage(raw, body)
            decision = scheduled.decide(candidates, 0)
            stream.ended = partial(scheduled.ended, decision)
            if prefill is not None:
                streamed = isinstance(body, dict) and streams(body)
                self._plan_prefill(stream, prefill, kind, scheduled, decision, streamed)
            prediction = scheduled.prediction(decision)
            x = Exchange(
                decision.target,
                start,
                headers,
                tenant,
                kind,
                scheduled.session,
                prediction,
                asked is not None,
                stream.trace if stream.trace.recording else None,
                unstored(body, kind),
            )
            return decision, x, asked if asked is not None else (raw if raw is not sent else None)
        # Not prompt-bearing: a stored response's own paths go to its engine, the rest by load.
        if path.startswith(_RESPONSE_ITEM) and self.scheduler.responses is not None:
            item, slash, rest = path[len(_RESPONSE_ITEM) :].partition("/")
            _served_on_response_item(headers.get(":method", "?"), path, item, slash + rest)
            response_id = unquote(item)  # as the proxy reads it
            responses = self.scheduler.responses
            with stream.trace.span("response_lookup") as span:
                pinned = await responses.target(response_id, candidates, headers, "response_id", tenant)
                span.set("routerfleet.engine", pinned.engine)
            route, profile = RouteRequest(pinned=pinned, subset=stream.subset), self.scheduler.profile
        elif path in FORWARDED or kind is not None or path in self.config.allow_paths:
            route, profile = RouteRequest(subset=stream.subset), self._by_load
        else:  # as the proxy answers a path it does not serve (administrative ones among them)
            raise not_found(headers.get(":method", "?"), path[:256])
        with stream.trace.span("schedule") as span:
            try:
                decision = profile.choose(route, candidates, self.scheduler.loads, None)
            except Unschedulable as e:
                raise unschedulable(e) from None
            span.update(
                {"routerfleet.engine": decision.target.engine, "routerfleet.reason": decision.reason.value}
            )
        return decision, Exchange(decision.target, start, headers, tenant, None), None

    @staticmethod
    def _plan_prefill(
        stream: _Stream,
        prefill: RemotePrefill,
        kind: Kind,
        scheduled: Scheduled,
        decision: Decision,
        streamed: bool,
    ) -> None:
        """A disaggregated fleet: whether the decode engine's sidecar prefills remotely, and where (the
        proxy's own decision: disaggregation/prefill.py); the decode engine's prediction expects what the
        transfer hands it. ``streamed``: the answer streams (its first byte says the prompt is
        prefilled)."""
        with stream.trace.span("prefill_plan") as span:
            try:
                planned = prefill.named(kind, scheduled.route, scheduled.index, decision, streamed)
            except PrefillFailed as e:  # as the proxy answers: nowhere to prefill, and the engine cannot
                raise no_engine(f"no engine can take the request: {e}") from None
            except Unservable as e:
                raise bad_request(str(e)) from None
            span.set("routerfleet.pd.verdict", planned.verdict.value)
            if planned.chosen is not None:
                span.set("routerfleet.engine", planned.chosen.target.engine)
        stream.queued = planned.queued
        if planned.chosen is None:
            return
        stream.prefiller = planned.chosen.target.endpoint
        stream.prefilled = partial(prefill.ended, planned, scheduled.route)
        scheduled.transferred(decision, planned.moved)

    def _decided(
        self, stream: _Stream, decision: Decision, x: Exchange, body: bytes | None, phase: str
    ) -> ep.ProcessingResponse:
        stream.target = decision.target
        self.load.acquire(decision.target)
        self._watch(stream, x)
        # The engine's part, as the picker sees it pass: from the pick to the response's end.
        stream.upstream = stream.trace.span("upstream", SpanKind.CLIENT)
        if stream.upstream.recording:
            stream.upstream.update(upstream_attributes(decision.target))
        # Another engine where the gateway may retry; not for a rank pinned on a data-parallel engine
        # (the rank header names one engine's rank), nor with a remote prefill (paired with the pick's
        # revision: a fallback's may differ), nor for a stored response (only its engine holds it),
        # and only one that can serve the request alone.
        others: Sequence[Target] = ()
        alone = (
            decision.target.rank is None
            and stream.prefiller is None
            and decision.reason is not Reason.RESPONSE
        )
        if self.fallbacks and alone:
            allowed = within(self.targets.candidates(), stream.subset)
            if self.prefill is not None:
                allowed = [t for t in allowed if self.prefill.serves_alone(t)]
            others = fallbacks(decision.target, allowed, self.scheduler.loads, self.fallbacks)
        headers = stream.trace.headers(stream.upstream)
        if stream.prefiller is not None:
            headers = {**headers, PREFILLER: stream.prefiller}
        return picked(
            decision.target, phase=phase, body=body, fallbacks=others, headers=headers, drop=self.strip
        )

    def _watch(self, stream: _Stream, x: Exchange) -> None:
        stream.exchange = x
        stream.watches = watching(self.hooks, x)
        stream.chunks = chunk_watchers(stream.watches)

    def _failed_over(self, stream: _Stream, served: str) -> None:
        """The gateway's retry went to a fallback: the pick could not be reached (its breaker counts it,
        as the proxy's connect failure does), and what the hooks count is the engine that served, with
        no prediction (none was made for it)."""
        picked_, x = stream.target, stream.exchange
        assert picked_ is not None and x is not None
        target = next((t for t in self.targets.candidates() if t.endpoint == served), None)
        if self.health is not None:
            self.health.failure(picked_.engine)
        if stream.ended is not None:  # the pick never got the request: what it predicted there ends
            stream.ended()
            stream.ended = None
        stream.upstream.event("failed_over", {"routerfleet.engine": target.engine if target else served})
        if target is None:  # not one of ours any more: nothing to count against it
            return
        if stream.upstream.recording:  # the span is the engine's part: the one that served
            stream.upstream.update(upstream_attributes(target))
            stream.upstream.set("routerfleet.failed_over_from", picked_.engine)
        self.load.release(picked_)
        self.load.acquire(target)
        stream.target = target
        self._watch(stream, replace(x, target=target, prediction=None, usage_asked=False))


def _refused(stream: _Stream, error: ProxyError) -> Answers:
    """The picker answers the client itself (an immediate response): the stream is over."""
    stream.status, stream.outcome = error.status, error.outcome
    stream.finished = True
    return [refused(error)]


def _answered(stream: _Stream, answers: list[ep.ProcessingResponse]) -> Answers:
    if answers and answers[-1].HasField("immediate_response"):
        stream.finished = True
    return answers


async def _settled(
    answers: list[ep.ProcessingResponse] | Awaitable[list[ep.ProcessingResponse]],
) -> list[ep.ProcessingResponse]:
    return answers if isinstance(answers, list) else await answers


def _served_on_response_item(method: str, path: str, item: str, rest: str) -> None:
    """Refuse, as the proxy's routes do, a method or a path under a stored response's id that neither
    engine nor router serves (``rest``: after the id), rather than relay the engine's own answer."""
    methods = RESPONSE_ITEM.get(rest) if item else None
    if methods is None:
        raise not_found(method, path[:256])
    allowed = {*methods, "HEAD"} if "GET" in methods else set(methods)
    if method not in allowed:
        raise method_not_allowed(method, path, allowed)


def _prefilled(stream: _Stream) -> None:
    """The answer's first byte: the prompt is prefilled, out of its engine's queue (once)."""
    queued, stream.queued = stream.queued, None
    if queued is not None:
        queued.done()


def _prefill_over(stream: _Stream) -> None:
    """The remote prefill the picker named is over (once): the decode engine answered, or the stream
    ended without an answer."""
    over, stream.prefilled = stream.prefilled, None
    if over is not None:
        over()


def _route(headers: Mapping[str, str]) -> str:
    """The path as a span names it: a stored response's id replaced by its template."""
    path = headers.get(":path", "/").split("?", 1)[0]
    if path.startswith(_RESPONSE_ITEM):
        return "/v1/responses/{response_id}"
    return path if path in ROUTED or path in FORWARDED else "unmatched"


def _ms_since(span: Span) -> float:
    return round((time.time_ns() - span.start_ns) / 1e6, 3)


def _end_trace(stream: _Stream) -> None:
    """The stream is over: the request's root span says how it went; the trace goes to the exporter."""
    root = stream.trace.root
    root.update(
        {
            "http.request.method": stream.headers.get(":method", "?"),
            "url.path": _route(stream.headers),
            "http.response.status_code": stream.status or None,
            "routerfleet.outcome": stream.outcome,
            "routerfleet.engine": stream.target.engine if stream.target is not None else None,
        }
    )
    if server_error(stream.status, stream.outcome):
        root.fail(stream.outcome)
    if stream.upstream.recording and not stream.status:  # no response passed: Envoy gave up on it
        stream.upstream.fail("no_response")
    stream.trace.end()
