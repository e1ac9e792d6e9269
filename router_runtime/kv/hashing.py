"""The router's block keys, from Python's side. The scheme itself (a content hash of each block's
token IDs chained from a namespace root) lives in the native core, ``native/src/keys.rs``; this module
names it and keeps the two helpers whose inputs are Python values.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import msgpack
import routerfleet_index
import xxhash

# Names the key scheme; two routers' keys are comparable only when block size and scheme match.
SCHEME: str = routerfleet_index.SCHEME


def extra_key_bytes(extra: object) -> bytes:
    """Canonical bytes of one block's opaque extra keys (vLLM's untagged tuples), hashed into its key."""
    return b"" if extra is None else msgpack.packb(extra)


def hash_set_digest(hashes: Iterable[int]) -> str:
    """A short, order-free digest of a set of engine block hashes: lets the demo and tests compare what
    the index believes with what an engine holds without printing hashes."""
    return f"{xxhash.xxh3_64_intdigest(array('Q', sorted(hashes)).tobytes()):016x}"
