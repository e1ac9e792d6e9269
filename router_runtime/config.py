"""The router's configuration and its command line. Bad values fail with one line naming the flag.

``RouterConfig`` is a few process-wide fields and one section per subsystem; each subsystem declares its
section's dataclass and its flags in its own ``config`` module (``kv/config.py``, ...). This module only
arranges those flags into the help's groups and checks what spans sections."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .bootstrap import config as bootstrap_config
from .bootstrap.config import InternalConfig, PeerConfig
from .bootstrap.http import read_token
from .bootstrap.sweep import BootstrapConfig
from .disaggregation import config as disaggregation_config
from .disaggregation.config import DisaggregationConfig
from .discovery import config as discovery_config
from .discovery.config import DiscoveryConfig
from .discovery.static import parse_worker
from .flags import PORT, Flag, Switch, Text
from .fleet import config as fleet_config
from .fleet.config import FleetConfig
from .gateway import config as gateway_config
from .gateway.config import PickerConfig
from .kv import config as kv_config
from .kv.config import KvConfig
from .proxy import config as proxy_config
from .proxy import health
from .proxy.config import ProxyConfig
from .proxy.health import HealthConfig
from .proxy.serving import ServerLimits
from .scheduling import config as scheduling_config
from .scheduling.config import SchedulingConfig
from .sessions import config as sessions_config
from .sessions.bindings import BindingConfig
from .sessions.config import SessionConfig, StoreConfig
from .tokens import config as tokens_config
from .tokens.config import TokenizerConfig
from .tokens.tokenizer import ENGINE_TOKENIZER, ChatTemplateSpecError, TokenizerError, load_tokenizer
from .tracing import config as tracing_config
from .tracing.config import TracingConfig
from .worker import WorkerSpec


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """The metrics port: ``/metrics``, ``/debug/index`` and ``/debug/load``, for Prometheus and
    operators, never on the public port unless ``public`` (docs/security.md)."""

    host: str | None = None  # None: the router's --host
    port: int = 9090
    public: bool = False  # also on the public port, as before the metrics port existed


@dataclass(frozen=True, slots=True)
class RouterConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # The engines, when listed statically (else discovery finds them).
    workers: tuple[WorkerSpec, ...] = field(default_factory=tuple)
    log_level: str = "info"
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    kv: KvConfig = field(default_factory=KvConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    tokens: TokenizerConfig = field(default_factory=TokenizerConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    server: ServerLimits = field(default_factory=ServerLimits)  # client connections
    health: HealthConfig = field(default_factory=HealthConfig)
    sessions: SessionConfig = field(default_factory=SessionConfig)
    responses: BindingConfig = field(default_factory=BindingConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    gateway: PickerConfig = field(default_factory=PickerConfig)
    internal: InternalConfig = field(default_factory=InternalConfig)
    peers: PeerConfig = field(default_factory=PeerConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    disaggregation: DisaggregationConfig = field(default_factory=DisaggregationConfig)


_DEFAULTS = RouterConfig()


# ---- the command line: every flag declared once --------------------------------------------------
#
# A flag (flags.py) names the RouterConfig field it sets (a dotted path: section, then field), its kind
# (type, unit, bounds) and its help; its default is the field's own default, so the parser, the config
# and the help cannot drift apart. Durations: the config holds seconds; a flag names its unit (``-ms``,
# integer milliseconds; three ``-s`` flags that deployed manifests already carry keep theirs).

_WORKER = Flag(
    "--worker",
    "workers",
    Text(parse_worker, many=True),
    metavar="SPEC",
    help="a static engine: url=http://H:P[,kv=tcp://H:P][,replay=tcp://H:P][,dp=N][,topic=T]"
    "[,role=prefill|decode|both][,rev=R][,bootstrap=PORT]; repeat",
)

# (group title, its flags); None: the parser's own options.
FLAGS: tuple[tuple[str | None, tuple[Flag, ...]], ...] = (
    (
        None,
        (
            Flag("--host", "host", Text(), "address to listen on"),
            Flag("--port", "port", PORT, "public HTTP port"),
            Flag(
                "--metrics-host", "metrics.host", Text(), "address of the metrics port", default_text="--host"
            ),
            Flag("--metrics-port", "metrics.port", PORT, "metrics port: /metrics, /debug/index, /debug/load"),
            Flag(
                "--public-metrics",
                "metrics.public",
                Switch(negatable=False),
                "serve /metrics and /debug/* on the public port too (they show engine URLs, replica names"
                " and block counts to whoever reaches it)",
            ),
            _WORKER,
            *kv_config.FLAGS,
            Flag(
                "--log-level", "log_level", Text(choices=("debug", "info", "warning", "error")), "log level"
            ),
        ),
    ),
    ("routing", (*scheduling_config.FLAGS, *tokens_config.FLAGS)),
    ("request plane", proxy_config.FLAGS),
    ("client connections (the router's HTTP server)", proxy_config.SERVER_FLAGS),
    ("engine health", health.FLAGS),
    ("session affinity (docs/sessions.md)", sessions_config.FLAGS),
    ("response bindings: a stored response's engine (docs/sessions.md)", sessions_config.RESPONSE_FLAGS),
    ("kubernetes discovery (instead of --worker)", discovery_config.FLAGS),
    ("gateway endpoint picker", gateway_config.FLAGS),
    ("peer bootstrap", bootstrap_config.FLAGS),
    ("fleet load (docs/fleet-load.md)", fleet_config.FLAGS),
    ("tracing (docs/tracing.md)", tracing_config.FLAGS),
    ("prefill/decode disaggregation (docs/disaggregation.md)", disaggregation_config.FLAGS),
)

# How an error in a section's own checks names it (else by its field name).
_SECTION_NAMES = {
    "server": "client connections",
    "sessions": "session affinity",
    "responses": "response bindings",
    "scheduling": "routing",
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
    """RouterConfig's keyword arguments from the parsed flags: each section built from its flags over
    its own defaults (a section's own checks name it when they fail)."""
    tree: dict[str, Any] = {}
    for _title, flags in FLAGS:
        for flag in flags:
            *sections, name = flag.path.split(".")
            node = tree
            for section in sections:
                node = node.setdefault(section, {})
            node[name] = flag.kind.to_config(getattr(a, flag.dest))
    top = {}
    for name, value in tree.items():
        if not isinstance(value, dict):
            top[name] = value
            continue
        try:
            top[name] = _section(getattr(_DEFAULTS, name), value)
        except ValueError as exc:
            parser.error(f"{_SECTION_NAMES.get(name, name)}: {exc}")
    return top


def _section(default: Any, values: dict[str, Any]) -> Any:
    """``default`` with ``values`` set, a nested dict setting a nested config's fields in turn."""
    changes = {k: _section(getattr(default, k), v) if isinstance(v, dict) else v for k, v in values.items()}
    return dataclasses.replace(default, **changes)


def _check_tokenizer(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.tokens__tokenizer == ENGINE_TOKENIZER:
        if a.tokens__chat_template is not None:
            parser.error("argument --chat-template: not with --tokenizer engine (the engines render)")
        return
    try:
        load_tokenizer(
            a.tokens__tokenizer, a.tokens__chat_family, a.tokens__chat_template
        )  # cached: the router reuses it
    except ChatTemplateSpecError as exc:
        parser.error(f"argument --chat-template: {exc}")
    except TokenizerError as exc:
        parser.error(f"argument --tokenizer: {exc}")


def _check_ports(parser: argparse.ArgumentParser, c: RouterConfig) -> None:
    """No two of the router's listeners on one address and port (0: any free port)."""
    listeners = [("--port", c.host, c.port), ("--metrics-port", c.metrics.host or c.host, c.metrics.port)]
    if c.internal.token_file:  # the internal port is on only with a token
        listeners.append(("--internal-port", c.internal.host or c.host, c.internal.port))
    g = c.gateway
    if g.port is not None:
        listeners.append(("--epp-port", g.host or c.host, g.port))
    if g.health_port is not None:
        listeners.append(("--epp-health-port", g.host or c.host, g.health_port))
    wildcard = ("", "0.0.0.0", "::", "[::]")  # every address of its family: any other host's too
    for i, (flag, host, port) in enumerate(listeners):
        for other, other_host, other_port in listeners[:i]:
            if (
                port
                and port == other_port
                and (host == other_host or host in wildcard or other_host in wildcard)
            ):
                parser.error(f"argument {flag}: the same port as {other} ({port})")


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    parser = build_parser()
    a = parser.parse_args(argv)
    _check_tokenizer(parser, a)
    c = RouterConfig(**_config_values(parser, a))
    engines = [w.engine for w in c.workers]
    if len(set(engines)) != len(engines):
        parser.error("argument --worker: the same url is listed twice")
    _check_ports(parser, c)
    if c.discovery.selector and c.workers:
        parser.error("argument --k8s-selector: not with --worker (one way to find engines)")
    if c.discovery.pool and (c.workers or c.discovery.selector):
        parser.error(
            "argument --k8s-inference-pool: not with --worker or --k8s-selector (one way to find engines)"
        )
    if c.discovery.prefill_selector and not c.discovery.selector:
        parser.error("argument --k8s-prefill-selector: needs --k8s-selector (the decode engines)")
    if c.discovery.role_label and c.discovery.prefill_selector:
        parser.error("argument --k8s-role-label: not with --k8s-prefill-selector (one way to name roles)")
    if c.discovery.role_label and not (c.discovery.selector or c.discovery.pool):
        parser.error("argument --k8s-role-label: needs --k8s-selector or --k8s-inference-pool (whose pods?)")
    if c.discovery.storage_annotation and not c.discovery.selector:
        parser.error("argument --k8s-storage-annotation: needs --k8s-selector (pods come from discovery)")
    if c.peers.selector and not (c.discovery.selector or c.discovery.pool):
        # No way to find a sibling: refuse rather than ignore. (Any policy: siblings share their load;
        # only kv_aware also seeds its index from them.)
        parser.error("argument --kv-peer-selector: needs --k8s-selector or --k8s-inference-pool")
    if (c.peers.urls or c.peers.selector) and not c.internal.token_file:
        parser.error("argument --kv-peer/--kv-peer-selector: needs --internal-token-file")
    if c.proxy.debug_prediction and not c.internal.token_file:
        parser.error("argument --debug-prediction: needs --internal-token-file (callers present that token)")
    if bool(c.gateway.cert_file) != bool(c.gateway.key_file):
        parser.error("argument --epp-cert-file/--epp-key-file: give both, or neither (a self-signed one)")
    if c.gateway.plaintext and c.gateway.cert_file:
        parser.error("argument --epp-plaintext: not with --epp-cert-file (plaintext or TLS)")
    for flag, path in (("--epp-cert-file", c.gateway.cert_file), ("--epp-key-file", c.gateway.key_file)):
        if path:
            try:
                with open(path, "rb") as f:
                    if b"-----BEGIN " not in f.read(1 << 20):
                        raise ValueError(f"{path}: not PEM")
            except (OSError, ValueError) as exc:
                parser.error(f"argument {flag}: {exc}")
    for flag, given in (
        ("--epp-health-port", c.gateway.health_port is not None),
        ("--epp-conformance-test", c.gateway.conformance_test),
    ):
        if given and c.gateway.port is None:
            parser.error(f"argument {flag}: needs --epp-port (the picker)")
    if c.gateway.health_port and c.gateway.health_port == c.gateway.port:
        parser.error("argument --epp-health-port: the same as --epp-port (its own, plaintext port)")
    if c.gateway.pool and c.gateway.port is None:
        parser.error("argument --epp-pool: needs --epp-port (the pool's picker)")
    if c.gateway.pool and c.fleet.scrape.interval_s <= 0:
        parser.error(
            "argument --epp-pool: needs --engine-load-interval-ms above 0 (the engines' reads say when"
            " they have no room)"
        )
    if c.store.password_file and not c.store.url:
        parser.error("argument --session-store-password-file: needs --session-store")
    for flag, path in (
        ("--internal-token-file", c.internal.token_file),
        ("--session-store-password-file", c.store.password_file),
    ):
        if path:
            try:
                read_token(path)
            except (OSError, ValueError) as exc:
                parser.error(f"argument {flag}: {exc}")
    scrape = c.fleet.scrape.interval_s
    if scrape > 0 and c.fleet.bounds.engine_max_age_s <= scrape:
        parser.error(
            f"argument --engine-load-max-age-ms: must exceed --engine-load-interval-ms"
            f" ({round(scrape * 1000)}), or each engine's read would age out before the next (a picker"
            " would shed requests for engines it has no fresh read of)"
        )
    if c.fleet.bounds.peer_max_age_s <= c.fleet.gossip.heartbeat_s:
        parser.error(
            f"argument --fleet-peer-max-age-ms: must exceed --fleet-heartbeat-ms"
            f" ({round(c.fleet.gossip.heartbeat_s * 1000)}), or live siblings would age out between reports"
        )
    return c
