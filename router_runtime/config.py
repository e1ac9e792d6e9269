"""The router's configuration and its command line. Bad values fail with one line naming the flag."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from .discovery.static import parse_worker
from .kv.plane import WorkerSpec
from .routing.policies import POLICY_NAMES, PolicyConfig
from .tokens.tokenizer import TokenizerError, load_tokenizer


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
    log_level: str = "info"
    # Routing.
    policy: str = "kv_aware"
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    tokenizer: str = "bytes"  # "bytes" or a Hugging Face tokenizer directory
    tokenizer_threads: int = 0  # 0: min(4, CPUs)
    tokenize_inline_max_bytes: int = 16 << 10  # larger request bodies tokenize (and parse) on the pool
    # The request plane.
    connect_timeout_s: float = 5.0
    first_byte_timeout_s: float = 600.0
    total_timeout_s: float = 3600.0
    idle_timeout_s: float = 300.0
    max_body_bytes: int = 32 << 20
    upstream_keepalive_s: float = 4.0
    # Engine health.
    health_interval_s: float = 5.0  # 0: no active checks (request outcomes still drive the breakers)
    health_timeout_s: float = 2.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 5.0


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


def _tokenizer(text: str) -> str:
    try:
        load_tokenizer(text)  # cached: the router reuses it
    except TokenizerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _port(text: str) -> int:
    v = _positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"expected a port (1-65535), got {v}")
    return v


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
        type=_tokenizer,
        default="bytes",
        metavar="bytes|PATH",
        help="tokenizer for prefix matching: 'bytes' (the fake engine's), or a directory holding a Hugging "
        "Face tokenizer.json (and tokenizer_config.json for the chat template); default bytes",
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
    return p


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


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    engines = [w.engine for w in a.worker]
    if len(set(engines)) != len(engines):
        parser.error("argument --worker: the same url is listed twice")
    return RouterConfig(
        host=a.host,
        port=a.port,
        workers=tuple(a.worker),
        block_size=a.block_size,
        replay_idle_timeout_s=a.replay_idle_timeout_ms / 1000,
        replay_timeout_s=a.replay_timeout_ms / 1000,
        queue_batches=a.kv_queue_batches,
        queue_bytes=a.kv_queue_bytes,
        log_level=a.log_level,
        policy=a.policy,
        policy_config=_policy_config(parser, a),
        tokenizer=a.tokenizer,
        tokenizer_threads=a.tokenizer_threads or 0,
        connect_timeout_s=a.connect_timeout_ms / 1000,
        first_byte_timeout_s=a.first_byte_timeout_ms / 1000,
        total_timeout_s=a.total_timeout_ms / 1000,
        idle_timeout_s=a.idle_timeout_ms / 1000,
        upstream_keepalive_s=a.upstream_keepalive_ms / 1000,
        max_body_bytes=a.max_body_bytes,
        health_interval_s=a.health_interval_ms / 1000,
        health_timeout_s=a.health_timeout_ms / 1000,
        breaker_failures=a.breaker_failures,
        breaker_cooldown_s=a.breaker_cooldown_ms / 1000,
    )
