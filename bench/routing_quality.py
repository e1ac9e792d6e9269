"""Routing quality: prefix-cache hit rate and simulated TTFT of each router on the same fake engines.

Run ``python -m bench.routing_quality`` (``--quick`` for a smoke run under a minute, ``--help``).

Rows, each a fresh set of engines (new processes: every row starts cold) replaying the same workload:

- ours: ``routerfleet-router --policy kv_aware`` fed by the engines' KV event streams;
- vllm-router: ``--policy kv_aware`` with ``--kv-event-source``/``--kv-event-replay-source`` on the same
  streams (vLLM 0.33 wire, the fake engine's default dialect);
- sglang-router: ``launch --policy cache_aware`` (its approximate text tree: no events);
- round-robin, the floor: ours with ``--policy round_robin``;
- oracle, the ceiling: no router; the client keeps an exact model of every engine's cache (the fake
  engine's own ``RankCache`` class, fed the same admissions in the same order) and sends each request
  to the engine holding the longest prefix, ties to the fewest requests in flight.

Workload (seeded, identical for every row): multi-turn chats in groups that share long system prompts.
Each turn's prompt is the previous turn's prompt + the previous reply + a new user message, so every
turn extends its history. Prompts are ASCII, so with the fake engine's byte tokenizer text and token IDs
are the same tokens: ours, vllm-router and round-robin get ``prompt`` as a list of token IDs;
sglang-router rejects token-ID prompts (``StringOrArray``), so it gets the same prompts as text, which
the engine tokenizes to the same IDs. Replies are deterministic (a function of the prompt), so the
whole workload is computed up front and every reply is checked against it.

Turns are dispatched in one fixed order with bounded concurrency; a turn waits for its conversation's
previous turn. Requests stream; TTFT is client-side, send to first body byte, so it includes the
router's own latency as well as the engine's queueing and its simulated prefill of the uncached tokens.
Engines run ``--cache-generated`` (a finished request's prompt + reply blocks are cached, as real
engines do), ``--max-concurrency`` slots (the rest queue), and a cache too small to hold everything.

The client sets TCP_QUICKACK on its sockets: without it sglang-router 0.3.2, which writes streamed
chunks with Nagle on, stalls ~40 ms per streamed response on a reused connection (the client's delayed
ACK); see ``bench/overhead.py``, which reports that separately. Hit rate = sum of
``usage.prompt_tokens_details.cached_tokens`` over the sum of ``prompt_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench import harness as h
from router_runtime.kv.events import Dialect
from routerfleet_fake_engine.cache import CacheConfig, RankCache
from routerfleet_fake_engine.openai_api import generate_tokens

# ---------------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Params:
    convs: int = 400
    groups: int = 8
    group_skew: float = 0.5  # Zipf exponent of group popularity (0 = uniform)
    sys_tokens: tuple[int, int] = (1024, 2048)
    user_tokens: tuple[int, int] = (48, 256)
    turns: tuple[int, int] = (2, 6)
    reply_tokens: int = 32
    active: int = 32  # conversations open at once
    concurrency: int = 16  # requests in flight
    engines: int = 4
    capacity_blocks: int = 320  # per engine: 5,120 tokens, ~3 system prompts
    block_size: int = 16
    prefill_us_per_token: float = 20.0
    decode_tokens_per_s: float = 2000.0
    engine_slots: int = 4  # --max-concurrency per engine
    seed: int = 11
    # Conversation c is tenant c % tenants's (its API key in Authorization); 1: no header. The groups'
    # system prompts are shared across tenants: what --tenant-cache-salt gives up.
    tenants: int = 1

    def engine_opts(self) -> h.EngineOpts:
        """The fake engines this workload runs on (finished requests' output cached, as real engines do)."""
        return h.EngineOpts(
            block_size=self.block_size,
            capacity_blocks=self.capacity_blocks,
            prefill_us_per_token=self.prefill_us_per_token,
            decode_tokens_per_s=self.decode_tokens_per_s,
            max_concurrency=self.engine_slots,
            cache_generated=True,
        )


QUICK = Params(convs=96, active=24, concurrency=12)


@dataclass
class Turn:
    conv: int
    group: int
    index: int  # turn number within its conversation
    prev: int  # position of the conversation's previous turn in the schedule, -1 for the first
    prompt: str
    reply: str

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.prompt.encode("ascii"))


def _text(rng: random.Random, n: int) -> str:
    """``n`` ASCII characters of word-like text (one token per character with the byte tokenizer)."""
    out: list[str] = []
    size = 0
    while size < n:
        w = "".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def build_workload(p: Params) -> list[Turn]:
    rng = random.Random(p.seed)
    systems = [f"System prompt {g}. " + _text(rng, rng.randint(*p.sys_tokens)) for g in range(p.groups)]
    weights = [1 / (g + 1) ** p.group_skew for g in range(p.groups)]
    groups = rng.choices(range(p.groups), weights, k=p.convs)
    plans = [rng.randint(*p.turns) for _ in range(p.convs)]
    history = [systems[g] for g in groups]
    done_turns = [0] * p.convs
    last_pos = [-1] * p.convs
    queue = list(range(p.convs))
    active = [queue.pop(0) for _ in range(min(p.active, len(queue)))]
    recent: list[int] = []  # the last `concurrency` conversations scheduled
    schedule: list[Turn] = []
    while active:
        fresh = [c for c in active if c not in recent]
        conv = rng.choice(fresh) if fresh else min(active, key=lambda c: last_pos[c])
        prompt = history[conv] + "\nUser: " + _text(rng, rng.randint(*p.user_tokens)) + "\nAssistant: "
        ids = tuple(prompt.encode("ascii"))
        reply = bytes(generate_tokens(ids, p.reply_tokens)).decode("ascii")
        schedule.append(Turn(conv, groups[conv], done_turns[conv], last_pos[conv], prompt, reply))
        last_pos[conv] = len(schedule) - 1
        history[conv] = prompt + reply
        done_turns[conv] += 1
        recent = [*recent, conv][-p.concurrency :]
        if done_turns[conv] == plans[conv]:
            active.remove(conv)
            if queue:
                active.append(queue.pop(0))
    return schedule


def reusable_share(schedule: list[Turn], block: int) -> float:
    """The hit rate of one engine with an unbounded cache: the share of prompt tokens (in full blocks)
    that some earlier request already carried: the previous turn of the same conversation, or the
    system prompt of an earlier conversation of the same group."""
    last_first: dict[int, str] = {}
    reusable = total = 0
    for t in schedule:
        if t.index > 0:
            prev = schedule[t.prev]
            shared = len(prev.prompt) + len(prev.reply)
        else:
            other = last_first.get(t.group, "")
            shared = next(
                (k for k, (a, b) in enumerate(zip(other, t.prompt, strict=False)) if a != b),
                min(len(other), len(t.prompt)),
            )
            last_first[t.group] = t.prompt
        reusable += min(shared, len(t.prompt)) // block * block
        total += len(t.prompt)
    return reusable / total


def body(turn: Turn, p: Params, text: bool) -> bytes:
    prompt: Any = turn.prompt if text else turn.prompt_ids
    b = {
        "model": h.MODEL,
        "prompt": prompt,
        "max_tokens": p.reply_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},  # engines stream usage only when asked
    }
    return json.dumps(b, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------------------------------
# The oracle


class Oracle:
    """Knows every engine's cache exactly. It runs the fake engine's own cache class per engine and
    feeds it what the engine does, in the engine's order: a request's prompt is admitted when it gets
    one of the engine's ``--max-concurrency`` slots (FIFO), and on completion its prompt + reply
    (``--cache-generated``) just before the slot passes to the next queued request."""

    def __init__(self, p: Params) -> None:
        cfg = CacheConfig(Dialect.VLLM_033, p.block_size, p.capacity_blocks)
        self.caches = [RankCache(cfg) for _ in range(p.engines)]
        self.slots = p.engine_slots
        self.running = [0] * p.engines
        self.queued: list[deque[tuple[int, list[int]]]] = [deque() for _ in range(p.engines)]
        self.predicted: dict[int, int] = {}  # schedule position -> cached tokens the model expected

    def pick(self, pos: int, ids: list[int]) -> int:
        chain = self.caches[0].chain(ids)[: self.caches[0].config.device_capacity]
        # RankCache.lookup would hash the prompt once per engine; the chain is the same everywhere.
        scores = [c._match(chain).blocks for c in self.caches]
        load = [r + len(q) for r, q in zip(self.running, self.queued, strict=True)]
        best = max(range(len(scores)), key=lambda e: (scores[e], -load[e], -e))
        if self.running[best] < self.slots:
            self.running[best] += 1
            self._admit(best, pos, ids)
        else:
            self.queued[best].append((pos, ids))
        return best

    def _admit(self, engine: int, pos: int, ids: list[int]) -> None:
        self.predicted[pos] = self.caches[engine].admit(ids).cached_tokens

    def finished(self, engine: int, ids: list[int], reply: str) -> None:
        self.caches[engine].admit([*ids, *reply.encode("ascii")])
        if self.queued[engine]:
            self._admit(engine, *self.queued[engine].popleft())
        else:
            self.running[engine] -= 1


# ---------------------------------------------------------------------------------------------------
# One pass


@dataclass
class Result:
    row: str
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    wait_ms: list[float] = field(default_factory=list)  # TTFT minus the simulated prefill: queues + hops
    per_engine: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    wrong_replies: int = 0
    oracle_agree: float | None = None  # share of requests whose cached_tokens the oracle predicted
    probe: str = ""
    flags: list[str] = field(default_factory=list)
    router_cpu_s: float = float("nan")  # CPU seconds the router processes used during the replay
    evicted: list[int] = field(default_factory=list)  # blocks each engine evicted (BlockRemoved)
    false_hits: int | None = None  # our routers' audited false-hit tokens outside doubtful predictions
    timeline: list[tuple[float, int, int]] = field(default_factory=list)  # (done at s, prompt, cached)
    killed_at: float | None = None  # when a replica was killed (s into the replay)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def requests(self) -> int:
        return len(self.ttft_ms)


async def replay(
    schedule: list[Turn],
    p: Params,
    *,
    urls: list[str],
    sticky: bool = False,
    kill: tuple[int, Callable[[], str]] | None = None,
    engine_urls: list[str],
    incarnations: dict[str, int],
    text: bool,
    oracle: Oracle | None,
    res: Result,
) -> None:
    # Several router replicas: the client alternates between them per request, as a Service spreads
    # connections, or keeps each conversation on one replica (``sticky``).
    clients = {u: h.HttpClient(u, quickack=True) for u in (urls or engine_urls)}
    done = [asyncio.Event() for _ in schedule]
    slots = asyncio.Semaphore(p.concurrency)
    actual: dict[int, int] = {}

    async def one(pos: int, turn: Turn) -> None:
        try:
            ids = turn.prompt_ids
            engine = -1
            if oracle is not None:
                engine = oracle.pick(pos, ids)
                client = clients[engine_urls[engine]]
            else:
                client = clients[live[(turn.conv if sticky else pos) % len(live)]]
            key = f"Authorization: Bearer tenant-{turn.conv % p.tenants}\r\n" if p.tenants > 1 else ""
            raw = client.request_bytes("/v1/completions", body(turn, p, text), key)
            try:
                t0, reply = await client.send(raw, keep_body=True)
            except (h.HttpError, OSError) as e:
                res.errors[type(e).__name__] += 1
                return
            finally:
                if oracle is not None:
                    oracle.finished(engine, ids, turn.reply)
            usage = h.read_completion(reply, turn.reply, res)
            if usage is None:
                return
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            actual[pos] = cached
            res.prompt_tokens += usage["prompt_tokens"]
            res.cached_tokens += cached
            res.timeline.append((time.perf_counter() - started, usage["prompt_tokens"], cached))
            res.ttft_ms.append((reply.t_first - t0) * 1e3)
            res.e2e_ms.append((reply.t_end - t0) * 1e3)
            prefill_ms = (usage["prompt_tokens"] - cached) * p.prefill_us_per_token / 1e3
            res.wait_ms.append(res.ttft_ms[-1] - prefill_ms)
            inc = (reply.headers or {}).get("x-engine-incarnation")
            res.per_engine[incarnations.get(inc or "", engine)] += 1
        finally:
            slots.release()
            done[pos].set()

    t0 = started = time.perf_counter()
    tasks = []
    live = list(urls)
    for pos, turn in enumerate(schedule):
        if kill is not None and pos == kill[0]:
            # A replica dies (SIGKILL); the client stops sending to it, as a Service drops an endpoint
            # whose pod is gone. Its in-flight requests fail (counted as errors).
            live.remove(kill[1]())
            res.killed_at = time.perf_counter() - started
        if turn.prev >= 0:
            await done[turn.prev].wait()
        await slots.acquire()
        tasks.append(asyncio.create_task(one(pos, turn)))
    await asyncio.gather(*tasks)
    res.wall_s = time.perf_counter() - t0
    for c in clients.values():
        c.close()
    if oracle is not None and actual:
        res.oracle_agree = sum(oracle.predicted.get(k) == v for k, v in actual.items()) / len(actual)


def probe_event_plane(router: h.Router, engines: list[h.Engine], kv: bool) -> str:
    """Put a fresh 4-block prompt in one engine's cache via /admin/store, send it through the router and
    expect a full hit: proves the router ingests that engine's events before the workload starts.
    Done for every router so every row starts from the same state; then every engine is cleared."""
    rng = random.Random(99)
    verdicts = []
    for e in engines:
        ok = False
        for _attempt in range(25):
            ids = [rng.randrange(97, 123) for _ in range(64)]
            h.http_post(e.url + "/admin/store", {"token_ids": ids})
            time.sleep(0.1)
            # one token past the stored blocks: an engine never reuses a prompt's last token
            body = {"model": h.MODEL, "prompt": [*ids, 97], "max_tokens": 1}
            st, b = h.http_post(router.url + "/v1/completions", body)
            if st == 200 and b["usage"]["prompt_tokens_details"]["cached_tokens"] == 64:
                ok = True
                break
            if not kv:
                break
        verdicts.append(ok)
    for e in engines:
        h.http_post(e.url + "/admin/clear", {})
    time.sleep(0.3)  # let the routers apply AllBlocksCleared
    if not kv:
        return ""
    return (
        "events ok"
        if all(verdicts)
        else f"events NOT verified on engines {[i for i, v in enumerate(verdicts) if not v]}"
    )


ROWS = {
    # name: (label, router kind or None for the oracle, our policy, text prompts)
    "ours": ("ours kv_aware", "ours", "kv_aware", False),
    "ours-text": ("ours kv_aware (text)", "ours", "kv_aware", True),
    "ours-epp": ("Envoy + ours kv_aware (picker)", "ours-epp", "kv_aware", False),
    "vllm": ("vllm-router kv_aware", "vllm-router", None, False),
    "sglang": ("sglang-router cache_aware", "sglang-router", None, True),
    "rr": ("round-robin (floor)", "ours", "round_robin", False),
    "oracle": ("oracle (ceiling)", None, None, False),
}


def run_row(name: str, schedule: list[Turn], p: Params, logdir: str, fleet: Fleet) -> Result:
    label, kind, policy, text = ROWS[name]
    res = Result(fleet.label(label) if kind in FLEET_KINDS else label)
    engines = h.start_engines(p.engines, p.engine_opts(), logdir)
    routers: list[h.Router] = []
    try:
        incarnations = h.engine_incarnations(engines)
        if kind in ("ours", "ours-epp"):
            routers = h.start_fleet(
                fleet.replicas,
                engines,
                logdir,
                kind=kind,
                policy=policy or "kv_aware",
                label=name,
                extra=fleet.flags,
            )
        elif kind == "vllm-router":
            # Its replicas share nothing but the engines' event streams: each its own ports.
            routers = [
                h.start_router(kind, engines, logdir, label=f"{name}-{i}") for i in range(fleet.replicas)
            ]
        elif kind is not None:
            routers = [h.start_router(kind, engines, logdir, policy=policy or "kv_aware", label=name)]
        if routers:
            res.flags = routers[0].flags
            kv = policy == "kv_aware" or kind == "vllm-router"
            if "--tenant-cache-salt" in fleet.flags:  # the probe's blocks are stored unsalted: no hit
                res.probe = "events not probed (tenant salts)"
            else:
                res.probe = "; ".join(sorted({probe_event_plane(r, engines, kv=kv) for r in routers}))
        oracle = Oracle(p) if kind is None else None
        cpu0 = sum(r.cpu_seconds() for r in routers)
        kill = None
        if fleet.kill_at is not None and len(routers) > 1:
            victim = routers[-1]

            def kill_one() -> str:
                os.killpg(victim.proc.popen.pid, signal.SIGKILL)
                return victim.url

            kill = (int(fleet.kill_at * len(schedule)), kill_one)
        asyncio.run(
            replay(
                schedule,
                p,
                urls=[r.url for r in routers],
                sticky=fleet.sticky,
                kill=kill,
                engine_urls=[e.url for e in engines],
                incarnations=incarnations,
                text=text,
                oracle=oracle,
                res=res,
            )
        )
        if routers:
            res.router_cpu_s = sum(r.cpu_seconds() for r in routers) - cpu0
        res.evicted = [h.evicted_blocks(e) for e in engines]
        audited = [h.false_hit_tokens(r) for r in routers if r.alive()]
        if audited and None not in audited:
            res.false_hits = sum(audited)  # type: ignore[arg-type]
        if any(not r.alive() for r in routers):
            res.errors["router exited"] += 1
    finally:
        h.stop_all(routers + engines)
    return res


# The rows of ``--engines vllm`` (bench/routing_vllm.py's ROWS).
VLLM_ROWS = ("ours", "ours-x3", "vllm", "rr")

# Router kinds that run ``--replicas`` instances (sglang-router keeps its approximate tree per process
# and has no event stream, so several of it measure nothing new).
FLEET_KINDS = ("ours", "ours-epp", "vllm-router")


@dataclass(frozen=True)
class Fleet:
    """How many router replicas stand in front of the engines (ours, and vllm-router as its anchor),
    and how the client spreads over them."""

    replicas: int = 1
    sticky: bool = False  # each conversation on one replica; else alternating per request
    flags: tuple[str, ...] = ()  # extra flags for our routers (e.g. the fleet load view off)
    kill_at: float | None = None  # kill one replica this far into the schedule (0..1)

    def label(self, base: str) -> str:
        if self.replicas == 1:
            return base
        return f"{base} x{self.replicas} ({'per conversation' if self.sticky else 'per request'})"


# ---------------------------------------------------------------------------------------------------
# Report


def around_kill(res: Result, window_s: float = 1.0, before_s: float = 5.0) -> str:
    """The hit rate in the ``before_s`` before the kill (steady state) and in 1 s windows after it, and
    when it was back within 2% of that steady state."""
    if res.killed_at is None:
        return ""
    k = res.killed_at

    def rate(lo: float, hi: float) -> float:
        got = [(pt, c) for t, pt, c in res.timeline if lo <= t < hi]
        total = sum(pt for pt, _ in got)
        return sum(c for _, c in got) / total if total else float("nan")

    steady = rate(k - before_s, k)
    end = max((t for t, _, _ in res.timeline), default=k)
    windows = []
    back = None
    t = k
    while t < end:
        r = rate(t, t + window_s)
        windows.append(r)
        if back is None and r == r and r >= 0.98 * steady:
            back = t + window_s - k
        t += window_s
    shown = " ".join(f"{100 * r:.0f}" for r in windows[:8])
    when = f"back within 2% after {back:.0f} s" if back is not None else "not back within 2%"
    return (
        f"replica killed at {k:.1f}s: hit {100 * steady:.1f}% in the {before_s:g}s before; per"
        f" {window_s:g}s after: {shown}; {when}"
    )


def _cell(rs: list[Result], f, fmt: str, scale: float = 1.0) -> str:
    return h.cell([scale * f(r) for r in rs], fmt)


def report(results: dict[str, list[Result]], rows: list[str], p: Params) -> None:
    def m(name: str, f) -> float:
        return h.med([f(r) for r in results[name]]) if name in results else float("nan")

    def hit(r: Result) -> float:
        return r.hit_rate

    def ttft50(r: Result) -> float:
        return h.pct(r.ttft_ms, 50)

    def ttft99(r: Result) -> float:
        return h.pct(r.ttft_ms, 99)

    oracle_hit, vllm_hit = m("oracle", hit), m("vllm", hit)
    out = []
    for name in rows:
        rs = results[name]
        shares: Counter = Counter()
        errs: Counter = Counter()
        for r in rs:
            shares.update(r.per_engine)
            errs.update(r.errors)
        total = sum(shares.values()) or 1
        notes = [", ".join(f"{k}: {v}" for k, v in errs.items())] if errs else []
        wrong = sum(r.wrong_replies for r in rs)
        if wrong:
            notes.append(f"{wrong} wrong replies")
        notes += sorted({r.probe for r in rs if r.probe})
        audited = [r.false_hits for r in rs if r.false_hits is not None]
        if audited:
            notes.append(f"false-hit tokens {sum(audited)}")
        notes += [around_kill(r) for r in rs if r.killed_at is not None]
        agree = [r.oracle_agree for r in rs if r.oracle_agree is not None]
        if agree:
            notes.append(
                f"its model matched the engines' cached_tokens on {100 * h.med(agree):.1f}% of requests"
            )
        cpu = [
            1e3 * r.router_cpu_s / r.requests for r in rs if r.requests and r.router_cpu_s == r.router_cpu_s
        ]
        evicted = [h.med([r.evicted[e] for r in rs if r.evicted]) for e in range(p.engines)]
        out.append(
            [
                rs[0].row,
                _cell(rs, hit, ".1f", 100),
                h.ratio(m(name, hit), oracle_hit),
                h.ratio(m(name, hit), vllm_hit),
                _cell(rs, ttft50, ".1f"),
                _cell(rs, ttft99, ".1f"),
                _cell(rs, lambda r: h.pct(r.wait_ms, 50), ".1f"),
                f"{h.med(cpu):.2f}" if cpu else "-",
                _cell(rs, lambda r: r.requests / r.wall_s, ".0f"),
                "/".join(f"{100 * shares[e] / total:.0f}" for e in range(p.engines)),
                "/".join(f"{x:.0f}" for x in evicted),
                "; ".join(notes),
            ]
        )
    header = [
        "router",
        "hit rate %",
        "/oracle",
        "/vllm",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "wait p50 ms",
        "router CPU ms/req",
        "req/s",
        "engine shares %",
        "evicted blocks per engine",
        "notes",
    ]
    print(h.table(out, header))
    print(
        "  hit rate = sum(cached_tokens) / sum(prompt_tokens), HIGHER is better; TTFT (send to first streamed"
        " byte) LOWER is better;\n  wait = TTFT minus the simulated prefill of the uncached tokens (engine"
        " queues + router time); medians over runs, (min-max)."
    )
    if "ours" not in results:
        return
    print()
    o_hit = m("ours", hit)
    if "vllm" in results:
        print(
            f"  goal: hit rate >= vllm-router kv_aware: {100 * o_hit:.1f}% vs {100 * vllm_hit:.1f}%"
            f" ({o_hit / vllm_hit:.2f}x) -> {'MET' if o_hit >= vllm_hit else 'NOT MET'}"
        )
    if "oracle" in results:
        print(
            f"  goal: hit rate within 10% of the oracle: {100 * o_hit:.1f}% vs {100 * oracle_hit:.1f}%"
            f" ({o_hit / oracle_hit:.3f}x) -> {'MET' if o_hit >= 0.9 * oracle_hit else 'NOT MET'}"
        )
    for name in rows:
        if name in ("ours", "oracle"):
            continue
        for what, f, higher in (
            ("hit rate", hit, True),
            ("TTFT p50", ttft50, False),
            ("TTFT p99", ttft99, False),
        ):
            a, b = m("ours", f), m(name, f)
            if (a < b) if higher else (a > b):
                worse = abs(a - b) / b * 100 if b else float("inf")
                print(f"  ours loses to {ROWS[name][0]} on {what}: {a:.3g} vs {b:.3g} ({worse:.0f}% worse)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.routing_quality", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK.convs} conversations, one run (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs per row; medians are reported (default 3, quick 1)")
    ap.add_argument(
        "--engines",
        choices=("fake", "vllm"),
        default="fake",
        help="fake engines (default), or two real vLLM engines, its CPU build (bench/routing_vllm.py: its"
        " own workload and rows; --quick, --runs and --rows apply)",
    )
    ap.add_argument(
        "--rows",
        help=f"comma-separated rows, in order, from {','.join(ROWS)} (default ours,vllm,sglang,rr,oracle;"
        f" with --engines vllm from {','.join(VLLM_ROWS)}, default all)",
    )
    ap.add_argument("--convs", type=int, help=f"conversations (default {Params.convs}, quick {QUICK.convs})")
    ap.add_argument(
        "--capacity-blocks", type=int, help=f"blocks per engine (default {Params.capacity_blocks})"
    )
    ap.add_argument("--concurrency", type=int, help=f"requests in flight (default {Params.concurrency})")
    ap.add_argument(
        "--group-skew",
        type=float,
        help=f"Zipf exponent of group popularity, 0 = uniform (default {Params.group_skew})",
    )
    ap.add_argument(
        "--engine-slots",
        type=int,
        help=f"--max-concurrency per engine, 0 = unlimited (default {Params.engine_slots})",
    )
    ap.add_argument("--active", type=int, help=f"conversations open at once (default {Params.active})")
    ap.add_argument(
        "--turns",
        type=int,
        help=f"turns per conversation (default {Params.turns[0]}-{Params.turns[1]} at random)",
    )
    ap.add_argument("--seed", type=int, help=f"workload seed (default {Params.seed})")
    ap.add_argument(
        "--tenants",
        type=int,
        help="spread the conversations over this many tenants (API keys); with --router-flags"
        " '--tenant-header Authorization --tenant-cache-salt' ours shares no block across them (the"
        " oracle still shares: it is the ceiling without isolation)",
    )
    ap.add_argument(
        "--max-wait", type=float, help="before each row, wait up to this many seconds for an idle machine"
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="router replicas in front of the engines, ours and vllm-router alike (default 1)",
    )
    ap.add_argument(
        "--client",
        choices=("per-request", "per-conversation"),
        default="per-request",
        help="with several replicas: alternate per request (as a Service does) or keep each conversation"
        " on one replica (default per-request)",
    )
    ap.add_argument(
        "--router-flags",
        default="",
        help="extra flags for our routers, e.g. '--fleet-gossip-window-ms 0 --engine-load-interval-ms 0'"
        " (the fleet load view off: each replica balances on its own in-flight counts)",
    )
    ap.add_argument(
        "--kill-at",
        type=float,
        help="kill one of our replicas (SIGKILL) this far into the schedule, e.g. 0.5, and report the"
        " hit rate around it",
    )
    ap.add_argument("--json", help="also write the raw per-run figures to this file")
    args = ap.parse_args(argv)
    if args.engines == "vllm":
        from bench import routing_vllm

        rows = args.rows.split(",") if args.rows else list(VLLM_ROWS)
        if unknown := [r for r in rows if r not in VLLM_ROWS]:
            ap.error(f"argument --rows: unknown with --engines vllm: {','.join(unknown)}")
        return routing_vllm.main(args.quick, args.runs, rows)
    args.rows = args.rows or "ours,vllm,sglang,rr,oracle"
    if args.replicas < 1:
        ap.error("argument --replicas: must be >= 1")
    if args.kill_at is not None and not (0 < args.kill_at < 1 and args.replicas > 1):
        ap.error("argument --kill-at: a fraction in (0, 1), with --replicas 2 or more")
    fleet = Fleet(
        args.replicas, args.client == "per-conversation", tuple(args.router_flags.split()), args.kill_at
    )

    p = QUICK if args.quick else Params()
    over = {
        "convs": args.convs,
        "capacity_blocks": args.capacity_blocks,
        "concurrency": args.concurrency,
        "seed": args.seed,
        "tenants": args.tenants,
        "turns": (args.turns, args.turns) if args.turns else None,
        "group_skew": args.group_skew,
        "active": args.active,
        "engine_slots": args.engine_slots,
    }
    p = Params(**{**p.__dict__, **{k: v for k, v in over.items() if v is not None}})
    runs = args.runs or (1 if args.quick else 3)
    max_wait = args.max_wait if args.max_wait is not None else (1.0 if args.quick else 15.0)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; choose from {', '.join(ROWS)}")
    rows = list(dict.fromkeys(rows))
    skipped = {}
    for r in list(rows):
        kind = ROWS[r][1]
        if kind in ("vllm-router", "sglang-router"):
            ok, why = h.anchor_status(kind)
            if not ok:
                skipped[r] = why
                rows.remove(r)

    loop = h.use_uvloop()
    t_start = time.perf_counter()
    schedule = build_workload(p)
    n_tokens = sum(len(t.prompt) for t in schedule)
    print(f"# RouterFleet routing-quality bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(f"# {h.machine()}; client loop {loop}")
    for kind in ("vllm-router", "sglang-router"):
        ok, why = h.anchor_status(kind)
        print(f"# {kind}: {why if ok else 'NOT AVAILABLE: ' + why}")
    for r, why in skipped.items():
        print(f"# row {r} skipped: {why}")
    print(
        f"# workload: {p.convs} conversations in {p.groups} groups (Zipf {p.group_skew}) sharing system"
        f" prompts of {p.sys_tokens[0]}-{p.sys_tokens[1]} tokens, {p.turns[0]}-{p.turns[1]} turns, user"
        f" messages {p.user_tokens[0]}-{p.user_tokens[1]} tokens, replies {p.reply_tokens} tokens (streamed);"
        f" {len(schedule)} requests, {n_tokens / len(schedule):.0f} prompt tokens on average, seed {p.seed};"
        f" an unbounded cache would hit {100 * reusable_share(schedule, p.block_size):.1f}%"
    )
    print(
        f"# engines: {p.engines} fake engines, block {p.block_size}, {p.capacity_blocks} blocks each"
        f" ({p.capacity_blocks * p.block_size} tokens), prefill {p.prefill_us_per_token:g} us per uncached"
        f" token, decode {p.decode_tokens_per_s:g} tok/s, {p.engine_slots} slots each, --cache-generated;"
        f" client: {p.concurrency} in flight, {p.active} conversations open"
    )
    print(
        f"# runs={runs}, rows: {', '.join(rows)}; new engine processes for every row and run; up to"
        f" {max_wait:g}s wait for an idle machine before each"
    )
    logdir = h.logdir("quality")
    results: dict[str, list[Result]] = {r: [] for r in rows}
    for run in range(runs):
        for name in rows:
            waited, idle = h.wait_quiet(max_wait)
            res = run_row(name, schedule, p, logdir, fleet)
            results[name].append(res)
            cpu = (
                f", router CPU {100 * res.router_cpu_s / res.wall_s:.0f}%"
                if res.router_cpu_s == res.router_cpu_s
                else ""
            )
            print(
                f"#   run {run + 1} {name:>9}: hit {100 * res.hit_rate:5.1f}%, TTFT p50"
                f" {h.pct(res.ttft_ms, 50):6.1f} p99 {h.pct(res.ttft_ms, 99):6.1f} ms, wait p50"
                f" {h.pct(res.wait_ms, 50):5.1f} ms, {res.requests} ok, {sum(res.errors.values())} errors,"
                f" {res.wall_s:.1f}s{cpu}; idle {100 * idle:.0f}% after {waited:.0f}s"
                f" (t={time.perf_counter() - t_start:.0f}s)",
                flush=True,
            )
    print()
    report(results, rows, p)
    h.print_flags_and_logs(results, {n: ROWS[n][0] for n in rows}, logdir, t_start)
    if args.json:
        raw = {
            k: [
                {
                    "hit_rate": r.hit_rate,
                    "ttft_p50_ms": h.pct(r.ttft_ms, 50),
                    "ttft_p99_ms": h.pct(r.ttft_ms, 99),
                    "wait_p50_ms": h.pct(r.wait_ms, 50),
                    "e2e_p50_ms": h.pct(r.e2e_ms, 50),
                    "wall_s": r.wall_s,
                    "requests": r.requests,
                    "router_cpu_s": r.router_cpu_s,
                    "errors": dict(r.errors),
                    "per_engine": dict(r.per_engine),
                    "evicted": r.evicted,
                }
                for r in v
            ]
            for k, v in results.items()
        }
        with open(args.json, "w") as f:
            json.dump({"params": p.__dict__, "results": raw}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
