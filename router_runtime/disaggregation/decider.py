"""Whether a request's prompt is prefilled remotely, and where (pure).

    decode decision (prefix held, load)  -> uncached suffix on that decode rank
    suffix < threshold                   -> the decode engine prefills it itself (no transfer)
    every paired prefill engine has more -> the decode engine prefills it itself (it starts sooner:
    queued to prefill than the decode       queues.py; a threshold of 0 is always remote)
    rank, by more than the threshold
    else                                 -> a prefill engine of the decode engine's revision, chosen by
                                            the prefill profile (prefix held, load); its KV goes to the
                                            decode engine

Only the index's confirmed blocks shorten the suffix: a block predicted by a request still in flight
may never be stored, and a prefill skipped on a wrong guess costs a long local prefill on a decode
engine (slow, never wrong, but the decider would be deciding on a guess). A request the router could
not tokenize has an unknown suffix: prefilled remotely, as a router without an index would.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..scheduling.types import Decision, Target


class Verdict(enum.StrEnum):
    """How a request's prompt was prefilled; a metric label."""

    REMOTE = "remote"  # on a prefill engine, its KV sent to the decode engine
    SHORT_SUFFIX = "short_suffix"  # the decode engine's uncached suffix is under the threshold
    NO_PREFILL_ENGINE = "no_prefill_engine"  # none healthy of the decode engine's revision
    PREFILL_BUSY = "prefill_busy"  # every prefill engine paired with it is backed up (``sooner``)
    UNSUPPORTED_API = "unsupported_api"  # an API whose body carries no transfer parameters
    PREFILL_FAILED = "prefill_failed"  # the prefill engines asked failed or timed out
    WHOLE_ENGINE = "whole_engine"  # the chosen engine is a whole one (role both): it prefills its own


@dataclass(frozen=True, slots=True)
class Need:
    """What the decode decision leaves to prefill: ``remote`` (else the verdict why not) and the
    uncached suffix in tokens (None: unknown, the request was not tokenized)."""

    remote: bool
    uncached_tokens: int | None
    verdict: Verdict | None = None  # why not remote


def uncached(decision: Decision, n_tokens: int, block_size: int) -> int:
    """The tokens of an ``n_tokens`` prompt that ``decision``'s target lacks, by its confirmed blocks."""
    return max(n_tokens - decision.matched_blocks * block_size, 0)


def need(decision: Decision, n_tokens: int | None, block_size: int, threshold_tokens: int) -> Need:
    """Whether ``decision``'s decode target should take a remote prefill of an ``n_tokens`` prompt."""
    if n_tokens is None:
        return Need(True, None)
    missing = uncached(decision, n_tokens, block_size)
    if missing < threshold_tokens:
        return Need(False, missing, Verdict.SHORT_SUFFIX)
    return Need(True, missing)


def sooner(
    prefill: Sequence[Target], decode: Target, queued: Callable[[Target], int], margin: int
) -> tuple[Target, ...]:
    """The prefill targets that would start the prompt soon enough: at most ``margin`` more prompt tokens
    ``queued`` to prefill there than on the decode target (the threshold: a local prefill that long
    would stall the decode rank's streams, worth that much of a wait). Behind a backed-up prefill engine
    a long prompt starts sooner on its decode engine (Dynamo's conditional disaggregation also asks how
    long the prefill queue is); while they keep up, every prefill engine qualifies."""
    bound = queued(decode) + margin
    return tuple(t for t in prefill if queued(t) <= bound)


def paired(prefill: Sequence[Target], decode: Target, revision: Callable[[str], str]) -> tuple[Target, ...]:
    """The prefill targets that may hand their KV to ``decode``: the same engine revision (the same
    model and KV layout), or none named on both sides."""
    want = revision(decode.engine)
    return tuple(t for t in prefill if revision(t.engine) == want)
