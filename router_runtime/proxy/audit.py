"""The prediction audit: what the router predicted an engine had cached for a request, against what the
engine says it had (``usage.prompt_tokens_details.cached_tokens``, vLLM's and SGLang's field).

"Never route on a false cache hit" becomes a number: false-hit tokens (predicted beyond what the engine
had) and missed-hit tokens (cached there but not credited), per engine and policy, counted as
``routerfleet_audit_*``. A prediction made while its rank was in doubt (bootstrap holding or proving
a graft, an engine being re-adopted, a gap being replayed, a stream silent while its engine stores
blocks) is labelled ``doubtful``: those are the states where the index is allowed to lag, and a
dashboard separates them from the steady state. The doubt is judged when the decision is made.

The engine's figure is read from the response bytes as they stream past (``UsageScan``): the key
``"cached_tokens":`` can only appear unescaped as a JSON key, never inside a string (a quote in a string
is escaped), so a scan for it is exact and costs a regex search per chunk. A response that carries no
such key (an engine that reports no usage) is counted as unaudited, never as a miss.

A streamed request whose client did not ask for usage gets it asked for (``request_usage``): the body
sent to the engine gains ``"stream_options":{"include_usage":true}``, and ``UsageStrip`` takes out of the
stream what that added: the usage-only chunk (``"choices":[]``) before ``[DONE]``. That is all vLLM
(0.33) and SGLang (0.5.23) add for it; the ``"usage":null`` that some of their chunks carry (SGLang's
completions, its tool-call chunks) is there with or without the option, so it stays. An engine started
to always include usage (vLLM's ``--enable-force-include-usage``) sends that chunk to clients that did
not ask; behind it, run the router with ``--no-audit-stream-usage``, or the chunk is stripped.

What the router predicts is what it credited: the chosen target's matched blocks times the block size.
(vLLM recomputes the last prompt token, so a fully cached, block-aligned prompt reports one block fewer;
that shows as a one-block false hit on such prompts.)
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..kv.events import Tier
from ..scheduling.hooks import Exchange, ResponseWatch
from ..scheduling.types import Kind
from ..worker import Carrier
from .rewrite import insertable, with_member

if TYPE_CHECKING:
    from .metrics import ProxyMetrics

log = logging.getLogger(__name__)

# vLLM's and SGLang's usage (and the Responses API's) say cached_tokens; Anthropic's Messages API says
# cache_read_input_tokens.
_CACHED = re.compile(rb'"(?:cached_tokens|cache_read_input_tokens)"\s*:\s*(\d{1,12})')
_TAIL = 64  # bytes kept across chunks: the key and its number may straddle two
# The order of the index match's tier counts: device, host, disk, external.
TIERS = tuple(t.name.lower() for t in Tier)


class AuditOutcome(enum.StrEnum):
    EXACT = "exact"
    FALSE_HIT = "false_hit"  # the engine had less cached than predicted
    # It had less, and its own events since the decision took part of the credited prefix out of the
    # index: it evicted what the index rightly credited, between the decision and the admission.
    EVICTED = "evicted"
    MISSED_HIT = "missed_hit"  # it had more
    UNAUDITED = "unaudited"  # no usage in the response


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the router credited the chosen target with, in tokens (never token IDs or hashes)."""

    tokens: int
    doubtful: bool = False
    tiers: tuple[int, int, int, int] = (0, 0, 0, 0)  # of ``tokens``: device, host, disk, external
    reusable_tokens: int = 0  # of the prompt, what the engine may serve from its cache (reuse.py)
    block_size: int = 0
    # Beyond ``tokens``: what a request just sent there predicts (not yet stored; not a cache claim).
    inflight_tokens: int = 0
    # Beyond ``tokens``: what a remote prefill hands the (decode) engine, which counts it as cached
    # (disaggregation/): at most the uncached suffix; not a claim on the engine's cache.
    transferred_tokens: int = 0
    # Whether the engine's own events, since the decision, took part of the credited prefix out of the
    # index (kv/writer.CreditWatch); None: not watched.
    evicted_since: Callable[[], bool] | None = field(default=None, compare=False)

    def tier_header(self) -> str:
        return ",".join(f"{name}={n}" for name, n in zip(TIERS, self.tiers, strict=True))

    def stores_blocks(self, cached_tokens: int) -> bool:
        """Whether the engine, having had ``cached_tokens`` of the prompt cached, computed at least one
        full block it would have reused had it held it: a block it did not hold, which it stores and
        announces on its KV stream. (A block it recomputed by rule, the last token's, it may have held:
        no claim.)"""
        bs = self.block_size
        return bs > 0 and self.reusable_tokens // bs > cached_tokens // bs


@dataclass(frozen=True, slots=True)
class Audit:
    outcome: AuditOutcome
    false_hit_tokens: int = 0
    missed_hit_tokens: int = 0
    inflight_reused_tokens: int = 0  # of the prediction's in-flight tokens, those the engine had cached
    evicted_tokens: int = 0  # credited, then evicted by the engine before admitting it, as it announced
    transferred_tokens: int = 0  # of the engine's cached tokens, those a remote prefill handed it


def judge(prediction: Prediction, cached_tokens: int | None) -> Audit:
    """The audit of one response: the engine's cached tokens (None: it did not say) against the
    prediction. Only the index's credit is a claim: short of it is a false hit. Beyond it, what a remote
    prefill handed the engine is expected, what an in-flight prediction counted on is its own measure
    (reused), and only the rest is a missed hit."""
    if cached_tokens is None:
        return Audit(AuditOutcome.UNAUDITED)
    if cached_tokens < prediction.tokens:
        return Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=prediction.tokens - cached_tokens)
    extra = cached_tokens - prediction.tokens
    moved = min(extra, prediction.transferred_tokens)
    extra -= moved
    reused = min(extra, prediction.inflight_tokens)
    if extra > reused:
        return Audit(
            AuditOutcome.MISSED_HIT,
            missed_hit_tokens=extra - reused,
            inflight_reused_tokens=reused,
            transferred_tokens=moved,
        )
    return Audit(AuditOutcome.EXACT, inflight_reused_tokens=reused, transferred_tokens=moved)


def explained(audit: Audit, evicted_since: bool) -> Audit:
    """A false hit whose credited prefix the engine announced evicting after the decision (its events
    took part of it out of the index before the response was in) is an eviction between the decision
    and the admission: the index was right when it decided. Anything else stays a false hit."""
    if audit.outcome is not AuditOutcome.FALSE_HIT or not evicted_since:
        return audit
    return Audit(AuditOutcome.EVICTED, evicted_tokens=audit.false_hit_tokens)


def denies(prediction: Prediction, audit: Audit) -> bool:
    """Whether the engine, by its own figure, lacks a prefix the index credited it with in no doubt:
    short by more than one block. The prediction models the engines' reuse rules (reuse.py); one block
    of tolerance keeps an engine whose reuse differs from them by a block (vLLM with speculative
    decoding's EAGLE drops one more) from being withheld as if it had lost its cache."""
    return (
        audit.outcome is AuditOutcome.FALSE_HIT
        and not prediction.doubtful
        and audit.false_hit_tokens > prediction.block_size
    )


class UsageScan:
    """Finds the engine's ``cached_tokens`` in a response streamed chunk by chunk (the last one wins:
    a stream may repeat usage per chunk, and its final figure is the request's)."""

    __slots__ = ("_tail", "cached_tokens")

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        if b"cached_tokens" in data or b"cache_read_input_tokens" in data:
            found = None
            for found in _CACHED.finditer(data):  # noqa: B007 (the last match is the one)
                pass
            if found is not None:
                self.cached_tokens = int(found.group(1))
        self._tail = data[-_TAIL:]


# The chunk ``include_usage`` adds, as bytes. Both keys can only appear unescaped as JSON keys, and only
# at a chunk's top level (``choices`` and ``usage`` are members of the chunk object itself).
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_BOUNDARY = re.compile(rb"\r\n\r\n|\n\n|\r\r")  # an event's end: a blank line, in any of SSE's line ends


# The APIs whose stream takes OpenAI's ``stream_options`` (the audit may ask for usage there); the
# other APIs always report it.
USAGE_OPTION_KINDS = frozenset({Kind.COMPLETION, Kind.CHAT})


def request_usage(raw: bytes, body: object) -> bytes | None:
    """``raw`` with ``stream_options.include_usage`` asked for, or None when it stays as it is: not a
    stream, or the client set ``stream_options`` itself (its choice, and continuous usage or other
    options would change what the stream carries). The key goes in as bytes after the opening brace:
    the rest of the body reaches the engine exactly as the client sent it."""
    if not isinstance(body, dict) or body.get("stream") is not True or "stream_options" in body:
        return None
    if not insertable(raw):  # re-encoded, the rest of the body would not be as the client sent it
        return None
    return with_member(raw, body, "stream_options", {"include_usage": True})[0]


class UsageStrip:
    """A stream's bytes as the client would have had them had the router not asked for usage: whole
    server-sent events pass on, each scanned for the engine's figure (``scan``), except the usage-only
    chunk. A partial event waits for its end (engines write one event per write, so nothing waits in
    practice)."""

    __slots__ = ("_pending", "_scanned", "scan")

    def __init__(self) -> None:
        self._pending = bytearray()  # a partial event
        self._scanned = 0  # how much of it was searched for an event's end (linear in a long event)
        self.scan = UsageScan()

    def feed(self, chunk: bytes) -> bytes:
        pending = self._pending
        if not pending and chunk.endswith(b"\n\n") and b'"usage"' not in chunk:
            return chunk  # whole events without usage, the common chunk: as they are
        pending += chunk
        out = []
        pos = 0
        # An event's end is at most 4 bytes: one that began in what was searched before ends here.
        for end in _BOUNDARY.finditer(pending, max(self._scanned - 3, 0)):
            out.append(self._event(bytes(pending[pos : end.start()]), end.group()))
            pos = end.end()
        if pos:
            del pending[:pos]
        self._scanned = len(pending)
        return b"".join(out)

    def flush(self) -> bytes:
        """What is left at the stream's end (an event without its blank line)."""
        rest = bytes(self._pending)
        self._pending.clear()
        self._scanned = 0
        return self._event(rest, b"") if rest else b""

    def _event(self, event: bytes, end: bytes) -> bytes:
        if b'"usage"' not in event:
            return event + end
        self.scan.feed(event)
        if _NO_CHOICES.search(event) and _USAGE_OBJECT.search(event):
            return b""  # the usage-only chunk
        return event + end


class PredictionAudit:
    """The request hook: a 2xx answer to a request with a prediction is scanned for the engine's figure
    as it streams past (and stripped of the usage the router asked for), then judged once the client has
    it all. A response that shows new blocks stored tells ``expect`` (a batch is due on that rank's
    stream); one that denies a prefix credited in no doubt tells ``deny`` (the rank is withheld)."""

    name = "audit"

    def __init__(
        self,
        metrics: ProxyMetrics,
        policy: str,
        *,
        expect: Callable[[Carrier, float], None] | None = None,
        deny: Callable[[Carrier, float], None] | None = None,
    ) -> None:
        self.metrics, self.policy, self.expect, self.deny = metrics, policy, expect, deny

    def pre_request(self, exchange: Exchange) -> ResponseWatch | None:
        return _Audited(self, exchange) if exchange.prediction is not None else None


class _Audited(ResponseWatch):
    def __init__(self, hook: PredictionAudit, exchange: Exchange) -> None:
        self.hook, self.exchange = hook, exchange
        self.scan: UsageScan | None = None  # None: not audited (not a 2xx)
        self.strip: UsageStrip | None = None

    def response_received(self, status: int, headers) -> None:
        if not 200 <= status < 300:
            return
        mime = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        if self.exchange.usage_asked and mime == "text/event-stream":
            self.strip = UsageStrip()
            self.scan = self.strip.scan
            self.rewrites_body = True
        else:
            self.scan = UsageScan()

    def response_streaming(self, chunk: bytes) -> bytes:
        if self.strip is not None:
            return self.strip.feed(chunk)
        if self.scan is not None:
            self.scan.feed(chunk)
        return chunk

    def response_ended(self) -> bytes:
        return self.strip.flush() if self.strip is not None else b""

    def response_complete(self) -> None:
        if self.scan is None:
            return
        hook, x = self.hook, self.exchange
        prediction = x.prediction
        assert prediction is not None
        cached = self.scan.cached_tokens
        audit = judge(prediction, cached)
        if audit.outcome is AuditOutcome.FALSE_HIT and prediction.evicted_since is not None:
            audit = explained(audit, prediction.evicted_since())
        hook.metrics.audit(x.target.engine, hook.policy, prediction, audit)
        if x.trace is not None:
            _traced(x, prediction, cached, audit)
        if cached is not None and hook.expect is not None and prediction.stores_blocks(cached):
            hook.expect(x.target.carrier, x.started)
        if hook.deny is not None and denies(prediction, audit):
            hook.deny(x.target.carrier, x.started)


def _traced(x: Exchange, prediction: Prediction, cached: int | None, audit: Audit) -> None:
    """The verdict on the request's root span; a false hit is logged with its trace id (and nothing of the
    request), so the trace of one is found from the logs."""
    assert x.trace is not None
    x.trace.root.update(
        {
            "routerfleet.audit.outcome": audit.outcome.value,
            "routerfleet.audit.predicted_tokens": prediction.tokens,
            "routerfleet.audit.cached_tokens": cached,
            "routerfleet.audit.false_hit_tokens": audit.false_hit_tokens,
            "routerfleet.audit.missed_hit_tokens": audit.missed_hit_tokens,
            "routerfleet.audit.inflight_reused_tokens": audit.inflight_reused_tokens,
            "routerfleet.audit.evicted_tokens": audit.evicted_tokens,
            "routerfleet.audit.doubtful": prediction.doubtful,
        }
    )
    if audit.outcome is AuditOutcome.FALSE_HIT:
        log.info(
            "audit: a false hit of %d tokens on engine %s (doubtful=%s), trace_id=%s",
            audit.false_hit_tokens,
            x.target.engine,
            prediction.doubtful,
            x.trace.trace_id_hex,
        )
