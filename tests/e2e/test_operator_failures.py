"""The RouterFleet CRD on the real API server, and the operator's failure paths through the shell.

- `test_crd_on_the_api_server`: the samples are accepted with their defaults filled; invalid specs are
  refused with the CRD's CEL messages; a decided status round-trips through `/status` with nothing
  pruned; every rendered manifest passes a server-side dry run; the scale subresource and the printer
  columns work. No operator runs.
- `test_all_router_pods_deleted`: every router pod deleted at once; the new ones are seeded cold
  (fleet_cold / no_peers / from_origin: nobody was serving, so gating would deadlock) and the fleet is
  Ready again.
- `test_unusable_snapshots`: a block size change makes every sibling's snapshot unusable (a hashing
  mismatch) and the engines' short replay buffers rule out a rebuild from origin, so a new replica
  times out with seedFailed. Pause holds it (Stalled/SeedFailurePaused) while the old revision serves;
  Rollback (after a retry) restores the old revision; Proceed (after another retry) completes with
  CacheWarm=False.

    .venv/bin/python -m pytest tests/e2e/test_operator_failures.py
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import test_operator
import yaml
from test_operator import (
    FLEET,
    GROUP,
    PLURAL,
    REPLAY_BUFFER,
    VERSION,
    WARM_PROMPTS,
    _local_only,
    aio,
    condition,
    deploy_engines,
    fleet_manifest,
    get_fleet,
    kubectl_path,
    seeded,
    wait_fleet_ready,
)

from e2e.fleet import ENGINE_LABELS, ROUTER_PORT, completion, metrics_url, pod_url
from routerfleet_operator.model import Verdict
from routerfleet_operator.render import render_all, render_controller_revision, render_pod_template
from routerfleet_operator.rollout import BootstrapReport, PodView, decide
from routerfleet_operator.spec import Fleet

crd = test_operator.crd  # the fixtures: the CRD applied, and the operator as a subprocess
operator = test_operator.operator
ROOT = Path(__file__).resolve().parents[2]
SAMPLES = ROOT / "manifests" / "samples"
SEL = f"routerfleet.io/fleet={FLEET}"
COLD_VERDICTS = {"fleet_cold", "no_peers", "from_origin"}


def kubectl_in(cluster, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


# ------------------------------------------------------------------------------------------ the CRD


def minimal(ns: str, **spec_overrides) -> dict:
    """manifests/samples/minimal.yaml in ``ns``; ``a__b=v`` sets spec.a.b = v."""
    obj = yaml.safe_load((SAMPLES / "minimal.yaml").read_text())
    obj["metadata"]["namespace"] = ns
    for path, value in spec_overrides.items():
        node = obj["spec"]
        keys = path.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return obj


def invalid_specs(ns: str) -> list[tuple[str, dict, tuple[str, ...]]]:
    """(what, object, substrings of the API server's refusal)."""
    m = minimal
    no_kv = m(ns)
    del no_kv["spec"]["engines"]["kvPort"]
    long_name, bad_name = m(ns), m(ns)
    long_name["metadata"]["name"] = "x" * 51
    bad_name["metadata"]["name"] = "9routers"
    owned = "may not set a flag the operator owns"
    return [
        (
            "passVerdicts without no_peers",
            m(ns, bootstrap__passVerdicts=["warm", "fleet_cold"]),
            ("must include no_peers and fleet_cold", "missing: no_peers"),
        ),
        (
            "extraArgs --internal-token-file",
            m(ns, router__extraArgs=["--load-cost-tokens=64", "--internal-token-file=/tmp/t"]),
            (owned, "extraArgs[1]", "--internal-token-file=/tmp/t"),
        ),
        (
            "extraArgs abbreviation --internal-tok",
            m(ns, router__extraArgs=["--internal-tok", "/tmp/t"]),
            (owned,),
        ),
        ("extraArgs --block-size", m(ns, router__extraArgs=["--block-size", "32"]), (owned,)),
        ("extraArgs --otlp-traces-endpoint", m(ns, router__extraArgs=["--otlp-traces-endpoint=x"]), (owned,)),
        (
            "tracing endpoint with credentials",
            m(ns, router__tracing={"endpoint": "http://u:secret@otel:4318/v1/traces"}),
            (
                "tracing.endpoint must be an http:// or https:// URL",
                "got http://u:secret@otel:4318/v1/traces",
            ),
        ),
        ("tracing endpoint grpc://", m(ns, router__tracing={"endpoint": "grpc://o"}), ("tracing.endpoint",)),
        (
            "tracing sampleRatio over 1",
            m(ns, router__tracing={"endpoint": "http://otel:4318", "sampleRatio": 1.5}),
            ("sampleRatio", "less than or equal to 1"),
        ),
        (
            "negative bootstrap timeout",
            m(ns, bootstrap__timeout="-5s"),
            ("bootstrap.timeout must be a duration between 1s and 1h", "got -5s"),
        ),
        ("bootstrap timeout over 1h", m(ns, bootstrap__timeout="2h"), ("between 1s and 1h",)),
        ("bootstrap timeout 0s", m(ns, bootstrap__timeout="0s"), ("between 1s and 1h",)),
        (
            "progressDeadline not a duration",
            m(ns, rollout__progressDeadline="30"),
            ("rollout.progressDeadline",),
        ),
        ("progressDeadline over 24h", m(ns, rollout__progressDeadline="25h"), ("rollout.progressDeadline",)),
        (
            "progressDeadline shorter than the bootstrap hold",
            m(ns, bootstrap__timeout="20m", bootstrap__seedRequired=True, rollout__progressDeadline="45m"),
            ("must exceed the bootstrap hold",),
        ),
        (
            "bootstrap with round_robin",
            m(ns, router__policy="round_robin"),
            ("needs router.policy kv_aware",),
        ),
        (
            "both serviceName and selector",
            m(ns, engines__selector={"matchLabels": {"a": "b"}}),
            ("exactly one",),
        ),
        ("env POD_IP", m(ns, router__env=[{"name": "POD_IP", "value": "x"}]), ("may not set POD_NAME",)),
        ("maxSurge 0", m(ns, rollout__maxSurge=0), ("rollout.maxSurge",)),
        ("onSeedFailure enum", m(ns, rollout__onSeedFailure="Abort"), ("Unsupported value",)),
        ("bootstrap without kvPort", no_kv, ("needs engines.kvPort",)),
        (
            "disaggregation naming no roles",
            m(ns, engines__disaggregation={"protocol": "vllm"}),
            ("names the engines' roles one way", "exactly one"),
        ),
        (
            "disaggregation naming roles twice",
            m(ns, engines__disaggregation={"prefillServiceName": "p", "roleLabel": "llm-d.ai/role"}),
            ("names the engines' roles one way",),
        ),
        ("name too long", long_name, ("may not be more than 50",)),
        ("name not a DNS-1035 label", bad_name, ("DNS-1035 label",)),
    ]


def test_crd_on_the_api_server(cluster, namespace, crd):
    ns = namespace
    t0 = time.monotonic()

    # ---- invalid specs: refused with the CEL messages
    wrong = []
    for what, obj, expect in invalid_specs(ns):
        p = kubectl_in(cluster, "create", "--dry-run=server", "-f", "-", stdin=json.dumps(obj))
        msg = p.stderr.strip()
        if p.returncode == 0 or not all(e in msg for e in expect):
            wrong.append(f"{what}: {msg or 'accepted'}")
    assert not wrong, "\n".join(wrong)

    # ---- the samples: accepted, with the defaults filled
    for path in sorted(SAMPLES.glob("*.yaml")):
        obj = yaml.safe_load(path.read_text())
        obj["metadata"]["namespace"] = ns
        p = kubectl_in(cluster, "create", "-f", "-", stdin=json.dumps(obj))
        assert p.returncode == 0, (path.name, p.stderr)
    got = crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "routers")
    spec = got["spec"]
    assert spec["replicas"] == 2, spec
    assert spec["router"]["policy"] == "kv_aware" and spec["router"]["tokenizer"] == {"source": "Bytes"}, spec
    assert spec["router"]["blockSize"] == 16, spec
    assert spec["bootstrap"]["timeout"] == "10m", spec
    assert spec["bootstrap"]["passVerdicts"] == [
        "warm", "from_origin", "warm_unwitnessed", "no_peers", "fleet_cold", "disabled",
    ], spec  # fmt: skip
    assert spec["rollout"] == {
        "maxSurge": 1, "onSeedFailure": "Pause", "progressDeadline": "1h", "minReadySeconds": 0,
    }, spec  # fmt: skip
    assert spec["engines"]["httpPort"] == "http", spec
    assert spec["service"] == {"type": "ClusterIP", "port": 80}, spec
    assert spec["disruption"] == {"enabled": True}, spec
    # the operator's parser reads the defaulted object exactly as the undefaulted one
    assert Fleet.parse(got).spec == Fleet.parse(minimal(ns)).spec

    # ---- a decided status round-trips through /status, nothing pruned
    fleet = Fleet.parse(got)
    rev = render_pod_template(fleet)["metadata"]["labels"]["routerfleet.io/revision"]
    now = datetime.now(UTC)
    report = BootstrapReport(settled=True, verdict=Verdict.NO_PEERS, index_nodes=3, peers_synced=True)
    pods = [PodView(f"routers-{i}", rev, created=f"2026-01-01T00:00:0{i}Z", report=report) for i in range(2)]
    d = decide(got, pods, now)
    views = [
        PodView(p.name, rev, p.created, gate=True, ready=True, ready_since=now, report=p.report) for p in pods
    ]
    status = json.loads(json.dumps(decide({**got, "status": d.status}, views, now).status))
    status["rollout"]["hold"] = {
        "reason": "SeedFailed",
        "revision": rev,
        "pods": ["x"],
        "since": "2026-01-01T00:00:00Z",
        "message": "m",
    }
    status["membersOmitted"] = 1
    crd.patch_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, "routers", {"status": status})
    back = crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "routers")["status"]
    assert back == status, json.dumps(back, sort_keys=True)[:1000]

    # ---- every rendered manifest passes a server-side dry run (the engines' namespace exists)
    engines_ns = f"{ns}-engines"
    cluster.core.create_namespace(
        {"metadata": {"name": engines_ns, "labels": {"routerfleet.e2e/test": "true"}}}
    )
    try:
        refused = []
        for name in ("routers", "chat-routers", "rr-routers"):
            live = crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
            if live["spec"]["engines"].get("namespace") not in (None, ns):
                live["spec"]["engines"]["namespace"] = engines_ns
            f = Fleet.parse(live)
            for doc in [*render_all(f, "t0ken"), render_controller_revision(f, render_pod_template(f), 1)]:
                p = kubectl_in(
                    cluster, "apply", "--server-side", "--dry-run=server",
                    "--field-manager=routerfleet-operator", "-f", "-", stdin=json.dumps(doc),
                )  # fmt: skip
                if p.returncode != 0:
                    refused.append(f"{name} {doc['kind']}: {p.stderr.strip()}")
        assert not refused, "\n".join(refused)
    finally:
        cluster.core.delete_namespace(engines_ns)

    # ---- the scale subresource and the printer columns
    p = kubectl_in(cluster, "-n", ns, "scale", "rf", "routers", "--replicas=4")
    assert p.returncode == 0, p.stderr
    scale = json.loads(
        kubectl_in(
            cluster, "get", "--raw", f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}/routers/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 4, scale
    assert scale["status"]["selector"] == "routerfleet.io/fleet=routers", scale
    table = kubectl_in(cluster, "-n", ns, "get", "rf", "-o", "wide").stdout
    assert table.split("\n")[0].split() == [
        "NAME", "DESIRED", "READY", "WARM", "UPDATED", "PHASE", "STATUS", "REASON", "AGE",
    ], table  # fmt: skip
    assert kubectl_in(cluster, "-n", ns, "get", "routerfleets").returncode == 0
    print(f"\n[crd] all API server checks in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------ helpers


def router_pods(cluster, ns: str) -> list:
    return [
        p
        for p in cluster.core.list_namespaced_pod(ns, label_selector=SEL).items
        if p.metadata.deletion_timestamp is None
    ]


def warm_up(pods: list) -> None:
    """Prompts through the routers until the engines' replay buffers no longer reach sequence 0."""
    rng = secrets.SystemRandom()
    for i in range(WARM_PROMPTS):
        tokens = [rng.randrange(1000, 30000) for _ in range(16 * rng.randrange(3, 10))]
        code, _, body = aio(completion, pod_url(pods[i % len(pods)], ROUTER_PORT), tokens)
        assert code == 200, body


def completion_through(pod) -> None:
    rng = secrets.SystemRandom()
    tokens = [rng.randrange(1000, 30000) for _ in range(48)]
    code, engine, body = aio(completion, pod_url(pod, ROUTER_PORT), tokens)
    assert code == 200 and engine, (pod.metadata.name, code, engine, body)


async def metrics_text(session, url: str) -> str | None:
    async with session.get(metrics_url(url) + "/metrics") as r:
        return await r.text() if r.status == 200 else None


def conds(obj: dict) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c.get("reason", "")) for c in obj["status"].get("conditions") or []}


def retry(api, ns: str, value: str) -> None:
    api.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"metadata": {"annotations": {"routerfleet.io/retry": value}}}
    )


# ------------------------------------------------------------------------------------------ all pods deleted


def test_all_router_pods_deleted(cluster, namespace, crd, operator):
    """Every router pod deleted at once: nobody is left serving, so the new replicas are seeded cold
    (gating them on a warm sibling would deadlock the fleet), and the fleet is Ready again."""
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    # short replay buffers, warmed below: no rebuild from origin either, so nothing can come up warm
    deploy_engines(cluster, ns, (f"--replay-buffer={REPLAY_BUFFER}",))
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns, replicas=3))
    obj = wait_fleet_ready(cluster, crd, ns, "first deploy Ready")
    rev = obj["status"]["currentRevision"]
    old = {p.metadata.name for p in cluster.wait_pods_ready(ns, SEL, 3, timeout=30)}
    warm_up(router_pods(cluster, ns))
    print(f"\n[all-deleted] 3 replicas Ready and warmed after {time.monotonic() - t0:.1f}s")

    t1 = time.monotonic()
    cluster.core.delete_collection_namespaced_pod(ns, label_selector=SEL)

    def recovered():
        o = get_fleet(crd, ns)
        members = o["status"].get("members") or []
        names = {m["pod"] for m in members}
        ready = condition(o, "Ready").get("status") == "True"
        return o if ready and len(members) == 3 and not names & old else None

    obj = cluster.wait_for("the fleet Ready again with 3 new replicas", recovered, 150)
    took = time.monotonic() - t1
    st = obj["status"]
    verdicts = sorted(m["verdict"] for m in st["members"])
    assert set(verdicts) <= COLD_VERDICTS, st["members"]
    assert all(m["gate"] and m["ready"] and not m.get("seedFailed") for m in st["members"]), st["members"]
    assert st["rollout"]["phase"] == "Complete" and st["currentRevision"] == rev, st["rollout"]
    assert conds(obj)["Stalled"][0] == "False", conds(obj)
    pods = cluster.wait_pods_ready(ns, SEL, 3, timeout=30)
    assert all(seeded(p) == "True" for p in pods)
    completion_through(pods[0])
    print(f"[all-deleted] Ready again after {took:.1f}s, verdicts {verdicts}")


# ---------------------------------------------------------------------------------- unusable snapshots


def test_unusable_snapshots(cluster, namespace, crd, operator):
    """A block size change: siblings' snapshots are refused (hashing mismatch), origin cannot rebuild
    (short replay buffers, warmed): timed_out with seedFailed. Pause, then Rollback, then Proceed."""
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    deploy_engines(cluster, ns, (f"--replay-buffer={REPLAY_BUFFER}",))
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    m = fleet_manifest(cluster, ns, replicas=2)
    m["spec"]["bootstrap"] = {"timeout": "20s"}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, m)
    obj = wait_fleet_ready(cluster, crd, ns, "first deploy Ready")
    rev1 = obj["status"]["currentRevision"]
    old = cluster.wait_pods_ready(ns, SEL, 2, timeout=30)
    old_names = {p.metadata.name for p in old}
    warm_up(old)
    print(f"\n[unusable] revision {rev1} Ready and warmed after {time.monotonic() - t0:.1f}s")

    # ---- Pause (the default): the new replica is held, the Deployment paused, the old revision serves
    t1 = time.monotonic()
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"router": {"blockSize": 32}}}
    )

    def paused():
        o = get_fleet(crd, ns)
        c = conds(o) if o.get("status") else {}
        return o if c.get("Stalled") == ("True", "SeedFailurePaused") else None

    obj = cluster.wait_for("Stalled/SeedFailurePaused", paused, 120)
    st = obj["status"]
    rev2 = st["updateRevision"]
    c = conds(obj)
    print(f"[unusable] paused after {time.monotonic() - t1:.1f}s: {c}")
    assert rev2 != rev1 and st["currentRevision"] == rev1, st
    assert st["rollout"]["phase"] == "Paused" and st["rollout"]["pauseReason"] == "SeedFailed", st["rollout"]
    hold = st["rollout"]["hold"]
    assert hold["revision"] == rev2 and len(hold["pods"]) == 1, hold
    (held,) = hold["pods"]
    assert c["Ready"] == ("False", "SeedFailurePaused") and c["Reconciling"][0] == "False", c
    assert c["Progressing"] == ("False", "SeedFailurePaused"), c
    by_pod = {mm["pod"]: mm for mm in st["members"]}
    assert by_pod[held]["verdict"] == "timed_out" and by_pod[held]["seedFailed"] is True, by_pod[held]
    assert not by_pod[held]["gate"] and by_pod[held]["revision"] == rev2, by_pod[held]
    assert st["verdicts"].get("seedFailed") == 1, st["verdicts"]
    assert cluster.apps.read_namespaced_deployment(FLEET, ns).spec.paused is True
    # the reason is the block size: vetting refused the siblings' snapshots as a hashing mismatch
    held_pod = cluster.core.read_namespaced_pod(held, ns)
    text = cluster.wait_for(
        "the held pod's /metrics",
        lambda: aio(metrics_text, pod_url(held_pod, ROUTER_PORT)),
        30,
    )
    assert 'routerfleet_bootstrap_vet_errors_total{reason="hashing_mismatch"}' in text, [
        ln for ln in text.splitlines() if "vet_errors" in ln or "seed_failed" in ln
    ]
    serving = [p for p in router_pods(cluster, ns) if cluster.pod_ready(p)]
    assert {p.metadata.name for p in serving} == old_names, [p.metadata.name for p in serving]
    completion_through(serving[0])
    # the hold is sticky: a while later nothing moved
    time.sleep(5)
    again = get_fleet(crd, ns)["status"]
    assert again["rollout"].get("hold") == hold and again["currentRevision"] == rev1, again["rollout"]
    assert seeded(cluster.core.read_namespaced_pod(held, ns)) != "True"

    # ---- Rollback: onSeedFailure Rollback and a retry; the fresh replica fails again -> rolled back
    t2 = time.monotonic()
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"rollout": {"onSeedFailure": "Rollback"}}}
    )
    retry(crd, ns, "1")

    def rolled_back():
        o = get_fleet(crd, ns)
        c = conds(o)
        if c.get("Stalled") != ("True", "SeedFailureRolledBack"):
            return None
        live = router_pods(cluster, ns)
        only_old = {p.metadata.labels.get("routerfleet.io/revision") for p in live} == {rev1}
        return o if only_old and len(live) == 2 and all(cluster.pod_ready(p) for p in live) else None

    obj = cluster.wait_for("Stalled/SeedFailureRolledBack, only the old revision running", rolled_back, 150)
    st = obj["status"]
    print(f"[unusable] rolled back after {time.monotonic() - t2:.1f}s: {conds(obj)}")
    assert st["rollout"]["phase"] == "RolledBack" and st["rollout"]["rolledBackRevision"] == rev2, st[
        "rollout"
    ]
    assert st["currentRevision"] == rev1 and st["updateRevision"] == rev2, st
    assert held not in {p.metadata.name for p in router_pods(cluster, ns)}, "the retry deletes the held pod"
    dep = cluster.apps.read_namespaced_deployment(FLEET, ns)
    assert dep.spec.template.metadata.labels["routerfleet.io/revision"] == rev1
    assert not dep.spec.paused
    live = router_pods(cluster, ns)
    assert {p.metadata.name for p in live} == old_names, "the old revision's pods kept serving"
    completion_through(live[0])
    events = cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={FLEET}").items
    reasons = [e.reason for e in events if e.involved_object.kind == "RouterFleet"]
    assert {"SeedFailurePaused", "RetryRequested", "RolledBack"} <= set(reasons), reasons

    # ---- Proceed: onSeedFailure Proceed and a retry; replicas admitted cold, CacheWarm=False
    t3 = time.monotonic()
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"rollout": {"onSeedFailure": "Proceed"}}}
    )
    retry(crd, ns, "2")

    def completed():
        o = get_fleet(crd, ns)
        st_ = o["status"]
        r = condition(o, "Ready")
        ok = (
            r.get("status") == "True"
            and r.get("observedGeneration") == o["metadata"]["generation"]
            and st_.get("currentRevision") == rev2
        )
        return o if ok else None

    obj = cluster.wait_for("Proceed: the new revision complete", completed, 180)
    st = obj["status"]
    c = conds(obj)
    print(f"[unusable] proceeded after {time.monotonic() - t3:.1f}s: {c}, members {st['members']}")
    assert st["rollout"]["phase"] == "Complete" and "rolledBackRevision" not in st["rollout"], st["rollout"]
    assert {mm["revision"] for mm in st["members"]} == {rev2} and len(st["members"]) == 2, st["members"]
    assert any(mm["verdict"] == "timed_out" and mm["seedFailed"] for mm in st["members"]), st["members"]
    assert c["CacheWarm"] == ("False", "SeedTimedOut"), c
    assert st["warmReplicas"] < 2, st
    reasons = [
        e.reason
        for e in cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={FLEET}").items
    ]
    assert "SeedFailedProceeding" in reasons and "RolloutComplete" in reasons, reasons
    completion_through(cluster.wait_pods_ready(ns, SEL, 2, timeout=30)[0])
    print(f"[unusable] done in {time.monotonic() - t0:.1f}s")


# -------------------------------------------------------------------- the status says what the routers know


def describe(cluster, ns: str, name: str) -> str:
    out = kubectl_in(cluster, "-n", ns, "describe", "rf", name)
    return out.stdout or out.stderr


def test_a_config_mismatch_and_missing_engines_say_so(cluster, namespace, crd, operator):
    """Engines whose replay buffers reach sequence 0: a block size change is found in the new replica's
    origin replay at once (not called from_origin on an empty index), the rollout pauses with a condition
    naming the mismatch while the old replicas serve, and reverting the spec is Ready again without a
    bootstrap timeout. Beside it, a fleet pointing at a Service that does not exist goes Stalled with
    "no engines discovered" within the documented bound (rollout.NO_ENGINES_STALL_S)."""
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    deploy_engines(cluster, ns)  # default replay buffers: an engine's whole history can be replayed
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    blind = fleet_manifest(cluster, ns, replicas=1)
    blind["metadata"]["name"] = "rf-blind"
    blind["spec"]["engines"]["serviceName"] = "no-such-engine"
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, blind)
    t_blind = time.monotonic()
    m = fleet_manifest(cluster, ns, replicas=2)
    m["spec"]["bootstrap"] = {"timeout": "60s"}
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, m)
    obj = wait_fleet_ready(cluster, crd, ns, "first deploy Ready")
    rev1 = obj["status"]["currentRevision"]
    old = cluster.wait_pods_ready(ns, SEL, 2, timeout=30)
    old_names = {p.metadata.name for p in old}
    for p in old:
        completion_through(p)  # the engines hold blocks: their replay has stores to judge by
    print(f"\n[mismatch] revision {rev1} Ready after {time.monotonic() - t0:.1f}s")

    # ---- blockSize 16 -> 32: the new replica's origin replay shows the mismatch
    t1 = time.monotonic()
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"router": {"blockSize": 32}}}
    )

    def paused():
        o = get_fleet(crd, ns)
        c = conds(o) if o.get("status") else {}
        return o if c.get("Stalled") == ("True", "ConfigMismatch") else None

    obj = cluster.wait_for("Stalled/ConfigMismatch", paused, 90)
    took = time.monotonic() - t1
    st = obj["status"]
    assert took < 60, f"paused after {took:.1f}s: as slow as the bootstrap timeout"
    assert st["rollout"]["pauseReason"] == "ConfigMismatch" and st["currentRevision"] == rev1, st["rollout"]
    message = condition(obj, "Stalled")["message"]
    assert "block size 16; this router is configured for 32" in message, message
    (held,) = st["rollout"]["hold"]["pods"]
    member = next(mm for mm in st["members"] if mm["pod"] == held)
    assert member["verdict"] == "config_mismatch" and member["cause"]["code"] == "ConfigMismatch", member
    assert member["indexNodes"] == 0 and not member["gate"], member
    held_pod = cluster.core.read_namespaced_pod(held, ns)
    url = pod_url(held_pod, ROUTER_PORT)
    text = cluster.wait_for("the held pod's /metrics", lambda: aio(metrics_text, url), 30)
    assert 'routerfleet_kv_config_mismatch{engine="' in text and 'reason="block_size_mismatch"} 1.0' in text
    serving = [p for p in router_pods(cluster, ns) if cluster.pod_ready(p)]
    assert {p.metadata.name for p in serving} == old_names
    completion_through(serving[0])
    paused_text = describe(cluster, ns, FLEET)
    print(f"[mismatch] paused after {took:.1f}s; kubectl describe rf {FLEET}:\n{paused_text}")

    # ---- undo: revert the spec; the old replicas are still seeded, nothing bootstraps
    t2 = time.monotonic()
    crd.patch_namespaced_custom_object(
        GROUP, VERSION, ns, PLURAL, FLEET, {"spec": {"router": {"blockSize": 16}}}
    )

    def reverted():
        o = get_fleet(crd, ns)
        names = {mm["pod"] for mm in o["status"].get("members") or []}
        ready = condition(o, "Ready")
        fresh = ready.get("observedGeneration") == o["metadata"]["generation"]
        return o if ready.get("status") == "True" and fresh and names == old_names else None

    obj = cluster.wait_for("Ready again on the old replicas", reverted, 90)
    undo = time.monotonic() - t2
    assert obj["status"]["currentRevision"] == rev1 and obj["status"]["updateRevision"] == rev1
    assert undo < 30, f"the revert took {undo:.1f}s"
    print(f"[mismatch] reverted, Ready after {undo:.1f}s")

    # ---- the fleet whose engine Service does not exist: Stalled, saying why
    def blind_stalled():
        o = crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, "rf-blind")
        c = condition(o, "Stalled")
        return o if c.get("status") == "True" else None

    bound = 60 + 30  # NO_ENGINES_STALL_S, plus the pod's start and a reconcile period
    obj = cluster.wait_for("rf-blind Stalled", blind_stalled, max(5, bound - (time.monotonic() - t_blind)))
    c = condition(obj, "Stalled")
    assert c["reason"] == "NoEnginesDiscovered" and "no engines discovered" in c["message"], c
    assert "no-such-engine" in c["message"] or "kubernetes.io/service-name" in c["message"], c
    assert condition(obj, "Ready")["reason"] == "NoEnginesDiscovered"
    took = time.monotonic() - t_blind
    print(f"[mismatch] rf-blind stalled after {took:.1f}s; kubectl describe rf rf-blind:")
    print(describe(cluster, ns, "rf-blind"))


# ------------------------------------------------------------------ engines in another namespace


def test_deleting_a_fleet_removes_its_rbac_in_the_engines_namespace(cluster, namespace, crd, operator):
    """Engines in another namespace (bootstrap off, as the CRD requires): the Role and RoleBinding the
    operator puts there cannot be owned across namespaces, so the operator deletes them itself (a kopf
    deletion handler, behind its finalizer) when the fleet goes."""
    ns = namespace
    engines_ns = f"{ns[:50]}-engines"
    labels = {"routerfleet.e2e/test": "true"}
    cluster.core.create_namespace({"metadata": {"name": engines_ns, "labels": labels}})
    try:
        m = fleet_manifest(cluster, ns, replicas=1)
        m["spec"]["engines"]["namespace"] = engines_ns
        m["spec"]["bootstrap"] = {"enabled": False}
        crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, m)

        def rbac_names():
            roles = {r.metadata.name for r in cluster.rbac.list_namespaced_role(engines_ns).items}
            bindings = {b.metadata.name for b in cluster.rbac.list_namespaced_role_binding(engines_ns).items}
            return roles, bindings

        roles, bindings = cluster.wait_for(
            "the Role and RoleBinding in the engines' namespace",
            lambda: rbac_names() if all(rbac_names()) else None,
            60,
        )
        assert len(roles) == 1 and len(bindings) == 1, (roles, bindings)
        crd.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)

        def gone():
            try:
                crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)
                return None
            except Exception as e:  # 404 once kopf's finalizer is off
                return getattr(e, "status", None) == 404 or None

        cluster.wait_for("the fleet deleted", gone, 60)
        assert rbac_names() == (set(), set())
    finally:
        cluster.core.delete_namespace(engines_ns)
