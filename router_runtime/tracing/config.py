"""The tracing section (``RouterConfig.tracing``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..flags import Flag, Real, Text


def _endpoint(text: str) -> str:
    """An OTLP/gRPC collector's URL: a scheme and a host, maybe a port; nothing else (a path is
    OTLP/HTTP's, and credentials would show in the process's arguments)."""
    bad = ValueError(f"expected http://HOST:PORT or https://HOST:PORT (OTLP/gRPC), got {text!r}")
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError:
        raise bad from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or parts.username is not None
        or parts.query
        or parts.fragment
    ):
        raise bad
    return text


@dataclass(frozen=True, slots=True)
class TracingConfig:
    # The collector's OTLP/gRPC endpoint (http://: plaintext; https://: TLS). None: tracing off.
    endpoint: str | None = None
    # Of the requests without a sampled parent, the ratio traced (by trace id, as OpenTelemetry's
    # TraceIdRatioBased sampler decides); a parent's decision is followed either way.
    sample_ratio: float = 1.0
    service_name: str = "routerfleet-router"

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None


FLAGS = (
    Flag(
        "--otlp-traces-endpoint",
        "tracing.endpoint",
        Text(_endpoint),
        metavar="URL",
        default_text="off",
        help="export request traces over OTLP/gRPC to this collector (http://H:P plaintext, https://H:P"
        " TLS); W3C traceparent is read from clients and passed on to the engines (docs/tracing.md)",
    ),
    Flag(
        "--trace-sample-ratio",
        "tracing.sample_ratio",
        Real(0.0, hi=1.0),
        "the ratio of requests traced among those whose client sent no sampled traceparent (parent-based:"
        " a client's decision is followed)",
    ),
    Flag(
        "--trace-service-name",
        "tracing.service_name",
        Text(),
        "the service.name of the router's spans",
    ),
)
