"""The OpenAI-compatible proxy: parse, tokenize if the policy needs it, choose, forward, relay.

One request::

    read body (413 over the limit) -> parse JSON, validate (400) -> tokens/text for the policy
    -> session: digest of an explicit key, trusted hint or store lookup (hard deadline), see sessions/
    -> candidates (503 if none) -> classify the session once (returning: its engine first, preferred)
    -> policy.choose -> acquire load -> POST to the engine
       connect failure before any byte: release, breaker failure, retry ONCE without that engine
    -> relay status, headers (hop-by-hop stripped; X-RouterFleet-Engine added with --engine-header)
       and body chunk by chunk;
       a 2xx status remembers the engine for the session before the body is relayed
    -> release load (always exactly once: success, error, timeout or client gone)

The body is forwarded as the client's bytes; responses are relayed as they arrive (``readany`` then
``write``, which waits for the client to drain), never buffered whole. Once the response has started,
an upstream failure can only be reported by cutting the client's connection, so it is cut (a chunked
response then lacks its terminator and the client sees the truncation). A client that goes away
cancels the handler (``handler_cancellation``), which closes the upstream connection, so the engine
stops generating.

Never logged: prompts, token IDs, block hashes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from ..disaggregation.prefill import DecodeLeg, PrefillFailed, Prompt, RemotePrefill, Unservable
from ..discovery.served_models import read_models
from ..fleet.inflight import LoadTracker
from ..scheduling.hooks import Exchange, RequestHook, ResponseWatch, chunk_watchers, watching
from ..scheduling.presets import make_policy
from ..scheduling.types import Decision, RouteRequest, Target
from ..scheduling.types import Reason as DecisionReason
from ..sessions.affinity import SessionCtx
from ..sessions.bindings import Verdict
from ..sessions.keys import tenant_of
from ..tracing.attributes import upstream as upstream_attributes
from ..tracing.context import put_context
from ..tracing.spans import OFF, Span, SpanKind, Trace, Tracer, server_error
from .audit import USAGE_OPTION_KINDS, request_usage
from .bodies import Bodies, Share
from .config import ProxyConfig
from .errors import (
    ProxyError,
    bad_gateway,
    bad_request,
    gateway_timeout,
    no_engine,
    slow_body,
    too_large,
    unsupported_encoding,
)
from .headers import (
    DECODED_ENCODINGS,
    ENGINE_HEADER,
    RANK_HEADER,
    request_headers,
    response_headers,
)
from .health import HealthBoard
from .metrics import ProxyMetrics
from .request import Kind
from .responses import response_error, unstored, without_chosen_id
from .salting import salted
from .scheduler import Inbound, Scheduled, Scheduler
from .serving import ServerLimits
from .targets import TargetBook

log = logging.getLogger(__name__)

# The decode request for a chosen target: its body, headers, and any prefill it waits on
# (disaggregation/prefill.py).
Legs = Callable[[Decision, float], Awaitable[DecodeLeg]]  # the decision, and the first byte's deadline


class _ConnectFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # retries_total label
        self.message = message


class _Ctx:
    """What the metrics need to know about one request when it ends, however it ends."""

    __slots__ = ("attempts", "engine", "outcome", "session", "status", "trace")

    def __init__(self, trace: Trace) -> None:
        self.status = 499  # nothing sent yet: if the handler is cancelled, the client closed
        self.outcome = "cancelled"
        self.engine: str | None = None
        self.session: SessionCtx | None = None
        self.trace = trace
        self.attempts = 0


class Proxy:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        targets: TargetBook,
        health: HealthBoard,
        load: LoadTracker,
        metrics: ProxyMetrics,
        config: ProxyConfig,
        executor: Executor | None = None,
        parse_inline_max_bytes: int = 256 << 10,
        models_timeout_s: float = 10.0,
        strip_headers: frozenset[str] = frozenset(),
        limits: ServerLimits | None = None,
        hooks: Sequence[RequestHook] = (),
        tracer: Tracer = OFF,
    ) -> None:
        self.scheduler = scheduler
        # The remote prefill step, when discovery finds prefill engines (set by the app, which builds
        # it over this proxy's connection pool and load).
        self.prefill: RemotePrefill | None = None
        self.tracer = tracer
        self.config = config
        self.limits = limits or ServerLimits()
        # What runs around each dispatch besides the relay (scheduling/hooks.py), in order.
        self.hooks = tuple(hooks)
        self.targets = targets
        self.health = health
        self.load = load
        self.metrics = metrics
        self.timeouts = config.timeouts
        self.max_body_bytes = config.max_body_bytes
        self.bodies = Bodies(
            config.body_budget_bytes, executor=executor, inline_max_bytes=parse_inline_max_bytes
        )
        metrics.body_budget_held.set_function(lambda: self.bodies.held)
        self.models_timeout = aiohttp.ClientTimeout(total=models_timeout_s)
        self._strip = strip_headers  # request headers never forwarded (a session hint)
        self._by_load = make_policy("least_loaded")  # what has no prefix to route on (endpoints.py)
        self._session: aiohttp.ClientSession | None = None

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        # One session, one pool for every engine. No connection limit (the engines queue, and the
        # policy sees the router's in-flight load); idle connections are dropped before uvicorn's 5 s
        # keep-alive would drop them under us. No cookies, no decompression, no added headers: the
        # bytes pass through.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.config.upstream_keepalive_s)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.timeouts.connect_s),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("proxy not started")
        return self._session

    # ---- handlers ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.COMPLETION, ctx))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.CHAT, ctx))

    async def responses_create(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.RESPONSES, ctx))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.MESSAGES, ctx))

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.GENERATE, ctx))

    async def token_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, lambda ctx: self._serve(request, Kind.TOKEN_GENERATE, ctx))

    async def response_item(self, request: web.Request) -> web.StreamResponse:
        """``/v1/responses/{response_id}[/...]`` (GET, DELETE, cancel, input items): to the engine
        holding that response, whatever the policy."""
        return await self._handle(
            request, lambda ctx: self._serve_bound(request, ctx), DecisionReason.RESPONSE.value
        )

    async def by_load(self, request: web.Request) -> web.StreamResponse:
        """A path without a prefix to route on (endpoints.py): to a healthy engine by load, relayed
        as chat is."""
        return await self._handle(request, lambda ctx: self._serve_by_load(request, ctx), self._by_load.name)

    async def _handle(
        self,
        request: web.Request,
        serve: Callable[[_Ctx], Awaitable[web.StreamResponse]],
        policy: str | None = None,
    ) -> web.StreamResponse:
        ctx = _Ctx(self.tracer.start(request.headers, lambda: f"{request.method} {_route(request)}"))
        try:
            return await serve(ctx)
        except ProxyError as e:
            ctx.status, ctx.outcome = e.status, e.outcome
            named = ctx.engine and self.config.engine_header
            return e.response({ENGINE_HEADER: ctx.engine} if named else None)
        except Exception:  # a bug: aiohttp answers 500 (or cuts a started response) and logs it
            ctx.outcome = "error"
            if ctx.status == 499:
                ctx.status = 500
            raise
        finally:
            self.metrics.request(policy or self.scheduler.profile.name, ctx.outcome, ctx.status)
            if ctx.trace.recording:
                _end_trace(ctx, request)

    async def _serve(self, request: web.Request, kind: Kind, ctx: _Ctx) -> web.StreamResponse:
        trace = ctx.trace
        with trace.span("parse") as span:
            async with self.bodies.share() as share:
                raw = await self._read_body(request, share)
                body = await self.bodies.parse(share, raw)
            span.set("routerfleet.request.bytes", len(raw))
        targets = self.targets.candidates()
        if not targets:
            raise no_engine("no engine can take the request (none discovered, or all unhealthy)")
        tenant = self.tenant(request)
        if self.config.tenant_cache_salt:
            raw, body = salted(raw, body, tenant)
        raw, body = without_chosen_id(raw, body, kind)
        scheduled = await self.scheduler.prepare(
            Inbound(kind, request.headers, body, len(raw), tenant, trace=trace), targets
        )
        ctx.session = scheduled.session
        asked = None
        if self.config.audit_stream_usage and kind in USAGE_OPTION_KINDS and scheduled.predicts:
            asked = request_usage(raw, body)
        sent = raw if asked is None else asked
        legs = self._legs(request, kind, sent, body, asked is not None, scheduled, trace)
        tokens = scheduled.route.tokens
        n_tokens = len(tokens) if tokens is not None else 0

        def exchange(decision: Decision, start: float) -> Exchange:
            prediction = scheduled.prediction(decision)
            return Exchange(
                decision.target,
                start,
                request.headers,
                tenant,
                kind,
                ctx.session,
                prediction,
                asked is not None,
                trace if trace.recording else None,
                unstored(body, kind),
            )

        return await self._forward(
            request, ctx, targets, scheduled.decide, sent, exchange, n_tokens, scheduled.ended, legs
        )

    def _legs(
        self,
        request: web.Request,
        kind: Kind,
        sent: bytes,
        body: Any,
        asked: bool,
        scheduled: Scheduled,
        trace: Trace,
    ) -> Legs | None:
        """In a disaggregated fleet, the remote prefill step before each decode request; else None."""
        prefill = self.prefill
        if prefill is None or not self.targets.disaggregated or not isinstance(body, dict):
            return None
        as_sent = {**body, "stream_options": {"include_usage": True}} if asked else body
        headers = request_headers(request.headers, self._strip)
        prompt = Prompt(kind, sent, as_sent, headers, scheduled.route, scheduled.index)

        previous: DecodeLeg | None = None  # an attempt's leg, for a retry on another decode engine

        async def legs(decision: Decision, deadline: float) -> DecodeLeg:
            nonlocal previous
            try:
                leg = await prefill.decode_leg(prompt, decision, request.path_qs, trace, previous, deadline)
            except PrefillFailed as e:  # nowhere to prefill, and the decode engine cannot
                raise no_engine(f"no engine can take the request: {e}") from None
            except Unservable as e:
                raise bad_request(str(e)) from None
            previous = leg
            if leg.transferred_tokens:
                scheduled.transferred(decision, leg.transferred_tokens)
            return leg

        return legs

    async def _serve_bound(self, request: web.Request, ctx: _Ctx) -> web.StreamResponse:
        async with self.bodies.share() as share:
            raw = await self._read_body(request, share)
        targets = self.targets.candidates()
        if not targets:
            raise no_engine("no engine can take the request (none discovered, or all unhealthy)")
        response_id = request.match_info["response_id"]
        responses = self.scheduler.responses
        if responses is None:  # pragma: no cover - the app always has bindings
            raise response_error(Verdict.UNKNOWN, response_id, "response_id")
        with ctx.trace.span("response_lookup") as span:
            target = await responses.target(
                response_id, targets, request.headers, "response_id", self.tenant(request)
            )
            span.set("routerfleet.engine", target.engine)

        def decide(targets: Sequence[Target], _attempt: int) -> Decision:
            if target not in targets:
                raise response_error(Verdict.UNAVAILABLE, response_id, "response_id")
            return Decision(target, DecisionReason.RESPONSE)

        return await self._forward(request, ctx, targets, decide, raw, self._plain(request))

    async def _serve_by_load(self, request: web.Request, ctx: _Ctx) -> web.StreamResponse:
        async with self.bodies.share() as share:
            raw = await self._read_body(request, share)
        targets = self.targets.candidates()
        if not targets:
            raise no_engine("no engine can take the request (none discovered, or all unhealthy)")
        unrouted = RouteRequest(tokens=None)

        def decide(targets: Sequence[Target], _attempt: int) -> Decision:
            with ctx.trace.span("schedule") as span:
                decision = self._by_load.choose(unrouted, targets, self.scheduler.loads, None)
                span.update(
                    {"routerfleet.engine": decision.target.engine, "routerfleet.reason": decision.reason}
                )
                return decision

        return await self._forward(request, ctx, targets, decide, raw, self._plain(request))

    def _plain(self, request: web.Request) -> Callable[[Decision, float], Exchange]:
        """The exchange of a request routed without parsing (by response id, or by load)."""
        tenant = self.tenant(request)
        return lambda decision, start: Exchange(decision.target, start, request.headers, tenant)

    async def _forward(
        self,
        request: web.Request,
        ctx: _Ctx,
        targets: Sequence[Target],
        decide: Callable[[Sequence[Target], int], Decision],
        body: bytes,
        exchange: Callable[[Decision, float], Exchange],
        n_tokens: int = 0,
        ended: Callable[[Decision], None] | None = None,
        legs: Legs | None = None,
    ) -> web.StreamResponse:
        """Send ``body`` to the target ``decide`` picks and relay the answer through the hooks that
        watch its ``exchange``, counting it in the target's load meanwhile (and telling ``ended`` when
        each attempt is over). A connect failure before any byte counts against the engine's breaker and
        is retried once, without that engine. ``legs``: a disaggregated fleet's remote prefill, run for
        each decode target before its request (the body and headers it sends)."""
        loop = asyncio.get_running_loop()
        for attempt in (0, 1):
            decision = decide(targets, attempt)
            target = decision.target
            ctx.engine = target.engine
            ctx.attempts = attempt + 1
            self.acquire(target, n_tokens)
            span = ctx.trace.span("upstream", SpanKind.CLIENT)
            leg: DecodeLeg | None = None
            try:
                start = loop.time()
                # The first byte's deadline holds from dispatch: a remote prefill leg's time counts in it.
                deadline = start + min(self.timeouts.first_byte_s, self.timeouts.total_s)
                if span.recording:
                    span.update(upstream_attributes(target))
                    span.set("routerfleet.attempt", attempt)
                try:
                    leg = None if legs is None else await legs(decision, deadline)
                except ProxyError as e:  # no prefill for it (failed, or none to pair): nothing was sent
                    span.fail(e.outcome)
                    raise
                sent, added = (body, {}) if leg is None else (leg.body, leg.headers)
                x = exchange(decision, start)
                watches = watching(self.hooks, x)
                try:
                    headers = {**ctx.trace.headers(span), **added}
                    opening = self._open(request, target, sent, headers, deadline)
                    upstream = await (opening if leg is None else _paired(opening, leg))
                except ProxyError as e:  # no answer in time, or a connection lost before one
                    span.fail(e.outcome)
                    raise
                except _ConnectFailed as e:
                    span.fail(e.reason)
                    self.health.failure(target.engine)
                    remaining = tuple(t for t in targets if t.engine != target.engine)
                    if attempt == 0 and remaining:
                        self.metrics.retry(e.reason)
                        targets = remaining
                        continue
                    if e.reason == "connect_timeout":
                        raise gateway_timeout(e.message, "connect_timeout") from None
                    raise bad_gateway(e.message, "upstream_connect_failed") from None
                prefilled = None if leg is None or leg.queued is None else leg.queued.done
                return await self._relay(request, upstream, x, watches, ctx, span, prefilled)
            finally:
                span.end()
                if leg is not None and leg.queued is not None:
                    leg.queued.done()
                if leg is not None and leg.ready is not None:
                    leg.ready.cancel()  # done, or no decode engine will join its room
                    if leg.ready.done() and not leg.ready.cancelled():
                        leg.ready.exception()  # seen (a failure was answered, or the request ended first)
                self.release(target, n_tokens)
                if ended is not None:
                    ended(decision)
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- request side --------------------------------------------------------------------------

    async def _read_body(self, request: web.Request, share: Share) -> bytes:
        """The body, whole (aiohttp inflates gzip and deflate), held in ``share`` as its bytes arrive (not
        as its Content-Length promises: a client that sends headers alone holds nothing)."""
        length = request.content_length
        if length is not None and length > self.max_body_bytes:
            raise too_large(self.max_body_bytes)
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in DECODED_ENCODINGS:
            raise unsupported_encoding(encoding, DECODED_ENCODINGS)
        timeout = self.limits.body_timeout_s(length, self.max_body_bytes)
        try:
            async with asyncio.timeout(timeout):
                body = bytearray()  # inflated as it arrives, and capped so
                async for chunk in request.content.iter_chunked(1 << 16):
                    body += chunk
                    if len(body) > self.max_body_bytes:
                        raise too_large(self.max_body_bytes)
                    await share.grow_to(len(body))
                return bytes(body)
        except TimeoutError:  # a body slower than the floor rate, or shorter than its Content-Length
            raise slow_body(timeout) from None
        except web.HTTPRequestEntityTooLarge:
            raise too_large(self.max_body_bytes) from None
        except RequestPayloadError:  # a body that does not decode as its Content-Encoding says
            raise bad_request(f"the request body is not valid {encoding}") from None

    def acquire(self, target: Target, tokens: int) -> None:
        self.metrics.set_inflight(target.engine, self.load.acquire(target, tokens))

    def release(self, target: Target, tokens: int) -> None:
        self.metrics.set_inflight(target.engine, self.load.release(target, tokens))

    async def _open(
        self, request: web.Request, target: Target, raw: bytes, trace_headers: dict[str, str], deadline: float
    ) -> aiohttp.ClientResponse:
        """Send the request (its method, path and query, ``raw`` as the body) to the engine and wait
        for its response headers, until ``deadline`` (the event loop's clock). ``trace_headers``: the
        engine's parent span, when traced (else a client's own trace context passes on as it came), and
        any header the router adds."""
        headers = request_headers(request.headers, self._strip)
        put_context(headers, trace_headers)
        if raw and "Content-Type" not in headers:  # a body that parsed as JSON (FastAPI servers insist)
            headers["Content-Type"] = "application/json"
        if target.rank is not None:
            headers[RANK_HEADER] = str(target.rank)
        try:
            async with asyncio.timeout_at(deadline):
                return await self.session.request(
                    request.method, target.url + request.path_qs, data=raw, headers=headers
                )
        except aiohttp.ConnectionTimeoutError:
            raise _ConnectFailed("connect_timeout", "timed out connecting to the engine") from None
        except aiohttp.ClientConnectorError:
            raise _ConnectFailed("connect", "cannot connect to the engine") from None
        except TimeoutError:
            raise gateway_timeout("the engine did not respond in time", "first_byte_timeout") from None
        except aiohttp.ServerDisconnectedError:
            self.health.failure(target.engine)
            raise bad_gateway(
                "the engine closed the connection before responding", "upstream_disconnected"
            ) from None
        except aiohttp.ClientError as e:
            raise bad_gateway(f"upstream error ({type(e).__name__})", "upstream_error") from None

    # ---- response side -------------------------------------------------------------------------

    async def _relay(
        self,
        request: web.Request,
        up: aiohttp.ClientResponse,
        x: Exchange,
        watches: Sequence[ResponseWatch],
        ctx: _Ctx,
        span: Span,
        prefilled: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """Stream the engine's response to the client, through the hooks' ``watches``
        (scheduling/hooks.py): its status and headers, each chunk before the client gets it, the end,
        and completion. ``prefilled``: told at the first chunk (the engine has prefilled the prompt)."""
        loop = asyncio.get_running_loop()
        start = x.started
        done = False
        try:
            status = up.status
            self.metrics.first_byte.observe(loop.time() - start)
            first_chunk = span.recording  # the span's time to first chunk is still to be taken
            if first_chunk:
                span.set("http.response.status_code", status)
                span.set("routerfleet.time_to_headers_ms", round((loop.time() - start) * 1e3, 3))
            headers = response_headers(up.headers)
            if self.config.engine_header:
                headers[ENGINE_HEADER] = x.target.engine
            for w in watches:
                w.response_received(status, headers)
            rewrites = any(w.rewrites_body for w in watches)
            streaming = chunk_watchers(watches)
            resp = web.StreamResponse(status=status, reason=up.reason, headers=headers)
            if up.content_length is not None and "Transfer-Encoding" not in up.headers and not rewrites:
                resp.content_length = up.content_length
            t = self.timeouts
            deadline = start + t.total_s
            idle = t.idle_s
            content = up.content
            writing = True  # to the client: a failure there means the client went away
            try:
                await resp.prepare(request)
                ctx.status = status
                async with asyncio.timeout_at(min(loop.time() + idle, deadline)) as cm:
                    while True:
                        writing = False
                        chunk = await content.readany()
                        if not chunk:
                            break
                        if prefilled is not None:
                            prefilled()
                            prefilled = None
                        if first_chunk:  # for a stream, the time to its first token
                            first_chunk = False
                            span.set(
                                "routerfleet.time_to_first_chunk_ms", round((loop.time() - start) * 1e3, 3)
                            )
                        cm.reschedule(deadline)  # a slow client is not an idle engine
                        for w in streaming:
                            out = w.response_streaming(chunk)
                            chunk = out if isinstance(out, bytes) else await out
                        writing = True
                        if chunk:
                            await resp.write(chunk)
                        cm.reschedule(min(loop.time() + idle, deadline))
                done = True  # the engine's response is complete: its connection can be reused
                writing = True
                async with asyncio.timeout_at(deadline):  # each waits for a client that stopped reading
                    for w in watches:
                        if rest := w.response_ended():
                            await resp.write(rest)
                    await resp.write_eof()
            except asyncio.CancelledError:  # the client went away (handler cancellation)
                ctx.outcome = "cancelled"
                raise
            except TimeoutError:
                ctx.outcome = "timeout"
                span.fail("timeout")
                self._cut(request)
                return resp
            except (aiohttp.ClientError, OSError):  # OSError: ConnectionResetError and friends
                if writing:
                    ctx.outcome = "cancelled"
                else:
                    ctx.outcome = "upstream_error"
                    span.fail("upstream_error")
                    self._cut(request)
                return resp
            self.metrics.total.observe(loop.time() - start)
            for w in watches:
                w.response_complete()
            ctx.outcome = "ok" if status < 400 else "upstream_status"
            return resp
        finally:
            if done:
                up.release()
            else:
                up.close()

    def tenant(self, request: web.Request) -> str:
        """The request's tenant ("" without ``--tenant-header``): response ids and session keys are
        scoped to it."""
        return tenant_of(request.headers, self.config.tenant_header)

    @staticmethod
    def _cut(request: web.Request) -> None:
        """End a response that already started without its terminator: the client sees a truncation,
        never a complete-looking body."""
        transport = request.transport
        if transport is not None:
            transport.close()

    # ---- /v1/models ----------------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        engines: dict[str, str] = {}
        for t in self.targets.candidates():
            engines.setdefault(t.engine, t.url)
        if not engines:
            return no_engine("no healthy engine").response()
        headers = request_headers(request.headers, self._strip)
        results = await asyncio.gather(
            *(read_models(self.session, url, headers, self.models_timeout) for url in engines.values()),
            return_exceptions=True,
        )
        merged: dict[str, Any] = {}
        answered = 0
        for r in results:
            if isinstance(r, list):
                answered += 1
                for m in r:
                    if isinstance(m, dict) and isinstance(m.get("id"), str):
                        merged.setdefault(m["id"], m)
        if not answered:
            return bad_gateway("no engine answered /v1/models", "upstream_error").response()
        return web.json_response({"object": "list", "data": list(merged.values())})


async def _paired(opening: Awaitable[aiohttp.ClientResponse], leg: DecodeLeg) -> aiohttp.ClientResponse:
    """The decode engine's answer once the prefill leg it waits on (``leg.ready``) is done: a prefill that
    fails first fails the request clearly (502), rather than leaving the decode engine waiting for KV
    that will never come; a decode engine that refuses the request (an error status), or cannot be
    reached, answers for itself at once."""
    ready = leg.ready
    if ready is None:
        return await opening
    answer = asyncio.ensure_future(opening)
    try:
        done, _ = await asyncio.wait((answer, ready), return_when=asyncio.FIRST_COMPLETED)
        if answer in done and answer.result().status >= 400:  # raises the decode's own failure
            return answer.result()
        try:
            await ready
        except PrefillFailed as e:
            raise bad_gateway(str(e), "prefill_failed") from None
        return await answer
    except BaseException:
        if not answer.done():
            answer.cancel()
        elif not answer.cancelled() and answer.exception() is None:
            answer.result().close()
        raise


def _route(request: web.Request) -> str:
    """The route the request matched, as a span names it: its template (``/v1/responses/{response_id}``),
    never the ids in its path."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


def _end_trace(ctx: _Ctx, request: web.Request) -> None:
    """The request's root span: what came in, how it ended; then the trace goes to the exporter."""
    root = ctx.trace.root
    root.update(
        {
            "http.request.method": request.method,
            "url.path": _route(request),
            "http.response.status_code": ctx.status,
            "routerfleet.outcome": ctx.outcome,
            "routerfleet.engine": ctx.engine,
            "routerfleet.retries": max(ctx.attempts - 1, 0),
        }
    )
    if server_error(ctx.status, ctx.outcome):
        root.fail(ctx.outcome)
    ctx.trace.end()
