"""The decoder and encoders against the golden wire vectors recorded from the engines' own publishers.

Each vector line (``tests/data/vectors/*.jsonl``, described in its README) is a frame captured from the
``kv_events.py`` of vLLM 0.20.0, vLLM 0.33.0 or SGLang 0.5.23, plus ``scripted``: the repr of the batch
the publisher was given. We build our expected ``EventBatch`` from that repr and require:

- every pub frame and every replay reply decodes to exactly it (rank and seq included);
- ``encode_batch`` re-renders it byte for byte (the fake engine speaks the real wire), except for the
  one batch whose hash is a raw 32-byte digest: normalizing keeps only its last 8 bytes, so there we
  require exactly that substitution;
- ``replay_reply_frames`` / ``replay_end_frames`` rebuild the recorded replay replies.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest

from router_runtime.kv.decode import (
    decode_batch,
    normalize_hash,
    parse_pub_message,
    parse_replay_reply,
    topic_matches,
)
from router_runtime.kv.encode import encode_batch, pub_frames, replay_end_frames, replay_reply_frames
from router_runtime.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeStats,
    Dialect,
    EventBatch,
)

# Checked in with the tests: tests/data/vectors.
VECTORS_DIR = Path(__file__).resolve().parent / "data" / "vectors"
DIALECTS = {
    "vllm-0.33.0": Dialect.VLLM_033,
    "vllm-0.20.0": Dialect.VLLM_020,
    "sglang-0.5.23": Dialect.SGLANG,
}
TOPIC = b"kv-topic"

# Publisher-side fields that our events deliberately do not carry; the scripted batches leave them
# unset, and we check that, so a vector exercising one of them cannot pass unnoticed.
_UNCARRIED = {"kv_cache_spec_sliding_window", "locality", "ownership", "session_id", "lookahead_token_ids"}


def _load(source: str) -> list[dict[str, Any]]:
    path = VECTORS_DIR / f"{source}.jsonl"
    if not path.is_file():
        pytest.fail(
            f"golden vectors missing: {path} (expected in tests/data/vectors)",
            pytrace=False,
        )
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- expected batches from the scripted repr -------------------------------------------------------


def _opt_hash(h: Any) -> int | None:
    return None if h is None else normalize_hash(h)


def _block_stored(**kw: Any) -> BlockStored:
    for name in _UNCARRIED:
        assert kw.pop(name, None) is None, f"vector sets {name}, which BlockStored does not carry"
    extra = kw.pop("extra_keys", None)
    out = BlockStored(
        block_hashes=tuple(normalize_hash(h) for h in kw.pop("block_hashes")),
        parent_block_hash=_opt_hash(kw.pop("parent_block_hash")),
        token_ids=tuple(kw.pop("token_ids")),
        block_size=kw.pop("block_size"),
        medium=kw.pop("medium", None),
        lora_id=kw.pop("lora_id", None),
        lora_name=kw.pop("lora_name", None),
        extra_keys=None if extra is None else tuple(tuple(k) for k in extra),
        cache_salt=kw.pop("cache_salt", None),
        group_idx=kw.pop("group_idx", None),
        kv_cache_spec_kind=kw.pop("kv_cache_spec_kind", None),
    )
    assert not kw, f"unexpected BlockStored fields in a vector: {sorted(kw)}"
    return out


def _block_removed(**kw: Any) -> BlockRemoved:
    for name in _UNCARRIED:
        assert kw.pop(name, None) is None, f"vector sets {name}, which BlockRemoved does not carry"
    out = BlockRemoved(
        block_hashes=tuple(normalize_hash(h) for h in kw.pop("block_hashes")),
        medium=kw.pop("medium", None),
        group_idx=kw.pop("group_idx", None),
    )
    assert not kw, f"unexpected BlockRemoved fields in a vector: {sorted(kw)}"
    return out


def _kv_event_batch(ts: float, events: list, data_parallel_rank: int | None = None, **kw: Any) -> EventBatch:
    rank = kw.pop("attn_dp_rank", data_parallel_rank)  # SGLang's name for the same slot
    assert not kw, f"unexpected KVEventBatch fields in a vector: {sorted(kw)}"
    return EventBatch(ts=ts, events=tuple(events), data_parallel_rank=rank)


_FACTORIES = {
    "KVEventBatch": _kv_event_batch,
    "BlockStored": _block_stored,
    "BlockRemoved": _block_removed,
    "AllBlocksCleared": AllBlocksCleared,
}


def _build(node: ast.expr) -> Any:
    """Evaluate the repr without eval(): calls to the known classes, list/tuple displays, literals."""
    if isinstance(node, ast.Call):
        assert isinstance(node.func, ast.Name) and node.func.id in _FACTORIES, ast.dump(node.func)
        args = [_build(a) for a in node.args]
        kwargs = {k.arg: _build(k.value) for k in node.keywords}
        return _FACTORIES[node.func.id](*args, **kwargs)
    if isinstance(node, ast.List):
        return [_build(e) for e in node.elts]
    if isinstance(node, ast.Tuple):
        return tuple(_build(e) for e in node.elts)
    return ast.literal_eval(node)


def expected_batch(scripted: str) -> EventBatch:
    return _build(ast.parse(scripted, mode="eval").body)


def _raw_bytes_hashes(scripted: str) -> list[bytes]:
    """Digests sent as raw bin (integer block hashes disabled in vLLM)."""
    found: list[bytes] = []
    for node in ast.walk(ast.parse(scripted, mode="eval")):
        if isinstance(node, ast.Constant) and isinstance(node.value, bytes):
            found.append(node.value)
    return found


# --- cases -----------------------------------------------------------------------------------------


def _pub_cases() -> list[Any]:
    return [
        pytest.param(source, v, id=f"{source}-r{v['rank']}-s{v['step']}")
        for source in DIALECTS
        for v in _load(source)
        if v["socket"] == "pub"
    ]


def _replay_cases() -> list[Any]:
    return [
        pytest.param(source, v, id=f"{source}-r{v['rank']}")
        for source in DIALECTS
        for v in _load(source)
        if v["socket"] == "replay"
    ]


def _expected_by_seq(source: str, rank: int) -> dict[int, tuple[EventBatch, bytes]]:
    out = {}
    for v in _load(source):
        if v["socket"] == "pub" and v["rank"] == rank:
            out[v["step"]] = (expected_batch(v["scripted"]), bytes.fromhex(v["frames_hex"][2]))
    return out


def test_every_source_has_pub_and_replay_vectors() -> None:
    for source in DIALECTS:
        sockets = {v["socket"] for v in _load(source)}
        assert sockets == {"pub", "replay"}, source


@pytest.mark.parametrize(("source", "vector"), _pub_cases())
def test_pub_frame_decodes_to_scripted_batch(source: str, vector: dict[str, Any]) -> None:
    frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
    topic, seq, payload = parse_pub_message(frames)
    assert topic == TOPIC and topic_matches(topic, TOPIC)
    assert seq == vector["step"]
    assert pub_frames(topic, seq, payload) == frames

    stats = DecodeStats()
    batch = decode_batch(payload, stats)
    expected = expected_batch(vector["scripted"])
    assert batch == expected
    assert batch.data_parallel_rank == vector["rank"]
    assert stats == DecodeStats()  # the vectors hold nothing we do not know
    hash(batch)  # frozen all the way down (extra_keys included)


@pytest.mark.parametrize(("source", "vector"), _pub_cases())
def test_pub_frame_reencodes_byte_identical(source: str, vector: dict[str, Any]) -> None:
    frames = [bytes.fromhex(h) for h in vector["frames_hex"]]
    payload = frames[2]
    batch = decode_batch(payload)
    encoded = encode_batch(DIALECTS[source], batch)

    recorded = payload
    for digest in _raw_bytes_hashes(vector["scripted"]):
        # A 32-byte bin hash normalizes to its last 8 bytes; re-encoding writes that u64 instead.
        recorded = recorded.replace(
            msgpack.packb(digest, use_bin_type=True), msgpack.packb(normalize_hash(digest))
        )
    assert encoded == recorded
    assert decode_batch(encoded) == batch


def test_raw_bytes_hash_vectors_exist() -> None:
    """The exemption above must stay narrow: exactly the bytes-hash batches, one per rank and vLLM."""
    exempt = [
        (source, v["rank"], v["step"])
        for source in DIALECTS
        for v in _load(source)
        if v["socket"] == "pub" and _raw_bytes_hashes(v["scripted"])
    ]
    assert sorted(exempt) == sorted(
        (source, rank, 2) for source in ("vllm-0.33.0", "vllm-0.20.0") for rank in (0, 1)
    )


@pytest.mark.parametrize(("source", "vector"), _replay_cases())
def test_replay_replies(source: str, vector: dict[str, Any]) -> None:
    dialect = DIALECTS[source]
    request = [bytes.fromhex(h) for h in vector["request_hex"]]
    assert request[0] == b"" and len(request[1]) == 8
    start = int.from_bytes(request[1], "big")
    by_seq = _expected_by_seq(source, vector["rank"])

    replies = [[bytes.fromhex(h) for h in reply] for reply in vector["replies_hex"]]
    *data, end = replies
    assert parse_replay_reply(end) is None
    assert end == replay_end_frames(dialect)

    seqs = []
    for reply in data:
        parsed = parse_replay_reply(reply)
        assert parsed is not None
        seq, payload = parsed
        seqs.append(seq)
        expected, pub_payload = by_seq[seq]
        assert payload == pub_payload  # replay serves the very bytes that were published
        assert decode_batch(payload) == expected
        assert expected.data_parallel_rank == vector["rank"]
        assert reply == replay_reply_frames(dialect, TOPIC, seq, payload)
    # Everything buffered from the start seq on, in order.
    assert seqs == list(range(start, max(by_seq) + 1))
