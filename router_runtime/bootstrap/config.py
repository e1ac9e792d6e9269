"""Peer bootstrap's configuration sections and their flags: the internal port siblings talk on
(``RouterConfig.internal``), how siblings are found (``.peers``) and the bootstrap itself
(``.bootstrap``, a ``sweep.BootstrapConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import PORT, Flag, Ms, Switch, Text


@dataclass(frozen=True, slots=True)
class InternalConfig:
    """The internal port (snapshot producer, bootstrap verdict, siblings' reports), on only with a
    token file."""

    host: str | None = None  # None: the router's --host
    port: int = 8081
    token_file: str | None = None


@dataclass(frozen=True, slots=True)
class PeerConfig:
    urls: tuple[str, ...] = ()  # static siblings' internal URLs
    selector: str | None = None  # the routers' own peer Service's EndpointSlices
    port: str = "internal"  # the siblings' internal port in those slices


FLAGS = (
    Flag(
        "--internal-host",
        "internal.host",
        Text(),
        "address of the internal port",
        default_text="--host",
    ),
    Flag(
        "--internal-port",
        "internal.port",
        PORT,
        "internal port: /internal/kv_snapshot and /internal/bootstrap",
    ),
    Flag(
        "--internal-token-file",
        "internal.token_file",
        Text(),
        metavar="PATH",
        help="the fleet's bearer token; without it the internal port and bootstrap are off",
    ),
    Flag(
        "--kv-peer",
        "peers.urls",
        Text(many=True),
        metavar="URL",
        help="a static sibling's internal URL, e.g. http://10.0.0.7:8081; repeat",
    ),
    Flag(
        "--kv-peer-selector",
        "peers.selector",
        Text(),
        metavar="LABELS",
        help="EndpointSlices of the routers' own peer Service (needs --k8s-selector)",
    ),
    Flag(
        "--kv-peer-port",
        "peers.port",
        Text(),
        metavar="NAME|NUM",
        help="the peers' internal port in those slices",
    ),
    Flag(
        "--no-kv-origin",
        "bootstrap.origin",
        Switch(negatable=False),
        "do not rebuild new ranks from the engines' replay buffers (from sequence 0)",
    ),
    Flag(
        "--no-kv-bootstrap",
        "bootstrap.enabled",
        Switch(negatable=False),
        "boot cold: do not pull a sibling's index",
    ),
    Flag(
        "--kv-bootstrap-timeout-ms",
        "bootstrap.timeout_s",
        Ms(1, 3_600_000),
        "give up pulling a sibling's index after this (at most 1 h)",
    ),
    Flag(
        "--kv-bootstrap-seed-required",
        "bootstrap.seed_required",
        Switch(negatable=False),
        "hold readiness when warm siblings were there but their index could not be pulled (bounded at"
        " 3x the timeout); no-peers and fleet-cold never hold",
    ),
)
