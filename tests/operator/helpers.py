"""Helpers for the operator's unit tests: fleets, the CRD's schema (defaults and a small validator),
and a simulated cluster (a Deployment controller, a kubelet and routers' verdicts) to run rollouts."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml

from routerfleet_operator.model import ANNOTATION_RETRY, Verdict
from routerfleet_operator.render import revision_of
from routerfleet_operator.rollout import BootstrapReport, Cause, Decision, PodView, decide, ts
from routerfleet_operator.spec import Fleet

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "routerfleet.io_routerfleets.yaml"
SAMPLES = ROOT / "manifests" / "samples"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())


def schema() -> dict[str, Any]:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def fleet_obj(
    spec: dict[str, Any] | None = None, *, name: str = "rf", generation: int = 1, **meta
) -> dict[str, Any]:
    """A RouterFleet as the API would return it (undefaulted spec is fine: the parser defaults)."""
    base = {
        "router": {"image": "routerfleet:dev"},
        "engines": {"serviceName": "vllm", "kvPort": "kv"},
    }
    merged = _merge(base, spec or {})
    return {
        "apiVersion": "routerfleet.io/v1alpha1",
        "kind": "RouterFleet",
        "metadata": {"name": name, "namespace": "ns", "uid": "uid-1", "generation": generation, **meta},
        "spec": merged,
    }


def _merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = (
            _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
        )
    return out


def report(
    verdict: Verdict | str,
    *,
    settled: bool = True,
    seed_failed: bool = False,
    synced: bool = True,
    nodes: int = 10,
    blocks: int = 0,
    cause: tuple[str, str] | None = None,
) -> BootstrapReport:
    return BootstrapReport(
        settled=settled,
        verdict=Verdict(verdict),
        seed_failed=seed_failed,
        index_nodes=nodes,
        index_blocks=blocks,
        peers_synced=synced,
        cause=Cause(*cause) if cause else None,
    )


# ---- the CRD's structural schema: defaults and validation ---------------------------------------------


def apply_defaults(value: Any, sch: dict[str, Any]) -> Any:
    """Structural defaulting as the API server does it: a missing property with a default gets it
    (then its own nested defaults), recursively."""
    if isinstance(value, dict) and sch.get("type") == "object":
        out = dict(value)
        for k, sub in (sch.get("properties") or {}).items():
            if k not in out and "default" in sub:
                out[k] = copy.deepcopy(sub["default"])
            if k in out:
                out[k] = apply_defaults(out[k], sub)
        return out
    if isinstance(value, list) and "items" in sch:
        return [apply_defaults(v, sch["items"]) for v in value]
    return value


def schema_errors(value: Any, sch: dict[str, Any], path: str = "") -> list[str]:
    """What the API server would refuse or prune: unknown fields (pruned: kopf loses them), wrong types,
    enums, bounds of numbers, required fields, maxItems (not CEL rules: tests/e2e on a real API server).
    Enough for the status the operator writes."""
    errs: list[str] = []
    if sch.get("x-kubernetes-preserve-unknown-fields") and "properties" not in sch:
        return errs
    if sch.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, int | str):
            errs.append(f"{path}: not int-or-string: {value!r}")
        return errs
    t = sch.get("type")
    checks = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    if t and not checks[t](value):
        return [f"{path}: expected {t}, got {value!r}"]
    if "enum" in sch and value not in sch["enum"]:
        errs.append(f"{path}: {value!r} not in {sch['enum']}")
    if t in ("integer", "number"):
        if "minimum" in sch and value < sch["minimum"]:
            errs.append(f"{path}: {value} below the minimum {sch['minimum']}")
        if "maximum" in sch and value > sch["maximum"]:
            errs.append(f"{path}: {value} above the maximum {sch['maximum']}")
    if t == "string" and sch.get("format") == "date-time":
        try:
            datetime.fromisoformat(value)
        except ValueError:
            errs.append(f"{path}: not a date-time: {value!r}")
    if t == "object":
        props = sch.get("properties")
        for r in sch.get("required") or ():
            if r not in value:
                errs.append(f"{path}.{r}: required")
        for k, v in value.items():
            if props is not None and k in props:
                errs += schema_errors(v, props[k], f"{path}.{k}")
            elif "additionalProperties" in sch:
                errs += schema_errors(v, sch["additionalProperties"], f"{path}.{k}")
            elif not sch.get("x-kubernetes-preserve-unknown-fields"):
                errs.append(f"{path}.{k}: unknown field (would be pruned)")
    if t == "array":
        if "maxItems" in sch and len(value) > sch["maxItems"]:
            errs.append(f"{path}: more than {sch['maxItems']} items")
        for i, v in enumerate(value):
            errs += schema_errors(v, sch["items"], f"{path}[{i}]")
    return errs


# ---- a simulated cluster ------------------------------------------------------------------------------


@dataclass
class SimPod:
    name: str
    revision: str
    seq: int
    gate: bool = False
    container_ready: bool = False
    report: BootstrapReport | None = None
    ready_since: datetime | None = None
    seeded: tuple[Verdict, str] | None = None  # what the gate condition records: verdict, time

    @property
    def ready(self) -> bool:
        return self.gate and self.container_ready

    def view(self) -> PodView:
        return PodView(
            name=self.name,
            revision=self.revision,
            created=f"{self.seq:08d}",
            gate=self.gate,
            ready=self.ready,
            ready_since=self.ready_since if self.ready else None,
            report=self.report,
            seeded_verdict=self.seeded[0] if self.seeded else None,
            seeded_at=self.seeded[1] if self.seeded else None,
        )


# A script decides a pod's bootstrap report when it settles: (the pod, the cluster) -> report.
Script = Callable[["SimPod", "Cluster"], BootstrapReport]


def natural(pod: SimPod, c: Cluster) -> BootstrapReport:
    """A working fleet: warm if a Ready sibling was there to seed from, else nothing to inherit."""
    if any(p.ready for p in c.pods.values() if p.name != pod.name):
        return report(Verdict.WARM)
    return report(Verdict.NO_PEERS, nodes=0)


def failing(bad: set[str]) -> Script:
    """Pods of the ``bad`` revisions cannot pull a snapshot: timed_out with seedFailed when a Ready
    sibling existed (a real candidate), else no_peers."""

    def script(pod: SimPod, c: Cluster) -> BootstrapReport:
        if pod.revision in bad and any(p.ready for p in c.pods.values() if p.name != pod.name):
            return report(Verdict.TIMED_OUT, seed_failed=True, nodes=0)
        return natural(pod, c)

    return script


@dataclass
class Cluster:
    """One RouterFleet, its Deployment and pods. ``reconcile`` runs the decision and applies it in the
    documented order (Deployment, deletions, gates, status last); ``crash=True`` drops the status write
    (the operator died after acting). ``tick`` runs the kubelet and the Deployment controller once."""

    obj: dict[str, Any]
    script: Script = natural
    pods: dict[str, SimPod] = field(default_factory=dict)
    now: datetime = T0
    deploy_revision: str | None = None
    deploy_paused: bool = False
    seq: int = 0
    decisions: list[Decision] = field(default_factory=list)
    min_ready_seen: int | None = None

    @property
    def fleet(self) -> Fleet:
        return Fleet.parse(self.obj)

    @property
    def status(self) -> dict[str, Any]:
        return self.obj.get("status") or {}

    def views(self) -> list[PodView]:
        return [p.view() for p in self.pods.values()]

    def reconcile(self, *, crash: bool = False, restart: bool = False) -> Decision:
        obj = json.loads(json.dumps(self.obj)) if restart else self.obj  # a fresh process reads JSON
        d = decide(obj, self.views(), self.now)
        self.decisions.append(d)
        if d.deploy_revision is not None:
            self.deploy_revision = d.deploy_revision
        if d.pause_deployment is not None:
            self.deploy_paused = d.pause_deployment
        for name in d.delete:
            self.pods.pop(name, None)
        for name in d.admit:
            assert not self.pods[name].gate, f"{name} admitted twice"
            self.pods[name].gate = True
            rep = self.pods[name].report
            self.pods[name].seeded = (rep.verdict if rep else Verdict.DISABLED, ts(self.now))
            if self.pods[name].container_ready:
                self.pods[name].ready_since = self.now
        if not crash:
            self.obj["status"] = json.loads(json.dumps(d.status))
        return d

    def tick(self) -> None:
        self.now += timedelta(seconds=1)
        # kubelet + router: a pod's bootstrap settles one tick after it starts; /readyz opens with it.
        for p in sorted(self.pods.values(), key=lambda p: p.seq):
            if p.report is None:
                p.report = report(Verdict.PENDING, settled=False)
            elif not p.report.settled:
                p.report = self.script(p, self)
                p.container_ready = True
                if p.gate:
                    p.ready_since = self.now
        self._deployment_controller()
        ready = sum(1 for p in self.pods.values() if p.ready)
        self.min_ready_seen = ready if self.min_ready_seen is None else min(self.min_ready_seen, ready)

    def _deployment_controller(self) -> None:
        """RollingUpdate with maxUnavailable 0 and an integer maxSurge, as the Deployment controller
        does it: old pods go only while enough Ready pods remain; unready old pods go first."""
        if self.deploy_revision is None or self.deploy_paused:
            return
        f = self.fleet.spec
        replicas, surge = f.replicas, int(f.rollout.max_surge)
        target = self.deploy_revision
        old = sorted((p for p in self.pods.values() if p.revision != target), key=lambda p: (p.ready, p.seq))
        for p in old:
            if not p.ready:
                del self.pods[p.name]  # not available anyway
        for p in [p for p in old if p.ready]:
            if sum(1 for q in self.pods.values() if q.ready) - 1 >= replicas:
                del self.pods[p.name]
        new = [p for p in self.pods.values() if p.revision == target]
        for p in sorted(new, key=lambda p: (p.ready, p.seq))[: max(0, len(new) - replicas)]:
            if not p.ready or sum(1 for q in self.pods.values() if q.ready) - 1 >= replicas:
                del self.pods[p.name]
        while (
            len(self.pods) < replicas + surge
            and sum(1 for p in self.pods.values() if p.revision == target) < replicas
        ):
            self.seq += 1
            name = f"rf-{target[:4]}-{self.seq}"
            self.pods[name] = SimPod(name, target, self.seq)

    def run(self, ticks: int, *, crash_at: set[int] = frozenset(), restart: bool = False) -> None:
        for i in range(ticks):
            self.reconcile(crash=i in crash_at, restart=restart)
            self.tick()
        self.reconcile()

    # ---- user actions ----
    def set_spec(self, **changes: Any) -> str:
        self.obj["spec"] = _merge(self.obj["spec"], changes)
        self.obj["metadata"]["generation"] += 1
        return revision_of(self.fleet)

    def annotate(self, key: str, value: str) -> str:
        self.obj["metadata"].setdefault("annotations", {})[key] = value
        return revision_of(self.fleet)

    def retry(self, value: str = "1") -> None:
        self.annotate(ANNOTATION_RETRY, value)

    def condition(self, type_: str) -> tuple[str, str]:
        for c in self.status.get("conditions") or ():
            if c["type"] == type_:
                return c["status"], c["reason"]
        raise KeyError(type_)

    def revisions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pods.values():
            out[p.revision] = out.get(p.revision, 0) + 1
        return out

    def events(self, reason: str) -> list[str]:
        return [e.message for d in self.decisions for e in d.events if e.reason == reason]


def with_gate(view: PodView, gate: bool = True) -> PodView:
    return replace(view, gate=gate)
