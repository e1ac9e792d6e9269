"""The consumer's fetch client: three bounds, not one.

A single total timeout has two opposite jobs: cut a peer that is gone, and let a large body finish.
Sized for the first it rejects every peer whose snapshot is big enough to be worth having. So
``connect`` cuts a peer that is gone, ``read_idle`` one that stopped sending mid-body, and ``total``
bounds only a transfer that is progressing. The body is read with a hard size cap and inflated with
one (``wire.inflate``), never by the HTTP library's automatic decoding.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from ..http_body import read_capped
from .peers import Peer
from .state import SnapshotOutcome
from .wire import FORMAT, Limits, WireError, WireSnapshot, decode, inflate


@dataclass(frozen=True, slots=True)
class FetchBounds:
    connect_s: float = 5.0
    read_idle_s: float = 15.0
    total_s: float = 300.0


class FetchFailed(Exception):
    def __init__(self, outcome: SnapshotOutcome, detail: str) -> None:
        super().__init__(f"{outcome.value}: {detail}")
        self.outcome = outcome


class SnapshotFetcher:
    def __init__(self, token: str, bounds: FetchBounds | None = None, limits: Limits | None = None) -> None:
        self.token = token
        self.bounds = bounds or FetchBounds()
        self.limits = limits or Limits()
        self._session: aiohttp.ClientSession | None = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            b = self.bounds
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=b.total_s, sock_connect=b.connect_s, sock_read=b.read_idle_s
                ),
                auto_decompress=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _get(
        self,
        peer: Peer,
        params: dict[str, str],
        gzip_ok: bool,
        cap: int | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
    ) -> tuple[int, bytes, str]:
        headers = {"Authorization": f"Bearer {self.token}"}
        if gzip_ok:
            headers["Accept-Encoding"] = "gzip"
        cap = self.limits.max_bytes if cap is None else cap
        try:
            bounds = {} if timeout is None else {"timeout": timeout}  # None: the session's three bounds
            async with self._sess().get(
                peer.url + "/internal/kv_snapshot", params=params, headers=headers, **bounds
            ) as r:
                body = await read_capped(r.content, cap)
                if body is None:
                    raise FetchFailed(SnapshotOutcome.REJECTED, "body over the limit")
                return r.status, body, r.headers.get("Content-Encoding", "")
        except FetchFailed:
            raise
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise FetchFailed(SnapshotOutcome.UNREACHABLE, type(exc).__name__) from None

    async def snapshot(self, peer: Peer, max_age_ms: int, *, sessions_only: bool = False) -> WireSnapshot:
        # A producer of the previous version ignores ``format`` and answers format 1: decode reads both.
        params = {"sessions_only": "true"} if sessions_only else {"max_age_ms": str(max_age_ms)}
        params["format"] = str(FORMAT)
        status, body, encoding = await self._get(peer, params, gzip_ok=True)
        if status == 404:  # no index there, or an older image: as good as cold
            raise FetchFailed(SnapshotOutcome.COLD_PEER, "404")
        if status != 200:  # it answered, and not with a snapshot: a refusal (a wrong token, a broken peer)
            raise FetchFailed(SnapshotOutcome.REJECTED, f"HTTP {status}")
        # Inflating and decoding run off the event loop (a large or hostile body must not stall it).
        # The failure is raised outside the except block and after dropping the body: a raise inside
        # it would chain the WireError, whose traceback holds the inflated buffer, to the FetchFailed
        # callers keep.
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _open, body, encoding, self.limits)
        except WireError as exc:
            kind = exc.kind
        del body
        raise FetchFailed(SnapshotOutcome.REJECTED, kind)

    async def cursors(self, peer: Peer) -> dict[tuple[str, int, str], int]:
        """A peer's live cursor table: (engine, rank, incarnation) -> last applied seq. Bounded as a
        probe is (a replica already serving asks it): a row per rank, at most ``Limits.max_workers``
        rows of ``CURSOR_ROW_BYTES`` each, within ``CURSORS_TOTAL_S``, and read off the event loop."""
        cap = self.limits.max_workers * CURSOR_ROW_BYTES
        b = self.bounds
        timeout = aiohttp.ClientTimeout(
            total=CURSORS_TOTAL_S, sock_connect=b.connect_s, sock_read=b.read_idle_s
        )
        status, body, _enc = await self._get(peer, {"cursors_only": "true"}, False, cap, timeout)
        if status != 200:
            raise FetchFailed(SnapshotOutcome.UNREACHABLE, f"HTTP {status}")
        try:
            return await asyncio.get_running_loop().run_in_executor(None, _cursors, body, self.limits)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise FetchFailed(SnapshotOutcome.REJECTED, type(exc).__name__) from None


def _open(body: bytes, encoding: str, limits: Limits) -> WireSnapshot:
    return decode(inflate(body, limits) if encoding == "gzip" else body, limits)


_MAX_SEQ = (1 << 63) - 1
# A cursors_only answer's row ({"engine": ..., "rank": ..., "incarnation": ..., "seq": ...}) is about
# 150 bytes with a URL and a pod UID; a peer answering more per row is refused by the cap.
CURSOR_ROW_BYTES = 512
CURSORS_TOTAL_S = 10.0


def _cursors(body: bytes, limits: Limits) -> dict[tuple[str, int, str], int]:
    rows = json.loads(body)["cursors"]
    if type(rows) is not list or len(rows) > limits.max_workers:
        raise ValueError("cursors: a list of at most max_workers rows")
    return dict(_cursor(c) for c in rows)


def _cursor(row: object) -> tuple[tuple[str, int, str], int]:
    """One row of a cursors_only answer, every field a bounded value of its type (a float such as
    1e999, a bool or a string where an integer belongs is refused, never converted)."""
    if type(row) is not dict:
        raise TypeError("a cursor is an object")
    engine, rank, incarnation, seq = row["engine"], row["rank"], row["incarnation"], row["seq"]
    if type(engine) is not str or type(incarnation) is not str:
        raise TypeError("engine and incarnation are strings")
    if type(rank) is not int or not 0 <= rank < 1 << 16 or type(seq) is not int or not -1 <= seq <= _MAX_SEQ:
        raise ValueError("rank and seq are bounded integers")
    return (engine, rank, incarnation), seq
