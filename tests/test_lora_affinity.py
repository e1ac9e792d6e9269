"""LoRA affinity (router_runtime/scheduling/lora_affinity.py): a request for an adapter goes where the
adapter is loaded, by the engines' own reports (vLLM's ``vllm:lora_requests_info``) and what this router
sent where. Pure (the page parser, the kv_aware preset on a clock the test moves), then over real HTTP
against fake engines that model vLLM's adapter slots."""

from __future__ import annotations

import json

import pytest

from router_runtime.fleet.config import FleetConfig
from router_runtime.fleet.engine_metrics import ScrapeConfig, parse_engine_load
from router_runtime.fleet.gossip import GossipRejected, encode_report, vet_report
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.proxy.config import ProxyConfig
from router_runtime.scheduling.config import SchedulingConfig
from router_runtime.scheduling.lora_affinity import LoraAffinity
from router_runtime.scheduling.presets import PolicyConfig, make_policy
from router_runtime.scheduling.types import Adapters, RouteRequest, Target
from tests.support import router_over_fakes

BS = 4
A, B = (Target(e, f"http://{e}", 0) for e in ("a", "b"))
PROMPT = list(range(100, 100 + 8 * BS + 1))


def test_the_newest_adapter_report_on_a_page_is_the_engines_state():
    page = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="m"} 1',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,chat",waiting_lora_adapters="x"}'
            " 1.7e9",
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1e9',
            'vllm:lora_requests_info{max_lora="x",running_lora_adapters="bad",waiting_lora_adapters=""} 2e9',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="nan",waiting_lora_adapters=""} NaN',
        ]
    )
    sample = parse_engine_load(page, 1.0)
    assert sample.adapters == Adapters(2, frozenset({"sql", "chat"}), frozenset({"x"}))
    assert parse_engine_load('vllm:num_requests_running{engine="0"} 0', 1.0).adapters is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kv_aware(clock: Clock, **tuning):
    profile = make_policy("kv_aware", PolicyConfig(**tuning))
    [lora] = [s for s in profile.scorers if isinstance(s, LoraAffinity)]
    lora._clock = clock
    return profile


def choose(profile, index, adapter: str | None, prompt=PROMPT):
    return profile.choose(RouteRequest(tokens=prompt, lora_name=adapter), [A, B], {}, index)


def test_a_request_goes_where_its_adapter_is_loaded_by_the_engines_report():
    clock = Clock()
    index = RadixIndex(BS)
    profile = kv_aware(clock, inflight_ttl_s=0)
    profile.adapters_read("b", Adapters(2, frozenset({"sql"}), frozenset()))
    profile.adapters_read("a", Adapters(2, frozenset({"x", "y"}), frozenset()))
    d = choose(profile, index, "sql")
    assert d.target == B
    profile.ended(d)
    # An adapter nobody holds: where a slot is free (b) before where every slot is in use (a).
    d = choose(profile, index, "chat", prompt=[7, *PROMPT])
    assert d.target == B
    profile.ended(d)
    # The reports age out: what this router sent is what it knows then (it sent "chat" to b).
    clock.now += 5
    assert choose(profile, index, "chat", prompt=[8, *PROMPT]).target == B
    # No adapter: the scorer has no say (the request hash breaks the tie, whichever it is).
    off = kv_aware(clock, inflight_ttl_s=0, lora_load_cost_tokens=0)
    off.adapters_read("b", Adapters(2, frozenset({"sql"}), frozenset()))
    assert {choose(off, index, "sql", prompt=[i, *PROMPT]).target for i in range(16)} == {A, B}


def test_a_cached_prefix_can_outweigh_an_adapter_load():
    """The costs add: 8 blocks of the adapter's cached on a lose to one load on a (1024 tokens = 256
    blocks here) where b holds the adapter; 300 cached blocks win over it."""
    clock = Clock()
    index = RadixIndex(BS)
    profile = kv_aware(clock, inflight_ttl_s=0)
    profile.adapters_read("b", Adapters(1, frozenset({"sql"}), frozenset()))
    profile.adapters_read("a", Adapters(2, frozenset({"other"}), frozenset()))  # a free slot: one load
    for tokens, winner in ((PROMPT, B), (list(range(1000, 1000 + 300 * BS + 1)), A)):
        blocks = len(tokens) // BS
        stored = BlockStored(
            tuple(range(1, blocks + 1)), None, tuple(tokens[: blocks * BS]), BS, lora_name="sql"
        )
        index.apply_batch(A.carrier, EventBatch(0.0, (stored,)))
        d = choose(profile, index, "sql", prompt=tokens)
        assert d.target == winner, (blocks, d)
        profile.ended(d)
        index.clear_carrier(A.carrier)


def test_siblings_place_an_adapter_alike_and_tell_each_other_where_they_sent_it():
    clock = Clock()
    index = RadixIndex(BS)
    one, two, three, fresh = (kv_aware(clock, inflight_ttl_s=0) for _ in range(4))
    for p in (one, two, three, fresh):
        for e in "ab":
            p.adapters_read(e, Adapters(2, frozenset(), frozenset()))
    # Nothing loaded anywhere: every replica picks the same engine for a new adapter, on any prompt.
    homes = {choose(p, index, "sql", prompt=[i, *PROMPT]).target for p in (one, two) for i in range(8)}
    assert len(homes) == 1
    # What one sent where reaches the others with its load report: "chat", sent by one to where its
    # home is not, draws the siblings' "chat" requests there.
    chat_home = choose(fresh, index, "chat").target
    elsewhere = B if chat_home == A else A
    one.choose(RouteRequest(tokens=PROMPT, lora_name="chat"), [elsewhere], {}, index)
    report = vet_report(encode_report("one", "1", 1, [], one.shared()))
    assert report.shared.adapters[elsewhere.engine][-1] == "chat"
    for p in (two, three):
        p.accept_peer(("one", "1"), report.shared, 2.0)
    assert choose(two, index, "chat", prompt=[99, *PROMPT]).target == elsewhere
    clock.now += 2.5  # the report aged out (and the engines' reads with it): the adapter's home again
    assert choose(three, index, "chat", prompt=[98, *PROMPT]).target == chat_home

    good = {"format": 1, "replica": "r", "incarnation": "i", "seq": 1, "targets": []}
    for bad in ([["e", ["x"] * 17]], [["e", "x"]], [["", ["x"]]], [["e", [1]]], {"e": ["x"]}):
        with pytest.raises(GossipRejected):
            vet_report(json.dumps({**good, "adapters": bad}).encode())


def fleet(lora_cost: float):
    """One router over 2 fake engines with one adapter slot each (50 ms to load one), their metrics read
    every 50 ms."""
    return router_over_fakes(
        2,
        BS,
        engine={"max_loras": 1, "lora_load_ms": 50, "decode_tokens_per_s": 0},
        proxy=ProxyConfig(engine_header=True),
        scheduling=SchedulingConfig(tuning=PolicyConfig(lora_load_cost_tokens=lora_cost)),
        fleet=FleetConfig(scrape=ScrapeConfig(interval_s=0.05)),
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cost", [1024.0, 0.0], ids=["affinity", "blind"])
async def test_each_adapter_stays_on_the_engine_that_loaded_it(cost):
    """Two adapters, one slot per engine, 16 requests alternating between them (distinct prompts: no
    cached prefix pulls them anywhere). With affinity each adapter is loaded once; blind, the tie-break
    scatters them and the engines load adapters over and over."""
    async with fleet(cost) as (engines, _router, url, s):
        for i in range(16):
            body = {"model": "m", "prompt": [i, *PROMPT], "max_tokens": 2, "lora_name": "ab"[i % 2]}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
        loads = sum(e.adapters.loads for e in engines)
        if cost:
            assert loads == 2
        else:
            assert loads > 4
