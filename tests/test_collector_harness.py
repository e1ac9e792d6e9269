"""The tests' OpenTelemetry Collector (e2e/tracing, the real binary `make otelcol` builds): a span sent
over OTLP/HTTP comes back from the file exporter with its resource, attributes, event and status, in the
OTLP JSON shapes e2e/tracing/collector.py decodes."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest

from e2e.tracing.collector import running_collector
from router_runtime.tracing.config import TracingConfig
from router_runtime.tracing.export import PROTOBUF
from router_runtime.tracing.spans import SpanKind, Trace
from router_runtime.tracing.wire import encode_trace, export_request, rejected_spans

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


# Generous for a cold build of the binary on first use (about 1.5 minutes); seconds once built.
@pytest.mark.timeout(240)
def test_span_round_trip(tmp_path: Path) -> None:
    t = Trace(int(TRACE_ID, 16), "route", SpanKind.CLIENT, 0, None, lambda _: None)
    t.root.update(
        {"route.replica": "engine-2", "route.blocks": 7, "route.candidates": ["engine-1", "engine-2"]}
    )
    t.root.event("picked")
    t.root.fail("no_capacity")
    t.end()
    request = export_request([encode_trace(t)], {"service.name": "collector-harness"}, "tests", "0")
    with running_collector(tmp_path) as collector:
        url = TracingConfig(endpoint=collector.endpoint).traces_url
        post = urllib.request.Request(url, data=request, headers={"Content-Type": PROTOBUF})
        with urllib.request.urlopen(post, timeout=10) as answer:
            assert answer.status == 200
            assert rejected_spans(answer.read()) == 0
        [got] = collector.spans(min_count=1)

    assert got["name"] == "route"
    assert got["attributes"] == {
        "route.replica": "engine-2",
        "route.blocks": 7,
        "route.candidates": ["engine-1", "engine-2"],
        "error.type": "no_capacity",
    }
    assert got["resource"]["service.name"] == "collector-harness"
    # OTLP JSON spells ids as hex (not the protobuf JSON mapping's base64) and enums as numbers.
    assert got["traceId"] == TRACE_ID and got["spanId"] == f"{t.root.span_id:016x}"
    assert got.get("parentSpanId", "") == ""
    assert got["kind"] == 3  # SPAN_KIND_CLIENT
    assert got["status"] == {"code": 2}  # STATUS_CODE_ERROR
    assert int(got["endTimeUnixNano"]) == t.root.end_ns
    assert [e["name"] for e in got["events"]] == ["picked"]
