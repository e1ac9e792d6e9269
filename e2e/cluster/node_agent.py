"""A process node agent: a minimal kubelet stand-in that runs pods as local processes.

    python -m e2e.cluster.node_agent --kubeconfig node-1.kubeconfig --node node-1 --workdir DIR

Authenticates as system:node:<node> (so the Node authorizer and NodeRestriction apply, as for a real
kubelet), registers the Node and renews its Lease, watches the pods bound to it and for each one:
allocates a pod IP 10.244.x.y (local in the test netns), runs every container's command+args as a
process (the image is ignored; the venv's bin dir leads PATH), probes readiness (httpGet, tcpSocket),
restarts exited containers (restartPolicy Always/OnFailure), writes the pod status like kubelet/kwok,
and on deletion sends SIGTERM, waits the grace period, SIGKILLs and deletes the pod with grace 0.

Container output goes to <workdir>/pods/<namespace>_<pod>_<uid>/<container>.log.

Not done: liveness/startup/exec probes, volumes, TokenRequest credentials, init containers,
preStop hooks, resources, configMap/secret env refs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

log = logging.getLogger("node-agent")

NODE_IP = "10.244.0.1"
POD_NET = ipaddress.ip_network("10.244.0.0/16")
RESERVED = {ipaddress.ip_address(NODE_IP), ipaddress.ip_address("10.244.255.254")}
LEASE_DURATION = 40
HEARTBEAT = 10.0
KUBELET_VERSION = "v1.36.3"


# ------------------------------------------------------------------------------------------ pure helpers


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined vars are replaced, undefined ones kept, `$$` -> `$`."""
    out, i = [], 0
    while i < len(s):
        if s[i] == "$" and i + 1 < len(s):
            if s[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if s[i + 1] == "(":
                end = s.find(")", i + 2)
                if end != -1:
                    name = s[i + 2 : end]
                    out.append(env[name] if name in env else s[i : end + 1])
                    i = end + 1
                    continue
        out.append(s[i])
        i += 1
    return "".join(out)


def field_ref(pod: dict, path: str, pod_ip: str, host_ip: str) -> str:
    md, spec = pod["metadata"], pod["spec"]
    simple = {
        "metadata.name": md.get("name", ""),
        "metadata.namespace": md.get("namespace", ""),
        "metadata.uid": md.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return simple[path]
    for prefix, key in (("metadata.labels['", "labels"), ("metadata.annotations['", "annotations")):
        if path.startswith(prefix) and path.endswith("']"):
            return (md.get(key) or {}).get(path[len(prefix) : -2], "")
    raise ValueError(f"unsupported fieldRef {path!r}")


def container_env(pod: dict, container: dict, pod_ip: str, host_ip: str) -> dict[str, str]:
    """The container's `env`, in order, with `$(VAR)` expansion against the earlier entries."""
    env: dict[str, str] = {}
    for e in container.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif (vf := e.get("valueFrom") or {}).get("fieldRef"):
            env[e["name"]] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif vf:
            raise ValueError(f"unsupported valueFrom in env {e['name']!r}: {sorted(vf)}")
        else:
            env[e["name"]] = ""
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    argv = [expand(a, env) for a in (container.get("command") or []) + (container.get("args") or [])]
    if not argv:
        raise ValueError(f"container {container['name']!r} has no command (images are not run)")
    return argv


def resolve_port(container: dict, port: int | str) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"no container port named {port!r}")


@dataclass
class ContainerRuntime:
    """What the agent knows about one container; input of compute_pod_status."""

    name: str
    image: str = ""
    pid: int | None = None
    started_at: str | None = None
    running: bool = False
    ready: bool = False
    restart_count: int = 0
    exit_code: int | None = None
    finished_at: str | None = None
    last_terminated: dict | None = None
    waiting_reason: str = "ContainerCreating"


def _cond(type_: str, ok: bool, old: dict[str, dict], now: str, reason: str = "", msg: str = "") -> dict:
    status = "True" if ok else "False"
    prev = old.get(type_)
    ltt = (
        prev["lastTransitionTime"]
        if prev and prev.get("status") == status and prev.get("lastTransitionTime")
        else now
    )
    c = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": ltt}
    if not ok:
        c["reason"], c["message"] = reason, msg
    else:
        c["reason"], c["message"] = None, None
    return c


def _container_status(c: ContainerRuntime) -> dict:
    if c.running:
        state = {"running": {"startedAt": c.started_at}, "waiting": None, "terminated": None}
    elif c.exit_code is not None:
        state = {
            "terminated": {
                "exitCode": c.exit_code,
                "reason": "Completed" if c.exit_code == 0 else "Error",
                "startedAt": c.started_at,
                "finishedAt": c.finished_at,
            },
            "running": None,
            "waiting": None,
        }
    else:
        state = {"waiting": {"reason": c.waiting_reason}, "running": None, "terminated": None}
    return {
        "name": c.name,
        "image": c.image,
        "imageID": "",
        "ready": c.ready,
        "started": c.running,
        "restartCount": c.restart_count,
        "state": state,
        "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
        "containerID": f"process://{c.pid}" if c.pid else None,
    }


def compute_pod_status(
    pod: dict, containers: list[ContainerRuntime], *, pod_ip: str, host_ip: str, start_time: str, now: str
) -> dict:
    """The pod status to write, from the pod (spec, current conditions) and the container runtimes.

    Ready = every container ready AND every spec.readinessGates condition True (set by others)."""
    old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    unready = [c.name for c in containers if not c.ready]
    containers_ready = not unready
    gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
    gates_false = [g for g in gates if (old.get(g) or {}).get("status") != "True"]
    if unready:
        reason, msg = "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]"
    else:
        reason, msg = (
            "ReadinessGatesNotReady",
            f"corresponding condition of pod readiness gate {gates_false!r} does not exist or is not True",
        )
    policy = pod["spec"].get("restartPolicy", "Always")
    if any(c.running for c in containers):
        phase = "Running"
    elif (
        containers
        and all(c.exit_code is not None for c in containers)
        and policy != "Always"
        and (policy == "Never" or all(c.exit_code == 0 for c in containers))
    ):
        phase = "Succeeded" if all(c.exit_code == 0 for c in containers) else "Failed"
    elif any(c.started_at for c in containers):
        phase = "Running"  # restarting
    else:
        phase = "Pending"
    return {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        "conditions": [
            _cond("PodScheduled", True, old, now),
            _cond("Initialized", True, old, now),
            _cond(
                "ContainersReady",
                containers_ready,
                old,
                now,
                "ContainersNotReady",
                f"containers with unready status: [{' '.join(unready)}]",
            ),
            _cond("Ready", containers_ready and not gates_false, old, now, reason, msg),
        ],
        "containerStatuses": [_container_status(c) for c in containers],
    }


def node_object(node: str) -> dict:
    return {
        "metadata": {
            "name": node,
            "labels": {
                "kubernetes.io/hostname": node,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux",
                "beta.kubernetes.io/arch": "amd64",
            },
        }
    }


def node_status(node: str, now: str) -> dict:
    res = {"cpu": "32", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi"}
    conds = [
        ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
        ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
        ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
        ("NetworkUnavailable", "False", "RouteCreated", "pod network is local to the netns"),
        ("Ready", "True", "KubeletReady", "process node agent is ready"),
    ]
    return {
        "status": {
            "capacity": res,
            "allocatable": res,
            "phase": "Running",
            "conditions": [
                {
                    "type": t,
                    "status": s,
                    "reason": r,
                    "message": m,
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
                for t, s, r, m in conds
            ],
            "addresses": [{"type": "InternalIP", "address": NODE_IP}, {"type": "Hostname", "address": node}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
            "nodeInfo": {
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
                "kernelVersion": os.uname().release,
                "osImage": "routerfleet process node",
                "containerRuntimeVersion": "process://1",
                "kubeletVersion": KUBELET_VERSION,
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
            },
        }
    }


# ------------------------------------------------------------------------------------------ API access


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str):
        super().__init__(f"{status}: {body[:300]}")
        self.status = status


class Api:
    """Tiny async REST client over aiohttp using a kubeconfig's server and client certificate."""

    def __init__(self, kubeconfig: str):
        cfg = k8s_client.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        self.base = cfg.host
        self.ssl = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        self.ssl.load_cert_chain(cfg.cert_file, cfg.key_file)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Api:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.ssl))
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.session is not None
        await self.session.close()

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: dict | None = None,
        ctype: str = "application/json",
    ) -> dict:
        assert self.session is not None
        data = None if body is None else json.dumps(body)
        async with self.session.request(
            method, self.base + path, data=data, params=params, headers={"Content-Type": ctype}
        ) as r:
            text = await r.text()
            if r.status >= 400:
                raise ApiError(r.status, text)
            return json.loads(text) if text else {}

    async def watch(self, path: str, params: dict):
        assert self.session is not None
        params = {**params, "watch": "1", "allowWatchBookmarks": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with self.session.get(self.base + path, params=params, timeout=timeout) as r:
            if r.status >= 400:
                raise ApiError(r.status, await r.text())
            async for line in r.content:
                if line.strip():
                    yield json.loads(line)


# ------------------------------------------------------------------------------------------ pods


def _pdeathsig() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _killpg(proc: asyncio.subprocess.Process, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


class PodWorker:
    """Runs one pod: processes, probes, status, termination."""

    def __init__(self, agent: NodeAgent, pod: dict, pod_ip: str):
        self.agent, self.pod, self.pod_ip = agent, pod, pod_ip
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.start_time = now_rfc3339()
        self.containers = [ContainerRuntime(c["name"], c.get("image", "")) for c in pod["spec"]["containers"]]
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.terminating = asyncio.Event()
        self.dirty = asyncio.Event()
        self.log_dir = agent.workdir / "pods" / f"{self.ns}_{self.name}_{self.uid}"
        self.tasks: list[asyncio.Task] = []

    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminating.set()
        self.dirty.set()  # a readiness gate may have flipped

    async def run(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.dirty.set()
        writer = asyncio.create_task(self._status_writer())
        self.tasks = [
            asyncio.create_task(self._container(spec, rt))
            for spec, rt in zip(self.pod["spec"]["containers"], self.containers, strict=True)
        ]
        try:
            await self.terminating.wait()
            await self._terminate()
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            await self._write_status()
            writer.cancel()
        try:
            await self.agent.api.call(
                "DELETE",
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                {
                    "kind": "DeleteOptions",
                    "apiVersion": "v1",
                    "gracePeriodSeconds": 0,
                    "preconditions": {"uid": self.uid},
                },
            )
            log.info("pod %s/%s deleted", self.ns, self.name)
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    async def kill_now(self) -> None:
        for p in self.procs.values():
            _killpg(p, signal.SIGKILL)

    async def _terminate(self) -> None:
        md = self.pod["metadata"]
        grace = md.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        live = [p for p in self.procs.values() if p.returncode is None]
        log.info("pod %s/%s: terminating %d processes (grace %ss)", self.ns, self.name, len(live), grace)
        for p in live:
            _killpg(p, signal.SIGTERM)
        if live:
            _, pending = await asyncio.wait([asyncio.create_task(p.wait()) for p in live], timeout=grace)
            for p in live:
                if p.returncode is None:
                    _killpg(p, signal.SIGKILL)
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(0)  # let container tasks record the exits

    async def _container(self, spec: dict, rt: ContainerRuntime) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        backoff = 1.0
        while not self.terminating.is_set():
            try:
                env = container_env(self.pod, spec, self.pod_ip, self.agent.host_ip)
                argv = container_argv(spec, env)
            except ValueError as e:  # bad/unsupported spec: report it and wait for deletion
                log.warning("pod %s/%s container %s: %s", self.ns, self.name, spec["name"], e)
                rt.waiting_reason = "CreateContainerConfigError"
                self.dirty.set()
                await self.terminating.wait()
                return
            penv = {
                "PATH": self.agent.path,
                "HOME": os.environ.get("HOME", "/root"),
                "HOSTNAME": self.name,
                **env,
            }
            logf = open(self.log_dir / f"{spec['name']}.log", "ab")  # noqa: SIM115
            logf.write(f"# {now_micro()} start {argv}\n".encode())
            logf.flush()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    env=penv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=logf,
                    stderr=logf,
                    cwd=self.log_dir,
                    start_new_session=True,
                    preexec_fn=_pdeathsig,
                )
            except OSError as e:
                logf.write(f"# start failed: {e}\n".encode())
                logf.close()
                rt.waiting_reason = "RunContainerError"
                self.dirty.set()
                await self._backoff(backoff)
                backoff = min(backoff * 2, 10)
                continue
            finally:
                if not logf.closed:
                    logf.close()
            self.procs[spec["name"]] = proc
            rt.pid, rt.started_at, rt.running, rt.exit_code = proc.pid, now_rfc3339(), True, None
            rt.ready = "readinessProbe" not in spec
            self.dirty.set()
            prober = asyncio.create_task(self._probe(spec, rt)) if "readinessProbe" in spec else None
            try:
                code = await proc.wait()
                code = 128 - code if code < 0 else code  # killed by signal N: 128+N
            finally:
                if prober:
                    prober.cancel()
            rt.running, rt.ready, rt.exit_code, rt.finished_at = False, False, code, now_rfc3339()
            log.info("pod %s/%s container %s exited %s", self.ns, self.name, spec["name"], code)
            self.dirty.set()
            if self.terminating.is_set() or policy == "Never" or (policy == "OnFailure" and code == 0):
                return
            await self._backoff(backoff)
            backoff = min(backoff * 2, 10)
            if self.terminating.is_set():
                return
            rt.last_terminated = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": rt.started_at,
                "finishedAt": rt.finished_at,
            }
            rt.restart_count += 1
            rt.exit_code, rt.waiting_reason = None, "CrashLoopBackOff"

    async def _backoff(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.terminating.wait(), delay)

    async def _probe(self, spec: dict, rt: ContainerRuntime) -> None:
        pr = spec["readinessProbe"]
        period = pr.get("periodSeconds", 10)
        timeout = pr.get("timeoutSeconds", 1)
        fail_th, ok_th = pr.get("failureThreshold", 3), pr.get("successThreshold", 1)
        await asyncio.sleep(pr.get("initialDelaySeconds", 0))
        oks = fails = 0
        while True:
            ok = await probe_once(pr, spec, self.pod_ip, timeout)
            oks, fails = (oks + 1, 0) if ok else (0, fails + 1)
            if ok and oks >= ok_th and not rt.ready:
                rt.ready = True
                self.dirty.set()
            elif not ok and fails >= fail_th and rt.ready:
                rt.ready = False
                self.dirty.set()
            await asyncio.sleep(period)

    async def _status_writer(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            try:
                await self._write_status()
            except (ApiError, aiohttp.ClientError) as e:
                if getattr(e, "status", None) == 404:
                    return
                log.warning("pod %s/%s status write failed: %s", self.ns, self.name, e)
                await asyncio.sleep(1)
                self.dirty.set()

    async def _write_status(self) -> None:
        status = compute_pod_status(
            self.pod,
            self.containers,
            pod_ip=self.pod_ip,
            host_ip=self.agent.host_ip,
            start_time=self.start_time,
            now=now_rfc3339(),
        )
        with contextlib.suppress(ApiError):
            self.pod = await self.agent.api.call(
                "PATCH",
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
                {"metadata": {"uid": self.uid}, "status": status},
                ctype="application/strategic-merge-patch+json",
            )


async def probe_once(pr: dict, spec: dict, pod_ip: str, timeout: float) -> bool:
    try:
        if "httpGet" in pr:
            h = pr["httpGet"]
            host = h.get("host") or pod_ip
            port = resolve_port(spec, h["port"])
            url = f"{h.get('scheme', 'HTTP').lower()}://{host}:{port}{h.get('path', '/')}"
            headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s,
                s.get(url, headers=headers, allow_redirects=False, ssl=False) as r,
            ):
                return 200 <= r.status < 400
        if "tcpSocket" in pr:
            t = pr["tcpSocket"]
            _, w = await asyncio.wait_for(
                asyncio.open_connection(t.get("host") or pod_ip, resolve_port(spec, t["port"])), timeout
            )
            w.close()
            return True
        log.warning("unsupported readiness probe %s: treated as failing", sorted(pr))
        return False
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ the agent


@dataclass
class NodeAgent:
    api: Api
    node: str
    workdir: Path
    host_ip: str = NODE_IP
    path: str = field(
        default_factory=lambda: os.pathsep.join(
            [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
        )
    )
    workers: dict[str, PodWorker] = field(default_factory=dict)
    worker_tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _next_ip: int = 2
    _ips: dict[str, str] = field(default_factory=dict)

    def allocate_ip(self, uid: str) -> str:
        """10.244.0.2, .3, ... in order, never reusing an address within one agent's life."""
        while True:
            ip = POD_NET[self._next_ip]
            self._next_ip += 1
            if ip not in RESERVED and ip.packed[-1] not in (0, 255):
                self._ips[uid] = str(ip)
                return str(ip)

    async def register(self) -> None:
        try:
            await self.api.call("POST", "/api/v1/nodes", node_object(self.node))
        except ApiError as e:
            if e.status != 409:
                raise
        await self.api.call(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            node_status(self.node, now_rfc3339()),
            ctype="application/strategic-merge-patch+json",
        )
        log.info("node %s registered", self.node)

    async def heartbeat(self) -> None:
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        lease = None
        ticks = 0
        while True:
            try:
                if lease is None:
                    node = await self.api.call("GET", f"/api/v1/nodes/{self.node}")
                    body = {
                        "metadata": {
                            "name": self.node,
                            "ownerReferences": [
                                {
                                    "apiVersion": "v1",
                                    "kind": "Node",
                                    "name": self.node,
                                    "uid": node["metadata"]["uid"],
                                }
                            ],
                        },
                        "spec": {
                            "holderIdentity": self.node,
                            "leaseDurationSeconds": LEASE_DURATION,
                            "renewTime": now_micro(),
                        },
                    }
                    try:
                        lease = await self.api.call("POST", path, body)
                    except ApiError as e:
                        if e.status != 409:
                            raise
                        lease = await self.api.call("GET", f"{path}/{self.node}")
                lease["spec"]["renewTime"] = now_micro()
                lease["spec"]["holderIdentity"] = self.node
                lease = await self.api.call("PUT", f"{path}/{self.node}", lease)
                ticks += 1
                if ticks % 6 == 0:  # node status every minute; the Lease carries liveness
                    await self.api.call(
                        "PATCH",
                        f"/api/v1/nodes/{self.node}/status",
                        node_status(self.node, now_rfc3339()),
                        ctype="application/strategic-merge-patch+json",
                    )
            except (ApiError, aiohttp.ClientError) as e:
                log.warning("heartbeat failed: %s", e)
                lease = None
            await asyncio.sleep(HEARTBEAT)

    def on_pod(self, kind: str, pod: dict) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            w = self.workers.get(uid)
            if w:
                w.terminating.set()
            return
        if uid in self.workers:
            self.workers[uid].update(pod)
            return
        if pod["spec"].get("nodeName") != self.node or pod.get("status", {}).get("phase") in (
            "Succeeded",
            "Failed",
        ):
            return
        w = PodWorker(self, pod, self.allocate_ip(uid))
        w.update(pod)
        self.workers[uid] = w
        log.info("pod %s/%s: starting with IP %s", w.ns, w.name, w.pod_ip)
        task = asyncio.create_task(w.run())
        self.worker_tasks[uid] = task
        task.add_done_callback(lambda t, uid=uid: self._done(uid, t))

    def _done(self, uid: str, task: asyncio.Task) -> None:
        self.workers.pop(uid, None)
        self.worker_tasks.pop(uid, None)
        self._ips.pop(uid, None)
        if not task.cancelled() and task.exception():
            log.error("pod worker %s failed: %r", uid, task.exception())

    async def watch_pods(self) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.node}"}
        while True:
            try:
                lst = await self.api.call("GET", "/api/v1/pods", params=params)
                for pod in lst["items"]:
                    self.on_pod("ADDED", pod)
                rv = lst["metadata"]["resourceVersion"]
                while True:
                    async for ev in self.api.watch("/api/v1/pods", {**params, "resourceVersion": rv}):
                        obj = ev["object"]
                        if ev["type"] == "ERROR":
                            raise ApiError(obj.get("code", 500), obj.get("message", ""))
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            self.on_pod(ev["type"], obj)
            except (TimeoutError, ApiError, aiohttp.ClientError) as e:
                log.info("pod watch restarts after: %s", e)
                await asyncio.sleep(0.5)

    async def shutdown(self) -> None:
        for w in list(self.workers.values()):
            await w.kill_now()


async def amain(a: argparse.Namespace) -> None:
    async with Api(a.kubeconfig) as api:
        agent = NodeAgent(api, a.node, Path(a.workdir).resolve())
        await agent.register()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(agent.heartbeat()), asyncio.create_task(agent.watch_pods())]
        try:
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await agent.shutdown()
            log.info("stopped")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m e2e.cluster.node_agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--kubeconfig", required=True, help="a system:node:<node> client kubeconfig")
    ap.add_argument("--node", default="node-1")
    ap.add_argument("--workdir", required=True, help="container logs go to <workdir>/pods/")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
