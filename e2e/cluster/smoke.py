"""Smoke check of the control plane (needs the `kubernetes` client and $KUBECONFIG):

    python -m e2e.cluster run -- python -m e2e.cluster.smoke

Checks that the controllers really act: serviceaccount + root-ca publisher in a new namespace;
Deployment -> ReplicaSet -> Pods; the scheduler marks them Unschedulable with no node; a Node that
reports Ready loses its not-ready taint (node-lifecycle) and gets the pods bound (scheduler);
EndpointSlices: empty for a selector matching nothing, 10.244.0.5 published for a pod whose status
says so, 127.0.0.1 never published (and rejected by validation); garbage collection; namespace
deletion. Exit code 0 when all pass.
"""

from __future__ import annotations

import sys
import time
import uuid

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

NODE = "smoke-node"


def wait(what: str, fn, timeout: float = 60.0, interval: float = 0.5):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            v = fn()
            if v:
                print(f"ok   {what} ({time.monotonic() - t0:.1f}s)", flush=True)
                return v
        except ApiException as e:
            last = f"{e.status} {e.reason}"
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s: {what} (last: {last})")


def main() -> int:
    config.load_kube_config()
    core, apps, disc = client.CoreV1Api(), client.AppsV1Api(), client.DiscoveryV1Api()
    ns = f"smoke-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})

    # serviceaccount-controller and root-ca-certificate-publisher-controller
    wait(
        "default ServiceAccount in a new namespace",
        lambda: core.read_namespaced_service_account("default", ns),
    )
    wait(
        "kube-root-ca.crt ConfigMap in a new namespace",
        lambda: core.read_namespaced_config_map("kube-root-ca.crt", ns),
    )
    wait(
        "built-in 'view' ClusterRole aggregated (clusterrole-aggregation)",
        lambda: client.RbacAuthorizationV1Api().read_cluster_role("view").rules,
    )

    # deployment-controller -> replicaset-controller -> pods; scheduler with no nodes
    labels = {"app": "web"}
    apps.create_namespaced_deployment(
        ns,
        {
            "metadata": {"name": "web"},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "none", "command": ["sleep", "inf"]}]},
                },
            },
        },
    )
    rs = wait(
        "ReplicaSet owned by the Deployment",
        lambda: [
            r
            for r in apps.list_namespaced_replica_set(ns).items
            if r.metadata.owner_references and r.metadata.owner_references[0].kind == "Deployment"
        ],
    )[0]

    def web_pods():
        return [
            p
            for p in core.list_namespaced_pod(ns, label_selector="app=web").items
            if p.metadata.owner_references and p.metadata.owner_references[0].uid == rs.metadata.uid
        ]

    wait(
        "2 Pending Pods owned by the ReplicaSet",
        lambda: len([p for p in web_pods() if p.status.phase == "Pending"]) == 2,
    )
    wait(
        "scheduler marks them Unschedulable (no nodes)",
        lambda: all(
            any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in (p.status.conditions or []))
            for p in web_pods()
        ),
    )

    # a Node reporting Ready: node-lifecycle removes the not-ready taint, scheduler binds the pods
    core.create_node(
        {
            "metadata": {
                "name": NODE,
                "labels": {
                    "kubernetes.io/hostname": NODE,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                },
            }
        }
    )
    node = core.read_node(NODE)
    print(f"info node created with taints {[t.key for t in node.spec.taints or []]}", flush=True)
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conds = [
        {
            "type": t,
            "status": "False",
            "reason": r,
            "message": r,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
        for t, r in (
            ("MemoryPressure", "KubeletHasSufficientMemory"),
            ("DiskPressure", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "KubeletHasSufficientPID"),
            ("NetworkUnavailable", "RouteCreated"),
        )
    ]
    conds.append(
        {
            "type": "Ready",
            "status": "True",
            "reason": "KubeletReady",
            "message": "ready",
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }
    )
    res = {"cpu": "32", "memory": "64Gi", "pods": "110"}
    core.patch_node_status(
        NODE,
        {
            "status": {
                "conditions": conds,
                "capacity": res,
                "allocatable": res,
                "addresses": [
                    {"type": "InternalIP", "address": "10.244.0.1"},
                    {"type": "Hostname", "address": NODE},
                ],
            }
        },
    )
    wait(
        "node-lifecycle removed the not-ready taint",
        lambda: (
            not [t for t in core.read_node(NODE).spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        ),
    )
    wait(
        "scheduler bound both Deployment pods to the node",
        lambda: [p.spec.node_name for p in web_pods()] == [NODE, NODE],
    )

    # EndpointSlices
    def svc(name, selector):
        core.create_namespaced_service(
            ns,
            {
                "metadata": {"name": name},
                "spec": {"selector": selector, "ports": [{"port": 80, "targetPort": 8080}]},
            },
        )

    def slices(name):
        sel = f"kubernetes.io/service-name={name}"
        return disc.list_namespaced_endpoint_slice(ns, label_selector=sel).items

    svc("nobody", {"app": "nobody"})
    s = wait("EndpointSlice (empty) for a Service selecting nothing", lambda: slices("nobody"))
    assert not s[0].endpoints, s[0].endpoints

    def pod(name, app, ip):
        core.create_namespaced_pod(
            ns,
            {
                "metadata": {"name": name, "labels": {"app": app}},
                "spec": {
                    "nodeName": NODE,
                    "containers": [{"name": "c", "image": "none", "ports": [{"containerPort": 8080}]}],
                },
            },
        )
        core.patch_namespaced_pod_status(
            name,
            ns,
            {
                "status": {
                    "phase": "Running",
                    "podIP": ip,
                    "podIPs": [{"ip": ip}],
                    "hostIP": "10.244.0.1",
                    "hostIPs": [{"ip": "10.244.0.1"}],
                    "startTime": now,
                    "conditions": [
                        {"type": t, "status": "True", "lastTransitionTime": now}
                        for t in ("Initialized", "ContainersReady", "Ready", "PodScheduled")
                    ],
                }
            },
        )
        got = core.read_namespaced_pod_status(name, ns).status.pod_ip
        assert got == ip, f"pod status podIP {got!r} != {ip!r}"
        print(f"ok   pod status accepted podIP {ip}", flush=True)

    pod("good", "good", "10.244.0.5")
    svc("good", {"app": "good"})
    wait(
        "EndpointSlice publishes 10.244.0.5 (ready)",
        lambda: [
            e
            for sl in slices("good")
            for e in sl.endpoints or []
            if e.addresses == ["10.244.0.5"] and e.conditions.ready and e.node_name == NODE
        ],
    )

    pod("loop", "loop", "127.0.0.1")
    svc("loop", {"app": "loop"})
    try:
        disc.create_namespaced_endpoint_slice(
            ns,
            {
                "metadata": {"name": "manual-loop"},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["127.0.0.1"]}],
                "ports": [{"port": 8080}],
            },
        )
        raise AssertionError("an EndpointSlice with 127.0.0.1 was accepted")
    except ApiException as e:
        assert e.status == 422, e
        print("ok   EndpointSlice validation rejects 127.0.0.1 (422)", flush=True)
    wait(
        "EndpointSlice controller reports the loopback failure (event on the Service)",
        lambda: [
            ev
            for ev in core.list_namespaced_event(ns, field_selector="involvedObject.name=loop").items
            if ev.reason == "FailedToUpdateEndpointSlices"
        ],
        timeout=30,
    )
    published = [a for sl in slices("loop") for e in sl.endpoints or [] for a in e.addresses]
    assert "127.0.0.1" not in published, published
    print(f"ok   127.0.0.1 never published (slices for 'loop' hold {published})", flush=True)

    # garbage-collector: deleting the Deployment removes its ReplicaSet
    apps.delete_namespaced_deployment("web", ns, propagation_policy="Background")
    wait("garbage collector deleted the ReplicaSet", lambda: not apps.list_namespaced_replica_set(ns).items)

    # namespace-controller: an empty namespace goes away
    ns2 = f"{ns}-gone"
    core.create_namespace({"metadata": {"name": ns2}})
    core.create_namespaced_config_map(ns2, {"metadata": {"name": "x"}, "data": {"k": "v"}})
    core.delete_namespace(ns2)

    def gone():
        try:
            core.read_namespace(ns2)
            return False
        except ApiException as e:
            return e.status == 404

    wait("namespace controller finished deleting a namespace", gone)
    print("smoke: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
