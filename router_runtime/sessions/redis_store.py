"""The fleet-shared store: Redis (or Valkey, which speaks its protocol) behind ``SessionStore``.

Every replica reads and writes the same keys, so a session's engine and a stored response's binding are
known fleet-wide, across replica restarts and rollouts. Keys are ``{prefix}{table}:{digest hex}`` (the
digests of ``keys.py``: never a raw session key or response id); values are a small msgpack array
``[engine, rank (-1: the whole engine), incarnation]`` with the table's TTL, written with one ``SET PX``.

What comes back is network data: ``_vetted`` decodes it into ``Remembered`` or refuses it, and a
``Remembered`` only routes after ``bindings.resolve``/``classify`` match it to an engine this replica
discovered itself, in the same incarnation.

An outage must cost a request nothing: the callers bound every call by their deadline, and after a
failure (an error, or a call abandoned at its deadline) the store answers ``StoreDown`` at once for
``backoff_s`` instead of making each request wait out the deadline again. An error the store answered
(a key of the wrong type) is that key's, like a malformed value: never a back-off for everyone.
``routerfleet_shared_store_up`` shows which state it is in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import urlsplit

import msgpack
import redis.asyncio as aioredis
from redis.connection import parse_url
from redis.exceptions import ResponseError

from .store import Remembered

SCHEMES = ("redis", "rediss", "unix")


class StoreDown(ConnectionError):
    """The shared store failed a moment ago; not asked again until its backoff ends."""


def store_url(value: str) -> str:
    """A ``--session-store`` URL, vetted: raises ``ValueError`` saying what is wrong."""
    parts = urlsplit(value)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{value[:60]!r}: expected a redis://, rediss:// or unix:// URL")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{value[:60]!r}: no host")
    if parts.password:
        raise ValueError("put the password in --session-store-password-file, not in the URL")
    try:
        parse_url(value)  # as the client will read it: its port, database and query's options
    except ValueError as e:
        raise ValueError(f"{value[:60]!r}: {e}") from None
    return value


def _vetted(raw: object) -> Remembered | None:
    """A stored value, decoded and checked (None: absent); raises ValueError on anything else."""
    if raw is None:
        return None
    if not isinstance(raw, bytes) or len(raw) > 1024:
        raise ValueError("a stored value is not a small byte string")
    v = msgpack.unpackb(raw, use_list=True)
    if not (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and isinstance(v[2], str)):
        raise ValueError("a stored value is not [engine, rank, incarnation]")
    if type(v[1]) is not int or not -1 <= v[1] < 1 << 16:
        raise ValueError("a stored rank is out of range")
    value = Remembered(v[0], None if v[1] < 0 else v[1], v[2])
    if not value.fits():
        raise ValueError("a stored value is too large")
    return value


class SharedClient:
    """One connection pool to the store, shared by its tables, with the outage backoff."""

    def __init__(
        self,
        url: str,
        *,
        password: str | None = None,
        key_prefix: str = "routerfleet:",
        connect_timeout_s: float = 0.5,
        op_timeout_s: float = 1.0,
        backoff_s: float = 1.0,
        on_state: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.redis = aioredis.Redis.from_url(
            url,
            password=password,
            socket_connect_timeout=connect_timeout_s,
            socket_timeout=op_timeout_s,
            retry_on_timeout=False,
        )
        self.key_prefix = key_prefix
        self.backoff_s = backoff_s
        self._on_state = on_state or (lambda _up: None)
        self._clock = clock
        self._down_until = 0.0
        self._on_state(True)

    def table(self, name: str, ttl_s: float) -> RedisStore:
        return RedisStore(self, f"{self.key_prefix}{name}:", ttl_s)

    async def call(self, op: Callable[[aioredis.Redis], object]):
        if self._clock() < self._down_until:
            raise StoreDown("the shared store failed a moment ago")
        try:
            result = await op(self.redis)
        except ResponseError:  # the store answered: the trouble is the command's or its key's
            self._on_state(True)
            raise
        except BaseException:  # an error, or abandoned at the caller's deadline (CancelledError)
            self._down_until = self._clock() + self.backoff_s
            self._on_state(False)
            raise
        self._on_state(True)
        return result

    async def ping(self) -> bool:
        try:
            return bool(await self.call(lambda r: r.ping()))
        except Exception:
            return False

    async def close(self) -> None:
        await self.redis.aclose()


class RedisStore:
    """One table (``sessions`` or ``responses``) of the shared store."""

    def __init__(self, client: SharedClient, prefix: str, ttl_s: float) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_ms = max(1, int(ttl_s * 1000))

    def _key(self, digest: bytes) -> str:
        return self.prefix + digest.hex()

    async def get(self, digest: bytes) -> Remembered | None:
        key = self._key(digest)
        try:
            raw = await self.client.call(lambda r: r.get(key))
        except ResponseError as exc:  # WRONGTYPE: something else wrote that key; a bad value, no outage
            raise ValueError(f"a stored value is not a string ({str(exc)[:40]})") from None
        return _vetted(raw)

    async def put(self, digest: bytes, value: Remembered) -> None:
        key = self._key(digest)
        raw = msgpack.packb([value.engine, -1 if value.rank is None else value.rank, value.incarnation])
        await self.client.call(lambda r: r.set(key, raw, px=self.ttl_ms))
