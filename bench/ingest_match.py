"""Ingestion and match benchmark: our radix index against Dynamo's Rust ``RadixTree``, in one process.

Run ``python -m bench.ingest_match`` (``--quick`` for a smoke run, ``--runs N``, ``--help``).

Workload. A synthetic but engine-shaped KV event stream, rendered with our own vLLM 0.33 encoder
(``encode_batch``), so both sides parse the same msgpack bytes:

- 4 engines x 2 DP ranks = 8 carriers, block size 16, token ids in a 128k vocabulary;
- 24 system prompts of 32-160 blocks (0.5k-2.5k tokens), shared by many conversations (Zipf-ish);
- multi-turn conversations, mostly sticky to one carrier (10% of requests go elsewhere): a request
  stores the uncached part of its prompt as one chained ``BlockStored`` (parent = last cached block,
  or none from the root), then one 1-block ``BlockStored`` per generated block, as vLLM does per step;
- each carrier has a block budget (target index size / 8); past it the least recently used
  conversation loses its tail blocks (``BlockRemoved``), so the stream has stores and removes mixed;
- events are grouped into batches of 4-16 events, as a scheduler step publishes them.

Engine block hashes are xxh3 chains with one deployment-wide seed (opaque u64s to the router), so
the same content has the same engine hash on every carrier, as vLLM gives with a fixed
PYTHONHASHSEED; Dynamo's tree needs that (our index does not).

What is timed (see ``bench/README.md`` for how to read it):

1. Ingestion, block events/s (stored + removed blocks per second; higher is better):
   ours = ``decode(payload)`` (the native decoder) + ``RadixIndex.apply_batch``, the router's real hot
   path.
   Dynamo's Python binding takes one JSON ``KvCacheEvent`` per ``apply_event`` call, not vLLM
   msgpack, so two figures are given for it:
   (a) same bytes: ``msgpack.unpackb`` of the same payload, ``compute_block_hash_for_seq`` (Rust) for
       each store's local block hashes, ``json.dumps`` and ``RadixTree.apply_event`` per event. This is
       what a Python router driving Dynamo's tree from the same wire pays; the Python glue is included.
   (b) apply only: the same JSON events prepared beforehand; only ``apply_event`` (serde_json parse +
       tree update in Rust) is timed. In Dynamo proper the msgpack decode and the local hashing run in
       the worker-side publisher, so (b) is the closest to Dynamo's router-side cost per event.
2. Match latency, microseconds (lower is better) for a 4,096-token prompt (256 blocks of 16), on
   indexes built by the stream above: ours ``index.match(token_ids)`` (hashes the tokens, then walks);
   Dynamo ``tree.find_matches(compute_block_hash_for_seq(token_ids, 16)).scores``. Prompts either hit
   deep (a cached conversation, most of the 256 blocks held) or miss early (a system prompt's first
   1-4 blocks then fresh tokens, or fresh tokens from the first block). Both answers are compared.
3. RSS per million held blocks (MiB, lower is better), each side in a fresh subprocess: RSS after
   ingesting the largest stream minus RSS before (payloads already loaded, empty index built).
4. GC and fleet rows (ours only), from ``bench.scale`` in a fresh subprocess: one full ``gc.collect()``
   with an empty index and with ``--gc-blocks`` held; a 128-carrier index of ``--fleet-blocks`` under a
   live 50k block events/s stream with matches on the same asyncio loop (match p50/p99, writer lag).

Last, the goals of issue 17, each as our ratio against its bound, and whether we are short of it.

The process pins itself to one CPU unless ``--no-pin`` (see ``main``), and waits for the process to
go idle before each timed phase.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import msgpack
import xxhash

from router_runtime.kv.decode import decode
from router_runtime.kv.encode import encode_batch
from router_runtime.kv.events import BlockRemoved, BlockStored, DecodeStats, Dialect, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.worker import Carrier

from . import scale as bench_scale

BLOCK = 16
VOCAB = 128_256
PROMPT_BLOCKS = 256  # 4,096 tokens
ENGINES = 4
RANKS = 2
SYS_PROMPTS = 24

_xxh = xxhash.xxh3_64_intdigest

# ---------------------------------------------------------------------------------------------------
# Workload


@dataclass
class Workload:
    size: int  # target held blocks (sum over carriers)
    batches: list[tuple[int, int, bytes]]  # (engine, rank, vLLM 0.33 payload), in stream order
    stored_blocks: int
    removed_blocks: int
    store_events: int
    remove_events: int
    held: int  # blocks held at the end, summed over carriers (what the engines report)
    payload_bytes: int
    deep: list[list[int]] = field(default_factory=list)  # 4,096-token prompts that hit deep
    miss: list[list[int]] = field(default_factory=list)  # prompts that miss early

    @property
    def block_events(self) -> int:
        return self.stored_blocks + self.removed_blocks


class _Conv:
    __slots__ = ("blocks", "cid", "done", "group", "home", "on", "turns_left")

    def __init__(self, cid: int, group: int, home: int, turns: int) -> None:
        self.cid = cid
        self.group = group
        self.home = home
        self.turns_left = turns
        self.blocks: list[bytes] = []  # token blocks after the system prompt, u32 LE
        self.on: set[int] = set()  # carriers that hold some of it
        self.done = False


class _CarrierSim:
    __slots__ = ("capacity", "conv_hashes", "engine", "events", "held", "lru", "rank", "seed", "sys_hashes")

    def __init__(self, engine: int, rank: int, capacity: int) -> None:
        self.engine = engine
        self.rank = rank
        self.capacity = capacity
        # One deployment-wide seed, as vLLM with a fixed PYTHONHASHSEED (what Dynamo's docs require):
        # the same content gets the same engine hash on every carrier. Dynamo's compressed tree keeps
        # one external hash per edge position, so per-carrier seeds make its parent lookups fail.
        self.seed = _xxh(b"deployment-seed")
        self.sys_hashes: dict[int, list[int]] = {}  # group -> engine hashes; cached once, never evicted
        self.conv_hashes: dict[int, list[int]] = {}  # conv -> engine hashes of its blocks (chained)
        self.lru: OrderedDict[int, int] = OrderedDict()  # conv -> blocks held beyond the system prompt
        self.held = 0
        self.events: list[Any] = []


def _chain(blocks: list[bytes], start: int, seed: int, out: list[int]) -> None:
    parent = out[-1] if out else seed
    for b in blocks[start:]:
        parent = _xxh(b, seed=parent)
        out.append(parent)


def _tokens(blocks: list[bytes]) -> tuple[int, ...]:
    return tuple(array("I", b"".join(blocks)))


def build_workload(size: int, seed: int = 7, n_queries: int = 100) -> Workload:
    rng = random.Random(seed * 1_000_003 + size)

    def rand_block() -> bytes:
        a = array("I", rng.randbytes(BLOCK * 4))
        return array("I", [x % VOCAB for x in a]).tobytes()

    sys_blocks = [[rand_block() for _ in range(rng.randint(32, 160))] for _ in range(SYS_PROMPTS)]
    group_weights = [1.0 / (g + 1) for g in range(SYS_PROMPTS)]
    n_carriers = ENGINES * RANKS
    carriers = [_CarrierSim(e, r, size // n_carriers) for e in range(ENGINES) for r in range(RANKS)]
    # Enough live conversations that the budgets overflow: ~1.6x what fits, at ~250 blocks each.
    live_target = max(16, int(size * 1.6 / 250))
    convs: dict[int, _Conv] = {}
    next_cid = itertools.count()

    def new_conv() -> _Conv:
        c = _Conv(
            next(next_cid),
            rng.choices(range(SYS_PROMPTS), group_weights)[0],
            rng.randrange(n_carriers),
            rng.randint(1, 12),
        )
        convs[c.cid] = c
        return c

    live = [new_conv() for _ in range(live_target)]
    batches: list[tuple[int, int, bytes]] = []
    stats = {"stored": 0, "removed": 0, "se": 0, "re": 0, "bytes": 0}
    ts = 1_700_000_000.0

    def flush(cs: _CarrierSim, force: bool) -> None:
        nonlocal ts
        while cs.events and (force or len(cs.events) >= 16):
            k = min(len(cs.events), rng.randint(4, 16))
            evs, cs.events = cs.events[:k], cs.events[k:]
            ts += 0.001
            payload = encode_batch(Dialect.VLLM_033, EventBatch(ts, tuple(evs), cs.rank))
            batches.append((cs.engine, cs.rank, payload))
            stats["bytes"] += len(payload)

    def drop_if_dead(conv: _Conv) -> None:
        if conv.done and not conv.on:
            del convs[conv.cid]

    def request(conv: _Conv, ci: int) -> None:
        cs = carriers[ci]
        g = conv.group
        sysb = sys_blocks[g]
        user = [rand_block() for _ in range(rng.randint(1, 12))]
        out = [rand_block() for _ in range(rng.randint(2, 32))]
        conv.blocks.extend(user)
        cached = cs.lru.pop(conv.cid, 0)
        hashes = cs.conv_hashes.setdefault(conv.cid, [])
        sys_h = cs.sys_hashes.get(g)
        new_blocks: list[bytes] = []
        new_hashes: list[int] = []
        if sys_h is None:
            sys_h = cs.sys_hashes[g] = []
            _chain(sysb, 0, cs.seed, sys_h)
            new_blocks += sysb
            new_hashes += sys_h
            parent = None
        else:
            parent = hashes[cached - 1] if cached else sys_h[-1]
        if not hashes:
            hashes.append(_xxh(conv.blocks[0], seed=sys_h[-1]))
        _chain(conv.blocks, len(hashes), 0, hashes)
        new_blocks += conv.blocks[cached:]
        new_hashes += hashes[cached:]
        cs.events.append(BlockStored(tuple(new_hashes), parent, _tokens(new_blocks), BLOCK, medium="GPU"))
        stats["se"] += 1
        stats["stored"] += len(new_hashes)
        cs.held += len(new_hashes)
        prev = hashes[-1]
        for b in out:  # decode: one full block at a time
            conv.blocks.append(b)
            h = _xxh(b, seed=prev)
            hashes.append(h)
            cs.events.append(BlockStored((h,), prev, _tokens([b]), BLOCK, medium="GPU"))
            prev = h
        stats["se"] += len(out)
        stats["stored"] += len(out)
        cs.held += len(out)
        cs.lru[conv.cid] = len(conv.blocks)
        conv.on.add(ci)
        # Evict least recently used conversation tails (never the system prompts) down to the budget.
        while cs.held > cs.capacity and len(cs.lru) > 1:
            vid, vheld = next(iter(cs.lru.items()))
            k = min(vheld, cs.held - cs.capacity)
            vh = cs.conv_hashes[vid]
            cs.events.append(BlockRemoved(tuple(reversed(vh[vheld - k : vheld])), medium="GPU"))
            stats["re"] += 1
            stats["removed"] += k
            cs.held -= k
            if k == vheld:
                del cs.lru[vid]
                del cs.conv_hashes[vid]
                victim = convs[vid]
                victim.on.discard(ci)
                drop_if_dead(victim)
            else:
                cs.lru[vid] = vheld - k
        flush(cs, False)

    total = int(size * 1.3)  # stored blocks: fill the budgets, then churn ~30% through eviction
    while stats["stored"] < total:
        i = rng.randrange(len(live))
        conv = live[i]
        ci = conv.home if rng.random() < 0.9 else rng.randrange(n_carriers)
        request(conv, ci)
        conv.turns_left -= 1
        if conv.turns_left <= 0 or len(conv.blocks) > 448:
            conv.done = True
            drop_if_dead(conv)
            live[i] = new_conv()
    for cs in carriers:
        flush(cs, True)

    # Queries against the final state. Deep: the most deeply held conversations, first 256 blocks
    # (padded with fresh blocks when shorter). Miss: a system prompt's first 0-4 blocks, then fresh.
    held_depth: dict[int, int] = {}
    for cs in carriers:
        for cid, n in cs.lru.items():
            d = len(sys_blocks[convs[cid].group]) + n
            held_depth[cid] = max(held_depth.get(cid, 0), d)
    deepest = sorted(held_depth, key=held_depth.__getitem__, reverse=True)[:n_queries]
    deep = []
    for cid in deepest:
        c = convs[cid]
        blocks = (sys_blocks[c.group] + c.blocks)[:PROMPT_BLOCKS]
        blocks += [rand_block() for _ in range(PROMPT_BLOCKS - len(blocks))]
        deep.append(list(_tokens(blocks)))
    miss = []
    for q in range(n_queries):
        keep = q % 5  # 0 = miss at the first block
        blocks = sys_blocks[q % SYS_PROMPTS][:keep]
        blocks = blocks + [rand_block() for _ in range(PROMPT_BLOCKS - keep)]
        miss.append(list(_tokens(blocks)))
    return Workload(
        size=size,
        batches=batches,
        stored_blocks=stats["stored"],
        removed_blocks=stats["removed"],
        store_events=stats["se"],
        remove_events=stats["re"],
        held=sum(cs.held for cs in carriers),
        payload_bytes=stats["bytes"],
        deep=deep,
        miss=miss,
    )


# ---------------------------------------------------------------------------------------------------
# Ours


def _settle(max_s: float = 10.0) -> None:
    """Wait until this process is idle before a timed phase: Dynamo's tree thread may still be freeing
    a dropped tree, which would steal one of the two cores from the next measurement."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        c0 = sum(os.times()[:2])
        time.sleep(0.05)
        if sum(os.times()[:2]) - c0 < 0.005:
            return


def _carriers() -> dict[tuple[int, int], Carrier]:
    return {(e, r): Carrier(f"engine-{e}", r) for e in range(ENGINES) for r in range(RANKS)}


def ingest_ours(wl: Workload) -> tuple[RadixIndex, float, float]:
    """Decode + apply every payload into a fresh index; returns (index, seconds, GC seconds)."""
    index = RadixIndex(BLOCK)
    carriers = _carriers()
    dstats = DecodeStats()
    gc_time = [0.0, 0.0]

    def on_gc(phase: str, _info: dict) -> None:
        if phase == "start":
            gc_time[1] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_time[1]

    gc.collect()
    _settle()
    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        for e, r, payload in wl.batches:
            index.apply_batch(carriers[e, r], decode(payload, dstats))
        dt = time.perf_counter() - t0
    finally:
        gc.callbacks.remove(on_gc)
    return index, dt, gc_time[0]


def ours_held(index: RadixIndex) -> int:
    return sum(sum(index.carrier_blocks(c).values()) for c in index.carriers)


# ---------------------------------------------------------------------------------------------------
# Dynamo


def dynamo_available() -> tuple[bool, str]:
    try:
        from dynamo.llm import RadixTree, compute_block_hash_for_seq  # noqa: F401
    except Exception as e:  # not installed, or its native module does not load here
        return False, f"{type(e).__name__}: {e}"
    try:
        version = metadata.version("ai-dynamo-runtime")
    except metadata.PackageNotFoundError:
        version = "?"
    return True, version


class DynamoGlue:
    """The same vLLM 0.33 msgpack bytes, turned into the JSON ``KvCacheEvent``s that
    ``dynamo.llm.RadixTree.apply_event(worker_id, bytes)`` deserializes (serde_json):
    ``{"event_id", "dp_rank", "data": {"stored": {"parent_hash", "blocks": [{"block_hash",
    "tokens_hash"}]}} | {"removed": {"block_hashes"}}}``. ``tokens_hash`` is Dynamo's local block hash
    (xxh3 of the block's tokens, unchained), from its own ``compute_block_hash_for_seq``."""

    def __init__(self) -> None:
        from dynamo.llm import compute_block_hash_for_seq

        self._local = compute_block_hash_for_seq
        self._event_ids: dict[tuple[int, int], int] = {}

    def events(self, engine: int, rank: int, payload: bytes) -> list[bytes]:
        _ts, raw, prank = msgpack.unpackb(payload, raw=False)
        dp = rank if prank is None else prank
        key = (engine, dp)
        eid = self._event_ids.get(key, 0)
        out = []
        dumps = json.dumps
        for ev in raw:
            kind = ev["type"]
            if kind == "BlockStored":
                local = self._local(ev["token_ids"], ev["block_size"])
                pairs = zip(ev["block_hashes"], local, strict=True)
                blocks = [{"block_hash": h, "tokens_hash": t} for h, t in pairs]
                data: dict[str, Any] = {"stored": {"parent_hash": ev["parent_block_hash"], "blocks": blocks}}
            elif kind == "BlockRemoved":
                data = {"removed": {"block_hashes": ev["block_hashes"]}}
            else:
                data = "cleared"  # type: ignore[assignment]
            out.append(dumps({"event_id": eid, "dp_rank": dp, "data": data}).encode())
            eid += 1
        self._event_ids[key] = eid
        return out


def _dynamo_sync(tree: Any) -> None:
    # RadixTree runs on its own thread; a read goes through the same queue, so it returns only after
    # every event sent before it was applied. Timings end after it.
    tree.find_matches([0])


def ingest_dynamo_same_bytes(wl: Workload) -> tuple[Any, float]:
    from dynamo.llm import RadixTree

    tree = RadixTree()
    glue = DynamoGlue()
    gc.collect()
    _settle()
    t0 = time.perf_counter()
    apply = tree.apply_event
    for e, r, payload in wl.batches:
        for ev in glue.events(e, r, payload):
            apply(e, ev)
    _dynamo_sync(tree)
    return tree, time.perf_counter() - t0


def dynamo_prepare(wl: Workload) -> list[tuple[int, bytes]]:
    glue = DynamoGlue()
    return [(e, ev) for e, r, payload in wl.batches for ev in glue.events(e, r, payload)]


def ingest_dynamo_apply_only(prepared: list[tuple[int, bytes]]) -> tuple[Any, float]:
    from dynamo.llm import RadixTree

    tree = RadixTree()
    gc.collect()
    _settle()
    apply = tree.apply_event
    t0 = time.perf_counter()
    for wid, ev in prepared:
        apply(wid, ev)
    _dynamo_sync(tree)
    return tree, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------
# Match


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def time_matches(
    index: RadixIndex, tree: Any | None, prompts: list[list[int]], reps: int
) -> tuple[list[float], list[float], int, float, float]:
    """Interleaved per-prompt timings (microseconds) for ours and Dynamo, the number of prompts on
    which the two answers differ, and the mean best matched depth on each side."""
    ours_t: list[float] = []
    dyn_t: list[float] = []
    mismatches = 0
    depth_ours = depth_dyn = 0.0
    clock = time.perf_counter_ns
    if tree is not None:
        from dynamo.llm import compute_block_hash_for_seq as local_hashes
    _settle()
    for p in prompts:  # warm-up and answer check
        mo = index.match(p)
        depth_ours += max((m.blocks for m in mo.values()), default=0)
        if tree is not None:
            md = tree.find_matches(local_hashes(p, BLOCK)).scores
            depth_dyn += max(md.values(), default=0)
            a = {(int(c.engine.rsplit("-", 1)[1]), c.rank): m.blocks for c, m in mo.items()}
            mismatches += a != dict(md)
    for _ in range(reps):
        for p in prompts:
            t0 = clock()
            index.match(p)
            ours_t.append((clock() - t0) / 1e3)
            if tree is not None:
                t0 = clock()
                tree.find_matches(local_hashes(p, BLOCK)).scores  # noqa: B018
                dyn_t.append((clock() - t0) / 1e3)
    n = max(len(prompts), 1)
    return ours_t, dyn_t, mismatches, depth_ours / n, depth_dyn / n


# ---------------------------------------------------------------------------------------------------
# RSS (fresh subprocesses)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(side: str, path: str) -> None:
    with open(path, "rb") as f:
        batches, size = pickle.load(f)
    wl = Workload(size, batches, 0, 0, 0, 0, 0, 0)
    if side == "ours":
        index = RadixIndex(BLOCK)
        carriers = _carriers()
        dstats = DecodeStats()
        gc.collect()
        before = _rss()
        for e, r, payload in batches:
            index.apply_batch(carriers[e, r], decode(payload, dstats))
        gc.collect()
        after = _rss()
        held, nodes = ours_held(index), index.node_count()
    else:
        from dynamo.llm import RadixTree

        tree = RadixTree()
        glue = DynamoGlue()
        _dynamo_sync(tree)
        gc.collect()
        before = _rss()
        for e, r, payload in wl.batches:
            for ev in glue.events(e, r, payload):
                tree.apply_event(e, ev)
        _dynamo_sync(tree)
        gc.collect()
        after = _rss()
        held, nodes = -1, -1
    print(json.dumps({"before": before, "after": after, "held": held, "nodes": nodes}))


def measure_rss(side: str, path: str) -> dict[str, int] | str:
    cmd = [sys.executable, "-m", "bench.ingest_match", "--rss-child", side, "--workload", path]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600)
    if p.returncode != 0:
        return f"child failed ({p.returncode}): {p.stderr.strip()[-300:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# Report


def _machine() -> str:
    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Linux {platform.release()}, Python {platform.python_version()}"


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs: list[float], fmt: str) -> str:
    if len(xs) < 2:
        return ""
    return f" ({format(min(xs), fmt)}-{format(max(xs), fmt)})"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def _k(n: float) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ingest_match", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small indexes (20k, 100k blocks): a smoke run")
    ap.add_argument("--runs", type=int, default=3, help="timed runs; medians are reported (default 3)")
    ap.add_argument("--sizes", help="comma-separated index sizes in held blocks (default 100000,1000000)")
    ap.add_argument("--queries", type=int, help="prompts per class (deep, miss) per size")
    ap.add_argument("--reps", type=int, help="timed passes over the prompts per run")
    ap.add_argument("--no-dynamo", action="store_true", help="ours only")
    ap.add_argument("--no-rss", action="store_true", help="skip the RSS subprocesses")
    ap.add_argument(
        "--no-pin",
        action="store_true",
        help="do not pin the process to one CPU (Dynamo's tree thread then wakes across cores: noisy)",
    )
    ap.add_argument("--gc-blocks", type=int, help="held blocks for the GC row (default 8M; --quick 1M)")
    ap.add_argument("--fleet-blocks", type=int, help="held blocks, fleet row (default 16M; --quick 1M)")
    ap.add_argument("--no-gc", action="store_true", help="skip the GC row")
    ap.add_argument("--no-fleet", action="store_true", help="skip the fleet row")
    ap.add_argument("--profile", action="store_true", help="cProfile our ingestion and match, then exit")
    ap.add_argument("--json", help="also write the raw figures to this file")
    ap.add_argument("--rss-child", choices=["ours", "dynamo"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.rss_child:
        rss_child(args.rss_child, args.workload)
        return 0

    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [20_000, 100_000] if args.quick else [100_000, 1_000_000]
    n_queries = args.queries or (30 if args.quick else 100)
    reps = args.reps or (3 if args.quick else 5)
    runs = max(1, args.runs)

    if args.no_dynamo:
        have_dynamo, dyn_note = False, "disabled (--no-dynamo)"
    else:
        have_dynamo, dyn_note = dynamo_available()
    pinned = "no (--no-pin)"
    if not args.no_pin and hasattr(os, "sched_setaffinity"):
        # One core for everything, both sides. Dynamo's binding hands every call to its tree thread
        # and waits; across two cores each hand-off is a cross-CPU wake-up, which on this VM costs
        # 5-20 us more and swings 3-5x with the neighbours' load. On one core it is cheap and stable,
        # so pinning gives Dynamo its best and steadiest figures (ours is single-threaded either way).
        cpu = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        pinned = f"CPU {cpu} (the RSS children inherit it)"
    t_start = time.perf_counter()

    print(f"# RouterFleet ingest/match bench, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"# {_machine()}")
    print(f"# ai-dynamo-runtime: {dyn_note if have_dynamo else 'NOT AVAILABLE: ' + dyn_note}")
    print(f"# runs={runs}: figures are medians, (min-max) over runs; pinned to {pinned}")

    workloads = {}
    for size in sizes:
        t0 = time.perf_counter()
        wl = build_workload(size, n_queries=n_queries)
        workloads[size] = wl
        print(
            f"# workload {_k(size)}: {len(wl.batches)} vLLM-0.33 payloads"
            f" ({wl.payload_bytes / 2**20:.0f} MiB),"
            f" {wl.store_events} BlockStored ({wl.stored_blocks} blocks),"
            f" {wl.remove_events} BlockRemoved ({wl.removed_blocks} blocks),"
            f" {wl.block_events / (wl.store_events + wl.remove_events):.1f} blocks/event,"
            f" {wl.held} held at the end; built in {time.perf_counter() - t0:.1f}s"
        )

    if args.profile:
        return profile(workloads[sizes[-1]])

    prepared = {s: dynamo_prepare(wl) for s, wl in workloads.items()} if have_dynamo else {}
    res: dict[int, dict[str, list[float]]] = {s: {} for s in sizes}
    info: dict[int, dict[str, Any]] = {s: {} for s in sizes}

    def add(size: int, key: str, v: float) -> None:
        res[size].setdefault(key, []).append(v)

    for run in range(runs):
        for size in sizes:
            wl = workloads[size]
            n = wl.block_events
            index, dt, gct = ingest_ours(wl)
            add(size, "ours_ingest", n / dt)
            add(size, "ours_gc_share", gct / dt)
            info[size]["nodes"] = index.node_count()
            t0 = time.perf_counter()
            gc.collect()
            add(size, "ours_full_gc_ms", (time.perf_counter() - t0) * 1e3)
            info[size]["held_ours"] = ours_held(index)
            tree = None
            if have_dynamo:
                tree_a, dt_a = ingest_dynamo_same_bytes(wl)
                add(size, "dyn_a", n / dt_a)
                del tree_a
                tree, dt_b = ingest_dynamo_apply_only(prepared[size])
                add(size, "dyn_b", n / dt_b)
            for cls, prompts in (("deep", wl.deep), ("miss", wl.miss)):
                ot, dt_, mism, d_o, d_d = time_matches(index, tree, prompts, reps)
                add(size, f"ours_{cls}_p50", _pct(ot, 50))
                add(size, f"ours_{cls}_p99", _pct(ot, 99))
                if dt_:
                    add(size, f"dyn_{cls}_p50", _pct(dt_, 50))
                    add(size, f"dyn_{cls}_p99", _pct(dt_, 99))
                info[size][f"{cls}_depth"] = (d_o, d_d)
                info[size][f"{cls}_mismatch"] = mism
            del index, tree
            gc.collect()
        print(f"# run {run + 1}/{runs} done at {time.perf_counter() - t_start:.0f}s", flush=True)

    rss: dict[str, list[dict[str, int]]] = {"ours": [], "dynamo": []}
    rss_err: dict[str, str] = {}
    big = workloads[sizes[-1]]
    if not args.no_rss:
        fd, path = tempfile.mkstemp(prefix="bench-ingest-", suffix=".pkl")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump((big.batches, big.size), f, protocol=pickle.HIGHEST_PROTOCOL)
            sides = ["ours", "dynamo"] if have_dynamo else ["ours"]
            for _ in range(1):  # deterministic to the MiB across runs: once is enough
                for side in sides:
                    r = measure_rss(side, path)
                    if isinstance(r, str):
                        rss_err[side] = r
                    else:
                        rss[side].append(r)
        finally:
            os.unlink(path)

    scale: dict[str, Any] = {}
    scale_err = ""
    if not (args.no_gc and args.no_fleet):
        scale, scale_err = run_scale(args, runs)

    # ---- table ---------------------------------------------------------------------------------
    print()
    dyn_hdr = "dynamo(a) same bytes | ours/(a) | dynamo(b) apply only | ours/(b)"
    print("## 1. Ingestion: decode + apply, block events/s (stored + removed blocks); HIGHER is better")
    print(f"{'index':>6} | {'ours':>22} | {dyn_hdr if have_dynamo else ''}")
    for size in sizes:
        r = res[size]
        o = _med(r["ours_ingest"])
        line = f"{_k(size):>6} | {o / 1e3:7.0f}k{_spread([x / 1e3 for x in r['ours_ingest']], '.0f'):>14}"
        if have_dynamo:
            a, b = _med(r["dyn_a"]), _med(r["dyn_b"])
            line += (
                f" | {a / 1e3:7.0f}k{_spread([x / 1e3 for x in r['dyn_a']], '.0f'):>12} | {_ratio(o, a):>8}"
                f" | {b / 1e3:7.0f}k{_spread([x / 1e3 for x in r['dyn_b']], '.0f'):>12} | {_ratio(o, b):>8}"
            )
        print(line)
    for size in sizes:
        print(
            f"  {_k(size)}: our GC share of ingest time {_med(res[size]['ours_gc_share']) * 100:.0f}%,"
            f" one full gc.collect() with the index alive {_med(res[size]['ours_full_gc_ms']):.0f} ms;"
            f" {info[size]['nodes']} trie nodes for {info[size]['held_ours']} held blocks"
        )
    if have_dynamo:
        print("  ratio ours/dynamo > 1 means ours ingests faster.")
    print()
    print("## 2. match() latency, 4,096-token prompt (256 blocks), microseconds; LOWER is better")
    print(f"{'index':>6} {'prompts':>8} | {'ours p50':>9} {'ours p99':>9} | ", end="")
    print(f"{'dyn p50':>9} {'dyn p99':>9} | {'ours/dyn p50':>12} {'ours/dyn p99':>12} | depth ours/dyn, diff")
    for size in sizes:
        r = res[size]
        for cls in ("deep", "miss"):
            o50, o99 = _med(r[f"ours_{cls}_p50"]), _med(r[f"ours_{cls}_p99"])
            line = f"{_k(size):>6} {cls:>8} | {o50:9.1f} {o99:9.1f} | "
            if have_dynamo:
                d50, d99 = _med(r[f"dyn_{cls}_p50"]), _med(r[f"dyn_{cls}_p99"])
                d_o, d_d = info[size][f"{cls}_depth"]
                line += f"{d50:9.1f} {d99:9.1f} | {_ratio(o50, d50):>12} {_ratio(o99, d99):>12} |"
                line += f" {d_o:.0f}/{d_d:.0f} blocks, {info[size][f'{cls}_mismatch']} differ"
            else:
                depth = info[size][f"{cls}_depth"][0]
                line += f"{'-':>9} {'-':>9} | {'-':>12} {'-':>12} | {depth:.0f} blocks"
            print(line)
    if have_dynamo:
        print("  ratio ours/dynamo < 1 means ours answers faster.")
    print("  deep = a held conversation (best matched depth near 256);")
    print("  miss = a system prompt's first 0-4 blocks, then fresh tokens.")
    if have_dynamo:
        print("  differ = prompts whose per-carrier matched depths differ between the sides (should be 0).")
    print()
    print(f"## 3. RSS per million held blocks, {_k(big.size)}-block stream, fresh subprocess;", end="")
    print(" LOWER is better")
    per_m: dict[str, float] = {}
    for side in ("ours", "dynamo"):
        if rss[side]:
            held = big.held
            vals = [(x["after"] - x["before"]) / 2**20 * 1e6 / held for x in rss[side]]
            per_m[side] = _med(vals)
            extra = ""
            if side == "ours":
                x = rss[side][0]
                extra = f"; {x['nodes']} nodes, {(x['after'] - x['before']) / x['nodes']:.0f} B/node"
            print(f"  {side:>6}: {per_m[side]:6.0f} MiB per 1M held blocks{_spread(vals, '.0f')}{extra}")
        elif side in rss_err:
            print(f"  {side:>6}: not measured: {rss_err[side]}")
    if "ours" in per_m and "dynamo" in per_m:
        print(f"  ratio ours/dynamo: {_ratio(per_m['ours'], per_m['dynamo'])} (< 1 means ours is smaller)")
    print()
    if scale_err:
        print(f"## 4. GC and fleet rows: not measured: {scale_err}")
    if "gc" in scale:
        bench_scale.print_gc(bench_scale.GcRow(**scale["gc"]), "## 4.")
    if "fleet" in scale:
        f = dict(scale["fleet"], passes=[bench_scale.StreamPass(**p) for p in scale["fleet"]["passes"]])
        bench_scale.print_fleet(bench_scale.FleetRow(**f), "## 5.")
    print()
    print_goals(sizes, res, per_m, scale, have_dynamo)
    print(f"\n# total {time.perf_counter() - t_start:.0f}s")

    if args.json:
        with open(args.json, "w") as f:
            doc = {"sizes": sizes, "results": res, "info": info, "rss": rss, "scale": scale}
            json.dump(doc, f, indent=1, default=str)
    return 0


def run_scale(args: argparse.Namespace, runs: int) -> tuple[dict[str, Any], str]:
    """The GC and fleet rows, from ``bench.scale`` in a fresh process: a collection there sees only the
    index, not this process's workloads and Dynamo trees, and the fleet's RAM is returned after."""
    cmd = [sys.executable, "-m", "bench.scale", "--json", "-", "--runs", str(runs)]
    cmd += ["--quick"] if args.quick else []
    cmd += ["--gc-blocks", str(args.gc_blocks)] if args.gc_blocks else []
    cmd += ["--fleet-blocks", str(args.fleet_blocks)] if args.fleet_blocks else []
    cmd += ["--no-gc"] if args.no_gc else []
    cmd += ["--no-fleet"] if args.no_fleet else []
    cmd += ["--no-pin"] if args.no_pin else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    print(f"# GC/fleet rows: {' '.join(cmd[1:])}", flush=True)
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=3600)
    if p.returncode != 0:
        return {}, f"bench.scale failed ({p.returncode}): {p.stderr.strip()[-300:]}"
    return json.loads(p.stdout.strip().splitlines()[-1]), ""


# Issue 17 asks for a GC pause "as long as with an empty index"; a few-ms collection swings by a
# quarter between medians on this shared VM, so "as long as" is read as within this factor.
GC_TOLERANCE = 1.25


def _verdict(ratio: float, bound: float, higher_better: bool) -> str:
    if ratio != ratio:  # nan: one side missing
        return "not measured"
    if (ratio >= bound) if higher_better else (ratio <= bound):
        return "MET"
    short = bound / ratio if higher_better else ratio / bound
    return f"SHORT by {short:.3f}x" if short < 1.1 else f"SHORT by {short:.2f}x"


def print_goals(
    sizes: list[int], res: dict[int, dict[str, list[float]]], per_m: dict[str, float], scale: dict, dyn: bool
) -> None:
    big = sizes[-1]
    at = _k(big) + ("" if big == 1_000_000 else ", the issue names 1M")
    rows: list[tuple[str, float, str, float, bool]] = []  # what, ratio, bound text, bound, higher better
    nan = float("nan")

    def ratio(a: str, b: str) -> float:
        r = res[big]
        return _med(r[a]) / _med(r[b]) if dyn and r.get(a) and r.get(b) else nan

    what = f"ingest, decode + apply vs Dynamo apply-only ({at})"
    rows.append((what, ratio("ours_ingest", "dyn_b"), ">=", 2.0, True))
    for p in ("p50", "p99"):
        what = f"deep match {p}, hashing included, vs Dynamo find_matches ({_k(big)})"
        rows.append((what, ratio(f"ours_deep_{p}", f"dyn_deep_{p}"), "<=", 0.5, False))
    rss = per_m["ours"] / per_m["dynamo"] if "ours" in per_m and "dynamo" in per_m else nan
    rows.append(("RSS per million held blocks vs Dynamo", rss, "<=", 0.6, False))
    if "gc" in scale:
        g = scale["gc"]
        what = f"full gc.collect(), {_k(g['blocks'])} held vs empty index"
        rows.append((what, g["held_ms"] / g["empty_ms"], "<=", GC_TOLERANCE, False))
    print("## Goals (issue 17): our ratio, the bound, the verdict")
    for what, r, op, bound, hb in rows:
        print(f"  {what:<72} {r:6.2f}x  (goal {op} {bound}x)  {_verdict(r, bound, hb)}")
    if "gc" in scale:
        print(f"  (GC goal: 'as long as with an empty index'; {GC_TOLERANCE}x allows for this VM's noise)")


def profile(wl: Workload) -> int:
    import cProfile
    import pstats

    print(f"\n## cProfile: our ingestion of the {_k(wl.size)} stream")
    pr = cProfile.Profile()
    pr.enable()
    index, _, _ = ingest_ours(wl)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    print(f"## cProfile: 20 x {len(wl.deep)} deep matches")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        for p in wl.deep:
            index.match(p)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
