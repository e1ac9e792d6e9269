"""The router process: the KV plane plus its HTTP surface (health, readiness, metrics, index summary)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .config import RouterConfig
from .kv.hashing import hash_set_digest
from .kv.index import TIER_ORDER
from .kv.plane import KVPlane
from .kv.subscription import ReplayTimeouts


class Router:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = CollectorRegistry()
        self.kv = KVPlane(
            config.block_size,
            self.registry,
            replay_timeouts=ReplayTimeouts(config.replay_idle_timeout_s, config.replay_timeout_s),
            queue_batches=config.queue_batches,
            queue_bytes=config.queue_bytes,
        )

    async def start(self) -> None:
        await self.kv.start()
        self.kv.set_workers(list(self.config.workers))

    async def stop(self) -> None:
        await self.kv.stop()

    def ready(self) -> tuple[bool, str]:
        if not self.kv.workers:
            return False, "no engines discovered"
        if any(w.kv for w in self.kv.workers.values()) and not self.kv.live():
            return False, "no live KV event subscription"
        return True, "ready"

    def index_summary(self) -> dict:
        """Per carrier and tier: how many blocks the index holds and a digest of their engine hashes."""
        index = self.kv.index
        carriers = []
        for c in index.carriers:
            by_tier = index.carrier_engine_hashes(c)
            carriers.append(
                {
                    "engine": c.engine,
                    "rank": c.rank,
                    "tiers": {
                        t.name.lower(): {"blocks": len(by_tier[t]), "digest": hash_set_digest(by_tier[t])}
                        for t in TIER_ORDER
                    },
                }
            )
        subs = [
            {"engine": s.carrier.engine, "rank": s.carrier.rank, "connected": s.connected, "cursor": s.cursor}
            for s in self.kv.subscriptions()
        ]
        return {"nodes": index.node_count(), "carriers": carriers, "subscriptions": subs}

    # ---- HTTP ----------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/debug/index", self._index)
        return app

    async def _healthz(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, _req: web.Request) -> web.Response:
        ok, why = self.ready()
        return web.json_response({"ready": ok, "reason": why}, status=200 if ok else 503)

    async def _metrics(self, _req: web.Request) -> web.Response:
        self.kv.live()  # refresh the live-subscription gauge
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _index(self, _req: web.Request) -> web.Response:
        return web.json_response(self.index_summary())


@contextlib.asynccontextmanager
async def run_router(config: RouterConfig) -> AsyncIterator[tuple[Router, str]]:
    """Start a router in this event loop; yields it and its base URL. For tests, the demo and benches."""
    router = Router(config)
    await router.start()
    runner = web.AppRunner(router.build_app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield router, f"http://{config.host}:{port}"
    finally:
        await runner.cleanup()
        await router.stop()
