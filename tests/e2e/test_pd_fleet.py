"""A disaggregated RouterFleet (``spec.engines.disaggregation``, docs/disaggregation.md) with the operator
on a real control plane: fake engines in two Deployments, one that decodes and one that prefills (vLLM's
KV-connector flow, the fake engine's ``--kv-transfer``), both labelled with one engine revision. The
routers find both pools through their Services' EndpointSlices and each engine's revision from its pod;
a multi-turn chat workload is prefilled remotely when a decode engine misses a long prefix and locally
when it misses a short suffix; a seed-gated rolling restart of the routers under it fails no request;
an engine rolling update to a new revision under it never pairs a prefill and a decode engine of two
revisions (the fake engines refuse such KV, as a connector's handshake does). Then llm-d's way: one
Service over both pools, each engine's role read from its pod's label, through the routers' proxy and
through the standalone gateway (the picker names the prefill engine to the decode engine's sidecar).

    .venv/bin/python -m e2e.cluster pytest -q tests/e2e/test_pd_fleet.py
"""

from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
import pytest
import test_gateway
import test_operator
from test_gateway import rolled_under_traffic
from test_operator import FLEET, GROUP, PLURAL, VERSION, _local_only, fleet_manifest, wait_fleet_ready

from e2e import fleet_traffic as T
from e2e.fleet import (
    ENGINE,
    ROUTER_PORT,
    apply,
    find,
    load_manifests,
    metrics,
    metrics_url,
    parse_metrics,
    pod_url,
)
from routerfleet_operator.model import GATEWAY_PORT

crd = test_operator.crd  # the fixtures: the RouterFleet CRD applied, and the operator as a subprocess
operator = test_operator.operator
pool_crds = test_gateway.pool_crds  # the extension's CRDs, for the gateway's pool
PREFILL = f"{ENGINE}-prefill"
DECODE = f"{ENGINE}-decode"
REVISION = {"app.kubernetes.io/version": "v1"}
ROLE_LABEL = "llm-d.ai/role"  # llm-d's
POOLS = "routerfleet.e2e/pool"  # both pools' pods, with a role label
BOTH_POOLS = f"{ENGINE}-pd"

pytestmark = pytest.mark.timeout(900)


def deploy_pools(cluster, ns: str, role_label: str | None = None, sidecar: bool = False) -> None:
    """The fake engine's Deployment and Service twice, renamed per role, both of revision v1; with
    ``role_label``, each pool's pods also say their role under it, and a third Service (BOTH_POOLS)
    selects the pods of both. ``sidecar``: the decode engines play llm-d's routing sidecar (a gateway's
    picker names the prefill engine to it)."""
    docs = load_manifests(image=getattr(cluster.provider, "image", None))
    for name, role in ((PREFILL, "prefill"), (DECODE, "decode")):
        dep, svc = (dict(find(docs, kind, ENGINE)) for kind in ("Deployment", "Service"))
        labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "routerfleet"}
        template = {**dep["spec"]["template"]}
        roles = {role_label: role, POOLS: "pd"} if role_label else {}
        template["metadata"] = {"labels": {**labels, **REVISION, **roles}}
        spec = template["spec"] = {**template["spec"]}
        engine = {**spec["containers"][0]}
        engine["args"] = [*engine["args"], "--kv-transfer", "--transfer-us-per-block=50", "--revision=v1"]
        if sidecar and role == "decode":
            engine["args"].append("--pd-sidecar")
        spec["containers"] = [engine]
        dep = {**dep, "metadata": {"name": name, "labels": labels}}
        dep["spec"] = {**dep["spec"], "selector": {"matchLabels": labels}, "template": template}
        svc = {
            **svc,
            "metadata": {"name": name, "labels": labels},
            "spec": {**svc["spec"], "selector": labels},
        }
        apply(cluster.api, ns, [dep, svc])
    if role_label:
        apply(
            cluster.api,
            ns,
            [{**svc, "metadata": {"name": BOTH_POOLS}, "spec": {**svc["spec"], "selector": {POOLS: "pd"}}}],
        )


def to_revision(cluster, ns: str, revision: str) -> None:
    """An engine rolling update of both pools to ``revision`` (their label and the engines' own)."""
    for name in (PREFILL, DECODE):
        dep = cluster.apps.read_namespaced_deployment(name, ns)
        container = dep.spec.template.spec.containers[0]
        args = [a for a in container.args if not a.startswith("--revision=")] + [f"--revision={revision}"]
        patch = {
            "spec": {
                "template": {
                    "metadata": {"labels": {"app.kubernetes.io/version": revision}},
                    "spec": {"containers": [{"name": container.name, "args": args}]},
                }
            }
        }
        cluster.apps.patch_namespaced_deployment(name, ns, patch)


def rolled_out(cluster, ns: str) -> bool:
    for name in (PREFILL, DECODE):
        d = cluster.apps.read_namespaced_deployment(name, ns)
        s = d.status
        want = d.spec.replicas
        if (s.observed_generation or 0) < d.metadata.generation or (s.updated_replicas or 0) < want:
            return False
        if (s.replicas or 0) != want or (s.ready_replicas or 0) < want:
            return False
    return True


def fleet_token(cluster, ns: str) -> str:
    secret = cluster.core.read_namespaced_secret(f"{FLEET}-internal-token", ns)
    return base64.b64decode(secret.data["token"]).decode()


async def chats(cluster, ns: str, token: str, seconds: float, port: int = ROUTER_PORT) -> T.Traffic:
    """The chat workload through the routers (at ``port``: their proxy, or the gateway beside each) for
    ``seconds``."""
    traffic = T.Traffic(T.Kube(str(cluster.kubeconfig)), ns, FLEET, token, seed=13, port=port)
    async with aiohttp.ClientSession(timeout=T.SESSION_TIMEOUT) as session, T.running(traffic, session):
        await asyncio.sleep(seconds)
    return traffic


async def engine_rollout_under_traffic(cluster, ns: str, token: str) -> T.Traffic:
    """Chats through the routers for 10 s, then both pools rolled to revision v2, then 5 s more."""
    traffic = T.Traffic(T.Kube(str(cluster.kubeconfig)), ns, FLEET, token, seed=12)
    async with aiohttp.ClientSession(timeout=T.SESSION_TIMEOUT) as session, T.running(traffic, session):
        await asyncio.sleep(10)
        await asyncio.to_thread(to_revision, cluster, ns, "v2")
        traffic.trigger = time.monotonic()
        deadline = time.monotonic() + 240
        while not await asyncio.to_thread(rolled_out, cluster, ns):
            assert time.monotonic() < deadline, "the engines' rolling update did not end within 240 s"
            await asyncio.sleep(1)
        traffic.done = time.monotonic()
        await asyncio.sleep(5)
    return traffic


async def engine_legs(session: aiohttp.ClientSession, pods) -> dict[str, float]:
    """The engines' disaggregated legs, summed: prefill, decode, and blocks the decode legs pulled."""
    out = {"requests": 0.0, "prefill": 0.0, "decode": 0.0, "received": 0.0, "cross": 0.0}
    for p in pods:
        async with session.get(pod_url(p, 8000) + "/metrics") as r:
            m = parse_metrics(await r.text())
        for k, v in m.items():
            if k.startswith("routerfleet_fake_engine_pd_legs_total{"):
                out["prefill" if 'leg="prefill"' in k else "decode"] += v
            elif k.startswith("routerfleet_fake_engine_pd_received_blocks_total"):
                out["received"] += v
            elif k.startswith("routerfleet_fake_engine_requests_total{"):
                out["requests"] += v
            elif k.startswith("routerfleet_fake_engine_pd_cross_revision_total"):
                out["cross"] += v
    return out


async def verdicts(session: aiohttp.ClientSession, pods) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in pods:
        m = await metrics(session, metrics_url(pod_url(p, ROUTER_PORT)))
        for k, v in m.items():
            if k.startswith("routerfleet_pd_prefills_total{"):
                verdict = k.split('verdict="')[1].split('"')[0]
                out[verdict] = out.get(verdict, 0.0) + v
    return out


async def pool_figures(cluster, ns: str) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """The prefill pool's legs, the decode pool's, and the routers' remote prefill verdicts."""
    core = cluster.core
    prefill = core.list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/name={PREFILL}").items
    decode = core.list_namespaced_pod(ns, label_selector=f"app.kubernetes.io/name={DECODE}").items
    routers = core.list_namespaced_pod(ns, label_selector=f"routerfleet.io/fleet={FLEET}").items
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        return (
            await engine_legs(s, prefill),
            await engine_legs(s, decode),
            await verdicts(s, [p for p in routers if p.status.pod_ip]),
        )


def test_a_disaggregated_fleet_prefills_where_it_pays_and_rolls_out_under_traffic(
    cluster, namespace, crd, operator
):
    _local_only(cluster)
    ns = namespace
    deploy_pools(cluster, ns)
    for name in (PREFILL, DECODE):
        cluster.wait_pods_ready(ns, f"app.kubernetes.io/name={name}", 2)
    manifest = fleet_manifest(cluster, ns, replicas=3)
    engines = manifest["spec"]["engines"]
    engines["serviceName"] = DECODE
    engines["disaggregation"] = {"prefillServiceName": PREFILL}  # a remote prefill from 512 tokens missing
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
    wait_fleet_ready(cluster, crd, ns, "a disaggregated fleet of 3 Ready", timeout=240)

    rolled_under_traffic(cluster, crd, ns, "disaggregated", port=ROUTER_PORT)

    on_prefill, on_decode, said = asyncio.run(pool_figures(cluster, ns))
    print(f"[disaggregated] prefill engines {on_prefill}, decode engines {on_decode}, routers now {said}")
    # Long uncached prefixes (a new system prompt) went to the prefill pool, their KV to the decode
    # pool; the short suffixes of later turns were prefilled where they were decoded.
    assert on_prefill["prefill"] > 0 and on_prefill["decode"] == 0
    assert on_decode["decode"] > 0 and on_decode["received"] > 0 and on_decode["prefill"] == 0
    assert on_decode["decode"] <= on_prefill["prefill"]  # every decode leg had its prefill
    assert on_decode["requests"] > 2 * on_decode["decode"], (on_decode, said)
    assert said["short_suffix"] > 0 and said["prefill_failed"] == 0, said

    # ---- an engine rolling update to revision v2 under the workload
    traffic = asyncio.run(engine_rollout_under_traffic(cluster, ns, fleet_token(cluster, ns)))
    during = [r for r in traffic.reqs if traffic.trigger <= r.t < traffic.done]
    after = [r for r in traffic.reqs if r.t >= traffic.done]
    print(
        f"[disaggregated] engine rollout: {len(during)} requests during, {len(after)} after,"
        f" errors {dict(traffic.error_texts)}"
    )
    refused = {e: n for e, n in traffic.error_texts.items() if "cross-revision" in e}
    assert not refused, refused  # no prefill and decode engine of two revisions were ever paired
    assert len(during) > 20 and len(after) > 10
    # Engines of one revision pair again once both pools are rolled: remote prefills on v2.
    on_prefill, on_decode, _said = asyncio.run(pool_figures(cluster, ns))
    print(f"[disaggregated] v2 prefill engines {on_prefill}, v2 decode engines {on_decode}")
    assert on_decode["cross"] == 0 and on_prefill["prefill"] > 0


@pytest.mark.parametrize("door", ["proxy", "gateway"])
def test_one_services_engines_split_by_their_pods_role_label(
    cluster, namespace, crd, pool_crds, operator, door
):
    """llm-d's way: one Service over both pools, each pod labelled with its role (llm-d.ai/role). The
    routers read each engine's role from its pod: a long uncached prefix is prefilled on a prefill
    engine, and no client request is ever sent to one (it would answer one token and stop). Through the
    routers' proxy, or through the standalone gateway: there the picker names the prefill engine to the
    decode engine's sidecar (llm-d's, played by the fake), which runs the prefill leg."""
    _local_only(cluster)
    ns = namespace
    gateway = door == "gateway"
    deploy_pools(cluster, ns, role_label=ROLE_LABEL, sidecar=gateway)
    for name in (PREFILL, DECODE):
        cluster.wait_pods_ready(ns, f"app.kubernetes.io/name={name}", 2)
    manifest = fleet_manifest(cluster, ns, replicas=2)
    manifest["spec"]["engines"]["serviceName"] = BOTH_POOLS
    manifest["spec"]["engines"]["disaggregation"] = {"roleLabel": ROLE_LABEL}
    if gateway:
        manifest["spec"]["gateway"] = {"enabled": True, "standalone": {"enabled": True}}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, manifest)
    wait_fleet_ready(cluster, crd, ns, "a role-labelled fleet of 2 Ready", timeout=240)

    port = GATEWAY_PORT if gateway else ROUTER_PORT
    traffic = asyncio.run(chats(cluster, ns, fleet_token(cluster, ns), 15, port))
    on_prefill, on_decode, said = asyncio.run(pool_figures(cluster, ns))
    print(
        f"[role label, {door}] {len(traffic.reqs)} requests; prefill engines {on_prefill}, decode"
        f" {on_decode}; {said}"
    )
    assert traffic.errors == 0 and len(traffic.reqs) > 20, dict(traffic.error_texts)
    assert on_prefill["prefill"] > 0 and on_prefill["requests"] == on_prefill["prefill"], on_prefill
    assert on_decode["decode"] > 0 and on_decode["prefill"] == 0, on_decode
    assert said.get("remote", 0) > 0 and said.get("whole_engine", 0) == 0, said
