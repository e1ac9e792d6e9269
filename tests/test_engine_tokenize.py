"""``--tokenizer engine`` over real HTTP: the router asks a healthy engine's tokenize endpoint for the
IDs (the fake engine serves vLLM's ``/tokenize`` and SGLang's ``/v1/tokenize``), routes on them, keeps
answers in a bounded cache, and when the endpoint is slow or failing serves the request anyway,
without tokens, within the deadline. Plus the pure parts: the request each family's endpoint takes,
and the vetting of its answer."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp import web

from router_runtime.tokens import encode, render_chat
from router_runtime.tokens.chat import Family, Reason, Untokenizable
from router_runtime.tokens.config import TokenizerConfig
from router_runtime.tokens.engine import EngineTokenizer, tokenize_body, vet_tokens

from .support import eventually, loopback_app
from .test_proxy_routing import ENGINE_HEADER, cached_blocks, kv_fleet, routed_to, sample

CHAT = [
    {"role": "system", "content": "You answer in one line, and you are always polite about it."},
    {"role": "user", "content": "Which engine holds this conversation's prefix?"},
]


def untokenized(router, reason: Reason) -> float:
    return sample(router, "routerfleet_untokenized_requests_total", reason=reason)


async def faults(session, engines, **body) -> None:
    for e in engines:
        async with session.post(e.http_url + "/admin/tokenize_faults", json=body) as r:
            assert r.status == 200, await r.text()


async def test_the_engines_tokens_route_requests_to_the_engine_holding_their_prefix():
    # A deadline no loaded CI machine misses (the first call opens the connection): this test is about
    # where the engine's tokens route; the deadline has its own tests, with injected delays.
    async with kv_fleet(tokens=TokenizerConfig(tokenizer="engine", engine_timeout_s=5.0)) as (
        engines,
        router,
        url,
        s,
    ):
        holder = engines[2]
        chat_ids = encode(render_chat(CHAT))  # what the engines' own chat path computes
        text = "an engine-tokenized completion prompt, long enough for several blocks"
        for ids in (chat_ids, encode(text)):
            async with s.post(holder.http_url + "/admin/store", json={"token_ids": ids}) as r:
                assert r.status == 200
        for ids in (chat_ids, encode(text)):
            await eventually_indexed(router, holder, ids)
        chat_body = {"messages": CHAT, "max_tokens": 1}
        assert await routed_to(s, url, chat_body, "/v1/chat/completions") == holder.http_url
        assert await routed_to(s, url, {"prompt": text, "max_tokens": 1}) == holder.http_url
        assert sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix") == 2
        # The same request again is answered from the cache: it routes the same with every endpoint down.
        await faults(s, engines, status=500)
        assert await routed_to(s, url, chat_body, "/v1/chat/completions") == holder.http_url
        assert untokenized(router, Reason.ENGINE_ERROR) == 0


async def eventually_indexed(router, engine, ids) -> None:
    await eventually(lambda: cached_blocks(router, engine, ids) == len(ids) // 4, what="indexed")


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"delay_ms": 3000}, Reason.ENGINE_TIMEOUT), ({"status": 500}, Reason.ENGINE_ERROR)],
)
async def test_a_slow_or_failing_tokenize_endpoint_never_holds_a_request(fault, reason):
    async with kv_fleet(tokens=TokenizerConfig(tokenizer="engine", engine_timeout_s=0.1)) as (
        engines,
        router,
        url,
        s,
    ):
        await faults(s, engines, **fault)
        for i in range(3):
            t0 = time.monotonic()
            body = {"messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 1}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
                assert r.headers[ENGINE_HEADER]
            assert time.monotonic() - t0 < 1.5  # the deadline (0.1 s) and the engine's own reply
        assert untokenized(router, reason) == 3
        assert (
            sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="no_match") == 3
        )


def test_each_family_is_asked_what_its_endpoint_takes():
    body = {
        "messages": CHAT,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "add_generation_prompt": True,
        "reasoning_effort": "low",
        "chat_template_kwargs": {"x": 1},
        "max_tokens": 5,
        "stream": True,
    }
    # vLLM's /tokenize has no reasoning_effort: it goes where the chat path puts it, as template variables.
    assert tokenize_body(body, Family.VLLM) == {
        "messages": CHAT,
        "tools": body["tools"],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"x": 1, "reasoning_effort": "low", "enable_thinking": True},
    }
    # SGLang's renders as a chat completion only without add_generation_prompt.
    assert tokenize_body(body, Family.SGLANG) == {
        "messages": CHAT,
        "tools": body["tools"],
        "tool_choice": "auto",
        "reasoning_effort": "low",
        "chat_template_kwargs": {"x": 1},
    }
    with pytest.raises(Untokenizable) as e:
        tokenize_body({"messages": CHAT, "documents": [{"text": "d"}]}, Family.VLLM)
    assert e.value.reason is Reason.UNSUPPORTED


@pytest.mark.parametrize(
    "answer",
    [
        b"null", b"[]", b"{nope", b'{"tokens": "1 2"}', b'{"tokens": [1, true]}', b'{"tokens": [1.0]}',
        b'{"tokens": [-1]}', b'{"tokens": [4294967296]}', b'{"tokens": ' + b"[" * 100_000,
    ],
)  # fmt: skip
def test_an_answer_that_is_not_token_ids_is_refused(answer):
    with pytest.raises(ValueError):
        vet_tokens(answer)


def test_token_ids_are_vetted_into_an_array():
    assert list(vet_tokens(b'{"tokens": [0, 5, 4294967295], "count": 3}')) == [0, 5, 2**32 - 1]


async def test_the_engine_is_asked_in_the_clients_key_order():
    """A template's tojson shows key order (a tool's properties, tool-call arguments): the request the
    engine tokenizes must be the client's, not a re-sorted copy. Also: the request's reasoning_effort
    outranks one in chat_template_kwargs, as in the chat path; a repeat is answered from the cache; a
    closed tokenizer refuses."""
    seen: list[bytes] = []

    async def tokenize(request):
        seen.append(await request.read())
        return web.json_response({"count": 1, "max_model_len": 8, "tokens": [7]})

    params = {"type": "object", "properties": {"zeta": {"type": "string"}, "alpha": {"type": "string"}}}
    body = {
        "messages": CHAT,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}],
        "reasoning_effort": "high",
        "chat_template_kwargs": {"reasoning_effort": "low"},
    }
    async with loopback_app(web.post("/tokenize", tokenize)) as url:
        tok = EngineTokenizer(lambda: [url], Family.VLLM, timeout_s=2)
        try:
            assert list(await tok.chat_ids(body, 0)) == [7]
            sent = seen[0].decode()
            assert sent.index('"zeta"') < sent.index('"alpha"')
            assert json.loads(sent)["chat_template_kwargs"]["reasoning_effort"] == "high"
            assert list(await tok.chat_ids(body, 0)) == [7] and len(seen) == 1
        finally:
            await tok.close()
    with pytest.raises(Untokenizable):
        await tok.chat_ids({**body, "messages": CHAT[:1]}, 0)
