"""The radix index against a naive reference model, over random event sequences."""

from __future__ import annotations

import random

import routerfleet_index
from hypothesis import given, settings
from hypothesis import strategies as st

from router_runtime.kv.events import (
    ALL_TIERS,
    MEDIUM_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Tier,
)
from router_runtime.kv.index import CarrierMatch, RadixIndex, Skip
from router_runtime.worker import Carrier

BS = 2
CARRIERS = [Carrier("e0", 0), Carrier("e0", 1), Carrier("e1", 0)]
BLOCKS = [(1, 2), (3, 4), (5, 6)]  # a tiny alphabet so prefixes are shared
MEDIA = [None, "GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL", "TAPE"]


class Reference:
    """Per carrier: engine hash -> path, path -> tiers. A path is (namespace, block, block, ...)."""

    def __init__(self) -> None:
        self.by_hash: dict[Carrier, dict[int, tuple]] = {c: {} for c in CARRIERS}
        self.held: dict[Carrier, dict[tuple, int]] = {c: {} for c in CARRIERS}

    def apply(self, carrier: Carrier, ev) -> None:
        by_hash, held = self.by_hash[carrier], self.held[carrier]
        if isinstance(ev, AllBlocksCleared):
            by_hash.clear()
            held.clear()
        elif isinstance(ev, BlockStored):
            tier = Tier.DEVICE if ev.medium is None else MEDIUM_TIERS.get(ev.medium)
            if tier is None or ev.block_size != BS:
                return
            if ev.parent_block_hash is None:
                path = (ev.lora_name,)
            elif by_hash.get(ev.parent_block_hash) in held:  # a parent it still holds
                path = by_hash[ev.parent_block_hash]
            else:
                return
            for i, h in enumerate(ev.block_hashes):
                path = (*path, tuple(ev.token_ids[i * BS : (i + 1) * BS]))
                old = by_hash.get(h)
                if old is not None and old != path:
                    held.pop(old, None)
                # One engine hash per position per carrier: the latest announcement wins.
                for other in [o for o, p in by_hash.items() if p == path and o != h]:
                    del by_hash[other]
                held[path] = held.get(path, 0) | tier
                by_hash[h] = path
        elif isinstance(ev, BlockRemoved):
            tiers = ALL_TIERS if ev.medium is None else MEDIUM_TIERS.get(ev.medium, ALL_TIERS)
            for h in ev.block_hashes:
                path = by_hash.get(h)
                if path is None:
                    continue
                left = held.get(path, 0) & ~tiers
                if left:
                    held[path] = left
                else:
                    held.pop(path, None)
                    del by_hash[h]

    def match(self, tokens: list[int]) -> dict[Carrier, CarrierMatch]:
        out = {}
        for c in CARRIERS:
            path: tuple = (None,)
            counts = [0, 0, 0, 0]
            n = 0
            for i in range(len(tokens) // BS):
                path = (*path, tuple(tokens[i * BS : (i + 1) * BS]))
                tiers = self.held[c].get(path)
                if not tiers:
                    break
                counts[(tiers & -tiers).bit_length() - 1] += 1
                n += 1
            if n:
                out[c] = CarrierMatch(n, tuple(counts))
        return out


blocks = st.sampled_from(BLOCKS)
engine_hash = st.integers(0, 12)  # a small pool: parents resolve often, reuse happens


@st.composite
def events(draw):
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
    if kind == "clear":
        return AllBlocksCleared()
    n = draw(st.integers(1, 3))
    hashes = tuple(draw(engine_hash) for _ in range(n))
    if kind == "remove":
        return BlockRemoved(hashes, draw(st.sampled_from(MEDIA)))
    toks = tuple(t for _ in range(n) for t in draw(blocks))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.one_of(st.none(), engine_hash)),
        token_ids=toks,
        block_size=draw(st.sampled_from([BS, BS, BS, 4])),
        medium=draw(st.sampled_from(MEDIA)),
        lora_name=draw(st.sampled_from([None, None, None, "adapter"])),
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(CARRIERS), events()), max_size=40),
    st.lists(st.lists(blocks, min_size=1, max_size=5), min_size=1, max_size=8),
)
def test_index_matches_reference(steps, queries):
    check_against_reference(steps, [[t for b in q for t in b] for q in queries])


def random_event(rng: random.Random):
    """The distribution of ``events()``, drawn without Hypothesis (fast enough for thousands of runs)."""
    kind = rng.choice(["store", "store", "store", "remove", "clear"])
    if kind == "clear":
        return AllBlocksCleared()
    hashes = tuple(rng.randint(0, 12) for _ in range(rng.randint(1, 3)))
    if kind == "remove":
        return BlockRemoved(hashes, rng.choice(MEDIA))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=rng.choice([None, rng.randint(0, 12)]),
        token_ids=tuple(t for _ in hashes for t in rng.choice(BLOCKS)),
        block_size=rng.choice([BS, BS, BS, 4]),
        medium=rng.choice(MEDIA),
        lora_name=rng.choice([None, None, None, "adapter"]),
    )


def test_index_matches_reference_over_5000_seeded_sequences():
    rng = random.Random(20261201)
    for _ in range(5000):
        steps = [(rng.choice(CARRIERS), random_event(rng)) for _ in range(rng.randint(0, 40))]
        queries = [[t for _ in range(rng.randint(1, 5)) for t in rng.choice(BLOCKS)] for _ in range(8)]
        check_against_reference(steps, queries)


def check_against_reference(steps, queries) -> None:
    index, ref = RadixIndex(BS), Reference()
    for carrier, ev in steps:
        index.apply_batch(carrier, EventBatch(0.0, (ev,)))
        ref.apply(carrier, ev)
        index.maintain()  # memory give-back interleaved with events
    for tokens in queries:
        assert index.match(tokens) == ref.match(tokens)
    # Nothing dangles: every node is held by some carrier.
    assert all(held for _key, _parent, held in index.iter_nodes())
    assert_invariants(index)
    # Per-tier counters agree with the reference.
    for c in CARRIERS:
        want = [0, 0, 0, 0]
        for tiers in ref.held[c].values():
            for slot, t in enumerate((Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL)):
                want[slot] += bool(tiers & t)
        assert list(index.carrier_blocks(c).values()) == want


def assert_invariants(index: RadixIndex) -> None:
    """White-box: each carrier's engine-hash map and the nodes' holders are inverse bijections, no
    holder is held in no tier, and the per-tier counters agree with a recount (the core checks)."""
    index.native.check()


def test_removing_a_carrier_empties_the_tree():
    index = RadixIndex(BS)
    store = BlockStored((1, 2), None, (1, 2, 3, 4), BS)
    index.apply_batch(CARRIERS[0], EventBatch(0.0, (store,)))
    index.apply_batch(CARRIERS[1], EventBatch(0.0, (store,)))
    assert set(index.match([1, 2, 3, 4])) == {CARRIERS[0], CARRIERS[1]}
    index.remove_carrier(CARRIERS[0])
    assert set(index.match([1, 2, 3, 4])) == {CARRIERS[1]}
    index.remove_carrier(CARRIERS[1])
    assert index.node_count() == 0


def test_unknown_parent_is_never_hung_off_the_root():
    index = RadixIndex(BS)
    stats = index.apply_batch(CARRIERS[0], EventBatch(0.0, (BlockStored((7,), 99, (1, 2), BS),)))
    assert index.match([1, 2]) == {}
    assert stats.skipped["unknown_parent"] == 1


def test_salted_and_adapter_blocks_never_match_a_plain_request():
    index = RadixIndex(BS)
    index.apply_batch(CARRIERS[0], EventBatch(0.0, (BlockStored((1,), None, (1, 2), BS, lora_name="a"),)))
    index.apply_batch(CARRIERS[1], EventBatch(0.0, (BlockStored((1,), None, (1, 2), BS, cache_salt="s"),)))
    assert index.match([1, 2]) == {}
    assert set(index.match([1, 2], lora_name="a")) == {CARRIERS[0]}
    assert set(index.match([1, 2], cache_salt="s")) == {CARRIERS[1]}


def test_skip_reasons_are_the_native_cores():
    assert [s.value for s in Skip] == routerfleet_index.SKIP_REASONS
