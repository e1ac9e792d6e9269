"""The picker's gRPC server. Rust serves the connections (``routerfleet_index.ExtProcServer``,
native/src/extproc.rs: HTTP/2, TLS, gRPC framing, off the event loop); this relays each ext_proc
stream's messages, as bytes, to ``EndpointPicker.process`` on the loop and its answers back, and
answers health checks (health.py). A stream the gateway drops cancels its relay; ``stop`` stops
taking streams, lets the open ones finish for ``grace`` seconds, then cancels them."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator, Callable

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from routerfleet_index import ExtProcServer

from .health import check

log = logging.getLogger(__name__)

# The inbox's event kinds (extproc.rs).
OPENED, MESSAGE, ENDED, RESET, CHECK_ASKED = range(5)

HEALTH_ONLY_CONNECTION_AGE_S = 3600.0  # a probe's connection carries no load to rebalance

Process = Callable[[AsyncIterator[ep.ProcessingRequest]], AsyncIterator[ep.ProcessingResponse]]


class Code(enum.IntEnum):
    """The gRPC status codes the picker ends a stream or a check with."""

    OK = 0
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    INTERNAL = 13
    UNAVAILABLE = 14


class PickerServer:
    def __init__(self, native: ExtProcServer, process: Process | None, ready: Callable[[], bool]) -> None:
        self._native = native
        self._process = process
        self._ready = ready
        self._relays: dict[int, tuple[asyncio.Queue[bytes | None], asyncio.Task[None]]] = {}
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(native.fileno(), self._drain)
        self._closed = False

    @property
    def port(self) -> int:
        return self._native.port

    def _drain(self) -> None:
        for sid, kind, payload in self._native.drain():
            try:
                self._take(sid, kind, payload)
            except Exception:  # one event's failure must not lose the others drained with it
                log.exception("the endpoint picker's transport failed on an event")
                self._native.finish(sid, Code.INTERNAL, "the endpoint picker failed")

    def _take(self, sid: int, kind: int, payload: bytes | None) -> None:
        if kind in (MESSAGE, ENDED):
            relay = self._relays.get(sid)
            if relay is not None:  # else finished already (an immediate response): nothing to say
                relay[0].put_nowait(payload)
        elif kind == OPENED:  # only where a picker is served (process=True)
            if self._closed:
                self._native.finish(sid, Code.UNAVAILABLE, "the endpoint picker is stopping")
                return
            inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
            self._relays[sid] = (inbox, self._loop.create_task(self._relay(sid, inbox)))
        elif kind == RESET:
            relay = self._relays.pop(sid, None)
            if relay is not None:
                relay[1].cancel()
        elif kind == CHECK_ASKED:
            try:
                self._native.send(sid, check(payload, self._ready()))
            except LookupError as e:
                self._native.finish(sid, Code.NOT_FOUND, str(e))
            except DecodeError:
                self._native.finish(sid, Code.INVALID_ARGUMENT, "not a HealthCheckRequest")

    async def _relay(self, sid: int, inbox: asyncio.Queue[bytes | None]) -> None:
        assert self._process is not None

        async def requests() -> AsyncIterator[ep.ProcessingRequest]:
            while (raw := await inbox.get()) is not None:
                self._native.consumed(sid, len(raw))  # the Rust side may read the stream on
                try:
                    message = ep.ProcessingRequest.FromString(raw)
                except DecodeError:
                    raise NotAMessage from None
                yield message

        code, message = Code.OK, ""
        try:
            async for answer in self._process(requests()):
                self._native.send(sid, answer.SerializeToString())
        except NotAMessage:
            code, message = Code.INVALID_ARGUMENT, "not a ProcessingRequest"
        except Exception:
            log.exception("the endpoint picker failed on a stream")
            code, message = Code.INTERNAL, "the endpoint picker failed"
        finally:
            self._relays.pop(sid, None)
        self._native.finish(sid, code, message)

    async def stop(self, grace: float | None) -> None:
        """No new streams; the open ones get ``grace`` seconds (None: none), then are cancelled (their
        clients told UNAVAILABLE); the connections then get what is left of it to close."""
        if self._closed:
            return
        self._closed = True
        self._native.shutdown()
        deadline = self._loop.time() + (grace or 0.0)
        while self._relays and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        while self._relays:  # a stream opened while the others were being cancelled is cancelled too
            tasks = [task for _, task in self._relays.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self._loop.remove_reader(self._native.fileno())
        await asyncio.to_thread(self._native.close, max(0.0, deadline - self._loop.time()))


class NotAMessage(Exception):
    """A stream's bytes that are no ProcessingRequest."""


async def serve(
    process: Process,
    host: str,
    port: int,
    ready: Callable[[], bool],
    tls: tuple[bytes, bytes] | None,
    connection_age_s: float,
    max_message: int,
) -> PickerServer:
    """The picker's ``process``, and its gRPC health (``ready``: as ``/readyz``), served at
    ``host:port`` over TLS with the (cert, key) PEM pair ``tls`` (None: plaintext). ``max_message``
    bounds a message (one may carry a whole buffered body). Each connection is told to go away once
    ``connection_age_s`` old (PickerConfig says why)."""
    native = ExtProcServer(
        host, port, tls=tls, max_message=max_message, connection_age_s=connection_age_s, process=True
    )
    return PickerServer(native, process, ready)


async def serve_health(host: str, port: int, ready: Callable[[], bool]) -> PickerServer:
    """The picker's health alone, plaintext, at ``host:port``, for a kubelet's gRPC probe (no TLS)."""
    native = ExtProcServer(
        host,
        port,
        tls=None,
        max_message=1 << 16,
        connection_age_s=HEALTH_ONLY_CONNECTION_AGE_S,
        process=False,
    )
    return PickerServer(native, None, ready)
