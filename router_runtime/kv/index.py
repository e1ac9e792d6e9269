"""The radix index: which carrier (engine, DP rank) holds which KV blocks, in which tiers.

The index itself is native (``native/src/index.rs``: storage, the store/remove rules, match, the
visibility mask); this module is its Python face. It owns carrier identity: the core knows carriers
as small ids, this wrapper maps them to ``Carrier`` values, and turns the core's rows into the typed
results the routing policies and the writer read.

Run cold, never wrong. A store whose parent this carrier never announced, with a different block
size, a non-full-attention group or an unknown medium is skipped and counted, never hung off the
root (that would invent a prefix the engine does not hold).

One writer. Every mutation is one synchronous native call, made from the index writer task, so a
reader on the same event loop never sees a half-applied batch.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import routerfleet_index

from ..worker import Carrier
from .events import MEDIUM_TIERS, BlockStored, EventBatch, Tier
from .hashing import extra_key_bytes

ROOT = -1  # parent key of the first block of every chain (block keys are u64, never negative)

TIER_ORDER = (Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.EXTERNAL)  # best first


class Skip(enum.StrEnum):
    """Why an event (or some of its blocks) was not indexed. Exported as a metric label; the values
    are the native core's (``routerfleet_index.SKIP_REASONS``)."""

    BLOCK_SIZE_MISMATCH = "block_size_mismatch"
    UNKNOWN_PARENT = "unknown_parent"
    UNKNOWN_MEDIUM = "unknown_medium"
    OTHER_GROUP = "other_group"
    TOKEN_COUNT = "token_count"
    UNKNOWN_BLOCK = "unknown_block"  # a remove for a block this carrier never announced


def as_native(batch: EventBatch | routerfleet_index.Batch) -> routerfleet_index.Batch:
    """The native form of a batch: decoded batches already are; typed events are converted once."""
    if isinstance(batch, EventBatch):
        return routerfleet_index.Batch.from_events(
            batch.ts, batch.events, batch.data_parallel_rank, extra_key_bytes
        )
    return batch


def store_skip(ev: BlockStored, block_size: int, full_attention_group: int) -> Skip | None:
    """Why a store cannot be indexed under this configuration, before the trie is consulted; None: it
    can. The index applies this rule; ``kv/fit.py`` tallies it over a rank's stream, to tell a
    configuration mismatch from an empty cache."""
    reason = routerfleet_index.store_skip(ev, block_size, full_attention_group)
    return None if reason is None else Skip(reason)


@dataclass(slots=True)
class ApplyStats:
    """What applying one batch did; the writer turns it into metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    events: dict[tuple[str, str], int] = field(default_factory=dict)  # (event type, medium) -> count
    skipped: dict[Skip, int] = field(default_factory=dict)  # Skip -> blocks, only those skipped


@dataclass(frozen=True, slots=True)
class CarrierMatch:
    """A carrier's matched prefix: its length in blocks, and how many of those blocks it holds at best
    in each tier (device, host, disk, external), so a policy can weight partial credit per tier."""

    blocks: int
    tier_blocks: tuple[int, int, int, int]

    @property
    def device_blocks(self) -> int:
        return self.tier_blocks[0]


def _on_device(medium: str) -> bool:
    """Whether a removal in ``medium`` (``""``: untagged) is a device eviction, one that shows the cache
    full. An unknown medium also clears the device copy (native/src/events.rs), but names some other
    tier's eviction: it says nothing of the device's size."""
    return not medium or MEDIUM_TIERS.get(medium) == Tier.DEVICE


class RadixIndex:
    """The index. Mutations: ``apply_batch``, ``clear_carrier``, ``remove_carrier``, ``drop_tiers``,
    ``set_visible``; reads: ``match``, ``match_keys``, ``carrier_blocks``, ``device_free``, ``node_count``,
    ``carrier_engine_hashes``, ``visible_tiers``. Reads that hand carriers out (``match``, the snapshot
    export) see only visible tiers; the bookkeeping reads see everything."""

    def __init__(self, block_size: int, *, full_attention_group: int = 0) -> None:
        self.native = routerfleet_index.Index(block_size, full_attention_group)
        self.block_size = block_size
        self.full_attention_group = full_attention_group
        self._cid: dict[Carrier, int] = {}
        self._by_cid: list[Carrier | None] = []
        # Carriers whose credit is withheld (kv/withhold.py): a read filter on ``match``, not index
        # content, so it is set on the loop and holds from the very next match.
        self.withheld: set[Carrier] = set()
        # Each carrier's device capacity in blocks, as its evictions show it: an engine evicts a cached
        # block only when no free one is left, so what it held around an eviction is what fits. Unknown
        # (absent) until it evicts, and again after a clear or a dropped device tier (a new process may
        # have another size; an emptied cache costs nothing to fill until it evicts again).
        self._capacity: dict[Carrier, int] = {}

    # ---- carriers -------------------------------------------------------------------------------

    def cid(self, carrier: Carrier) -> int:
        """The native id of ``carrier``, which is created (empty, visible) if new."""
        cid = self._cid.get(carrier)
        if cid is None:
            cid = self._cid[carrier] = self.native.carrier(carrier.engine, carrier.rank)
            if cid >= len(self._by_cid):
                self._by_cid.extend([None] * (cid + 1 - len(self._by_cid)))
            self._by_cid[cid] = carrier
        return cid

    def carrier_of(self, cid: int) -> Carrier:
        carrier = self._by_cid[cid]
        assert carrier is not None, "a live carrier id"
        return carrier

    @property
    def carriers(self) -> list[Carrier]:
        return sorted(self._cid)

    def node_count(self) -> int:
        return self.native.node_count()

    def carrier_blocks(self, carrier: Carrier) -> dict[Tier, int]:
        cid = self._cid.get(carrier)
        counts = self.native.carrier_blocks(cid) if cid is not None else (0, 0, 0, 0)
        return dict(zip(TIER_ORDER, counts, strict=True))

    def device_capacity(self, carrier: Carrier) -> int | None:
        """How many blocks this carrier's device cache holds, as its evictions showed (at least what
        it held around one); None until it has evicted: not known to be full."""
        return self._capacity.get(carrier)

    def device_free(self, carrier: Carrier) -> int | None:
        """How many more blocks this carrier can store on its device before it evicts one (its learned
        capacity less what it holds); None while its capacity is unknown, or while ``match`` does not
        show its device tier (withheld, hidden): what it holds is in doubt, so it is read as cold."""
        capacity = self._capacity.get(carrier)
        if capacity is None or carrier in self.withheld or not self.visible_tiers(carrier) & Tier.DEVICE:
            return None
        cid = self._cid.get(carrier)
        held = self.native.carrier_blocks(cid)[0] if cid is not None else 0
        return max(capacity - held, 0)

    def carrier_engine_hashes(self, carrier: Carrier) -> dict[Tier, set[int]]:
        """The engine hashes this carrier holds, per tier: what the index believes the engine holds,
        in the engine's own terms, so it can be compared with the engine's state."""
        cid = self._cid.get(carrier)
        if cid is None:
            return {t: set() for t in TIER_ORDER}
        return {t: set(hs) for t, hs in zip(TIER_ORDER, self.native.carrier_engine_hashes(cid), strict=True)}

    # ---- mutations (writer only) ---------------------------------------------------------------

    def apply_batch(self, carrier: Carrier, batch: EventBatch | routerfleet_index.Batch) -> ApplyStats:
        cid = self.cid(carrier)
        held = self.native.carrier_blocks(cid)[0]
        row = self.native.apply_batch(cid, as_native(batch))
        stored, removed, cleared, events, skipped = row
        stats = ApplyStats(
            stored,
            removed,
            cleared,
            {(kind, medium): n for kind, medium, n in events},
            {Skip(reason): n for reason, n in skipped} if skipped else {},
        )
        if cleared:  # AllBlocksCleared: as clear_carrier
            self._capacity.pop(carrier, None)
        if removed and any(kind == "BlockRemoved" and _on_device(medium) for kind, medium in stats.events):
            # The batch's peak is at least the larger of before and after (an estimate from below).
            held = max(held, self.native.carrier_blocks(cid)[0])
            if held > self._capacity.get(carrier, 0):
                self._capacity[carrier] = held
        return stats

    def clear_carrier(self, carrier: Carrier) -> int:
        """Forget every block of a carrier (AllBlocksCleared, a gap replay could not cover, a restart).
        Returns how many blocks it held."""
        self._capacity.pop(carrier, None)
        cid = self._cid.get(carrier)
        return self.native.clear_carrier(cid) if cid is not None else 0

    def remove_carrier(self, carrier: Carrier) -> int:
        """Forget a carrier entirely (its engine left discovery or restarted as a new incarnation)."""
        self._capacity.pop(carrier, None)
        cid = self._cid.pop(carrier, None)
        if cid is None:
            return 0
        self._by_cid[cid] = None
        return self.native.remove_carrier(cid)

    def set_visible(self, carrier: Carrier, tiers: int) -> None:
        """Make exactly ``tiers`` of this carrier visible to readers (0: the carrier is invisible).
        O(1) and atomic for readers on the loop. A carrier the index does not know is created empty, so
        a hide issued before its first batch still holds."""
        self.native.set_visible(self.cid(carrier), int(tiers) & 0xF)

    def visible_tiers(self, carrier: Carrier) -> int:
        cid = self._cid.get(carrier)
        return self.native.visible_tiers(cid) if cid is not None else 0

    def drop_tiers(self, carrier: Carrier, tiers: int) -> int:
        """Forget ``tiers`` of every block this carrier holds (a device tier that did not survive a
        restart); blocks left in no tier are forgotten. O(blocks), writer only. Returns the blocks that
        lost a tier."""
        if tiers & Tier.DEVICE:
            self._capacity.pop(carrier, None)
        cid = self._cid.get(carrier)
        return self.native.drop_tiers(cid, int(tiers) & 0xF) if cid is not None else 0

    def maintain(self) -> None:
        """Give memory back after a mass removal; called by the writer between batches, cheap when
        there is nothing to do."""
        self.native.maintain()

    # ---- reads ---------------------------------------------------------------------------------

    def keys_for(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        return self.native.keys_for(token_ids, lora_name, cache_salt)

    def match(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[Carrier, CarrierMatch]:
        """Per carrier that visibly holds at least the first block: its matched prefix. Hashes while
        walking (the same keys as ``keys_for``), so a prompt that misses early costs one block's hash."""
        return self._matches(self.native.match_tokens(token_ids, lora_name, cache_salt))

    def match_keys(self, keys: Iterable[int]) -> dict[Carrier, CarrierMatch]:
        """``match`` for precomputed keys (``keys_for``)."""
        return self._matches(self.native.match_keys(list(keys)))

    def _matches(self, rows: list[tuple[int, int, int, int, int, int]]) -> dict[Carrier, CarrierMatch]:
        by_cid = self._by_cid
        found = {by_cid[cid]: CarrierMatch(blocks, (d, h, k, e)) for cid, blocks, d, h, k, e in rows}
        for carrier in self.withheld:
            found.pop(carrier, None)
        return found

    def iter_nodes(self) -> Iterator[tuple[int, int, dict[Carrier, Tier]]]:
        """(key, parent key, carriers with tiers) for every node, in no particular order; for tests and
        debugging. The snapshot export walks in DFS pre-order instead."""
        for key, parent, held in self.native.nodes():
            yield key, ROOT if parent is None else parent, {self.carrier_of(c): Tier(t) for c, t in held}
