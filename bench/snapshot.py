"""Peer-snapshot pipeline cost: export, encode, compress, inflate, decode, vet, graft.

    python -m bench.snapshot                 # the captured shape (36,612 blocks of 256 tokens, 2 engines)
    python -m bench.snapshot --nodes 1000000 --nodes 8000000

Anchors (from the seeds; not runnable here): the snapshot companion recovered the captured shape in
1.14 s p95; SGLang's router served an 8.3M-node tree as 40 MB gzipped in 17 s. Goals: captured shape
under 250 ms end to end, 8M nodes under 10 s, no writer stall over 50 ms (the longest single export or
graft step, which is what live event application waits for). Each size runs in a fresh subprocess so
peak RSS is its own. Transfer over HTTP is measured once the producer endpoint exists; here the body
crosses a gzip round trip in memory.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import resource
import statistics
import subprocess
import sys
import time

from router_runtime.bootstrap.vetting import HashingConfig, LocalWorker, vet
from router_runtime.bootstrap.wire import Limits, WireSnapshot, WireWorker, decode, encode, inflate
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.hashing import SCHEME
from router_runtime.kv.index import Carrier, RadixIndex
from router_runtime.kv.snapshot import Exporter, Grafter

CHUNK = 4096


def build(nodes: int, block_size: int, engines: int, seed: int = 1) -> RadixIndex:
    """A tree of ``nodes`` blocks: shared system prompts, then conversation tails, spread over engines."""
    rng = random.Random(seed)
    index = RadixIndex(block_size)
    carriers = [Carrier(f"http://engine-{e}", 0) for e in range(engines)]
    systems = [[rng.randrange(50_000) for _ in range(block_size * 8)] for _ in range(16)]
    h = 1
    made = 0
    while made < nodes:
        carrier = rng.choice(carriers)
        n = min(rng.randrange(4, 64), nodes - made + 8)
        toks = rng.choice(systems) + [rng.randrange(50_000) for _ in range(block_size * n)]
        blocks = len(toks) // block_size
        index.apply_batch(
            carrier,
            EventBatch(0.0, (BlockStored(tuple(range(h, h + blocks)), None, tuple(toks), block_size),)),
        )
        h += blocks
        made = index.node_count()
    return index


def run_one(nodes: int, block_size: int, engines: int) -> dict:
    index = build(nodes, block_size, engines)
    out: dict = {"nodes": index.node_count()}
    stalls = []
    t0 = time.perf_counter()
    ex = Exporter(index)
    while True:
        s = time.perf_counter()
        done = ex.step(CHUNK)
        stalls.append(time.perf_counter() - s)
        if done:
            break
    out["export_s"] = time.perf_counter() - t0
    snap = WireSnapshot(
        1,
        "bench",
        "p",
        True,
        block_size,
        SCHEME,
        [WireWorker(c.engine, c.rank, "i") for c in ex.workers],
        [(i, 100) for i in range(len(ex.workers))],
        0,
        ex.columns,
    )
    t = time.perf_counter()
    body = encode(snap)
    out["encode_s"] = time.perf_counter() - t
    t = time.perf_counter()
    wire = gzip.compress(body, compresslevel=1)
    out["gzip_s"] = time.perf_counter() - t
    out["bytes_raw"], out["bytes_gzip"] = len(body), len(wire)
    t = time.perf_counter()
    decoded = decode(inflate(wire, Limits()), Limits())
    out["inflate_decode_s"] = time.perf_counter() - t
    local = {(c.engine, c.rank): LocalWorker(c, "i") for c in ex.workers}
    t = time.perf_counter()
    vetted = vet(decoded, local, HashingConfig(block_size, SCHEME))
    out["vet_s"] = time.perf_counter() - t
    dst = RadixIndex(block_size)
    g = Grafter(dst, vetted.columns, vetted.carriers)
    t = time.perf_counter()
    while True:
        s = time.perf_counter()
        done = g.step(CHUNK)
        stalls.append(time.perf_counter() - s)
        if done:
            break
    out["graft_s"] = time.perf_counter() - t
    out["total_s"] = sum(
        out[k] for k in ("export_s", "encode_s", "gzip_s", "inflate_decode_s", "vet_s", "graft_s")
    )
    out["max_stall_ms"] = max(stalls) * 1e3
    out["p99_stall_ms"] = (
        statistics.quantiles(stalls, n=100)[-1] * 1e3 if len(stalls) > 2 else out["max_stall_ms"]
    )
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert dst.node_count() == index.node_count()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, action="append", help="tree sizes (default: the captured shape)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)  # nodes block_size engines
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*a.one)))
        return
    shapes = [(n, 16, 8) for n in a.nodes] if a.nodes else [(36_612, 256, 2)]
    print(
        "| nodes | block | total s | export | encode | gzip | inflate+decode | vet | graft | raw MiB "
        "| gzip MiB | max stall ms | peak RSS MiB |"
    )
    for nodes, bs, engines in shapes:
        runs = []
        for _ in range(a.runs):
            r = subprocess.run(
                [sys.executable, "-m", "bench.snapshot", "--one", str(nodes), str(bs), str(engines)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(r.stdout))
            print(f"# {nodes} run {len(runs)}/{a.runs}: {runs[-1]['total_s']:.3f} s", file=sys.stderr)
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {m['nodes']:.0f} | {bs} | {m['total_s']:.3f} | {m['export_s']:.3f} | {m['encode_s']:.3f} | "
            f"{m['gzip_s']:.3f} | {m['inflate_decode_s']:.3f} | {m['vet_s']:.3f} | {m['graft_s']:.3f} | "
            f"{m['bytes_raw'] / 2**20:.1f} | {m['bytes_gzip'] / 2**20:.1f} | {m['max_stall_ms']:.1f} | "
            f"{m['peak_rss_mib']:.0f} |"
        )
    print("medians of runs; goals: captured shape < 0.25 s, 8M nodes < 10 s, max stall < 50 ms")


if __name__ == "__main__":
    main()
