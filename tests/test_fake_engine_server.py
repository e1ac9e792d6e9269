"""The fake engine over real sockets: HTTP via aiohttp, KV events via real ZMQ SUB and DEALER sockets.

Every engine binds 127.0.0.1 on free ports (``run_fake_engine``'s defaults), so tests run in parallel.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from router_runtime.kv.decode import MalformedFrame, decode_batch, parse_pub_message, parse_replay_reply
from router_runtime.kv.events import BlockRemoved, BlockStored, Dialect, EventBatch
from router_runtime.tokens import encode, tokenize_chat
from routerfleet_fake_engine import FakeEngine, run_fake_engine
from routerfleet_fake_engine.cache import RankCache
from routerfleet_fake_engine.hashing import block_hashes

BS = 4
FAST = {"block_size": BS, "prefill_us_per_token": 0.0, "decode_tokens_per_s": 0.0}
TIMEOUT = 5.0


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        yield session


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with run_fake_engine(**FAST) as e:
        yield e


async def subscribe(ctx: zmq.asyncio.Context, endpoint: str, topic: bytes = b"") -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    await asyncio.sleep(0.2)  # ZMQ slow joiner: the subscription must reach the PUB before it sends
    return sub


async def recv_batch(sub: zmq.asyncio.Socket) -> tuple[bytes, int, EventBatch]:
    topic, seq, payload = parse_pub_message(await asyncio.wait_for(sub.recv_multipart(), TIMEOUT))
    return topic, seq, decode_batch(payload)


async def assert_no_message(sub: zmq.asyncio.Socket, wait: float = 0.15) -> None:
    assert await sub.poll(int(wait * 1000)) == 0, "unexpected message on the PUB stream"


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int) -> tuple[list[list[bytes]], list[int]]:
    """Send one replay request over a DEALER; return the raw replies and the replayed seqs."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        raw: list[list[bytes]] = []
        seqs: list[int] = []
        while True:
            frames = await asyncio.wait_for(dealer.recv_multipart(), TIMEOUT)
            raw.append(frames)
            parsed = parse_replay_reply(frames)
            if parsed is None:
                return raw, seqs
            seqs.append(parsed[0])
            decode_batch(parsed[1])  # every replayed payload decodes
    finally:
        dealer.close(0)


async def post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as r:
        return r.status, await r.json()


async def sse(http: aiohttp.ClientSession, url: str, body: dict) -> list[Any]:
    async with http.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = await r.text()
    events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in text.split("\n\n") if block)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------------- completions


async def test_completion_text_non_stream_and_cached_tokens_grow(engine: FakeEngine, http) -> None:
    url = engine.http_url + "/v1/completions"
    prompt = "x" * 10  # 2 full blocks + 2 tokens
    status, first = await post(http, url, {"prompt": prompt, "max_tokens": 5})
    assert status == 200
    assert first["object"] == "text_completion"
    assert len(first["choices"][0]["text"]) == 5 and first["choices"][0]["finish_reason"] == "length"
    assert first["usage"] == {
        "prompt_tokens": 10,
        "completion_tokens": 5,
        "total_tokens": 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    _, second = await post(http, url, {"prompt": prompt, "max_tokens": 5})
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # deterministic
    _, longer = await post(http, url, {"prompt": prompt + "yyyyyy", "max_tokens": 1})
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    _, again = await post(http, url, {"prompt": prompt + "yyyyyy", "max_tokens": 1})
    # all 16 tokens cached, but the last is computed (as in vLLM): its block is no hit
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 12


async def test_completion_token_list_forms_share_cache(engine: FakeEngine, http) -> None:
    url = engine.http_url + "/v1/completions"
    ids = list(range(300, 308))
    _, r1 = await post(http, url, {"prompt": ids, "max_tokens": 2})
    _, r2 = await post(http, url, {"prompt": [ids], "max_tokens": 2})
    _, r3 = await post(http, url, {"prompt": ["ab"], "max_tokens": 2})
    assert r1["usage"]["prompt_tokens"] == 8 and r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == 4  # the last token's block: computed
    assert r3["usage"]["prompt_tokens"] == 2


async def test_completion_stream_chunks_and_usage(engine: FakeEngine, http) -> None:
    url = engine.http_url + "/v1/completions"
    body = {"prompt": "hello world!", "max_tokens": 4}
    chunks = await sse(http, url, body)
    assert len(chunks) == 4
    assert all(c["object"] == "text_completion" and len(c["choices"][0]["text"]) == 1 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert not any("usage" in c for c in chunks)  # as vLLM and SGLang: no usage unless asked
    _, full = await post(http, url, body)
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    # include_usage adds OpenAI's usage-only chunk after the finishing one
    asked = {**body, "stream_options": {"include_usage": True}}
    chunks = await sse(http, url, asked)
    # 12 tokens cached, the last block (the last token's) computed
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and not any("usage" in c for c in chunks[:-1])
    # zero tokens: still one finishing chunk, then the usage
    chunks = await sse(http, url, {**asked, "max_tokens": 0})
    assert len(chunks) == 2 and chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[1]["usage"]["completion_tokens"] == 0


async def test_chat_non_stream_and_stream(engine: FakeEngine, http) -> None:
    url = engine.http_url + "/v1/chat/completions"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    status, full = await post(http, url, {"messages": messages, "max_tokens": 3})
    assert status == 200 and full["object"] == "chat.completion"
    assert full["choices"][0]["message"]["role"] == "assistant"
    assert len(full["choices"][0]["message"]["content"]) == 3
    n_prompt = len(tokenize_chat(messages))
    assert full["usage"]["prompt_tokens"] == n_prompt
    chunks = await sse(
        http, url, {"messages": messages, "max_tokens": 3, "stream_options": {"include_usage": True}}
    )
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    usage = chunks.pop()["usage"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert (
        "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        == full["choices"][0]["message"]["content"]
    )
    assert usage["prompt_tokens_details"]["cached_tokens"] == n_prompt // BS * BS
    # the same chat sent as a completion of the rendered tokens hits the same blocks
    _, as_completion = await post(
        http, engine.http_url + "/v1/completions", {"prompt": tokenize_chat(messages), "max_tokens": 1}
    )
    assert as_completion["usage"]["prompt_tokens_details"]["cached_tokens"] == n_prompt // BS * BS


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b"{not json", None),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -2}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "data_parallel_rank": 1}, "data_parallel_rank"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/admin/store", {"token_ids": "abc"}, "token_ids"),
        ("/admin/store", {"token_ids": [1, 2, 3, 4], "medium": "CPU"}, "medium"),  # no host tier
        ("/admin/skip_seq", {"n": 0}, "n"),
        ("/admin/publish_raw", {"payload_hex": "zz"}, "payload_hex"),
        ("/admin/clear", {"rank": 3}, "rank"),
    ],
)
async def test_bad_requests_get_openai_error_shape(engine: FakeEngine, http, path, body, param) -> None:
    kw = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(engine.http_url + path, **kw) as r:
        assert r.status == 400
        err = await r.json()
    assert set(err) == {"error"}
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param
    assert err["error"]["message"]


async def test_info_endpoints(http) -> None:
    async with run_fake_engine(dp_size=2, dialect=Dialect.SGLANG, topic="kv-topic", **FAST) as engine:
        async with http.get(engine.http_url + "/health") as r:
            assert r.status == 200
        async with http.get(engine.http_url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == engine.config.model
        async with http.get(engine.http_url + "/server_info") as r:
            info = await r.json()
        kv = info["kv_events"]
        assert kv == {
            "publisher": "zmq",
            "endpoint_host": "127.0.0.1",
            "endpoint_port_base": engine.publisher.kv_port_base,
            "replay_port_base": engine.publisher.replay_port_base,
            "topic": "kv-topic",
            "block_size": BS,
            "dp_size": 2,
            "dialect": "sglang",
        }
        assert engine.kv_endpoint(1).endswith(f":{kv['endpoint_port_base'] + 1}")
        assert engine.replay_endpoint(1).endswith(f":{kv['replay_port_base'] + 1}")
        assert info["incarnation"] == engine.incarnation and info["model"] == engine.config.model
        await post(http, engine.http_url + "/v1/completions", {"prompt": "abcdabcd", "data_parallel_rank": 1})
        await post(http, engine.http_url + "/v1/completions", {"prompt": "abcdabcd", "data_parallel_rank": 1})
        async with http.get(engine.http_url + "/metrics") as r:
            metrics = await r.text()
    assert 'routerfleet_fake_engine_requests_total{endpoint="completion",rank="1"} 2.0' in metrics
    assert 'routerfleet_fake_engine_cached_tokens_total{rank="1"} 4.0' in metrics  # the last block computed
    assert 'routerfleet_fake_engine_prompt_tokens_total{rank="1"} 16.0' in metrics
    assert 'routerfleet_fake_engine_blocks_resident{rank="1",tier="device"} 2.0' in metrics
    assert 'routerfleet_fake_engine_blocks_resident{rank="0",tier="device"} 0.0' in metrics
    assert 'routerfleet_fake_engine_kv_events_total{event="BlockStored",rank="1"} 1.0' in metrics
    assert 'routerfleet_fake_engine_kv_batches_total{rank="1"} 1.0' in metrics


# ---------------------------------------------------------------------------------------- KV events


async def test_pub_stream_contiguous_seq_and_matches_state(engine: FakeEngine, http, ctx) -> None:
    sub = await subscribe(ctx, engine.kv_endpoint(0))
    url = engine.http_url + "/v1/completions"
    prompts = ["aaaabbbb", "aaaabbbbcccc", "zzzz"]
    for p in prompts:
        await post(http, url, {"prompt": p, "max_tokens": 1})
    await post(http, url, {"prompt": "zzzz", "max_tokens": 1})  # full hit: no events, no batch
    got = [await recv_batch(sub) for _ in prompts]
    await assert_no_message(sub)
    assert [seq for _, seq, _ in got] == [0, 1, 2]
    assert all(topic == b"" and batch.data_parallel_rank == 0 for topic, _, batch in got)
    (second,) = got[1][2].events
    assert isinstance(second, BlockStored) and second.medium == "GPU" and second.block_size == BS
    chain = block_hashes(Dialect.VLLM_033, encode("aaaabbbbcccc"), BS)
    assert second.block_hashes == (chain[2],) and second.parent_block_hash == chain[1]
    assert second.token_ids == tuple(encode("cccc"))
    async with http.get(engine.http_url + "/admin/state") as r:
        state = await r.json()
    assert state["ranks"][0]["last_seq"] == 2 and state["dialect"] == "vllm-0.33"
    published = {h for _, _, b in got for e in b.events for h in e.block_hashes}
    assert set(state["ranks"][0]["blocks"]["device"]) == published


async def test_dp_ranks_ports_stamps_and_round_robin(http, ctx) -> None:
    async with run_fake_engine(dp_size=2, **FAST) as engine:
        subs = [await subscribe(ctx, engine.kv_endpoint(r)) for r in (0, 1)]
        url = engine.http_url + "/v1/completions"
        await post(http, url, {"prompt": "aaaa"}, headers={"X-Data-Parallel-Rank": "1"})
        _, seq, batch = await recv_batch(subs[1])
        assert (seq, batch.data_parallel_rank) == (0, 1)
        await assert_no_message(subs[0])
        seen = []
        for p in ("bbbb", "cccc", "dddd", "eeee"):  # round robin alternates ranks
            async with http.post(url, json={"prompt": p}) as resp:
                seen.append(int(resp.headers["X-Data-Parallel-Rank"]))
        assert sorted(seen) == [0, 0, 1, 1] and seen[0] != seen[1]
        assert [(await recv_batch(subs[0]))[1] for _ in range(2)] == [0, 1]
        assert [(await recv_batch(subs[1]))[1] for _ in range(2)] == [1, 2]


@pytest.mark.parametrize("dialect", list(Dialect))
async def test_replay_returns_range_then_end_marker(http, ctx, dialect: Dialect) -> None:
    async with run_fake_engine(dialect=dialect, topic="kv-topic", **FAST) as engine:
        for i in range(5):
            status, reply = await post(http, engine.http_url + "/admin/store", {"token_ids": [i] * BS})
            assert status == 200 and reply["seq"] == i
        raw, seqs = await replay(ctx, engine.replay_endpoint(0), 2)
        assert seqs == [2, 3, 4]
        expected_frames = 3 if dialect is Dialect.VLLM_020 else 4  # 3-frame layout carries the topic
        assert all(len(frames) == expected_frames for frames in raw)
        if dialect is not Dialect.VLLM_020:
            assert raw[0][1] == b"kv-topic"
        assert raw[-1][-2:] == [b"\xff" * 8, b""]
        _, seqs = await replay(ctx, engine.replay_endpoint(0), 99)
        assert seqs == []


async def test_replay_buffer_is_bounded(http, ctx) -> None:
    async with run_fake_engine(replay_buffer=3, **FAST) as engine:
        for i in range(6):
            await post(http, engine.http_url + "/admin/store", {"token_ids": [i] * BS})
        _, seqs = await replay(ctx, engine.replay_endpoint(0), 0)
        assert seqs == [3, 4, 5]


async def test_lost_batches_skip_seq_and_drop(engine: FakeEngine, http, ctx) -> None:
    sub = await subscribe(ctx, engine.kv_endpoint(0))
    admin = engine.http_url + "/admin/"
    _, r = await post(http, admin + "skip_seq", {"n": 2})  # seq 0, 1: lost on PUB, kept for replay
    assert r["last_seq"] == 1
    _, r = await post(http, admin + "store", {"token_ids": [1] * BS, "drop": "pub"})  # seq 2, real events
    assert r["seq"] == 2
    await post(http, admin + "skip_seq", {"n": 1, "keep_in_replay": False})  # seq 3: gone for good
    _, r = await post(http, admin + "store", {"token_ids": [2] * BS})  # seq 4: delivered
    _, seq, _ = await recv_batch(sub)
    assert seq == 4
    await assert_no_message(sub)
    _, seqs = await replay(ctx, engine.replay_endpoint(0), 0)
    assert seqs == [0, 1, 2, 4]


async def test_restart_resets_seq_cache_and_replay(engine: FakeEngine, http, ctx) -> None:
    sub = await subscribe(ctx, engine.kv_endpoint(0))
    url = engine.http_url + "/v1/completions"
    await post(http, url, {"prompt": "abcdefgh"})
    await post(http, url, {"prompt": "ijklmnop"})
    assert [(await recv_batch(sub))[1] for _ in range(2)] == [0, 1]
    old = engine.incarnation
    status, r = await post(http, engine.http_url + "/admin/restart", None)
    assert status == 200 and r["incarnation"] != old
    async with http.get(engine.http_url + "/admin/state") as resp:
        state = await resp.json()
    assert state["incarnation"] == r["incarnation"]
    assert state["ranks"][0] == {"rank": 0, "last_seq": -1, "blocks": {"device": [], "host": []}}
    _, seqs = await replay(ctx, engine.replay_endpoint(0), 0)
    assert seqs == []
    _, again = await post(http, url, {"prompt": "abcdefgh"})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, seq, _ = await recv_batch(sub)
    assert seq == 0  # the same sockets, sequence back at 0


async def test_admin_host_tier_remove_clear_sglang_wire(http, ctx) -> None:
    async with run_fake_engine(dialect=Dialect.SGLANG, host_capacity_blocks=4, **FAST) as engine:
        sub = await subscribe(ctx, engine.kv_endpoint(0))
        admin = engine.http_url + "/admin/"
        tokens = [1, 2, 3, 4, 5, 6, 7, 8]
        chain = block_hashes(Dialect.SGLANG, tokens, BS)
        await post(http, admin + "store", {"token_ids": tokens, "medium": "CPU_PINNED", "cache_salt": "t"})
        await post(http, admin + "store", {"token_ids": tokens})
        _, r = await post(http, admin + "remove", {"token_ids": tokens})
        assert r == {"rank": 0, "seq": 2, "events": 2}
        _, r = await post(http, admin + "remove", {"token_ids": tokens})
        assert r["seq"] is None  # nothing left to remove: no batch
        _, r = await post(http, admin + "clear", {})
        assert r["ranks"] == [{"rank": 0, "seq": 3, "events": 1}]
        (host_store,) = (await recv_batch(sub))[2].events
        assert isinstance(host_store, BlockStored)
        assert host_store.medium == "CPU_PINNED" and host_store.cache_salt == "t"
        assert host_store.block_hashes != tuple(chain)  # salted chain differs from the plain one
        (dev_store,) = (await recv_batch(sub))[2].events
        assert isinstance(dev_store, BlockStored) and dev_store.block_hashes == tuple(chain)
        removed = (await recv_batch(sub))[2].events
        assert removed == (BlockRemoved((chain[0],), "GPU"), BlockRemoved((chain[1],), "GPU"))
        assert type((await recv_batch(sub))[2].events[0]).__name__ == "AllBlocksCleared"


async def test_publish_raw_sends_exact_bytes(engine: FakeEngine, http, ctx) -> None:
    sub = await subscribe(ctx, engine.kv_endpoint(0))
    _, r = await post(http, engine.http_url + "/admin/publish_raw", {"payload_hex": "c1ff00"})
    assert r["seq"] == 0
    topic, seq, payload = parse_pub_message(await asyncio.wait_for(sub.recv_multipart(), TIMEOUT))
    assert (topic, seq, payload) == (b"", 0, b"\xc1\xff\x00")
    with pytest.raises(MalformedFrame):
        decode_batch(payload)


# ------------------------------------------------------------------------------------ timing and load


async def test_prefill_time_scales_with_uncached_tokens(http) -> None:
    async with run_fake_engine(block_size=BS, prefill_us_per_token=2000.0, decode_tokens_per_s=0) as engine:
        url = engine.http_url + "/v1/completions"
        body = {"prompt": list(range(100)), "max_tokens": 1}  # 100 uncached tokens: 0.2 s
        t0 = time.monotonic()
        await post(http, url, body)
        cold = time.monotonic() - t0
        t0 = time.monotonic()
        await post(http, url, body)
        warm = time.monotonic() - t0
    assert cold >= 0.19
    assert warm < cold / 2


async def test_max_concurrency_queues_requests(http) -> None:
    async with run_fake_engine(
        block_size=BS, prefill_us_per_token=0, decode_tokens_per_s=100, max_concurrency=1
    ) as e:
        url = e.http_url + "/v1/completions"
        t0 = time.monotonic()
        tasks = [asyncio.create_task(post(http, url, {"prompt": p, "max_tokens": 10})) for p in ("a", "b")]
        await asyncio.sleep(0.05)
        assert (e.load.running, e.load.waiting) == (1, 1)
        async with http.get(e.http_url + "/metrics") as r:
            assert "routerfleet_fake_engine_requests_waiting 1.0" in await r.text()
        await asyncio.gather(*tasks)
        assert time.monotonic() - t0 >= 0.19  # 2 x 10 tokens at 100 tok/s, one at a time


async def test_shared_compute_runs_a_ranks_prefills_one_at_a_time_and_stalls_its_decodes(http) -> None:
    """With --shared-compute a rank prefills one prompt at a time and its streams wait while it does;
    alone (the default), each request computes as if nothing else ran."""

    async def timed(body: dict) -> float:
        t0 = time.monotonic()
        async with http.post(url, json=body) as r:
            assert r.status == 200
            await r.read()
        return time.monotonic() - t0

    for shared in (False, True):
        async with run_fake_engine(
            block_size=BS, prefill_us_per_token=2000.0, decode_tokens_per_s=100, shared_compute=shared
        ) as e:
            url = e.http_url + "/v1/completions"
            # Two cold 100-token prompts at once (0.2 s of prefill each), one token each.
            both = await asyncio.gather(
                *(timed({"prompt": list(range(k, k + 100)), "max_tokens": 1}) for k in (1000, 2000))
            )
            # 20 tokens (0.2 s of decode), streamed or whole, with a 0.2 s prefill landing in the middle.
            decoded = []
            for k, streamed in ((4000, True), (5000, False)):
                answer = asyncio.create_task(timed({"prompt": [1], "max_tokens": 20, "stream": streamed}))
                await asyncio.sleep(0.05)
                await timed({"prompt": list(range(k, k + 100)), "max_tokens": 1})
                decoded.append(await answer)
        if shared:
            assert max(both) >= 0.39  # the second waited for the first's prefill
            assert min(decoded) >= 0.37  # the decode stood still for the prefill
        else:
            assert max(both) < 0.35
            assert max(decoded) < 0.35


async def test_health_fault_fails_health_and_nothing_else(engine: FakeEngine, http) -> None:
    async with http.post(engine.http_url + "/admin/health_fault", json={"ms": 60_000}) as r:
        assert r.status == 200
    async with http.get(engine.http_url + "/health") as r:
        assert r.status == 503
    status, _ = await post(http, engine.http_url + "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert status == 200  # a readiness flap: the engine still serves
    async with http.post(engine.http_url + "/admin/health_fault", json={"ms": 0}) as r:
        assert r.status == 200
    async with http.get(engine.http_url + "/health") as r:
        assert r.status == 200


async def test_cached_tokens_are_exact_under_concurrency(http) -> None:
    """The prediction audit is only as good as the engine's report: with many requests in flight over a
    cache small enough to evict, each response's cached_tokens is what a replay of the prompts in
    admission order (the ids' order) through the same cache reports."""
    rng = random.Random(7)
    systems = [[rng.randrange(1000) for _ in range(4 * BS)] for _ in range(3)]
    tail = [[rng.randrange(1000) for _ in range(rng.randrange(0, 3 * BS))] for _ in range(48)]
    prompts = [rng.choice(systems) + t for t in tail]
    async with run_fake_engine(
        block_size=BS, prefill_us_per_token=300.0, decode_tokens_per_s=2000, capacity_blocks=10,
        host_capacity_blocks=6,
    ) as e:  # fmt: skip
        url = e.http_url + "/v1/completions"

        async def one(prompt):
            if rng.random() < 0.5:
                status, body = await post(http, url, {"prompt": prompt, "max_tokens": 3})
                assert status == 200
                return body["id"], body["usage"]
            asked = {"prompt": prompt, "max_tokens": 3, "stream_options": {"include_usage": True}}
            chunks = await sse(http, url, asked)
            return chunks[-1]["id"], chunks[-1]["usage"]

        results = await asyncio.gather(*(one(p) for p in prompts))
        replay = RankCache(e.caches[0].config)
    order = sorted(range(len(prompts)), key=lambda i: int(results[i][0].rsplit("-", 1)[1]))
    assert len({results[i][0] for i in order}) == len(prompts)
    seen_hits = 0
    for i in order:
        want = replay.admit(prompts[i]).cached_tokens
        got = results[i][1]["prompt_tokens_details"]["cached_tokens"]
        assert got == want, (i, got, want)
        seen_hits += got > 0
    assert 0 < seen_hits < len(prompts)  # the run had hits, and misses (evictions) among them


# -------------------------------------------------------------------------------------------- the CLI


def test_cli_starts_serves_and_stops_on_sigterm() -> None:
    cmd = [sys.executable, "-m", "routerfleet_fake_engine.cli", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--kv-port", "0", "--replay-port", "0", "--dp-size", "2", "--dialect", "sglang"]
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        m = re.search(r"url=(http://\S+) .*kv_port_base=(\d+)", line)
        assert m, line
        info = asyncio.run(_get_json(m.group(1) + "/server_info"))
        assert info["kv_events"]["endpoint_port_base"] == int(m.group(2))
        assert info["kv_events"]["dp_size"] == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def _get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.json()


def test_cli_bad_flag_is_one_line_exit_2() -> None:
    cmd = [sys.executable, "-m", "routerfleet_fake_engine.cli", "--block-size", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert "argument --block-size" in proc.stderr.strip().splitlines()[-1]
