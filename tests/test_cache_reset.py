"""An engine's cache reset never leaves the fleet routing on blocks the engine dropped (kv/withhold.py):
over real ZMQ and HTTP, fake engines that announce a reset only with their next step's events (as vLLM
does) or lose their cache without a word, behind one router or three replicas.

Each test warms prompts through the routers, resets the engines one way, then sends every prompt
again, one at a time, and counts the audit's false hits:
* a flush through the router: none, on any replica;
* a reset or a loss behind the router's back: at most the first request per rank and replica (the
  audit withholds the rank until its engine's events show what it lost, or clears it at the bound).
"""

from __future__ import annotations

import asyncio

import pytest

from router_runtime.fleet.notices import KvNotice, NoticeKind, NoticeRejected, encode_notice, vet_notice
from router_runtime.kv.config import KvConfig
from router_runtime.proxy.audit import Audit, AuditOutcome, Prediction, denies
from router_runtime.proxy.config import ProxyConfig
from router_runtime.worker import Carrier

from .support import eventually, static_workers
from .test_fleet_load_http import BS as FLEET_BS
from .test_fleet_load_http import TOKEN, replicas, sample

BS = 16
PROMPTS = [[1000 * p + i for i in range(6 * BS)] for p in range(1, 7)]  # six prompts of six blocks
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_denial_is_a_false_hit_beyond_the_engines_last_block_rule_made_in_no_doubt():
    p = Prediction(96, reusable_tokens=96, block_size=BS)
    assert denies(p, Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=96))
    assert not denies(p, Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=BS))  # vLLM's last-token rule
    assert not denies(Prediction(96, doubtful=True, block_size=BS), Audit(AuditOutcome.FALSE_HIT, 96))
    assert not denies(p, Audit(AuditOutcome.MISSED_HIT, missed_hit_tokens=96))


def test_a_notice_is_vetted_before_it_names_a_rank():
    n = KvNotice(NoticeKind.WITHHOLD_FLUSH, (Carrier("http://e:8000", 1),))
    assert vet_notice(encode_notice(n)) == n
    for bad in (
        b"[",
        b'{"format": 2, "kind": "flushed", "ranks": []}',
        b'{"format": 1, "kind": "forget_everything", "ranks": []}',
        b'{"format": 1, "kind": "flushed", "ranks": [{"engine": "", "rank": 0}]}',
        b'{"format": 1, "kind": "flushed", "ranks": [{"engine": "e", "rank": true}]}',
        b'{"format": 1, "kind": "flushed", "ranks": [{"engine": "e", "rank": -1}]}',
        b'{"format": 1, "kind": "flushed", "ranks": "all"}',
    ):
        with pytest.raises(NoticeRejected):
            vet_notice(bad)


def false_hit_requests(routers) -> int:
    """Requests the audit found predicted beyond what their engine had, over every replica."""
    return int(
        sum(
            sample(
                r,
                "routerfleet_audit_requests_total",
                engine=e,
                policy="kv_aware",
                outcome="false_hit",
                doubtful=d,
            )
            for r, _ in routers
            for e in r.targets.urls
            for d in ("true", "false")
        )
    )


async def complete(session, url: str, prompt: list[int]) -> dict:
    async with session.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def warm(session, routers, engines) -> None:
    """Every prompt cached on its engine and indexed, as every replica sees it."""
    for p in PROMPTS:
        await complete(session, routers[0][1], p)
    for router, _ in routers:
        await eventually(
            lambda router=router: sum(len(router.kv.index.match(p)) > 0 for p in PROMPTS) == len(PROMPTS),
            what="every prompt indexed",
        )


async def again(session, routers) -> int:
    """Each prompt once more, through the replicas in turn; the false-hit requests among them."""
    before = false_hit_requests(routers)
    for i, p in enumerate(PROMPTS):
        await complete(session, routers[i % len(routers)][1], p)
    return false_hit_requests(routers) - before


async def test_a_flush_through_the_router_routes_no_request_on_the_dropped_blocks(tmp_path):
    async with replicas(tmp_path, 3, engine_kw={"lazy_clear": True}) as (engines, routers, session):
        await warm(session, routers, engines)
        async with session.post(routers[0][0].internal_url + "/internal/flush_cache", headers=AUTH) as r:
            assert r.status == 200, await r.text()
            answer = await r.json()
        assert sorted(e["engine"] for e in answer["engines"]) == sorted(e.http_url for e in engines)
        assert all(e["status"] == 200 and e["path"] == "/reset_prefix_cache" for e in answer["engines"])
        assert sorted(answer["siblings"]["withheld"].values()) == ["ok", "ok"]  # told before any reset
        assert all(not c.device_hashes() for e in engines for c in e.caches)  # the engines did reset
        assert await again(session, routers) == 0
        for router, _ in routers:  # every replica cleared both ranks, and gave them back
            assert sample(router, "routerfleet_kv_ranks_cleared_total", reason="flush") == 2
            assert sample(router, "routerfleet_kv_ranks_withheld") == 0
        # The ranks warm again from the engines' own events: the same prompts now hit, exactly.
        await warm(session, routers, engines)
        body = await complete(session, routers[1][1], PROMPTS[0])
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 5 * BS
        assert await again(session, routers) == 0


async def test_a_flushed_notice_clears_a_rank_this_replica_did_not_withhold(tmp_path):
    """A replica that missed a flush's first notice (it timed out, or the replica joined between the
    two) still clears the ranks when told the engines have reset: their caches are gone either way."""
    async with replicas(tmp_path, 1, engine_kw={"lazy_clear": True}) as (engines, routers, session):
        await warm(session, routers, engines)
        for e in engines:
            async with session.post(e.http_url + "/reset_prefix_cache") as r:
                assert r.status == 200
        (router, _), ranks = routers[0], tuple(c for e in engines for c in static_workers([e])[0].carriers())
        notice = encode_notice(KvNotice(NoticeKind.FLUSHED, ranks))
        async with session.post(router.internal_url + "/internal/kv_notice", data=notice, headers=AUTH) as r:
            assert r.status == 204, await r.text()
        await eventually(lambda: not any(router.kv.index.match(p) for p in PROMPTS), what="the ranks cleared")
        assert await again(session, routers) == 0


async def test_the_flush_needs_the_fleet_token_and_names_an_unknown_engine(tmp_path):
    async with replicas(tmp_path, 1) as (_engines, routers, session):
        url = routers[0][0].internal_url + "/internal/flush_cache"
        async with session.post(url) as r:
            assert r.status == 401
        async with session.post(url, headers=AUTH, json={"engines": ["http://nowhere:1"]}) as r:
            assert r.status == 400 and "http://nowhere:1" in (await r.json())["error"]["message"]
        async with session.post(url, headers=AUTH, json={"engines": "all"}) as r:
            assert r.status == 400


@pytest.mark.parametrize("how", ["lazy_reset", "lost_unannounced"])
async def test_a_reset_behind_the_routers_back_costs_one_false_hit_per_rank(tmp_path, how):
    """vLLM's reset, announced with the step that serves the next request, or a cache lost without a
    word (a restart behind a proxy that hides it): the first request per rank may land on the dropped
    blocks, over the whole fleet. The announced reset proves itself with that request's batch; the
    silent loss is found by the audit, which withholds the rank here and on every sibling until, with
    no event to show what went, the bound clears it."""
    async with replicas(
        tmp_path, 3, engine_kw={"lazy_clear": True}, kv=KvConfig(block_size=FLEET_BS, withhold_s=1.0)
    ) as (
        engines,
        routers,
        session,
    ):
        await warm(session, routers, engines)
        for e in engines:
            path = "/reset_prefix_cache" if how == "lazy_reset" else "/admin/lose_cache"
            async with session.post(e.http_url + path) as r:
                assert r.status == 200
        await asyncio.sleep(0.2)  # quiet: nothing announces the loss yet
        n = await again(session, routers)
        assert 1 <= n <= 2  # one per engine's rank that was asked again (two), over three replicas

        def total(name: str, **labels) -> float:
            return sum(sample(r, name, **labels) for r, _ in routers)

        if how == "lazy_reset":
            assert total("routerfleet_kv_ranks_cleared_total", reason="all_blocks_cleared") >= n * 3
            assert total("routerfleet_kv_rank_withholds_total", reason="false_hit") == 0  # proved already
        else:
            assert total("routerfleet_kv_rank_withholds_total", reason="false_hit") == 2
            assert total("routerfleet_kv_rank_withholds_total", reason="sibling_false_hit") == 2 * 2
            for router, _ in routers:
                await eventually(
                    lambda r=router: (
                        sample(r, "routerfleet_kv_ranks_cleared_total", reason="withhold_expired") == 2
                    ),
                    what="both ranks cleared at the bound",
                )
            assert total("routerfleet_kv_ranks_withheld") == 0
        # Either way the fleet routes right again: what is indexed now is what the engines announced.
        # (Fresh prompts sharing the old prefixes: with the loss unannounced and no withhold, each one
        # would be a false hit, as test_without_the_withhold_every_lost_prefix_is_a_false_hit shows.)
        for p in PROMPTS:  # stored anew where the index cleared them
            await complete(session, routers[0][1], [*p, 7])
        assert await again(session, routers) == 0


async def test_without_the_withhold_every_lost_prefix_is_a_false_hit(tmp_path):
    """--no-audit-withhold (the router before withholds): a cache lost without a word costs a false hit
    per cached prompt, not per rank."""
    async with replicas(tmp_path, 1, proxy=ProxyConfig(audit_withhold=False)) as (engines, routers, session):
        await warm(session, routers, engines)
        for e in engines:
            async with session.post(e.http_url + "/admin/lose_cache") as r:
                assert r.status == 200
        assert await again(session, routers) == len(PROMPTS)
