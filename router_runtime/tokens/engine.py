"""``--tokenizer engine``: the engines tokenize for the router (docs/tokens.md).

For a model whose template the router cannot reproduce locally, the engine's own tokenize endpoint
gives the exact IDs: vLLM's ``POST /tokenize`` (always served; the render endpoints need
``--enable-scale-out``), SGLang's ``POST /v1/tokenize``. A request never waits long for it: one call
to one healthy engine in turn, under a hard deadline; a timeout, an error or an answer that does not
vet routes the request without tokens (counted as ``engine_timeout`` / ``engine_error``), and it is
still served. The request goes as the client wrote it (key order included: a template's ``tojson``
shows it). Answers are kept briefly (``CACHE_TTL_S``, ``CACHE_BYTES`` in all) under a digest of what
was asked, so a retried request costs one call and a redeployed template is not served stale for long.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import aiohttp

from ..http_body import read_capped
from .chat import Family, Reason, Untokenizable, completion_flags, malformed_is_rejected

MAX_ANSWER_BYTES = 16 << 20  # a tokenize answer larger than this is refused (about 2M token IDs)
CACHE_TTL_S = 30.0
CACHE_BYTES = 64 << 20  # the cached token IDs, all entries together

# What each engine's tokenize endpoint accepts of a chat request (it ignores other keys, so a request
# that needs one it cannot take is refused rather than tokenized differently).
_VLLM_CHAT_KEYS = (
    "messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template", "chat_template_kwargs",
)  # fmt: skip
_SGLANG_CHAT_KEYS = ("messages", "tools", "tool_choice", "reasoning_effort", "continue_final_message",
                     "chat_template_kwargs")  # fmt: skip


def tokenize_body(body: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """A chat request as the engine family's tokenize endpoint takes it (pure). Raises Untokenizable
    for a field the endpoint would silently drop."""
    if family is Family.SGLANG:
        # Without add_generation_prompt, SGLang renders it exactly as a chat completion.
        return {k: body[k] for k in _SGLANG_CHAT_KEYS if body.get(k) is not None}
    if body.get("documents") is not None:
        raise Untokenizable(Reason.UNSUPPORTED, "vLLM's /tokenize takes no 'documents'")
    out = {k: body[k] for k in _VLLM_CHAT_KEYS if body.get(k) is not None}
    effort = body.get("reasoning_effort")
    if effort is not None:  # what the chat path derives from it: template variables above the kwargs
        kwargs = dict(out.get("chat_template_kwargs") or {})
        kwargs["reasoning_effort"] = effort
        kwargs.setdefault("enable_thinking", effort != "none")
        out["chat_template_kwargs"] = kwargs
    return out


def vet_tokens(raw: bytes) -> array:
    """An engine's tokenize answer -> its token IDs: the one way its bytes become usable. Raises
    ValueError unless they are JSON of an object whose ``tokens`` is a list of integers in [0, 2**32)
    (a bool is not one)."""
    try:
        answer = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deep") from None
    if not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
        raise ValueError("no 'tokens' list")
    tokens = answer["tokens"]
    if any(type(t) is not int for t in tokens):
        raise ValueError("'tokens' holds a value that is not an integer")
    try:
        return array("I", tokens)
    except OverflowError:
        raise ValueError("a token ID outside [0, 2**32)") from None


# How this task's last tokenization was answered ("cache" or "engine"): read by a trace (each request
# runs in its own task, so its own call's answer is what it reads).
ANSWERED_BY: ContextVar[str] = ContextVar("routerfleet_tokenize_answered_by", default="")


class EngineTokenizer:
    """The async tokenizer interface of ``AsyncTokenizer``, answered by the engines.

    ``engines`` gives the base URLs of the engines that may be asked now (healthy ones)."""

    name = "engine"

    def __init__(
        self,
        engines: Callable[[], Sequence[str]],
        family: Family = Family.VLLM,
        *,
        timeout_s: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engines = engines
        self.family = family
        self.timeout_s = timeout_s
        self.clock = clock
        self._cache: OrderedDict[bytes, tuple[float, array]] = OrderedDict()  # digest -> (expiry, IDs)
        self._cache_bytes = 0
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    @property
    def path(self) -> str:
        return "/v1/tokenize" if self.family is Family.SGLANG else "/tokenize"

    async def prompt(self, text: str, body: Mapping[str, Any], size: int) -> Sequence[int]:
        """A completion prompt's IDs, with the special tokens the engine's completion path adds."""
        with malformed_is_rejected():
            flags = completion_flags(body, self.family)
            return await self._ask({"prompt": text, "add_special_tokens": flags.add_special_tokens})

    async def chat_ids(self, body: Mapping[str, Any], size: int) -> Sequence[int]:
        with malformed_is_rejected():
            return await self._ask(tokenize_body(body, self.family))

    async def chat_text(self, body: Mapping[str, Any], size: int) -> str:
        raise Untokenizable(Reason.UNSUPPORTED, "the engines' tokenize endpoints return no prompt text")

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _ask(self, request: dict[str, Any]) -> array:
        if self._closed:
            raise Untokenizable(Reason.ENGINE_ERROR, "the router is stopping")
        raw = json.dumps(request, separators=(",", ":")).encode()  # ASCII: a lone surrogate stays escaped
        key = hashlib.blake2b(raw, digest_size=16).digest()
        now = self.clock()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            self._cache.move_to_end(key)
            ANSWERED_BY.set("cache")
            return hit[1]
        engines = self.engines()
        if not engines:
            raise Untokenizable(Reason.ENGINE_ERROR, "no healthy engine to tokenize")
        url = engines[self._turn % len(engines)] + self.path
        self._turn += 1
        try:
            tokens = await asyncio.wait_for(self._post(url, raw), self.timeout_s)
        except TimeoutError:
            raise Untokenizable(Reason.ENGINE_TIMEOUT, "the engine's tokenize missed its deadline") from None
        except (
            aiohttp.ClientError,
            ValueError,
        ) as e:  # unreachable, non-200, or an answer that fails vetting
            raise Untokenizable(
                Reason.ENGINE_ERROR, f"the engine's tokenize failed: {type(e).__name__}"
            ) from None
        self._remember(key, tokens, now)
        ANSWERED_BY.set("engine")
        return tokens

    def _remember(self, key: bytes, tokens: array, now: float) -> None:
        old = self._cache.pop(key, None)
        if old is not None:
            self._cache_bytes -= old[1].itemsize * len(old[1])
        size = tokens.itemsize * len(tokens)
        if size > CACHE_BYTES:
            return
        self._cache[key] = (now + CACHE_TTL_S, tokens)
        self._cache_bytes += size
        while self._cache_bytes > CACHE_BYTES:
            _, (_, gone) = self._cache.popitem(last=False)
            self._cache_bytes -= gone.itemsize * len(gone)

    async def _post(self, url: str, raw: bytes) -> array:
        if self._session is None:
            # Its own small pool: tokenize calls never take a connection the proxy would use.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit_per_host=4, keepalive_timeout=4.0)
            )
        headers = {"Content-Type": "application/json"}
        async with self._session.post(url, data=raw, headers=headers) as r:
            if r.status != 200:
                raise ValueError(f"HTTP {r.status}")
            body = await read_capped(r.content, MAX_ANSWER_BYTES)
        if body is None:
            raise ValueError("answer too large")
        return vet_tokens(body)
