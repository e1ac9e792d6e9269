"""Session affinity under overflow: hit rate, TTFT and turn stickiness with affinity on and off.

Run ``python -m bench.affinity`` (``--quick`` for a smoke run under a minute, ``--help``).

The workload is ``bench.routing_quality``'s (multi-turn chats in groups sharing long system prompts,
each turn extending its conversation's history), run hotter: fewer engine slots
(``--max-concurrency``) and more requests in flight, so a turn's first-choice engine is often busy and
the policy's load guard sends it elsewhere. Every turn carries its conversation's session key in the
``x-session-id`` header: ours reads it with ``--session-affinity`` (docs/sessions.md); vllm-router
0.1.17 reads the same header (also ``session-id``, ``x-claude-code-session-id`` or the body's
``session_params.session_id``) for its ``--kv-aware-session-affinity-ttl-secs``.

Rows, each on fresh engines (cold caches) replaying the same seeded schedule:

- ours kv_aware, affinity off / on (``--session-affinity``);
- ours kv_aware without KV events (the index stays empty), affinity off / on: the session memory alone;
- vllm-router kv_aware, affinity off / on (``--kv-aware-session-affinity-ttl-secs 600``), fed the same
  KV event streams.

Figures: hit rate = sum(``usage.prompt_tokens_details.cached_tokens``) / sum(``prompt_tokens``); TTFT
(send to first streamed byte) p50/p99; "stayed" = the share of follow-up turns served by the engine
that served the conversation's previous turn (from the engines' ``X-Engine-Incarnation`` header).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from bench import harness as h
from bench.routing_quality import Params, Turn, body, build_workload, probe_event_plane, reusable_share

# Hotter than routing_quality: 2 slots per engine (8 in all) against 20 requests in flight.
FULL = Params(convs=320, active=40, concurrency=20, engine_slots=2, capacity_blocks=320, seed=11)
QUICK = Params(convs=80, active=32, concurrency=20, engine_slots=2, capacity_blocks=320, seed=11)

ROWS = {
    # name: (label, router kind, extra flags, KV events on)
    "ours-off": ("ours kv_aware, affinity off", "ours", [], True),
    "ours-on": ("ours kv_aware, --session-affinity", "ours", ["--session-affinity"], True),
    # The index blind (no KV event endpoints given): what the session memory covers on its own.
    "blind-off": ("ours kv_aware, no KV events, affinity off", "ours", [], False),
    "blind-on": ("ours kv_aware, no KV events, --session-affinity", "ours", ["--session-affinity"], False),
    "vllm-off": ("vllm-router kv_aware, affinity off", "vllm-router", [], True),
    "vllm-on": (
        "vllm-router kv_aware, --kv-aware-session-affinity-ttl-secs 600",
        "vllm-router",
        ["--kv-aware-session-affinity-ttl-secs", "600"],
        True,
    ),
}


@dataclass
class Result:
    row: str
    wall_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    followups: int = 0  # turns after a conversation's first whose previous turn's engine is known
    stayed: int = 0
    per_engine: Counter = field(default_factory=Counter)
    errors: Counter = field(default_factory=Counter)
    wrong_replies: int = 0
    probe: str = ""
    flags: list[str] = field(default_factory=list)
    session_metrics: str = ""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def stayed_share(self) -> float:
        return self.stayed / self.followups if self.followups else float("nan")


async def replay(
    schedule: list[Turn], p: Params, url: str, incarnations: dict[str, int], res: Result
) -> None:
    client = h.HttpClient(url, quickack=True)
    done = [asyncio.Event() for _ in schedule]
    slots = asyncio.Semaphore(p.concurrency)
    served_by: dict[int, int] = {}  # schedule position -> engine index

    async def one(pos: int, turn: Turn) -> None:
        try:
            raw = client.request_bytes(
                "/v1/completions", body(turn, p, text=False), f"x-session-id: conv-{p.seed}-{turn.conv}\r\n"
            )
            try:
                t0, reply = await client.send(raw, keep_body=True)
            except (h.HttpError, OSError) as e:
                res.errors[type(e).__name__] += 1
                return
            usage = h.read_completion(reply, turn.reply, res)
            if usage is None:
                return
            res.prompt_tokens += usage["prompt_tokens"]
            res.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
            res.ttft_ms.append((reply.t_first - t0) * 1e3)
            engine = incarnations.get((reply.headers or {}).get("x-engine-incarnation", ""), -1)
            res.per_engine[engine] += 1
            served_by[pos] = engine
            if turn.prev >= 0 and served_by.get(turn.prev, -1) >= 0 and engine >= 0:
                res.followups += 1
                res.stayed += served_by[turn.prev] == engine
        finally:
            slots.release()
            done[pos].set()

    t0 = time.perf_counter()
    tasks = []
    for pos, turn in enumerate(schedule):
        if turn.prev >= 0:
            await done[turn.prev].wait()
        await slots.acquire()
        tasks.append(asyncio.create_task(one(pos, turn)))
    await asyncio.gather(*tasks)
    res.wall_s = time.perf_counter() - t0
    client.close()


def session_metrics(router: h.Router) -> str:
    """Ours only: routerfleet_session_selections_total, as state/selection=count."""
    if router.kind != "ours":
        return ""
    st, raw = h.http_get(f"http://{h.HOST}:{router.metrics_port}/metrics")
    if st != 200:
        return ""
    out = []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith("routerfleet_session_selections_total{"):
            labels, _, value = line.rpartition(" ")
            state = labels.split('session_state="', 1)[1].split('"', 1)[0]
            sel = labels.split('selection="', 1)[1].split('"', 1)[0]
            if float(value):
                out.append(f"{state}/{sel}={float(value):.0f}")
    return "sessions " + ", ".join(sorted(out)) if out else ""


def run_row(name: str, schedule: list[Turn], p: Params, logdir: str) -> Result:
    label, kind, extra, events = ROWS[name]
    res = Result(label)
    engines = h.start_engines(p.engines, p.engine_opts(), logdir)
    router = None
    try:
        incarnations = h.engine_incarnations(engines)
        router = h.start_router(
            kind, engines, logdir, policy="kv_aware", label=name, extra=extra, events=events
        )
        res.flags = router.flags
        res.probe = probe_event_plane(router, engines, kv=events)
        asyncio.run(replay(schedule, p, router.url, incarnations, res))
        res.session_metrics = session_metrics(router)
        if not router.alive():
            res.errors["router exited"] += 1
    finally:
        h.stop_all(([router] if router else []) + engines)
    return res


def report(results: dict[str, list[Result]], rows: list[str], p: Params) -> None:
    def cell(rs: list[Result], f, fmt: str, scale: float = 1.0) -> str:
        vals = [scale * f(r) for r in rs]
        return f"{format(h.med(vals), fmt)}{h.spread(vals, fmt)}"

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
        notes += [r.session_metrics for r in rs[-1:] if r.session_metrics]
        out.append(
            [
                ROWS[name][0],
                cell(rs, lambda r: r.hit_rate, ".1f", 100),
                cell(rs, lambda r: h.pct(r.ttft_ms, 50), ".1f"),
                cell(rs, lambda r: h.pct(r.ttft_ms, 99), ".1f"),
                cell(rs, lambda r: r.stayed_share, ".1f", 100),
                cell(rs, lambda r: len(r.ttft_ms) / r.wall_s, ".0f"),
                "/".join(f"{100 * shares[e] / total:.0f}" for e in range(p.engines)),
                "; ".join(notes),
            ]
        )
    header = ["router", "hit rate %", "TTFT p50 ms", "TTFT p99 ms", "stayed %", "req/s", "engine %", "notes"]
    print(h.table(out, header))
    print(
        "  hit rate = sum(cached_tokens) / sum(prompt_tokens), HIGHER is better; TTFT LOWER is better;"
        " stayed = follow-up turns\n  served by their previous turn's engine; medians over runs, (min-max);"
        " sessions = ours' routerfleet_session_selections_total (last run)."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.affinity", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK.convs} conversations, one run (< 1 min)")
    ap.add_argument("--runs", type=int, help="runs per row; medians are reported (default 3, quick 1)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default %(default)s)")
    ap.add_argument("--convs", type=int, help=f"conversations (default {FULL.convs}, quick {QUICK.convs})")
    ap.add_argument("--concurrency", type=int, help=f"requests in flight (default {FULL.concurrency})")
    ap.add_argument("--engine-slots", type=int, help=f"--max-concurrency per engine ({FULL.engine_slots})")
    ap.add_argument("--capacity-blocks", type=int, help=f"blocks per engine ({FULL.capacity_blocks})")
    ap.add_argument("--seed", type=int, help=f"workload seed (default {FULL.seed})")
    ap.add_argument(
        "--max-wait", type=float, help="before each row, wait up to this long for an idle machine"
    )
    ap.add_argument("--json", help="also write the raw per-run figures to this file")
    args = ap.parse_args(argv)

    p = QUICK if args.quick else FULL
    over = {
        "convs": args.convs,
        "concurrency": args.concurrency,
        "engine_slots": args.engine_slots,
        "capacity_blocks": args.capacity_blocks,
        "seed": args.seed,
    }
    p = Params(**{**p.__dict__, **{k: v for k, v in over.items() if v is not None}})
    runs = args.runs or (1 if args.quick else 3)
    max_wait = args.max_wait if args.max_wait is not None else (1.0 if args.quick else 10.0)
    rows = list(dict.fromkeys(r.strip() for r in args.rows.split(",") if r.strip()))
    for r in rows:
        if r not in ROWS:
            ap.error(f"unknown row {r!r}; choose from {', '.join(ROWS)}")
    skipped = {}
    for r in list(rows):
        if ROWS[r][1] == "vllm-router":
            ok, why = h.anchor_status("vllm-router")
            if not ok:
                skipped[r] = why
                rows.remove(r)

    loop = h.use_uvloop()
    t_start = time.perf_counter()
    schedule = build_workload(p)
    n_tokens = sum(len(t.prompt) for t in schedule)
    print(f"# RouterFleet session-affinity bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(f"# {h.machine()}; client loop {loop}")
    ok, why = h.anchor_status("vllm-router")
    print(f"# vllm-router: {why if ok else 'NOT AVAILABLE: ' + why}")
    for r, why in skipped.items():
        print(f"# row {r} skipped: {why}")
    print(
        f"# workload: bench.routing_quality's, {p.convs} conversations in {p.groups} groups, system prompts"
        f" {p.sys_tokens[0]}-{p.sys_tokens[1]} tokens, {p.turns[0]}-{p.turns[1]} turns, {len(schedule)}"
        f" requests, {n_tokens / len(schedule):.0f} prompt tokens on average, seed {p.seed}; an unbounded"
        f" cache would hit {100 * reusable_share(schedule, p.block_size):.1f}%; session key in x-session-id"
    )
    print(
        f"# engines: {p.engines} fake engines, --max-concurrency {p.engine_slots} each"
        f" ({p.engines * p.engine_slots} slots), {p.capacity_blocks} blocks of {p.block_size}, prefill"
        f" {p.prefill_us_per_token:g} us/token, decode {p.decode_tokens_per_s:g} tok/s, --cache-generated;"
        f" client: {p.concurrency} in flight, {p.active} conversations open; runs={runs}"
    )
    logdir = h.logdir("affinity")
    results: dict[str, list[Result]] = {r: [] for r in rows}
    for run in range(runs):
        for name in rows:
            waited, idle = h.wait_quiet(max_wait)
            res = run_row(name, schedule, p, logdir)
            results[name].append(res)
            print(
                f"#   run {run + 1} {name:>8}: hit {100 * res.hit_rate:5.1f}%, TTFT p50"
                f" {h.pct(res.ttft_ms, 50):6.1f} p99 {h.pct(res.ttft_ms, 99):6.1f} ms, stayed"
                f" {100 * res.stayed_share:5.1f}%, {len(res.ttft_ms)} ok, {sum(res.errors.values())} errors,"
                f" {res.wall_s:.1f}s; idle {100 * idle:.0f}% after {waited:.0f}s"
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
                    "stayed_share": r.stayed_share,
                    "requests": len(r.ttft_ms),
                    "wall_s": r.wall_s,
                    "errors": dict(r.errors),
                    "per_engine": dict(r.per_engine),
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
