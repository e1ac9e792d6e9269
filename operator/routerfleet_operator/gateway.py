"""The fleet behind a Gateway (``spec.gateway``): the InferencePool's target, resolved from the engines'
own objects, and the ``GatewayReady`` condition, read off the pool's status. Pure functions; the shell
(``apply.sync_pool``) reads the objects and applies the pool.

The pool selects pods by labels and sends to port numbers, where the fleet names its engines by their
Service (or their EndpointSlices' labels) and a port that may be a name. So the pool's selector is the
engines' Service's pod selector, and its ports the numbers the EndpointSlices resolve the named port to
(``spec.gateway.engineSelector`` and ``targetPorts`` say them outright, for engines without a Service
selector). Resolved on every reconcile, the pool follows the engines' Service.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .render import PoolTarget
from .spec import Fleet

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MAX_TARGET_PORTS = 8  # the InferencePool CRD's maxItems
CONDITION = "GatewayReady"


class PoolProblem(Exception):
    """Why the pool is not applied as the fleet asks (a ``GatewayReady`` reason and message)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PoolProblem) and (self.reason, self.message) == (other.reason, other.message)

    __hash__ = Exception.__hash__


def engine_services(fleet: Fleet, slices: Iterable[Mapping[str, Any]]) -> set[str]:
    """The Services the engines belong to: the one named, else those of their EndpointSlices."""
    if fleet.spec.engines.service_name:
        return {fleet.spec.engines.service_name}
    labels = ((s.get("metadata") or {}).get("labels") or {} for s in slices)
    return {owner for owner in (lab.get(SERVICE_NAME_LABEL) for lab in labels) if owner}


def resolve_target(
    fleet: Fleet, slices: Iterable[Mapping[str, Any]], services: Mapping[str, Mapping[str, Any] | None]
) -> PoolTarget:
    """The pool's selector and ports from the engines' EndpointSlices (those ``engines`` selects) and
    the Services they belong to (by name; None: not found). Raises PoolProblem."""
    g, e = fleet.spec.gateway, fleet.spec.engines
    slices = list(slices)
    selector = dict(g.engine_selector)
    if not selector:
        owners = sorted(engine_services(fleet, slices))
        if not owners:
            raise PoolProblem("EnginesNotFound", "no EndpointSlice of the engines yet: nothing to select")
        found = []
        for name in owners:
            svc = services.get(name)
            if svc is None:
                raise PoolProblem("EnginesNotFound", f"the engines' Service {name} does not exist")
            found.append(dict((svc.get("spec") or {}).get("selector") or {}))
        if any(not s for s in found) or any(s != found[0] for s in found):
            raise PoolProblem(
                "EngineSelectorUnknown",
                f"the engines' Services ({', '.join(owners)}) do not select their pods by one set of labels:"
                " set spec.gateway.engineSelector",
            )
        selector = found[0]
    if isinstance(e.http_port, int):
        picked = {e.http_port}
    else:  # the numbers the routers pick the engines on
        picked = {
            p["port"]
            for s in slices
            for p in s.get("ports") or ()
            if p.get("name") == e.http_port and isinstance(p.get("port"), int)
        }
    ports = g.target_ports
    if ports and not picked <= set(ports):
        missing = ", ".join(str(p) for p in sorted(picked - set(ports)))
        raise PoolProblem(
            "TargetPortsUnpicked",
            f"spec.gateway.targetPorts does not list {missing}, the engines' port {e.http_port!r} the routers"
            " pick them on: a pick there would go to no endpoint of the pool",
        )
    if not ports:
        ports = tuple(sorted(picked))
        if not ports:
            raise PoolProblem(
                "EnginesNotFound",
                f"no EndpointSlice of the engines resolves their port {e.http_port!r} to a number yet",
            )
        if len(ports) > MAX_TARGET_PORTS:
            raise PoolProblem(
                "EngineSelectorUnknown",
                f"the engines' port {e.http_port!r} is {len(ports)} numbers, more than an InferencePool"
                f" takes ({MAX_TARGET_PORTS})",
            )
    return PoolTarget(selector=selector, ports=tuple(ports))


@dataclass(frozen=True)
class ParentView:
    """One Gateway's word on the pool (an entry of ``status.parents``)."""

    gateway: str  # namespace/name
    accepted: str  # the Accepted condition's status: True, False or Unknown (absent)
    resolved: str  # ResolvedRefs: True, False or Unknown
    message: str


@dataclass(frozen=True)
class PoolView:
    """What the shell learned applying the pool: a problem that kept it from being applied, or the
    Gateways that have taken it up."""

    problem: PoolProblem | None = None
    parents: tuple[ParentView, ...] = ()
    pickers: int = 0  # replicas the picker Service lists ready (seeded, and of a revision that picks)

    @classmethod
    def of(cls, pool: Mapping[str, Any], picker_slices: Iterable[Mapping[str, Any]] = ()) -> PoolView:
        """The pool as applied, and the EndpointSlices of its picker Service."""
        # Replicas, not addresses: a dual-stack pod is in two slices (one per family). A ready
        # condition absent is ready, as the EndpointSlice API reads it.
        ready = {
            (ep.get("targetRef") or {}).get("uid") or tuple(ep.get("addresses") or ())
            for s in picker_slices
            for ep in s.get("endpoints") or ()
            if (ep.get("conditions") or {}).get("ready") is not False
        }
        parents = []
        for p in (pool.get("status") or {}).get("parents") or ():
            ref = p.get("parentRef") or {}
            conds = {c.get("type"): c for c in p.get("conditions") or ()}
            acc, res = conds.get("Accepted") or {}, conds.get("ResolvedRefs") or {}
            bad = next((c for c in (acc, res) if c.get("status") == "False"), acc)
            namespace = ref.get("namespace") or (pool.get("metadata") or {}).get("namespace", "")
            parents.append(
                ParentView(
                    gateway=f"{namespace}/{ref.get('name', '')}",
                    accepted=acc.get("status") or "Unknown",
                    resolved=res.get("status") or "Unknown",
                    message=bad.get("message") or bad.get("reason") or "",
                )
            )
        return cls(parents=tuple(parents), pickers=len(ready))


def gateway_condition(fleet: Fleet, pool: PoolView | None) -> tuple[str, str, str]:
    """``GatewayReady`` (status, reason, message): the pool exists, a Gateway accepted it and resolved
    its references, and a replica is ready to pick (the picker Service lists it ready: seeded, and of a
    revision that serves picks)."""
    name = fleet.pool_name
    if pool is None:
        return ("Unknown", "PoolNotSynced", f"InferencePool {name} not applied yet")
    if pool.problem is not None:
        return ("False", pool.problem.reason, f"InferencePool {name}: {pool.problem.message}")
    if not pool.parents:
        return (
            "False",
            "NoGateway",
            f"InferencePool {name} exists; no Gateway has taken it up yet (an HTTPRoute names it as a"
            " backendRef, and its Gateway reports in the pool's status.parents)",
        )
    accepted = [p for p in pool.parents if p.accepted == "True" and p.resolved != "False"]
    if not accepted:
        p = pool.parents[0]
        return ("False", "NotAccepted", f"InferencePool {name}: Gateway {p.gateway}: {p.message}")
    if pool.pickers == 0:
        return ("False", "PickerNotReady", f"InferencePool {name}: no router replica is ready to pick")
    gateways = ", ".join(p.gateway for p in accepted)
    return (
        "True",
        "Accepted",
        f"InferencePool {name} accepted by {gateways}; {pool.pickers} router replica(s) picking",
    )
