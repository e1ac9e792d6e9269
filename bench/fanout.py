"""Fan-out bursts: one long prompt sent N times (best-of-N, an agent fanning one context out to its
tools). Does the fleet prefill it once, or once per engine its copies reach?

Run ``python -m bench.fanout`` (``--quick`` for a smoke run under a minute, ``--help``).

4 fake engines (fresh processes per row, so every row starts cold) with a simulated prefill of
``--prefill-us-per-token`` per uncached token; 16 distinct prompts of ~2k tokens (token IDs, the
router's byte tokenizer), each sent as one burst of N streamed requests (all at once, or one every
``--spacing-ms``), bursts one after another with a short pause. Through 1 router or through 3 replicas
as the operator deploys them (static peers, one fleet token), copy k of a burst going to replica k mod
3. ``--background N``: N more streams of distinct prompts run throughout, spread over the replicas the
same way (a busy fleet, where the replicas' views of the load differ). ``--publish-delay-ms``: the
engines announce a request's blocks that long after admitting it (a real engine announces them once
computed; the fake engine otherwise announces them at admission, leaving a prediction only the
milliseconds before its events arrive). Rows: in-flight predictions off
(``--inflight-ttl-s 0``), kept local (``--no-share-predictions``; through one router, the same as
shared) and shared with the siblings (the default).

Figures, medians over runs (min-max):
- distinct engines per prompt: how many engines a burst's copies reached (1.0: the prompt was prefilled
  once), from the engines' own request counters before and after each burst (without background);
  with background, from the routers' answer header naming the engine;
- TTFT p50/p99 of the copies, client-side, send to the first streamed body byte;
- prefilled tokens per prompt: the prompt tokens the engines did not serve from cache (their counters;
  without background only).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp

from bench import harness as h

ENGINES = 4
PROMPT_TOKENS = 2048


PREDICTIONS = {  # row mode -> our routers' flags
    "off": ["--inflight-ttl-s", "0"],
    "local": ["--no-share-predictions"],
    "shared": [],
}
ENGINE_HEADER = "X-RouterFleet-Engine"


@dataclass
class Row:
    label: str
    replicas: int
    copies: int
    predictions: str  # a PREDICTIONS key


@dataclass
class Result:
    distinct: float  # engines per prompt, mean over the bursts
    ttft_p50_ms: float
    ttft_p99_ms: float
    prefilled: float  # uncached prompt tokens per prompt


def engine_counters(engine: h.Engine) -> tuple[int, int, int]:
    """(requests, prompt tokens, cached tokens) the engine has admitted so far, over its ranks."""
    _, text = h.http_get(engine.url + "/metrics")
    out = [0, 0, 0]
    names = ("requests_total", "prompt_tokens_total", "cached_tokens_total")
    for line in text.decode().splitlines():
        for i, name in enumerate(names):
            if line.startswith(f"routerfleet_fake_engine_{name}{{"):
                out[i] += int(float(line.rsplit(" ", 1)[1]))
    return out[0], out[1], out[2]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(32, 127) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def one(
    s: aiohttp.ClientSession, url: str, prompt: list[int], delay_s: float = 0.0
) -> tuple[float, str]:
    """One streamed completion, sent after ``delay_s``: its TTFT in ms, and the engine that served it."""
    await asyncio.sleep(delay_s)
    body = {"model": h.MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    ttft, headers = await h.streamed(s, url + "/v1/completions", body)
    return ttft, headers.get(ENGINE_HEADER, "")


async def background(s: aiohttp.ClientSession, urls: list[str], streams: int, stop: asyncio.Event) -> int:
    """``streams`` loops of requests with prompts of their own (~1k tokens, 64 generated), spread over
    ``urls``, until ``stop``; returns how many were sent."""
    rng = random.Random(7)
    sent = 0

    async def loop(k: int) -> None:
        nonlocal sent
        while not stop.is_set():
            prompt = [rng.randrange(32, 127) for _ in range(1024)]
            body = {"model": h.MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}
            async with s.post(urls[(k + sent) % len(urls)] + "/v1/completions", json=body) as r:
                await r.read()
            sent += 1

    await asyncio.gather(*(loop(k) for k in range(streams)))
    return sent


async def run_row(
    row: Row,
    engines: list[h.Engine],
    routers: list[h.Router],
    ps: list[list[int]],
    pause: float,
    spacing_s: float,
    streams: int,
):
    urls = [r.url for r in routers]
    ttfts: list[float] = []
    distinct: list[int] = []
    before_all = [engine_counters(e) for e in engines]
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as s:
        busy = asyncio.create_task(background(s, urls, streams, stop)) if streams else None
        if busy is not None:
            await asyncio.sleep(1.0)  # under way before the first burst
        for p in ps:
            before = [engine_counters(e)[0] for e in engines] if busy is None else []
            answers = await asyncio.gather(
                *(one(s, urls[k % len(urls)], p, k * spacing_s) for k in range(row.copies))
            )
            ttfts += [t for t, _ in answers]
            if busy is None:  # the engines' counters: a router's header could lie, they cannot
                after = [engine_counters(e)[0] for e in engines]
                distinct.append(sum(1 for a, b in zip(after, before, strict=True) if a > b))
            else:
                distinct.append(len({engine for _, engine in answers}))
            await asyncio.sleep(pause)
        stop.set()
        if busy is not None:
            await busy
    after_all = [engine_counters(e) for e in engines]
    prefilled = sum((a[1] - a[2]) - (b[1] - b[2]) for a, b in zip(after_all, before_all, strict=True))
    return Result(
        statistics.mean(distinct),
        h.pct(ttfts, 50),
        h.pct(ttfts, 99),
        prefilled / len(ps) if busy is None else float("nan"),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run, 4 prompts, 4 copies (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs; medians are reported (default 3, quick 1)")
    ap.add_argument("--prompts", type=int, help="bursts per row (default 16, quick 4)")
    ap.add_argument("--copies", default="4,8", help="copies per burst, a comma list (default 4,8)")
    ap.add_argument("--replicas", default="1,3", help="router replicas, a comma list (default 1,3)")
    ap.add_argument(
        "--prefill-us-per-token", type=float, default=25.0, help="the engines' simulated prefill (default 25)"
    )
    ap.add_argument(
        "--spacing-ms",
        type=float,
        default=0.0,
        help="send a burst's copies this far apart (default 0: at once)",
    )
    ap.add_argument(
        "--background", type=int, default=0, help="streams of other requests throughout (default 0: none)"
    )
    ap.add_argument(
        "--publish-delay-ms",
        type=float,
        default=0.0,
        help="the engines announce a request's stored blocks this long after admission, as real engines do"
        " once they are computed (default 0: at admission)",
    )
    ap.add_argument(
        "--modes",
        default=",".join(PREDICTIONS),
        help=f"prediction modes, a comma list of {','.join(PREDICTIONS)} (default all; local is skipped"
        " through one router)",
    )
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in PREDICTIONS]:
        ap.error(f"argument --modes: unknown: {','.join(unknown)}")
    runs = args.runs or 1 if args.quick else args.runs or 3
    n_prompts = args.prompts or (4 if args.quick else 16)
    copies = [4] if args.quick else [int(c) for c in args.copies.split(",")]
    replicas = [int(r) for r in args.replicas.split(",")]
    rows = [
        Row(f"{n} {'replica' if n == 1 else 'replicas'}, {c} copies, predictions {mode}", n, c, mode)
        for n in replicas
        for c in copies
        for mode in modes
        if not (n == 1 and mode == "local")
    ]
    logdir = h.logdir("fanout")
    print(f"# RouterFleet fan-out bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(
        f"# {h.machine()}; {ENGINES} fake engines, {n_prompts} prompts of {PROMPT_TOKENS} tokens,"
        f" runs={runs}, copies {args.spacing_ms:g} ms apart, {args.background} background streams, blocks"
        f" announced {args.publish_delay_ms:g} ms after admission"
    )
    opts = h.EngineOpts(
        prefill_us_per_token=args.prefill_us_per_token,
        decode_tokens_per_s=2000.0,
        capacity_blocks=65536,
        publish_delay_ms=args.publish_delay_ms,
    )
    results: dict[str, list[Result]] = {r.label: [] for r in rows}
    t_start = time.perf_counter()
    for run in range(runs):
        for i, row in enumerate(rows):
            extra = ["--engine-header", *PREDICTIONS[row.predictions]]
            with h.fleet_over_engines(ENGINES, opts, row.replicas, logdir, label=f"r{i}", extra=extra) as (
                engines,
                routers,
            ):
                ps = prompts(n_prompts, seed=1000 * run + i)
                result = run_row(row, engines, routers, ps, 0.3, args.spacing_ms / 1e3, args.background)
                results[row.label].append(asyncio.run(result))
        print(f"# run {run + 1}/{runs} done at {time.perf_counter() - t_start:.0f}s", flush=True)
    table = []
    for row in rows:
        rs = results[row.label]
        table.append(
            [
                row.label,
                f"{h.med([r.distinct for r in rs]):.2f}{h.spread([r.distinct for r in rs], '.2f')}",
                f"{h.med([r.ttft_p50_ms for r in rs]):.0f}",
                f"{h.med([r.ttft_p99_ms for r in rs]):.0f}",
                "-" if math.isnan(rs[0].prefilled) else f"{h.med([r.prefilled for r in rs]):.0f}",
            ]
        )
    print()
    print(
        h.table(
            table, ["row", "engines per prompt", "TTFT p50 ms", "TTFT p99 ms", "prefilled tokens per prompt"]
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
