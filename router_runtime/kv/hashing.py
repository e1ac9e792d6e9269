"""The router's own block keys: a content hash of each block's token IDs, chained from the root.

Engine block hashes are not reproducible outside the engine (vLLM hashes pickles with a per-deployment
seed; SGLang and vLLM disagree on sign and width), so, as Dynamo and llm-d do, the router hashes the
token IDs itself and keeps the engine hash only as an opaque ID per carrier. A block's key is
``xxh3_64(tokens_le_u32 || extra, seed=parent_key)``: chaining through the seed makes the key of block
``i`` identify the whole prefix up to ``i``, so the trie is stored flat, one dict entry per node.

The namespace (LoRA adapter, cache salt) seeds the root, so salted or adapter blocks can never match
a plain request; per-block extra keys (vLLM's multimodal ids, salts) are hashed into their block.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

import msgpack
import xxhash

_h = xxhash.xxh3_64_intdigest

# Names the key scheme below; two routers' keys are comparable only when block size and scheme match.
SCHEME = "xxh3_64-chain-u32le/v1"

# The root seed of the plain namespace. A constant, so every router replica and every build agrees.
PLAIN_ROOT = _h(b"routerfleet/block-key/v1")


def namespace_root(lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The chain seed for a namespace: plain requests, a LoRA adapter, a cache salt, or both."""
    if lora_name is None and cache_salt is None:
        return PLAIN_ROOT
    return _h(msgpack.packb([lora_name, cache_salt]), seed=PLAIN_ROOT)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("I", token_ids).tobytes()
    except OverflowError:  # IDs beyond u32 (or negative) are nonsense for a vocabulary but must not crash
        return array("q", token_ids).tobytes()


def extra_key_bytes(extra: object) -> bytes:
    """Canonical bytes of one block's opaque extra keys (vLLM's untagged tuples)."""
    return b"" if extra is None else msgpack.packb(extra)


def block_keys(
    token_ids: Sequence[int],
    block_size: int,
    root: int = PLAIN_ROOT,
    extra_keys: Sequence[object] | None = None,
) -> list[int]:
    """Keys of every full block of ``token_ids``, chained from ``root``; a trailing partial block is not
    keyed (engines only cache full blocks)."""
    data = _token_bytes(token_ids)
    width = len(data) // max(len(token_ids), 1) * block_size
    n = len(token_ids) // block_size
    keys = [0] * n
    parent = root
    if extra_keys is None:
        for i in range(n):
            parent = keys[i] = _h(data[i * width : (i + 1) * width], seed=parent)
    else:
        for i in range(n):
            extra = extra_key_bytes(extra_keys[i]) if i < len(extra_keys) else b""
            parent = keys[i] = _h(data[i * width : (i + 1) * width] + extra, seed=parent)
    return keys


def hash_set_digest(hashes: Iterable[int]) -> str:
    """A short, order-free digest of a set of engine block hashes: lets the demo and tests compare what
    the index believes with what an engine holds without printing hashes."""
    return f"{_h(array('Q', sorted(hashes)).tobytes()):016x}"
