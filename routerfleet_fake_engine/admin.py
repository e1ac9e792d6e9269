"""Admin endpoints: drive KV events deterministically and read engine state (tests, demo, benchmarks).

All bodies are JSON objects; errors are 400 with OpenAI's error shape. ``rank`` defaults to 0.
Event-producing ops answer ``{"rank", "seq", "events"}`` where ``seq`` is the batch's sequence number,
or null when the op changed nothing (no events -> no batch, as an engine step without events).

``drop`` (optional on store/remove/clear/publish_raw) simulates losing that one batch:
``"none"`` (default), ``"pub"`` (not sent on PUB, still replayable), ``"all"`` (seq consumed, gone).

- ``POST /admin/store {"rank", "token_ids" | "text", "medium"?, "lora_name"?, "cache_salt"?, "drop"?}``:
  admit the full blocks as if a request ran (medium GPU, the default) or put them on the host tier
  (medium CPU / CPU_PINNED; needs ``--host-capacity-blocks``) or the disk tier (medium STORAGE / DISK;
  needs ``--storage-dir`` and ``--disk-capacity-blocks``).
- ``POST /admin/remove {"rank", "token_ids" | "text", "medium"?, "lora_name"?, "cache_salt"?, "drop"?}``:
  evict those blocks from that tier (no medium: from any tier); one BlockRemoved per block.
- ``POST /admin/clear {"rank"?, "drop"?}``: AllBlocksCleared on that rank, or every rank when omitted.
- ``POST /admin/restart``: new incarnation; caches, sequences and replay buffers reset; sockets stay.
- ``POST /admin/publish_raw {"rank", "payload_hex", "drop"?}``: arbitrary payload bytes as the next
  sequenced batch (malformed-input tests).
- ``POST /admin/skip_seq {"rank", "n"?=1, "keep_in_replay"?=true}``: consume ``n`` seqs with nothing on
  PUB. ``keep_in_replay`` true buffers each as an empty batch (replay fills the gap); false loses them.
- ``POST /admin/mute {"rank", "on"?=true}``: while on, the rank sends nothing on PUB (every batch,
  requests' included, is kept for replay): a silent stream.
- ``POST /admin/wipe_storage {}``: invalidate the disk tier (BlockRemoved per disk block on every rank)
  and move the storage epoch; needs ``--storage-dir``. Answers ``{"storage_epoch"}``.
- ``POST /admin/tokenize_faults {"delay_ms"?=0, "status"?=200}``: the tokenize endpoints answer after
  that delay, with that status (an error body unless 200); ``{}`` clears both.
- ``POST /admin/health_fault {"ms"}``: ``/health`` answers 503 for that long (a readiness flap);
  ``{"ms": 0}`` ends it.
- ``GET /admin/state``: ``{"incarnation", "dialect", "block_size", "ranks": [{"rank", "last_seq",
  "blocks": {"device": [u64...], "host": [u64...]}}]}``; hashes least recently used first,
  ``last_seq`` -1 before the first batch. Hashes are JSON integers up to 2**64-1 (beyond a JS double).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router_runtime.kv.events import MEDIUM_TIERS, Tier
from router_runtime.tokens import encode
from routerfleet_fake_engine.hashing import Namespace
from routerfleet_fake_engine.openai_api import RequestError, parse_json_body
from routerfleet_fake_engine.publisher import Drop

if TYPE_CHECKING:
    from routerfleet_fake_engine.server import FakeEngine


def _int(body: dict, key: str, default: int | None = None, minimum: int = 0) -> int:
    v = body.get(key, default)
    if type(v) is not int or v < minimum:
        raise RequestError(f"'{key}' must be an integer >= {minimum}", key)
    return v


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if not isinstance(v, bool):
        raise RequestError(f"'{key}' must be a boolean", key)
    return v


def _opt_str(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and (not isinstance(v, str) or not v):
        raise RequestError(f"'{key}' must be a non-empty string", key)
    return v


class _Admin:
    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine

    async def _body(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        if not raw.strip():
            return {}
        body = parse_json_body(raw)
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def _rank(self, body: dict) -> int:
        rank = _int(body, "rank", 0)
        if rank >= self.engine.config.dp_size:
            raise RequestError(f"rank {rank} out of range for dp_size {self.engine.config.dp_size}", "rank")
        return rank

    @staticmethod
    def _tokens(body: dict) -> list[int]:
        if "text" in body and "token_ids" not in body:
            if not isinstance(body["text"], str):
                raise RequestError("'text' must be a string", "text")
            return encode(body["text"])
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not all(type(t) is int and 0 <= t < 1 << 32 for t in ids):
            raise RequestError("'token_ids' must be a list of integers in [0, 2**32)", "token_ids")
        return ids

    @staticmethod
    def _tier(body: dict) -> Tier | None:
        medium = body.get("medium")
        if medium is None:
            return None
        tier = MEDIUM_TIERS.get(medium) if isinstance(medium, str) else None
        if tier not in (Tier.DEVICE, Tier.HOST, Tier.DISK):
            raise RequestError("'medium' must be one of GPU, CPU, CPU_PINNED, STORAGE, DISK", "medium")
        return tier

    @staticmethod
    def _drop(body: dict) -> Drop:
        try:
            return Drop(body.get("drop", "none"))
        except ValueError:
            raise RequestError("'drop' must be one of none, pub, all", "drop") from None

    @staticmethod
    def _namespace(body: dict) -> Namespace:
        return Namespace(lora_name=_opt_str(body, "lora_name"), cache_salt=_opt_str(body, "cache_salt"))

    def _reply(self, rank: int, events: list, drop: Drop) -> web.Response:
        seq = self.engine.emit(rank, events, drop)
        return web.json_response({"rank": rank, "seq": seq, "events": len(events)})

    async def store(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rank, tokens, tier = self._rank(body), self._tokens(body), self._tier(body) or Tier.DEVICE
        try:
            events = self.engine.caches[rank].store(tokens, self._namespace(body), tier)
        except ValueError as e:
            raise RequestError(str(e), "medium") from None
        return self._reply(rank, events, self._drop(body))

    async def remove(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rank, tokens, tier = self._rank(body), self._tokens(body), self._tier(body)
        events = self.engine.caches[rank].remove(tokens, self._namespace(body), tier)
        return self._reply(rank, events, self._drop(body))

    async def clear(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        drop = self._drop(body)
        ranks = [self._rank(body)] if body.get("rank") is not None else range(self.engine.config.dp_size)
        results = [
            {"rank": r, "seq": self.engine.emit(r, self.engine.caches[r].clear(), drop), "events": 1}
            for r in ranks
        ]
        return web.json_response(results[0] if body.get("rank") is not None else {"ranks": results})

    async def restart(self, request: web.Request) -> web.Response:
        await self._body(request)  # validates JSON if one was sent
        return web.json_response({"incarnation": self.engine.restart()})

    async def lose_cache(self, request: web.Request) -> web.Response:
        await self._body(request)
        self.engine.lose_cache()
        return web.json_response({"lost": True})

    async def wipe_storage(self, request: web.Request) -> web.Response:
        await self._body(request)
        try:
            epoch = self.engine.wipe_storage()
        except ValueError as e:
            raise RequestError(str(e)) from None
        return web.json_response({"storage_epoch": epoch})

    async def publish_raw(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rank = self._rank(body)
        try:
            payload = bytes.fromhex(body["payload_hex"])
        except (KeyError, TypeError, ValueError):
            raise RequestError("'payload_hex' must be a hex string", "payload_hex") from None
        seq = self.engine.publisher.publish_payload(rank, payload, self._drop(body))
        return web.json_response({"rank": rank, "seq": seq})

    async def skip_seq(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rank, n = self._rank(body), _int(body, "n", 1, minimum=1)
        last = self.engine.publisher.skip(rank, n, _bool(body, "keep_in_replay", True))
        return web.json_response({"rank": rank, "last_seq": last})

    async def mute(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        rank, on = self._rank(body), _bool(body, "on", True)
        self.engine.publisher.mute(rank, on)
        return web.json_response({"rank": rank, "muted": on})

    async def tokenize_faults(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        status = _int(body, "status", 200, minimum=200)
        if status > 599:
            raise RequestError("'status' must be an HTTP status", "status")
        faults = self.engine.tokenize_faults
        faults.delay_s, faults.status = _int(body, "delay_ms", 0) / 1000, status
        return web.json_response({"delay_ms": faults.delay_s * 1000, "status": faults.status})

    async def health_fault(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        ms = _int(body, "ms", 0)
        self.engine.unhealthy_until = time.monotonic() + ms / 1000
        return web.json_response({"unhealthy_ms": ms})

    async def state(self, _request: web.Request) -> web.Response:
        return web.json_response(self.engine.state())


def _errors_as_400(handler):
    async def wrapped(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except RequestError as e:
            return web.json_response(e.to_json(), status=400)

    return wrapped


def admin_routes(engine: FakeEngine) -> list[web.RouteDef]:
    admin = _Admin(engine)
    posts = {
        "store": admin.store,
        "remove": admin.remove,
        "clear": admin.clear,
        "restart": admin.restart,
        "lose_cache": admin.lose_cache,
        "publish_raw": admin.publish_raw,
        "skip_seq": admin.skip_seq,
        "mute": admin.mute,
        "wipe_storage": admin.wipe_storage,
        "tokenize_faults": admin.tokenize_faults,
        "health_fault": admin.health_fault,
    }
    return [
        *(web.post(f"/admin/{name}", _errors_as_400(h)) for name, h in posts.items()),
        web.get("/admin/state", admin.state),
    ]
