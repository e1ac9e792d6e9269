"""The added latency of a lookup in the fleet-shared session store (Redis), against the local table.

    python -m bench.session_store             # 5 runs x 2,000 lookups of each kind, about 15 s
    python -m bench.session_store --runs 3 --lookups 500

A redis-server of its own (Debian's package, `make redis`) on a loopback port, without persistence.
Measured in this process, on one asyncio loop, as the router calls them:

- *binding, local*: ``ResponseBindings.find`` answered by this replica's table (no store call);
- *binding, store*: ``find`` of an id only the shared store holds (a replica that never saw it: one
  GET round trip, the value vetted, then kept locally, so each id is looked up once);
- *session, store*: ``SessionAffinity.begin`` of a request with a session key, which asks the shared
  store first (the fleet's latest word) on every request;
- *store GET*: the bare ``RedisStore.get`` round trip under both.

Reported: p50 and p99 in microseconds, medians over the runs (min-max).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import time

from prometheus_client import CollectorRegistry

from router_runtime.scheduling.types import Target
from router_runtime.sessions.affinity import SessionAffinity
from router_runtime.sessions.bindings import BindingConfig, BindingMetrics, ResponseBindings
from router_runtime.sessions.config import SessionConfig
from router_runtime.sessions.keys import digest, response_digest
from router_runtime.sessions.metrics import SessionMetrics
from router_runtime.sessions.redis_store import SharedClient
from router_runtime.sessions.store import Remembered

from .harness import HOST, free_ports, machine, pct, wait_until

ENGINE = Target("http://10.0.0.1:8000", "http://10.0.0.1:8000", 0)
INCARNATIONS = {ENGINE.engine: "inc-1"}


def start_redis(workdir: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench.session_store: redis-server not found: run `make redis`")
    port = free_ports(1)[0]
    argv = [binary, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no", "--dir", workdir]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://{HOST}:{port}/0"

    def answers() -> bool:
        return asyncio.run(_ping(url))

    wait_until(answers, 10, "redis-server")
    return proc, url


async def _ping(url: str) -> bool:
    client = SharedClient(url)
    try:
        return await client.ping()
    finally:
        await client.close()


async def timed(fn, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await fn(i)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


async def one_run(url: str, n: int, run: int) -> dict[str, list[float]]:
    client = SharedClient(url)
    try:
        writer = ResponseBindings(
            BindingConfig(),
            BindingMetrics(CollectorRegistry()),
            lambda: INCARNATIONS,
            client.table("responses", 600),
        )
        reader = ResponseBindings(
            BindingConfig(),
            BindingMetrics(CollectorRegistry()),
            lambda: INCARNATIONS,
            client.table("responses", 600),
        )
        ids = [f"resp_{run:02d}{i:08d}" for i in range(n)]
        for rid in ids:  # bound by one replica...
            await writer.bind(rid, ENGINE)
        sessions = SessionAffinity(
            SessionConfig(enabled=True), SessionMetrics(CollectorRegistry()), client.table("sessions", 600)
        )
        names = [f"s{run}-{i}" for i in range(n)]
        keys = [digest("header", "m", name) for name in names]
        table = client.table("sessions", 600)
        for k in keys:  # sessions another replica remembered
            await table.put(k, Remembered(ENGINE.engine, ENGINE.rank, INCARNATIONS[ENGINE.engine]))
        found = {
            "binding, local": await timed(lambda i: writer.find(ids[i]), n),
            "binding, store": await timed(lambda i: reader.find(ids[i]), n),  # ...found by another
            "session, store": await timed(
                lambda i: sessions.begin({"x-session-id": names[i]}, {"model": "m"}), n
            ),
            "store GET": await timed(lambda i: table.get(keys[i]), n),
        }
        misses = sum(1 for rid in ids if reader.local.get_nowait(response_digest(rid)) is None)
        if misses:
            raise SystemExit(f"bench.session_store: {misses} bindings were not found through the store")
        return found
    finally:
        await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=2000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        proc, url = start_redis(workdir)
        try:
            runs = [asyncio.run(one_run(url, a.lookups, r)) for r in range(a.runs)]
        finally:
            proc.kill()
            proc.wait()
    print(
        f"# bench.session_store: {machine()}; {a.runs} runs x {a.lookups} lookups; redis-server on loopback"
    )
    print("| lookup | p50 us | p99 us |")
    print("| --- | --- | --- |")
    for kind in runs[0]:
        cells = []
        for p in (50, 99):
            vals = [pct(r[kind], p) for r in runs]
            cells.append(f"{statistics.median(vals):.0f} ({min(vals):.0f}-{max(vals):.0f})")
        print(f"| {kind} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
