"""The prediction audit (proxy/audit.py): the pure rule and the scan over every split of a response,
then a router over a real fake engine: exact predictions counted exact, a cache the engine lost
without telling anyone counted as false-hit tokens, streams audited from the usage they carry."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re

import aiohttp
import pytest
import zmq
import zmq.asyncio

from router_runtime.app import run_router
from router_runtime.bootstrap.config import InternalConfig
from router_runtime.config import RouterConfig
from router_runtime.kv.config import KvConfig
from router_runtime.kv.subscription import ReplayTimeouts
from router_runtime.proxy.audit import (
    Audit,
    AuditOutcome,
    Prediction,
    UsageScan,
    UsageStrip,
    explained,
    judge,
    request_usage,
)
from router_runtime.proxy.config import ProxyConfig
from router_runtime.proxy.health import HealthConfig
from router_runtime.proxy.salting import tenant_salt
from router_runtime.sessions.keys import tenant_of
from router_runtime.worker import WorkerSpec
from routerfleet_fake_engine.server import run_fake_engine
from tests.support import LOCAL_METRICS, router_over_fakes

from .support import eventually

BS = 4


def test_judge():
    assert judge(Prediction(32), 32) == Audit(AuditOutcome.EXACT)
    assert judge(Prediction(32), 16) == Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=16)
    assert judge(Prediction(0), 8) == Audit(AuditOutcome.MISSED_HIT, missed_hit_tokens=8)
    assert judge(Prediction(8), None) == Audit(AuditOutcome.UNAUDITED)


def test_what_a_remote_prefill_hands_the_engine_is_expected_beyond_the_claim():
    moved = Prediction(16, transferred_tokens=48)  # 16 of its own, up to 48 from a prefill engine
    assert judge(moved, 64) == Audit(AuditOutcome.EXACT, transferred_tokens=48)
    assert judge(moved, 40) == Audit(AuditOutcome.EXACT, transferred_tokens=24)
    assert judge(moved, 72) == Audit(AuditOutcome.MISSED_HIT, missed_hit_tokens=8, transferred_tokens=48)
    assert judge(moved, 8) == Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=8)  # its own prefix: a claim


def test_an_eviction_the_engine_announced_since_the_decision_is_not_a_false_hit():
    false_hit = judge(Prediction(64), 16)
    assert explained(false_hit, True) == Audit(AuditOutcome.EVICTED, evicted_tokens=48)
    assert explained(false_hit, False) == false_hit  # a loss without a word stays a false hit
    assert explained(judge(Prediction(64), 64), True) == judge(Prediction(64), 64)  # only false hits


BODY = json.dumps(
    {
        "choices": [{"text": 'a "cached_tokens": 999 in the text is escaped'}],
        "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 1234}},
    }
).encode()


@pytest.mark.parametrize("size", [1, 3, 7, 64, len(BODY)])
def test_the_scan_finds_the_figure_across_every_split_and_never_in_a_string(size):
    for offset in range(size):
        scan = UsageScan()
        chunks = [BODY[:offset], *(BODY[i : i + size] for i in range(offset, len(BODY), size))]
        for c in chunks:
            scan.feed(c)
        assert scan.cached_tokens == 1234, (size, offset)


def test_a_stream_reports_its_last_usage_and_none_without_it():
    scan = UsageScan()
    for n in (4, 8, 12):
        scan.feed(b'data: {"usage": {"prompt_tokens_details": {"cached_tokens": %d}}}\n\n' % n)
    assert scan.cached_tokens == 12
    scan = UsageScan()
    scan.feed(b'data: {"choices": [{"text": "x"}], "usage": null}\n\ndata: [DONE]\n\n')
    assert scan.cached_tokens is None


def test_usage_is_asked_for_only_on_streams_whose_client_left_stream_options_alone():
    raw = b' \n{"model": "m", "stream": true, "prompt": "caf\xc3\xa9 \\"q\\""}'
    asked = request_usage(raw, json.loads(raw))
    assert asked is not None and asked.startswith(b' \n{"stream_options":{"include_usage":true},')
    assert json.loads(asked) == {**json.loads(raw), "stream_options": {"include_usage": True}}
    assert asked.endswith(raw[3:])  # the client's bytes, unchanged behind the added key
    for body in (
        {"stream": False, "prompt": "x"},
        {"prompt": "x"},
        {"stream": "yes", "prompt": "x"},
        {"stream": True, "stream_options": {"include_usage": False}},
        {"stream": True, "stream_options": {"continuous_usage_stats": True}},
        {"stream": True, "stream_options": None},
    ):
        assert request_usage(json.dumps(body).encode(), body) is None, body
    utf16 = json.dumps({"stream": True, "prompt": "x"}).encode("utf-16-le")
    assert request_usage(utf16, json.loads(utf16)) is None


def _events(*chunks: dict, end: bytes = b"\n\n") -> bytes:
    return b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + end for c in chunks) + (
        b"data: [DONE]" + end
    )


def _chunk(text: str, finish=None, **extra) -> dict:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
    return {**base, "choices": [choice], **extra}


USAGE = {"prompt_tokens": 40, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 32}}
# SGLang's completion chunks carry "usage":null with or without include_usage: it is not the router's.
CHUNKS = [_chunk("a"), _chunk('"choices":[] in text', usage=None), _chunk("", "length")]
USAGE_ONLY = {**{k: v for k, v in _chunk("").items() if k != "choices"}, "choices": [], "usage": USAGE}


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"])
@pytest.mark.parametrize("size", [1, 2, 5, 17, 1 << 20])
def test_the_strip_gives_the_client_the_stream_it_would_have_had(end, size):
    """Across every split of the engine's bytes, the client gets exactly the stream it would have had
    without include_usage, and the scan the engine's figure."""
    engine = _events(*CHUNKS, USAGE_ONLY, end=end)
    wanted = _events(*CHUNKS, end=end)
    for offset in range(0, min(size, 9)):
        strip = UsageStrip()
        pieces = [engine[:offset], *(engine[i : i + size] for i in range(offset, len(engine), size))]
        out = b"".join(strip.feed(p) for p in pieces) + strip.flush()
        assert out == wanted, (size, offset)
        assert strip.scan.cached_tokens == 32


def test_the_strip_keeps_usage_an_engine_sends_unasked_and_an_unterminated_tail():
    """SGLang-style usage on the finishing chunk is the engine's own and stays; only the usage-only
    chunk goes. A stream cut before its blank line still passes on what it had."""
    engine = _events(_chunk("a"), _chunk("", "stop", usage=USAGE), USAGE_ONLY)
    strip = UsageStrip()
    out = strip.feed(engine) + strip.flush()
    assert out == _events(_chunk("a"), _chunk("", "stop", usage=USAGE))
    strip = UsageStrip()
    assert strip.feed(b'data: {"choices":[],"usage":null}') == b""
    assert strip.flush() == b'data: {"choices":[],"usage":null}'  # no usage object: not the usage chunk


def test_a_prediction_names_its_tiers():
    assert Prediction(48, tiers=(32, 16, 0, 0)).tier_header() == "device=32,host=16,disk=0,external=0"


def audited(router, outcome: str, doubtful: str = "false") -> float:
    return sum(
        router.registry.get_sample_value(
            "routerfleet_audit_requests_total",
            {"engine": e, "policy": "kv_aware", "outcome": outcome, "doubtful": doubtful},
        )
        or 0
        for e in router.targets.urls
    )


def debugging(tmp_path, **proxy) -> dict:
    """Config sections for a router that answers the debug prediction header to callers holding TOKEN
    (``proxy``: more of the request plane's section)."""
    path = tmp_path / "token"
    path.write_text(TOKEN)
    return {
        "internal": InternalConfig(port=0, token_file=str(path)),
        "proxy": ProxyConfig(debug_prediction=True, **proxy),
    }


@contextlib.asynccontextmanager
async def debugged(tmp_path, kv: KvConfig | None = None, **proxy):
    """A ready router over one fake engine whose events it follows, answering the debug prediction
    header to TOKEN (``proxy``: more of its request plane): (engine, router, url, session)."""
    async with run_fake_engine(block_size=BS, decode_tokens_per_s=0) as e:
        worker = WorkerSpec(e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=e.replay_endpoint(0))
        cfg = RouterConfig(
            port=0,
            metrics=LOCAL_METRICS,
            workers=(worker,),
            **debugging(tmp_path, **proxy),
            kv=kv or KvConfig(block_size=BS),
            health=HealthConfig(interval_s=0),
        )
        async with run_router(cfg) as (router, url), aiohttp.ClientSession() as s:
            await eventually(lambda: router.ready()[0], what="ready")
            yield e, router, url, s


TOKEN = "fleet-s3cret"
DEBUG = {"X-RouterFleet-Debug-Prediction": TOKEN}


async def test_a_router_audits_its_predictions_against_the_engine(tmp_path):
    async with debugged(tmp_path) as (e, router, url, s):
        prompt = list(range(1, 42))  # 10 blocks and a token: all 10 reusable (scheduling/reuse.py)
        debug = DEBUG
        body = {"prompt": prompt, "max_tokens": 1}
        async with s.post(url + "/v1/completions", json=body, headers=debug) as r:
            assert r.status == 200 and r.headers["X-RouterFleet-Predicted-Cached-Tokens"] == "0"
        await eventually(lambda: router.kv.index.node_count() >= 10, what="the blocks indexed")
        async with s.post(url + "/v1/completions", json=body, headers=debug) as r:
            usage = (await r.json())["usage"]
            assert r.headers["X-RouterFleet-Predicted-Cached-Tokens"] == "40"
            assert r.headers["X-RouterFleet-Prediction-Doubtful"] == "false"
            assert r.headers["X-RouterFleet-Predicted-Tiers"] == "device=40,host=0,disk=0,external=0"
        assert usage["prompt_tokens_details"]["cached_tokens"] == 40
        assert audited(router, "exact") == 2 and audited(router, "false_hit") == 0

        # The engine loses its cache and the event never arrives: the index is wrong, and the
        # audit is what says so.
        async with s.post(e.http_url + "/admin/clear", json={"rank": 0, "drop": "all"}) as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200 and "X-RouterFleet-Predicted-Cached-Tokens" not in r.headers
        assert audited(router, "false_hit") == 1
        false_hit = router.registry.get_sample_value(
            "routerfleet_audit_false_hit_tokens_total",
            {"engine": e.http_url, "policy": "kv_aware", "doubtful": "false"},
        )
        assert false_hit == 40
        # That request's own blocks came with a sequence past the lost one: a gap, replayed. A
        # prediction made while it is being filled is doubtful, so wait for it to settle.
        carrier = router.kv.subscriptions()[0].carrier
        await eventually(lambda: router.registry.get_sample_value("routerfleet_kv_gaps_total") == 1)
        await eventually(lambda: not router.doubtful(carrier), what="the gap settled")

        # Streams are audited whether or not the client asked for usage: the router asks, and a
        # client that did not gets the stream it would have had from the engine itself (the same
        # events but the id and timestamp), usage-only chunk and all taken out again.
        for options, usage_chunk in (({}, False), ({"stream_options": {"include_usage": True}}, True)):
            before = audited(router, "exact")
            stream = {"prompt": list(range(100, 140)), "max_tokens": 2, "stream": True, **options}
            async with s.post(url + "/v1/completions", json=stream) as r:
                via_router = await r.read()
            assert audited(router, "exact") == before + 1, options
            async with s.post(e.http_url + "/v1/completions", json=stream) as r:
                direct = await r.read()
            assert _same_events(via_router, direct) and (b'"choices":[]' in via_router) is usage_chunk


async def test_without_audit_stream_usage_a_stream_without_usage_is_unaudited_never_a_miss(tmp_path):
    async with debugged(tmp_path, audit_stream_usage=False) as (_e, router, url, s):
        stream = {"prompt": list(range(200, 240)), "max_tokens": 2, "stream": True}
        async with s.post(url + "/v1/completions", json=stream) as r:
            assert b"usage" not in await r.read()
        assert audited(router, "unaudited") == 1 and audited(router, "exact") == 0


def _same_events(a: bytes, b: bytes) -> bool:
    """Two streams of the same request, equal but for each response's id and creation time."""
    ids = re.compile(rb'"id":"[^"]*","object":"([^"]*)","created":\d+')
    return ids.sub(rb"\1", a) == ids.sub(rb"\1", b) and a.count(b"\n\n") >= 3


def test_a_prediction_knows_when_the_engine_must_have_stored_blocks():
    p = Prediction(16, reusable_tokens=39, block_size=16)  # a 40-token prompt: 2 full blocks reusable
    assert p.stores_blocks(16) and p.stores_blocks(0)
    assert not p.stores_blocks(32)  # both full blocks were cached: nothing new to store
    assert not Prediction(0, reusable_tokens=39).stores_blocks(0)  # no block size: no claim
    # a block-aligned 32-token prompt served 16 cached: its last block recomputed by rule, maybe held
    assert not Prediction(32, reusable_tokens=31, block_size=16).stores_blocks(16)


async def test_a_silent_stream_makes_the_rank_doubtful_until_a_batch_comes(tmp_path):
    """The engine serves requests that store blocks but its PUB stays silent (a partition TCP would
    hide): once it owes a batch for longer than --kv-stall-ms, the rank's predictions are doubtful and
    routerfleet_kv_stalled_ranks says so; the batch that finally comes (the gap filled by replay) ends
    it."""
    async with debugged(tmp_path, kv=KvConfig(block_size=BS, stall_s=0.3)) as (e, router, url, s):
        debug = DEBUG
        stalled = lambda: router.registry.get_sample_value("routerfleet_kv_stalled_ranks")  # noqa: E731

        async def complete(first: int) -> str:
            body = {"prompt": list(range(first, first + 40)), "max_tokens": 1}
            async with s.post(url + "/v1/completions", json=body, headers=debug) as r:
                assert r.status == 200
                return r.headers["X-RouterFleet-Prediction-Doubtful"]

        assert await complete(1) == "false"  # heard: its batch arrives
        await eventually(lambda: router.kv.index.node_count() >= 10, what="the blocks indexed")
        await asyncio.sleep(0.5)
        assert stalled() == 0 and await complete(1) == "false"  # all cached: nothing owed

        await e_admin(s, e, "mute", {"rank": 0})
        assert await complete(100) == "false"  # stores 10 blocks nobody hears of
        await eventually(lambda: stalled() == 1, what="the rank stalled")
        assert await complete(300) == "true"

        await e_admin(s, e, "mute", {"rank": 0, "on": False})
        await e_admin(s, e, "store", {"rank": 0, "token_ids": list(range(400, 440))})
        filled = {"outcome": "filled"}
        await eventually(
            lambda: router.registry.get_sample_value("routerfleet_kv_replays_total", filled) == 1,
            what="the gap filled by replay",
        )
        assert stalled() == 0 and await complete(500) == "false"


async def e_admin(s, e, what: str, body: dict) -> None:
    async with s.post(f"{e.http_url}/admin/{what}", json=body) as r:
        assert r.status == 200, await r.text()


async def test_the_prediction_is_answered_only_when_enabled_to_the_fleet_token_on_an_accepted_answer(
    tmp_path,
):
    """The prediction is an exact cache oracle: a guess of another tenant's secret, one block at a
    time, read 48 predicted tokens for a right guess and 32 for a wrong one. It is off by default; on,
    only the fleet token asks, and an answer the engine rejected (its 400) never carries it."""
    prompt = {"prompt": list(range(1, 41)), "max_tokens": 1}
    async with run_fake_engine(block_size=BS, decode_tokens_per_s=0) as e:
        worker = WorkerSpec(e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=e.replay_endpoint(0))
        for enabled in (False, True):
            extra = debugging(tmp_path) if enabled else {}
            cfg = RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                workers=(worker,),
                **extra,
                kv=KvConfig(block_size=BS),
                health=HealthConfig(interval_s=0),
            )
            async with run_router(cfg) as (router, url), aiohttp.ClientSession() as s:
                await eventually(lambda router=router: router.ready()[0], what="ready")
                asked = {}
                for who, value in (("anyone", "1"), ("a wrong token", "guess"), ("the fleet", TOKEN)):
                    for body in (prompt, {**prompt, "max_tokens": -1}):  # the second, the engine refuses
                        headers = {"X-RouterFleet-Debug-Prediction": value}
                        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                            asked[who, r.status] = "X-RouterFleet-Predicted-Cached-Tokens" in r.headers
                assert asked == {
                    ("anyone", 200): False,
                    ("anyone", 400): False,
                    ("a wrong token", 200): False,
                    ("a wrong token", 400): False,
                    ("the fleet", 200): enabled,
                    ("the fleet", 400): False,
                }


@pytest.mark.parametrize("enforced", [True, False], ids=["tenant_cache_salt", "off"])
async def test_a_tenant_derived_cache_salt_keeps_each_tenants_cache_its_own(tmp_path, enforced):
    """With --tenant-cache-salt, the engine itself (its cached-token figure) never serves one tenant
    the blocks another cached: not for the same prompt, not for a client that sends the other tenant's
    salt as its own; the router predicts under the salt the engine sees, so the audit stays exact.
    Off, a second tenant's first request reads the first tenant's cache (the leak the flag closes)."""
    prompt = {"prompt": list(range(1, 42)), "max_tokens": 1}  # 10 reusable blocks: 40 tokens
    tenancy = {"tenant_header": "Authorization", "tenant_cache_salt": enforced}
    async with debugged(tmp_path, **tenancy) as (_e, router, url, s):

        async def ask(key: str, **extra) -> tuple[int, int]:
            """(predicted, the engine's cached tokens) of ``prompt`` sent with API key ``key``."""
            headers = {**DEBUG, "Authorization": f"Bearer {key}"}
            async with s.post(url + "/v1/completions", json={**prompt, **extra}, headers=headers) as r:
                assert r.status == 200, await r.text()
                cached = (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"]
                predicted = int(r.headers["X-RouterFleet-Predicted-Cached-Tokens"])
            await eventually(lambda: router.kv.index.node_count() > 0, what="the blocks indexed")
            await asyncio.sleep(0.1)  # the store's events: the next prediction knows them
            return predicted, cached

        assert await ask("alice") == (0, 0)
        assert await ask("alice") == (40, 40)
        if not enforced:
            assert await ask("bob") == (40, 40)  # bob reads what alice cached
            return
        assert await ask("bob") == (0, 0)
        assert await ask("bob") == (40, 40)  # his own, now
        alices = tenant_salt(tenant_of({"Authorization": "Bearer alice"}, "Authorization"), None)
        assert await ask("mallory", cache_salt=alices) == (0, 0)  # a named salt is namespaced
        assert await ask("alice", cache_salt="per-user") == (0, 0)  # a client's salt parts within
        assert await ask("alice", cache_salt="per-user") == (40, 40)
        assert audited(router, "false_hit") == 0 and audited(router, "exact") == 7


async def test_a_rank_whose_gap_is_being_replayed_is_doubtful():
    """A gap is seen and the replay socket does not answer (a ROUTER that never replies): until the
    replay gives up and the rank goes cold, what the index holds for it lacks batches, and a
    prediction then is doubtful; after, it is a plain cold rank again."""
    ctx = zmq.asyncio.Context()
    mute = ctx.socket(zmq.ROUTER)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with run_fake_engine(block_size=BS, decode_tokens_per_s=0) as e:
            worker = WorkerSpec(e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=f"tcp://127.0.0.1:{port}")
            cfg = RouterConfig(
                port=0,
                metrics=LOCAL_METRICS,
                workers=(worker,),
                kv=KvConfig(block_size=BS, replay=ReplayTimeouts(idle_s=1.0)),
                health=HealthConfig(interval_s=0),
            )
            async with run_router(cfg) as (router, _), aiohttp.ClientSession() as s:
                await eventually(lambda: router.ready()[0], what="ready")
                carrier = router.kv.subscriptions()[0].carrier
                await e_admin(s, e, "store", {"rank": 0, "token_ids": list(range(1, 41))})
                await eventually(lambda: router.kv.index.node_count() >= 10, what="the blocks indexed")
                assert not router.doubtful(carrier)
                await e_admin(s, e, "skip_seq", {"rank": 0, "keep_in_replay": False})
                await e_admin(s, e, "store", {"rank": 0, "token_ids": list(range(100, 140))})
                await eventually(lambda: router.doubtful(carrier), what="the gap seen, its replay out")
                await eventually(lambda: not router.doubtful(carrier), what="the replay given up")
                cleared = {"reason": "replay_failed"}
                assert router.registry.get_sample_value("routerfleet_kv_ranks_cleared_total", cleared) == 1
    finally:
        mute.close(0)
        ctx.term()


@pytest.mark.timeout(60)
async def test_a_prefix_the_engine_evicts_while_the_request_waits_is_counted_evicted_not_a_false_hit():
    """Over real HTTP and ZMQ: a router over one engine with one running slot credits a cached prefix to
    a request that then waits behind a long stream; meanwhile the engine evicts the prefix and says so
    on its KV stream. Admitted with nothing cached, the request is audited as an eviction the engine
    announced since the decision, never as a false hit (and its rank is not withheld)."""
    prefix = list(range(700, 700 + 32 * BS))
    engine = {"max_concurrency": 1, "decode_tokens_per_s": 50}
    async with router_over_fakes(1, BS, engine=engine) as ([e], router, url, s):
        async with s.post(e.http_url + "/admin/store", json={"rank": 0, "token_ids": prefix}) as r:
            assert r.status == 200
        credited = lambda: sum(m.blocks for m in router.kv.index.match(prefix).values())  # noqa: E731
        await eventually(lambda: credited() == 32, what="the prefix indexed")
        hold = await s.post(
            url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 500, "stream": True}
        )
        await hold.content.readany()  # it holds the engine's one running slot
        body = {"prompt": [*prefix, 9, 9], "max_tokens": 2}
        waiting = asyncio.create_task(s.post(url + "/v1/completions", json=body))
        await eventually(lambda: e.load.waiting == 1, what="the request waiting for the slot")
        async with s.post(e.http_url + "/admin/remove", json={"rank": 0, "token_ids": prefix}) as r:
            assert r.status == 200
        await eventually(lambda: credited() == 0, what="the eviction applied")
        hold.close()
        async with await waiting as r:
            assert r.status == 200
            assert (await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        get = router.registry.get_sample_value
        labels = {"engine": e.http_url, "policy": "kv_aware", "doubtful": "false"}
        outcomes = lambda: {  # noqa: E731
            o: get("routerfleet_audit_requests_total", {**labels, "outcome": o})
            for o in ("exact", "false_hit", "evicted", "missed_hit", "unaudited")
        }
        await eventually(lambda: outcomes()["evicted"] == 1, what=f"the audit: {outcomes()}")
        assert get("routerfleet_audit_evicted_tokens_total", labels) == 32 * BS
        assert get("routerfleet_audit_false_hit_tokens_total", labels) == 0
        assert not router.kv.index.withheld
