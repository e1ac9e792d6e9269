"""The tracing section (``RouterConfig.tracing``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from ..flags import Flag, Real, Text

# OTLP/HTTP's path for traces, taken when the endpoint names none (as OTEL_EXPORTER_OTLP_ENDPOINT's is).
TRACES_PATH = "/v1/traces"


def _endpoint(text: str) -> str:
    """An OTLP/HTTP collector's URL: a scheme and a host, maybe a port and a path; nothing else
    (credentials would show in the process's arguments)."""
    bad = ValueError(
        f"expected http://HOST:PORT[/PATH] or https://HOST:PORT[/PATH] (OTLP/HTTP), got {text!r}"
    )
    parts = urlsplit(text)
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError:
        raise bad from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.username is not None
        or parts.query
        or parts.fragment
    ):
        raise bad
    return text


@dataclass(frozen=True, slots=True)
class TracingConfig:
    # The collector's OTLP/HTTP endpoint (http://: plaintext; https://: TLS). None: tracing off.
    endpoint: str | None = None
    # Of the requests without a sampled parent, the ratio traced (by trace id, as OpenTelemetry's
    # TraceIdRatioBased sampler decides); a parent's decision is followed either way.
    sample_ratio: float = 1.0
    service_name: str = "routerfleet-router"

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @property
    def traces_url(self) -> str:
        """Where traces are POSTed: the endpoint, with OTLP's /v1/traces when it names no path."""
        assert self.endpoint is not None
        if urlsplit(self.endpoint).path in ("", "/"):
            return self.endpoint.rstrip("/") + TRACES_PATH
        return self.endpoint


FLAGS = (
    Flag(
        "--otlp-traces-endpoint",
        "tracing.endpoint",
        Text(_endpoint),
        metavar="URL",
        default_text="off",
        help="export request traces over OTLP/HTTP to this collector (http://H:4318 plaintext, https://"
        " TLS; /v1/traces unless a path is given); W3C traceparent is read from clients and passed on to"
        " the engines (docs/tracing.md)",
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
