"""The prediction audit (proxy/audit.py): the pure rule and the scan over every split of a response,
then a router over a real fake engine: exact predictions counted exact, a cache the engine lost
without telling anyone counted as false-hit tokens, streams audited from the usage they carry."""

from __future__ import annotations

import json

import aiohttp
import pytest

from router_runtime.app import run_router
from router_runtime.config import RouterConfig
from router_runtime.fake_engine.server import run_fake_engine
from router_runtime.kv.plane import WorkerSpec
from router_runtime.proxy.audit import Audit, AuditOutcome, Prediction, UsageScan, judge

from .support import eventually

BS = 4


def test_judge():
    assert judge(Prediction(32), 32) == Audit(AuditOutcome.EXACT)
    assert judge(Prediction(32), 16) == Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=16)
    assert judge(Prediction(0), 8) == Audit(AuditOutcome.MISSED_HIT, missed_hit_tokens=8)
    assert judge(Prediction(8), None) == Audit(AuditOutcome.UNAUDITED)


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


def audited(router, outcome: str, doubtful: str = "false") -> float:
    return sum(
        router.registry.get_sample_value(
            "routerfleet_audit_requests_total",
            {"engine": e, "policy": "kv_aware", "outcome": outcome, "doubtful": doubtful},
        )
        or 0
        for e in router.targets.urls
    )


async def test_a_router_audits_its_predictions_against_the_engine():
    async with run_fake_engine(block_size=BS, decode_tokens_per_s=0) as e:
        worker = WorkerSpec(e.http_url, e.http_url, kv=e.kv_endpoint(0), replay=e.replay_endpoint(0))
        cfg = RouterConfig(port=0, workers=(worker,), block_size=BS, health_interval_s=0)
        async with run_router(cfg) as (router, url), aiohttp.ClientSession() as s:
            await eventually(lambda: router.ready()[0], what="ready")
            prompt = list(range(1, 41))  # 10 blocks
            debug = {"X-RouterFleet-Debug-Prediction": "1"}
            body = {"prompt": prompt, "max_tokens": 1}
            async with s.post(url + "/v1/completions", json=body, headers=debug) as r:
                assert r.status == 200 and r.headers["X-RouterFleet-Predicted-Cached-Tokens"] == "0"
            await eventually(lambda: router.kv.index.node_count() >= 10, what="the blocks indexed")
            async with s.post(url + "/v1/completions", json=body, headers=debug) as r:
                usage = (await r.json())["usage"]
                assert r.headers["X-RouterFleet-Predicted-Cached-Tokens"] == "40"
                assert r.headers["X-RouterFleet-Prediction-Doubtful"] == "false"
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

            # Streams are audited from the usage they carry (the fake engine sends it on the last
            # chunk, and again in the usage-only chunk when asked); with none, the pure scan says None.
            for options in ({}, {"stream_options": {"include_usage": True}}):
                before = audited(router, "exact")
                stream = {"prompt": list(range(100, 140)), "max_tokens": 2, "stream": True, **options}
                async with s.post(url + "/v1/completions", json=stream) as r:
                    await r.read()
                assert audited(router, "exact") == before + 1, options
