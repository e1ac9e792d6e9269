"""Hostile and careless client input over real HTTP: every case gets a clear 4xx in OpenAI's error shape
(never a 500 with a traceback), nothing reaches an engine that the engine could not take, and the
router stays healthy and in rotation afterwards. Raw sockets where a client library would refuse to
send the bytes."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import zlib

import aiohttp
import pytest

from router_runtime.app import run_router
from router_runtime.bootstrap.config import InternalConfig, PeerConfig
from router_runtime.bootstrap.sweep import BootstrapConfig
from router_runtime.config import RouterConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.gossip import GossipConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.health import BreakerState, HealthConfig
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, snapshot_peer
from .test_proxy_http import breakers

BS = 4
TOKEN = "hostile-s3cret"
PROMPT = {"prompt": "the quick brown fox", "max_tokens": 3}


@contextlib.asynccontextmanager
async def router_over_engine(tmp_path, *, events: bool = False, **sections):
    """A router over one fake engine (``events``: subscribed to its KV events too); ``sections``:
    RouterConfig sections in place of these defaults."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with run_fake_engine(block_size=BS) as engine:
        streams = {"kv": engine.kv_endpoint(0), "replay": engine.replay_endpoint(0)} if events else {}
        defaults = {
            "internal": InternalConfig(port=0, token_file=str(token)),
            "kv": KvConfig(block_size=BS),
            "health": breakers(2),
        }
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=(WorkerSpec(engine.http_url, engine.http_url, **streams),),
            **{**defaults, **sections},
        )
        async with (
            run_router(cfg) as (router, url),
            # one connection per request: a body the server could not frame closes its connection
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
        ):
            yield engine, router, url, s


async def assert_healthy(router, url, s, engine) -> None:
    async with s.post(url + "/v1/completions", json=PROMPT) as r:
        assert r.status == 200, await r.text()
    async with s.get(url + "/readyz") as r:
        assert r.status == 200
    assert router.health.state(engine.http_url) is BreakerState.CLOSED


def gzipped(obj) -> bytes:
    return gzip.compress(json.dumps(obj).encode())


PLAIN = json.dumps(PROMPT).encode()
BAD = "invalid_request"
GZ = {"Content-Encoding": "gzip"}

# (name, body bytes, extra headers, expected status, expected error code)
CASES = [
    ("gzip", gzipped(PROMPT), GZ, 200, None),
    ("deflate", zlib.compress(PLAIN), {"Content-Encoding": "deflate"}, 200, None),
    ("not gzip, labelled gzip", PLAIN, GZ, 400, BAD),
    ("unknown encoding", PLAIN, {"Content-Encoding": "x-squash"}, 415, "unsupported_encoding"),
    ("a 5,000-digit integer", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", {}, 400, BAD),
    ("a 5,000-digit integer, gzipped", gzip.compress(b'{"prompt": [' + b"7" * 5000 + b"]}"), GZ, 400, BAD),
    ("a lone surrogate in a text prompt", b'{"prompt": "abc \\ud800 def", "max_tokens": 1}', {}, 400, BAD),
    ("a lone surrogate in cache_salt", b'{"prompt": "a", "cache_salt": "s\\udfff"}', {}, 400, BAD),
    ("a lone surrogate in lora_name", b'{"prompt": "a", "lora_name": "\\uDA00x"}', {}, 400, BAD),
    ("a lone surrogate in a key", b'{"prompt": "a", "\\ud800": 1}', {}, 400, BAD),
    ("deep nesting", b"[" * 50_000 + b"]" * 50_000, {}, 400, BAD),
]


@pytest.mark.parametrize(("name", "body", "headers", "status", "code"), CASES, ids=[c[0] for c in CASES])
async def test_bad_bodies_get_a_clear_error_and_cost_nothing(tmp_path, name, body, headers, status, code):
    async with router_over_engine(tmp_path) as (engine, router, url, s):
        for _ in range(3):  # repeated: no cumulative effect on the breaker or readiness
            async with s.post(
                url + "/v1/completions", data=body, headers={"Content-Type": "application/json", **headers}
            ) as r:
                text = await r.text()
                assert r.status == status, (name, text[:200])
                if code is not None:
                    assert r.content_type == "application/json", text[:200]
                    assert json.loads(text)["error"]["code"] == code
        await assert_healthy(router, url, s, engine)


async def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(tmp_path):
    """Valid JSON, not text: it reached quote() and the native match as a 500."""
    async with router_over_engine(tmp_path) as (_engine, _router, url, s):
        for path, body, field in (
            (
                "/v1/responses",
                b'{"input": "hi", "previous_response_id": "resp_\\ud800"}',
                "previous_response_id",
            ),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
        ):
            async with s.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
                error = (await r.json())["error"]
                assert r.status == 400 and error["param"] == field and field in error["message"], error


async def test_a_client_on_the_public_port_learns_no_engine_address_nor_any_debug_page(tmp_path):
    """By default no answer names its engine (X-RouterFleet-Engine: engine URLs), and /metrics,
    /debug/index and /debug/load (engine URLs, replica names, block counts) are on the metrics port."""
    async with router_over_engine(tmp_path) as (engine, router, url, s):
        for body in (PROMPT, {**PROMPT, "max_tokens": -1}):  # accepted, and refused by the engine
            async with s.post(url + "/v1/completions", json=body) as r:
                assert "X-RouterFleet-Engine" not in r.headers and engine.http_url not in await r.text()
        for page in ("/metrics", "/debug/index", "/debug/load"):
            async with s.get(url + page) as r:
                text = await r.text()
                assert r.status == 404 and "metrics port" in text and engine.http_url not in text, page
            async with s.get(router.metrics_url + page) as r:
                assert r.status == 200 and (page != "/debug/load" or engine.http_url in await r.text()), page


async def test_a_non_ascii_authorization_header_on_the_internal_port_is_a_401(tmp_path):
    async with router_over_engine(tmp_path) as (engine, router, url, s):
        host, port = router.internal_url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"GET /internal/bootstrap HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe"
            + TOKEN.encode()
            + b"\r\n"
            b"Connection: close\r\n\r\n"
        )
        await writer.drain()
        head = await reader.read(200)
        writer.close()
        assert head.startswith(b"HTTP/1.1 401"), head
        await assert_healthy(router, url, s, engine)


async def test_the_fake_engine_refuses_max_tokens_beyond_its_model_length_as_vllm_does():
    async with run_fake_engine(block_size=BS, max_model_len=64) as e, aiohttp.ClientSession() as s:
        for max_tokens in (10**30, 61):
            async with s.post(
                e.http_url + "/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": max_tokens}
            ) as r:
                assert r.status == 400
                body = await r.json()
                assert (
                    body["error"]["param"] == "max_tokens"
                    and "maximum context length is 64" in body["error"]["message"]
                )
        async with s.post(
            e.http_url + "/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 60}
        ) as r:
            assert r.status == 200


MARKER = "PROMPT-MARKER-7f3a"
LONG = "z" * 9000  # past aiohttp's 8,190-byte line limit


def framing_attacks(host: str) -> list[bytes]:
    """Requests whose framing aiohttp's parser refuses, each carrying MARKER where it would be logged."""
    body = json.dumps({"prompt": MARKER, "max_tokens": 1}).encode()
    post = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
    return [
        post + b"Transfer-Encoding: chunked\r\n\r\n" + body + b"\r\n",  # a chunked request, unframed
        post + b"Transfer-Encoding: chunked\r\n\r\nzz" + MARKER.encode() + b"\r\n" + body + b"\r\n0\r\n\r\n",
        post + b"Content-Length: 10\r\n\r\n" + body + b"\r\n\r\n",  # the rest parses as a request line
        f"GET /{MARKER}{'x' * 9000} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),  # request line too long
        post + f"X-Note: {MARKER}{'y' * 9000}\r\nContent-Length: 2\r\n\r\n{{}}".encode(),  # header too long
        f"{MARKER} / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(),  # a bad method
        post + f"Bad Header {MARKER}: v\r\nContent-Length: 2\r\n\r\n{{}}".encode(),
    ]


async def send_raw(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(5):
            return await reader.read(65536)
    finally:
        writer.close()


async def test_malformed_framing_never_puts_request_bytes_or_the_token_in_any_log(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    async with router_over_engine(tmp_path) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        answers = [await send_raw(host, int(port), raw) for raw in framing_attacks(host)]
        assert all(a.split(b" ", 2)[1].startswith(b"4") for a in answers), [a[:40] for a in answers]
        for a in answers:  # OpenAI's error shape, like every other error, and none of the request's bytes
            head, _, body = a.partition(b"\r\n\r\n")
            assert b"Content-Type: application/json" in head and MARKER.encode() not in a, a[:300]
            if b"Content-Length" in head:
                assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, body
        ihost, iport = router.internal_url.removeprefix("http://").rsplit(":", 1)
        auth = f"GET /internal/bootstrap HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}{LONG}\r\n\r\n"
        assert (await send_raw(ihost, int(iport), auth.encode())).split(b" ", 2)[1] == b"400"
        await assert_healthy(router, url, s, engine)
    text = "\n".join(
        r.getMessage() + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
        for r in caplog.records
    )
    assert "refused a malformed request" in text  # the events are kept
    assert MARKER not in text and TOKEN not in text


async def cursors_refused(body: str, fetcher) -> None:
    """A peer answering the splice probe (cursors_only) with ``body``: a rejected answer."""
    from aiohttp import web

    from router_runtime.bootstrap.fetch import FetchFailed
    from router_runtime.bootstrap.peers import Peer
    from router_runtime.bootstrap.state import SnapshotOutcome

    async def answer(_req):
        return web.Response(text=body, content_type="application/json")

    async with snapshot_peer(answer) as url:
        try:
            with pytest.raises(FetchFailed) as failed:
                await fetcher.cursors(Peer(url, url))
            assert failed.value.outcome is SnapshotOutcome.REJECTED
        finally:
            await fetcher.close()


@pytest.mark.parametrize(
    "seq",
    ["1e999", "true", '"7"', "1.5", str(1 << 64), "-2"],
)
async def test_a_peer_cursor_that_is_not_a_bounded_integer_is_a_rejected_answer(seq):
    """The splice probe's answer (cursors_only) with a hostile seq: refused as a rejected answer, never
    an exception that would kill the probe task (1e999 parses as infinity, whose int() overflows)."""
    from router_runtime.bootstrap.fetch import SnapshotFetcher

    row = '{"engine": "e", "rank": 0, "incarnation": "i", "seq": ' + seq + "}"
    body = '{"format": 1, "cursors": [' + row + "]}"

    await cursors_refused(body, SnapshotFetcher(TOKEN))


async def test_a_peer_that_accepts_and_never_answers_is_cut_at_the_fetchers_own_bounds():
    """Connected, and not a byte: the snapshot and the cursor table both fail at the read-idle bound."""
    from router_runtime.bootstrap.fetch import FetchBounds, FetchFailed, SnapshotFetcher
    from router_runtime.bootstrap.peers import Peer

    async def silent(_reader, writer):
        await asyncio.sleep(30)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    fetcher = SnapshotFetcher(TOKEN, FetchBounds(connect_s=0.5, read_idle_s=0.5, total_s=60))
    try:
        for ask in (lambda: fetcher.snapshot(Peer(url, url), 0), lambda: fetcher.cursors(Peer(url, url))):
            async with asyncio.timeout(5):
                with pytest.raises(FetchFailed):
                    await ask()
    finally:
        await fetcher.close()
        server.close()


@pytest.mark.parametrize("rows", [5, 50], ids=["more_rows_than_workers", "over_the_byte_cap"])
async def test_a_peer_cursor_table_past_its_bounds_is_a_rejected_answer(rows):
    """The probe asks its peers while this replica serves: an answer with more rows than there can be
    workers, or more bytes than such rows take, is refused rather than parsed."""
    from router_runtime.bootstrap.fetch import SnapshotFetcher
    from router_runtime.bootstrap.wire import Limits

    row = '{"engine": "e%d", "rank": 0, "incarnation": "i", "seq": 1}'
    body = '{"format": 1, "cursors": [' + ",".join(row % i for i in range(rows)) + "]}"

    await cursors_refused(body, SnapshotFetcher(TOKEN, limits=Limits(max_workers=4)))  # 2 KiB of rows at most


# ---- slow and idle clients (proxy/serving.py) -------------------------------------------------------

FAST = {"header_timeout_s": 1.0, "idle_timeout_s": 1.5, "body_base_s": 1.0, "max_connections": 4}


def limits(**kw):
    from router_runtime.proxy.serving import ServerLimits

    return ServerLimits(**{**FAST, **kw})


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails past ``seconds``)."""
    async with asyncio.timeout(seconds):
        return await reader.read()


async def test_a_head_sent_a_byte_at_a_time_is_cut_while_normal_clients_are_served(tmp_path):
    async with router_over_engine(tmp_path, server=limits()) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode() + b"a" * 100
        t0 = asyncio.get_running_loop().time()

        async def trickle():
            for b in head:
                writer.write(bytes([b]))
                await asyncio.sleep(0.05)  # 20 bytes/s: the head would take 5 s

        task = asyncio.create_task(trickle())
        await assert_healthy(router, url, s, engine)  # served meanwhile
        with contextlib.suppress(ConnectionError):
            assert await closed_within(reader, 3) == b""
        took = asyncio.get_running_loop().time() - t0
        task.cancel()
        writer.close()
        assert 0.9 < took < 2.5, took


async def test_an_idle_keep_alive_connection_is_closed_and_a_busy_one_is_not(tmp_path):
    async with router_over_engine(tmp_path, server=limits()) as (_engine, _router, url, _s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        body = json.dumps(PROMPT).encode()
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        for _ in range(3):  # requests 1 s apart keep it open (each resets the idle clock)
            writer.write(request)
            line = await asyncio.wait_for(reader.readline(), 5)
            assert line.startswith(b"HTTP/1.1 200"), line
            await asyncio.sleep(1.0)
            await reader.read(1 << 16)
        t0 = asyncio.get_running_loop().time()
        rest = await closed_within(reader, 4)
        took = asyncio.get_running_loop().time() - t0
        writer.close()
        assert b"HTTP/1.1" not in rest and took < 2.5, (rest[:80], took)


async def test_a_body_shorter_than_its_content_length_gets_408_in_its_budget(tmp_path):
    async with router_over_engine(tmp_path, server=limits()) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            'Content-Length: 1000\r\n\r\n{"prompt": '.encode()
        )
        answer = await closed_within(reader, 5)  # 1 s base + 1000 B at 64 KiB/s, then 2 s lingering
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert json.loads(body)["error"]["code"] == "request_timeout"
        await assert_healthy(router, url, s, engine)


async def test_past_the_connection_cap_a_new_connection_gets_503_and_the_rest_are_served(tmp_path):
    async with router_over_engine(tmp_path, server=limits(idle_timeout_s=30)) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(4)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await closed_within(reader, 3)
        writer.close()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), answer[:200]
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        for _r, w in idle:
            w.close()
        await asyncio.sleep(0.2)
        await assert_healthy(router, url, s, engine)  # room again


# ---- hostile peers: a router bootstrapping from them stays healthy, small and cold ------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


class Harm:
    """What a hostile party costs the router while it works on it: RSS growth and the worst /healthz.
    The healthz bound is not a latency figure: a busy 2-core CI machine alone has held it 0.18 s, so it
    is well above that and far below a hostile body's cost (inflating or parsing 1 GiB on the loop takes
    seconds)."""

    def __init__(self) -> None:
        self.rss0 = self.rss_max = _rss()
        self.worst_healthz = 0.0

    async def look(self, s: aiohttp.ClientSession, url: str) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with s.get(url + "/healthz") as r:
            assert r.status == 200
        self.worst_healthz = max(self.worst_healthz, loop.time() - t0)
        self.rss_max = max(self.rss_max, _rss())

    def assert_none(self) -> None:
        assert self.rss_max - self.rss0 < 100 << 20, (self.rss_max - self.rss0) >> 20
        assert self.worst_healthz < 0.5, self.worst_healthz


def _zeros_gzip(mib: int) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zero = bytes(1 << 20)
    return b"".join([*(c.compress(zero) for _ in range(mib)), c.flush()])


def _absurd_counts() -> bytes:
    """A well-formed envelope whose body claims 80M carrier entries and a million records, with none of
    the bytes to back them (its checksum is right: only the claims are hostile)."""
    import msgpack
    import xxhash

    body = msgpack.packb(
        {
            "format": 1,
            "producer": {"id": "p", "incarnation": "i"},
            "hashing": {"block_size": BS, "scheme": "x"},
            "producer_ready": True,
            "workers": [["e", 0, "i"]],
            "cursors": [[0, 5]],
            "records": 20_000_000,  # the limit, claimed
            "parent": b"",
            "key": b"",
            "ncar": b"\xff\xff" * 1000,
        }
    )
    return msgpack.packb({"format": 1, "body": body, "checksum": xxhash.xxh3_128_digest(body)})


HOSTILE_PEERS = {
    "gzip bomb (1 GiB of zeros)": (_zeros_gzip(1024), {"Content-Encoding": "gzip"}),
    "absurd counts": (_absurd_counts(), {}),
    "garbage": (b"\xc1" * 4096, {}),
}


@pytest.mark.parametrize("case", HOSTILE_PEERS)
async def test_a_hostile_peer_leaves_the_router_healthy_small_and_cold(tmp_path, case):
    from aiohttp import web

    body, headers = HOSTILE_PEERS[case]
    served = 0

    async def hostile(_req):
        nonlocal served
        served += 1
        return web.Response(body=body, headers={"Content-Type": "application/x-msgpack", **headers})

    harm = Harm()
    async with snapshot_peer(hostile) as peer:
        # origin off: a young engine's replay would rebuild the rank without asking any peer
        cfg = {"peers": PeerConfig(urls=(peer,)), "bootstrap": BootstrapConfig(timeout_s=30, origin=False)}
        async with router_over_engine(tmp_path, events=True, **cfg) as (engine, router, url, s):
            loop = asyncio.get_running_loop()
            start = loop.time()
            while served < 3 or not router.bootstrap.settled:  # several refused sweeps, then settled
                assert loop.time() - start < 20, "never settled"
                await harm.look(s, url)
                await asyncio.sleep(0.01)
            report = router.bootstrap.report()
            assert report["verdict"] == "timed_out" and report["cause"]["code"] == "PeerRefused", report
            assert router.kv.index.node_count() == 0
            await assert_healthy(router, url, s, engine)
    harm.assert_none()  # the loop never waited on the body


@pytest.mark.parametrize("path", ["/internal/load", "/internal/kv_notice"])
async def test_a_peer_answering_a_gzip_bomb_to_a_post_costs_the_router_nothing(tmp_path, path):
    """What peer discovery points at needs no token to answer: a 1 MiB gzip body inflating to 1 GiB, in
    answer to every load report (or KV notice) the router posts, is never read nor inflated (it drove a
    router to 2.3 GB RSS and /healthz to 6.3 s on every heartbeat)."""
    from aiohttp import web

    from router_runtime.bootstrap.peers import Peer
    from router_runtime.fleet.notices import KvNotice, NoticeKind
    from router_runtime.worker import Carrier

    from .support import loopback_app

    body, headers = HOSTILE_PEERS["gzip bomb (1 GiB of zeros)"]
    answered = 0

    async def bomb(_req):
        nonlocal answered
        answered += 1
        return web.Response(body=body, headers={"Content-Type": "application/json", **headers})

    harm = Harm()
    async with (
        loopback_app(web.post(path, bomb)) as peer,
        router_over_engine(tmp_path, fleet=FleetConfig(GossipConfig(window_s=0.005, heartbeat_s=0.05))) as (
            engine,
            router,
            url,
            s,
        ),
    ):
        router.bootstrap.peers.publish([Peer(peer, peer)])
        loop = asyncio.get_running_loop()
        start = loop.time()
        while answered < 5:  # five answers, each 1 GiB inflated
            assert loop.time() - start < 20, "the peer was never asked"
            if path == "/internal/kv_notice":
                router.notices.tell(KvNotice(NoticeKind.WITHHOLD_FALSE_HIT, (Carrier(engine.http_url, 0),)))
            await harm.look(s, url)
            await asyncio.sleep(0.05)
        await assert_healthy(router, url, s, engine)
    harm.assert_none()


async def test_an_engine_answering_without_end_costs_the_router_a_bounded_read(tmp_path):
    """An engine whose /v1/models, /health and stored-response answers never end (256 MiB each, made
    as they are sent): the router reads a capped prefix of each (http_body.read_capped), so its memory
    stays flat and /v1/models says no engine answered; it read all 256 MiB of each before."""
    from aiohttp import web

    from .support import loopback_app

    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        chunk = b" " * (1 << 20)
        for _ in range(256):
            await resp.write(chunk)
            sent += len(chunk)
        return resp

    routes = [web.get(p, endless) for p in ("/v1/models", "/health", "/v1/responses/{id}")]
    async with loopback_app(*routes) as engine_url:
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=(WorkerSpec(engine_url, engine_url),),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0.2),
        )
        harm = Harm()
        async with run_router(cfg) as (_router, url), aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.get(url + "/v1/models") as r:
                    assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_error"
                async with s.get(url + "/v1/responses/resp_1") as r:  # probed, then relayed as a stream
                    await r.content.read(1024)
                await harm.look(s, url)
            assert sent > 0
    harm.assert_none()


# ---- no sequence of client requests opens a breaker -------------------------------------------------


async def _one_hostile_request(rng, url, s, host, port) -> None:
    """One request a client without credentials can send, drawn at random."""
    kind = rng.randrange(7)
    if kind == 0:
        _name, body, headers, _status, _code = rng.choice(CASES)
        async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
            await r.read()
    elif kind == 1:
        await send_raw(host, port, rng.choice(framing_attacks(host)))
    elif kind == 2:  # the engine refuses these itself (400): its answer, not its health
        bad = rng.choice([{"max_tokens": 10**30}, {"max_tokens": -1}, {"prompt": [1] * 200_000}])
        async with s.post(url + "/v1/completions", json={**PROMPT, **bad}) as r:
            await r.read()
    elif kind == 3:  # a stream the client drops half-way
        async with s.post(url + "/v1/completions", json={**PROMPT, "max_tokens": 500, "stream": True}) as r:
            await r.content.readany()
    elif kind == 4:
        path = rng.choice(["/v1/nothing", "/internal/kv_snapshot", "/../etc/passwd", "/v1/completions/x"])
        async with s.get(url + path) as r:
            await r.read()
    elif kind == 5:  # a chat request with a shape the engine may refuse
        msgs = rng.choice([[{"role": "user"}], [{"role": 7, "content": "x"}], "text", [{"content": None}]])
        async with s.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}) as r:
            await r.read()
    else:
        async with s.post(url + "/v1/completions", json=PROMPT) as r:
            await r.read()


@pytest.mark.parametrize("seed", range(3))
async def test_no_sequence_of_client_requests_opens_a_breaker(tmp_path, seed):
    """A breaker that opens on one failure, and random sequences of every hostile or careless request
    in this file: the engine's breaker stays closed and the router ready after each one."""
    import random

    rng = random.Random(seed)
    async with router_over_engine(tmp_path, health=breakers(1)) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for i in range(40):
            await _one_hostile_request(rng, url, s, host, int(port))
            assert router.health.state(engine.http_url) is BreakerState.CLOSED, i
        await assert_healthy(router, url, s, engine)


# ---- memory in flight: the router-wide body budget (proxy/bodies.py) --------------------------------

BUDGET_MIB = 64


def proxy_config(**kw):
    from router_runtime.proxy.config import ProxyConfig

    return ProxyConfig(**kw)


async def slow_body(host: str, port: int, length: int, sent: int) -> asyncio.StreamWriter:
    """A client that declares ``length`` bytes and sends the first ``sent`` (at least 12), then waits."""
    _reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f'Content-Length: {length}\r\n\r\n{{"prompt": "'.encode()
        + b"a" * (sent - 12)
    )
    await writer.drain()
    return writer


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_past_the_body_budget_a_request_waits_then_gets_503_with_retry_after(tmp_path, framing):
    """Two slow clients have each sent all but 20 bytes of 32 MiB, filling a 64 MiB budget between them: a
    third request, however small, waits 1 s for a share and gets a 503 it can retry (no budget: nothing
    capped what all bodies held together); the health check is answered meanwhile, and once the slow
    clients go the router serves again. A client that sends its headers alone holds nothing."""
    cfg = proxy_config(max_body_bytes=32 << 20, body_budget_bytes=BUDGET_MIB << 20)
    async with router_over_engine(tmp_path, proxy=cfg) as (engine, router, url, s):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        idle = await slow_body(host, int(port), 32 << 20, 12)
        await asyncio.sleep(0.2)
        assert router.proxy.bodies.held == 12  # what it sent, not what it promised
        hogs = [idle] + [await slow_body(host, int(port), 32 << 20, (32 << 20) - 20) for _ in range(2)]
        held = 12 + 2 * ((32 << 20) - 20)  # 28 bytes short of the budget: no request fits
        await eventually(lambda: router.proxy.bodies.held == held, what="the hogs' bytes held")
        assert len(PLAIN) > 28
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if framing == "chunked":

            async def chunks():
                yield PLAIN

            sent = s.post(
                url + "/v1/completions", data=chunks(), headers={"Content-Type": "application/json"}
            )
        else:
            sent = s.post(url + "/v1/completions", json=PROMPT)
        async with sent as r:
            body = await r.json()
            took = loop.time() - t0
            assert r.status == 503, body
            assert r.headers["Retry-After"] == "1"
            assert body["error"]["code"] == "body_budget_exhausted", body
        assert 0.9 < took < 3, took
        harm = Harm()
        await harm.look(s, url)
        assert harm.worst_healthz < 0.5
        for w in hogs:
            w.close()
        await asyncio.sleep(0.2)
        assert router.proxy.bodies.held == 0
        await assert_healthy(router, url, s, engine)
        text = await (await s.get(router.metrics_url + "/metrics")).text()
        assert 'outcome="overloaded",policy="kv_aware",status="503"' in text


def _empty_arrays(n: int) -> bytes:
    return b'{"prompt": "a", "x": [' + b"[]," * (n - 1) + b"[]]}"


# Posts a file's bytes N times at once, from its own process: a client sharing the router's event loop
# (or its GIL) would count its own sending as the router's stall.
_POSTER = """
import http.client, json, sys, threading
host, port, path, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
body = open(path, "rb").read()
out = [None] * n
def post(i):
    c = http.client.HTTPConnection(host, port, timeout=120)
    c.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    out[i] = [r.status, json.loads(r.read())]
threads = [threading.Thread(target=post, args=(i,)) for i in range(n)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(out))
"""


async def test_a_body_whose_parse_would_exceed_the_budget_is_refused_before_it_parses(tmp_path):
    """32 MiB of ten million empty arrays: parsed, +725 MB and /healthz stalled 2.3 s (four at once:
    3.2 GB, 7 s). Now its parse's upper bound (~700 MB) exceeds the whole default budget: four at once
    get a 413 naming the budget, and the router holds no more than their bytes."""
    import sys

    path = tmp_path / "body.json"
    path.write_bytes(_empty_arrays(11_000_000))
    assert path.stat().st_size > 32_000_000
    harm = Harm()
    async with router_over_engine(tmp_path) as (engine, router, url, s):
        assert router.proxy.bodies.cap == 256 << 20  # the default
        host, port = url.removeprefix("http://").rsplit(":", 1)
        poster = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _POSTER, host, port, str(path), "4", stdout=asyncio.subprocess.PIPE
        )
        out = asyncio.create_task(poster.communicate())
        while not out.done():
            await harm.look(s, url)
            await asyncio.sleep(0.02)
        answers = json.loads((await out)[0])
        for status, answer in answers:
            assert status == 413, answer
            assert answer["error"]["code"] == "request_too_large", answer
            assert "body budget" in answer["error"]["message"], answer
        await assert_healthy(router, url, s, engine)
    grew = (harm.rss_max - harm.rss0) >> 20
    print(f"\n[body budget] four 32 MiB bodies: RSS +{grew} MiB, worst /healthz {harm.worst_healthz:.3f}s")
    assert harm.worst_healthz < 0.5, harm.worst_healthz
    # four bodies' bytes as read (aiohttp's buffer, then the bytes), never their parse
    assert harm.rss_max - harm.rss0 < 8 * (32 << 20), (harm.rss_max - harm.rss0) >> 20
