"""Prefill/decode disaggregation (docs/disaggregation.md): the decider and vLLM's wire shapes without I/O,
then a router over real HTTP and ZMQ with fake engines serving vLLM's disaggregated prefill."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import aiohttp
import pytest
from aiohttp import web

from router_runtime.app import Router, run_router
from router_runtime.config import RouterConfig
from router_runtime.disaggregation import sglang, vllm
from router_runtime.disaggregation.config import DisaggregationConfig, Protocol
from router_runtime.disaggregation.decider import Verdict, need, paired, sooner
from router_runtime.disaggregation.prefill import Prompt
from router_runtime.disaggregation.queues import PrefillQueues
from router_runtime.discovery.static import parse_worker
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.config import ProxyConfig, Timeouts
from router_runtime.proxy.health import HealthConfig
from router_runtime.scheduling.types import Decision, Kind, Reason, RouteRequest, Target
from router_runtime.tracing.config import TracingConfig
from router_runtime.tracing.spans import Trace, Tracer
from router_runtime.worker import Role
from routerfleet_fake_engine import transfer
from routerfleet_fake_engine.server import FakeEngine, run_fake_engine
from tests.support import LOCAL_METRICS, closed_port_url, eventually, join_all, loopback_app, static_workers

BS = 4
ENGINE_HEADER = "X-RouterFleet-Engine"


# ---- the decision, pure ----------------------------------------------------------------------


def decided(matched: int) -> Decision:
    return Decision(Target("d", "http://d"), Reason.PREFIX, matched_blocks=matched)


def test_the_decode_engines_uncached_suffix_decides_whether_to_prefill_remotely():
    assert need(decided(0), 64, BS, 16) == need(decided(0), 64, BS, 16)
    assert need(decided(0), 64, BS, 16).remote  # 64 tokens missing
    short = need(decided(14), 64, BS, 16)  # 8 missing
    assert (short.remote, short.uncached_tokens, short.verdict) == (False, 8, Verdict.SHORT_SUFFIX)
    at = need(decided(12), 64, BS, 16)  # exactly the threshold: remote
    assert at.remote and at.uncached_tokens == 16
    assert need(decided(16), 64, BS, 0).remote  # 0: always remote, even with nothing missing
    unknown = need(decided(0), None, BS, 16)  # not tokenized: the suffix is unknown
    assert unknown.remote and unknown.uncached_tokens is None


def test_a_prefill_engine_pairs_only_with_a_decode_engine_of_its_revision():
    revisions = {"d": "r1", "p1": "r1", "p2": "r2", "p3": ""}
    prefill = tuple(Target(e, f"http://{e}") for e in ("p1", "p2", "p3"))
    assert [t.engine for t in paired(prefill, Target("d", "http://d"), revisions.get)] == ["p1"]
    assert [t.engine for t in paired(prefill, Target("x", "http://x"), lambda e: revisions.get(e, ""))] == [
        "p3"
    ]


def test_static_workers_name_their_role_and_revision():
    w = parse_worker("url=http://p:8000,kv=tcp://p:5557,role=prefill,rev=abc")
    assert (w.role, w.revision) == (Role.PREFILL, "abc")
    assert parse_worker("http://d:8000").role is Role.BOTH
    with pytest.raises(ValueError, match="role must be one of"):
        parse_worker("url=http://p:8000,role=encode")


def test_the_prefill_leg_asks_for_one_token_held_for_a_remote_decode():
    body = {
        "model": "m",
        "prompt": "hi",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 50,
        "max_completion_tokens": 50,
        "min_tokens": 5,
        "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "attacker"},
    }
    leg = json.loads(vllm.prefill_body(body))
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["kv_transfer_params"]["remote_host"] is None  # the client's own never passes
    assert body["max_tokens"] == 50  # the client's body is left as it is


def test_a_prefill_answer_is_vetted_before_its_parameters_reach_a_decode_engine():
    good = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    assert vllm.vet_answer(json.dumps({"kv_transfer_params": good}).encode()) == vllm.TransferParams(good)
    deep = b"[" * 100_000 + b"]" * 100_000
    surrogate = b'{"kv_transfer_params": {"do_remote_prefill": true, "x": "\\ud800"}}'
    for answer in (
        deep,  # past the parser's recursion: refused, not raised
        surrogate,  # a lone surrogate cannot be passed on
        b"not json",
        b"[1]",
        json.dumps({"choices": []}).encode(),
        json.dumps({"kv_transfer_params": "x"}).encode(),
        json.dumps({"kv_transfer_params": {"do_remote_prefill": False}}).encode(),
        json.dumps({"kv_transfer_params": {**good, "pad": "x" * vllm.MAX_PARAMS_BYTES}}).encode(),
    ):
        assert vllm.vet_answer(answer) is None, answer[:40]


def test_the_decode_leg_carries_the_prefills_parameters_and_never_the_clients():
    params = vllm.TransferParams({"do_remote_prefill": True, "remote_engine_id": "e"})
    raw = b'{"prompt": "hi",  "max_tokens": 3}'
    sent = vllm.decode_body(raw, json.loads(raw), params)
    assert sent.endswith(b'"prompt": "hi",  "max_tokens": 3}')  # the client's bytes, one member added
    assert json.loads(sent)["kv_transfer_params"] == params.value
    own = {"prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "attacker"}}
    assert json.loads(vllm.decode_body(json.dumps(own).encode(), own, params))["kv_transfer_params"] == (
        params.value
    )
    assert "kv_transfer_params" not in json.loads(vllm.decode_body(json.dumps(own).encode(), own, None))
    assert vllm.decode_body(raw, json.loads(raw), None) == raw


def test_the_fake_decode_leg_takes_the_blocks_past_its_own_prefix():
    assert transfer.received_blocks(66, 0, 16, BS) == 16
    assert transfer.received_blocks(66, 40, 16, BS) == 6
    assert transfer.received_blocks(66, 64, 16, BS) == 0
    assert transfer.received_blocks(66, 0, 10, BS) == 10  # no more than offered
    assert transfer.remote_of({"prompt": "x"}) is None
    with pytest.raises(transfer.TransferError):
        transfer.remote_of({"kv_transfer_params": {"do_remote_prefill": True}})


def test_a_long_prompt_goes_where_it_starts_soon_enough_and_each_prompt_leaves_its_queue_once():
    d, p1, p2 = (Target(e, f"http://{e}") for e in ("d", "p1", "p2"))
    queues = PrefillQueues()
    assert sooner((p1, p2), d, queues.get, 0) == (p1, p2)  # nothing queued anywhere: remote
    first = queues.add(p1, 2048)
    assert sooner((p1, p2), d, queues.get, 0) == (p2,)
    second = queues.add(p2, 100)
    assert sooner((p1, p2), d, queues.get, 0) == ()  # both backed up: the decode engine starts it sooner
    assert sooner((p1, p2), d, queues.get, 100) == (p2,)  # within the margin: worth the wait
    local = queues.add(d, 100)
    assert sooner((p1, p2), d, queues.get, 0) == (p2,)  # as much queued here as there: remote
    for q in (first, first, second, local):  # done twice counts once
        q.done()
    assert (queues.get(p1), queues.get(p2), queues.get(d), queues.total) == (0, 0, 0, 0)


# ---- a router over fake engines ----------------------------------------------------------------


@dataclasses.dataclass
class Fleet:
    decoders: list[FakeEngine]
    prefillers: list[FakeEngine]
    router: Router
    url: str
    session: aiohttp.ClientSession


@contextlib.asynccontextmanager
async def pd_fleet(
    decode: int = 2,
    prefill: int = 2,
    *,
    extra=(),
    revisions=None,
    threshold=16,
    timeout_s=10.0,
    protocol=Protocol.VLLM,
    engine_kw=None,
    engine_revisions=None,
    first_byte_s=600.0,
    shared_compute=False,
):
    """``decode`` and ``prefill`` fake engines serving ``protocol``'s disaggregated prefill, as static
    workers of one kv_aware router (``extra``: more WorkerSpecs; ``revisions``: per engine, decode ones
    first)."""
    sglang = protocol is Protocol.SGLANG
    async with contextlib.AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(
                run_fake_engine(
                    block_size=BS,
                    kv_transfer=not sglang,
                    disaggregation_mode=("decode" if i < decode else "prefill") if sglang else "",
                    revision=engine_revisions[i] if engine_revisions else "",
                    shared_compute=shared_compute,
                    **(engine_kw or {}),
                )
            )
            for i in range(decode + prefill)
        ]
        revs = revisions or [""] * len(engines)
        workers = [
            dataclasses.replace(
                w,
                role=Role.DECODE if i < decode else Role.PREFILL,
                revision=revs[i],
                bootstrap_port=engines[i].port if sglang and i >= decode else None,  # the fake's own port
            )
            for i, w in enumerate(static_workers(engines))
        ]
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=(*workers, *extra),
            kv=KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
            proxy=ProxyConfig(engine_header=True, timeouts=Timeouts(first_byte_s=first_byte_s)),
            disaggregation=DisaggregationConfig(
                protocol=protocol, threshold_tokens=threshold, prefill_timeout_s=timeout_s
            ),
        )
        router, url = await stack.enter_async_context(run_router(cfg))
        await join_all(router, engines)
        session = await stack.enter_async_context(aiohttp.ClientSession())
        yield Fleet(engines[:decode], engines[decode:], router, url, session)


def verdicts(router) -> dict[str, float]:
    get = router.registry.get_sample_value
    return {v.value: get("routerfleet_pd_prefills_total", {"verdict": v.value}) or 0 for v in Verdict}


async def chat_stream(s, url, prompt, path="/v1/completions") -> tuple[str, str]:
    """A streamed completion's engine and text."""
    body = {"prompt": prompt, "max_tokens": 4, "stream": True}
    async with s.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        text = (await r.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        return r.headers[ENGINE_HEADER], text


def audits(router, decode_engine=None) -> dict[str, float]:
    """The prefill legs' audit outcomes, or (``decode_engine``) the proxy's audit of that engine."""
    out = {}
    for metric in router.registry.collect():
        for sample in metric.samples:
            if decode_engine is None and sample.name == "routerfleet_pd_prefill_audits_total":
                out[sample.labels["outcome"]] = sample.value
            elif (
                sample.name == "routerfleet_audit_requests_total" and sample.labels["engine"] == decode_engine
            ):
                out[sample.labels["outcome"]] = out.get(sample.labels["outcome"], 0) + sample.value
    return {k: v for k, v in out.items() if v}


def legs(engines, field):
    return [getattr(e.rank_stats[0], field) for e in engines]


async def test_a_long_uncached_prompt_prefills_remotely_and_its_next_turn_on_the_decode_engine():
    async with pd_fleet() as f:
        prompt = list(range(100, 166))  # 66 tokens: 16 full blocks
        engine, _ = await chat_stream(f.session, f.url, prompt)
        decoder = next(e for e in f.decoders if e.http_url == engine)
        assert sum(legs(f.prefillers, "prefill_legs")) == 1
        # The decode engine pulled every full block from the prefill engine and reported them cached.
        assert (decoder.rank_stats[0].decode_legs, decoder.rank_stats[0].received_blocks) == (1, 16)
        assert decoder.rank_stats[0].cached_tokens == 64
        assert verdicts(f.router)["remote"] == 1
        assert f.router.registry.get_sample_value("routerfleet_pd_remote_prefill_tokens_total") == 66
        # Both legs audited exact: the prefill engine had nothing cached, as its decision credited; the
        # decode engine's 64 cached tokens are the transfer's, expected beyond its own (empty) prefix.
        assert audits(f.router) == {"exact": 1}
        assert audits(f.router, engine) == {"exact": 1}
        # Both engines published the blocks: the next turn goes to the decode engine, whose uncached
        # suffix is now short: it prefills the rest itself.
        await asyncio.sleep(0.2)
        again, _ = await chat_stream(f.session, f.url, [*prompt, 7, 7, 7, 7, 7, 7])
        assert again == engine
        assert verdicts(f.router)["short_suffix"] == 1
        assert sum(legs(f.prefillers, "prefill_legs")) == 1 and decoder.rank_stats[0].decode_legs == 1
        assert audits(f.router, engine) == {"exact": 2}


async def test_behind_a_backed_up_prefill_engine_the_decode_engine_prefills_a_long_prompt_itself():
    """A long prompt waits for no prefill engine with more queued to prefill than its decode engine:
    that engine starts it sooner. Once the queue drains, long prompts go remote again."""
    slow = {"prefill_us_per_token": 5000.0, "decode_tokens_per_s": 10}  # 66 uncached tokens: 0.33 s
    async with pd_fleet(decode=1, prefill=1, engine_kw=slow, shared_compute=True) as f:
        queues = f.router.proxy.prefill.queues
        first = asyncio.create_task(chat_stream(f.session, f.url, list(range(100, 166))))
        await eventually(lambda: queues.total == 66, timeout=5, what="the first prompt queued remotely")
        body = {"prompt": list(range(200, 266)), "max_tokens": 4, "stream": True}
        async with f.session.post(f.url + "/v1/completions", json=body) as r:  # the prefill engine is busy
            assert r.status == 200
            await r.content.readany()  # its first token: the decode engine prefilled it
            (decode,) = [t for t in f.router.targets.candidates() if t.engine == f.decoders[0].http_url]
            assert queues.get(decode) == 0  # out of its queue while it decodes
            await r.read()
        await first
        assert verdicts(f.router)["remote"] == 1 and verdicts(f.router)["prefill_busy"] == 1
        assert legs(f.prefillers, "prefill_legs") == [1] and legs(f.decoders, "decode_legs") == [1]
        assert queues.total == 0  # each prompt left its queue (the decode engine's at its first byte)
        await chat_stream(f.session, f.url, list(range(300, 366)))
        assert verdicts(f.router)["remote"] == 2


async def test_only_a_streamed_prompt_waits_in_its_decode_engines_queue():
    """A prompt counts in its decode engine's queue until its first byte says it is prefilled: a whole
    answer's first byte comes after the generation, so a prompt answered whole is not counted."""
    async with pd_fleet(decode=1, prefill=1) as f:
        prefill = f.router.proxy.prefill
        candidates = f.router.targets.candidates()
        (decode,) = [t for t in candidates if t.engine == f.decoders[0].http_url]
        (busy,) = prefill.targets.prefill_candidates()
        backlog = prefill.queues.add(busy, 1000)  # the prefill engine backed up
        legs_ = []
        for streamed in (True, False):
            tokens = list(range(100, 166))
            body = {"prompt": tokens, "max_tokens": 1, "stream": streamed}
            prompt = Prompt(
                Kind.COMPLETION, json.dumps(body).encode(), body, {}, RouteRequest(tokens), f.router.kv.index
            )
            legs_.append(
                await prefill.decode_leg(prompt, Decision(decode, Reason.NO_MATCH), "/v1/completions")
            )
        assert [leg.verdict for leg in legs_] == [Verdict.PREFILL_BUSY] * 2
        assert legs_[0].queued is not None and legs_[1].queued is None
        assert prefill.queues.get(decode) == 66
        legs_[0].queued.done()
        backlog.done()
        assert prefill.queues.total == 0


async def test_a_prefill_engine_that_refuses_is_skipped_and_without_one_the_decode_engine_prefills():
    dead = dataclasses.replace(parse_worker(closed_port_url()), role=Role.PREFILL)
    async with pd_fleet(prefill=1, extra=(dead,)) as f:
        for i in range(4):  # whichever the profile picks first, the live one serves
            await chat_stream(f.session, f.url, list(range(1000 * (i + 1), 1000 * (i + 1) + 40)))
        assert verdicts(f.router)["remote"] == 4
        assert sum(legs(f.decoders, "decode_legs")) == 4
    async with pd_fleet(prefill=0, extra=(dead,)) as f:
        await chat_stream(f.session, f.url, list(range(50, 90)))
        assert verdicts(f.router)["prefill_failed"] == 1
        assert sum(legs(f.decoders, "decode_legs")) == 0  # prefilled locally, no transfer asked
        get = f.router.registry.get_sample_value
        assert get("routerfleet_pd_prefill_leg_failures_total", {"reason": "connect"}) == 1


async def test_a_prefill_leg_that_errs_or_stalls_is_bounded_and_the_request_still_answered():
    async def failing(_request: web.Request) -> web.Response:
        return web.json_response({"error": "boom"}, status=500)

    async def stalling(_request: web.Request) -> web.Response:
        await released.wait()  # past the leg's deadline (set when the test is done with it)
        return web.json_response({})

    for handler, reason in ((failing, "status_5xx"), (stalling, "timeout")):
        released = asyncio.Event()
        async with loopback_app(web.post("/v1/completions", handler)) as bad:
            worker = dataclasses.replace(parse_worker(bad), role=Role.PREFILL)
            async with pd_fleet(prefill=0, extra=(worker,), timeout_s=0.3) as f:
                traces: list[Trace] = []
                f.router.proxy.tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:9"), traces.append)
                async with asyncio.timeout(10):
                    await chat_stream(f.session, f.url, list(range(50, 90)))
                assert verdicts(f.router)["prefill_failed"] == 1
                get = f.router.registry.get_sample_value
                assert get("routerfleet_pd_prefill_leg_failures_total", {"reason": reason}) == 1
                (leg,) = [s for s in traces[0].spans if s.name == "prefill"]  # its span says so too
                assert leg.error == reason and leg.attributes["routerfleet.pd.prefill_ok"] is False
            released.set()


async def test_the_first_bytes_deadline_holds_across_a_stalled_prefill_leg():
    """The first-byte timeout runs from dispatch, the prefill leg's time in it: a prefill engine that
    stalls past it (inside its own longer timeout) leaves the request a 504 at the deadline, not later,
    and no second leg is started on the other prefill engine once it has passed."""
    released = asyncio.Event()
    asked = []

    async def stalling(_request: web.Request) -> web.Response:
        asked.append(1)
        await released.wait()
        return web.json_response({})

    async with (
        loopback_app(web.post("/v1/completions", stalling)) as bad,
        loopback_app(web.post("/v1/completions", stalling)) as worse,
    ):
        workers = tuple(dataclasses.replace(parse_worker(u), role=Role.PREFILL) for u in (bad, worse))
        async with pd_fleet(prefill=0, extra=workers, timeout_s=30.0, first_byte_s=0.5) as f:
            t0 = time.monotonic()
            body = {"prompt": list(range(50, 90)), "max_tokens": 4}
            async with f.session.post(f.url + "/v1/completions", json=body) as r:
                assert r.status == 504, await r.text()
                assert (await r.json())["error"]["code"] == "first_byte_timeout"
            assert time.monotonic() - t0 < 3
            get = f.router.registry.get_sample_value
            assert get("routerfleet_pd_prefill_leg_failures_total", {"reason": "deadline"}) == 1
            assert len(asked) == 1
        released.set()


async def test_no_prefill_engine_of_the_decode_engines_revision_means_no_remote_prefill():
    async with pd_fleet(decode=1, prefill=1, revisions=["r1", "r2"]) as f:
        await chat_stream(f.session, f.url, list(range(50, 90)))
        assert verdicts(f.router)["no_prefill_engine"] == 1
        assert legs(f.prefillers, "prefill_legs") == [0]
    async with pd_fleet(decode=1, prefill=1, revisions=["r1", "r1"]) as f:
        await chat_stream(f.session, f.url, list(range(50, 90)))
        assert verdicts(f.router)["remote"] == 1


async def test_a_clients_own_transfer_parameters_never_reach_an_engine():
    async with pd_fleet(threshold=1000) as f:
        forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": list(range(10))}
        body = {"prompt": list(range(50, 90)), "max_tokens": 2, "kv_transfer_params": forged}
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        assert verdicts(f.router)["short_suffix"] == 1
        assert sum(legs(f.decoders, "decode_legs")) == 0  # the forged parameters were taken out


async def test_an_api_without_transfer_parameters_is_decoded_whole():
    async with pd_fleet() as f:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 200}]}
        async with f.session.post(f.url + "/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            assert any(e.http_url == r.headers[ENGINE_HEADER] for e in f.decoders)
        assert verdicts(f.router)["unsupported_api"] == 1
        assert sum(legs(f.prefillers, "prefill_legs")) == 0


async def test_a_decode_engine_that_restarts_between_the_legs_still_answers_and_no_false_hit_is_counted():
    """The decode engine loses its cache while the prefill leg runs: the decode leg pulls what it no
    longer holds, the client is answered, and the prefix the router credited there is no false hit (the
    engine reports it cached: it came over with the transfer)."""
    async with pd_fleet(decode=1, prefill=1) as f:
        (decoder,), (prefiller,) = f.decoders, f.prefillers
        prompt = list(range(100, 166))
        await chat_stream(f.session, f.url, prompt)  # the decode engine holds the 16 blocks now
        await asyncio.sleep(0.2)

        async def restarting_prefill(request: web.Request) -> web.Response:
            decoder.restart()  # between the legs: the prefill is computed, the decode not yet asked
            async with f.session.post(prefiller.http_url + request.path, data=await request.read()) as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        async with loopback_app(web.post("/v1/completions", restarting_prefill)) as via:
            f.router.targets.set_workers(  # the prefill engine, reached through the restarting proxy
                [
                    w if w.role is not Role.PREFILL else dataclasses.replace(w, url=via)
                    for w in f.router.config.workers
                ]
            )
            long_suffix = [*prompt, *range(300, 340)]  # 40 new tokens: over the threshold, remote
            engine, text = await chat_stream(f.session, f.url, long_suffix)
        assert engine == decoder.http_url and "[DONE]" in text
        assert verdicts(f.router)["remote"] == 2
        assert decoder.rank_stats[0].received_blocks == 16 + 26  # all 26 full blocks: its cache was lost
        assert audits(f.router, engine) == {"exact": 2}


# ---- SGLang's bootstrap rooms ------------------------------------------------------------------


def test_both_sglang_legs_carry_one_room_and_never_the_clients():
    own = {"text": "hi", "bootstrap_host": "attacker", "bootstrap_port": 1, "bootstrap_room": 7}
    room = sglang.Room("10.0.0.5", 8998, 12345)
    sent = json.loads(sglang.with_room(json.dumps(own).encode(), own, room))
    assert (sent["bootstrap_host"], sent["bootstrap_port"], sent["bootstrap_room"]) == (
        "10.0.0.5",
        8998,
        12345,
    )
    raw = b'{"text": "hi"}'
    assert sglang.with_room(raw, json.loads(raw), room).endswith(b'"text": "hi"}')  # the rest as sent
    assert 0 <= sglang.Room.new("h", 1).room < 1 << 63


async def test_sglang_prefills_every_request_remotely_in_one_room_with_the_decode_engine():
    async with pd_fleet(protocol=Protocol.SGLANG) as f:
        prompt = list(range(100, 166))
        engine, _ = await chat_stream(f.session, f.url, prompt)
        decoder = next(e for e in f.decoders if e.http_url == engine)
        assert sum(legs(f.prefillers, "prefill_legs")) == 1
        assert (decoder.rank_stats[0].decode_legs, decoder.rank_stats[0].received_blocks) == (1, 16)
        # A decode engine cannot prefill by itself: the next turn takes a room too, its prefix kept.
        await asyncio.sleep(0.2)
        again, _ = await chat_stream(f.session, f.url, [*prompt, 7, 7, 7, 7, 7, 7])
        assert again == engine and verdicts(f.router)["remote"] == 2
        assert decoder.rank_stats[0].received_blocks == 18  # the second turn pulled only its 2 new blocks
        body = {"text": "x" * 80, "sampling_params": {"max_new_tokens": 3}, "bootstrap_room": 5}
        async with f.session.post(f.url + "/generate", json=body) as r:  # SGLang's own API, a forged room
            assert r.status == 200, await r.text()
        assert verdicts(f.router)["remote"] == 3 and sum(legs(f.prefillers, "prefill_legs")) == 3


async def test_sglang_prefill_legs_planned_back_to_back_each_count_before_either_runs():
    """SGLang's prefill leg runs beside its decode leg, in a task of its own: it counts in its engine's
    load and prefill queue from its plan, not from when its task first runs, or a burst of requests
    planned before any leg started would all pick the same idle-looking prefill engine."""
    async with pd_fleet(protocol=Protocol.SGLANG) as f:
        prefill = f.router.proxy.prefill
        (decode, *_) = [t for t in f.router.targets.candidates() if t.engine == f.decoders[0].http_url]
        legs_ = []
        for k in (1000, 2000):  # planned back to back, as a burst's handlers may run
            tokens = list(range(k, k + 66))
            body = {"prompt": tokens, "max_tokens": 1}
            prompt = Prompt(
                Kind.COMPLETION, json.dumps(body).encode(), body, {}, RouteRequest(tokens), f.router.kv.index
            )
            legs_.append(
                await prefill.decode_leg(prompt, Decision(decode, Reason.NO_MATCH), "/v1/completions")
            )
        assert prefill.queues.total == 2 * 66 and f.router.load.total == 2  # neither task has run yet
        assert {leg.prefill.engine for leg in legs_} == {e.http_url for e in f.prefillers}
        for leg in legs_:
            leg.ready.cancel()  # never run: what the legs held is let go all the same
        await asyncio.gather(*(leg.ready for leg in legs_), return_exceptions=True)
        assert prefill.queues.total == 0 and f.router.load.total == 0


async def test_an_sglang_prefill_that_fails_fails_the_request_clearly_and_never_holds_it():
    dead = dataclasses.replace(parse_worker(closed_port_url()), role=Role.PREFILL, bootstrap_port=1)
    async with pd_fleet(prefill=0, extra=(dead,), protocol=Protocol.SGLANG) as f:
        body = {"prompt": list(range(50, 90)), "max_tokens": 4, "stream": True}
        async with asyncio.timeout(10), f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 502, await r.text()
            assert (await r.json())["error"]["code"] == "prefill_failed"
    async with pd_fleet(decode=1, prefill=1, revisions=["r1", "r2"], protocol=Protocol.SGLANG) as f:
        traces: list[Trace] = []
        f.router.proxy.tracer = Tracer(TracingConfig(endpoint="http://127.0.0.1:9"), traces.append)
        body = {"prompt": list(range(50, 90)), "max_tokens": 4}
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 503, await r.text()
        assert verdicts(f.router)["no_prefill_engine"] == 1
        (up,) = [sp for sp in traces[0].spans if sp.name == "upstream"]  # nothing sent: its span says why
        assert up.error == "no_engine" and up.attributes["routerfleet.engine"] == f.decoders[0].http_url


# ---- what a client or a half-listed fleet cannot make the router do ------------------------------


async def test_with_no_prefill_engine_listed_a_clients_own_fields_still_never_pass():
    forged = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": list(range(10))}
    body = {"prompt": list(range(50, 90)), "max_tokens": 2, "kv_transfer_params": forged}
    async with pd_fleet(prefill=0) as f:  # the prefill pool scaled to nothing: still a P/D fleet
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        assert verdicts(f.router)["no_prefill_engine"] == 1 and sum(legs(f.decoders, "decode_legs")) == 0
    async with pd_fleet(prefill=0, protocol=Protocol.SGLANG) as f:  # SGLang's decode engines need one
        room = {"prompt": "x" * 40, "bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 3}
        async with f.session.post(f.url + "/v1/completions", json=room) as r:
            assert r.status == 503, await r.text()


async def test_a_whole_engine_in_a_disaggregated_fleet_prefills_its_own():
    async with run_fake_engine(block_size=BS, kv_transfer=True) as whole:
        (spec,) = static_workers([whole])
        spec = dataclasses.replace(spec, kv=None, replay=None)  # its events unfollowed: no join to wait for
        async with pd_fleet(decode=0, prefill=1, extra=(spec,)) as f:
            await chat_stream(f.session, f.url, list(range(50, 90)))
            assert verdicts(f.router)["whole_engine"] == 1 and legs(f.prefillers, "prefill_legs") == [0]


async def test_a_retry_on_another_decode_engine_reuses_the_prefill():
    dead = dataclasses.replace(parse_worker(closed_port_url()), role=Role.DECODE)
    async with pd_fleet(decode=1, prefill=1, extra=(dead,)) as f:

        def retried() -> float | None:
            return f.router.registry.get_sample_value("routerfleet_retries_total", {"reason": "connect"})

        sent = 0
        while not retried() and sent < 16:  # until a request tries the dead decode engine first
            sent += 1
            await chat_stream(f.session, f.url, list(range(1000 * sent, 1000 * sent + 40)))
        assert retried() == 1
        # The retry sent the same transfer parameters to the live decode engine: one prefill each.
        assert legs(f.prefillers, "prefill_legs") == [sent] and verdicts(f.router)["remote"] == sent
        assert f.decoders[0].rank_stats[0].decode_legs == sent


async def test_a_retry_on_a_whole_engine_prefills_there_not_from_the_leg_made_for_a_decode_engine():
    dead = dataclasses.replace(parse_worker(closed_port_url()), role=Role.DECODE)
    async with run_fake_engine(block_size=BS, kv_transfer=True) as whole:
        (spec,) = static_workers([whole])
        spec = dataclasses.replace(spec, kv=None, replay=None)  # its events unfollowed: no join to wait for
        async with pd_fleet(decode=0, prefill=1, extra=(dead, spec)) as f:

            def retried() -> float | None:
                return f.router.registry.get_sample_value("routerfleet_retries_total", {"reason": "connect"})

            sent = 0
            while not retried() and sent < 16:  # until a request tries the dead decode engine first
                sent += 1
                engine, _ = await chat_stream(f.session, f.url, list(range(1000 * sent, 1000 * sent + 40)))
                assert engine == whole.http_url
            assert retried() == 1
            # The retried request's prefill leg ran for the dead engine; the whole engine was never sent
            # its transfer parameters (it would have pulled the blocks), and prefilled every request.
            assert legs(f.prefillers, "prefill_legs") == [1]
            assert (whole.rank_stats[0].decode_legs, whole.rank_stats[0].received_blocks) == (0, 0)
            assert verdicts(f.router)["whole_engine"] == sent


async def test_an_sglang_decode_engine_that_refuses_a_request_answers_for_itself():
    async with pd_fleet(protocol=Protocol.SGLANG, engine_kw={"max_model_len": 100}) as f:
        body = {"prompt": list(range(50, 90)), "max_tokens": 80}  # the prefill leg's one token fits
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 400, await r.text()
            assert "maximum context length" in (await r.json())["error"]["message"]
        messages = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        async with f.session.post(f.url + "/v1/messages", json=messages) as r:
            assert r.status == 400 and "completions, chat and /generate" in await r.text()


async def test_engines_of_two_revisions_refuse_each_others_kv_and_the_router_never_pairs_them():
    body = {"prompt": list(range(50, 90)), "max_tokens": 2}
    # The router not told their revisions: a remote prefill pairs them, and the decode engine refuses.
    async with pd_fleet(decode=1, prefill=1, engine_revisions=["v1", "v2"]) as f:
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 500 and "cross-revision" in await r.text()
        assert f.decoders[0].rank_stats[0].cross_revision == 1
    # Told (discovery reads them off the pods): the decode engine prefills by itself.
    async with pd_fleet(decode=1, prefill=1, engine_revisions=["v1", "v2"], revisions=["v1", "v2"]) as f:
        async with f.session.post(f.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
        assert (
            verdicts(f.router)["no_prefill_engine"] == 1 and f.decoders[0].rank_stats[0].cross_revision == 0
        )
