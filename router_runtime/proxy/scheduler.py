"""The scheduler's shell, behind every front door: a request (its API, headers and parsed body, nothing of
the transport) becomes what the profile decides on, then decisions.

    prepare:  pin (a stored response it continues: its engine, or the clear error)
              -> session (an explicit key, a trusted hint, a store lookup; see sessions/)
              -> tokens or text, as the profile needs them (never a guessed sequence)
    decide:   the session classified once (its remembered target preferred while a candidate)
              -> the profile's filters, scorers and picker (scheduling/), timed and counted

The proxy calls it per request (and ``decide`` again, without a failed engine, on a retry); the
gateway's endpoint picker calls it the same way. The I/O here is the tokenizer's, the session store's
and the response probe's; the decision itself is the pure ``Profile.choose``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..kv.index import RadixIndex
from ..kv.writer import CreditWatch, IndexWriter
from ..scheduling.admission import OBJECTIVE_HEADER, Admission
from ..scheduling.filters import PinnedTarget
from ..scheduling.framework import Profile, Unschedulable
from ..scheduling.reuse import reusable_tokens
from ..scheduling.types import Decision, Kind, RouteRequest, Target
from ..sessions.affinity import SessionAffinity, SessionCtx
from ..sessions.bindings import Verdict
from ..tokens.engine import ANSWERED_BY, EngineTokenizer
from ..tokens.shapes import messages_chat, responses_chat
from ..tokens.tokenizer import AsyncTokenizer, Reason, Untokenizable
from ..tracing.spans import NO_SPAN, NO_TRACE, Attr, Trace
from ..worker import Carrier
from .audit import TIERS, Prediction
from .errors import ProxyError, bad_request, no_engine, shed
from .metrics import ProxyMetrics
from .request import ParsedRequest, names_rank, other_adapter, parse_request, truncated
from .responses import ResponseRouter, response_error

# The APIs rendered as a chat request, and how their body becomes one (tokens/shapes.py).
_AS_CHAT = {Kind.RESPONSES: responses_chat, Kind.MESSAGES: messages_chat}
# The schedule span's per-tier arrays, device first (audit.TIERS' order).
_TIER_KEYS = tuple(f"routerfleet.candidates.matched_blocks.{tier}" for tier in TIERS)


@dataclass(frozen=True, slots=True)
class Inbound:
    """A request as the scheduler takes it from any front door."""

    kind: Kind
    headers: Mapping[str, str]
    body: Any  # the parsed JSON body
    size: int  # its bytes: bounds what the tokenizer may spend on it
    tenant: str = ""  # sessions/keys.py: tenant_of
    subset: frozenset[str] | None = None  # the endpoints a gateway allows (None: any)
    trace: Trace = NO_TRACE  # the request's trace (tracing/): the stages below add their spans to it


class Scheduled:
    """One request's scheduling, across its attempts."""

    __slots__ = (
        "_credit",
        "_credits",
        "_scheduler",
        "_transfers",
        "index",
        "parsed",
        "route",
        "session",
        "trace",
    )

    def __init__(
        self,
        scheduler: Scheduler,
        parsed: ParsedRequest,
        route: RouteRequest,
        session: SessionCtx | None,
        index: RadixIndex | None,
        trace: Trace = NO_TRACE,
    ) -> None:
        self._scheduler = scheduler
        self.trace = trace
        self.parsed = parsed
        self.route = route
        self.session = session
        self.index = index  # as it stood when the request came: every attempt decides on it
        self._credits: dict[int, CreditWatch] = {}  # id(decision) -> its credited prefix, watched
        self._transfers: dict[int, int] = {}  # id(decision) -> tokens a remote prefill hands its target
        self._credit: tuple[Decision, tuple[int, bool, int]] | None = None  # the latest decision's

    @property
    def predicts(self) -> bool:
        """Whether a decision credits a cached prefix that the audit can check (KV profiles, tokens)."""
        return (
            self.route.tokens is not None and self.index is not None and self._scheduler.profile.needs_tokens
        )

    def decide(self, candidates: Sequence[Target], attempt: int) -> Decision:
        """A decision among ``candidates``; ``attempt`` 1 is the retry without an engine that failed."""
        s = self._scheduler
        route, sctx = self.route, self.session
        if sctx is not None:
            # Classified once (the first decision); a retry keeps the state, and the preference while
            # the remembered engine is still a candidate.
            classified = s.sessions.classify(sctx, candidates)
            prefer = classified.preferred if classified.preferred in candidates else None
            route = replace(route, prefer=prefer, prefer_vouched=classified.vouched)
        with self.trace.span("schedule") as span:
            try:
                decision = s.choose(route, candidates, self.index, explain=span.recording)
            except Unschedulable as e:
                if e.filter == PinnedTarget.name:  # its engine failed to connect: nowhere else holds it
                    previous = self.parsed.previous_response_id
                    raise response_error(Verdict.UNAVAILABLE, previous, "previous_response_id") from None
                raise unschedulable(e) from None
            if span.recording:
                span.update(self._explained(decision, route, attempt))
        if sctx is not None and attempt == 0:
            s.sessions.selected(sctx, decision.target, s.profile.name)
        return decision

    def transferred(self, decision: Decision, tokens: int) -> None:
        """A remote prefill hands ``decision``'s target up to ``tokens`` of the prompt (its prediction
        expects them cached beyond the index's credit)."""
        self._transfers[id(decision)] = tokens

    def ended(self, decision: Decision) -> None:
        """The request ``decision`` sent has ended, however: the profile's plugins let go of it."""
        self._scheduler.profile.ended(decision)
        self._transfers.pop(id(decision), None)
        watch = self._credits.pop(id(decision), None)
        if watch is not None and self._scheduler.credit_watches is not None:
            self._scheduler.credit_watches.unwatch_credit(watch)

    def _explained(self, decision: Decision, route: RouteRequest, attempt: int) -> dict[str, Attr | None]:
        """The schedule span's attributes: the winner and why, what it credits, and every candidate's
        standing (parallel arrays, in the order the picker saw them; a tier's matched blocks only when
        some candidate holds blocks there, the device tier always)."""
        s = self._scheduler
        rows = decision.candidates
        credited = self._credited(decision) if self.predicts else None
        session = self.session.classified if self.session is not None else None
        engines, ranks, loads, costs = [], [], [], []
        tiers: list[list[int]] = [[], [], [], []]
        for c in rows:
            t = c.target
            engines.append(t.engine)
            ranks.append(-1 if t.rank is None else t.rank)
            loads.append(float(c.load))
            costs.append(c.cost)
            for i, n in enumerate(c.tier_blocks):
                tiers[i].append(n)
        attributes: dict[str, Attr | None] = {
            "routerfleet.profile": s.profile.name,
            "routerfleet.attempt": attempt,
            "routerfleet.engine": decision.target.engine,
            "routerfleet.rank": decision.target.rank,
            "routerfleet.reason": decision.reason.value,
            "routerfleet.request.blocks": decision.total_blocks if route.tokens is not None else None,
            "routerfleet.matched.blocks": decision.matched_blocks,
            "routerfleet.session.state": session.state.value if session is not None else None,
            "routerfleet.session.preferred": route.prefer.engine if route.prefer is not None else None,
            "routerfleet.prediction.cached_tokens": credited[0] if credited is not None else None,
            "routerfleet.prediction.doubtful": credited[1] if credited is not None else None,
            "routerfleet.prediction.inflight_tokens": credited[2] if credited is not None else None,
            "routerfleet.candidates.engine": engines,
            "routerfleet.candidates.rank": ranks,
            "routerfleet.candidates.load": loads,
            # The scorers' summed cost, in blocks (absent: no scorer spoke, as for round robin).
            "routerfleet.candidates.cost": costs if rows and costs[0] is not None else None,
        }
        for i, blocks in enumerate(tiers):
            if i == 0 or any(blocks):
                attributes[_TIER_KEYS[i]] = blocks
        if s.describe_load is not None and rows:  # parallel to the rows (none: a filter decided)
            attributes.update(s.describe_load([c.target for c in rows]))
        return attributes

    def prediction(self, decision: Decision) -> Prediction | None:
        """What ``decision`` credits its target with, as the index stood when it was made (None: nothing
        the audit can check)."""
        if not self.predicts:
            return None
        s, route, index = self._scheduler, self.route, self.index
        cached, doubtful, inflight = self._credited(decision)
        bs = index.block_size
        tiers = tuple(n * bs for n in decision.tier_blocks)
        reusable = reusable_tokens(len(route.tokens), route.logprobs_from)
        watch, watches = self._credits.get(id(decision)), s.credit_watches
        if watch is None and watches is not None and decision.matched_blocks and route.tokens is not None:
            credited = route.tokens[: decision.matched_blocks * bs]
            watch = CreditWatch(
                decision.target.carrier, credited, route.lora_name, route.cache_salt, decision.matched_blocks
            )
            self._credits[id(decision)] = watches.watch_credit(watch)
        evicted = (lambda: watch.evicted) if watch is not None else None
        moved = self._transfers.get(id(decision), 0)
        return Prediction(cached, doubtful, tiers, reusable, bs, inflight, moved, evicted)

    def _credited(self, decision: Decision) -> tuple[int, bool, int]:
        """Of ``prediction``: the cached tokens credited, whether in doubt, the in-flight tokens beyond
        them (what a trace's schedule span says, without the watch and the audit's figures). Judged
        once per decision, when first asked: a traced one's span and its prediction say the same."""
        known = self._credit
        if known is not None and known[0] is decision:
            return known[1]
        assert self.index is not None
        s, bs = self._scheduler, self.index.block_size
        doubtful = s.doubt_fn(decision.target.carrier) if s.doubt_fn is not None else False
        credited = decision.matched_blocks * bs, doubtful, decision.inflight_blocks * bs
        self._credit = (decision, credited)
        return credited


class Scheduler:
    def __init__(
        self,
        profile: Profile,
        *,
        tokenizer: AsyncTokenizer | EngineTokenizer,
        metrics: ProxyMetrics,
        loads: Mapping[Target, float],
        index_fn: Callable[[], RadixIndex | None],
        sessions: SessionAffinity | None = None,
        responses: ResponseRouter | None = None,
        doubt_fn: Callable[[Carrier], bool] | None = None,
        admission: Admission | None = None,
        describe_load: Callable[[Sequence[Target]], Mapping[str, Attr]] | None = None,
        adapters: Callable[[], frozenset[str]] = frozenset,
        credit_watches: IndexWriter | None = None,
    ) -> None:
        self.profile = profile
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.loads = loads  # the fleet's in-flight view (fleet/board.py)
        self.index_fn = index_fn
        self.sessions = sessions if sessions is not None and sessions.enabled else None
        self.responses = responses
        # Whether a carrier's index entry is in a known-doubtful state (bootstrap holding or proving a
        # graft, an engine being re-adopted): its audited predictions are labelled so.
        self.doubt_fn = doubt_fn
        self.admission = admission  # None: every request is admitted
        # Where each candidate's load figure came from (this router, its siblings, the engine), for a
        # trace's schedule span (fleet/board.py).
        self.describe_load = describe_load
        # The LoRA adapters the engines serve (discovery/served_models.py): a request naming one as its
        # model is routed in its namespace, as the engine stores its blocks.
        self.adapters = adapters
        # Where a decision's credited prefix is watched while its request runs, so the audit tells an
        # eviction the engine announced since the decision from a false hit (kv/writer.CreditWatch).
        self.credit_watches = credit_watches

    async def prepare(self, inbound: Inbound, candidates: Sequence[Target]) -> Scheduled:
        """Everything a decision needs that takes I/O; raises the request's ProxyError (a bad body, an
        unknown response, a sheddable request while the pool is saturated)."""
        if self.admission is not None and self.admission.sheds(inbound.headers, candidates):
            self.metrics.shed.inc()
            raise shed(inbound.headers[OBJECTIVE_HEADER])
        parsed = parse_request(inbound.body, inbound.kind)
        pinned = None
        previous = parsed.previous_response_id
        trace = inbound.trace
        if previous is not None and self.responses is not None:
            with trace.span("response_lookup") as span:
                pinned = await self.responses.target(
                    previous, candidates, inbound.headers, "previous_response_id", inbound.tenant
                )
                span.set("routerfleet.engine", pinned.engine if pinned is not None else None)
        if pinned is not None:  # not routed by the profile: nothing to tokenize, no session to keep
            route = RouteRequest(pinned=pinned, subset=inbound.subset)
            return Scheduled(self, parsed, route, None, self.index_fn(), trace)
        session = None
        if self.sessions is not None:
            with trace.span("session"):
                session = await self.sessions.begin(inbound.headers, inbound.body, inbound.tenant)
        route = await self._route_request(parsed, inbound.size, inbound.subset, trace)
        return Scheduled(self, parsed, route, session, self.index_fn(), trace)

    def choose(
        self,
        route: RouteRequest,
        candidates: Sequence[Target],
        index: RadixIndex | None,
        *,
        explain: bool = False,
    ) -> Decision:
        """The profile's decision, timed and counted; raises ``Unschedulable`` when a filter left no
        candidate (``unschedulable`` says it to the client)."""
        m = self.metrics
        t0 = time.perf_counter()
        decision = self.profile.choose(route, candidates, self.loads, index, explain=explain)
        m.decision_seconds.observe(time.perf_counter() - t0)
        m.decision(self.profile.name, decision.reason)
        if decision.total_blocks:
            m.matched_ratio.observe(decision.matched_blocks / decision.total_blocks)
        elif decision.total_chars:
            m.matched_ratio.observe(decision.matched_chars / decision.total_chars)
        return decision

    async def _route_request(
        self, parsed: ParsedRequest, size: int, subset: frozenset[str] | None, trace: Trace = NO_TRACE
    ) -> RouteRequest:
        needs_tokens, needs_text = self.profile.needs_tokens, self.profile.needs_text
        tokens: Sequence[int] | None = None
        text = parsed.text
        refused: Reason | None = None
        span = trace.span("tokenize") if needs_tokens or needs_text else NO_SPAN
        if span.recording:
            ANSWERED_BY.set("")
        with span:
            # What the chat template renders: the chat body, or the one another API's request becomes.
            chat = parsed.body if parsed.kind is Kind.CHAT else None
            if parsed.kind in _AS_CHAT and (needs_tokens or needs_text):
                try:
                    chat = _AS_CHAT[parsed.kind](parsed.body)
                except Untokenizable as e:
                    refused = e.reason
            if needs_tokens:
                if names_rank(parsed.body) or other_adapter(parsed.body, parsed.kind):
                    refused = Reason.UNSUPPORTED
                elif parsed.tokens is not None:
                    if truncated(parsed.body, parsed.kind):
                        refused = Reason.UNSUPPORTED
                    else:
                        tokens = parsed.tokens
                elif parsed.text is not None:
                    try:
                        tokens = await self.tokenizer.prompt(parsed.text, parsed.body, size)
                    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): no engine can take it either
                        raise bad_request("'prompt' is not valid Unicode text", "prompt") from None
                    except Untokenizable as e:  # a prompt the engine refuses, or no engine answer in time
                        refused = e.reason
                elif chat is not None:
                    try:
                        tokens = await self.tokenizer.chat_ids(chat, size)
                    except Untokenizable as e:  # routed without tokens: never on a guessed sequence
                        refused = e.reason
            if needs_text and chat is not None:
                try:
                    text = await self.tokenizer.chat_text(chat, size)
                except Untokenizable as e:
                    refused = refused or e.reason
            if text is not None and other_adapter(parsed.body, parsed.kind):  # its namespace: unknown here
                text, refused = None, refused or Reason.UNSUPPORTED
            if refused is not None:  # once per request, whatever the profile needed
                self.metrics.untokenized.labels(refused).inc()
            if span.recording:
                span.update(
                    {
                        "routerfleet.tokenizer": "engine"
                        if isinstance(self.tokenizer, EngineTokenizer)
                        else "router",
                        "routerfleet.tokens.count": len(tokens) if tokens is not None else None,
                        "routerfleet.tokens.from_request": parsed.tokens is not None,
                        "routerfleet.tokens.answered_by": ANSWERED_BY.get() or None,
                        "routerfleet.tokens.refused": refused.value if refused is not None else None,
                    }
                )
        return RouteRequest(
            tokens=tokens,
            text=text,
            lora_name=parsed.lora_name or self._adapter(parsed),
            cache_salt=parsed.cache_salt,
            logprobs_from=parsed.logprobs_from,
            subset=subset,
        )

    def _adapter(self, parsed: ParsedRequest) -> str | None:
        model = parsed.body.get("model") if parsed.body is not None else None
        return model if isinstance(model, str) and model in self.adapters() else None


def unschedulable(e: Unschedulable) -> ProxyError:
    """A filter left no candidate: a gateway's subset named none of the engines that can take it."""
    return no_engine(f"no engine can take the request (the {e.filter} filter left none)")
