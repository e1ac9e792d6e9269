"""Shared test helpers: wait on conditions (never fixed sleeps), join a publisher's stream, stand up a
peer that answers /internal/kv_snapshot as a test wants, and a router over fake engines."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import aiohttp
from aiohttp import web

from router_runtime.app import Router, run_router
from router_runtime.config import MetricsConfig, RouterConfig
from router_runtime.kv.config import KvConfig
from router_runtime.kv.subscription import RankSubscription
from router_runtime.proxy.health import HealthConfig
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.publisher import KvPublisher
from routerfleet_fake_engine.server import FakeEngine, run_fake_engine


async def eventually(predicate: Callable[[], object], timeout: float = 5.0, what: str = "condition"):
    """Poll ``predicate`` until it is truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


def static_workers(engines: Iterable[FakeEngine]) -> tuple[WorkerSpec, ...]:
    """Fake engines as static workers (rank 0's KV and replay endpoints; the ranks above follow)."""
    return tuple(
        WorkerSpec(
            e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=e.replay_endpoint(0), dp_size=e.config.dp_size
        )
        for e in engines
    )


async def join_all(router, engines: Iterable[FakeEngine]) -> None:
    """Wait until the router follows every rank of every engine's stream (``join_stream``)."""
    by_url = {e.http_url: e for e in engines}
    for sub in router.kv.subscriptions():
        await join_stream(by_url[sub.carrier.engine].publisher, sub, sub.carrier.rank)


async def join_stream(publisher: KvPublisher, sub: RankSubscription, rank: int = 0) -> None:
    """ZMQ drops what a PUB sends before the SUB's subscription arrives, so publish empty batches until
    the subscription has taken one: from then on the stream is contiguous. (A cursor of -1 waits for
    a new publisher's first batch.) The bound only tells a hang from a join: a suite loading both cores
    has taken over 5 s to deliver the first batch."""
    deadline = time.monotonic() + 30
    while sub.cursor is None or sub.cursor < 0:
        if time.monotonic() > deadline:
            raise AssertionError(  # what it did take, to tell a silent socket from a stuck loop
                f"subscription {sub.carrier} never received a batch (connected {sub.connected},"
                f" cursor {sub.cursor}, last live {sub.live_last}, filling {sub.filling},"
                f" held {sub.hold is not None})"
            )
        publisher.publish(rank, ())
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def loopback_app(*routes: web.RouteDef) -> AsyncIterator[str]:
    """An HTTP server on loopback answering ``routes``; yields its base URL."""
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def snapshot_peer(answer: Callable[[web.Request], Awaitable[web.Response]]) -> AsyncIterator[str]:
    """A peer on loopback whose ``/internal/kv_snapshot`` is ``answer`` (hostile, broken, forged);
    yields its base URL."""
    async with loopback_app(web.get("/internal/kv_snapshot", answer)) as url:
        yield url


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def threads_named(prefix: str) -> list[int]:
    """This process's threads whose name starts with ``prefix`` (thread ids; one that ends meanwhile is
    left out)."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().startswith(prefix):
                out.append(int(tid))
    return out


def free_port() -> int:
    """A loopback port free a moment ago (nothing listens on it: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port_url() -> str:
    """An engine URL where nothing listens: connecting is refused."""
    return f"http://127.0.0.1:{free_port()}"


# A test router's metrics port: any free one (the default, 9090, is one router's per host).
LOCAL_METRICS = MetricsConfig(port=0)


def predicted_blocks(router, *, prefill: bool = False) -> int:
    """Blocks the router's in-flight predictions hold over all its candidates (0: every request that made
    one has ended); ``prefill``: its prefill profile's, over its prefill engines."""
    from router_runtime.scheduling.inflight_prefix import InflightPrefix

    profile = router.proxy.prefill.profile if prefill else router.scheduler.profile
    targets = router.targets.prefill_candidates() if prefill else router.targets.candidates()
    plugins = [p for p in profile.scorers if isinstance(p, InflightPrefix)]
    return sum(p.predicted_blocks(t.carrier) for p in plugins for t in targets)


@contextlib.asynccontextmanager
async def router_over_fakes(
    n_engines: int, block_size: int, *, engine: dict | None = None, **sections
) -> AsyncIterator[tuple[list[FakeEngine], Router, str, aiohttp.ClientSession]]:
    """``n_engines`` fake engines (``engine``: their config fields) as static workers of one router that
    follows every stream, with no health probes and ``sections`` (RouterConfig fields) over those
    defaults: (engines, router, its URL, a client session)."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(run_fake_engine(block_size=block_size, **(engine or {})))
            for _ in range(n_engines)
        ]
        defaults = {"kv": KvConfig(block_size=block_size), "health": HealthConfig(interval_s=0)}
        cfg = RouterConfig(
            port=0, metrics=LOCAL_METRICS, workers=static_workers(engines), **{**defaults, **sections}
        )
        router, url = await stack.enter_async_context(run_router(cfg))
        await join_all(router, engines)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield engines, router, url, session
