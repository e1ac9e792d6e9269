"""The tests' OpenTelemetry Collector (e2e/tracing, the real binary `make otelcol` builds): a span the
Python SDK exports over OTLP gRPC comes back from the file exporter with its resource and attributes."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from e2e.tracing.collector import running_collector


# Generous for a cold build of the binary on first use (about 1.5 minutes); seconds once built.
@pytest.mark.timeout(240)
def test_span_round_trip(tmp_path: Path) -> None:
    with running_collector(tmp_path) as collector:
        provider = TracerProvider(resource=Resource.create({"service.name": "collector-harness"}))
        # Simple (synchronous) export: the span is in the collector when the `with` below ends.
        exporter = OTLPSpanExporter(endpoint=collector.endpoint, insecure=True, timeout=10)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("tests.collector_harness")
        attrs = {"route.replica": "engine-2", "route.blocks": 7, "route.candidates": ["engine-1", "engine-2"]}
        with tracer.start_as_current_span("route", kind=SpanKind.CLIENT, attributes=attrs) as span:
            span.add_event("picked", {"score": 0.5})
            span.set_status(Status(StatusCode.ERROR, "no capacity"))
        context = span.get_span_context()
        provider.shutdown()

        [got] = collector.spans(min_count=1)

    assert got["name"] == "route"
    assert got["attributes"] == attrs
    assert got["resource"]["service.name"] == "collector-harness"
    # OTLP JSON spells ids as hex (not the protobuf JSON mapping's base64) and enums as numbers.
    assert got["traceId"] == format(context.trace_id, "032x")
    assert got["spanId"] == format(context.span_id, "016x")
    assert got.get("parentSpanId", "") == ""
    assert got["kind"] == 3  # SPAN_KIND_CLIENT
    assert got["status"] == {"code": 2, "message": "no capacity"}  # STATUS_CODE_ERROR
    assert int(got["endTimeUnixNano"]) >= int(got["startTimeUnixNano"]) > 0
    assert [e["name"] for e in got["events"]] == ["picked"]
