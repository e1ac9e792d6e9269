"""The proxy over real HTTP: a router on 127.0.0.1 in front of real fake engines (and, for header
checks, a small recording upstream). Completions and chat, streaming and not; every error path;
retry, timeouts, client disconnects, hop-by-hop headers, the circuit breaker, /v1/models, /readyz."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import time

import aiohttp
import pytest
from aiohttp import web

from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig, Timeouts
from router_runtime.proxy.health import BreakerConfig, BreakerState, HealthConfig
from router_runtime.scheduling.framework import Choice, Cycle, Profile, Scored
from router_runtime.scheduling.types import Reason, Target
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import closed_port_url, eventually, loopback_app

ENGINE_HEADER = "X-RouterFleet-Engine"


def http_worker(url: str, dp: int = 1) -> WorkerSpec:
    return WorkerSpec(url, url, dp_size=dp)


class PreferEngines:
    """A stand-in picker: the first candidate of the preferred engines (else the first), recording the
    candidates it was offered."""

    name = "prefer"

    def __init__(self, engines: tuple[str, ...]) -> None:
        self.engines = engines
        self.seen: list[tuple[Target, ...]] = []

    def pick(self, cycle: Cycle, scored: Scored) -> Choice:
        targets = cycle.targets
        self.seen.append(tuple(targets))
        for engine in self.engines:
            for i, t in enumerate(targets):
                if t.engine == engine:
                    return Choice(i, Reason.LEAST_LOADED)
        return Choice(0, Reason.LEAST_LOADED)


def preferring(*engines: str) -> Profile:
    return Profile("prefer", picker=PreferEngines(engines))


@contextlib.asynccontextmanager
async def routed(workers, policy=None, **sections):
    sections.setdefault("health", HealthConfig(interval_s=0))
    # Named: the tests read where each request went in X-RouterFleet-Engine.
    sections["proxy"] = dataclasses.replace(sections.get("proxy", ProxyConfig()), engine_header=True)
    cfg = RouterConfig(
        port=0, metrics=LOCAL_METRICS, workers=tuple(workers), kv=KvConfig(block_size=4), **sections
    )
    async with run_router(cfg, policy=policy) as (router, url), aiohttp.ClientSession() as session:
        yield router, url, session


def breakers(failures: int) -> HealthConfig:
    return HealthConfig(interval_s=0, breaker=BreakerConfig(failures=failures))


def timeouts(**bounds: float) -> ProxyConfig:
    return ProxyConfig(timeouts=Timeouts(**bounds))


def sample(router, name: str, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


def sse_events(raw: bytes) -> list:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def stream_text(events: list) -> str:
    text = ""
    for e in events:
        if e == "[DONE]":
            continue
        for c in e["choices"]:
            text += c.get("text") or c.get("delta", {}).get("content") or ""
    return text


COMPLETION = {"prompt": "the quick brown fox jumps", "max_tokens": 7}
CHAT = {
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "max_tokens": 5,
}


async def post(session, url, body, path="/v1/completions", **kw):
    async with session.post(url + path, json=body, **kw) as r:
        return r.status, r.headers.copy(), await r.read()


# ------------------------------------------------------------------------------------ happy paths


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_non_streaming_through_the_router_matches_the_engine(path, body):
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(engine.http_url)]) as (router, url, s),
    ):
        status, direct_headers, direct = await post(s, engine.http_url, body, path)
        assert status == 200
        status, headers, routed_body = await post(s, url, body, path)
        assert status == 200
        assert headers[ENGINE_HEADER] == engine.http_url
        assert headers["Content-Type"] == direct_headers["Content-Type"]
        assert int(headers["Content-Length"]) == len(routed_body)
        a, b = json.loads(direct), json.loads(routed_body)
        assert a["choices"] == b["choices"] and a["object"] == b["object"]
        assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
        assert (
            sample(router, "routerfleet_requests_total", policy="kv_aware", outcome="ok", status="200") == 1
        )
        assert router.load.total == 0


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
async def test_streaming_is_relayed_chunk_by_chunk(path, body):
    body = {**body, "stream": True, "max_tokens": 8, "stream_options": {"include_usage": True}}
    async with (
        run_fake_engine(block_size=4, decode_tokens_per_s=100) as engine,
        routed([http_worker(engine.http_url)]) as (router, url, s),
    ):
        _, _, direct = await post(s, engine.http_url, body, path)
        async with s.post(url + path, json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers[ENGINE_HEADER] == engine.http_url
            arrivals, raw = [], b""
            async for chunk in r.content.iter_any():
                arrivals.append(time.monotonic())
                raw += chunk
        # 8 tokens 10 ms apart: a buffering proxy would deliver one lump at the end.
        assert len(arrivals) >= 4, arrivals
        assert arrivals[-1] - arrivals[0] >= 0.04
        events, direct_events = sse_events(raw), sse_events(direct)
        assert events[-1] == "[DONE]" and len(events) == len(direct_events)
        assert stream_text(events) == stream_text(direct_events) and len(stream_text(events)) == 8
        assert events[-2]["usage"]["completion_tokens"] == 8
        await eventually(lambda: router.load.total == 0, what="load released")


async def test_token_id_and_nested_prompts_and_upstream_errors_pass_through():
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(engine.http_url)]) as (router, url, s),
    ):
        for prompt in ([5, 6, 7, 8, 9], [[5, 6, 7, 8, 9]]):
            status, _, body = await post(s, url, {"prompt": prompt, "max_tokens": 3})
            assert status == 200 and json.loads(body)["usage"]["prompt_tokens"] == 5
        # Valid for the router, invalid for the engine: the engine's answer comes back as it is.
        bad = {"prompt": "x", "max_tokens": -1}
        d_status, _, d_body = await post(s, engine.http_url, bad)
        status, headers, body = await post(s, url, bad)
        assert (status, body) == (d_status, d_body) == (400, d_body)
        assert headers[ENGINE_HEADER] == engine.http_url
        assert sample(
            router, "routerfleet_requests_total", policy="kv_aware", outcome="upstream_status", status="400"
        )


# ------------------------------------------------------------------------------------- client errors


def assert_openai_error(status, body, want_status, param=None):
    assert status == want_status
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


async def test_bad_json_invalid_bodies_and_oversized_bodies():
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(engine.http_url)], proxy=ProxyConfig(max_body_bytes=1000)) as (router, url, s),
    ):
        async with s.post(url + "/v1/completions", data=b'{"prompt": ') as r:
            assert_openai_error(r.status, await r.read(), 400)
        cases = [
            ("/v1/completions", {"max_tokens": 1}, "prompt"),
            ("/v1/completions", {"prompt": [1, 2, "x"]}, "prompt"),
            ("/v1/completions", {"prompt": [1.5]}, "prompt"),
            ("/v1/completions", {"prompt": "x", "stream": "true"}, "stream"),
            ("/v1/chat/completions", {"messages": []}, "messages"),
            ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages"),
        ]
        for path, body, param in cases:
            status, _, raw = await post(s, url, body, path)
            assert_openai_error(status, raw, 400, param)
        # Over the limit: by Content-Length, and streamed in chunks with no length.
        status, _, raw = await post(s, url, {"prompt": "x" * 2000})
        assert_openai_error(status, raw, 413)

        async def chunks():
            for _ in range(20):
                yield b" " * 100

        async with s.post(url + "/v1/completions", data=chunks()) as r:
            assert_openai_error(r.status, await r.read(), 413)
        assert sum(engine.rank_stats[0].requests.values()) == 0  # nothing reached the engine
        assert (
            sample(router, "routerfleet_requests_total", policy="kv_aware", outcome="invalid", status="400")
            == 7
        )
        assert (
            sample(router, "routerfleet_requests_total", policy="kv_aware", outcome="invalid", status="413")
            == 2
        )


# ------------------------------------------------------------------------------- no engine, 502, retry


async def test_503_without_engines_and_readiness():
    async with routed([]) as (_router, url, s):
        status, _, raw = await post(s, url, COMPLETION)
        assert assert_openai_error(status, raw, 503)["code"] == "no_engine_available"
        async with s.get(url + "/v1/models") as r:
            assert r.status == 503
        async with s.get(url + "/readyz") as r:
            assert r.status == 503 and (await r.json())["reason"] == "no engines discovered"
        async with s.get(url + "/healthz") as r:
            assert r.status == 200


async def test_502_when_every_engine_refuses_after_one_retry_then_503_when_all_breakers_are_open():
    dead = [closed_port_url(), closed_port_url()]
    async with routed([http_worker(u) for u in dead], policy=preferring(), health=breakers(1)) as (
        router,
        url,
        s,
    ):
        status, headers, raw = await post(s, url, COMPLETION)
        assert assert_openai_error(status, raw, 502)["code"] == "upstream_connect_failed"
        assert headers[ENGINE_HEADER] in dead
        assert sample(router, "routerfleet_retries_total", reason="connect") == 1  # exactly one retry
        assert router.load.total == 0
        assert {router.health.state(u) for u in dead} == {BreakerState.OPEN}
        status, _, raw = await post(s, url, COMPLETION)
        assert_openai_error(status, raw, 503)
        async with s.get(url + "/readyz") as r:
            assert r.status == 503 and (await r.json())["reason"] == "no healthy engine"


async def test_a_refused_connection_retries_once_on_another_engine():
    dead = closed_port_url()
    policy = preferring(dead)
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(dead), http_worker(engine.http_url)], policy=policy) as (router, url, s),
    ):
        status, headers, raw = await post(s, url, COMPLETION)
        assert status == 200 and headers[ENGINE_HEADER] == engine.http_url
        assert json.loads(raw)["choices"][0]["text"]
        assert sample(router, "routerfleet_retries_total", reason="connect") == 1
        # The retry asked the policy again, without the engine that failed.
        seen = policy.picker.seen
        assert [len(ts) for ts in seen] == [2, 1] and seen[1][0].engine == engine.http_url
        assert (
            sample(router, "routerfleet_routing_decisions_total", policy="prefer", reason="least_loaded") == 2
        )
        assert router.load.total == 0


@contextlib.asynccontextmanager
async def raw_upstream(reply: bytes):
    """An engine that reads a request, writes ``reply`` and closes the connection."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def test_502_when_the_engine_closes_before_responding():
    async with raw_upstream(b"") as upstream, routed([http_worker(upstream)]) as (router, url, s):
        status, headers, raw = await post(s, url, COMPLETION)
        assert assert_openai_error(status, raw, 502)["code"] == "upstream_disconnected"
        assert headers[ENGINE_HEADER] == upstream
        assert sample(router, "routerfleet_retries_total", reason="connect") == 0  # it may have run: no retry
        assert router.load.total == 0


async def test_an_engine_that_dies_mid_stream_truncates_the_client_response():
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunk = b'data: {"choices": []}\n\n'
    reply = head + f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"  # no terminating chunk
    async with raw_upstream(reply) as upstream, routed([http_worker(upstream)]) as (router, url, s):
        async with s.post(url + "/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status == 200
            assert await r.content.readany() == chunk  # what arrived was relayed...
            with pytest.raises(aiohttp.ClientPayloadError):  # ...and the end is not faked
                await r.read()
        await eventually(
            lambda: sample(
                router,
                "routerfleet_requests_total",
                policy="kv_aware",
                outcome="upstream_error",
                status="200",
            ),
            what="counted as an upstream error",
        )
        assert router.load.total == 0


# ------------------------------------------------------------------------------------------- timeouts


async def test_504_when_the_first_byte_is_late():
    async with (
        run_fake_engine(block_size=4, prefill_us_per_token=1e6) as engine,
        routed([http_worker(engine.http_url)], proxy=timeouts(first_byte_s=0.2)) as (router, url, s),
    ):
        t = time.monotonic()
        status, headers, raw = await post(s, url, {"prompt": "slow prompt", "max_tokens": 1})
        assert time.monotonic() - t < 5
        assert assert_openai_error(status, raw, 504)["code"] == "first_byte_timeout"
        assert headers[ENGINE_HEADER] == engine.http_url
        assert router.load.total == 0
        assert (
            sample(router, "routerfleet_requests_total", policy="kv_aware", outcome="timeout", status="504")
            == 1
        )
        assert router.health.state(engine.http_url) is BreakerState.CLOSED  # slow is not dead


async def test_an_idle_stream_is_cut_not_completed():
    async with (
        run_fake_engine(block_size=4, decode_tokens_per_s=4) as engine,
        routed([http_worker(engine.http_url)], proxy=timeouts(idle_s=0.1)) as (router, url, s),
    ):
        async with s.post(
            url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 50}
        ) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
        await eventually(
            lambda: router.load.total == 0 and engine.load.running == 0, what="both sides released"
        )
        assert (
            sample(router, "routerfleet_requests_total", policy="kv_aware", outcome="timeout", status="200")
            == 1
        )


async def test_a_client_that_stops_reading_is_cut_at_the_deadline_even_after_the_engine_ended():
    """The stream's end (the usage strip's held tail, then the final chunk) waits for the client's
    socket too: a client that stopped reading holds the request, its load and its prediction no longer
    than ``total_s``, as it does mid-stream."""

    async def engine(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"index":0,"text":"a"}]}\n\n')
        # The last event, 12 MiB with no blank line after it: the strip holds it until the end.
        tail = b'data: {"choices":[{"index":0,"text":"' + b"x" * (12 << 20) + b'"}]}'
        for i in range(0, len(tail), 1 << 16):
            await resp.write(tail[i : i + (1 << 16)])
        await resp.write_eof()
        return resp

    async with (
        loopback_app(web.post("/v1/completions", engine)) as engine_url,
        routed([http_worker(engine_url)], proxy=timeouts(total_s=2)) as (router, url, _s),
    ):
        host, port = url.removeprefix("http://").split(":")
        _reader, writer = await asyncio.open_connection(host, int(port))  # and never reads
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        body = json.dumps({"prompt": list(range(1, 40)), "stream": True}).encode()
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        writer.write(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        try:
            await eventually(lambda: router.load.total == 1, what="the request under way")
            await eventually(lambda: router.load.total == 0, timeout=10, what="the request cut and released")
            assert sample(
                router, "routerfleet_requests_total", policy="kv_aware", outcome="timeout", status="200"
            )
        finally:
            writer.close()


# ---------------------------------------------------------------------------------- client disconnect


async def test_a_client_that_disconnects_mid_stream_cancels_the_engine_request():
    async with (
        run_fake_engine(block_size=4, decode_tokens_per_s=20) as engine,
        routed([http_worker(engine.http_url)]) as (router, url, s),
    ):
        r = await s.post(url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 1000})
        assert r.status == 200
        await r.content.readany()  # the stream is flowing
        assert engine.load.running == 1 and router.load.total == 1
        r.close()  # the client goes away ~50 s before the stream would end
        await eventually(lambda: engine.load.running == 0, what="the engine's request cancelled")
        await eventually(lambda: router.load.total == 0, what="the router's load released")
        await eventually(
            lambda: sample(
                router, "routerfleet_requests_total", policy="kv_aware", outcome="cancelled", status="200"
            ),
            what="counted as cancelled",
        )
        assert sample(router, "routerfleet_inflight", engine=engine.http_url) == 0


async def test_a_client_that_disconnects_while_waiting_cancels_the_engine_request():
    async with (
        run_fake_engine(block_size=4, prefill_us_per_token=1e6) as engine,
        routed([http_worker(engine.http_url)]) as (router, url, s),
    ):
        task = asyncio.create_task(post(s, url, {"prompt": "slow", "max_tokens": 1}))
        await eventually(lambda: engine.load.running == 1, what="the request reached the engine")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await eventually(lambda: router.load.total == 0, what="the router's load released")
        await eventually(
            lambda: sample(
                router, "routerfleet_requests_total", policy="kv_aware", outcome="cancelled", status="499"
            ),
            what="counted as cancelled before any byte",
        )


# ---------------------------------------------------------------------------------------- headers


@contextlib.asynccontextmanager
async def recording_upstream():
    """An engine stand-in that records request headers and answers with hop-by-hop headers."""
    seen: list = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.copy())
        await request.read()
        resp = web.StreamResponse(
            headers={
                "Connection": "X-Resp-Hop",
                "X-Resp-Hop": "1",
                "Keep-Alive": "timeout=99",
                "Proxy-Authenticate": "Basic",
                "Trailer": "X-Trailer",
                "X-End-To-End": "kept",
                "Content-Type": "application/json",
            }
        )
        await resp.prepare(request)
        await resp.write(b'{"ok": true}')
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


async def raw_request(url: str, head: str, body: bytes) -> tuple[str, dict[str, str], bytes]:
    """One HTTP/1.1 exchange on a raw socket, so the request carries exactly these headers."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
    await writer.drain()
    status_line = (await reader.readline()).decode().strip()
    headers: dict[str, str] = {}
    while (line := (await reader.readline()).decode().strip()) != "":
        name, _, value = line.partition(":")
        headers.setdefault(name.strip().lower(), value.strip())
    payload = await reader.read()
    writer.close()
    return status_line, headers, payload


async def test_hop_by_hop_headers_are_stripped_both_ways_and_the_rank_is_pinned():
    async with (
        recording_upstream() as (upstream, seen),
        routed([http_worker(upstream, dp=2)]) as (_router, url, _s),
    ):
        body = json.dumps({"prompt": [1, 2, 3, 4, 5]}).encode()
        head = (
            "POST /v1/completions?x=1 HTTP/1.1\n"
            "Host: router.example\n"
            "Connection: close, X-Req-Hop\n"
            "X-Req-Hop: secret\n"
            "Keep-Alive: timeout=5\n"
            "TE: trailers\n"
            "Proxy-Authorization: Basic abc\n"
            "X-Data-Parallel-Rank: 7\n"
            "Authorization: Bearer key\n"
            "X-Request-Id: r1\n"
            "Accept-Encoding: gzip\n"
            "Content-Type: application/json\n"
            f"Content-Length: {len(body)}\n"
        )
        status_line, headers, payload = await raw_request(url, head, body)
        assert status_line.startswith("HTTP/1.1 200")
        got = seen[0]
        # Nor an Accept-Encoding: the router reads the answer (a compressed one would pass unread).
        for hop in ("X-Req-Hop", "Keep-Alive", "TE", "Proxy-Authorization", "Accept-Encoding"):
            assert hop not in got, hop
        assert got["Authorization"] == "Bearer key" and got["X-Request-Id"] == "r1"
        assert got["Host"] != "router.example"
        # kv_aware targets each rank of a dp=2 engine and pins it; the client's own rank is dropped.
        assert got["X-Data-Parallel-Rank"] in ("0", "1")
        for hop in ("x-resp-hop", "keep-alive", "proxy-authenticate", "trailer"):
            assert hop not in headers, hop
        assert headers["x-end-to-end"] == "kept" and headers[ENGINE_HEADER.lower()] == upstream
        assert json.loads(payload.split(b"\r\n")[1] if b"\r\n" in payload else payload) == {"ok": True}
        # A body without a Content-Type was parsed as JSON, and is labelled so for the engine.
        head = f"POST /v1/completions HTTP/1.1\nHost: r\nConnection: close\nContent-Length: {len(body)}\n"
        status_line, _, _ = await raw_request(url, head, body)
        assert status_line.startswith("HTTP/1.1 200") and seen[1]["Content-Type"] == "application/json"


async def test_whole_engine_policies_do_not_pin_a_rank():
    async with (
        recording_upstream() as (upstream, seen),
        routed([http_worker(upstream, dp=2)], policy=preferring()) as (_router, url, s),
    ):
        status, _, _ = await post(s, url, {"prompt": "x"}, headers={"X-Data-Parallel-Rank": "1"})
        assert status == 200 and "X-Data-Parallel-Rank" not in seen[0]


# ------------------------------------------------------------------------------------ circuit breaker


async def test_the_breaker_takes_a_dead_engine_out_and_brings_it_back():
    async with run_fake_engine(block_size=4) as a:
        b_engine = run_fake_engine(block_size=4)
        b = await b_engine.__aenter__()
        b_url, b_port = b.http_url, b.port
        try:
            async with routed(
                [http_worker(a.http_url), http_worker(b_url)],
                policy=preferring(b_url),
                health=HealthConfig(interval_s=0.05, breaker=BreakerConfig(failures=2, cooldown_s=0.2)),
            ) as (router, url, s):
                _, headers, _ = await post(s, url, COMPLETION)
                assert headers[ENGINE_HEADER] == b_url
                await b_engine.__aexit__(None, None, None)
                await eventually(lambda: router.health.state(b_url) is BreakerState.OPEN, what="breaker open")
                for _ in range(3):
                    status, headers, _ = await post(s, url, COMPLETION)
                    assert status == 200 and headers[ENGINE_HEADER] == a.http_url
                assert router.ready() == (True, "ready")
                # The engine comes back on the same port: the next health check after the cooldown closes it.
                b_engine = run_fake_engine(dataclasses.replace(b.config, port=b_port))
                await b_engine.__aenter__()
                await eventually(
                    lambda: router.health.state(b_url) is BreakerState.CLOSED, what="breaker closed"
                )
                status, headers, _ = await post(s, url, COMPLETION)
                assert status == 200 and headers[ENGINE_HEADER] == b_url
                assert sample(router, "routerfleet_breaker_transitions_total", state="open") >= 1
                assert sample(router, "routerfleet_breaker_transitions_total", state="closed") >= 1
                async with s.get(router.metrics_url + "/metrics") as r:
                    assert 'routerfleet_engines{state="closed"} 2.0' in await r.text()
        finally:
            await b_engine.__aexit__(None, None, None)


async def test_5xx_answers_to_client_requests_never_open_the_breaker():
    """Any client can make an engine fail its own request (a bad body, a huge prompt): those 5xx are
    passed through and cost the engine nothing; the engine stays in rotation."""
    calls = []

    async def fail(request: web.Request) -> web.Response:
        calls.append(1)
        return web.json_response({"error": {"message": "boom"}}, status=500)

    app = web.Application()
    app.router.add_post("/v1/completions", fail)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    bad = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with (
            run_fake_engine(block_size=4) as good,
            routed(
                [http_worker(bad), http_worker(good.http_url)], policy=preferring(bad), health=breakers(2)
            ) as (router, url, s),
        ):
            for _ in range(6):
                status, _headers, raw = await post(s, url, COMPLETION)
                assert status == 500 and json.loads(raw)["error"]["message"] == "boom"  # passed through
            assert router.health.state(bad) is BreakerState.CLOSED and len(calls) == 6
            async with s.get(url + "/readyz") as r:
                assert r.status == 200
    finally:
        await runner.cleanup()


async def test_a_gzip_body_is_forwarded_decoded_and_cannot_open_a_breaker():
    """A valid gzip request body (Content-Encoding: gzip) reaches the engine as the JSON it encodes,
    without the encoding header; many of them in a row leave every engine in rotation."""
    import gzip

    async with (
        run_fake_engine(block_size=4) as e,
        routed([http_worker(e.http_url)], health=breakers(2)) as (
            router,
            url,
            s,
        ),
    ):
        body = gzip.compress(json.dumps(COMPLETION).encode())
        headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
        for _ in range(8):
            async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["prompt_tokens"] == len(COMPLETION["prompt"])
        assert router.health.state(e.http_url) is BreakerState.CLOSED
        async with s.get(url + "/readyz") as r:
            assert r.status == 200


# ------------------------------------------------------------------------------------------- models


async def test_models_are_aggregated_over_healthy_engines_and_deduplicated():
    async with (
        run_fake_engine(model="m-one") as e1,
        run_fake_engine(model="m-one") as e2,
        run_fake_engine(model="m-two") as e3,
    ):
        workers = [http_worker(e.http_url) for e in (e1, e2, e3)] + [http_worker(closed_port_url())]
        async with routed(workers) as (_router, url, s), s.get(url + "/v1/models") as r:
            assert r.status == 200
            body = await r.json()
            assert body["object"] == "list"
            assert sorted(m["id"] for m in body["data"]) == ["m-one", "m-two"]


# ------------------------------------------------------------------------------------------ load


async def test_load_accounting_is_exact_under_concurrency_errors_and_cancels():
    dead = closed_port_url()
    async with (
        run_fake_engine(block_size=4, decode_tokens_per_s=200) as engine,
        routed(
            [http_worker(engine.http_url), http_worker(dead)], policy=preferring(dead, engine.http_url)
        ) as (
            router,
            url,
            s,
        ),
    ):
        peak = 0

        async def one(i: int):
            nonlocal peak
            body = {"prompt": f"request {i}", "max_tokens": 10, "stream": i % 2 == 0}
            if i % 5 == 0:
                body["max_tokens"] = -1  # an engine 400
            async with s.post(url + "/v1/completions", json=body) as r:
                peak = max(peak, router.load.total)
                if i % 7 == 0:
                    await r.content.readany()
                    r.close()  # a client that leaves early
                    return
                await r.read()

        await asyncio.gather(*(one(i) for i in range(40)))
        assert peak > 1
        await eventually(lambda: router.load.total == 0 and not router.load.view, what="no load left")
        await eventually(lambda: engine.load.running == 0, what="engine idle")
        assert sample(router, "routerfleet_inflight", engine=engine.http_url) == 0
        assert sample(router, "routerfleet_routing_decision_seconds_count") >= 40
