"""OTLP's trace export request as protobuf bytes, written directly, and its answer read (pure
functions).

Why not the protobuf classes (opentelemetry-proto): building a span's message objects costs about 30 us
in Python (the upb backend copies each nested message in), which is what tracing a request would cost the
router again; and the package cannot be installed beside xds-protos (the endpoint picker's Envoy stubs),
which ships its own, older ``opentelemetry/proto`` files at the same paths. Written as bytes, with the
encoding of each recurring (key, value) remembered, a trace of five spans costs a fraction of that. The
fields are those of OTLP v1's ``trace.proto``, ``common.proto``, ``resource.proto`` and
``trace_service.proto``; tests/test_tracing.py has a real collector read them.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence

from .spans import Attr, Trace

_SMALL = [bytes((i,)) for i in range(128)]
_U64 = (1 << 64) - 1
_INT64 = range(-(1 << 63), 1 << 63)
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack


def varint(n: int) -> bytes:
    if n < 128 and n >= 0:
        return _SMALL[n]
    n &= _U64  # a negative int64 is its two's complement, ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the payload's length, the payload."""
    n = len(payload)
    return tag + (_SMALL[n] if n < 128 else varint(n)) + payload


def any_value(v: Attr) -> bytes:
    """An AnyValue; never raises (what it cannot type goes as text, None in a list is left out), so one
    odd value cannot cost the batch it is in."""
    if isinstance(v, str):
        return field(b"\x0a", v.encode())
    if isinstance(v, bool):  # before int: a bool is an int
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, int) and v in _INT64:
        return b"\x18" + varint(v)
    if isinstance(v, float):
        return b"\x21" + _double(v)
    if isinstance(v, list | tuple):
        return field(b"\x2a", b"".join(field(b"\x0a", any_value(x)) for x in v if x is not None))
    return field(b"\x0a", str(v).encode())


# (key, value) -> the encoded KeyValue, for the values that recur from one request to the next: text
# (names, reasons, outcomes, engines), flags, and short lists of one type (the candidates' engines, their
# matched blocks per tier, their loads). Single numbers mostly differ, and cost little to write.
_KV_CACHE: dict[tuple, bytes] = {}
_KV_CACHE_MAX = 8192
_LISTED = (str, int, float)


def _cache_key(tag: bytes, key: str, v: Attr) -> tuple | None:
    t = type(v)
    if t is str or t is bool:
        return (tag, key, t, v)
    if t is list and len(v) <= 16:
        first = type(v[0]) if v else str
        if first in _LISTED and all(type(x) is first for x in v):  # [1] and [True] are not one key
            return (tag, key, first, tuple(v))
    return None


def key_value(key: str, v: Attr) -> bytes:
    """A KeyValue (KeyValue.key = 1, .value = 2)."""
    return field(b"\x0a", key.encode()) + field(b"\x12", any_value(v))


def attribute(tag: bytes, key: str, v: Attr) -> bytes:
    """One attribute as the repeated field ``tag`` of its message."""
    k = _cache_key(tag, key, v)
    hit = _KV_CACHE.get(k) if k is not None else None
    if hit is None:
        hit = field(tag, key_value(key, v))
        if k is not None:
            if len(_KV_CACHE) >= _KV_CACHE_MAX:
                _KV_CACHE.clear()
            _KV_CACHE[k] = hit
    return hit


def attributes(tag: bytes, attrs: Mapping[str, Attr | None]) -> bytes:
    """Each attribute that has a value (None: the span does not have it)."""
    return b"".join([attribute(tag, k, v) for k, v in attrs.items() if v is not None])


_ERROR_STATUS = field(b"\x7a", b"\x18\x02")  # Span.status = 15: Status.code = 3, STATUS_CODE_ERROR


def span_bytes(trace: Trace, trace_id: bytes) -> list[bytes]:
    out = []
    for s in trace.spans:
        attrs = s.attributes if s.error is None else {**s.attributes, "error.type": s.error}
        parts = [b"\x0a\x10", trace_id, b"\x12\x08", s.span_id.to_bytes(8, "big")]
        if s is trace.root and trace.tracestate:
            parts.append(field(b"\x1a", trace.tracestate.encode()))
        if s.parent_id:
            parts += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
        parts += (
            field(b"\x2a", s.name.encode()),
            b"\x30",
            varint(int(s.kind)),
            b"\x39",
            _fixed64(s.start_ns),
            b"\x41",
            _fixed64(s.end_ns),
            attributes(b"\x4a", attrs),
        )
        for at, name, event_attrs in s.events:  # Span.events = 11: time 1, name 2, attributes 3
            parts.append(
                field(
                    b"\x5a",
                    b"\x09" + _fixed64(at) + field(b"\x12", name.encode()) + attributes(b"\x1a", event_attrs),
                )
            )
        if s.error is not None:
            parts.append(_ERROR_STATUS)
        out.append(b"".join(parts))
    return out


def encode_trace(trace: Trace) -> bytes:
    """A finished trace's spans, as ScopeSpans' repeated ``spans`` field (2) holds them."""
    return b"".join(field(b"\x12", s) for s in span_bytes(trace, trace.trace_id.to_bytes(16, "big")))


def export_request(traces: Sequence[bytes], resource: Mapping[str, Attr], scope: str, version: str) -> bytes:
    """ExportTraceServiceRequest{resource_spans: [{resource, scope_spans: [{scope, spans}]}]} of
    ``traces`` (each ``encode_trace``'s): one resource (this router) and one instrumentation scope."""
    spans = b"".join(traces)
    scope_msg = field(b"\x0a", field(b"\x0a", scope.encode()) + field(b"\x12", version.encode()))
    scope_spans = field(b"\x12", scope_msg + spans)
    resource_msg = field(b"\x0a", attributes(b"\x0a", resource))
    return field(b"\x0a", resource_msg + scope_spans)


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
