"""W3C Trace Context (``traceparent``), and the sampling decision: pure functions of the header and a
random source.

    traceparent: 00-<trace id, 32 hex>-<parent span id, 16 hex>-<flags, 2 hex; 01 = sampled>

The decision is OpenTelemetry's ``ParentBased(TraceIdRatioBased(ratio))``: a valid parent's sampled flag
decides; without one, the trace id's low 64 bits against ``ratio`` (so every service that samples by
ratio agrees on the same trace). A malformed header is treated as absent, as the W3C spec says.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from random import getrandbits

from multidict import MutableMultiMapping

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

# Version 00's shape; a later version may carry more after the flags (the spec: parse its prefix).
_HEADER = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_INVALID_TRACE = "0" * 32
_INVALID_SPAN = "0" * 16
_SAMPLED = 0x01


@dataclass(frozen=True, slots=True)
class Parent:
    """A client's trace context."""

    trace_id: int
    span_id: int
    sampled: bool


def parse_traceparent(value: str | None) -> Parent | None:
    """The parent a ``traceparent`` header names (None: absent or malformed)."""
    if not value:
        return None
    m = _HEADER.fullmatch(value.strip())
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest) or trace == _INVALID_TRACE or span == _INVALID_SPAN:
        return None
    return Parent(int(trace, 16), int(span, 16), bool(int(flags, 16) & _SAMPLED))


def traceparent(trace_id: int, span_id: int, *, sampled: bool = True) -> str:
    """The header naming ``span_id`` of a trace as the parent of what the receiver does."""
    # Bytes' hex, not the ints' padded formats: a third of the cost, and every request pays it while
    # tracing is on (a declined one tells the engine so).
    trace, span = trace_id.to_bytes(16, "big").hex(), span_id.to_bytes(8, "big").hex()
    return f"00-{trace}-{span}-{'01' if sampled else '00'}"


def put_context(headers: MutableMultiMapping[str], context: Mapping[str, str]) -> None:
    """Set a trace's ``context`` for the engine (``Trace.headers``') on a request's ``headers``. A
    ``tracestate`` belongs to the ``traceparent`` it came with (W3C), so where the router names its own
    parent, the client's goes unless the trace carries it on; and a repeated traceparent goes whole."""
    if TRACEPARENT in context:
        headers.popall(TRACESTATE, None)
    headers.update(context)


def new_id(bits: int) -> int:
    """A random, non-zero trace (128 bits) or span (64 bits) id."""
    while not (v := getrandbits(bits)):
        pass
    return v


def sampling_bound(ratio: float) -> int:
    """What a trace id's low 64 bits are under when a request is traced at ``ratio``."""
    return int(ratio * (1 << 64))


def sampled(parent: Parent | None, trace_id: int, bound: int) -> bool:
    """Whether a request is traced: as its parent decided, else by its trace id's low 64 bits against
    ``bound`` (``sampling_bound``'s)."""
    if parent is not None:
        return parent.sampled
    return (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < bound
