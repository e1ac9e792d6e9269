"""The fleet's load view over real HTTP and ZMQ: router replicas tell each other what they have in flight
(a stream of reports per sibling, fleet token: tests/test_fleet_load_stream.py), read the engines' own
queues from their ``/metrics``, and balance on the sum, so a fleet of replicas trips the imbalance guard
where one replica alone (seeing a third of the load) would not."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import pytest
from aiohttp import web

from router_runtime.app import run_router
from router_runtime.bootstrap.config import InternalConfig
from router_runtime.bootstrap.peers import Peer
from router_runtime.config import RouterConfig
from router_runtime.disaggregation.config import DisaggregationConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.fleet.gossip import GossipConfig
from router_runtime.fleet.view import PEER_SLACK, Bounds
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.scheduling.config import SchedulingConfig
from router_runtime.scheduling.presets import PolicyConfig
from router_runtime.worker import Carrier, Role, WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, join_stream, predicted_blocks

BS = 4
TOKEN = "fleet-s3cret"
ENGINE_HEADER = "X-RouterFleet-Engine"
# The guard trips at a spread above 2 (and max > 1.5 x min); no load price, so the prefix wins up to it.
GUARD = PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=1.5, load_cost_tokens=0)


def sample(router, name, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


@contextlib.asynccontextmanager
async def replicas(
    tmp_path,
    n_routers: int,
    *,
    engines: int = 2,
    engine_kw=None,
    roles=None,
    gossip: bool = True,
    scrape_s: float = 0.0,
    heartbeat_s: float = 0.5,
    bounds: Bounds | None = None,
    **sections,
):
    """``engines`` fake engines and ``n_routers`` kv_aware replicas over them, each listing the others as
    peers (as peer discovery would), every KV subscription joined; engines' metrics read every
    ``scrape_s`` (0: not read); ``roles``: each engine's (a disaggregated fleet); ``sections``:
    RouterConfig sections in place of these defaults."""
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    async with contextlib.AsyncExitStack() as stack:
        es = [
            await stack.enter_async_context(run_fake_engine(block_size=BS, **(engine_kw or {})))
            for _ in range(engines)
        ]
        workers = tuple(
            WorkerSpec(
                e.http_url,
                e.http_url,
                kv=e.kv_endpoint(0),
                replay=e.replay_endpoint(0),
                role=roles[i] if roles else Role.BOTH,
            )
            for i, e in enumerate(es)
        )
        defaults = {
            "internal": InternalConfig(port=0, token_file=str(token)),
            "kv": KvConfig(block_size=BS),
            "health": HealthConfig(interval_s=0),
            "proxy": ProxyConfig(engine_header=True),
            "scheduling": SchedulingConfig(tuning=GUARD),
            "fleet": FleetConfig(
                GossipConfig(window_s=0.005 if gossip else 0, heartbeat_s=heartbeat_s),
                ScrapeConfig(interval_s=scrape_s),
                bounds or Bounds(),
            ),
        }
        cfg = RouterConfig(port=0, metrics=LOCAL_METRICS, workers=workers, **{**defaults, **sections})
        routers = [await stack.enter_async_context(run_router(cfg)) for _ in range(n_routers)]
        for i, (r, _) in enumerate(routers):
            r.bootstrap.peers.publish(
                [Peer(o.internal_url, o.internal_url) for j, (o, _) in enumerate(routers) if j != i]
            )
        by_url = {e.http_url: e for e in es}
        for r, _ in routers:
            for sub in r.kv.subscriptions():
                await join_stream(by_url[sub.carrier.engine].publisher, sub)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield es, routers, session


async def cache_prefix(session, engine, routers, prefix) -> None:
    async with session.post(engine.http_url + "/admin/store", json={"token_ids": prefix}) as r:
        assert r.status == 200
    for router, _ in routers:
        await eventually(
            lambda router=router: (
                (router.kv.index.match(prefix).get(Carrier(engine.http_url, 0)) or None) is not None
            ),
            what="prefix indexed",
        )


async def hold_open(session, url, prompt) -> aiohttp.ClientResponse:
    """A long stream: it stays in flight (on the router and the engine) until closed."""
    r = await session.post(
        url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1000, "stream": True}
    )
    assert r.status == 200, await r.text()
    await r.content.readany()
    return r


async def test_replicas_share_their_load_and_balance_a_skewed_workload(tmp_path):
    """Every request carries the prefix one engine caches, and each request goes to another replica, as
    a Service spreads them. Each replica alone holds 2 of them, which never trips its guard; the
    fleet holds 6, so once the hot engine carries 3 more than the other the next ones go there."""
    slow = {"decode_tokens_per_s": 20}
    async with replicas(tmp_path, 3, engine_kw=slow) as (es, routers, s):
        hot, other = es
        prefix = list(range(100, 164))
        await cache_prefix(s, hot, routers, prefix)
        holds = []
        try:
            for i in range(6):
                _, url = routers[i % 3]
                holds.append(await hold_open(s, url, [*prefix, i]))
                # the siblings' reports of this request have arrived before the next one is routed
                await eventually(
                    lambda i=i: all(sum(_fleet(r).values()) == i + 1 for r, _ in routers),
                    what="every replica sees the fleet's load",
                )
            placed = [r.headers[ENGINE_HEADER] for r in holds]
            assert max(r.load.total for r, _ in routers) == 2  # no replica alone would trip its guard
            assert placed.count(other.http_url) >= 2, placed
            assert placed[:3] == [hot.http_url] * 3  # until the spread exceeds 2, the prefix wins
            assert (
                sum(
                    sample(r, "routerfleet_routing_decisions_total", policy="kv_aware", reason="imbalanced")
                    for r, _ in routers
                )
                >= 1  # the first move off the prefix; later ones tie on it (the other engine caches it now)
            )
            assert all(
                sample(r, "routerfleet_fleet_peer_reports_total", outcome="accepted") > 0 for r, _ in routers
            )
            for r, _ in routers:  # over a stream to each sibling, not a POST per report
                siblings = sorted(o.internal_url for o, _ in routers if o is not r)
                await eventually(
                    lambda r=r, siblings=siblings: sorted(r.gossip.streaming_to()) == siblings,
                    what="a stream to each sibling",
                )
        finally:
            for r in holds:
                r.close()
        await eventually(
            lambda: all(sum(_fleet(r).values()) == 0 for r, _ in routers), what="released everywhere"
        )


@pytest.mark.parametrize("share", [True, False], ids=["shared", "local"])
async def test_a_fan_outs_copies_through_different_replicas_meet_on_one_engine(tmp_path, share):
    """One 128-block prompt, its copies sent one to each replica in turn, each still streaming when the
    next is sent, every replica's view of the fleet's load current before it is, and no engine's stored
    blocks published yet (muted: as while a long prefill runs). With predictions
    shared, each replica credits what its siblings' copies will store and sends its copy there; kept
    local, the load view moves each sibling's copy to an idle engine, and the prompt is prefilled on
    each."""
    slow = {"decode_tokens_per_s": 20}
    # One request in flight costs 16 blocks (as the defaults price it at block size 16).
    tuning = SchedulingConfig(tuning=PolicyConfig(load_cost_tokens=16 * BS, inflight_share=share))
    async with replicas(tmp_path, 3, engines=4, engine_kw=slow, scheduling=tuning) as (es, routers, s):
        prompt = list(range(100, 100 + 128 * BS + 1))
        for e in es:  # still prefilling, as far as the routers can tell: no engine publishes a block
            async with s.post(e.http_url + "/admin/mute", json={"rank": 0}) as r:
                assert r.status == 200
        holds = []
        try:
            for i in range(4):
                _, url = routers[i % 3]
                holds.append(await hold_open(s, url, prompt))
                await eventually(
                    lambda i=i: all(sum(_fleet(r).values()) == i + 1 for r, _ in routers),
                    what="every replica sees the fleet's load",
                )
            placed = {r.headers[ENGINE_HEADER] for r in holds}
            if share:
                assert len(placed) == 1, placed
                inflight = sum(
                    sample(r, "routerfleet_routing_decisions_total", policy="kv_aware", reason="inflight")
                    for r, _ in routers
                )
                assert inflight == 3
            else:  # only the 4th copy, sent by the first copy's replica, meets the first
                assert len(placed) == 3, placed
        finally:
            for r in holds:
                r.close()


@pytest.mark.parametrize("share", [True, False], ids=["shared", "local"])
async def test_a_fan_outs_remote_prefills_through_different_replicas_meet_on_one_prefill_engine(
    tmp_path, share
):
    """A disaggregated fleet: one long prompt's copies, one through each replica, the second sent while
    the first's prefill leg still runs (and no engine publishes a block). With predictions shared, the
    second replica's prefill profile credits what the first's prefill leg will store and sends its leg
    to the same prefill engine; kept local, the load view sends it to the idle one."""
    roles = [Role.DECODE, Role.DECODE, Role.PREFILL, Role.PREFILL]
    tuning = SchedulingConfig(tuning=PolicyConfig(load_cost_tokens=16 * BS, inflight_share=share))
    slow_prefill = {"kv_transfer": True, "prefill_us_per_token": 5000}  # a 516-token prompt: ~2.6 s
    async with replicas(
        tmp_path,
        2,
        engines=4,
        engine_kw=slow_prefill,
        roles=roles,
        scheduling=tuning,
        disaggregation=DisaggregationConfig(threshold_tokens=16),
    ) as (es, routers, s):
        prefillers = es[2:]
        for e in es:  # nothing stored is published: only predictions and loads say where a copy is
            async with s.post(e.http_url + "/admin/mute", json={"rank": 0}) as r:
                assert r.status == 200
        prompt = list(range(100, 100 + 128 * BS + 4))
        (_, url_a), (second, url_b) = routers

        async def complete(url: str) -> None:
            body = {"prompt": prompt, "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()

        def prefill_load(router) -> float:
            return sum(
                v for (engine, _), v in _fleet(router).items() if engine in {p.http_url for p in prefillers}
            )

        one = asyncio.create_task(complete(url_a))
        await eventually(lambda: prefill_load(second) == 1, what="the sibling sees the prefill leg's load")
        if share:
            await eventually(
                lambda: predicted_blocks(second, prefill=True) > 0, what="the sibling's prefill prediction"
            )
        await complete(url_b)
        await one
        legs = sorted(p.rank_stats[0].prefill_legs for p in prefillers)
        assert legs == ([0, 2] if share else [1, 1]), legs
        assert all(sample(r, "routerfleet_pd_prefills_total", verdict="remote") == 1 for r, _ in routers)


def _fleet(router) -> dict:
    return {(t["engine"], t["rank"]): t["load"] for t in router.fleet.summary()["targets"]}


async def test_engine_queue_counts_requests_that_bypass_the_router(tmp_path):
    """One replica, no siblings: a client calling the hot engine directly fills its queue; the router
    reads the engine's own running/waiting gauges and balances on them."""
    slow = {"decode_tokens_per_s": 20}
    async with replicas(tmp_path, 1, engine_kw=slow, gossip=False, scrape_s=0.02) as (
        es,
        routers,
        s,
    ):
        (router, url), (hot, other) = routers[0], es
        prefix = list(range(200, 264))
        await cache_prefix(s, hot, routers, prefix)
        assert await _routed(s, url, [*prefix, 1]) == hot.http_url  # idle engines: the prefix wins
        holds = [await _hold_direct(s, hot, [*prefix, 10 + i]) for i in range(4)]
        try:
            await eventually(
                lambda: _fleet(router)[(hot.http_url, None)] >= 4, what="the engine's queue read"
            )
            assert router.load.total == 0
            assert await _routed(s, url, [*prefix, 2]) == other.http_url
            assert sample(router, "routerfleet_fleet_engine_reads_total", outcome="ok") > 0
        finally:
            for r in holds:
                r.close()


async def _hold_direct(session, engine, prompt) -> aiohttp.ClientResponse:
    r = await session.post(
        engine.http_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1000, "stream": True}
    )
    assert r.status == 200
    await r.content.readany()
    return r  # running on the engine: its gauges count it


async def _routed(session, url, prompt) -> str:
    async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers[ENGINE_HEADER]


async def test_a_sibling_that_stops_reporting_ages_out(tmp_path):
    async with replicas(tmp_path, 1, bounds=Bounds(peer_max_age_s=0.3), heartbeat_s=0.1) as (es, routers, s):
        router, _ = routers[0]
        hot = es[0].http_url
        report = {
            "format": 1,
            "replica": "sibling-a",
            "incarnation": "1",
            "seq": 1,
            "targets": [[hot, None, 7, 1200]],
        }
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with s.post(router.internal_url + "/internal/load", json=report, headers=headers) as r:
            assert r.status == 204
        assert _fleet(router)[(hot, None)] == 7
        # An older report of the same process is not taken over the newer one.
        async with s.post(
            router.internal_url + "/internal/load", json={**report, "seq": 0, "targets": []}, headers=headers
        ) as r:
            assert r.status == 204
        assert _fleet(router)[(hot, None)] == 7
        assert sample(router, "routerfleet_fleet_peer_reports_total", outcome="stale") == 1
        # Silence: within the age bound it drops out, with nothing else happening.
        await eventually(lambda: _fleet(router)[(hot, None)] == 0, timeout=2, what="aged out")
        assert router.fleet.fresh_peers() == 0


async def test_a_siblings_claim_its_engines_read_contradicts_cannot_starve_that_engine(tmp_path):
    """A sibling (with the fleet token) keeps claiming 1,000 requests in flight on an idle engine. The
    engine's own read says otherwise: the claim is discounted to what the read leaves room for (plus
    PEER_SLACK), the metric says how much was, and once the other engine is the busier one the next
    request goes to the idle one (taken at its word, it would never again)."""
    long = Bounds(peer_max_age_s=30.0)
    async with replicas(tmp_path, 1, bounds=long, scrape_s=0.02, gossip=False) as (es, routers, s):
        (router, url), (idle, other) = routers[0], es
        headers = {"Authorization": f"Bearer {TOKEN}"}
        lie = {"format": 1, "replica": "liar", "incarnation": "1", "seq": 1}
        lie["targets"] = [[idle.http_url, None, 1000, 0]]
        async with s.post(router.internal_url + "/internal/load", json=lie, headers=headers) as r:
            assert r.status == 204
        await eventually(
            lambda: _fleet(router)[(idle.http_url, None)] <= PEER_SLACK,
            what="the engine's read discounts the claim",
        )
        async with s.get(router.metrics_url + "/metrics") as r:  # the gauges are set as it is read
            await r.read()
        discounted = sample(router, "routerfleet_fleet_load", engine=idle.http_url, source="discounted")
        assert discounted >= 1000 - PEER_SLACK
        holds = [await _hold_direct(s, other, [900 + i, 1, 2]) for i in range(PEER_SLACK + 4)]
        try:
            await eventually(
                lambda: _fleet(router)[(other.http_url, None)] >= PEER_SLACK + 4,
                what="the other engine's queue read",
            )
            assert await _routed(s, url, [5, 6, 7]) == idle.http_url
        finally:
            for r in holds:
                r.close()


async def test_a_stalled_engine_metrics_endpoint_delays_no_request(tmp_path):
    """An engine whose /metrics never answers: requests are served while its read is still pending, the
    read times out (counted), and routing runs on what is left."""
    pending = 0

    async with run_fake_engine(block_size=BS) as real:

        async def stall(_req):
            nonlocal pending
            pending += 1
            try:
                await asyncio.sleep(3600)
            finally:
                pending -= 1
            return web.Response()

        async def relay(req: web.Request) -> web.StreamResponse:
            async with (
                aiohttp.ClientSession() as c,
                c.post(real.http_url + req.path, data=await req.read()) as r,
            ):
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        async def health(_req):
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/metrics", stall)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", relay)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stalled = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=(WorkerSpec(stalled, stalled),),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0.01, timeout_s=1.0)),
        )
        try:
            async with run_router(cfg) as (router, url), aiohttp.ClientSession() as s:
                await eventually(lambda: pending == 1, what="a read in flight")
                for i in range(5):
                    assert await _routed(s, url, [1, 2, 3, 4, i]) == stalled
                    assert pending == 1  # served while the read was still hanging
                await eventually(
                    lambda: sample(router, "routerfleet_fleet_engine_reads_total", outcome="timeout") >= 1,
                    what="the read timed out",
                )
        finally:
            await runner.cleanup()


async def test_load_reports_need_the_fleet_token_and_a_valid_body(tmp_path):
    async with replicas(tmp_path, 1) as (es, routers, s):
        router, _ = routers[0]
        url = router.internal_url + "/internal/load"
        good = {"format": 1, "replica": "x", "incarnation": "1", "seq": 1, "targets": []}
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            async with s.post(url, json=good, headers=headers) as r:
                assert r.status == 401
        auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        bad = [
            b"not json",
            b"[]",
            json.dumps({**good, "format": 2}).encode(),
            json.dumps({**good, "seq": True}).encode(),  # a bool is not an integer here
            json.dumps({**good, "seq": -1}).encode(),
            json.dumps({**good, "targets": [[es[0].http_url, None, 10**9, 0]]}).encode(),
            json.dumps({**good, "targets": [[es[0].http_url, None, 1.5, 0]]}).encode(),
            json.dumps({**good, "targets": [[es[0].http_url, None, 1]]}).encode(),
            json.dumps({**good, "targets": [["", None, 1, 0]]}).encode(),
            json.dumps({**good, "predictions": [[es[0].http_url, 0, 0, "AAAA"]]}).encode(),  # not u64s
            b'{"format": 1, "seq": ' + b"9" * 5000 + b"}",  # beyond Python's int-digit limit
            b"[" * 100_000 + b"]" * 100_000,
        ]
        for body in bad:
            async with s.post(url, data=body, headers=auth) as r:
                assert r.status == 400, body[:60]
                assert (await r.json())["error"]["code"] == "invalid_load_report"
        async with s.post(url, data=b"x" * (300 << 10), headers=auth) as r:
            assert r.status == 413
        assert sample(router, "routerfleet_fleet_peer_reports_total", outcome="rejected") == len(bad)
        assert sum(_fleet(router).values()) == 0
        async with s.get(routers[0][1] + "/healthz") as r:
            assert r.status == 200
