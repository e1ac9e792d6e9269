"""Kubernetes discovery (router_runtime/discovery/kubernetes.py) against a real cluster with RBAC, on the
shared `cluster` and a fresh `namespace` (tests/e2e/conftest.py). The scenario lives in
e2e/cluster/discovery_smoke.py (also runnable alone: `python -m e2e.cluster run --node-agent node-1 --
python -m e2e.cluster.discovery_smoke`): a ServiceAccount token that may only get/list/watch
endpointslices, 2 fake engines (dp 2) feeding a KVPlane, a pod replaced (new incarnation), the watcher
in a pod on in-cluster config, an unbound ServiceAccount and a revoked binding seen as forbidden.

    .venv/bin/python -m pytest tests/e2e/test_discovery.py
"""

from pathlib import Path

from e2e.cluster.discovery_smoke import run_discovery_checks


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
