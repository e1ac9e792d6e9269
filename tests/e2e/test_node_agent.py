"""The process node agent (e2e/cluster/node_agent.py) runs pods as local processes on a real control plane.

The first tests check the agent's pure helpers (no cluster); the others use the `cluster` and
`namespace` fixtures of conftest.py and are marked e2e. One of them:

    .venv/bin/python -m pytest tests/e2e/test_node_agent.py::test_serviceaccount_token_and_rbac
"""

import asyncio
import base64
import contextlib
import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio
from kubernetes.client.exceptions import ApiException

from e2e.cluster.node_agent import (
    ContainerRuntime,
    _killpg,
    compute_pod_status,
    container_argv,
    container_env,
    container_mounts,
    descendants,
    expand,
    object_refs,
    probe_once,
    probe_verdicts,
    resolve_port,
    token_requests,
    volume_files,
    with_mounts,
)
from tests.support import free_port

NODE = "node-1"

NOW = "2026-01-01T00:00:00Z"


def _pod(**spec) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c"}], **spec},
        "status": {},
    }


def test_expand():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING) $$(A) $ $(", env) == "$(MISSING) $(A) $ $("


def test_container_env_fieldrefs_and_expansion():
    c = {
        "name": "c",
        "command": ["engine"],
        "args": ["--host", "$(POD_IP)", "--name", "$(ID)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "ID", "value": "$(NS)/$(NAME)@$(POD_IP)"},
        ],
    }
    env = container_env(_pod(), c, "10.244.0.7", "10.244.0.1")
    assert env["ID"] == "ns/p@10.244.0.7" and env["UID"] == "u-1" and env["APP"] == "x"
    assert container_argv(c, env) == ["engine", "--host", "10.244.0.7", "--name", "ns/p@10.244.0.7"]
    assert resolve_port({"ports": [{"name": "http", "containerPort": 8000}]}, "http") == 8000
    assert resolve_port({}, 9000) == 9000


def _conds(status: dict) -> dict:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_compute_pod_status_phases_and_readiness_gates():
    kw = {"pod_ip": "10.244.0.2", "host_ip": "10.244.0.1", "start_time": NOW, "now": NOW}
    pod = _pod(readinessGates=[{"conditionType": "example.com/gate"}])
    s = compute_pod_status(pod, [ContainerRuntime("c")], **kw)
    assert s["phase"] == "Pending" and s["podIPs"] == [{"ip": "10.244.0.2"}]
    assert s["containerStatuses"][0]["state"]["waiting"] == {"reason": "ContainerCreating"}
    assert _conds(s) == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "False",
        "Ready": "False",
    }

    running = ContainerRuntime("c", pid=42, started_at=NOW, running=True, ready=True)
    s = compute_pod_status(pod, [running], **kw)
    assert s["phase"] == "Running" and s["containerStatuses"][0]["state"]["running"] == {"startedAt": NOW}
    assert _conds(s)["ContainersReady"] == "True" and _conds(s)["Ready"] == "False"  # gate not True
    ready_cond = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready_cond["reason"] == "ReadinessGatesNotReady"

    pod["status"]["conditions"] = [{"type": "example.com/gate", "status": "True"}]
    assert _conds(compute_pod_status(pod, [running], **kw))["Ready"] == "True"

    done = ContainerRuntime("c", started_at=NOW, exit_code=1, finished_at=NOW)
    assert compute_pod_status(_pod(restartPolicy="Never"), [done], **kw)["phase"] == "Failed"
    assert compute_pod_status(_pod(), [done], **kw)["phase"] == "Running"  # Always: being restarted


def test_env_from_secrets_and_configmaps():
    c = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "mode"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
            {"name": "URL", "value": "https://$(KUBERNETES_SERVICE_HOST)/$(MODE)"},
        ],
    }
    pod = _pod(containers=[c])
    assert object_refs(pod) == {("secrets", "s"), ("configmaps", "cm"), ("secrets", "nope")}
    objs = {("secrets", "s"): {"password": b"hunter2"}, ("configmaps", "cm"): {"mode": b"fast"}}
    env = container_env(pod, c, "10.244.0.7", "10.244.0.1", objs, {"KUBERNETES_SERVICE_HOST": "127.0.0.1"})
    assert env["PASS"] == "hunter2" and env["MODE"] == "fast" and env["CM_mode"] == "fast"
    assert "OPT" not in env and env["URL"] == "https://127.0.0.1/fast"
    with pytest.raises(ValueError, match="secret 's'"):
        container_env(pod, c, "10.244.0.7", "10.244.0.1", {("configmaps", "cm"): {"mode": b"x"}})


def test_volume_files_and_mounts(tmp_path):
    pod = _pod(
        volumes=[
            {
                "name": "kube-api-access",
                "projected": {
                    "sources": [
                        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                        {
                            "configMap": {
                                "name": "kube-root-ca.crt",
                                "items": [{"key": "ca.crt", "path": "ca.crt"}],
                            }
                        },
                        {
                            "downwardAPI": {
                                "items": [
                                    {"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}
                                ]
                            }
                        },
                    ]
                },
            },
            {"name": "conf", "secret": {"secretName": "s", "defaultMode": 0o400}},
            {"name": "scratch", "emptyDir": {}},
        ]
    )
    assert token_requests(pod) == {("", 3607)}
    objs = {("configmaps", "kube-root-ca.crt"): {"ca.crt": b"PEM"}, ("secrets", "s"): {"a": b"1"}}
    vols = {v["name"]: v for v in pod["spec"]["volumes"]}
    files = volume_files(vols["kube-api-access"], pod, objs, {("", 3607): "tok"}, "10.244.0.7", "10.244.0.1")
    assert files == {"token": (b"tok", 0o644), "ca.crt": (b"PEM", 0o644), "namespace": (b"ns", 0o644)}
    assert volume_files(vols["conf"], pod, objs, {}, "", "") == {"a": (b"1", 0o400)}
    assert volume_files(vols["scratch"], pod, objs, {}, "", "") is None
    with pytest.raises(ValueError, match="secret 's'"):
        volume_files(vols["conf"], pod, {}, {}, "", "")

    c = {"volumeMounts": [{"name": "conf", "mountPath": "/etc/conf", "readOnly": True}]}
    mounts = container_mounts(c, tmp_path)
    assert mounts == [(str(tmp_path / "conf"), "/etc/conf", "ro")]
    assert with_mounts([], ["x"]) == ["x"]
    argv = with_mounts(mounts, ["cat", "/etc/conf/a"])
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"] and argv[-3:] == [
        "--",
        "cat",
        "/etc/conf/a",
    ]


async def test_probe_verdicts_thresholds():
    results = iter([False, False, True, True, False, False, False])

    async def check():
        return next(results)

    pr = {"periodSeconds": 0, "successThreshold": 2, "failureThreshold": 2}
    got = []
    async for v in probe_verdicts(pr, check):
        got.append(v)
        if len(got) == 3:
            break
    assert got == [False, True, False]
    await asyncio.sleep(0)


def _dead(pid: int) -> bool:
    """Gone, or a zombie its new parent has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


async def test_a_containers_kill_ends_what_it_started_in_a_session_of_its_own():
    """A container's shell starts a process with setsid (as the standalone gateway's does with Envoy):
    the SIGKILL that ends the container ends it too, as a runtime's cgroup kill would (it outlived the
    cluster before: the group kill never reached it)."""
    proc = await asyncio.create_subprocess_exec("sh", "-c", "setsid sleep 300 & wait", start_new_session=True)
    try:
        for _ in range(100):  # until the shell's child has left its group (setsid, then sleep)
            below = descendants(proc.pid)
            with contextlib.suppress(ProcessLookupError):
                if len(below) == 1 and os.getpgid(below[0]) != proc.pid:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no child of the shell in a session of its own: {below}")
        _killpg(proc, signal.SIGKILL)
        await proc.wait()
        for _ in range(100):
            if _dead(below[0]):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"the setsid child {below[0]} outlived its container")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


async def test_a_grpc_probe_asks_the_health_service_as_kubelet_does():
    """Over real gRPC (plaintext, as kubelet probes): SERVING passes; NOT_SERVING, a service the server
    does not know, and nothing listening fail."""
    server = grpc.aio.server()
    health = aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        await health.set("inference-extension", health_pb2.HealthCheckResponse.SERVING)

        async def probe(service: str, at: int = port) -> bool:
            return await probe_once({"grpc": {"port": at, "service": service}}, {}, "127.0.0.1")

        assert await probe("inference-extension")
        assert not await probe("something-else")
        await health.set("inference-extension", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert not await probe("inference-extension")
        assert not await probe("inference-extension", at=free_port())
    finally:
        await server.stop(None)


# ------------------------------------------------------------------------------------------ on the cluster


IMAGE = os.environ.get("ROUTERFLEET_E2E_IMAGE", "routerfleet:e2e")  # the kind provider's image


def _container(name: str, *command: str, **extra) -> dict:
    return {"name": name, "image": IMAGE, "command": list(command), **extra}


def _local_only(cluster, why: str) -> None:
    if cluster.provider.name != "local":
        pytest.skip(f"needs the local provider: {why}")


def _pod_body(name: str, *containers: dict, **spec) -> dict:
    return {"metadata": {"name": name}, "spec": {"containers": list(containers), **spec}}


def _gone(core, ns: str, name: str) -> bool:
    try:
        core.read_namespaced_pod(name, ns)
        return False
    except ApiException as e:
        return e.status == 404


def test_node_registered_with_lease(cluster):
    _local_only(cluster, "checks the process node agent's Node and Lease")
    node = cluster.core.read_node(NODE)
    assert node.metadata.labels["kubernetes.io/hostname"] == NODE, node.metadata.labels
    assert cluster.conditions(node)["Ready"] == "True"
    lease = cluster.coord.read_namespaced_lease(NODE, "kube-node-lease")
    assert lease.spec.holder_identity == NODE and lease.spec.renew_time, lease.spec
    assert lease.metadata.owner_references[0].uid == node.metadata.uid


def test_deployment_endpoints_and_replacement(cluster, namespace):
    """2 fake engines bound to their pod IPs with an httpGet readiness probe behind a Service: both Ready
    on 10.244.x IPs, the EndpointSlice lists both, a completion answers, a deleted pod is replaced."""
    _local_only(cluster, "connects to a pod IP")
    ns, core = namespace, cluster.core
    labels = {"app": "engine"}
    container = _container(
        "engine",
        "routerfleet-fake-engine",
        args=["--host", "$(POD_IP)", "--port", "8000", "--kv-port", "5557", "--replay-port", "5657"],
        env=[
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        ports=[{"name": "http", "containerPort": 8000}],
        readinessProbe={
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 1,
            "failureThreshold": 3,
        },
    )
    cluster.apps.create_namespaced_deployment(
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
    cluster.wait_deployment_available(ns, "engine")
    running = cluster.wait_pods_ready(ns, "app=engine", 2)
    for p in running:
        cs = p.status.container_statuses[0]
        assert cs.ready and cs.started and cs.state.running and cs.restart_count == 0, cs
        assert p.spec.node_name == NODE and p.status.host_ip == "10.244.0.1", p.status
        assert p.status.pod_ip.startswith("10.244."), p.status.pod_ip
        assert [i.ip for i in p.status.pod_ips] == [p.status.pod_ip], p.status.pod_ips
    ips = sorted(p.status.pod_ip for p in running)
    assert len(set(ips)) == 2, ips

    def slice_ready_ips(objs):
        return sorted(
            a for s in objs.values() for e in s.endpoints or [] if e.conditions.ready for a in e.addresses
        )

    slices = (
        cluster.disc.list_namespaced_endpoint_slice,
        {"namespace": ns, "label_selector": "kubernetes.io/service-name=engine"},
    )
    cluster.wait_for(
        "EndpointSlice lists both pod IPs as ready", lambda o: slice_ready_ips(o) == ips, 60, slices
    )

    body = json.dumps({"model": "routerfleet/fake-model", "prompt": "hello node agent", "max_tokens": 4})
    req = urllib.request.Request(
        f"http://{ips[0]}:8000/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        out = json.loads(r.read())
    assert r.status == 200 and out.get("choices"), out

    victim = next(p for p in running if p.status.pod_ip == ips[0])
    core.delete_namespaced_pod(victim.metadata.name, ns)
    cluster.wait_pod_gone(ns, victim.metadata.name)
    replaced = cluster.wait_pods_ready(ns, "app=engine", 2)
    new_ips = sorted(p.status.pod_ip for p in replaced)
    assert ips[1] in new_ips and ips[0] not in new_ips, (ips, new_ips)
    cluster.wait_for(
        "EndpointSlice follows (old IP gone, new IP ready)",
        lambda o: slice_ready_ips(o) == new_ips,
        60,
        slices,
    )

    cluster.apps.delete_namespaced_deployment("engine", ns, propagation_policy="Foreground")
    cluster.wait_for(
        "Deployment deleted, all pods removed by the agent",
        lambda objs: not objs,
        60,
        (core.list_namespaced_pod, {"namespace": ns, "label_selector": "app=engine"}),
    )


def test_restart_policy_and_readiness_gates(cluster, namespace):
    """restartPolicy Always bumps restartCount; a tcpSocket probe plus an unmet readiness gate gives
    ContainersReady=True but Ready=False until someone sets the gate's condition True."""
    ns, core = namespace, cluster.core
    core.create_namespaced_pod(
        ns, _pod_body("crasher", _container("c", "python", "-c", "import sys; print('bye'); sys.exit(3)"))
    )

    def restarted(p):
        cs = (p.status.container_statuses or [None])[0]
        return (
            cs
            and cs.restart_count >= 1
            and cs.last_state.terminated
            and cs.last_state.terminated.exit_code == 3
        )

    p = cluster.wait_pod(ns, "crasher", restarted, "restarted (restartCount >= 1, lastState exit 3)")
    assert not cluster.pod_ready(p), p.status
    assert "bye" in cluster.container_log(ns, "crasher", "c")

    gate = "example.com/gate"
    web = _container(
        "web",
        "python",
        "-m",
        "http.server",
        args=["--bind", "$(ADDR)", "9000"],
        env=[
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "ADDR", "value": "$(IP)"},
        ],
        readinessProbe={"tcpSocket": {"port": 9000}, "periodSeconds": 1},
    )
    core.create_namespaced_pod(ns, _pod_body("gated", web, readinessGates=[{"conditionType": gate}]))
    cluster.wait_pod(
        ns,
        "gated",
        lambda p: (c := cluster.conditions(p)).get("ContainersReady") == "True" and c.get("Ready") == "False",
        "ContainersReady=True, Ready=False (gate unset)",
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    core.patch_namespaced_pod_status(
        "gated", ns, {"status": {"conditions": [{"type": gate, "status": "True", "lastTransitionTime": now}]}}
    )
    cluster.wait_pod(
        ns, "gated", lambda p: cluster.conditions(p).get("Ready") == "True", "Ready once the gate is True"
    )


def test_grace_period_then_sigkill(cluster, namespace):
    """SIGTERM ignored: SIGKILL after the (1 s) grace period, then the agent deletes the pod."""
    ns, core = namespace, cluster.core
    ignore_term = (
        "import os, signal, socket, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "s = socket.socket(); s.bind((os.environ['IP'], 9000)); s.listen(); time.sleep(600)"
    )
    stubborn = _container(
        "c",
        "python",
        "-c",
        ignore_term,
        env=[{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        readinessProbe={"tcpSocket": {"port": 9000}, "periodSeconds": 1},  # Ready once SIGTERM is ignored
    )
    core.create_namespaced_pod(ns, _pod_body("stubborn", stubborn, terminationGracePeriodSeconds=1))
    cluster.wait_pod(ns, "stubborn", cluster.pod_ready, "Ready")
    t0 = time.monotonic()
    core.delete_namespaced_pod("stubborn", ns)
    cluster.wait_pod_gone(ns, "stubborn", timeout=20)
    assert time.monotonic() - t0 >= 1.0


LIST_SLICES = """
import sys
from kubernetes import client, config
config.load_incluster_config()
ns = open('/var/run/secrets/kubernetes.io/serviceaccount/namespace').read()
try:
    n = len(client.DiscoveryV1Api().list_namespaced_endpoint_slice(ns).items)
except client.exceptions.ApiException as e:
    print('status', e.status, flush=True)
    sys.exit(3)
print('listed', n, 'slices', flush=True)
"""


def test_serviceaccount_token_and_rbac(cluster, namespace):
    """In-cluster config works unchanged: the projected token (a TokenRequest bound to the pod), ca.crt
    and namespace at /var/run/secrets/kubernetes.io/serviceaccount plus KUBERNETES_SERVICE_HOST/PORT.
    RBAC applies to the pod's ServiceAccount: 403 without a Role, allowed with one."""
    ns, core = namespace, cluster.core
    core.create_namespaced_service_account(ns, {"metadata": {"name": "lister"}})
    pod = _pod_body(
        "denied",
        _container("c", "python", "-c", LIST_SLICES),
        restartPolicy="Never",
        serviceAccountName="lister",
    )
    core.create_namespaced_pod(ns, pod)
    p = cluster.wait_pod(ns, "denied", lambda p: p.status.phase in ("Succeeded", "Failed"), "finished")
    assert p.status.phase == "Failed", cluster.container_log(ns, "denied", "c")
    assert "status 403" in cluster.container_log(ns, "denied", "c")

    cluster.rbac.create_namespaced_role(
        ns,
        {
            "metadata": {"name": "slices"},
            "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}
            ],
        },
    )
    cluster.rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "slices"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "slices"},
            "subjects": [{"kind": "ServiceAccount", "name": "lister", "namespace": ns}],
        },
    )
    pod["metadata"]["name"] = "allowed"
    core.create_namespaced_pod(ns, pod)
    p = cluster.wait_pod(ns, "allowed", lambda p: p.status.phase in ("Succeeded", "Failed"), "finished")
    log = cluster.container_log(ns, "allowed", "c")
    assert p.status.phase == "Succeeded" and "listed 0 slices" in log, log

    # the token is bound to the pod (TokenRequest boundObjectRef), as kubelet's
    claims_of = "import base64, json; t = open('/var/run/secrets/kubernetes.io/serviceaccount/token').read()"
    claims_of += "; print(base64.urlsafe_b64decode(t.split('.')[1] + '==').decode())"
    core.create_namespaced_pod(
        ns, _pod_body("claims", _container("c", "python", "-c", claims_of), restartPolicy="Never")
    )
    cluster.wait_pod(ns, "claims", lambda p: p.status.phase == "Succeeded", "Succeeded")
    claims = json.loads(cluster.container_log(ns, "claims", "c").splitlines()[-1])
    k8s = claims["kubernetes.io"]
    assert (
        k8s["namespace"] == ns
        and k8s["pod"]["name"] == "claims"
        and k8s["serviceaccount"]["name"] == "default"
    )


def test_secret_and_configmap_env_and_volumes(cluster, namespace):
    ns, core = namespace, cluster.core
    core.create_namespaced_secret(
        ns, {"metadata": {"name": "creds"}, "data": {"password": base64.b64encode(b"hunter2").decode()}}
    )
    core.create_namespaced_config_map(
        ns, {"metadata": {"name": "conf"}, "data": {"mode": "fast", "app.ini": "x=1\n"}}
    )
    script = (
        "import os; p = '/etc/app/password'; print('env', os.environ['PASS'], os.environ['MODE']); "
        "print('file', open(p).read(), oct(os.stat(p).st_mode & 0o777)); "
        "print('ini', open('/etc/conf/app.ini').read().strip()); "
        "open('/scratch/x', 'w').write('ok'); print('scratch', open('/scratch/x').read())"
    )
    c = _container(
        "c",
        "python",
        "-c",
        script,
        env=[
            {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
            {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "conf", "key": "mode"}}},
        ],
        volumeMounts=[
            {"name": "creds", "mountPath": "/etc/app", "readOnly": True},
            {"name": "conf", "mountPath": "/etc/conf"},
            {"name": "scratch", "mountPath": "/scratch"},
        ],
    )
    volumes = [
        {"name": "creds", "secret": {"secretName": "creds", "defaultMode": 0o400}},
        {"name": "conf", "configMap": {"name": "conf"}},
        {"name": "scratch", "emptyDir": {}},
    ]
    core.create_namespaced_pod(ns, _pod_body("reader", c, volumes=volumes, restartPolicy="Never"))
    p = cluster.wait_pod(ns, "reader", lambda p: p.status.phase in ("Succeeded", "Failed"), "finished")
    log = cluster.container_log(ns, "reader", "c")
    assert p.status.phase == "Succeeded", log
    assert (
        "env hunter2 fast" in log and "file hunter2 0o400" in log and "ini x=1" in log and "scratch ok" in log
    ), log

    # a missing Secret: CreateContainerConfigError until it exists, then the container runs
    c2 = _container(
        "c",
        "python",
        "-c",
        "import os; print('late', os.environ['LATE'])",
        env=[{"name": "LATE", "valueFrom": {"secretKeyRef": {"name": "late", "key": "k"}}}],
    )
    core.create_namespaced_pod(ns, _pod_body("waiter", c2, restartPolicy="Never"))

    def config_error(p):
        cs = (p.status.container_statuses or [None])[0]
        return cs and cs.state.waiting and cs.state.waiting.reason == "CreateContainerConfigError"

    cluster.wait_pod(ns, "waiter", config_error, "waiting: CreateContainerConfigError")
    core.create_namespaced_secret(ns, {"metadata": {"name": "late"}, "stringData": {"k": "here"}})
    cluster.wait_pod(
        ns, "waiter", lambda p: p.status.phase == "Succeeded", "Succeeded once the Secret exists"
    )
    assert "late here" in cluster.container_log(ns, "waiter", "c")


HTTP_AFTER = """
import http.server, os, sys, time
delay, port = float(sys.argv[1]), int(sys.argv[2])
time.sleep(delay)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = not os.path.exists('/tmp/sick-' + os.environ['POD'])
        self.send_response(200 if ok else 500); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ['IP'], port), H).serve_forever()
"""


def test_startup_liveness_and_exec_probes(cluster, namespace):
    """The startup probe gates readiness (started=False until it passes); a failing liveness probe
    restarts the container; an exec readiness probe decides `ready`."""
    _local_only(cluster, "the test flips the probes with files in the node's /tmp")
    ns, core = namespace, cluster.core
    env = [
        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
    ]
    probe = {"periodSeconds": 1, "failureThreshold": 2}
    c = _container(
        "web",
        "python",
        "-c",
        HTTP_AFTER,
        "3",
        "8080",
        env=env,
        startupProbe={"tcpSocket": {"port": 8080}, "periodSeconds": 1, "failureThreshold": 30},
        livenessProbe={"httpGet": {"path": "/", "port": 8080}, **probe},
        readinessProbe={"exec": {"command": ["sh", "-c", "test ! -e /tmp/unready-$POD"]}, **probe},
    )
    pod = core.create_namespaced_pod(ns, _pod_body("probed", c, terminationGracePeriodSeconds=2))
    uid = pod.metadata.uid

    def running_not_started(p):
        cs = (p.status.container_statuses or [None])[0]
        return cs and cs.state.running and not cs.started and not cs.ready

    cluster.wait_pod(ns, "probed", running_not_started, "running, not started yet (startup probe pending)")
    cluster.wait_pod(ns, "probed", cluster.pod_ready, "Ready after the startup probe passed")

    # exec readiness probe fails -> not Ready, container keeps running (no restart)
    marker = f"/tmp/unready-{uid}"
    open(marker, "w").close()
    try:
        p = cluster.wait_pod(
            ns, "probed", lambda p: cluster.conditions(p).get("Ready") == "False", "unready (exec)"
        )
        assert (
            p.status.container_statuses[0].restart_count == 0 and p.status.container_statuses[0].state.running
        )
    finally:
        os.unlink(marker)
    cluster.wait_pod(ns, "probed", cluster.pod_ready, "Ready again (exec probe passes)")

    # liveness fails -> container killed and restarted, lastState terminated; Ready again afterwards
    sick = f"/tmp/sick-{uid}"
    open(sick, "w").close()
    try:
        cluster.wait_pod(
            ns,
            "probed",
            lambda p: p.status.container_statuses[0].restart_count >= 1,
            "restarted by the liveness probe",
        )
    finally:
        os.unlink(sick)
    p = cluster.wait_pod(ns, "probed", cluster.pod_ready, "Ready after the restart")
    assert p.status.container_statuses[0].last_state.terminated is not None
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=probed").items
    assert any(e.reason == "Killing" and "liveness" in e.message for e in events), [e.message for e in events]


# A server on 0.0.0.0:7000 answering with its pod's name.
SERVE_NAME = """
import http.server, os
class Name(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(os.environ["HOSTNAME"].encode())
http.server.HTTPServer(("0.0.0.0", 7000), Name).serve_forever()
"""

# What a pod sees of the network: its own loopback (nothing listens there), the others' pod IPs.
LOOK_AROUND = """
import socket, sys, urllib.request
try:
    socket.create_connection(("127.0.0.1", 7000), 2)
    print("loopback: answered")
except ConnectionRefusedError:
    print("loopback: refused")
for ip in sys.argv[1:]:
    print(ip, urllib.request.urlopen(f"http://{ip}:7000/", timeout=5).read().decode())
"""


def test_each_pod_has_its_own_network(cluster, namespace):
    """Two pods both listen on 0.0.0.0:7000 (one port, two network namespaces) and each answers at its
    own pod IP; an exec probe runs in its pod's netns (it reaches the pod's own loopback); a third pod
    finds its loopback empty and reaches the others at their pod IPs."""
    _local_only(cluster, "connects to pod IPs")
    ns, core = namespace, cluster.core
    dial_own_loopback = "import socket; socket.create_connection(('127.0.0.1', 7000), 1)"
    own_loopback = {"exec": {"command": ["python", "-c", dial_own_loopback]}, "periodSeconds": 1}
    for name in ("a", "b"):
        server = _container(name, "python", "-c", SERVE_NAME, readinessProbe=own_loopback)
        body = _pod_body(name, server)
        body["metadata"]["labels"] = {"app": "serve-name"}
        core.create_namespaced_pod(ns, body)
    pods = {p.metadata.name: p for p in cluster.wait_pods_ready(ns, "app=serve-name", 2)}
    ips = [pods["a"].status.pod_ip, pods["b"].status.pod_ip]
    assert len(set(ips)) == 2, ips
    for name, ip in zip("ab", ips, strict=True):
        with urllib.request.urlopen(f"http://{ip}:7000/", timeout=5) as r:
            assert r.read().decode() == name

    look = _container("c", "python", "-c", LOOK_AROUND, *ips)
    core.create_namespaced_pod(ns, _pod_body("c", look, restartPolicy="Never"))
    cluster.wait_pod(ns, "c", lambda p: p.status.phase in ("Succeeded", "Failed"), "finished")
    log = cluster.container_log(ns, "c", "c")
    assert "loopback: refused" in log, log
    assert f"{ips[0]} a" in log and f"{ips[1]} b" in log, log
