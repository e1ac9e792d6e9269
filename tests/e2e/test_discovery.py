"""Kubernetes discovery (router_runtime/discovery/kubernetes.py) against a real cluster with RBAC, on the
shared `cluster` and a fresh `namespace` (tests/e2e/conftest.py). The first scenario lives in
e2e/cluster/discovery_smoke.py (also runnable alone: `python -m e2e.cluster run --node-agent node-1 --
python -m e2e.cluster.discovery_smoke`): a ServiceAccount token that may only get/list/watch
endpointslices, 2 fake engines (dp 2) feeding a KVPlane, a pod replaced (new incarnation), the watcher
in a pod on in-cluster config, an unbound ServiceAccount and a revoked binding seen as forbidden. The
second, here: the engines' storage identity from their pods' annotations (--k8s-storage-annotation),
with and without `get` on pods.

    .venv/bin/python -m pytest tests/e2e/test_discovery.py
"""

import contextlib
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry
from test_gateway import kubectl, pool_crds  # noqa: F401 (a fixture)

from e2e.cluster.discovery_smoke import api, metric, run_discovery_checks, token_kubeconfig, wait
from router_runtime.discovery.endpointslices import EngineDiscoveryConfig
from router_runtime.discovery.kubernetes import EndpointSliceWatcher, InferencePoolWatcher


async def test_endpointslice_discovery_with_rbac(cluster, namespace, tmp_path):
    provider = cluster.provider
    await run_discovery_checks(
        Path(cluster.kubeconfig),
        namespace,
        tmp_path,
        image=getattr(provider, "image", "routerfleet:e2e"),
        reach_pods=getattr(provider, "reaches_pod_ips", True),
        container_log=cluster.container_log,
    )


# ------------------------------------------------------------------------------------- storage annotation

KEY = "routerfleet.io/storage-id"
SLICES_RULE = {
    "apiGroups": ["discovery.k8s.io"],
    "resources": ["endpointslices"],
    "verbs": ["get", "list", "watch"],
}
PODS_GET_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}  # as manifests/base grants


def engine_pod(name: str, annotations: dict, image: str) -> dict:
    """A bare fake-engine pod behind the `engine` Service, Ready once it answers /health."""
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    return {
        "metadata": {"name": name, "labels": {"app": "engine"}, "annotations": annotations},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "engine",
                    "image": image,
                    "command": ["routerfleet-fake-engine"],
                    "args": ["--host", "$(POD_IP)", "--port", "8000"],
                    "env": [pod_ip],
                    "ports": [{"name": "http", "containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
                }
            ],
        },
    }


async def test_storage_identity_from_pod_annotations_with_and_without_get_pods(cluster, namespace, tmp_path):
    """--k8s-storage-annotation on the real API server: with `get pods` (and nothing more on pods) each
    engine's WorkerSpec carries the storage identity its pod's annotations declare (found, absent,
    malformed); a ServiceAccount that may read EndpointSlices but not pods discovers the same engines,
    synced, without identities, counting result="forbidden" once per pod."""
    ns = namespace
    core, rbac = cluster.core, cluster.rbac
    rules = {"router": [SLICES_RULE, PODS_GET_RULE], "slices-only": [SLICES_RULE]}
    kubeconfigs = {}
    for sa, sa_rules in rules.items():
        await api(core.create_namespaced_service_account, ns, {"metadata": {"name": sa}})
        await api(rbac.create_namespaced_role, ns, {"metadata": {"name": sa}, "rules": sa_rules})
        await api(
            rbac.create_namespaced_role_binding,
            ns,
            {
                "metadata": {"name": sa},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
            },
        )
        tr = await api(
            core.create_namespaced_service_account_token, sa, ns, {"spec": {"expirationSeconds": 3600}}
        )
        kc = tmp_path / f"{sa}.kubeconfig"
        kubeconfigs[sa] = token_kubeconfig(Path(cluster.kubeconfig), kc, tr.status.token, ns)

    annotations = {
        "e-found": {KEY: "pv-e2e-found", f"{KEY}-epoch": "2"},
        "e-absent": {"unrelated.io/note": "x"},
        "e-malformed": {KEY: "pv-e2e-malformed", f"{KEY}-epoch": "two"},
    }
    image = getattr(cluster.provider, "image", "routerfleet:e2e")
    for name, ann in annotations.items():
        await api(core.create_namespaced_pod, ns, engine_pod(name, ann, image))
    await api(
        core.create_namespaced_service,
        ns,
        {
            "metadata": {"name": "engine"},
            "spec": {
                "selector": {"app": "engine"},
                "ports": [{"name": "http", "port": 8000, "targetPort": "http"}],
            },
        },
    )
    pods = {p.metadata.name: p for p in await api(cluster.wait_pods_ready, ns, "app=engine", 3)}

    # RBAC as intended: get on one pod, never list; the slices-only token may not even get
    as_router = client.CoreV1Api(config.new_client_from_config(str(kubeconfigs["router"])))
    as_slices_only = client.CoreV1Api(config.new_client_from_config(str(kubeconfigs["slices-only"])))
    await wait("the router token can get a pod", lambda: api(as_router.read_namespaced_pod, "e-found", ns))
    for call in (
        lambda: as_router.list_namespaced_pod(ns),
        lambda: as_slices_only.read_namespaced_pod("e-found", ns),
    ):
        with pytest.raises(ApiException) as e:
            await api(call)
        assert e.value.status == 403

    async with contextlib.AsyncExitStack() as stack:
        watchers, history = {}, {sa: [] for sa in rules}
        for sa in rules:
            registry = CollectorRegistry()
            w = EndpointSliceWatcher(
                ns,
                "kubernetes.io/service-name=engine",
                history[sa].append,
                config=EngineDiscoveryConfig(http_port="http"),
                kubeconfig=str(kubeconfigs[sa]),
                registry=registry,
                storage_annotation=KEY,
            )
            await w.start()
            stack.push_async_callback(w.stop)
            watchers[sa] = (w, registry)

        def published(sa):
            w, _ = watchers[sa]
            return w.workers if w.workers is not None and len(w.workers) == 3 else None

        def result(sa, r):
            return metric(watchers[sa][1], "routerfleet_discovery_storage_annotation_total", result=r)

        # with get pods: the identity is in the spec from its first publication on
        found = await wait("3 engines (router)", lambda: published("router"))
        specs = {s.engine.split("/")[1]: s for s in found}
        for name, s in specs.items():
            assert s.incarnation == pods[name].metadata.uid
        assert (specs["e-found"].storage_id, specs["e-found"].storage_epoch) == ("pv-e2e-found", 2)
        assert all(
            (s.storage_id, s.storage_epoch) == ("pv-e2e-found", 2)
            for published_set in history["router"]
            for s in published_set
            if s.engine.endswith("/e-found")
        ), history["router"]
        for name in ("e-absent", "e-malformed"):
            assert (specs[name].storage_id, specs[name].storage_epoch) == ("", 0), specs[name]
        assert {r: result("router", r) for r in ("found", "absent", "malformed", "forbidden", "error")} == {
            "found": 1, "absent": 1, "malformed": 1, "forbidden": 0, "error": 0,
        }  # fmt: skip

        # without it: the same engines, synced, no identity; forbidden counted, discovery unharmed
        others = await wait("3 engines (slices-only)", lambda: published("slices-only"))
        assert {s.engine: s for s in others} == {
            s.engine: replace(s, storage_id="", storage_epoch=0) for s in specs.values()
        }
        w, registry = watchers["slices-only"]
        assert result("slices-only", "forbidden") == 3 and result("slices-only", "found") == 0
        assert w.synced and metric(registry, "routerfleet_discovery_errors_total", reason="forbidden") == 0


# ------------------------------------------------------------------------------------- InferencePool

POOL_RULES = [
    {
        "apiGroups": ["inference.networking.k8s.io"],
        "resources": ["inferencepools"],
        "verbs": ["get", "list", "watch"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
]


async def test_engines_from_an_inference_pool_follow_the_pool_and_its_pods(
    cluster,
    namespace,
    tmp_path,
    pool_crds,  # noqa: F811
):
    """--k8s-inference-pool on the real API server, with only the extension's picker RBAC (inferencepools
    and pods): no pool, no engines (and why); the pool's ready pods on its target port; a changed
    selector or port list takes effect; a deleted pod leaves."""
    ns, core, rbac = namespace, cluster.core, cluster.rbac
    await api(core.create_namespaced_service_account, ns, {"metadata": {"name": "picker"}})
    await api(rbac.create_namespaced_role, ns, {"metadata": {"name": "picker"}, "rules": POOL_RULES})
    await api(
        rbac.create_namespaced_role_binding,
        ns,
        {
            "metadata": {"name": "picker"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "picker"},
            "subjects": [{"kind": "ServiceAccount", "name": "picker", "namespace": ns}],
        },
    )
    tr = await api(
        core.create_namespaced_service_account_token, "picker", ns, {"spec": {"expirationSeconds": 3600}}
    )
    kubeconfig = token_kubeconfig(
        Path(cluster.kubeconfig), tmp_path / "picker.kubeconfig", tr.status.token, ns
    )
    image = getattr(cluster.provider, "image", "routerfleet:e2e")
    for name in ("e-1", "e-2"):
        await api(core.create_namespaced_pod, ns, engine_pod(name, {}, image))
    pods = {p.metadata.name: p for p in await api(cluster.wait_pods_ready, ns, "app=engine", 2)}

    def pool(labels: dict, ports: list[int]) -> dict:
        return {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": "pool", "namespace": ns},
            "spec": {
                "selector": {"matchLabels": labels},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {"name": "picker", "port": {"number": 9002}},
            },
        }

    def apply(obj: dict) -> None:
        f = tmp_path / "pool.yaml"
        f.write_text(yaml.safe_dump(obj))
        p = kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(f))
        assert p.returncode == 0, p.stderr

    registry = CollectorRegistry()
    w = InferencePoolWatcher(ns, "pool", lambda _w: None, kubeconfig=str(kubeconfig), registry=registry)
    await w.start()
    try:

        def engines():
            return sorted((s.engine, s.url, s.incarnation) for s in w.workers or [])

        await wait(
            "no pool: synced, no engines, and why",
            lambda: w.workers == [] and "not found" in (w.last_error or ""),
        )
        assert metric(registry, "routerfleet_discovery_pool_errors_total", reason="not_found") == 1
        apply(pool({"app": "engine"}, [8000]))
        want = [
            (f"{ns}/{n}", f"http://{pods[n].status.pod_ip}:8000", pods[n].metadata.uid) for n in sorted(pods)
        ]
        await wait("the pool's two engines", lambda: engines() == want)
        assert w.last_error is None
        apply(pool({"app": "nothing"}, [8000]))
        await wait("a selector that matches nothing: no engines", lambda: w.workers == [])
        apply(pool({"app": "engine"}, [8000, 8001]))
        await wait("two ports: an engine each", lambda: len(engines()) == 4)
        assert {e for e, _u, _i in engines()} == {f"{ns}/{n}:{p}" for n in pods for p in (8000, 8001)}
        await api(core.delete_namespaced_pod, "e-1", ns, grace_period_seconds=0)
        await wait(
            "the deleted pod's engines leave",
            lambda: {e.split(":")[0] for e, _u, _i in engines()} == {f"{ns}/e-2"},
        )
        assert metric(registry, "routerfleet_discovery_synced") == 1
        assert metric(registry, "routerfleet_discovery_errors_total", reason="forbidden") == 0
    finally:
        await w.stop()
