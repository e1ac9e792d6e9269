"""Typed KV events, as the router understands them after decoding.

These are the dialect-neutral shapes: every engine dialect (vLLM <= 0.25 tagged arrays, vLLM >= 0.26
and SGLang 0.5.23 ``"type"``-keyed maps, older SGLang arrays) decodes into them, and the fake engine's
encoders render them back into each dialect byte for byte.

Engine block hashes are normalized to unsigned 64-bit ints (signed i64 two's complement, raw bytes:
last 8 bytes big-endian) and are only ever used as opaque IDs per (engine, rank).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import routerfleet_index


class Tier(enum.IntFlag):
    """Where a carrier holds a block. A bitset: one carrier may hold a block in several tiers."""

    DEVICE = 1
    HOST = 2
    DISK = 4
    EXTERNAL = 8


ALL_TIERS = Tier.DEVICE | Tier.HOST | Tier.DISK | Tier.EXTERNAL

# Storage media from both engines' vocabularies, as the native core maps them. An untagged (None)
# store means DEVICE; an unknown medium on a store is ignored, and on a remove clears every tier (see
# docs/kv-wire.md, section 3.2).
MEDIUM_TIERS: dict[str, Tier] = {m: Tier(t) for m, t in routerfleet_index.MEDIUM_TIERS.items()}


class Dialect(enum.StrEnum):
    """The wire dialects we speak. The fake engine publishes any of them; the decoder accepts all."""

    VLLM_033 = "vllm-0.33"  # map events, 3-frame replay replies carrying the topic
    VLLM_020 = "vllm-0.20"  # tagged-array events, 2-frame replay replies
    SGLANG = "sglang"  # map events (0.5.23), signed i64 hashes, SGLang media names


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    # One entry per block (vLLM's untagged extra keys: LoRA name, multimodal ids, cache salt...),
    # each an opaque tuple; None when the engine sent none.
    extra_keys: tuple[tuple, ...] | None = None
    cache_salt: str | None = None  # SGLang's salt field
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


@dataclass(frozen=True, slots=True)
class SequencedBatch:
    """A batch as it came off one rank's stream: the publisher's sequence number and the batch."""

    seq: int
    batch: EventBatch | routerfleet_index.Batch  # native when decoded off the wire
    nbytes: int = 0  # payload size on the wire, for queue accounting


@dataclass(slots=True)
class DecodeStats:
    """What the decoder skipped, by reason; counted, never raised."""

    unknown_tags: dict[str, int] = field(default_factory=dict)
    unknown_fields: int = 0
