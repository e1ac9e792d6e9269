"""Tracing's pure parts (router_runtime/tracing/): W3C trace context, the sampling rule, one request's
spans, their OTLP encoding; and the scheduler framework's explanation of a decision."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

from router_runtime.scheduling.presets import make_policy
from router_runtime.scheduling.types import RouteRequest, Target
from router_runtime.tracing.config import TracingConfig, _endpoint
from router_runtime.tracing.context import parse_traceparent, sampled, traceparent
from router_runtime.tracing.spans import NO_TRACE, SpanKind, Trace, Tracer
from router_runtime.tracing.wire import any_value, attribute, encode_trace, export_request, key_value

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
    assert sampled(parent, 0, 0.0) and not sampled(unsampled, 0, 1.0)
    low, high = 1, (1 << 64) - 1  # the trace id's low 64 bits decide
    assert sampled(None, low, 0.5) and not sampled(None, high, 0.5)
    assert not sampled(None, low, 0.0) and sampled(None, high, 1.0)
    ids = range(1, 1 << 64, (1 << 64) // 1000)
    assert 90 <= sum(sampled(None, i, 0.1) for i in ids) <= 110


def name() -> str:
    return "POST /v1/completions"


def test_a_tracer_follows_the_client_and_names_its_own_span_to_the_engine():
    finished: list[Trace] = []
    tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:4317", sample_ratio=0.0), finished.append)
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
    off = Tracer(TracingConfig(), finished.append)
    assert off.start(CIMultiDict(traceparent=f"00-{TRACE}-{SPAN}-01"), name) is NO_TRACE


def test_the_unsampled_trace_records_nothing():
    span = NO_TRACE.span("parse")
    with span:
        span.set("a", 1)
        span.update({"b": 2})
    assert not span.recording and NO_TRACE.headers(span) == {}
    NO_TRACE.end()


def test_spans_encode_as_otlp():
    t = Trace(
        int(TRACE, 16), "POST /v1/chat/completions", SpanKind.SERVER, int(SPAN, 16), "k=v", lambda _: None
    )
    child = t.span("schedule")
    child.update({"s": "x", "b": True, "i": 3, "f": 0.5, "l": [1, 2], "ls": ["a"], "none": None})
    child.event("failed_over", {"routerfleet.engine": "e1"})
    child.end()
    with t.span("upstream", SpanKind.CLIENT) as up:
        up.fail("timeout")
    t.end()
    wire = ExportTraceServiceRequest.FromString(
        export_request(
            [encode_trace(t)] * 2, {"service.name": "routerfleet-router"}, "routerfleet.router", "0.1.0"
        )
    )
    (rs,) = wire.resource_spans
    assert rs.resource.attributes[0].value.string_value == "routerfleet-router"
    (scope,) = rs.scope_spans
    assert (scope.scope.name, scope.scope.version) == ("routerfleet.router", "0.1.0")
    root, sched, upstream, *again = scope.spans
    assert again == [root, sched, upstream]  # a second trace in the batch: its spans follow
    assert root.trace_id.hex() == TRACE and root.parent_span_id.hex() == SPAN and root.trace_state == "k=v"
    assert root.kind == trace_pb2.Span.SPAN_KIND_SERVER and upstream.kind == trace_pb2.Span.SPAN_KIND_CLIENT
    assert sched.parent_span_id == root.span_id and sched.end_time_unix_nano >= sched.start_time_unix_nano
    got = {kv.key: kv.value for kv in sched.attributes}
    assert got["s"].string_value == "x" and got["b"].bool_value is True and got["i"].int_value == 3
    assert got["f"].double_value == 0.5 and [v.int_value for v in got["l"].array_value.values] == [1, 2]
    assert "none" not in got and sched.events[0].name == "failed_over"
    assert upstream.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert {kv.key: kv.value.string_value for kv in upstream.attributes}["error.type"] == "timeout"
    assert sched.status.code == trace_pb2.Status.STATUS_CODE_UNSET


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
        return AnyValue.FromString(any_value(v))

    assert value([1, None, 2]).array_value.values[1].int_value == 2
    assert value(-5).int_value == -5 and value(0.25).double_value == 0.25 and value(False).bool_value is False
    assert value(1 << 70).string_value == str(1 << 70)
    assert value((True,)).array_value.values[0].bool_value is True
    assert value(object()).string_value.startswith("<object")
    assert (
        value("\u00e9t\u00e9").string_value == "\u00e9t\u00e9" and len(value("x" * 300).string_value) == 300
    )
    # Text values are remembered encoded; a list of them too, by its contents.
    kv = KeyValue.FromString(key_value("routerfleet.candidates.engine", ["a", "b"]))
    assert kv.key == "routerfleet.candidates.engine" and [
        v.string_value for v in kv.value.array_value.values
    ] == ["a", "b"]
    assert attribute(b"\x4a", "k", ["a"]) is attribute(b"\x4a", "k", ["a"])
    assert attribute(b"\x4a", "k", True) != attribute(b"\x4a", "k", 1) != attribute(b"\x4a", "k", [1])


@pytest.mark.parametrize(
    "bad",
    [
        "grpc://c:4317",
        "http://c:4318/v1/traces",
        "http://c:abc",
        "http://u:p@c:4317",
        "http://c:4317?x=1",
        "c:4317",
    ],
)
def test_the_collectors_endpoint_is_a_url_with_a_host_and_nothing_else(bad):
    with pytest.raises(ValueError, match="expected http://HOST:PORT"):
        _endpoint(bad)
    assert _endpoint("https://[::1]:4317/") == "https://[::1]:4317/"
