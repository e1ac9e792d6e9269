"""The HTTP server's own bounds: how long a client may take to send a request head, how long a
connection may sit idle, how many connections may be open, and the answer to a request aiohttp could
not parse (OpenAI-style JSON, like every other error, with no request bytes in it or in the log).

aiohttp bounds none of these by default (its keep-alive timeout is an hour, counted from the last
response, and there is no head timeout or connection cap), so a client that trickles headers at a
byte a second, or thousands of idle keep-alive connections, hold a file descriptor each for as long
as they like. The body read is bounded where the body is read (``proxy/server.py``), relative to its
size (``ServerLimits.body_timeout_s``).

``GuardedRunner`` is an ``aiohttp.web.AppRunner`` whose connections are ``_GuardedHandler``s. It
reaches one level under aiohttp's public API (the per-connection ``RequestHandler``): the only place
these bounds can live without a proxy in front.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from ..tasks import end_tasks
from .errors import error_json

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerLimits:
    header_timeout_s: float = 10.0  # from a request's first byte to its complete head
    idle_timeout_s: float = 60.0  # a keep-alive connection with no request in flight
    max_connections: int = 4096  # past it, new connections get a 503 and are closed
    body_min_bytes_per_s: int = 64 << 10  # a body may take 10 s plus its size at this rate
    body_base_s: float = 10.0
    # After an answer to a request whose body was not read to its end, how long the rest is read and
    # dropped before the connection closes (so the client sees the answer, not a reset).
    lingering_s: float = 2.0

    def body_timeout_s(self, length: int | None, cap: int) -> float:
        """How long reading a body of ``length`` bytes (None: chunked, up to ``cap``) may take."""
        size = cap if length is None else min(length, cap)
        return self.body_base_s + size / self.body_min_bytes_per_s


_OVER_CAPACITY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


def _over_capacity_response() -> bytes:
    body = json.dumps(
        error_json("too many connections; retry", type_="service_unavailable", code="too_many_connections")
    ).encode()
    return _OVER_CAPACITY % (len(body), body)


class _GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol, with a head timeout, a connection cap and JSON errors."""

    def __init__(self, manager: Any, *, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if len(self._manager.connections) > self._limits.max_connections:  # type: ignore[union-attr]
            log.warning("refused a connection: %d open", len(self._manager.connections))  # type: ignore[union-attr]
            transport.write(_over_capacity_response())  # type: ignore[attr-defined]
            self.force_close()

    def data_received(self, data: bytes) -> None:
        # Between requests (the handler waits for a message), a byte starts a head: it must be
        # complete within the head timeout, however slowly it trickles in.
        idle = self._waiter is not None and not self._waiter.done()
        if idle and self._head_timer is None and data:
            self._head_timer = self._loop.call_later(self._limits.header_timeout_s, self._head_expired)
        super().data_received(data)
        if self._head_timer is not None and (self._messages or not idle or self._force_close):
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._waiter is not None and not self._waiter.done() and not self._messages:
            log.info("closed a connection: no complete request head in %.0fs", self._limits.header_timeout_s)
            self.force_close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """A request aiohttp could not parse (or a handler that raised): the OpenAI error shape, the
        connection closed. The exception's text may quote the request's bytes, so it is neither
        answered nor logged (``log_redaction`` covers aiohttp's own log line)."""
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if status >= 500:
            self.log_exception("Error handling request from %s", request.remote, exc_info=exc)
        else:
            log.info("refused a malformed request from %s: %s", request.remote, type(exc).__name__)
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Error"
        kind = "invalid_request_error" if status < 500 else "server_error"
        code = {400: "malformed_request", 413: "request_too_large", 431: "headers_too_large"}.get(status)
        text = f"{phrase}: the request could not be parsed" if status < 500 else phrase
        resp = web.Response(
            status=status,
            body=json.dumps(error_json(text, type_=kind, code=code)),
            content_type="application/json",
        )
        resp.force_close()
        return resp


class _GuardedServer(web.Server):
    limits: ServerLimits

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, limits=self.limits, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """An AppRunner under ``ServerLimits``: keep-alive idle timeout, head timeout, connection cap; and a
    bounded stop: ``cleanup`` stops listening, gives the requests in flight ``shutdown_timeout``, then
    cuts what is left. (aiohttp's own shutdown waits its timeout twice over for a streaming handler:
    once for it to finish, then again after asking it to end, which a handler writing a stream does
    not see.)"""

    def __init__(self, app: web.Application, limits: ServerLimits, **kwargs: Any) -> None:
        super().__init__(
            app, keepalive_timeout=limits.idle_timeout_s, lingering_time=limits.lingering_s, **kwargs
        )
        self.limits = limits
        self.shutdown_timeout_s: float = kwargs.get("shutdown_timeout", 60.0)
        self._inflight: set[asyncio.Task] = set()
        app.middlewares.append(self._track)

    @web.middleware
    async def _track(self, request: web.Request, handler: Any) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            return await handler(request)
        finally:
            self._inflight.discard(task)

    async def cleanup(self) -> None:
        for site in list(self.sites):
            await site.stop()
        # The app's on_shutdown first: it ends its long-lived handlers (a sibling's report stream), which
        # would otherwise hold the wait below to its end. aiohttp's own cleanup sends it again.
        if self.server is not None:  # set up (an app's signals are frozen then)
            try:
                await self.shutdown()
            except Exception:  # a handler's bug: the stop goes on, bounded as ever
                log.exception("the HTTP server's on_shutdown failed")
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=self.shutdown_timeout_s)
        await end_tasks(self._inflight, "HTTP server")  # cut what is still in flight
        await super().cleanup()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer  # same state, our per-connection protocol
        server.limits = self.limits  # type: ignore[attr-defined]
        return server
