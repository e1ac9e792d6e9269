"""Peer-snapshot pipeline end to end: export, encode, compress, HTTP transfer, inflate, decode, vet, graft.

    python -m bench.snapshot                 # the captured shape (36,612 blocks of 256 tokens, 2 engines)
    python -m bench.snapshot --nodes 1000000 --nodes 8000000
    python -m bench.snapshot --captured --nodes 1000000 --nodes 8000000   # all three, as issue 17 asks

Two processes per run, as two replicas: a producer (builds the index, serves the library's own
``internal_app`` + ``SnapshotProducer`` on a loopback port, its index writer being a real ``IndexWriter``)
and a consumer (GETs ``/internal/kv_snapshot?format=2`` as ``SnapshotFetcher`` does, decodes and vets
off the loop as the fetcher and the bootstrapper do, and grafts through its own writer in chunks;
``--format 1`` takes the previous version's path instead: gzip over HTTP, inflate, then decode).
Both processes are fresh, so RSS figures are their own.

Figures (issue 17 goals):

- total: from the GET to the last graft step (export + encode on the producer, transfer, decode, vet,
  graft); goals: captured shape <= 25 ms, 1M nodes <= 0.4 s, 8M nodes <= 3 s;
- longest stall of live event application, on either side: each process feeds its writer a one-block
  live batch every millisecond and records how late each was applied against its schedule, so a long
  export or graft step, or anything run on the loop (vet), shows; goal <= 5 ms. Timer resolution is
  about 1 ms, so ~1 ms is the floor. Also the longest single graft step;
- peak RSS during the graft vs the finished index: the consumer's peak RSS growth over the whole
  pipeline (body, columns and index alive together), over its RSS growth once only the index is left;
  goal <= 2x;
- bytes per node on the wire (format 2's packed columns; format 1 gzipped); goal <= 12.

Engine hashes are random 64-bit values, as vLLM's and SGLang's are (digests); counting hashes
(1, 2, 3...) compress to a fraction of that and would flatter the wire size (``--seq-hashes`` shows it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import os
import random
import resource
import socket
import statistics
import subprocess
import sys
import time
import types
from dataclasses import asdict, dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry

from router_runtime.bootstrap.http import internal_app
from router_runtime.bootstrap.producer import SnapshotProducer
from router_runtime.bootstrap.vetting import HashingConfig, LocalWorker, vet
from router_runtime.bootstrap.wire import FORMAT, LEGACY_FORMAT, Limits, decode, inflate
from router_runtime.http_body import read_capped
from router_runtime.kv.events import BlockRemoved, BlockStored, EventBatch, SequencedBatch
from router_runtime.kv.hashing import SCHEME
from router_runtime.kv.index import RadixIndex
from router_runtime.kv.metrics import KVMetrics
from router_runtime.kv.snapshot import Grafter
from router_runtime.kv.writer import IndexWriter
from router_runtime.worker import Carrier

CHUNK = 4096  # export and graft budget per writer turn: the library's defaults
TOKEN = "bench-token"
LIVE = Carrier("http://live-engine", 0)  # the live stream's carrier on each side (never grafted)
CAPTURED = (36_612, 256, 2)  # nodes, block size, engines

# Goals of issue 17.
GOAL_TOTAL_S = {36_612: 0.025, 1_000_000: 0.4, 8_000_000: 3.0}
GOAL_STALL_MS = 5.0
GOAL_RSS_RATIO = 2.0
GOAL_WIRE_BYTES = 12.0


def build(nodes: int, block_size: int, engines: int, seq_hashes: bool = False, seed: int = 1) -> RadixIndex:
    """A tree of ``nodes`` blocks: 16 shared system prompts of 8 blocks, then conversation tails of 4-63
    blocks, spread over engines. Each carrier gives a system prompt one set of engine hashes."""
    rng = random.Random(seed)
    index = RadixIndex(block_size)
    carriers = [Carrier(f"http://engine-{e}", 0) for e in range(engines)]
    systems = [[rng.randrange(50_000) for _ in range(block_size * 8)] for _ in range(16)]
    counter = iter(range(1, 1 << 62))

    def hashes(n: int) -> tuple[int, ...]:
        if seq_hashes:
            return tuple(next(counter) for _ in range(n))
        return tuple(rng.getrandbits(64) for _ in range(n))

    sys_hashes: dict[tuple[int, int], tuple[int, ...]] = {}
    tok = 1_000_000  # fresh tail tokens, counting (their block keys are hashes: the shape is the same)
    made = 0
    while made < nodes:
        ci = rng.randrange(engines)
        s = rng.randrange(len(systems))
        n = min(rng.randrange(4, 64), nodes - made + 8)
        sh = sys_hashes.get((ci, s))
        if sh is None:
            sh = sys_hashes[ci, s] = hashes(8)
        toks = (*systems[s], *range(tok, tok + block_size * n))
        tok += block_size * n
        ev = BlockStored(sh + hashes(n), None, toks, block_size)
        index.apply_batch(carriers[ci], EventBatch(0.0, (ev,)))
        made = index.node_count()
    return index


def _rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _trim() -> None:
    # Give freed heap back to the kernel, so RSS shows what is alive rather than allocator slack.
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _writer(index: RadixIndex) -> IndexWriter:
    return IndexWriter(index, KVMetrics(CollectorRegistry()))


class LiveFeed:
    """A one-block store (then its removal) for ``LIVE`` every ``period`` seconds, through the writer, on
    the loop; ``late`` holds (when, how far behind its schedule) per batch applied, in
    ``time.perf_counter`` seconds, so a stall can be put in the phase it happened in."""

    def __init__(self, writer: IndexWriter, block_size: int, period: float = 0.001) -> None:
        self.writer = writer
        self.period = period
        self.late: list[float] = []
        self._bs = block_size
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def reset(self) -> None:
        self.late = []

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        writer = self.writer
        t0 = loop.time()
        k = 0
        while True:
            k += 1
            due = t0 + k * self.period
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            # Store, then remove, block 1 of the live carrier: the tree does not grow.
            ev = BlockStored((1,), None, tuple(range(self._bs)), self._bs) if k % 2 else BlockRemoved((1,))
            writer.submit_batch(LIVE, SequencedBatch(k, EventBatch(0.0, (ev,))))
            writer.call(lambda _i, due=due: self.late.append((time.perf_counter(), loop.time() - due)))
            if loop.time() - due > self.period:  # the loop was blocked: count it once, do not pile up
                t0, k = loop.time(), 0


def _stalls(late: list[tuple[float, float]], starts: dict[str, float]) -> dict[str, float]:
    """The longest lateness (ms) per phase; ``starts`` maps each phase to its start, in order. A late
    batch waited from its due time to its application; it is put in the phase that most of that wait
    fell in (the one that held the loop or the writer), and left out if it was due before the first."""
    names = list(starts)
    bounds = [
        (n, starts[n], starts[names[i + 1]] if i + 1 < len(names) else float("inf"))
        for i, n in enumerate(names)
    ]
    out = dict.fromkeys(names, 0.0)
    for when, lag in late:
        due = when - lag
        if due < bounds[0][1]:
            continue
        phase = max(bounds, key=lambda b: min(when, b[2]) - max(due, b[1]))[0]
        out[phase] = max(out[phase], lag * 1e3)
    return out


# ---------------------------------------------------------------------------------------------------
# Producer process


class _TimedProducer(SnapshotProducer):
    """The library's producer; the bench only times its encode (+ gzip for format 1) apart from the build."""

    encode_at = (0.0, 0.0)  # perf_counter at its start and end

    async def get(self, max_age_s=None):
        built = await super().get(max_age_s)
        self.encode_at = (time.perf_counter(), 0.0)
        return built

    async def body(self, built, fmt, gzipped):
        try:
            return await super().body(built, fmt, gzipped)
        finally:
            self.encode_at = (self.encode_at[0], time.perf_counter())


async def produce(nodes: int, block_size: int, engines: int, seq_hashes: bool) -> None:
    index = build(nodes, block_size, engines, seq_hashes)
    built_nodes = index.node_count()
    writer = _writer(index)
    for c in index.carriers:
        writer.applied[c] = 0  # as if the stream were applied up to seq 0: vetting wants a cursor
    plane = types.SimpleNamespace(index=index, writer=writer, workers={})  # what the producer reads
    producer = _TimedProducer(
        plane,  # type: ignore[arg-type]
        HashingConfig(block_size, SCHEME),
        producer_id="bench-producer",
        producer_incarnation="p",
        ready=lambda: True,
        include=lambda c: c != LIVE,
        chunk=CHUNK,
    )
    wtask = asyncio.ensure_future(writer.run())
    feed = LiveFeed(writer, block_size)
    app = internal_app(TOKEN, None, producer)
    timing: dict[str, float] = {}

    async def mark(_r: web.Request) -> web.Response:
        feed.reset()
        timing["t0"] = time.perf_counter()
        return web.json_response({})

    async def stats(_r: web.Request) -> web.Response:
        enc0, enc1 = producer.encode_at
        phases = {"export": timing["t0"], "encode": enc0, "after": enc1}
        return web.json_response(
            {
                "built_nodes": built_nodes,
                "encode_s": enc1 - enc0,
                "stalls_ms": _stalls(feed.late, phases),
                "rss_mib": _rss(),
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )

    app.router.add_get("/bench/mark", mark)
    app.router.add_get("/bench/stats", stats)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    feed.start()
    print(json.dumps({"port": port}), flush=True)
    # Serve until the consumer closes our stdin.
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await feed.stop()
    wtask.cancel()
    await runner.cleanup()


# ---------------------------------------------------------------------------------------------------
# Consumer process (one run)


@dataclass(slots=True)
class Run:
    nodes: int
    records: int = 0
    total_s: float = 0.0
    format: int = FORMAT
    produce_s: float = 0.0  # GET sent -> response headers: the producer's export + encode
    export_s: float = 0.0
    encode_s: float = 0.0  # format 1: + gzip
    transfer_s: float = 0.0
    decode_s: float = 0.0  # format 1: inflate + decode
    vet_s: float = 0.0  # off the loop, as the bootstrapper runs it
    graft_s: float = 0.0
    bytes_raw: int = 0  # the envelope (format 1: inflated)
    bytes_wire: int = 0
    wire_bytes_per_node: float = 0.0
    stall_producer_ms: float = 0.0  # longest lateness of a live batch on the producer
    stall_consumer_ms: float = 0.0  # same on the consumer, fetch to graft end
    stalls_by_phase: dict[str, float] = field(default_factory=dict)  # "side phase" -> longest, ms
    max_graft_step_ms: float = 0.0
    consumer_base_mib: float = 0.0
    consumer_peak_mib: float = 0.0
    consumer_final_mib: float = 0.0  # after the graft, body and columns dropped, heap trimmed
    rss_ratio: float = 0.0  # (peak - base) / (final - base)
    producer_peak_mib: float = 0.0


async def consume(nodes: int, block_size: int, engines: int, seq_hashes: bool, fmt: int) -> Run:
    cmd = [sys.executable, "-m", "bench.snapshot", "--produce", str(nodes), str(block_size), str(engines)]
    cmd += ["--seq-hashes"] if seq_hashes else []
    prod = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.get_running_loop().run_in_executor(None, prod.stdout.readline)  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"the producer exited ({prod.wait()})")
        url = f"http://127.0.0.1:{json.loads(line)['port']}"
        return await _consume(url, nodes, block_size, engines, fmt)
    finally:
        prod.stdin.close()  # type: ignore[union-attr]
        prod.wait(timeout=60)


async def _consume(url: str, nodes: int, block_size: int, engines: int, fmt: int) -> Run:
    loop = asyncio.get_running_loop()
    run = Run(nodes, format=fmt)
    dst = RadixIndex(block_size)
    writer = _writer(dst)
    wtask = asyncio.ensure_future(writer.run())
    feed = LiveFeed(writer, block_size)
    feed.start()
    hdr = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        async with http.get(url + "/bench/mark", headers=hdr) as r:
            await r.read()
        await asyncio.sleep(0.05)  # the live feeds settle
        gc.collect()
        _trim()
        run.consumer_base_mib = _rss()
        feed.reset()
        # The fetch as SnapshotFetcher does it (format 2 asked; for format 1, gzip accepted and no
        # automatic decoding), split in two so the producer's work and the transfer are timed apart.
        t0 = time.perf_counter()
        legacy = fmt == LEGACY_FORMAT
        headers = {**hdr, "Accept-Encoding": "gzip"} if legacy else hdr
        params = {"max_age_ms": "0", "format": str(fmt)}
        async with http.get(url + "/internal/kv_snapshot", params=params, headers=headers) as r:
            t_hdr = time.perf_counter()
            assert r.status == 200, r.status
            assert (r.headers.get("Content-Encoding") == "gzip") == legacy
            body = await read_capped(r.content, Limits().max_bytes)  # as SnapshotFetcher reads it
        t_body = time.perf_counter()
        run.produce_s, run.transfer_s = t_hdr - t0, t_body - t_hdr
        run.bytes_wire = len(body)

        def open_body(b: bytes):
            raw = inflate(b, Limits()) if legacy else b
            return len(raw), decode(raw, Limits())

        run.bytes_raw, wire = await loop.run_in_executor(
            None, open_body, body
        )  # off the loop, as the fetcher
        del body
        t_dec = time.perf_counter()
        run.decode_s = t_dec - t_body
        run.records = len(wire.columns)
        local = {
            (w.engine, w.rank): LocalWorker(Carrier(w.engine, w.rank), w.incarnation) for w in wire.workers
        }
        # Vetted and the grafter built off the loop, as sweep.py does.
        vetted = await loop.run_in_executor(None, vet, wire, local, HashingConfig(block_size, SCHEME))
        del wire
        grafter = await loop.run_in_executor(None, Grafter, dst, vetted.columns, vetted.carriers)
        t_vet = time.perf_counter()
        run.vet_s = t_vet - t_dec
        steps: list[float] = []

        def step(_index: RadixIndex, g: Grafter = grafter) -> bool:
            s = time.perf_counter()
            done = g.step(CHUNK)
            steps.append(time.perf_counter() - s)
            return done

        while not await writer.call(step):
            pass
        t_end = time.perf_counter()
        run.graft_s = t_end - t_vet
        run.total_s = t_end - t0
        run.max_graft_step_ms = max(steps) * 1e3
        print(
            "DEBUG steps",
            [(i, round(x * 1e3, 1)) for i, x in enumerate(steps) if x > 0.003],
            len(steps),
            file=sys.stderr,
        )
        phases = {"fetch": t0, "decode": t_body, "vet": t_dec, "graft": t_vet, "after": t_end}
        cons = {k: v for k, v in _stalls(feed.late, phases).items() if k != "after"}
        run.stall_consumer_ms = max(cons.values(), default=0.0)
        async with http.get(url + "/bench/stats", headers=hdr) as r:
            ps = await r.json()
    await feed.stop()
    wtask.cancel()
    run.consumer_peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    del vetted, grafter, step
    _trim()
    run.consumer_final_mib = _rss()
    grown = run.consumer_final_mib - run.consumer_base_mib
    run.rss_ratio = (run.consumer_peak_mib - run.consumer_base_mib) / grown if grown > 0 else float("nan")
    run.encode_s = ps["encode_s"]
    run.export_s = run.produce_s - run.encode_s
    prod = {k: v for k, v in ps["stalls_ms"].items() if k != "after"}
    run.stall_producer_ms = max(prod.values(), default=0.0)
    run.stalls_by_phase = {f"producer {k}": v for k, v in prod.items()}
    run.stalls_by_phase.update({f"consumer {k}": v for k, v in cons.items()})
    run.producer_peak_mib = ps["peak_rss_mib"]
    run.wire_bytes_per_node = run.bytes_wire / max(run.records, 1)
    assert dst.node_count() >= ps["built_nodes"], (dst.node_count(), ps["built_nodes"])
    return run


# ---------------------------------------------------------------------------------------------------
# Report


def _verdict(v: float, goal: float) -> str:
    if v <= goal:
        return "MET"
    short = v / goal
    return f"SHORT by {short:.3f}x" if short < 1.1 else f"SHORT by {short:.2f}x"


@dataclass(slots=True)
class Shape:
    nodes: int
    block_size: int
    engines: int
    runs: list[Run] = field(default_factory=list)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.snapshot", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, action="append", help="tree sizes, 16-token blocks, 8 engines")
    ap.add_argument("--captured", action="store_true", help="also the captured shape (the default alone)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seq-hashes", action="store_true", help="counting engine hashes (compress well)")
    ap.add_argument("--json", help="also write every run to this file")
    ap.add_argument(
        "--format",
        type=int,
        choices=(LEGACY_FORMAT, FORMAT),
        default=FORMAT,
        help="the envelope asked for (1: the previous version's, gzipped)",
    )
    ap.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)  # nodes block_size engines
    ap.add_argument("--produce", nargs=3, type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.produce:
        asyncio.run(produce(*a.produce, a.seq_hashes))
        return
    if a.one:
        print(json.dumps(asdict(asyncio.run(consume(*a.one, a.seq_hashes, a.format)))))
        return
    shapes = [Shape(*CAPTURED)] if a.captured or not a.nodes else []
    shapes += [Shape(n, 16, 8) for n in a.nodes or []]
    for sh in shapes:
        for _ in range(a.runs):
            cmd = [sys.executable, "-m", "bench.snapshot", "--one", str(sh.nodes), str(sh.block_size)]
            cmd += [str(sh.engines), "--format", str(a.format)] + (["--seq-hashes"] if a.seq_hashes else [])
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(
                    f"# {sh.nodes}: run failed ({r.returncode}): {r.stderr.strip()[-600:]}", file=sys.stderr
                )
                continue
            sh.runs.append(Run(**json.loads(r.stdout.strip().splitlines()[-1])))
            print(f"# {sh.nodes} run {len(sh.runs)}/{a.runs}: {sh.runs[-1].total_s:.3f} s", file=sys.stderr)
    hashes = "counting" if a.seq_hashes else "random 64-bit"
    print(
        f"# medians of the runs that finished (fresh producer and consumer each); engine hashes {hashes};"
        f" envelope format {a.format}" + (" (gzipped)" if a.format == LEGACY_FORMAT else "")
    )
    print(
        "| nodes | block | runs | total s | export | encode | transfer | decode | vet | graft "
        "| raw MiB | wire MiB | B/node wire | stall prod/cons ms | max graft step ms "
        "| consumer RSS base/peak/final MiB | peak/final |"
    )
    meds: list[tuple[Shape, dict[str, float]]] = []
    for sh in shapes:
        if not sh.runs:
            continue
        m = {
            k: statistics.median(getattr(r, k) for r in sh.runs)
            for k, v in asdict(sh.runs[0]).items()
            if isinstance(v, int | float)
        }
        meds.append((sh, m))
        print(
            f"| {m['records']:.0f} | {sh.block_size} | {len(sh.runs)}/{a.runs} | {m['total_s']:.3f} "
            f"| {m['export_s']:.3f} "
            f"| {m['encode_s']:.3f} | {m['transfer_s']:.3f} | {m['decode_s']:.3f} "
            f"| {m['vet_s']:.3f} | {m['graft_s']:.3f} | {m['bytes_raw'] / 2**20:.1f} "
            f"| {m['bytes_wire'] / 2**20:.1f} | {m['wire_bytes_per_node']:.1f} "
            f"| {m['stall_producer_ms']:.1f} / {m['stall_consumer_ms']:.1f} | {m['max_graft_step_ms']:.1f} "
            f"| {m['consumer_base_mib']:.0f} / {m['consumer_peak_mib']:.0f} / {m['consumer_final_mib']:.0f} "
            f"| {m['rss_ratio']:.2f}x |"
        )
    print("\n## Longest live-event stall per phase, ms (median over runs): where the writer was held")
    for sh, _m in meds:
        keys = sh.runs[0].stalls_by_phase
        cells = [f"{k} {statistics.median(r.stalls_by_phase.get(k, 0.0) for r in sh.runs):.1f}" for k in keys]
        print(f"  {sh.nodes}: " + ", ".join(cells))
    print("\n## Goals (issue 17): value, goal, verdict")
    for sh, m in meds:
        name = "captured shape" if (sh.nodes, sh.block_size, sh.engines) == CAPTURED else f"{sh.nodes} nodes"
        goal = GOAL_TOTAL_S.get(sh.nodes)
        if goal is not None:
            print(f"  {name}: total {m['total_s']:.3f} s (goal <= {goal} s): {_verdict(m['total_s'], goal)}")
        stall = max(m["stall_producer_ms"], m["stall_consumer_ms"])
        print(
            f"  {name}: longest live-event stall {stall:.1f} ms (goal <= {GOAL_STALL_MS} ms):"
            f" {_verdict(stall, GOAL_STALL_MS)}"
        )
        print(
            f"  {name}: consumer peak RSS growth / finished index {m['rss_ratio']:.2f}x"
            f" (goal <= {GOAL_RSS_RATIO}x): {_verdict(m['rss_ratio'], GOAL_RSS_RATIO)}"
        )
        print(
            f"  {name}: {m['wire_bytes_per_node']:.1f} bytes/node on the wire (goal <= {GOAL_WIRE_BYTES}):"
            f" {_verdict(m['wire_bytes_per_node'], GOAL_WIRE_BYTES)}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{**asdict(sh), "median": m} for sh, m in meds], f, indent=1)


if __name__ == "__main__":
    main()
