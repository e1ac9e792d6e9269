"""Decode KV-event frames from every engine dialect into the typed events of ``events.py``.

Pure functions, no I/O. This is the ingestion hot path: one ``msgpack.unpackb`` per payload, then a
walk over plain tuples/dicts with ``type(x) is T`` checks (cheaper than ``isinstance`` chains and
exact: msgpack ``true`` is a ``bool``, which must not pass for an int).

Accepted shapes (docs/kv-wire.md sections 1.3, 2 and 6):

- batch: ``[ts, events]`` or ``[ts, events, rank]`` (extra trailing elements ignored), or defensively
  a map ``{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}``;
- events: tagged arrays read positionally (vLLM <= 0.25, older SGLang; trailing extras ignored,
  shorter arrays from older versions are fine) and ``"type"``-keyed maps read by name (vLLM >= 0.26,
  SGLang 0.5.23; unknown keys skipped and counted);
- tags ``BlockStored`` (also ``BlockStoredWithMetadata``), ``BlockRemoved``, ``AllBlocksCleared``;
  unknown tags are skipped and counted.

A payload is all-or-nothing: a batch is applied under one sequence number, so one bad event drops
the whole batch (``MalformedFrame``) rather than applying part of it. Every failure raises
``MalformedFrame`` with a low-cardinality ``reason`` (fit for a metric label) and a message that never
contains token ids or hashes. Nothing else escapes; a ``MalformedReason.UNEXPECTED`` means a check is
missing here (the frame is still dropped safely).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Any

import msgpack

from router_runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeStats,
    EventBatch,
    KVEvent,
)

__all__ = [
    "REPLAY_END_SEQ",
    "MalformedFrame",
    "MalformedReason",
    "decode_batch",
    "normalize_hash",
    "parse_pub_message",
    "parse_replay_reply",
    "topic_matches",
]

_U64_MASK = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_INT_ONLY = frozenset({int})
_SEQ_LEN = 8
REPLAY_END_SEQ = _U64_MASK  # the replay end marker's seq frame is 0xFF * 8

# Per-value bounds handed to msgpack (a value over them is "too_large"). Strings are tags, media,
# LoRA names and salts; binaries are 32-byte digests; maps are events (at most ~18 keys) or extra keys.
_MAX_STR = 1 << 16
_MAX_BIN = 1 << 16
_MAX_MAP = 1 << 12
_MAX_EXT = 1 << 16
# Arrays are also the batch itself and positional events (<= 16 elements), so the array bound never
# drops below this, however small the caller's event/token bounds.
_MIN_ARRAY = 64
# extra_keys nesting we are willing to freeze (msgpack itself stops at depth 1024).
_MAX_FREEZE_DEPTH = 32
# Distinct unknown tag names kept in DecodeStats; tags come off the wire, so the map must not grow
# without bound. Longer names are cut.
_MAX_TAG_NAMES = 32
_MAX_TAG_LEN = 64
_OTHER_TAG = "<other>"


class MalformedReason(enum.StrEnum):
    """Why a frame was dropped. Values are stable: they are used as metric label values."""

    FRAME_COUNT = "frame_count"  # wrong number of multipart frames
    BAD_DELIMITER = "bad_delimiter"  # replay reply does not start with the empty delimiter frame
    BAD_SEQ = "bad_seq"  # sequence frame is not 8 bytes
    TOO_LARGE = "too_large"  # payload, array or string over our bounds
    TRUNCATED = "truncated"  # msgpack ended early
    TRAILING_DATA = "trailing_data"  # bytes after the msgpack object
    NOT_MSGPACK = "not_msgpack"  # invalid msgpack (reserved byte, bad UTF-8, nesting too deep)
    BAD_SHAPE = "bad_shape"  # wrong container shape: arity, missing field, batch/event not array/map
    BAD_TYPE = "bad_type"  # a field has the wrong type
    BAD_VALUE = "bad_value"  # right type, impossible value (block_size <= 0, negative rank)
    BAD_HASH = "bad_hash"  # a block hash that is not i64, u64 or bin
    UNEXPECTED = "unexpected"  # a check missing in this module; the frame is dropped all the same


class MalformedFrame(Exception):
    """A frame or payload we cannot decode. ``reason`` is a ``MalformedReason``."""

    def __init__(self, reason: MalformedReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason


# ---------------------------------------------------------------------------------------------------
# Frames


def normalize_hash(x: object) -> int:
    """An engine block hash as u64: i64 two's complement, u64 as is, bytes by their last 8 bytes BE.

    Engines disagree on the representation (SGLang: signed i64; vLLM: u64, or the raw 32-byte digest
    with integer hashes disabled); as opaque IDs they only need one canonical form. Bytes shorter than
    8 are read as they are (zero-extended), as Dynamo does.
    """
    t = type(x)
    if t is int:
        if _I64_MIN <= x <= _U64_MASK:  # type: ignore[operator]
            return x & _U64_MASK  # type: ignore[operator]
        raise MalformedFrame(MalformedReason.BAD_HASH, "int hash outside the i64/u64 range")
    if t is bytes or t is bytearray:
        if x:
            return int.from_bytes(x[-8:], "big")  # type: ignore[index]
        raise MalformedFrame(MalformedReason.BAD_HASH, "empty bytes hash")
    raise MalformedFrame(MalformedReason.BAD_HASH, f"hash must be an int or bytes, not {t.__name__}")


def _seq(frame: bytes) -> int:
    if len(frame) != _SEQ_LEN:
        raise MalformedFrame(MalformedReason.BAD_SEQ, f"seq frame is {len(frame)} bytes, not 8")
    return int.from_bytes(frame, "big")


def parse_pub_message(frames: Sequence[bytes]) -> tuple[bytes, int, bytes]:
    """Split what a SUB socket received, ``[topic, seq (8 bytes BE), payload]``, into its parts.

    The payload is returned as given (no copy); decode it with ``decode_batch``.
    """
    if len(frames) != 3:
        raise MalformedFrame(MalformedReason.FRAME_COUNT, f"pub message has {len(frames)} frames, not 3")
    topic, seq, payload = frames
    return bytes(topic), _seq(seq), payload


def topic_matches(topic: bytes, prefix: bytes) -> bool:
    """ZMQ SUB semantics: ``topic`` matches when it starts with ``prefix`` (an empty prefix matches all).

    A plain prefix match is what lets SGLang's ``\\x00sgl-kv-epoch=...`` and ``\\x00sgl-kv-snapshot=...``
    suffixes through: they extend the configured topic.
    """
    return topic[: len(prefix)] == prefix


def parse_replay_reply(frames: Sequence[bytes]) -> tuple[int, bytes] | None:
    """One reply as a DEALER receives it from a replay ROUTER: ``(seq, payload)``, or None at the end.

    Two layouts exist (docs/kv-wire.md 1.1): ``[b"", seq, payload]`` (vLLM <= 0.25, older SGLang) and
    ``[b"", topic, seq, payload]`` (vLLM >= 0.26, SGLang 0.5.23). The end marker has seq 0xFF * 8 and
    an empty payload; either one alone also ends the stream (a payload is never empty).
    """
    n = len(frames)
    if n == 3:
        delim, seq_frame, payload = frames
    elif n == 4:
        delim, _topic, seq_frame, payload = frames
    else:
        raise MalformedFrame(MalformedReason.FRAME_COUNT, f"replay reply has {n} frames, not 3 or 4")
    if len(delim) != 0:
        raise MalformedFrame(MalformedReason.BAD_DELIMITER, "replay reply does not start with b''")
    seq = _seq(seq_frame)
    if seq == REPLAY_END_SEQ or len(payload) == 0:
        return None
    return seq, payload


# ---------------------------------------------------------------------------------------------------
# Payload


class _Ctx:
    """Per-payload limits and counters. Counters reach DecodeStats only if the whole batch decodes."""

    __slots__ = ("max_tokens", "unknown_fields", "unknown_tags")

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.unknown_fields = 0
        self.unknown_tags: list[str] = []


def _hashes(v: Any, ctx: _Ctx, name: str) -> tuple[int, ...]:
    if type(v) is not tuple:
        raise MalformedFrame(MalformedReason.BAD_TYPE, f"{name} must be an array")
    if len(v) > ctx.max_tokens:
        raise MalformedFrame(MalformedReason.TOO_LARGE, f"{name} has {len(v)} entries")
    if set(map(type, v)) <= _INT_ONLY:
        # msgpack ints are always within i64..u64, so only the sign needs fixing.
        if v and min(v) < 0:
            return tuple([h & _U64_MASK for h in v])
        return v
    return tuple(map(normalize_hash, v))


def _opt_hash(v: Any) -> int | None:
    if v is None:
        return None
    if type(v) is int:
        return v & _U64_MASK
    return normalize_hash(v)


def _tokens(v: Any, ctx: _Ctx) -> tuple[int, ...]:
    if type(v) is not tuple:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "token_ids must be an array")
    if len(v) > ctx.max_tokens:
        raise MalformedFrame(MalformedReason.TOO_LARGE, f"token_ids has {len(v)} entries")
    # One C-level pass. This also rejects SGLang EAGLE bigram pairs ([a, b] per token): we have no
    # field to mark them and reading them as plain tokens would index wrong content.
    if not set(map(type, v)) <= _INT_ONLY:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "token_ids must all be ints")
    return v


def _block_size(v: Any) -> int:
    if type(v) is not int:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "block_size must be an int")
    if v <= 0:
        raise MalformedFrame(MalformedReason.BAD_VALUE, "block_size must be positive")
    return v


def _opt_int(v: Any, name: str) -> int | None:
    if v is None or type(v) is int:
        return v
    raise MalformedFrame(MalformedReason.BAD_TYPE, f"{name} must be an int or nil")


def _opt_str(v: Any, name: str) -> str | None:
    if v is None or type(v) is str:
        return v
    raise MalformedFrame(MalformedReason.BAD_TYPE, f"{name} must be a string or nil")


def _freeze(v: Any, depth: int) -> Any:
    """Make a decoded value hashable: maps become tuples of (key, value) pairs, recursively."""
    if depth > _MAX_FREEZE_DEPTH:
        raise MalformedFrame(MalformedReason.BAD_SHAPE, "extra_keys nested too deeply")
    t = type(v)
    if t is tuple:
        return tuple([_freeze(x, depth + 1) for x in v])
    if t is dict:
        return tuple([(_freeze(k, depth + 1), _freeze(x, depth + 1)) for k, x in v.items()])
    return v


def _extra_keys(v: Any) -> tuple[Any, ...] | None:
    """vLLM's per-block extra keys: opaque values (normally tuples, None for a block without keys).

    ``unpackb(use_list=False)`` already made every array a tuple; only a map inside makes the value
    unhashable, which would break the frozen events, so that rare case is frozen explicitly.
    """
    if v is None:
        return None
    if type(v) is not tuple:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "extra_keys must be an array or nil")
    try:
        hash(v)
        return v
    except TypeError:
        pass
    frozen = _freeze(v, 0)
    try:
        hash(frozen)
    except TypeError:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "extra_keys holds an unhashable value") from None
    return frozen


_METADATA_KEYS = frozenset({"cache_salt"})


def _metadata_salt(meta: Any, ctx: _Ctx) -> str | None:
    """SGLang's ``BlockStoredWithMetadata`` map ``{"cache_salt": str}``."""
    if meta is None:
        return None
    if type(meta) is not dict:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "metadata must be a map")
    if not meta.keys() <= _METADATA_KEYS:
        ctx.unknown_fields += len(meta.keys() - _METADATA_KEYS)
    return _opt_str(meta.get("cache_salt"), "metadata.cache_salt")


# Positional layouts (docs/kv-wire.md 1.3): highest index we understand + 1; more is counted as unknown.
_STORED_ARRAY_FIELDS = 16  # tag + 15 fields in vLLM 0.33
_REMOVED_ARRAY_FIELDS = 6  # tag, block_hashes, medium, group_idx, locality, ownership


def _stored_array(ev: tuple, ctx: _Ctx) -> BlockStored:
    # [tag, block_hashes, parent, token_ids, block_size, lora_id, medium, lora_name | metadata,
    #  extra_keys, group_idx, kv_cache_spec_kind, sliding_window, locality, ownership, session_id,
    #  lookahead_token_ids]; the first vLLM release stopped at lora_id.
    n = len(ev)
    if n < 5:
        raise MalformedFrame(MalformedReason.BAD_SHAPE, f"BlockStored array has {n} elements")
    if n > _STORED_ARRAY_FIELDS:
        ctx.unknown_fields += n - _STORED_ARRAY_FIELDS
    lora_name = cache_salt = None
    if n > 7:
        # Index 7 is vLLM's lora_name, but SGLang's BlockStoredWithMetadata (same "BlockStored" tag)
        # puts its metadata map there instead; the type tells them apart.
        v7 = ev[7]
        if type(v7) is dict:
            cache_salt = _metadata_salt(v7, ctx)
        else:
            lora_name = _opt_str(v7, "lora_name")
    return BlockStored(
        block_hashes=_hashes(ev[1], ctx, "block_hashes"),
        parent_block_hash=_opt_hash(ev[2]),
        token_ids=_tokens(ev[3], ctx),
        block_size=_block_size(ev[4]),
        medium=_opt_str(ev[6], "medium") if n > 6 else None,
        lora_id=_opt_int(ev[5], "lora_id") if n > 5 else None,
        lora_name=lora_name,
        extra_keys=_extra_keys(ev[8]) if n > 8 else None,
        cache_salt=cache_salt,
        group_idx=_opt_int(ev[9], "group_idx") if n > 9 else None,
        kv_cache_spec_kind=_opt_str(ev[10], "kv_cache_spec_kind") if n > 10 else None,
    )


def _removed_array(ev: tuple, ctx: _Ctx) -> BlockRemoved:
    # [tag, block_hashes, medium, group_idx, locality, ownership]; the first release had only hashes.
    n = len(ev)
    if n < 2:
        raise MalformedFrame(MalformedReason.BAD_SHAPE, "BlockRemoved array has no block_hashes")
    if n > _REMOVED_ARRAY_FIELDS:
        ctx.unknown_fields += n - _REMOVED_ARRAY_FIELDS
    return BlockRemoved(
        block_hashes=_hashes(ev[1], ctx, "block_hashes"),
        medium=_opt_str(ev[2], "medium") if n > 2 else None,
        group_idx=_opt_int(ev[3], "group_idx") if n > 3 else None,
    )


_CLEARED = AllBlocksCleared()


def _cleared_array(ev: tuple, ctx: _Ctx) -> AllBlocksCleared:
    if len(ev) > 1:
        ctx.unknown_fields += len(ev) - 1
    return _CLEARED


# Map keys we read, plus those we know but deliberately do not carry (they are not "unknown").
_STORED_KEYS = frozenset(
    {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "cache_salt",  # SGLang 0.5.23
        "metadata",  # SGLang BlockStoredWithMetadata
        # known, not carried:
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    }
)
_REMOVED_KEYS = frozenset({"type", "block_hashes", "medium", "group_idx", "locality", "ownership"})
_CLEARED_KEYS = frozenset({"type"})


def _stored_map(ev: dict, ctx: _Ctx) -> BlockStored:
    if not ev.keys() <= _STORED_KEYS:
        ctx.unknown_fields += len(ev.keys() - _STORED_KEYS)
    try:
        hashes, tokens, block_size = ev["block_hashes"], ev["token_ids"], ev["block_size"]
    except KeyError:
        raise MalformedFrame(MalformedReason.BAD_SHAPE, "BlockStored map misses a required field") from None
    get = ev.get
    cache_salt = _opt_str(get("cache_salt"), "cache_salt")
    if cache_salt is None:
        cache_salt = _metadata_salt(get("metadata"), ctx)
    return BlockStored(
        block_hashes=_hashes(hashes, ctx, "block_hashes"),
        parent_block_hash=_opt_hash(get("parent_block_hash")),
        token_ids=_tokens(tokens, ctx),
        block_size=_block_size(block_size),
        medium=_opt_str(get("medium"), "medium"),
        lora_id=_opt_int(get("lora_id"), "lora_id"),
        lora_name=_opt_str(get("lora_name"), "lora_name"),
        extra_keys=_extra_keys(get("extra_keys")),
        cache_salt=cache_salt,
        group_idx=_opt_int(get("group_idx"), "group_idx"),
        kv_cache_spec_kind=_opt_str(get("kv_cache_spec_kind"), "kv_cache_spec_kind"),
    )


def _removed_map(ev: dict, ctx: _Ctx) -> BlockRemoved:
    if not ev.keys() <= _REMOVED_KEYS:
        ctx.unknown_fields += len(ev.keys() - _REMOVED_KEYS)
    try:
        hashes = ev["block_hashes"]
    except KeyError:
        raise MalformedFrame(MalformedReason.BAD_SHAPE, "BlockRemoved map misses block_hashes") from None
    return BlockRemoved(
        block_hashes=_hashes(hashes, ctx, "block_hashes"),
        medium=_opt_str(ev.get("medium"), "medium"),
        group_idx=_opt_int(ev.get("group_idx"), "group_idx"),
    )


def _cleared_map(ev: dict, ctx: _Ctx) -> AllBlocksCleared:
    if len(ev) > 1:
        ctx.unknown_fields += len(ev.keys() - _CLEARED_KEYS)
    return _CLEARED


_ARRAY_EVENTS = {
    "BlockStored": _stored_array,
    "BlockStoredWithMetadata": _stored_array,
    "BlockRemoved": _removed_array,
    "AllBlocksCleared": _cleared_array,
}
_MAP_EVENTS = {
    "BlockStored": _stored_map,
    "BlockStoredWithMetadata": _stored_map,
    "BlockRemoved": _removed_map,
    "AllBlocksCleared": _cleared_map,
}

_BATCH_MAP_KEYS = frozenset({"ts", "events", "data_parallel_rank", "attn_dp_rank"})


def _events(raw: Any, ctx: _Ctx) -> tuple[KVEvent, ...]:
    out: list[KVEvent] = []
    append = out.append
    for ev in raw:
        t = type(ev)
        if t is dict:
            tag = ev.get("type")
            parsers = _MAP_EVENTS
        elif t is tuple:
            if not ev:
                raise MalformedFrame(MalformedReason.BAD_SHAPE, "empty event array")
            tag = ev[0]
            parsers = _ARRAY_EVENTS
        else:
            raise MalformedFrame(MalformedReason.BAD_SHAPE, "event must be an array or a map")
        if type(tag) is not str:
            raise MalformedFrame(MalformedReason.BAD_TYPE, "event tag must be a string")
        parse = parsers.get(tag)
        if parse is None:
            ctx.unknown_tags.append(tag)
            continue
        append(parse(ev, ctx))
    return tuple(out)


def _ts(v: Any) -> float:
    t = type(v)
    if t is float:
        return v
    if t is int:
        return float(v)
    raise MalformedFrame(MalformedReason.BAD_TYPE, "ts must be a number")


def _rank(v: Any) -> int | None:
    if v is None:
        return None
    if type(v) is not int:
        raise MalformedFrame(MalformedReason.BAD_TYPE, "rank must be an int or nil")
    if v < 0:
        raise MalformedFrame(MalformedReason.BAD_VALUE, "rank must not be negative")
    return v


_EXCEEDS = re.compile(r"(\d+) exceeds (max_\w+)\((\d+)\)")


def _unpack_error(e: Exception, array_bound: int) -> MalformedFrame:
    """Classify msgpack's exceptions. Only runs on the error path."""
    if isinstance(e, msgpack.ExtraData):
        return MalformedFrame(MalformedReason.TRAILING_DATA, "bytes after the msgpack object")
    if isinstance(e, UnicodeDecodeError):
        return MalformedFrame(MalformedReason.NOT_MSGPACK, "string is not UTF-8")
    if isinstance(e, TypeError):  # e.g. a map key that is itself a map (unhashable)
        return MalformedFrame(MalformedReason.BAD_TYPE, "unhashable map key")
    msg = str(e)
    if "incomplete input" in msg:
        return MalformedFrame(MalformedReason.TRUNCATED, "msgpack ended early")
    m = _EXCEEDS.match(msg)
    if m:
        # Container bounds are capped at len(payload) (see decode_batch): over our own bound is "too
        # large", within it the payload simply cannot hold what the header declares.
        declared, which = int(m.group(1)), m.group(2)
        bound = {"max_array_len": array_bound, "max_map_len": _MAX_MAP}.get(which, 0)
        if declared > bound:
            return MalformedFrame(MalformedReason.TOO_LARGE, f"declared length over {which}")
        return MalformedFrame(MalformedReason.TRUNCATED, "declared length longer than the payload")
    return MalformedFrame(MalformedReason.NOT_MSGPACK, type(e).__name__)


def decode_batch(
    payload: bytes,
    stats: DecodeStats | None = None,
    *,
    max_bytes: int = 64 << 20,
    max_events: int = 1 << 20,
    max_tokens_per_event: int = 1 << 22,
) -> EventBatch:
    """Decode one msgpack batch payload (any dialect) into an ``EventBatch`` with u64 hashes.

    ``stats`` receives skipped unknown tags and unknown fields, only when the batch decodes.
    ``max_tokens_per_event`` also bounds the number of hashes in one event.
    Raises ``MalformedFrame`` for anything else; never another exception.
    """
    n = len(payload)
    if n > max_bytes:
        raise MalformedFrame(MalformedReason.TOO_LARGE, f"payload is {n} bytes")
    array_bound = max(max_events, max_tokens_per_event, _MIN_ARRAY)
    try:
        # msgpack preallocates arrays and maps from their headers, so their bounds are also capped at
        # the payload size (every element takes at least a byte): a forged 4G-element header costs
        # nothing. Strings and binaries are checked against the remaining input before allocation.
        obj = msgpack.unpackb(
            payload,
            raw=False,
            use_list=False,  # arrays as tuples: token_ids/extra_keys go into frozen events as they are
            strict_map_key=False,
            max_array_len=min(array_bound, n),
            max_map_len=min(_MAX_MAP, n),
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_BIN,
            max_ext_len=_MAX_EXT,
        )
    except Exception as e:
        raise _unpack_error(e, array_bound) from None

    ctx = _Ctx(max_tokens_per_event)
    try:
        t = type(obj)
        if t is tuple:
            size = len(obj)
            if size < 2:
                raise MalformedFrame(MalformedReason.BAD_SHAPE, f"batch array has {size} elements")
            if size > 3:
                ctx.unknown_fields += size - 3
            ts, raw_events = obj[0], obj[1]
            rank = obj[2] if size > 2 else None
        elif t is dict:
            # No release encodes a batch as a map, but one vLLM main commit would (docs/kv-wire.md 1.3).
            if not obj.keys() <= _BATCH_MAP_KEYS:
                ctx.unknown_fields += len(obj.keys() - _BATCH_MAP_KEYS)
            if "ts" not in obj or "events" not in obj:
                raise MalformedFrame(MalformedReason.BAD_SHAPE, "batch map misses ts or events")
            ts, raw_events = obj["ts"], obj["events"]
            rank = obj.get("data_parallel_rank")
            if rank is None:
                rank = obj.get("attn_dp_rank")
        else:
            raise MalformedFrame(MalformedReason.BAD_SHAPE, "batch must be an array or a map")
        if type(raw_events) is not tuple:
            raise MalformedFrame(MalformedReason.BAD_TYPE, "events must be an array")
        if len(raw_events) > max_events:
            raise MalformedFrame(MalformedReason.TOO_LARGE, f"batch has {len(raw_events)} events")
        batch = EventBatch(ts=_ts(ts), events=_events(raw_events, ctx), data_parallel_rank=_rank(rank))
    except MalformedFrame:
        raise
    except Exception as e:  # a check missing above; still never let it escape as another type
        raise MalformedFrame(MalformedReason.UNEXPECTED, type(e).__name__) from e

    if stats is not None:
        stats.unknown_fields += ctx.unknown_fields
        if ctx.unknown_tags:
            tags = stats.unknown_tags
            for tag in ctx.unknown_tags:
                key = tag[:_MAX_TAG_LEN]
                if key not in tags and len(tags) >= _MAX_TAG_NAMES:
                    key = _OTHER_TAG
                tags[key] = tags.get(key, 0) + 1
    return batch
