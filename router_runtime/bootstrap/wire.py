"""The peer snapshot envelope: versioned, binary, checksummed, bounded while reading.

Two formats. Format 2 (``native/src/envelope.rs``) is what routers of this version exchange: the
metadata below as one msgpack map, then the node columns framed, checksummed and (for the columns
that compress) LZ4-packed by the core with the GIL released; a consumer asks for it with
``?format=2``. Format 1 is the previous version's, still served to a consumer that does not ask
(a sibling of the old version during a rollout or a rollback) and still read from a producer that
does not offer format 2; it is slower (gzip over digests that do not compress) but says the same.

Format 1's outer frame: ``msgpack({"format": 1, "body": bin, "checksum": bin16})``, the checksum
being xxh3-128 of ``body``, so corruption is caught before the body is even unpacked. The body is a
msgpack map (format 2's metadata map holds the same fields, without ``records`` and the columns):

- ``producer``: ``{"id", "incarnation"}``, who built it (a pod name and a per-process id);
- ``producer_ready``: the producer's tree is non-empty, its hashing configuration is set and its own
  bootstrap has settled; a consumer never grafts from a producer that is not ready;
- ``hashing``: ``{"block_size", "scheme"}``, read by the producer as one value;
- ``workers``: ``[[engine, rank, incarnation], ...]``; ``cursors``: ``[[worker, last_seq], ...]``;
- ``built_ms``: when the producer stamped the build (before it read the cursors);
- ``records`` and the node columns as little-endian arrays: ``parent`` (i64), ``key`` (u64),
  ``ncar`` (u16), and per carrier entry ``worker`` (u32), ``tiers`` (u8), ``hash`` (u64).
  Columnar arrays keep encoding and decoding at C speed for trees of millions of nodes.
- ``sessions`` (optional; absent from older producers): the producer's session-affinity table, columnar
  too: ``targets`` ``[[engine, rank (-1: whole engine), incarnation], ...]``, ``digest`` (32 bytes per
  entry: the SHA-256 session digest, never a raw key), ``target`` (u32 index into ``targets``) and
  ``age_ms`` (u32) per entry. Vetted apart from the tree (``vetting.vet_sessions``).
- ``responses`` (optional; absent from older producers): the producer's response bindings (which engine
  holds a stored Responses API response), in the same columnar shape, each ``digest`` the SHA-256 of a
  response id. Vetted as the sessions are.

Format 1's compression is the HTTP layer's (gzip when the client accepts it); ``inflate`` bounds it.
"""

from __future__ import annotations

import enum
import sys
import zlib
from array import array
from dataclasses import dataclass, field

import msgpack
import routerfleet_index
import xxhash

from ..kv.snapshot import Columns

FORMAT = 2  # what this version builds and asks for
LEGACY_FORMAT = 1
FORMATS = (LEGACY_FORMAT, FORMAT)
# Media types of the two formats' bodies (format 1's is plain msgpack).
CONTENT_TYPE = {LEGACY_FORMAT: "application/x-msgpack", FORMAT: "application/vnd.routerfleet.kv-snapshot.v2"}


class WireErrorKind(enum.StrEnum):
    MALFORMED = "malformed"
    TRUNCATED = "truncated"
    TOO_LARGE = "too_large"
    CHECKSUM = "checksum"
    UNKNOWN_FORMAT = "unknown_format"


class WireError(Exception):
    """The body is not a well-formed snapshot. ``kind`` is a metric label; messages carry no data."""

    def __init__(self, kind: WireErrorKind, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Limits:
    """Every bound a reader enforces before it allocates for what a peer claims."""

    max_bytes: int = 1 << 30  # inflated envelope
    max_records: int = 20_000_000
    max_carrier_entries: int = 80_000_000
    max_workers: int = 65_536
    max_depth: int = 1_000_000
    max_sessions: int = 1_000_000
    max_meta_bytes: int = 256 << 20  # format 2's metadata map (workers, cursors, sessions)


@dataclass(frozen=True, slots=True)
class WireWorker:
    engine: str
    rank: int
    incarnation: str


@dataclass(frozen=True, slots=True)
class WireSession:
    """One remembered session: its digest, the engine (and DP rank) that served it, and how long ago."""

    digest: bytes  # 32 bytes
    engine: str
    rank: int | None
    incarnation: str
    age_ms: int


SESSION_DIGEST_BYTES = 32
_U32_MAX = 2**32 - 1


@dataclass(slots=True)
class WireSnapshot:
    """A decoded envelope: well-formed, NOT trusted. Only ``vetting.vet`` turns it into something that
    can touch the index."""

    format: int
    producer_id: str
    producer_incarnation: str
    producer_ready: bool
    block_size: int
    scheme: str
    workers: list[WireWorker]
    cursors: list[tuple[int, int]]
    built_ms: int
    columns: Columns = field(default_factory=Columns)
    sessions: list[WireSession] = field(default_factory=list)
    responses: list[WireSession] = field(default_factory=list)  # response bindings, same shape


def _le(a: array) -> bytes:
    if sys.byteorder == "big":
        a = array(a.typecode, a)
        a.byteswap()
    return a.tobytes()


def _meta(snap: WireSnapshot) -> dict:
    fields = {
        "format": snap.format,
        "producer": {"id": snap.producer_id, "incarnation": snap.producer_incarnation},
        "producer_ready": snap.producer_ready,
        "hashing": {"block_size": snap.block_size, "scheme": snap.scheme},
        "workers": [[w.engine, w.rank, w.incarnation] for w in snap.workers],
        "cursors": [list(c) for c in snap.cursors],
        "built_ms": snap.built_ms,
    }
    if snap.sessions:
        fields["sessions"] = _encode_sessions(snap.sessions)
    if snap.responses:
        fields["responses"] = _encode_sessions(snap.responses)
    return fields


def _from_le(typecode: str, data: object, count: int, name: str) -> array:
    if not isinstance(data, bytes):
        raise WireError(WireErrorKind.MALFORMED, f"{name} is not bytes")
    a = array(typecode)
    if len(data) != count * a.itemsize:
        raise WireError(WireErrorKind.MALFORMED, f"{name} has {len(data)} bytes for {count} entries")
    a.frombytes(data)
    if sys.byteorder == "big":
        a.byteswap()
    return a


def encode(snap: WireSnapshot) -> bytes:
    """The envelope in ``snap.format``. Format 2 is built by the core, off the GIL: call it off the loop
    for a large tree all the same (the caller's executor), as the columns' size is unbounded."""
    if snap.format == FORMAT:
        return routerfleet_index.encode_snapshot(msgpack.packb(_meta(snap), use_bin_type=True), snap.columns)
    if snap.format != LEGACY_FORMAT:
        raise ValueError(f"no encoder for snapshot format {snap.format}")
    parent, key, ncar, worker, tiers, hashes = snap.columns.le()
    fields = _meta(snap)
    fields |= {
        "records": len(snap.columns),
        "parent": parent,
        "key": key,
        "ncar": ncar,
        "worker": worker,
        "tiers": tiers,
        "hash": hashes,
    }
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb(
        {"format": LEGACY_FORMAT, "body": body, "checksum": xxhash.xxh3_128_digest(body)}, use_bin_type=True
    )


def _encode_sessions(sessions: list[WireSession]) -> dict:
    table: dict[tuple[str, int, str], int] = {}
    idx = array("I")
    ages = array("I")
    digests = bytearray()
    for e in sessions:
        if len(e.digest) != SESSION_DIGEST_BYTES:
            raise ValueError("a session digest is 32 bytes")
        key = (e.engine, -1 if e.rank is None else e.rank, e.incarnation)
        idx.append(table.setdefault(key, len(table)))
        ages.append(min(max(e.age_ms, 0), _U32_MAX))
        digests += e.digest
    return {
        "targets": [list(k) for k in table],
        "digest": bytes(digests),
        "target": _le(idx),
        "age_ms": _le(ages),
    }


def _sessions(s: object, limits: Limits) -> list[WireSession]:
    if s is None:
        return []
    if not isinstance(s, dict):
        raise WireError(WireErrorKind.MALFORMED, "sessions is not a map")
    targets = []
    for t in s["targets"]:
        if not isinstance(t, list) or len(t) != 3:
            raise WireError(WireErrorKind.MALFORMED, "session target entry")
        rank = _int(t[1], "session rank", -1, 1 << 16)
        targets.append((_str(t[0], "session engine"), None if rank < 0 else rank, _str(t[2], "session inc")))
    digests = s["digest"]
    if not isinstance(digests, bytes) or len(digests) % SESSION_DIGEST_BYTES:
        raise WireError(WireErrorKind.MALFORMED, "session digests")
    n = len(digests) // SESSION_DIGEST_BYTES
    if n > limits.max_sessions:
        raise WireError(WireErrorKind.TOO_LARGE, "session count over the limit")
    idx = _from_le("I", s["target"], n, "session target")
    ages = _from_le("I", s["age_ms"], n, "session age_ms")
    if n and max(idx) >= len(targets):
        raise WireError(WireErrorKind.MALFORMED, "session target out of range")
    out = []
    for i in range(n):
        engine, rank, inc = targets[idx[i]]
        out.append(WireSession(digests[32 * i : 32 * i + 32], engine, rank, inc, ages[i]))
    return out


# A snapshot is mostly hashes and keys, which do not compress: measured 2.8x at level 1 whatever the
# fleet's size (bench/snapshot.py). A body that inflates far more than that is a compression bomb, and
# is refused after a few MiB instead of after ``max_bytes``.
MAX_INFLATE_RATIO = 32
_IN_CHUNK, _OUT_CHUNK = 1 << 20, 4 << 20


def inflate(data: bytes, limits: Limits) -> bytearray:
    """Gunzip in bounded steps: at most ``max_bytes`` out, and never more than MAX_INFLATE_RATIO times
    what was consumed (plus one step), so a compression bomb costs a few MiB, not ``max_bytes``."""
    d = zlib.decompressobj(wbits=31)
    out = bytearray()
    view = memoryview(data)

    def take(chunk: bytes | memoryview, consumed_before: int) -> bytes:
        out.extend(d.decompress(chunk, _OUT_CHUNK))
        rest = d.unconsumed_tail
        consumed = consumed_before + len(chunk) - len(rest)
        if len(out) > limits.max_bytes:
            raise WireError(WireErrorKind.TOO_LARGE, "inflated body over the limit")
        if len(out) > MAX_INFLATE_RATIO * consumed + _OUT_CHUNK:
            raise WireError(WireErrorKind.TOO_LARGE, f"inflates more than {MAX_INFLATE_RATIO}x")
        return rest

    try:
        for start in range(0, len(data), _IN_CHUNK):
            chunk: bytes | memoryview = view[start : start + _IN_CHUNK]
            consumed = start
            while chunk and not d.eof:
                rest = take(chunk, consumed)
                consumed += len(chunk) - len(rest)
                chunk = rest
            if d.eof:
                break
        while not d.eof:  # output zlib still holds once every input byte went in
            before = len(out)
            take(b"", len(data))
            if len(out) == before:
                break
    except zlib.error:
        raise WireError(WireErrorKind.MALFORMED, "not gzip") from None
    if not d.eof:
        raise WireError(WireErrorKind.TRUNCATED, "gzip stream ends early")
    return out


def decode(data: bytes, limits: Limits) -> WireSnapshot:
    """Parse an (inflated) envelope of either format; raises WireError for anything malformed, corrupt
    or over a bound."""
    if len(data) > limits.max_bytes:
        raise WireError(WireErrorKind.TOO_LARGE, "envelope over the limit")
    if routerfleet_index.is_envelope(bytes(data[:4])):
        return _decode_v2(data if isinstance(data, bytes) else bytes(data), limits)
    try:
        outer = msgpack.unpackb(
            data, raw=False, max_bin_len=limits.max_bytes, max_str_len=64, max_array_len=0, max_map_len=8
        )
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise WireError(WireErrorKind.MALFORMED, type(exc).__name__) from None
    if not isinstance(outer, dict):
        raise WireError(WireErrorKind.MALFORMED, "envelope is not a map")
    if outer.get("format") != LEGACY_FORMAT:
        raise WireError(WireErrorKind.UNKNOWN_FORMAT, str(outer.get("format"))[:16])
    body, checksum = outer.get("body"), outer.get("checksum")
    if not isinstance(body, bytes) or not isinstance(checksum, bytes):
        raise WireError(WireErrorKind.MALFORMED, "body or checksum missing")
    if xxhash.xxh3_128_digest(body) != checksum:
        raise WireError(WireErrorKind.CHECKSUM, "body does not match its checksum")
    b = _unpack_map(body, limits, limits.max_bytes)
    try:
        columns = _legacy_columns(b, limits)
        return _body(b, limits, LEGACY_FORMAT, columns)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise WireError(WireErrorKind.MALFORMED, type(exc).__name__) from None


def _decode_v2(data: bytes, limits: Limits) -> WireSnapshot:
    try:
        meta, columns = routerfleet_index.decode_snapshot(
            data, limits.max_bytes, limits.max_records, limits.max_carrier_entries, limits.max_meta_bytes
        )
    except routerfleet_index.WireRefused as exc:
        raise WireError(WireErrorKind(exc.args[0]), exc.args[1]) from None
    b = _unpack_map(meta, limits, limits.max_meta_bytes)
    try:
        return _body(b, limits, FORMAT, columns)
    except WireError:
        raise
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise WireError(WireErrorKind.MALFORMED, type(exc).__name__) from None


def _unpack_map(data: bytes, limits: Limits, max_bin: int) -> dict:
    try:
        b = msgpack.unpackb(
            data,
            raw=False,
            max_bin_len=max_bin,
            max_str_len=4096,
            max_array_len=limits.max_workers,
            max_map_len=32,
        )
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise WireError(WireErrorKind.MALFORMED, type(exc).__name__) from None
    if not isinstance(b, dict):
        raise WireError(WireErrorKind.MALFORMED, "body is not a map")
    return b


def _legacy_columns(b: dict, limits: Limits) -> Columns:
    """Format 1's columns, from the body map's little-endian byte fields."""
    records = _int(b["records"], "records")
    if records > limits.max_records:
        raise WireError(WireErrorKind.TOO_LARGE, "record count over the limit")
    parent = _sized(b["parent"], records, 8, "parent")
    ncar = _sized(b["ncar"], records, 2, "ncar")
    entries = sum(_from_le("H", ncar, records, "ncar"))
    if entries > limits.max_carrier_entries:
        raise WireError(WireErrorKind.TOO_LARGE, "carrier entries over the limit")
    return Columns.from_le(
        parent,
        _sized(b["key"], records, 8, "key"),
        ncar,
        _sized(b["worker"], entries, 4, "worker"),
        _sized(b["tiers"], entries, 1, "tiers"),
        _sized(b["hash"], entries, 8, "hash"),
    )


def _sized(data: object, count: int, width: int, name: str) -> bytes:
    if not isinstance(data, bytes):
        raise WireError(WireErrorKind.MALFORMED, f"{name} is not bytes")
    if len(data) != count * width:
        raise WireError(WireErrorKind.MALFORMED, f"{name} has {len(data)} bytes for {count} entries")
    return data


def _int(v: object, name: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise WireError(WireErrorKind.MALFORMED, f"{name} out of range")
    return v


def _str(v: object, name: str) -> str:
    if not isinstance(v, str):
        raise WireError(WireErrorKind.MALFORMED, f"{name} is not a string")
    return v


def _body(b: dict, limits: Limits, fmt: int, columns: Columns) -> WireSnapshot:
    if _int(b["format"], "format") != fmt:
        raise WireError(WireErrorKind.UNKNOWN_FORMAT, str(b["format"]))
    producer, hashing = b["producer"], b["hashing"]
    workers = []
    for w in b["workers"]:
        if not isinstance(w, list) or len(w) != 3:
            raise WireError(WireErrorKind.MALFORMED, "worker entry")
        workers.append(
            WireWorker(_str(w[0], "engine"), _int(w[1], "rank", 0, 1 << 16), _str(w[2], "incarnation"))
        )
    cursors = []
    for c in b["cursors"]:
        if not isinstance(c, list) or len(c) != 2:
            raise WireError(WireErrorKind.MALFORMED, "cursor entry")
        cursors.append((_int(c[0], "cursor worker", 0, len(workers) - 1), _int(c[1], "cursor seq", -1)))
    return WireSnapshot(
        format=fmt,
        producer_id=_str(producer["id"], "producer id"),
        producer_incarnation=_str(producer["incarnation"], "producer incarnation"),
        producer_ready=bool(b["producer_ready"]),
        block_size=_int(hashing["block_size"], "block_size", 1, 1 << 20),
        scheme=_str(hashing["scheme"], "scheme"),
        workers=workers,
        cursors=cursors,
        built_ms=_int(b["built_ms"], "built_ms"),
        columns=columns,
        sessions=_sessions(b.get("sessions"), limits),
        responses=_sessions(b.get("responses"), limits),
    )
