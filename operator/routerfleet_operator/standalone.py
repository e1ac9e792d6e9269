"""The standalone gateway (``spec.gateway.standalone``): for a cluster without a Gateway implementation,
an Envoy beside each router replica, in its pod, asking that replica's picker over loopback where each
request goes. ``envoy_config(fleet)`` is its whole configuration, a pure function of the spec.

Why a container in the router pod and not a Deployment of its own: the Envoy then needs no control
plane and no DNS (the picker is at 127.0.0.1; the engine is the address the picker names, through an
ORIGINAL_DST cluster on ``x-gateway-destination-endpoint``), and it is Ready exactly when its picker
is seeded and Ready, so the gateway Service never sends a request to a cold replica.
"""

from __future__ import annotations

from typing import Any

from .model import ENVOY_DIR, ENVOY_KEY, EPP_PORT, GATEWAY_PORT
from .spec import Fleet

ADMIN_PORT = 9901  # loopback only: the pod's own
# The picker answers a request's headers once its whole body is in, so Envoy holds the body meanwhile:
# it must fit Envoy's buffer (1 MiB by default, a stall then a 413 above it); the router's own body
# limit (--max-body-bytes' default) decides instead, with its OpenAI-shaped 413.
BUFFER_LIMIT_BYTES = 32 << 20
DESTINATION = "x-gateway-destination-endpoint"
# Headers only the picker may set: a client's own would steer the request (to any address, through the
# ORIGINAL_DST cluster, or a decode engine's sidecar to a prefill engine of its choosing) wherever the
# picker sets none.
PICKER_HEADERS = (DESTINATION, "x-data-parallel-rank", "x-prefiller-host-port", "x-prefiller-url")

_T = "type.googleapis.com/envoy."

# Envoy exits at once on SIGTERM, cutting its requests in flight. Its container stops it this long
# after the pod's SIGTERM instead (the pod is out of the Service's endpoints by then; a client's
# kept-alive connection may still bring requests until Envoy goes), and the router beside it drains
# (--shutdown-drain-ms) until after that, answering picks; then its requests in flight get its
# --shutdown-timeout-ms (10 s): 12 + 10 s, inside the pod's 30 s grace period.
STOP_DELAY_S = 10
ROUTER_DRAIN_S = STOP_DELAY_S + 2


def envoy_command() -> list[str]:
    """The Envoy container's command: Envoy in a session of its own (so a runtime that signals the
    container's process group reaches only this shell), stopped STOP_DELAY_S after the shell's SIGTERM.
    No hot restart: a container never hands over to a second Envoy, and its shared memory would be
    shared with every other Envoy on a node that runs pods as processes."""
    script = (
        f"setsid envoy -c {ENVOY_DIR}/{ENVOY_KEY} --disable-hot-restart -l warning & pid=$!\n"
        f'trap "sleep {STOP_DELAY_S}; kill -TERM $pid" TERM\n'
        "wait $pid; code=$?\n"  # Envoy's status, or 128+15 when the trap interrupted the wait
        "while kill -0 $pid 2>/dev/null; do wait $pid; code=$?; done\n"
        "exit $code\n"
    )
    return ["sh", "-c", script]


def envoy_config(fleet: Fleet) -> dict[str, Any]:
    """Envoy's bootstrap: one listener on GATEWAY_PORT; the picker at 127.0.0.1:EPP_PORT (TLS, not
    verified, as gateways reach a picker, unless spec.gateway.tls is false); bodies FULL_DUPLEX_STREAMED
    both ways (the audit reads the engine's usage on the way out); no fail-open (a pod whose picker is
    down is not Ready: the Service has already taken it out)."""
    picker: dict[str, Any] = {
        "name": "picker",
        "type": "STATIC",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "picker",
            "endpoints": [{"lb_endpoints": [_endpoint("127.0.0.1", EPP_PORT)]}],
        },
    }
    if fleet.spec.gateway.tls:
        picker["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": {
                "@type": _T + "extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"alpn_protocols": ["h2"]},
            },
        }
    return {
        "admin": {"address": _address("127.0.0.1", ADMIN_PORT)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address("0.0.0.0", GATEWAY_PORT),
                    "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                    "filter_chains": [{"filters": [_connection_manager()]}],
                }
            ],
            "clusters": [
                {
                    "name": "pool",  # wherever the picker's x-gateway-destination-endpoint says
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
                },
                picker,
            ],
        },
    }


def _connection_manager() -> dict[str, Any]:
    return {
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
            "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "gateway",
            # The clients are the edge: their x-envoy-* headers (retries, timeouts) are not obeyed.
            "use_remote_address": True,
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "pool",
                        "domains": ["*"],
                        # No route timeout: a generation streams as long as it takes (the stream idle
                        # timeout, 5 minutes by default, still ends a silent one).
                        "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}}],
                    }
                ]
            },
            "http_filters": [
                {
                    "name": "envoy.filters.http.header_mutation",
                    "typed_config": {
                        "@type": _T + "extensions.filters.http.header_mutation.v3.HeaderMutation",
                        "mutations": {"request_mutations": [{"remove": h} for h in PICKER_HEADERS]},
                    },
                },
                {
                    "name": "envoy.filters.http.ext_proc",
                    "typed_config": {
                        "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": "10s"},
                        "failure_mode_allow": False,
                        "message_timeout": "10s",
                        "response_attributes": ["upstream.address"],  # the engine that served
                        # Both bodies streamed both ways, trailers sent: the mode the extension's
                        # own gateway runs, the one every picker speaks (the reference picker speaks
                        # no other).
                        "processing_mode": {
                            "request_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_header_mode": "SEND",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND",
                            "response_trailer_mode": "SEND",
                        },
                    },
                },
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"},
                },
            ],
        },
    }


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoint(host: str, port: int) -> dict[str, Any]:
    return {"endpoint": {"address": _address(host, port)}}
