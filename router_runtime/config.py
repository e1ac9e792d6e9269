"""The router's configuration and its command line. Bad values fail with one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from .bootstrap.http import read_token
from .discovery.static import parse_worker
from .discovery.storage_annotation import validate_annotation_key
from .proxy.endpoints import allowed_path
from .proxy.serving import ServerLimits
from .routing.policies import POLICY_NAMES, PolicyConfig
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
    # On SIGTERM: this long not Ready, closing each connection after its response, before the server
    # stops listening (cli.py).
    shutdown_drain_s: float = 5.0
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


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {v}")
    return v


def _port(text: str) -> int:
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port (1-65535), got {v}")
    return v


def _annotation_key(text: str) -> str:
    try:
        return validate_annotation_key(text.strip()) if text.strip() else ""
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a Kubernetes annotation key: {exc}") from None


def _allow_path(text: str) -> str:
    try:
        return allowed_path(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _worker(text: str) -> WorkerSpec:
    try:
        return parse_worker(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="routerfleet-router",
        description="KV-cache-aware router: ingests engines' KV event streams into a radix index and routes "
        "OpenAI-compatible requests to the engine holding their prefix.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8080, help="public HTTP port (default 8080)")
    p.add_argument(
        "--worker",
        type=_worker,
        action="append",
        default=[],
        metavar="SPEC",
        help="a static engine: url=http://H:P[,kv=tcp://H:P][,replay=tcp://H:P][,dp=N][,topic=T]; repeat",
    )
    p.add_argument("--block-size", type=_positive_int, default=16, help="tokens per KV block (default 16)")
    p.add_argument(
        "--replay-idle-timeout-ms",
        type=_positive_int,
        default=1000,
        help="silence that ends a gap replay (default 1000)",
    )
    p.add_argument(
        "--replay-timeout-ms",
        type=_positive_int,
        default=10_000,
        help="total bound on one gap replay (default 10000)",
    )
    p.add_argument(
        "--kv-stall-ms",
        type=_non_negative_int,
        default=2000,
        help="a rank whose engine stored new blocks for a request (its usage says so) and sent no batch"
        " for this long counts as stalled: its predictions are doubtful until a batch comes"
        " (routerfleet_kv_stalled_ranks; default 2000, 0: off)",
    )
    p.add_argument(
        "--kv-disconnect-grace-s",
        type=float,
        default=600.0,
        help="how long a departed or unhealthy engine's blocks are kept hidden for re-adoption before "
        "they are removed (default 600; 0: removed at once)",
    )
    p.add_argument(
        "--kv-adoption-cap",
        type=_non_negative_int,
        default=3,
        help="re-adoptions allowed per storage identity per --kv-adoption-window-s (default 3; 0: no cap)",
    )
    p.add_argument(
        "--kv-adoption-window-s",
        type=float,
        default=3600.0,
        help="sliding window of the adoption cap (default 3600)",
    )
    p.add_argument(
        "--kv-queue-batches",
        type=_positive_int,
        default=10_000,
        help="batches the index writer may hold before a rank overflows (default 10000)",
    )
    p.add_argument(
        "--kv-queue-bytes",
        type=_positive_int,
        default=256 << 20,
        help="payload bytes the index writer may hold (default 256 MiB)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    r = p.add_argument_group("routing")
    r.add_argument(
        "--policy", default="kv_aware", choices=POLICY_NAMES, help="routing policy (default kv_aware)"
    )
    for f in dataclasses.fields(PolicyConfig):
        _add_policy_flag(r, f)
    r.add_argument(
        "--tokenizer",
        default="bytes",
        metavar="bytes|PATH",
        help="tokenizer for prefix matching: 'bytes' (the fake engine's), a directory holding a Hugging "
        "Face tokenizer.json (and tokenizer_config.json or chat_template.jinja for the chat template), or "
        "'engine' (the engines' own tokenize endpoint, under --engine-tokenize-timeout-ms); default bytes",
    )
    r.add_argument(
        "--engine-tokenize-timeout-ms",
        type=_positive_int,
        default=100,
        help="with --tokenizer engine: the deadline of one tokenize call; past it the request routes"
        " without tokens (default 100)",
    )
    r.add_argument(
        "--chat-family",
        type=Family,
        choices=list(Family),
        default=Family.VLLM,
        help="whose chat preprocessing to reproduce, as the engines behind the router run it (default vllm)",
    )
    r.add_argument(
        "--chat-template",
        metavar="FILE|NAME",
        help="the chat template the engines are started with (their --chat-template): a file, or the name of"
        " one of the tokenizer's named templates; default the tokenizer's own",
    )
    r.add_argument(
        "--tokenizer-threads",
        type=_positive_int,
        default=None,
        help="tokenizer thread pool (default min(4, CPUs))",
    )

    q = p.add_argument_group("request plane")
    for flag, default, what in (
        ("--connect-timeout-ms", 5_000, "TCP connect to an engine"),
        ("--first-byte-timeout-ms", 600_000, "dispatch to the engine's response headers"),
        ("--total-timeout-ms", 3_600_000, "dispatch to the end of the response"),
        ("--idle-timeout-ms", 300_000, "silence between two chunks of a response"),
        ("--upstream-keepalive-ms", 4_000, "idle engine connections are closed after this"),
    ):
        q.add_argument(flag, type=_positive_int, default=default, help=f"{what} (default {default})")
    q.add_argument(
        "--max-body-bytes",
        type=_positive_int,
        default=32 << 20,
        help="request body limit; larger: 413 (32 MiB)",
    )
    q.add_argument(
        "--allow-path",
        type=_allow_path,
        action="append",
        default=[],
        metavar="PATH",
        help="forward this engine path too (any method, to an engine by load); repeatable. Every path"
        " the router does not serve is refused with a 404, engines' administrative ones included",
    )
    p.add_argument(
        "--shutdown-drain-ms",
        type=_non_negative_int,
        default=5_000,
        help="on SIGTERM, stay up this long not Ready, closing connections after each response, so the"
        " Service and clients move off before the server stops (keep it below the pod's termination"
        " grace period; default 5000)",
    )
    p.add_argument(
        "--audit-stream-usage",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask the engine for usage on streams whose client did not (stream_options.include_usage),"
        " so the prediction audit covers them; the client's stream is unchanged (default on)",
    )
    c = p.add_argument_group("client connections (the router's HTTP server)")
    for flag, default, what in (
        (
            "--client-header-timeout-ms",
            10_000,
            "a request head, from its first byte; then the connection closes",
        ),
        ("--client-idle-timeout-ms", 60_000, "an idle keep-alive connection is closed after this"),
        (
            "--client-body-base-timeout-ms",
            10_000,
            "a request body may take this plus its size at the min rate",
        ),
    ):
        c.add_argument(flag, type=_positive_int, default=default, help=f"{what} (default {default})")
    c.add_argument(
        "--client-body-min-rate",
        type=_positive_int,
        default=64 << 10,
        metavar="BYTES_PER_S",
        help="slowest body upload accepted, past the base timeout; slower: 408 (default 65536)",
    )
    c.add_argument(
        "--max-connections",
        type=_positive_int,
        default=4096,
        help="open client connections; past it a new one gets 503 and is closed (default 4096)",
    )

    h = p.add_argument_group("engine health")
    h.add_argument(
        "--health-interval-ms",
        type=_non_negative_int,
        default=5_000,
        help="GET /health on every engine this often; 0 turns active checks off (default 5000)",
    )
    h.add_argument(
        "--health-timeout-ms", type=_positive_int, default=2_000, help="one health check (default 2000)"
    )
    h.add_argument(
        "--breaker-failures",
        type=_positive_int,
        default=3,
        help="consecutive failures (connect errors, 5xx) that take an engine out (default 3)",
    )
    h.add_argument(
        "--breaker-cooldown-ms",
        type=_non_negative_int,
        default=5_000,
        help="time an engine stays out before it is tried again (default 5000)",
    )
    s = p.add_argument_group("session affinity (docs/sessions.md)")
    s.add_argument(
        "--session-affinity",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="remember each explicit session's engine and send its next turn there (default off)",
    )
    s.add_argument(
        "--session-ttl-ms",
        type=_positive_int,
        default=600_000,
        help="a session's engine is remembered this long after its last 2xx (default 600000)",
    )
    s.add_argument(
        "--session-max-entries",
        type=_positive_int,
        default=100_000,
        help="sessions remembered per replica, LRU beyond (default 100000)",
    )
    s.add_argument(
        "--session-lookup-timeout-ms",
        type=_bounded_ms(1, 1_000),
        default=20,
        help="hard deadline of a session lookup; past it the request is routed as new (default 20)",
    )
    s.add_argument(
        "--session-header",
        default="x-session-id",
        metavar="NAME",
        help="request header carrying a session id, besides the prompt_cache_key and conversation_id "
        "body fields; '' for none (default x-session-id)",
    )
    s.add_argument(
        "--session-engine-header",
        default="X-RouterFleet-Engine-Id",
        metavar="NAME",
        help="response header with the serving engine's opaque id (default X-RouterFleet-Engine-Id)",
    )
    s.add_argument(
        "--session-hint-header",
        default="X-RouterFleet-Last-Engine",
        metavar="NAME",
        help="request header echoing that id back; always stripped before proxying "
        "(default X-RouterFleet-Last-Engine)",
    )
    s.add_argument(
        "--session-store",
        type=_session_store,
        metavar="URL",
        help="the fleet-shared store of session memory and response bindings (Redis or Valkey: "
        "redis://host:6379/0, rediss://..., unix:///path); default: each replica's own memory",
    )
    s.add_argument(
        "--session-store-password-file",
        metavar="PATH",
        help="file holding the store's password (a mounted Secret)",
    )
    s.add_argument(
        "--session-user-ids",
        action="store_true",
        help="treat an Anthropic request's metadata.user_id as its session key (where each user holds "
        "one conversation at a time)",
    )
    s.add_argument(
        "--session-trust-hints",
        action="store_true",
        help="use inbound hint headers to classify a session (only behind a gateway that sets them)",
    )
    r = p.add_argument_group("response bindings: a stored response's engine (docs/sessions.md)")
    r.add_argument(
        "--response-ttl-ms",
        type=_positive_int,
        default=86_400_000,
        help="how long a response id stays bound to its engine (default 86400000)",
    )
    r.add_argument(
        "--response-max-entries",
        type=_positive_int,
        default=200_000,
        help="response bindings kept per replica, LRU beyond (default 200000)",
    )
    r.add_argument(
        "--response-probe-timeout-ms",
        type=_bounded_ms(0, 60_000),
        default=1_000,
        help="deadline for asking the engines which holds a response no table knows; 0: never ask "
        "(default 1000)",
    )
    k = p.add_argument_group("kubernetes discovery (instead of --worker)")
    k.add_argument(
        "--k8s-selector",
        metavar="LABELS",
        help="EndpointSlices of the engines' Service, e.g. kubernetes.io/service-name=vllm",
    )
    k.add_argument("--k8s-namespace", help="namespace of those slices (default: the pod's own)")
    k.add_argument(
        "--k8s-http-port", default="http", metavar="NAME|NUM", help="engine HTTP port (default http)"
    )
    k.add_argument("--k8s-kv-port", metavar="NAME|NUM", help="engine KV event PUB port of rank 0")
    k.add_argument("--k8s-replay-port", metavar="NAME|NUM", help="engine KV replay port of rank 0")
    k.add_argument("--k8s-dp-size", type=_positive_int, default=1, help="DP ranks per engine (default 1)")
    k.add_argument("--k8s-topic", default="", help="KV event topic prefix (default: all)")
    k.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, then $KUBECONFIG)")
    k.add_argument(
        "--k8s-watch-timeout-s",
        type=_positive_int,
        default=300,
        help="server-side watch timeout; also how soon a revoked RBAC rule shows as not synced (default 300)",
    )
    k.add_argument(
        "--k8s-storage-annotation",
        type=_annotation_key,
        default="",
        metavar="KEY",
        help="read each engine pod's storage identity from its annotations KEY (the id) and KEY-epoch "
        "(default 0), e.g. routerfleet.io/storage-id; needs get on pods (default: off)",
    )

    b = p.add_argument_group("peer bootstrap")
    b.add_argument("--internal-host", help="address of the internal port (default: --host)")
    b.add_argument(
        "--internal-port",
        type=_port,
        default=8081,
        help="internal port: /internal/kv_snapshot and /internal/bootstrap (default 8081)",
    )
    b.add_argument(
        "--internal-token-file",
        metavar="PATH",
        help="the fleet's bearer token; without it the internal port and bootstrap are off",
    )
    b.add_argument(
        "--kv-peer",
        action="append",
        default=[],
        metavar="URL",
        help="a static sibling's internal URL, e.g. http://10.0.0.7:8081; repeat",
    )
    b.add_argument(
        "--kv-peer-selector",
        metavar="LABELS",
        help="EndpointSlices of the routers' own peer Service (needs --k8s-selector)",
    )
    b.add_argument(
        "--kv-peer-port",
        default="internal",
        metavar="NAME|NUM",
        help="the peers' internal port in those slices (default internal)",
    )
    b.add_argument(
        "--no-kv-origin",
        dest="kv_origin",
        action="store_false",
        help="do not rebuild new ranks from the engines' replay buffers (from sequence 0)",
    )
    b.add_argument(
        "--no-kv-bootstrap",
        dest="kv_bootstrap",
        action="store_false",
        help="boot cold: do not pull a sibling's index",
    )
    b.add_argument(
        "--kv-bootstrap-timeout-ms",
        type=_bounded_ms(1, 3_600_000),
        default=600_000,
        help="give up pulling a sibling's index after this (default 600000, at most 1 h)",
    )
    b.add_argument(
        "--kv-bootstrap-seed-required",
        action="store_true",
        help="hold readiness when warm siblings were there but their index could not be pulled "
        "(bounded at 3x the timeout); no-peers and fleet-cold never hold",
    )
    f = p.add_argument_group("fleet load (docs/fleet-load.md)")
    f.add_argument(
        "--fleet-gossip-window-ms",
        type=_non_negative_int,
        default=50,
        help="after this replica's load changes, wait this long for more, then tell the siblings "
        "(needs --internal-token-file and peers; default 50; 0: off)",
    )
    f.add_argument(
        "--fleet-heartbeat-ms",
        type=_bounded_ms(10, 60_000),
        default=500,
        help="tell the siblings at least this often (default 500)",
    )
    f.add_argument(
        "--fleet-peer-max-age-ms",
        type=_bounded_ms(10, 600_000),
        default=2000,
        help="a sibling's report counts this long after it arrived (default 2000; above the heartbeat)",
    )
    f.add_argument(
        "--engine-load-interval-ms",
        type=_non_negative_int,
        default=200,
        help="read each engine's /metrics (running and waiting requests) this often (default 200; 0: off)",
    )
    f.add_argument(
        "--engine-load-timeout-ms",
        type=_bounded_ms(1, 60_000),
        default=500,
        help="the deadline of one engine read (default 500)",
    )
    f.add_argument(
        "--engine-load-max-age-ms",
        type=_bounded_ms(10, 600_000),
        default=2000,
        help="an engine read counts this long (default 2000)",
    )
    return p


def _session_store(text: str) -> str:
    try:
        return store_url(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _bounded_ms(lo: int, hi: int):
    def parse(text: str) -> int:
        v = _non_negative_int(text) if lo == 0 else _positive_int(text)
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {lo}..{hi}, got {v}")
        return v

    return parse


_POLICY_HELP = {
    "balance_abs_threshold": "imbalance guard: least loaded when the in-flight spread max - min exceeds "
    "this and max > min * --balance-rel-threshold",
    "balance_rel_threshold": "imbalance guard: see --balance-abs-threshold",
    "host_weight": "kv_aware: credit of a block held in host memory (device = 1)",
    "disk_weight": "kv_aware: credit of a block held on disk",
    "external_weight": "kv_aware: credit of a block held in an external store",
    "load_cost_tokens": "kv_aware: one in-flight request costs as much as prefilling this many tokens",
    "spread_ties": "kv_aware: break ties by a hash of the request (else target order)",
    "cache_threshold": "approx_prefix: route by prefix above this matched fraction of the text",
    "max_tree_size": "approx_prefix: characters per target's text tree before LRU eviction",
    "seed": "power_of_two: random seed (default: OS entropy)",
}


def _policy_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_policy_flag(group, f: dataclasses.Field) -> None:
    """One flag per PolicyConfig field, typed after its default, so new tunables get flags for free."""
    default = f.default if f.default is not dataclasses.MISSING else None
    help_ = _POLICY_HELP.get(f.name, "routing tunable")
    if isinstance(default, bool):
        group.add_argument(
            _policy_flag(f.name),
            dest=f"policy_{f.name}",
            action=argparse.BooleanOptionalAction,
            default=default,
            help=f"{help_} (default {default})",
        )
        return
    annotation = str(f.type)
    if isinstance(default, float) or annotation.startswith("float"):
        kind = float
    elif isinstance(default, str) or annotation.startswith("str"):
        kind = str
    else:
        kind = int
    group.add_argument(
        _policy_flag(f.name),
        dest=f"policy_{f.name}",
        type=kind,
        default=default,
        metavar=kind.__name__.upper(),
        help=help_ if default is None else f"{help_} (default {default})",
    )


def _policy_config(parser: argparse.ArgumentParser, a: argparse.Namespace) -> PolicyConfig:
    values = {f.name: getattr(a, f"policy_{f.name}") for f in dataclasses.fields(PolicyConfig)}
    for name, value in values.items():  # one at a time, so the error names the flag
        try:
            PolicyConfig(**{name: value})
        except ValueError as exc:
            parser.error(f"argument {_policy_flag(name)}: {exc}")
    try:
        return PolicyConfig(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


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
    engines = [w.engine for w in a.worker]
    if len(set(engines)) != len(engines):
        parser.error("argument --worker: the same url is listed twice")
    if a.k8s_selector and a.worker:
        parser.error("argument --k8s-selector: not with --worker (one way to find engines)")
    if a.k8s_storage_annotation and not a.k8s_selector:
        parser.error("argument --k8s-storage-annotation: needs --k8s-selector (pods come from discovery)")
    if a.kv_peer_selector and not a.k8s_selector:
        # No way to find a sibling: refuse rather than ignore. (Any policy: siblings share their load;
        # only kv_aware also seeds its index from them.)
        parser.error("argument --kv-peer-selector: needs --k8s-selector")
    if (a.kv_peer or a.kv_peer_selector) and not a.internal_token_file:
        parser.error("argument --kv-peer/--kv-peer-selector: needs --internal-token-file")
    if a.internal_token_file:
        try:
            read_token(a.internal_token_file)
        except (OSError, ValueError) as exc:
            parser.error(f"argument --internal-token-file: {exc}")
    try:
        sessions = SessionConfig(
            enabled=a.session_affinity,
            ttl_s=a.session_ttl_ms / 1000,
            max_entries=a.session_max_entries,
            lookup_timeout_s=a.session_lookup_timeout_ms / 1000,
            key_header=a.session_header,
            engine_header=a.session_engine_header,
            hint_header=a.session_hint_header,
            trust_hints=a.session_trust_hints,
            user_ids=a.session_user_ids,
        )
    except ValueError as exc:
        parser.error(f"session affinity: {exc}")
    if a.session_store_password_file:
        if not a.session_store:
            parser.error("argument --session-store-password-file: needs --session-store")
        try:
            read_token(a.session_store_password_file)
        except (OSError, ValueError) as exc:
            parser.error(f"argument --session-store-password-file: {exc}")
    responses = BindingConfig(
        ttl_s=a.response_ttl_ms / 1000,
        max_entries=a.response_max_entries,
        probe_timeout_s=a.response_probe_timeout_ms / 1000,
    )
    if a.kv_disconnect_grace_s < 0:
        parser.error(f"--kv-disconnect-grace-s must be >= 0, got {a.kv_disconnect_grace_s}")
    if a.kv_adoption_cap < 0:
        parser.error(f"--kv-adoption-cap must be >= 0, got {a.kv_adoption_cap}")
    if a.kv_adoption_window_s <= 0:
        parser.error(f"--kv-adoption-window-s must be > 0, got {a.kv_adoption_window_s}")
    if a.fleet_peer_max_age_ms <= a.fleet_heartbeat_ms:
        parser.error(
            f"argument --fleet-peer-max-age-ms: must exceed --fleet-heartbeat-ms ({a.fleet_heartbeat_ms}),"
            " or live siblings would age out between reports"
        )
    return RouterConfig(
        host=a.host,
        port=a.port,
        workers=tuple(a.worker),
        block_size=a.block_size,
        replay_idle_timeout_s=a.replay_idle_timeout_ms / 1000,
        replay_timeout_s=a.replay_timeout_ms / 1000,
        queue_batches=a.kv_queue_batches,
        queue_bytes=a.kv_queue_bytes,
        kv_disconnect_grace_s=a.kv_disconnect_grace_s,
        kv_stall_s=a.kv_stall_ms / 1000,
        kv_adoption_cap=a.kv_adoption_cap,
        kv_adoption_window_s=a.kv_adoption_window_s,
        log_level=a.log_level,
        policy=a.policy,
        policy_config=_policy_config(parser, a),
        tokenizer=a.tokenizer,
        chat_family=a.chat_family,
        chat_template=a.chat_template,
        engine_tokenize_timeout_s=a.engine_tokenize_timeout_ms / 1000,
        tokenizer_threads=a.tokenizer_threads or 0,
        connect_timeout_s=a.connect_timeout_ms / 1000,
        first_byte_timeout_s=a.first_byte_timeout_ms / 1000,
        total_timeout_s=a.total_timeout_ms / 1000,
        idle_timeout_s=a.idle_timeout_ms / 1000,
        upstream_keepalive_s=a.upstream_keepalive_ms / 1000,
        max_body_bytes=a.max_body_bytes,
        allow_paths=tuple(dict.fromkeys(a.allow_path)),
        audit_stream_usage=a.audit_stream_usage,
        shutdown_drain_s=a.shutdown_drain_ms / 1000,
        server=ServerLimits(
            header_timeout_s=a.client_header_timeout_ms / 1000,
            idle_timeout_s=a.client_idle_timeout_ms / 1000,
            max_connections=a.max_connections,
            body_min_bytes_per_s=a.client_body_min_rate,
            body_base_s=a.client_body_base_timeout_ms / 1000,
        ),
        health_interval_s=a.health_interval_ms / 1000,
        health_timeout_s=a.health_timeout_ms / 1000,
        breaker_failures=a.breaker_failures,
        breaker_cooldown_s=a.breaker_cooldown_ms / 1000,
        k8s_selector=a.k8s_selector,
        k8s_namespace=a.k8s_namespace,
        k8s_http_port=a.k8s_http_port,
        k8s_kv_port=a.k8s_kv_port,
        k8s_replay_port=a.k8s_replay_port,
        k8s_dp_size=a.k8s_dp_size,
        k8s_topic=a.k8s_topic,
        kubeconfig=a.kubeconfig,
        k8s_watch_timeout_s=a.k8s_watch_timeout_s,
        k8s_storage_annotation=a.k8s_storage_annotation,
        internal_host=a.internal_host,
        internal_port=a.internal_port,
        internal_token_file=a.internal_token_file,
        kv_peers=tuple(a.kv_peer),
        kv_peer_selector=a.kv_peer_selector,
        kv_peer_port=a.kv_peer_port,
        bootstrap=a.kv_bootstrap,
        bootstrap_timeout_s=a.kv_bootstrap_timeout_ms / 1000,
        bootstrap_seed_required=a.kv_bootstrap_seed_required,
        bootstrap_origin=a.kv_origin,
        sessions=sessions,
        responses=responses,
        session_store=a.session_store,
        session_store_password_file=a.session_store_password_file,
        fleet_gossip_window_s=a.fleet_gossip_window_ms / 1000,
        fleet_heartbeat_s=a.fleet_heartbeat_ms / 1000,
        fleet_peer_max_age_s=a.fleet_peer_max_age_ms / 1000,
        engine_load_interval_s=a.engine_load_interval_ms / 1000,
        engine_load_timeout_s=a.engine_load_timeout_ms / 1000,
        engine_load_max_age_s=a.engine_load_max_age_ms / 1000,
    )
