"""The remote prefill step of a disaggregated fleet, between the decode decision and the decode request:
the decider's verdict, then (when remote) the prefill leg, bounded, retried once on another prefill
engine, and the decode leg's body and headers. It never fails a request: with no transfer parameters
the decode engine prefills the prompt itself (slower, never wrong), and the verdict says why.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

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
from . import sglang, vllm
from .config import DisaggregationConfig, Protocol
from .decider import Need, Verdict, need, paired
from .metrics import PdMetrics

REQUEST_ID = "X-Request-Id"
_ANSWER_CAP = 1 << 20  # a one-token answer with its transfer parameters


class PrefillFailed(Exception):
    """A prefill leg the decode leg depends on failed (SGLang: the decode engine would wait for its
    room in vain): the request is answered with this reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the prefill engine failed ({reason})")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode request carries: its body, headers beside the client's, and how the prompt was
    prefilled (with the prefill engine, when remote). ``ready``: a prefill leg running beside the decode
    leg (SGLang's), which raises ``PrefillFailed``; the decode's answer is relayed once it is done."""

    body: bytes
    headers: Mapping[str, str]
    verdict: Verdict
    prefill: Target | None = None
    transferred_tokens: int = 0  # at most what the decode engine takes from the prefill engine
    ready: asyncio.Future[None] | None = None


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
        if self.config.protocol == Protocol.SGLANG:
            leg = self._sglang(prompt, decision, path, headers, trace)
        else:
            verdict, params, prefill, moved = await self._vllm(prompt, decision, path, request_id, trace)
            # Never the client's own parameters, whatever the API.
            leg = DecodeLeg(
                vllm.decode_body(prompt.raw, prompt.body, params), headers, verdict, prefill, moved
            )
        self.metrics.verdict(leg.verdict)
        return leg

    def _wanted(self, prompt: Prompt, decision: Decision) -> Need:
        tokens, index = prompt.route.tokens, prompt.index
        n = len(tokens) if tokens is not None and index is not None else None
        block_size = index.block_size if index is not None else 1
        return need(decision, n, block_size, self.config.threshold_tokens)

    def _choose(self, prompt: Prompt, candidates: Sequence[Target]) -> Decision | None:
        route = replace(prompt.route, prefer=None, prefer_vouched=False, pinned=None, subset=None)
        try:
            return self.profile.choose(route, candidates, self.loads, prompt.index)
        except Unschedulable:
            return None

    async def _vllm(
        self, prompt: Prompt, decision: Decision, path: str, request_id: str, trace: Trace
    ) -> tuple[Verdict, vllm.TransferParams | None, Target | None, int]:
        """vLLM's flow: the prefill leg first; its transfer parameters go to the decode leg."""
        if prompt.kind not in vllm.KINDS:
            return Verdict.UNSUPPORTED_API, None, None, 0
        wanted = self._wanted(prompt, decision)
        if not wanted.remote:
            return wanted.verdict or Verdict.SHORT_SUFFIX, None, None, 0
        candidates = paired(self.targets.prefill_candidates(), decision.target, self.targets.revision)
        if not candidates:
            return Verdict.NO_PREFILL_ENGINE, None, None, 0
        body = vllm.prefill_body(prompt.body)
        headers = {REQUEST_ID: request_id}
        for _attempt in (0, 1):
            chosen = self._choose(prompt, candidates)
            if chosen is None:
                break
            answer = await self._leg(prompt, chosen, path, body, headers, trace)
            params = vllm.vet_answer(answer) if answer is not None else None
            if answer is not None and params is None:
                self.metrics.leg_failures.labels("no_transfer_params").inc()
            if params is not None:
                moved = wanted.uncached_tokens or 0
                self.metrics.remote_tokens.inc(moved)
                return Verdict.REMOTE, params, chosen.target, moved
            candidates = tuple(t for t in candidates if t.engine != chosen.target.engine)
            if not candidates:
                break
        return Verdict.PREFILL_FAILED, None, None, 0

    def _sglang(
        self, prompt: Prompt, decision: Decision, path: str, headers: dict[str, str], trace: Trace
    ) -> DecodeLeg:
        """SGLang's flow: both legs at once, paired by a bootstrap room; a decode engine cannot prefill by
        itself, so without a prefill engine the request fails clearly."""
        if prompt.kind not in sglang.KINDS:
            raw, _ = sglang.without_bootstrap(prompt.raw, prompt.body)
            return DecodeLeg(raw, headers, Verdict.UNSUPPORTED_API)
        candidates = paired(self.targets.prefill_candidates(), decision.target, self.targets.revision)
        chosen = self._choose(prompt, candidates) if candidates else None
        if chosen is None:
            self.metrics.verdict(Verdict.NO_PREFILL_ENGINE)
            raise PrefillFailed("no prefill engine of the decode engine's revision")
        target = chosen.target
        port = self.targets.bootstrap_port(target.engine) or sglang.DEFAULT_BOOTSTRAP_PORT
        room = sglang.Room.new(_host(target), port)
        body = sglang.with_room(prompt.raw, prompt.body, room)
        moved = self._wanted(prompt, decision).uncached_tokens or 0

        async def prefilled() -> None:
            if await self._leg(prompt, chosen, path, body, headers, trace) is None:
                raise PrefillFailed("no answer")
            self.metrics.remote_tokens.inc(moved)

        return DecodeLeg(body, headers, Verdict.REMOTE, target, moved, asyncio.ensure_future(prefilled()))

    def _audit(self, chosen: Decision, cached: int, block_size: int) -> None:
        """The prefill leg's audit: the prefill engine's cached tokens against the prefix its decision
        credited (the decode leg's is the proxy's, with the transfer expected: proxy/audit.py)."""
        audit = judge(Prediction(chosen.matched_blocks * block_size, block_size=block_size), cached)
        self.metrics.prefill_audit(audit)

    async def _leg(
        self,
        prompt: Prompt,
        chosen: Decision,
        path: str,
        body: bytes,
        added: Mapping[str, str],
        trace: Trace,
    ) -> bytes | None:
        """One prefill request, bounded: its whole answer, or None (counted by reason); audited against
        the prefill decision when it reports its cached tokens."""
        target = chosen.target
        tokens, index = prompt.route.tokens, prompt.index
        headers = CIMultiDict(prompt.headers)  # already what an engine may see (proxy/headers.py)
        headers.update(added)
        headers["Content-Type"] = "application/json"
        if target.rank is not None:
            headers[RANK_HEADER] = str(target.rank)
        n = len(tokens) if tokens is not None else 0
        self._acquire(target, n)
        t0 = time.perf_counter()
        reason = "ok"
        span = trace.span("prefill", SpanKind.CLIENT)
        answer = None
        try:
            with span:
                span.update({"routerfleet.engine": target.engine, "routerfleet.rank": target.rank})
                headers.update(trace.headers(span))
                async with asyncio.timeout(self.config.prefill_timeout_s):
                    async with self._session().post(target.url + path, data=body, headers=headers) as up:
                        answer = await read_capped(up.content, _ANSWER_CAP)
                        if up.status != 200:
                            reason, answer = f"status_{up.status // 100}xx", None
                        elif answer is None:
                            reason = "too_large"
                span.set("routerfleet.pd.prefill_ok", answer is not None)
        except TimeoutError:
            reason = "timeout"
        except aiohttp.ClientConnectorError:
            reason = "connect"
            self.health.failure(target.engine)
        except aiohttp.ClientError:
            reason = "upstream_error"
        finally:
            self._release(target, n)
            self.profile.ended(chosen)
            if reason == "ok":
                self.metrics.leg_seconds.observe(time.perf_counter() - t0)
            else:
                self.metrics.leg_failures.labels(reason).inc()
        if answer is not None and tokens is not None and index is not None:
            scan = UsageScan()
            scan.feed(answer)
            if scan.cached_tokens is not None:
                self._audit(chosen, scan.cached_tokens, index.block_size)
        return answer


def _host(target: Target) -> str:
    """The prefill engine's host, as its bootstrap server is reached."""
    return urlsplit(target.url).hostname or ""
