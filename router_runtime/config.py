"""The router's configuration and its command line. Bad values fail with one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .bootstrap.http import read_token
from .discovery.static import parse_worker
from .discovery.storage_annotation import validate_annotation_key
from .flags import PORT, Bytes, Count, Flag, Ms, Real, Seconds, Switch, Text
from .proxy.endpoints import allowed_path
from .proxy.serving import ServerLimits
from .scheduling.presets import POLICY_NAMES, PolicyConfig
from .sessions.bindings import BindingConfig
from .sessions.config import SessionConfig
from .sessions.redis_store import store_url
from .tokens.tokenizer import ENGINE_TOKENIZER, ChatTemplateSpecError, Family, TokenizerError, load_tokenizer
from .worker import WorkerSpec


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    workers: tuple[WorkerSpec, ...] = field(default_factory=tuple)
    block_size: int = 16
    replay_idle_timeout_s: float = 1.0
    replay_timeout_s: float = 10.0
    queue_batches: int = 10_000
    queue_bytes: int = 256 << 20
    # Carrier lifecycle: an engine that leaves or fails health stays DISCONNECTED (hidden) this long
    # before its blocks are removed; 0: removed at once (no re-adoption).
    kv_disconnect_grace_s: float = 600.0
    kv_adoption_cap: int = 3  # re-adoptions per storage identity per window (0: no cap)
    kv_adoption_window_s: float = 3600.0
    # A rank whose engine stored blocks for a request and sent no batch for this long is doubtful.
    kv_stall_s: float = 2.0
    kv_withhold_s: float = 10.0
    log_level: str = "info"
    # Routing.
    policy: str = "kv_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: str = "bytes"  # "bytes" or a Hugging Face tokenizer directory
    chat_family: Family = Family.VLLM  # whose chat preprocessing the router reproduces
    chat_template: str | None = None  # the engines' own --chat-template (a file, or a template name)
    engine_tokenize_timeout_s: float = 0.1  # --tokenizer engine: the deadline of one tokenize call
    tokenizer_threads: int = 0  # 0: min(4, CPUs)
    tokenize_inline_max_bytes: int = 16 << 10  # larger request bodies tokenize (and parse) on the pool
    # The request plane.
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    total_timeout_s: float = 3600.0
    idle_timeout_s: float = 300.0
    max_body_bytes: int = 32 << 20
    upstream_keepalive_s: float = 4.0
    # Engine paths beyond the served ones (proxy/endpoints.py) an operator lets through, by load.
    allow_paths: tuple[str, ...] = ()
    # Ask engines for usage on streams whose client did not, and strip it again (proxy/audit.py).
    audit_stream_usage: bool = True
    # X-RouterFleet-Debug-Prediction is honoured (its value must be the fleet token), never by default.
    debug_prediction: bool = False
    # The request header naming a request's tenant (its value's digest scopes response ids and session
    # keys; sessions/keys.py); None: no tenants.
    tenant_header: str | None = None
    # An audited false hit withholds its rank fleet-wide (kv/withhold.py); off for engines whose
    # cached-token figures are not to be trusted.
    audit_withhold: bool = True
    # On SIGTERM: this long not Ready, closing each connection after its response, before the server
    # stops listening (cli.py); then requests still in flight get this long before they are cut.
    # Together with the stop's own bound they fit the pod's 30 s grace period with room to spare.
    shutdown_drain_s: float = 5.0
    shutdown_timeout_s: float = 10.0
    # Client connections: the router's own HTTP server (proxy/serving.py).
    server: ServerLimits = field(default_factory=ServerLimits)
    # Engine health.
    health_interval_s: float = 5.0  # 0: no active checks (request outcomes still drive the breakers)
    health_timeout_s: float = 2.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0
    # Kubernetes engine discovery (instead of --worker).
    k8s_selector: str | None = None
    k8s_namespace: str | None = None
    k8s_http_port: str = "http"
    k8s_kv_port: str | None = None
    k8s_replay_port: str | None = None
    k8s_dp_size: int = 1
    k8s_topic: str = ""
    kubeconfig: str | None = None
    k8s_watch_timeout_s: float = 300.0
    # A pod annotation key naming the engine's storage identity (KEY, and KEY-epoch); "": off.
    k8s_storage_annotation: str = ""
    # The internal port (snapshot producer, bootstrap verdict), on only with a token file.
    # The gateway's endpoint picker (gateway/): None: not served.
    epp_host: str | None = None  # default: --host
    epp_port: int | None = None
    epp_cert_file: str | None = None  # with epp_key_file; neither: a self-signed certificate
    epp_key_file: str | None = None
    epp_plaintext: bool = False
    internal_host: str | None = None  # default: --host
    internal_port: int = 8081
    internal_token_file: str | None = None
    # Peer bootstrap.
    kv_peers: tuple[str, ...] = ()
    kv_peer_selector: str | None = None
    kv_peer_port: str = "internal"
    bootstrap: bool = True
    bootstrap_timeout_s: float = 600.0
    bootstrap_seed_required: bool = False
    bootstrap_origin: bool = True
    # Session affinity (docs/sessions.md).
    sessions: SessionConfig = field(default_factory=SessionConfig)
    # Which engine holds each stored Responses API response (docs/sessions.md).
    responses: BindingConfig = field(default_factory=BindingConfig)
    # The fleet-shared store for both (redis://, rediss:// or unix://), and its password's file.
    session_store: str | None = None
    session_store_password_file: str | None = None
    # The fleet's load view (docs/fleet-load.md): siblings' reports over the internal port, engine reads.
    fleet_gossip_window_s: float = 0.05  # 0: do not gossip
    fleet_heartbeat_s: float = 0.5
    fleet_peer_max_age_s: float = 2.0
    engine_load_interval_s: float = 0.2  # 0: do not read the engines' metrics
    engine_load_timeout_s: float = 0.5
    engine_load_max_age_s: float = 2.0


_DEFAULTS = RouterConfig()


# ---- the command line: every flag declared once --------------------------------------------------
#
# A flag (flags.py) names the RouterConfig field it sets (a dotted path into a nested config), its kind (type,
# unit, bounds) and its help; its default is the field's own default, so the parser, the config and
# the help cannot drift apart. Durations: the config holds seconds; a flag names its unit (``-ms``,
# integer milliseconds; three ``-s`` flags that deployed manifests already carry keep theirs).


def _annotation_key(text: str) -> str:
    try:
        return validate_annotation_key(text.strip()) if text.strip() else ""
    except ValueError as exc:
        raise ValueError(f"not a Kubernetes annotation key: {exc}") from None


# (group title, its flags); None: the parser's own options.
FLAGS: tuple[tuple[str | None, tuple[Flag, ...]], ...] = (
    (
        None,
        (
            Flag("--host", "host", Text(), "address to listen on"),
            Flag("--port", "port", PORT, "public HTTP port"),
            Flag(
                "--worker",
                "workers",
                Text(parse_worker, many=True),
                metavar="SPEC",
                help="a static engine: url=http://H:P[,kv=tcp://H:P][,replay=tcp://H:P][,dp=N][,topic=T];"
                " repeat",
            ),
            Flag("--block-size", "block_size", Count(1), "tokens per KV block"),
            Flag(
                "--replay-idle-timeout-ms", "replay_idle_timeout_s", Ms(1), "silence that ends a gap replay"
            ),
            Flag("--replay-timeout-ms", "replay_timeout_s", Ms(1), "total bound on one gap replay"),
            Flag(
                "--kv-stall-ms",
                "kv_stall_s",
                Ms(0),
                "a rank whose engine stored new blocks for a request (its usage says so) and sent no batch"
                " for this long counts as stalled: its predictions are doubtful until a batch comes"
                " (routerfleet_kv_stalled_ranks)",
                zero="off",
            ),
            Flag(
                "--kv-withhold-ms",
                "kv_withhold_s",
                Ms(1),
                "a rank whose engine denied a credited prefix, or that a flush is resetting, routes cold"
                " until its engine's events show what it lost (or the flush ends); after this long the"
                " rank is cleared instead (routerfleet_kv_rank_withholds_total)",
            ),
            Flag(
                "--kv-disconnect-grace-s",
                "kv_disconnect_grace_s",
                Seconds(0),
                "how long a departed or unhealthy engine's blocks are kept hidden for re-adoption before they"
                " are removed",
                zero="removed at once",
            ),
            Flag(
                "--kv-adoption-cap",
                "kv_adoption_cap",
                Count(0),
                "re-adoptions allowed per storage identity per --kv-adoption-window-s",
                zero="no cap",
            ),
            Flag(
                "--kv-adoption-window-s",
                "kv_adoption_window_s",
                Seconds(0, strict=True),
                "sliding window of the adoption cap",
            ),
            Flag(
                "--kv-queue-batches",
                "queue_batches",
                Count(1),
                "batches the index writer may hold before a rank overflows",
            ),
            Flag("--kv-queue-bytes", "queue_bytes", Bytes(1), "payload bytes the index writer may hold"),
            Flag(
                "--log-level", "log_level", Text(choices=("debug", "info", "warning", "error")), "log level"
            ),
        ),
    ),
    (
        "routing",
        (
            Flag("--policy", "policy", Text(choices=POLICY_NAMES), "routing policy"),
            # the policies' tunables (PolicyConfig), each named for the policies it tunes
            Flag(
                "--balance-abs-threshold",
                "policy_config.balance_abs_threshold",
                Count(0),
                "imbalance guard: least loaded when the in-flight spread max - min exceeds this and"
                " max > min * --balance-rel-threshold",
            ),
            Flag(
                "--balance-rel-threshold",
                "policy_config.balance_rel_threshold",
                Real(1.0),
                "imbalance guard: see --balance-abs-threshold",
            ),
            Flag(
                "--host-weight",
                "policy_config.host_weight",
                Real(0.0, hi=1.0),
                "kv_aware: credit of a block held in host memory (device = 1)",
            ),
            Flag(
                "--disk-weight",
                "policy_config.disk_weight",
                Real(0.0, hi=1.0),
                "kv_aware: credit of a block held on disk",
            ),
            Flag(
                "--external-weight",
                "policy_config.external_weight",
                Real(0.0, hi=1.0),
                "kv_aware: credit of a block held in an external store",
            ),
            Flag(
                "--load-cost-tokens",
                "policy_config.load_cost_tokens",
                Real(0.0),
                "kv_aware: one in-flight request costs as much as prefilling this many tokens",
            ),
            Flag(
                "--spread-ties",
                "policy_config.spread_ties",
                Switch(),
                "kv_aware: break ties by a hash of the request (else target order)",
            ),
            Flag(
                "--cache-threshold",
                "policy_config.cache_threshold",
                Real(0.0, hi=1.0),
                "approx_prefix: route by prefix above this matched fraction of the text",
            ),
            Flag(
                "--max-tree-size",
                "policy_config.max_tree_size",
                Count(1),
                "approx_prefix: characters per target's text tree before LRU eviction",
            ),
            Flag(
                "--seed",
                "policy_config.seed",
                Count(None),
                "power_of_two: random seed",
                default_text="OS entropy",
            ),
            Flag(
                "--tokenizer",
                "tokenizer",
                Text(),
                metavar="bytes|PATH",
                help="tokenizer for prefix matching: 'bytes' (the fake engine's), a directory holding a"
                " Hugging Face tokenizer.json (and tokenizer_config.json or chat_template.jinja for the chat"
                " template), or 'engine' (the engines' own tokenize endpoint, under"
                " --engine-tokenize-timeout-ms)",
            ),
            Flag(
                "--engine-tokenize-timeout-ms",
                "engine_tokenize_timeout_s",
                Ms(1),
                "with --tokenizer engine: the deadline of one tokenize call; past it the request routes"
                " without tokens",
            ),
            Flag(
                "--chat-family",
                "chat_family",
                Text(Family, choices=tuple(Family)),
                "whose chat preprocessing to reproduce, as the engines behind the router run it",
            ),
            Flag(
                "--chat-template",
                "chat_template",
                Text(),
                metavar="FILE|NAME",
                default_text="the tokenizer's own",
                help="the chat template the engines are started with (their --chat-template): a file, or the"
                " name of one of the tokenizer's named templates",
            ),
            Flag(
                "--tokenizer-threads",
                "tokenizer_threads",
                Count(1),
                "tokenizer thread pool",
                default_text="min(4, CPUs)",
            ),
        ),
    ),
    (
        "request plane",
        (
            Flag("--connect-timeout-ms", "connect_timeout_s", Ms(1), "TCP connect to an engine"),
            Flag(
                "--first-byte-timeout-ms",
                "first_byte_timeout_s",
                Ms(1),
                "dispatch to the engine's response headers",
            ),
            Flag("--total-timeout-ms", "total_timeout_s", Ms(1), "dispatch to the end of the response"),
            Flag("--idle-timeout-ms", "idle_timeout_s", Ms(1), "silence between two chunks of a response"),
            Flag(
                "--upstream-keepalive-ms",
                "upstream_keepalive_s",
                Ms(1),
                "idle engine connections are closed after this",
            ),
            Flag("--max-body-bytes", "max_body_bytes", Bytes(1), "request body limit; larger: 413"),
            Flag(
                "--allow-path",
                "allow_paths",
                Text(allowed_path, many=True, unique=True),
                metavar="PATH",
                help="forward this engine path too (any method, to an engine by load); repeatable. Every path"
                " the router does not serve is refused with a 404, engines' administrative ones included",
            ),
            Flag(
                "--shutdown-drain-ms",
                "shutdown_drain_s",
                Ms(0),
                "on SIGTERM, stay up this long not Ready, closing connections after each response, so the"
                " Service and clients move off before the server stops (keep it below the pod's termination"
                " grace period)",
            ),
            Flag(
                "--shutdown-timeout-ms",
                "shutdown_timeout_s",
                Ms(0),
                "after the drain, how long requests still in flight get to finish before they are cut (drain"
                " plus this plus a few seconds must fit the pod's termination grace period)",
            ),
            Flag(
                "--debug-prediction",
                "debug_prediction",
                Switch(),
                "answer a request whose X-RouterFleet-Debug-Prediction header is the fleet token with the"
                " router's prediction (X-RouterFleet-Predicted-Cached-Tokens, -Predicted-Tiers,"
                " -Prediction-Doubtful) on an answer the engine accepted; an operator's tool: whoever it is"
                " open to can probe what is cached",
            ),
            Flag(
                "--tenant-header",
                "tenant_header",
                Text(),
                metavar="NAME",
                help="the request header that names its tenant (e.g. Authorization, OpenAI-Organization):"
                " stored responses and session keys are scoped to it (another tenant's response id is not"
                " found; responses are never probed for), its value kept only as a digest",
            ),
            Flag(
                "--audit-withhold",
                "audit_withhold",
                Switch(),
                "an engine that reports more than a block fewer cached tokens than a prediction made in no"
                " doubt has its rank routed cold on every replica until its events show what it lost"
                " (--kv-withhold-ms); off: such false hits are only counted",
            ),
            Flag(
                "--audit-stream-usage",
                "audit_stream_usage",
                Switch(),
                "ask the engine for usage on streams whose client did not (stream_options.include_usage), so"
                " the prediction audit covers them; the client's stream is unchanged",
            ),
        ),
    ),
    (
        "client connections (the router's HTTP server)",
        (
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
        ),
    ),
    (
        "engine health",
        (
            Flag(
                "--health-interval-ms",
                "health_interval_s",
                Ms(0),
                "GET /health on every engine this often",
                zero="no active checks",
            ),
            Flag("--health-timeout-ms", "health_timeout_s", Ms(1), "one health check"),
            Flag(
                "--breaker-failures",
                "breaker_failures",
                Count(1),
                "consecutive failures (connect errors, 5xx) that take an engine out",
            ),
            Flag(
                "--breaker-cooldown-ms",
                "breaker_cooldown_s",
                Ms(0),
                "time an engine stays out before it is tried again",
            ),
        ),
    ),
    (
        "session affinity (docs/sessions.md)",
        (
            Flag(
                "--session-affinity",
                "sessions.enabled",
                Switch(),
                "remember each explicit session's engine and send its next turn there",
            ),
            Flag(
                "--session-ttl-ms",
                "sessions.ttl_s",
                Ms(1),
                "a session's engine is remembered this long after its last 2xx",
            ),
            Flag(
                "--session-max-entries",
                "sessions.max_entries",
                Count(1),
                "sessions remembered per replica, LRU beyond",
            ),
            Flag(
                "--session-lookup-timeout-ms",
                "sessions.lookup_timeout_s",
                Ms(1, 1_000),
                "hard deadline of a session lookup; past it the request is routed as new",
            ),
            Flag(
                "--session-header",
                "sessions.key_header",
                Text(),
                metavar="NAME",
                help="request header carrying a session id, besides the prompt_cache_key and conversation_id"
                " body fields; '' for none",
            ),
            Flag(
                "--session-engine-header",
                "sessions.engine_header",
                Text(),
                metavar="NAME",
                help="response header with the serving engine's opaque id",
            ),
            Flag(
                "--session-hint-header",
                "sessions.hint_header",
                Text(),
                metavar="NAME",
                help="request header echoing that id back; always stripped before proxying",
            ),
            Flag(
                "--session-store",
                "session_store",
                Text(store_url),
                metavar="URL",
                default_text="each replica's own memory",
                help="the fleet-shared store of session memory and response bindings (Redis or Valkey:"
                " redis://host:6379/0, rediss://..., unix:///path)",
            ),
            Flag(
                "--session-store-password-file",
                "session_store_password_file",
                Text(),
                metavar="PATH",
                help="file holding the store's password (a mounted Secret)",
            ),
            Flag(
                "--session-user-ids",
                "sessions.user_ids",
                Switch(negatable=False),
                "treat an Anthropic request's metadata.user_id as its session key (where each user holds one"
                " conversation at a time)",
            ),
            Flag(
                "--session-trust-hints",
                "sessions.trust_hints",
                Switch(negatable=False),
                "use inbound hint headers to classify a session (only behind a gateway that sets them)",
            ),
        ),
    ),
    (
        "response bindings: a stored response's engine (docs/sessions.md)",
        (
            Flag(
                "--response-ttl-ms",
                "responses.ttl_s",
                Ms(1),
                "how long a response id stays bound to its engine",
            ),
            Flag(
                "--response-max-entries",
                "responses.max_entries",
                Count(1),
                "response bindings kept per replica, LRU beyond",
            ),
            Flag(
                "--response-probe-timeout-ms",
                "responses.probe_timeout_s",
                Ms(0, 60_000),
                "deadline for asking the engines which holds a response no table knows",
                zero="never ask",
            ),
        ),
    ),
    (
        "kubernetes discovery (instead of --worker)",
        (
            Flag(
                "--k8s-selector",
                "k8s_selector",
                Text(),
                metavar="LABELS",
                help="EndpointSlices of the engines' Service, e.g. kubernetes.io/service-name=vllm",
            ),
            Flag(
                "--k8s-namespace",
                "k8s_namespace",
                Text(),
                "namespace of those slices",
                default_text="the pod's own",
            ),
            Flag("--k8s-http-port", "k8s_http_port", Text(), "engine HTTP port", metavar="NAME|NUM"),
            Flag(
                "--k8s-kv-port",
                "k8s_kv_port",
                Text(),
                "engine KV event PUB port of rank 0",
                metavar="NAME|NUM",
            ),
            Flag(
                "--k8s-replay-port",
                "k8s_replay_port",
                Text(),
                "engine KV replay port of rank 0",
                metavar="NAME|NUM",
            ),
            Flag("--k8s-dp-size", "k8s_dp_size", Count(1), "DP ranks per engine"),
            Flag("--k8s-topic", "k8s_topic", Text(), "KV event topic prefix", default_text="all"),
            Flag(
                "--kubeconfig",
                "kubeconfig",
                Text(),
                "kubeconfig",
                default_text="in-cluster, then $KUBECONFIG",
            ),
            Flag(
                "--k8s-watch-timeout-s",
                "k8s_watch_timeout_s",
                Count(1),
                "server-side watch timeout; also how soon a revoked RBAC rule shows as not synced",
            ),
            Flag(
                "--k8s-storage-annotation",
                "k8s_storage_annotation",
                Text(_annotation_key),
                metavar="KEY",
                default_text="off",
                help="read each engine pod's storage identity from its annotations KEY (the id) and KEY-epoch"
                " (default 0), e.g. routerfleet.io/storage-id; needs get on pods",
            ),
        ),
    ),
    (
        "gateway endpoint picker",
        (
            Flag(
                "--epp-host",
                "epp_host",
                Text(),
                "address of the endpoint picker's gRPC port",
                default_text="--host",
            ),
            Flag(
                "--epp-port",
                "epp_port",
                Count(0, 65535),
                "serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc over gRPC,"
                " TLS) on this port, beside the proxy (docs/gateway.md)",
                default_text="off",
                zero="any free port",
            ),
            Flag(
                "--epp-cert-file",
                "epp_cert_file",
                Text(),
                metavar="PATH",
                default_text="a self-signed certificate made at start",
                help="the picker port's TLS certificate (PEM), with --epp-key-file",
            ),
            Flag("--epp-key-file", "epp_key_file", Text(), metavar="PATH", help="its private key (PEM)"),
            Flag(
                "--epp-plaintext",
                "epp_plaintext",
                Switch(),
                "serve the picker without TLS (a gateway on a trusted network, or a mesh that encrypts)",
            ),
        ),
    ),
    (
        "peer bootstrap",
        (
            Flag(
                "--internal-host",
                "internal_host",
                Text(),
                "address of the internal port",
                default_text="--host",
            ),
            Flag(
                "--internal-port",
                "internal_port",
                PORT,
                "internal port: /internal/kv_snapshot and /internal/bootstrap",
            ),
            Flag(
                "--internal-token-file",
                "internal_token_file",
                Text(),
                metavar="PATH",
                help="the fleet's bearer token; without it the internal port and bootstrap are off",
            ),
            Flag(
                "--kv-peer",
                "kv_peers",
                Text(many=True),
                metavar="URL",
                help="a static sibling's internal URL, e.g. http://10.0.0.7:8081; repeat",
            ),
            Flag(
                "--kv-peer-selector",
                "kv_peer_selector",
                Text(),
                metavar="LABELS",
                help="EndpointSlices of the routers' own peer Service (needs --k8s-selector)",
            ),
            Flag(
                "--kv-peer-port",
                "kv_peer_port",
                Text(),
                metavar="NAME|NUM",
                help="the peers' internal port in those slices",
            ),
            Flag(
                "--no-kv-origin",
                "bootstrap_origin",
                Switch(negatable=False),
                "do not rebuild new ranks from the engines' replay buffers (from sequence 0)",
            ),
            Flag(
                "--no-kv-bootstrap",
                "bootstrap",
                Switch(negatable=False),
                "boot cold: do not pull a sibling's index",
            ),
            Flag(
                "--kv-bootstrap-timeout-ms",
                "bootstrap_timeout_s",
                Ms(1, 3_600_000),
                "give up pulling a sibling's index after this (at most 1 h)",
            ),
            Flag(
                "--kv-bootstrap-seed-required",
                "bootstrap_seed_required",
                Switch(negatable=False),
                "hold readiness when warm siblings were there but their index could not be pulled (bounded at"
                " 3x the timeout); no-peers and fleet-cold never hold",
            ),
        ),
    ),
    (
        "fleet load (docs/fleet-load.md)",
        (
            Flag(
                "--fleet-gossip-window-ms",
                "fleet_gossip_window_s",
                Ms(0),
                "after this replica's load changes, wait this long for more, then tell the siblings (needs"
                " --internal-token-file and peers)",
                zero="off",
            ),
            Flag(
                "--fleet-heartbeat-ms",
                "fleet_heartbeat_s",
                Ms(10, 60_000),
                "tell the siblings at least this often",
            ),
            Flag(
                "--fleet-peer-max-age-ms",
                "fleet_peer_max_age_s",
                Ms(10, 600_000),
                "a sibling's report counts this long after it arrived (above the heartbeat)",
            ),
            Flag(
                "--engine-load-interval-ms",
                "engine_load_interval_s",
                Ms(0),
                "read each engine's /metrics (running and waiting requests) this often",
                zero="off",
            ),
            Flag(
                "--engine-load-timeout-ms",
                "engine_load_timeout_s",
                Ms(1, 60_000),
                "the deadline of one engine read",
            ),
            Flag(
                "--engine-load-max-age-ms",
                "engine_load_max_age_s",
                Ms(10, 600_000),
                "an engine read counts this long",
            ),
        ),
    ),
)

# The nested configs a dotted path may name, each built from its flags over its own defaults.
_NESTED = {
    "server": "client connections",
    "sessions": "session affinity",
    "responses": "response bindings",
    "policy_config": "routing",
}


def _default(path: str) -> Any:
    value: Any = _DEFAULTS
    for part in path.split("."):
        value = getattr(value, part)
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="routerfleet-router",
        description="KV-cache-aware router: ingests engines' KV event streams into a radix index and routes "
        "OpenAI-compatible requests to the engine holding their prefix.",
    )
    for title, flags in FLAGS:
        group = p if title is None else p.add_argument_group(title)
        for flag in flags:
            flag.kind.add(group, flag, _default(flag.path))
    return p


def _config_values(parser: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig's keyword arguments from the parsed flags, the nested configs built from theirs."""
    top: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {name: {} for name in _NESTED}
    for _title, flags in FLAGS:
        for flag in flags:
            value = flag.kind.to_config(getattr(a, flag.dest))
            head, _, rest = flag.path.partition(".")
            if rest:
                nested[head][rest] = value
            else:
                top[flag.path] = value
    for name, what in _NESTED.items():
        try:
            top[name] = dataclasses.replace(getattr(_DEFAULTS, name), **nested[name])
        except ValueError as exc:
            parser.error(f"{what}: {exc}")
    return top


def _check_tokenizer(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.tokenizer == ENGINE_TOKENIZER:
        if a.chat_template is not None:
            parser.error("argument --chat-template: not with --tokenizer engine (the engines render)")
        return
    try:
        load_tokenizer(a.tokenizer, a.chat_family, a.chat_template)  # cached: the router reuses it
    except ChatTemplateSpecError as exc:
        parser.error(f"argument --chat-template: {exc}")
    except TokenizerError as exc:
        parser.error(f"argument --tokenizer: {exc}")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    _check_tokenizer(parser, a)
    c = RouterConfig(**_config_values(parser, a))
    engines = [w.engine for w in c.workers]
    if len(set(engines)) != len(engines):
        parser.error("argument --worker: the same url is listed twice")
    if c.k8s_selector and c.workers:
        parser.error("argument --k8s-selector: not with --worker (one way to find engines)")
    if c.k8s_storage_annotation and not c.k8s_selector:
        parser.error("argument --k8s-storage-annotation: needs --k8s-selector (pods come from discovery)")
    if c.kv_peer_selector and not c.k8s_selector:
        # No way to find a sibling: refuse rather than ignore. (Any policy: siblings share their load;
        # only kv_aware also seeds its index from them.)
        parser.error("argument --kv-peer-selector: needs --k8s-selector")
    if (c.kv_peers or c.kv_peer_selector) and not c.internal_token_file:
        parser.error("argument --kv-peer/--kv-peer-selector: needs --internal-token-file")
    if c.debug_prediction and not c.internal_token_file:
        parser.error("argument --debug-prediction: needs --internal-token-file (callers present that token)")
    if bool(c.epp_cert_file) != bool(c.epp_key_file):
        parser.error("argument --epp-cert-file/--epp-key-file: give both, or neither (a self-signed one)")
    if c.epp_plaintext and c.epp_cert_file:
        parser.error("argument --epp-plaintext: not with --epp-cert-file (plaintext or TLS)")
    for flag, path in (("--epp-cert-file", c.epp_cert_file), ("--epp-key-file", c.epp_key_file)):
        if path:
            try:
                with open(path, "rb") as f:
                    if b"-----BEGIN " not in f.read(1 << 20):
                        raise ValueError(f"{path}: not PEM")
            except (OSError, ValueError) as exc:
                parser.error(f"argument {flag}: {exc}")
    if c.session_store_password_file and not c.session_store:
        parser.error("argument --session-store-password-file: needs --session-store")
    for flag, path in (
        ("--internal-token-file", c.internal_token_file),
        ("--session-store-password-file", c.session_store_password_file),
    ):
        if path:
            try:
                read_token(path)
            except (OSError, ValueError) as exc:
                parser.error(f"argument {flag}: {exc}")
    if c.fleet_peer_max_age_s <= c.fleet_heartbeat_s:
        parser.error(
            f"argument --fleet-peer-max-age-ms: must exceed --fleet-heartbeat-ms"
            f" ({round(c.fleet_heartbeat_s * 1000)}), or live siblings would age out between reports"
        )
    return c
