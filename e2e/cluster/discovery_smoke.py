"""Kubernetes discovery against a real cluster with RBAC enforced: `run_discovery_checks` is used by
tests/e2e/test_discovery.py (on the shared e2e cluster) and by this script, standalone:

    python -m e2e.cluster run --node-agent node-1 -- python -m e2e.cluster.discovery_smoke

A ServiceAccount whose Role allows only get/list/watch on endpointslices gets a token (TokenRequest API);
the EndpointSliceWatcher runs in this process on a kubeconfig holding just that token, feeding a KVPlane:

1. synced and empty before any engine exists (one publish of []);
2. a Deployment of 2 fake engines (dp 2) + Service: both published with the right URL, KV/replay
   endpoints and pod UID; the plane's 4 rank subscriptions connect (so base + rank is right), and
   each engine's /server_info agrees;
3. a deleted pod leaves the set and its replacement joins as a new incarnation;
4. the watcher in a pod, on in-cluster config (the pod's projected ServiceAccount token), sees both;
5. a second ServiceAccount without the binding: never synced, errors{reason="forbidden"} > 0;
6. the RoleBinding removed: the watcher goes unsynced with forbidden errors, keeping its last set;
   restored: synced again.
Exit code 0 when all pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from prometheus_client import CollectorRegistry

from router_runtime.discovery.endpointslices import EngineDiscoveryConfig
from router_runtime.discovery.kubernetes import EndpointSliceWatcher
from router_runtime.discovery.server_info import server_info_spec
from router_runtime.kv.config import KvConfig
from router_runtime.kv.plane import KVPlane
from router_runtime.worker import WorkerSpec

NODE = "node-1"
SELECTOR = "kubernetes.io/service-name=engine"
CFG = EngineDiscoveryConfig(http_port="http", kv_port="kv", replay_port=5657, dp_size=2, topic="")
ENGINE_ARGS = "--host $(POD_IP) --port 8000 --kv-port 5557 --replay-port 5657 --dp-size 2".split()  # noqa: SIM905
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


async def wait(what: str, fn, timeout: float = 90.0, interval: float = 0.1):
    """Poll ``fn`` (sync, or returning an awaitable) until truthy; API errors count as not yet."""
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            v = fn()
            if inspect.isawaitable(v):
                v = await v
            if v:
                say(f"ok   {what} ({time.monotonic() - t0:.1f}s)")
                return v
        except (ApiException, OSError) as e:
            last = repr(e)[:200]
        await asyncio.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s: {what} (last: {last})")


def api(fn, *a, **kw):
    """Run a blocking kubernetes-client call off the event loop (the watcher lives on it)."""
    return asyncio.to_thread(fn, *a, **kw)


def pod_ready(p) -> bool:
    conds = {c.type: c.status for c in p.status.conditions or []}
    return (
        p.status.phase == "Running" and conds.get("Ready") == "True" and p.metadata.deletion_timestamp is None
    )


def token_kubeconfig(admin_kubeconfig: Path, path: Path, token: str, namespace: str) -> Path:
    """A kubeconfig for the admin kubeconfig's current cluster that authenticates with ``token`` only."""
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    ctx = next(c["context"] for c in admin["contexts"] if c["name"] == admin["current-context"])
    cluster = next(c["cluster"] for c in admin["clusters"] if c["name"] == ctx["cluster"])
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": cluster}],
        "users": [{"name": "sa", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "e2e", "user": "sa", "namespace": namespace}}],
        "current-context": "sa",
    }
    path.write_text(json.dumps(cfg))
    path.chmod(0o600)
    return path


# The watcher inside a pod: in-cluster config (KUBECONFIG blanked so it cannot win), namespace from the
# service account. Exits 0 once it has published 2 workers.
IN_CLUSTER = """
import asyncio, base64, json
from router_runtime.discovery.endpointslices import EngineDiscoveryConfig
from router_runtime.discovery.kubernetes import EndpointSliceWatcher
from routerfleet_kube import default_namespace, load_configuration
cfg = load_configuration()
token = cfg.get_api_key_with_prefix("BearerToken").split()[-1]
sub = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "==="))["sub"]
print("api server", cfg.host, "as", sub, "namespace", default_namespace(), flush=True)

async def main():
    done = asyncio.Event()
    def on_change(specs):
        print("published", len(specs), *(w.url for w in specs), flush=True)
        if len(specs) == 2:
            done.set()
    w = EndpointSliceWatcher(default_namespace(), "kubernetes.io/service-name=engine", on_change,
                             config=EngineDiscoveryConfig(kv_port="kv"))
    await w.start()
    try:
        await asyncio.wait_for(done.wait(), 60)
    finally:
        await w.stop()

asyncio.run(main())
"""


def expected(pod) -> WorkerSpec:
    ip = pod.status.pod_ip
    return WorkerSpec(
        engine=f"{pod.metadata.namespace}/{pod.metadata.name}",
        url=f"http://{ip}:8000",
        kv=f"tcp://{ip}:5557",
        replay=f"tcp://{ip}:5657",
        dp_size=2,
        topic=b"",
        incarnation=pod.metadata.uid,
    )


def metric(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def run_discovery_checks(
    kubeconfig: Path,
    ns: str,
    tmp: Path,
    *,
    image: str = "routerfleet:e2e",
    reach_pods: bool = True,
    container_log: Callable[[str, str, str], str] | None = None,
) -> None:
    """All checks, in the existing namespace ``ns``, as the admin of ``kubeconfig``. ``reach_pods``:
    this process can connect to pod IPs (the local cluster; not kind), for the KV plane and /server_info.
    ``container_log(ns, pod, container)``: a container's output (default: the API server's pods/log)."""
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(kubeconfig), client_configuration=cfg)
    admin = client.ApiClient(cfg)
    core, apps, rbac = client.CoreV1Api(admin), client.AppsV1Api(admin), client.RbacAuthorizationV1Api(admin)
    if container_log is None:

        def container_log(ns: str, pod: str, container: str) -> str:
            return core.read_namespaced_pod_log(pod, ns, container=container)

    for sa in ("router", "nobody"):
        await api(core.create_namespaced_service_account, ns, {"metadata": {"name": sa}})
    await api(
        rbac.create_namespaced_role,
        ns,
        {
            "metadata": {"name": "endpointslice-reader"},
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
    )
    binding = {
        "metadata": {"name": "router-reads-endpointslices"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "endpointslice-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "router", "namespace": ns}],
    }
    await api(rbac.create_namespaced_role_binding, ns, binding)

    kubeconfigs = {}
    for sa in ("router", "nobody"):
        tr = await api(
            core.create_namespaced_service_account_token, sa, ns, {"spec": {"expirationSeconds": 3600}}
        )
        kubeconfigs[sa] = token_kubeconfig(kubeconfig, tmp / f"{sa}.kubeconfig", tr.status.token, ns)
    say(f"info ServiceAccount tokens issued via TokenRequest in namespace {ns}")

    # RBAC is really enforced for this token: it may not read pods
    sa_core = client.CoreV1Api(config.new_client_from_config(str(kubeconfigs["router"])))
    try:
        await api(sa_core.list_namespaced_pod, ns)
        raise AssertionError("the router ServiceAccount could list pods: RBAC not enforced")
    except ApiException as e:
        assert e.status == 403, e
    say("ok   the router token cannot list pods (403)")
    # ... but can list endpointslices (kept retrying: the RBAC authorizer's cache may lag the binding)
    sa_disc = client.DiscoveryV1Api(config.new_client_from_config(str(kubeconfigs["router"])))
    await wait(
        "the router token can list endpointslices", lambda: api(sa_disc.list_namespaced_endpoint_slice, ns)
    )

    async with contextlib.AsyncExitStack() as stack:  # stops whatever started, pass or fail
        registry = CollectorRegistry()
        plane = KVPlane(KvConfig(block_size=16, disconnect_grace_s=0.0), registry)
        await plane.start()
        stack.push_async_callback(plane.stop)
        history: list[list[WorkerSpec]] = []

        def on_change(specs: list[WorkerSpec]) -> None:
            history.append(specs)
            plane.set_workers(specs)
            say(f"info published {[(w.engine.split('/')[1], w.url) for w in specs]}")

        watcher = EndpointSliceWatcher(
            ns,
            SELECTOR,
            on_change,
            config=CFG,
            kubeconfig=str(kubeconfigs["router"]),
            registry=registry,
            watch_timeout_s=2,  # short server-side watch timeout: a revoked binding shows within seconds
            backoff_initial_s=0.2,
            backoff_max_s=2.0,
        )
        assert not watcher.synced and watcher.workers is None
        await watcher.start()
        stack.push_async_callback(watcher.stop)

        # 1. synced and empty
        await wait("watcher synced with an empty set (no engines yet)", lambda: watcher.synced)
        assert history == [[]], history
        assert metric(registry, "routerfleet_discovery_synced") == 1

        # 2. two engines
        labels = {"app": "engine"}
        container = {
            "name": "engine",
            "image": image,
            "command": ["routerfleet-fake-engine"],
            "args": ENGINE_ARGS,
            "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "ports": [{"name": "http", "containerPort": 8000}, {"name": "kv", "containerPort": 5557}],
            "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1},
        }
        await api(
            apps.create_namespaced_deployment,
            ns,
            {
                "metadata": {"name": "engine"},
                "spec": {
                    "replicas": 2,
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {"containers": [container], "terminationGracePeriodSeconds": 5},
                    },
                },
            },
        )
        await api(
            core.create_namespaced_service,
            ns,
            {
                "metadata": {"name": "engine"},
                "spec": {
                    "selector": labels,
                    "ports": [
                        {"name": "http", "port": 8000, "targetPort": "http"},
                        {"name": "kv", "port": 5557, "targetPort": "kv"},
                    ],
                },
            },
        )

        async def ready_pods():
            pods = (await api(core.list_namespaced_pod, ns, label_selector="app=engine")).items
            return sorted((p for p in pods if pod_ready(p)), key=lambda p: p.metadata.name)

        async def published_matches_pods():
            pods = await ready_pods()
            want = [expected(p) for p in pods]
            return pods if len(pods) == 2 and watcher.workers == want else None

        pods = await wait(
            "both engines published with their URL, KV/replay endpoints and pod UID", published_matches_pods
        )
        for w in watcher.workers:
            say(f"info   {w.engine} url={w.url} kv={w.kv} replay={w.replay} incarnation={w.incarnation}")
        assert all(w.incarnation for w in watcher.workers)
        assert metric(registry, "routerfleet_discovery_workers") == 2
        if reach_pods:
            await wait(
                "KV plane: 4 rank subscriptions (2 engines x dp 2) connected at base + rank",
                lambda: len(subs := plane.subscriptions()) == 4 and all(s.connected for s in subs),
            )
            for w in watcher.workers:  # the engines' own /server_info describes the same KV endpoints
                assert await server_info_spec(w.url, engine=w.engine, incarnation=w.incarnation) == w
            say("ok   /server_info of each engine agrees with the EndpointSlice mapping")

        # 3. a pod replaced: dropped, and the replacement joins as a new incarnation
        victim, survivor = pods
        await api(core.delete_namespaced_pod, victim.metadata.name, ns)
        await wait(
            f"deleted pod {victim.metadata.name} dropped from the set",
            lambda: (
                watcher.workers is not None
                and expected(victim).engine not in [w.engine for w in watcher.workers]
            ),
        )

        async def replaced():
            pods = await published_matches_pods()
            if pods and victim.metadata.uid not in [p.metadata.uid for p in pods]:
                return pods
            return None

        new_pods = await wait("replacement published (new pod, new incarnation)", replaced)
        (new,) = [p for p in new_pods if p.metadata.uid != survivor.metadata.uid]
        assert expected(survivor) in watcher.workers, watcher.workers
        assert new.metadata.uid != victim.metadata.uid and new.metadata.name != victim.metadata.name
        old_id, new_id = (f"{p.metadata.name} ({p.metadata.uid[:8]})" for p in (victim, new))
        say(f"info   {old_id} -> {new_id}")
        if reach_pods:
            await wait(
                "KV plane follows: the victim's ranks dropped, the replacement's connected",
                lambda: (
                    sorted(s.carrier.engine for s in plane.subscriptions() if s.connected)
                    == sorted([expected(survivor).engine] * 2 + [expected(new).engine] * 2)
                ),
            )

        # 4. the watcher in a pod, on in-cluster config
        await api(
            core.create_namespaced_pod,
            ns,
            {
                "metadata": {"name": "router-in-cluster"},
                "spec": {
                    "serviceAccountName": "router",
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "router",
                            "image": image,
                            "command": ["python", "-c", IN_CLUSTER],
                            "env": [{"name": "KUBECONFIG", "value": ""}],
                        }
                    ],
                },
            },
        )
        phase = await wait(
            "in-cluster watcher pod finished",
            lambda: api(
                lambda: (
                    (p := core.read_namespaced_pod("router-in-cluster", ns).status.phase)
                    in ("Succeeded", "Failed")
                    and p
                )
            ),
            timeout=90,
        )
        log = await api(container_log, ns, "router-in-cluster", "router")
        assert phase == "Succeeded", log
        assert f"as system:serviceaccount:{ns}:router namespace {ns}" in log, log
        assert all(w.url in log for w in watcher.workers), log
        say(f"ok   in-cluster watcher: {' / '.join(log.strip().splitlines()[-2:])}")

        # 5. a ServiceAccount without the binding: forbidden, visibly, and never synced
        reg2 = CollectorRegistry()
        calls2: list = []
        unbound = EndpointSliceWatcher(
            ns,
            SELECTOR,
            calls2.append,
            config=CFG,
            kubeconfig=str(kubeconfigs["nobody"]),
            registry=reg2,
            backoff_initial_s=0.2,
            backoff_max_s=1.0,
        )
        await unbound.start()
        stack.push_async_callback(unbound.stop)
        await wait(
            'unbound ServiceAccount: errors{reason="forbidden"} counted',
            lambda: metric(reg2, "routerfleet_discovery_errors_total", reason="forbidden") >= 2,
        )
        assert not unbound.synced and unbound.workers is None and calls2 == []
        assert metric(reg2, "routerfleet_discovery_synced") == 0
        assert "forbidden" in (unbound.last_error or "") and "system:serviceaccount" in unbound.last_error
        say(f"info   last_error: {unbound.last_error[:160]}")
        await unbound.stop()

        # 6. the binding revoked: unsynced, forbidden counted, last set kept; restored: synced again
        before = list(watcher.workers)
        await api(rbac.delete_namespaced_role_binding, binding["metadata"]["name"], ns)
        await wait(
            'binding removed: watcher unsynced, errors{reason="forbidden"} > 0',
            lambda: (
                not watcher.synced
                and metric(registry, "routerfleet_discovery_errors_total", reason="forbidden") > 0
            ),
            timeout=30,
        )
        assert metric(registry, "routerfleet_discovery_synced") == 0
        assert watcher.last_error and watcher.last_error.startswith("forbidden"), watcher.last_error
        assert watcher.workers == before and plane.workers.keys() == {w.engine for w in before}
        say(f"info   last_error: {watcher.last_error[:160]}")
        await api(rbac.create_namespaced_role_binding, ns, binding)
        await wait(
            "binding restored: synced again",
            lambda: watcher.synced and watcher.last_error is None,
            timeout=30,
        )
        assert watcher.workers == before

        t = time.monotonic()
        await watcher.stop()
        say(f"ok   watcher stopped in {time.monotonic() - t:.2f}s")
        assert time.monotonic() - t < 2.0

        await api(apps.delete_namespaced_deployment, "engine", ns, propagation_policy="Foreground")
        await wait(
            "engines removed",
            lambda: api(lambda: not core.list_namespaced_pod(ns, label_selector="app=engine").items),
            timeout=60,
        )
        say("discovery checks: all passed")


async def main_async(tmp: Path) -> int:
    kubeconfig = Path(os.environ["KUBECONFIG"])
    config.load_kube_config(config_file=str(kubeconfig))
    core = client.CoreV1Api()
    await wait(
        f"node {NODE} Ready and untainted",
        lambda: api(
            lambda: (
                any(
                    c.type == "Ready" and c.status == "True"
                    for c in core.read_node(NODE).status.conditions or []
                )
                and not [
                    t
                    for t in core.read_node(NODE).spec.taints or []
                    if t.key.startswith("node.kubernetes.io/")
                ]
            )
        ),
    )
    ns = f"discovery-{uuid.uuid4().hex[:6]}"
    await api(core.create_namespace, {"metadata": {"name": ns}})
    await wait(  # pods need it to be admitted
        f"default ServiceAccount in {ns}", lambda: api(core.read_namespaced_service_account, "default", ns)
    )
    work = kubeconfig.resolve().parent  # the local cluster's work dir: pods/<ns>_<pod>_<uid>/<c>.log

    def container_log(ns: str, pod: str, container: str) -> str:
        return "".join(p.read_text() for p in sorted((work / "pods").glob(f"{ns}_{pod}_*/{container}.log")))

    await run_discovery_checks(kubeconfig, ns, tmp, container_log=container_log)
    await api(core.delete_namespace, ns)
    say("discovery smoke: all checks passed")
    return 0


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="discovery-smoke-") as tmp:
        return asyncio.run(main_async(Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
