"""Unit tests of the fake engine's functional core: hashing, the prefix cache, the tokenizer and chat
template, request parsing. No sockets, no event loop."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router_runtime.kv.decode import decode_batch
from router_runtime.kv.encode import encode_batch
from router_runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, EventBatch, Tier
from router_runtime.kv.index import RadixIndex
from router_runtime.tokens import decode, encode, render_chat, tokenize_chat
from router_runtime.worker import Carrier
from routerfleet_fake_engine.cache import CacheConfig, RankCache, host_medium
from routerfleet_fake_engine.hashing import PLAIN, Namespace, block_hashes, to_signed_i64
from routerfleet_fake_engine.openai_api import (
    RequestError,
    generate_tokens,
    parse_chat,
    parse_completion,
    parse_json_body,
)

VLLM = Dialect.VLLM_033
BS = 4


def cache(dialect: Dialect = VLLM, device: int = 8, host: int = 0, bs: int = BS) -> RankCache:
    return RankCache(CacheConfig(dialect=dialect, block_size=bs, device_capacity=device, host_capacity=host))


def toks(start: int, n_blocks: int, bs: int = BS) -> list[int]:
    return list(range(start, start + n_blocks * bs))


# --------------------------------------------------------------------------------------------- hashing


def test_sglang_chain_golden_values() -> None:
    # experimental/sgl-router hash.rs golden vectors (docs/kv-wire.md section 2); published as signed i64.
    assert [to_signed_i64(h) for h in block_hashes(Dialect.SGLANG, [1, 2, 3, 4], 4)] == [-3488128144981237669]
    assert [to_signed_i64(h) for h in block_hashes(Dialect.SGLANG, [10, 20, 30, 40, 50, 60, 70, 80], 2)] == [
        978178666101069530,
        -895308556211281782,
        -8033692805846017938,
        835415944263129316,
    ]


@pytest.mark.parametrize("dialect", [Dialect.VLLM_033, Dialect.VLLM_020])
def test_vllm_chain_golden_values(dialect: Dialect) -> None:
    # vLLM 0.33 sha256 with NONE_HASH seed "vllm-none-hash" (docs/kv-wire.md section 1.4).
    assert block_hashes(dialect, list(range(1, 33)), 16) == [1403909460543360175, 1643945449041937783]


@pytest.mark.parametrize("dialect", list(Dialect))
def test_hash_is_a_chain_over_full_blocks_only(dialect: Dialect) -> None:
    a = block_hashes(dialect, toks(0, 3), BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(dialect, [*toks(0, 3), 99, 98], BS) == a  # partial tail not hashed
    assert block_hashes(dialect, toks(0, 2), BS) == a[:2]  # prefix property
    changed = [1000, *toks(0, 3)[1:]]
    assert all(x != y for x, y in zip(block_hashes(dialect, changed, BS), a, strict=True))  # chained
    assert all(0 <= h < 1 << 64 for h in a)


@pytest.mark.parametrize("dialect", list(Dialect))
def test_namespaces_never_share_hashes(dialect: Dialect) -> None:
    tokens = toks(0, 3)
    spaces = [PLAIN, Namespace(cache_salt="a"), Namespace(cache_salt="b"), Namespace(lora_name="a")]
    spaces.append(Namespace(lora_name="a", cache_salt="a"))
    all_hashes = [h for ns in spaces for h in block_hashes(dialect, tokens, BS, ns)]
    assert len(set(all_hashes)) == len(all_hashes)
    assert block_hashes(dialect, tokens, BS, Namespace(cache_salt="a")) == block_hashes(
        dialect, tokens, BS, Namespace(cache_salt="a")
    )


# ------------------------------------------------------------------------------------------ the cache


def test_admit_stores_chain_then_hits_without_events() -> None:
    c = cache()
    tokens = [*toks(0, 2), 7]  # two full blocks and a partial one
    first = c.admit(tokens)
    hashes = block_hashes(VLLM, tokens, BS)
    assert first.cached_tokens == 0
    assert first.events == (
        BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=None,
            token_ids=tuple(tokens[:8]),
            block_size=BS,
            medium="GPU",
        ),
    )
    again = c.admit(tokens)
    assert again.cached_tokens == 8 and again.events == ()
    assert c.lookup(tokens).cached_tokens == 8


def test_extension_is_stored_under_last_cached_block() -> None:
    c = cache()
    c.admit(toks(0, 2))
    longer = toks(0, 4)
    adm = c.admit(longer)
    hashes = block_hashes(VLLM, longer, BS)
    assert adm.cached_tokens == 8
    (stored,) = adm.events
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash == hashes[1]
    assert stored.block_hashes == tuple(hashes[2:])
    assert stored.token_ids == tuple(longer[8:])


def test_lru_eviction_evicts_tails_first_and_emits_one_removed_per_block() -> None:
    c = cache(device=4)
    a, b = toks(0, 3), toks(100, 2)
    ha, hb = block_hashes(VLLM, a, BS), block_hashes(VLLM, b, BS)
    c.admit(a)
    adm = c.admit(b)  # needs 2 slots, only 1 free: evicts a's LRU block, which is its tail
    assert adm.events[0] == BlockRemoved((ha[2],), "GPU")
    assert adm.events[1] == BlockStored(tuple(hb), None, tuple(b), BS, "GPU")
    assert len(adm.events) == 2
    assert c.lookup(a).cached_tokens == 8  # a's prefix survived
    assert set(c.device_hashes()) == {ha[0], ha[1], *hb}


def test_touch_on_hit_protects_from_eviction() -> None:
    c = cache(device=4)
    a, b, d = toks(0, 2), toks(100, 2), toks(200, 2)
    c.admit(a)
    c.admit(b)
    c.admit(a)  # a becomes most recently used
    adm = c.admit(d)
    removed = {e.block_hashes[0] for e in adm.events if isinstance(e, BlockRemoved)}
    assert removed == set(block_hashes(VLLM, b, BS))
    assert c.lookup(a).cached_tokens == 8 and c.lookup(b).cached_tokens == 0


def test_admission_never_evicts_its_own_hits() -> None:
    c = cache(device=4)
    a, x = toks(0, 3), toks(100, 2)
    ha, hx = block_hashes(VLLM, a, BS), block_hashes(VLLM, x, BS)
    c.admit(a[:8])
    c.admit(x)  # a's two blocks are now the least recently used
    adm = c.admit(a)  # its new third block needs room: x's tail goes, not a's own cached prefix
    assert adm.cached_tokens == 8
    assert adm.events == (
        BlockRemoved((hx[1],), "GPU"),
        BlockStored((ha[2],), ha[1], tuple(a[8:]), BS, "GPU"),
    )


def test_chain_longer_than_device_is_truncated_and_never_self_evicts() -> None:
    c = cache(device=3)
    tokens = toks(0, 5)
    adm = c.admit(tokens)
    assert adm.events == (
        BlockStored(tuple(block_hashes(VLLM, tokens, BS)[:3]), None, tuple(tokens[:12]), BS, "GPU"),
    )
    assert c.lookup(tokens).cached_tokens == 12


def test_eviction_moves_to_host_then_host_hit_counts_and_promotes() -> None:
    c = cache(device=2, host=2)
    a, b = toks(0, 2), toks(100, 2)
    ha = block_hashes(VLLM, a, BS)
    c.admit(a)
    adm = c.admit(b)
    # each of a's blocks: stored on host (CPU) first, then removed from GPU; tail first
    assert adm.events[:4] == (
        BlockStored((ha[1],), ha[0], tuple(a[4:]), BS, "CPU"),
        BlockRemoved((ha[1],), "GPU"),
        BlockStored((ha[0],), None, tuple(a[:4]), BS, "CPU"),
        BlockRemoved((ha[0],), "GPU"),
    )
    assert c.host_hashes() == [ha[1], ha[0]] and c.resident(Tier.HOST) == 2
    match = c.lookup(a)
    assert (match.device_blocks, match.host_blocks, match.cached_tokens) == (0, 2, 8)
    promote = c.admit(a)
    assert promote.cached_tokens == 4  # a's last block holds its last token: computed, not a hit (vLLM)
    stored = [e for e in promote.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert stored == [BlockStored(tuple(ha), None, tuple(a), BS, "GPU")]
    assert promote.events[-2:] == (BlockRemoved((ha[0],), "CPU"), BlockRemoved((ha[1],), "CPU"))
    assert set(c.device_hashes()) == set(ha)
    assert set(c.host_hashes()) == set(block_hashes(VLLM, b, BS))  # b moved down to host


def test_host_tier_evicts_lru_and_sglang_uses_cpu_pinned() -> None:
    c = cache(Dialect.SGLANG, device=1, host=1)
    a, b, d = toks(0, 1), toks(100, 1), toks(200, 1)
    (ha,), (hb,) = block_hashes(Dialect.SGLANG, a, BS), block_hashes(Dialect.SGLANG, b, BS)
    c.admit(a)
    c.admit(b)  # a -> host
    adm = c.admit(d)  # b -> host, a dropped from host
    assert host_medium(Dialect.SGLANG) == "CPU_PINNED"
    assert adm.events[:3] == (
        BlockRemoved((ha,), "CPU_PINNED"),
        BlockStored((hb,), None, tuple(b), BS, "CPU_PINNED"),
        BlockRemoved((hb,), "GPU"),
    )
    assert c.lookup(a).cached_tokens == 0 and c.lookup(b).cached_tokens == BS


def test_salted_and_lora_events_carry_dialect_fields() -> None:
    tokens = toks(0, 2)
    ns = Namespace(lora_name="adapter-a", cache_salt="tenant-a")
    (vllm,) = cache().admit(tokens, ns).events
    assert isinstance(vllm, BlockStored)
    assert vllm.lora_name == "adapter-a" and vllm.cache_salt is None
    assert vllm.extra_keys == (("adapter-a", "tenant-a"), ("adapter-a",))  # salt on the first block only
    (sg,) = cache(Dialect.SGLANG).admit(tokens, ns).events
    assert isinstance(sg, BlockStored)
    assert sg.cache_salt == "tenant-a" and sg.extra_keys is None
    # a salted prompt does not hit the plain one
    c = cache()
    c.admit(tokens)
    assert c.lookup(tokens, Namespace(cache_salt="x")).cached_tokens == 0
    assert c.admit(tokens, Namespace(cache_salt="x")).events  # stored separately


@pytest.mark.parametrize("dialect", [VLLM, Dialect.SGLANG], ids=str)
def test_the_index_matches_a_namespaced_request_to_the_blocks_its_engine_published(dialect) -> None:
    """vLLM sends a cache salt as a per-block extra key, SGLang as a field: either way the index keys the
    blocks as a request with that salt looks them up, and no other namespace matches. A vLLM adapter's
    blocks stay cold: vLLM picks the adapter by ``model``, not by the ``lora_name`` the router reads."""
    spaces = [PLAIN, Namespace(cache_salt="a"), Namespace(lora_name="l"), Namespace("l", "a")]
    for ns in spaces[1:]:
        index = RadixIndex(BS)
        carrier = Carrier("http://e", 0)
        c = cache(dialect)
        tokens = toks(0, 3)
        index.apply_batch(carrier, EventBatch(0.0, c.admit(tokens[: 2 * BS], ns).events))
        index.apply_batch(carrier, EventBatch(0.0, c.admit(tokens, ns).events))  # a continuation
        held = 0 if dialect is VLLM and ns.lora_name else 3
        for other in spaces:
            m = index.match(tokens, lora_name=other.lora_name, cache_salt=other.cache_salt).get(carrier)
            assert (m.blocks if m else 0) == (held if other == ns else 0), (ns, other)


def test_admin_store_host_remove_clear() -> None:
    c = cache(device=4, host=4)
    tokens = toks(0, 2)
    h = block_hashes(VLLM, tokens, BS)
    assert c.store(tokens, tier=Tier.HOST) == [BlockStored(tuple(h), None, tuple(tokens), BS, "CPU")]
    assert c.host_hashes() == h[::-1] and c.device_hashes() == []
    assert c.remove(tokens, tier=Tier.DEVICE) == []
    assert c.remove(tokens[:4]) == [BlockRemoved((h[0],), "CPU")]
    assert c.lookup(tokens).cached_tokens == 0  # prefix gone: the orphan tail does not count
    c.admit(tokens)
    assert c.clear() == [AllBlocksCleared()]
    assert c.device_hashes() == [] and c.host_hashes() == []
    with pytest.raises(ValueError, match="no host tier"):
        cache(host=0).store(tokens, tier=Tier.HOST)


def test_deterministic_event_stream() -> None:
    def run() -> list:
        c = cache(device=5, host=3)
        out = []
        for start in (0, 100, 0, 200, 300, 100):
            out.extend(c.admit(toks(start, 2)).events)
        return out

    assert run() == run()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=25),
    device=st.integers(1, 6),
    host=st.integers(0, 4),
)
def test_events_replayed_reconstruct_resident_sets(
    ops: list[tuple[int, int]], device: int, host: int
) -> None:
    """Applying the emitted events (as a router would) always reproduces the cache's tiers exactly,
    capacities are never exceeded, and every event survives the real wire encoding."""
    c = cache(device=device, host=host)
    seen: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for prompt, n_blocks in ops:
        events = c.admit(toks(prompt * 1000, n_blocks)).events
        assert decode_batch(encode_batch(VLLM, EventBatch(1.0, events, 0))).events == events
        for e in events:
            if isinstance(e, BlockStored):
                assert not seen[e.medium] & set(e.block_hashes)  # never stored twice in a tier
                seen[e.medium] |= set(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= seen[e.medium]
                seen[e.medium] -= set(e.block_hashes)
        assert seen["GPU"] == set(c.device_hashes()) and seen["CPU"] == set(c.host_hashes())
        assert len(seen["GPU"]) <= device and len(seen["CPU"]) <= host
        assert not seen["GPU"] & seen["CPU"]


# ----------------------------------------------------------------------------- tokens and chat template


def test_bytes_tokenizer_round_trips_utf8() -> None:
    text = "héllo, 世界"
    assert encode("ab") == [97, 98]
    assert decode(encode(text)) == text
    assert decode([104, 105, 300]) == "hi"  # ids beyond the byte vocabulary are dropped, not raised


def test_render_chat_template_and_prefix_property() -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(turn1) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": [{"type": "text", "text": "x"}]},
    ]
    assert render_chat(turn2).startswith(render_chat(turn1))
    assert tokenize_chat(turn2) == encode(render_chat(turn2))
    for bad in ([], [{"content": "x"}], [{"role": "user", "content": 5}], "hi"):
        with pytest.raises(ValueError):
            render_chat(bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ request parsing


def test_parse_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": "ab"}).prompt_tokens == (97, 98)
    assert parse_completion({"prompt": [5, 6]}).prompt_tokens == (5, 6)
    assert parse_completion({"prompt": ["ab"]}).prompt_tokens == (97, 98)
    assert parse_completion({"prompt": [[5, 6]]}).prompt_tokens == (5, 6)
    req = parse_completion({"prompt": "x", "cache_salt": "s", "data_parallel_rank": 1, "stream": True})
    assert (req.max_tokens, req.namespace, req.rank, req.stream) == (16, Namespace(cache_salt="s"), 1, True)
    assert parse_chat({"messages": [{"role": "user", "content": "Hi"}]}).prompt_tokens == tuple(
        tokenize_chat([{"role": "user", "content": "Hi"}])
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "3"}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "data_parallel_rank": -1}, "data_parallel_rank"),
        ({"prompt": "x", "cache_salt": 3}, "cache_salt"),
        ([1], None),
    ],
)
def test_parse_completion_rejects(body: object, param: str | None) -> None:
    with pytest.raises(RequestError) as info:
        parse_completion(body)
    assert info.value.param == param
    assert info.value.to_json()["error"]["type"] == "invalid_request_error"


def test_parse_json_body_and_generation() -> None:
    with pytest.raises(RequestError):
        parse_json_body(b"{nope")
    out = generate_tokens((1, 2, 3), 30)
    assert out == generate_tokens((1, 2, 3), 30) and len(out) == 30
    assert all(ord("a") <= t <= ord("z") for t in out)
    assert out != generate_tokens((1, 2, 4), 30)
