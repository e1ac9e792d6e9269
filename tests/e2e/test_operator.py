"""The operator (``routerfleet-operator run``, a subprocess watching the test's namespace) on a real
control plane with the process node agent (tests/e2e/conftest.py). Local provider only: the operator
and the test reach the router pods at their IPs.

`test_first_deploy`: the CRD applied, 2 fake engines (+ Service) and a 3-replica RouterFleet:
- every router pod gets ``routerfleet.io/seeded=True`` through pods/status, with a passing first-deploy
  verdict (no_peers / fleet_cold, or from_origin: a young engine's replay buffer still reaches
  sequence 0, so a replica may rebuild from it);
- ``kubectl wait --for=condition=Ready rf/NAME``, started right after the create, returns only once
  Ready=True is written with observedGeneration == metadata.generation (checked at its return);
- the status tells the same story (Complete, counts, members, conditions) and Events mark the steps;
- a completion flows through a router pod;
- deleting the RouterFleet removes everything it owned (the garbage collector, via ownerReferences).

    .venv/bin/python -m pytest tests/e2e/test_operator.py
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from e2e.fleet import (
    ENGINE,
    ENGINE_HEADER_ARG,
    ENGINE_LABELS,
    ROUTER_PORT,
    aio,
    apply,
    chat_turn,
    completion,
    engine_id,
    engines_view,
    find,
    get,
    index_diff,
    index_view,
    load_manifests,
    metrics,
    metrics_url,
    parse_metrics,
    pod_url,
)

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "routerfleet.io_routerfleets.yaml"
GROUP, VERSION, PLURAL = "routerfleet.io", "v1alpha1", "routerfleets"
SEEDED = "routerfleet.io/seeded"
FIRST_DEPLOY_VERDICTS = {"no_peers", "fleet_cold", "from_origin"}
FLEET = "rf"


def _local_only(cluster) -> None:
    if not getattr(cluster.provider, "reaches_pod_ips", False):
        pytest.skip("the operator and the test talk to pods at their IPs: local provider only")


def kubectl_path(cluster) -> str:
    c = getattr(cluster.provider, "cluster", None)
    candidates = [Path(c.bin_dir) / "kubectl"] if c is not None else []
    if os.environ.get("ROUTERFLEET_KUBE_BIN"):
        candidates.append(Path(os.environ["ROUTERFLEET_KUBE_BIN"]) / "kubectl")
    for p in candidates:
        if p.is_file():
            return str(p)
    found = shutil.which("kubectl")
    if found:
        return found
    from e2e.cluster import kube_bin_dir

    return str(kube_bin_dir(build=False) / "kubectl")


def kubectl(cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def crd(cluster):
    p = kubectl(cluster, "apply", "--server-side", "-f", str(CRD))
    assert p.returncode == 0, p.stderr
    p = kubectl(cluster, "wait", "--for=condition=Established", "crd/routerfleets.routerfleet.io")
    assert p.returncode == 0, p.stderr
    return client.CustomObjectsApi(cluster.api)


OPERATOR_STOP_LIMIT_S = 25  # the pod's grace period (30 s) less a margin


class OperatorProcess:
    """``routerfleet-operator run --namespace NS`` as a subprocess; ``kill()`` (SIGKILL: no clean
    shutdown) and ``start()`` again to test that a restart resumes from status."""

    def __init__(self, cluster, namespace: str, log_path: Path):
        self.args = [
            sys.executable, "-m", "routerfleet_operator.cli", "run", "--namespace", namespace,
            "--operator-namespace", namespace, "--verbose",
        ]  # fmt: skip
        self.env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PYTHONUNBUFFERED": "1"}
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "operator"), str(ROOT), os.environ.get("PYTHONPATH", "")]
        )
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log_path.open("a") as log:
            log.write(f"===== operator started at {time.strftime('%H:%M:%S')}\n")
            log.flush()
            self.proc = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
            )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM, as the kubelet sends it: the operator must exit within its pod's grace period (30 s,
        Kubernetes' default, which the chart keeps) less a margin, whatever it was doing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(OPERATOR_STOP_LIMIT_S)
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(f"the operator ignored SIGTERM for {OPERATOR_STOP_LIMIT_S}s") from None


@pytest.fixture
def operator(cluster, namespace, crd, tmp_path):
    """The operator watching the test's namespace (its log is printed at the end)."""
    op = OperatorProcess(cluster, namespace, tmp_path / "operator.log")
    op.start()
    try:
        yield op
    finally:
        try:
            op.stop()
        finally:
            lines = [ln for ln in op.log_path.read_text(errors="replace").splitlines() if "[DEBUG" not in ln]
            print(f"\n--- operator log without DEBUG (last 60 of {len(lines)} lines)")
            print("\n".join(lines[-60:]))


def deploy_engines(cluster, ns: str, engine_args: tuple[str, ...] = ()) -> None:
    docs = load_manifests(image=getattr(cluster.provider, "image", None))
    engine = find(docs, "Deployment", ENGINE)
    engine["spec"]["template"]["spec"]["containers"][0]["args"] += list(engine_args)
    apply(cluster.api, ns, [engine, find(docs, "Service", ENGINE)])


def fleet_manifest(cluster, ns: str, replicas: int = 3) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RouterFleet",
        "metadata": {"name": FLEET, "namespace": ns},
        "spec": {
            "replicas": replicas,
            "router": {
                "image": getattr(cluster.provider, "image", "routerfleet:dev"),
                "extraArgs": [ENGINE_HEADER_ARG],
            },
            "engines": {
                "serviceName": ENGINE,
                "kvPort": "kv",
                "replayPort": "replay",
                "dpSize": 2,
            },
            "bootstrap": {"timeout": "30s"},
        },
    }


def get_fleet(crd, ns: str) -> dict:
    return crd.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def seeded(p) -> str | None:
    return next((c.status for c in p.status.conditions or [] if c.type == SEEDED), None)


async def views_while_held(session: aiohttp.ClientSession, urls: list[str], n: int) -> list[dict]:
    """Hold ``n`` long streams open, one per replica in turn, and return each replica's /debug/load
    once every one of them counts all ``n`` (or as they stand after 15 s)."""
    rng = secrets.SystemRandom()
    streams = []
    try:
        for i in range(n):
            body = {
                "prompt": [rng.randrange(1000, 30000) for _ in range(32)],
                "max_tokens": 2000,
                "stream": True,
            }
            r = await session.post(urls[i % len(urls)] + "/v1/completions", json=body)
            assert r.status == 200, await r.text()
            await r.content.readany()
            streams.append(r)
        deadline = time.monotonic() + 15
        while True:
            views = [(await get(session, metrics_url(u) + "/debug/load"))[1] for u in urls]
            if all(sum(t["load"] for t in v["targets"]) == n for v in views) or time.monotonic() > deadline:
                return views
            await asyncio.sleep(0.1)
    finally:
        for r in streams:
            r.close()


def test_first_deploy(cluster, namespace, crd, operator):
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    deploy_engines(cluster, ns, ("--decode-tokens-per-s=100",))  # streams that stay in flight a while
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)

    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns))
    # Started at once: it must not return on anything but the new generation's Ready=True.
    waiter = subprocess.Popen(
        [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), "-n", ns, "wait",
         "--for=condition=Ready", f"rf/{FLEET}", "--timeout=150s"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        out, err = waiter.communicate(timeout=170)
    finally:
        if waiter.poll() is None:
            waiter.kill()
    t_ready = time.monotonic() - t0
    obj = get_fleet(crd, ns)  # read right after the wait returned
    assert waiter.returncode == 0, (out, err, obj.get("status"))
    ready = condition(obj, "Ready")
    gen = obj["metadata"]["generation"]
    assert ready.get("status") == "True", obj.get("status")
    assert ready.get("observedGeneration") == gen and obj["status"]["observedGeneration"] == gen, obj
    print(f"\n[operator] kubectl wait returned after {t_ready:.1f}s: {ready}")

    # every router pod is seeded (pods/status), with a passing first-deploy verdict
    sel = f"routerfleet.io/fleet={FLEET}"
    pods = cluster.wait_pods_ready(ns, sel, 3, timeout=30)
    assert all(seeded(p) == "True" for p in pods), [p.status.conditions for p in pods]
    status = obj["status"]
    verdicts = {m["pod"]: m["verdict"] for m in status["members"]}
    assert set(verdicts) == {p.metadata.name for p in pods}, (verdicts, [p.metadata.name for p in pods])
    assert set(verdicts.values()) <= FIRST_DEPLOY_VERDICTS, verdicts
    assert all(m["gate"] and m["ready"] for m in status["members"]), status["members"]
    for p in pods:
        c = next(c for c in p.status.conditions if c.type == SEEDED)
        assert c.reason.startswith("Verdict"), c
    print(f"[operator] verdicts: {sorted(verdicts.values())}")

    # the status
    assert status["rollout"]["phase"] == "Complete", status["rollout"]
    assert status["currentRevision"] == status["updateRevision"], status
    assert status["replicas"] == status["readyReplicas"] == status["updatedReplicas"] == 3, status
    assert status["selector"] == sel
    conds = {c["type"]: c["status"] for c in status["conditions"]}
    assert conds["Stalled"] == "False" and conds["Reconciling"] == "False", conds
    assert conds["CacheWarm"] == "True", status["conditions"]
    # kopf's bookkeeping stays out of the status
    assert "kopf" not in status, status.keys()

    # the owned objects, all with the fleet as controller
    uid = obj["metadata"]["uid"]
    owned = [
        cluster.apps.read_namespaced_deployment(FLEET, ns),
        cluster.core.read_namespaced_service(FLEET, ns),
        cluster.core.read_namespaced_service(f"{FLEET}-peers", ns),
        cluster.core.read_namespaced_service_account(f"{FLEET}-router", ns),
        cluster.core.read_namespaced_secret(f"{FLEET}-internal-token", ns),
        cluster.rbac.read_namespaced_role(f"{FLEET}-router", ns),
        cluster.rbac.read_namespaced_role_binding(f"{FLEET}-router", ns),
        client.PolicyV1Api(cluster.api).read_namespaced_pod_disruption_budget(FLEET, ns),
        client.NetworkingV1Api(cluster.api).read_namespaced_network_policy(f"{FLEET}-internal", ns),
    ]
    crs = cluster.apps.list_namespaced_controller_revision(ns, label_selector=sel).items
    assert [c.metadata.name for c in crs] == [f"{FLEET}-{status['currentRevision']}"], crs
    for o in [*owned, *crs]:
        refs = o.metadata.owner_references or []
        assert [(r.uid, r.controller) for r in refs] == [(uid, True)], (o.kind, o.metadata.name, refs)
    dep = owned[0]
    managers = {m.manager for m in dep.metadata.managed_fields or [] if m.operation == "Apply"}
    assert managers == {"routerfleet-operator"}, managers

    # the Events mark the steps
    events = cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={FLEET}").items
    reasons = [e.reason for e in events if e.involved_object.kind == "RouterFleet"]
    assert reasons.count("ReplicaSeeded") == 3 and "RolloutComplete" in reasons, reasons

    # one load view for the fleet (docs/fleet-load.md): every replica hears its two siblings, and
    # requests held open through all three count in every replica's view
    urls = [pod_url(p, ROUTER_PORT) for p in pods]
    cluster.wait_for(
        "every replica hears its two siblings",
        lambda: all(aio(metrics, metrics_url(u)).get("routerfleet_fleet_peers_reporting") == 2 for u in urls),
        30,
    )
    views = aio(views_while_held, urls, 6)
    assert all(sum(t["load"] for t in v["targets"]) == 6 for v in views), views
    print(
        f"[operator] fleet load as each replica sees it: {[[t['load'] for t in v['targets']] for v in views]}"
    )

    # a completion through a router pod
    rng = secrets.SystemRandom()
    tokens = [rng.randrange(1000, 30000) for _ in range(48)]
    status_code, engine, body = aio(completion, pod_url(pods[0], ROUTER_PORT), tokens)
    assert status_code == 200 and engine, (status_code, engine, body)

    # deleting the fleet removes everything it owned
    crd.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)

    def gone():
        left = []
        for fn, name in (
            (cluster.apps.read_namespaced_deployment, FLEET),
            (cluster.core.read_namespaced_service, FLEET),
            (cluster.core.read_namespaced_service, f"{FLEET}-peers"),
            (cluster.core.read_namespaced_secret, f"{FLEET}-internal-token"),
            (cluster.core.read_namespaced_service_account, f"{FLEET}-router"),
            (cluster.rbac.read_namespaced_role, f"{FLEET}-router"),
        ):
            try:
                fn(name, ns)
                left.append(name)
            except ApiException as e:
                if e.status != 404:
                    raise
        left += [c.metadata.name for c in cluster.apps.list_namespaced_controller_revision(ns).items]
        left += [p.metadata.name for p in cluster.core.list_namespaced_pod(ns, label_selector=sel).items]
        return not left

    cluster.wait_for("the fleet's objects and pods garbage-collected", gone, 90)
    print(f"[operator] first deploy test done in {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------ rollout

REPLAY_BUFFER = 8  # batches per rank: once warmed, the engines' replay no longer reaches sequence 0
WARM_PROMPTS = 96


def wait_fleet_ready(cluster, crd, ns: str, what: str, timeout: float = 150) -> dict:
    """The fleet once Ready=True for its current generation."""

    def cond():
        obj = get_fleet(crd, ns)
        ready = condition(obj, "Ready")
        gen = obj["metadata"]["generation"]
        ok = ready.get("status") == "True" and ready.get("observedGeneration") == gen
        return obj if ok and obj["status"]["observedGeneration"] == gen else None

    return cluster.wait_for(what, cond, timeout)


class Traffic:
    """Fresh prompts straight to every engine rank, a few per second, in a thread: live KV events,
    so a replica's graft is witnessed by an event (verdict warm, not warm_unwitnessed)."""

    def __init__(self, engine_urls: list[str]):
        import threading

        self.urls = engine_urls
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        rng = secrets.SystemRandom()

        async def go(session):
            i = 0
            while not self.stop.is_set():
                url = self.urls[i % len(self.urls)]
                tokens = [rng.randrange(1000, 30000) for _ in range(32)]
                try:
                    await completion(session, url, tokens, max_tokens=1, data_parallel_rank=(i // 2) % 2)
                    self.sent += 1
                except aiohttp.ClientError:
                    pass
                i += 1
                await asyncio.sleep(0.15)

        aio(go)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(10)


def test_rollout_and_scale(cluster, namespace, crd, operator):
    """A template change rolls replica by replica, each new replica seeded `warm` from a sibling (the
    engines' short replay buffers rule out a rebuild from origin); `kubectl scale rf` adds a replica."""
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    deploy_engines(cluster, ns, (f"--replay-buffer={REPLAY_BUFFER}",))
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    engine_urls = [pod_url(p, 8000) for p in engines]
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns, replicas=2))
    obj = wait_fleet_ready(cluster, crd, ns, "first deploy Ready")
    rev1 = obj["status"]["currentRevision"]
    sel = f"routerfleet.io/fleet={FLEET}"
    pods = cluster.wait_pods_ready(ns, sel, 2, timeout=30)
    print(f"\n[rollout] 2 replicas Ready after {time.monotonic() - t0:.1f}s")

    # warm the fleet: the engines' replay buffers move past sequence 0
    rng = secrets.SystemRandom()
    for i in range(WARM_PROMPTS):
        tokens = [rng.randrange(1000, 30000) for _ in range(16 * rng.randrange(3, 10))]
        code, _, body = aio(completion, pod_url(pods[i % 2], ROUTER_PORT), tokens)
        assert code == 200, body

    # a template change: a new revision, rolled out one replica at a time (maxSurge 1). The operator
    # is killed (SIGKILL) once the first new replica is seeded, and started again: it resumes from
    # the status.
    with Traffic(engine_urls):
        crd.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, FLEET,
            {"spec": {"router": {"env": [{"name": "ROUTERFLEET_E2E_ROLL", "value": "1"}]}}},
        )  # fmt: skip
        # the fleet is Ready=True for generation 1 right now: this must wait for generation 2
        waiter = subprocess.Popen(
            [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), "-n", ns, "wait",
             "--for=condition=Ready", f"rf/{FLEET}", "--timeout=180s"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        seen_unseeded_new: set[int] = set()
        restarted = False

        def rolled():
            nonlocal restarted
            ps = cluster.core.list_namespaced_pod(ns, label_selector=sel).items
            live = [p for p in ps if p.metadata.deletion_timestamp is None]
            new = [p for p in live if p.metadata.labels.get("routerfleet.io/revision") != rev1]
            seen_unseeded_new.add(sum(1 for p in new if seeded(p) != "True"))
            assert len(live) <= 3, [p.metadata.name for p in live]  # replicas + maxSurge
            ready = [p for p in live if cluster.pod_ready(p)]
            assert len(ready) >= 2 or not new, "maxUnavailable 0: never fewer Ready than replicas"
            if not restarted and sum(1 for p in new if seeded(p) == "True") == 1:
                operator.kill()
                operator.start()
                restarted = True
            o = get_fleet(crd, ns)
            r = condition(o, "Ready")
            done = (
                r.get("status") == "True"
                and r.get("observedGeneration") == o["metadata"]["generation"] == 2
                and o["status"].get("currentRevision") not in (None, rev1)
            )
            return o if done else None

        obj = cluster.wait_for("the new revision rolled out and Ready", rolled, 180)
        out, err = waiter.communicate(timeout=30)
        assert waiter.returncode == 0, (out, err)
        after_wait = get_fleet(crd, ns)["status"]
        assert after_wait["currentRevision"] != rev1 and after_wait["observedGeneration"] == 2
    assert restarted, "the operator was never restarted mid-rollout"
    rev2 = obj["status"]["currentRevision"]
    members = obj["status"]["members"]
    assert {m["revision"] for m in members} == {rev2} and len(members) == 2, members
    assert [m["verdict"] for m in members] == ["warm", "warm"], members
    assert max(seen_unseeded_new) <= 1, seen_unseeded_new
    events = cluster.core.list_namespaced_event(ns, field_selector=f"involvedObject.name={FLEET}").items
    seeded_new = [e.message for e in events if e.reason == "ReplicaSeeded" and rev2 in e.message]
    assert len(seeded_new) == 2 and all("verdict warm" in m for m in seeded_new), seeded_new
    assert any(e.reason == "RolloutStarted" for e in events)
    crs = cluster.apps.list_namespaced_controller_revision(ns, label_selector=sel).items
    assert {c.metadata.name for c in crs} == {f"{FLEET}-{rev1}", f"{FLEET}-{rev2}"}, crs
    print(f"[rollout] {rev1} -> {rev2}, both replicas warm, after {time.monotonic() - t0:.1f}s")

    # The new replicas answer like the fleet they seeded from: with the traffic stopped, each one's
    # index equals the engines' caches, per engine, rank and tier (what routing decides on).
    routers = [
        pod_url(p, ROUTER_PORT)
        for p in cluster.core.list_namespaced_pod(ns, label_selector=sel).items
        if p.metadata.deletion_timestamp is None
    ]
    truth_urls = {f"{ns}/{p.metadata.name}": pod_url(p, 8000) for p in engines}

    def indexes_agree():
        truth = aio(engines_view, truth_urls)
        views = [aio(index_view, r) for r in routers]
        return truth if truth and all(index_diff(v, truth) == [] for v in views) else None

    cluster.wait_for("the new replicas' indexes equal the engines' caches", indexes_agree, 30)

    # kubectl scale: the scale subresource changes spec.replicas; the new replica is seeded warm
    with Traffic(engine_urls):
        p = kubectl(cluster, "-n", ns, "scale", f"rf/{FLEET}", "--replicas=3")
        assert p.returncode == 0, p.stderr
        obj = wait_fleet_ready(cluster, crd, ns, "3 replicas Ready after kubectl scale")
    st = obj["status"]
    assert st["readyReplicas"] == 3 and len(st["members"]) == 3, st
    assert [m["verdict"] for m in st["members"]] == ["warm"] * 3, st["members"]
    assert cluster.apps.read_namespaced_deployment(FLEET, ns).spec.replicas == 3
    print(f"[rollout] scaled to 3 after {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------------------ fleet routing

GROUPS, CONVERSATIONS, TURNS = 8, 24, 4


def chat_workload(seed: int) -> list[tuple[str, list[str]]]:
    """Multi-turn chats in GROUPS groups that share a long system prompt: (system, user messages)."""
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))

    systems = [text(512) for _ in range(GROUPS)]
    return [
        (systems[c % GROUPS], [text(rng.randrange(200, 400)) for _ in range(TURNS)])
        for c in range(CONVERSATIONS)
    ]


async def run_chats(session: aiohttp.ClientSession, routers: list[str], chats, concurrency: int = 6) -> float:
    """Every chat turn by turn, each request to the next router in turn (as a Service spreads
    connections); the hit rate the engines reported (cached over prompt tokens)."""
    sent = 0
    totals = [0, 0]
    slots = asyncio.Semaphore(concurrency)

    async def chat(system: str, users: list[str]) -> None:
        nonlocal sent
        messages = [{"role": "system", "content": system}]
        async with slots:
            for user in users:
                messages.append({"role": "user", "content": user})
                router = routers[sent % len(routers)]
                sent += 1
                _, answer, prompt, cached = await chat_turn(session, router, messages)
                messages.append({"role": "assistant", "content": answer})
                totals[0] += prompt
                totals[1] += cached

    await asyncio.gather(*(chat(s, u) for s, u in chats))
    return totals[1] / totals[0]


async def rank_requests(session: aiohttp.ClientSession, engines: dict[str, str]) -> dict[str, float]:
    """Requests each engine rank admitted: {'<engine>/<rank>': n}."""
    out: dict[str, float] = {}
    for eid, url in engines.items():
        async with session.get(url + "/metrics") as r:
            page = parse_metrics(await r.text())
        for k, v in page.items():
            if k.startswith("routerfleet_fake_engine_requests_total{"):
                rank = k.split('rank="')[1].split('"')[0]
                out[f"{eid}/{rank}"] = out.get(f"{eid}/{rank}", 0) + v
    return out


def measure_fleet(
    cluster, crd, ns: str, n: int, chats, port: int = ROUTER_PORT, urls: list[str] | None = None
) -> tuple[float, list[float]]:
    """Once ``n`` replicas are Ready, each routing on both engines and hearing its ``n - 1``
    siblings: the workload's hit rate and the engine ranks' shares of its requests, largest first.
    ``port``: where the workload is sent on each replica (its proxy, or its standalone gateway); or
    ``urls``: where it is sent instead (a Gateway)."""
    wait_fleet_ready(cluster, crd, ns, f"{n} replicas Ready")
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2, timeout=60)
    pods = cluster.wait_pods_ready(ns, f"routerfleet.io/fleet={FLEET}", n, timeout=60)
    routers = [pod_url(p, ROUTER_PORT) for p in pods]
    engine_urls = {engine_id(p): pod_url(p, 8000) for p in engines}

    def settled() -> bool:
        pages = [aio(metrics, metrics_url(u)) for u in routers]
        return all(
            m.get('routerfleet_engines{state="closed"}') == 2
            and m.get("routerfleet_fleet_peers_reporting", 0) == n - 1
            for m in pages
        )

    cluster.wait_for(f"{n} replicas see both engines and their {n - 1} siblings", settled, 60)
    before = aio(rank_requests, engine_urls)
    hit = aio(run_chats, urls or [pod_url(p, port) for p in pods], chats)
    after = aio(rank_requests, engine_urls)
    ranks = [f"{e}/{r}" for e in engine_urls for r in (0, 1)]  # a rank with no request has no series
    counts = sorted((after.get(k, 0) - before.get(k, 0) for k in ranks), reverse=True)
    shares = [c / sum(counts) for c in counts]
    print(f"\n[fleet] {n} replica(s): hit rate {100 * hit:.1f}%, rank shares {[round(x, 2) for x in shares]}")
    return hit, shares


def test_three_replicas_route_as_well_as_one(cluster, namespace, crd, operator):
    """The fleet is the unit (docs/fleet-load.md): one multi-turn chat workload through one replica, then
    the same workload on fresh engines through three replicas, each request to the next replica. The
    three keep the hit rate one gets and spread the engine ranks' requests as evenly (replicas that
    balanced on their own in-flight counts alone could herd onto the same ranks)."""
    _local_only(cluster)
    ns = namespace
    deploy_engines(cluster, ns, ("--decode-tokens-per-s=400",))
    cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns, replicas=1))
    chats = chat_workload(seed=13)
    hit1, shares1 = measure_fleet(cluster, crd, ns, 1, chats)

    # fresh engines (empty caches), then two more replicas
    for p in cluster.core.list_namespaced_pod(ns, label_selector=ENGINE_LABELS).items:
        cluster.core.delete_namespaced_pod(p.metadata.name, ns, grace_period_seconds=0)
    p = kubectl(cluster, "-n", ns, "scale", f"rf/{FLEET}", "--replicas=3")
    assert p.returncode == 0, p.stderr
    hit3, shares3 = measure_fleet(cluster, crd, ns, 3, chats)

    figures = {"one": (hit1, shares1), "three": (hit3, shares3)}
    assert hit3 >= 0.9 * hit1, figures
    # no rank carries far more than its fair quarter, or than it did behind one router (at this low
    # load the prefix outweighs balance: one router alone leaves shares of 0.38 to 0.12)
    assert shares3[0] <= max(0.45, shares1[0] + 0.1), figures


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def respond(session: aiohttp.ClientSession, router: str, text: str, previous: str | None = None):
    """POST /v1/responses: (status, X-RouterFleet-Engine, body)."""
    body = {"model": "m", "input": text, "max_output_tokens": 3}
    if previous is not None:
        body["previous_response_id"] = previous
    async with session.post(router + "/v1/responses", json=body) as r:
        return r.status, r.headers.get("X-RouterFleet-Engine"), await r.json(content_type=None)


def test_responses_follow_ups_stay_on_their_engine_through_a_shared_store(
    cluster, namespace, crd, operator, tmp_path
):
    """Three replicas sharing a real redis-server (spec.router.sessionStore, its password from a
    Secret), each request to the next replica: every previous_response_id follow-up lands on the
    engine holding the response, after the replica that served the last turn is deleted and after a
    rolling update replaces them all; with the store killed, on every replica still (its own table,
    else the probe of the engines)."""
    _local_only(cluster)
    from e2e.cluster.netns import NODE_IP

    ns = namespace
    server = shutil.which("redis-server")
    assert server, "redis-server is not installed: run `make redis` (make test does)"
    port = free_port()
    password = secrets.token_hex(8)
    redis = subprocess.Popen(
        [server, "--bind", NODE_IP, "--port", str(port), "--save", "", "--appendonly", "no",
         "--requirepass", password, "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        cluster.core.create_namespaced_secret(
            ns, client.V1Secret(metadata=client.V1ObjectMeta(name="redis-auth"), string_data={"pw": password})
        )
        deploy_engines(cluster, ns)
        cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
        fleet = fleet_manifest(cluster, ns, replicas=3)
        store = {
            "url": f"redis://{NODE_IP}:{port}/0",
            "passwordSecretRef": {"name": "redis-auth", "key": "pw"},
        }
        fleet["spec"]["router"]["sessionStore"] = store
        crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet)
        wait_fleet_ready(cluster, crd, ns, "3 replicas with a shared store Ready")
        sel = f"routerfleet.io/fleet={FLEET}"

        def routers() -> list[str]:
            pods = cluster.core.list_namespaced_pod(ns, label_selector=sel).items
            live = [p for p in pods if p.metadata.deletion_timestamp is None and cluster.pod_ready(p)]
            return [pod_url(p, ROUTER_PORT) for p in sorted(live, key=lambda p: p.metadata.name)]

        urls = routers()
        code, engine, first = aio(respond, urls[0], "The quick brown fox " * 8)
        assert code == 200, first
        state = {"id": first["id"], "k": 0}

        def follow(where: list[str], n: int) -> None:
            for i in range(n):
                url = where[(state["k"] + i) % len(where)]
                code, got, body = aio(respond, url, f"turn {state['k'] + i}", state["id"])
                assert code == 200 and got == engine, (url, code, got, body)
                state["id"] = body["id"]
            state["k"] += n

        follow(urls[1:] + urls[:1], 6)
        from_store = 'routerfleet_response_lookups_total{source="store"}'
        stored = sum(aio(metrics, metrics_url(u)).get(from_store, 0) for u in urls)
        assert stored >= 4, stored  # the turns another replica served were found in the store
        # The replica that served the last turn is deleted.
        last = urls[(state["k"] - 1) % 3]
        victim = next(p for p in cluster.core.list_namespaced_pod(ns, label_selector=sel).items
                      if pod_url(p, ROUTER_PORT) == last)  # fmt: skip
        cluster.core.delete_namespaced_pod(victim.metadata.name, ns, grace_period_seconds=0)
        follow([u for u in urls if u != last], 2)
        # A rolling update replaces every replica.
        crd.patch_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL, FLEET,
            {"spec": {"router": {"env": [{"name": "ROUTERFLEET_E2E_ROLL", "value": "1"}]}}},
        )  # fmt: skip
        obj = wait_fleet_ready(cluster, crd, ns, "the new revision rolled out", timeout=240)
        cluster.wait_for(
            "3 new replicas Ready", lambda: len(routers()) == 3 and set(routers()).isdisjoint(urls), 90
        )
        assert obj["status"]["currentRevision"]
        follow(routers(), 3)
        # The store dies: no replica fails a follow-up.
        redis.kill()
        redis.wait()
        follow(routers(), 3)
        up = [aio(metrics, metrics_url(u)).get("routerfleet_shared_store_up") for u in routers()]
        assert 0 in up, up
    finally:
        if redis.poll() is None:
            redis.kill()
            redis.wait()


# ------------------------------------------------------------------------------------------ in the cluster

OPERATOR_MANIFESTS = ROOT / "manifests" / "operator"
OPERATOR_LABELS = "app.kubernetes.io/name=routerfleet-operator"


def operator_docs(cluster, ns: str) -> tuple[list[dict], list[dict]]:
    """(cluster-scoped, namespaced) objects of manifests/operator, moved into ``ns``: its own binding
    name, the test namespace's ServiceAccount, the e2e image."""
    docs = [
        d
        for f in ("crds/clusterkopfpeerings.kopf.dev.yaml", "operator.yaml")
        for d in yaml.safe_load_all((OPERATOR_MANIFESTS / f).read_text())
        if d
    ]
    cluster_scoped, namespaced = [], []
    for d in docs:
        if d["kind"] == "ClusterRoleBinding":
            d["metadata"]["name"] = f"routerfleet-operator-{ns}"
            d["subjects"][0]["namespace"] = ns
        if d["kind"] == "Deployment":
            d["spec"]["template"]["spec"]["containers"][0]["image"] = getattr(
                cluster.provider, "image", "routerfleet:dev"
            )
        if d["kind"] in ("ServiceAccount", "Deployment", "Service"):
            d["metadata"]["namespace"] = ns
            namespaced.append(d)
        else:
            cluster_scoped.append(d)
    return cluster_scoped, namespaced


def test_two_operator_replicas_in_cluster(cluster, namespace, crd):
    """manifests/operator as deployed: 2 operator pods under their least-privilege ClusterRole, kopf
    peering with distinct priorities (one active, one paused); the fleet is reconciled; the active
    replica deleted, the fleet is still reconciled (a scale-up)."""
    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    cluster_scoped, namespaced = operator_docs(cluster, ns)
    binding = f"routerfleet-operator-{ns}"
    p = subprocess.run(
        [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), "apply", "--server-side", "-f", "-"],
        input="\n---\n".join(yaml.safe_dump(d) for d in cluster_scoped if d["kind"] != "ClusterKopfPeering"),
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert (
        kubectl(cluster, "wait", "--for=condition=Established", "crd/clusterkopfpeerings.kopf.dev").returncode
        == 0
    )
    peering = next(d for d in cluster_scoped if d["kind"] == "ClusterKopfPeering")
    p = subprocess.run(
        [kubectl_path(cluster), "--kubeconfig", str(cluster.kubeconfig), "apply", "--server-side", "-f", "-"],
        input=yaml.safe_dump(peering),
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    try:
        deploy_engines(cluster, ns)
        apply(cluster.api, ns, namespaced)
        ops = cluster.wait_pods_ready(ns, OPERATOR_LABELS, 2, timeout=60)

        peering = client.CustomObjectsApi(cluster.api)

        def both_peers():
            st = (
                peering.get_cluster_custom_object(
                    "kopf.dev", "v1", "clusterkopfpeerings", "routerfleet-operator"
                ).get("status")
                or {}
            )
            names_ = {o.metadata.name for o in ops}
            return st if names_ <= set(st) else None

        peers = cluster.wait_for("both replicas in the ClusterKopfPeering", both_peers, 60)
        prio = {n: peers[n]["priority"] for n in (o.metadata.name for o in ops)}
        assert len(set(prio.values())) == 2, prio  # distinct: equal priorities freeze both
        active = max(prio, key=prio.get)
        (paused,) = set(prio) - {active}
        print(f"\n[ha] priorities {prio}: {active} active ({time.monotonic() - t0:.1f}s)")

        cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
        crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns, 2))
        obj = wait_fleet_ready(cluster, crd, ns, "fleet Ready under the in-cluster operator")
        assert [m["verdict"] in FIRST_DEPLOY_VERDICTS for m in obj["status"]["members"]] == [True, True]
        # only the higher-priority replica reconciled (the other is paused by kopf peering)
        assert "ReplicaSeeded" in cluster.container_log(ns, active, "operator")
        assert "ReplicaSeeded" not in cluster.container_log(ns, paused, "operator")
        print(f"[ha] fleet Ready under the active replica ({time.monotonic() - t0:.1f}s)")
        # the metrics Service selects both replicas; the active one counts its reconciles
        slices = cluster.disc.list_namespaced_endpoint_slice(
            ns, label_selector="kubernetes.io/service-name=routerfleet-operator-metrics"
        ).items
        assert sum(len(s.endpoints or []) for s in slices) == 2, slices
        by_name = {o.metadata.name: o for o in ops}
        samples = aio(metrics, f"http://{by_name[active].status.pod_ip}:9090")
        assert samples.get('routerfleet_operator_reconciles_total{result="ok"}', 0) > 0, samples

        # the active replica goes: another one (the survivor or the Deployment's new pod) takes over
        cluster.core.delete_namespaced_pod(active, ns)
        cluster.wait_pod_gone(ns, active, timeout=60)
        p = kubectl(cluster, "-n", ns, "scale", f"rf/{FLEET}", "--replicas=3")
        assert p.returncode == 0, p.stderr
        obj = wait_fleet_ready(cluster, crd, ns, "3 replicas Ready after a failover", timeout=150)
        assert obj["status"]["readyReplicas"] == 3, obj["status"]
        print(f"[ha] scaled to 3 after the failover ({time.monotonic() - t0:.1f}s)")
    finally:
        try:
            cluster.rbac.delete_cluster_role_binding(binding)
        except ApiException as e:
            if e.status != 404:
                raise


def helm_install_operator(cluster, ns: str) -> str:
    """charts/routerfleet-operator installed by helm into ``ns``, watching only ``ns`` (the other tests'
    operators own theirs), without the CRDs (the suite's); returns the release name."""
    from e2e import chart

    release = f"op-{ns[-5:]}"  # the namespace's random suffix
    peering_crd = OPERATOR_MANIFESTS / "crds" / "kopfpeerings.kopf.dev.yaml"
    p = kubectl(cluster, "apply", "--server-side", "-f", str(peering_crd))
    assert p.returncode == 0, p.stderr
    assert (
        kubectl(cluster, "wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev").returncode == 0
    )
    kube = ("--kubeconfig", str(cluster.kubeconfig), "--namespace", ns)
    repo, tag = getattr(cluster.provider, "image", "routerfleet:dev").rsplit(":", 1)
    sets = (f"watchNamespaces={{{ns}}}", "crds.install=false", f"image.repository={repo}", f"image.tag={tag}")
    chart.run("install", release, str(chart.CHART), *kube, *(a for v in sets for a in ("--set", v)))
    return release


def test_helm_install_and_uninstall(cluster, namespace, crd):
    """charts/routerfleet-operator installed by helm, watching this namespace (the other tests' operators
    own theirs): its replicas coordinate through a KopfPeering here, the fleet is reconciled to Ready,
    and `helm uninstall` leaves nothing of the release behind. The CRDs are the suite's (installed
    before any test), so the release does not install them (tests/operator/test_chart.py renders them)."""
    from e2e import chart

    _local_only(cluster)
    ns = namespace
    t0 = time.monotonic()
    release = helm_install_operator(cluster, ns)
    kube = ("--kubeconfig", str(cluster.kubeconfig), "--namespace", ns)
    selector = f"app.kubernetes.io/instance={release}"
    try:
        ops = cluster.wait_pods_ready(ns, selector, 2, timeout=90)
        print(f"\n[helm] {release}: {len(ops)} operator pods Ready ({time.monotonic() - t0:.1f}s)")
        deploy_engines(cluster, ns)
        cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
        crd.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, fleet_manifest(cluster, ns, 2))
        obj = wait_fleet_ready(cluster, crd, ns, "fleet Ready under the helm-installed operator")
        assert len(obj["status"]["members"]) == 2
        names = {o.metadata.name for o in ops}

        def both_peers():
            p = client.CustomObjectsApi(cluster.api).get_namespaced_custom_object(
                "kopf.dev", "v1", ns, "kopfpeerings", "routerfleet-operator"
            )
            return p if names <= set(p.get("status") or {}) else None

        cluster.wait_for("both replicas in the namespace's KopfPeering", both_peers, 30)
        # One replica reconciled, the other stood by: each waited for the peering object Helm creates
        # after the Deployment (routerfleet_operator/peering.py), so neither ran as if alone.
        logs = {n: cluster.container_log(ns, n, "operator") for n in names}
        seeded = [n for n, log in logs.items() if "ReplicaSeeded" in log]
        assert len(seeded) == 1, seeded
        print(
            f"[helm] fleet Ready, both replicas in the namespace's KopfPeering ({time.monotonic() - t0:.1f}s)"
        )
        crd.delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, FLEET)  # the operator's finalizer
        cluster.wait_for("the fleet gone", lambda: not crd.list_namespaced_custom_object(
            GROUP, VERSION, ns, PLURAL)["items"], 60)  # fmt: skip
    finally:
        chart.run("uninstall", release, *kube, "--wait", "--timeout", "60s")
    sel = {"label_selector": selector}
    listed = [
        ("deployment", cluster.apps.list_namespaced_deployment(ns, **sel).items),
        ("serviceaccount", cluster.core.list_namespaced_service_account(ns, **sel).items),
        ("service", cluster.core.list_namespaced_service(ns, **sel).items),
        ("clusterrole", cluster.rbac.list_cluster_role(**sel).items),
        ("clusterrolebinding", cluster.rbac.list_cluster_role_binding(**sel).items),
    ]
    left = [f"{kind}/{o.metadata.name}" for kind, objs in listed for o in objs]
    peerings = client.CustomObjectsApi(cluster.api).list_namespaced_custom_object(
        "kopf.dev", "v1", ns, "kopfpeerings", **sel
    )
    left += [f"kopfpeering/{k['metadata']['name']}" for k in peerings["items"]]
    assert not left, f"helm uninstall left {left}"
    print(f"[helm] uninstalled, nothing of {release} left ({time.monotonic() - t0:.1f}s)")


def test_the_operator_waits_for_its_peering_object(cluster, namespace, monkeypatch):
    """`run --peering` waits for the peering object kopf will use (created by Helm after the Deployment)
    and, past its bound, says which is missing instead of running as if alone."""
    from routerfleet_operator.handlers import connect
    from routerfleet_operator.peering import PeeringMissing, wait_for_peering

    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    peering_crd = OPERATOR_MANIFESTS / "crds" / "kopfpeerings.kopf.dev.yaml"
    assert kubectl(cluster, "apply", "--server-side", "-f", str(peering_crd)).returncode == 0
    assert (
        kubectl(cluster, "wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev").returncode == 0
    )
    obj = {
        "apiVersion": "kopf.dev/v1",
        "kind": "KopfPeering",
        "metadata": {"name": "late", "namespace": namespace},
    }

    async def scenario() -> None:
        kube = await connect()
        try:
            with pytest.raises(PeeringMissing, match=f"namespaces/{namespace}/kopfpeerings/late"):
                await wait_for_peering(kube, "late", [namespace], timeout_s=1.0)
            waiter = asyncio.ensure_future(wait_for_peering(kube, "late", [namespace], timeout_s=30.0))
            await asyncio.sleep(1.0)
            assert not waiter.done()
            await asyncio.to_thread(
                client.CustomObjectsApi(cluster.api).create_namespaced_custom_object,
                "kopf.dev", "v1", namespace, "kopfpeerings", obj,
            )  # fmt: skip
            await asyncio.wait_for(waiter, 10)  # it returns once the object exists
        finally:
            await kube.close()

    asyncio.run(scenario())
