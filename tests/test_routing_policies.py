"""Routing policies as pure functions of (request, targets, loads, index) plus their own state."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_runtime.kv.events import ALL_TIERS, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, Tier
from router_runtime.kv.index import RadixIndex
from router_runtime.proxy.request import Kind, parse_request
from router_runtime.scheduling.eviction_cost import EvictionCost
from router_runtime.scheduling.framework import Cycle, Profile
from router_runtime.scheduling.presets import POLICY_NAMES, PolicyConfig, make_policy
from router_runtime.scheduling.text_tree import TextTree
from router_runtime.scheduling.types import Reason, RouteRequest, Target

BS = 4
A = Target("a", "http://a", 0)
B = Target("b", "http://b", 0)
C = Target("c", "http://c", 0)
ABC = [A, B, C]
NO_GUARD = {"balance_abs_threshold": 10**9}

_hashes = itertools.count(1)


def prompt(n_blocks: int, base: int = 100, tail: int = 1) -> list[int]:
    """A prompt of ``n_blocks`` full blocks (token values base, base+1, ...) plus ``tail`` extra tokens:
    by default one, so that all ``n_blocks`` are reusable (an engine never reuses a prompt's last
    token: a block-aligned prompt's last block is not a hit; scheduling/reuse.py)."""
    return list(range(base, base + n_blocks * BS + tail))


def store(index: RadixIndex, target: Target, tokens: list[int], medium: str | None = None, **ns) -> None:
    """``target`` caches every full block of ``tokens`` (a chain from the root) in ``medium``."""
    n = len(tokens) // BS
    hashes = tuple(next(_hashes) for _ in range(n))
    ev = BlockStored(hashes, None, tuple(tokens[: n * BS]), BS, medium=medium, **ns)
    index.apply_batch(target.carrier, EventBatch(0.0, (ev,)))


def kv(**kw) -> Profile:
    """kv_aware, each decision standing alone (no request it sent stays in flight, so no in-flight
    prediction: tests/test_inflight_prefix.py has those)."""
    return make_policy("kv_aware", PolicyConfig(**({"inflight_ttl_s": 0.0} | kw)))


def req(tokens, **kw) -> RouteRequest:
    return RouteRequest(tokens=tokens, **kw)


# ---- kv_aware --------------------------------------------------------------------------------------


def test_longest_prefix_wins():
    index = RadixIndex(BS)
    p = prompt(6, tail=2)
    store(index, A, p[: 2 * BS])
    store(index, B, p[: 5 * BS])
    for order in (ABC, [C, B, A], [A, C, B]):
        d = kv().choose(req(p), order, {}, index)
        assert (d.target, d.reason, d.matched_blocks, d.total_blocks) == (B, Reason.PREFIX, 5, 6)


def test_a_prediction_credits_only_what_the_engine_reuses():
    """The engines' rules (scheduling/reuse.py): a prompt's last token is computed, so a block-aligned
    prompt held whole is credited a block fewer; a request for prompt logprobs reads no cache (vLLM), or
    up to its logprob start (SGLang)."""
    index = RadixIndex(BS)
    p = prompt(4, tail=0)
    store(index, A, p)
    d = kv().choose(req(p), [B, A], {}, index)
    assert (d.target, d.matched_blocks, d.total_blocks) == (A, 3, 3)
    d = kv().choose(req([*p, 1]), [B, A], {}, index)
    assert (d.target, d.matched_blocks, d.total_blocks) == (A, 4, 4)
    d = kv().choose(req([*p, 1], logprobs_from=0), [B, A], {}, index)
    assert (d.reason, d.matched_blocks, d.total_blocks) == (Reason.NO_MATCH, 0, 0)
    d = kv().choose(req([*p, 1], logprobs_from=2 * BS + 1), [B, A], {}, index)
    assert (d.target, d.matched_blocks, d.total_blocks) == (A, 2, 2)


@pytest.mark.parametrize(
    ("kind", "body", "start"),
    [
        (Kind.COMPLETION, {"prompt": "x"}, None),
        (Kind.COMPLETION, {"prompt": "x", "prompt_logprobs": 0}, 0),
        (Kind.CHAT, {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 5}, 0),
        (Kind.TOKEN_GENERATE, {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}, 0),
        (Kind.GENERATE, {"text": "x", "return_logprob": True}, None),  # SGLang's default start: the last
        (Kind.GENERATE, {"text": "x", "return_logprob": True, "logprob_start_len": 7}, 7),
        (Kind.GENERATE, {"text": "x", "return_logprob": False, "logprob_start_len": 7}, None),
        (Kind.COMPLETION, {"prompt": "x", "echo": True}, None),  # echo without logprobs: none
        (Kind.COMPLETION, {"prompt": "x", "echo": True, "logprobs": 0}, 0),
        (Kind.CHAT, {"messages": [{"role": "user", "content": "x"}], "echo": True}, 0),  # top_logprobs 0
        (
            Kind.CHAT,
            {"messages": [{"role": "user", "content": "x"}], "echo": True, "top_logprobs": None},
            None,
        ),
        (Kind.TOKEN_GENERATE, {"token_ids": [1], "sampling_params": {"prompt_logprob_token_ids": [3]}}, 0),
        (
            Kind.TOKEN_GENERATE,
            {"token_ids": [1], "sampling_params": {"prompt_logprobs": 1, "skip_reading_prefix_cache": False}},
            None,
        ),
    ],
)
def test_the_request_says_where_its_prompt_logprobs_start(kind, body, start):
    assert parse_request(body, kind).logprobs_from == start


def test_device_prefix_beats_an_equal_host_prefix():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p, medium="CPU")
    store(index, B, p, medium="GPU")
    assert kv().choose(req(p), ABC, {}, index).target == B
    # A block held on device and on host counts as device.
    store(index, A, p, medium="GPU")
    d = kv(spread_ties=False).choose(req(p), ABC, {}, index)
    assert d.target == A


def test_a_longer_host_prefix_beats_a_shorter_device_prefix_per_the_weights():
    index = RadixIndex(BS)
    p = prompt(8)
    store(index, A, p, medium="CPU_PINNED")  # 8 host blocks: 8 * 0.5 = 4 > 3
    store(index, B, p[: 3 * BS])  # 3 device blocks
    assert kv().choose(req(p), ABC, {}, index).target == A
    assert kv(host_weight=0.25).choose(req(p), ABC, {}, index).target == B  # 2 < 3
    # Disk and external credit likewise.
    index2 = RadixIndex(BS)
    store(index2, A, p, medium="DISK")  # 8 * 0.25 = 2
    store(index2, B, p, medium="EXTERNAL")  # 8 * 0.1 = 0.8
    store(index2, C, p[:BS])  # 1
    assert kv().choose(req(p), ABC, {}, index2).target == A
    assert kv(disk_weight=0.1).choose(req(p), ABC, {}, index2).target == C


def test_load_trades_against_cached_blocks():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p)
    # One in-flight request = one block of prefill; ties fall to target order unless load separates them.
    pol = kv(load_cost_tokens=BS, spread_ties=False, **NO_GUARD)
    assert pol.choose(req(p), [A, B], {A: 3}, index).target == A  # -4 + 3 < 0
    d = pol.choose(req(p), [A, B], {A: 4}, index)  # -4 + 4 == 0: tie, lower load wins
    assert (d.target, d.reason, d.matched_blocks) == (B, Reason.LEAST_LOADED, 0)
    assert pol.choose(req(p), [A, B], {A: 5}, index).target == B
    # With loads on both sides only the difference matters.
    assert pol.choose(req(p), [A, B], {A: 13, B: 10}, index).target == A


def test_default_load_cost_keeps_a_long_conversation_sticky_and_lets_short_prompts_balance():
    index = RadixIndex(16)
    long_p = list(range(3000))  # 187 blocks: worth ~11.7 in-flight requests at 256 tokens (16 blocks) each
    short_p = list(range(5000, 5100))  # 6 blocks: worth less than one in-flight request
    h = itertools.count(1)
    for p in (long_p, short_p):
        n = len(p) // 16
        ev = BlockStored(tuple(next(h) for _ in range(n)), None, tuple(p[: n * 16]), 16)
        index.apply_batch(A.carrier, EventBatch(0.0, (ev,)))
    pol = kv()
    assert pol.choose(req(long_p), [A, B], {A: 10, B: 2}, index).target == A  # 160 - 187 < 32
    assert pol.choose(req(long_p), [A, B], {A: 14, B: 2}, index).target == B  # 224 - 187 > 32
    assert pol.choose(req(short_p), [A, B], {A: 1, B: 1}, index).target == A
    assert pol.choose(req(short_p), [A, B], {A: 2, B: 1}, index).target == B


def fill(index: RadixIndex, target: Target, tokens: list[int] | None = None) -> None:
    """``target`` caches ``tokens`` (if any) and then evicts as it stores: its cache is full at what it
    holds now."""
    if tokens:
        store(index, target, tokens)
    junk = prompt(1, base=next(_hashes) * 1000, tail=0)
    store(index, target, junk)
    gone = next(_hashes) - 1  # the hash store() just gave the junk block
    ev = BlockStored((next(_hashes),), None, tuple(prompt(1, base=next(_hashes) * 1000, tail=0)), BS)
    index.apply_batch(target.carrier, EventBatch(0.0, (BlockRemoved((gone,)), ev)))


def test_the_index_learns_a_device_capacity_from_device_evictions_only():
    index = RadixIndex(BS)
    store(index, A, prompt(6))
    sixth = next(_hashes) - 1  # the hash of its sixth block, then its fifth
    fifth = sixth - 1
    assert (index.device_capacity(A.carrier), index.device_free(A.carrier)) == (None, None)
    # A host tier's eviction says nothing of the device's size; nor does one in a medium we do not know
    # (it clears the device copy too: never credit what the engine may not hold).
    store(index, A, prompt(1, base=7000), medium="CPU")
    index.apply_batch(A.carrier, EventBatch(0.0, (BlockRemoved((next(_hashes) - 1,), medium="CPU"),)))
    index.apply_batch(A.carrier, EventBatch(0.0, (BlockRemoved((sixth,), medium="NVME"),)))
    assert (index.carrier_blocks(A.carrier)[Tier.DEVICE], index.device_capacity(A.carrier)) == (5, None)
    # A device eviction: what it held before (5) and after (4) bounds the cache from below.
    index.apply_batch(A.carrier, EventBatch(0.0, (BlockRemoved((fifth,), medium="GPU"),)))
    assert (index.device_capacity(A.carrier), index.device_free(A.carrier)) == (5, 1)
    # While its credit is withheld, or its device tier hidden, what it holds is in doubt: read as cold.
    index.withheld.add(A.carrier)
    assert index.device_free(A.carrier) is None
    index.withheld.clear()
    index.set_visible(A.carrier, Tier.HOST)
    assert index.device_free(A.carrier) is None
    index.set_visible(A.carrier, ALL_TIERS)
    assert index.device_free(A.carrier) == 1
    # An untagged eviction is a device one. A clear, or a device tier dropped, may be a new process of
    # another size: unknown until it evicts again; so is an engine gone.
    fill(index, B, prompt(3))
    assert (index.device_capacity(B.carrier), index.device_free(B.carrier)) == (4, 0)
    index.clear_carrier(B.carrier)
    assert index.device_capacity(B.carrier) is None
    fill(index, B, prompt(3))
    index.apply_batch(B.carrier, EventBatch(0.0, (AllBlocksCleared(),)))
    assert index.device_capacity(B.carrier) is None
    fill(index, B, prompt(3))
    index.drop_tiers(B.carrier, Tier.HOST)
    assert index.device_capacity(B.carrier) == 4
    index.drop_tiers(B.carrier, Tier.DEVICE)
    assert index.device_capacity(B.carrier) is None
    index.remove_carrier(A.carrier)
    assert index.device_capacity(A.carrier) is None


def test_a_full_cache_pays_for_what_it_evicts_so_an_empty_engine_warms():
    index = RadixIndex(BS)
    group = prompt(4)  # a system prompt both busy engines hold
    fill(index, A, group)
    fill(index, B, group)
    p = group[:-1] + list(range(9000, 9000 + 5 * BS + 1))  # + 5 blocks of a new conversation
    decide = lambda pol: pol.choose(req(p), ABC, {}, index)  # noqa: E731
    # Credit alone keeps the new conversation off C (-4 < 0) however full A and B are.
    assert decide(kv(eviction_weight=0.0, spread_ties=False)).target == A
    # Priced: A and B would evict 5 blocks (-4 + 5 = 1); C has never evicted: nothing known to be full.
    d = decide(kv(spread_ties=False, **NO_GUARD))
    assert (d.target, d.matched_blocks) == (C, 0)
    # An engine that never evicted is not known to be full: storing there is free, and the credit wins.
    roomy = RadixIndex(BS)
    store(roomy, A, group)
    assert kv(spread_ties=False).choose(req(p), [A, C], {}, roomy).target == A


def test_the_eviction_cost_is_what_does_not_fit_in_the_free_blocks():
    index = RadixIndex(BS)
    fill(index, A, prompt(4))  # holds 5 (the prompt's 4 blocks and another) of 5
    fill(index, B)
    store(index, B, prompt(1, base=8000))
    index.apply_batch(B.carrier, EventBatch(0.0, (BlockRemoved((next(_hashes) - 1,)),)))  # holds 1 of 2
    assert [index.device_free(t.carrier) for t in ABC] == [0, 1, None]
    p = prompt(4)[:-1] + list(range(9000, 9000 + 3 * BS + 1))  # 4 held on A, then 3 more: 7 full blocks

    def costs(**kw) -> list[float]:
        return list(EvictionCost().score(Cycle.of(req(p, **kw), ABC, {}, index)).costs)

    # A stores 3 into no free block; B stores 7 into 1; C's size is unknown: nothing known to evict.
    assert costs() == [3, 6, 0]
    # A vouched returning session's target is taken to hold its whole reusable prefix (all 7 blocks).
    assert costs(prefer=B, prefer_vouched=True) == [3, 0, 0]
    assert costs(prefer=B) == [3, 6, 0]


def test_among_full_caches_a_held_prefix_also_spares_an_eviction():
    index = RadixIndex(BS)
    p = prompt(6)
    fill(index, A, p[: 4 * BS])
    fill(index, B, p[: 2 * BS])
    # One in-flight request = one block. Unpriced: A -4 + 3 = -1 against B's -2: B.
    loads = {A: 3}
    unpriced = kv(eviction_weight=0.0, load_cost_tokens=BS, **NO_GUARD)
    assert unpriced.choose(req(p), [A, B], loads, index).target == B
    # Priced at one block per eviction: A -4 + 2 + 3 = 1 against B -2 + 4 = 2: A.
    assert kv(load_cost_tokens=BS, **NO_GUARD).choose(req(p), [A, B], loads, index).target == A


def test_imbalance_guard_needs_both_thresholds():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p)
    pol = kv(load_cost_tokens=0)  # scoring alone would always pick A
    d = pol.choose(req(p), [A, B], {A: 20, B: 3}, index)  # 17 > 16 and 20 > 4.5
    assert (d.target, d.reason, d.matched_blocks) == (B, Reason.IMBALANCED, 0)
    d = pol.choose(req(p), [A, B], {A: 100, B: 80}, index)  # 20 > 16 but 100 <= 120
    assert (d.target, d.reason) == (A, Reason.PREFIX)
    d = pol.choose(req(p), [A, B], {A: 16, B: 0}, index)  # 16 is not > 16
    assert (d.target, d.reason) == (A, Reason.PREFIX)
    d = pol.choose(req(p), [A, B], {A: 17, B: 0}, index)
    assert (d.target, d.reason) == (B, Reason.IMBALANCED)
    # The guard looks at every target, and sends to the least loaded one.
    d = pol.choose(req(p), [A, B, C], {A: 30, B: 12, C: 10}, index)
    assert (d.target, d.reason) == (C, Reason.IMBALANCED)
    # Configurable thresholds.
    d = kv(load_cost_tokens=0, balance_abs_threshold=2).choose(req(p), [A, B], {A: 10, B: 1}, index)
    assert d.target == B
    d = kv(load_cost_tokens=0, balance_rel_threshold=3).choose(req(p), [A, B], {A: 100, B: 40}, index)
    assert d.target == A


def test_unknown_cold_and_other_rank_targets_get_no_credit():
    index = RadixIndex(BS)
    p = prompt(4)
    ghost = Target("ghost", "http://ghost", 0)
    store(index, ghost, p)  # in the index, not a target
    store(index, A, p[: 2 * BS])
    a1 = Target("a", "http://a", 1)  # same engine, another rank: its own cache
    cold = Target("cold", "http://cold", 0)
    d = kv().choose(req(p), [cold, a1, A], {}, index)
    assert (d.target, d.matched_blocks) == (A, 2)
    d = kv(spread_ties=False).choose(req(p), [cold, a1], {}, index)
    assert (d.target, d.reason, d.matched_blocks, d.total_blocks) == (cold, Reason.NO_MATCH, 0, 4)
    d = kv(spread_ties=False).choose(req(p), [cold, a1], {cold: 1}, index)
    assert (d.target, d.reason) == (a1, Reason.NO_MATCH)
    # rank=None reads the engine's rank 0.
    a_any = Target("a", "http://a")
    assert kv().choose(req(p), [cold, a_any], {}, index).matched_blocks == 2


def test_namespaces_are_respected():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p, lora_name="x")
    store(index, B, p)
    store(index, C, p, cache_salt="s")
    assert kv().choose(req(p), ABC, {}, index).target == B
    assert kv().choose(req(p, lora_name="x"), ABC, {}, index).target == A
    assert kv().choose(req(p, cache_salt="s"), ABC, {}, index).target == C
    d = kv().choose(req(p, lora_name="y"), ABC, {}, index)
    assert (d.reason, d.matched_blocks) == (Reason.NO_MATCH, 0)


def test_no_tokens_no_index_or_short_prompt_fall_back_to_least_loaded():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p)
    loads = {A: 2, B: 1, C: 3}
    for request, idx in ((RouteRequest(text="hi"), index), (req(p), None), (req(p[: BS - 1]), index)):
        d = kv().choose(request, ABC, loads, idx)
        assert (d.target, d.reason, d.matched_blocks) == (B, Reason.NO_MATCH, 0)


def test_ties_spread_by_request_hash_or_fall_to_target_order():
    index = RadixIndex(BS)
    prompts = [prompt(3, base=1000 * k) for k in range(60)]
    spread = kv()
    picks = [spread.choose(req(p), ABC, {}, index).target for p in prompts]
    assert set(picks) == set(ABC)  # 60 fresh conversations at equal load do not all go to A
    assert picks == [kv().choose(req(p), ABC, {}, index).target for p in prompts]  # deterministic
    ordered = kv(spread_ties=False)
    assert {ordered.choose(req(p), ABC, {}, index).target for p in prompts} == {A}
    # Load still comes first among equal scores.
    assert {spread.choose(req(p), ABC, {A: 1, C: 1}, index).target for p in prompts} == {B}


def test_choose_does_not_mutate_the_index():
    index = RadixIndex(BS)
    p = prompt(4)
    store(index, A, p)
    before = sorted(index.iter_nodes(), key=lambda n: n[0])
    for _ in range(3):
        kv().choose(req([*p, 1, 2, 3, 4, 5, 6, 7, 8]), ABC, {B: 1}, index)
    assert sorted(index.iter_nodes(), key=lambda n: n[0]) == before


# ---- approx_prefix -------------------------------------------------------------------------------


def text_req(text: str, **kw) -> RouteRequest:
    return RouteRequest(text=text, **kw)


def test_approx_repeated_prompt_sticks_and_new_prompts_spread_to_the_smallest_tree():
    pol = make_policy("approx_prefix")
    t1, t2, t3 = "alpha " * 50, "bravo " * 40, "charlie " * 20
    d = pol.choose(text_req(t1), ABC, {}, None)
    assert (d.target, d.reason, d.matched_chars, d.total_chars) == (A, Reason.NO_MATCH, 0, len(t1))
    assert pol.choose(text_req(t2), ABC, {}, None).target == B  # A's tree is no longer the smallest
    assert pol.choose(text_req(t3), ABC, {}, None).target == C
    # C (160 chars) now holds the smallest tree, B (240) the next.
    assert pol.scorers[0].tree.size(C) < pol.scorers[0].tree.size(B) < pol.scorers[0].tree.size(A)
    assert pol.choose(text_req("delta " * 10), ABC, {}, None).target == C
    # Repeats go home, even to a somewhat busier target (the guard is not tripped).
    d = pol.choose(text_req(t1), ABC, {A: 5}, None)
    assert (d.target, d.reason, d.matched_chars) == (A, Reason.PREFIX, len(t1))
    d = pol.choose(text_req(t2 + " and a follow-up turn"), ABC, {}, None)
    assert (d.target, d.reason, d.matched_chars) == (B, Reason.PREFIX, len(t2))


def test_approx_cache_threshold():
    pol = make_policy("approx_prefix", PolicyConfig(cache_threshold=0.3))
    shared = "s" * 20
    pol.choose(text_req(shared + "x" * 80), [A, B], {}, None)  # -> A
    pol.choose(text_req("q" * 10), [A, B], {}, None)  # -> B (smallest)
    d = pol.choose(text_req(shared + "y" * 80), [A, B], {}, None)  # 20% shared: smallest tree
    assert (d.target, d.reason, d.matched_chars) == (B, Reason.NO_MATCH, 0)
    d = pol.choose(text_req(shared + "x" * 30 + "z" * 50), [A, B], {}, None)  # 50% shared
    assert (d.target, d.reason, d.matched_chars) == (A, Reason.PREFIX, 50)


def test_approx_least_loaded_among_the_longest_holders():
    pol = make_policy("approx_prefix")
    t = "the same long system prompt " * 10
    pol.choose(text_req(t), [A], {}, None)
    pol.choose(text_req(t), [B], {}, None)
    pol.choose(text_req(t[:50]), [C], {}, None)  # a shorter match only
    assert pol.choose(text_req(t + "?"), ABC, {A: 3, B: 2}, None).target == B
    assert pol.choose(text_req(t + "!"), ABC, {A: 1, B: 2}, None).target == A
    # A holder that is not a target right now does not count; the next best match does.
    d = pol.choose(text_req(t + "."), [C], {}, None)
    assert (d.target, d.reason, d.matched_chars) == (C, Reason.NO_MATCH, 50)


def test_approx_imbalanced_goes_least_loaded_and_still_inserts():
    pol = make_policy("approx_prefix")
    t = "a conversation that lives on A " * 5
    pol.choose(text_req(t), [A, B], {}, None)
    d = pol.choose(text_req(t + "turn 2"), [A, B], {A: 20, B: 1}, None)
    assert (d.target, d.reason, d.matched_chars) == (B, Reason.IMBALANCED, 0)
    assert pol.scorers[0].tree.match(t + "turn 2").chars_for(B) == len(t) + 6
    # Balanced again: B alone holds the longest match, so it wins though busier.
    d = pol.choose(text_req(t + "turn 2"), [A, B], {A: 2, B: 3}, None)
    assert (d.target, d.reason) == (B, Reason.PREFIX)
    # Both hold t: the less loaded one wins.
    assert pol.choose(text_req(t), [A, B], {A: 2, B: 3}, None).target == A
    assert pol.choose(text_req(t), [A, B], {A: 3, B: 2}, None).target == B


def test_approx_evicts_lru_down_to_max_tree_size():
    pol = make_policy("approx_prefix", PolicyConfig(max_tree_size=100))
    t1, t2, t3 = "1" * 40, "2" * 40, "3" * 40
    for t in (t1, t2):
        pol.choose(text_req(t), [A], {}, None)
    pol.choose(text_req(t1), [A], {}, None)  # t1 is now fresher than t2
    pol.choose(text_req(t3), [A], {}, None)  # 120 > 100: t2 goes
    assert pol.scorers[0].tree.size(A) == 80
    m = pol.scorers[0].tree.match
    assert (m(t1).chars_for(A), m(t2).chars_for(A), m(t3).chars_for(A)) == (40, 0, 40)
    pol.scorers[0].tree.check()
    # A shared prefix is only evicted after the branches below it.
    pol2 = make_policy("approx_prefix", PolicyConfig(max_tree_size=60))
    pol2.choose(text_req("p" * 30 + "a" * 10), [A], {}, None)
    pol2.choose(text_req("p" * 30 + "b" * 10), [A], {}, None)
    pol2.choose(text_req("z" * 15), [A], {}, None)  # 65 > 60: the oldest leaf ("a"*10) goes
    assert pol2.scorers[0].tree.size(A) == 55
    assert pol2.scorers[0].tree.match("p" * 30 + "a" * 10).chars_for(A) == 30
    assert pol2.scorers[0].tree.match("p" * 30 + "b" * 10).chars_for(A) == 40
    pol2.scorers[0].tree.check()


def test_approx_remove_target():
    pol = make_policy("approx_prefix")
    t = "hello world " * 20
    pol.choose(text_req(t), [A, B], {}, None)
    pol.choose(text_req("other"), [A, B], {}, None)
    assert pol.scorers[0].tree.size(A) == len(t)
    assert pol.remove_target(A) == len(t)
    assert pol.scorers[0].tree.size(A) == 0 and pol.scorers[0].tree.node_count() == 1
    d = pol.choose(text_req(t), [A, B], {}, None)
    assert (d.reason, d.matched_chars) == (Reason.NO_MATCH, 0)
    assert pol.remove_target(C) == 0


def test_approx_namespaces_do_not_share_text():
    pol = make_policy("approx_prefix")
    t = "shared words " * 10
    pol.choose(text_req(t, lora_name="x"), [A, B], {}, None)  # -> A
    d = pol.choose(text_req(t), [A, B], {}, None)  # plain: no match, B's tree is smaller
    assert (d.target, d.reason, d.matched_chars) == (B, Reason.NO_MATCH, 0)
    d = pol.choose(text_req(t, lora_name="x"), [A, B], {}, None)
    assert (d.target, d.reason, d.matched_chars) == (A, Reason.PREFIX, len(t))
    d = pol.choose(text_req(t, cache_salt="x"), [A, B], {A: 1}, None)
    assert (d.reason, d.matched_chars) == (Reason.NO_MATCH, 0)


def test_approx_without_text_is_least_loaded_and_inserts_nothing():
    pol = make_policy("approx_prefix")
    d = pol.choose(RouteRequest(tokens=[1, 2, 3]), [A, B], {A: 1}, None)
    assert (d.target, d.reason, d.total_chars) == (B, Reason.NO_MATCH, 0)
    assert pol.scorers[0].tree.node_count() == 0


def test_text_tree_long_prompts_use_few_nodes_and_are_fast():
    rng = random.Random(7)
    system = "".join(rng.choice("abcdefgh ") for _ in range(4000))
    tree = TextTree()
    texts = [system + "".join(rng.choice("abcdefgh ") for _ in range(6000)) for _ in range(50)]
    start = time.perf_counter()
    for i, t in enumerate(texts):
        tree.insert(t, ABC[i % 3])
    for t in texts:
        assert tree.match(t).longest(set(ABC))[0] == len(t)
    elapsed = time.perf_counter() - start
    assert tree.node_count() <= 2 * len(texts) + 1  # compressed edges: not one node per character
    assert elapsed < 0.5, elapsed  # 100 operations on 10k-char prompts (typically ~5 ms in total)
    tree.check()


words = st.text(alphabet="abc", min_size=0, max_size=12)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1, 2]), words), max_size=30), st.lists(words, max_size=10))
def test_text_tree_matches_a_naive_model(inserts, queries):
    tree, held = TextTree(), {0: set(), 1: set(), 2: set()}
    for tenant, text in inserts:
        tree.insert(text, tenant)
        if text:
            held[tenant].add(text)
        tree.check()

    def common(a: str, b: str) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    for q in queries + [t for _, t in inserts]:
        m = tree.match(q)
        want = {t: max((common(q, h) for h in held[t]), default=0) for t in held}
        assert {t: m.chars_for(t) for t in held} == want
        best = max(want.values())
        chars, holders = m.longest({0, 1, 2})
        assert chars == best
        assert holders == ({t for t, v in want.items() if v == best} if best else set())
    for t in held:  # a tenant's size is the number of distinct non-empty prefixes it holds
        assert tree.size(t) == len({h[:k] for h in held[t] for k in range(1, len(h) + 1)})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0, 1, 2]), words), max_size=40),
    st.integers(0, 20),
    st.sampled_from([None, 0, 1]),
)
def test_text_tree_invariants_under_eviction_and_removal(inserts, cap, removed):
    tree = TextTree()
    for tenant, text in inserts:
        tree.insert(text, tenant)
        tree.evict(tenant, cap)
        assert tree.size(tenant) <= cap
        tree.check()
        # The text just inserted is the freshest: kept whole if it fits, since evictions start elsewhere.
        if len(text) <= cap:
            assert tree.match(text).chars_for(tenant) == len(text)
    if removed is not None:
        tree.remove_tenant(removed)
        tree.check()
        assert removed not in tree.tenants
        assert all(removed not in n.tenants for n in tree._iter_nodes())


# ---- simple policies -------------------------------------------------------------------------------


def test_round_robin_cycles_and_survives_a_shrinking_list():
    pol = make_policy("round_robin")
    assert [pol.choose(RouteRequest(), ABC, {A: 9}, None).target for _ in range(7)] == [A, B, C, A, B, C, A]
    assert pol.choose(RouteRequest(), [A, B], {}, None).target == B
    d = pol.choose(RouteRequest(), [A, B], {}, None)
    assert (d.target, d.reason) == (A, Reason.ROUND_ROBIN)


def test_least_loaded_picks_the_minimum_and_rotates_ties():
    pol = make_policy("least_loaded")
    d = pol.choose(RouteRequest(), ABC, {A: 3, B: 1, C: 2}, None)
    assert (d.target, d.reason) == (B, Reason.LEAST_LOADED)
    assert [pol.choose(RouteRequest(), ABC, {B: 1}, None).target for _ in range(4)] == [C, A, C, A]
    assert {pol.choose(RouteRequest(), ABC, {}, None).target for _ in range(3)} == set(ABC)


def test_power_of_two_prefers_the_lower_load_and_is_reproducible():
    loads = {A: 0, B: 10, C: 10, Target("d", "http://d", 0): 10}
    targets = list(loads)
    pol = make_policy("power_of_two", PolicyConfig(seed=42))
    picks = [pol.choose(RouteRequest(), targets, loads, None).target for _ in range(400)]
    # A wins whenever it is drawn: P(A in a pair of 4) = 1/2; never-A pairs split over the other three.
    assert 160 < picks.count(A) < 240
    two = make_policy("power_of_two", PolicyConfig(seed=1))
    assert {two.choose(RouteRequest(), [A, B], {A: 5, B: 1}, None).target for _ in range(50)} == {B}
    again = make_policy("power_of_two", PolicyConfig(seed=42))
    assert [again.choose(RouteRequest(), targets, loads, None).target for _ in range(400)] == picks
    d = make_policy("power_of_two", PolicyConfig(seed=0)).choose(RouteRequest(), [C], {}, None)
    assert (d.target, d.reason) == (C, Reason.POWER_OF_TWO)


# ---- factory and config ------------------------------------------------------------------------------


def test_factory_builds_every_policy_from_one_config():
    cfg = PolicyConfig(host_weight=0.3, cache_threshold=0.5, max_tree_size=1000, seed=3)
    for name in POLICY_NAMES:
        pol = make_policy(name, cfg)
        assert pol.name == name
        assert pol.needs_tokens == (name == "kv_aware")
    assert make_policy("kv_aware", cfg).scorers[0].host_weight == 0.3
    ap = make_policy("approx_prefix", cfg)
    assert (ap.scorers[0].cache_threshold, ap.scorers[0].max_tree_size) == (0.5, 1000)
    draws = [make_policy("power_of_two", cfg).picker.rng.random() for _ in range(2)]
    assert draws[0] == draws[1]
    with pytest.raises(ValueError, match="unknown routing policy 'cache_aware'"):
        make_policy("cache_aware", cfg)


def test_config_defaults_are_frozen_and_validated():
    cfg = PolicyConfig()
    assert (cfg.balance_abs_threshold, cfg.balance_rel_threshold, cfg.cache_threshold) == (16, 1.5, 0.3)
    assert (cfg.host_weight, cfg.disk_weight, cfg.external_weight) == (0.5, 0.25, 0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.host_weight = 1.0  # type: ignore[misc]
    for bad in (
        {"host_weight": 1.5},
        {"disk_weight": -0.1},
        {"balance_rel_threshold": 0.5},
        {"balance_abs_threshold": -1},
        {"cache_threshold": 2.0},
        {"max_tree_size": 0},
        {"load_cost_tokens": float("nan")},
        {"eviction_weight": -1.0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            PolicyConfig(**bad)


def test_kv_aware_choose_is_fast_on_a_warm_index():
    index = RadixIndex(16)
    targets = [Target(f"e{i}", f"http://e{i}", r) for i in range(8) for r in range(2)]
    h = itertools.count(1)
    p = list(range(4096))  # 256 blocks
    for k, t in enumerate(targets):  # target k holds the first 16 * (k + 1) blocks
        n = 16 * (k + 1) * 16
        ev = BlockStored(tuple(next(h) for _ in range(n // 16)), None, tuple(p[:n]), 16)
        index.apply_batch(t.carrier, EventBatch(0.0, (ev,)))
    pol = kv()
    loads = {t: i % 5 for i, t in enumerate(targets)}
    request = req([*p, 0])  # a partial block after: all 256 blocks reusable
    pol.choose(request, targets, loads, index)
    start = time.perf_counter()
    for _ in range(200):
        d = pol.choose(request, targets, loads, index)
    per = (time.perf_counter() - start) / 200
    assert d.reason == Reason.PREFIX and d.total_blocks == 256
    assert per < 0.005, per  # typically ~0.1 ms: dominated by hashing 256 blocks in index.match


def test_a_vouched_session_is_credited_its_prefix_once_and_never_on_a_withheld_rank():
    """A returning session's vouched target is credited its whole reusable prefix: no more for a copy
    of the request in flight there (its prefix is counted once), and nothing when its rank's credit is
    withheld (the audit found it did not hold what the index said)."""
    index = RadixIndex(BS)
    p = prompt(32)
    store(index, B, p)  # B holds it all, as the index confirms
    pol = make_policy("kv_aware", PolicyConfig(load_cost_tokens=16 * BS, **NO_GUARD))
    first = pol.choose(req(p, prefer=A, prefer_vouched=True), [A, B], {}, index)
    assert (first.target, first.reason) == (A, Reason.SESSION)  # the session's engine, all else equal
    # A copy in flight on A (a prediction there) adds nothing to its credit: A at one request's load
    # (16 blocks) costs more than B.
    second = pol.choose(req(p, prefer=A, prefer_vouched=True), [A, B], {A: 1}, index, explain=True)
    costs = {c.target: c.cost for c in second.candidates}
    assert costs == {A: -32 + 16, B: -32} and second.target == B
    pol.ended(first)
    pol.ended(second)
    index.withheld.add(A.carrier)
    withheld = kv(**NO_GUARD).choose(req(p, prefer=A, prefer_vouched=True), [A, B], {}, index)
    assert (withheld.target, withheld.reason) == (B, Reason.PREFIX)
