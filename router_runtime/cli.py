"""``routerfleet-router``: run the router until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import time

from .app import run_router
from .config import RouterConfig, parse_args

log = logging.getLogger("routerfleet.router")

# The young generation's collection threshold (CPython's default is 700 allocations). A request makes
# hundreds of objects that die with it, and at 700 the collector scanned the requests in flight about
# every ten requests: 3-6% of the router's CPU per request (bench.overhead's ours-gc700 row, side by
# side). Cyclic garbage waits for at most this many objects' worth of allocations.
GC_YOUNG_THRESHOLD = 10_000


async def _serve(config: RouterConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with run_router(config) as (router, url):
        log.info(
            "router listening on %s (metrics on %s): policy %s, tokenizer %s, %d static workers",
            url,
            router.metrics_url,
            config.scheduling.policy,
            "bytes" if config.tokens.tokenizer == "bytes" else "hf",
            len(config.workers),
        )
        # Everything made while starting (modules, the app, the parsers) lives as long as the process:
        # out of the collector's reach, a full collection scans only what serving made since. Without
        # it, requests' objects promoted to the oldest generation set off a full scan of ~85k objects
        # every half second under load.
        gc.freeze()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        await stop.wait()
        # Drain: not Ready, every response closes its connection, and new requests and picks are still
        # served, while the Service's endpoints, the gateways and the clients' pools catch up (drain.py);
        # a second signal cuts it short. Then the server stops listening and waits for the requests in
        # flight.
        stop.clear()
        drain = router.drain()
        log.info("draining: at least %.1fs, at most %.1fs", drain.minimum, drain.maximum)
        while not stop.is_set() and (wait := drain.remaining(time.monotonic())) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
        log.info("%s", drain.summary(time.monotonic()))
    log.info("router stopped")


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # optional: faster event loop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(config))


if __name__ == "__main__":
    main()
