"""The remote prefill step of a disaggregated fleet, between the decode decision and the decode request:
the decider's verdict, then (when remote) the prefill leg, bounded, retried once on another prefill
engine, and the decode leg's body and headers. It never fails a request: with no transfer parameters
the decode engine prefills the prompt itself (slower, never wrong), and the verdict says why.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
from multidict import CIMultiDict

from ..http_body import read_capped
from ..kv.index import RadixIndex
from ..proxy.audit import Prediction, UsageScan, judge
from ..proxy.headers import RANK_HEADER
from ..proxy.health import HealthBoard
from ..proxy.targets import TargetBook
from ..scheduling.framework import Profile, Unschedulable
from ..scheduling.types import Decision, Kind, RouteRequest, Target
from ..tracing.spans import NO_TRACE, SpanKind, Trace
from . import vllm
from .config import DisaggregationConfig
from .decider import Verdict, need, paired
from .metrics import PdMetrics

REQUEST_ID = "X-Request-Id"
_ANSWER_CAP = 1 << 20  # a one-token answer with its transfer parameters


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode request carries: its body, headers beside the client's, and how the prompt was
    prefilled (with the prefill engine, when remote)."""

    body: bytes
    headers: Mapping[str, str]
    verdict: Verdict
    prefill: Target | None = None
    transferred_tokens: int = 0  # at most what the decode engine takes from the prefill engine


@dataclass(frozen=True, slots=True)
class Prompt:
    """The request as both legs need it: its API, the body as the router sends it (raw and parsed), the
    client's headers to pass on, the profile's view of it and the index it was scheduled on."""

    kind: Kind
    raw: bytes
    body: dict[str, Any]
    headers: Mapping[str, str]
    route: RouteRequest
    index: RadixIndex | None


class RemotePrefill:
    def __init__(
        self,
        config: DisaggregationConfig,
        *,
        profile: Profile,
        targets: TargetBook,
        loads: Mapping[Target, float],
        health: HealthBoard,
        metrics: PdMetrics,
        session: Callable[[], aiohttp.ClientSession],
        acquire: Callable[[Target, int], None],
        release: Callable[[Target, int], None],
    ) -> None:
        self.config = config
        self.profile = profile  # chooses among prefill engines (its own instance: its own predictions)
        self.targets = targets
        self.loads = loads
        self.health = health
        self.metrics = metrics
        self._session = session
        self._acquire = acquire
        self._release = release

    async def decode_leg(
        self, prompt: Prompt, decision: Decision, path: str, trace: Trace = NO_TRACE
    ) -> DecodeLeg:
        """The decode request for ``decision`` (the decode engine already chosen)."""
        request_id = prompt.headers.get(REQUEST_ID) or uuid.uuid4().hex
        headers = {REQUEST_ID: request_id}
        verdict, params, prefill, moved = await self._prefilled(prompt, decision, path, request_id, trace)
        self.metrics.verdict(verdict)
        body = vllm.decode_body(prompt.raw, prompt.body, params)  # never the client's own, whatever the API
        return DecodeLeg(body, headers, verdict, prefill, moved)

    async def _prefilled(
        self, prompt: Prompt, decision: Decision, path: str, request_id: str, trace: Trace
    ) -> tuple[Verdict, vllm.TransferParams | None, Target | None, int]:
        if prompt.kind not in vllm.KINDS:
            return Verdict.UNSUPPORTED_API, None, None, 0
        tokens = prompt.route.tokens
        index = prompt.index
        n = len(tokens) if tokens is not None and index is not None else None
        wanted = need(decision, n, index.block_size if index is not None else 1, self.config.threshold_tokens)
        if not wanted.remote:
            return wanted.verdict or Verdict.SHORT_SUFFIX, None, None, 0
        candidates = paired(self.targets.prefill_candidates(), decision.target, self.targets.revision)
        if not candidates:
            return Verdict.NO_PREFILL_ENGINE, None, None, 0
        route = replace(prompt.route, prefer=None, prefer_vouched=False, pinned=None, subset=None)
        body = vllm.prefill_body(prompt.body)
        for _attempt in (0, 1):
            try:
                chosen = self.profile.choose(route, candidates, self.loads, index)
            except Unschedulable:
                break
            target = chosen.target
            with trace.span("prefill", SpanKind.CLIENT) as span:
                span.update({"routerfleet.engine": target.engine, "routerfleet.rank": target.rank})
                params, cached = await self._leg(
                    target, path, body, prompt.headers, request_id, tokens, chosen, trace.headers(span)
                )
                span.set("routerfleet.pd.transfer", params is not None)
            if cached is not None and index is not None and tokens is not None:
                self._audit(chosen, cached, index.block_size)
            if params is not None:
                moved = wanted.uncached_tokens or 0
                self.metrics.remote_tokens.inc(moved)
                return Verdict.REMOTE, params, target, moved
            candidates = tuple(t for t in candidates if t.engine != target.engine)
            if not candidates:
                break
        return Verdict.PREFILL_FAILED, None, None, 0

    def _audit(self, chosen: Decision, cached: int, block_size: int) -> None:
        """The prefill leg's audit: the prefill engine's cached tokens against the prefix its decision
        credited (the decode leg's is the proxy's, with the transfer expected: proxy/audit.py)."""
        audit = judge(Prediction(chosen.matched_blocks * block_size, block_size=block_size), cached)
        self.metrics.prefill_audit(audit)

    async def _leg(
        self,
        target: Target,
        path: str,
        body: bytes,
        client_headers: Mapping[str, str],
        request_id: str,
        tokens: Any,
        decision: Decision,
        trace_headers: Mapping[str, str],
    ) -> tuple[vllm.TransferParams | None, int | None]:
        """One prefill request: its transfer parameters, or None (counted by reason), and the cached
        tokens its usage reports (None: not said)."""
        headers = CIMultiDict(client_headers)  # already what an engine may see (proxy/headers.py)
        headers.update(trace_headers)
        headers[REQUEST_ID] = request_id
        headers["Content-Type"] = "application/json"
        if target.rank is not None:
            headers[RANK_HEADER] = str(target.rank)
        n = len(tokens) if tokens is not None else 0
        self._acquire(target, n)
        t0 = time.perf_counter()
        reason = "ok"
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                async with self._session().post(target.url + path, data=body, headers=headers) as up:
                    answer = await read_capped(up.content, _ANSWER_CAP)
                    if up.status != 200:
                        reason = f"status_{up.status // 100}xx"
                        return None, None
            if answer is None:
                reason = "too_large"
                return None, None
            params = vllm.vet_answer(answer)
            if params is None:
                reason = "no_transfer_params"
            scan = UsageScan()
            scan.feed(answer)
            return params, scan.cached_tokens
        except TimeoutError:
            reason = "timeout"
            return None, None
        except aiohttp.ClientConnectorError:
            reason = "connect"
            self.health.failure(target.engine)
            return None, None
        except aiohttp.ClientError:
            reason = "upstream_error"
            return None, None
        finally:
            self._release(target, n)
            self.profile.ended(decision)
            if reason == "ok":
                self.metrics.leg_seconds.observe(time.perf_counter() - t0)
            else:
                self.metrics.leg_failures.labels(reason).inc()
