"""gRPC health (``grpc.health.v1``) on the picker's port, as gateways probe an endpoint picker: the
service ``envoy.service.ext_proc.v3.ExternalProcessor`` (and the server as a whole, "", and
``inference-extension``, the name the extension's own manifests probe) is SERVING exactly when the
router's ``/readyz`` would say ready (bootstrap settled, live subscriptions). ``serve_health`` serves it
alone on a plaintext port too (``--epp-health-port``), for a kubelet's gRPC probe, which has no TLS."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVICES = ("", SERVICE, "inference-extension")


class PickerHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in SERVICES:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:80]!r}")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)


async def serve_health(host: str, port: int, ready: Callable[[], bool]) -> tuple[grpc.aio.Server, int]:
    """The picker's health alone, plaintext, on a started gRPC server at ``host:port``; returns it and
    the port bound."""
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(PickerHealth(ready), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    return server, bound
