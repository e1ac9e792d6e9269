"""OTLP's trace export request as protobuf bytes, written directly, and its answer read (pure
functions).

Why not the protobuf classes (opentelemetry-proto): building a span's message objects costs about 30 us
in Python (the upb backend copies each nested message in), which is what tracing a request would cost the
router again; and the package cannot be installed beside xds-protos (the endpoint picker's Envoy stubs),
which ships its own, older ``opentelemetry/proto`` files at the same paths. The spans and attributes are
written by the native core (``native/src/otlp.rs``: in Python that was over half of tracing's own work
per request), the batch's envelope here. The fields are those of OTLP v1's ``trace.proto``,
``common.proto``, ``resource.proto`` and ``trace_service.proto``; tests/test_tracing.py has a real
collector read them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from routerfleet_index import encode_attributes, encode_spans

from .spans import Attr, Trace

_SMALL = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:
        return _SMALL[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def attributes(tag: int, attrs: Mapping[str, Attr | None]) -> bytes:
    """Each attribute that has a value (None: the message does not have it) as the repeated KeyValue
    field ``tag`` of its message. A value that is not an OTLP type goes as its text: never an error."""
    return encode_attributes(tag, attrs if isinstance(attrs, dict) else dict(attrs))


def encode_trace(trace: Trace) -> bytes:
    """A finished trace's spans, as ScopeSpans' repeated ``spans`` field (2) holds them."""
    return encode_spans(trace.trace_id, trace.tracestate, trace.root, trace.spans)


def export_request(traces: Sequence[bytes], resource: Mapping[str, Attr], scope: str, version: str) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [{resource, scope_spans: [{scope, spans}]}]} of
    ``traces`` (each ``encode_trace``'s): one resource (this router) and one instrumentation scope. The
    envelopes' lengths are summed from their parts, so the batch's spans are copied once."""
    scope_msg = field(b"\x0a", field(b"\x0a", scope.encode()) + field(b"\x12", version.encode()))
    scope_spans_len = len(scope_msg) + sum(len(t) for t in traces)
    scope_spans_head = b"\x12" + _varint(scope_spans_len)
    resource_msg = field(b"\x0a", attributes(0x0A, resource))
    resource_spans_len = len(resource_msg) + len(scope_spans_head) + scope_spans_len
    head = b"\x0a" + _varint(resource_spans_len) + resource_msg + scope_spans_head + scope_msg
    return b"".join((head, *traces))


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """A message's fields in order: (number, value), a varint as an int, a length-delimited field and a
    fixed64/fixed32 as its bytes. Raises ValueError on bytes that are not a message."""
    i, n = 0, len(data)
    while i < n:
        key, i = _read_varint(data, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _read_varint(data, i)
            yield number, value
        elif wire_type == 2:
            size, i = _read_varint(data, i)
            if i + size > n:
                raise ValueError("a length past the message's end")
            yield number, data[i : i + size]
            i += size
        elif wire_type in (1, 5):
            width = 8 if wire_type == 1 else 4
            if i + width > n:
                raise ValueError("a fixed field past the message's end")
            yield number, data[i : i + width]
            i += width
        else:
            raise ValueError(f"wire type {wire_type}")


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("a varint past the message's end")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7


def rejected_spans(answer: bytes) -> int:
    """ExportTraceServiceResponse.partial_success (1) .rejected_spans (1): the spans the collector
    refused (0: all taken)."""
    for number, value in fields(answer):
        if number == 1 and isinstance(value, bytes):
            for inner, count in fields(value):
                if inner == 1 and isinstance(count, int):
                    return count
    return 0
