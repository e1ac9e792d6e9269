"""LoRA adapters: does a request for an adapter go where the adapter is loaded, or pay a load?

Run ``python -m bench.lora`` (``--quick`` for a smoke run under a minute, ``--help``).

4 fake engines, each with 2 adapter slots (``--max-loras 2``, least recently used out) and
``--lora-load-ms`` to load an adapter that is not resident; their ``/metrics`` report the adapters
running and waiting as vLLM's ``vllm:lora_requests_info`` does, which our routers read. The workload:
requests over 8 adapters (uniformly at random, seeded), each prompt its own (~512 tokens: no cached
prefix pulls a request anywhere), ``--concurrency`` in flight. Through 1 router or 3 replicas as the
operator deploys them, request k going to replica k mod 3. Rows: affinity off
(``--lora-load-cost-tokens 0``: LoRA-blind, the request hash spreads them) and on (the default).

Figures, medians over runs (min-max): adapter loads per request (the engines' own counters), TTFT
p50/p99 client-side (send to first streamed byte), and each engine's share of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

import aiohttp

from bench import harness as h

ENGINES = 4
ADAPTERS = 8
SLOTS = 2
PROMPT_TOKENS = 512
MODES = {"blind": ["--lora-load-cost-tokens", "0"], "affinity": []}


@dataclass
class Result:
    loads_per_request: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    shares: list[float]


def counters(engine: h.Engine) -> tuple[int, int]:
    """(adapter loads, requests) the engine has counted so far."""
    _, text = h.http_get(engine.url + "/metrics")
    loads = requests = 0
    for line in text.decode().splitlines():
        if line.startswith("routerfleet_fake_engine_lora_loads_total "):
            loads += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("routerfleet_fake_engine_requests_total{"):
            requests += int(float(line.rsplit(" ", 1)[1]))
    return loads, requests


async def run_row(routers: list[h.Router], engines: list[h.Engine], n: int, concurrency: int, seed: int):
    rng = random.Random(seed)
    work = [
        (rng.randrange(ADAPTERS), [rng.randrange(32, 127) for _ in range(PROMPT_TOKENS)]) for _ in range(n)
    ]
    urls = [r.url for r in routers]
    ttfts: list[float] = []
    queue = list(enumerate(work))
    before = [counters(e) for e in engines]

    async def worker(s: aiohttp.ClientSession) -> None:
        while queue:
            k, (adapter, prompt) = queue.pop(0)
            body = {
                "model": h.MODEL,
                "prompt": prompt,
                "max_tokens": 8,
                "stream": True,
                "lora_name": f"adapter-{adapter}",
            }
            ttfts.append((await h.streamed(s, urls[k % len(urls)] + "/v1/completions", body))[0])

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    after = [counters(e) for e in engines]
    loads = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    served = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    return Result(loads / n, h.pct(ttfts, 50), h.pct(ttfts, 99), [100 * x / n for x in served])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.lora", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run, 200 requests (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs; medians are reported (default 3, quick 1)")
    ap.add_argument("--requests", type=int, help="requests per row (default 1000, quick 200)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--replicas", default="1,3", help="router replicas, a comma list (default 1,3)")
    ap.add_argument(
        "--lora-load-ms", type=float, default=20.0, help="the engines' time to load an adapter (default 20)"
    )
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    n = args.requests or (200 if args.quick else 1000)
    replicas = [int(r) for r in args.replicas.split(",")]
    rows = [(r, mode) for r in replicas for mode in MODES]
    label = {row: f"{row[0]} {'replica' if row[0] == 1 else 'replicas'}, {row[1]}" for row in rows}
    logdir = h.logdir("lora")
    print(f"# RouterFleet LoRA bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(
        f"# {h.machine()}; {ENGINES} fake engines x {SLOTS} adapter slots, {args.lora_load_ms:g} ms a load;"
        f" {ADAPTERS} adapters, {n} requests of {PROMPT_TOKENS} tokens, {args.concurrency} in flight,"
        f" runs={runs}"
    )
    opts = h.EngineOpts(
        prefill_us_per_token=5.0, decode_tokens_per_s=2000.0, max_loras=SLOTS, lora_load_ms=args.lora_load_ms
    )
    results: dict[tuple[int, str], list[Result]] = {row: [] for row in rows}
    t_start = time.perf_counter()
    for run in range(runs):
        for i, row in enumerate(rows):
            with h.fleet_over_engines(ENGINES, opts, row[0], logdir, label=f"r{i}", extra=MODES[row[1]]) as (
                engines,
                routers,
            ):
                results[row].append(asyncio.run(run_row(routers, engines, n, args.concurrency, 100 * run)))
        print(f"# run {run + 1}/{runs} done at {time.perf_counter() - t_start:.0f}s", flush=True)
    table = []
    for row in rows:
        rs = results[row]
        loads = [r.loads_per_request for r in rs]
        table.append(
            [
                label[row],
                f"{h.med(loads):.3f}{h.spread(loads, '.3f')}",
                f"{h.med([r.ttft_p50_ms for r in rs]):.1f}",
                f"{h.med([r.ttft_p99_ms for r in rs]):.1f}",
                "/".join(f"{h.med([r.shares[e] for r in rs]):.0f}" for e in range(ENGINES)),
            ]
        )
    print()
    header = ["row", "adapter loads per request", "TTFT p50 ms", "TTFT p99 ms", "engine shares %"]
    print(h.table(table, header))
    return 0


if __name__ == "__main__":
    sys.exit(main())
