"""The Endpoint Picker protocol's shapes, as pure functions over Envoy's ext_proc messages.

What the picker reads: the request's pseudo-headers and headers (``request_headers``), then its whole
body (``request_body``: Envoy's BUFFERED mode, or FULL_DUPLEX_STREAMED chunks it gathers). What it sets:
``x-gateway-destination-endpoint`` (the chosen engine as ``ip:port``) as a request header and, the same
value, under the ``envoy.lb`` dynamic metadata namespace; ``X-Data-Parallel-Rank`` when the decision
pins a rank. A request it refuses gets an immediate response in OpenAI's error shape, as the proxy's.

In FULL_DUPLEX_STREAMED mode Envoy forwards no body of its own: every body chunk goes on as the
picker's streamed answer (``streamed``), and the answers keep HTTP's order, headers, body, trailers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from ..proxy.errors import ProxyError
from ..proxy.headers import DEBUG_PREDICTION_HEADER, RANK_HEADER
from ..scheduling.types import Target
from ..tracing.context import TRACEPARENT, TRACESTATE

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET = "x-gateway-destination-endpoint-subset"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# A disaggregated fleet's remote prefill, as llm-d's routing sidecar beside a decode engine reads it: the
# prefill engine's ip:port (its older name, a URL, is read when this one is absent). Only the picker
# sets either: a client's own would point the sidecar at any address.
PREFILLER = "x-prefiller-host-port"
PREFILLER_HEADERS = (PREFILLER, "x-prefiller-url")
# The request headers a pick takes out, as the proxy never forwards them: the router's own (a client
# may send them), and Accept-Encoding (the picker reads the answer: compressed, it would pass unread).
ROUTER_ONLY = (DEBUG_PREDICTION_HEADER.lower(), "accept-encoding")
# At most this much body per streamed answer, as the reference picker splits a body.
STREAMED_CHUNK = 62_000
# TEST ONLY (--epp-conformance-test), as the extension's conformance suite drives a picker: the
# endpoints a request names for itself, and the response header that says which one served it.
TEST_SELECTION = "test-epp-endpoint-selection"
TEST_SERVED = "x-conformance-test-served-endpoint"
_PHASE_ANSWERS = {
    "request_headers": ep.HeadersResponse,
    "response_headers": ep.HeadersResponse,
    "request_body": ep.BodyResponse,
    "response_body": ep.BodyResponse,
    "request_trailers": ep.TrailersResponse,
    "response_trailers": ep.TrailersResponse,
}


def duplex_of(message: ep.ProcessingRequest) -> tuple[bool, bool]:
    """Whether the request's and the response's bodies come FULL_DUPLEX_STREAMED, from the protocol
    configuration Envoy sends with a stream's first message (absent: an older Envoy, not duplex)."""
    config = message.protocol_config
    duplex = ProcessingMode.FULL_DUPLEX_STREAMED
    return config.request_body_mode == duplex, config.response_body_mode == duplex


def header_pairs(message: ep.HttpHeaders) -> list[tuple[str, str]]:
    """Envoy's header map as (lower-case name, value) pairs, in order, a repeated header once per value.
    Envoy sends values as ``raw_value`` bytes or ``value``."""
    return [
        (h.key.lower(), h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value)
        for h in message.headers.headers
    ]


def headers_of(message: ep.HttpHeaders) -> dict[str, str]:
    """Envoy's header map as a dict (a repeated header keeps its last value)."""
    return dict(header_pairs(message))


def subset_of(metadata: base_pb2.Metadata) -> frozenset[str] | None:
    """The endpoints the gateway allows (``ip:port``), from the filter metadata Envoy forwards
    (``envoy.lb.subset_hint``): a list of strings, or one comma-separated string; None: no hint."""
    hint = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if hint is None or SUBSET not in hint.fields:
        return None
    value = hint.fields[SUBSET]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(i.strip() for i in items if i.strip())


def header(name: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=name, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def picked(
    target: Target,
    *,
    phase: str,
    body: bytes | None = None,
    fallbacks: Sequence[Target] = (),
    headers: Mapping[str, str] | None = None,
    drop: Sequence[str] = ROUTER_ONLY,
) -> ep.ProcessingResponse:
    """The answer that sends the request to ``target``, then to ``fallbacks`` in order on a gateway's
    retry (``ip:port,ip:port``), to the ``phase`` the pick is answered in (``request_headers`` for a
    request without a body, and for every FULL_DUPLEX_STREAMED one; else the BUFFERED ``request_body``,
    with ``body`` instead of the one sent, None: as sent). ``headers``: set on the request too (a
    traced request's ``traceparent``, a remote prefill's ``PREFILLER``; a client's own prefiller headers
    are removed, and its ``tracestate`` where the router sets a ``traceparent``: ``put_context``).
    ``drop``: the router's own request headers (lower-case), removed as the proxy never forwards them."""
    where = ",".join(t.endpoint for t in (target, *fallbacks))
    mutation = [header(DESTINATION, where)]
    mutation += [header(k, v) for k, v in (headers or {}).items()]
    removed = list(drop)
    if target.rank is not None:
        mutation.append(header(RANK_HEADER, str(target.rank)))
    else:  # a client's own rank would reach the engine, as the proxy never lets it
        removed.append(RANK_HEADER.lower())
    removed += [h for h in PREFILLER_HEADERS if h not in (headers or {})]
    if headers and TRACEPARENT in headers and TRACESTATE not in headers:
        removed.append(TRACESTATE)  # the client's, which belongs to the traceparent it came with
    if body is not None:  # Envoy refuses a buffered body whose Content-Length no longer says its size
        mutation.append(header("content-length", str(len(body))))
    common = ep.CommonResponse(
        header_mutation=ep.HeaderMutation(set_headers=mutation, remove_headers=removed)
    )
    if body is not None:
        common.body_mutation.body = body
    metadata = struct_pb2.Struct()  # {LB_NAMESPACE: {DESTINATION: where}}; Struct.update is slow
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = where
    if phase == "request_headers":
        return ep.ProcessingResponse(
            request_headers=ep.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=metadata)


def proceed(phase: str) -> ep.ProcessingResponse:
    """Go on unchanged (the headers of a request whose body decides; a chunk nothing rewrites)."""
    return ep.ProcessingResponse(**{phase: _PHASE_ANSWERS[phase]()})


def streamed(phase: str, body: bytes, *, end: bool) -> list[ep.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: ``body`` goes on as the picker's answers to a ``phase`` body, in chunks of
    at most STREAMED_CHUNK bytes; ``end``: it is the last of the body."""
    pieces = [body[i : i + STREAMED_CHUNK] for i in range(0, len(body), STREAMED_CHUNK)] or [b""]
    answers = []
    for i, piece in enumerate(pieces):
        answer = ep.ProcessingResponse()
        # Set in place: nested constructors would copy the piece once per level (3x the cost per chunk).
        part = getattr(answer, phase).response.body_mutation.streamed_response
        part.body = piece
        part.end_of_stream = end and i == len(pieces) - 1
        answers.append(answer)
    return answers


def rewritten(phase: str, body: bytes) -> ep.ProcessingResponse:
    """A streamed body chunk, replaced (the usage the router asked for, taken out again)."""
    answer = ep.ProcessingResponse()
    getattr(answer, phase).response.body_mutation.body = body  # set in place, as ``streamed`` says why
    return answer


def refused(error: ProxyError) -> ep.ProcessingResponse:
    """The picker answers the client itself: OpenAI's error JSON with the error's status."""
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.status),
            headers=ep.HeaderMutation(
                set_headers=[header("content-type", "application/json")]
                + [header(k, v) for k, v in error.headers.items()]  # Retry-After
            ),
            body=json.dumps(error.to_json()).encode(),
            details=error.outcome,
        )
    )


def with_headers(answer: ep.ProcessingResponse, added: Mapping[str, str]) -> ep.ProcessingResponse:
    """``answer`` (to response headers) also setting ``added`` on the response."""
    if added:
        answer.response_headers.response.header_mutation.set_headers.extend(
            header(k, v) for k, v in added.items()
        )
    return answer


def served_by(
    attributes: Mapping[str, struct_pb2.Struct], metadata: base_pb2.Metadata | None = None
) -> str | None:
    """The ``ip:port`` that answered, after any retry: the protocol's ``envoy.lb`` metadata
    (x-gateway-destination-endpoint-served) when the gateway forwards it, else Envoy's
    ``upstream.address`` response attribute."""
    stated = served_metadata(metadata)
    if stated is not None:
        return stated
    ours = attributes.get("envoy.filters.http.ext_proc")
    if ours is None or "upstream.address" not in ours.fields:
        return None
    return ours.fields["upstream.address"].string_value or None


def served_metadata(metadata: base_pb2.Metadata | None) -> str | None:
    """The served endpoint as the protocol hands it over: ``envoy.lb`` filter metadata."""
    lb = metadata.filter_metadata.get(LB_NAMESPACE) if metadata is not None else None
    if lb is None or SERVED not in lb.fields:
        return None
    return lb.fields[SERVED].string_value or None


def named_endpoints(value: str | None, endpoints: Sequence[str]) -> frozenset[str] | None:
    """TEST ONLY: the ``endpoints`` (``host:port``) a TEST_SELECTION header allows: its items are
    comma-separated ``ip`` (every port of that address) or ``ip:port`` (IPv6 in brackets); None: no
    header, no restriction. An item that names none of ``endpoints`` allows nothing."""
    if value is None or not value.strip():
        return None
    # Each endpoint as (host, port), an IPv6 host without its brackets (Target.endpoint has them).
    split = [
        (h.removeprefix("[").removesuffix("]"), p, e) for e in endpoints for h, _, p in [e.rpartition(":")]
    ]
    allowed: set[str] = set()
    for item in (i.strip() for i in value.split(",")):
        if item.startswith("["):
            host, _, rest = item[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else ""
        elif item.count(":") == 1:
            host, _, port = item.partition(":")
        else:  # an address alone (a bare IPv6 one included)
            host, port = item, ""
        allowed.update(e for h, p, e in split if h == host and (not port or p == port))
    return frozenset(allowed)


def status_of(headers: Mapping[str, str]) -> int:
    """The ``:status`` of response headers (0 when missing or malformed)."""
    try:
        return int(headers.get(":status", "0"))
    except ValueError:
        return 0
