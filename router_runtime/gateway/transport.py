"""The picker's gRPC server. Rust serves the connections (``routerfleet_index.ExtProcServer``,
native/src/extproc.rs: HTTP/2, TLS, gRPC framing, off the event loop); this relays each ext_proc
stream's messages, as bytes, to the picker's ``Stream`` for it on the loop and its answers back, and
answers health checks (health.py). A message is answered as the inbox is drained, with no task of its
own, unless its step awaits (a pick, room in the body budget, a binding stored): then the stream's
later messages wait behind that step, in order. Each message's bytes are credited back to the Rust
side as it is taken, so a client is held to one message cap of bytes waiting. A stream the gateway
drops cancels its step; ``stop`` stops taking streams, lets the open ones finish for ``grace`` seconds,
then cancels them."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Protocol

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

Answers = list[ep.ProcessingResponse]


class Stream(Protocol):
    """One ext_proc stream as the picker handles it (picker.py)."""

    # The picker has answered for good (an immediate response): the stream ends OK, whatever follows.
    finished: bool

    def step(self, message: ep.ProcessingRequest) -> Answers | Awaitable[Answers]:
        """The answers to one message, in order: at once, or once what the step waits for is done."""
        ...

    def close(self) -> None:
        """The stream is over, however it ended (the transport calls it once; what it raises is logged,
        and the stream ends as it would have)."""
        ...


class Code(enum.IntEnum):
    """The gRPC status codes the picker ends a stream or a check with."""

    OK = 0
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    INTERNAL = 13
    UNAVAILABLE = 14


class _Relay:
    """One open stream: the picker's ``Stream``, the step it awaits (None: none), the messages waiting
    behind that step (raw), and whether the client's side has ended."""

    __slots__ = ("ended", "step", "stream", "waiting")

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.step: asyncio.Task[None] | None = None
        self.waiting: deque[bytes] = deque()
        self.ended = False


class PickerServer:
    def __init__(
        self, native: ExtProcServer, open_stream: Callable[[], Stream] | None, ready: Callable[[], bool]
    ) -> None:
        self._native = native
        self._open = open_stream
        self._ready = ready
        self._relays: dict[int, _Relay] = {}
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
                relay = self._relays.get(sid)
                if relay is not None:
                    self._end(sid, relay, Code.INTERNAL, "the endpoint picker failed")
                else:
                    self._native.finish(sid, Code.INTERNAL, "the endpoint picker failed")

    def _take(self, sid: int, kind: int, payload: bytes | None) -> None:
        if kind == MESSAGE:
            relay = self._relays.get(sid)
            if relay is None:  # finished already (an immediate response): nothing to say
                return
            assert payload is not None
            if relay.step is not None:  # behind a step that awaits: in order, after it
                relay.waiting.append(payload)
            else:
                self._handle(sid, relay, payload)
        elif kind == ENDED:
            relay = self._relays.get(sid)
            if relay is None:
                return
            relay.ended = True
            if relay.step is None:  # nothing waits (messages wait only behind a step)
                self._end(sid, relay, Code.OK, "")
        elif kind == OPENED:  # only where a picker is served (open_stream given)
            assert self._open is not None
            if self._stopping is not None:
                self._native.finish(sid, Code.UNAVAILABLE, "the endpoint picker is stopping")
                return
            self._relays[sid] = _Relay(self._open())
        elif kind == RESET:
            relay = self._relays.pop(sid, None)
            if relay is not None:
                self._cancel(relay)
        elif kind == CHECK_ASKED:
            try:
                self._native.send(sid, check(payload, self._ready()))
            except LookupError as e:
                self._native.finish(sid, Code.NOT_FOUND, str(e))
            except DecodeError:
                self._native.finish(sid, Code.INVALID_ARGUMENT, "not a HealthCheckRequest")

    def _handle(self, sid: int, relay: _Relay, raw: bytes) -> None:
        """Handles ``raw``, then whatever waits behind it, until a step awaits or the stream ends."""
        while True:
            self._native.consumed(sid, len(raw))  # the Rust side may read the stream on
            try:
                message = ep.ProcessingRequest.FromString(raw)
            except DecodeError:
                self._end(sid, relay, Code.INVALID_ARGUMENT, "not a ProcessingRequest")
                return
            try:
                answers = relay.stream.step(message)
            except Exception:
                log.exception("the endpoint picker failed on a stream")
                self._end(sid, relay, Code.INTERNAL, "the endpoint picker failed")
                return
            if not isinstance(answers, list):  # it awaits: what follows waits for it
                relay.step = self._loop.create_task(self._step_awaited(sid, relay, answers))
                # However it ends: a step cancelled before it started never runs its own code.
                relay.step.add_done_callback(partial(_closed_if_cancelled, relay, answers))
                return
            if not self._answer(sid, relay, answers):
                return
            if not relay.waiting:
                if relay.ended:
                    self._end(sid, relay, Code.OK, "")
                return
            raw = relay.waiting.popleft()

    async def _step_awaited(self, sid: int, relay: _Relay, pending: Awaitable[Answers]) -> None:
        try:
            answers = await pending
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # its client went away, or the server is stopping: closed as the task ends
            log.error("the endpoint picker's stream was cancelled from within")
            self._end(sid, relay, Code.INTERNAL, "the endpoint picker failed")
            return
        except Exception:
            log.exception("the endpoint picker failed on a stream")
            self._end(sid, relay, Code.INTERNAL, "the endpoint picker failed")
            return
        relay.step = None
        try:
            if not self._answer(sid, relay, answers):
                return
            if relay.waiting:
                self._handle(sid, relay, relay.waiting.popleft())
            elif relay.ended:
                self._end(sid, relay, Code.OK, "")
        except Exception:  # as _drain ends a stream whose handling fails
            log.exception("the endpoint picker's transport failed on a stream")
            self._end(sid, relay, Code.INTERNAL, "the endpoint picker failed")

    def _answer(self, sid: int, relay: _Relay, answers: Answers) -> bool:
        """Sends ``answers``; False once the stream is over (the picker answered for good, or the stream
        is gone: its client reset it, or left more than it may unread)."""
        for answer in answers:
            if not self._native.send(sid, answer.SerializeToString()):
                self._end(sid, relay, Code.UNAVAILABLE, "the stream is gone")
                return False
        if relay.stream.finished:
            self._end(sid, relay, Code.OK, "")
            return False
        return True

    def _end(self, sid: int, relay: _Relay, code: Code, message: str) -> None:
        if self._relays.get(sid) is relay:
            del self._relays[sid]
        _close(relay)
        self._native.finish(sid, code, message)

    @staticmethod
    def _cancel(relay: _Relay) -> None:
        """A stream gone before it ended: its step cancelled (which closes the stream as it unwinds)."""
        if relay.step is not None:
            relay.step.cancel()
        else:
            _close(relay)

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
        relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            self._cancel(relay)
        steps = [relay.step for relay in relays if relay.step is not None]
        if steps:  # bounded: a step that ignores its cancel is left behind, its stream ended below
            await asyncio.wait(steps, timeout=CANCEL_WAIT_S)
        self._loop.remove_reader(self._native.fileno())
        await asyncio.to_thread(self._native.close, max(FINAL_STATUS_S, deadline - self._loop.time()))


def _close(relay: _Relay) -> None:
    try:
        relay.stream.close()
    except Exception:  # what the stream held may be left counted; the stream ends all the same
        log.exception("the endpoint picker failed closing a stream")


def _closed_if_cancelled(relay: _Relay, pending: Awaitable[Answers], task: asyncio.Task[None]) -> None:
    if task.cancelled():
        if asyncio.iscoroutine(pending):
            pending.close()  # never awaited, if the task was cancelled before it started: nothing to run
        _close(relay)


async def serve(
    open_stream: Callable[[], Stream],
    host: str,
    port: int,
    ready: Callable[[], bool],
    tls: tuple[bytes, bytes] | None,
    connection_age_s: float,
    max_message: int,
    keepalive_s: float,
) -> PickerServer:
    """The picker's streams (``open_stream`` makes each one's ``Stream``) and its gRPC health (``ready``:
    as ``/readyz``), served at ``host:port`` over TLS with the (cert, key) PEM pair ``tls`` (None:
    plaintext). ``max_message`` bounds a message (one may carry a whole buffered body). Each connection
    is told to go away once ``connection_age_s`` old, and closed when a ping sent every ``keepalive_s``
    goes unanswered that long (PickerConfig says why)."""
    native = ExtProcServer(
        host,
        port,
        tls=tls,
        max_message=max_message,
        connection_age_s=connection_age_s,
        keepalive_s=keepalive_s,
        process=True,
    )
    return PickerServer(native, open_stream, ready)


async def serve_health(host: str, port: int, ready: Callable[[], bool]) -> PickerServer:
    """The picker's health alone, plaintext, at ``host:port``, for a kubelet's gRPC probe (no TLS)."""
    native = ExtProcServer(
        host,
        port,
        tls=None,
        max_message=1 << 16,
        connection_age_s=HEALTH_ONLY_CONNECTION_AGE_S,
        keepalive_s=HEALTH_ONLY_CONNECTION_AGE_S,  # a probe carries no stream to give back
        process=False,
    )
    return PickerServer(native, None, ready)
