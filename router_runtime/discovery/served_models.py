"""Which model names the engines serve as LoRA adapters: each engine's ``/v1/models``, read at an
interval.

vLLM's OpenAI server selects an adapter by the request's ``model`` (``--lora-modules NAME=PATH``, or one
loaded at runtime), lists each adapter in ``/v1/models`` with ``parent`` naming its base model, and
stores the request's blocks in the adapter's namespace (its KV events carry ``lora_name``). A router that
hashed such a request's prompt in the base model's namespace would credit blocks the base model cached
for the same prefix: a false hit. So a request whose ``model`` is an adapter here is routed in that
adapter's namespace (``proxy/scheduler.py``). An engine whose read fails keeps its last answer; one
that leaves discovery takes its adapters along.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping

import aiohttp

from ..http_body import read_capped

log = logging.getLogger(__name__)

MAX_BYTES = 4 << 20  # of one engine's answer; past it, that engine did not answer
MAX_ADAPTERS = 4096  # per engine
_MAX_NAME = 512


async def read_models(
    session: aiohttp.ClientSession,
    url: str,
    headers: Mapping[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> list:
    """The ``data`` list of an engine's ``/v1/models`` answer (the proxy's merged listing reads it too);
    ValueError when the engine does not answer one (a status, a page over ``MAX_BYTES``, no list)."""
    async with session.get(url + "/v1/models", headers=headers, timeout=timeout) as r:
        if r.status != 200:
            raise ValueError(f"status {r.status}")
        raw = await read_capped(r.content, MAX_BYTES)
        if raw is None:
            raise ValueError(f"an answer over {MAX_BYTES} bytes")
    body = json.loads(raw)
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise ValueError("no data list")
    return data


def adapters_in(data: list) -> frozenset[str]:
    """The adapters among an OpenAI-style ``/v1/models`` answer's models: entries with a ``parent``
    (their base model) other than themselves. Anything else on the page is ignored."""
    out = set()
    for m in data:
        if not isinstance(m, dict):
            continue
        name, parent = m.get("id"), m.get("parent")
        named = isinstance(name, str) and 0 < len(name) <= _MAX_NAME
        if named and isinstance(parent, str) and parent and name != parent:
            out.add(name)
        if len(out) >= MAX_ADAPTERS:
            break
    return frozenset(out)


class ServedModels:
    """Reads every engine's ``/v1/models`` each ``interval_s`` (concurrently, each with a deadline);
    ``adapters`` is the union of their latest answers."""

    def __init__(self, urls: Callable[[], Mapping[str, str]], interval_s: float, timeout_s: float = 2.0):
        self.urls = urls
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.adapters: frozenset[str] = frozenset()
        self._by_engine: dict[str, frozenset[str]] = {}

    async def run(self) -> None:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=1),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        ) as session:
            while True:
                urls = dict(self.urls())
                answers = await asyncio.gather(*(self._read(session, url) for url in urls.values()))
                held = self._by_engine
                self._by_engine = {
                    engine: answer if answer is not None else held.get(engine, frozenset())
                    for engine, answer in zip(urls, answers, strict=True)
                }
                self.adapters = frozenset().union(*self._by_engine.values())
                await asyncio.sleep(self.interval_s)

    async def _read(self, session: aiohttp.ClientSession, url: str) -> frozenset[str] | None:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError, ValueError, RecursionError):
            return adapters_in(await read_models(session, url))
        return None
