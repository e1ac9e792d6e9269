"""Smoke check of the process node agent (needs $KUBECONFIG and the agent running as node-1):

    python -m e2e.cluster run --node-agent node-1 -- python -m e2e.cluster.node_smoke

A Deployment of 2 fake engines (each bound to its own pod IP via `--host $(POD_IP)`) with an httpGet
readiness probe and a Service: both pods Running+Ready on 10.244.x IPs, the EndpointSlice lists both
as ready, a completion to a pod IP answers, and a deleted pod is replaced (new IP ready, slice follows).
Exit code 0 when all pass.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
import uuid
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

NODE = "node-1"


def wait(what: str, fn, timeout: float = 90.0, interval: float = 0.3):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            v = fn()
            if v:
                print(f"ok   {what} ({time.monotonic() - t0:.1f}s)", flush=True)
                return v
        except (ApiException, OSError) as e:
            last = repr(e)[:200]
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s: {what} (last: {last})")


def ready(p) -> bool:
    conds = {c.type: c.status for c in p.status.conditions or []}
    return (
        p.status.phase == "Running"
        and conds.get("Ready") == "True"
        and bool(p.status.pod_ip)
        and p.metadata.deletion_timestamp is None
    )


def check_restart_and_gates(core, ns: str) -> None:
    """restartPolicy Always bumps restartCount; a tcpSocket probe plus an unmet readiness gate gives
    ContainersReady=True but Ready=False until someone sets the gate's condition True."""
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "crasher"},
            "spec": {
                "containers": [
                    {
                        "name": "c",
                        "image": "none",
                        "command": ["python", "-c", "import sys; print('bye'); sys.exit(3)"],
                    }
                ]
            },
        },
    )
    p = wait(
        "crashing container restarted (restartCount >= 1, lastState exit 3)",
        lambda: [
            p
            for p in [core.read_namespaced_pod("crasher", ns)]
            if p.status.container_statuses
            and p.status.container_statuses[0].restart_count >= 1
            and p.status.container_statuses[0].last_state.terminated
            and p.status.container_statuses[0].last_state.terminated.exit_code == 3
        ],
    )[0]
    assert not ready(p), p.status

    gate = "example.com/gate"
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "gated"},
            "spec": {
                "readinessGates": [{"conditionType": gate}],
                "containers": [
                    {
                        "name": "web",
                        "image": "none",
                        "command": ["python", "-m", "http.server"],
                        "args": ["--bind", "$(ADDR)", "9000"],
                        "env": [
                            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                            {"name": "ADDR", "value": "$(IP)"},
                        ],
                        "readinessProbe": {"tcpSocket": {"port": 9000}, "periodSeconds": 1},
                    }
                ],
            },
        },
    )

    def conds():
        return {c.type: c.status for c in core.read_namespaced_pod("gated", ns).status.conditions or []}

    wait(
        "gated pod: ContainersReady=True, Ready=False (gate unset)",
        lambda: (c := conds()).get("ContainersReady") == "True" and c.get("Ready") == "False",
    )
    core.patch_namespaced_pod_status(
        "gated",
        ns,
        {
            "status": {
                "conditions": [
                    {
                        "type": gate,
                        "status": "True",
                        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    }
                ]
            }
        },
    )
    wait("gated pod: Ready=True once the gate condition is True", lambda: conds().get("Ready") == "True")
    core.delete_namespaced_pod("crasher", ns)
    core.delete_namespaced_pod("gated", ns)

    work = Path(os.environ["KUBECONFIG"]).resolve().parent  # admin.kubeconfig lives in the work dir
    logs = list((work / "pods").glob(f"{ns}_crasher_*/c.log"))
    assert logs and "bye" in logs[0].read_text(), logs
    print(f"ok   container log written to {logs[0]}", flush=True)

    # SIGTERM ignored: SIGKILL after the (1 s) grace period, then the agent deletes the pod
    core.create_namespaced_pod(
        ns,
        {
            "metadata": {"name": "stubborn"},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {
                        "name": "c",
                        "image": "none",
                        "command": [
                            "python",
                            "-c",
                            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            "time.sleep(600)",
                        ],
                    }
                ],
            },
        },
    )
    wait("stubborn pod Ready", lambda: ready(core.read_namespaced_pod("stubborn", ns)))
    core.delete_namespaced_pod("stubborn", ns)
    wait("stubborn pod killed after its grace period and deleted", lambda: pod_gone(core, ns, "stubborn"), 20)


def pod_gone(core, ns: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, ns)
        return False
    except ApiException as e:
        return e.status == 404


def main() -> int:
    config.load_kube_config()
    core, apps, disc = client.CoreV1Api(), client.AppsV1Api(), client.DiscoveryV1Api()

    node = wait(
        f"node {NODE} registered and Ready",
        lambda: [
            n
            for n in core.list_node().items
            if n.metadata.name == NODE
            and any(c.type == "Ready" and c.status == "True" for c in n.status.conditions or [])
        ],
    )[0]
    assert node.metadata.labels["kubernetes.io/hostname"] == NODE, node.metadata.labels
    wait(
        f"Lease kube-node-lease/{NODE} renewed by the agent",
        lambda: client.CoordinationV1Api().read_namespaced_lease(NODE, "kube-node-lease").spec.renew_time,
    )
    wait(
        "node-lifecycle removed the not-ready taint",
        lambda: (
            not [t for t in core.read_node(NODE).spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        ),
    )

    ns = f"node-smoke-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": ns}})
    labels = {"app": "engine"}
    container = {
        "name": "engine",
        "image": "routerfleet/fake-engine:unused",
        "command": ["routerfleet-fake-engine"],
        "args": ["--host", "$(POD_IP)", "--port", "8000", "--kv-port", "5557", "--replay-port", "5657"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 3,
        },
    }
    apps.create_namespaced_deployment(
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
    core.create_namespaced_service(
        ns,
        {
            "metadata": {"name": "engine"},
            "spec": {"selector": labels, "ports": [{"name": "http", "port": 8000, "targetPort": "http"}]},
        },
    )

    def pods():
        return core.list_namespaced_pod(ns, label_selector="app=engine").items

    def ready_pods():
        return [p for p in pods() if ready(p)]

    running = wait(
        "2 pods Running+Ready with 10.244.x IPs",
        lambda: (
            r
            if len(r := ready_pods()) == 2 and all(p.status.pod_ip.startswith("10.244.") for p in r)
            else None
        ),
    )
    for p in running:
        cs = p.status.container_statuses[0]
        assert cs.ready and cs.started and cs.state.running and cs.restart_count == 0, cs
        assert p.spec.node_name == NODE and p.status.host_ip == "10.244.0.1", p.status
        assert [i.ip for i in p.status.pod_ips] == [p.status.pod_ip], p.status.pod_ips
    ips = sorted(p.status.pod_ip for p in running)
    assert len(set(ips)) == 2, ips
    print(f"info pod IPs {ips}", flush=True)

    def slice_ready_ips():
        sel = "kubernetes.io/service-name=engine"
        return sorted(
            a
            for s in disc.list_namespaced_endpoint_slice(ns, label_selector=sel).items
            for e in s.endpoints or []
            if e.conditions.ready
            for a in e.addresses
        )

    wait("EndpointSlice lists both pod IPs as ready", lambda: slice_ready_ips() == ips)

    body = json.dumps({"model": "routerfleet/fake-model", "prompt": "hello node agent", "max_tokens": 4})
    req = urllib.request.Request(
        f"http://{ips[0]}:8000/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        out = json.loads(r.read())
    assert r.status == 200 and out.get("choices"), out
    print(f"ok   completion from {ips[0]}: {out['choices'][0].get('text')!r}", flush=True)

    victim = next(p for p in running if p.status.pod_ip == ips[0])
    core.delete_namespaced_pod(victim.metadata.name, ns)

    wait(
        f"deleted pod {victim.metadata.name} terminated and removed by the agent",
        lambda: pod_gone(core, ns, victim.metadata.name),
    )
    replaced = wait(
        "ReplicaSet replacement Running+Ready with a new IP",
        lambda: r if len(r := ready_pods()) == 2 and ips[0] not in [p.status.pod_ip for p in r] else None,
    )
    new_ips = sorted(p.status.pod_ip for p in replaced)
    assert ips[1] in new_ips, (ips, new_ips)
    print(f"info pod IPs now {new_ips}", flush=True)
    wait("EndpointSlice follows (old IP gone, new IP ready)", lambda: slice_ready_ips() == new_ips)

    check_restart_and_gates(core, ns)

    apps.delete_namespaced_deployment("engine", ns, propagation_policy="Foreground")
    wait("Deployment deleted, all pods removed by the agent", lambda: not pods(), timeout=60)
    print("node smoke: all checks passed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
