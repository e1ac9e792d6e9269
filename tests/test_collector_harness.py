"""The tests' OpenTelemetry Collector (e2e/tracing, the real binary `make otelcol` builds): a span sent
over OTLP gRPC with opentelemetry-proto's own message classes and stub (not the router's encoder, which
tests/test_tracing.py checks through it) comes back from the file exporter with its resource and
attributes."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsg
from opentelemetry.proto.common.v1 import common_pb2 as cp
from opentelemetry.proto.resource.v1 import resource_pb2 as rp
from opentelemetry.proto.trace.v1 import trace_pb2 as tp

from e2e.tracing.collector import running_collector

TRACE_ID = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
SPAN_ID = bytes.fromhex("00f067aa0ba902b7")


def kv(key: str, value: cp.AnyValue) -> cp.KeyValue:
    return cp.KeyValue(key=key, value=value)


# Generous for a cold build of the binary on first use (about 1.5 minutes); seconds once built.
@pytest.mark.timeout(240)
def test_span_round_trip(tmp_path: Path) -> None:
    now = time.time_ns()
    span = tp.Span(
        trace_id=TRACE_ID,
        span_id=SPAN_ID,
        name="route",
        kind=tp.Span.SPAN_KIND_CLIENT,
        start_time_unix_nano=now,
        end_time_unix_nano=now + 1000,
        attributes=[
            kv("route.replica", cp.AnyValue(string_value="engine-2")),
            kv("route.blocks", cp.AnyValue(int_value=7)),
            kv(
                "route.candidates",
                cp.AnyValue(
                    array_value=cp.ArrayValue(
                        values=[cp.AnyValue(string_value="engine-1"), cp.AnyValue(string_value="engine-2")]
                    )
                ),
            ),
        ],
        events=[tp.Span.Event(time_unix_nano=now + 500, name="picked")],
        status=tp.Status(code=tp.Status.STATUS_CODE_ERROR, message="no capacity"),
    )
    resource = rp.Resource(attributes=[kv("service.name", cp.AnyValue(string_value="collector-harness"))])
    request = ts.ExportTraceServiceRequest(
        resource_spans=[tp.ResourceSpans(resource=resource, scope_spans=[tp.ScopeSpans(spans=[span])])]
    )
    with running_collector(tmp_path) as collector:
        with grpc.insecure_channel(collector.endpoint.removeprefix("http://")) as channel:
            tsg.TraceServiceStub(channel).Export(request, timeout=10)
        [got] = collector.spans(min_count=1)

    assert got["name"] == "route"
    assert got["attributes"] == {
        "route.replica": "engine-2",
        "route.blocks": 7,
        "route.candidates": ["engine-1", "engine-2"],
    }
    assert got["resource"]["service.name"] == "collector-harness"
    # OTLP JSON spells ids as hex (not the protobuf JSON mapping's base64) and enums as numbers.
    assert got["traceId"] == TRACE_ID.hex() and got["spanId"] == SPAN_ID.hex()
    assert got.get("parentSpanId", "") == ""
    assert got["kind"] == 3  # SPAN_KIND_CLIENT
    assert got["status"] == {"code": 2, "message": "no capacity"}  # STATUS_CODE_ERROR
    assert int(got["endTimeUnixNano"]) == now + 1000
    assert [e["name"] for e in got["events"]] == ["picked"]
