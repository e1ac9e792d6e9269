"""Tracing's pure parts (router_runtime/tracing/): W3C trace context, the sampling rule, one request's
spans, their OTLP encoding; and the scheduler framework's explanation of a decision."""

from __future__ import annotations

import struct

import pytest
from multidict import CIMultiDict

from router_runtime.scheduling.presets import make_policy
from router_runtime.scheduling.types import RouteRequest, Target
from router_runtime.tracing.config import TracingConfig, _endpoint
from router_runtime.tracing.context import parse_traceparent, sampled, sampling_bound, traceparent
from router_runtime.tracing.spans import NO_TRACE, SpanKind, Trace, Tracer
from router_runtime.tracing.wire import attributes, encode_trace, export_request, fields, rejected_spans

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_traceparent_is_parsed_as_the_w3c_spec_says():
    p = parse_traceparent(f"00-{TRACE}-{SPAN}-01")
    assert p is not None and (p.trace_id, p.span_id, p.sampled) == (int(TRACE, 16), int(SPAN, 16), True)
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled is False
    # A later version may carry more after the flags; version 00 may not.
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-more") is not None
    for bad in (
        None,
        "",
        f"00-{TRACE}-{SPAN}-01-more",
        f"ff-{TRACE}-{SPAN}-01",
        f"00-{'0' * 32}-{SPAN}-01",
        f"00-{TRACE}-{'0' * 16}-01",
        f"00-{TRACE.upper()}-{SPAN}-01",
        f"00-{TRACE[:-1]}-{SPAN}-01",
        "garbage",
    ):
        assert parse_traceparent(bad) is None, bad
    assert traceparent(int(TRACE, 16), int(SPAN, 16)) == f"00-{TRACE}-{SPAN}-01"


def test_sampling_is_parent_based_then_by_trace_id_ratio():
    parent = parse_traceparent(f"00-{TRACE}-{SPAN}-01")
    unsampled = parse_traceparent(f"00-{TRACE}-{SPAN}-00")
    none, half, all_ = sampling_bound(0.0), sampling_bound(0.5), sampling_bound(1.0)
    assert sampled(parent, 0, none) and not sampled(unsampled, 0, all_)
    low, high = 1, (1 << 64) - 1  # the trace id's low 64 bits decide
    assert sampled(None, low, half) and not sampled(None, high, half)
    assert not sampled(None, low, none) and sampled(None, high, all_)
    ids = range(1, 1 << 64, (1 << 64) // 1000)
    assert 90 <= sum(sampled(None, i, sampling_bound(0.1)) for i in ids) <= 110


def name() -> str:
    return "POST /v1/completions"


def test_a_tracer_follows_the_client_and_names_its_own_span_to_the_engine():
    finished: list[Trace] = []
    tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=0.0), finished.append)
    # Not traced (ratio 0, no parent): the engine is told so, in a trace of its own.
    declined = tracer.start(CIMultiDict(), name)
    assert not declined.recording
    told = parse_traceparent(declined.headers(declined.span("upstream"))["traceparent"])
    assert told is not None and not told.sampled
    # The client's "no": nothing of ours; its own header reaches the engine as it came.
    assert tracer.start(CIMultiDict(traceparent=f"00-{TRACE}-{SPAN}-00"), name) is NO_TRACE
    headers = CIMultiDict(traceparent=f"00-{TRACE}-{SPAN}-01")
    headers.extend([("tracestate", "k=v"), ("tracestate", "j=w")])  # several lines make one list
    t = tracer.start(headers, name)
    assert t.recording and t.trace_id_hex == TRACE and t.root.parent_id == int(SPAN, 16)
    assert t.root.kind is SpanKind.SERVER and t.root.name == "POST /v1/completions"
    upstream = t.span("upstream", SpanKind.CLIENT)
    assert t.headers(upstream) == {
        "traceparent": f"00-{TRACE}-{upstream.span_id:016x}-01",
        "tracestate": "k=v,j=w",
    }
    t.end()
    t.end()
    assert finished == [t]
    assert upstream.end_ns == t.root.end_ns and upstream.error == "cancelled"  # still open at the end
    headers["tracestate"] = "k=" + "v" * 600  # past the W3C limit: dropped, not cut
    assert "tracestate" not in tracer.start(headers, name).headers(upstream)
    headers["tracestate"] = "k=v\udcff"  # a byte that is not UTF-8, as aiohttp reads it: dropped
    odd = tracer.start(headers, name)
    assert odd.recording and "tracestate" not in odd.headers(upstream)
    off = Tracer(TracingConfig(), finished.append)
    assert off.start(CIMultiDict(traceparent=f"00-{TRACE}-{SPAN}-01"), name) is NO_TRACE


def test_the_unsampled_trace_records_nothing():
    span = NO_TRACE.span("parse")
    with span:
        span.set("a", 1)
        span.update({"b": 2})
    assert not span.recording and NO_TRACE.headers(span) == {}
    NO_TRACE.end()


def message(data: bytes) -> dict[int, list]:
    """A message's fields by number (OTLP's field numbers), each a list of its values in order."""
    out: dict[int, list] = {}
    for number, value in fields(data):
        out.setdefault(number, []).append(value)
    return out


def decoded(value: bytes):
    """An AnyValue (common.proto) as Python: string 1, bool 2, int64 3, double 4, array 5."""
    ((number, v),) = fields(value)
    if number == 1:
        return v.decode()
    if number == 2:
        return bool(v)
    if number == 3:
        return v - (1 << 64) if v >= 1 << 63 else v
    if number == 4:
        return struct.unpack("<d", v)[0]
    return [decoded(x) for x in message(v).get(1, [])]


def span_attributes(span: dict[int, list], field_number: int = 9) -> dict:
    """A span's attributes (field 9; an event's are 3): KeyValue key 1, value 2."""
    kvs = [message(kv) for kv in span.get(field_number, [])]
    return {kv[1][0].decode(): decoded(kv[2][0]) for kv in kvs}


def test_spans_encode_as_otlp():
    t = Trace(
        int(TRACE, 16), "POST /v1/chat/completions", SpanKind.SERVER, int(SPAN, 16), "k=v", lambda _: None
    )
    child = t.span("schedule")
    child.update({"s": "x", "b": True, "i": -3, "f": 0.5, "l": [1, 2], "ls": ["a"], "none": None})
    child.event("failed_over", {"routerfleet.engine": "e1"})
    child.end()
    with t.span("upstream", SpanKind.CLIENT) as up:
        up.fail("timeout")
    t.end()
    request = export_request([encode_trace(t)] * 2, {"service.name": "r"}, "routerfleet.router", "0.1.0")
    (resource_spans,) = message(request)[1]  # ExportTraceServiceRequest.resource_spans
    rs = message(resource_spans)
    assert span_attributes(message(rs[1][0]), 1) == {"service.name": "r"}  # .resource.attributes
    (scope_spans,) = rs[2]
    ss = message(scope_spans)
    scope = message(ss[1][0])
    assert (scope[1][0], scope[2][0]) == (b"routerfleet.router", b"0.1.0")
    root, sched, upstream, *again = (message(x) for x in ss[2])
    assert again == [root, sched, upstream]  # a second trace in the batch: its spans follow
    # Span: trace_id 1, span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start 7, end 8,
    # attributes 9, events 11, status 15.
    assert root[1][0].hex() == TRACE and root[4][0].hex() == SPAN and root[3][0] == b"k=v"
    assert 3 not in sched and 3 not in upstream  # the client's tracestate is the root's alone
    assert root[5][0] == b"POST /v1/chat/completions" and root[6][0] == 2 and upstream[6][0] == 3
    assert sched[4][0] == root[2][0]
    lone = Trace(1, "x", SpanKind.SERVER, 0, "", lambda _: None)  # no client's parent, an empty state
    lone.end()
    (only,) = message(encode_trace(lone))[2]
    assert 4 not in message(only) and 3 not in message(only)
    start, end = (struct.unpack("<Q", sched[n][0])[0] for n in (7, 8))
    assert end >= start > 0
    assert span_attributes(sched) == {"s": "x", "b": True, "i": -3, "f": 0.5, "l": [1, 2], "ls": ["a"]}
    (event,) = (message(e) for e in sched[11])
    assert event[2][0] == b"failed_over" and span_attributes(event, 3) == {"routerfleet.engine": "e1"}
    assert start <= struct.unpack("<Q", event[1][0])[0] <= end
    assert message(upstream[15][0]) == {3: [2]}  # status.code STATUS_CODE_ERROR
    assert span_attributes(upstream)["error.type"] == "timeout" and 15 not in sched


def test_an_explained_decision_lists_every_candidate_it_weighed():
    a, b = Target("a", "http://a:1"), Target("b", "http://b:1")
    policy = make_policy("least_loaded")
    plain = policy.choose(RouteRequest(), [a, b], {a: 3, b: 1}, None)
    assert plain.target == b and plain.candidates == ()
    explained = policy.choose(RouteRequest(), [a, b], {a: 3, b: 1}, None, explain=True)
    assert explained.target == b
    assert [(c.target, c.load) for c in explained.candidates] == [(a, 3), (b, 1)]


def test_an_odd_attribute_value_is_encoded_never_raised():
    def value(v):
        return span_attributes(message(attributes(0x4A, {"k": v})))["k"]  # 0x4a: Span.attributes (9)

    assert value([1, None, 2]) == [1, 2]
    assert value(-5) == -5 and value(0.25) == 0.25 and value(False) is False
    assert value(-(1 << 63)) == -(1 << 63) and value((1 << 63) - 1) == (1 << 63) - 1
    assert value(1 << 70) == str(1 << 70) and value([1 << 64]) == [str(1 << 64)]
    assert value((True,)) == [True] and value([[1], ["a"]]) == [[1], ["a"]]
    assert value(object()).startswith("<object")
    itself: list = [1]
    itself.append(itself)  # deeper than eight lists: their text
    assert value(itself) == [1, [1, [1, [1, [1, [1, [1, [1, "[1, [...]]"]]]]]]]]
    assert value("\u00e9t\u00e9") == "\u00e9t\u00e9" and value("x" * 300) == "x" * 300
    assert value(["y" * 200] * 100) == ["y" * 200] * 100  # lengths of two and three bytes
    assert attributes(0x4A, {"a": None}) == b""  # None: the message does not have it
    with pytest.raises(TypeError):
        attributes(0x4A, {1: "a key that is not text"})
    with pytest.raises(ValueError):
        attributes(0x48, {"k": 1})  # a varint field's tag

    class Growing:  # a value whose text changes the dict being written: no panic past the exporter
        def __str__(self):
            grown["more"] = 1
            return "grown"

    grown: dict = {"a": Growing(), "b": 2}
    assert span_attributes(message(attributes(0x4A, grown))) == {"a": "grown", "b": 2}


def test_a_failed_spans_error_type_takes_the_place_of_one_it_set():
    t = Trace(1, "x", SpanKind.SERVER, 0, None, lambda _: None)
    with t.span("upstream") as up:
        up.update({"a": 1, "error.type": None, "b": 2})
        up.fail("timeout")
    with t.span("schedule") as plain:
        plain.set("error.type", "set by hand")  # not failed: no status, the value as set
    t.end()
    _, up_span, plain_span = (message(x) for x in message(encode_trace(t))[2])
    keys = [message(kv)[1][0] for kv in up_span[9]]
    assert keys == [b"a", b"error.type", b"b"] and span_attributes(up_span)["error.type"] == "timeout"
    assert span_attributes(plain_span) == {"error.type": "set by hand"} and 15 not in plain_span


def test_the_collectors_answer_says_how_many_spans_it_refused():
    assert rejected_spans(b"") == 0  # ExportTraceServiceResponse{}: every span taken
    partial = b"\x08\x07" + b"\x12\x02no"  # ExportTracePartialSuccess{rejected_spans: 7, error_message}
    assert rejected_spans(b"\x0a" + bytes([len(partial)]) + partial) == 7
    with pytest.raises(ValueError):
        rejected_spans(b"\x0a\x09\x08")  # a length past the end


@pytest.mark.parametrize(
    "bad",
    [
        "grpc://c:4317",
        "http://c:abc",
        "http://u:p@c:4318",
        "http://c:4318?x=1",
        "http://c:4318/v1/traces#x",
        "c:4318",
    ],
)
def test_the_collectors_endpoint_is_a_url_with_a_host_and_maybe_a_path(bad):
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        _endpoint(bad)


@pytest.mark.parametrize(
    ("endpoint", "url"),
    [
        ("http://c:4318", "http://c:4318/v1/traces"),
        ("https://[::1]:4318/", "https://[::1]:4318/v1/traces"),
        ("http://c:4318/v1/traces", "http://c:4318/v1/traces"),
        ("https://gw.example/tenant-a/otlp/v1/traces", "https://gw.example/tenant-a/otlp/v1/traces"),
    ],
)
def test_traces_go_to_otlps_path_unless_the_endpoint_names_one(endpoint, url):
    assert TracingConfig(endpoint=_endpoint(endpoint)).traces_url == url
