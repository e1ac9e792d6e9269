"""gRPC health (``grpc.health.v1``) on the picker's port, as gateways probe an endpoint picker: the
service ``envoy.service.ext_proc.v3.ExternalProcessor`` (and the server as a whole, "", and
``inference-extension``, the name the extension's own manifests probe) is SERVING exactly when the
router's ``/readyz`` would say ready (bootstrap settled, live subscriptions). transport.py serves it
alone on a plaintext port too (``--epp-health-port``), for a kubelet's gRPC probe, which has no TLS."""

from __future__ import annotations

from grpc_health.v1 import health_pb2

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
SERVICES = ("", SERVICE, "inference-extension")


def check(request: bytes, ready: bool) -> bytes:
    """The serialized answer to a serialized ``HealthCheckRequest``. Raises LookupError for a service
    not served here, google.protobuf's DecodeError for bytes that are no request."""
    service = health_pb2.HealthCheckRequest.FromString(request).service
    if service not in SERVICES:
        raise LookupError(f"unknown service {service[:80]!r}")
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    return health_pb2.HealthCheckResponse(status=status).SerializeToString()
