"""The router fleet of manifests/base on a real control plane, deployed as is (image and fleet token
replaced), with the shared `cluster` and a fresh `namespace` (tests/e2e/conftest.py). Local provider
only: the test talks to the router and engine pods at their pod IPs.

1. `test_router_fleet`: the router discovers the engines through EndpointSlices as its own
   ServiceAccount (get/list/watch endpointslices, nothing else) and a completion flows through it; an
   engine pod deleted and recreated is dropped and re-added; the first replica is warmed with
   token-ID completions; scaling the Deployment 1 -> 3 gives replicas whose bootstrap verdict is
   `warm` (inherited from the sibling: the engines' replay buffers are kept short, so they no longer
   reach sequence 0 and the `from_origin` rebuild cannot apply), whose index equals the first
   one's (and the engines') per engine, rank and tier, and whose routing decisions for 1200 token
   sequences equal the first replica's.
2. `test_router_without_rbac_rule`: the Role's rule removed: discovery reports not-synced in
   /metrics and /readyz (the pod stays unready) instead of failing silently; the rule restored: ready.

    .venv/bin/python -m pytest tests/e2e/test_router_in_cluster.py

Routing decisions are observed without side effects: a probe is a completion the engine refuses with
400 (`n: 2`; the fake engine only does n=1) after the router has chosen it, so nothing is cached, and
the router's answer names the engine it chose (X-RouterFleet-Engine). The DP rank it chose is not
visible that way; the per-rank index digests cover ranks.
"""

from __future__ import annotations

import random
import secrets
import time

import pytest
from kubernetes import client

from e2e.fleet import (
    BLOCK,
    ENGINE,
    ENGINE_LABELS,
    ENGINE_PORT,
    INTERNAL_PORT,
    ROUTER,
    ROUTER_LABELS,
    ROUTER_PORT,
    ROUTER_ROLE,
    ROUTER_SA,
    aio,
    apply,
    bootstrap_report,
    completion,
    engine_id,
    engines_view,
    find,
    get,
    index_diff,
    index_view,
    load_idle,
    load_manifests,
    metrics,
    metrics_url,
    pod_url,
)

WARM_PROMPTS = 96
PROBES = 1200
REPLAY_BUFFER = 8  # batches per rank; the warm-up publishes 20-40 per rank


def _local_only(cluster) -> None:
    if not getattr(cluster.provider, "reaches_pod_ips", False):
        pytest.skip("talks to pods at their IPs: local provider only")


def _deploy(
    cluster, ns: str, token: str, *, role_rules: list | None = None, engine_args: tuple[str, ...] = ()
) -> list[dict]:
    docs = load_manifests(image=getattr(cluster.provider, "image", None), token=token)
    if role_rules is not None:
        find(docs, "Role", ROUTER_ROLE)["rules"] = role_rules
    find(docs, "Deployment", ENGINE)["spec"]["template"]["spec"]["containers"][0]["args"] += engine_args
    apply(cluster.api, ns, docs)
    return docs


def _can(cluster, ns: str, sa: str, verb: str, resource: str, group: str) -> bool:
    review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
        {
            "spec": {
                "user": f"system:serviceaccount:{ns}:{sa}",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}"],
                "resourceAttributes": {"namespace": ns, "verb": verb, "resource": resource, "group": group},
            }
        }
    )
    return bool(review.status.allowed)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def _discovered(session, router: str) -> tuple[dict, dict, set, set]:
    """(metrics, /readyz body, engines with a connected subscription, engines in the index)."""
    m = await metrics(session, metrics_url(router))
    _, ready = await get(session, router + "/readyz")
    _, index = await get(session, metrics_url(router) + "/debug/index")
    connected = {s["engine"] for s in index["subscriptions"] if s["connected"]}
    # Engines that left are kept (hidden) for re-adoption during the grace window: count visible ones.
    visible = {c["engine"] for c in index["carriers"] if c.get("state", "ok") == "ok"}
    subscribed = {s["engine"] for s in index["subscriptions"]} | visible
    return m, ready, connected, subscribed


def _wait_discovery(cluster, router: str, want: set[str], what: str) -> dict:
    """Wait until the router's discovery lists exactly ``want`` (synced, 2 ranks each connected)."""

    def cond():
        m, ready, connected, subscribed = aio(_discovered, router)
        ok = (
            m.get("routerfleet_discovery_synced") == 1
            and m.get("routerfleet_discovery_workers") == len(want)
            and connected == want
            and subscribed == want
            and ready.get("ready") is True
        )
        return m if ok else None

    return cluster.wait_for(what, cond, 60)


async def _views(session, routers: list[str], engines: dict[str, str]) -> tuple[list[dict], dict]:
    return [await index_view(session, r) for r in routers], await engines_view(session, engines)


async def _route_all(session, routers: list[str], probes: list[list[int]]) -> list[list]:
    """Each router's decision (the engine it chose) for every probe. One probe at a time, one router
    after the other, each starting once every replica's fleet load view is idle: the replicas share
    their load (docs/fleet-load.md), so a sibling's in-flight probe would rightly skew a decision."""

    out = []
    for router in routers:
        await load_idle(session, routers)
        decisions = []
        for tokens in probes:
            status, engine, body = await completion(session, router, tokens, max_tokens=1, n=2)
            assert status == 400 and "n=1" in str(body), (status, body)  # refused: nothing cached
            decisions.append(engine)
        out.append(decisions)
    return out


def test_router_fleet(cluster, namespace):
    _local_only(cluster)
    ns, core, apps = namespace, cluster.core, cluster.apps
    t0 = time.monotonic()
    token = secrets.token_hex(16)
    # A short replay buffer, as a long-running engine's: once warm, it no longer reaches sequence 0,
    # so a new replica cannot rebuild a rank from the engine (verdict from_origin) and must inherit a
    # sibling's index (verdict warm), which is what this test is about.
    _deploy(cluster, ns, token, engine_args=(f"--replay-buffer={REPLAY_BUFFER}",))

    # The router's ServiceAccount may get/list/watch endpointslices and nothing else.
    for verb in ("get", "list", "watch"):
        assert _can(cluster, ns, ROUTER_SA, verb, "endpointslices", "discovery.k8s.io")
    assert not _can(cluster, ns, ROUTER_SA, "list", "pods", "")
    assert not _can(cluster, ns, ROUTER_SA, "list", "endpoints", "")
    assert not _can(cluster, ns, "default", "list", "endpointslices", "discovery.k8s.io")

    cluster.wait_deployment_available(ns, ENGINE)
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    cluster.wait_deployment_available(ns, ROUTER, timeout=120)
    (r0,) = cluster.wait_pods_ready(ns, ROUTER_LABELS, 1)
    assert r0.spec.service_account_name == ROUTER_SA
    router = pod_url(r0, ROUTER_PORT)
    print(f"\n[fleet] engines and router ready after {time.monotonic() - t0:.1f}s")

    # 1. discovery through EndpointSlices, and a completion through the router (at its pod IP)
    ids = {engine_id(p) for p in engines}
    m = _wait_discovery(cluster, router, ids, "router discovered both engines (synced, subscriptions live)")
    assert m.get('routerfleet_discovery_errors_total{reason="forbidden"}') == 0, m
    rng = random.Random(11)
    status, chosen, body = aio(completion, router, _tokens(rng, 3 * BLOCK))
    assert status == 200 and chosen in ids, (status, chosen, body)
    assert body["usage"]["prompt_tokens"] == 3 * BLOCK, body

    # 2. an engine pod deleted: dropped; its replacement (a new pod) added
    victim = engines[0]
    core.delete_namespaced_pod(victim.metadata.name, ns)
    cluster.wait_pod_gone(ns, victim.metadata.name)
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    new_ids = {engine_id(p) for p in engines}
    assert engine_id(victim) not in new_ids and len(new_ids - ids) == 1, (ids, new_ids)
    _wait_discovery(cluster, router, new_ids, "router dropped the deleted engine and added its replacement")
    engine_urls = {engine_id(p): pod_url(p, ENGINE_PORT) for p in engines}
    print(f"[fleet] engine replaced and rediscovered after {time.monotonic() - t0:.1f}s")

    # 3. warm the first replica: token-ID completions through it
    warm = [_tokens(rng, BLOCK * rng.randrange(3, 13) + rng.randrange(BLOCK)) for _ in range(WARM_PROMPTS)]
    owners = []
    for tokens in warm:
        status, chosen, body = aio(completion, router, tokens)
        assert status == 200 and chosen in new_ids, (status, chosen, body)
        owners.append(chosen)
    assert set(owners) == new_ids, "the warm-up should have spread over both engines"

    def agrees_with_engines(routers):
        def cond():
            views, truth = aio(_views, routers, engine_urls)
            diffs = {r: index_diff(v, truth) for r, v in zip(routers, views, strict=True)}
            return (views, truth) if truth and not any(diffs.values()) else None

        return cond

    cluster.wait_for(
        "the first replica's index equals the engines' caches", agrees_with_engines([router]), 30
    )

    # 4. scale 1 -> 3: the new replicas pull the first one's index
    t_scale = time.monotonic()
    apps.patch_namespaced_deployment_scale(ROUTER, ns, {"spec": {"replicas": 3}})
    cluster.wait_deployment_available(ns, ROUTER, timeout=120)
    pods = cluster.wait_pods_ready(ns, ROUTER_LABELS, 3)
    t_ready = time.monotonic() - t_scale
    others = sorted((p for p in pods if p.metadata.uid != r0.metadata.uid), key=lambda p: p.metadata.name)
    assert len(others) == 2
    routers = [router] + [pod_url(p, ROUTER_PORT) for p in others]
    internals = [pod_url(p, INTERNAL_PORT) for p in [r0, *others]]

    # A live batch on every rank proves each graft joins the stream (else, after a quiet spell, a
    # rank settles as warm_unwitnessed): one new prompt straight to each engine's ranks.
    for url in engine_urls.values():
        for rank in (0, 1):
            status, _, body = aio(completion, url, _tokens(rng, 2 * BLOCK), data_parallel_rank=rank)
            assert status == 200, body

    def all_warm():
        reports = [aio(bootstrap_report, u, token) for u in internals[1:]]
        ok = all(
            r["settled"]
            and r["verdict"] == "warm"
            and r["ranks"]
            and all(k["outcome"] == "warm" for k in r["ranks"])
            for r in reports
        )
        return reports if ok else None

    reports = cluster.wait_for("both new replicas settled with verdict warm on every rank", all_warm, 60)
    first = aio(bootstrap_report, internals[0], token)
    assert first["verdict"] == "no_peers", first  # it booted alone
    for p, r in zip(others, reports, strict=True):
        assert r["peers"]["seen"] >= 1 and not r["seedFailed"], r
        print(
            f"[fleet] {p.metadata.name}: verdict {r['verdict']}, {len(r['ranks'])} ranks warm, "
            f"{r['index']['blocks']} blocks, settled {r['settledAfterSeconds']:.2f}s after its first rank"
        )
    print(f"[fleet] 2 new replicas Ready {t_ready:.1f}s after the scale-up")

    # 5. every replica's index equals the first one's and the engines', per engine/rank/tier
    views, truth = cluster.wait_for(
        "all three replicas' indexes equal the engines' caches", agrees_with_engines(routers), 30
    )
    assert all(v == views[0] for v in views), views
    n_blocks = sum(b for k, (b, _) in truth.items())
    print(f"[fleet] 3 indexes agree: {len(views[0])} (engine, rank, tier) views, {n_blocks} blocks")

    # 6. the same routing decision from every replica for PROBES token sequences: prefixes of the warm
    # prompts cut at a block boundary plus a fresh tail (the owner must win), and some cold ones
    probes, expect = [], []
    for i in range(PROBES):
        if i % 10 == 9:
            probes.append(_tokens(rng, rng.randrange(BLOCK, 6 * BLOCK)))
            expect.append(None)
            continue
        j = rng.randrange(WARM_PROMPTS)
        cut = BLOCK * rng.randrange(1, len(warm[j]) // BLOCK + 1)
        # a tail of at least one token: an engine never reuses a prompt's last token (scheduling/reuse.py)
        probes.append(warm[j][:cut] + _tokens(rng, rng.randrange(1, 3 * BLOCK)))
        expect.append(owners[j])
    t = time.monotonic()
    decisions = aio(_route_all, routers, probes)
    elapsed = time.monotonic() - t
    for r, d in zip(routers[1:], decisions[1:], strict=True):
        differ = [i for i in range(PROBES) if d[i] != decisions[0][i]]
        assert not differ, f"{r}: {len(differ)}/{PROBES} decisions differ from the first replica's"
    wrong = [i for i in range(PROBES) if expect[i] is not None and decisions[0][i] != expect[i]]
    assert not wrong, f"{len(wrong)} probes not routed to the engine holding their prefix"
    print(f"[fleet] {PROBES} probes x 3 replicas: identical decisions ({elapsed:.1f}s)")
    # the probes cached nothing
    assert aio(engines_view, engine_urls) == truth


def test_router_without_rbac_rule(cluster, namespace):
    _local_only(cluster)
    ns = namespace
    rules = find(load_manifests(), "Role", ROUTER_ROLE)["rules"]
    docs = _deploy(cluster, ns, secrets.token_hex(16), role_rules=[])  # the Role, without its rule
    assert not _can(cluster, ns, ROUTER_SA, "list", "endpointslices", "discovery.k8s.io")
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)

    def running(objs):
        pods = [p for p in objs.values() if p.status.phase == "Running" and p.status.pod_ip]
        return pods[0] if len(pods) == 1 else None

    pod = cluster.wait_for(
        "router pod running",
        running,
        60,
        (cluster.core.list_namespaced_pod, {"namespace": ns, "label_selector": ROUTER_LABELS}),
    )
    router = pod_url(pod, ROUTER_PORT)

    def not_synced():
        m = aio(metrics, metrics_url(router))
        status, ready = aio(get, router + "/readyz")
        ok = (
            m.get("routerfleet_discovery_synced") == 0
            and m.get('routerfleet_discovery_errors_total{reason="forbidden"}', 0) >= 1
            and m.get("routerfleet_discovery_workers") == 0
            and status == 503
            and "engine discovery not synced" in ready["reason"]
            and "forbidden" in ready["reason"]
        )
        return (m, ready) if ok else None

    _, ready = cluster.wait_for(
        "discovery reports forbidden, not synced, in /metrics and /readyz", not_synced, 60
    )
    print(f"\n[rbac] /readyz 503: {ready['reason'][:160]}")
    p = cluster.core.read_namespaced_pod(pod.metadata.name, ns)
    assert cluster.conditions(p).get("Ready") == "False", p.status.conditions
    assert find(docs, "Deployment", ROUTER)["spec"]["template"]["spec"]["serviceAccountName"] == ROUTER_SA

    # the rule back: the next relist (bounded backoff, at most 30 s) syncs and the pod turns Ready
    cluster.rbac.patch_namespaced_role(ROUTER_ROLE, ns, {"rules": rules})
    cluster.wait_pod(ns, pod.metadata.name, cluster.pod_ready, "router Ready once the rule is back", 90)
    _wait_discovery(cluster, router, {engine_id(e) for e in engines}, "router discovered both engines")
