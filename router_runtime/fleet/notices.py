"""KV notices between sibling replicas: ``POST /internal/kv_notice`` on the internal port, with the fleet
token, to every peer the bootstrap's peer discovery lists. A notice names ranks and what to do with
them (``kv/withhold.py``): withhold their credit because an engine denied a credited prefix, withhold it
because a flush is about to reset their engines, or the flush is done.

``vet_notice`` is the only way a body off the network becomes a ``KvNotice``: bounded, typed, and
acted on only for ranks the receiver subscribes to (a hostile peer can at most make ranks of known
engines run cold for a while).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from ..tasks import end_tasks
from ..worker import Carrier
from .gossip import peer_session

log = logging.getLogger(__name__)

FORMAT = 1
MAX_BODY_BYTES = 256 << 10
MAX_RANKS = 4096
_MAX_NAME = 512
_MAX_RANK = 1 << 16
_MAX_AGE_MS = 3_600_000


class NoticeKind(enum.StrEnum):
    WITHHOLD_FALSE_HIT = "withhold_false_hit"  # the sender's audit: the engine denied a credited prefix
    WITHHOLD_FLUSH = "withhold_flush"  # a flush through the sender is about to reset these ranks' engines
    FLUSHED = "flushed"  # that flush's engines have answered


class NoticeRejected(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class KvNotice:
    kind: NoticeKind
    ranks: tuple[Carrier, ...]
    age_ms: int = 0  # a withhold for a false hit: how long before sending the denied prediction was made


def encode_notice(notice: KvNotice) -> bytes:
    ranks = [{"engine": c.engine, "rank": c.rank} for c in notice.ranks]
    doc = {"format": FORMAT, "kind": notice.kind.value, "ranks": ranks, "age_ms": notice.age_ms}
    return json.dumps(doc).encode()


def vet_notice(body: bytes) -> KvNotice:
    """The notice in ``body``, or ``NoticeRejected`` naming what is wrong with it."""
    if len(body) > MAX_BODY_BYTES:
        raise NoticeRejected(f"a notice is at most {MAX_BODY_BYTES} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise NoticeRejected("not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise NoticeRejected(f"format must be {FORMAT}")
    try:
        kind = NoticeKind(doc.get("kind"))
    except ValueError:
        raise NoticeRejected(f"kind must be one of {[k.value for k in NoticeKind]}") from None
    ranks = doc.get("ranks")
    if not isinstance(ranks, list) or len(ranks) > MAX_RANKS:
        raise NoticeRejected(f"ranks must be a list of at most {MAX_RANKS}")
    age_ms = doc.get("age_ms", 0)
    if type(age_ms) is not int or not 0 <= age_ms <= _MAX_AGE_MS:
        raise NoticeRejected(f"age_ms must be an integer from 0 to {_MAX_AGE_MS}")
    carriers = []
    for r in ranks:
        engine, rank = (r.get("engine"), r.get("rank")) if isinstance(r, dict) else (None, None)
        if not isinstance(engine, str) or not 0 < len(engine) <= _MAX_NAME:
            raise NoticeRejected("a rank's engine must be a non-empty string")
        if type(rank) is not int or not 0 <= rank < _MAX_RANK:
            raise NoticeRejected("a rank's rank must be a small non-negative integer")
        carriers.append(Carrier(engine, rank))
    return KvNotice(kind, tuple(carriers), age_ms)


class Notices:
    """Sends notices to every peer, one bounded POST each, all at once. ``send`` waits for the answers;
    ``tell`` sends in the background (its tasks end with ``close``)."""

    def __init__(self, token: str, peer_urls: Callable[[], list[str]], timeout_s: float = 1.0) -> None:
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.peer_urls = peer_urls
        self.timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task] = set()

    async def send(self, notice: KvNotice) -> dict[str, str]:
        """Each peer's answer: ``ok``, ``http_NNN``, ``timeout`` or ``error``."""
        urls = self.peer_urls()
        if not urls:
            return {}
        if self._session is None:
            self._session = peer_session(self.timeout_s)
        body = encode_notice(notice)
        outcomes = await asyncio.gather(*(self._post(url, body) for url in urls))
        return dict(zip(urls, outcomes, strict=True))

    def tell(self, notice: KvNotice) -> None:
        task = asyncio.create_task(self.send(notice), name=f"kv-notice-{notice.kind}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        await end_tasks(self._tasks, "KV notices")
        if self._session is not None:
            await self._session.close()

    async def _post(self, url: str, body: bytes) -> str:
        assert self._session is not None
        try:
            async with self._session.post(url + "/internal/kv_notice", data=body, headers=self._headers) as r:
                return "ok" if r.status == 204 else f"http_{r.status}"
        except TimeoutError:
            return "timeout"
        except aiohttp.ClientError:
            return "error"
