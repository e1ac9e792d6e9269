"""The engine a request naming a stored response must go to (``sessions/bindings.py``), or the clear
error that says why it cannot go anywhere.

Lookup order: this replica's table, the fleet's shared store (hard deadline), then the engines
themselves: ``GET /v1/responses/{id}`` on one target of each routable engine at once, under
``probe_timeout_s``; the first 200 answers (it holds the response) and is bound. The probe makes a
fleet without a shared store correct, at one fan-out per response id a replica has not seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import aiohttp

from ..http_body import STATUS_ONLY, read_capped
from ..scheduling.types import Kind, Target
from ..sessions.bindings import ResponseBindings, Source, Verdict, resolve
from ..sessions.store import Remembered
from .errors import ProxyError
from .rewrite import without_member

# The Responses API's request field vLLM takes as the new response's id (``ResponsesResponse``'s ``id``).
CHOSEN_ID = "request_id"


def without_chosen_id(raw: bytes, body: Any, kind: Kind) -> tuple[bytes, Any]:
    """A Responses request without ``request_id``: vLLM would make it the stored response's id, which the
    router binds to the engine that served it (and to the caller's tenant). A client choosing it could
    name another's response, and so read, continue or delete it through its own binding, or move
    another's binding to its engine; the engine's own id is unguessable (pure: rewrite.py)."""
    if kind is not Kind.RESPONSES or not isinstance(body, dict):
        return raw, body
    return without_member(raw, body, CHOSEN_ID)


def unstored(body: Any, kind: Kind) -> bool:
    """A Responses request with ``store: false``: its answer is kept nowhere, so its id is bound to no
    engine (a binding would only push a live one out of the store)."""
    return kind is Kind.RESPONSES and isinstance(body, dict) and body.get("store") is False


def response_error(verdict: Verdict, response_id: str, param: str) -> ProxyError:
    """What a request naming ``response_id`` is answered when it cannot go to its engine."""
    rid = response_id[:256]
    if verdict is Verdict.GONE:
        return ProxyError(
            404,
            f"Response with id '{rid}' was stored on an engine that has restarted or left the fleet;"
            " its context is lost (send the conversation again without it).",
            param=param,
            code="response_engine_gone",
        )
    if verdict is Verdict.UNAVAILABLE:
        return ProxyError(
            503,
            f"The engine holding response '{rid}' cannot take requests right now (unhealthy or"
            " unreachable); retry later.",
            type_="service_unavailable",
            param=param,
            code="response_engine_unavailable",
            outcome="no_engine",
        )
    return ProxyError(
        404,
        f"Response with id '{rid}' not found: no engine in this fleet holds it.",
        param=param,
        code="response_not_found",
    )


class ResponseRouter:
    def __init__(self, bindings: ResponseBindings, session: Callable[[], aiohttp.ClientSession]) -> None:
        self.bindings = bindings
        self._session = session

    async def target(
        self,
        response_id: str,
        targets: Sequence[Target],
        headers: Mapping[str, str],
        param: str,
        tenant: str = "",
    ) -> Target:
        """The target holding ``response_id`` among ``targets`` (``tenant``'s: another tenant's id is not
        found); raises the ProxyError that says why there is none. Tenants are never probed for: an
        engine answering a probe would hand one tenant another's response unless it checks the key."""
        b = self.bindings
        bound, source = await b.find(response_id, tenant)
        if bound is None and b.config.probe_timeout_s > 0 and targets and not tenant:
            bound = await self._probe(response_id, targets, headers)
            if bound is not None:
                source = Source.PROBE
        b.metrics.lookup(source)
        if bound is None and source is Source.STORE_UNAVAILABLE:  # not known here; the store may know it
            raise ProxyError(
                503,
                f"Response '{response_id[:256]}' is not known to this router and the fleet's shared store"
                " could not be asked; retry shortly.",
                type_="service_unavailable",
                param=param,
                code="response_store_unavailable",
                outcome="no_engine",
                headers={"Retry-After": "1"},
            )
        verdict, target = resolve(bound, targets, b.incarnations())
        b.metrics.verdict(verdict)
        if target is None:
            raise response_error(verdict, response_id, param)
        return target

    async def _probe(
        self, response_id: str, targets: Sequence[Target], headers: Mapping[str, str]
    ) -> Remembered | None:
        """Ask one target of each engine whether it holds the response; bind the first that does."""
        per_engine: dict[str, Target] = {}
        for t in targets:
            per_engine.setdefault(t.engine, t)
        path = "/v1/responses/" + quote(response_id, safe="")
        # The client's credentials only: its other headers describe its own request (its body's length).
        auth = headers.get("Authorization")
        probe_headers = {"Authorization": auth} if auth is not None else {}
        timeout = aiohttp.ClientTimeout(total=self.bindings.config.probe_timeout_s)
        session = self._session()

        async def ask(t: Target) -> Target | None:
            async with session.get(t.url + path, headers=probe_headers, timeout=timeout) as r:
                await read_capped(r.content, STATUS_ONLY)
                return t if r.status == 200 else None

        tasks = [asyncio.ensure_future(ask(t)) for t in per_engine.values()]
        found: Target | None = None
        try:
            for next_done in asyncio.as_completed(tasks, timeout=self.bindings.config.probe_timeout_s):
                # an engine that fails or does not answer in time does not hold it for us
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    found = await next_done
                if found is not None:
                    break
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return None if found is None else await self.bindings.bind(response_id, found)
