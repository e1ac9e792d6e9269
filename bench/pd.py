"""Prefill/decode disaggregation: TTFT, throughput and KV transferred, with the decider on and off.

Run ``python -m bench.pd`` (``--quick`` for a smoke run under a minute, ``--help``).

Fake engines serving vLLM's disaggregated prefill (``--kv-transfer``: a prefill leg answers the
transfer parameters, a decode leg pulls the blocks it lacks at ``--transfer-us-per-block`` each, then
decodes at ``--decode-tokens-per-s``; a prefill costs ``--prefill-us-per-token`` per uncached token,
wherever it runs), or SGLang's (``--disaggregation-mode``: both legs at once, paired by a bootstrap
room; a decode engine cannot prefill by itself). The workload: conversations in groups sharing a long
system prompt, each turn adding a user message and an answer to the conversation's prompt (text,
streamed completions), ``--concurrency`` conversations at a time. Rows (fresh engines and router each):

- ``colocated``: the same number of engines, every one whole (no disaggregation), our kv_aware router;
- ``ours``: half prefill, half decode engines; a remote prefill only when the decode engine's uncached
  suffix reaches ``--pd-threshold-tokens`` (the default 512) and a prefill engine would start it no
  later than the decode engine;
- ``ours, always remote``: the same with ``--pd-threshold-tokens 0`` (every request prefilled remotely,
  as a router without the decider does);
- ``Envoy + ours (picker)``: the ``ours`` fleet behind real Envoy, our router its endpoint picker: the
  pick names the decode engine and, when it pays, the prefill engine (``x-prefiller-host-port``) for
  the decode engines' fake playing llm-d's routing sidecar (``--pd-sidecar``), which runs the prefill
  leg first;
- ``vllm-router``: vllm-router in its P/D mode (``--vllm-pd-disaggregation``, NIXL's flow, cache_aware
  for both roles) over the same prefill and decode engines;
- SGLang: ours (``--pd-protocol sglang``: every request prefilled remotely, both engines by what they
  hold) and sglang-router in its P/D mode (``--pd-disaggregation``, cache_aware).

The engines share their compute (``--shared-compute``: a rank prefills one prompt at a time and its
streams wait while it does; ``--alone-compute`` turns it off). Figures, medians over runs (min-max):
TTFT p50/p99 client-side (send to the first streamed byte), output tokens/s, remote prefills per
request and blocks transferred (the engines' own counters).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, replace

import aiohttp

from bench import harness as h

ENGINES = 4
BLOCK = 16


@dataclass(frozen=True)
class Workload:
    groups: int = 8
    system_tokens: int = 2048
    conversations: int = 48
    turns: int = 6
    user_tokens: int = 64
    answer_tokens: int = 32
    concurrency: int = 12
    seed: int = 1


@dataclass(frozen=True)
class Row:
    label: str
    protocol: str  # the engines' disaggregation ("": none, every engine whole)
    extra: tuple[str, ...] = ()
    kind: str = "ours"  # or an anchor in its P/D mode


ROWS = (
    Row("colocated", ""),
    Row("vLLM: ours", "vllm"),
    Row("vLLM: ours, always remote", "vllm", ("--pd-threshold-tokens", "0")),
    Row("vLLM: Envoy + ours (picker), llm-d's sidecar", "vllm", kind="ours-epp"),
    Row("vLLM: vllm-router", "vllm", kind="vllm-router"),
    Row("SGLang: ours", "sglang", ("--pd-protocol", "sglang")),
    Row("SGLang: sglang-router", "sglang", kind="sglang-router"),
)


def anchor_argv(
    kind: str, prefill: list[h.Engine], decode: list[h.Engine], port: int, metrics: int
) -> list[str]:
    """An anchor in its P/D mode over the engines, its cache-aware policy for both roles."""
    if kind == "vllm-router":  # vLLM's KV-connector flow (NIXL: the decode engine pulls)
        argv = [str(h.BIN / "vllm-router"), "--vllm-pd-disaggregation", "--policy", "cache_aware"]
        argv += [a for e in prefill for a in ("--prefill", e.url)]
        level = "warning"
    elif kind == "sglang-router":  # a bootstrap room; the fake's bootstrap server is its HTTP port
        argv = [str(h.BIN / "sglang-router"), "launch", "--pd-disaggregation", "--policy", "cache_aware"]
        argv += [a for e in prefill for a in ("--prefill", e.url, str(e.port))]
        level = "warn"
    else:
        raise ValueError(kind)
    argv += [a for e in decode for a in ("--decode", e.url)]
    argv += ["--host", h.HOST, "--port", str(port), "--prometheus-host", h.HOST]
    return [*argv, "--prometheus-port", str(metrics), "--log-level", level]


def start_engines(row: Row, opts: h.EngineOpts, logdir: str) -> tuple[list[h.Engine], list[h.Engine]]:
    """(prefill, decode) engines for the row; colocated: no prefill engines."""
    if not row.protocol:
        return [], h.start_engines(ENGINES, opts, logdir)
    sglang = row.protocol == "sglang"
    started: list[h.Engine] = []
    try:
        for role, n in (("prefill", ENGINES // 2), ("decode", ENGINES - ENGINES // 2)):
            mode = role if sglang else ""
            sidecar = role == "decode" and row.kind == "ours-epp"  # the picker names the prefill to it
            started += h.start_engines(
                n, replace(opts, kv_transfer=not sglang, disaggregation_mode=mode, pd_sidecar=sidecar), logdir
            )
    except BaseException:
        h.stop_all(started)
        raise
    return started[: ENGINES // 2], started[ENGINES // 2 :]


def start(row: Row, prefill: list[h.Engine], decode: list[h.Engine], logdir: str, label: str) -> h.Router:
    engines = [*prefill, *decode]
    keys = [f"role=prefill,bootstrap={e.port}" for e in prefill]
    keys += ["role=decode" if prefill else ""] * len(decode)
    if row.kind == "ours":
        return h.start_router(
            "ours", engines, logdir, label=label, extra=list(row.extra), block_size=BLOCK, worker_keys=keys
        )
    if row.kind == "ours-epp":  # Envoy sends each request to the decode engine the picker names
        return h.start_pickers(  # ours_argv's block size is BLOCK
            engines,
            logdir,
            [list(row.extra)],
            policy="kv_aware",
            label=label,
            cpus=None,
            worker_keys=keys,
            pool=decode,
        )[0]
    port, metrics = h.free_ports(2)
    argv = anchor_argv(row.kind, prefill, decode, port, metrics)
    proc = h.Proc(label, argv, logdir, env=h.ANCHOR_ENV)
    router = h.Router(
        row.kind, label, proc, port, h.shown_flags(argv, engines), "/health", metrics_port=metrics
    )
    h.await_router(router)
    return router


@dataclass
class Result:
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float
    remote_per_request: float
    transferred_blocks: int
    requests: int


def conversations(w: Workload) -> list[list[list[int]]]:
    """Each conversation's prompts, turn by turn: its group's system prompt, then every earlier user
    message and answer, then this turn's message (an answer stands in for the engine's: the earlier
    prompt stays a prefix of the next, which is all the caches see)."""
    rng = random.Random(w.seed)
    systems = [[rng.randrange(32, 127) for _ in range(w.system_tokens)] for _ in range(w.groups)]
    out = []
    for c in range(w.conversations):
        history = list(systems[c % w.groups])
        prompts = []
        for _ in range(w.turns):
            history += [rng.randrange(32, 127) for _ in range(w.user_tokens)]
            prompts.append(list(history))
            history += [rng.randrange(32, 127) for _ in range(w.answer_tokens)]
        out.append(prompts)
    return out


def counters(engines: list[h.Engine]) -> tuple[int, int, int]:
    """(requests, prefill legs, received blocks) over the engines' own counters."""
    requests = legs = received = 0
    for e in engines:
        _, text = h.http_get(e.url + "/metrics")
        for line in text.decode().splitlines():
            value = int(float(line.rsplit(" ", 1)[1])) if line and not line.startswith("#") else 0
            if line.startswith("routerfleet_fake_engine_requests_total{"):
                requests += value
            elif line.startswith("routerfleet_fake_engine_pd_legs_total{") and 'leg="prefill"' in line:
                legs += value
            elif line.startswith("routerfleet_fake_engine_pd_received_blocks_total{"):
                received += value
    return requests, legs, received


async def replay(url: str, convs: list[list[list[int]]], w: Workload) -> tuple[list[float], int, float]:
    """The conversations through ``url``, ``w.concurrency`` at a time: TTFTs (ms), requests, seconds."""
    ttfts: list[float] = []
    queue = list(convs)
    sent = 0

    async def worker(s: aiohttp.ClientSession) -> None:
        nonlocal sent
        while queue:
            for prompt in queue.pop():
                # Text (sglang-router takes no token IDs), one byte per token (the engines' tokenizer).
                text = "".join(map(chr, prompt))
                body = {"model": h.MODEL, "prompt": text, "max_tokens": w.answer_tokens, "stream": True}
                ttfts.append((await h.streamed(s, url + "/v1/completions", body))[0])
                sent += 1

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await asyncio.gather(*(worker(s) for _ in range(w.concurrency)))
    return ttfts, sent, time.perf_counter() - t0


def run_row(row: Row, w: Workload, opts: h.EngineOpts, logdir: str, label: str) -> Result:
    prefill, decode = start_engines(row, opts, logdir)
    engines = [*prefill, *decode]
    router = None
    try:
        router = start(row, prefill, decode, logdir, label)
        before = counters(engines)
        ttfts, sent, seconds = asyncio.run(replay(router.url, conversations(w), w))
        after = counters(engines)
    finally:
        h.stop_all([*([router] if router else []), *engines])
    return Result(
        h.pct(ttfts, 50),
        h.pct(ttfts, 99),
        sent * w.answer_tokens / seconds,
        (after[1] - before[1]) / sent,
        after[2] - before[2],
        sent,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pd", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one run, 16 conversations (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs; medians are reported (default 3, quick 1)")
    ap.add_argument("--conversations", type=int, help="conversations per row (default 48, quick 16)")
    ap.add_argument("--prefill-us-per-token", type=float, default=20.0, help="prefill cost (default 20)")
    ap.add_argument("--transfer-us-per-block", type=float, default=100.0, help="pull cost (default 100)")
    ap.add_argument("--decode-tokens-per-s", type=float, default=500.0, help="decode rate (default 500)")
    ap.add_argument("--max-concurrency", type=int, default=8, help="running slots per engine (default 8)")
    ap.add_argument(
        "--alone-compute",
        action="store_true",
        help="every request computes alone (the fake's default; before 2026-12-08 the bench's): no prefill"
        " queues behind another, no decode stalls while its engine prefills",
    )
    args = ap.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    w = Workload(conversations=args.conversations or (16 if args.quick else 48))
    opts = h.EngineOpts(
        block_size=BLOCK,
        capacity_blocks=65536,
        prefill_us_per_token=args.prefill_us_per_token,
        decode_tokens_per_s=args.decode_tokens_per_s,
        max_concurrency=args.max_concurrency,
        shared_compute=not args.alone_compute,
        transfer_us_per_block=args.transfer_us_per_block,
    )
    logdir = h.logdir("pd")
    print(f"# RouterFleet P/D bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(
        f"# {h.machine()}; {ENGINES} fake engines (P/D rows: {ENGINES // 2} prefill, {ENGINES - ENGINES // 2}"
        f" decode), {w.conversations} conversations x {w.turns} turns in {w.groups} groups,"
        f" {w.system_tokens}-token system prompts, {w.user_tokens}-token messages, {w.answer_tokens}-token"
        f" answers, {w.concurrency} at a time; prefill {args.prefill_us_per_token:g} us/token, transfer"
        f" {args.transfer_us_per_block:g} us/block of {BLOCK}, decode {args.decode_tokens_per_s:g} tokens/s,"
        f" {args.max_concurrency} slots per engine, {'alone' if args.alone_compute else 'shared'} compute;"
        f" runs={runs}"
    )
    results: dict[str, list[Result]] = {r.label: [] for r in ROWS}
    t_start = time.perf_counter()
    for run in range(runs):
        for i, row in enumerate(ROWS):
            results[row.label].append(run_row(row, w, opts, logdir, f"r{run}-{i}"))
        print(f"# run {run + 1}/{runs} done at {time.perf_counter() - t_start:.0f}s", flush=True)
    table = []
    for row in ROWS:
        rs = results[row.label]
        table.append(
            [
                row.label,
                h.cell([r.ttft_p50_ms for r in rs], ".1f"),
                h.cell([r.ttft_p99_ms for r in rs], ".0f"),
                h.cell([r.tokens_per_s for r in rs], ".0f"),
                h.cell([r.remote_per_request for r in rs], ".2f"),
                h.cell([float(r.transferred_blocks) for r in rs], ".0f"),
            ]
        )
    header = [
        "row",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "output tokens/s",
        "remote prefills/request",
        "blocks moved",
    ]
    print(h.table(table, header))
    print(f"# logs: {logdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
