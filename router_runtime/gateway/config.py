"""The endpoint picker's configuration section (``RouterConfig.gateway``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..flags import Count, Flag, Real, Switch, Text
from ..fleet.saturation import SaturationLimits


@dataclass(frozen=True, slots=True)
class PickerConfig:
    host: str | None = None  # None: the router's --host
    port: int | None = None  # None: not served; 0: any free port
    cert_file: str | None = None  # with key_file; neither: a self-signed certificate
    key_file: str | None = None
    plaintext: bool = False
    # Endpoints named after the pick, for a gateway that retries down the list (an override-host
    # cluster). 0, the reference picker's one endpoint: a gateway that reads the header as one address
    # (an ORIGINAL_DST cluster, as the extension's own test gateway runs) answers 503 to a list.
    fallbacks: int = 0
    # The InferencePool served: its InferenceObjectives' priorities are followed (objectives.py), and a
    # sheddable request is turned away while no engine has room. None: every request is admitted.
    pool: str | None = None
    saturation: SaturationLimits = field(default_factory=SaturationLimits)
    # gRPC health alone, plaintext, on its own port: a kubelet's gRPC probe speaks no TLS.
    health_port: int | None = None
    # TEST ONLY (the extension's conformance suite): a request's own header names its endpoints.
    conformance_test: bool = False
    # A gateway that reaches the picker through its Service's ClusterIP keeps one HTTP/2 connection, so
    # every pick of that gateway goes to the replica the connection happened to reach, and keeps going
    # there while the replica drains: a server stop under that traffic cancels the picks that race it
    # (the gateway answers 500). So each connection is told to go away (a graceful GOAWAY, while the
    # server still takes the streams sent before it) once this old: the gateway reconnects through the
    # Service, which by then leads to a Ready replica. Below the drain's minimum (--shutdown-drain-ms,
    # 5 s) by the second a Service takes to drop a terminating pod, with a margin, so every connection
    # that can still bring a pick has been told to go away before the drain can end (proxy/drain.py).
    # Streams in flight finish on the old connection (no deadline: a stream lasts as its request).
    connection_age_s: float = 3.0
    # A gateway gone without closing its connection (its node lost, a partition) would hold its streams'
    # picks, load and predictions until TCP gives up (~15 min): the picker pings each connection this
    # often and closes it when a ping goes unanswered this long, so its streams end and give them back.
    keepalive_s: float = 20.0


FLAGS = (
    Flag(
        "--epp-host",
        "gateway.host",
        Text(),
        "address of the endpoint picker's gRPC port",
        default_text="--host",
    ),
    Flag(
        "--epp-port",
        "gateway.port",
        Count(0, 65535),
        "serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc over gRPC,"
        " TLS) on this port, beside the proxy (docs/gateway.md)",
        default_text="off",
        zero="any free port",
    ),
    Flag(
        "--epp-cert-file",
        "gateway.cert_file",
        Text(),
        metavar="PATH",
        default_text="a self-signed certificate made at start",
        help="the picker port's TLS certificate (PEM), with --epp-key-file",
    ),
    Flag("--epp-key-file", "gateway.key_file", Text(), metavar="PATH", help="its private key (PEM)"),
    Flag(
        "--epp-plaintext",
        "gateway.plaintext",
        Switch(),
        "serve the picker without TLS (a gateway on a trusted network, or a mesh that encrypts)",
    ),
    Flag(
        "--epp-fallbacks",
        "gateway.fallbacks",
        Count(0, 8),
        "name this many fallback endpoints after the pick (ip:port,ip:port,...), for a gateway that"
        " retries down the list; a gateway that reads one address (ORIGINAL_DST) needs 0",
    ),
    Flag(
        "--epp-pool",
        "gateway.pool",
        Text(),
        metavar="NAME",
        help="the InferencePool this router picks for: the priorities of its InferenceObjectives (in the"
        " router's namespace) are followed from the API server (list and watch), and a request whose"
        " x-gateway-inference-objective names one below 0 is answered 429 while no engine has room"
        " (needs --engine-load-interval-ms above 0)",
    ),
    Flag(
        "--epp-health-port",
        "gateway.health_port",
        Count(0, 65535),
        "serve the picker's gRPC health (grpc.health.v1) on this port too, plaintext, for a kubelet's"
        " gRPC probe (which speaks no TLS); SERVING exactly when /readyz is ready",
        default_text="off",
        zero="any free port",
    ),
    Flag(
        "--epp-conformance-test",
        "gateway.conformance_test",
        Switch(),
        "TEST ONLY, never in production: as the Gateway API Inference Extension's conformance suite"
        " drives a picker, a request's test-epp-endpoint-selection header (ip or ip:port, comma-separated)"
        " names the endpoints it may go to, and the endpoint that served it is answered in"
        " x-conformance-test-served-endpoint: any client then chooses its engine",
    ),
    Flag(
        "--epp-saturation-queue-depth",
        "gateway.saturation.queue_depth",
        Count(0),
        "an engine rank with more requests waiting than this has no room",
    ),
    Flag(
        "--epp-saturation-kv-usage",
        "gateway.saturation.kv_usage",
        Real(0.0, hi=1.0),
        "an engine rank using more of its KV cache than this has no room",
    ),
)
