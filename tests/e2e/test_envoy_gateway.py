"""Envoy Gateway on the local cluster (e2e/gateway/envoy_gateway.py): installed from its own chart, it
programs a Gateway whose Envoy routes an HTTPRoute to a Service, reached at the Gateway's own address."""

import subprocess
import time
import urllib.request

import pytest
import yaml
from test_node_agent import SERVE_NAME, _container, _local_only, _pod_body
from test_operator import kubectl_path

from e2e.entrypoints import entrypoints
from e2e.gateway import envoy_gateway as eg


@pytest.fixture(scope="module")
def envoy_gateway(cluster):
    _local_only(cluster, "runs Envoy Gateway's images as the binaries built here")
    assert "docker.io/envoyproxy/gateway" in entrypoints(), "Envoy Gateway is not built: make envoy-gateway"

    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
        argv = [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), *args]
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=240)

    eg.install(kubectl)
    return kubectl


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


@pytest.mark.timeout(600)
def test_a_gateway_routes_an_http_route_to_a_service(cluster, namespace, envoy_gateway):
    ns, core, kubectl = namespace, cluster.core, envoy_gateway
    ready = {"tcpSocket": {"port": 7000}, "periodSeconds": 1}
    for name in ("a", "b"):
        body = _pod_body(name, _container(name, "python", "-c", SERVE_NAME, readinessProbe=ready))
        body["metadata"]["labels"] = {"app": "serve-name"}
        core.create_namespaced_pod(ns, body)
    spec = {"selector": {"app": "serve-name"}, "ports": [{"port": 80, "targetPort": 7000}]}
    core.create_namespaced_service(ns, {"metadata": {"name": "names"}, "spec": spec})
    gateway = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "gw", "namespace": ns},
        "spec": {
            "gatewayClassName": eg.CLASS,
            "listeners": [{"name": "http", "port": 8080, "protocol": "HTTP"}],
        },
    }
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "names", "namespace": ns},
        "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": [{"name": "names", "port": 80}]}]},
    }
    p = kubectl("apply", "-f", "-", input=yaml.safe_dump_all([gateway, route]))
    assert p.returncode == 0, p.stderr
    cluster.wait_pods_ready(ns, "app=serve-name", 2)
    address = eg.gateway_address(kubectl, ns, "gw", timeout=180)
    deadline, seen = time.monotonic() + 60, set()
    while seen != {"a", "b"} and time.monotonic() < deadline:
        try:
            seen.add(_get(f"http://{address}:8080/"))
        except OSError:
            time.sleep(0.5)
    assert seen == {"a", "b"}, seen
