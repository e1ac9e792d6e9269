"""Origin bootstrap: time to exact for a rank whose engine buffers N batches from sequence 0.

    python -m bench.origin                # 10,000 buffered batches (vLLM's default buffer), 3 runs
    python -m bench.origin --batches 2000 --runs 5

Measures, per run, from the router subscribing to the rank being exact (verdict from_origin): replay
over the engine's DEALER socket, decode, the private scratch index, the graft on the writer. The
anchor is the snapshot companion's note that bare vLLM replay of ~5,500 long batches took 180 s on a
busy publisher (fail closed); for a young engine the fake engine's replay is the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from prometheus_client import CollectorRegistry

from router_runtime.bootstrap.fetch import SnapshotFetcher
from router_runtime.bootstrap.metrics import BootstrapMetrics
from router_runtime.bootstrap.peers import PeerRegistry
from router_runtime.bootstrap.sweep import BootstrapConfig, Bootstrapper
from router_runtime.bootstrap.vetting import HashingConfig
from router_runtime.kv.config import KvConfig
from router_runtime.kv.hashing import SCHEME
from router_runtime.kv.plane import KVPlane
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.cache import PLAIN
from routerfleet_fake_engine.server import run_fake_engine

BS = 16


async def one(batches: int, seed: int) -> dict:
    rng = random.Random(seed)
    async with run_fake_engine(block_size=BS, capacity_blocks=20_000, replay_buffer=batches) as e:
        systems = [[rng.randrange(1, 30_000) for _ in range(BS * 8)] for _ in range(32)]
        for _ in range(batches):
            e.admit(
                0,
                rng.choice(systems) + [rng.randrange(1, 30_000) for _ in range(BS * rng.randrange(1, 6))],
                PLAIN,
            )
        assert e.publisher.last_seq(0) == batches - 1
        reg = CollectorRegistry()
        plane = KVPlane(KvConfig(block_size=BS, disconnect_grace_s=0.0), reg)
        await plane.start()
        peers = PeerRegistry()
        peers.publish([])
        boot = Bootstrapper(
            plane,
            peers,
            SnapshotFetcher(""),
            HashingConfig(BS, SCHEME),
            BootstrapMetrics(reg),
            BootstrapConfig(timeout_s=120, origin_timeout_s=120),
        )
        boot.start()
        t0 = time.perf_counter()
        plane.set_workers(
            [WorkerSpec(e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=e.replay_endpoint(0))]
        )
        while not boot.settled:
            await asyncio.sleep(0.005)
        elapsed = time.perf_counter() - t0
        verdict = boot.verdict.value
        replayed = reg.get_sample_value("routerfleet_bootstrap_origin_replayed_bytes_total")
        blocks = sum(sum(plane.index.carrier_blocks(c).values()) for c in plane.index.carriers)
        await boot.stop()
        await plane.stop()
        return {"seconds": elapsed, "verdict": verdict, "mib": replayed / 2**20, "blocks": blocks}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.origin", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    runs = [asyncio.run(one(a.batches, seed)) for seed in range(a.runs)]
    for r in runs:
        assert r["verdict"] == "from_origin", r
    secs = sorted(r["seconds"] for r in runs)
    print(
        f"origin time to exact, {a.batches} buffered batches ({runs[0]['mib']:.1f} MiB replayed, "
        f"{runs[0]['blocks']} blocks held): median {statistics.median(secs):.3f} s "
        f"(min {secs[0]:.3f}, max {secs[-1]:.3f}) over {a.runs} runs"
    )


if __name__ == "__main__":
    main()
