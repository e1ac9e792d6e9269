"""Property tests for the KV-event decoder: hostile input only ever yields MalformedFrame, and every
dialect's encoding of any valid batch decodes back to it.

Round trips compare modulo the fields a dialect cannot carry (``_project``):

- ``vllm-0.33``: BlockStored.cache_salt (vLLM carries a salt inside extra_keys instead);
- ``vllm-0.20``: BlockStored.cache_salt and kv_cache_spec_kind;
- ``sglang``: BlockStored.extra_keys, group_idx and kv_cache_spec_kind; BlockRemoved.group_idx.

A few fixed examples at the end pin shapes no vector shows (legacy SGLang arrays with metadata, map
batches, unknown tags and fields).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router_runtime.kv.decode import (
    MalformedFrame,
    MalformedReason,
    decode_batch,
    normalize_hash,
    parse_pub_message,
    parse_replay_reply,
    topic_matches,
)
from router_runtime.kv.encode import encode_batch, replay_end_frames, replay_reply_frames
from router_runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeStats,
    Dialect,
    EventBatch,
)

U64 = (1 << 64) - 1
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies ------------------------------------------------------------------------------------

hashes = st.integers(0, U64)
opt_str = st.none() | st.text(max_size=40)  # up to 40 so str8 (>= 32 bytes) is exercised
mediums = st.none() | st.sampled_from(["GPU", "CPU", "CPU_PINNED", "DISK", "STORAGE", "EXTERNAL"])
extra_key_part = st.one_of(
    st.text(max_size=8),
    st.integers(-(1 << 63), U64),
    st.binary(max_size=8),
    st.tuples(st.text(max_size=4), st.integers(0, 1 << 20)),
)
extra_keys = st.none() | st.lists(
    st.none() | st.lists(extra_key_part, max_size=3).map(tuple), max_size=4
).map(tuple)

block_stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, max_size=5).map(tuple),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, (1 << 32) - 1), max_size=40).map(tuple),
    block_size=st.integers(1, 1 << 16),
    medium=mediums,
    lora_id=st.none() | st.integers(0, (1 << 31) - 1),
    lora_name=opt_str,
    extra_keys=extra_keys,
    cache_salt=opt_str,
    group_idx=st.none() | st.integers(0, 64),
    kv_cache_spec_kind=st.none() | st.sampled_from(["full_attention", "sliding_window", "mamba"]),
)
block_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, max_size=5).map(tuple),
    medium=mediums,
    group_idx=st.none() | st.integers(0, 64),
)
events = st.one_of(block_stored, block_removed, st.just(AllBlocksCleared()))
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False),
    events=st.lists(events, max_size=6).map(tuple),
    data_parallel_rank=st.none() | st.integers(0, 1 << 16),
)
dialects = st.sampled_from(list(Dialect))

# Any msgpack-able value, to drop into a field.
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), U64),
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=40),
)
any_value = st.recursive(
    leaf,
    lambda kids: (
        st.lists(kids, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(-(1 << 63), U64), kids, max_size=4)
    ),
    max_leaves=12,
)


def _project(dialect: Dialect, batch: EventBatch) -> EventBatch:
    """``batch`` minus what ``dialect`` cannot carry (see the module docstring)."""

    def one(ev: Any) -> Any:
        if type(ev) is BlockStored:
            if dialect is Dialect.VLLM_033:
                return dataclasses.replace(ev, cache_salt=None)
            if dialect is Dialect.VLLM_020:
                return dataclasses.replace(ev, cache_salt=None, kv_cache_spec_kind=None)
            return dataclasses.replace(ev, extra_keys=None, group_idx=None, kv_cache_spec_kind=None)
        if type(ev) is BlockRemoved and dialect is Dialect.SGLANG:
            return dataclasses.replace(ev, group_idx=None)
        return ev

    return dataclasses.replace(batch, events=tuple(one(ev) for ev in batch.events))


def _assert_well_typed(batch: EventBatch) -> None:
    """What consumers rely on from any batch the decoder returns."""

    def opt(v: Any, t: type) -> None:
        assert v is None or type(v) is t

    def u64s(hs: Any) -> None:
        assert type(hs) is tuple and all(type(h) is int and 0 <= h <= U64 for h in hs)

    assert type(batch) is EventBatch and type(batch.ts) is float and type(batch.events) is tuple
    assert batch.data_parallel_rank is None or (
        type(batch.data_parallel_rank) is int and batch.data_parallel_rank >= 0
    )
    for ev in batch.events:
        if type(ev) is BlockStored:
            u64s(ev.block_hashes)
            assert ev.parent_block_hash is None or 0 <= ev.parent_block_hash <= U64
            assert type(ev.token_ids) is tuple and all(type(t) is int for t in ev.token_ids)
            assert type(ev.block_size) is int and ev.block_size > 0
            for name in ("medium", "lora_name", "cache_salt", "kv_cache_spec_kind"):
                opt(getattr(ev, name), str)
            opt(ev.lora_id, int)
            opt(ev.group_idx, int)
            opt(ev.extra_keys, tuple)
        elif type(ev) is BlockRemoved:
            u64s(ev.block_hashes)
            opt(ev.medium, str)
            opt(ev.group_idx, int)
        else:
            assert type(ev) is AllBlocksCleared
    hash(batch)  # frozen all the way down


def _decode_or_malformed(payload: bytes, **limits: int) -> EventBatch | MalformedFrame:
    """Decode; anything but MalformedFrame (or a check falling to UNEXPECTED) fails the test."""
    try:
        batch = decode_batch(payload, DecodeStats(), **limits)
    except MalformedFrame as e:
        assert isinstance(e.reason, MalformedReason)
        assert e.reason is not MalformedReason.UNEXPECTED, repr(e.__cause__)
        return e
    _assert_well_typed(batch)
    return batch


# --- (a) arbitrary bytes ---------------------------------------------------------------------------


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_raise_malformed(payload: bytes) -> None:
    _decode_or_malformed(payload)


@FUZZ
@given(dialects, batches, st.data())
def test_corrupted_bytes_only_raise_malformed(
    dialect: Dialect, batch: EventBatch, data: st.DataObject
) -> None:
    payload = bytearray(encode_batch(dialect, batch))
    for _ in range(data.draw(st.integers(1, 4))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_malformed(bytes(payload))


# --- (b) structured fuzz ---------------------------------------------------------------------------


@FUZZ
@given(dialects, batches, st.data())
def test_truncated_payload_is_truncated(dialect: Dialect, batch: EventBatch, data: st.DataObject) -> None:
    payload = encode_batch(dialect, batch)
    cut = data.draw(st.integers(0, len(payload) - 1))
    result = _decode_or_malformed(payload[:cut])
    # Every proper prefix of one msgpack object is incomplete.
    assert isinstance(result, MalformedFrame) and result.reason is MalformedReason.TRUNCATED
    assert isinstance(_decode_or_malformed(payload + b"\xc0"), MalformedFrame)


def _slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key-or-index) position in a decoded msgpack tree."""
    out: list[tuple[Any, Any]] = []
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            out.extend((node, i) for i in range(len(node)))
            stack.extend(node)
        elif isinstance(node, dict):
            out.extend((node, k) for k in node)
            stack.extend(node.values())
    return out


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dialects, batches, st.data())
def test_mutated_fields_only_raise_malformed(
    dialect: Dialect, batch: EventBatch, data: st.DataObject
) -> None:
    """Replace, delete or add one value anywhere in a valid batch: wrong types in every field,
    missing fields, short and long arrays, unknown keys and tags."""
    tree = msgpack.unpackb(encode_batch(dialect, batch), raw=False, strict_map_key=False)
    slots = _slots(tree)
    op = data.draw(st.sampled_from(["replace", "delete", "append", "root"]))
    if op == "root" or not slots:
        tree = data.draw(any_value)
    else:
        container, key = data.draw(st.sampled_from(slots))
        if op == "replace":
            container[key] = data.draw(any_value)
        elif op == "delete":
            del container[key]
        elif isinstance(container, list):
            container.append(data.draw(any_value))
        else:
            container[data.draw(st.text(max_size=20))] = data.draw(any_value)
    _decode_or_malformed(msgpack.packb(tree, use_bin_type=True))


_ABSURD_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G elements
    b"\xdc\xff\xff",  # array16 of 65535
    b"\xdf\xff\xff\xff\xff",  # map32
    b"\xdb\xff\xff\xff\xff",  # str32
    b"\xc6\xff\xff\xff\xff",  # bin32
    b"\xc9\xff\xff\xff\xff\x01",  # ext32
    b"\x91" * 3000,  # nesting deeper than msgpack's stack
]


@FUZZ
@given(dialects, batches, st.sampled_from(_ABSURD_HEADERS), st.data())
def test_absurd_lengths_only_raise_malformed(
    dialect: Dialect, batch: EventBatch, header: bytes, data: st.DataObject
) -> None:
    payload = encode_batch(dialect, batch)
    at = data.draw(st.integers(0, len(payload)))
    # Mostly malformed; spliced into the body of a number or string it can still parse.
    _decode_or_malformed(payload[:at] + header + payload[at:])
    # In place of the whole payload it never can.
    result = _decode_or_malformed(header + payload)
    assert isinstance(result, MalformedFrame)


@FUZZ
@given(dialects, batches, st.integers(0, 3), st.integers(0, 8))
def test_bounds_give_too_large(dialect: Dialect, batch: EventBatch, max_events: int, max_tokens: int) -> None:
    payload = encode_batch(dialect, batch)
    result = _decode_or_malformed(payload, max_events=max_events, max_tokens_per_event=max_tokens)
    over = len(batch.events) > max_events or any(
        len(getattr(ev, "token_ids", ())) > max_tokens or len(getattr(ev, "block_hashes", ())) > max_tokens
        for ev in batch.events
    )
    if over:
        assert isinstance(result, MalformedFrame) and result.reason is MalformedReason.TOO_LARGE
    else:
        assert result == _project(dialect, batch)
    small = _decode_or_malformed(payload, max_bytes=len(payload) - 1)
    assert isinstance(small, MalformedFrame) and small.reason is MalformedReason.TOO_LARGE


frames_lists = st.lists(st.binary(max_size=12), max_size=6)


@settings(max_examples=500, deadline=None)
@given(frames_lists)
def test_frame_parsers_only_raise_malformed(frames: list[bytes]) -> None:
    try:
        topic, seq, payload = parse_pub_message(frames)
    except MalformedFrame as e:
        assert len(frames) != 3 or len(frames[1]) != 8, e
    else:
        assert (topic, seq.to_bytes(8, "big"), payload) == tuple(frames)
    try:
        reply = parse_replay_reply(frames)
    except MalformedFrame as e:
        assert e.reason in {
            MalformedReason.FRAME_COUNT,
            MalformedReason.BAD_DELIMITER,
            MalformedReason.BAD_SEQ,
        }
    else:
        assert len(frames) in (3, 4) and frames[0] == b""
        if reply is not None:
            assert reply[1] == frames[-1] and reply[0].to_bytes(8, "big") == frames[-2]


# --- (c) round trip --------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(dialects, batches)
def test_round_trip_every_dialect(dialect: Dialect, batch: EventBatch) -> None:
    stats = DecodeStats()
    decoded = decode_batch(encode_batch(dialect, batch), stats)
    assert decoded == _project(dialect, batch)
    assert stats == DecodeStats()
    # The encoding is a fixed point: what a dialect carries, it re-renders identically.
    assert encode_batch(dialect, decoded) == encode_batch(dialect, batch)


@settings(max_examples=200, deadline=None)
@given(dialects, batches, st.integers(0, U64 - 1), st.binary(min_size=1, max_size=20))
def test_replay_frames_round_trip(dialect: Dialect, batch: EventBatch, seq: int, topic: bytes) -> None:
    payload = encode_batch(dialect, batch)
    assert parse_replay_reply(replay_reply_frames(dialect, topic, seq, payload)) == (seq, payload)
    assert parse_replay_reply(replay_end_frames(dialect)) is None


# --- fixed examples: shapes the vectors do not show ------------------------------------------------


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_legacy_sglang_arrays_with_metadata_and_signed_hashes() -> None:
    # Older SGLang: array events, [ts, events] without rank, BlockStoredWithMetadata sharing the
    # "BlockStored" tag with its metadata map where vLLM has lora_name.
    payload = _pack(
        [
            1.5,
            [
                ["BlockStored", [-1, 5], None, [1, 2, 3, 4], 2, None, "CPU_PINNED", {"cache_salt": "s"}],
                ["BlockStored", [7], -1, [5, 6], 2, None],
                ["BlockRemoved", [-1]],
                ["BlockStoredWithMetadata", [8], None, [9], 1, None, None, {"cache_salt": "t"}],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch == EventBatch(
        ts=1.5,
        events=(
            BlockStored((U64, 5), None, (1, 2, 3, 4), 2, medium="CPU_PINNED", cache_salt="s"),
            BlockStored((7,), U64, (5, 6), 2),
            BlockRemoved((U64,)),
            BlockStored((8,), None, (9,), 1, cache_salt="t"),
        ),
        data_parallel_rank=None,
    )


def test_map_batch_unknown_tags_and_fields_are_counted() -> None:
    payload = _pack(
        {
            "ts": 2,
            "events": [
                {"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1, "new": 1},
                {"type": "BlockMoved", "block_hashes": [1]},
                ["BlockRemoved", [1], "GPU", 0, "LOCAL", None, "future"],
                {"type": "AllBlocksCleared", "why": "reset"},
            ],
            "attn_dp_rank": 3,
            "future": True,
        }
    )
    stats = DecodeStats()
    batch = decode_batch(payload, stats)
    assert batch == EventBatch(
        ts=2.0,
        events=(BlockStored((1,), None, (1,), 1), BlockRemoved((1,), "GPU", 0), AllBlocksCleared()),
        data_parallel_rank=3,
    )
    assert stats.unknown_tags == {"BlockMoved": 1}
    assert stats.unknown_fields == 4  # "new", trailing "future", "why", batch "future"


def test_extra_keys_with_a_map_are_frozen() -> None:
    payload = _pack(
        [0.0, [["BlockStored", [1], None, [1], 1, None, None, None, [["mm", {"a": [1, 2]}], None]]], 0]
    )
    (ev,) = decode_batch(payload).events
    assert ev.extra_keys == (("mm", (("a", (1, 2)),)), None)
    hash(ev)


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        (
            [0.0, [["BlockStored", [1], None, [[1, 2], [3, 4]], 2, None]], 0],
            MalformedReason.BAD_TYPE,
        ),  # bigrams
        ([0.0, [["BlockStored", [1], None, [1], 0, None]], 0], MalformedReason.BAD_VALUE),
        ([0.0, [["BlockStored", [1], None, [1], True, None]], 0], MalformedReason.BAD_TYPE),
        ([0.0, [["BlockStored", [1.5], None, [1], 1, None]], 0], MalformedReason.BAD_HASH),
        ([0.0, [["BlockStored", [1], None, [1]]], 0], MalformedReason.BAD_SHAPE),
        ([0.0, [{"type": "BlockRemoved"}], 0], MalformedReason.BAD_SHAPE),
        ([0.0, [[]], 0], MalformedReason.BAD_SHAPE),
        ([0.0, [[7]], 0], MalformedReason.BAD_TYPE),
        ([0.0, [], -1], MalformedReason.BAD_VALUE),
        (["0", [], 0], MalformedReason.BAD_TYPE),
        ([0.0], MalformedReason.BAD_SHAPE),
        ({"ts": 0.0}, MalformedReason.BAD_SHAPE),
        (7, MalformedReason.BAD_SHAPE),
    ],
)
def test_malformed_examples(obj: Any, reason: MalformedReason) -> None:
    with pytest.raises(MalformedFrame) as info:
        decode_batch(_pack(obj))
    assert info.value.reason is reason


def test_msgpack_level_failures() -> None:
    for payload, reason in [
        (b"", MalformedReason.TRUNCATED),
        (b"\xc1", MalformedReason.NOT_MSGPACK),
        (b"\x90\x90", MalformedReason.TRAILING_DATA),
        (b"\x92\xa1\xff\x90", MalformedReason.NOT_MSGPACK),  # invalid UTF-8
        (b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", MalformedReason.TOO_LARGE),
        (b"\x93\xcb" + b"\x00" * 8 + b"\xdc\x01\x00", MalformedReason.TRUNCATED),
    ]:
        with pytest.raises(MalformedFrame) as info:
            decode_batch(payload)
        assert info.value.reason is reason, payload


def test_normalize_hash() -> None:
    assert normalize_hash(-1) == U64
    assert normalize_hash(-(1 << 63)) == 1 << 63
    assert normalize_hash(U64) == U64
    assert normalize_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")
    assert normalize_hash(b"\x01\x02") == 0x0102
    for bad in (1 << 64, -(1 << 63) - 1, True, 1.0, "1", None, b""):
        with pytest.raises(MalformedFrame) as info:
            normalize_hash(bad)
        assert info.value.reason is MalformedReason.BAD_HASH


def test_frames() -> None:
    assert parse_pub_message([b"t", b"\x00" * 7 + b"\x05", b"p"]) == (b"t", 5, b"p")
    with pytest.raises(MalformedFrame, match="bad_seq"):
        parse_pub_message([b"t", b"\x05", b"p"])
    with pytest.raises(MalformedFrame, match="frame_count"):
        parse_pub_message([b"t", b"p"])
    assert parse_replay_reply([b"", b"\x00" * 8, b"p"]) == (0, b"p")
    assert parse_replay_reply([b"", b"t", b"\x00" * 8, b"p"]) == (0, b"p")
    assert parse_replay_reply([b"", b"\xff" * 8, b""]) is None
    assert parse_replay_reply([b"", b"", b"\xff" * 8, b""]) is None
    with pytest.raises(MalformedFrame, match="bad_delimiter"):
        parse_replay_reply([b"x", b"\x00" * 8, b"p"])
    assert topic_matches(b"kv\x00sgl-kv-epoch=3", b"kv")
    assert topic_matches(b"anything", b"")
    assert not topic_matches(b"k", b"kv")
