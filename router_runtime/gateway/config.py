"""The endpoint picker's configuration section (``RouterConfig.gateway``) and its flags."""

from __future__ import annotations

from dataclasses import dataclass

from ..flags import Count, Flag, Switch, Text


@dataclass(frozen=True, slots=True)
class PickerConfig:
    host: str | None = None  # None: the router's --host
    port: int | None = None  # None: not served; 0: any free port
    cert_file: str | None = None  # with key_file; neither: a self-signed certificate
    key_file: str | None = None
    plaintext: bool = False


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
)
