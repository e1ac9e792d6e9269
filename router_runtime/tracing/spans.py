"""One request's spans, recorded as plain objects and handed whole to the exporter when the request ends.

Why not the OpenTelemetry SDK's tracer: its spans cost about 14 us each to record and its OTLP encoder
about 55 us more each (measured here, Python 3.11), three times what the router spends on a whole
request; these cost about 2 us each, and ``wire.py`` writes them as OTLP protobuf bytes. A request that
is not sampled gets ``NO_TRACE``, whose every method does nothing: the proxy and the picker call the same
methods either way, and check ``recording`` before building attributes that cost anything.

Attributes are str, bool, int, float or lists of one of them (OTLP's AnyValue). Never a prompt, token
IDs or block hashes: counts, names and verdicts only (the house rule for logs).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from typing import Any

from multidict import MultiMapping

from .config import TracingConfig
from .context import (
    TRACEPARENT,
    TRACESTATE,
    Parent,
    new_id,
    parse_traceparent,
    sampled,
    sampling_bound,
    traceparent,
)

Attr = str | bool | int | float | list


class SpanKind(enum.IntEnum):
    """OTLP's span kinds (the values its protobuf enum gives them)."""

    INTERNAL = 1
    SERVER = 2
    CLIENT = 3


class Span:
    __slots__ = (
        "attributes",
        "end_ns",
        "error",
        "events",
        "kind",
        "name",
        "parent_id",
        "span_id",
        "start_ns",
    )

    recording = True

    def __init__(self, name: str, parent_id: int, kind: SpanKind) -> None:
        self.name = name
        self.span_id = new_id(64)
        self.parent_id = parent_id  # 0: none (a root without a client's parent)
        self.kind = kind
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.attributes: dict[str, Attr | None] = {}
        self.events: list[tuple[int, str, dict[str, Attr]]] = []
        self.error: str | None = None  # error.type, and the span's status ERROR

    def set(self, key: str, value: Attr | None) -> None:
        """An attribute; None is one the span does not have (it is not exported)."""
        self.attributes[key] = value

    def update(self, attributes: Mapping[str, Attr | None]) -> None:
        self.attributes.update(attributes)

    def event(self, name: str, attributes: Mapping[str, Attr] | None = None) -> None:
        self.events.append((time.time_ns(), name, dict(attributes or {})))

    def fail(self, error_type: str) -> None:
        self.error = error_type

    def end(self) -> None:
        if not self.end_ns:
            self.end_ns = time.time_ns()

    def __enter__(self) -> Span:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if exc_type is not None and self.error is None:
            self.fail(getattr(exc, "outcome", None) or exc_type.__name__)
        self.end()


class Trace:
    """A sampled request's trace: its root span (the request at this router) and its children."""

    __slots__ = ("_finish", "root", "spans", "trace_id", "tracestate")

    recording = True

    def __init__(
        self,
        trace_id: int,
        name: str,
        kind: SpanKind,
        parent_span_id: int,
        tracestate: str | None,
        finish: Callable[[Trace], None],
    ) -> None:
        self.trace_id = trace_id
        self.tracestate = tracestate  # the client's, passed on to the engine as it came
        self.root = Span(name, parent_span_id, kind)
        self.spans = [self.root]
        self._finish = finish

    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Span | None = None) -> Span:
        """A child of ``parent`` (the root by default), started now."""
        s = Span(name, (parent or self.root).span_id, kind)
        self.spans.append(s)
        return s

    def headers(self, span: Span) -> dict[str, str]:
        """What tells the engine that ``span`` is its request's parent."""
        out = {TRACEPARENT: traceparent(self.trace_id, span.span_id)}
        if self.tracestate:
            out[TRACESTATE] = self.tracestate
        return out

    @property
    def trace_id_hex(self) -> str:
        return f"{self.trace_id:032x}"

    def end(self) -> None:
        """The request is over: spans still open (a response cut short) end with it, once."""
        if self.root.end_ns:
            return
        self.root.end()
        for s in self.spans:
            if not s.end_ns:
                s.end_ns = self.root.end_ns
                s.error = s.error or "cancelled"
        self._finish(self)


class _NoSpan(Span):
    __slots__ = ()
    recording = False

    def __init__(self) -> None:  # no id, no clock: nothing is recorded
        pass

    def set(self, key: str, value: Attr | None) -> None:
        pass

    def update(self, attributes: Mapping[str, Attr | None]) -> None:
        pass

    def event(self, name: str, attributes: Mapping[str, Attr] | None = None) -> None:
        pass

    def fail(self, error_type: str) -> None:
        pass

    def end(self) -> None:
        pass

    def __enter__(self) -> Span:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        pass


NO_SPAN = _NoSpan()


class _NoTrace(Trace):
    __slots__ = ()
    recording = False

    def __init__(self) -> None:
        self.root = NO_SPAN

    def span(self, name: str, kind: SpanKind = SpanKind.INTERNAL, parent: Span | None = None) -> Span:
        return NO_SPAN

    def headers(self, span: Span) -> dict[str, str]:
        return {}

    def end(self) -> None:
        pass


NO_TRACE: Trace = _NoTrace()


class _Declined(_NoTrace):
    """A request this router chose not to trace, with no client's context: the engine is told so
    (flags 00), as OpenTelemetry propagates a sampler's "no", so a parent-based engine does not start a
    trace of its own."""

    __slots__ = ("_trace_id",)

    def __init__(self, trace_id: int) -> None:
        self.root = NO_SPAN
        self._trace_id = trace_id

    def headers(self, span: Span) -> dict[str, str]:
        return {TRACEPARENT: traceparent(self._trace_id, new_id(64), sampled=False)}


# The W3C limit on tracestate: a longer one is dropped rather than cut mid-entry. So is one that is not
# ASCII, which the W3C grammar never is (bytes that are not UTF-8 could not be encoded: the trace lost).
MAX_TRACESTATE = 512


def server_error(status: int, outcome: str) -> bool:
    """Whether a request's root span failed: the server answered 5xx, or the response was cut (a 4xx is
    the client's error, not the server span's, as OpenTelemetry's HTTP conventions say)."""
    return status >= 500 or outcome in ("error", "timeout", "upstream_error")


class Tracer:
    """Starts a request's trace, or a non-recording one; a finished trace goes to ``sink`` (the
    exporter)."""

    def __init__(self, config: TracingConfig, sink: Callable[[Trace], None] | None) -> None:
        self.bound = sampling_bound(config.sample_ratio)
        self.sink = sink if config.enabled else None

    def start(
        self, headers: MultiMapping[str], name: Callable[[], str], kind: SpanKind = SpanKind.SERVER
    ) -> Trace:
        """The request's trace; ``name`` (the root span's) is asked only when it is traced."""
        sink = self.sink
        if sink is None:
            return NO_TRACE
        given = headers.getall(TRACEPARENT, ())
        parent: Parent | None = parse_traceparent(given[0]) if len(given) == 1 else None  # several: invalid
        if parent is None:
            trace_id = new_id(128)
            if not sampled(None, trace_id, self.bound):
                return _Declined(trace_id)
            return Trace(trace_id, name(), kind, 0, None, sink)
        if not parent.sampled:
            return NO_TRACE  # the client's own traceparent reaches the engine, with its headers
        state = ",".join(headers.getall(TRACESTATE, ()))
        state = state if len(state) <= MAX_TRACESTATE and state.isascii() else ""
        return Trace(parent.trace_id, name(), kind, parent.span_id, state or None, sink)


OFF = Tracer(TracingConfig(), None)
