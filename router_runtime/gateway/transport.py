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
CANCEL_WAIT_S = 2.0  # how long stop waits for cancelled streams to unwind
FINAL_STATUS_S = 0.2  # what stop leaves the connections at least, to carry the streams' last statuses

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
        self._stopping: asyncio.Task[None] | None = None

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
            if self._stopping is not None:
                self._native.finish(sid, Code.UNAVAILABLE, "the endpoint picker is stopping")
                return
            inbox: asyncio.Queue[bytes | None] = asyncio.Queue()
            task = self._loop.create_task(self._relay(sid, inbox))
            # Gone from the relays however it ends, even cancelled before its first step.
            task.add_done_callback(lambda _, sid=sid: self._relays.pop(sid, None))
            self._relays[sid] = (inbox, task)
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
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # cancelled: its client went away, or the server is stopping
            log.error("the endpoint picker's stream was cancelled from within")
            code, message = Code.INTERNAL, "the endpoint picker failed"
        except Exception:
            log.exception("the endpoint picker failed on a stream")
            code, message = Code.INTERNAL, "the endpoint picker failed"
        self._native.finish(sid, code, message)

    async def stop(self, grace: float | None) -> None:
        """No new streams; the open ones get ``grace`` seconds (None: none), then are cancelled (their
        clients told UNAVAILABLE); the connections then get what is left of it to close (at least
        FINAL_STATUS_S, for the statuses to reach them). A second call waits for the first."""
        if self._stopping is None:  # from now on a new stream is refused
            self._stopping = self._loop.create_task(self._stop(grace or 0.0))
        await asyncio.shield(self._stopping)

    async def _stop(self, grace: float) -> None:
        self._native.shutdown()
        deadline = self._loop.time() + grace
        while self._relays and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        tasks = [task for _, task in self._relays.values()]
        for task in tasks:
            task.cancel()
        if tasks:  # bounded: a relay that ignores its cancel is left behind, its stream ended below
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
        self._loop.remove_reader(self._native.fileno())
        await asyncio.to_thread(self._native.close, max(FINAL_STATUS_S, deadline - self._loop.time()))


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
