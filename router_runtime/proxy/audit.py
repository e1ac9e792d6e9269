"""The prediction audit: what the router predicted an engine had cached for a request, against what the
engine says it had (``usage.prompt_tokens_details.cached_tokens``, vLLM's and SGLang's field).

"Never route on a false cache hit" becomes a number: false-hit tokens (predicted beyond what the engine
had) and missed-hit tokens (cached there but not credited), per engine and policy, counted as
``routerfleet_audit_*``. A prediction made while its rank was in doubt (bootstrap holding or proving
a graft, an engine being re-adopted) is labelled ``doubtful``: those are the states where the index is
allowed to lag, and a dashboard separates them from the steady state.

The engine's figure is read from the response bytes as they stream past (``UsageScan``): the key
``"cached_tokens":`` can only appear unescaped as a JSON key, never inside a string (a quote in a string
is escaped), so a scan for it is exact and costs a regex search per chunk. A response that carries no
such key (a streamed one without ``stream_options.include_usage``, an engine that reports no usage) is
counted as unaudited, never as a miss.

What the router predicts is what it credited: the chosen target's matched blocks times the block size.
(vLLM recomputes the last prompt token, so a fully cached, block-aligned prompt reports one block fewer;
that shows as a one-block false hit on such prompts.)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

_CACHED = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')
_TAIL = 64  # bytes kept across chunks: the key and its number may straddle two


class AuditOutcome(enum.StrEnum):
    EXACT = "exact"
    FALSE_HIT = "false_hit"  # the engine had less cached than predicted
    MISSED_HIT = "missed_hit"  # it had more
    UNAUDITED = "unaudited"  # no usage in the response


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the router credited the chosen target with, in tokens (never token IDs or hashes)."""

    tokens: int
    doubtful: bool = False


@dataclass(frozen=True, slots=True)
class Audit:
    outcome: AuditOutcome
    false_hit_tokens: int = 0
    missed_hit_tokens: int = 0


def judge(prediction: Prediction, cached_tokens: int | None) -> Audit:
    """The audit of one response: the engine's cached tokens (None: it did not say) against the
    prediction."""
    if cached_tokens is None:
        return Audit(AuditOutcome.UNAUDITED)
    if cached_tokens < prediction.tokens:
        return Audit(AuditOutcome.FALSE_HIT, false_hit_tokens=prediction.tokens - cached_tokens)
    if cached_tokens > prediction.tokens:
        return Audit(AuditOutcome.MISSED_HIT, missed_hit_tokens=cached_tokens - prediction.tokens)
    return Audit(AuditOutcome.EXACT)


class UsageScan:
    """Finds the engine's ``cached_tokens`` in a response streamed chunk by chunk (the last one wins:
    a stream may repeat usage per chunk, and its final figure is the request's)."""

    __slots__ = ("_tail", "cached_tokens")

    def __init__(self) -> None:
        self._tail = b""
        self.cached_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk if self._tail else chunk
        if b"cached_tokens" in data:
            found = None
            for found in _CACHED.finditer(data):  # noqa: B007 (the last match is the one)
                pass
            if found is not None:
                self.cached_tokens = int(found.group(1))
        self._tail = data[-_TAIL:]
