"""Routing end to end: three fake engines publish KV events to a router, and requests whose prefix one
engine caches go to that engine (token IDs, text, chat; the bytes and a Hugging Face tokenizer), until
load skew trips the imbalance guard. Also: which policies make the router tokenize at all."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from concurrent.futures import ThreadPoolExecutor

import aiohttp

from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.scheduling.config import SchedulingConfig
from router_runtime.scheduling.presets import PolicyConfig
from router_runtime.tokens.config import TokenizerConfig
from router_runtime.tokens.hf import HFTokenizer
from router_runtime.tokens.tokenizer import BytesTokenizer
from router_runtime.worker import Carrier, WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, join_all, static_workers
from .test_tokens_hf import build_tokenizer_dir

BS = 4
ENGINE_HEADER = "X-RouterFleet-Engine"


@contextlib.asynccontextmanager
async def kv_fleet(n: int = 3, engine_kw=None, with_tokenizer=None, **config):
    """``n`` engines publishing KV events to one kv_aware router, every subscription joined;
    ``with_tokenizer`` a tokenizer object in place of the config's ``tokenizer``."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(run_fake_engine(block_size=BS, **(engine_kw or {})))
            for _ in range(n)
        ]
        workers = static_workers(engines)
        # Named: the tests read where each request went in X-RouterFleet-Engine.
        config["proxy"] = dataclasses.replace(config.get("proxy", ProxyConfig()), engine_header=True)
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=workers,
            **config,
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
        )
        router, url = await stack.enter_async_context(run_router(cfg, tokenizer=with_tokenizer))
        await join_all(router, engines)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield engines, router, url, session


def cached_blocks(router, engine, tokens) -> int:
    m = router.kv.index.match(tokens).get(Carrier(engine.http_url, 0))
    return m.blocks if m else 0


async def routed_to(session, url, body, path="/v1/completions") -> str:
    async with session.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()
        return r.headers[ENGINE_HEADER]


def sample(router, name, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


async def test_token_id_prompts_go_to_the_engine_caching_their_prefix():
    async with kv_fleet() as (engines, router, url, s):
        prefixes = {i: [1000 * (i + 1) + t for t in range(64)] for i in range(3)}
        # Engine i caches prefix i (through its admin API: events only, no request).
        for i, e in enumerate(engines):
            async with s.post(e.http_url + "/admin/store", json={"token_ids": prefixes[i]}) as r:
                assert r.status == 200
        for i, e in enumerate(engines):
            await eventually(
                lambda e=e, i=i: cached_blocks(router, e, prefixes[i]) == 16, what=f"engine {i} indexed"
            )
        for _ in range(2):
            for i in (2, 0, 1):
                assert (
                    await routed_to(s, url, {"prompt": [*prefixes[i], 7, 7, 7], "max_tokens": 2})
                    == engines[i].http_url
                )
        assert sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix") == 6
        assert sample(router, "routerfleet_routing_matched_prefix_ratio_count") == 6
        # The engines agree: the prompt was served from their cache.
        for e in engines:
            assert e.rank_stats[0].cached_tokens == 2 * 64


async def test_text_and_chat_requests_follow_what_the_engines_cached_from_earlier_requests():
    async with kv_fleet() as (engines, router, url, s):
        text = "Summarize the following document in three sentences: " + "lorem ipsum " * 10
        chat = [
            {"role": "system", "content": "You are terse. " * 5},
            {"role": "user", "content": "hello there"},
        ]
        # Earlier requests, sent to the engines directly: they cache those prompts and publish it.
        async with s.post(
            engines[2].http_url + "/v1/completions", json={"prompt": text, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        async with s.post(
            engines[1].http_url + "/v1/chat/completions", json={"messages": chat, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        tok = BytesTokenizer()
        await eventually(
            lambda: cached_blocks(router, engines[2], tok.encode(text)) > 10, what="text indexed"
        )
        await eventually(
            lambda: cached_blocks(router, engines[1], tok.chat_ids({"messages": chat})) > 10,
            what="chat indexed",
        )
        assert (
            await routed_to(s, url, {"prompt": text + " And then some.", "max_tokens": 2})
            == engines[2].http_url
        )
        follow_up = [*chat, {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "more"}]
        assert (
            await routed_to(s, url, {"messages": follow_up, "max_tokens": 2}, "/v1/chat/completions")
            == engines[1].http_url
        )


async def test_a_hugging_face_tokenizer_drives_matching(tmp_path):
    build_tokenizer_dir(tmp_path / "tok")
    hf = HFTokenizer.from_dir(str(tmp_path / "tok"))
    text = "the quick brown fox jumps over the lazy dog " * 2
    chat = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "hello world"},
    ]
    async with kv_fleet(with_tokenizer=hf) as (engines, router, url, s):
        # The engines cache what the router's tokenizer makes of these prompts.
        for engine, ids in ((engines[0], hf.encode(text)), (engines[2], hf.chat_ids({"messages": chat}))):
            async with s.post(engine.http_url + "/admin/store", json={"token_ids": ids}) as r:
                assert r.status == 200
        await eventually(lambda: cached_blocks(router, engines[0], hf.encode(text)) >= 4, what="text indexed")
        await eventually(
            lambda: cached_blocks(router, engines[2], hf.chat_ids({"messages": chat})) >= 3,
            what="chat indexed",
        )
        assert await routed_to(s, url, {"prompt": text + "paris", "max_tokens": 1}) == engines[0].http_url
        assert (
            await routed_to(s, url, {"messages": chat, "max_tokens": 1}, "/v1/chat/completions")
            == engines[2].http_url
        )


async def test_a_full_engine_is_charged_for_what_a_request_would_evict_there():
    """Over real HTTP and ZMQ: engine A's 12-block cache holds a system prompt's first 4 blocks and is
    full (it evicted, and the router learned its size from that); B is empty. A request sharing those 4
    blocks and adding 6 would evict 6 of A's: it goes to B, unless evictions are not priced."""
    system = list(range(1000, 1000 + 12 * BS))
    for weight, expect in ((1.0, 1), (0.0, 0)):
        tuning = SchedulingConfig(tuning=PolicyConfig(eviction_weight=weight))
        async with kv_fleet(2, {"capacity_blocks": 12}, scheduling=tuning) as (engines, router, url, s):
            a = engines[0]
            for tokens in (system, system[: 4 * BS] + list(range(5000, 5000 + 8 * BS))):
                async with s.post(a.http_url + "/admin/store", json={"token_ids": tokens}) as r:
                    assert r.status == 200
            capacity = {"engine": a.http_url, "rank": "0"}
            await eventually(
                lambda c=capacity: sample(router, "routerfleet_kv_device_capacity_blocks", **c) == 12,
                what="A's cache size learned from its evictions",
            )
            assert router.kv.index.device_free(Carrier(a.http_url, 0)) == 0
            assert router.kv.index.device_capacity(Carrier(engines[1].http_url, 0)) is None
            prompt = system[: 4 * BS] + list(range(7000, 7000 + 6 * BS + 3))
            assert cached_blocks(router, a, prompt) == 4
            assert await routed_to(s, url, {"prompt": prompt, "max_tokens": 2}) == engines[expect].http_url


async def test_load_skew_trips_the_imbalance_guard():
    policy = PolicyConfig(balance_abs_threshold=2, balance_rel_threshold=1.5, load_cost_tokens=0)
    async with kv_fleet(
        engine_kw={"decode_tokens_per_s": 20}, scheduling=SchedulingConfig(tuning=policy)
    ) as (
        engines,
        router,
        url,
        s,
    ):
        hot = engines[1]
        prefix = list(range(100, 164))
        async with s.post(hot.http_url + "/admin/store", json={"token_ids": prefix}) as r:
            assert r.status == 200
        await eventually(lambda: cached_blocks(router, hot, prefix) == 16, what="prefix indexed")
        holds = []
        try:
            for i in range(3):  # long streams that stay on the hot engine
                r = await s.post(
                    url + "/v1/completions", json={"prompt": [*prefix, i], "max_tokens": 1000, "stream": True}
                )
                holds.append(r)
                assert r.headers[ENGINE_HEADER] == hot.http_url
                await r.content.readany()
            assert router.load.engine(hot.http_url) == 3
            # Loads (0, 3, 0): 3 - 0 > 2 and 3 > 0 * 1.5, so the cached prefix no longer wins.
            elsewhere = await routed_to(s, url, {"prompt": [*prefix, 99], "max_tokens": 1})
            assert elsewhere != hot.http_url
            assert (
                sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="imbalanced")
                == 1
            )
        finally:
            for r in holds:
                r.close()
        await eventually(lambda: router.load.total == 0, what="holds released")
        # Balanced again: the prefix wins again (the engine that took the overflow request now caches
        # the prefix too, so either of the two may win the tie).
        before = sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix")
        assert await routed_to(s, url, {"prompt": [*prefix, 98], "max_tokens": 1}) in (
            hot.http_url,
            elsewhere,
        )
        assert (
            sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix")
            == before + 1
        )
        await eventually(lambda: hot.load.running == 0, what="the hot engine's streams cancelled")


class CountingTokenizer(BytesTokenizer):
    def __init__(self) -> None:
        self.calls = 0

    def prompt_ids(self, text, body, *, unlocked=False):
        self.calls += 1
        return super().prompt_ids(text, body, unlocked=unlocked)

    def render_chat(self, body):  # chat_ids renders too: one call per chat tokenized
        self.calls += 1
        return super().render_chat(body)


async def test_only_policies_that_match_tokens_or_text_make_the_router_tokenize():
    bodies = [
        ("/v1/completions", {"prompt": "some text prompt " * 4, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 1}),
    ]
    calls = {}
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(2)]
        workers = tuple(WorkerSpec(e.http_url, e.http_url) for e in engines)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        for policy in ("round_robin", "least_loaded", "power_of_two", "approx_prefix", "kv_aware"):
            tok = CountingTokenizer()
            cfg = RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                workers=workers,
                kv=KvConfig(block_size=BS),
                health=HealthConfig(interval_s=0),
                scheduling=SchedulingConfig(policy=policy),
                proxy=ProxyConfig(engine_header=True),
            )
            async with run_router(cfg, tokenizer=tok) as (router, url):
                for _ in range(2):
                    for path, body in bodies:
                        await routed_to(session, url, body, path)
                calls[policy] = tok.calls
                if policy == "approx_prefix":  # text routing: the second time, the same engine by prefix
                    assert (
                        sample(router, "routerfleet_routing_decisions_total", policy=policy, reason="prefix")
                        == 2
                    )
    # Text prompts need no tokenizer; chat needs the template rendered (approx_prefix) or tokenized.
    assert calls == {
        "round_robin": 0,
        "least_loaded": 0,
        "power_of_two": 0,
        "approx_prefix": 2,
        "kv_aware": 4,
    }


async def test_a_prompt_under_sglangs_lora_path_matches_no_text_either():
    """SGLang runs a request under its ``lora_path`` adapter, vLLM ignores the field: its text matches
    nothing in any namespace (approx_prefix routes it by load), as its tokens do under kv_aware."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(2)]
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=tuple(WorkerSpec(e.http_url, e.http_url) for e in engines),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            scheduling=SchedulingConfig(policy="approx_prefix"),
            proxy=ProxyConfig(engine_header=True),
        )
        session = await stack.enter_async_context(aiohttp.ClientSession())
        router, url = await stack.enter_async_context(run_router(cfg))
        body = {"prompt": "some text prompt " * 4, "max_tokens": 1}
        await routed_to(session, url, body)
        for _ in range(2):
            await routed_to(session, url, {**body, "lora_path": "sql-adapter"})
        decided = "routerfleet_routing_decisions_total"
        assert sample(router, decided, policy="approx_prefix", reason="prefix") == 0
        assert sample(router, "routerfleet_untokenized_requests_total", reason="unsupported") == 2


class CountingExecutor(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.submitted = 0

    def submit(self, *a, **kw):
        self.submitted += 1
        return super().submit(*a, **kw)


async def test_large_bodies_are_parsed_and_tokenized_off_the_loop_and_still_routed():
    # engine reads off: the direct request that seeds the cache would count as the engine's load
    # (a client bypassing the router) until the next read
    async with kv_fleet(
        n=2,
        tokens=TokenizerConfig(inline_max_bytes=1024),
        fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0)),
    ) as (
        engines,
        router,
        url,
        s,
    ):
        pool = CountingExecutor()
        router.proxy.bodies.executor = router.tokenizer.executor = pool
        router.proxy.bodies.inline_max_bytes = 1024
        text = "x" * 8000
        async with s.post(
            engines[0].http_url + "/v1/completions", json={"prompt": text, "max_tokens": 1}
        ) as r:
            assert r.status == 200
        await eventually(
            lambda: cached_blocks(router, engines[0], list(text.encode())) == 2000, what="indexed"
        )
        results = await asyncio.gather(
            *(routed_to(s, url, {"prompt": text + "y", "max_tokens": 1}) for _ in range(3))
        )
        assert set(results) == {engines[0].http_url}
        assert pool.submitted == 6  # each request: its JSON parsed and its prompt tokenized on the pool
        small = await routed_to(s, url, {"prompt": "x" * 100, "max_tokens": 1})
        assert small == engines[0].http_url and pool.submitted == 6  # small ones stay inline
        pool.shutdown()
