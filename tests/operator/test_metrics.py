"""The operator's metrics: what one applied decision, and one reconcile through the shell, count."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from routerfleet_kube import ApiError
from routerfleet_operator.apply import reconcile
from routerfleet_operator.metrics import OperatorMetrics
from routerfleet_operator.model import OnSeedFailure

from .helpers import fleet_obj
from .test_rollout import first_deploy, seed_failure


def sample(reg: CollectorRegistry, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else v


def feed(m: OperatorMetrics, c) -> None:
    """Every decision the simulated cluster made, as the shell would report it."""
    for d in c.decisions:
        admitted = ["warm" for _ in d.admit]  # the verdicts are checked on the shell path below
        m.observe("ns", "rf", c.obj, d.status, [e.reason for e in d.events], admitted)


def test_first_deploy_counts_and_gauges():
    reg = CollectorRegistry()
    m = OperatorMetrics(reg)
    c = first_deploy()
    feed(m, c)
    assert sample(reg, "routerfleet_operator_rollouts_total", outcome="complete") == 1
    assert sample(reg, "routerfleet_operator_rollouts_total", outcome="paused") == 0
    assert sample(reg, "routerfleet_operator_seeded_total", verdict="warm") == 3
    assert sample(reg, "routerfleet_operator_fleet_phase", namespace="ns", fleet="rf", phase="Complete") == 1
    assert sample(reg, "routerfleet_operator_fleet_phase", namespace="ns", fleet="rf", phase="Paused") == 0
    for kind in ("desired", "ready", "updated"):
        assert sample(reg, "routerfleet_operator_fleet_replicas", namespace="ns", fleet="rf", kind=kind) == 3
    assert (
        sample(reg, "routerfleet_operator_fleet_verdicts", namespace="ns", fleet="rf", verdict="noPeers")
        == (c.status["verdicts"]["noPeers"])
    )
    m.forget("ns", "rf")
    assert (
        reg.get_sample_value(
            "routerfleet_operator_fleet_phase", {"namespace": "ns", "fleet": "rf", "phase": "Complete"}
        )
        is None
    )
    assert (
        reg.get_sample_value(
            "routerfleet_operator_fleet_verdicts", {"namespace": "ns", "fleet": "rf", "verdict": "noPeers"}
        )
        is None
    )


@pytest.mark.parametrize(
    "policy,outcome,phase",
    [
        (OnSeedFailure.PAUSE, "paused", "Paused"),
        (OnSeedFailure.ROLLBACK, "rolled_back", "RolledBack"),
        (OnSeedFailure.PROCEED, "complete", "Complete"),
    ],
)
def test_seed_failures_by_policy(policy, outcome, phase):
    reg = CollectorRegistry()
    m = OperatorMetrics(reg)
    c, _old, _new = seed_failure(policy)
    if policy is OnSeedFailure.PROCEED:
        c.run(20)
    feed(m, c)
    assert sample(reg, "routerfleet_operator_rollouts_total", outcome="started") == 1
    assert sample(reg, "routerfleet_operator_rollouts_total", outcome=outcome) >= 1
    assert sample(reg, "routerfleet_operator_seed_failures_total", policy=policy.value) >= 1
    others = {p.value for p in OnSeedFailure} - {policy.value}
    assert all(sample(reg, "routerfleet_operator_seed_failures_total", policy=p) == 0 for p in others)
    assert sample(reg, "routerfleet_operator_fleet_phase", namespace="ns", fleet="rf", phase=phase) == 1
    if policy is OnSeedFailure.PROCEED:
        assert sample(reg, "routerfleet_operator_rollouts_total", outcome="complete") == 2  # first + this


def test_verdict_gauges_drop_verdicts_no_longer_seen():
    reg = CollectorRegistry()
    m = OperatorMetrics(reg)
    m.observe("ns", "rf", {"spec": {}}, {"verdicts": {"warm": 2, "timedOut": 1}}, [], [])
    m.observe("ns", "rf", {"spec": {}}, {"verdicts": {"warm": 3}}, [], [])
    assert sample(reg, "routerfleet_operator_fleet_verdicts", namespace="ns", fleet="rf", verdict="warm") == 3
    assert (
        reg.get_sample_value(
            "routerfleet_operator_fleet_verdicts", {"namespace": "ns", "fleet": "rf", "verdict": "timedOut"}
        )
        is None
    )


# ---- through the shell: apply.reconcile against an in-memory API ------------------------------------


class FakeKube:
    """Just enough of routerfleet_kube.KubeClient for one reconcile of a fleet without pods."""

    def __init__(self, obj: dict[str, Any] | None):
        self.objs: dict[tuple[str, str], dict] = {}
        if obj is not None:
            self.objs[("RouterFleet", obj["metadata"]["name"])] = obj
        self.conflict = False
        self.fail_list = False
        self.refuse: str | None = None  # a kind whose apply the API server refuses (422 Invalid)
        self.status_patches: list[dict] = []

    async def get(self, kind: str, namespace: str, name: str) -> dict | None:
        o = self.objs.get((kind, name))
        return copy.deepcopy(o) if o is not None else None

    async def list(self, kind: str, namespace: str, label_selector: str) -> list[dict]:
        if self.fail_list:
            raise ApiError(500, "list")
        return [copy.deepcopy(o) for (k, _), o in self.objs.items() if k == kind]

    async def create(self, manifest: dict) -> dict:
        self.objs[(manifest["kind"], manifest["metadata"]["name"])] = copy.deepcopy(manifest)
        return manifest

    async def apply(self, manifest: dict) -> dict:
        if manifest["kind"] == self.refuse:
            raise ApiError(422, f'{manifest["kind"]} "rf" is invalid: spec.template...limits[cpu]: quantity')
        return await self.create(manifest)

    async def delete(self, kind: str, namespace: str, name: str, *, uid: str | None = None) -> bool:
        return self.objs.pop((kind, name), None) is not None

    async def patch(self, kind: str, namespace: str, name: str, body: Any, *, ctype: str, sub=None) -> Any:
        if self.conflict:
            raise ApiError(409, "patch")
        if kind == "RouterFleet" and sub == "status":
            self.status_patches.append(body)
        return body


async def test_reconcile_results_and_durations():
    reg = CollectorRegistry()
    m = OperatorMetrics(reg)
    obj = fleet_obj(resourceVersion="1")
    kube = FakeKube(obj)
    delay = await reconcile(kube, "ns", "rf", metrics=m)  # type: ignore[arg-type]
    assert delay is not None
    assert sample(reg, "routerfleet_operator_reconciles_total", result="ok") == 1
    assert sample(reg, "routerfleet_operator_reconcile_duration_seconds_count", result="ok") == 1
    assert (
        sample(reg, "routerfleet_operator_fleet_phase", namespace="ns", fleet="rf", phase="Progressing") == 1
    )
    assert sample(reg, "routerfleet_operator_fleet_replicas", namespace="ns", fleet="rf", kind="desired") == 2

    kube.conflict = True  # the status write loses to a concurrent change
    assert await reconcile(kube, "ns", "rf", metrics=m) == 0.2  # type: ignore[arg-type]
    assert sample(reg, "routerfleet_operator_reconciles_total", result="conflict") == 1

    kube.conflict, kube.fail_list = False, True
    with pytest.raises(ApiError):
        await reconcile(kube, "ns", "rf", metrics=m)  # type: ignore[arg-type]
    assert sample(reg, "routerfleet_operator_reconciles_total", result="error") == 1
    assert sample(reg, "routerfleet_operator_reconcile_duration_seconds_count", result="error") == 1

    kube.fail_list, kube.refuse = False, "Deployment"  # a valid spec whose Deployment the API refuses
    await reconcile(kube, "ns", "rf", metrics=m)  # type: ignore[arg-type]
    assert sample(reg, "routerfleet_operator_reconciles_total", result="invalid") == 1
    conditions = {c["type"]: c for c in kube.status_patches[-1]["status"]["conditions"]}
    assert (conditions["Stalled"]["status"], conditions["Stalled"]["reason"]) == ("True", "InvalidSpec")
    assert "limits[cpu]" in conditions["Stalled"]["message"] and conditions["Ready"]["status"] == "False"
    assert ("Event", "rf.") in {(k, n[:3]) for k, n in kube.objs}  # said as an event too

    kube.refuse = None
    bad = fleet_obj({"bootstrap": {"passVerdicts": ["warm"]}}, resourceVersion="2")
    kube.objs[("RouterFleet", "rf")] = bad
    await reconcile(kube, "ns", "rf", metrics=m)  # type: ignore[arg-type]
    assert sample(reg, "routerfleet_operator_reconciles_total", result="invalid") == 2

    del kube.objs[("RouterFleet", "rf")]
    assert await reconcile(kube, "ns", "rf", metrics=m) is None  # type: ignore[arg-type]
    assert sample(reg, "routerfleet_operator_reconciles_total", result="gone") == 1
    assert (
        reg.get_sample_value(
            "routerfleet_operator_fleet_phase", {"namespace": "ns", "fleet": "rf", "phase": "Progressing"}
        )
        is None
    )


def test_cli_metrics_port_flag():
    import argparse

    from routerfleet_operator import cli

    seen = {}

    def fake_run(a: argparse.Namespace) -> int:
        seen["port"], seen["addr"] = a.metrics_port, a.metrics_addr
        return 0

    orig = cli._run
    cli._run = fake_run
    try:
        assert cli.main(["run", "--metrics-port", "9090"]) == 0
        assert seen == {"port": 9090, "addr": "0.0.0.0"}
        assert cli.main(["run"]) == 0 and seen["port"] is None  # off by default
    finally:
        cli._run = orig


def test_run_serves_metrics(monkeypatch):
    """``run --metrics-port``: /metrics is served (kopf.run stubbed out)."""
    import socket
    import urllib.request

    import kopf

    from routerfleet_operator import cli

    monkeypatch.setattr(kopf, "run", lambda **_: None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["run", "--metrics-port", str(port), "--metrics-addr", "127.0.0.1"]) == 0
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'routerfleet_operator_reconciles_total{result="ok"}' in body
    assert "routerfleet_operator_rollouts_total" in body
