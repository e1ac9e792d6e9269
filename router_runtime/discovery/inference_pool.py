"""An InferencePool and the pods it selects -> WorkerSpecs: the pure half of pool discovery (no I/O; the
watcher is ``kubernetes.InferencePoolWatcher``).

The pool (``inference.networking.k8s.io/v1``) says which pods are its engines (``spec.selector``, labels
to match) and on which ports (``spec.targetPorts``): each pod serves on every target port, and each
(pod, port) is one engine, as the extension's reference picker counts them. The engine identity is the
pod's ``<namespace>/<name>``, with ``:<port>`` when the pool has several target ports.

A pod is routable when it is Ready, has an IP and is not being deleted (a terminating pod still serving
its in-flight requests gets no new ones). The KV event and replay ports of ``EngineDiscoveryConfig``
are a container port's name or a number; with several target ports, the i-th port's engine publishes on
that number + i, as data-parallel ranks bind theirs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..worker import Role, WorkerSpec
from .endpointslices import EngineDiscoveryConfig, PortRef, SliceMapping, url_host


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What discovery reads of an InferencePool: the labels its pods carry and the ports they serve."""

    selector: tuple[tuple[str, str], ...]
    target_ports: tuple[int, ...]

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector)


def pool_shape(pool: Mapping[str, Any]) -> PoolShape:
    """The vetted shape of an InferencePool object; raises ``ValueError`` saying what is wrong. A pool
    with ``matchExpressions``, no labels or no ports is refused: no pod would be guessed into it."""
    spec = pool.get("spec")
    if not isinstance(spec, Mapping):
        raise ValueError("the pool has no spec")
    selector = spec.get("selector")
    if not isinstance(selector, Mapping):
        raise ValueError("spec.selector is missing")
    if selector.get("matchExpressions"):
        raise ValueError("spec.selector.matchExpressions is not supported (matchLabels only)")
    labels = selector.get("matchLabels")
    if not isinstance(labels, Mapping) or not labels:
        raise ValueError("spec.selector.matchLabels is empty")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValueError("spec.selector.matchLabels holds a value that is not a string")
    ports: list[int] = []
    for p in spec.get("targetPorts") or []:
        number = p.get("number") if isinstance(p, Mapping) else None
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise ValueError(f"spec.targetPorts holds {number!r}, not a port number")
        if number not in ports:
            ports.append(number)
    if not ports:
        raise ValueError("spec.targetPorts is empty")
    return PoolShape(tuple(sorted(labels.items())), tuple(ports))


def pod_state(pod: Mapping[str, Any]) -> str:
    """``routable``, ``terminating``, ``not_ready`` or ``no_address`` for a pod object."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp"):
        return "terminating"
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if not ready:
        return "not_ready"
    if url_host(status.get("podIP") or "") is None:
        return "no_address"
    return "routable"


def _container_ports(pod: Mapping[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        for p in c.get("ports") or []:
            if p.get("name") and p.get("containerPort"):
                out.setdefault(p["name"], int(p["containerPort"]))
    return out


def _port(ref: PortRef | None, named: Mapping[str, int], index: int) -> int | None:
    if ref is None:
        return None
    base = ref if isinstance(ref, int) else named.get(ref)
    return None if base is None else base + index


# The pod label naming an engine's revision for disaggregation: a prefill and a decode engine pair only
# when it is equal on both (their Deployments differ, so their pod template hashes always do).
REVISION_LABEL = "app.kubernetes.io/version"


def pod_revision(meta: Mapping[str, Any], label: str = REVISION_LABEL) -> str:
    """The engine revision a pod's ``label`` names ("" when it has none): engines of one revision run
    the same model and KV layout, so only they hand KV to each other."""
    value = (meta.get("labels") or {}).get(label)
    return value if isinstance(value, str) else ""


# llm-d's role label values (its filters' own list): what each can serve here. Its encoders (multimodal
# inputs) answer no client and prefill no text, so a pod that only encodes is not an engine here.
ROLES = {
    "decode": Role.DECODE,
    "prefill": Role.PREFILL,
    "encode-prefill": Role.PREFILL,
    "both": Role.BOTH,
    "prefill-decode": Role.BOTH,
    "encode-prefill-decode": Role.BOTH,
}


def pod_role(meta: Mapping[str, Any], label: str) -> Role | None:
    """The role a pod's ``label`` names in a disaggregated fleet (llm-d's ``llm-d.ai/role``; ROLES). A
    pod without the label is a whole engine (serves its own requests, never paired, as llm-d's decode
    filter keeps it); a value that names no role here (``encode``, or one this router does not know)
    is None: not routed, since the engine might not answer a client's request."""
    value = (meta.get("labels") or {}).get(label)
    return Role.BOTH if value is None else ROLES.get(value) if isinstance(value, str) else None


def map_pool_pods(
    shape: PoolShape,
    pods: Iterable[Mapping[str, Any]],
    config: EngineDiscoveryConfig,
    revision_label: str = REVISION_LABEL,
    role_label: str | None = None,
) -> SliceMapping:
    """One WorkerSpec per routable pod the pool selects and per target port, sorted by engine; pods the
    pool does not select are not counted. States as ``endpointslices.map_slices`` names them, and
    ``port_missing:<name>`` for a configured KV port name a pod's containers do not declare. With
    ``role_label``, each engine's role is its pod's (``pod_role``; ``role_unknown``: none it can serve).
    """
    states: Counter[str] = Counter()
    workers: list[WorkerSpec] = []
    several = len(shape.target_ports) > 1
    for pod in pods:
        meta = pod.get("metadata") or {}
        if not shape.selects(meta.get("labels") or {}):
            continue
        state = pod_state(pod)
        named = _container_ports(pod)
        missing = [r for r in (config.kv_port, config.replay_port) if isinstance(r, str) and r not in named]
        if state == "routable" and missing:
            state = f"port_missing:{missing[0]}"
        role = pod_role(meta, role_label) if role_label else Role.BOTH
        if state == "routable" and role is None:
            state = "role_unknown"
        states[state] += 1
        if state != "routable":
            continue
        host = url_host((pod.get("status") or {})["podIP"])
        pod_id = f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"
        for i, port in enumerate(shape.target_ports):
            kv, replay = _port(config.kv_port, named, i), _port(config.replay_port, named, i)
            workers.append(
                WorkerSpec(
                    engine=f"{pod_id}:{port}" if several else pod_id,
                    url=f"{config.scheme}://{host}:{port}",
                    kv=f"tcp://{host}:{kv}" if kv is not None else None,
                    replay=f"tcp://{host}:{replay}" if replay is not None else None,
                    dp_size=config.dp_size,
                    topic=config.topic.encode(),
                    incarnation=meta.get("uid") or "",
                    revision=pod_revision(meta, revision_label),
                    role=role,
                )
            )
    return SliceMapping(sorted(workers, key=lambda w: w.engine), states)
