"""The picker's gRPC transport (router_runtime/gateway/transport.py over native/src/extproc.rs): real
gRPC clients (grpcio) against the native server, with small streams in place of the picker's, so each
test sees what the transport alone does with a stream: relays it in order, cancels it when the client
goes away, refuses what is not a message or too big, and stops within its grace. The picker behind
real Envoy is tests/test_gateway_picker.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Awaitable, Sequence
from pathlib import Path

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_runtime.gateway.transport import MESSAGE, OPENED, RESET, serve
from tests.support import eventually, threads_named

HOST = "127.0.0.1"
KEEPALIVE_S = 60.0  # a ping a minute: never in these tests but the one about pings


def headers(end: bool = False) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=end))


ANSWER = ep.ProcessingResponse(request_headers=ep.HeadersResponse())


class Echo:
    """Streams that answer each message with a headers answer (``hold``: once it is set; later messages
    wait behind the step that waits for it), recording how each stream ends."""

    def __init__(self, hold: asyncio.Event | None = None) -> None:
        self.hold = hold
        self.seen = 0
        self.ended: list[str] = []

    def __call__(self) -> EchoStream:
        return EchoStream(self)


class EchoStream:
    finished = False

    def __init__(self, echo: Echo) -> None:
        self.echo = echo

    def step(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse] | Awaitable:
        self.echo.seen += 1
        return [ANSWER] if self.echo.hold is None else self._held(self.echo.hold)

    async def _held(self, hold: asyncio.Event) -> Sequence[ep.ProcessingResponse]:
        try:
            await hold.wait()
        except asyncio.CancelledError:
            self.echo.ended.append("cancelled")
            raise
        return [ANSWER]

    def close(self) -> None:
        self.echo.ended.append("closed")


class Answering:
    """Streams whose first message is answered with ``answers``, and that are then over."""

    def __init__(self, answers: Sequence[ep.ProcessingResponse]) -> None:
        self.answers = answers
        self.closed = 0
        self.finished = False

    def __call__(self) -> Answering:
        return self

    def step(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse]:
        self.finished = True
        return self.answers

    def close(self) -> None:
        self.closed += 1  # after the answers are handed to the transport


@contextlib.asynccontextmanager
async def served(process, *, max_message: int = 1 << 20):
    server = await serve(process, HOST, 0, lambda: True, None, 60.0, max_message, KEEPALIVE_S)
    try:
        async with grpc.aio.insecure_channel(f"{HOST}:{server.port}") as channel:
            yield server, epg.ExternalProcessorStub(channel)
    finally:
        await server.stop(0)


async def test_a_streams_messages_are_answered_in_order_and_it_ends_with_the_clients_side():
    echo = Echo()
    async with served(echo) as (_, stub):
        answers = [a async for a in stub.Process(iter([headers(), headers(), headers(end=True)]), timeout=5)]
    assert len(answers) == 3 and echo.seen == 3
    assert echo.ended == ["closed"]


async def test_a_client_that_goes_away_cancels_its_stream():
    hold = asyncio.Event()  # never set: the answer is pending when the client leaves
    echo = Echo(hold)
    async with served(echo) as (server, stub):
        call = stub.Process()
        await call.write(headers())
        await eventually(lambda: echo.seen == 1, 5, "the message relayed")
        call.cancel()
        await eventually(lambda: echo.ended == ["cancelled", "closed"], 5, "the stream cancelled")
        assert server._native.open_streams() == 0


async def test_a_client_gone_without_closing_its_connection_loses_its_stream_to_an_unanswered_ping():
    """A gateway that vanishes without a FIN (its node lost, a partition) stops answering: the server's
    ping goes unanswered, the connection closes, and its stream is cancelled, so what it held goes back."""
    keepalive_s = 0.5
    hold = asyncio.Event()  # never set: the stream waits for its answer when the client vanishes
    echo = Echo(hold)
    server = await serve(echo, HOST, 0, lambda: True, None, 60.0, 1 << 20, keepalive_s)
    vanished = asyncio.Event()
    held: list[asyncio.StreamWriter] = []  # the relay's sockets, never closed while the test runs

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(1 << 16):
                if not vanished.is_set():  # after: every byte lost, as on a dead link
                    writer.write(data)
                    await writer.drain()

    async def relay(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(HOST, server.port)
        held.extend([client_writer, server_writer])
        await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))

    front = await asyncio.start_server(relay, HOST, 0)
    try:
        async with grpc.aio.insecure_channel(f"{HOST}:{front.sockets[0].getsockname()[1]}") as channel:
            call = epg.ExternalProcessorStub(channel).Process()
            await call.write(headers())
            await eventually(lambda: echo.seen == 1, 5, "the message relayed")
            vanished.set()
            await eventually(
                lambda: echo.ended == ["cancelled", "closed"], 10 * keepalive_s, "the stream ended"
            )
            assert server._native.open_streams() == 0
            call.cancel()
    finally:
        for w in held:
            w.close()
        front.close()
        await server.stop(0)


async def test_bytes_that_are_no_message_end_the_stream_invalid_argument():
    async with served(Echo()) as (server, _), grpc.aio.insecure_channel(f"{HOST}:{server.port}") as channel:
        raw = channel.stream_stream(
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in raw(iter([b"\xff\xff\xff"]), timeout=5):
                pass
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_message_over_the_cap_is_refused_and_its_stream_is_gone():
    echo = Echo()
    async with served(echo, max_message=1024) as (server, stub):
        big = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * 4096))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Process(iter([big]), timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE  # "decoded message length too large"
        await eventually(lambda: server._native.open_streams() == 0, 5, "the stream gone")
    assert echo.seen == 0


async def test_a_client_sending_faster_than_the_picker_reads_is_held_to_one_message_cap():
    hold = asyncio.Event()
    echo = Echo(hold)
    chunk = ep.ProcessingRequest(request_body=ep.HttpBody(body=b"x" * 30_000))
    async with served(echo, max_message=64 * 1024) as (server, stub):
        call = stub.Process()

        async def send() -> None:
            for _ in range(40):  # 1.2 MB, far past the cap, while the picker is busy on the first
                await call.write(chunk)
            await call.done_writing()

        sending = asyncio.create_task(send())
        await eventually(lambda: echo.seen == 1, 5, "the first message relayed")
        await asyncio.sleep(0.5)
        (relay,) = server._relays.values()
        assert len(relay.waiting) <= 2  # 64 KiB of credit: two 30 KB messages wait, the rest stay unread
        hold.set()
        assert len([a async for a in call]) == 40
        await sending
    assert echo.seen == 40 and echo.ended == ["closed"]


async def test_stop_lets_open_streams_finish_within_the_grace_then_cancels_them():
    hold = asyncio.Event()
    echo = Echo(hold)
    server = await serve(echo, HOST, 0, lambda: True, None, 60.0, 1 << 20, KEEPALIVE_S)
    async with grpc.aio.insecure_channel(f"{HOST}:{server.port}") as channel:
        stub = epg.ExternalProcessorStub(channel)
        finishing = stub.Process()
        await finishing.write(headers())
        await eventually(lambda: echo.seen == 1, 5, "the first stream open")
        stopping = asyncio.create_task(server.stop(5))
        await asyncio.sleep(0.2)
        hold.set()  # the open stream answers within the grace
        await finishing.write(headers(end=True))
        await finishing.done_writing()
        assert len([a async for a in finishing]) == 2
        await asyncio.wait_for(stopping, 5)
    assert echo.ended == ["closed"]

    hold = asyncio.Event()  # never set: the stream outlives a short grace
    echo = Echo(hold)
    server = await serve(echo, HOST, 0, lambda: True, None, 60.0, 1 << 20, KEEPALIVE_S)
    async with grpc.aio.insecure_channel(f"{HOST}:{server.port}") as channel:
        call = epg.ExternalProcessorStub(channel).Process()
        await call.write(headers())
        await eventually(lambda: echo.seen == 1, 5, "the stream open")
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(server.stop(0.3), 5)
        assert asyncio.get_running_loop().time() - started < 3
        call.cancel()
    assert echo.ended == ["cancelled", "closed"]


async def test_stop_delivers_the_answers_of_streams_already_finished():
    big = b"y" * (8 << 20)  # more than the connection's flow-control window: still in flight at stop
    answer = ep.ProcessingResponse(
        request_body=ep.BodyResponse(response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=big)))
    )

    once = Answering([answer])
    server = await serve(once, HOST, 0, lambda: True, None, 60.0, 16 << 20, KEEPALIVE_S)
    options = [("grpc.max_receive_message_length", 16 << 20)]
    async with grpc.aio.insecure_channel(f"{HOST}:{server.port}", options=options) as channel:
        call = epg.ExternalProcessorStub(channel).Process(iter([headers()]))
        await eventually(lambda: once.closed and server._native.open_streams() == 0, 5, "the stream finished")
        stopping = asyncio.create_task(server.stop(5))
        answers = [a async for a in call]
        await asyncio.wait_for(stopping, 5)
    assert [len(a.request_body.response.body_mutation.body) for a in answers] == [len(big)]


async def test_a_client_that_does_not_read_its_answers_loses_its_stream_not_memory():
    answer = ep.ProcessingResponse(
        request_body=ep.BodyResponse(
            response=ep.CommonResponse(body_mutation=ep.BodyMutation(body=b"z" * 60_000))
        )
    )
    flood = Answering([answer] * 400)  # 24 MB for a client that never reads

    async with served(flood, max_message=64 * 1024) as (server, stub):
        server._native = sends = Counting(server._native)
        call = stub.Process()
        await call.write(headers())
        # Two caps (128 KiB) of unread answers past what the windows hold: the stream is ended, the picker
        # told as if the client had gone, and no more is sent.
        await eventually(lambda: not server._relays and flood.closed == 1, 10, "the end")
        assert sends.refused == 1 and sends.sent < 200  # not an unbounded queue
        call.cancel()


class Counting:
    """The native server, its ``send``s counted: those taken, and those refused (the stream gone)."""

    def __init__(self, native) -> None:
        self.native, self.sent, self.refused = native, 0, 0

    def send(self, sid: int, data: bytes) -> bool:
        taken = self.native.send(sid, data)
        self.sent += taken
        self.refused += not taken
        return taken

    def __getattr__(self, name: str):
        return getattr(self.native, name)


async def test_stop_right_after_a_stream_opens_ends_it():
    echo = Echo()
    server = await serve(echo, HOST, 0, lambda: True, None, 60.0, 1 << 20, KEEPALIVE_S)
    server._take(10**9, OPENED, None)  # a stream id the native side does not know: its calls are no-ops
    await asyncio.wait_for(server.stop(0), 5)  # cancelled before its first step, it is gone all the same
    assert not server._relays


@pytest.mark.skipif(sys.platform != "linux", reason="SCHED_BATCH is Linux's")
async def test_the_transport_thread_runs_sched_batch_and_the_event_loop_does_not():
    # Waking a SCHED_BATCH thread does not preempt the waker (extproc.rs, batch_scheduling): otherwise,
    # where the two share a core, every answer handed over switches the loop out mid-drain and back.
    loop_policy = os.sched_getscheduler(threading.get_native_id())
    async with served(Echo()):
        # The thread names itself, then sets its policy, as it starts: a loaded machine may not have
        # run it yet.
        def policies() -> set[int]:
            return {os.sched_getscheduler(t) for t in threads_named("routerfleet-epp")}

        await eventually(lambda: policies() == {os.SCHED_BATCH}, 5, "the transport thread SCHED_BATCH")
        assert os.sched_getscheduler(threading.get_native_id()) == loop_policy  # the loop's own untouched


async def test_a_port_in_use_fails_at_start_naming_it():
    async with served(Echo()) as (server, _):
        with pytest.raises(OSError, match=f"picker port {HOST}:{server.port}"):
            await serve(Echo(), HOST, server.port, lambda: True, None, 60.0, 1 << 20, KEEPALIVE_S)


# A picker out of file descriptors: it holds every one it can open until the test names a file.
_OUT_OF_DESCRIPTORS = """
import asyncio, os, resource, sys
from router_runtime.gateway.transport import serve_health

async def main(release):
    server = await serve_health("127.0.0.1", 0, lambda: True)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    print(server.port, flush=True)
    while not os.path.exists(release):
        await asyncio.sleep(0.05)
    for fd in held:
        os.close(fd)
    await asyncio.sleep(30)

asyncio.run(main(sys.argv[1]))
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_a_picker_out_of_file_descriptors_waits_for_them_without_spinning(tmp_path):
    release = tmp_path / "release"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _OUT_OF_DESCRIPTORS, str(release), stdout=asyncio.subprocess.PIPE
    )
    try:
        port = int(await asyncio.wait_for(child.stdout.readline(), 30))
        waiting = socket.create_connection((HOST, port), timeout=5)  # queued: the picker cannot accept it
        await asyncio.sleep(0.5)
        before = _cpu_seconds(child.pid)
        await asyncio.sleep(2)
        spent = _cpu_seconds(child.pid) - before
        assert spent < 0.5, f"{spent:.2f} s of CPU in 2 s while out of descriptors"
        release.touch()  # descriptors free again: connections are taken as before
        async with grpc.aio.insecure_channel(f"{HOST}:{port}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            answer = await check(health_pb2.HealthCheckRequest(), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        waiting.close()
    finally:
        child.kill()
        await child.wait()


async def test_a_stream_reset_in_the_batch_that_started_its_awaiting_step_is_closed():
    echo = Echo(asyncio.Event())  # never set: the step awaits
    server = await serve(echo, HOST, 0, lambda: True, None, 60.0, 1 << 20, KEEPALIVE_S)
    sid = 10**9  # a stream id the native side does not know: its calls are no-ops
    # One drained batch: the message whose step awaits, then the client's reset, before the step's task
    # ever ran (so its own code never does).
    for kind, payload in ((OPENED, None), (MESSAGE, headers().SerializeToString()), (RESET, None)):
        server._take(sid, kind, payload)
    await eventually(lambda: echo.ended == ["closed"], 5, "the stream closed")
    assert not server._relays
    await server.stop(0)


class Unanswerable:
    """A stream whose step, once it has awaited, answers with something that is no message."""

    finished = False
    closed = 0

    def step(self, message: ep.ProcessingRequest) -> Awaitable:
        async def later() -> list:
            await asyncio.sleep(0)
            return [object()]

        return later()

    def close(self) -> None:
        Unanswerable.closed += 1


async def test_a_step_failing_after_its_await_ends_its_stream_internal():
    async with served(Unanswerable) as (server, stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.Process(iter([headers()]), timeout=5):
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert Unanswerable.closed == 1 and not server._relays
