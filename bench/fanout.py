"""Fan-out bursts: one long prompt sent N times at once (best-of-N, an agent fanning one context out to
its tools). Does the fleet prefill it once, or once per engine its copies reach?

Run ``python -m bench.fanout`` (``--quick`` for a smoke run under a minute, ``--help``).

4 fake engines (fresh processes per row, so every row starts cold) with a simulated prefill of
``--prefill-us-per-token`` per uncached token; 16 distinct prompts of ~2k tokens (token IDs, the
router's byte tokenizer), each sent as one burst of N concurrent streamed requests, bursts one after
another with a short pause. Through 1 router or through 3 replicas as the operator deploys them (static
peers, one fleet token), copy k of a burst going to replica k mod 3. Rows: in-flight predictions off
(``--inflight-ttl-s 0``) and on (the default).

Figures, medians over runs (min-max):
- distinct engines per prompt: how many engines a burst's copies reached (1.0: the prompt was prefilled
  once), from the engines' own request counters before and after each burst;
- TTFT p50/p99, client-side, send to the first streamed body byte;
- prefilled tokens per prompt: the prompt tokens the engines did not serve from cache (their counters).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from dataclasses import dataclass

import aiohttp

from bench import harness as h

ENGINES = 4
PROMPT_TOKENS = 2048


@dataclass
class Row:
    label: str
    replicas: int
    copies: int
    predictions: bool


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


async def one(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> float:
    """One streamed completion; its TTFT in ms."""
    body = {"model": h.MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.read())[:200]!r}")
        first = None
        async for _ in r.content.iter_any():
            if first is None:
                first = time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1e3


async def run_row(
    row: Row, engines: list[h.Engine], routers: list[h.Router], ps: list[list[int]], pause: float
):
    urls = [r.url for r in routers]
    ttfts: list[float] = []
    distinct: list[int] = []
    before_all = [engine_counters(e) for e in engines]
    async with aiohttp.ClientSession() as s:
        for p in ps:
            before = [engine_counters(e)[0] for e in engines]
            ttfts += await asyncio.gather(*(one(s, urls[k % len(urls)], p) for k in range(row.copies)))
            after = [engine_counters(e)[0] for e in engines]
            distinct.append(sum(1 for a, b in zip(after, before, strict=True) if a > b))
            await asyncio.sleep(pause)
    after_all = [engine_counters(e) for e in engines]
    prefilled = sum((a[1] - a[2]) - (b[1] - b[2]) for a, b in zip(after_all, before_all, strict=True))
    return Result(statistics.mean(distinct), h.pct(ttfts, 50), h.pct(ttfts, 99), prefilled / len(ps))


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
    args = ap.parse_args(argv)
    runs = args.runs or 1 if args.quick else args.runs or 3
    n_prompts = args.prompts or (4 if args.quick else 16)
    copies = [4] if args.quick else [int(c) for c in args.copies.split(",")]
    replicas = [int(r) for r in args.replicas.split(",")]
    rows = [
        Row(
            f"{n} {'replica' if n == 1 else 'replicas'}, {c} copies, predictions {'on' if on else 'off'}",
            n,
            c,
            on,
        )
        for n in replicas
        for c in copies
        for on in (False, True)
    ]
    logdir = h.logdir("fanout")
    print(f"# RouterFleet fan-out bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(
        f"# {h.machine()}; {ENGINES} fake engines, {n_prompts} prompts of {PROMPT_TOKENS} tokens, runs={runs}"
    )
    opts = h.EngineOpts(
        prefill_us_per_token=args.prefill_us_per_token, decode_tokens_per_s=2000.0, capacity_blocks=65536
    )
    results: dict[str, list[Result]] = {r.label: [] for r in rows}
    t_start = time.perf_counter()
    for run in range(runs):
        for i, row in enumerate(rows):
            engines = h.start_engines(ENGINES, opts, logdir)
            routers: list[h.Router] = []
            try:
                extra = [] if row.predictions else ["--inflight-ttl-s", "0"]
                routers = h.start_fleet(row.replicas, engines, logdir, label=f"r{i}", extra=extra)
                ps = prompts(n_prompts, seed=1000 * run + i)
                results[row.label].append(asyncio.run(run_row(row, engines, routers, ps, pause=0.3)))
            finally:
                h.stop_all([*routers, *engines])
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
                f"{h.med([r.prefilled for r in rs]):.0f}",
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
