"""The paths beyond chat and completions (proxy/endpoints.py), over real HTTP against fake engines:
the pooling and tokenizer endpoints and audio transcription go to an engine by load and come back as
the engine answered; every other path, an engine's administrative ones included, is a 404 in OpenAI's
shape unless ``--allow-path`` adds it."""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import openai
import pytest

from router_runtime.config import parse_args
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.endpoints import FORWARDED, OWN, allowed_path
from router_runtime.tokens import encode
from routerfleet_fake_engine.pooling_api import DIM, vector
from routerfleet_fake_engine.server import run_fake_engine

from .test_proxy_http import ENGINE_HEADER, breakers, closed_port_url, http_worker, post, routed, sample

BODIES = {
    "/v1/embeddings": {"model": "m", "input": ["the quick brown fox", [1, 2, 3]]},
    "/pooling": {"model": "m", "input": "pool me"},
    "/classify": {"model": "m", "input": ["good", "bad"]},
    "/score": {"model": "m", "text_1": "fox", "text_2": ["the fox", "a dog"]},
    "/v1/score": {"model": "m", "text_1": "fox", "text_2": "fox"},
    "/rerank": {"model": "m", "query": "fox", "documents": ["dog", "the fox"], "top_n": 1},
    "/v1/rerank": {"model": "m", "query": "fox", "documents": ["dog", "the fox"]},
    "/v2/rerank": {"model": "m", "query": "fox", "documents": ["fox"]},
    "/tokenize": {"model": "m", "prompt": "hello"},
    "/v1/tokenize": {"model": "m", "prompt": "hello"},
    "/detokenize": {"model": "m", "tokens": [104, 105]},
    "/v1/detokenize": {"model": "m", "tokens": [104, 105]},
}


def test_allow_path_values_are_vetted():
    assert allowed_path("/v1/load_lora_adapter") == "/v1/load_lora_adapter"
    for bad, why in [
        ("v1/x", "absolute"),
        ("/x?y=1", "absolute"),
        ("/a/../metrics", "dot segment"),
        ("/metrics", "served by the router"),
        ("/v1/chat/completions", "served by the router"),
        ("/debug/index", "served by the router"),
        ("/v1/embeddings", "served by the router"),
        ("/" + "a" * 300, "absolute"),
    ]:
        with pytest.raises(ValueError, match=why):
            allowed_path(bad)
    assert parse_args(["--allow-path", "/sleep", "--allow-path", "/sleep"]).proxy.allow_paths == ("/sleep",)


def test_a_bad_allow_path_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--allow-path", "/metrics"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "argument --allow-path" in err and "served by the router" in err


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_each_forwarded_path_answers_as_the_engine_does(path):
    assert path in FORWARDED
    async with run_fake_engine(block_size=4) as engine, routed([http_worker(engine.http_url)]) as (r, url, s):
        status, _, direct = await post(s, engine.http_url, BODIES[path], path)
        assert status == 200, direct
        status, headers, through = await post(s, url, BODIES[path], path)
        assert status == 200 and headers[ENGINE_HEADER] == engine.http_url
        assert json.loads(through) == json.loads(direct)
        assert sample(r, "routerfleet_requests_total", policy="least_loaded", outcome="ok", status="200") == 1


async def test_an_engines_error_comes_back_as_it_sent_it():
    async with run_fake_engine(block_size=4) as engine, routed([http_worker(engine.http_url)]) as (_, url, s):
        bad = {"model": "m", "input": 7}
        _, _, direct = await post(s, engine.http_url, bad, "/v1/embeddings")
        status, _, through = await post(s, url, bad, "/v1/embeddings")
        assert status == 400 and through == direct
        assert json.loads(through)["error"]["param"] == "input"


async def test_own_lists_every_path_the_router_itself_serves():
    """allowed_path refuses the router's own paths by endpoints.OWN: it must name what the app
    serves, or an allowed path could hide behind one of them."""
    async with routed([http_worker(closed_port_url())]) as (router, _, _s):
        served = {r.resource.canonical for r in router.build_app().router.routes()}
    items = {"/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel"}
    items.add("/v1/responses/{response_id}/input_items")
    assert served - set(FORWARDED) == {*OWN, "/debug/index", "/debug/load", *items}


async def test_by_load_spreads_and_avoids_the_busy_engine():
    """Sequential requests alternate (ties rotate); with a slow stream in flight on one engine, the
    next embeddings go to the other."""
    async with (
        run_fake_engine(block_size=4, decode_tokens_per_s=5) as a,
        run_fake_engine(block_size=4) as b,
        routed([http_worker(a.http_url), http_worker(b.http_url)]) as (_, url, s),
    ):
        seen = set()
        for _ in range(4):
            _, headers, _ = await post(s, url, BODIES["/v1/embeddings"], "/v1/embeddings")
            seen.add(headers[ENGINE_HEADER])
        assert seen == {a.http_url, b.http_url}

        async def slow_on_a():
            for i in range(100):  # until the policy puts one on a (slow there, quick on b)
                body = {"prompt": f"slow {i} " * 4, "max_tokens": 600, "stream": True}
                async with s.post(url + "/v1/completions", json=body) as r:
                    if r.headers[ENGINE_HEADER] == a.http_url:
                        started.set()
                        await r.read()  # two minutes on a: cancelled once the checks are done
                        return
                    await r.read()  # quick on b

        started = asyncio.Event()
        task = asyncio.create_task(slow_on_a())
        await asyncio.wait_for(started.wait(), 30)
        for _ in range(3):
            _, headers, _ = await post(s, url, BODIES["/v1/embeddings"], "/v1/embeddings")
            assert headers[ENGINE_HEADER] == b.http_url
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_transcription_form_arrives_whole():
    audio = bytes(range(256)) * 1000
    async with run_fake_engine(block_size=4) as engine, routed([http_worker(engine.http_url)]) as (_, url, s):
        form = aiohttp.FormData()
        form.add_field("model", "whisper")
        form.add_field("file", audio, filename="a.wav", content_type="audio/wav")
        async with s.post(url + "/v1/audio/transcriptions", data=form) as r:
            assert r.status == 200 and r.headers[ENGINE_HEADER] == engine.http_url
            assert await r.json() == {"text": f"{len(audio)} bytes of audio", "model": "whisper"}


async def test_a_refused_connection_is_retried_on_another_engine():
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(closed_port_url()), http_worker(engine.http_url)], health=breakers(1)) as ctx,
    ):
        r, url, s = ctx
        for _ in range(2):  # one of the two lands on the closed port first, which opens its breaker
            status, headers, _ = await post(s, url, BODIES["/classify"], "/classify")
            assert status == 200 and headers[ENGINE_HEADER] == engine.http_url
        assert sample(r, "routerfleet_retries_total", reason="connect") == 1


async def test_no_engine_is_a_503_in_openai_shape():
    async with routed([http_worker(closed_port_url())], health=breakers(1)) as (_, url, s):
        await post(s, url, BODIES["/v1/embeddings"], "/v1/embeddings")  # opens the only breaker
        status, _, body = await post(s, url, BODIES["/v1/embeddings"], "/v1/embeddings")
        assert status == 503 and json.loads(body)["error"]["code"] == "no_engine_available"


async def test_other_paths_are_refused_and_an_engines_admin_path_is_unreachable():
    async with run_fake_engine(block_size=4) as engine, routed([http_worker(engine.http_url)]) as (_, url, s):
        async with s.get(engine.http_url + "/admin/state") as r:
            assert r.status == 200  # the engine serves it ...
        for method, path in [("GET", "/admin/state"), ("POST", "/admin/clear"), ("POST", "/sleep"),
                             ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/nothing")]:  # fmt: skip
            async with s.request(method, url + path, json={}) as r:
                assert r.status == 404, path  # ... the router does not pass it through
                err = (await r.json())["error"]
                assert err["code"] == "not_found" and f"{method} {path}" in err["message"]
                assert ENGINE_HEADER not in r.headers
        async with s.get(url + "/v1/chat/completions") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert (await r.json())["error"]["code"] == "method_not_allowed"


async def test_an_allowed_path_goes_through_with_its_method():
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(engine.http_url)], proxy=ProxyConfig(allow_paths=("/admin/state",))) as (
            _,
            url,
            s,
        ),
        s.get(url + "/admin/state") as r,
    ):
        assert r.status == 200 and r.headers[ENGINE_HEADER] == engine.http_url
        assert (await r.json())["block_size"] == 4


async def test_the_openai_sdks_embeddings_create_through_the_router():
    """The SDK asks for base64 unless told otherwise and decodes it: both ways give the engine's
    vectors (float32)."""
    async with (
        run_fake_engine(block_size=4) as engine,
        routed([http_worker(engine.http_url)]) as (_, url, _s),
    ):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            for fmt in ({}, {"encoding_format": "float"}):
                out = await client.embeddings.create(model="m", input=["fox", "dog"], **fmt)
                want = [vector(encode(t)) for t in ("fox", "dog")]
                got = [d.embedding for d in out.data]
                assert [len(v) for v in got] == [DIM, DIM]
                assert all(
                    abs(a - b) < 1e-6
                    for v, w in zip(got, want, strict=True)
                    for a, b in zip(v, w, strict=True)
                )
                assert out.usage.prompt_tokens == 6
        finally:
            await client.close()
