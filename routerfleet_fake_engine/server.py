"""The fake engine's imperative shell: the aiohttp server, the KV publisher and the per-rank caches.

Everything runs on one asyncio loop. A request's cache admission and the publication of its events are
one synchronous step (no ``await`` in between), so each scheduler step is exactly one sequenced batch
and batches appear on the wire in the order the cache changed.

Use it in-process from a test::

    async with run_fake_engine(FakeEngineConfig(dp_size=2, block_size=4)) as engine:
        engine.http_url            # "http://127.0.0.1:<port>"
        engine.kv_endpoint(1)      # "tcp://127.0.0.1:<kv base + 1>"   (SUB connects here)
        engine.replay_endpoint(1)  # "tcp://127.0.0.1:<replay base + 1>"  (DEALER connects here)

Ports default to 0: HTTP gets an ephemeral port and each ZMQ base gets ``dp_size`` consecutive free
ports, so tests can run in parallel. HTTP routes are documented on ``FakeEngine._routes``; the admin
API is in ``admin.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from router_runtime.kv.events import KVEvent
from router_runtime.tokens import decode
from routerfleet_fake_engine import pooling_api, transfer
from routerfleet_fake_engine.adapters import AdapterSlots
from routerfleet_fake_engine.admin import admin_routes
from routerfleet_fake_engine.cache import Admission, CacheConfig, RankCache
from routerfleet_fake_engine.compute import Alone, Compute, paced
from routerfleet_fake_engine.config import FakeEngineConfig
from routerfleet_fake_engine.generate_api import (
    GenerateShape,
    TokenGenerateShape,
    parse_generate,
    parse_token_generate,
)
from routerfleet_fake_engine.hashing import Namespace
from routerfleet_fake_engine.messages_api import MessagesShape, count_tokens, parse_messages
from routerfleet_fake_engine.messages_api import error_json as messages_error
from routerfleet_fake_engine.metrics import EngineCollector
from routerfleet_fake_engine.openai_api import (
    ChatShape,
    GenerationRequest,
    Kind,
    RequestError,
    ResponseHeader,
    Shape,
    Usage,
    detokenize_request,
    generate_tokens,
    parse_chat,
    parse_completion,
    parse_json_body,
    tokenize_request,
)
from routerfleet_fake_engine.publisher import Drop, KvPublisher
from routerfleet_fake_engine.responses_api import (
    CHOSEN_ID,
    ResponsesShape,
    ResponseStore,
    StoredResponse,
    not_found,
    parse_responses,
)
from routerfleet_fake_engine.storage import StorageDir

log = logging.getLogger(__name__)

RANK_HEADER = "X-Data-Parallel-Rank"
INCARNATION_HEADER = "X-Engine-Incarnation"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


@dataclass(slots=True)
class TokenizeFaults:
    """Faults of the tokenize endpoint: answer after ``delay_s``, with ``status`` (200: no fault)."""

    delay_s: float = 0.0
    status: int = 200


@dataclass(slots=True)
class RankRequestStats:
    """Monotonic per-rank request counters (kept across admin restarts, as Prometheus expects)."""

    requests: dict[str, int] = field(default_factory=dict)  # by endpoint kind
    prompt_tokens: int = 0
    cached_tokens: int = 0  # taken from a remote prefill included, as vLLM reports them
    generation_tokens: int = 0
    prefill_legs: int = 0  # requests prefilled for a remote decode (transfer.py)
    decode_legs: int = 0  # requests decoded on a remote prefill's KV
    received_blocks: int = 0  # blocks the decode legs pulled from a prefill engine
    cross_revision: int = 0  # decode legs refused: prefilled by an engine of another revision


@dataclass(slots=True)
class LoadStats:
    running: int = 0
    waiting: int = 0


def bad_request(e: RequestError) -> web.Response:
    return web.json_response(e.to_json(), status=e.status)


class FakeEngine:
    """One fake vLLM/SGLang server: HTTP API, ``dp_size`` ranks of prefix cache, and their KV streams."""

    def __init__(self, config: FakeEngineConfig, *, clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self.config = config
        self._clock = clock
        cache_config = CacheConfig(
            dialect=config.dialect,
            block_size=config.block_size,
            device_capacity=config.capacity_blocks,
            host_capacity=config.host_capacity_blocks,
            disk_capacity=config.disk_capacity_blocks,
        )
        self.caches = [RankCache(cache_config) for _ in range(config.dp_size)]
        self._unannounced: dict[int, list[KVEvent]] = {}  # a lazy reset's clear, per rank
        # The disk tier: found again in the storage directory, whatever process wrote it.
        self.storage = StorageDir(config.storage_dir) if config.storage_dir else None
        if self.storage is not None:
            for rank, cache in enumerate(self.caches):
                cache.load_disk(self.storage.load(rank))
        self.incarnation = self._new_incarnation()
        self.rank_stats = [RankRequestStats() for _ in range(config.dp_size)]
        self.load = LoadStats()
        self.rank_load = [LoadStats() for _ in range(config.dp_size)]  # the same, per DP rank
        self._round_robin = itertools.cycle(range(config.dp_size))
        self.tokenize_faults = TokenizeFaults()  # set through /admin/tokenize_faults (tests)
        # /health answers 503 until this time.monotonic() (set through /admin/health_fault): a readiness
        # flap without touching anything else the engine serves.
        self.unhealthy_until = 0.0
        self._request_ids = itertools.count(1)
        # The W3C trace context of the latest generation requests, as they arrived (a tracing test
        # reads which span was the engine's parent; vLLM itself continues the trace with its own).
        self.traceparents: collections.deque[str | None] = collections.deque(maxlen=64)
        # ... and all their headers as they arrived (and a stored response's GET's), repeated ones each:
        # ((lower-case name, value), ...).
        self.received_headers: collections.deque[tuple[tuple[str, str], ...]] = collections.deque(maxlen=64)
        self.sidecar_prefills = 0  # requests its sidecar (--pd-sidecar) prefilled on another engine
        # SGLang's bootstrap rooms this engine prefilled (transfer.py): room -> (ready, full blocks).
        self.rooms: collections.OrderedDict[int, tuple[asyncio.Event, list[int]]] = collections.OrderedDict()
        self.responses = ResponseStore()  # the Responses API's stored responses (lost on restart)
        self._slots: asyncio.Semaphore | None = None
        alone = Alone()
        self.compute = [Compute() if config.shared_compute else alone for _ in range(config.dp_size)]
        self.adapters: AdapterSlots | None = None  # LoRA slots, when modeled (--max-loras)
        if config.max_loras:
            self.adapters = AdapterSlots(config.max_loras, config.lora_load_ms / 1e3)
        self._publisher: KvPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._port = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineCollector(self))
        self.app = self._build_app()

    # ---------------------------------------------------------------- lifecycle

    @staticmethod
    def _new_incarnation() -> str:
        # The one random thing about the engine: a restart must be told apart from the previous run.
        return secrets.token_hex(8)

    async def start(self) -> None:
        """Bind ZMQ and HTTP and start serving. Raises (and releases what it bound) on failure."""
        cfg = self.config
        self._slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self._publisher = KvPublisher(
            dialect=cfg.dialect,
            dp_size=cfg.dp_size,
            host=cfg.zmq_host,
            kv_port=cfg.kv_port,
            replay_port=cfg.replay_port,
            topic=cfg.topic,
            replay_buffer=cfg.replay_buffer,
            clock=self._clock,
        )
        try:
            self._publisher.start()
            # No access log: request lines are noise at benchmark rates. A short shutdown timeout:
            # on SIGTERM in-flight requests get a moment to finish, then are cut (not aiohttp's minute).
            self._runner = web.AppRunner(
                self.app, access_log=None, handle_signals=False, shutdown_timeout=0.5
            )
            await self._runner.setup()
            await web.TCPSite(self._runner, cfg.host, cfg.port).start()
            self._port = self._runner.addresses[0][1]
        except BaseException:
            await self.stop()
            raise
        log.info(
            "fake engine ready: url=%s dialect=%s dp_size=%d block_size=%d kv_port_base=%d "
            "replay_port_base=%d incarnation=%s",
            self.http_url,
            cfg.dialect,
            cfg.dp_size,
            cfg.block_size,
            self._publisher.kv_port_base,
            self._publisher.replay_port_base,
            self.incarnation,
        )

    async def stop(self) -> None:
        self.persist()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._publisher is not None:
            await self._publisher.close()

    # ---------------------------------------------------------------- addresses

    @property
    def publisher(self) -> KvPublisher:
        if self._publisher is None:
            raise RuntimeError("engine not started")
        return self._publisher

    @property
    def publishing(self) -> bool:
        """Whether the KV publisher exists (start() has begun), so its stats can be read."""
        return self._publisher is not None

    @property
    def port(self) -> int:
        return self._port

    @property
    def http_url(self) -> str:
        host = "127.0.0.1" if self.config.zmq_host == "*" else self.config.host
        return f"http://{host}:{self._port}"

    def kv_endpoint(self, rank: int = 0) -> str:
        return self.publisher.kv_endpoint(rank)

    def replay_endpoint(self, rank: int = 0) -> str:
        return self.publisher.replay_endpoint(rank)

    # ----------------------------------------------- scheduler steps (sync: one step = one batch)

    def emit(self, rank: int, events: Sequence[KVEvent], drop: Drop = Drop.NONE) -> int | None:
        """Publish a step's events as one batch; a step without events publishes nothing, as in vLLM.
        A lazy reset's AllBlocksCleared goes first in the rank's next batch."""
        self.persist(rank)
        if (cleared := self._unannounced.pop(rank, None)) is not None:
            events = [*cleared, *events]
        return self.publisher.publish(rank, events, drop) if events else None

    def reset_prefix_cache(self) -> None:
        """vLLM's /reset_prefix_cache, SGLang's /flush_cache: every rank's cache is dropped now; the
        AllBlocksCleared is published at once, or (``lazy_clear``) with the rank's next step."""
        for rank, cache in enumerate(self.caches):
            events = cache.clear()
            if self.config.lazy_clear:
                self._unannounced[rank] = events
            else:
                self.emit(rank, events)

    def lose_cache(self) -> None:
        """Every rank's cache gone without a word: a restart behind a proxy that hides it, a bug."""
        for cache in self.caches:
            cache.reset(keep_disk=self.storage is not None)

    def persist(self, rank: int | None = None) -> None:
        """Write the disk tier of ``rank`` (every rank when None) to the storage dir, if it changed."""
        if self.storage is None:
            return
        for r in range(self.config.dp_size) if rank is None else (rank,):
            cache = self.caches[r]
            if cache.disk_dirty:
                self.storage.save(r, cache.disk_blocks())
                cache.disk_dirty = False

    def wipe_storage(self) -> int:
        """Invalidate the disk tier: its blocks go (announced) and the storage epoch moves."""
        if self.storage is None:
            raise ValueError("no storage dir configured")
        for rank, cache in enumerate(self.caches):
            self.emit(rank, cache.wipe_disk())
        epoch = self.storage.bump_epoch()
        for rank, cache in enumerate(self.caches):
            self.storage.save(rank, cache.disk_blocks())
            cache.disk_dirty = False
        return epoch

    def admit(self, rank: int, tokens: Sequence[int], namespace: Namespace) -> Admission:
        admission = self.caches[rank].admit(tokens, namespace)
        delay = self.config.publish_delay_ms / 1e3
        if delay and admission.events:  # announced later, in admission order (equal delays keep it)
            incarnation = self.incarnation
            asyncio.get_running_loop().call_later(delay, self._emit_late, incarnation, rank, admission.events)
        else:
            self.emit(rank, admission.events)
        return admission

    def _emit_late(self, incarnation: str, rank: int, events: Sequence[KVEvent]) -> None:
        if incarnation == self.incarnation and self._publisher is not None:  # not across a restart
            self.emit(rank, events)

    def restart(self) -> str:
        """Become a new incarnation: empty caches, sequences back at 0, replay buffers empty. Publishes
        nothing (a real restart announces nothing either; consumers see the seq go back to 0). The
        disk tier survives (it is in the storage dir) and is not re-announced either."""
        self.persist()
        self.lose_cache()
        self._unannounced.clear()
        self.publisher.reset()
        self.incarnation = self._new_incarnation()
        self.responses.clear()
        self._round_robin = itertools.cycle(range(self.config.dp_size))
        log.info("restarted as incarnation %s", self.incarnation)
        return self.incarnation

    def state(self) -> dict[str, Any]:
        return {
            "incarnation": self.incarnation,
            "dialect": str(self.config.dialect),
            "block_size": self.config.block_size,
            "ranks": [
                {
                    "rank": rank,
                    "last_seq": self.publisher.last_seq(rank),
                    "blocks": {
                        "device": cache.device_hashes(),
                        "host": cache.host_hashes(),
                        **({"disk": cache.disk_hashes()} if cache.config.disk_capacity else {}),
                    },
                }
                for rank, cache in enumerate(self.caches)
            ],
        }

    # --------------------------------------------------------------------- HTTP

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.post("/v1/responses", self._responses),
                web.get("/v1/responses/{response_id}", self._get_response),
                web.delete("/v1/responses/{response_id}", self._delete_response),
                web.post("/v1/responses/{response_id}/cancel", self._cancel_response),
                web.post("/v1/messages", self._messages),  # vLLM's Anthropic API
                web.post("/v1/messages/count_tokens", self._count_tokens),
                web.post("/generate", self._native_generate),  # SGLang's
                web.post("/inference/v1/generate", self._token_generate),  # vLLM's token-in
                web.post("/tokenize", self._tokenize),  # vLLM's
                web.post("/v1/tokenize", self._tokenize),  # SGLang's
                web.post("/detokenize", self._detokenize),
                web.post("/v1/detokenize", self._detokenize),
                web.post("/v1/embeddings", self._pooling(pooling_api.embeddings)),
                web.post("/pooling", self._pooling(pooling_api.pooling)),
                web.post("/classify", self._pooling(pooling_api.classify)),
                web.post("/score", self._pooling(pooling_api.score)),
                web.post("/v1/score", self._pooling(pooling_api.score)),
                web.post("/rerank", self._pooling(pooling_api.rerank)),
                web.post("/v1/rerank", self._pooling(pooling_api.rerank)),
                web.post("/v2/rerank", self._pooling(pooling_api.rerank)),
                web.post("/v1/audio/transcriptions", self._transcription),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),  # vLLM's
                web.post("/flush_cache", self._reset_prefix_cache),  # SGLang's
                web.get("/flush_cache", self._reset_prefix_cache),
                web.get("/metrics", self._metrics),
                web.get("/server_info", self._server_info),
                web.get("/get_server_info", self._server_info),  # older SGLang spelling
                web.get("/fake/rooms/{room}", self._room),  # SGLang's bootstrap server, as the fake plays it
                *admin_routes(self),
            ]
        )
        return app

    def _room_entry(self, room: int) -> tuple[asyncio.Event, list[int]]:
        entry = self.rooms.get(room)
        if entry is None:
            entry = self.rooms[room] = (asyncio.Event(), [0])
            while len(self.rooms) > 10_000:
                self.rooms.popitem(last=False)
        return entry

    async def _room(self, request: web.Request) -> web.Response:
        """A decode engine waits here for a room this engine prefills: its full blocks once ready."""
        try:
            room = int(request.match_info["room"])
        except ValueError:
            return web.json_response({"error": "room must be an integer"}, status=400)
        ready, blocks = self._room_entry(room)
        try:
            async with asyncio.timeout(self.config.room_timeout_s):
                await ready.wait()
        except TimeoutError:
            return web.json_response({"error": "the room was never prefilled"}, status=504)
        return web.json_response({"blocks": blocks[0], transfer.REVISION: self.config.revision})

    async def _sidecar_prefill(
        self, prefiller: str, path: str, doc: dict[str, Any], rank: str | None
    ) -> tuple[dict[str, Any], web.Response | None]:
        """llm-d's sidecar: the prefill leg on ``prefiller`` (ip:port), then the request with its transfer
        parameters; or the prefill's failure as the answer (its status, as the sidecar passes it on).
        The prefill leg carries the request's data-parallel ``rank`` header, as the sidecar's copy of
        the request's headers does."""
        self.sidecar_prefills += 1
        timeout = aiohttp.ClientTimeout(total=60)
        headers = {RANK_HEADER: rank} if rank is not None else {}
        body = transfer.sidecar_prefill_body(doc)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as s,
                s.post(f"http://{prefiller}{path}", json=body, headers=headers) as r,
            ):
                if r.status != 200:
                    return doc, web.Response(status=r.status, text=await r.text())
                answer = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            failed = {"error": f"prefill on {prefiller}: {type(e).__name__}"}
            return doc, web.json_response(failed, status=502)
        params = answer.get(transfer.PARAMS) if isinstance(answer, dict) else None
        return ({**doc, transfer.PARAMS: params} if params is not None else doc), None

    async def _await_room(self, room: transfer.Room) -> tuple[int, str]:
        """The full blocks the prefill engine of ``room`` offers, once it has prefilled the prompt, and
        that engine's revision."""
        url = f"http://{room.host}:{room.port}/fake/rooms/{room.room}"
        timeout = aiohttp.ClientTimeout(total=self.config.room_timeout_s + 5)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as s, s.get(url) as r:
                if r.status != 200:
                    raise RequestError(
                        f"bootstrap room {room.room}: HTTP {r.status}", "bootstrap_room", status=500
                    )
                answer = await r.json()
                return int(answer["blocks"]), str(answer.get(transfer.REVISION) or "")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise RequestError(
                f"bootstrap room {room.room}: {type(e).__name__}", "bootstrap_room", status=500
            ) from None

    async def _reset_prefix_cache(self, _request: web.Request) -> web.Response:
        self.reset_prefix_cache()
        return web.Response(status=200)

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(status=503 if time.monotonic() < self.unhealthy_until else 200)

    async def _models(self, _request: web.Request) -> web.Response:
        model = {
            "id": self.config.model,
            "object": "model",
            "created": 0,
            "owned_by": "routerfleet",
            "root": self.config.model,
            "max_model_len": self.config.max_model_len,
        }
        adapters = [
            {**model, "id": name, "root": f"/adapters/{name}", "parent": self.config.model}
            for name in self.config.lora_modules
        ]
        return web.json_response({"object": "list", "data": [model, *adapters]})

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _server_info(self, _request: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response(
            {
                "kv_events": {
                    "publisher": "zmq",
                    "endpoint_host": cfg.zmq_host,  # "*" = use the host of this server's URL
                    "endpoint_port_base": self.publisher.kv_port_base,
                    "replay_port_base": self.publisher.replay_port_base,
                    "topic": cfg.topic,
                    "block_size": cfg.block_size,
                    "dp_size": cfg.dp_size,
                    "dialect": str(cfg.dialect),
                },
                "incarnation": self.incarnation,
                "model": cfg.model,
                "model_path": cfg.model,
                "dp_size": cfg.dp_size,
                "page_size": cfg.block_size,
                "speculative_algorithm": None,
                **(
                    {"storage_id": self.storage.storage_id, "storage_epoch": self.storage.epoch}
                    if self.storage is not None
                    else {}
                ),
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_messages, messages_error)

    async def _count_tokens(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(count_tokens(parse_json_body(await request.read())))
        except RequestError as e:
            return web.json_response(messages_error(e), status=e.status)

    async def _native_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_generate)

    async def _token_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_token_generate)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """The engines' tokenize endpoint: a ``prompt`` or chat ``messages`` -> the token IDs a
        completion or chat completion of it would run on (``{"count", "max_model_len", "tokens"}``)."""
        faults = self.tokenize_faults
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if faults.status != 200:
            return web.json_response({"error": {"message": "injected fault"}}, status=faults.status)
        try:
            tokens = tokenize_request(parse_json_body(await request.read()))
        except RequestError as e:
            return bad_request(e)
        return web.json_response(
            {
                "count": len(tokens),
                "max_model_len": self.config.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            return web.json_response({"prompt": detokenize_request(parse_json_body(await request.read()))})
        except RequestError as e:
            return bad_request(e)

    def _pooling(self, shape: Callable[[Any, str], dict]):
        """A pooling endpoint (pooling_api.py): its JSON body -> ``shape``'s answer."""

        async def handler(request: web.Request) -> web.Response:
            try:
                return web.json_response(shape(parse_json_body(await request.read()), self.config.model))
            except RequestError as e:
                return bad_request(e)

        return handler

    async def _transcription(self, request: web.Request) -> web.Response:
        """OpenAI's audio transcription: a multipart form with ``file`` (and ``model``); the "text" says
        how many bytes of audio arrived, so a test can tell the whole form got through."""
        if not request.content_type.startswith("multipart/"):
            return bad_request(RequestError("expected a multipart/form-data body", "file"))
        size, model = None, self.config.model
        async for part in await request.multipart():
            if part.name == "file":
                size = len(await part.read())
            elif part.name == "model":
                model = await part.text()
        if size is None:
            return bad_request(RequestError("'file' is required", "file"))
        return web.json_response({"text": f"{size} bytes of audio", "model": model})

    def _pick_rank(self, req: GenerationRequest, request: web.Request) -> int:
        rank = req.rank
        if rank is None and RANK_HEADER in request.headers:
            try:
                rank = int(request.headers[RANK_HEADER])
            except ValueError:
                raise RequestError(f"{RANK_HEADER} must be an integer", "data_parallel_rank") from None
        if rank is None:
            return next(self._round_robin)
        if not 0 <= rank < self.config.dp_size:
            raise RequestError(
                f"data_parallel_rank {rank} out of range for dp_size {self.config.dp_size}",
                "data_parallel_rank",
            )
        return rank

    @contextlib.asynccontextmanager
    async def _slot(self, rank: int) -> AsyncIterator[None]:
        """Hold one of ``max_concurrency`` running slots; beyond that, requests wait (FIFO). Counted for
        the engine and for ``rank``, as the engines' running/waiting gauges count them."""
        both = (self.load, self.rank_load[rank])
        for s in both:
            s.waiting += 1
        try:
            if self._slots is not None:
                await self._slots.acquire()
        finally:
            for s in both:
                s.waiting -= 1
        for s in both:
            s.running += 1
        try:
            yield
        finally:
            for s in both:
                s.running -= 1
            if self._slots is not None:
                self._slots.release()

    def _adapter(self, name: str | None) -> contextlib.AbstractAsyncContextManager:
        """The request's LoRA adapter held resident while it runs (adapters.py), when slots are modeled."""
        if name is None or self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.use(name)

    async def _generate(
        self,
        request: web.Request,
        parse: Callable[[Any], GenerationRequest],
        errors: Callable[[RequestError], dict[str, Any]] = RequestError.to_json,
    ) -> web.StreamResponse:
        self.traceparents.append(request.headers.get("traceparent"))
        self._received(request)
        try:
            doc = parse_json_body(await request.read())
            prefiller = request.headers.get(transfer.SIDECAR_HEADER) if self.config.pd_sidecar else None
            if prefiller and request.path in transfer.SIDECAR_PATHS and isinstance(doc, dict):
                rank_header = request.headers.get(RANK_HEADER)
                doc, failed = await self._sidecar_prefill(prefiller, request.path, doc, rank_header)
                if failed is not None:
                    return failed
            req = parse(doc)
            try:
                remote = transfer.remote_of(doc) if self.config.kv_transfer else None
                room = transfer.room_of(doc) if self.config.disaggregation_mode else None
            except transfer.TransferError as e:
                raise RequestError(str(e), transfer.PARAMS) from None
            mode = self.config.disaggregation_mode if room is not None else ""
            if self.config.disaggregation_mode == "decode" and room is None:  # as SGLang's decode mode
                raise RequestError(
                    "a decode-mode server needs bootstrap_room (a prefill to pair with)", "bootstrap_room"
                )
            if mode == "prefill":  # SGLang's prefill answers its first token only
                req = dataclasses.replace(req, max_tokens=min(req.max_tokens, 1))
            rank = self._pick_rank(req, request)
            n, limit = len(req.prompt_tokens), self.config.max_model_len
            if n + req.max_tokens > limit:
                raise RequestError(
                    f"This model's maximum context length is {limit} tokens. However, you requested"
                    f" {n + req.max_tokens} tokens ({n} in the prompt, {req.max_tokens} in the completion).",
                    "max_tokens",
                )
        except RequestError as e:
            return web.json_response(errors(e), status=e.status)
        cfg = self.config
        if req.namespace.lora_name is None and req.model in cfg.lora_modules:  # vLLM: model names it
            req = dataclasses.replace(req, namespace=dataclasses.replace(req.namespace, lora_name=req.model))
        adapter = req.namespace.lora_name
        async with self._slot(rank), self._adapter(adapter):
            admission = self.admit(rank, req.prompt_tokens, req.namespace)
            # Numbered in admission order (nothing awaits between the two), so each response's
            # cached_tokens can be checked against a replay of the prompts in id order.
            serial = next(self._request_ids)
            cached = admission.cached_tokens
            n_prompt = len(req.prompt_tokens)
            stats = self.rank_stats[rank]
            received = 0
            offered: int | None = None
            theirs = ""
            if (remote is not None and remote.decode) or mode == "prefill":
                stats.prefill_legs += 1
            elif remote is not None and remote.prefill_blocks is not None:
                offered, theirs = remote.prefill_blocks, remote.revision
            elif mode == "decode" and room is not None:
                try:
                    offered, theirs = await self._await_room(room)
                except RequestError as e:
                    return web.json_response(errors(e), status=e.status)
            if offered is not None and not transfer.compatible(cfg.revision, theirs):
                stats.cross_revision += 1
                e = RequestError(
                    f"cross-revision KV transfer refused: prefilled by revision {theirs!r}, this engine is"
                    f" {cfg.revision!r}",
                    transfer.PARAMS,
                    status=500,
                )
                return web.json_response(errors(e), status=e.status)
            if offered is not None:
                received = transfer.received_blocks(n_prompt, cached, offered, cfg.block_size)
                stats.decode_legs += 1
                stats.received_blocks += received
                await _sleep(received * cfg.transfer_us_per_block / 1e6)
                cached += received * cfg.block_size
            stats.requests[req.kind] = stats.requests.get(req.kind, 0) + 1
            stats.prompt_tokens += n_prompt
            stats.cached_tokens += cached
            log.debug("request rank=%d prompt_tokens=%d cached_tokens=%d", rank, n_prompt, cached)

            compute = self.compute[rank]
            await compute.prefill((n_prompt - cached) * cfg.prefill_us_per_token / 1e6)  # uncached only
            if mode == "prefill" and room is not None:
                ready, blocks = self._room_entry(room.room)
                blocks[0] = n_prompt // cfg.block_size
                ready.set()
            output = generate_tokens(req.prompt_tokens, req.max_tokens)
            text = decode(output)
            shape = self._shape(req, serial)
            usage = Usage(n_prompt, len(output), cached)
            headers = {RANK_HEADER: str(rank), INCARNATION_HEADER: self.incarnation}
            try:
                if req.stream:
                    response = await self._stream(request, req, shape, output, usage, headers, compute)
                else:
                    async for _ in paced(len(output), cfg.decode_tokens_per_s, compute):
                        pass
                    body = shape.full(text, usage)
                    if remote is not None and remote.decode:
                        body[transfer.PARAMS] = transfer.answer_params(
                            self.incarnation, cfg.host, self.port, n_prompt, cfg.block_size, cfg.revision
                        )
                    self._keep(req, shape, text, usage)
                    response = web.json_response(body, headers=headers)
            finally:
                # Counted even if the client went away mid-stream: the engine did the work.
                stats.generation_tokens += len(output)
                if cfg.cache_generated and output:
                    self.admit(rank, (*req.prompt_tokens, *output), req.namespace)
            return response

    def _shape(self, req: GenerationRequest, serial: int) -> Shape:
        """The answer's shape for the request's API; its id is unique for this incarnation."""
        tag = f"{self.incarnation[:8]}-{serial}"
        model = req.model or self.config.model
        if req.kind is Kind.RESPONSES:
            chosen = req.fields.get(CHOSEN_ID)  # vLLM's: the client may choose the id
            return ResponsesShape(chosen or f"resp_{self.incarnation}{serial:08x}", model, req.fields)
        if req.kind is Kind.MESSAGES:
            return MessagesShape(f"msg_{self.incarnation}{serial:08x}", model)
        if req.kind is Kind.GENERATE:
            return GenerateShape(tag)
        if req.kind is Kind.TOKEN_GENERATE:
            return TokenGenerateShape(tag)
        prefix = "cmpl" if req.kind is Kind.COMPLETION else "chatcmpl"
        header = ResponseHeader(id=f"{prefix}-{tag}", created=int(time.time()), model=model, kind=req.kind)
        return ChatShape(header, req.include_usage)

    def _keep(self, req: GenerationRequest, shape: Shape, text: str, usage: Usage) -> None:
        """A stored response keeps its conversation (before the client can see its end)."""
        if isinstance(shape, ResponsesShape) and req.fields.get("store"):
            history = (*req.messages, {"role": "assistant", "content": text})
            self.responses.put(shape.id, StoredResponse(history, shape.full(text, usage)))

    async def _stream(
        self,
        request: web.Request,
        req: GenerationRequest,
        shape: Shape,
        output: list[int],
        usage: Usage,
        headers: dict[str, str],
        compute: Compute | Alone,
    ) -> web.StreamResponse:
        """SSE in the shape of the request's API, one event per generated token, paced at the decode
        rate (a token waits while the rank prefills, with shared compute). As vLLM and SGLang stream: no
        usage in a chat stream unless asked for."""
        response = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await response.prepare(request)
        try:
            for event in shape.opening(usage):
                await response.write(event)
            async for i in paced(len(output), self.config.decode_tokens_per_s, compute):
                await response.write(shape.delta(decode([output[i]]), i, i == len(output) - 1))
            text = decode(output)
            self._keep(req, shape, text, usage)
            for event in shape.closing(text, usage):
                await response.write(event)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            log.debug("client went away mid-stream")
            raise
        return response

    # ------------------------------------------------------- stored responses

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: parse_responses(body, self.responses))

    def _received(self, request: web.Request) -> None:
        self.received_headers.append(tuple((k.lower(), v) for k, v in request.headers.items()))

    async def _get_response(self, request: web.Request) -> web.Response:
        self._received(request)
        response_id = request.match_info["response_id"]
        stored = self.responses.get(response_id)
        if stored is None:
            return bad_request(not_found(response_id, "response_id"))
        return web.json_response(stored.body)

    async def _delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if not self.responses.delete(response_id):
            return bad_request(not_found(response_id, "response_id"))
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def _cancel_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        if self.responses.get(response_id) is None:
            return bad_request(not_found(response_id, "response_id"))
        return bad_request(RequestError("Cannot cancel a synchronous response."))


async def _sleep(seconds: float) -> None:
    if seconds > 0:
        await asyncio.sleep(seconds)


@contextlib.asynccontextmanager
async def run_fake_engine(
    config: FakeEngineConfig | None = None, *, clock: Callable[[], float] = time.time, **overrides: Any
) -> AsyncIterator[FakeEngine]:
    """Start a fake engine in this event loop for the duration of the block.

    ``overrides`` replace config fields: ``run_fake_engine(dp_size=2, block_size=4)``. The default
    config binds 127.0.0.1 on free ports, so any number of engines can run side by side.
    """
    config = dataclasses.replace(config or FakeEngineConfig(), **overrides)
    engine = FakeEngine(config, clock=clock)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()
