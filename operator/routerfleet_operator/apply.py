"""The shell's one reconcile of a fleet: read the cluster, ``decide``, apply the decision in order.

    delay = await reconcile(kube, namespace, name, operator=OperatorRef(...))

The order (see ``rollout``): the owned objects and the Deployment first (from a stored
ControllerRevision when the decision rolls back), then the pod deletions, then the
``routerfleet.io/seeded`` gates through ``pods/status``, then ``status`` last, then the Events. Every
decision is made by the pure core; this module only moves data between it and the API server.
"""

from __future__ import annotations

import base64
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from routerfleet_kube import MERGE, STRATEGIC, ApiError, KubeClient

from .gateway import SERVICE_NAME_LABEL, PoolProblem, PoolView, engine_services, resolve_target
from .metrics import METRICS, OperatorMetrics
from .model import API_VERSION, FIELD_MANAGER, KIND, LABEL_FLEET, LABEL_REVISION, TOKEN_KEY, Phase
from .render import (
    OperatorRef,
    controller_revision_name,
    names,
    new_token,
    render_all,
    render_controller_revision,
    render_inference_pool,
    render_pod_template,
    render_secret,
    seeded_condition,
)
from .rollout import Decision, Event, PodView, decide, refused
from .spec import Fleet, SpecError, validate
from .verdicts import fetch_reports

log = logging.getLogger(__name__)
REVISION_HISTORY = 10  # ControllerRevisions kept per fleet (besides the current and update ones)
# An apply the API server refuses for what it says (400 BadRequest, 422 Invalid): the spec's doing.
SPEC_REFUSED = (400, 422)
POLL_BUSY_S = 2.0  # while a rollout is not Complete
POLL_IDLE_S = 60.0  # Complete: pod and fleet events wake the loop anyway


# ---- the fleet token ----------------------------------------------------------------------------------


def _token_of(secret: Mapping[str, Any] | None) -> str:
    data = (secret or {}).get("data") or {}
    try:
        return base64.b64decode(data.get(TOKEN_KEY) or "").decode().strip()
    except ValueError:
        return ""


async def ensure_token(kube: KubeClient, fleet: Fleet) -> tuple[str, list[Event]]:
    """The fleet token: the Secret's, or a new one when there is no Secret yet (created, never
    rotated). A Secret without a usable token is refilled, with a Warning (never silently)."""
    name = names(fleet).secret
    secret = await kube.get("Secret", fleet.namespace, name)
    if token := _token_of(secret):
        return token, []
    token = new_token()
    if secret is None:
        try:
            await kube.create(render_secret(fleet, token))
            return token, [Event("Normal", "TokenCreated", f"created the fleet token Secret {name}")]
        except ApiError as e:
            if e.status != 409:
                raise
            raced = _token_of(await kube.get("Secret", fleet.namespace, name))
            if raced:
                return raced, []
    await kube.apply(render_secret(fleet, token))
    msg = f"Secret {name} had no usable token; wrote a new one (routers restart to pick it up)"
    return token, [Event("Warning", "TokenReplaced", msg)]


# ---- ControllerRevisions ------------------------------------------------------------------------------


async def record_revision(
    kube: KubeClient, fleet: Fleet, template: Mapping[str, Any], keep: set[str]
) -> None:
    """Store the deployed template as a ControllerRevision (once per revision) and prune the history
    to REVISION_HISTORY, never dropping the revisions in ``keep``."""
    stored = await kube.list("ControllerRevision", fleet.namespace, f"{LABEL_FLEET}={fleet.name}")
    rev = template["metadata"]["labels"][LABEL_REVISION]
    name = controller_revision_name(fleet, rev)
    if not any(c["metadata"]["name"] == name for c in stored):
        number = max((int(c.get("revision") or 0) for c in stored), default=0) + 1
        try:
            stored.append(await kube.create(render_controller_revision(fleet, template, number)))
        except ApiError as e:
            if e.status != 409:
                raise
    keep = keep | {rev}
    prunable = sorted(
        (c for c in stored if (c["metadata"].get("labels") or {}).get(LABEL_REVISION) not in keep),
        key=lambda c: int(c.get("revision") or 0),
    )
    for c in prunable[: max(0, len(prunable) - REVISION_HISTORY)]:
        await kube.delete("ControllerRevision", fleet.namespace, c["metadata"]["name"])


async def stored_template(kube: KubeClient, fleet: Fleet, revision: str) -> dict[str, Any] | None:
    cr = await kube.get("ControllerRevision", fleet.namespace, controller_revision_name(fleet, revision))
    return ((cr or {}).get("data") or {}).get("template")


# ---- the InferencePool (spec.gateway) ------------------------------------------------------------------


async def sync_pool(kube: KubeClient, fleet: Fleet) -> PoolView | None:
    """Apply the fleet's InferencePool, its target resolved from the engines' Service and
    EndpointSlices, and return what its status says and how many replicas its picker Service lists
    ready (None without spec.gateway). A failure is a problem of the view, never of the reconcile: a
    gateway's trouble must not hold up the rollout."""
    if not fleet.spec.gateway.enabled:
        return None  # a pool of an earlier spec is pruned with the other optional objects
    e, n = fleet.spec.engines, names(fleet)
    applying = False
    try:
        slices = await kube.list("EndpointSlice", fleet.engines_namespace, e.label_selector())
        owners = engine_services(fleet, slices)
        services = {o: await kube.get("Service", fleet.engines_namespace, o) for o in owners}
        target = resolve_target(fleet, slices, services)
        applying = True
        pool = await kube.apply(render_inference_pool(fleet, target))
        applying = False
        picker_slices = f"{SERVICE_NAME_LABEL}={n.picker_service}"
        pickers = await kube.list("EndpointSlice", fleet.namespace, picker_slices)
    except PoolProblem as problem:
        return PoolView(problem=problem)
    except ApiError as err:
        if applying and err.status == 404:
            problem = PoolProblem(
                "CRDNotInstalled",
                "the InferencePool CRD (inference.networking.k8s.io/v1) is not installed: install the "
                "Gateway API Inference Extension's CRDs, or the chart's with gatewayApi.installCRDs=true",
            )
        elif applying and err.status in (400, 403, 422):
            problem = PoolProblem("PoolRefused", f"the API server refused it: {err}")
        else:
            log.warning("InferencePool %s/%s not synced: %s", fleet.namespace, n.pool, err)
            problem = PoolProblem("PoolSyncFailed", f"not synced: {err}")
        return PoolView(problem=problem)
    return PoolView.of(pool, pickers)


# ---- status -------------------------------------------------------------------------------------------


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) from ``old`` to ``new``: removed keys are null, nested objects
    are patched, lists are replaced. Empty when nothing changed."""
    out: dict[str, Any] = {}
    for k in old.keys() - new.keys():
        out[k] = None
    for k, v in new.items():
        o = old.get(k)
        if isinstance(v, Mapping) and isinstance(o, Mapping):
            sub = merge_patch(o, v)
            if sub:
                out[k] = sub
        elif o != v or k not in old:
            out[k] = v
    return out


def event_body(obj: Mapping[str, Any], ev: Event, now: datetime) -> dict[str, Any]:
    meta = obj["metadata"]
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{meta['name']}.{ev.key or secrets.token_hex(8)}",
            "namespace": meta["namespace"],
        },
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "type": ev.type,
        "reason": ev.reason,
        "message": ev.message[:1024],
        "source": {"component": FIELD_MANAGER},
        "reportingComponent": FIELD_MANAGER,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


async def post_events(
    kube: KubeClient, obj: Mapping[str, Any], events: Sequence[Event], now: datetime
) -> None:
    """Each event, awaited, under its key's name when it has one. Not ``kopf.event``: that one queues
    events for a background poster under generated names, so a keyed event (posted once, before the
    step it marks, even across an operator's death) could be posted twice or not yet, and it works only
    inside kopf's runtime, where ``reconcile`` need not run."""
    for ev in events:
        (log.warning if ev.type == "Warning" else log.info)("%s: %s", ev.reason, ev.message)
        try:
            await kube.create(event_body(obj, ev, now))
        except ApiError as e:  # an event is never worth failing a reconcile
            if not (ev.key and e.status == 409):  # a keyed event posted before, by a reconcile that died
                log.warning("event %s not posted: %s", ev.reason, e)


# ---- one reconcile ------------------------------------------------------------------------------------


async def apply_owned(
    kube: KubeClient,
    fleet: Fleet,
    obj: Mapping[str, Any],
    decision: Decision,
    token: str,
    operator: OperatorRef,
) -> list[Event]:
    """Step 1: every owned object, the Deployment last, with the decided template and ``paused``."""
    assert decision.deploy_revision is not None
    status = obj.get("status") or {}
    events: list[Event] = []
    template: Mapping[str, Any] | None
    if decision.rollback:
        template = await stored_template(kube, fleet, decision.deploy_revision)
        if template is None:
            events.append(
                Event(
                    "Warning",
                    "RevisionMissing",
                    f"ControllerRevision of {decision.deploy_revision} not found: Deployment left as is",
                )
            )
    else:
        template = render_pod_template(fleet)
        keep = {r for r in (status.get("currentRevision"), decision.deploy_revision) if r}
        await record_revision(kube, fleet, template, keep)
    manifests = render_all(
        fleet, token, operator=operator, template=template, paused=bool(decision.pause_deployment)
    )
    for m in manifests:
        if m["kind"] == "Deployment" and template is None:
            continue
        await kube.apply(m)
    phase = ((decision.status or {}).get("rollout") or {}).get("phase")
    prior_phase = (status.get("rollout") or {}).get("phase")
    generation = int(obj["metadata"].get("generation") or 0)
    if phase == Phase.COMPLETE.value and (
        prior_phase != Phase.COMPLETE.value or generation != status.get("observedGeneration")
    ):
        await prune_optional(kube, fleet, manifests)
    return events


# The kinds of the objects a spec may turn off (or rename): the PodDisruptionBudget, and the gateway's
# picker and gateway Services, Envoy ConfigMaps and InferencePool.
OPTIONAL_KINDS = ("PodDisruptionBudget", "Service", "ConfigMap", "InferencePool")


async def prune_optional(kube: KubeClient, fleet: Fleet, manifests: Sequence[Mapping[str, Any]]) -> None:
    """Delete the fleet's own objects of OPTIONAL_KINDS that the spec no longer renders: labelled with
    the fleet and owned by it (its uid), each deleted with that uid as a precondition, so another
    fleet's or a user's object of the same name is never touched. Run when a rollout completes (the
    pods of an earlier revision, and a rollback to one, may need them until then) and for a new spec
    once it has (a change that rolls nothing). What it may not list or delete is logged and left."""
    keep = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    if fleet.spec.gateway.enabled:
        keep.add(("InferencePool", names(fleet).pool))
    for kind in OPTIONAL_KINDS:
        try:
            objs = await kube.list(kind, fleet.namespace, f"{LABEL_FLEET}={fleet.name}")
        except ApiError as e:
            if e.status not in (403, 404):  # 404: the kind is not served (no InferencePool CRD)
                raise
            if e.status == 403:
                log.warning("cannot list %s to prune them: %s", kind, e)
            continue
        for o in objs:
            meta = o["metadata"]
            if (kind, meta["name"]) in keep or not _owned_by_uid(meta, fleet.uid):
                continue
            try:
                await kube.delete(kind, fleet.namespace, meta["name"], uid=meta.get("uid"))
                log.info("pruned %s %s/%s (no longer in the spec)", kind, fleet.namespace, meta["name"])
            except ApiError as e:
                if e.status != 403:
                    raise
                log.warning("cannot prune %s %s/%s: %s", kind, fleet.namespace, meta["name"], e)


def _owned_by_uid(meta: Mapping[str, Any], uid: str) -> bool:
    return bool(uid) and any(r.get("uid") == uid for r in meta.get("ownerReferences") or ())


async def reconcile(
    kube: KubeClient,
    namespace: str,
    name: str,
    *,
    operator: OperatorRef | None = None,
    now: datetime | None = None,
    metrics: OperatorMetrics | None = None,
) -> float | None:
    """One pass over one fleet. Returns the delay before the next pass (None: the fleet is gone).
    Counted and timed in ``metrics`` (default: the process's ``METRICS``) by result."""
    metrics = metrics or METRICS
    t0 = time.monotonic()
    result = "error"
    try:
        delay, result = await _reconcile(kube, namespace, name, operator, now, metrics)
        return delay
    finally:
        metrics.reconciled(result, time.monotonic() - t0)


async def _reconcile(
    kube: KubeClient,
    namespace: str,
    name: str,
    operator: OperatorRef | None,
    now: datetime | None,
    metrics: OperatorMetrics,
) -> tuple[float | None, str]:
    operator = operator or OperatorRef()
    obj = await kube.get("RouterFleet", namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        metrics.forget(namespace, name)
        return None, "gone"
    now = now or datetime.now(UTC)
    try:
        fleet: Fleet | None = Fleet.parse(obj)
        if validate(fleet):  # type: ignore[arg-type]
            fleet = None
    except SpecError:
        fleet = None

    events: list[Event] = []
    token = ""
    if fleet is not None:
        token, events = await ensure_token(kube, fleet)
    pods = await kube.list("Pod", namespace, f"{LABEL_FLEET}={name}")
    pods = [p for p in pods if _owned_by_fleet(p, name)]
    reports = await fetch_reports(pods, token) if token else {}
    views = [PodView.from_pod(p, reports.get(p["metadata"]["name"])) for p in pods]
    pool = await sync_pool(kube, fleet) if fleet is not None else None
    decision = decide(obj, views, now, pool)

    # 1. the owned objects and the Deployment (an invalid spec changes nothing)
    result = "ok" if fleet is not None else "invalid"
    if fleet is not None and decision.deploy_revision is not None:
        try:
            events += await apply_owned(kube, fleet, obj, decision, token, operator)
        except ApiError as e:
            if e.status not in SPEC_REFUSED:  # not the spec's doing (the API away, a conflict): retried
                raise
            decision, result = refused(obj, str(e), now), "invalid"  # nothing more this pass
    # 2. pod deletions (by UID: a recreated pod of the same name is not ours to delete)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    for pod in decision.delete:
        await kube.delete("Pod", namespace, pod, uid=uids.get(pod))
    # 3. the seeded gates, through pods/status (a strategic merge: conditions merge by type), each
    # after its event (keyed: posted again, never twice, if this process dies in between)
    actions = [e for e in decision.events if e.key]
    await post_events(kube, obj, actions, now)
    events += [e for e in decision.events if not e.key]
    by_name = {v.name: v for v in views}
    for pod in decision.admit:
        report = by_name[pod].report
        cond = seeded_condition(report.verdict.value if report else "disabled", now)
        try:
            await kube.patch(
                "Pod", namespace, pod, {"status": {"conditions": [cond]}}, ctype=STRATEGIC, sub="status"
            )
        except ApiError as e:
            if e.status != 404:
                raise
    # 4. status last, guarded by the resourceVersion it was decided from
    if decision.status is not None:
        diff = merge_patch(obj.get("status") or {}, decision.status)
        if diff:
            body = {"metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]}, "status": diff}
            try:
                await kube.patch("RouterFleet", namespace, name, body, ctype=MERGE, sub="status")
            except ApiError as e:
                if e.status != 409:
                    raise
                log.info("%s/%s changed while deciding: deciding again", namespace, name)
                await post_events(kube, obj, events, now)
                _observe(metrics, namespace, name, obj, fleet, decision, by_name, None)
                return 0.2, "conflict"
    await post_events(kube, obj, events, now)
    _observe(metrics, namespace, name, obj, fleet, decision, by_name, decision.status)
    return next_delay(decision), result


async def release_foreign(kube: KubeClient, obj: Mapping[str, Any]) -> list[str]:
    """A deleted fleet's Role and RoleBinding in the engines' namespace, when that is another one: an
    ownerReference cannot cross namespaces, so the garbage collector never removes them. Idempotent
    (gone is fine); returns what it deleted, as namespace/kind/name."""
    try:
        fleet = Fleet.parse(obj)
    except SpecError:
        return []
    if fleet.engines_namespace == fleet.namespace:
        return []  # owned: the garbage collector removes them with the fleet
    n = names(fleet)
    deleted = []
    for kind, name in (("RoleBinding", n.role_binding), ("Role", n.role)):
        if await kube.delete(kind, fleet.engines_namespace, name):
            deleted.append(f"{fleet.engines_namespace}/{kind}/{name}")
    return deleted


def _observe(
    metrics: OperatorMetrics,
    namespace: str,
    name: str,
    obj: Mapping[str, Any],
    fleet: Fleet | None,
    decision: Decision,
    views: Mapping[str, PodView],
    status: Mapping[str, Any] | None,
) -> None:
    """The applied decision into the metrics (its admissions happened; its status was written, or
    ``status`` is None)."""
    admitted = []
    for pod in decision.admit:
        report = views[pod].report
        admitted.append(report.verdict.value if report else "disabled")
    desired = fleet.spec.replicas if fleet is not None else None
    metrics.observe(namespace, name, obj, status, [e.reason for e in decision.events], admitted, desired)


def _owned_by_fleet(pod: Mapping[str, Any], name: str) -> bool:
    """A pod of the fleet's Deployment (its ReplicaSets are named <deployment>-<hash>)."""
    refs = (pod.get("metadata") or {}).get("ownerReferences") or ()
    return any(r.get("kind") == "ReplicaSet" and r.get("name", "").startswith(f"{name}-") for r in refs)


def next_delay(decision: Decision) -> float:
    phase = ((decision.status or {}).get("rollout") or {}).get("phase")
    busy = phase != Phase.COMPLETE.value or decision.admit or decision.requeue_after_s is not None
    delay = POLL_BUSY_S if busy else POLL_IDLE_S
    if decision.requeue_after_s is not None:
        delay = min(delay, decision.requeue_after_s)
    return max(0.2, delay)
