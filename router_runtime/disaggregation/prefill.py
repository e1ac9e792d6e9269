"""The remote prefill step of a disaggregated fleet, between the decode decision and the decode request:
the decider's verdict, then (when remote) the prefill leg, bounded, and the decode leg's body and
headers.

vLLM's flow never fails a request: a prefill leg that fails is retried once on another prefill engine,
then the decode engine prefills the prompt itself (slower, never wrong), and the verdict says why.
SGLang's decode engines cannot prefill by themselves: there a failed prefill fails the request clearly.
Every leg carries a request id of the router's own (the engines key the held KV by it: a client's id
could collide with another's), and a client's own transfer or bootstrap fields never reach an engine.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from multidict import CIMultiDict

from ..kv.index import RadixIndex
from ..proxy.audit import Prediction, UsageScan, judge
from ..proxy.headers import RANK_HEADER
from ..proxy.health import HealthBoard
from ..proxy.rewrite import without_member
from ..proxy.targets import TargetBook
from ..scheduling.framework import Profile, Unschedulable
from ..scheduling.types import Decision, Kind, RouteRequest, Target
from ..tracing.context import put_context
from ..tracing.spans import NO_TRACE, SpanKind, Trace
from ..worker import Role
from . import sglang, vllm
from .config import DisaggregationConfig, Protocol
from .decider import Need, Verdict, need, paired, sooner, uncached
from .metrics import PdMetrics
from .queues import PrefillQueues, Queued

REQUEST_ID = "X-Request-Id"
SIDECAR_KINDS = frozenset({Kind.COMPLETION, Kind.CHAT})  # the paths llm-d's routing sidecar serves
_ANSWER_CAP = 1 << 20  # a one-token answer with its transfer parameters (vLLM's; SGLang's is drained)


class PrefillFailed(Exception):
    """A prefill leg the decode leg depends on failed (SGLang: the decode engine would wait for its
    room in vain): the request is answered with this reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"the prefill engine failed ({reason})")
        self.reason = reason


class Unservable(Exception):
    """A request the fleet's protocol cannot serve (SGLang: an API that carries no bootstrap room)."""


@dataclass(frozen=True, slots=True)
class DecodeLeg:
    """What the decode request carries: its body, headers beside the client's, and how the prompt was
    prefilled (with the prefill engine, when remote). ``ready``: a prefill leg running beside the decode
    leg (SGLang's), which raises ``PrefillFailed``; the decode's answer is relayed once it is done.
    ``revision``: the decode engine's, for which a vLLM leg's transfer parameters hold."""

    body: bytes
    headers: Mapping[str, str]
    verdict: Verdict
    prefill: Target | None = None
    transferred_tokens: int = 0  # at most what the decode engine takes from the prefill engine
    ready: asyncio.Future[None] | None = None
    revision: str = ""
    # A prompt the decode engine prefills itself, in its queue until the decode answers its first byte.
    queued: Queued | None = None

    def serves(self, revision: str) -> bool:
        """Whether a retry on a decode engine of ``revision`` can send this leg as it is (a vLLM
        remote prefill's KV waits on its prefill engine for any decode engine of its revision)."""
        return self.ready is None and self.verdict is Verdict.REMOTE and revision == self.revision


@dataclass(frozen=True, slots=True)
class Planned:
    """A decode decision's prefill: ``verdict``, and when it is ``REMOTE`` the prefill engine's decision
    and the tokens it hands the decode engine (its uncached suffix, by the index)."""

    verdict: Verdict
    chosen: Decision | None = None
    moved: int = 0
    queued: Queued | None = None  # ``named``'s: the prompt in its prefill engine's or decode engine's queue


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
        self.queues = PrefillQueues()  # what each target is still to prefill, as this replica sent it

    async def decode_leg(
        self,
        prompt: Prompt,
        decision: Decision,
        path: str,
        trace: Trace = NO_TRACE,
        previous: DecodeLeg | None = None,
        deadline: float | None = None,
    ) -> DecodeLeg:
        """The decode request for ``decision`` (the decode engine already chosen); ``previous``: the leg
        of an attempt whose decode engine could not be reached, reused when it still holds;
        ``deadline``: the request's first byte's (the event loop's clock), which a prefill leg ends by."""
        engine = decision.target.engine
        revision = self.targets.revision(engine)
        # A whole engine prefills its own (``plan``): a leg made for a decode engine never goes to one.
        if previous is not None and self.targets.role(engine) is not Role.BOTH and previous.serves(revision):
            return previous
        headers = {REQUEST_ID: uuid.uuid4().hex}
        if self.config.protocol == Protocol.SGLANG:
            return self._sglang(prompt, decision, path, headers, trace, deadline)
        verdict, params, prefill, moved = await self._vllm(prompt, decision, path, headers, trace, deadline)
        self.metrics.verdict(verdict)
        # Never the client's own parameters, whatever the API.
        body = vllm.decode_body(prompt.raw, prompt.body, params)
        queued = None
        if (
            verdict is not Verdict.REMOTE
            and self.targets.role(engine) is Role.DECODE
            and streams(prompt.body)
        ):
            queued = self.queues.add(decision.target, self._uncached(prompt.route, prompt.index, decision))
        return DecodeLeg(body, headers, verdict, prefill, moved, revision=revision, queued=queued)

    @staticmethod
    def _uncached(route: RouteRequest, index: RadixIndex | None, decision: Decision) -> int:
        """The prompt tokens ``decision``'s target lacks, by the index (0: not tokenized)."""
        if route.tokens is None or index is None:
            return 0
        return uncached(decision, len(route.tokens), index.block_size)

    def _wanted(self, route: RouteRequest, index: RadixIndex | None, decision: Decision) -> Need:
        tokens = route.tokens
        n = len(tokens) if tokens is not None and index is not None else None
        block_size = index.block_size if index is not None else 1
        return need(decision, n, block_size, self.config.threshold_tokens)

    def _choose(
        self, route: RouteRequest, index: RadixIndex | None, candidates: Sequence[Target]
    ) -> Decision | None:
        route = replace(route, prefer=None, prefer_vouched=False, pinned=None, subset=None)
        try:
            return self.profile.choose(route, candidates, self.loads, index)
        except Unschedulable:
            return None

    def plan(
        self,
        kind: Kind,
        route: RouteRequest,
        index: RadixIndex | None,
        decision: Decision,
        skip: Collection[str] = (),
        *,
        kinds: Collection[Kind] | None = None,
        same_rank: bool = False,
    ) -> Planned:
        """Whether ``decision``'s decode engine takes a remote prefill, and from which prefill engine
        (its decision made: the prefill profile counts it until ``ended``), none of ``skip``'s engines
        (``kinds``: the APIs a remote prefill can carry, the protocol's by default; ``same_rank``: only
        targets the decode target's rank header reaches). vLLM's flow: by the decider; SGLang's: always
        (its decode engines cannot prefill alone)."""
        if self.targets.role(decision.target.engine) is Role.BOTH:  # a whole engine: prefills its own
            return Planned(Verdict.WHOLE_ENGINE)
        sglang_ = self.config.protocol == Protocol.SGLANG
        if kind not in (kinds if kinds is not None else sglang.KINDS if sglang_ else vllm.KINDS):
            return Planned(Verdict.UNSUPPORTED_API)
        wanted = self._wanted(route, index, decision)
        if not wanted.remote and not sglang_:
            return Planned(wanted.verdict or Verdict.SHORT_SUFFIX)
        candidates = paired(self.targets.prefill_candidates(), decision.target, self.targets.revision)
        rank = decision.target.rank
        candidates = tuple(
            t for t in candidates if t.engine not in skip and (not same_rank or _runs_rank(t, rank))
        )
        # Behind backed-up prefill engines the decode engine starts it sooner (a threshold of 0 is always
        # remote; SGLang's decode engines cannot prefill alone).
        if candidates and self.config.threshold_tokens and not sglang_:
            candidates = sooner(candidates, decision.target, self.queues.get, self.config.threshold_tokens)
            if not candidates:
                return Planned(Verdict.PREFILL_BUSY)
        chosen = self._choose(route, index, candidates) if candidates else None
        if chosen is None:
            return Planned(Verdict.NO_PREFILL_ENGINE)
        return Planned(Verdict.REMOTE, chosen, wanted.uncached_tokens or 0)

    def named(
        self, kind: Kind, route: RouteRequest, index: RadixIndex | None, decision: Decision, streamed: bool
    ) -> Planned:
        """The gateway's remote prefill (gateway/picker.py): the plan, counted when named (the legs are
        the sidecar's beside the decode engine: docs/disaggregation.md), its prefill engine loaded until
        ``ended``. The sidecar serves completions and chat only, and names a prefill engine by address
        alone, passing the decode leg's rank header on to it: in vLLM's flow the prefill leg runs on the
        decode leg's rank, so the prefill engine is chosen among the targets that header reaches. A
        ``streamed`` request's prompt waits in the queue of the engine that prefills it (queues.py) until
        the picker takes it out (``Planned.queued``) at the answer's first byte."""
        # The rank header is vLLM's flow's (an SGLang decode engine cannot prefill alone: any rank).
        vllm_ = self.config.protocol == Protocol.VLLM
        planned = self.plan(kind, route, index, decision, kinds=SIDECAR_KINDS, same_rank=vllm_)
        self.metrics.verdict(planned.verdict)
        if not vllm_:  # SGLang's decode engines cannot prefill alone
            _sglang_servable(
                planned, "behind a gateway, a disaggregated SGLang fleet serves completions and chat only"
            )
        if planned.chosen is not None:
            self.metrics.remote_tokens.inc(planned.moved)
            self._acquire(planned.chosen.target, len(route.tokens or ()))
        # Queued only where its first streamed byte will tell that the prompt is prefilled (the sidecar
        # runs the prefill leg before the decode's): a whole answer comes only after the generation.
        if not streamed:
            return planned
        if planned.chosen is not None:
            missing = self._uncached(route, index, planned.chosen)
            return replace(planned, queued=self.queues.add(planned.chosen.target, missing))
        if self.targets.role(decision.target.engine) is Role.DECODE and vllm_:
            missing = self._uncached(route, index, decision)
            return replace(planned, queued=self.queues.add(decision.target, missing))
        return planned

    def serves_alone(self, target: Target) -> bool:
        """Whether ``target`` can serve a request sent with no remote prefill (a gateway's fallback): a
        whole engine, or in vLLM's flow a decode engine (it prefills the prompt itself); never an SGLang
        decode engine, which waits for a prefill engine in its bootstrap room."""
        return self.config.protocol == Protocol.VLLM or self.targets.role(target.engine) is Role.BOTH

    def without_clients_fields(self, raw: bytes, body: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
        """A client's request without its own transfer or bootstrap fields (they would tell a decode
        engine where to take KV from), as the picker passes it on; unchanged when it has none."""
        if self.config.protocol == Protocol.SGLANG:
            return sglang.without_bootstrap(raw, body)
        return without_member(raw, body, vllm.PARAMS)

    def ended(self, planned: Planned, route: RouteRequest) -> None:
        """A ``named`` remote prefill is over (the decode engine answered, or the request ended)."""
        if planned.chosen is not None:
            self._release(planned.chosen.target, len(route.tokens or ()))
            self.profile.ended(planned.chosen)

    async def _vllm(
        self,
        prompt: Prompt,
        decision: Decision,
        path: str,
        headers: Mapping[str, str],
        trace: Trace,
        deadline: float | None,
    ) -> tuple[Verdict, vllm.TransferParams | None, Target | None, int]:
        """vLLM's flow: the prefill leg first; its transfer parameters go to the decode leg. A failed leg
        is retried once on another prefill engine."""
        body: bytes | None = None
        failed: list[str] = []
        for _attempt in (0, 1):
            planned = self.plan(prompt.kind, prompt.route, prompt.index, decision, failed)
            chosen = planned.chosen
            if chosen is None:
                return (Verdict.PREFILL_FAILED if failed else planned.verdict), None, None, 0
            body = body or vllm.prefill_body(prompt.body)
            params = await self._leg(
                prompt, chosen, path, body, headers, trace, vllm.vet_answer, keep=True, deadline=deadline
            )
            if params is not None:
                self.metrics.remote_tokens.inc(planned.moved)
                return Verdict.REMOTE, params, chosen.target, planned.moved
            failed.append(chosen.target.engine)
            if deadline is not None and asyncio.get_running_loop().time() >= deadline:
                break  # the request's first byte is due: no second leg
        return Verdict.PREFILL_FAILED, None, None, 0

    def _sglang(
        self,
        prompt: Prompt,
        decision: Decision,
        path: str,
        headers: dict[str, str],
        trace: Trace,
        deadline: float | None,
    ) -> DecodeLeg:
        """SGLang's flow: both legs at once, paired by a bootstrap room. A decode engine cannot prefill by
        itself, so a request without a paired prefill engine, or on an API that carries no room, fails
        clearly; a whole engine takes the request as it is. The verdict of a remote prefill is counted
        when its leg has ended (remote, or prefill_failed)."""
        raw, body = sglang.without_bootstrap(prompt.raw, prompt.body)
        revision = self.targets.revision(decision.target.engine)
        planned = self.plan(prompt.kind, prompt.route, prompt.index, decision)
        chosen, moved = planned.chosen, planned.moved
        if chosen is None:
            self.metrics.verdict(planned.verdict)
        _sglang_servable(planned)
        if chosen is None:  # a whole engine
            return DecodeLeg(raw, headers, Verdict.WHOLE_ENGINE, revision=revision)
        target = chosen.target
        port = self.targets.bootstrap_port(target.engine) or sglang.DEFAULT_BOOTSTRAP_PORT
        room = sglang.Room.new(_host(target), port)
        both = sglang.with_room(raw, body, room)

        # Counted now, not when the leg's task first runs: the next request's plan, which may come first,
        # sees it (a burst would pile onto one prefill engine); ended even if the task never runs.
        held = self._hold(prompt, chosen)

        async def prefilled() -> None:
            answered = await self._leg(
                prompt, chosen, path, both, headers, trace, _drained, deadline=deadline, held=held
            )
            if answered is None:
                self.metrics.verdict(Verdict.PREFILL_FAILED)
                raise PrefillFailed("no answer")
            self.metrics.verdict(Verdict.REMOTE)
            self.metrics.remote_tokens.inc(moved)

        ready = asyncio.ensure_future(prefilled())
        ready.add_done_callback(lambda _: held())
        return DecodeLeg(both, headers, Verdict.REMOTE, target, moved, ready, revision)

    def _audit(self, chosen: Decision, cached: int, block_size: int) -> None:
        """The prefill leg's audit: the prefill engine's cached tokens against the prefix its decision
        credited (the decode leg's is the proxy's, with the transfer expected: proxy/audit.py)."""
        audit = judge(Prediction(chosen.matched_blocks * block_size, block_size=block_size), cached)
        self.metrics.prefill_audit(audit)

    def _hold(self, prompt: Prompt, chosen: Decision) -> Callable[[], None]:
        """Count ``chosen``'s prefill leg from now, in its engine's load and prefill queue; the call
        returned ends it, once, with the profile's count of the decision."""
        target, tokens = chosen.target, prompt.route.tokens
        n = len(tokens) if tokens is not None else 0
        self._acquire(target, n)
        queued = self.queues.add(target, self._uncached(prompt.route, prompt.index, chosen))
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                queued.done()
                self._release(target, n)
                self.profile.ended(chosen)

        return end

    async def _leg(
        self,
        prompt: Prompt,
        chosen: Decision,
        path: str,
        body: bytes,
        added: Mapping[str, str],
        trace: Trace,
        accept: Callable[[bytes], Any],
        *,
        keep: bool = False,
        deadline: float | None = None,
        held: Callable[[], None] | None = None,
    ) -> Any:
        """One prefill request, bounded by the prefill timeout and by ``deadline`` (the request's first
        byte's, the event loop's clock): ``accept`` of its answer (kept whole with ``keep``, else
        drained: b""), or None; counted by outcome, and audited against the prefill decision when the
        answer reports its cached tokens. ``held``: the leg already counted (``_hold``)."""
        end = held or self._hold(prompt, chosen)
        target = chosen.target
        tokens, index = prompt.route.tokens, prompt.index
        headers = CIMultiDict(prompt.headers)  # already what an engine may see (proxy/headers.py)
        headers.update(added)
        headers["Content-Type"] = "application/json"
        if target.rank is not None:
            headers[RANK_HEADER] = str(target.rank)
        t0 = time.perf_counter()
        reason = "cancelled"  # until it ends otherwise (the request went away, or its decode leg did)
        cut = "timeout"  # what a TimeoutError means: the leg's own timeout, or the request's deadline
        scan = UsageScan()
        result = None
        span = trace.span("prefill", SpanKind.CLIENT)
        try:
            with span:
                span.update({"routerfleet.engine": target.engine, "routerfleet.rank": target.rank})
                put_context(headers, trace.headers(span))
                answer = bytearray()
                until = asyncio.get_running_loop().time() + self.config.prefill_timeout_s
                if deadline is not None and deadline < until:
                    until, cut = deadline, "deadline"  # the request's first byte comes first
                async with asyncio.timeout_at(until):
                    async with self._session().post(target.url + path, data=body, headers=headers) as up:
                        if up.status != 200:
                            reason = f"status_{up.status // 100}xx"
                            return None
                        async for chunk in up.content.iter_chunked(1 << 16):
                            scan.feed(chunk)
                            if keep:
                                answer += chunk
                                if len(answer) > _ANSWER_CAP:
                                    reason = "too_large"
                                    return None
                result = accept(bytes(answer))
                reason = "ok" if result is not None else "no_transfer_params"
                span.set("routerfleet.pd.prefill_ok", result is not None)
        except TimeoutError:
            reason = cut
        except aiohttp.ClientConnectorError:
            reason = "connect"
            self.health.failure(target.engine)
        except aiohttp.ClientError:
            reason = "upstream_error"
        finally:
            end()
            if reason == "ok":
                self.metrics.leg_seconds.observe(time.perf_counter() - t0)
            else:
                self.metrics.leg_failures.labels(reason).inc()
                span.set("routerfleet.pd.prefill_ok", False)  # the metric's reason, raised or not
                span.fail(reason)
        if result is not None and scan.cached_tokens is not None and tokens is not None and index is not None:
            self._audit(chosen, scan.cached_tokens, index.block_size)
        return result


def streams(body: Mapping[str, Any]) -> bool:
    """Whether a request's answer streams (its first byte follows the prefill; a whole answer's, the
    generation)."""
    return body.get("stream") is True


def _runs_rank(target: Target, rank: int | None) -> bool:
    """Whether a prefill leg sent with the decode leg's data-parallel ``rank`` header (None: none) runs
    on ``target``: its rank of that number, or a single-rank engine's only one (rank 0). Without a
    header the engine balances its own ranks: any of them may."""
    return rank is None or target.rank == rank or (target.rank is None and rank == 0)


def _sglang_servable(
    planned: Planned,
    unsupported: str = "a disaggregated SGLang fleet serves completions, chat and /generate only",
) -> None:
    """An SGLang fleet's request goes to a whole engine, or with a prefill engine to pair with; raises
    why not (its decode engines cannot prefill by themselves)."""
    if planned.verdict is Verdict.UNSUPPORTED_API:
        raise Unservable(unsupported)
    if planned.chosen is None and planned.verdict is not Verdict.WHOLE_ENGINE:
        raise PrefillFailed("no prefill engine of the decode engine's revision")


def _drained(_answer: bytes) -> bool:
    """An SGLang prefill leg's answer, read to its end: the KV went to the decode engine's room."""
    return True


def _host(target: Target) -> str:
    """The prefill engine's host, as its bootstrap server is reached."""
    return urlsplit(target.url).hostname or ""
