"""Origin bootstrap over real ZMQ and HTTP: a router that joins late rebuilds each rank exactly from
the engine's own replay buffer when it still reaches sequence 0, and stays cold (never partial) when it
does not."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

import aiohttp
import pytest

from router_runtime.app import run_router
from router_runtime.config import parse_args
from router_runtime.kv.decode import normalize_hash
from router_runtime.kv.events import Tier
from routerfleet_fake_engine.cache import PLAIN
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually
from .test_bootstrap_component import replica

BS = 4
DIALECTS = ["vllm-0.33", "vllm-0.20", "sglang"]


def engine_prefixes(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(BS * rng.randrange(4, 12))] for _ in range(n)]


def router_config(engines, *extra):
    workers = [f"url={e.http_url},kv={e.kv_endpoint(0)},replay={e.replay_endpoint(0)}" for e in engines]
    config = parse_args(
        [
            "--block-size",
            str(BS),
            "--health-interval-ms",
            "0",
            "--engine-header",
            *[a for w in workers for a in ("--worker", w)],
            *extra,
        ]
    )
    return dataclasses.replace(config, port=0, metrics=LOCAL_METRICS)


def index_matches_engine(router, e) -> bool:
    """Exactly what the engine holds, per tier, in the engine's own hashes."""
    carrier = next(c for c in router.kv.index.carriers if c.engine == e.http_url)
    ours = router.kv.index.carrier_engine_hashes(carrier)
    truth = e.state()["ranks"][0]["blocks"]
    return ours[Tier.DEVICE] == {normalize_hash(h) for h in truth["device"]} and ours[Tier.HOST] == {
        normalize_hash(h) for h in truth["host"]
    }


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_late_joiner_routes_every_request_to_the_engine_holding_its_prefix(dialect):
    """The vllm-router experiment (9-12 right in 30 by chance): here 30 in 30, with no peer at all."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                run_fake_engine(block_size=BS, dialect=dialect, decode_tokens_per_s=0)
            )
            for _ in range(3)
        ]
        owned = {e.http_url: engine_prefixes(i, 10) for i, e in enumerate(engines)}
        for e in engines:  # every block is announced before the router exists
            for p in owned[e.http_url]:
                e.admit(0, p, PLAIN)
        router, url = await stack.enter_async_context(run_router(router_config(engines)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        await eventually(lambda: router.bootstrap.settled, timeout=10, what="bootstrap settled")
        assert router.bootstrap.verdict.value == "from_origin"
        assert all(index_matches_engine(router, e) for e in engines)
        right = 0
        for e in engines:
            for p in owned[e.http_url]:
                async with http.post(
                    url + "/v1/completions", json={"prompt": [*p, 7, 7], "max_tokens": 1}
                ) as r:
                    assert r.status == 200
                    right += r.headers["X-RouterFleet-Engine"] == e.http_url
        assert right == 30


async def test_a_buffer_that_aged_past_zero_reports_cold_not_partial():
    async with run_fake_engine(block_size=BS, replay_buffer=5) as e:
        for p in engine_prefixes(1, 20):  # 20 batches: the buffer keeps the last 5
            e.admit(0, p, PLAIN)
        async with run_router(router_config([e])) as (router, _url):
            await eventually(lambda: router.bootstrap.settled, timeout=10, what="bootstrap settled")
            assert router.bootstrap.verdict.value == "no_peers"  # nothing exact, nobody to ask
            assert router.kv.index.node_count() == 0
            outcome = {"outcome": "aged_out"}
            assert (
                router.registry.get_sample_value("routerfleet_bootstrap_origin_attempts_total", outcome) == 1
            )


async def test_a_replay_truncated_mid_way_is_discarded():
    async with run_fake_engine(block_size=BS) as e:
        for p in engine_prefixes(1, 40):
            e.admit(0, p, PLAIN)
        async with replica("b", [e], peers=[], origin=True, origin_max_bytes=2_000) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="settled")
            assert b.boot.verdict.value == "no_peers" and b.plane.index.node_count() == 0
            outcome = {"outcome": "truncated"}
            assert b.registry.get_sample_value("routerfleet_bootstrap_origin_attempts_total", outcome) == 1


async def test_live_batches_during_the_replay_are_held_then_applied_in_order():
    async with run_fake_engine(block_size=BS, capacity_blocks=400) as e:
        for p in engine_prefixes(1, 1500):  # a long history, with evictions: removals matter
            e.admit(0, p, PLAIN)

        async def live():  # keeps publishing (stores and evictions) while the router boots
            for p in engine_prefixes(2, 300):
                e.admit(0, p, PLAIN)
                await asyncio.sleep(0)

        async with replica("b", [e], peers=[], origin=True) as b:
            writer = asyncio.create_task(live())
            await eventually(lambda: b.boot.settled, timeout=20, what="settled")
            await writer
            sub = b.plane.subscriptions()[0]
            await eventually(
                lambda: b.plane.writer.applied.get(sub.carrier) == e.publisher.last_seq(0),
                timeout=10,
                what="caught up",
            )
            assert b.boot.report()["ranks"][0]["outcome"] == "from_origin"
            ours = b.plane.index.carrier_engine_hashes(sub.carrier)[Tier.DEVICE]
            assert ours == {normalize_hash(h) for h in e.state()["ranks"][0]["blocks"]["device"]}
            assert b.registry.get_sample_value("routerfleet_kv_gaps_total") == 0


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_a_replay_that_does_not_fit_this_routers_block_size_is_a_config_mismatch(dialect):
    """The engines replay their whole history and not one store fits: not from_origin (an empty index
    called exact), but config_mismatch, quickly, naming both block sizes; readiness says it too."""
    async with run_fake_engine(block_size=BS, dialect=dialect) as e:
        for p in engine_prefixes(1, 10):
            e.admit(0, p, PLAIN)
        config = router_config([e], "--block-size", str(BS * 2))
        async with run_router(config) as (router, url):
            await eventually(lambda: router.bootstrap.settled, timeout=10, what="bootstrap settled")
            report = router.bootstrap.report()
            assert report["verdict"] == "config_mismatch", report
            assert report["ranks"][0]["outcome"] == "config_mismatch"
            assert report["cause"]["code"] == "ConfigMismatch", report
            assert f"block size {BS}; this router is configured for {BS * 2}" in report["cause"]["message"]
            assert report["index"]["nodes"] == 0
            attempts = "routerfleet_bootstrap_origin_attempts_total"
            assert router.registry.get_sample_value(attempts, {"outcome": "config_mismatch"}) == 1
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/readyz") as r:
                    body = await r.json()
                async with http.get(router.metrics_url + "/metrics") as m:
                    text = await m.text()
            # Nothing to inherit can fix it, and no seed is required here: ready, and says it is blind.
            assert r.status == 200 and "cache-blind" in body["reason"], body
            labels = f'engine="{e.http_url}",rank="0",reason="block_size_mismatch"'
            assert f"routerfleet_kv_config_mismatch{{{labels}}} 1.0" in text


async def test_a_router_started_with_the_wrong_block_size_reports_it_once_stores_arrive():
    """No history to replay, no rollout: the live stream alone shows the mismatch (verdict, metric)."""
    async with run_fake_engine(block_size=BS) as e:
        config = router_config([e], "--block-size", str(BS * 2))
        async with run_router(config) as (router, _url):
            await eventually(lambda: router.bootstrap.settled, timeout=10, what="bootstrap settled")
            assert router.bootstrap.verdict.value == "no_peers"  # no evidence yet: an empty cache
            await eventually(lambda: router.kv.live(), what="subscribed")
            await asyncio.sleep(0.3)
            for p in engine_prefixes(2, 5):
                e.admit(0, p, PLAIN)
            await eventually(lambda: router.bootstrap.verdict.value == "config_mismatch", what="the verdict")
            async with aiohttp.ClientSession() as http, http.get(router.metrics_url + "/metrics") as r:
                text = await r.text()
            labels = f'engine="{e.http_url}",rank="0",reason="block_size_mismatch"'
            sample = f"routerfleet_kv_config_mismatch{{{labels}}}"
            assert f"{sample} 1.0" in text, text


async def test_one_rank_that_does_not_fit_settles_the_others_when_the_peers_are_foreign():
    """Two DP ranks, history on one: that rank's replay shows the mismatch; the other has nothing to
    judge by, and its only peer uses another block size. Our own rank already proved we are the odd
    one, so it settles at once (config_mismatch), not after the bootstrap timeout."""
    async with (
        run_fake_engine(block_size=BS, dp_size=2) as e,
        replica("a", [e], peers=[], origin=True) as a,
    ):
        for p in engine_prefixes(1, 10):
            e.admit(1, p, PLAIN)
        async with replica("b", [e], peers=[a.url], origin=True, block_size=BS * 2, timeout_s=30) as b:
            await eventually(lambda: b.boot.settled, timeout=10, what="settled well before the timeout")
            report = b.boot.report()
            assert report["verdict"] == "config_mismatch", report
            outcomes = {r["rank"]: r["outcome"] for r in report["ranks"]}
            assert outcomes == {0: "abandoned", 1: "config_mismatch"}, outcomes
