"""Session affinity over real HTTP with fake engines.

- The cache-thrash regression (after the seed): engines with a concurrency limit; two long streams fill
  the first-choice engine A, so a conversation's first turn overflows to B through the router's load
  guard. With affinity on, its next 10 turns stay on B and hit B's cache; with it off they go back to
  A and the first of them misses. Run for kv_aware (B publishes no KV events: the index cannot see the
  conversation) and approx_prefix (token-ID prompts: the text tree cannot see it).
- A fleet of three replicas behind round robin keeps a conversation's engine with the echoed engine-id
  header, and a replica started mid-conversation inherits the table with its bootstrap snapshot.
- Writes only on 2xx; transport errors never write; hint headers are stripped before proxying.
"""

from __future__ import annotations

import contextlib
import socket
import time

import aiohttp
from aiohttp import web

from router_runtime.app import run_router
from router_runtime.bootstrap.config import InternalConfig, PeerConfig
from router_runtime.bootstrap.sweep import BootstrapConfig
from router_runtime.config import RouterConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.scheduling.config import SchedulingConfig
from router_runtime.scheduling.presets import PolicyConfig
from router_runtime.sessions.config import SessionConfig
from router_runtime.worker import Carrier, WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, join_all, join_stream, static_workers

BS = 4
ENGINE = "X-RouterFleet-Engine"
ENGINE_ID = "X-RouterFleet-Engine-Id"
HINT = "X-RouterFleet-Last-Engine"
HOLD = [9000 + t for t in range(64)]
CONV = [5000 + t for t in range(64)]


def sample(router, name, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


def turn_prompt(k: int) -> list[int]:
    """Turn k's prompt: the conversation so far plus 8 new tokens per turn (a growing prefix)."""
    return CONV + [6000 + j for j in range(8 * k)]


async def post(s, url, body, headers=None):
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        doc = await r.json()
        return (
            r.headers[ENGINE],
            r.headers.get(ENGINE_ID),
            doc["usage"]["prompt_tokens_details"]["cached_tokens"],
        )


async def thrash(policy: str, affinity: bool):
    """Returns (A, B, first turn's engine, [(engine, cached_tokens)] of the 10 follow-ups), router."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                run_fake_engine(block_size=BS, max_concurrency=2, decode_tokens_per_s=50)
            )
            for _ in range(2)
        ]
        a, b = sorted(engines, key=lambda e: e.http_url)  # A sorts first: every policy's tie winner
        if policy == "kv_aware":
            # B publishes no KV events (off, or lagging): the index never sees the conversation there.
            workers = (
                WorkerSpec(a.http_url, a.http_url, kv=a.kv_endpoint(0), replay=a.replay_endpoint(0)),
                WorkerSpec(b.http_url, b.http_url),
            )
        else:
            workers = (WorkerSpec(a.http_url, a.http_url), WorkerSpec(b.http_url, b.http_url))
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=workers,
            sessions=SessionConfig(enabled=affinity),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            bootstrap=BootstrapConfig(enabled=False),
            scheduling=SchedulingConfig(
                policy=policy,
                tuning=PolicyConfig(balance_abs_threshold=1, load_cost_tokens=0, spread_ties=False),
            ),
            # The holders are cut by the client; the engine notices at its next write, and a read of
            # its gauges in between would (rightly) count them: this scenario is about the router's own.
            fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0)),
        )
        router, url = await stack.enter_async_context(run_router(cfg))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        if policy == "kv_aware":
            for sub in router.kv.subscriptions():
                await join_stream(a.publisher, sub)
            async with s.post(a.http_url + "/admin/store", json={"token_ids": HOLD}) as r:
                assert r.status == 200
            await eventually(
                lambda: (router.kv.index.match(HOLD).get(Carrier(a.http_url, 0)) or None) is not None,
                what="A's prefix indexed",
            )
            holders = [{"prompt": [*HOLD, i], "max_tokens": 1000, "stream": True} for i in range(2)]
        else:
            # The text tree: A small, B large (so the smallest-tree rule picks A for what it cannot see).
            for text in ("a short warm-up text", "a long unrelated warm-up document " * 100):
                await post(s, url, {"prompt": text, "max_tokens": 1})
            holders = [
                {"prompt": "the holders share this long instruction prefix " * 3 + str(i), "max_tokens": 1000}
                | {"stream": True}
                for i in range(2)
            ]
        holds = []
        try:
            for body in holders:  # fill A's two slots (its concurrency limit)
                r = await s.post(url + "/v1/completions", json=body)
                holds.append(r)
                assert r.headers[ENGINE] == a.http_url
                await r.content.readany()
            assert a.load.running == 2
            key = {"prompt_cache_key": "conversation-1", "max_tokens": 1}
            first, _id, _c = await post(s, url, {"prompt": turn_prompt(0), **key})
        finally:
            for r in holds:
                r.close()
        await eventually(lambda: router.load.total == 0 and a.load.running == 0, what="holders gone")
        turns = []
        for k in range(1, 11):
            engine, _id, cached = await post(s, url, {"prompt": turn_prompt(k), **key})
            turns.append((engine, cached))
        states = {
            st: sample(router, "routerfleet_session_selections_total", session_state=st, selection=sel)
            for st, sel in (("new", "policy"), ("returning", "remembered"))
        }
        return a.http_url, b.http_url, first, turns, states


def previous_blocks(k: int) -> int:
    return len(turn_prompt(k - 1)) // BS * BS


async def _regression(policy: str) -> None:
    t0 = time.perf_counter()
    a, b, first, turns, states = await thrash(policy, affinity=True)
    assert first == b  # overflowed from A
    assert [e for e, _c in turns] == [b] * 10
    assert [c for _e, c in turns] == [previous_blocks(k) for k in range(1, 11)]  # every turn a hit
    assert states["returning"] == 10
    # New: the two holders and the first turn (and approx_prefix's two warm-ups).
    assert states["new"] == (3 if policy == "kv_aware" else 5)
    a, b, first, turns, _states = await thrash(policy, affinity=False)
    assert first == b
    assert [e for e, _c in turns] == [a] * 10  # back to the first choice
    assert turns[0][1] == 0  # ... where the conversation's cache is not: a full miss
    print(f"{policy}: {time.perf_counter() - t0:.2f}s")


async def test_cache_thrash_regression_kv_aware():
    await _regression("kv_aware")


async def test_cache_thrash_regression_approx_prefix():
    await _regression("approx_prefix")


# ---- a fleet of replicas ---------------------------------------------------------------------------


async def test_three_replicas_keep_the_engine_with_the_echoed_header_and_a_new_one_inherits(tmp_path):
    token = tmp_path / "token"
    token.write_text("fleet-secret")
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(2)]
        workers = static_workers(engines)

        def cfg(peers=()):
            # Origin bootstrap stays on: the late replica rebuilds every rank from the engines' replay
            # buffers and fetches only the session table from its sibling.
            return RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                proxy=ProxyConfig(engine_header=True),
                workers=workers,
                sessions=SessionConfig(enabled=True, trust_hints=True),
                kv=KvConfig(block_size=BS),
                health=HealthConfig(interval_s=0),
                internal=InternalConfig(port=0, token_file=str(token)),
                peers=PeerConfig(urls=tuple(peers)),
                # No gossip between these replicas: a read of an engine serving a sibling's turn would
                # (rightly) count that turn for a moment; this scenario is about the echoed hint.
                fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0)),
            )

        replicas = []
        for _ in range(3):
            router, url = await stack.enter_async_context(run_router(cfg()))
            await join_all(router, engines)
            replicas.append((router, url))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        key = {"conversation_id": "conv-42", "max_tokens": 1}
        engine, engine_id, _c = await post(s, replicas[0][1], {"prompt": turn_prompt(0), **key})
        assert engine_id and engine not in engine_id  # opaque
        for k in range(1, 7):  # round robin over the replicas; the client echoes the id back
            router, url = replicas[k % 3]
            got, engine_id, cached = await post(
                s, url, {"prompt": turn_prompt(k), **key}, headers={HINT: engine_id}
            )
            assert got == engine and cached == previous_blocks(k)
        for router, _url in replicas:
            assert sample(router, "routerfleet_session_hints_total", result="used") >= 2 - (
                router is replicas[0][0]
            )
            assert (
                sample(
                    router,
                    "routerfleet_session_selections_total",
                    session_state="returning",
                    selection="remembered",
                )
                == 2
            )
        # A fourth replica starts mid-conversation and bootstraps from the first.
        late, late_url = await stack.enter_async_context(run_router(cfg([replicas[0][0].internal_url])))
        await eventually(
            lambda: sample(late, "routerfleet_session_inherited_total") >= 1,
            timeout=15,
            what="table inherited",
        )
        got, _id, _c = await post(s, late_url, {"prompt": turn_prompt(7), **key})  # no hint: its own table
        assert got == engine
        assert sample(late, "routerfleet_session_lookups_total", result="hit") == 1
        assert (
            sample(
                late,
                "routerfleet_session_selections_total",
                session_state="returning",
                selection="remembered",
            )
            == 1
        )


# ---- writes and hints, against an upstream that shows what it got ---------------------------------


@contextlib.asynccontextmanager
async def echo_engine():
    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response(
            {"headers": {k.lower(): v for k, v in request.headers.items()}, "usage": None},
            status=body.get("status", 200),
        )

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_only_2xx_writes_and_transport_errors_never_do():
    async with contextlib.AsyncExitStack() as stack:
        echo = await stack.enter_async_context(echo_engine())
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=(WorkerSpec(echo, echo),),
            sessions=SessionConfig(enabled=True),
            scheduling=SchedulingConfig(policy="round_robin"),
            health=HealthConfig(interval_s=0),
        )
        router, url = await stack.enter_async_context(run_router(cfg))
        s = await stack.enter_async_context(aiohttp.ClientSession())
        store = router.sessions.local
        for status in (400, 429, 500, 503):
            async with s.post(
                url + "/v1/completions", json={"prompt": "x", "prompt_cache_key": "k", "status": status}
            ) as r:
                assert r.status == status
                assert r.headers[ENGINE_ID]  # every relayed response names its engine
        assert len(store) == 0
        assert sample(router, "routerfleet_session_writes_total", result="written") == 0
        async with s.post(url + "/v1/completions", json={"prompt": "x", "prompt_cache_key": "k"}) as r:
            assert r.status == 200
        assert len(store) == 1
    dead = dead_url()
    async with run_router(
        RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            proxy=ProxyConfig(engine_header=True),
            workers=(WorkerSpec(dead, dead),),
            sessions=SessionConfig(enabled=True),
            scheduling=SchedulingConfig(policy="round_robin"),
            health=HealthConfig(interval_s=0),
        )
    ) as (router, url):
        async with (
            aiohttp.ClientSession() as s,
            s.post(url + "/v1/completions", json={"prompt": "x", "prompt_cache_key": "k"}) as r,
        ):
            assert r.status == 502
        assert len(router.sessions.local) == 0


async def test_hint_headers_are_stripped_trusted_or_not_and_session_headers_pass():
    async with echo_engine() as echo:
        for sessions in (
            SessionConfig(),
            SessionConfig(enabled=True),
            SessionConfig(enabled=True, trust_hints=True),
        ):
            cfg = RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                proxy=ProxyConfig(engine_header=True),
                workers=(WorkerSpec(echo, echo),),
                sessions=sessions,
                scheduling=SchedulingConfig(policy="round_robin"),
                health=HealthConfig(interval_s=0),
            )
            async with (
                run_router(cfg) as (_router, url),
                aiohttp.ClientSession() as s,
                s.post(
                    url + "/v1/completions",
                    json={"prompt": "x"},
                    headers={HINT: "e1.whatever", "x-session-id": "abc"},
                ) as r,
            ):
                got = (await r.json())["headers"]
                assert HINT.lower() not in got
                assert got["x-session-id"] == "abc"
                assert (ENGINE_ID in r.headers) is sessions.enabled
