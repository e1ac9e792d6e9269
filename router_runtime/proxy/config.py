"""The request plane's configuration sections and their flags: forwarding (``RouterConfig.proxy``) and
the router's own HTTP server (``RouterConfig.server``, a ``ServerLimits``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..flags import Bytes, Count, Flag, Ms, Switch, Text
from .endpoints import allowed_path


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 5.0  # TCP connect to an engine
    first_byte_s: float = 600.0  # dispatch to the engine's response headers (a remote prefill's time in it)
    total_s: float = 3600.0  # dispatch to the end of the response
    idle_s: float = 300.0  # between two chunks of a response body

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_byte_s", "total_s", "idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_body_bytes: int = 32 << 20
    # What all bodies being read and parsed may hold at once (bodies.py); 0: no budget.
    body_budget_bytes: int = 256 << 20
    upstream_keepalive_s: float = 4.0
    # Engine paths beyond the served ones (endpoints.py) an operator lets through, by load.
    allow_paths: tuple[str, ...] = ()
    # Ask engines for usage on streams whose client did not, and strip it again (audit.py).
    audit_stream_usage: bool = True
    # An audited false hit withholds its rank fleet-wide (kv/withhold.py); off for engines whose
    # cached-token figures are not to be trusted.
    audit_withhold: bool = True
    # X-RouterFleet-Debug-Prediction is honoured (its value must be the fleet token), never by default.
    debug_prediction: bool = False
    # X-RouterFleet-Engine (the serving engine's URL) on every proxied answer: an operator's tool, off.
    engine_header: bool = False
    # The request header naming a request's tenant (its value's digest scopes response ids and session
    # keys; sessions/keys.py); None: no tenants.
    tenant_header: str | None = None
    # Every prompt-bearing request's cache_salt derived from its tenant (salting.py), so engines never
    # share KV across tenants.
    tenant_cache_salt: bool = False
    # On SIGTERM: at least this long not Ready, closing each connection after its response, and longer
    # while requests or picks still arrive, up to the maximum, before the server stops listening
    # (drain.py); then requests still in flight get the timeout before they are cut. Together with
    # the stop's own bound they fit the pod's 30 s grace period.
    shutdown_drain_s: float = 5.0
    shutdown_drain_max_s: float = 12.0
    shutdown_timeout_s: float = 10.0
    # Each engine's /v1/models is read this often for the LoRA adapters it serves, so that a request
    # naming one as its model is routed in the adapter's KV namespace (discovery/served_models.py); 0: off.
    served_models_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if 0 < self.body_budget_bytes < self.max_body_bytes:
            raise ValueError("--body-budget-bytes must be 0 (none) or at least --max-body-bytes")
        if self.tenant_cache_salt and not self.tenant_header:
            raise ValueError("--tenant-cache-salt needs --tenant-header (whose tenant is it?)")
        name = self.tenant_header
        if name is not None and not (
            name and all(c.isascii() and (c.isalnum() or c in _TCHAR) for c in name)
        ):
            # One no request carries would put every request in one tenant: isolation silently gone.
            raise ValueError(f"--tenant-header {name!r}: must be a header name (an HTTP token)")


_TCHAR = "!#$%&'*+-.^_`|~"  # a header name's characters besides letters and digits (RFC 9110)


FLAGS = (
    Flag("--connect-timeout-ms", "proxy.timeouts.connect_s", Ms(1), "TCP connect to an engine"),
    Flag(
        "--first-byte-timeout-ms",
        "proxy.timeouts.first_byte_s",
        Ms(1),
        "dispatch to the engine's response headers (a remote prefill leg's time counts in it)",
    ),
    Flag("--total-timeout-ms", "proxy.timeouts.total_s", Ms(1), "dispatch to the end of the response"),
    Flag("--idle-timeout-ms", "proxy.timeouts.idle_s", Ms(1), "silence between two chunks of a response"),
    Flag(
        "--upstream-keepalive-ms",
        "proxy.upstream_keepalive_s",
        Ms(1),
        "idle engine connections are closed after this",
    ),
    Flag("--max-body-bytes", "proxy.max_body_bytes", Bytes(1), "request body limit; larger: 413"),
    Flag(
        "--body-budget-bytes",
        "proxy.body_budget_bytes",
        Bytes(0),
        "what all request bodies being read and parsed may hold at once, their parse's upper bound"
        " included (a pathological body holds up to ~31 bytes per byte while it parses); past it a"
        " request waits up to 1 s, then gets a 503 with Retry-After; 0: no budget",
    ),
    Flag(
        "--allow-path",
        "proxy.allow_paths",
        Text(allowed_path, many=True, unique=True),
        metavar="PATH",
        help="forward this engine path too (any method, to an engine by load); repeatable. Every path"
        " the router does not serve is refused with a 404, engines' administrative ones included",
    ),
    Flag(
        "--shutdown-drain-ms",
        "proxy.shutdown_drain_s",
        Ms(0),
        "on SIGTERM, stay up at least this long not Ready, closing connections after each response,"
        " so the Service, gateways and clients move off before the server stops; longer while requests"
        " or picks still arrive (until none for 1 s), up to --shutdown-drain-max-ms",
    ),
    Flag(
        "--shutdown-drain-max-ms",
        "proxy.shutdown_drain_max_s",
        Ms(0),
        "the longest drain on SIGTERM (at least --shutdown-drain-ms), however late requests still"
        " arrive (this plus --shutdown-timeout-ms plus a few seconds must fit the pod's termination"
        " grace period)",
    ),
    Flag(
        "--shutdown-timeout-ms",
        "proxy.shutdown_timeout_s",
        Ms(0),
        "after the drain, how long requests still in flight get to finish before they are cut (drain"
        " plus this plus a few seconds must fit the pod's termination grace period)",
    ),
    Flag(
        "--debug-prediction",
        "proxy.debug_prediction",
        Switch(),
        "answer a request whose X-RouterFleet-Debug-Prediction header is the fleet token with the"
        " router's prediction (X-RouterFleet-Predicted-Cached-Tokens, -Predicted-Tiers,"
        " -Prediction-Doubtful) on an answer the engine accepted; an operator's tool: whoever it is"
        " open to can probe what is cached",
    ),
    Flag(
        "--tenant-header",
        "proxy.tenant_header",
        Text(),
        metavar="NAME",
        help="the request header that names its tenant (e.g. Authorization, OpenAI-Organization):"
        " stored responses and session keys are scoped to it (another tenant's response id is not"
        " found; responses are never probed for), its value kept only as a digest",
    ),
    Flag(
        "--tenant-cache-salt",
        "proxy.tenant_cache_salt",
        Switch(negatable=False),
        "set every prompt-bearing request's cache_salt from its tenant (and its own salt, if any), so"
        " engines never share cached blocks across tenants; costs the hits tenants would share"
        " (docs/security.md)",
    ),
    Flag(
        "--engine-header",
        "proxy.engine_header",
        Switch(),
        "name the serving engine's URL in X-RouterFleet-Engine on every proxied answer (an operator's"
        " tool: it tells clients internal addresses)",
    ),
    Flag(
        "--audit-withhold",
        "proxy.audit_withhold",
        Switch(),
        "an engine that reports more than a block fewer cached tokens than a prediction made in no"
        " doubt has its rank routed cold on every replica until its events show what it lost"
        " (--kv-withhold-ms); off: such false hits are only counted",
    ),
    Flag(
        "--audit-stream-usage",
        "proxy.audit_stream_usage",
        Switch(),
        "ask the engine for usage on streams whose client did not (stream_options.include_usage), so"
        " the prediction audit covers them; the client's stream is unchanged",
    ),
    Flag(
        "--served-models-interval-ms",
        "proxy.served_models_interval_s",
        Ms(0),
        "read each engine's /v1/models this often for the LoRA adapters it serves: a request naming one"
        " as its model is routed in that adapter's KV namespace",
        zero="off (an adapter is known only by a request's lora_name)",
    ),
)

SERVER_FLAGS = (
    Flag(
        "--client-header-timeout-ms",
        "server.header_timeout_s",
        Ms(1),
        "a request head, from its first byte; then the connection closes",
    ),
    Flag(
        "--client-idle-timeout-ms",
        "server.idle_timeout_s",
        Ms(1),
        "an idle keep-alive connection is closed after this",
    ),
    Flag(
        "--client-body-base-timeout-ms",
        "server.body_base_s",
        Ms(1),
        "a request body may take this plus its size at the min rate",
    ),
    Flag(
        "--client-body-min-rate",
        "server.body_min_bytes_per_s",
        Count(1),
        metavar="BYTES_PER_S",
        help="slowest body upload accepted, past the base timeout; slower: 408",
    ),
    Flag(
        "--max-connections",
        "server.max_connections",
        Count(1),
        "open client connections; past it a new one gets 503 and is closed",
    ),
)
