"""Scale rows of issue 17: a full GC pause with a large index held, and a fleet-sized index under a live
event stream. Ours only (Dynamo's tree has no Python-visible GC cost and no asyncio writer).

    python -m bench.scale                      # GC at 8M held blocks, fleet at 16M, 3 stream passes
    python -m bench.scale --quick              # GC at 1M, fleet at 1M, short passes
    python -m bench.scale --gc-blocks 8000000 --fleet-blocks 4000000 --no-gc --json out.json

``bench.ingest_match`` runs this in a fresh subprocess and prints its rows with the goals, so the
collector here sees the index and nothing of the ingest bench's workloads.

1. GC. ``gc.collect()`` (full, all generations), median of several, with an empty ``RadixIndex`` and
   again after synthetic ``BlockStored`` chains (512 blocks per event, block size 16) brought it to
   ``--gc-blocks`` held blocks. Goal: the same pause either way (the index holds no GC-tracked objects).
2. Fleet. 64 engines x 2 DP ranks (128 carriers), ``--fleet-blocks`` held blocks (16 system prompts of
   64 blocks, each carrier holding two, then 448-block conversations off them; built with synthetic
   events). Then, on one asyncio loop in one thread as the router runs it, a writer task applies a live
   stream of vLLM 0.33 payloads at ``--rate`` block events/s (``decode`` + ``apply_batch``, then a
   yield, as the index writer does); the stream opens conversations (a 16-128 block prompt store), extends
   recent ones block by block (1-block decode stores) and evicts the oldest tails (``BlockRemoved``) so
   each carrier stays at its budget. A reader task runs ``match`` on 4,096-token deep prompts at
   ``--match-rate`` per second on the same loop. Reported: the match call p50/p99 during the stream (and
   on the quiet index for contrast), the match latency counted from when it was due (what a request
   waits behind a writer batch), and the writer's lag behind the stream's schedule (a batch's apply end
   minus the time it was due), p99 and max. Both tasks spin on ``asyncio.sleep(0)`` for the last 2 ms
   before a deadline: the loop's timers are rounded up to the millisecond, which would show up as lag.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import statistics
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field

from router_runtime.kv.decode import decode
from router_runtime.kv.encode import encode_batch
from router_runtime.kv.events import BlockRemoved, BlockStored, DecodeStats, Dialect, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.worker import Carrier

BLOCK = 16
CHAIN = 512  # blocks per synthetic store event for the GC build
ENGINES = 64
RANKS = 2
SYS_PROMPTS = 16
SYS_BLOCKS = 64
CONV_BLOCKS = 448  # a built conversation: with its system prompt, 512 blocks
PROMPT_BLOCKS = 256  # 4,096 tokens
SYS_TOKEN_BASE = 2_000_000_000  # system prompt tokens; conversation tokens are 16 x engine hash (< 2**31)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def _block_tokens(h: int) -> range:
    # A conversation block's tokens follow from its engine hash, so a prompt can be rebuilt from the
    # hashes alone (no token lists kept per conversation).
    return range(h * BLOCK, (h + 1) * BLOCK)


# ---------------------------------------------------------------------------------------------------
# 1. GC


@dataclass(slots=True)
class GcRow:
    blocks: int  # held blocks after the build
    nodes: int
    collects: int  # collections timed per state
    empty_ms: float  # median full collection, empty index
    held_ms: float  # median full collection, index holding ``blocks``
    empty_all: list[float] = field(default_factory=list)
    held_all: list[float] = field(default_factory=list)
    build_s: float = 0.0
    rss_mib: float = 0.0  # process RSS with the index held
    tracked: int = 0  # GC-tracked objects in the process with the index held


def _time_collects(n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def gc_row(blocks: int, collects: int = 9) -> GcRow:
    index = RadixIndex(BLOCK)
    carriers = [Carrier(f"engine-{e}", r) for e in range(4) for r in range(2)]
    gc.collect()
    empty = _time_collects(collects)
    t0 = time.perf_counter()
    h = 1
    made = 0
    while made < blocks:
        n = min(CHAIN, blocks - made)
        ev = BlockStored(tuple(range(h, h + n)), None, tuple(range(h * BLOCK, (h + n) * BLOCK)), BLOCK)
        index.apply_batch(carriers[(made // CHAIN) % len(carriers)], EventBatch(0.0, (ev,)))
        h += n
        made += n
    build_s = time.perf_counter() - t0
    del ev
    gc.collect()
    held = _time_collects(collects)
    return GcRow(
        blocks=made,
        nodes=index.node_count(),
        collects=collects,
        empty_ms=statistics.median(empty),
        held_ms=statistics.median(held),
        empty_all=empty,
        held_all=held,
        build_s=build_s,
        rss_mib=_rss_mib(),
        tracked=len(gc.get_objects()),
    )


# ---------------------------------------------------------------------------------------------------
# 2. Fleet


class _Conv:
    __slots__ = ("alive", "base", "n", "room")

    def __init__(self, base: int, n: int, room: int) -> None:
        self.base = base  # engine hash of its first block; block i has hash base + i
        self.n = n  # blocks held
        self.room = room  # hashes reserved for it (decode growth)
        self.alive = True


class _Fleet:
    """The fleet's state as the engines hold it: per carrier a system prompt pair (its own engine
    hashes, shared tokens) and its conversations, oldest first."""

    def __init__(self, blocks: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.carriers = [Carrier(f"engine-{e}", r) for e in range(ENGINES) for r in range(RANKS)]
        self.capacity = max(SYS_BLOCKS * 2 + CONV_BLOCKS, blocks // len(self.carriers))
        self.next_hash = 1
        self.sys: list[dict[int, int]] = []  # carrier -> {system prompt: engine hash of its last block}
        self.convs: list[deque[_Conv]] = []
        self.recent: list[list[_Conv]] = []  # carrier -> conversations the stream opened (decode targets)
        self.conv_sys: dict[int, int] = {}  # conversation base -> its system prompt
        self.held = [0] * len(self.carriers)

    def hashes(self, n: int) -> int:
        h = self.next_hash
        self.next_hash += n
        return h

    def sys_store(self, ci: int, s: int) -> BlockStored:
        h = self.hashes(SYS_BLOCKS)
        self.sys[ci][s] = h + SYS_BLOCKS - 1
        self.held[ci] += SYS_BLOCKS
        toks = range(SYS_TOKEN_BASE + s * SYS_BLOCKS * BLOCK, SYS_TOKEN_BASE + (s + 1) * SYS_BLOCKS * BLOCK)
        return BlockStored(tuple(range(h, h + SYS_BLOCKS)), None, tuple(toks), BLOCK, medium="GPU")

    def open_conv(self, ci: int, n: int, room: int) -> BlockStored:
        s = self.rng.choice(list(self.sys[ci]))
        base = self.hashes(room)
        conv = _Conv(base, n, room)
        self.convs[ci].append(conv)
        self.conv_sys[base] = s
        self.held[ci] += n
        toks = tuple(range(base * BLOCK, (base + n) * BLOCK))
        return BlockStored(tuple(range(base, base + n)), self.sys[ci][s], toks, BLOCK, medium="GPU")

    def evict(self, ci: int) -> list[BlockRemoved]:
        out = []
        q = self.convs[ci]
        while self.held[ci] > self.capacity and q:
            conv = q[0]
            k = min(conv.n, self.held[ci] - self.capacity)
            tail = range(conv.base + conv.n - 1, conv.base + conv.n - 1 - k, -1)
            out.append(BlockRemoved(tuple(tail), medium="GPU"))
            conv.n -= k
            self.held[ci] -= k
            if conv.n == 0:
                conv.alive = False
                q.popleft()
        return out

    def prompt(self, ci: int, conv: _Conv) -> list[int]:
        first = SYS_TOKEN_BASE + self.conv_sys[conv.base] * SYS_BLOCKS * BLOCK
        toks = list(range(first, first + SYS_BLOCKS * BLOCK))
        toks += range(conv.base * BLOCK, (conv.base + PROMPT_BLOCKS - SYS_BLOCKS) * BLOCK)
        return toks


def build_fleet(blocks: int, seed: int = 11) -> tuple[RadixIndex, _Fleet, float]:
    fleet = _Fleet(blocks, seed)
    index = RadixIndex(BLOCK)
    t0 = time.perf_counter()
    for ci, carrier in enumerate(fleet.carriers):
        fleet.sys.append({})
        fleet.convs.append(deque())
        fleet.recent.append([])
        first = ci % SYS_PROMPTS
        events: list = [fleet.sys_store(ci, first), fleet.sys_store(ci, (first + 5) % SYS_PROMPTS)]
        while fleet.held[ci] + CONV_BLOCKS <= fleet.capacity:
            events.append(fleet.open_conv(ci, CONV_BLOCKS, CONV_BLOCKS))
            if len(events) >= 16:
                index.apply_batch(carrier, EventBatch(0.0, tuple(events)))
                events = []
        if events:
            index.apply_batch(carrier, EventBatch(0.0, tuple(events)))
    return index, fleet, time.perf_counter() - t0


Stream = list[tuple[int, bytes, float, int]]


def make_stream(fleet: _Fleet, rate: float, seconds: float) -> Stream:
    """(carrier, vLLM 0.33 payload, due second, block events) for ``seconds`` at ``rate`` block events/s."""
    rng = fleet.rng
    out: Stream = []
    done = 0  # block events so far
    total = rate * seconds
    ts = 1_800_000_000.0
    while done < total:
        ci = rng.randrange(len(fleet.carriers))
        events: list = []
        if rng.random() < 0.3 or not fleet.recent[ci]:
            n = rng.randint(16, 128)
            events.append(fleet.open_conv(ci, n, n + 512))
            fleet.recent[ci].append(fleet.convs[ci][-1])
            del fleet.recent[ci][:-16]
        for conv in rng.sample(fleet.recent[ci], min(len(fleet.recent[ci]), rng.randint(1, 8))):
            if conv.alive and conv.n < conv.room:
                h = conv.base + conv.n
                events.append(BlockStored((h,), h - 1, tuple(_block_tokens(h)), BLOCK, medium="GPU"))
                conv.n += 1
                fleet.held[ci] += 1
        events += fleet.evict(ci)
        blocks = sum(len(ev.block_hashes) for ev in events)
        ts += 0.001
        payload = encode_batch(Dialect.VLLM_033, EventBatch(ts, tuple(events), fleet.carriers[ci].rank))
        out.append((ci, payload, done / rate, blocks))
        done += blocks
    return out


@dataclass(slots=True)
class StreamPass:
    seconds: float
    block_events: int
    batches: int
    achieved_rate: float  # block events/s actually applied over the pass
    matches: int
    match_p50_us: float  # the match call itself
    match_p99_us: float
    waited_p50_us: float  # from the time the match was due to its answer (includes waiting on the writer)
    waited_p99_us: float
    lag_p99_ms: float  # writer: a batch's apply end minus its due time
    lag_max_ms: float
    apply_p99_us: float  # one batch: decode + apply
    apply_max_us: float
    busy: float  # share of the pass the writer spent in decode + apply
    # The loop spins for the last 2 ms before each deadline, so it sleeps only across longer gaps: many
    # involuntary switches mean the machine took the core away, and the lag is not ours.
    on_cpu: float = 0.0
    preempted: int = 0  # involuntary context switches during the pass


@dataclass(slots=True)
class FleetRow:
    carriers: int
    blocks: int  # held blocks after the build (sum over carriers)
    nodes: int
    build_s: float
    rss_mib: float
    rate: float
    match_rate: float
    quiet_p50_us: float  # match on the idle index
    quiet_p99_us: float
    depth: float  # mean best matched depth of the deep prompts, blocks
    passes: list[StreamPass] = field(default_factory=list)


async def _until(loop: asyncio.AbstractEventLoop, due: float) -> None:
    wait = due - loop.time()
    if wait > 0.002:
        await asyncio.sleep(wait - 0.002)
    while loop.time() < due:
        await asyncio.sleep(0)


async def _stream_pass(
    index: RadixIndex, fleet: _Fleet, stream: Stream, prompts: list[list[int]], mrate: float
) -> StreamPass:
    loop = asyncio.get_running_loop()
    carriers = fleet.carriers
    dstats = DecodeStats()
    lags: list[float] = []
    applies: list[float] = []
    call_t: list[float] = []
    waited: list[float] = []
    seconds = stream[-1][2] if stream else 0.0
    running = True
    clock = time.perf_counter
    t0 = loop.time() + 0.01

    async def writer() -> None:
        nonlocal running
        for ci, payload, due, _blocks in stream:
            at = t0 + due
            if loop.time() < at:
                await _until(loop, at)
            s = clock()
            index.apply_batch(carriers[ci], decode(payload, dstats))
            e = clock()
            applies.append(e - s)
            lags.append(loop.time() - at)
            await asyncio.sleep(0)  # as the index writer: let readers in between batches
        running = False

    async def reader() -> None:
        k = 0
        while running:
            at = t0 + k / mrate
            await _until(loop, at)
            p = prompts[k % len(prompts)]
            s = clock()
            index.match(p)
            e = clock()
            call_t.append((e - s) * 1e6)
            waited.append((loop.time() - at) * 1e6)
            k += 1

    start = clock()
    cpu0, ru0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
    await asyncio.gather(writer(), reader())
    wall = clock() - start
    cpu, preempted = time.process_time() - cpu0, resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - ru0
    n = sum(blocks for *_, blocks in stream)
    return StreamPass(
        seconds=seconds,
        block_events=n,
        batches=len(stream),
        achieved_rate=n / wall if wall else 0.0,
        matches=len(call_t),
        match_p50_us=_pct(call_t, 50),
        match_p99_us=_pct(call_t, 99),
        waited_p50_us=_pct(waited, 50),
        waited_p99_us=_pct(waited, 99),
        lag_p99_ms=_pct(lags, 99) * 1e3,
        lag_max_ms=max(lags, default=0.0) * 1e3,
        apply_p99_us=_pct(applies, 99) * 1e6,
        apply_max_us=max(applies, default=0.0) * 1e6,
        busy=sum(applies) / wall if wall else 0.0,
        on_cpu=cpu / wall if wall else 0.0,
        preempted=preempted,
    )


def fleet_row(blocks: int, rate: float, seconds: float, passes: int, mrate: float) -> FleetRow:
    index, fleet, build_s = build_fleet(blocks)
    gc.collect()
    # Deep prompts: the newest built conversation of each carrier (the stream evicts the oldest first).
    picks = [(ci, q[-1]) for ci, q in enumerate(fleet.convs) if q][:200]
    prompts = [fleet.prompt(ci, conv) for ci, conv in picks]
    depth = statistics.mean(max((m.blocks for m in index.match(p).values()), default=0) for p in prompts)
    quiet = []
    for _ in range(5):
        for p in prompts:
            t = time.perf_counter()
            index.match(p)
            quiet.append((time.perf_counter() - t) * 1e6)
    row = FleetRow(
        carriers=len(fleet.carriers),
        blocks=sum(fleet.held),
        nodes=index.node_count(),
        build_s=build_s,
        rss_mib=_rss_mib(),
        rate=rate,
        match_rate=mrate,
        quiet_p50_us=_pct(quiet, 50),
        quiet_p99_us=_pct(quiet, 99),
        depth=depth,
    )
    for _ in range(passes):
        stream = make_stream(fleet, rate, seconds)
        gc.collect()
        row.passes.append(asyncio.run(_stream_pass(index, fleet, stream, prompts, mrate)))
        del stream
    return row


# ---------------------------------------------------------------------------------------------------
# Report


def _k(n: float) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def print_gc(g: GcRow, head: str = "##") -> None:
    print(f"{head} GC: one full gc.collect(), median of {g.collects}, ms; LOWER is better")
    print(
        f"  empty index {g.empty_ms:.2f} ms | {_k(g.blocks)} held blocks ({g.nodes} nodes) {g.held_ms:.2f} ms"
        f" | held/empty {g.held_ms / g.empty_ms:.2f}x"
    )
    print(
        f"  built in {g.build_s:.1f}s; process RSS {g.rss_mib:.0f} MiB, {g.tracked} GC-tracked objects"
        f" with the index held"
    )


def print_fleet(f: FleetRow, head: str = "##") -> None:
    print(
        f"{head} Fleet: {f.carriers} carriers ({ENGINES} engines x {RANKS} ranks),"
        f" {_k(f.blocks)} held blocks, {f.nodes} nodes, built in {f.build_s:.0f}s, RSS {f.rss_mib:.0f} MiB"
    )
    print(
        f"  stream {f.rate / 1e3:.0f}k block events/s (decode + apply, yield per batch), deep matches"
        f" {f.match_rate:.0f}/s on the same loop, {len(f.passes)} passes of"
        f" {_med([p.seconds for p in f.passes]):.0f}s; medians over passes"
    )
    ps = f.passes
    m = {k: _med([getattr(p, k) for p in ps]) for k in asdict(ps[0])} if ps else {}
    print(f"  match call, quiet index: p50 {f.quiet_p50_us:.0f} us, p99 {f.quiet_p99_us:.0f} us")
    if ps:
        print(
            f"  match call, during the stream: p50 {m['match_p50_us']:.0f} us,"
            f" p99 {m['match_p99_us']:.0f} us;"
            f" from its due time: p50 {m['waited_p50_us']:.0f} us, p99 {m['waited_p99_us']:.0f} us"
            f" (mean matched depth {f.depth:.0f} blocks)"
        )
        print(
            f"  writer lag behind the schedule: p99 {m['lag_p99_ms']:.2f} ms, max {m['lag_max_ms']:.2f} ms"
            f" (worst pass {max(p.lag_max_ms for p in ps):.2f} ms); one batch decode + apply p99"
            f" {m['apply_p99_us']:.0f} us, max {m['apply_max_us']:.0f} us;"
            f" writer busy {m['busy'] * 100:.0f}%;"
            f" applied {m['achieved_rate'] / 1e3:.0f}k block events/s"
        )
        print(
            f"  process on CPU {m['on_cpu'] * 100:.0f}% of the pass,"
            f" {m['preempted']:.0f} involuntary switches (if many: the machine took the core, and the lag)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1M-block GC and fleet rows, short passes")
    ap.add_argument("--gc-blocks", type=int, help="held blocks for the GC row (default 8M; --quick 1M)")
    ap.add_argument("--fleet-blocks", type=int, help="held blocks, fleet row (default 16M; --quick 1M)")
    ap.add_argument("--rate", type=float, default=50_000, help="live stream, block events/s (default 50k)")
    ap.add_argument("--match-rate", type=float, default=1000, help="deep matches/s during the stream")
    ap.add_argument("--seconds", type=float, help="seconds per stream pass (default 10; --quick 3)")
    ap.add_argument("--runs", type=int, default=3, help="stream passes (default 3)")
    ap.add_argument("--no-gc", action="store_true")
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--no-pin", action="store_true", help="do not pin to one CPU")
    ap.add_argument("--json", help="write the rows to this file ('-': stdout, one line, no table)")
    a = ap.parse_args(argv)
    if not a.no_pin and hasattr(os, "sched_setaffinity"):
        # One core, as bench.ingest_match: the loop is single-threaded, the pin only steadies it.
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    gc_blocks = a.gc_blocks or (1_000_000 if a.quick else 8_000_000)
    fleet_blocks = a.fleet_blocks or (1_000_000 if a.quick else 16_000_000)
    seconds = a.seconds or (3.0 if a.quick else 10.0)
    out: dict = {}
    table = a.json != "-"
    if not a.no_gc:
        g = gc_row(gc_blocks)
        out["gc"] = asdict(g)
        if table:
            print_gc(g)
        gc.collect()
    if not a.no_fleet:
        f = fleet_row(fleet_blocks, a.rate, seconds, max(1, a.runs), a.match_rate)
        out["fleet"] = asdict(f)
        if table:
            print_fleet(f)
    if a.json == "-":
        print(json.dumps(out))
    elif a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
