"""The desired state of a fleet, rendered by pure functions of its spec.

Every ``render_*`` returns one manifest (a dict) for server-side apply with one field manager
(``model.FIELD_MANAGER``). Everything in the fleet's namespace carries an ownerReference to the
RouterFleet, so deleting the fleet deletes it all. The one exception: with ``engines.namespace`` set to
another namespace, the Role and RoleBinding that let the routers watch the engines' EndpointSlices live
there, where an ownerReference cannot point across namespaces; they carry the fleet's labels and the
shell deletes them with the fleet.

The pod template's hash is the fleet's *revision*: pods carry it as a label, the rollout decision
compares revisions, and a ControllerRevision keeps each deployed template for a rollback.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .model import (
    ANNOTATION_RESTARTED_AT,
    API_VERSION,
    ENVOY_DIR,
    ENVOY_KEY,
    ENVOY_VOLUME,
    EPP_PORT,
    EPP_PORT_NAME,
    FIELD_MANAGER,
    GATEWAY_PORT,
    GATEWAY_PORT_NAME,
    GROUP,
    HTTP_PORT,
    HTTP_PORT_NAME,
    INTERNAL_PORT,
    INTERNAL_PORT_NAME,
    KIND,
    LABEL_COMPONENT,
    LABEL_FLEET,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_REVISION,
    METRICS_PORT,
    METRICS_PORT_NAME,
    POOL_API_VERSION,
    POOL_KIND,
    ROUTER_APP,
    SEEDED,
    SESSION_STORE_DIR,
    SESSION_STORE_KEY,
    SESSION_STORE_VOLUME,
    TOKEN_DIR,
    TOKEN_KEY,
    TOKEN_VOLUME,
    TOKENIZER_DIR,
    TOKENIZER_VOLUME,
    Verdict,
)
from .spec import Fleet
from .standalone import ROUTER_DRAIN_S, envoy_command, envoy_config

LABEL_FLEET_NAMESPACE = f"{GROUP}/fleet-namespace"  # on the cross-namespace Role/RoleBinding

# Probe budgets. The startup probe asks /readyz: it passes only once bootstrap has settled (and the
# seed-required hold, if any, has opened), so its budget is the bootstrap hold plus a margin for
# engine discovery and the first KV subscription. Liveness starts only after it, so a slow bootstrap
# is never a restart. A startup probe shorter than the bootstrap would restart pods mid-bootstrap.
STARTUP_PERIOD_S = 5
STARTUP_MARGIN_S = 120
READINESS_PERIOD_S = 5
LIVENESS_PERIOD_S = 10


@dataclass(frozen=True)
class OperatorRef:
    """Where the operator runs: the NetworkPolicy admits it to the internal port (it reads each
    replica's /internal/bootstrap there). From the operator's own configuration, not the spec."""

    namespace: str = "routerfleet-system"
    pod_labels: Mapping[str, str] = field(default_factory=lambda: {LABEL_NAME: "routerfleet-operator"})


@dataclass(frozen=True)
class Names:
    deployment: str
    service: str
    peer_service: str
    service_account: str
    role: str
    role_binding: str
    pdb: str
    secret: str
    network_policy: str
    picker_service: str  # spec.gateway: the routers' picker port, the pool's endpointPickerRef
    pool: str  # spec.gateway: the InferencePool
    gateway_service: str  # spec.gateway.standalone: the Envoys beside the routers
    # spec.gateway.standalone: their ConfigMap, named by its content, so a change to it is a new revision
    # and the pods of the old one keep theirs until the rollout completes (apply.prune_optional); "" without
    envoy_config: str


def names(fleet: Fleet) -> Names:
    n = fleet.name
    role = (
        f"{n}-router" if fleet.engines_namespace == fleet.namespace else f"routerfleet-{fleet.namespace}-{n}"
    )
    return Names(
        deployment=n,
        service=n,
        peer_service=f"{n}-peers",
        service_account=f"{n}-router",
        role=role,
        role_binding=role,
        pdb=n,
        secret=f"{n}-internal-token",
        network_policy=f"{n}-internal",
        picker_service=f"{n}-epp",
        pool=fleet.pool_name,
        gateway_service=f"{n}-gateway",
        # rendered and hashed only when the fleet runs the Envoys (names() is called all through a reconcile)
        envoy_config=(
            f"{n}-envoy-{_digest(envoy_config_text(fleet))}" if fleet.spec.gateway.standalone.enabled else ""
        ),
    )


def selector_labels(fleet: Fleet) -> dict[str, str]:
    return {LABEL_FLEET: fleet.name}


def status_selector(fleet: Fleet) -> str:
    """``status.selector``: the scale subresource's label selector, as a string."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(fleet).items())


def labels(fleet: Fleet) -> dict[str, str]:
    return {
        LABEL_NAME: ROUTER_APP,
        LABEL_INSTANCE: fleet.name,
        LABEL_MANAGED_BY: FIELD_MANAGER,
        LABEL_FLEET: fleet.name,
    }


def owner_reference(fleet: Fleet) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": fleet.name,
        "uid": fleet.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _meta(fleet: Fleet, name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels(fleet),
        "ownerReferences": [owner_reference(fleet)],
    }
    meta.update(extra)
    return meta


# ---- the router's command line ------------------------------------------------------------------------


def tokenizer_arg(fleet: Fleet) -> str:
    tok = fleet.spec.router.tokenizer
    if tok.source == "Path":
        return tok.path or ""
    if tok.source == "ConfigMap":
        return TOKENIZER_DIR
    if tok.source == "Engine":
        return "engine"
    return "bytes"


def router_args(fleet: Fleet) -> list[str]:
    """The flags of ``routerfleet-router``, derived from the spec; then the user's extraArgs. The router
    listens on all addresses, like any container (an extraArgs ``--host=$(POD_IP)`` comes later and wins)."""
    s = fleet.spec
    e = s.engines
    args = [
        "--host", "0.0.0.0",
        "--port", str(HTTP_PORT),
        "--metrics-port", str(METRICS_PORT),
        "--log-level", s.router.log_level,
        "--policy", s.router.policy,
        "--block-size", str(s.router.block_size),
        "--tokenizer", tokenizer_arg(fleet),
        "--k8s-selector", e.label_selector(),
        "--k8s-namespace", fleet.engines_namespace,
        "--k8s-http-port", str(e.http_port),
    ]  # fmt: skip
    if e.kv_port is not None:
        args += ["--k8s-kv-port", str(e.kv_port)]
    if e.replay_port is not None:
        args += ["--k8s-replay-port", str(e.replay_port)]
    args += ["--k8s-dp-size", str(e.dp_size)]
    if e.topic:
        args += ["--k8s-topic", e.topic]
    pd = e.disaggregation
    if pd is not None:  # the engines' roles; a prefill engine pairs with a decode engine of its revision
        if pd.role_label:
            args += ["--k8s-role-label", pd.role_label]
        else:
            args += ["--k8s-prefill-selector", f"kubernetes.io/service-name={pd.prefill_service_name}"]
        args += ["--pd-protocol", pd.protocol, "--pd-threshold-tokens", str(pd.threshold_tokens)]
        args += ["--k8s-revision-label", pd.revision_label]
    # The internal port is always on: the operator reads /internal/bootstrap there, bootstrap or not.
    # The siblings always find each other: they share their load there (docs/fleet-load.md), and seed
    # each other's index when bootstrap is on.
    args += [
        "--internal-port", str(INTERNAL_PORT),
        "--internal-token-file", f"{TOKEN_DIR}/{TOKEN_KEY}",
        "--kv-peer-selector", f"kubernetes.io/service-name={names(fleet).peer_service}",
        "--kv-peer-port", INTERNAL_PORT_NAME,
    ]  # fmt: skip
    store = s.router.session_store
    if store is not None:
        args += ["--session-store", store.url]
        if store.password_secret:
            args += ["--session-store-password-file", f"{SESSION_STORE_DIR}/{SESSION_STORE_KEY}"]
    t = s.router.tracing
    if t is not None:
        # The ratio always, not the router's default: what the spec says is what the pods run.
        args += ["--otlp-traces-endpoint", t.endpoint, "--trace-sample-ratio", str(t.sample_ratio)]
    b = s.bootstrap
    if b.enabled:
        args += ["--kv-bootstrap-timeout-ms", str(round(b.timeout_s * 1000))]
        if b.seed_required:
            args.append("--kv-bootstrap-seed-required")
    else:
        args.append("--no-kv-bootstrap")
    g = s.gateway
    if g.enabled:
        # The pool's picker: the pool's InferenceObjectives make requests sheddable (docs/gateway.md).
        args += ["--epp-port", str(EPP_PORT), "--epp-pool", fleet.pool_name]
        if not g.tls:
            args.append("--epp-plaintext")
    if g.standalone.enabled:
        # On SIGTERM the Envoy beside it takes requests until it stops: the picker answers until then.
        args += ["--shutdown-drain-ms", str(ROUTER_DRAIN_S * 1000)]
    return args + list(s.router.extra_args)


# ---- the pod template and its revision ----------------------------------------------------------------


def startup_failure_threshold(fleet: Fleet) -> int:
    b = fleet.spec.bootstrap
    hold = b.hold_s if b.enabled else 0.0
    return math.ceil((hold + STARTUP_MARGIN_S) / STARTUP_PERIOD_S)


def _probes(fleet: Fleet) -> dict[str, Any]:
    def get(path: str) -> dict[str, Any]:
        return {"httpGet": {"path": path, "port": HTTP_PORT_NAME}}

    return {
        "startupProbe": {
            **get("/readyz"),
            "periodSeconds": STARTUP_PERIOD_S,
            "timeoutSeconds": 3,
            "failureThreshold": startup_failure_threshold(fleet),
        },
        "readinessProbe": {
            **get("/readyz"),
            "periodSeconds": READINESS_PERIOD_S,
            "timeoutSeconds": 3,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            **get("/healthz"),
            "periodSeconds": LIVENESS_PERIOD_S,
            "timeoutSeconds": 5,
            "failureThreshold": 3,
        },
    }


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _container(fleet: Fleet) -> dict[str, Any]:
    r = fleet.spec.router
    mounts: list[dict[str, Any]] = [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}]
    if r.tokenizer.source == "ConfigMap":
        mounts.append({"name": TOKENIZER_VOLUME, "mountPath": TOKENIZER_DIR, "readOnly": True})
    if r.session_store is not None and r.session_store.password_secret:
        mounts.append({"name": SESSION_STORE_VOLUME, "mountPath": SESSION_STORE_DIR, "readOnly": True})
    c: dict[str, Any] = {
        "name": "router",
        "image": r.image,
        "command": ["routerfleet-router"],
        "args": router_args(fleet),
        "ports": [
            {"name": HTTP_PORT_NAME, "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": INTERNAL_PORT_NAME, "containerPort": INTERNAL_PORT, "protocol": "TCP"},
            {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT, "protocol": "TCP"},
            *_picker_ports(fleet, "containerPort", EPP_PORT),
        ],
        # POD_NAME/POD_IP let a replica leave itself out of its peer set.
        "env": [
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("POD_IP", "status.podIP"),
            *(dict(e) for e in r.env),
        ],
        "volumeMounts": mounts + [dict(m) for m in r.volume_mounts],
        **_probes(fleet),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if r.image_pull_policy:
        c["imagePullPolicy"] = r.image_pull_policy
    if r.resources:
        c["resources"] = dict(r.resources)
    return c


def _picker_ports(fleet: Fleet, key: str, number: int) -> list[dict[str, Any]]:
    """The picker port, in a container's or a Service's port list, when the fleet serves a gateway."""
    if not fleet.spec.gateway.enabled:
        return []
    return [{"name": EPP_PORT_NAME, key: number, "protocol": "TCP"}]


def envoy_config_text(fleet: Fleet) -> str:
    """The standalone gateway's envoy.yaml (JSON, which is YAML), as its ConfigMap holds it."""
    return json.dumps(envoy_config(fleet), indent=1, sort_keys=True) + "\n"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _envoy_containers(fleet: Fleet) -> list[dict[str, Any]]:
    """The standalone gateway's Envoy (none without spec.gateway.standalone). It is Ready when it
    listens; the pod is Ready only when the router is too (and seeded), so the gateway Service sends only
    to a seeded replica's Envoy."""
    st = fleet.spec.gateway.standalone
    if not st.enabled:
        return []
    return [
        {
            "name": "envoy",
            "image": st.image,
            "command": envoy_command(),
            "ports": [{"name": GATEWAY_PORT_NAME, "containerPort": GATEWAY_PORT, "protocol": "TCP"}],
            "volumeMounts": [{"name": ENVOY_VOLUME, "mountPath": ENVOY_DIR, "readOnly": True}],
            "readinessProbe": {
                "tcpSocket": {"port": GATEWAY_PORT_NAME},
                "periodSeconds": READINESS_PERIOD_S,
                "timeoutSeconds": 3,
            },
            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        }
    ]


def _pod_template_unhashed(fleet: Fleet) -> dict[str, Any]:
    r = fleet.spec.router
    n = names(fleet)
    annotations = dict(r.pod_annotations)
    if restarted := fleet.annotations.get(ANNOTATION_RESTARTED_AT):
        annotations[ANNOTATION_RESTARTED_AT] = restarted
    volumes: list[dict[str, Any]] = [
        {
            "name": TOKEN_VOLUME,
            "secret": {"secretName": n.secret, "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}]},
        }
    ]
    if r.tokenizer.source == "ConfigMap":
        volumes.append({"name": TOKENIZER_VOLUME, "configMap": {"name": r.tokenizer.config_map}})
    store = r.session_store
    if store is not None and store.password_secret:
        items = [{"key": store.password_key, "path": SESSION_STORE_KEY}]
        volumes.append(
            {"name": SESSION_STORE_VOLUME, "secret": {"secretName": store.password_secret, "items": items}}
        )
    if fleet.spec.gateway.standalone.enabled:
        volumes.append({"name": ENVOY_VOLUME, "configMap": {"name": n.envoy_config}})
    volumes += [dict(v) for v in r.volumes]
    spec: dict[str, Any] = {
        "serviceAccountName": n.service_account,
        "readinessGates": [{"conditionType": SEEDED}],
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "containers": [_container(fleet), *_envoy_containers(fleet)],
        "volumes": volumes,
    }
    sched = r.scheduling
    if sched.node_selector:
        spec["nodeSelector"] = dict(sched.node_selector)
    if sched.tolerations:
        spec["tolerations"] = [dict(t) for t in sched.tolerations]
    if sched.affinity:
        spec["affinity"] = dict(sched.affinity)
    if sched.topology_spread_constraints:
        spec["topologySpreadConstraints"] = [dict(t) for t in sched.topology_spread_constraints]
    if sched.priority_class_name:
        spec["priorityClassName"] = sched.priority_class_name
    if r.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in r.image_pull_secrets]
    meta: dict[str, Any] = {
        "labels": {**r.pod_labels, **labels(fleet), LABEL_COMPONENT: "router"},
    }
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def template_hash(template: Mapping[str, Any]) -> str:
    """A stable short hash of a pod template (its canonical JSON, without the revision label)."""
    body = json.loads(json.dumps(template))
    body.get("metadata", {}).get("labels", {}).pop(LABEL_REVISION, None)
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


def render_pod_template(fleet: Fleet) -> dict[str, Any]:
    """The router pods' template, labelled with its own revision."""
    template = _pod_template_unhashed(fleet)
    template["metadata"]["labels"][LABEL_REVISION] = template_hash(template)
    return template


def revision_of(fleet: Fleet) -> str:
    """The revision the spec asks for (the rollout's update revision)."""
    return template_hash(_pod_template_unhashed(fleet))


def controller_revision_name(fleet: Fleet, revision: str) -> str:
    return f"{fleet.name}-{revision}"


def render_controller_revision(fleet: Fleet, template: Mapping[str, Any], number: int) -> dict[str, Any]:
    """Keeps a deployed template, so a rollback can restore it after the spec has moved on.
    ``number`` is the ControllerRevision's ordinal (the shell's: one more than the highest kept)."""
    revision = template_hash(template)
    meta = _meta(fleet, controller_revision_name(fleet, revision))
    meta["labels"] = {**meta["labels"], LABEL_REVISION: revision}
    return {
        "apiVersion": "apps/v1",
        "kind": "ControllerRevision",
        "metadata": meta,
        "data": {"template": dict(template)},
        "revision": number,
    }


# ---- the workload -------------------------------------------------------------------------------------


def render_deployment(
    fleet: Fleet, *, template: Mapping[str, Any] | None = None, paused: bool = False
) -> dict[str, Any]:
    """The router Deployment: surge-only rolling updates (maxUnavailable 0), so an old replica goes
    only once a new one is Ready, which it is only once the operator set its seeded gate. ``template``
    is the revision to run (default: the spec's; a rollback passes the stored one); ``paused`` comes
    from the rollout decision."""
    s = fleet.spec
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(fleet, names(fleet).deployment),
        "spec": {
            "replicas": s.replicas,
            "paused": paused,
            "selector": {"matchLabels": selector_labels(fleet)},
            "minReadySeconds": s.rollout.min_ready_seconds,
            "progressDeadlineSeconds": int(s.rollout.progress_deadline_s),
            "revisionHistoryLimit": 3,
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": s.rollout.max_surge, "maxUnavailable": 0},
            },
            "template": dict(template) if template is not None else render_pod_template(fleet),
        },
    }


# ---- identity and access ------------------------------------------------------------------------------


def render_service_account(fleet: Fleet) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(fleet, names(fleet).service_account),
    }


def _engines_meta(fleet: Fleet, name: str) -> dict[str, Any]:
    """Metadata of the RBAC objects in the engines' namespace: owned when it is the fleet's."""
    if fleet.engines_namespace == fleet.namespace:
        return _meta(fleet, name)
    return {
        "name": name,
        "namespace": fleet.engines_namespace,
        "labels": {**labels(fleet), LABEL_FLEET_NAMESPACE: fleet.namespace},
    }


def render_role(fleet: Fleet) -> dict[str, Any]:
    """Read access to EndpointSlices in the engines' namespace (engines and peers), and ``get`` on pods
    there, nothing more. The pods rule serves ``--k8s-storage-annotation`` (set through
    ``spec.router.extraArgs``) and a disaggregated fleet's revision and role labels: one GET per new
    engine pod, never list/watch. It is unconditional so enabling that flag needs no RBAC change. A
    gateway's picker also follows its pool's InferenceObjectives (list and watch)."""
    rules: list[dict[str, Any]] = [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
    ]
    if fleet.spec.gateway.enabled:
        rules.append(
            {
                "apiGroups": ["inference.networking.x-k8s.io"],
                "resources": ["inferenceobjectives"],
                "verbs": ["get", "list", "watch"],
            }
        )
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _engines_meta(fleet, names(fleet).role),
        "rules": rules,
    }


def render_role_binding(fleet: Fleet) -> dict[str, Any]:
    n = names(fleet)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _engines_meta(fleet, n.role_binding),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": n.role},
        "subjects": [{"kind": "ServiceAccount", "name": n.service_account, "namespace": fleet.namespace}],
    }


def new_token() -> str:
    """A fresh fleet token (the shell calls this once, when the Secret does not exist yet)."""
    return secrets.token_urlsafe(32)


def render_secret(fleet: Fleet, token: str) -> dict[str, Any]:
    """The fleet's internal bearer token: siblings and the operator present it on the internal port."""
    if not token.strip():
        raise ValueError("the fleet token must not be empty (an empty token would authorize anyone)")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(fleet, names(fleet).secret),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


# ---- the network ------------------------------------------------------------------------------------


def render_service(fleet: Fleet) -> dict[str, Any]:
    """The public Service: only Ready pods (so only seeded ones) get traffic."""
    svc = fleet.spec.service
    meta = _meta(fleet, names(fleet).service)
    meta["labels"] = {**svc.labels, **meta["labels"]}
    if svc.annotations:
        meta["annotations"] = dict(svc.annotations)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "type": svc.type,
            "selector": selector_labels(fleet),
            "ports": [
                {"name": HTTP_PORT_NAME, "port": svc.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def _port_service(fleet: Fleet, name: str, port_name: str, port: int) -> dict[str, Any]:
    """A ClusterIP Service of the fleet's Ready pods with one port, to the container port of that name."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(fleet, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(fleet),
            "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}],
        },
    }


def render_picker_service(fleet: Fleet) -> dict[str, Any] | None:
    """The Service the InferencePool's endpointPickerRef names (None without spec.gateway). Only Ready
    pods are in it, so a new replica picks for the gateway only once it is seeded, as it serves."""
    g = fleet.spec.gateway
    if not g.enabled:
        return None
    return _port_service(fleet, names(fleet).picker_service, EPP_PORT_NAME, g.picker_port)


def render_gateway_service(fleet: Fleet) -> dict[str, Any] | None:
    """The standalone gateway's Service: the Envoys beside the Ready (seeded) routers."""
    st = fleet.spec.gateway.standalone
    if not st.enabled:
        return None
    return _port_service(fleet, names(fleet).gateway_service, GATEWAY_PORT_NAME, st.port)


def render_envoy_config_map(fleet: Fleet) -> dict[str, Any] | None:
    """The standalone gateway's Envoy configuration (standalone.py)."""
    if not fleet.spec.gateway.standalone.enabled:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(fleet, names(fleet).envoy_config),
        "data": {ENVOY_KEY: envoy_config_text(fleet)},
    }


@dataclass(frozen=True)
class PoolTarget:
    """What an InferencePool selects: the engine pods' labels and the ports a gateway sends to
    (``gateway.resolve_target`` reads them off the engines' Service and EndpointSlices)."""

    selector: Mapping[str, str]
    ports: tuple[int, ...]


def render_inference_pool(fleet: Fleet, target: PoolTarget) -> dict[str, Any]:
    """The InferencePool whose endpoint picker is the fleet (its picker Service), over the engines."""
    g = fleet.spec.gateway
    n = names(fleet)
    return {
        "apiVersion": POOL_API_VERSION,
        "kind": POOL_KIND,
        "metadata": _meta(fleet, n.pool),
        "spec": {
            "selector": {"matchLabels": dict(target.selector)},
            "targetPorts": [{"number": p} for p in target.ports],
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": n.picker_service,
                "port": {"number": g.picker_port},
                "failureMode": g.failure_mode,
            },
        },
    }


def render_peer_service(fleet: Fleet) -> dict[str, Any]:
    """The headless peer Service whose EndpointSlices the routers watch (--kv-peer-selector). Only
    Ready replicas are listed as ready, so a booting replica never seeds from another booting one."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(fleet, names(fleet).peer_service),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(fleet),
            "ports": [
                {
                    "name": INTERNAL_PORT_NAME,
                    "port": INTERNAL_PORT,
                    "targetPort": INTERNAL_PORT_NAME,
                    "protocol": "TCP",
                }
            ],
        },
    }


def render_network_policy(fleet: Fleet, operator: OperatorRef | None = None) -> dict[str, Any]:
    """The internal port only from the fleet's own pods and the operator; the public, metrics and picker
    ports from anyone (Prometheus and a gateway's data plane may run anywhere; the metrics port is in no
    Service: narrow them with a policy of your own, docs/security.md)."""
    op = operator or OperatorRef()
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(fleet, names(fleet).network_policy),
        "spec": {
            "podSelector": {"matchLabels": selector_labels(fleet)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "ports": [{"port": INTERNAL_PORT_NAME, "protocol": "TCP"}],
                    "from": [
                        {"podSelector": {"matchLabels": selector_labels(fleet)}},
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": op.namespace}
                            },
                            "podSelector": {"matchLabels": dict(op.pod_labels)},
                        },
                    ],
                },
                {
                    "ports": [
                        {"port": HTTP_PORT_NAME, "protocol": "TCP"},
                        {"port": METRICS_PORT_NAME, "protocol": "TCP"},
                        *({"port": p["name"], "protocol": "TCP"} for p in _picker_ports(fleet, "port", 0)),
                        *(
                            [{"port": GATEWAY_PORT_NAME, "protocol": "TCP"}]
                            if fleet.spec.gateway.standalone.enabled
                            else []
                        ),
                    ]
                },
            ],
        },
    }


def render_pdb(fleet: Fleet) -> dict[str, Any] | None:
    """The PodDisruptionBudget (None when disabled). Unhealthy pods (a held, unseeded one) may always be
    evicted, so a held pod never blocks a node drain."""
    d = fleet.spec.disruption
    if not d.enabled:
        return None
    spec: dict[str, Any] = {
        "selector": {"matchLabels": selector_labels(fleet)},
        "unhealthyPodEvictionPolicy": "AlwaysAllow",
    }
    if d.min_available is not None:
        spec["minAvailable"] = d.min_available
    else:
        spec["maxUnavailable"] = 1 if d.max_unavailable is None else d.max_unavailable
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(fleet, names(fleet).pdb),
        "spec": spec,
    }


def render_all(
    fleet: Fleet,
    token: str,
    *,
    operator: OperatorRef | None = None,
    template: Mapping[str, Any] | None = None,
    paused: bool = False,
) -> list[dict[str, Any]]:
    """Every manifest of the fleet, in apply order (the Deployment last: what it mounts exists first)."""
    out = [
        render_service_account(fleet),
        render_role(fleet),
        render_role_binding(fleet),
        render_secret(fleet, token),
        render_service(fleet),
        render_peer_service(fleet),
        render_picker_service(fleet),
        render_gateway_service(fleet),
        render_envoy_config_map(fleet),
        render_network_policy(fleet, operator),
        render_pdb(fleet),
        render_deployment(fleet, template=template, paused=paused),
    ]
    return [m for m in out if m is not None]


# ---- the pod's readiness gate -------------------------------------------------------------------------


def _gate_reason(verdict: str) -> str:
    return "Verdict" + ("".join(w.capitalize() for w in verdict.split("_")) or "Unknown")


_GATE_VERDICTS = {_gate_reason(v.value): v for v in Verdict}


def seeded_condition(verdict: str, now: datetime) -> dict[str, Any]:
    """The pod condition that opens the readiness gate (PATCHed into pods/status; never set back). It is
    also the member's history: the verdict it was seeded with, and when (``seeded_verdict``)."""
    return {
        "type": SEEDED,
        "status": "True",
        "reason": _gate_reason(verdict),
        "message": f"bootstrap verdict {verdict} passed the fleet's policy",
        "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def seeded_verdict(condition: Mapping[str, Any]) -> Verdict | None:
    """The verdict a pod's gate was opened with (None: not opened, or by something else)."""
    if condition.get("status") != "True":
        return None
    return _GATE_VERDICTS.get(condition.get("reason", ""))
