"""A process node agent: a minimal kubelet stand-in that runs pods as local processes.

    python -m e2e.cluster.node_agent --kubeconfig node-1.kubeconfig --node node-1 --workdir DIR

Authenticates as system:node:<node> (so the Node authorizer and NodeRestriction apply, as for a real
kubelet), registers the Node and renews its Lease, watches the pods bound to it and for each one:
- gives the pod a network namespace of its own (held open by a sleeping process) on a veth pair to the
  node's bridge, with its loopback and eth0 = a pod IP 10.244.x.y/16, default route via the node: pods
  listen on 0.0.0.0 like any container, and a pod's localhost is its own;
- materialises its volumes in <pod dir>/volumes/<name>: emptyDir, secret, configMap, downwardAPI and
  projected (serviceAccountToken via the TokenRequest API, bound to the pod and renewed after 80% of
  its lifetime; configMap; secret; downwardAPI). The ServiceAccount admission plugin adds the usual
  kube-api-access projected volume, so pods get token, ca.crt and namespace like on a real node;
- runs every container's command+args as a process (the image is not pulled; the venv's bin dir leads
  PATH; a container without a command runs the binary --entrypoint names for its image's repository)
  in the pod's network namespace and a private mount namespace (`unshare --mount --propagation private`)
  with each volumeMount bind-mounted at its mountPath (missing mount points are created, empty, in the
  host's tree);
- builds the environment as kubelet does: KUBERNETES_SERVICE_HOST/PORT = the API server at its
  advertise address on the node's bridge (a SAN of its certificate), so in-cluster config works
  unchanged with the pod's own token and RBAC; envFrom; env with $(VAR) expansion, fieldRefs, secretKeyRef and
  configMapKeyRef (a missing reference: CreateContainerConfigError, retried);
- probes: startupProbe gates the others; livenessProbe failure kills the container (SIGTERM, the
  grace period, SIGKILL; a `Killing` event); readinessProbe sets `ready`; httpGet, tcpSocket, exec,
  grpc;
- restarts exited containers (restartPolicy Always/OnFailure, backoff up to 10 s), writes the pod
  status like kubelet/kwok (phase, conditions incl. readinessGates, containerStatuses, podIP(s)),
  and on deletion sends SIGTERM, waits the grace period, SIGKILLs and deletes the pod with grace 0.

Container output goes to <workdir>/pods/<namespace>_<pod>_<uid>/<container>.log.

Not done: init and sidecar containers, lifecycle hooks (preStop/postStart), resources and cgroups,
securityContext (processes run as the agent's user), hostPath/PVC volumes, image pulls, kubelet's
HTTP server (no `kubectl logs/exec/port-forward`), resourceFieldRef env, per-service env variables,
hostNetwork. Service ClusterIPs and names are e2e/cluster/services.py's (kube-proxy's and the cluster
DNS's part): each pod's /etc/resolv.conf names that DNS (dnsPolicy ClusterFirst, the default).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import logging
import os
import signal
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from routerfleet_kube import STRATEGIC, ApiError, KubeClient

from .netns import ADVERTISE_ADDRESS, BRIDGE, NODE_IP, POD_CIDR
from .services import resolv_conf

log = logging.getLogger("node-agent")

POD_NET = ipaddress.ip_network(POD_CIDR)
RESERVED = {ipaddress.ip_address(NODE_IP), ipaddress.ip_address(ADVERTISE_ADDRESS)}
LEASE_DURATION = 40
HEARTBEAT = 10.0
WATCH_S = 300  # the pod watch's server-side timeout; resumed from its resourceVersion
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


SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
Objects = dict[tuple[str, str], "dict[str, bytes] | None"]  # ("secrets"|"configmaps", name) -> data


def object_refs(pod: dict) -> set[tuple[str, str]]:
    """Every Secret and ConfigMap the pod's env, envFrom and volumes refer to."""
    refs: set[tuple[str, str]] = set()
    for c in pod["spec"].get("containers") or []:
        for e in c.get("env") or []:
            vf = e.get("valueFrom") or {}
            if "secretKeyRef" in vf:
                refs.add(("secrets", vf["secretKeyRef"]["name"]))
            if "configMapKeyRef" in vf:
                refs.add(("configmaps", vf["configMapKeyRef"]["name"]))
        for ef in c.get("envFrom") or []:
            if "secretRef" in ef:
                refs.add(("secrets", ef["secretRef"]["name"]))
            if "configMapRef" in ef:
                refs.add(("configmaps", ef["configMapRef"]["name"]))
    for v in pod["spec"].get("volumes") or []:
        sources = [v, *((v.get("projected") or {}).get("sources") or [])]
        for src in sources:
            if "secret" in src:
                refs.add(("secrets", src["secret"].get("secretName") or src["secret"].get("name")))
            if "configMap" in src:
                refs.add(("configmaps", src["configMap"]["name"]))
    return refs


def object_data(kind: str, obj: dict) -> dict[str, bytes]:
    """A Secret's or ConfigMap's keys as bytes (Secret data and ConfigMap binaryData are base64)."""
    if kind == "secrets":
        return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _key_ref(ref: dict, kind: str, objects: Objects) -> str | None:
    data = objects.get((kind, ref["name"]))
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        what = "secret" if kind == "secrets" else "configmap"
        raise ValueError(f"{what} {ref['name']!r} or its key {ref['key']!r} not found")
    return data[ref["key"]].decode()


def container_env(
    pod: dict,
    container: dict,
    pod_ip: str,
    host_ip: str,
    objects: Objects | None = None,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment as kubelet builds it: `base` (the service variables), then
    `envFrom`, then `env` in order with `$(VAR)` expansion against everything before it.

    `objects` holds the referenced Secrets/ConfigMaps (None: does not exist); a missing non-optional
    reference raises ValueError (kubelet: CreateContainerConfigError)."""
    objects = objects or {}
    env: dict[str, str] = dict(base or {})
    for ef in container.get("envFrom") or []:
        kind, ref = ("secrets", ef["secretRef"]) if "secretRef" in ef else ("configmaps", ef["configMapRef"])
        data = objects.get((kind, ref["name"]))
        if data is None and not ref.get("optional"):
            raise ValueError(f"{kind[:-1]} {ref['name']!r} not found")
        for k, v in (data or {}).items():
            env[ef.get("prefix", "") + k] = v.decode()
    for e in container.get("env") or []:
        vf = e.get("valueFrom")
        if vf is None:
            env[e["name"]] = expand(e.get("value", ""), env)
        elif "fieldRef" in vf:
            env[e["name"]] = field_ref(pod, vf["fieldRef"]["fieldPath"], pod_ip, host_ip)
        elif "secretKeyRef" in vf or "configMapKeyRef" in vf:
            kind = "secrets" if "secretKeyRef" in vf else "configmaps"
            value = _key_ref(vf.get("secretKeyRef") or vf["configMapKeyRef"], kind, objects)
            if value is not None:
                env[e["name"]] = value
        else:
            raise ValueError(f"unsupported valueFrom in env {e['name']!r}: {sorted(vf)}")
    return env


def _token_key(t: dict) -> tuple[str, int]:
    return t.get("audience", ""), t.get("expirationSeconds", 3600)


def token_requests(pod: dict) -> set[tuple[str, int]]:
    """(audience, expirationSeconds) of every projected serviceAccountToken source."""
    return {
        _token_key(s["serviceAccountToken"])
        for v in pod["spec"].get("volumes") or []
        for s in (v.get("projected") or {}).get("sources") or []
        if "serviceAccountToken" in s
    }


def _items(data: dict[str, bytes], items: list | None, mode: int, what: str) -> dict[str, tuple[bytes, int]]:
    if not items:
        return {k: (v, mode) for k, v in data.items()}
    out = {}
    for it in items:
        if it["key"] not in data:
            raise ValueError(f"{what} has no key {it['key']!r}")
        out[it["path"]] = (data[it["key"]], it.get("mode", mode))
    return out


def _downward(pod: dict, items: list, mode: int, pod_ip: str, host_ip: str) -> dict[str, tuple[bytes, int]]:
    out = {}
    for it in items:
        path = it["fieldRef"]["fieldPath"]
        if path in ("metadata.labels", "metadata.annotations"):
            kv = pod["metadata"].get(path.split(".")[1]) or {}
            value = "\n".join(f"{k}={json.dumps(v)}" for k, v in sorted(kv.items()))
        else:
            value = field_ref(pod, path, pod_ip, host_ip)
        out[it["path"]] = (value.encode(), it.get("mode", mode))
    return out


def volume_files(
    vol: dict, pod: dict, objects: Objects, tokens: dict[tuple[str, int], str], pod_ip: str, host_ip: str
) -> dict[str, tuple[bytes, int]] | None:
    """The files (relative path -> (content, mode)) of one volume; None for an emptyDir.

    Secret, ConfigMap, downwardAPI and projected (serviceAccountToken, secret, configMap,
    downwardAPI) volumes. Raises ValueError for a missing non-optional object or an unsupported kind."""
    if "emptyDir" in vol:
        return None
    if "projected" in vol:
        mode = vol["projected"].get("defaultMode", 0o644)
        out: dict[str, tuple[bytes, int]] = {}
        for s in vol["projected"].get("sources") or []:
            if "serviceAccountToken" in s:
                t = s["serviceAccountToken"]
                out[t["path"]] = (tokens[_token_key(t)].encode(), mode)
            elif "downwardAPI" in s:
                out.update(_downward(pod, s["downwardAPI"].get("items") or [], mode, pod_ip, host_ip))
            else:
                out.update(_object_volume(s, objects, mode) or {})
        return out
    if "downwardAPI" in vol:
        d = vol["downwardAPI"]
        return _downward(pod, d.get("items") or [], d.get("defaultMode", 0o644), pod_ip, host_ip)
    if "secret" in vol or "configMap" in vol:
        src = vol.get("secret") or vol["configMap"]
        return _object_volume(vol, objects, src.get("defaultMode", 0o644)) or {}
    raise ValueError(f"unsupported volume {vol['name']!r}: {sorted(k for k in vol if k != 'name')}")


def _object_volume(src: dict, objects: Objects, mode: int) -> dict[str, tuple[bytes, int]] | None:
    kind = "secrets" if "secret" in src else "configmaps"
    ref = src["secret"] if kind == "secrets" else src["configMap"]
    name = ref.get("secretName") or ref.get("name")
    data = objects.get((kind, name))
    if data is None:
        if ref.get("optional"):
            return None
        raise ValueError(f"{kind[:-1]} {name!r} not found")
    return _items(data, ref.get("items"), mode, f"{kind[:-1]} {name!r}")


_MOUNT_SCRIPT = (
    'set -e; while [ "$1" != -- ]; do '
    'if [ -d "$1" ]; then mkdir -p "$2"; else mkdir -p "$(dirname "$2")"; [ -e "$2" ] || : > "$2"; fi; '
    'mount --bind -o "$3" "$1" "$2"; shift 3; done; shift; exec "$@"'
)


def container_mounts(container: dict, volume_dir: Path) -> list[tuple[str, str, str]]:
    """(source in the pod dir, mountPath, "ro"|"rw") for each volumeMount (subPath supported)."""
    out = []
    for m in container.get("volumeMounts") or []:
        src = volume_dir / m["name"]
        if m.get("subPath"):
            src = src / m["subPath"]
        out.append((str(src), m["mountPath"], "ro" if m.get("readOnly") else "rw"))
    return out


def with_mounts(mounts: list[tuple[str, str, str]], argv: list[str]) -> list[str]:
    """`argv` run in a private mount namespace with each (src, dst, mode) bind-mounted first.

    `unshare` and `sh` exec in place, so the pid is the container process's pid. Missing mount points
    are created (empty) in the host's tree; the mounts themselves are visible only to the process."""
    if not mounts:
        return argv
    flat = [x for m in mounts for x in m]
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _MOUNT_SCRIPT, "mount",
            *flat, "--", *argv]  # fmt: skip


def image_repository(image: str) -> str:
    """``registry/path/name`` of an image reference, without its tag or digest."""
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def container_argv(container: dict, env: dict[str, str], entrypoints: Mapping[str, str] = {}) -> list[str]:
    """The process a container runs: its command and args, as kubelet expands them. A container without
    a command runs its image's entrypoint, where ``entrypoints`` names a binary for the image's
    repository (images are not pulled: the binary is one built from the same source)."""
    command = container.get("command") or []
    if not command:
        entry = entrypoints.get(image_repository(container.get("image", "")))
        if entry is None:
            raise ValueError(
                f"container {container['name']!r} has no command, and image {container.get('image')!r}"
                " has no entrypoint here (images are not run)"
            )
        command = [entry]
    return [expand(a, env) for a in command + (container.get("args") or [])]


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
    started: bool = False  # startup probe passed (or none)
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
        "started": c.running and c.started,
        "restartCount": c.restart_count,
        "state": state,
        "lastState": {"terminated": c.last_terminated} if c.last_terminated else {},
        "containerID": f"process://{c.pid}" if c.pid else None,
    }


def gate_states(pod: dict) -> dict[str, str | None]:
    """The status of each of the pod's readiness gates' conditions (None: not set)."""
    have = {c["type"]: c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
    return {g["conditionType"]: have.get(g["conditionType"]) for g in pod["spec"].get("readinessGates") or []}


def compute_pod_status(
    pod: dict, containers: list[ContainerRuntime], *, pod_ip: str, host_ip: str, start_time: str, now: str
) -> dict:
    """The pod status to write, from the pod (spec, current conditions) and the container runtimes.

    Ready = every container ready AND every spec.readinessGates condition True (set by others)."""
    old = {c["type"]: c for c in (pod.get("status") or {}).get("conditions") or []}
    unready = [c.name for c in containers if not c.ready]
    containers_ready = not unready
    gates_false = [g for g, status in gate_states(pod).items() if status != "True"]
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


# ------------------------------------------------------------------------------------------ pods


def _pdeathsig() -> None:
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _killpg(proc: asyncio.subprocess.Process, sig: int) -> None:
    """``sig`` to the container's process group; a SIGKILL also to every process below it wherever it
    put itself (``setsid`` leaves the group, not the tree), as a runtime's cgroup kill ends them all."""
    below = descendants(proc.pid) if sig == signal.SIGKILL else []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: each one's parent)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # after "pid (comm) state"
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


def veth_name(pod_ip: str) -> str:
    """The node-side end of a pod's veth pair, from its IP (unique: an agent never reuses an IP; at
    most 15 characters, the kernel's limit)."""
    b = ipaddress.ip_address(pod_ip).packed
    return f"rfv{b[2]}x{b[3]}"


async def _run(*argv: str) -> None:
    p = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await p.communicate()
    if p.returncode != 0:
        raise OSError(f"{' '.join(argv)}: exit {p.returncode}: {out.decode(errors='replace').strip()}")


class PodNetwork:
    """A pod's network namespace, as a CNI bridge plugin would make it: held open by a sleeping
    process (the pause container's role), one end of a veth pair as its eth0 with the pod IP, the
    other end on the node's bridge. Containers and exec probes join it with ``enter``; it ends with the
    holder, and the veth pair with it."""

    def __init__(self, pod_ip: str, holder: asyncio.subprocess.Process):
        self.pod_ip, self.holder = pod_ip, holder

    @classmethod
    async def create(cls, pod_ip: str) -> PodNetwork:
        holder = await asyncio.create_subprocess_exec(
            "unshare", "--net", "--", "sleep", "infinity",
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True, preexec_fn=_pdeathsig,
        )  # fmt: skip
        net = cls(pod_ip, holder)
        try:
            ns = f"/proc/{holder.pid}/ns/net"
            await net._until_own_netns(ns)
            veth = veth_name(pod_ip)
            await _run(
                "ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", str(holder.pid)
            )
            await _run("ip", "link", "set", veth, "master", BRIDGE, "up")
            inside = (
                f"ip link set lo up && ip addr add {pod_ip}/{POD_NET.prefixlen} dev eth0 && "
                f"ip link set eth0 up && ip route add default via {NODE_IP}"
            )
            await _run("nsenter", f"--net={ns}", "--", "sh", "-c", inside)
        except BaseException:
            await net.close()
            raise
        return net

    async def _until_own_netns(self, ns: str) -> None:
        """Until the holder has left the agent's netns (unshare execs sleep once it has)."""
        mine = os.stat("/proc/self/ns/net").st_ino
        for _ in range(200):
            with contextlib.suppress(OSError):
                if os.stat(ns).st_ino != mine:
                    return
            if self.holder.returncode is not None:
                break
            await asyncio.sleep(0.01)
        raise OSError(f"the pod network's holder did not enter a new netns (exit {self.holder.returncode})")

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run in the pod's netns (nsenter execs in place: the pid stays the container's)."""
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--", *argv]

    async def close(self) -> None:
        _killpg(self.holder, signal.SIGKILL)
        await self.holder.wait()


class PodWorker:
    """Runs one pod: volumes and credentials, processes, probes, status, termination."""

    def __init__(self, agent: NodeAgent, pod: dict, pod_ip: str):
        self.agent, self.pod, self.pod_ip = agent, pod, pod_ip
        md = pod["metadata"]
        self.ns, self.name, self.uid = md["namespace"], md["name"], md["uid"]
        self.start_time = now_rfc3339()
        self.containers = [ContainerRuntime(c["name"], c.get("image", "")) for c in pod["spec"]["containers"]]
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.terminating = asyncio.Event()
        self.dirty = asyncio.Event()
        self.volumes_ready = asyncio.Event()
        self.log_dir = agent.workdir / "pods" / f"{self.ns}_{self.name}_{self.uid}"
        self.volume_dir = self.log_dir / "volumes"
        self.tasks: list[asyncio.Task] = []
        self.tokens: dict[tuple[str, int], tuple[str, float]] = {}  # key -> (token, refresh at)
        self.net: PodNetwork | None = None

    def update(self, pod: dict) -> None:
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminating.set()
        self.dirty.set()  # a readiness gate may have flipped

    async def run(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.dirty.set()
        writer = asyncio.create_task(self._status_writer())
        try:
            if await self._sandbox():
                self.tasks = [asyncio.create_task(self._volumes())] + [
                    asyncio.create_task(self._container(spec, rt))
                    for spec, rt in zip(self.pod["spec"]["containers"], self.containers, strict=True)
                ]
                await self.terminating.wait()
                await self._terminate()
        finally:
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            if self.net is not None:
                await self.net.close()
            await self._write_status()
            writer.cancel()
        try:
            await self.agent.api.request(
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

    async def _sandbox(self) -> bool:
        """The pod's network, retried (with kubelet's Warning event) until it exists or the pod is
        deleted first (False)."""
        while not self.terminating.is_set():
            try:
                self.net = await PodNetwork.create(self.pod_ip)
                return True
            except OSError as e:
                log.warning("pod %s/%s network: %s", self.ns, self.name, e)
                await self.agent.event(self.pod, "FailedCreatePodSandBox", f"pod network: {e}", "Warning")
                await self._backoff(5.0)
        return False

    async def kill_now(self) -> None:
        for p in self.procs.values():
            _killpg(p, signal.SIGKILL)
        if self.net is not None:
            await self.net.close()

    def _grace(self) -> int:
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        return self.pod["spec"].get("terminationGracePeriodSeconds", 30) if grace is None else grace

    async def _terminate(self) -> None:
        grace = self._grace()
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

    # ------------------------------------------------------------ volumes, credentials, env

    async def _objects(self) -> Objects:
        """The Secrets/ConfigMaps the pod refers to (the Node authorizer lets the node read exactly those)."""
        out: Objects = {}
        for kind, name in object_refs(self.pod):
            try:
                obj = await self.agent.api.request("GET", f"/api/v1/namespaces/{self.ns}/{kind}/{name}")
                out[kind, name] = object_data(kind, obj)
            except ApiError as e:
                if e.status != 404:
                    raise
                out[kind, name] = None
        return out

    async def _token(self, audience: str, expiration: int) -> str:
        """A TokenRequest token bound to this pod, renewed after 80% of its lifetime, as kubelet does."""
        key = (audience, expiration)
        cached = self.tokens.get(key)
        if cached and time.time() < cached[1]:
            return cached[0]
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": expiration,
            "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.name, "uid": self.uid},
        }
        if audience:
            spec["audiences"] = [audience]
        t0 = time.time()
        tr = await self.agent.api.request(
            "POST",
            f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        expires = dt.datetime.fromisoformat(tr["status"]["expirationTimestamp"].replace("Z", "+00:00"))
        self.tokens[key] = (tr["status"]["token"], t0 + 0.8 * (expires.timestamp() - t0))
        return tr["status"]["token"]

    async def _sync_volumes(self) -> None:
        objects = await self._objects()
        tokens = {k: await self._token(*k) for k in token_requests(self.pod)}
        for vol in self.pod["spec"].get("volumes") or []:
            files = volume_files(vol, self.pod, objects, tokens, self.pod_ip, self.agent.host_ip)
            d = self.volume_dir / vol["name"]
            d.mkdir(parents=True, exist_ok=True)
            for rel, (data, mode) in (files or {}).items():
                write_atomic(d / rel, data, mode)

    async def _volumes(self) -> None:
        """Materialise the volumes before any container starts, then keep them current (Secret and
        ConfigMap changes, token renewal) like kubelet's periodic sync."""
        while True:
            try:
                await self._sync_volumes()
                self.volumes_ready.set()
                delay = 30.0
            except (ApiError, ValueError, KeyError, aiohttp.ClientError) as e:
                log.warning("pod %s/%s volumes: %s", self.ns, self.name, e)
                delay = 1.0
            await asyncio.sleep(delay)

    async def _prepare(self, spec: dict) -> tuple[list[str], dict[str, str], list]:
        """argv (wrapped for the mounts), environment and mounts of one container start."""
        env = container_env(
            self.pod, spec, self.pod_ip, self.agent.host_ip, await self._objects(), self.agent.service_env
        )
        argv = container_argv(spec, env, self.agent.entrypoints)
        penv = {
            "PATH": self.agent.path,
            "HOME": os.environ.get("HOME", "/root"),
            "HOSTNAME": self.name,
            **env,
        }
        mounts = container_mounts(spec, self.volume_dir)
        resolv = resolv_conf(self.pod)
        if resolv is not None and not any(dst == "/etc/resolv.conf" for _, dst, _ in mounts):
            path = self.log_dir / "resolv.conf"
            path.write_text(resolv)
            mounts.append((str(path), "/etc/resolv.conf", "ro"))
        return self.enter(mounts, argv), penv, mounts

    def enter(self, mounts: list, argv: list[str]) -> list[str]:
        """``argv`` as a process of this pod: in its network namespace, with its mounts."""
        assert self.net is not None
        return self.net.enter(with_mounts(mounts, argv))

    # ------------------------------------------------------------ containers

    async def _container(self, spec: dict, rt: ContainerRuntime) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        backoff = 1.0
        await self.volumes_ready.wait()
        while not self.terminating.is_set():
            try:
                argv, penv, mounts = await self._prepare(spec)
            except (ValueError, ApiError, aiohttp.ClientError) as e:  # e.g. a Secret not created yet
                log.warning("pod %s/%s container %s: %s", self.ns, self.name, spec["name"], e)
                rt.waiting_reason = "CreateContainerConfigError"
                self.dirty.set()
                await self._backoff(backoff)
                backoff = min(backoff * 2, 10)
                continue
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
            rt.ready = rt.started = False
            self.dirty.set()
            prober = asyncio.create_task(self._probes(spec, rt, proc, penv, mounts))
            try:
                code = await proc.wait()
                code = 128 - code if code < 0 else code  # killed by signal N: 128+N
            finally:
                prober.cancel()
                # A container ends with its main process: the runtime kills what else ran in it (its
                # cgroup), as here its process group. Else a server's children (vLLM's engine core, holding
                # the KV event ports) outlive it, and the restarted container cannot bind them.
                _killpg(proc, signal.SIGKILL)
            rt.running, rt.ready, rt.started = False, False, False
            rt.exit_code, rt.finished_at = code, now_rfc3339()
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

    async def _probes(self, spec: dict, rt: ContainerRuntime, proc, env: dict[str, str], mounts) -> None:
        """kubelet's probe semantics: the startup probe runs first and gates the others; a failed
        startup or liveness probe kills the container (restartPolicy decides what follows); readiness
        sets `ready`. Without a startup probe the container counts as started at once."""

        def check(pr: dict):
            return lambda: probe_once(pr, spec, self.pod_ip, env, lambda argv: self.enter(mounts, argv))

        if sp := spec.get("startupProbe"):
            async for ok in probe_verdicts(sp, check(sp)):
                if not ok:
                    await self._kill_container(spec, proc, sp, "startup")
                    return
                break
        rt.started, rt.ready = True, "readinessProbe" not in spec
        self.dirty.set()

        async def readiness(pr: dict) -> None:
            async for ok in probe_verdicts(pr, check(pr)):
                if rt.ready != ok:
                    rt.ready = ok
                    self.dirty.set()

        async def liveness(pr: dict) -> None:
            async for ok in probe_verdicts(pr, check(pr)):
                if not ok:
                    await self._kill_container(spec, proc, pr, "liveness")
                    return

        loops = []
        if rp := spec.get("readinessProbe"):
            loops.append(readiness(rp))
        if lp := spec.get("livenessProbe"):
            loops.append(liveness(lp))
        await asyncio.gather(*loops)

    async def _kill_container(self, spec: dict, proc, pr: dict, which: str) -> None:
        grace = pr.get("terminationGracePeriodSeconds") or self.pod["spec"].get(
            "terminationGracePeriodSeconds", 30
        )
        log.info(
            "pod %s/%s container %s failed %s probe, will be restarted",
            self.ns,
            self.name,
            spec["name"],
            which,
        )
        await self.agent.event(
            self.pod, "Killing", f"Container {spec['name']} failed {which} probe, will be restarted", "Normal"
        )
        _killpg(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            _killpg(proc, signal.SIGKILL)

    # ------------------------------------------------------------ status

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
        gates = gate_states(self.pod)
        status = compute_pod_status(
            self.pod,
            self.containers,
            pod_ip=self.pod_ip,
            host_ip=self.agent.host_ip,
            start_time=self.start_time,
            now=now_rfc3339(),
        )
        with contextlib.suppress(ApiError):
            self.pod = await self.agent.api.request(
                "PATCH",
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
                {"metadata": {"uid": self.uid}, "status": status},
                ctype=STRATEGIC,
            )
        # The answer may be older than a watch event already taken (a gate set while this write was in
        # flight) or newer (the gate set just before it was applied): either way Ready was computed from
        # gates that are not the server's now. Write again; a no-op write makes no watch event to wake us.
        if gate_states(self.pod) != gates:
            self.dirty.set()


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` in one rename, so a reader (a client re-reading its token) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)


async def probe_verdicts(pr: dict, check) -> AsyncIterator[bool]:
    """Run `check()` every periodSeconds after initialDelaySeconds; yield True once successThreshold
    consecutive successes are seen and False once failureThreshold consecutive failures are, each time
    the verdict changes (kubelet's prober worker)."""
    period = pr.get("periodSeconds", 10)
    fail_th, ok_th = pr.get("failureThreshold", 3), pr.get("successThreshold", 1)
    await asyncio.sleep(pr.get("initialDelaySeconds", 0))
    oks = fails = 0
    verdict = None
    while True:
        ok = await check()
        oks, fails = (oks + 1, 0) if ok else (0, fails + 1)
        if ok and oks >= ok_th and verdict is not True:
            verdict = True
            yield True
        elif not ok and fails >= fail_th and verdict is not False:
            verdict = False
            yield False
        await asyncio.sleep(period)


async def probe_once(
    pr: dict, spec: dict, pod_ip: str, env: dict[str, str] | None = None, enter=lambda argv: argv
) -> bool:
    """One httpGet / tcpSocket / exec / grpc probe with timeoutSeconds. exec runs the command with the
    container's environment, as a process of its pod (``enter(argv)``: in its network namespace, with
    its mounts); exit code 0 is success."""
    timeout = pr.get("timeoutSeconds", 1)
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
        if "exec" in pr:
            p = await asyncio.create_subprocess_exec(
                *enter(pr["exec"]["command"]),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_pdeathsig,
            )
            try:
                return await asyncio.wait_for(p.wait(), timeout) == 0
            except TimeoutError:
                _killpg(p, signal.SIGKILL)
                await p.wait()
                return False
        if "grpc" in pr:
            g = pr["grpc"]
            return await _grpc_serving(f"{pod_ip}:{g['port']}", g.get("service") or "", timeout)
        log.warning("unsupported probe %s: treated as failing", sorted(pr))
        return False
    except (OSError, TimeoutError, aiohttp.ClientError, ValueError):
        return False


async def _grpc_serving(target: str, service: str, timeout: float) -> bool:
    """kubelet's grpc probe: grpc.health.v1 Check of ``service`` over plaintext, SERVING or not."""
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.aio.AioRpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------------------ the agent


@dataclass
class NodeAgent:
    api: KubeClient
    node: str
    workdir: Path
    host_ip: str = NODE_IP
    path: str = field(
        default_factory=lambda: os.pathsep.join(
            [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
        )
    )
    entrypoints: Mapping[str, str] = field(default_factory=dict)  # image repository -> binary
    workers: dict[str, PodWorker] = field(default_factory=dict)
    worker_tasks: dict[str, asyncio.Task] = field(default_factory=dict)
    _next_ip: int = 2
    _ips: dict[str, str] = field(default_factory=dict)

    @property
    def service_env(self) -> dict[str, str]:
        """KUBERNETES_SERVICE_HOST/PORT: the API server at its advertise address on the node's bridge,
        as the pods reach it from their own netns (a SAN of its serving certificate), on the port this
        agent uses; in-cluster config works unchanged."""
        port = urllib.parse.urlsplit(self.api.host).port or 443
        return {"KUBERNETES_SERVICE_HOST": ADVERTISE_ADDRESS, "KUBERNETES_SERVICE_PORT": str(port)}

    async def event(self, pod: dict, reason: str, message: str, type_: str = "Normal") -> None:
        """A core/v1 Event about `pod`, as kubelet records them; failures are only logged."""
        md, now = pod["metadata"], now_rfc3339()
        body = {
            "metadata": {"generateName": f"{md['name']}."},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "namespace": md["namespace"],
                "name": md["name"],
                "uid": md["uid"],
            },
            "reason": reason,
            "message": message,
            "type": type_,
            "source": {"component": "kubelet", "host": self.node},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.api.request("POST", f"/api/v1/namespaces/{md['namespace']}/events", body)
        except (ApiError, aiohttp.ClientError) as e:
            log.warning("event %s for %s/%s not written: %s", reason, md["namespace"], md["name"], e)

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
            await self.api.request("POST", "/api/v1/nodes", node_object(self.node))
        except ApiError as e:
            if e.status != 409:
                raise
        await self.api.request(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            node_status(self.node, now_rfc3339()),
            ctype=STRATEGIC,
        )
        log.info("node %s registered", self.node)

    async def heartbeat(self) -> None:
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
        lease = None
        ticks = 0
        while True:
            try:
                if lease is None:
                    node = await self.api.request("GET", f"/api/v1/nodes/{self.node}")
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
                        lease = await self.api.request("POST", path, body)
                    except ApiError as e:
                        if e.status != 409:
                            raise
                        lease = await self.api.request("GET", f"{path}/{self.node}")
                lease["spec"]["renewTime"] = now_micro()
                lease["spec"]["holderIdentity"] = self.node
                lease = await self.api.request("PUT", f"{path}/{self.node}", lease)
                ticks += 1
                if ticks % 6 == 0:  # node status every minute; the Lease carries liveness
                    await self.api.request(
                        "PATCH",
                        f"/api/v1/nodes/{self.node}/status",
                        node_status(self.node, now_rfc3339()),
                        ctype=STRATEGIC,
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
                lst = await self.api.request("GET", "/api/v1/pods", params=params)
                for pod in lst["items"]:
                    self.on_pod("ADDED", pod)
                rv = lst["metadata"]["resourceVersion"]
                while True:  # each watch ends at its server-side timeout: resume from rv
                    watch = self.api.watch(
                        "/api/v1/pods", {**params, "resourceVersion": rv}, timeout_s=WATCH_S
                    )
                    async with contextlib.aclosing(watch):
                        async for ev in watch:
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
    async with await KubeClient.connect(a.kubeconfig, user_agent="routerfleet-node-agent") as api:
        entrypoints = dict(e.split("=", 1) for e in a.entrypoint)
        agent = NodeAgent(api, a.node, Path(a.workdir).resolve(), entrypoints=entrypoints)
        # An image's binary is on PATH too: its other containers name it as their command (Envoy
        # Gateway's shutdown-manager runs `envoy-gateway`).
        dirs = dict.fromkeys(str(Path(b).parent) for b in entrypoints.values())
        agent.path = os.pathsep.join([*dirs, agent.path])
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
    ap.add_argument(
        "--entrypoint",
        action="append",
        default=[],
        metavar="REPOSITORY=BINARY",
        help="what a container of this image runs when it names no command (repeatable)",
    )
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
