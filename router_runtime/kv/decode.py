"""Decode KV-event frames from every engine dialect.

The frames (the multipart messages of the PUB and replay sockets) are split here; the payloads are
decoded by the native core (``native/src/decode.rs``), straight from their msgpack bytes into a
``routerfleet_index.Batch`` the index applies without a Python object per event. ``decode`` is that
hot path; ``decode_batch`` also turns the batch into the typed events of ``events.py``, for tests and
tools.

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
missing in the core (the frame is still dropped safely).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import msgpack
import routerfleet_index

from router_runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeStats,
    EventBatch,
)

__all__ = [
    "REPLAY_END_SEQ",
    "MalformedFrame",
    "MalformedReason",
    "decode",
    "decode_batch",
    "normalize_hash",
    "parse_pub_message",
    "parse_replay_reply",
    "topic_matches",
]

_SEQ_LEN = 8
REPLAY_END_SEQ = (1 << 64) - 1  # the replay end marker's seq frame is 0xFF * 8

# Distinct unknown tag names kept in DecodeStats; tags come off the wire, so the map must not grow
# without bound (the core already cuts each name to 64 characters).
_MAX_TAG_NAMES = 32
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
    UNEXPECTED = "unexpected"  # a check missing in the core; the frame is dropped all the same


class MalformedFrame(Exception):
    """A frame or payload we cannot decode. ``reason`` is a ``MalformedReason``."""

    def __init__(self, reason: MalformedReason, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else str(reason))
        self.reason = reason


def _malformed(e: routerfleet_index.DecodeError) -> MalformedFrame:
    reason, detail = e.args
    return MalformedFrame(MalformedReason(reason), detail)


def normalize_hash(x: object) -> int:
    """An engine block hash as u64: i64 two's complement, u64 as is, bytes by their last 8 bytes BE.

    Engines disagree on the representation (SGLang: signed i64; vLLM: u64, or the raw 32-byte digest
    with integer hashes disabled); as opaque IDs they only need one canonical form. Bytes shorter than
    8 are read as they are (zero-extended), as Dynamo does. The core's rule, the one the decoder uses.
    """
    try:
        return routerfleet_index.normalize_hash(x)
    except routerfleet_index.DecodeError as e:
        raise _malformed(e) from None


# ---------------------------------------------------------------------------------------------------
# Frames


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


def decode(
    payload: bytes,
    stats: DecodeStats | None = None,
    *,
    max_bytes: int = 64 << 20,
    max_events: int = 1 << 20,
    max_tokens_per_event: int = 1 << 22,
) -> routerfleet_index.Batch:
    """Decode one msgpack batch payload (any dialect) into a native batch with u64 hashes.

    ``stats`` receives skipped unknown tags and unknown fields, only when the batch decodes.
    ``max_tokens_per_event`` also bounds the number of hashes in one event.
    Raises ``MalformedFrame`` for anything else; never another exception.
    """
    try:
        batch = routerfleet_index.decode_batch(payload, max_bytes, max_events, max_tokens_per_event)
    except routerfleet_index.DecodeError as e:
        raise _malformed(e) from None
    if stats is not None:
        stats.unknown_fields += batch.unknown_fields
        tags = stats.unknown_tags
        for tag in batch.unknown_tags:
            key = tag if tag in tags or len(tags) < _MAX_TAG_NAMES else _OTHER_TAG
            tags[key] = tags.get(key, 0) + 1
    return batch


def _unpack_extra(data: bytes) -> object:
    return msgpack.unpackb(data, use_list=False, strict_map_key=False)


def to_event_batch(batch: routerfleet_index.Batch) -> EventBatch:
    """A native batch as the typed events of ``events.py``."""
    events = batch.to_events(BlockStored, BlockRemoved, AllBlocksCleared, _unpack_extra)
    return EventBatch(ts=batch.ts, events=tuple(events), data_parallel_rank=batch.data_parallel_rank)


def decode_batch(
    payload: bytes,
    stats: DecodeStats | None = None,
    *,
    max_bytes: int = 64 << 20,
    max_events: int = 1 << 20,
    max_tokens_per_event: int = 1 << 22,
) -> EventBatch:
    """``decode``, as typed events (for tests and tools; the router applies ``decode``'s batch)."""
    return to_event_batch(
        decode(
            payload,
            stats,
            max_bytes=max_bytes,
            max_events=max_events,
            max_tokens_per_event=max_tokens_per_event,
        )
    )
