"""A replica's load reports to a sibling over real HTTP: one WebSocket per peer
(``GET /internal/load/stream``, fleet/gossip.py), a report per binary message, each vetted as a POSTed
one is and answered; one report in flight per peer until its answer; a sibling of an older release (no
stream) gets them posted; a restart, an idle close, a wrong token and a peer that never answers each
end as the POSTs did, and an open stream never holds the receiver's stop."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import socket
import time

import aiohttp
import pytest
import uvloop
from aiohttp import web

from router_runtime.bootstrap import http as internal_http
from router_runtime.bootstrap.http import internal_app
from router_runtime.fleet.gossip import (
    MAX_BODY_BYTES,
    REFUSAL_HOLD_S,
    REFUSED,
    STREAM_PATH,
    STREAM_RETRY_S,
    TAKEN,
    GossipConfig,
    LoadGossip,
    encode_report,
)
from router_runtime.fleet.view import TargetReport
from router_runtime.proxy.serving import GuardedRunner, ServerLimits

from .support import eventually, loopback_app

TOKEN = "fleet-s3cret"
FAST = GossipConfig(window_s=0.001, heartbeat_s=0.05)


class Sibling:
    """A receiving replica's internal port (the real app), started and stopped at will on one port."""

    def __init__(self, token: str = TOKEN) -> None:
        self.token = token
        self.taken: list = []  # reports as load_report got them (None: refused)
        self.asked: list[tuple[str, str]] = []  # (method, path) of every request answered
        self.port = 0
        self.runner: GuardedRunner | None = None

    async def start(self) -> str:
        app = internal_app(self.token, None, None, self.taken.append)

        async def prepared(request: web.Request, _response: web.StreamResponse) -> None:
            self.asked.append((request.method, request.path))

        app.on_response_prepare.append(prepared)
        self.runner = GuardedRunner(app, ServerLimits(), shutdown_timeout=10.0)  # as run_router serves it
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True).start()
        self.port = self.runner.addresses[0][1]
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()
        self.runner = None

    def reports(self) -> list:
        return [r for r in self.taken if r is not None]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def gossiping(url: str, token: str = TOKEN, config: GossipConfig = FAST, clock=time.monotonic):
    """A LoadGossip telling ``url`` a fresh report at every change; yields it and its send outcomes."""
    seq = itertools.count(1)
    outcomes: list[str] = []
    report = lambda: encode_report("a", "inc-1", next(seq), [TargetReport("e", 0, 1, 10)])  # noqa: E731
    gossip = LoadGossip(token, lambda: [url], report, config, on_sent=outcomes.append, clock=clock)
    task = asyncio.create_task(gossip.run())
    try:
        yield gossip, outcomes
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def changes(gossip: LoadGossip, n: int, every_s: float = 0.005) -> None:
    for _ in range(n):
        gossip.changed.set()
        await asyncio.sleep(every_s)


async def test_a_sibling_gets_every_report_over_one_stream_that_outlives_a_request_timeout():
    sibling = Sibling()
    url = await sibling.start()
    try:
        async with gossiping(url) as (gossip, outcomes):
            await changes(gossip, 20)
            await eventually(lambda: len(sibling.reports()) >= 20, what="20 reports taken")
            # Past the peers' request timeout (0.5 s), the same stream carries them.
            await asyncio.sleep(0.8)
            n = len(sibling.reports())
            await changes(gossip, 5)
            await eventually(lambda: len(sibling.reports()) >= n + 5, what="5 more reports")
            assert sibling.asked == [("GET", STREAM_PATH)]  # one upgrade; not a POST per report
            assert gossip.streaming_to() == [url]
            assert set(outcomes) <= {"ok", "busy"} and "ok" in outcomes  # ok: answered TAKEN
    finally:
        await sibling.stop()


async def test_a_sibling_that_restarts_gets_a_new_stream_and_its_stop_is_not_held_by_it():
    sibling = Sibling()
    url = await sibling.start()
    async with gossiping(url) as (gossip, _):
        await changes(gossip, 5)
        await eventually(lambda: len(sibling.reports()) >= 5, what="reports over the first stream")
        t = time.monotonic()
        await sibling.stop()  # its shutdown_timeout is 10 s: an open stream must not wait it out
        assert time.monotonic() - t < 3
        await sibling.start()  # the same port, a new process as far as the sender can tell
        n = len(sibling.reports())
        await eventually(lambda: len(sibling.reports()) > n, timeout=10, what="reports over a new stream")
        assert sibling.asked.count(("GET", STREAM_PATH)) == 2
        assert ("POST", "/internal/load") not in sibling.asked
    await sibling.stop()


async def test_a_stream_the_sibling_closed_while_idle_is_reopened_for_the_next_report(monkeypatch):
    """Nothing reads a stream between reports, so the sender learns of the sibling's close only as it
    sends: the report goes again, on a new stream, and is not lost."""
    monkeypatch.setattr(internal_http, "STREAM_IDLE_S", 0.1)
    monkeypatch.setattr(internal_http, "STREAM_CLOSE_S", 0.1)
    sibling = Sibling()
    url = await sibling.start()
    try:
        async with gossiping(url, config=GossipConfig(window_s=0.001, heartbeat_s=60)) as (gossip, outcomes):
            await changes(gossip, 4, every_s=0.5)  # each report after its stream was closed, and gone
            await eventually(lambda: len(sibling.reports()) == 4, what="4 reports taken")
        assert outcomes == ["ok"] * 4  # not one lost to a stream found closed
        assert sibling.asked == [("GET", STREAM_PATH)] * 4
    finally:
        await sibling.stop()


async def test_a_sibling_of_an_older_release_gets_its_reports_posted_and_is_asked_again_later():
    posted: list[bytes] = []
    upgrades = 0

    async def load(request: web.Request) -> web.Response:
        posted.append(await request.read())
        return web.Response(status=204)

    async def no_stream(request: web.Request) -> web.Response:
        nonlocal upgrades
        upgrades += 1
        return web.Response(status=404)

    clock = Clock()
    async with (
        loopback_app(web.post("/internal/load", load), web.get(STREAM_PATH, no_stream)) as url,
        gossiping(url, clock=clock) as (gossip, outcomes),
    ):
        await changes(gossip, 10)
        await eventually(lambda: len(posted) >= 10, what="10 reports posted")
        assert upgrades == 1  # asked once, then posted to
        clock.now += STREAM_RETRY_S + 1
        await changes(gossip, 3)
        await eventually(lambda: len(posted) >= 13, what="3 more reports posted")
        assert upgrades == 2
    assert b'"replica":"a"' in posted[0]
    assert "ok" in outcomes and not [o for o in outcomes if o not in ("ok", "busy")]


async def test_a_sibling_refusing_the_stream_for_a_while_is_asked_again_and_never_posted_to():
    """A 503 to the upgrade (a sibling stopping, or at its connection cap) is not an older release: it
    is counted for each report, and asked again after REFUSAL_HOLD_S (not a connection per round)."""
    upgrades = 0

    async def busy(request: web.Request) -> web.Response:
        nonlocal upgrades
        upgrades += 1
        return web.Response(status=503)

    async def load(request: web.Request) -> web.Response:
        raise AssertionError("posted to a sibling that serves streams")

    clock = Clock()
    async with (
        loopback_app(web.get(STREAM_PATH, busy), web.post("/internal/load", load)) as url,
        gossiping(url, clock=clock) as (gossip, outcomes),
    ):
        await changes(gossip, 10)
        await eventually(lambda: outcomes.count("http_5xx") >= 5, what="5 reports counted refused")
        assert upgrades == 1
        clock.now += REFUSAL_HOLD_S
        await changes(gossip, 3)
        await eventually(lambda: upgrades == 2, what="the stream asked for again")
    assert set(outcomes) <= {"http_5xx", "busy"}


async def test_a_wrong_token_opens_no_stream_and_says_so():
    sibling = Sibling(token="another-fleet")
    url = await sibling.start()
    try:
        async with gossiping(url) as (gossip, outcomes):
            await changes(gossip, 5)
            await eventually(lambda: outcomes.count("http_4xx") >= 3, what="3 reports refused")
        assert sibling.taken == []
        assert sibling.asked == [("GET", STREAM_PATH)]  # one connection, then the refusal held
        assert ("POST", "/internal/load") not in sibling.asked  # no fallback: the token is wrong
    finally:
        await sibling.stop()


async def test_a_sibling_that_never_answers_costs_one_connection_and_a_timeout_per_report():
    """A peer that takes the stream and reads but never answers: each report times out (the send
    timeout), the rounds meanwhile are ``busy``, and the sender holds at most one connection to it."""
    open_now = most = 0

    async def silent(request: web.Request) -> web.WebSocketResponse:
        nonlocal open_now, most
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        open_now += 1
        most = max(most, open_now)
        try:
            async for _ in ws:
                pass
        finally:
            open_now -= 1
        return ws

    config = GossipConfig(window_s=0.001, heartbeat_s=0.02, timeout_s=0.2)
    async with loopback_app(web.get(STREAM_PATH, silent)) as url:
        async with gossiping(url, config=config) as (_, outcomes):
            await eventually(lambda: outcomes.count("timeout") >= 3, timeout=10, what="3 timed-out reports")
            assert "busy" in outcomes and "ok" not in outcomes
            assert most == 1
        await eventually(lambda: open_now == 0, what="the sender's stop closed its stream")
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("gossip")]


async def test_what_a_stream_carries_is_vetted_and_answered_one_message_at_a_time():
    """Text, bytes that are no report, a report refused by vetting and a message of exactly the bound
    are each answered REFUSED and counted; a good report TAKEN (the stream goes on); a message over the
    bound ends the stream."""
    sibling = Sibling()
    url = await sibling.start()
    good = encode_report("b", "inc-2", 7, [TargetReport("e", 0, 3, 30)])
    try:
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(url + STREAM_PATH, headers={"Authorization": f"Bearer {TOKEN}"}) as ws:

                async def answer(send) -> bytes:
                    await send
                    msg = await asyncio.wait_for(ws.receive(), 5)
                    assert msg.type is aiohttp.WSMsgType.BINARY, msg
                    return msg.data

                assert await answer(ws.send_str(good.decode())) == REFUSED
                assert await answer(ws.send_bytes(b"\xc1" * 64)) == REFUSED
                assert await answer(ws.send_bytes(b" " * MAX_BODY_BYTES)) == REFUSED  # at the bound: read
                assert await answer(ws.send_bytes(good)) == TAKEN
                assert [r is None for r in sibling.taken] == [True, True, True, False]
                assert sibling.reports()[0].seq == 7
                await ws.send_bytes(b" " * (MAX_BODY_BYTES + 1))
                msg = await asyncio.wait_for(ws.receive(), 5)
                assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
            assert sibling.taken[4:] == [None]  # the one over the bound: refused, and counted
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await s.ws_connect(url + STREAM_PATH)  # no token
            assert refused.value.status == 401
    finally:
        await sibling.stop()


async def test_a_refused_report_is_counted_as_refused_by_its_sender():
    sibling = Sibling()
    url = await sibling.start()
    try:
        gossip = LoadGossip(TOKEN, lambda: [url], lambda: b"{}", FAST, on_sent=(outcomes := []).append)
        task = asyncio.create_task(gossip.run())
        try:
            await changes(gossip, 3)
            await eventually(lambda: "refused" in outcomes, what="a refused report")
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert sibling.reports() == [] and sibling.taken[0] is None
    finally:
        await sibling.stop()


LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F")  # 127.0.0.1 in /proc/net/tcp and tcp6


def _connections_to(port: int) -> int:
    """Sockets in this network namespace connected to 127.0.0.1:``port`` from another port (the sender's
    side of each connection to a server listening there), in any state but TIME_WAIT (nothing is held
    then)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for line in list(f)[1:]:
                local, remote, state = line.split()[1:4]
                address, remote_port = remote.rsplit(":", 1)
                if address not in LOOPBACK or int(remote_port, 16) != port:
                    continue
                if int(local.rsplit(":", 1)[1], 16) != port:
                    n += state != "06"  # TIME_WAIT
    return n


async def a_sibling_that_reads_nothing() -> None:
    """A peer that takes the stream, answers ahead and reads nothing: the sender's reports fill the
    connection until a send times out and the stream is dropped. Each dropped stream's connection is let
    go (reset), not kept with its unsent bytes, so the sender holds at most the open stream and the one
    closing, however many it drops, and none after its stop."""
    held: list[web.WebSocketResponse] = []
    done = asyncio.Event()

    async def hoarder(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        held.append(ws)
        for _ in range(2000):  # answers ahead: each report is "taken" while nothing reads it
            await ws.send_bytes(TAKEN)
        await done.wait()
        return ws

    body = b" " * (MAX_BODY_BYTES - 1)
    config = GossipConfig(window_s=0.001, heartbeat_s=0.005, timeout_s=0.2)
    async with loopback_app(web.get(STREAM_PATH, hoarder)) as url:
        port = int(url.rsplit(":", 1)[1])
        gossip = LoadGossip(TOKEN, lambda: [url], lambda: body, config, on_sent=(outcomes := []).append)
        task = asyncio.create_task(gossip.run())
        try:
            most = 0
            deadline = time.monotonic() + 20
            while len(held) < 4 and time.monotonic() < deadline:
                most = max(most, _connections_to(port))
                await asyncio.sleep(0.01)
            assert len(held) >= 4, f"streams opened: {len(held)}; outcomes: {set(outcomes)}"
            assert "timeout" in outcomes
            assert most <= 2, f"the sender held {most} connections to a peer that reads nothing"
            n = outcomes.count("busy")  # a send blocked on the full connection: the stop comes then
            await eventually(lambda: outcomes.count("busy") > n + 2, what="a blocked send")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await eventually(lambda: _connections_to(port) == 0, what="no connection left after the stop")
        finally:
            task.cancel()
            done.set()  # the server's stop waits for its handlers


async def test_a_sibling_that_reads_nothing_keeps_no_dropped_stream_of_the_sender():
    await a_sibling_that_reads_nothing()


def test_a_sibling_that_reads_nothing_keeps_no_dropped_stream_of_the_sender_under_uvloop():
    """The same on uvloop, the loop a router runs on (its socket objects refuse a shutdown)."""
    uvloop.run(a_sibling_that_reads_nothing())


async def test_a_sender_that_reads_no_answer_does_not_hold_the_siblings_stop():
    """A sender that sends and never reads the answers (a raw socket with a small receive buffer):
    once they fill its connection, the sibling's handler waits to answer (bounded by the idle bound,
    10 s). The sibling's stop closes that stream within its close bound (1 s) rather than waiting."""
    sibling = Sibling()
    await sibling.start()
    assert sibling.runner is not None
    for site in sibling.runner.sites:  # small send buffers (accepted sockets inherit them): blocked sooner
        for listening in site._server.sockets:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock = socket.socket()
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", sibling.port))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
        key = base64.b64encode(b"0123456789abcdef").decode()
        headers = {
            "Host": "127.0.0.1",
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": key,
            "Sec-WebSocket-Version": "13",
            "Authorization": f"Bearer {TOKEN}",
        }
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        writer.write(f"GET {STREAM_PATH} HTTP/1.1\r\n{head}\r\n".encode())
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 101")
        frame = b"\x82\x81\x00\x00\x00\x00x"  # a masked one-byte binary message (a zero mask), refused
        sent = 0
        async with asyncio.timeout(20):
            while True:  # until the sibling stops taking them: its answers are blocked
                writer.write(frame * 1000)
                sent += 1000
                n = len(sibling.taken)
                await asyncio.sleep(0.05)
                if len(sibling.taken) == n < sent:
                    break
        t = time.monotonic()
        await sibling.stop()  # its shutdown_timeout is 10 s, as the idle bound
        assert time.monotonic() - t < 5
        writer.close()
    finally:
        sock.close()
        if sibling.runner is not None:
            await sibling.stop()
