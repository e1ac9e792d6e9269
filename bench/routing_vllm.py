"""Routing quality on real vLLM: ``python -m bench.routing_quality --engines vllm`` (``--quick``, ``--runs``).

Two vLLM engines (the CPU build serving the tiny Qwen3 model, e2e/vllm) replay one seeded chat workload
through each row's routers; rows share the engines, whose caches are reset between rows
(``/reset_prefix_cache``, then one request each so vLLM announces the reset before the next row's
routers replay its stream). Rows:

- ours: ``routerfleet-router --policy kv_aware --tokenizer MODEL_DIR --chat-family vllm``, 1 replica and
  3 (the client alternating per request, the replicas static peers with a fleet token);
- round-robin, the floor: ours with ``--policy round_robin``;
- vllm-router ``--policy kv_aware`` on the same event streams;
- the ceiling: per request, the block-aligned longest prefix that any request sent before it carries
  (by vLLM's own tokenization: ``/tokenize``), capped by vLLM's rule (never the last token): no engine
  can hold more of it. Caches never fill here, so a router at the ceiling misses nothing it could hit.

Requests per engine come from the engines' own ``vllm:request_success_total``.

Hit rate = sum of vLLM's ``cached_tokens`` over the sum of ``prompt_tokens``. Each conversation's turns go
in order; assistant turns in the history are fixed text (the same for every row), the model's own
replies (random weights) are discarded. The engines bind their KV sockets on every interface, so the
bench runs itself in a private network namespace (e2e/cluster/netns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import harness as h
from e2e import vllm

CONCURRENCY = 4  # requests in flight: two CPU engines saturate at about this


@dataclass(frozen=True)
class Workload:
    convs: int = 48
    groups: int = 8
    sys_words: tuple[int, int] = (200, 400)
    user_words: tuple[int, int] = (10, 60)
    reply_words: tuple[int, int] = (10, 40)
    turns: tuple[int, int] = (2, 5)
    seed: int = 11


QUICK = Workload(convs=16, groups=4)


def _words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8))) for _ in range(n))


def conversations(w: Workload) -> list[list[dict]]:
    """Each conversation's requests (message lists), in order; conversations of a group share its
    system prompt."""
    rng = random.Random(w.seed)
    systems = [f"System prompt {g}. " + _words(rng, rng.randint(*w.sys_words)) for g in range(w.groups)]
    out = []
    for _ in range(w.convs):
        messages = [{"role": "system", "content": rng.choice(systems)}]
        turns = []
        for _ in range(rng.randint(*w.turns)):
            messages = [*messages, {"role": "user", "content": _words(rng, rng.randint(*w.user_words))}]
            turns.append(messages)
            messages = [*messages, {"role": "assistant", "content": _words(rng, rng.randint(*w.reply_words))}]
        out.append(turns)
    return out


@dataclass
class Result:
    row: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ceiling_tokens: int = 0
    errors: int = 0
    per_engine: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")

    @property
    def ceiling(self) -> float:
        return self.ceiling_tokens / self.prompt_tokens if self.prompt_tokens else float("nan")


class Ceiling:
    """The block chains of every prompt sent so far: a request's ceiling is its longest chain already
    here (a prompt is cached whole once computed, and the cache never fills in this bench)."""

    def __init__(self, block: int) -> None:
        self.block, self.chains = block, set()

    def _keys(self, ids: list[int], limit: int) -> list[int]:
        keys, key = [], 0
        for i in range(0, limit // self.block * self.block, self.block):
            key = hash((key, tuple(ids[i : i + self.block])))
            keys.append(key)
        return keys

    def reusable(self, ids: list[int]) -> int:
        n = 0
        for key in self._keys(ids, len(ids) - 1):  # vLLM computes the last token
            if key not in self.chains:
                break
            n += 1
        return n * self.block

    def add(self, ids: list[int]) -> None:
        self.chains.update(self._keys(ids, len(ids)))


async def _replay(
    convs: list[list[dict]], urls: list[str], engines: list[vllm.VllmEngine], res: Result
) -> None:
    ceiling = Ceiling(vllm.BLOCK_SIZE)
    slots = asyncio.Semaphore(CONCURRENCY)
    sent = 0

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:

        async def tokens(messages: list[dict]) -> list[int]:
            async with s.post(
                engines[0].url + "/tokenize", json={"model": vllm.MODEL, "messages": messages}
            ) as r:
                return (await r.json())["tokens"]

        async def conversation(turns: list[list[dict]]) -> None:
            nonlocal sent
            for messages in turns:
                async with slots:
                    ids = await tokens(messages)
                    reusable = ceiling.reusable(ids)
                    ceiling.add(ids)
                    url = urls[sent % len(urls)]
                    sent += 1
                    body = {"model": vllm.MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
                    async with s.post(url + "/v1/chat/completions", json=body) as r:
                        if r.status != 200:
                            res.errors += 1
                            continue
                        answer = await r.json()
                    usage = answer["usage"]
                    res.prompt_tokens += usage["prompt_tokens"]
                    res.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    res.ceiling_tokens += reusable

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in convs))
        res.wall_s = time.perf_counter() - t0


def _served(engines: list[vllm.VllmEngine]) -> dict[str, float]:
    """Requests each engine has finished, by its own metrics."""
    out = {}
    for e in engines:
        text = h.http_get(e.url + "/metrics")[1].decode()
        out[e.name] = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:request_success_total")
        )
    return out


def _reset(engines: list[vllm.VllmEngine]) -> None:
    """Every engine's cache dropped, and the drop announced (vLLM publishes AllBlocksCleared with its
    next step, which a one-token request makes): a new router replaying the stream sees it."""
    for e in engines:
        assert h.http_post(e.url + "/reset_prefix_cache", {})[0] == 200
        body = {"model": vllm.MODEL, "prompt": [secrets.randbelow(1000) + 100], "max_tokens": 1}
        assert h.http_post(e.url + "/v1/completions", body)[0] == 200
    time.sleep(0.5)


ROWS = {  # bench/routing_quality.py's VLLM_ROWS names them for --rows
    # name: (label, router kind, policy, replicas)
    "ours": ("ours kv_aware", "ours", "kv_aware", 1),
    "ours-x3": ("ours kv_aware x3 (per request)", "ours", "kv_aware", 3),
    "vllm": ("vllm-router kv_aware", "vllm-router", None, 1),
    "rr": ("round-robin (floor)", "ours", "round_robin", 1),
}


def run_row(
    name: str, convs: list[list[dict]], engines: list[vllm.VllmEngine], home: Path, logdir: str
) -> Result:
    label, kind, policy, replicas = ROWS[name]
    _reset(engines)
    res = Result(label)
    model = str(home / "model")
    engine = {"block_size": vllm.BLOCK_SIZE, "model": vllm.MODEL}
    if kind == "ours":
        extra = ("--tokenizer", model, "--chat-family", "vllm")
        routers = h.start_fleet(
            replicas, engines, logdir, kind=kind, policy=policy, label=name, extra=extra, **engine
        )
    else:
        routers = [h.start_router(kind, engines, logdir, label=name, **engine)]
    try:
        before = _served(engines)
        asyncio.run(_replay(convs, [r.url for r in routers], engines, res))
        res.per_engine = {k: round(v - before[k]) for k, v in _served(engines).items()}
    finally:
        h.stop_all(routers)
    return res


def main(quick: bool, runs: int | None, rows: list[str] | None) -> int:
    home = vllm.install()  # before the network namespace: the install needs the registry
    from e2e.cluster import reexec_in_netns

    reexec_in_netns()
    w = QUICK if quick else Workload()
    runs = runs or (1 if quick else 3)
    rows = rows or list(ROWS)
    convs = conversations(w)
    logdir = tempfile.mkdtemp(prefix="routing-vllm-")
    print(f"[routing_vllm] {w}, {runs} run(s), rows {rows}; logs in {logdir}", file=sys.stderr)
    engines = vllm.start_engines(2, Path(logdir), home)
    results: dict[str, list[Result]] = {r: [] for r in rows}
    try:
        for run in range(runs):
            for row in rows:
                res = run_row(row, convs, engines, home, logdir)
                results[row].append(res)
                print(
                    f"[routing_vllm] run {run + 1} {res.row}: hit {res.hit_rate:.3f}"
                    f" ceiling {res.ceiling:.3f} errors {res.errors} per engine {res.per_engine}"
                    f" ({res.wall_s:.0f}s)",
                    file=sys.stderr,
                )
    finally:
        for e in engines:
            with contextlib.suppress(Exception):
                e.stop()
    print(
        f"\nRouting quality on real vLLM (2 CPU engines, tiny Qwen3, block {vllm.BLOCK_SIZE}): {w},"
        f" medians of {runs}\n"
    )
    print("| row | hit rate | ceiling | x ceiling | errors | requests per engine |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        rs = results[row]
        hit = statistics.median(r.hit_rate for r in rs)
        ceil = statistics.median(r.ceiling for r in rs)
        per = " / ".join(str(rs[-1].per_engine.get(e.name, 0)) for e in engines)
        errors = sum(r.errors for r in rs)
        print(f"| {rs[0].row} | {hit:.3f} | {ceil:.3f} | {hit / ceil:.3f} | {errors} | {per} |")
    return 0
