"""Render an ``EventBatch`` in each engine dialect, byte for byte as the engines' own publishers do.

This is what the fake engine publishes, so the fake speaks the real wire; ``tests/test_wire_vectors.py``
holds it to the golden vectors in ``tests/data/vectors``. The engines encode with msgspec; plain
``msgpack.Packer`` writes the same bytes (float64 ``cb``, smallest int forms with ``cf`` for u64 >= 2**63
and ``d3`` for negative i64, ``str8`` from 32 bytes, ``bin`` for bytes) except for one quirk:

- msgspec sizes a struct's map header by the struct's *maximum* field count. vLLM 0.33's BlockStored
  has 15 fields plus the tag, so it always starts with a map16 header (``de 00 NN``, NN the entries
  actually written) even for 8 entries; we rewrite msgpack's fixmap byte into that header.

What each dialect carries (the rest of an event is dropped when encoding):

- ``vllm-0.33``: map events. BlockStored writes type + fields 1-7 always (nil allowed), then
  extra_keys, group_idx, kv_cache_spec_kind only when set; cache_salt is not a vLLM field (vLLM puts
  a salt into extra_keys). BlockRemoved writes type, block_hashes, medium always, group_idx if set.
- ``vllm-0.20``: tagged arrays with every field written, trailing nils included:
  BlockStored ``[tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra_keys,
  group_idx]`` (no cache_salt, no kv_cache_spec_kind); BlockRemoved ``[tag, hashes, medium, group_idx]``.
- ``sglang`` (0.5.23): map events with hashes as signed i64. BlockStored writes type, block_hashes,
  parent_block_hash, token_ids, block_size, lora_id always, then medium, cache_salt, lora_name only
  when set (no extra_keys, group_idx, kv_cache_spec_kind). BlockRemoved writes type, block_hashes,
  and medium when set. (That medium on BlockStored is omitted when None, like on BlockRemoved, is
  inferred from SGLang's struct defaults; no vector shows it.)

All three batches are ``[ts (float64), events, rank]`` with a nil rank when unset.
Hashes in events are u64 (as decoded); the encoders do not re-validate them.
"""

from __future__ import annotations

from typing import Any

import msgpack

from router_runtime.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, Dialect, EventBatch

__all__ = ["encode_batch", "pub_frames", "replay_end_frames", "replay_reply_frames"]

_I64_WRAP = 1 << 64
_I64_MAX = (1 << 63) - 1
_END_SEQ = b"\xff" * 8
_BATCH_HEADER = b"\x93"  # [ts, events, rank]


def _new_packer() -> msgpack.Packer:
    # A Packer per call: Packer is not thread-safe and costs about a microsecond to build.
    return msgpack.Packer(use_bin_type=True, use_single_float=False, autoreset=True)


def _as_map16(packed: bytes, entries: int) -> bytes:
    """Swap msgpack's fixmap header (entries <= 15) for msgspec's map16 header of the same count."""
    assert packed[0] == 0x80 | entries, "expected a fixmap header"
    return b"\xde" + entries.to_bytes(2, "big") + packed[1:]


def _i64(h: int) -> int:
    """u64 hash -> SGLang's signed i64 (two's complement)."""
    return h - _I64_WRAP if h > _I64_MAX else h


def _vllm033_event(ev: Any, pack: Any) -> bytes:
    if type(ev) is BlockStored:
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": ev.block_hashes,
            "parent_block_hash": ev.parent_block_hash,
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
            "medium": ev.medium,
            "lora_name": ev.lora_name,
        }
        if ev.extra_keys is not None:
            d["extra_keys"] = ev.extra_keys
        if ev.group_idx is not None:
            d["group_idx"] = ev.group_idx
        if ev.kv_cache_spec_kind is not None:
            d["kv_cache_spec_kind"] = ev.kv_cache_spec_kind
        return _as_map16(pack(d), len(d))
    if type(ev) is BlockRemoved:
        r: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": ev.medium}
        if ev.group_idx is not None:
            r["group_idx"] = ev.group_idx
        return pack(r)
    if type(ev) is AllBlocksCleared:
        return pack({"type": "AllBlocksCleared"})
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def _vllm020_event(ev: Any, pack: Any) -> bytes:
    if type(ev) is BlockStored:
        return pack(
            (
                "BlockStored",
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.block_size,
                ev.lora_id,
                ev.medium,
                ev.lora_name,
                ev.extra_keys,
                ev.group_idx,
            )
        )
    if type(ev) is BlockRemoved:
        return pack(("BlockRemoved", ev.block_hashes, ev.medium, ev.group_idx))
    if type(ev) is AllBlocksCleared:
        return pack(("AllBlocksCleared",))
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def _sglang_event(ev: Any, pack: Any) -> bytes:
    if type(ev) is BlockStored:
        parent = ev.parent_block_hash
        d: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": [_i64(h) for h in ev.block_hashes],
            "parent_block_hash": None if parent is None else _i64(parent),
            "token_ids": ev.token_ids,
            "block_size": ev.block_size,
            "lora_id": ev.lora_id,
        }
        if ev.medium is not None:
            d["medium"] = ev.medium
        if ev.cache_salt is not None:
            d["cache_salt"] = ev.cache_salt
        if ev.lora_name is not None:
            d["lora_name"] = ev.lora_name
        return pack(d)
    if type(ev) is BlockRemoved:
        r: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": [_i64(h) for h in ev.block_hashes]}
        if ev.medium is not None:
            r["medium"] = ev.medium
        return pack(r)
    if type(ev) is AllBlocksCleared:
        return pack({"type": "AllBlocksCleared"})
    raise TypeError(f"not a KV event: {type(ev).__name__}")


_EVENT_ENCODERS = {
    Dialect.VLLM_033: _vllm033_event,
    Dialect.VLLM_020: _vllm020_event,
    Dialect.SGLANG: _sglang_event,
}


def encode_batch(dialect: Dialect, batch: EventBatch) -> bytes:
    """The msgpack payload ``dialect``'s publisher would send for ``batch``."""
    encode_event = _EVENT_ENCODERS[Dialect(dialect)]
    packer = _new_packer()
    pack = packer.pack
    parts = [
        _BATCH_HEADER,
        pack(float(batch.ts)),
        packer.pack_array_header(len(batch.events)),
    ]
    parts.extend(encode_event(ev, pack) for ev in batch.events)
    parts.append(pack(batch.data_parallel_rank))
    return b"".join(parts)


def pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB multipart message: ``[topic, seq (8 bytes BE), payload]`` (same in every dialect)."""
    return [topic, seq.to_bytes(8, "big"), payload]


def replay_reply_frames(dialect: Dialect, topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """One replay data message as a ROUTER sends it after the client's identity frame.

    vLLM <= 0.25 (our ``vllm-0.20``): ``[b"", seq, payload]``; vLLM >= 0.26 and SGLang 0.5.23 add the
    topic: ``[b"", topic, seq, payload]``.
    """
    seq_frame = seq.to_bytes(8, "big")
    if Dialect(dialect) is Dialect.VLLM_020:
        return [b"", seq_frame, payload]
    return [b"", topic, seq_frame, payload]


def replay_end_frames(dialect: Dialect) -> list[bytes]:
    """The end-of-replay marker after the identity frame: seq 0xFF * 8, empty payload (and topic)."""
    if Dialect(dialect) is Dialect.VLLM_020:
        return [b"", _END_SEQ, b""]
    return [b"", b"", _END_SEQ, b""]
