"""The prompt-bearing APIs besides chat and completions, through the router over real HTTP with the
official SDKs: OpenAI's Responses API (routed KV-aware; a stored response's follow-ups, GET, DELETE and
cancel go to the engine holding it, or get a clear error), Anthropic's Messages API, SGLang's native
/generate and vLLM's token-in generate. Plus the pure parts: the id scan, the binding verdict, the
request shapes as chat, the bindings in the peer snapshot."""

from __future__ import annotations

import contextlib

import aiohttp
import anthropic
import openai
import pytest

from router_runtime.app import run_router
from router_runtime.bootstrap.config import InternalConfig, PeerConfig
from router_runtime.bootstrap.vetting import vet_sessions
from router_runtime.bootstrap.wire import Limits, WireSession, WireSnapshot, decode, encode
from router_runtime.config import RouterConfig
from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.proxy.request import Kind, parse_request
from router_runtime.scheduling.types import Target
from router_runtime.sessions.bindings import (
    SCAN_HEAD_BYTES,
    BindingConfig,
    ResponseIdScan,
    Verdict,
    resolve,
)
from router_runtime.sessions.keys import digest, response_digest
from router_runtime.sessions.store import Remembered
from router_runtime.tokens.chat import Reason, Untokenizable
from router_runtime.tokens.shapes import messages_chat, responses_chat
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS

from .support import eventually, join_all, router_over_fakes, static_workers
from .test_proxy_routing import kv_fleet

BS = 4
ENGINE_HEADER = "X-RouterFleet-Engine"
LONG = "The quick brown fox jumps over the lazy dog. " * 4


def sample(router, name, **labels) -> float:
    return router.registry.get_sample_value(name, labels) or 0.0


def sdk(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """A client to use as ``async with``: one left to the garbage collector closes its sockets first
    and its connections later, and that late close unregisters whatever took the socket's number
    meanwhile from the event loop (a ZMQ subscription went deaf so)."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)


async def create(client: openai.AsyncOpenAI | str, **kw):
    """``responses.create`` (not streamed) through ``client`` (a URL: a client of its own, closed after):
    the response and the engine that served it."""
    if isinstance(client, str):
        async with sdk(client) as own:
            return await create(own, **kw)
    raw = await client.responses.with_raw_response.create(model="m", max_output_tokens=4, **kw)
    return raw.parse(), raw.headers[ENGINE_HEADER]


# ---- Responses through one router ------------------------------------------------------------------


async def test_responses_route_kv_aware_and_follow_ups_stay_on_their_engine():
    async with kv_fleet() as (engines, router, url, _s), sdk(url) as client:
        first, engine = await create(client, input=LONG, instructions="Be brief.")
        assert first.id.startswith("resp_") and first.output_text
        # The same prompt again: the index knows where it is cached, and says so.
        again, engine2 = await create(client, input=LONG, instructions="Be brief.")
        assert engine2 == engine and again.usage.input_tokens_details.cached_tokens > 0
        assert sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix") >= 1
        # Continued turns go to the engine holding the stored response, streamed or not.
        turn = first
        for k in range(3):
            turn, got = await create(client, input=f"and then {k}?", previous_response_id=turn.id)
            assert got == engine
        stream = await client.responses.create(
            model="m", input="last one", previous_response_id=turn.id, max_output_tokens=3, stream=True
        )
        kinds, final = [], None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.completed":
                final = event.response
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert final is not None and final.previous_response_id == turn.id
        by_url = {e.http_url: e for e in engines}
        assert by_url[engine].responses.get(final.id) is not None  # stored where it was routed
        # The streamed response was bound as it passed: its follow-up lands there too.
        _r, got = await create(client, input="after the stream", previous_response_id=final.id)
        assert got == engine
        assert sample(router, "routerfleet_response_lookups_total", source="local") == 5
        assert sample(router, "routerfleet_response_verdicts_total", verdict="found") == 5
        decisions = "routerfleet_routing_decisions_total"
        assert sample(router, decisions, policy="kv_aware", reason="response") == 5
        # GET, DELETE and cancel of a response go to its engine too.
        got = await client.responses.retrieve(first.id)
        assert got.id == first.id and got.status == "completed"
        with pytest.raises(openai.BadRequestError, match="synchronous"):  # the engine's own answer
            await client.responses.cancel(first.id)
        await client.responses.delete(first.id)
        assert by_url[engine].responses.get(first.id) is None


async def test_a_response_no_engine_holds_gets_a_clear_404_and_the_pool_stays_sound():
    async with kv_fleet() as (_engines, router, url, s), sdk(url) as client:
        for _ in range(2):  # probed on every engine each time: the probe must leave no bytes behind
            with pytest.raises(openai.NotFoundError) as err:
                await create(client, input="hi", previous_response_id="resp_0123456789abcdef")
            e = err.value.body
            assert e["code"] == "response_not_found" and e["param"] == "previous_response_id"
            assert "no engine in this fleet holds it" in e["message"]
        async with s.get(url + "/v1/responses/resp_unknown") as r:
            assert r.status == 404 and (await r.json())["error"]["param"] == "response_id"
        # The connections the probes used carry ordinary requests afterwards.
        for _ in range(6):
            first, _e = await create(client, input=LONG)
            assert first.output_text
        assert sample(router, "routerfleet_response_lookups_total", source="none") == 3
        assert sample(router, "routerfleet_response_verdicts_total", verdict="unknown") == 3


async def test_a_response_on_a_restarted_or_unreachable_engine_is_refused_not_rerouted():
    async with kv_fleet() as (engines, router, url, _s), sdk(url) as client:
        first, engine = await create(client, input=LONG)
        by_url = {e.http_url: e for e in engines}
        # The engine restarts (its stored responses are gone): a router that has not heard of it yet
        # sends the follow-up there, and the engine's own 404 says so. (Once discovery reports the new
        # incarnation, the router refuses it itself: the verdict test below.)
        by_url[engine].restart()
        with pytest.raises(openai.NotFoundError) as err:
            await create(client, input="more", previous_response_id=first.id)
        assert err.value.body["code"] == "response_not_found"
        second, engine = await create(client, input=LONG + " again")
        # Its engine stops answering: the follow-up is not sent anywhere else.
        for e in engines:
            if e.http_url == engine:
                await e.stop()
        with pytest.raises(openai.InternalServerError) as err:
            await create(client, input="more", previous_response_id=second.id)
        assert err.value.status_code == 503
        assert err.value.body["code"] == "response_engine_unavailable"
        # Both follow-ups found their binding; the first got the engine's 404, the second no engine.
        assert sample(router, "routerfleet_response_verdicts_total", verdict="found") == 2


@pytest.mark.parametrize("tenants", [True, False])
async def test_a_tenant_never_reaches_another_tenants_stored_response(tenants):
    """With --tenant-header Authorization, a response is bound to its tenant's key: another API key
    gets response_not_found for it (GET, DELETE, a follow-up), its owner everything. Without it, the
    fake engine (which checks no key, as many engines behind a gateway do) serves anyone the id."""
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(2)]
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=static_workers(engines),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            proxy=ProxyConfig(tenant_header="Authorization" if tenants else None, engine_header=True),
        )
        _router, url = await stack.enter_async_context(run_router(cfg))
        alice = await stack.enter_async_context(sdk(url, "alice-key"))
        mallory = await stack.enter_async_context(sdk(url, "mallory-key"))
        turn, engine = await create(alice, input=LONG)
        steps = (
            lambda c: c.responses.retrieve(turn.id),
            lambda c: create(c, input="more", previous_response_id=turn.id),
            lambda c: c.responses.delete(turn.id),
        )
        for step in steps:
            if tenants:
                with pytest.raises(openai.NotFoundError) as e:
                    await step(mallory)
                assert e.value.code == "response_not_found"
            else:
                await step(mallory)  # the leak the tenant header closes
                return
        assert (await alice.responses.retrieve(turn.id)).id == turn.id
        _turn, got = await create(alice, input="more", previous_response_id=turn.id)
        assert got == engine


async def test_a_client_cannot_name_the_response_id_its_answer_is_bound_under():
    """vLLM makes a Responses request's ``request_id`` the new response's id, and the router binds the id
    its answer carries to the caller's tenant: a client naming another's id would read, continue and
    delete it through its own binding. The router sends no client's ``request_id`` on, and binds only the
    answer's own id (an id in the client's metadata, echoed later in the answer, is not it)."""
    tenants = ProxyConfig(tenant_header="Authorization")
    async with router_over_fakes(1, BS, proxy=tenants) as (_engines, _router, url, s):
        alice, mallory = ({"Authorization": f"Bearer {k}"} for k in ("alice-key", "mallory-key"))

        async def post(who: dict, **body) -> dict:
            body = {"model": "m", "max_output_tokens": 2, **body}
            async with s.post(url + "/v1/responses", json=body, headers=who) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        x = (await post(alice, input=LONG))["id"]
        theirs = await post(mallory, input="hi", request_id=x, store=False)
        assert theirs["id"] != x  # the engine chose it
        y = (await post(alice, input=LONG + " again"))["id"]
        await post(mallory, input="hi", request_id="m.1", metadata={"id": y}, store=False)
        for rid in (x, y):
            async with s.get(url + f"/v1/responses/{rid}", headers=mallory) as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "response_not_found"
            async with s.get(url + f"/v1/responses/{rid}", headers=alice) as r:
                assert r.status == 200 and (await r.json())["id"] == rid


async def test_an_answer_stored_nowhere_is_bound_to_no_engine():
    """``store: false`` keeps the answer nowhere: binding its id would only push a live binding out of
    the store. A stored answer's id is bound (streamed or whole)."""
    async with router_over_fakes(1, BS) as (_engines, router, url, s):
        ids = {}
        for store in (False, True):
            body = {"model": "m", "input": LONG, "max_output_tokens": 2, "store": store}
            async with s.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200, await r.text()
                ids[store] = (await r.json())["id"]
        assert len(router.bindings.export()) == 1
        assert (await router.bindings.find(ids[True]))[0] is not None
        assert (await router.bindings.find(ids[False]))[0] is None


# ---- three replicas, no shared store ---------------------------------------------------------------


async def test_three_replicas_find_a_response_by_probing_and_a_new_replica_inherits_bindings(tmp_path):
    token = tmp_path / "token"
    token.write_text("fleet-secret")
    async with contextlib.AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(run_fake_engine(block_size=BS)) for _ in range(3)]
        workers = static_workers(engines)

        def cfg(probe_s: float, peers=()):
            return RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                proxy=ProxyConfig(engine_header=True),
                workers=workers,
                responses=BindingConfig(probe_timeout_s=probe_s),
                kv=KvConfig(block_size=BS),
                health=HealthConfig(interval_s=0),
                internal=InternalConfig(port=0, token_file=str(token)),
                peers=PeerConfig(urls=tuple(peers)),
                fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0)),
            )

        async def start(config):
            router, url = await stack.enter_async_context(run_router(config))
            await join_all(router, engines)
            return router, url

        probing = [await start(cfg(2.0)) for _ in range(3)]
        turn, engine = await create(probing[0][1], input=LONG)
        for k in range(1, 7):  # round robin over the replicas
            _router, url = probing[k % 3]
            turn, got = await create(url, input=f"turn {k}", previous_response_id=turn.id)
            assert got == engine
        # Each turn's id was made through another replica: every follow-up was found by a probe.
        probes = sum(sample(r, "routerfleet_response_lookups_total", source="probe") for r, _u in probing)
        assert probes == 6
        # Without the probe, a replica that never saw the response cannot route its follow-up...
        _blind, blind_url = await start(cfg(0))
        with pytest.raises(openai.NotFoundError):
            await create(blind_url, input="lost", previous_response_id=turn.id)
        # ...unless it inherited the binding from a sibling when it booted.
        late, late_url = await start(cfg(0, [probing[0][0].internal_url]))
        await eventually(
            lambda: sample(late, "routerfleet_response_bindings_inherited_total") >= 1,
            timeout=15,
            what="bindings inherited",
        )
        _r, got = await create(late_url, input="found", previous_response_id=turn.id)
        assert got == engine
        assert sample(late, "routerfleet_response_lookups_total", source="local") == 1


# ---- Anthropic Messages, SGLang and vLLM generate ---------------------------------------------------


async def test_anthropic_messages_route_kv_aware_streamed_and_not():
    async with (
        kv_fleet() as (_engines, router, url, _s),
        anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as client,
    ):
        system = [{"type": "text", "text": LONG}]
        messages = [{"role": "user", "content": "Summarize."}]
        raw = await client.messages.with_raw_response.create(
            model="m", max_tokens=4, system=system, messages=messages
        )
        first, engine = await raw.parse(), raw.headers[ENGINE_HEADER]
        assert first.content[0].text and first.usage.cache_read_input_tokens == 0
        async with client.messages.stream(model="m", max_tokens=3, system=system, messages=messages) as st:
            text = "".join([t async for t in st.text_stream])
            final = await st.get_final_message()
        assert len(text) == 3 and final.usage.cache_read_input_tokens > 0  # routed where it is cached
        assert sample(router, "routerfleet_routing_decisions_total", policy="kv_aware", reason="prefix") >= 1
        assert sample(router, "routerfleet_untokenized_requests_total", reason="unsupported") == 0
        # Audited by Anthropic's cache_read_input_tokens, streamed or not: the predictions held.
        labels = {"engine": engine, "policy": "kv_aware", "doubtful": "false"}
        audits = {
            o: sample(router, "routerfleet_audit_requests_total", outcome=o, **labels)
            for o in ("exact", "false_hit", "unaudited")
        }
        assert audits == {"exact": 2, "false_hit": 0, "unaudited": 0}
        counted = await client.messages.count_tokens(model="m", system=system, messages=messages)
        assert counted.input_tokens == first.usage.input_tokens


async def test_generate_endpoints_route_kv_aware():
    async with kv_fleet() as (_engines, _router, url, s):
        for body in (
            {"text": LONG, "sampling_params": {"max_new_tokens": 2}},
            {"input_ids": list(range(40, 120)), "sampling_params": {"max_new_tokens": 2}},
        ):
            seen = set()
            for _ in range(2):
                async with s.post(url + "/generate", json=body) as r:
                    assert r.status == 200, await r.text()
                    answer = await r.json()
                    seen.add(r.headers[ENGINE_HEADER])
            assert len(seen) == 1 and answer["meta_info"]["cached_tokens"] > 0
        async with s.post(url + "/generate", json={"sampling_params": {}}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "text"
        body = {"token_ids": list(range(130, 210)), "sampling_params": {"max_tokens": 2}}
        for cached in (False, True):
            async with s.post(url + "/inference/v1/generate", json=body) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            assert len(answer["choices"][0]["token_ids"]) == 2
            assert (answer["usage"]["prompt_tokens_details"]["cached_tokens"] > 0) is cached
        async with s.post(url + "/inference/v1/generate", json={"token_ids": "x"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "token_ids"


# ---- the pure parts --------------------------------------------------------------------------------


def test_the_id_scan_finds_the_response_id_across_chunks_and_never_an_item_id():
    body = b'{"id":"resp_abc123","object":"response","output":[{"id":"msg_x"}]}'
    for cut in range(1, len(body)):
        scan = ResponseIdScan()
        found = [scan.feed(body[:cut]), scan.feed(body[cut:])]
        assert [f for f in found if f] == ["resp_abc123"]
    stream = b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_9"}}\n\n'
    scan = ResponseIdScan()
    assert scan.feed(stream) == "resp_9" and scan.feed(stream) is None  # once
    scan = ResponseIdScan()
    assert scan.feed(b'{"previous_response_id":"resp_1","output":[{"id":"msg_2"}]}') is None
    scan.feed(b" " * SCAN_HEAD_BYTES)
    assert scan.done and scan.feed(b'"id":"resp_late"') is None  # only the head is looked at


def test_a_binding_resolves_to_its_target_its_engine_or_a_verdict():
    a0, a1 = Target("http://a", "http://a", 0), Target("http://a", "http://a", 1)
    b0 = Target("http://b", "http://b", 0)
    inc = {"http://a": "i1", "http://b": "i1"}
    assert resolve(None, (a0, b0), inc) == (Verdict.UNKNOWN, None)
    assert resolve(Remembered("http://a", 1, "i1"), (a0, a1, b0), inc) == (Verdict.FOUND, a1)
    assert resolve(Remembered("http://a", 1, "i1"), (a0, b0), inc) == (Verdict.FOUND, a0)  # rank out
    assert resolve(Remembered("http://a", 0, "i0"), (a0, b0), inc) == (Verdict.GONE, None)  # restarted
    assert resolve(Remembered("http://c", 0, "i1"), (a0, b0), inc) == (Verdict.GONE, None)  # left
    assert resolve(Remembered("http://a", 0, "i1"), (b0,), inc) == (Verdict.UNAVAILABLE, None)
    assert response_digest("resp_1") != response_digest("resp_2")
    assert response_digest("x") not in {digest(s, "", "x") for s in ("prompt_cache_key", "header")}


def test_responses_and_messages_become_the_chat_the_engine_renders():
    body = {
        "instructions": "Be brief.",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "c"}]},
            {"role": "developer", "content": "d"},
        ],
    }
    assert responses_chat(body)["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "developer", "content": "d"},
    ]
    assert responses_chat({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    for bad, reason in (
        ({"input": "x", "previous_response_id": "resp_1"}, Reason.UNSUPPORTED),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, Reason.UNSUPPORTED),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, Reason.UNSUPPORTED),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            Reason.MULTIMODAL,
        ),
        ({"input": [{"role": "assistant", "status": "in_progress", "content": "x"}]}, Reason.UNSUPPORTED),
        ({"input": 3}, Reason.REJECTED),
    ):
        with pytest.raises(Untokenizable) as err:
            responses_chat(bad)
        assert err.value.reason is reason
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc=1"}, {"type": "text", "text": "A"}]
    system.append({"type": "text", "text": "B"})
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "q"}]},
        {"role": "assistant", "content": "r"},
    ]
    assert messages_chat({"system": system, "messages": turns})["messages"] == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "q"},  # one text block is sent as a string
        {"role": "assistant", "content": "r"},
    ]
    for bad, reason in (
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, Reason.MULTIMODAL),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, Reason.UNSUPPORTED),
        ({"messages": [{"role": "system", "content": "s"}]}, Reason.UNSUPPORTED),
        ({"messages": []}, Reason.REJECTED),
    ):
        with pytest.raises(Untokenizable) as err:
            messages_chat(bad)
        assert err.value.reason is reason


def test_a_responses_request_keeps_its_namespace():
    """A salted or adapter request is matched in its own namespace, as chat and completions are."""
    parsed = parse_request({"input": "x", "cache_salt": "s", "lora_name": "l"}, Kind.RESPONSES)
    assert (parsed.cache_salt, parsed.lora_name) == ("s", "l")


def test_bindings_round_trip_in_the_envelope_apart_from_sessions_and_are_vetted():
    bindings = [
        WireSession(response_digest(f"resp_{i}"), f"http://e{i % 2}", i % 2, "i1", 10 * i) for i in range(6)
    ]
    snap = WireSnapshot(1, "p", "i", True, 4, "s", [], [], 0, responses=bindings)
    got = decode(encode(snap), Limits())
    assert got.responses == bindings and got.sessions == []
    assert {b.engine for b in vet_sessions(got.responses, {"http://e1": "i1"})} == {"http://e1"}


async def test_the_fake_engine_keeps_responses_per_incarnation():
    async with (
        run_fake_engine(block_size=BS) as engine,
        aiohttp.ClientSession() as s,
        openai.AsyncOpenAI(base_url=engine.http_url + "/v1", api_key="unused", max_retries=0) as client,
    ):
        first = await client.responses.create(model="m", input="hi", max_output_tokens=2)
        follow = await client.responses.create(model="m", input="on", previous_response_id=first.id)
        assert follow.usage.input_tokens > first.usage.input_tokens  # the history is part of the prompt
        unstored = await client.responses.create(model="m", input="x", store=False, max_output_tokens=1)
        async with s.get(engine.http_url + f"/v1/responses/{unstored.id}") as r:
            assert r.status == 404
        engine.restart()
        with pytest.raises(openai.NotFoundError):
            await client.responses.create(model="m", input="on", previous_response_id=first.id)
