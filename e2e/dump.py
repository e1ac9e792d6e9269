"""What a failed e2e run leaves for the engineer reading it: a namespace's events, its Deployments and
ReplicaSets, its pods' states and the tail of every container's log. One dump for the e2e tests, the
demo and the soak."""

from __future__ import annotations

from collections.abc import Callable

from kubernetes import client
from kubernetes.client.exceptions import ApiException


def describe_pod(p) -> str:
    lines = [
        f"pod {p.metadata.name}: phase={p.status.phase} ip={p.status.pod_ip} node={p.spec.node_name}"
        f"{' terminating' if p.metadata.deletion_timestamp else ''}",
        "  conditions: "
        + ", ".join(
            f"{c.type}={c.status}{f'({c.reason})' if c.reason else ''}" for c in p.status.conditions or []
        ),
    ]
    for cs in p.status.container_statuses or []:
        state = next((k for k in ("running", "waiting", "terminated") if getattr(cs.state, k)), "?")
        detail = getattr(cs.state, state, None)
        extra = getattr(detail, "reason", None) or getattr(detail, "exit_code", None) or ""
        lines.append(
            f"  container {cs.name}: {state} {extra} ready={cs.ready} started={cs.started} "
            f"restarts={cs.restart_count} id={cs.container_id}"
        )
    return "\n".join(lines)


def _owner(o) -> str:
    refs = o.metadata.owner_references or []
    return f" owner={refs[0].kind}/{refs[0].name}" if refs else ""


def dump_namespace(
    api: client.ApiClient, ns: str, container_log: Callable[[str, str, str], str], log_lines: int = 40
) -> str:
    """Events, workloads, pod statuses and the last ``log_lines`` of every container's log in ``ns``;
    ``container_log(ns, pod, container)`` reads a log. Never raises for an API error: it says so."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    out = [f"--- events in {ns}"]
    try:
        events = core.list_namespaced_event(ns).items
        events.sort(key=lambda e: str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp))
        for e in events:
            obj = f"{e.involved_object.kind}/{e.involved_object.name}"
            out.append(f"{e.last_timestamp or e.event_time} {e.type} {e.reason} {obj}: {e.message}")
        out.append(f"--- deployments and replicasets in {ns}")
        for d in apps.list_namespaced_deployment(ns).items:
            s = d.status
            out.append(
                f"deployment {d.metadata.name}: generation={d.metadata.generation} observed="
                f"{s.observed_generation} paused={bool(d.spec.paused)} replicas={d.spec.replicas} "
                f"updated={s.updated_replicas} ready={s.ready_replicas} available={s.available_replicas}"
            )
        for rs in apps.list_namespaced_replica_set(ns).items:
            rev = (rs.metadata.annotations or {}).get("deployment.kubernetes.io/revision", "?")
            out.append(
                f"replicaset {rs.metadata.name}: revision={rev} desired={rs.spec.replicas} "
                f"current={rs.status.replicas} ready={rs.status.ready_replicas}{_owner(rs)}"
            )
        pods = core.list_namespaced_pod(ns).items
    except ApiException as e:
        return "\n".join([*out, f"(API error: {e.status} {e.reason})"])
    out.append(f"--- pods in {ns}")
    out += [describe_pod(p) + _owner(p) for p in pods]
    for p in pods:
        for c in p.spec.containers:
            tail = container_log(ns, p.metadata.name, c.name).splitlines()[-log_lines:]
            out.append(f"--- log {p.metadata.name}/{c.name} (last {log_lines} lines)")
            out += tail
    return "\n".join(out)
