"""The fleet-shared session store on a real redis-server (Debian's package, `make redis`), started by
these tests on loopback: three router replicas behind round robin keep every Responses follow-up on its
engine through the store, after the replica that served the first turn is gone and after the replicas
are replaced; a session's engine is shared the same way. A store that is killed, or stops answering,
degrades each replica to its own tables (a metric says so), never a failed or hung request; a restarted
store is used again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time

import aiohttp
import msgpack
import openai
import pytest

from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.sessions.bindings import BindingConfig
from router_runtime.sessions.config import SessionConfig, StoreConfig
from router_runtime.sessions.redis_store import SharedClient, _vetted, store_url
from router_runtime.sessions.store import Remembered
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, free_port, join_stream, static_workers

BS = 4
ENGINE_HEADER = "X-RouterFleet-Engine"
LONG = "The quick brown fox jumps over the lazy dog. " * 4
HANG_S = 10.0  # a request slower than this is hung, not slow (the store's deadline is 20 ms)


class RedisServer:
    """A redis-server of our own on a loopback port, without persistence (a restart forgets all)."""

    def __init__(self, workdir) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run `make redis` (make test does)"
        self.binary, self.dir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        args += ["no", "--dir", str(self.dir)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:  # still accepts connections (the kernel does), answers nothing
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.kill()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def sample(router, name, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


async def create(url: str, **kw):
    # Closed here: a client left to the garbage collector closes its connections late, unregistering
    # whatever took their socket numbers meanwhile from the event loop.
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        raw = await asyncio.wait_for(
            client.responses.with_raw_response.create(model="m", max_output_tokens=3, **kw), HANG_S
        )
    return raw.parse(), raw.headers[ENGINE_HEADER]


@contextlib.asynccontextmanager
async def fleet(store_url_: str, n_engines: int = 3, bindings: BindingConfig | None = None):
    """Engines, and a way to start router replicas on them sharing ``store_url_`` (no probing: the
    store alone must carry the bindings)."""
    bindings = bindings or BindingConfig(probe_timeout_s=0)
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(n_engines)]
        workers = static_workers(engines)
        by_url = {e.http_url: e for e in engines}

        async def replica(stack_=stack, join: bool = True):
            """A replica; ``join``: wait until it follows every engine's stream (a replica started
            mid-stream replays first: what it routes by binding or session does not need that)."""
            cfg = RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                proxy=ProxyConfig(engine_header=True),
                workers=workers,
                sessions=SessionConfig(enabled=True),
                responses=bindings,
                kv=KvConfig(block_size=BS),
                health=HealthConfig(interval_s=0),
                fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0)),
                store=StoreConfig(url=store_url_),
            )
            router, url = await stack_.enter_async_context(run_router(cfg))
            for sub in router.kv.subscriptions() if join else ():
                await join_stream(by_url[sub.carrier.engine].publisher, sub)
            return router, url

        yield engines, replica


async def test_three_replicas_keep_follow_ups_on_their_engine_through_kills_and_replacement(redis_server):
    # Where follow-ups go is the point here, not the store's deadlines (the outage test's): a loaded CI
    # machine has missed the 20 ms lookup deadline while a replica booted, and lost a follow-up to it.
    patient = BindingConfig(probe_timeout_s=0, lookup_timeout_s=1.0, write_timeout_s=1.0)
    async with fleet(redis_server.url, bindings=patient) as (_engines, replica):
        stacks = [contextlib.AsyncExitStack() for _ in range(3)]
        replicas = []
        for st in stacks:
            await st.__aenter__()
            replicas.append(await replica(st))
        turn, engine = await create(replicas[0][1], input=LONG)
        for k in range(1, 7):  # round robin: each follow-up on a replica that did not serve the last turn
            turn, got = await create(replicas[k % 3][1], input=f"turn {k}", previous_response_id=turn.id)
            assert got == engine
        found = sum(sample(r, "routerfleet_response_lookups_total", source="store") for r, _u in replicas)
        assert found == 6
        # The replica that served the last turn goes away; the others still know where it lives.
        await stacks[0].aclose()
        turn, got = await create(replicas[1][1], input="after the kill", previous_response_id=turn.id)
        assert got == engine
        # A rolling update: two new replicas replace the rest; they never saw any of it.
        fresh = [await replica(join=False) for _ in range(2)]
        for st in stacks[1:]:
            await st.aclose()
        for k, (_r, url) in enumerate(fresh * 2):
            turn, got = await create(url, input=f"new {k}", previous_response_id=turn.id)
            assert got == engine
        # A session's engine is shared the same way: no hints, no bootstrap.
        body = {"model": "m", "prompt": LONG, "max_tokens": 1, "prompt_cache_key": "conversation-7"}
        async with aiohttp.ClientSession() as s:
            seen = set()
            for k in range(4):
                async with s.post(fresh[k % 2][1] + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    seen.add(r.headers[ENGINE_HEADER])
        assert len(seen) == 1
        assert sample(fresh[1][0], "routerfleet_session_lookups_total", result="hit") >= 1
        assert sample(fresh[0][0], "routerfleet_shared_store_up") == 1


async def test_a_store_outage_degrades_to_each_replicas_own_table_and_a_restart_recovers(redis_server):
    async with fleet(redis_server.url) as (_engines, replica):
        (a, a_url), (b, b_url) = await replica(), await replica()
        first, engine = await create(a_url, input=LONG)
        redis_server.kill()
        # The replica that saw the response still routes its follow-up (its own table)...
        second, got = await create(a_url, input="store down", previous_response_id=first.id)
        assert got == engine
        # ...and a new response bound while the store is down is kept there too.
        third, got = await create(a_url, input="still down", previous_response_id=second.id)
        assert got == engine
        # The other replica never saw it, and cannot ask: retry (never "not found": it exists).
        with pytest.raises(openai.InternalServerError) as err:
            await create(b_url, input="elsewhere", previous_response_id=third.id)
        assert err.value.status_code == 503 and err.value.body["code"] == "response_store_unavailable"
        assert sample(a, "routerfleet_shared_store_up") == 0
        assert sample(a, "routerfleet_response_binds_total", result="error") >= 1
        # Restarted (empty): used again by each replica once its own backoff has passed (b failed
        # later than a, so a being up says nothing of b).
        redis_server.start()
        deadline = time.monotonic() + 5
        for r, url in ((a, a_url), (b, b_url)):
            while sample(r, "routerfleet_shared_store_up") == 0:
                assert time.monotonic() < deadline, "the store was not used again after its restart"
                await create(url, input=LONG + " restart")  # each binding write tries the store
                await asyncio.sleep(0.2)
        fourth, got = await create(a_url, input="written again", previous_response_id=third.id)
        _r, got_b = await create(b_url, input="found again", previous_response_id=fourth.id)
        assert got == got_b == engine
        # What a bound while the store was down reaches it once it answers again: b finds it now.
        await eventually(lambda: sample(a, "routerfleet_response_binds_total", result="stored_late") >= 2)
        _r, got_b = await create(b_url, input="found late", previous_response_id=third.id)
        assert got_b == engine
        # A store that stops answering (connections accepted, nothing said) holds nobody either: the
        # write waits out its deadline, the lookup elsewhere too, and neither request hangs.
        redis_server.pause()
        try:
            fifth, got = await create(a_url, input="paused", previous_response_id=fourth.id)
            assert got == engine
            with pytest.raises(openai.InternalServerError):  # 503: ask again
                await create(b_url, input="paused elsewhere", previous_response_id=fifth.id)
            _sixth, got = await create(a_url, input="paused again", previous_response_id=fifth.id)
            assert got == engine
        finally:
            redis_server.resume()
        assert sample(a, "routerfleet_response_binds_total", result="timeout") == 1  # then skipped
        assert sample(b, "routerfleet_shared_store_up") == 0


async def test_stored_values_are_vetted_and_urls_checked(redis_server):
    client = SharedClient(redis_server.url)
    try:
        table = client.table("responses", 60)
        value = Remembered("http://e", 1, "inc")
        await table.put(b"d" * 32, value)
        assert await table.get(b"d" * 32) == value
        assert await table.get(b"x" * 32) is None
        for bad in (b"\x00junk", msgpack.packb(["e", 1 << 20, "i"]), msgpack.packb({"engine": "e"})):
            await client.redis.set(table.prefix + (b"b" * 32).hex(), bad)
            with pytest.raises(ValueError):
                await table.get(b"b" * 32)
        assert await client.redis.pttl(table.prefix + (b"d" * 32).hex()) > 50_000
    finally:
        await client.close()


async def test_a_key_of_the_wrong_type_is_that_keys_bad_value_never_a_store_wide_back_off(redis_server):
    """A list under one session's key (anything else writing the store) answers WRONGTYPE: that lookup
    is a bad value, and every other key is still asked (it backed the whole store off for a second,
    each time that key was used)."""
    states: list[bool] = []
    client = SharedClient(redis_server.url, on_state=states.append)
    try:
        table = client.table("sessions", 60)
        value = Remembered("http://e", 0, "inc")
        await table.put(b"g" * 32, value)
        await client.redis.lpush(table.prefix + (b"w" * 32).hex(), "not ours")
        for _ in range(3):
            with pytest.raises(ValueError, match="not a string"):
                await table.get(b"w" * 32)
            assert await table.get(b"g" * 32) == value  # not StoreDown
        assert states and all(states)
    finally:
        await client.close()
    with pytest.raises(ValueError, match="password"):
        store_url("redis://:secret@host:6379")
    with pytest.raises(ValueError, match="redis://"):
        store_url("http://host")
    for bad in ("redis://r:abc/0", "redis://r:99999/0", "redis://r:6379/0?socket_timeout=abc"):
        with pytest.raises(ValueError, match="redis://r:"):  # at the flag, not a traceback at start
            store_url(bad)
    assert _vetted(None) is None
