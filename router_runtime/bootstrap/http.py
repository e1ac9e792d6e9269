"""The internal port: ``GET /internal/kv_snapshot`` (the producer), ``GET /internal/bootstrap`` (the
verdict the operator reads), ``GET /internal/load/stream`` (a sibling's load reports, a WebSocket) and
``POST /internal/load`` (one report, from a sibling of an older release; fleet/gossip.py),
``POST /internal/kv_notice`` (a sibling's KV notice, fleet/notices.py) and ``POST /internal/flush_cache``
(a fleet-wide cache flush, fleet/flush.py). Separate from the public proxy port and authenticated with
the fleet's bearer token: a request without it gets 401."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp import WSCloseCode, WSMsgType, web

from ..fleet import notices
from ..fleet.flush import FlushResult
from ..fleet.gossip import (
    MAX_BODY_BYTES,
    REFUSED,
    STREAM_PATH,
    TAKEN,
    GossipRejected,
    PeerReport,
    vet_report,
)
from ..fleet.notices import KvNotice, NoticeRejected, vet_notice
from .producer import SnapshotProducer
from .sweep import Bootstrapper
from .wire import CONTENT_TYPE, FORMAT, LEGACY_FORMAT


def read_token(path: str) -> str:
    """The fleet token from a file (a mounted Secret). Refuses an empty one: it would authorize all."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


# A sibling's report stream: closed after this long without a report (its sender reports at least every
# heartbeat, 0.5 s by default) or without taking an answer; a close waits this long for the sender's.
STREAM_IDLE_S = 10.0
STREAM_CLOSE_S = 1.0

# A snapshot body goes out a slice at a time: one write of hundreds of MiB is copied whole into the
# transport's buffer, on the loop, where every live event waits behind it.
_SEND_SLICE = 1 << 20


async def _send(request: web.Request, body: bytes, content_type: str, gzipped: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Encoding": "gzip"} if gzipped else None)
    resp.content_type = content_type
    resp.content_length = len(body)
    await resp.prepare(request)
    view = memoryview(body)
    for start in range(0, len(body), _SEND_SLICE):
        await resp.write(view[start : start + _SEND_SLICE])
    await resp.write_eof()
    return resp


def _error(status: int, message: str, code: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
        status=status,
    )


async def _bounded_body(request: web.Request, limit: int, what: str) -> bytes | web.Response:
    """The request's body, or the 413 that says it is over ``limit`` bytes."""
    too_large = _error(413, f"{what} is at most {limit} bytes", "too_large")
    if (request.content_length or 0) > limit:
        return too_large
    try:
        body = await request.read()  # aiohttp bounds it (client_max_size, 1 MiB)
    except web.HTTPRequestEntityTooLarge:
        return too_large
    return too_large if len(body) > limit else body


def internal_app(
    token: str,
    bootstrapper: Bootstrapper | None,
    producer: SnapshotProducer | None,
    load_report: Callable[[PeerReport | None], None] | None = None,
    *,
    notice: Callable[[KvNotice], None] | None = None,
    flush: Callable[[list[str] | None], Awaitable[FlushResult]] | None = None,
) -> web.Application:
    expected = f"Bearer {token}".encode()

    @web.middleware
    async def auth(request: web.Request, handler):
        # surrogateescape: a header with non-ASCII bytes is a wrong token (401), never an exception
        got = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(got, expected):
            return _error(401, "missing or wrong bearer token", "unauthorized")
        return await handler(request)

    async def kv_snapshot(request: web.Request) -> web.StreamResponse:
        if producer is None:  # this replica keeps no index: as good as cold to a consumer
            return _error(404, "this router keeps no KV index", "no_index")
        q = request.query
        # The consumer names the format it reads (this version's routers ask for 2); without it, the
        # body is format 1, what a router of the previous version expects during a rollout or rollback.
        fmt = LEGACY_FORMAT
        if "format" in q:
            if q["format"] not in (str(LEGACY_FORMAT), str(FORMAT)):
                return _error(400, f"format must be {LEGACY_FORMAT} or {FORMAT}", "invalid_format")
            fmt = int(q["format"])
        if q.get("sessions_only") == "true":
            return web.Response(body=producer.sessions_body(fmt), content_type=CONTENT_TYPE[fmt])
        if q.get("cursors_only") == "true":
            return web.json_response(
                {
                    "format": 1,
                    "cursors": [
                        {"engine": c.engine, "rank": c.rank, "incarnation": inc, "seq": seq}
                        for c, inc, seq in producer.cursors()
                    ],
                }
            )
        max_age_s = None
        if "max_age_ms" in q:
            try:
                max_age_ms = int(q["max_age_ms"])
            except ValueError:
                return _error(400, "max_age_ms must be an integer", "invalid_max_age")
            if max_age_ms < 0:
                return _error(400, "max_age_ms must be >= 0", "invalid_max_age")
            max_age_s = max_age_ms / 1000
        built = await producer.get(max_age_s)
        gzipped = fmt == LEGACY_FORMAT and "gzip" in request.headers.get("Accept-Encoding", "")
        return await _send(request, await producer.body(built, fmt, gzipped), CONTENT_TYPE[fmt], gzipped)

    async def bootstrap(_request: web.Request) -> web.Response:
        if bootstrapper is None:
            return web.json_response(
                {
                    "apiVersion": "routerfleet.io/bootstrap/v1",
                    "settled": True,
                    "verdict": "disabled",
                    "seedFailed": False,
                    "ranks": [],
                }
            )
        bootstrapper.check_settled()  # a settlement due since the loop last looked is reported whole
        return web.json_response(bootstrapper.report())

    async def load(request: web.Request) -> web.Response:
        if load_report is None:
            return _error(404, "this router takes no load reports", "no_fleet_load")
        body = await _bounded_body(request, MAX_BODY_BYTES, "a load report")
        if isinstance(body, web.Response):
            return body
        try:
            report = vet_report(body)
        except GossipRejected as exc:
            load_report(None)  # counted
            return _error(400, f"load report refused: {exc}", "invalid_load_report")
        load_report(report)
        return web.Response(status=204)

    streams: set[web.WebSocketResponse] = set()
    stopping = False

    async def load_stream(request: web.Request) -> web.StreamResponse:
        """A sibling's reports, one per binary message, each vetted and taken as a POSTed one is, and
        answered (``TAKEN``, or ``REFUSED``: counted, and the stream goes on, as a 400 leaves a
        connection open). Its sender waits for each answer, so nothing queues here. A stream idle for
        ``STREAM_IDLE_S`` is closed (its sender opens another at its next report)."""
        if load_report is None:
            return _error(404, "this router takes no load reports", "no_fleet_load")
        if stopping:
            return _error(503, "this router is stopping", "stopping")
        ws = web.WebSocketResponse(
            max_msg_size=MAX_BODY_BYTES + 1, autoping=False, timeout=STREAM_CLOSE_S, compress=False
        )
        await ws.prepare(request)
        streams.add(ws)
        try:
            while not stopping:  # a stop that came while this one was opening: closed below
                # Bounded whole: aiohttp's own close after a bad frame drains without a bound.
                async with asyncio.timeout(STREAM_IDLE_S + STREAM_CLOSE_S):
                    msg = await ws.receive(timeout=STREAM_IDLE_S)
                if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
                report = None
                if msg.type is WSMsgType.BINARY:
                    with contextlib.suppress(GossipRejected):
                        report = vet_report(msg.data)
                load_report(report)  # None (text, a control frame, an error, a refused one): counted
                if msg.type not in (WSMsgType.BINARY, WSMsgType.TEXT):  # no answer (an error ends it)
                    if msg.type is WSMsgType.ERROR:  # a message over the bound: aiohttp closes the stream
                        break
                    continue
                async with asyncio.timeout(STREAM_IDLE_S):  # a sender that reads no answer: cut
                    await ws.send_bytes(REFUSED if report is None else TAKEN)
        except (TimeoutError, ConnectionError):  # idle, or an answer the sender no longer reads
            pass
        finally:
            streams.discard(ws)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STREAM_CLOSE_S):
                    await ws.close(code=WSCloseCode.GOING_AWAY)
            if request.transport is not None:  # a sender that reads nothing keeps no socket here
                request.transport.abort()
        return ws

    async def close_streams(_app: web.Application) -> None:
        # At the stop, before the server waits for its handlers (a stream's would wait out its bound);
        # sent twice at a GuardedRunner's stop, so it must do nothing the second time.
        nonlocal stopping
        stopping = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STREAM_CLOSE_S):
                await asyncio.gather(*(ws.close(code=WSCloseCode.GOING_AWAY) for ws in list(streams)))

    async def kv_notice(request: web.Request) -> web.Response:
        if notice is None:
            return _error(404, "this router keeps no KV index", "no_index")
        body = await _bounded_body(request, notices.MAX_BODY_BYTES, "a KV notice")
        if isinstance(body, web.Response):
            return body
        try:
            notice(vet_notice(body))
        except NoticeRejected as exc:
            return _error(400, f"KV notice refused: {exc}", "invalid_kv_notice")
        return web.Response(status=204)

    async def flush_cache(request: web.Request) -> web.Response:
        if flush is None:
            return _error(404, "this router keeps no KV index", "no_index")
        body = await _bounded_body(request, notices.MAX_BODY_BYTES, "a flush request")
        if isinstance(body, web.Response):
            return body
        try:
            doc = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError):
            doc = None
        engines = doc.get("engines") if isinstance(doc, dict) else None
        valid = engines is None or (isinstance(engines, list) and all(isinstance(e, str) for e in engines))
        if not isinstance(doc, dict) or not valid:
            return _error(400, 'the body must be {} or {"engines": [engine id, ...]}', "invalid_flush")
        try:
            result = await flush(engines)
        except LookupError as exc:
            return _error(400, str(exc.args[0]), "unknown_engine")
        return web.json_response(result.json())

    app = web.Application(middlewares=[auth])
    app.router.add_get("/internal/kv_snapshot", kv_snapshot)
    app.router.add_get("/internal/bootstrap", bootstrap)
    app.router.add_post("/internal/load", load)
    app.router.add_get(STREAM_PATH, load_stream)
    app.on_shutdown.append(close_streams)
    app.router.add_post("/internal/kv_notice", kv_notice)
    app.router.add_post("/internal/flush_cache", flush_cache)
    return app
