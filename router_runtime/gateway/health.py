"""gRPC health (``grpc.health.v1``) on the picker's port, as gateways probe an endpoint picker: the
service ``envoy.service.ext_proc.v3.ExternalProcessor`` (and the server as a whole, "") is SERVING
exactly when the router's ``/readyz`` would say ready (bootstrap settled, live subscriptions)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class PickerHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, ready: Callable[[], bool]) -> None:
        self._ready = ready

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:80]!r}")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        return health_pb2.HealthCheckResponse(status=status)
