"""The fake engine's prefix cache: the functional core (no I/O, no clocks, no randomness).

One ``RankCache`` per data-parallel rank holds full blocks keyed by their engine hash (see
``hashing.py``), in a device tier and an optional host tier, each an LRU of bounded size. Every mutation
returns the KV events a real engine would publish for it, in order, so the imperative shell only has
to batch and send them. Same inputs, same call order -> same hashes, same events.

How it models vLLM's block pool (and where it simplifies):

* Only full blocks are cached; a prompt's trailing partial block is neither matched nor stored.
* A block is in exactly one tier. Evicting from device moves it to host when a host tier exists
  (``BlockStored`` host medium, then ``BlockRemoved`` GPU); evicting from host moves it to the disk tier
  when one exists, else drops it (``BlockRemoved`` host medium). With a disk tier and no host tier,
  device evictions go to disk; evicting from disk drops. A host or disk hit is promoted back to device
  on admission (``BlockStored`` GPU, then ``BlockRemoved`` of the lower medium): copy first, free
  second, as offloading does. The disk tier outlives the process (see ``storage.py``): ``reset`` keeps
  it when asked, as a restarted engine finds its disk again (and announces nothing about it).
* After an admission the request's blocks are touched leaf-first, so the chain's root is the most
  recently used: like vLLM's free queue, tails are evicted before the prefixes they hang off.
* Blocks of the request being admitted are never evicted to make room for the same request; a chain
  longer than the device tier is truncated to the device capacity (vLLM would refuse to schedule it).
* Cached prefix = leading blocks resident in any tier, counted in full blocks, of the prompt but its
  last token: like vLLM (and SGLang), the engine computes the last token for its logits, so a fully
  cached block-aligned prompt reports one block fewer than it holds. (vLLM's other rule, no cache read
  for a request with ``prompt_logprobs``, is not modelled: the fake computes no logprobs.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from router_runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, KVEvent, Tier
from routerfleet_fake_engine.hashing import (
    PLAIN,
    Namespace,
    block_hashes,
    vllm_event_extra_keys,
)

DEVICE_MEDIUM = "GPU"


def host_medium(dialect: Dialect) -> str:
    """The host tier's medium name in each engine's vocabulary."""
    return "CPU_PINNED" if dialect is Dialect.SGLANG else "CPU"


def disk_medium(dialect: Dialect) -> str:
    """The disk tier's medium name in each engine's vocabulary."""
    return "DISK" if dialect is Dialect.SGLANG else "STORAGE"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    dialect: Dialect
    block_size: int = 16
    device_capacity: int = 4096  # blocks
    host_capacity: int = 0  # blocks; 0 = no host tier
    disk_capacity: int = 0  # blocks; 0 = no disk tier

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.device_capacity < 1:
            raise ValueError("device_capacity must be >= 1")
        if self.host_capacity < 0:
            raise ValueError("host_capacity must be >= 0")
        if self.disk_capacity < 0:
            raise ValueError("disk_capacity must be >= 0")


@dataclass(frozen=True, slots=True)
class CachedBlock:
    hash: int  # engine hash as u64
    parent: int | None  # hash of the previous block in the chain, None at the root
    tokens: tuple[int, ...]
    namespace: Namespace
    index: int  # position in its chain; vLLM's cache salt rides on index 0 only


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """How much of a prompt is already resident, counted from the root in full blocks."""

    device_blocks: int
    host_blocks: int
    block_size: int
    disk_blocks: int = 0

    @property
    def blocks(self) -> int:
        return self.device_blocks + self.host_blocks + self.disk_blocks

    @property
    def cached_tokens(self) -> int:
        return self.blocks * self.block_size


@dataclass(frozen=True, slots=True)
class Admission:
    """The result of running a request's prompt through the cache."""

    match: PrefixMatch  # what was resident before the admission (the request's cache hit)
    events: tuple[KVEvent, ...]  # what the engine publishes for this scheduler step

    @property
    def cached_tokens(self) -> int:
        return self.match.cached_tokens


class RankCache:
    """The prefix cache of one DP rank. Mutable, but pure in the sense that matters: no I/O."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        # Insertion order is LRU order: first = least recently used.
        self._device: OrderedDict[int, CachedBlock] = OrderedDict()
        self._host: OrderedDict[int, CachedBlock] = OrderedDict()
        self._disk: OrderedDict[int, CachedBlock] = OrderedDict()
        self.disk_dirty = False  # the disk tier changed since the shell last persisted it

    # ----------------------------------------------------------------- queries

    def chain(self, tokens: Sequence[int], namespace: Namespace = PLAIN) -> list[CachedBlock]:
        """The blocks ``tokens`` would occupy (full blocks only), without touching the cache."""
        bs = self.config.block_size
        hashes = block_hashes(self.config.dialect, tokens, bs, namespace)
        return [
            CachedBlock(h, hashes[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]), namespace, i)
            for i, h in enumerate(hashes)
        ]

    def lookup(self, tokens: Sequence[int], namespace: Namespace = PLAIN) -> PrefixMatch:
        """The resident prefix of ``tokens`` (device and host hits both count). Changes nothing: the
        promotion of host hits happens in ``admit``, which is where events can be emitted."""
        return self._match(self.chain(tokens, namespace)[: self.config.device_capacity])

    def device_hashes(self) -> list[int]:
        """Device-resident hashes, least recently used first."""
        return list(self._device)

    def host_hashes(self) -> list[int]:
        """Host-resident hashes, least recently used first."""
        return list(self._host)

    def disk_hashes(self) -> list[int]:
        """Disk-resident hashes, least recently used first."""
        return list(self._disk)

    def disk_blocks(self) -> list[CachedBlock]:
        return list(self._disk.values())

    def load_disk(self, blocks: Iterable[CachedBlock]) -> None:
        """Put blocks found on disk back in the disk tier (LRU first), silently: a restarted engine
        announces nothing about what its disk holds."""
        self._disk.clear()
        for b in blocks:
            self._disk[b.hash] = b
        while len(self._disk) > self.config.disk_capacity:
            self._disk.popitem(last=False)
        self.disk_dirty = False

    def resident(self, tier: Tier) -> int:
        tiers = {Tier.DEVICE: self._device, Tier.HOST: self._host, Tier.DISK: self._disk}
        return len(tiers.get(tier, ()))

    # --------------------------------------------------------------- mutations

    def admit(self, tokens: Sequence[int], namespace: Namespace = PLAIN) -> Admission:
        """Run a prompt through the cache as a request would: report the hit, touch device hits, promote
        host hits, store the missing blocks on device (evicting LRU blocks as needed)."""
        blocks = self.chain(tokens, namespace)[: self.config.device_capacity]
        match = self._match(blocks[: max(len(tokens) - 1, 0) // self.config.block_size])
        pinned = {b.hash for b in blocks}
        events: list[KVEvent] = []
        promoted: list[int] = []
        from_disk: list[int] = []
        run: list[CachedBlock] = []
        for block in blocks:
            if block.hash in self._device:
                self._flush(run, DEVICE_MEDIUM, events)
                continue
            if block.hash in self._host:
                del self._host[block.hash]
                promoted.append(block.hash)
            elif block.hash in self._disk:
                del self._disk[block.hash]
                self.disk_dirty = True
                from_disk.append(block.hash)
            self._make_room_on_device(pinned, events)
            self._device[block.hash] = block
            run.append(block)
        self._flush(run, DEVICE_MEDIUM, events)
        medium = host_medium(self.config.dialect)
        events.extend(BlockRemoved((h,), medium) for h in promoted)
        events.extend(BlockRemoved((h,), disk_medium(self.config.dialect)) for h in from_disk)
        self._touch_leaf_first(self._device, blocks)
        return Admission(match, tuple(events))

    def store(
        self, tokens: Sequence[int], namespace: Namespace = PLAIN, tier: Tier = Tier.DEVICE
    ) -> list[KVEvent]:
        """Admin: put a prompt's blocks in ``tier``. Device behaves exactly like ``admit``. Host stores the
        blocks not already resident (a device-resident block stays where it is) and raises ValueError
        when no host tier is configured."""
        if tier is Tier.DEVICE:
            return list(self.admit(tokens, namespace).events)
        if tier is Tier.HOST:
            if self.config.host_capacity == 0:
                raise ValueError("no host tier configured (host capacity is 0)")
            capacity, medium, store, make_room = (
                self.config.host_capacity,
                host_medium(self.config.dialect),
                self._host,
                self._make_room_on_host,
            )
        elif tier is Tier.DISK:
            if self.config.disk_capacity == 0:
                raise ValueError("no disk tier configured (disk capacity is 0)")
            capacity, medium, store, make_room = (
                self.config.disk_capacity,
                disk_medium(self.config.dialect),
                self._disk,
                self._make_room_on_disk,
            )
            self.disk_dirty = True
        else:
            raise ValueError(f"the fake engine has no {tier.name.lower()} tier")
        blocks = self.chain(tokens, namespace)[:capacity]
        pinned = {b.hash for b in blocks}
        events: list[KVEvent] = []
        run: list[CachedBlock] = []
        for block in blocks:
            if block.hash in self._device or block.hash in self._host or block.hash in self._disk:
                self._flush(run, medium, events)
                continue
            make_room(pinned, events)
            store[block.hash] = block
            run.append(block)
        self._flush(run, medium, events)
        self._touch_leaf_first(store, blocks)
        return events

    def remove(
        self, tokens: Sequence[int], namespace: Namespace = PLAIN, tier: Tier | None = None
    ) -> list[KVEvent]:
        """Admin: evict a prompt's blocks from ``tier`` (None = from whichever tier holds them). A plain
        drop, one ``BlockRemoved`` per block as vLLM emits them; nothing moves to host."""
        events: list[KVEvent] = []
        medium = host_medium(self.config.dialect)
        for block in self.chain(tokens, namespace):
            if tier in (None, Tier.DEVICE) and self._device.pop(block.hash, None) is not None:
                events.append(BlockRemoved((block.hash,), DEVICE_MEDIUM))
            if tier in (None, Tier.HOST) and self._host.pop(block.hash, None) is not None:
                events.append(BlockRemoved((block.hash,), medium))
            if tier in (None, Tier.DISK) and self._disk.pop(block.hash, None) is not None:
                self.disk_dirty = True
                events.append(BlockRemoved((block.hash,), disk_medium(self.config.dialect)))
        return events

    def wipe_disk(self) -> list[KVEvent]:
        """The disk tier's content is invalidated (the shell bumps the storage epoch): every disk block
        goes, announced as removals."""
        medium = disk_medium(self.config.dialect)
        events: list[KVEvent] = [BlockRemoved((h,), medium) for h in self._disk]
        self._disk.clear()
        self.disk_dirty = True
        return events

    def clear(self) -> list[KVEvent]:
        """A prefix-cache reset: everything goes, announced as one AllBlocksCleared."""
        self.reset()
        return [AllBlocksCleared()]

    def reset(self, *, keep_disk: bool = False) -> None:
        """Forget everything silently, as a restarted engine does (it publishes nothing about it). The
        disk tier survives a process restart (``keep_disk``), and is still not announced."""
        self._device.clear()
        self._host.clear()
        if not keep_disk:
            self._disk.clear()
            self.disk_dirty = True

    # ---------------------------------------------------------------- internals

    def _match(self, blocks: Iterable[CachedBlock]) -> PrefixMatch:
        device = host = disk = 0
        for block in blocks:
            if block.hash in self._device:
                device += 1
            elif block.hash in self._host:
                host += 1
            elif block.hash in self._disk:
                disk += 1
            else:
                break
        return PrefixMatch(device, host, self.config.block_size, disk)

    @staticmethod
    def _touch_leaf_first(tier: OrderedDict[int, CachedBlock], blocks: Sequence[CachedBlock]) -> None:
        for block in reversed(blocks):
            if block.hash in tier:
                tier.move_to_end(block.hash)

    @staticmethod
    def _victim(tier: OrderedDict[int, CachedBlock], pinned: set[int]) -> int:
        # The LRU block that is not part of the chain being admitted; if everything is pinned (a host
        # tier smaller than the chain), fall back to plain LRU.
        return next((h for h in tier if h not in pinned), next(iter(tier)))

    def _make_room_on_device(self, pinned: set[int], events: list[KVEvent]) -> None:
        while len(self._device) >= self.config.device_capacity:
            victim = self._device.pop(self._victim(self._device, pinned))
            if self.config.host_capacity > 0:
                self._make_room_on_host(pinned, events)
                self._host[victim.hash] = victim
                events.append(self._stored([victim], host_medium(self.config.dialect)))
            elif self.config.disk_capacity > 0:
                self._to_disk(victim, pinned, events)
            events.append(BlockRemoved((victim.hash,), DEVICE_MEDIUM))

    def _make_room_on_host(self, pinned: set[int], events: list[KVEvent]) -> None:
        while len(self._host) >= self.config.host_capacity:
            victim = self._host.pop(self._victim(self._host, pinned))
            if self.config.disk_capacity > 0:
                self._to_disk(victim, pinned, events)
            events.append(BlockRemoved((victim.hash,), host_medium(self.config.dialect)))

    def _to_disk(self, block: CachedBlock, pinned: set[int], events: list[KVEvent]) -> None:
        if block.hash in self._disk:
            self._disk.move_to_end(block.hash)
            return
        self._make_room_on_disk(pinned, events)
        self._disk[block.hash] = block
        self.disk_dirty = True
        events.append(self._stored([block], disk_medium(self.config.dialect)))

    def _make_room_on_disk(self, pinned: set[int], events: list[KVEvent]) -> None:
        while len(self._disk) >= self.config.disk_capacity:
            victim = self._disk.pop(self._victim(self._disk, pinned))
            self.disk_dirty = True
            events.append(BlockRemoved((victim.hash,), disk_medium(self.config.dialect)))

    def _flush(self, run: list[CachedBlock], medium: str, events: list[KVEvent]) -> None:
        # One BlockStored per contiguous run of newly resident blocks (vLLM: one per cache_full_blocks).
        if run:
            events.append(self._stored(run, medium))
            run.clear()

    def _stored(self, run: Sequence[CachedBlock], medium: str) -> BlockStored:
        ns = run[0].namespace
        vllm = self.config.dialect is not Dialect.SGLANG
        return BlockStored(
            block_hashes=tuple(b.hash for b in run),
            parent_block_hash=run[0].parent,
            token_ids=tuple(t for b in run for t in b.tokens),
            block_size=self.config.block_size,
            medium=medium,
            lora_name=ns.lora_name,
            # vLLM carries the namespace as per-block extra keys; SGLang has a cache_salt field instead.
            extra_keys=tuple(vllm_event_extra_keys(ns, b.index) for b in run)
            if vllm and not ns.is_plain
            else None,
            cache_salt=ns.cache_salt if not vllm else None,
        )
