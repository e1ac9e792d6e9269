"""The snapshot envelope and its vetting: a round trip grafts to an equal index; every malformed,
corrupt, oversized or foreign snapshot is refused before it can touch the index."""

from __future__ import annotations

import contextlib
import gzip
import random
import tracemalloc
import zlib
from dataclasses import replace as dataclasses_replace

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from router_runtime.bootstrap.vetting import HashingConfig, LocalWorker, VetError, VetFailed, vet
from router_runtime.bootstrap.wire import (
    FORMAT,
    FORMATS,
    LEGACY_FORMAT,
    Limits,
    WireError,
    WireSnapshot,
    WireWorker,
    decode,
    encode,
    inflate,
)
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.hashing import SCHEME
from router_runtime.kv.index import RadixIndex
from router_runtime.kv.snapshot import Exporter, Grafter, VettedColumns
from router_runtime.worker import Carrier

from .columns import arrays, edited

BS = 4
A, B = Carrier("http://a", 0), Carrier("http://b", 1)
HASHING = HashingConfig(BS, SCHEME)
LOCAL = {("http://a", 0): LocalWorker(A, "inc-a"), ("http://b", 1): LocalWorker(B, "inc-b")}


def warm_index(seed: int = 1, conversations: int = 40) -> RadixIndex:
    rng = random.Random(seed)
    index = RadixIndex(BS)
    system = [rng.randrange(1000) for _ in range(BS * 3)]
    h = 1
    for _ in range(conversations):
        carrier = rng.choice([A, B])
        toks = system + [rng.randrange(1000) for _ in range(BS * rng.randrange(1, 6))]
        n = len(toks) // BS
        hashes = tuple(range(h, h + n))
        h += n
        medium = rng.choice(["GPU", "GPU", "CPU"])
        index.apply_batch(
            carrier, EventBatch(0.0, (BlockStored(hashes, None, tuple(toks[: n * BS]), BS, medium),))
        )
    return index


def export(index: RadixIndex, fmt: int = FORMAT, **over) -> WireSnapshot:
    ex = Exporter(index)
    while not ex.step():
        pass
    incs = {A: "inc-a", B: "inc-b"}
    snap = WireSnapshot(
        format=fmt,
        producer_id="router-0",
        producer_incarnation="p1",
        producer_ready=True,
        block_size=BS,
        scheme=SCHEME,
        workers=[WireWorker(c.engine, c.rank, incs[c]) for c in ex.workers],
        cursors=[(i, 41) for i in range(len(ex.workers))],
        built_ms=1,
        columns=ex.columns,
    )
    for k, v in over.items():
        setattr(snap, k, v)
    return snap


def edit(snap: WireSnapshot, name: str, i: int, value: int) -> None:
    snap.columns = edited(snap.columns, name, i, value)


def graft(snapshot) -> RadixIndex:
    dst = RadixIndex(BS)
    g = Grafter(dst, snapshot.columns, snapshot.carriers)
    while not g.step():
        pass
    return dst


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_grafts_an_index_that_answers_like_the_source(fmt):
    src = warm_index()
    body = encode(export(src, fmt))
    if fmt == LEGACY_FORMAT:  # gzipped by the HTTP layer
        body = bytes(inflate(gzip.compress(body, compresslevel=1), Limits()))
    wire = decode(body, Limits())
    assert wire.format == fmt
    vetted = vet(wire, LOCAL, HASHING)
    dst = graft(vetted)
    assert vetted.cursors == {A: 41, B: 41}
    assert sorted((k, p, tuple(sorted(h.items()))) for k, p, h in dst.iter_nodes()) == sorted(
        (k, p, tuple(sorted(h.items()))) for k, p, h in src.iter_nodes()
    )
    for c in (A, B):
        assert dst.carrier_engine_hashes(c) == src.carrier_engine_hashes(c)


def test_unknown_workers_and_other_incarnations_are_dropped():
    src = warm_index()
    local = {("http://a", 0): LocalWorker(A, "inc-a"), ("http://b", 1): LocalWorker(B, "restarted")}
    vetted = vet(decode(encode(export(src)), Limits()), local, HASHING)
    dst = graft(vetted)
    assert dst.carrier_blocks(B) == dict.fromkeys(dst.carrier_blocks(B), 0)
    assert sum(dst.carrier_blocks(A).values()) == sum(src.carrier_blocks(A).values())
    with pytest.raises(VetFailed) as err:
        vet(decode(encode(export(src)), Limits()), {}, HASHING)
    assert err.value.error is VetError.NOTHING_USABLE and err.value.error.cold_peer


def test_unknown_tier_bits_are_dropped_not_folded():
    src = warm_index()
    snap = export(src)
    tiers = arrays(snap.columns)["tiers"]
    edit(snap, "tiers", 0, 0x10)  # a tier this build does not know
    edit(snap, "tiers", 1, tiers[1] | 0x20)
    vetted = arrays(vet(decode(encode(snap), Limits()), LOCAL, HASHING).columns)
    assert vetted["tiers"][1] == tiers[1]
    snap = vet(decode(encode(snap), Limits()), LOCAL, HASHING)
    assert snap.carriers[arrays(snap.columns)["worker"][0]] is None  # entry 0 has no known tier left


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda s: setattr(s, "producer_ready", False), VetError.PRODUCER_COLD),
        (lambda s: setattr(s, "block_size", BS * 2), VetError.HASHING_MISMATCH),
        (lambda s: setattr(s, "scheme", "sha256-chain"), VetError.HASHING_MISMATCH),
        (lambda s: edit(s, "parent", 0, 5), VetError.INVALID_PARENT),  # forward
        (lambda s: edit(s, "parent", 3, 3), VetError.INVALID_PARENT),  # self
        (lambda s: edit(s, "parent", 2, -7), VetError.INVALID_PARENT),  # out of range
        (lambda s: edit(s, "worker", 0, 99), VetError.WORKER_OUT_OF_RANGE),
        (lambda s: setattr(s, "cursors", []), VetError.NOTHING_USABLE),  # nothing proves continuity
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_vetting_refuses(mutate, error, fmt):
    snap = export(warm_index(), fmt)
    mutate(snap)
    bad = arrays(snap.columns)["parent"]
    if fmt == FORMAT and any(p < -1 or p == i for i, p in enumerate(bad)):
        pytest.skip("format 2 names a parent by its distance back: a self or negative one is not expressible")
    with pytest.raises(VetFailed) as err:
        vet(decode(encode(snap), Limits()), LOCAL, HASHING)
    assert err.value.error is error


def test_depth_is_bounded():
    with pytest.raises(VetFailed) as err:
        vet(decode(encode(export(warm_index())), Limits()), LOCAL, HASHING, Limits(max_depth=3))
    assert err.value.error is VetError.TOO_DEEP


def test_a_compression_bomb_costs_only_the_limit():
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
    assert len(bomb) < 100_000
    with pytest.raises(WireError) as err:
        inflate(bomb, Limits(max_bytes=1 << 20))
    assert err.value.kind == "too_large"


def zeros_bomb(mib: int) -> bytes:
    """``mib`` MiB of zeros, gzipped in constant memory (about 1 KiB per MiB)."""
    c = zlib.compressobj(9, zlib.DEFLATED, 31)
    zero = bytes(1 << 20)
    return b"".join([*(c.compress(zero) for _ in range(mib)), c.flush()])


def test_a_compression_bomb_is_refused_by_its_ratio_long_before_the_size_limit():
    """Under the production limit (1 GiB inflated), a 1 GiB bomb costs a few MiB: a snapshot inflates
    about 2.8x, so more than MAX_INFLATE_RATIO times what was read is refused as it happens."""
    bomb = zeros_bomb(1024)
    tracemalloc.start()
    try:
        with pytest.raises(WireError) as err:
            inflate(bomb, Limits())
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.kind == "too_large" and "32x" in str(err.value)
    assert peak < 16 << 20, peak


def test_a_large_honest_body_inflates_whole_across_many_steps():
    # 19 MiB that compress about 3x, like a snapshot: many 1 MiB input and 4 MiB output steps
    rng = random.Random(5)
    body = b"".join(rng.randbytes(1 << 16) + bytes(2 << 16) for _ in range(100))
    packed = gzip.compress(body, compresslevel=1)
    assert len(packed) > 4 << 20
    assert inflate(packed, Limits()) == body


@pytest.mark.parametrize("fmt", FORMATS)
def test_corruption_and_truncation_are_refused(fmt):
    body = encode(export(warm_index(), fmt))
    flipped = bytearray(body)
    flipped[len(body) // 2] ^= 0x40
    with pytest.raises(WireError) as err:
        decode(bytes(flipped), Limits())
    assert err.value.kind in ("checksum", "malformed")
    with pytest.raises(WireError):
        decode(body[: len(body) // 2], Limits())
    with pytest.raises(WireError) as err:
        inflate(gzip.compress(body)[:-20], Limits())
    assert err.value.kind == "truncated"
    with pytest.raises(WireError) as err:
        decode(body, Limits(max_records=3))
    assert err.value.kind == "too_large"
    if fmt == FORMAT:
        with pytest.raises(WireError) as err:
            decode(body[:-1], Limits())
        assert err.value.kind == "truncated"


def test_the_vetted_type_cannot_be_built_outside_vetting():
    from router_runtime.bootstrap.vetting import VettedSnapshot

    with pytest.raises(TypeError):
        VettedSnapshot(
            object(), columns=None, carriers=[], cursors={}, built_ms=0, producer_id="", usable_entries=1
        )
    # In the core too: vetted columns have no constructor, and a grafter takes nothing else.
    with pytest.raises(TypeError):
        VettedColumns()
    with pytest.raises(TypeError):
        Grafter(RadixIndex(BS), export(warm_index()).columns, [A, B])


def test_vetted_columns_graft_once():
    vetted = vet(decode(encode(export(warm_index())), Limits()), LOCAL, HASHING)
    graft(vetted)
    with pytest.raises(ValueError, match="grafted already"):
        graft(vetted)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=64)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=20,
)
FIELDS = [
    "format",
    "producer",
    "producer_ready",
    "hashing",
    "workers",
    "cursors",
    "built_ms",
    "records",
    "parent",
    "key",
    "ncar",
    "worker",
    "tiers",
    "hash",
]


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2000), st.dictionaries(st.sampled_from(FIELDS), msgpack_values), st.data())
def test_arbitrary_input_only_ever_raises_wire_errors(data, fields, draw):
    with contextlib.suppress(WireError):
        decode(data, Limits())
    # A well-checksummed body with arbitrary field values: the checksum passes, the shape does not.
    legacy = encode(export(warm_index(conversations=3), LEGACY_FORMAT))
    good = msgpack.unpackb(msgpack.unpackb(legacy)["body"])
    good.update(fields)
    body = msgpack.packb(good)
    envelope = msgpack.packb({"format": 1, "body": body, "checksum": xxhash.xxh3_128_digest(body)})
    try:
        snap = decode(envelope, Limits())
    except WireError:
        return
    with contextlib.suppress(VetFailed):
        vet(snap, LOCAL, HASHING)


META_FIELDS = [f for f in FIELDS if f not in ("records", "parent", "key", "ncar", "worker", "tiers", "hash")]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*META_FIELDS, "sessions"]), msgpack_values), st.binary(max_size=64))
def test_a_format_2_envelope_with_arbitrary_metadata_only_ever_raises_wire_errors(fields, junk):
    """The core checks the frame and the columns; the metadata map is the shell's to check."""
    import routerfleet_index

    snap = export(warm_index(conversations=3))
    good = msgpack.unpackb(msgpack.unpackb(encode(dataclasses_replace(snap, format=LEGACY_FORMAT)))["body"])
    meta = {k: v for k, v in good.items() if k in META_FIELDS} | fields
    for envelope in (
        routerfleet_index.encode_snapshot(msgpack.packb(meta), snap.columns),
        routerfleet_index.encode_snapshot(junk, snap.columns),
    ):
        try:
            wire = decode(envelope, Limits())
        except WireError:
            continue
        with contextlib.suppress(VetFailed):
            vet(wire, LOCAL, HASHING)
