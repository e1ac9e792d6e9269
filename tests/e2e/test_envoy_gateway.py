"""Envoy Gateway on the local cluster (e2e/gateway/envoy_gateway.py): installed from its own chart, it
programs a Gateway whose Envoy routes an HTTPRoute to a Service, reached at the Gateway's own address;
and a RouterFleet picks for its InferencePool behind it: the hit rate, a rolling restart under traffic,
a paused rollout."""

import asyncio
import subprocess

import aiohttp
import pytest
import test_gateway
import test_operator
import yaml
from test_gateway import gateway_ready, paused_on_block_size, rolled_under_traffic
from test_node_agent import _local_only
from test_operator import (
    FLEET,
    GROUP,
    PLURAL,
    VERSION,
    chat_workload,
    deploy_engines,
    fleet_manifest,
    get_fleet,
    kubectl_path,
    measure_fleet,
    wait_fleet_ready,
)
from test_services import both_answer, serve_names

from e2e.entrypoints import entrypoints
from e2e.fleet import ENGINE_LABELS
from e2e.gateway import envoy_gateway as eg

crd = test_operator.crd  # the fixtures: the RouterFleet CRD applied, and the operator as a subprocess
operator = test_operator.operator
pool_crds = test_gateway.pool_crds  # the extension's CRDs, as a cluster with a Gateway has them
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def envoy_gateway(cluster):
    _local_only(cluster, "runs Envoy Gateway's images as the binaries built here")
    images = entrypoints()
    for repo in ("docker.io/envoyproxy/gateway", eg.EXTENSION_IMAGE):
        assert repo in images, f"{repo} is not built: make envoy-gateway"

    def kubectl(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
        argv = [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), *args]
        return subprocess.run(argv, input=input, capture_output=True, text=True, timeout=240)

    eg.install(kubectl)
    return kubectl


def test_a_gateway_routes_an_http_route_to_a_service(cluster, namespace, envoy_gateway):
    ns, kubectl = namespace, envoy_gateway
    serve_names(cluster, ns)
    route = eg.http_route(ns, "names", "gw", {"name": "names", "port": 80})
    p = kubectl("apply", "-f", "-", input=yaml.safe_dump_all([eg.gateway(ns, "gw"), route]))
    assert p.returncode == 0, p.stderr
    address = eg.gateway_address(kubectl, ns, "gw", timeout=180)
    assert both_answer(f"http://{address}:8080/", timeout=60) == {"a", "b"}


def test_a_fleet_picks_for_its_inference_pool_behind_envoy_gateway(
    cluster, namespace, crd, pool_crds, operator, envoy_gateway
):
    """A RouterFleet with spec.gateway renders its InferencePool; an HTTPRoute of a Gateway of Envoy
    Gateway names the pool: the Gateway reports the pool accepted (the fleet's GatewayReady follows), and
    the chat workload through the Gateway, each request picked by the fleet's pickers over ext_proc, hits
    the cache as well as through the routers' own proxy."""
    ns, kubectl = namespace, envoy_gateway
    deploy_engines(cluster, ns, ("--decode-tokens-per-s=400",))
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    manifest = fleet_manifest(cluster, ns, replicas=3)
    manifest["spec"]["gateway"] = {"enabled": True}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
    wait_fleet_ready(cluster, crd, ns, "3 replicas Ready", timeout=240)
    gateway = eg.gateway(ns, "inference")
    pool = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": FLEET}
    route = eg.http_route(ns, "chat", "inference", pool, timeouts={"request": "60s"})
    p = kubectl("apply", "-f", "-", input=yaml.safe_dump_all([gateway, route]))
    assert p.returncode == 0, p.stderr
    address = eg.gateway_address(kubectl, ns, "inference", timeout=180)
    cluster.wait_for(
        "GatewayReady True: Envoy Gateway accepted the pool",
        lambda: gateway_ready(get_fleet(crd, ns)) == ("True", "Accepted"),
        90,
    )

    chats = chat_workload(seed=17)
    hit_proxy, _ = measure_fleet(cluster, crd, ns, 3, chats)
    for pod in cluster.core.list_namespaced_pod(ns, label_selector=ENGINE_LABELS).items:
        cluster.core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
    cluster.wait_for(
        "the old engines gone",
        lambda: len(cluster.core.list_namespaced_pod(ns, label_selector=ENGINE_LABELS).items) == 2,
        60,
    )
    hit_gateway, shares = measure_fleet(cluster, crd, ns, 3, chats, urls=[f"http://{address}:8080"])
    print(f"\n[envoy-gateway] hit rate: proxy {hit_proxy:.1%}, through Envoy Gateway {hit_gateway:.1%}")
    assert hit_gateway >= 0.9 * hit_proxy, (hit_proxy, hit_gateway, shares)

    # A rolling restart under traffic through the Gateway: no request fails, the hit rate holds, each
    # new replica picks only once seeded.
    rolled_under_traffic(cluster, crd, ns, "envoy-gateway", via=f"http://{address}:8080")

    # A block size the engines do not share: the rollout pauses as through the proxy; the held replica
    # picks nothing (not in the picker Service) and the Gateway goes on serving through the old ones.
    paused_on_block_size(cluster, crd, ns)
    statuses = asyncio.run(completions(f"http://{address}:8080", 9))
    assert statuses == [200] * 9, statuses


async def completions(base: str, n: int) -> list[int]:
    """``n`` distinct completions through ``base``: their statuses."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        statuses = []
        for k in range(n):
            body = {"model": "m", "prompt": f"paused {k} " * 40, "max_tokens": 2}
            async with s.post(f"{base}/v1/completions", json=body) as r:
                statuses.append(r.status)
        return statuses
