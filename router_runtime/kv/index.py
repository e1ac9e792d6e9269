"""The radix index: which carrier (engine, DP rank) holds which KV blocks, in which tiers.

Storage. A node is one block position in the prefix trie, keyed by the router's chained block key
(see ``hashing``): the key identifies the whole path from the root, so the trie lives in flat dicts
and a lookup is one dict probe per block. ``_carriers_of`` maps key -> carriers packed into one int
(4 tier bits per carrier id, ``Tier`` values); ``_parent`` maps key -> parent key, for the DFS
pre-order export the peer bootstrap needs. A node that no carrier holds is dropped at once: its
descendants stay (an engine may hold a child whose parent it evicted) but are unreachable until the
parent is stored again, which is exactly what the engine can serve. The dicts hold only ints, so the
garbage collector never scans them (per-node objects cost 18% of ingestion and 0.4 s pauses at 1M
blocks). Each carrier keeps ``engine hash -> key`` for its own blocks, because removals and parent
links arrive as engine hashes, which are opaque and only meaningful per (engine, rank).

Run cold, never wrong. A store whose parent this carrier never announced, with a different block
size, a non-full-attention group or an unknown medium is skipped and counted, never hung off the
root (that would invent a prefix the engine does not hold).

One writer. Every mutation is synchronous (no await inside), and all of them are called from the
index writer task, so a reader on the same event loop never sees a half-applied batch.
"""

from __future__ import annotations

import enum
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import xxhash

from .events import (
    ALL_TIERS,
    MEDIUM_TIERS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    Tier,
)
from .hashing import PLAIN_ROOT, block_keys, namespace_root

_h = xxhash.xxh3_64_intdigest

ROOT = -1  # parent key of the first block of every chain (block keys are u64, never negative)

TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL)  # best first


@dataclass(frozen=True, slots=True, order=True)
class Carrier:
    """Who holds a block: one engine's data-parallel rank. ``engine`` is the worker identity string."""

    engine: str
    rank: int = 0

    def __str__(self) -> str:
        return f"{self.engine}#{self.rank}"


class Skip(enum.StrEnum):
    """Why an event (or some of its blocks) was not indexed. Exported as a metric label."""

    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    UNKNOWN_PARENT = "unknown_parent"
    UNKNOWN_MEDIUM = "unknown_medium"
    OTHER_GROUP = "other_group"
    TOKEN_COUNT = "token_count"
    UNKNOWN_BLOCK = "unknown_block"  # a remove for a block this carrier never announced


def store_skip(ev: BlockStored, block_size: int, full_attention_group: int) -> Skip | None:
    """Why a store cannot be indexed under this configuration, before the trie is consulted (the
    parent check needs it, so it is not here); None: it can. ``kv/fit.py`` tallies the same rule over
    a rank's stream, to tell a configuration mismatch from an empty cache."""
    if ev.medium is not None and ev.medium not in MEDIUM_TIERS:
        return Skip.UNKNOWN_MEDIUM
    if ev.kv_cache_spec_kind not in (None, "full_attention") or (
        ev.group_idx is not None and ev.group_idx != full_attention_group
    ):
        return Skip.OTHER_GROUP
    if ev.block_size != block_size:
        return Skip.BLOCK_SIZE_MISMATCH
    if len(ev.token_ids) != len(ev.block_hashes) * block_size:
        return Skip.TOKEN_COUNT
    return None


@dataclass(slots=True)
class ApplyStats:
    """What applying one batch did; the writer turns it into metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    events: Counter = field(default_factory=Counter)  # (event type, medium) -> count
    skipped: Counter = field(default_factory=Counter)  # Skip -> blocks


@dataclass(frozen=True, slots=True)
class CarrierMatch:
    """A carrier's matched prefix: its length in blocks, and how many of those blocks it holds at best
    in each tier (device, host, disk, external), so a policy can weight partial credit per tier."""

    blocks: int
    tier_blocks: tuple[int, int, int, int]

    @property
    def device_blocks(self) -> int:
        return self.tier_blocks[0]


class _CarrierState:
    __slots__ = ("by_engine_hash", "carrier", "cid", "hash_of", "shift", "tier_blocks")

    def __init__(self, carrier: Carrier, cid: int) -> None:
        self.carrier = carrier
        self.cid = cid
        self.shift = cid * 4
        # engine hash <-> key, a bijection over the blocks this carrier holds (nibble non-zero): removals
        # and parents arrive as engine hashes; the snapshot export needs the way back.
        self.by_engine_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.tier_blocks = [0, 0, 0, 0]  # blocks held per tier, parallel to TIER_ORDER


_TIER_SLOT = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.DISK: 2, Tier.EXTERNAL: 3}


# For each 4-bit tier nibble, the tier slots it holds (plain ints: enum arithmetic is slow here).
_NIBBLE_SLOTS = tuple(tuple(slot for slot in range(4) if nib >> slot & 1) for nib in range(16))


class RadixIndex:
    """The index. Mutations: ``apply_batch``, ``clear_carrier``, ``remove_carrier``, ``drop_tiers``,
    ``set_visible``; reads: ``match``, ``match_keys``, ``carrier_blocks``, ``node_count``,
    ``carrier_engine_hashes``, ``visible_tiers``. Reads that hand carriers out (``match``, the snapshot
    export) see only visible tiers; the bookkeeping reads see everything."""

    def __init__(self, block_size: int, *, full_attention_group: int = 0) -> None:
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.block_size = block_size
        self.full_attention_group = full_attention_group
        self._carriers_of: dict[int, int] = {}  # key -> packed carriers; a node exists iff it is here
        self._parent: dict[int, int] = {}
        # Every key in creation order (deleted ones linger until compaction): lets an export walk the
        # trie in chunks while the writer keeps applying events, which a dict iteration cannot.
        self._order: list[int] = []
        self._compaction: tuple[list[int], int] | None = None
        self._carriers: dict[Carrier, _CarrierState] = {}
        self._by_cid: list[_CarrierState | None] = []
        self._any_mask = 0  # bit 0 of every allocated carrier nibble
        # Visibility, the one predicate readers use (``match``, the snapshot export): per carrier id the
        # nibble of tiers currently visible. 0xF for a live carrier; 0 while its engine is DISCONNECTED
        # (unreachable: never handed out), so hiding or re-adopting a carrier is one int assignment.
        self._visible = 0

    # ---- carriers -------------------------------------------------------------------------------

    def _state(self, carrier: Carrier) -> _CarrierState:
        st = self._carriers.get(carrier)
        if st is None:
            # Lowest free id keeps the packed carrier ints small.
            cid = next((i for i, s in enumerate(self._by_cid) if s is None), len(self._by_cid))
            st = _CarrierState(carrier, cid)
            if cid == len(self._by_cid):
                self._by_cid.append(st)
            else:
                self._by_cid[cid] = st
            self._carriers[carrier] = st
            self._any_mask |= 1 << st.shift
            self._visible |= 0xF << st.shift
        return st

    @property
    def carriers(self) -> list[Carrier]:
        return sorted(self._carriers)

    def node_count(self) -> int:
        return len(self._carriers_of)

    def carrier_blocks(self, carrier: Carrier) -> dict[Tier, int]:
        st = self._carriers.get(carrier)
        counts = st.tier_blocks if st else [0, 0, 0, 0]
        return dict(zip(TIER_ORDER, counts, strict=True))

    def carrier_engine_hashes(self, carrier: Carrier) -> dict[Tier, set[int]]:
        """The engine hashes this carrier holds, per tier: what the index believes the engine holds,
        in the engine's own terms, so it can be compared with the engine's state."""
        out: dict[Tier, set[int]] = {t: set() for t in TIER_ORDER}
        st = self._carriers.get(carrier)
        if st is None:
            return out
        for h, key in st.by_engine_hash.items():
            nib = (self._carriers_of.get(key, 0) >> st.shift) & 0xF
            for t in TIER_ORDER:
                if nib & t:
                    out[t].add(h)
        return out

    # ---- mutations (writer only) ---------------------------------------------------------------

    def apply_batch(self, carrier: Carrier, batch: EventBatch) -> ApplyStats:
        stats = ApplyStats()
        st = self._state(carrier)
        for ev in batch.events:
            if type(ev) is BlockStored:
                self._store(st, ev, stats)
            elif type(ev) is BlockRemoved:
                self._remove(st, ev, stats)
            elif type(ev) is AllBlocksCleared:
                stats.events["AllBlocksCleared", ""] += 1
                stats.cleared += self._clear(st)
        return stats

    def clear_carrier(self, carrier: Carrier) -> int:
        """Forget every block of a carrier (AllBlocksCleared, a gap replay could not cover, a restart).
        Returns how many blocks it held."""
        st = self._carriers.get(carrier)
        return self._clear(st) if st else 0

    def remove_carrier(self, carrier: Carrier) -> int:
        """Forget a carrier entirely (its engine left discovery or restarted as a new incarnation)."""
        st = self._carriers.pop(carrier, None)
        if st is None:
            return 0
        n = self._clear(st)
        self._by_cid[st.cid] = None
        self._any_mask &= ~(1 << st.shift)
        self._visible &= ~(0xF << st.shift)
        return n

    # ---- visibility (the reader predicate) ------------------------------------------------------

    def set_visible(self, carrier: Carrier, tiers: int) -> None:
        """Make exactly ``tiers`` of this carrier visible to readers (0: the carrier is invisible).
        O(1) and atomic for readers on the loop. A carrier the index does not know is created empty, so
        a hide issued before its first batch still holds."""
        st = self._state(carrier)
        self._visible = (self._visible & ~(0xF << st.shift)) | ((tiers & 0xF) << st.shift)

    def visible_tiers(self, carrier: Carrier) -> int:
        st = self._carriers.get(carrier)
        return (self._visible >> st.shift) & 0xF if st is not None else 0

    def drop_tiers(self, carrier: Carrier, tiers: int) -> int:
        """Forget ``tiers`` of every block this carrier holds (a device tier that did not survive a
        restart); blocks left in no tier are forgotten. O(blocks), writer only. Returns tier-blocks
        cleared."""
        st = self._carriers.get(carrier)
        if st is None or not tiers & 0xF:
            return 0
        if tiers & 0xF == 0xF:
            return self._clear(st)
        n = 0
        gone_hashes = []
        for h, key in st.by_engine_hash.items():
            n += self._clear_node(st, key, Tier(tiers & 0xF))
            if not (self._carriers_of.get(key, 0) >> st.shift) & 0xF:
                gone_hashes.append((h, key))
        for h, key in gone_hashes:
            self._drop_hash(st, h, key)
            self._prune(key)
        return n

    def _store(self, st: _CarrierState, ev: BlockStored, stats: ApplyStats) -> None:
        medium = ev.medium
        stats.events["BlockStored", medium or ""] += 1
        n = len(ev.block_hashes)
        skip = store_skip(ev, self.block_size, self.full_attention_group)
        if skip is not None:
            stats.skipped[skip] += n
            return
        tier = Tier.DEVICE if medium is None else MEDIUM_TIERS[medium]
        if ev.parent_block_hash is None:
            parent = ROOT
            seed = (
                PLAIN_ROOT
                if ev.lora_name is None and ev.cache_salt is None
                else namespace_root(ev.lora_name, ev.cache_salt)
            )
        else:
            parent = st.by_engine_hash.get(ev.parent_block_hash)
            # A parent this carrier no longer holds is as unknown as one it never announced.
            if parent is None or not (self._carriers_of.get(parent, 0) >> st.shift) & 0xF:
                stats.skipped[Skip.UNKNOWN_PARENT] += n
                return
            seed = parent
        keys = block_keys(ev.token_ids, self.block_size, seed, ev.extra_keys)
        bits = int(tier)
        for h, key in zip(ev.block_hashes, keys, strict=True):
            stats.stored += self._hold(st, key, parent, bits, h)
            parent = key

    def _hold(self, st: _CarrierState, key: int, parent: int, bits: int, h: int) -> int:
        """Record that carrier ``st`` holds ``key`` (under ``parent``) in ``bits`` tiers as engine hash
        ``h``. The one way a carrier gains a block: events and snapshot grafts both come here. Returns
        how many tier bits were new."""
        carriers_of = self._carriers_of
        old = st.by_engine_hash.get(h)
        if old is not None and old != key:
            # The engine reused a hash for other content: the old position is no longer held.
            self._clear_node(st, old, ALL_TIERS)
            self._drop_hash(st, h, old)
            self._prune(old)
        old_h = st.hash_of.get(key)
        if old_h is not None and old_h != h:
            del st.by_engine_hash[old_h]  # the same position, announced under a new engine hash
        c = carriers_of.get(key)
        if c is None:
            c = 0
            self._parent[key] = parent
            self._order.append(key)
        new = bits & ~(c >> st.shift)
        if new:
            carriers_of[key] = c | (new << st.shift)
            tb = st.tier_blocks
            for slot in _NIBBLE_SLOTS[new & 0xF]:
                tb[slot] += 1
        st.by_engine_hash[h] = key
        st.hash_of[key] = h
        return len(_NIBBLE_SLOTS[new & 0xF])

    @staticmethod
    def _drop_hash(st: _CarrierState, h: int, key: int) -> None:
        del st.by_engine_hash[h]
        st.hash_of.pop(key, None)

    def _remove(self, st: _CarrierState, ev: BlockRemoved, stats: ApplyStats) -> None:
        stats.events["BlockRemoved", ev.medium or ""] += 1
        if ev.group_idx is not None and ev.group_idx != self.full_attention_group:
            stats.skipped[Skip.OTHER_GROUP] += len(ev.block_hashes)
            return
        # Untagged or unknown medium: clear every tier (the engine no longer holds it anywhere we know).
        tiers = MEDIUM_TIERS.get(ev.medium, ALL_TIERS) if ev.medium is not None else ALL_TIERS
        by_hash = st.by_engine_hash
        for h in ev.block_hashes:
            key = by_hash.get(h)
            if key is None:
                stats.skipped[Skip.UNKNOWN_BLOCK] += 1
                continue
            stats.removed += self._clear_node(st, key, tiers)
            if not (self._carriers_of.get(key, 0) >> st.shift) & 0xF:
                self._drop_hash(st, h, key)
                self._prune(key)

    def _clear_node(self, st: _CarrierState, key: int, tiers: Tier) -> int:
        """Clear ``tiers`` of one carrier on one node; returns the tier-blocks cleared. No pruning."""
        c = self._carriers_of.get(key)
        if c is None:
            return 0
        gone = (c >> st.shift) & int(tiers)
        if not gone:
            return 0
        self._carriers_of[key] = c & ~(gone << st.shift)
        tb = st.tier_blocks
        for slot in _NIBBLE_SLOTS[gone]:
            tb[slot] -= 1
        return 1

    def _prune(self, key: int) -> None:
        if self._carriers_of.get(key) == 0:
            del self._carriers_of[key]
            del self._parent[key]

    def _clear(self, st: _CarrierState) -> int:
        n = 0
        keep = ~(0xF << st.shift)
        carriers_of = self._carriers_of
        for key in st.by_engine_hash.values():
            c = carriers_of.get(key)
            if c is not None and c & ~keep:
                carriers_of[key] = c & keep
                n += 1
        for key in st.by_engine_hash.values():
            self._prune(key)
        st.by_engine_hash.clear()
        st.hash_of.clear()
        st.tier_blocks[:] = [0, 0, 0, 0]
        return n

    def maintain(self, budget: int = 65_536) -> None:
        """Compact ``_order`` (drop deleted keys) a chunk at a time, so no single writer turn stalls on
        it. Called by the writer between batches; cheap when there is nothing to do."""
        order = self._order
        if self._compaction is None:
            if len(order) <= 2 * len(self._carriers_of) + 4096:
                return
            self._compaction = ([], 0)
        fresh, pos = self._compaction
        live = self._carriers_of
        fresh.extend([k for k in order[pos : pos + budget] if k in live])
        pos += budget
        if pos < len(order):
            self._compaction = (fresh, pos)
            return
        # Done: anything appended meanwhile was already copied (pos reached the moving end). An
        # export holding the old list keeps its own reference and is unaffected.
        self._order = fresh
        self._compaction = None

    # ---- reads ---------------------------------------------------------------------------------

    def keys_for(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return block_keys(token_ids, self.block_size, namespace_root(lora_name, cache_salt))

    def match(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[Carrier, CarrierMatch]:
        """Per carrier that holds at least the first block: its matched prefix. Hashes while walking
        (the same keys as ``keys_for``), so a prompt that misses early costs one block's hash."""
        bs = self.block_size
        n = len(token_ids) // bs
        carriers_of = self._carriers_of
        if n == 0 or not carriers_of:
            return {}
        root = namespace_root(lora_name, cache_salt)
        key = block_keys(token_ids[:bs], bs, root)[0]
        if key not in carriers_of:
            return {}
        data = array("I")
        try:
            data.fromlist(token_ids if type(token_ids) is list else list(token_ids))
        except OverflowError:  # IDs beyond u32: the general path hashes them as 64-bit
            return self.match_keys(block_keys(token_ids, bs, root))
        # The walk below is match_keys' loop with the hashing inlined: a generator feeding match_keys
        # costs ~15 µs more on a 256-block prompt, and this is the routing hot path.
        any_mask = self._any_mask
        visible = self._visible
        alive = any_mask
        runs: list[list[int]] = []  # [packed visible carriers, run length]
        prev = -1
        parent = root
        for off in range(0, n * bs, bs):
            key = _h(data[off : off + bs], seed=parent)
            c = carriers_of.get(key)
            if c is None:
                break
            parent = key
            if c == prev:
                runs[-1][1] += 1
                continue
            prev = c
            c &= visible
            alive &= (c | c >> 1 | c >> 2 | c >> 3) & any_mask
            if not alive:
                break
            runs.append([c, 1])
        return self._settle(runs)

    def match_keys(self, keys: Iterable[int]) -> dict[Carrier, CarrierMatch]:
        """``match`` for precomputed keys (``keys_for``)."""
        # Walk while any carrier still holds the prefix, recording runs of nodes whose packed carrier
        # int is identical (along a hot path it rarely changes); ``_settle`` then counts per carrier.
        carriers_of = self._carriers_of
        any_mask = self._any_mask
        visible = self._visible
        alive = any_mask
        runs: list[list[int]] = []
        prev = -1
        for key in keys:
            c = carriers_of.get(key)
            if c is None:
                break
            if c == prev:
                runs[-1][1] += 1
                continue
            prev = c
            c &= visible
            alive &= (c | c >> 1 | c >> 2 | c >> 3) & any_mask
            if not alive:
                break
            runs.append([c, 1])
        return self._settle(runs)

    def _settle(self, runs: list[list[int]]) -> dict[Carrier, CarrierMatch]:
        if not runs:
            return {}
        out: dict[Carrier, CarrierMatch] = {}
        first = runs[0][0]
        for st in self._by_cid:
            if st is None or not (first >> st.shift) & 0xF:
                continue
            shift = st.shift
            counts = [0, 0, 0, 0]
            total = 0
            for c, length in runs:
                nib = (c >> shift) & 0xF
                if not nib:
                    break
                # Best tier held: lowest set bit (DEVICE=1 < HOST=2 < DISK=4 < EXTERNAL=8).
                counts[(nib & -nib).bit_length() - 1] += length
                total += length
            out[st.carrier] = CarrierMatch(total, tuple(counts))
        return out

    def iter_nodes(self) -> Iterator[tuple[int, int, dict[Carrier, Tier]]]:
        """(key, parent key, carriers with tiers) for every node, in no particular order; for tests and
        debugging. The snapshot export walks in DFS pre-order instead."""
        for key, c in self._carriers_of.items():
            held = {}
            for st in self._by_cid:
                if st is not None:
                    nib = (c >> st.shift) & 0xF
                    if nib:
                        held[st.carrier] = Tier(nib)
            yield key, self._parent[key], held
