"""The request plane's functional core: body parsing, header filtering, load accounting, the circuit
breaker and the candidate targets. No I/O."""

from __future__ import annotations

import json
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from router_runtime.fleet.inflight import LoadTracker
from router_runtime.proxy.errors import ProxyError
from router_runtime.proxy.headers import request_headers, response_headers
from router_runtime.proxy.health import Breaker, BreakerConfig, BreakerState, HealthBoard
from router_runtime.proxy.request import Kind, parse_json, parse_request
from router_runtime.proxy.salting import salted, tenant_salt
from router_runtime.proxy.targets import TargetBook
from router_runtime.scheduling.types import Target
from router_runtime.worker import WorkerSpec

# ---------------------------------------------------------------------------------------------- bodies


def test_completion_prompt_forms():
    text = parse_request({"prompt": "hello"}, Kind.COMPLETION)
    assert (text.text, text.tokens, text.stream) == ("hello", None, False)
    ids = parse_request({"prompt": [1, 2, 3], "stream": True}, Kind.COMPLETION)
    assert ids.tokens == array("I", [1, 2, 3]) and ids.text is None and ids.stream
    nested = parse_request({"prompt": [[4, 5], [6]]}, Kind.COMPLETION)
    assert list(nested.tokens) == [4, 5]  # a batch is routed by its first prompt
    batch = parse_request({"prompt": ["a", "b"]}, Kind.COMPLETION)
    assert batch.text == "a"
    big = parse_request({"prompt": [2**32 - 1, 0]}, Kind.COMPLETION)
    assert list(big.tokens) == [2**32 - 1, 0]
    ns = parse_request({"prompt": "x", "lora_name": "ad", "cache_salt": "s", "stream": None}, Kind.COMPLETION)
    assert (ns.lora_name, ns.cache_salt, ns.stream) == ("ad", "s", False)


def test_chat_forms():
    msgs = [{"role": "user", "content": "hi"}]
    p = parse_request({"messages": msgs}, Kind.CHAT)
    assert p.body == {"messages": msgs} and p.tokens is None and p.text is None
    # The whole body goes to the tokenizer: the engine's chat rules read tools, flags and kwargs too.
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": msgs, "tools": tools, "chat_template_kwargs": {"enable_thinking": False}}
    assert parse_request(body, Kind.CHAT).body is body


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ([1, 2], Kind.COMPLETION, None),
        ({}, Kind.COMPLETION, "prompt"),
        ({"prompt": None}, Kind.COMPLETION, "prompt"),
        ({"prompt": []}, Kind.COMPLETION, "prompt"),
        ({"prompt": 5}, Kind.COMPLETION, "prompt"),
        ({"prompt": [1, "a"]}, Kind.COMPLETION, "prompt"),
        ({"prompt": [1, 2.5]}, Kind.COMPLETION, "prompt"),
        ({"prompt": [1, -1]}, Kind.COMPLETION, "prompt"),
        ({"prompt": [1, 2**32]}, Kind.COMPLETION, "prompt"),
        ({"prompt": [[1], [None]]}, Kind.COMPLETION, "prompt"),
        ({"prompt": ["a", 1]}, Kind.COMPLETION, "prompt"),
        ({"prompt": [{"x": 1}]}, Kind.COMPLETION, "prompt"),
        ({"prompt": "x", "stream": "yes"}, Kind.COMPLETION, "stream"),
        ({"prompt": "x", "stream": 1}, Kind.COMPLETION, "stream"),
        ({"prompt": "x", "lora_name": 3}, Kind.COMPLETION, "lora_name"),
        ({}, Kind.CHAT, "messages"),
        ({"messages": []}, Kind.CHAT, "messages"),
        ({"messages": "hi"}, Kind.CHAT, "messages"),
        ({"messages": ["hi"]}, Kind.CHAT, "messages"),
        ({"messages": [{"content": "hi"}]}, Kind.CHAT, "messages"),
        ({"messages": [{"role": ""}]}, Kind.CHAT, "messages"),
        ({"messages": [{"role": "user"}], "chat_template_kwargs": []}, Kind.CHAT, "chat_template_kwargs"),
    ],
)
def test_invalid_bodies_are_400(body, kind, param):
    with pytest.raises(ProxyError) as e:
        parse_request(body, kind)
    assert e.value.status == 400
    assert e.value.to_json()["error"]["param"] == param
    assert set(e.value.to_json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"[" * 100_000])
def test_bad_json_is_400(raw):
    with pytest.raises(ProxyError) as e:
        parse_json(raw)
    assert e.value.status == 400


# --------------------------------------------------------------------------------------------- headers


def test_hop_by_hop_request_headers_are_stripped():
    h = CIMultiDict(
        [
            ("Host", "router"),
            ("Connection", "keep-alive, X-Private"),
            ("Connection", "X-Other"),
            ("X-Private", "1"),
            ("x-other", "2"),
            ("Keep-Alive", "timeout=5"),
            ("TE", "trailers"),
            ("Trailer", "X-T"),
            ("Transfer-Encoding", "chunked"),
            ("Upgrade", "h2c"),
            ("Proxy-Authorization", "secret"),
            ("Proxy-Anything", "x"),
            ("Content-Length", "10"),
            ("X-Data-Parallel-Rank", "3"),
            ("Authorization", "Bearer k"),
            ("X-Trace", "a"),
            ("X-Trace", "b"),
            ("Content-Type", "application/json"),
        ]
    )
    out = request_headers(h)
    assert list(out.items()) == [
        ("Authorization", "Bearer k"),
        ("X-Trace", "a"),
        ("X-Trace", "b"),
        ("Content-Type", "application/json"),
    ]


def test_hop_by_hop_response_headers_are_stripped():
    h = CIMultiDict(
        [
            ("Connection", "close, X-Hop"),
            ("X-Hop", "1"),
            ("Transfer-Encoding", "chunked"),
            ("Content-Length", "3"),
            ("Content-Type", "text/event-stream"),
            ("X-Data-Parallel-Rank", "1"),
            ("Content-Encoding", "gzip"),
        ]
    )
    assert list(response_headers(h).items()) == [
        ("Content-Type", "text/event-stream"),
        ("X-Data-Parallel-Rank", "1"),
        ("Content-Encoding", "gzip"),
    ]


# ------------------------------------------------------------------------------------------------ load

A0, A1, B = Target("a", "http://a", 0), Target("a", "http://a", 1), Target("b", "http://b")


def test_load_tracker_counts_exactly():
    load = LoadTracker()
    view = load.view
    assert load.acquire(A0) == 1 and load.acquire(A1) == 2 and load.acquire(A0) == 3
    assert load.acquire(B) == 1
    assert dict(view) == {A0: 2, A1: 1, B: 1} and load.total == 4
    assert load.engine("a") == 3 and load.engines() == {"a": 3, "b": 1}
    assert load.release(A0) == 2 and load.release(A0) == 1 and load.release(A1) == 0
    assert dict(view) == {B: 1} and load.engine("a") == 0 and load.get(A0) == 0
    with pytest.raises(RuntimeError):
        load.release(A0)
    with pytest.raises(TypeError):
        view[A0] = 5  # policies get a read-only view


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([A0, A1, B]), st.booleans()), max_size=60))
def test_load_tracker_matches_a_model(ops):
    load, model = LoadTracker(), {A0: 0, A1: 0, B: 0}
    for target, acquire in ops:
        if acquire:
            load.acquire(target)
            model[target] += 1
        elif model[target]:
            load.release(target)
            model[target] -= 1
        else:
            with pytest.raises(RuntimeError):
                load.release(target)
        assert dict(load.view) == {t: n for t, n in model.items() if n}
        assert load.total == sum(model.values())
        assert load.engine("a") == model[A0] + model[A1]


# --------------------------------------------------------------------------------------------- breaker


def test_breaker_opens_after_k_consecutive_failures_and_recovers_after_cooldown():
    b = Breaker(BreakerConfig(failures=3, cooldown_s=10))
    assert b.failure(0) is None and b.failure(1) is None
    assert b.success(2) is None  # a success resets the count
    assert b.failure(3) is None and b.failure(4) is None
    assert b.failure(5) is BreakerState.OPEN
    assert not b.available(5) and b.state(14.9) is BreakerState.OPEN and b.reopens_at() == 15
    # Outcomes while cooling down are stale news: ignored.
    assert b.success(6) is None and b.failure(7) is None and b.state(14.9) is BreakerState.OPEN
    assert b.state(15) is BreakerState.HALF_OPEN and b.available(15)
    assert b.success(16) is BreakerState.CLOSED and b.consecutive_failures == 0


def test_a_half_open_failure_reopens_at_once():
    b = Breaker(BreakerConfig(failures=2, cooldown_s=1))
    b.failure(0)
    assert b.failure(0) is BreakerState.OPEN
    assert b.state(1) is BreakerState.HALF_OPEN
    assert b.failure(1.5) is BreakerState.OPEN  # one failure suffices in half-open
    assert b.state(2.4) is BreakerState.OPEN and b.state(2.5) is BreakerState.HALF_OPEN


def test_breaker_config_is_validated():
    with pytest.raises(ValueError):
        BreakerConfig(failures=0)
    with pytest.raises(ValueError):
        BreakerConfig(cooldown_s=-1)


def test_health_board_tracks_the_engine_set_and_versions_changes():
    now = [0.0]
    seen = []
    board = HealthBoard(
        BreakerConfig(1, 5), clock=lambda: now[0], on_transition=lambda e, s: seen.append((e, s))
    )
    board.sync(["a", "b"])
    v = board.version
    board.success("a")
    assert board.version == v  # no state change, no new version
    board.failure("b")
    assert board.version == v + 1 and seen == [("b", BreakerState.OPEN)]
    assert board.available("a") and not board.available("b") and not board.should_probe("b")
    assert board.next_change() == 5
    now[0] = 5
    assert board.state("b") is BreakerState.HALF_OPEN and board.should_probe("b")
    board.success("b")
    assert seen[-1] == ("b", BreakerState.CLOSED)
    board.failure("gone")  # an engine that already left: ignored
    board.sync(["a"])
    assert board.states() == {"a": BreakerState.CLOSED} and not board.available("b")


def test_target_book_per_rank_and_health_filtering():
    now = [0.0]
    board = HealthBoard(BreakerConfig(1, 5), clock=lambda: now[0])
    specs = [WorkerSpec("b", "http://b", dp_size=2), WorkerSpec("a", "http://a")]
    kv = TargetBook(board, per_rank=True)
    kv.set_workers(specs)
    a, b0, b1 = Target("a", "http://a"), Target("b", "http://b", 0), Target("b", "http://b", 1)
    assert kv.candidates() == (a, b0, b1)
    assert kv.urls == {"a": "http://a", "b": "http://b"}
    board.failure("b")
    assert kv.candidates() == (a,)
    now[0] = 5  # cooldown over: half-open, a candidate again without any event
    assert kv.candidates() == (a, b0, b1)
    whole = TargetBook(HealthBoard(BreakerConfig()), per_rank=False)
    whole.set_workers(specs)
    assert whole.candidates() == (a, Target("b", "http://b"))
    assert whole.all_targets() == {a, Target("b", "http://b")}


# ---- the body budget (proxy/bodies.py) ----------------------------------------------------------------


async def test_a_share_that_does_not_fit_waits_for_one_given_back():
    import asyncio

    from router_runtime.proxy.bodies import Bodies

    budget = Bodies(100, wait_s=2.0)
    async with budget.share() as a:
        await a.grow_to(60)
        await a.grow_to(40)  # a share never shrinks until it is given back
        assert (a.size, budget.held) == (60, 60)

        async def second():
            async with budget.share() as b:
                await b.grow_to(50)
                return budget.held

        waiting = asyncio.create_task(second())
        await asyncio.sleep(0.05)
        assert not waiting.done()
    assert await waiting == 50  # admitted once the first was given back
    assert budget.held == 0


async def test_a_share_refused_past_the_wait_is_a_503_and_one_beyond_the_cap_a_413():
    from router_runtime.proxy.bodies import Bodies, parse_cost

    budget = Bodies(100, wait_s=0.05)
    async with budget.share() as a:
        await a.grow_to(90)
        async with budget.share() as b:
            with pytest.raises(ProxyError) as e:
                await b.grow_to(20)
            assert (e.value.status, e.value.code, e.value.headers) == (
                503,
                "body_budget_exhausted",
                {"Retry-After": "1"},
            )
            with pytest.raises(ProxyError) as e:
                await b.grow_to(101)
            assert (e.value.status, e.value.code) == (413, "request_too_large")
    assert budget.held == 0
    none = Bodies(0)
    async with none.share() as c:
        await c.grow_to(1 << 40)  # no budget: nothing held, nothing refused
    assert none.held == 0
    # a value per comma, bracket and brace, plus the bytes: an upper bound on what json.loads holds
    assert parse_cost(b"[[],[]]") == 3 * 7 + 64 * (1 + 3 + 1) + 4096  # ASCII: its bytes, text, strings


def test_a_budget_smaller_than_one_body_is_refused_naming_both_flags():
    from router_runtime.proxy.config import ProxyConfig

    with pytest.raises(ValueError, match=r"--body-budget-bytes must be 0 .* --max-body-bytes"):
        ProxyConfig(max_body_bytes=32 << 20, body_budget_bytes=16 << 20)
    assert ProxyConfig(body_budget_bytes=0).body_budget_bytes == 0


PARSE_SHAPES = {
    "an ASCII prompt": json.dumps({"prompt": "a" * 200_000}).encode(),
    "a prompt with an emoji": json.dumps(
        {"prompt": "a" * 200_000 + "\U0001f600"}, ensure_ascii=False
    ).encode(),
    "an ASCII body escaping an emoji": json.dumps({"prompt": "a" * 200_000 + "\U0001f600"}).encode(),
    "a CJK prompt": json.dumps({"prompt": "\u4e2d" * 70_000}, ensure_ascii=False).encode(),
    "short emoji strings": json.dumps(["\U0001f600"] * 40_000, ensure_ascii=False).encode(),
    "empty arrays": b"[" + b",".join([b"[]"] * 60_000) + b"]",
    "nested empty arrays": b"[" + b",".join([b"[[]]"] * 40_000) + b"]",
    "empty objects": b"[" + b",".join([b"{}"] * 60_000) + b"]",
    "token IDs": json.dumps({"prompt": list(range(10_000, 70_000))}).encode(),
    "floats": json.dumps([1.5] * 60_000).encode(),
    "one-member objects, unique keys": b"[" + b",".join(b'{"%08x":0}' % i for i in range(60_000)) + b"]",
    "an object of unique keys": b"{" + b",".join(b'"%08x":0' % i for i in range(60_000)) + b"}",
    "objects of empty objects": b"[" + b",".join(b'{"%08x":{}}' % i for i in range(60_000)) + b"]",
    "objects of one key": b"[" + b",".join([b'{"a":0}'] * 60_000) + b"]",
}


@pytest.mark.parametrize("shape", PARSE_SHAPES)
def test_the_parse_cost_bounds_what_parsing_holds(shape):
    """``parse_cost`` is what a body holds in the budget while it parses: measured, it is never less."""
    import gc
    import tracemalloc

    from router_runtime.proxy.bodies import parse_cost

    raw = PARSE_SHAPES[shape]
    gc.collect()
    tracemalloc.start()
    try:
        parsed = parse_json(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del parsed
    assert len(raw) + peak <= parse_cost(raw), (shape, len(raw), peak, parse_cost(raw))


async def test_a_parse_its_request_left_running_keeps_its_share_until_it_ends():
    """A client gone while its body parses on a thread: the thread still holds the memory, so the share
    is given back when the parse ends, not when the request does."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from router_runtime.proxy.bodies import Bodies

    raw = b"[" + b",".join([b"[]"] * 3_000_000) + b"]"  # a parse of several tenths of a second
    with ThreadPoolExecutor(1) as pool:
        budget = Bodies(1 << 30, executor=pool, inline_max_bytes=0)

        async def request():
            async with budget.share() as share:
                await budget.parse(share, raw)

        task = asyncio.create_task(request())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert budget.held > 0  # the parse runs on
        for _ in range(200):
            if budget.held == 0:
                break
            await asyncio.sleep(0.05)
        assert budget.held == 0


# ---- tenant cache salts (proxy/salting.py) -------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "max_tokens": 2}',
        b'  {"messages": [{"role": "user", "content": "\xc3\xa9"}]}',
        b'{"prompt": "hi", "cache_salt": "mine"}',
        b'{"prompt": "hi", "cache_salt": null}',  # a later null must not undo an inserted salt
        '{"prompt": "hi"}'.encode("utf-16"),
    ],
)
def test_a_salted_body_carries_its_tenants_salt_and_everything_else_unchanged(raw):
    body = json.loads(raw)
    sent, salted_body = salted(raw, body, "tenant-a")
    decoded = json.loads(sent)
    assert (
        decoded["cache_salt"] == salted_body["cache_salt"] == tenant_salt("tenant-a", body.get("cache_salt"))
    )
    assert {k: v for k, v in decoded.items() if k != "cache_salt"} == {
        k: v for k, v in body.items() if k != "cache_salt"
    }
    if "cache_salt" not in body and raw.startswith(b"{"):
        assert sent.endswith(raw[1:])  # inserted: the client's bytes follow as they were


def test_salts_part_tenants_and_the_clients_own_salts_within_one():
    salts = {tenant_salt(t, own) for t in ("", "a", "b") for own in (None, "x", "y")}
    assert len(salts) == 9
    # A client cannot name another tenant's salt: its own salt is namespaced, never used as it is.
    assert tenant_salt("a", tenant_salt("b", None)) != tenant_salt("b", None)
    # vLLM's rules for a salt (entrypoints' validate_cache_salt): at most 128 characters, none of @ / \ NUL.
    assert all(len(s) <= 128 and not set(s) & set("@/\\\x00") for s in salts)


def test_a_utf16_body_with_a_raw_lone_surrogate_is_a_400_not_a_salting_crash():
    raw = '{"prompt": "hi", "junk": "\ud800"}'.encode("utf-16-le", "surrogatepass")
    with pytest.raises(ProxyError) as e:
        parse_json(raw)  # before salting ever sees it (its UTF-8 encode would raise)
    assert e.value.status == 400 and "junk" in str(e.value.to_json())


@pytest.mark.parametrize("body", [["not", "an", "object"], {"prompt": "hi", "cache_salt": 7}])
def test_a_body_the_parser_refuses_is_left_for_its_400(body):
    raw = json.dumps(body).encode()
    assert salted(raw, body, "a") == (raw, body)
