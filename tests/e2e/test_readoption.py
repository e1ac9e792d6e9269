"""Warm re-adoption on a real control plane (issue 8): an engine's container is killed and restarts in
the same pod with its storage directory (an emptyDir) intact; the router that keeps a departed
engine's blocks hidden for re-adoption routes the prefixes that lived on its disk tier back to it,
and they hit, within a second of its return. A second router beside it, with re-adoption off
(``--kv-disconnect-grace-s=0``: today's behaviour, a departed engine's blocks are erased), routes the
same kind of prefixes cold.

    .venv/bin/python -m e2e.cluster pytest tests/e2e/test_readoption.py

The kill is a SIGKILL to the container's process (the node agent reports it as
``process://<pid>``), as an OOM kill would be; the node agent restarts the container in the same pod,
so the engine keeps its identity and its pod UID (the router's incarnation for it) and comes back as
a new process: the router tells it apart by its event stream, whose sequence starts again, and
re-adopts its disk tier only because /server_info proves the same storage identity and epoch.

"Its return" is the moment the test sees the pod Ready again in the API. From then on both routers
are probed side-effect free (a completion the engine refuses after the router chose it: ``n: 2``)
until 95% of the prefixes route to the engine; then real completions measure the hits. Each router
gets its own prefixes (the hits of one would otherwise warm the other's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import secrets
import signal
import threading
import time

import pytest

from e2e.fleet import (
    BLOCK,
    ENGINE,
    ENGINE_LABELS,
    ENGINE_PORT,
    ROUTER,
    ROUTER_LABELS,
    ROUTER_PORT,
    aio,
    apply,
    completion,
    engine_id,
    find,
    get,
    load_manifests,
    metrics,
    metrics_url,
    pod_url,
)

COLD = "router-cold"
COLD_LABELS = "app.kubernetes.io/name=routerfleet-router-cold"
STORAGE = "/var/lib/routerfleet-kv"
PREFIXES = 40  # per router, on the victim's disk tier, half on each DP rank
PREFIX_BLOCKS = 4
RECOVERY_S = 1.0  # the bound, from the engine's return
SHARE = 0.95


def _local_only(cluster) -> None:
    if not getattr(cluster.provider, "reaches_pod_ips", False):
        pytest.skip("talks to pods at their IPs and kills a container's process: local provider only")


def _deploy(cluster, ns: str) -> None:
    docs = load_manifests(image=getattr(cluster.provider, "image", None), token=secrets.token_hex(16))
    pod = find(docs, "Deployment", ENGINE)["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    engine["args"] += [f"--storage-dir={STORAGE}", "--disk-capacity-blocks=4096"]
    engine.setdefault("volumeMounts", []).append({"name": "kv-storage", "mountPath": STORAGE})
    pod.setdefault("volumes", []).append({"name": "kv-storage", "emptyDir": {}})
    # The same router with re-adoption off, beside the first (not one of its peers: other labels).
    cold = find(docs, "Deployment", ROUTER)
    cold = {**cold, "metadata": {**cold["metadata"], "name": COLD}}
    labels = {"app.kubernetes.io/name": "routerfleet-router-cold"}
    spec = cold["spec"] = {**cold["spec"], "selector": {"matchLabels": labels}}
    template = spec["template"] = {**spec["template"], "metadata": {"labels": labels}}
    container = dict(template["spec"]["containers"][0])
    container["args"] = [*container["args"], "--kv-disconnect-grace-s=0"]
    template["spec"] = {**template["spec"], "containers": [container]}
    apply(cluster.api, ns, [*docs, cold])


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


async def _store_on_disk(session, engine: str, prompts: list[list[int]]) -> None:
    for i, tokens in enumerate(prompts):
        body = {"rank": i % 2, "token_ids": tokens, "medium": "STORAGE"}
        async with session.post(engine + "/admin/store", json=body) as r:
            assert r.status == 200, await r.text()


_PROBES = itertools.count(40_000)  # a fresh block per probe: a resident block's store publishes nothing


async def _joined(session, engine_url: str, routers: list[str], engine: str) -> bool:
    """One probe batch on each of the engine's ranks; whether every router has taken a batch from each.
    ZMQ drops what a publisher sends before a new subscriber's subscription reaches it, and nothing
    shows that gap until a later batch: until both routers have taken one, a store could go unseen.
    Each probe stores a new block: storing one already resident publishes no batch at all (as in
    vLLM), so a repeated probe whose first batch was dropped would never be seen."""
    for rank in (0, 1):
        body = {"rank": rank, "token_ids": [next(_PROBES)] * BLOCK}
        async with session.post(engine_url + "/admin/store", json=body) as r:
            assert r.status == 200, await r.text()
    for router in routers:
        _, index = await get(session, metrics_url(router) + "/debug/index")
        cursors = [s["cursor"] for s in index["subscriptions"] if s["engine"] == engine]
        if len(cursors) != 2 or any(c is None or c < 0 for c in cursors):
            return False
    return True


async def _routes(session, router: str, prompts: list[list[int]]) -> list[str | None]:
    """Where the router sends each prompt (plus a partial block), without caching anything: the engine
    refuses ``n: 2`` after the router has chosen it."""
    out = []
    for tokens in prompts:
        status, chosen, body = await completion(session, router, [*tokens, 7, 7, 7], max_tokens=1, n=2)
        assert status in (400, 502, 503), (status, body)
        out.append(chosen if status == 400 else None)
    return out


async def _hits(session, router: str, prompts: list[list[int]]) -> tuple[int, list[str | None]]:
    """Real completions: how many reused the whole prefix (cached_tokens), and where each went."""
    hit, where = 0, []
    for tokens in prompts:
        status, chosen, body = await completion(session, router, [*tokens, 7, 7, 7], max_tokens=1)
        assert status == 200, body
        cached = (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        hit += cached >= PREFIX_BLOCKS * BLOCK
        where.append(chosen)
    return hit, where


async def _victim_state(session, router: str, victim: str) -> tuple[str, int]:
    """(state, disk blocks visible) of the victim's carriers in a router's /debug/index."""
    _, index = await get(session, metrics_url(router) + "/debug/index")
    mine = [c for c in index["carriers"] if c["engine"] == victim]
    if not mine:
        return "absent", 0
    states = {c.get("state", "ok") for c in mine}
    state = states.pop() if len(states) == 1 else "mixed"
    return state, sum(c["tiers"]["disk"]["blocks"] for c in mine) if state == "ok" else 0


def test_container_restart_is_readopted_within_a_second(cluster, namespace):
    _local_only(cluster)
    ns, core = namespace, cluster.core
    _deploy(cluster, ns)
    engines = cluster.wait_pods_ready(ns, ENGINE_LABELS, 2)
    (r_warm,) = cluster.wait_pods_ready(ns, ROUTER_LABELS, 1, timeout=120)
    (r_cold,) = cluster.wait_pods_ready(ns, COLD_LABELS, 1, timeout=120)
    warm, cold = pod_url(r_warm, ROUTER_PORT), pod_url(r_cold, ROUTER_PORT)
    victim_pod, other_pod = engines
    victim, other = engine_id(victim_pod), engine_id(other_pod)
    victim_url = pod_url(victim_pod, ENGINE_PORT)

    rng = random.Random(8)
    sets = {r: [_tokens(rng, PREFIX_BLOCKS * BLOCK) for _ in range(PREFIXES)] for r in (warm, cold)}
    cluster.wait_for(
        f"both routers follow {victim}'s streams", lambda: aio(_joined, victim_url, [warm, cold], victim), 30
    )
    aio(_store_on_disk, victim_url, sets[warm] + sets[cold])

    def routed_to_victim(router, prompts):
        def cond():
            where = aio(_routes, router, prompts)
            return where if where.count(victim) == len(prompts) else None

        return cond

    for r in (warm, cold):
        cluster.wait_for(f"{r} routes every disk prefix to {victim}", routed_to_victim(r, sets[r]), 30)
    m_before = aio(metrics, metrics_url(warm))

    # Kill the engine's container process; the node agent restarts it in the same pod.
    status = core.read_namespaced_pod(victim_pod.metadata.name, ns).status.container_statuses[0]
    pid = int(status.container_id.removeprefix("process://"))
    restarts = status.restart_count
    # The warm router's view of the victim, sampled every 10 ms from the kill until it is adopted.
    samples: list[tuple[float, str, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            with contextlib.suppress(Exception):
                state, disk = aio(_victim_state, warm, victim)
                samples.append((time.monotonic(), state, disk))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)

    def hidden():
        states = [aio(_victim_state, r, victim)[0] for r in (warm, cold)]
        return states if states[0] == "disconnected" and states[1] in ("absent", "ok") else None

    cluster.wait_for("the warm router hides the victim, the cold one erases it", hidden, 30)

    def back(p):
        cs = p.status.container_statuses or []
        ready = any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
        return ready and cs and cs[0].restart_count > restarts

    pod = cluster.wait_pod(ns, victim_pod.metadata.name, back, "restarted in place and Ready", 90)
    t_back = time.monotonic()
    assert pod.metadata.uid == victim_pod.metadata.uid  # the same pod: same identity, same incarnation
    print(f"\n[readopt] container killed; Ready again {t_back - t_kill:.1f}s later (restart in place)")

    # From its return: probe until 95% of the warm router's disk prefixes route to the victim.
    async def recovery(session):
        probes, t_share = 0, None
        timeline = []
        while time.monotonic() - t_back < 10:
            where = await _routes(session, warm, sets[warm])
            probes += 1
            share = where.count(victim) / len(where)
            state, disk = await _victim_state(session, warm, victim)
            timeline.append((round(time.monotonic() - t_back, 3), share, state, disk))
            if share >= SHARE:
                t_share = time.monotonic() - t_back
                break
            await asyncio.sleep(0.02)
        return t_share, probes, timeline

    t_share, probes, timeline = aio(recovery)
    stop.set()
    sampler.join()
    t_hidden = next(t for t, state, _ in samples if state == "disconnected")
    t_adopted = next(t for t, state, disk in samples if t > t_hidden and state == "ok" and disk)
    print(f"[readopt] warm router: timeline after return (s, share, state, disk blocks): {timeline[-5:]}")
    assert t_share is not None, f"never reached {SHARE:.0%}: {timeline}"
    warm_share = aio(_routes, warm, sets[warm]).count(victim) / PREFIXES
    cold_where = aio(_routes, cold, sets[cold])
    cold_share = cold_where.count(victim) / PREFIXES
    warm_hits, _ = aio(_hits, warm, sets[warm])
    cold_hits, cold_hit_where = aio(_hits, cold, sets[cold])
    m_after = aio(metrics, metrics_url(warm))

    def delta(name: str) -> float:
        return m_after.get(name, 0) - m_before.get(name, 0)

    adopted = delta('routerfleet_kv_adoption_attempts_total{outcome="success"}')
    print(
        f"[readopt] re-adoption on:  {warm_share:.0%} of {PREFIXES} disk prefixes route to the engine "
        f"{t_share * 1000:.0f} ms after its return ({probes} probe rounds); hits {warm_hits}/{PREFIXES}; "
        f"adoptions {adopted:.0f}"
    )
    print(
        f"[readopt] warm router: hid the engine {t_hidden - t_kill:.2f}s after the kill; showed its disk "
        f"tier again {t_adopted - t_kill:.2f}s after the kill, {(t_adopted - t_back) * 1000:+.0f} ms from "
        "the test seeing the pod Ready (negative: before)"
    )
    print(
        f"[readopt] re-adoption off: {cold_share:.0%} route to it (cold: by load and tie-break); "
        f"hits {cold_hits}/{PREFIXES} ({cold_hit_where.count(other)} went to {other})"
    )
    assert adopted >= 1 and delta('routerfleet_kv_adoption_attempts_total{outcome="rejected"}') == 0
    assert t_share <= RECOVERY_S, f"{t_share:.2f}s to reach {SHARE:.0%} after the return: {timeline}"
    assert warm_share >= SHARE and warm_hits >= SHARE * PREFIXES
    # Off: the router erased what it knew, so nothing steers these prefixes to the engine that still
    # holds them on disk; about half land there by chance (two engines, ties spread by a hash).
    assert cold_share < SHARE and cold_hits < SHARE * PREFIXES
