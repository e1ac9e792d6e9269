"""Request traces through a real OpenTelemetry Collector (e2e/tracing): a router over fake engines, and
the endpoint picker behind real Envoy, export their spans over OTLP/HTTP; the collector writes them to a
file the tests read. The client's traceparent is followed, the engine receives the router's own span as
its parent, the decision's reasons are on the schedule span, the audit's verdict on the root, a false hit
is found from the log by its trace id, and no prompt reaches any span."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from e2e.tracing.collector import Collector, free_port, running_collector
from router_runtime.tokens.config import TokenizerConfig
from router_runtime.tokens.tokenizer import ENGINE_TOKENIZER
from router_runtime.tracing.config import TracingConfig
from router_runtime.tracing.context import parse_traceparent
from router_runtime.tracing.export import (
    BATCH_TRACES,
    FLUSH_TIMEOUT_S,
    INTERVAL_S,
    MAX_QUEUED_TRACES,
    OtlpExporter,
    TraceMetrics,
)
from router_runtime.tracing.spans import SpanKind, Trace
from tests.support import eventually, loopback_app, router_over_fakes

from .test_gateway_picker import gateway

pytestmark = pytest.mark.timeout(240)  # the collector's first build, if `make otelcol` has not run

BS = 4
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SAMPLED = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
SECRET = "the quarterly numbers are confidential"
CHAT = {
    "messages": [{"role": "user", "content": f"{SECRET}, repeated: " * 6}],
    "max_tokens": 2,
    "stream": True,
}


@contextlib.asynccontextmanager
async def traced(
    tmp_path: Path, ratio: float, n_engines: int = 2, tokens: TokenizerConfig | None = None
) -> AsyncIterator[tuple[Any, ...]]:
    """A collector, fake engines and a ready router tracing to it (``tokens``: its tokenizer section):
    (collector, engines, router, url, session)."""
    with running_collector(tmp_path) as collector:
        async with router_over_fakes(
            n_engines,
            BS,
            engine={"decode_tokens_per_s": 0},
            tokens=tokens or TokenizerConfig(),
            tracing=TracingConfig(endpoint=collector.endpoint, sample_ratio=ratio),
        ) as (engines, router, url, s):
            yield collector, engines, router, url, s


async def traces(collector: Collector, n_spans: int) -> dict[str, list[dict]]:
    """The spans the collector has written (at least ``n_spans``), by trace id. Read off the event loop:
    the router exporting them runs on it."""
    spans = await asyncio.to_thread(collector.spans, min_count=n_spans)
    out: dict[str, list[dict]] = {}
    for span in spans:
        out.setdefault(span["traceId"], []).append(span)
    return out


def by_name(spans: list[dict]) -> dict[str, dict]:
    return {s["name"]: s for s in spans}


def engine_parent(engines, n: int = 1) -> list[str]:
    """The traceparent each engine received on its latest ``n`` generation requests (None: none)."""
    return [tp for e in engines for tp in list(e.traceparents)[-n:]]


async def chat(s: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> None:
    async with s.post(url + "/v1/chat/completions", json=CHAT, headers=headers or {}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def test_a_chat_requests_trace_has_the_decision_and_reaches_the_engine(tmp_path):
    async with traced(tmp_path, ratio=0.0) as (collector, engines, router, url, s):
        await chat(s, url)  # no traceparent, ratio 0: not traced, and the engine is told so
        (declined,) = [parse_traceparent(tp) for tp in engine_parent(engines) if tp]
        assert declined is not None and not declined.sampled
        unsampled = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-00"}
        await chat(s, url, unsampled)  # the client's decision: not traced, its context passed on as it came
        assert unsampled["traceparent"] in engine_parent(engines)
        await chat(s, url, SAMPLED)  # the client's sampled parent: traced
        await eventually(lambda: router.kv.index.node_count() > 0, what="the prompt's blocks indexed")
        await chat(s, url, SAMPLED)  # the same prompt again: a cached prefix, and why it won
        got = await traces(collector, 10)
        assert list(got) == [CLIENT_TRACE], got.keys()  # only the two sampled requests
        # Both requests are in the client's trace: the second is the root that started last.
        roots = [sp for sp in got[CLIENT_TRACE] if sp["parentSpanId"] == CLIENT_SPAN]
        assert len(roots) == 2
        root = max(roots, key=lambda sp: int(sp["startTimeUnixNano"]))
        spans = [sp for sp in got[CLIENT_TRACE] if sp["parentSpanId"] == root["spanId"]]
        named = by_name(spans)
        assert all(not sp["status"] for sp in [root, *spans]), [sp["status"] for sp in spans]
        assert set(named) == {"parse", "tokenize", "schedule", "upstream"}
        assert root["name"] == "POST /v1/chat/completions" and root["kind"] == 2
        assert (
            root["parentSpanId"] == CLIENT_SPAN and root["resource"]["service.name"] == "routerfleet-router"
        )
        a = root["attributes"]
        assert a["http.response.status_code"] == 200 and a["routerfleet.outcome"] == "ok"
        assert a["routerfleet.audit.outcome"] == "exact" and a["routerfleet.audit.cached_tokens"] > 0
        assert a["routerfleet.audit.predicted_tokens"] == a["routerfleet.audit.cached_tokens"]

        sched = named["schedule"]["attributes"]
        assert sched["routerfleet.reason"] == "prefix" and sched["routerfleet.profile"] == "kv_aware"
        assert sched["routerfleet.prediction.doubtful"] is False
        assert sched["routerfleet.prediction.cached_tokens"] == a["routerfleet.audit.cached_tokens"]
        assert sorted(sched["routerfleet.candidates.engine"]) == sorted(e.http_url for e in engines)
        winner = sched["routerfleet.candidates.engine"].index(sched["routerfleet.engine"])
        device = sched["routerfleet.candidates.matched_blocks.device"]
        assert device[winner] == sched["routerfleet.matched.blocks"] > 0 and sum(device) == device[winner]
        assert sched["routerfleet.candidates.cost"][winner] == min(sched["routerfleet.candidates.cost"])
        assert len(sched["routerfleet.candidates.load"]) == 2 and sched["routerfleet.load.fresh_peers"] == 0
        assert "routerfleet.candidates.matched_blocks.host" not in sched  # no candidate holds blocks there
        tok = named["tokenize"]["attributes"]
        assert tok["routerfleet.tokenizer"] == "router" and tok["routerfleet.tokens.count"] > 0

        up = named["upstream"]
        assert up["kind"] == 3 and up["attributes"]["routerfleet.engine"] == sched["routerfleet.engine"]
        assert up["attributes"]["routerfleet.time_to_first_chunk_ms"] >= 0
        # The engine that served got the router's upstream span as its parent, in the client's trace.
        winner_engine = next(e for e in engines if e.http_url == sched["routerfleet.engine"])
        parent = parse_traceparent(winner_engine.traceparents[-1])
        assert parent is not None and parent.sampled
        assert f"{parent.trace_id:032x}" == CLIENT_TRACE and f"{parent.span_id:016x}" == up["spanId"]

        # Nothing of the prompt in any span: its text, or anything as long as its tokens.
        raw = collector.spans_file.read_text()
        assert SECRET not in raw and "quarterly" not in raw
        arrays = [v for sp in got[CLIENT_TRACE] for v in sp["attributes"].values() if isinstance(v, list)]
        assert arrays and max(len(v) for v in arrays) == len(engines)
        await eventually(lambda: sample(router, "routerfleet_trace_spans_exported_total") >= 10)


async def test_a_false_hit_is_found_from_the_log_by_its_trace_id(tmp_path, caplog):
    async with traced(tmp_path, ratio=1.0, n_engines=1) as (collector, engines, router, url, s):
        (engine,) = engines
        body = {"prompt": list(range(1, 42)), "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200
        await eventually(lambda: router.kv.index.node_count() >= 10, what="the blocks indexed")
        # The engine loses its cache and no event says so: the index is wrong, the audit says it.
        async with s.post(engine.http_url + "/admin/clear", json={"rank": 0, "drop": "all"}) as r:
            assert r.status == 200
        with caplog.at_level(logging.INFO, logger="router_runtime.proxy.audit"):
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
        (line,) = [r.getMessage() for r in caplog.records if "false hit" in r.getMessage()]
        trace_id = line.rsplit("trace_id=", 1)[1]
        got = await traces(collector, 10)
        root = next(sp for sp in got[trace_id] if not sp.get("parentSpanId"))
        assert root["attributes"]["routerfleet.audit.outcome"] == "false_hit"
        assert root["attributes"]["routerfleet.audit.false_hit_tokens"] == 40
        arrays = [v for sp in got[trace_id] for v in sp["attributes"].values() if isinstance(v, list)]
        assert arrays and max(len(v) for v in arrays) == 1  # one candidate; nothing prompt-sized


@pytest.mark.parametrize("duplex", [False, True], ids=["buffered", "full_duplex"])
async def test_the_pickers_trace_names_its_span_as_the_engines_parent(tmp_path, duplex):
    with running_collector(tmp_path) as collector:
        tracing = TracingConfig(endpoint=collector.endpoint, sample_ratio=1.0)
        async with (
            gateway(tmp_path, duplex=duplex, tracing=tracing) as (engines, _router, base),
            aiohttp.ClientSession() as s,
        ):
            async with s.post(base + "/v1/chat/completions", json=CHAT, headers=SAMPLED) as r:
                assert r.status == 200, await r.text()
                await r.read()
            got = await traces(collector, 5)
            (served,) = [e for e in engines if e.traceparents]
            parent = parse_traceparent(served.traceparents[-1])
            # A client's tracestate without the traceparent it belongs to does not ride on the router's.
            async with s.post(base + "/v1/chat/completions", json=CHAT, headers={"tracestate": "k=v"}) as r:
                assert r.status == 200, await r.text()
            contexts = [[k for k, _ in trace_context(got)] for e in engines for got in e.received_headers]
            assert contexts == [["traceparent"]] * 2
        spans = got[CLIENT_TRACE]
        named = by_name(spans)
        assert {"POST /v1/chat/completions", "parse", "tokenize", "schedule", "upstream"} <= set(named)
        root, up = named["POST /v1/chat/completions"], named["upstream"]
        assert root["parentSpanId"] == CLIENT_SPAN and root["attributes"]["http.response.status_code"] == 200
        assert root["attributes"]["routerfleet.audit.outcome"] in ("exact", "missed_hit")
        assert up["attributes"]["http.response.status_code"] == 200
        assert not up["status"] and not root["status"]  # ended with the response, not cut by the stream's end
        assert parent is not None and f"{parent.span_id:016x}" == up["spanId"]
        assert SECRET not in collector.spans_file.read_text()


UNSAMPLED = f"00-{'1' * 32}-{'2' * 16}-00"


def trace_context(received: tuple[tuple[str, str], ...]) -> list[tuple[str, str]]:
    """The trace context headers among an engine's ``received_headers``, repeated ones each."""
    return [(k, v) for k, v in received if k in ("traceparent", "tracestate")]


@pytest.mark.parametrize("ratio", [0.0, 1.0], ids=["declined", "traced"])
async def test_the_engine_gets_one_trace_context_the_clients_as_it_came_or_the_routers_whole(tmp_path, ratio):
    tp = ("traceparent", SAMPLED["traceparent"])
    theirs = [
        [("tracestate", "k=orphan")],  # no traceparent: the router starts its own, without it
        [("traceparent", "ff" + tp[1][2:]), ("tracestate", "k=v")],  # an invalid one: the same
        [("traceparent", UNSAMPLED), tp, ("tracestate", "k=v")],  # several: invalid (W3C)
        [tp, ("tracestate", "k=" + "v" * 600)],  # a tracestate past the W3C limit: dropped
    ]
    async with traced(tmp_path, ratio, n_engines=1) as (_collector, (engine,), _router, url, s):
        for sent in theirs:
            await chat(s, url, CIMultiDict(sent))
            got = trace_context(engine.received_headers[-1])
            assert [k for k, _ in got] == ["traceparent"], (sent, got)
            assert got[0][1] not in [v for _, v in sent] and parse_traceparent(got[0][1]) is not None
        # A sampled parent's tracestate goes on beside the router's own span; an unsampled parent's
        # context reaches the engine as it came.
        await chat(s, url, CIMultiDict([tp, ("tracestate", "k=v")]))
        got = dict(trace_context(engine.received_headers[-1]))
        assert got["tracestate"] == "k=v" and got["traceparent"] != tp[1]
        assert parse_traceparent(got["traceparent"]).trace_id == int(CLIENT_TRACE, 16)
        await chat(s, url, CIMultiDict([("traceparent", UNSAMPLED), ("tracestate", "k=v")]))
        assert sorted(trace_context(engine.received_headers[-1])) == [
            ("traceparent", UNSAMPLED),
            ("tracestate", "k=v"),
        ]


def sample(router, name: str) -> float:
    return router.registry.get_sample_value(name) or 0.0


async def test_the_tokenize_span_says_whether_the_engine_was_asked(tmp_path):
    engine_tokens = TokenizerConfig(tokenizer=ENGINE_TOKENIZER)
    async with traced(tmp_path, 1.0, n_engines=1, tokens=engine_tokens) as (collector, _e, _r, url, s):
        for _ in range(2):
            await chat(s, url)
        got = await traces(collector, 10)
    tokenized = sorted(
        (sp for spans in got.values() for sp in spans if sp["name"] == "tokenize"),
        key=lambda sp: int(sp["startTimeUnixNano"]),
    )
    answered = [
        (sp["attributes"]["routerfleet.tokenizer"], sp["attributes"]["routerfleet.tokens.answered_by"])
        for sp in tokenized
    ]
    assert answered == [("engine", "engine"), ("engine", "cache")]


def finished_trace(n_children: int = 1) -> Trace:
    t = Trace(int(CLIENT_TRACE, 16), "route", SpanKind.SERVER, 0, None, lambda _: None)
    for _ in range(n_children):
        t.span("child").end()
    t.end()
    return t


def exporter_to(endpoint: str) -> tuple[OtlpExporter, CollectorRegistry]:
    registry = CollectorRegistry()
    return OtlpExporter(TracingConfig(endpoint=endpoint), TraceMetrics(registry), "test"), registry


def spans_counted(registry: CollectorRegistry) -> tuple[float, float, float]:
    """(exported, dropped for export_failed, dropped for queue_full)"""
    get = registry.get_sample_value
    return (
        get("routerfleet_trace_spans_exported_total") or 0.0,
        get("routerfleet_trace_spans_dropped_total", {"reason": "export_failed"}) or 0.0,
        get("routerfleet_trace_spans_dropped_total", {"reason": "queue_full"}) or 0.0,
    )


async def test_the_exporter_counts_what_the_collector_took_and_what_it_could_not_send(tmp_path):
    # Taken: a real collector's 200 and an empty partial_success; the stop flushes what is queued.
    with running_collector(tmp_path) as collector:
        exporter, registry = exporter_to(collector.endpoint)
        exporter.start()
        exporter.submit(finished_trace(2))
        await exporter.stop()
        assert spans_counted(registry) == (3, 0, 0)
        [got] = {sp["traceId"] for sp in await asyncio.to_thread(collector.spans, min_count=3)}
        assert got == CLIENT_TRACE

    # Nobody listening: counted as failed, and the stop still returns within its flush bound.
    exporter, registry = exporter_to(f"http://127.0.0.1:{free_port()}")
    exporter.start()
    exporter.submit(finished_trace())
    async with asyncio.timeout(FLUSH_TIMEOUT_S + 2):
        await exporter.stop()
    assert spans_counted(registry) == (0, 2, 0)

    # A collector that answers with an error status (here: overloaded) took nothing, though its empty
    # body would read as "nothing rejected".
    async def overloaded(_: web.Request) -> web.Response:
        return web.Response(status=503)

    async with loopback_app(web.post("/v1/traces", overloaded)) as url:
        exporter, registry = exporter_to(url)
        exporter.start()
        exporter.submit(finished_trace())
        await exporter.stop()
        assert spans_counted(registry) == (0, 2, 0)

    # One that says it refused more spans than it was sent (5 of 2): all of them refused, and the
    # exporter goes on.
    async def nonsense(_: web.Request) -> web.Response:
        return web.Response(body=b"\x0a\x02\x08\x05", content_type="application/x-protobuf")

    async with loopback_app(web.post("/v1/traces", nonsense)) as url:
        exporter, registry = exporter_to(url)
        exporter.start()
        exporter.submit(finished_trace())
        await eventually(lambda: spans_counted(registry) == (0, 2, 0), 10, "the first batch refused")
        exporter.submit(finished_trace())
        await exporter.stop()
        assert spans_counted(registry) == (0, 4, 0)


async def test_a_batch_goes_full_or_at_the_interval_never_just_what_queued_during_an_export():
    # A collector that takes 0.2 s per export: traces queued meanwhile wait for a full batch or the
    # interval, rather than going as a batch of their own as soon as the export ends. Each export is
    # stamped when it arrives, so a slow machine delays both without changing which comes when.
    loop = asyncio.get_running_loop()
    exports: list[tuple[float, int]] = []  # (arrival, spans)

    async def slow(request: web.Request) -> web.Response:
        arrived = loop.time()
        body = await request.read()
        await asyncio.sleep(0.2)
        exports.append((arrived, body.count(b"\x2a\x05route")))  # each trace's one span, its root "route"
        return web.Response(body=b"", content_type="application/x-protobuf")

    async with loopback_app(web.post("/v1/traces", slow)) as url:
        exporter, registry = exporter_to(url)
        started = loop.time()
        exporter.start()
        try:
            for _ in range(BATCH_TRACES):
                exporter.submit(finished_trace(0))
            await asyncio.sleep(0.05)  # the full batch is on its way
            for _ in range(5):
                exporter.submit(finished_trace(0))
            taken = BATCH_TRACES + 5
            await eventually(lambda: spans_counted(registry)[0] == taken, INTERVAL_S + 5, "both batches")
            assert [n for _, n in exports] == [BATCH_TRACES, 5]
            assert exports[0][0] - started < INTERVAL_S  # the full batch did not wait for it
            assert exports[1][0] - started >= INTERVAL_S  # the 5 waited for the interval
        finally:
            await exporter.stop()
        assert spans_counted(registry) == (taken, 0, 0)


async def test_a_collectors_later_is_honoured_and_the_batch_sent_again():
    """OTLP/HTTP's 429 and 502-504 mean "retry later": the batch goes again once the collector's
    Retry-After has passed (at least the export interval: a "0" is no hot loop), nothing lost; the
    stop's last flush does not wait for a pause."""
    loop = asyncio.get_running_loop()
    arrivals: list[float] = []
    later = ["3"]  # the Retry-After of the next "later"; none left: the collector takes the batch

    async def busy(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(loop.time())
        if later:
            return web.Response(status=429 if later[0] != "0" else 503, headers={"Retry-After": later.pop()})
        return web.Response(body=b"", content_type="application/x-protobuf")

    async with loopback_app(web.post("/v1/traces", busy)) as url:
        exporter, registry = exporter_to(url)
        exporter.start()
        try:
            for _ in range(BATCH_TRACES):
                exporter.submit(finished_trace(0))
            await eventually(lambda: spans_counted(registry)[0] == BATCH_TRACES, 10, "the batch again")
            assert len(arrivals) == 2 and arrivals[1] - arrivals[0] >= 2.9  # after its Retry-After
            arrivals.clear()
            later.append("0")
            for _ in range(BATCH_TRACES):
                exporter.submit(finished_trace(0))
            await eventually(lambda: spans_counted(registry)[0] == 2 * BATCH_TRACES, 10, "after a 0")
            assert len(arrivals) == 2 and arrivals[1] - arrivals[0] >= INTERVAL_S - 0.05
        finally:
            await exporter.stop()
        assert spans_counted(registry) == (2 * BATCH_TRACES, 0, 0)

        # Paused by a "later" (30 s), the stop still flushes at once and within its bound: what the
        # collector will not take now is counted lost.
        exporter, registry = exporter_to(url)
        exporter.start()
        later.extend(["30", "30"])
        for _ in range(BATCH_TRACES):
            exporter.submit(finished_trace(0))
        await eventually(lambda: not later[1:], 5, "the first later")
        async with asyncio.timeout(FLUSH_TIMEOUT_S + 1):
            await exporter.stop()
        assert spans_counted(registry) == (0, BATCH_TRACES, 0)


def test_a_full_queue_drops_new_traces_and_counts_their_spans():
    exporter, registry = exporter_to("http://127.0.0.1:4318")  # never started: nothing is sent
    for _ in range(MAX_QUEUED_TRACES):
        exporter.submit(finished_trace(0))
    exporter.submit(finished_trace(4))
    assert spans_counted(registry) == (0, 0, 5)
