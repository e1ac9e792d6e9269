"""Engine-side block hashes, as the real engines compute them (pure functions, no state).

These are the *engine's* opaque block IDs that go on the wire, not the router's content keys
(``router_runtime.kv.hashing``). They are reproduced faithfully so the fake's events look like a real
engine's:

* ``sglang``: SGLang's seedless per-page chain, ``d_i = sha256(d_{i-1} || tokens as u32 LE)`` with an
  empty ``d_{-1}``; the published ID is the first 8 digest bytes as a signed i64 (we keep it as the
  equivalent u64). Golden: ``chain([1, 2, 3, 4], 4) == [-3488128144981237669]``.
* vLLM dialects: vLLM 0.33's default ``sha256`` chain, ``d_i = sha256(pickle((d_{i-1}, tokens,
  extra_keys)))`` with ``d_{-1} = NONE_HASH = sha256(pickle("vllm-none-hash"))`` (no PYTHONHASHSEED),
  published as the last 8 digest bytes as u64. Golden: tokens 1..32, block 16 ->
  ``[1403909460543360175, 1643945449041937783]`` (docs/kv-wire.md section 1.4). Pickle of a tuple of bytes,
  ints and strs is stable across CPython versions at a fixed protocol, so this is deterministic.

Namespaces (LoRA adapter, cache salt) change every hash so salted blocks never collide with plain ones:
for vLLM they enter as extra keys the way vLLM does (``("lora", name, None)`` on every block,
``("cache_salt", salt)`` on the first block only; modelled on vLLM 0.33, not verified byte for byte);
for SGLang, which keys its radix tree by ``extra_key`` instead of hashing it, the chain starts from
``d_{-1} = sha256(b"routerfleet-namespace\\0" + f"{lora_name or ''}\\0{cache_salt or ''}".encode())``
(a fake-engine convention, documented here; unsalted chains are exactly SGLang's).
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from router_runtime.kv.events import Dialect

_U64 = (1 << 64) - 1
_PICKLE_PROTOCOL = 5  # vLLM uses pickle.HIGHEST_PROTOCOL; pinned so a future Python cannot change hashes
_VLLM_NONE_HASH = hashlib.sha256(pickle.dumps("vllm-none-hash", _PICKLE_PROTOCOL)).digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """What keeps a request's blocks apart from everyone else's: its LoRA adapter and its cache salt."""

    lora_name: str | None = None
    cache_salt: str | None = None

    @property
    def is_plain(self) -> bool:
        return self.lora_name is None and self.cache_salt is None


PLAIN = Namespace()


def _u32le(tokens: Sequence[int]) -> bytes:
    # Callers validate 0 <= t < 2**32 (struct raises otherwise); "<" pins little-endian on any host.
    return struct.pack(f"<{len(tokens)}I", *tokens)


def sglang_root(namespace: Namespace) -> bytes:
    if namespace.is_plain:
        return b""
    text = f"{namespace.lora_name or ''}\0{namespace.cache_salt or ''}".encode()
    return hashlib.sha256(b"routerfleet-namespace\0" + text).digest()


def vllm_hash_extra_keys(namespace: Namespace, block_index: int) -> tuple | None:
    """The tagged extra keys vLLM hashes into block ``block_index`` (None when there are none)."""
    keys: list[tuple] = []
    if namespace.lora_name is not None:
        keys.append(("lora", namespace.lora_name, None))
    if namespace.cache_salt is not None and block_index == 0:
        keys.append(("cache_salt", namespace.cache_salt))
    return tuple(keys) if keys else None


def vllm_event_extra_keys(namespace: Namespace, block_index: int) -> tuple:
    """The untagged extra keys vLLM puts on a BlockStored for that block: the LoRA name on every block,
    the cache salt on the first block only (docs/kv-wire.md section 1.3). Empty tuple when none."""
    keys: list[str] = []
    if namespace.lora_name is not None:
        keys.append(namespace.lora_name)
    if namespace.cache_salt is not None and block_index == 0:
        keys.append(namespace.cache_salt)
    return tuple(keys)


def block_hashes(
    dialect: Dialect, tokens: Sequence[int], block_size: int, namespace: Namespace = PLAIN
) -> list[int]:
    """The engine hash (as u64) of every full block of ``tokens``, chained from the root. A trailing
    partial block gets no hash: both engines only cache full blocks here."""
    n = len(tokens) // block_size
    out: list[int] = []
    if dialect is Dialect.SGLANG:
        prev = sglang_root(namespace)
        for i in range(n):
            prev = hashlib.sha256(prev + _u32le(tokens[i * block_size : (i + 1) * block_size])).digest()
            out.append(int.from_bytes(prev[:8], "big"))
        return out
    prev = _VLLM_NONE_HASH
    for i in range(n):
        obj = (prev, tuple(tokens[i * block_size : (i + 1) * block_size]), vllm_hash_extra_keys(namespace, i))
        prev = hashlib.sha256(pickle.dumps(obj, _PICKLE_PROTOCOL)).digest()
        out.append(int.from_bytes(prev, "big") & _U64)
    return out


def to_signed_i64(value: int) -> int:
    """A u64 engine hash as SGLang publishes it (two's complement i64)."""
    return value - (1 << 64) if value >= 1 << 63 else value
